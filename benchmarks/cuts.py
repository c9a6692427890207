"""Where to cut: the parameter-count cut, the cut by measured time and the best cut found by trying them all.

    python benchmarks/cuts.py [--models cnn,resnet,gpt] [--stages 2,3,4] [--repeats 3] [--max-cuts 40]

One pipeline (D = 1, so only the cut and the pipeline's bubble matter), 1F1B, 4 micro-batches, batch 64, on an
embedded LocalCluster of single-threaded workers on 127.0.0.1.  Per model and number of stages S:

1. where the model has at most ``--max-cuts`` cuts into S stages, every cut trains 2 epochs once (the second
   epoch's samples/s), to find the best few;
2. the contenders, alternated in ``--repeats`` rounds of 3 epochs each (samples/s: the median of epochs 1 and 2,
   evaluation apart): ``cuts="params"`` (the default), ``cuts="time"`` (measured on the driver at each run's
   start: the cut it chose is listed), and the two fastest cuts of step 1.

Reported: each contender's median samples/s with its spread, and the time and parameter cuts against the best of
the tried cuts.  Results: ``benchmarks/results/cuts.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time

from _common import local_cluster, results_head, run_meta


def model_of(name: str):
    """(model, train data, loss_fn or None, text) of a fresh model."""
    from sdpipe.data import digits, digits_cnn

    if name == "cnn":
        return digits_cnn(), digits()[0], None, "digits CNN (32/64/128 channels)"
    if name == "resnet":
        from sdpipe.examples import digits_resnet

        return digits_resnet(), digits()[0], None, "digits ResNet"
    if name == "gpt":
        from sdpipe.examples import char_data, char_gpt, lm_loss

        return char_gpt(), char_data(train_chars=100_000, eval_chars=10_000)[0], lm_loss, "GPT example"
    raise ValueError(f"--models: {name!r} is not one of cnn, resnet, gpt")


def train(client, name: str, stages: int, cuts, epochs: int) -> tuple:
    """(samples/s of the epochs after the first, the cut the run took) of one run."""
    import sdpipe
    from sdpipe.core.partition import balanced_cuts

    model, data, loss_fn, _ = model_of(name)
    kw = {} if loss_fn is None else {"loss_fn": loss_fn}
    run = sdpipe.train(
        model, data, stages=stages, pipelines=1, policy="allreduce", epochs=epochs, batch_size=64, microbatches=4,
        cuts=cuts, cluster=client, **kw,
    )  # fmt: skip
    result = run.result(timeout=900)
    rates = [h["samples_per_s"] for h in result.history if h["epoch"] > 0]
    taken = run.config.cuts
    if taken == "params":
        taken = balanced_cuts([sum(p.numel() for p in m.parameters()) for m in model], stages)
    return statistics.median(rates), tuple(taken)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="cnn,resnet,gpt")
    ap.add_argument("--stages", default="2,3,4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-cuts", type=int, default=40)
    ap.add_argument("--out", default="benchmarks/results/cuts.md")
    args = ap.parse_args(argv)
    stages_list = [int(s) for s in args.stages.split(",")]
    client, cluster = local_cluster(max(stages_list))
    rows = []
    try:
        for name, S in itertools.product(args.models.split(","), stages_list):
            layers = len(model_of(name)[0])
            every = list(itertools.combinations(range(1, layers), S - 1))
            tried = {}
            if len(every) <= args.max_cuts:
                for c in every:
                    tried[c] = train(client, name, S, c, 2)[0]
                    print(f"{name} S={S} cut {c}: {tried[c]:.0f}", file=sys.stderr, flush=True)
            best = sorted(tried, key=tried.get, reverse=True)[:2]
            contenders = ["params", "time", *best]
            rates = {c: [] for c in contenders}
            taken = {c: set() for c in contenders}
            for rep in range(args.repeats):
                order = contenders if rep % 2 == 0 else contenders[::-1]
                for c in order:
                    rate, cut = train(client, name, S, c, 3)
                    rates[c].append(rate)
                    taken[c].add(cut)
            row = {"model": name, "stages": S, "layers": layers, "tried": {str(k): v for k, v in tried.items()}}
            row["contenders"] = [
                {"cuts": c if isinstance(c, str) else list(c), "taken": sorted(list(t) for t in taken[c]),
                 "samples_per_s": rates[c], "median": statistics.median(rates[c])}
                for c in contenders
            ]  # fmt: skip
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    finally:
        client.close()
        cluster.close()

    meta = run_meta(
        "cuts.py",
        argv,
        "1 pipeline, allreduce, 1F1B, 4 micro-batches, batch 64; step 1: every cut 2 epochs once (where at most "
        f"{args.max_cuts} cuts); step 2: {args.repeats} alternated rounds of 3 epochs",
    )
    out, lines = results_head(args.out, "Cuts by parameter count, by measured time, and the best tried", meta)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines += [
        "",
        "samples/s: the median over the rounds of each run's median over its epochs after the first (evaluation "
        "apart); spread: smallest - largest round. *vs best*: against the fastest cut of step 2's tried ones "
        "(step 1 picks them; '-' where the cuts were too many to try).",
        "",
        "| model | S | contender | cut taken | samples/s (spread) | vs best tried |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        tried = [c for c in row["contenders"] if not isinstance(c["cuts"], str)]
        best = max((c["median"] for c in tried), default=math.nan)
        for c in row["contenders"]:
            name = c["cuts"] if isinstance(c["cuts"], str) else "tried " + str(tuple(c["cuts"]))
            cut = "; ".join(str(tuple(t)) for t in c["taken"])
            vs = f"{c['median'] / best:.2f}" if best == best else "-"
            lines.append(
                f"| {row['model']} | {row['stages']} | {name} | {cut} | {c['median']:.0f} "
                f"({min(c['samples_per_s']):.0f} - {max(c['samples_per_s']):.0f}) | {vs} |"
            )
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())
    return 0


if __name__ == "__main__":
    t = time.time()
    code = main()
    print(f"{time.time() - t:.0f} s", file=sys.stderr)
    sys.exit(code)
