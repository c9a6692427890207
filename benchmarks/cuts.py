"""Where to cut: the parameter-count cut, the cut by measured time, the best cut found by trying them all, and
automatic rebalancing started from the worst one.

    python benchmarks/cuts.py [--models cnn,resnet,gpt] [--stages 2,3,4] [--repeats 3] [--max-cuts 40]

One pipeline (D = 1, so only the cut and the pipeline's bubble matter), 1F1B, 4 micro-batches, batch 64, on an
embedded LocalCluster of single-threaded workers on 127.0.0.1.  Per model and number of stages S:

1. where the model has at most ``--max-cuts`` cuts into S stages, every cut trains 2 epochs once (the second
   epoch's samples/s), to find the best few;
2. the contenders, alternated in ``--repeats`` rounds of 3 epochs each (samples/s: the median of epochs 1 and 2,
   evaluation apart): ``cuts="params"`` (the default), ``cuts="time"`` (measured on the driver at each run's
   start: the cut it chose is listed), the two fastest cuts of step 1, and ``rebalance=True`` started from the
   slowest cut of step 1 (6 epochs; its samples/s: the median of its last 2, after it re-cut itself);
3. recovery: a run with ``rebalance=True`` from the time cut trains 3 epochs, then its last stage's compute is
   slowed 3x (``compute_slowdown``, live): the seconds until the run re-cut itself, and its samples/s before the
   slowdown, after it under the old cut (the first epoch after it) and after the re-cut (the median of 2 epochs).

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


#: automatic rebalancing as benchmarked: a decision after 8 steps, re-cuts at most every 5 s
REBALANCE = {"steps": 8, "every": 5.0}


def train(client, name: str, stages: int, cuts, epochs: int, rebalance=None) -> tuple:
    """(samples/s of the epochs after the first, the cut the run took) of one run; with ``rebalance``, of its last
    2 epochs, and the cut it ended with."""
    import sdpipe
    from sdpipe.core.partition import balanced_cuts

    model, data, loss_fn, _ = model_of(name)
    kw = {} if loss_fn is None else {"loss_fn": loss_fn}
    run = sdpipe.train(
        model, data, stages=stages, pipelines=1, policy="allreduce", epochs=epochs, batch_size=64, microbatches=4,
        cuts=cuts, cluster=client, rebalance=rebalance, **kw,
    )  # fmt: skip
    result = run.result(timeout=900)
    first = epochs - 2 if rebalance else 1
    rates = [h["samples_per_s"] for h in result.history if h["epoch"] >= first]
    taken = run.config.cuts
    if taken == "params":
        taken = balanced_cuts([sum(p.numel() for p in m.parameters()) for m in model], stages)
    return statistics.median(rates), tuple(taken)


def recovery(client, name: str, stages: int) -> dict:
    """Step 3 of the module's docstring: a slowdown of the last stage, live, and the run's automatic re-cut."""
    import sdpipe

    model, data, loss_fn, _ = model_of(name)
    kw = {} if loss_fn is None else {"loss_fn": loss_fn}
    run = sdpipe.train(
        model, data, stages=stages, pipelines=1, policy="allreduce", epochs=10_000, batch_size=64, microbatches=4,
        cuts="time", cluster=client, rebalance=REBALANCE, **kw,
    )  # fmt: skip

    def epochs() -> list:
        return [e["metrics"] for e in run.events if e["kind"] == "epoch"]

    def automatic() -> list:
        return [e for e in run.events if e["kind"] == "control" and e.get("what") == "recut" and e.get("reason")]

    def wait(test, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not test():
            if time.monotonic() > deadline or run.done():
                raise RuntimeError(f"{name} S={stages}: waited {timeout:.0f} s ({run.status})")
            time.sleep(0.2)

    try:
        wait(lambda: len(epochs()) >= 3)
        before = statistics.median(h["samples_per_s"] for h in epochs()[-2:])
        made = len(automatic())
        cut_before = run.cuts
        at = time.time() - run.t0
        run.set_heterogeneity(compute_slowdown={(0, stages - 1): 3.0})
        seen = len(epochs())
        wait(lambda: len(epochs()) > seen)
        slowed = epochs()[-1]["samples_per_s"]  # the epoch the slowdown came in (under the old cut)
        try:
            wait(lambda: len(automatic()) > made, timeout=60)
        except RuntimeError:
            return {"cut_before": list(cut_before), "before": before, "slowed": slowed, "recut_after_s": None}
        e = automatic()[made]
        n = len(epochs())
        wait(lambda: len(epochs()) >= n + 3)
        after = statistics.median(h["samples_per_s"] for h in epochs()[-2:])
        return {
            "cut_before": list(cut_before), "cut_after": e["cuts"], "reason": e["reason"], "before": before,
            "slowed": slowed, "after": after, "recut_after_s": round(e["start"] - at, 2),
        }  # fmt: skip
    finally:
        run.stop()
        run.result(timeout=300)


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
            worst = min(tried, key=tried.get) if tried else None
            contenders = ["params", "time", *best, *(["rebalance"] if worst else [])]
            rates = {c: [] for c in contenders}
            taken = {c: set() for c in contenders}
            for rep in range(args.repeats):
                order = contenders if rep % 2 == 0 else contenders[::-1]
                for c in order:
                    if c == "rebalance":
                        rate, cut = train(client, name, S, worst, 6, rebalance=REBALANCE)
                    else:
                        rate, cut = train(client, name, S, c, 3)
                    rates[c].append(rate)
                    taken[c].add(cut)
            row = {"model": name, "stages": S, "layers": layers, "tried": {str(k): v for k, v in tried.items()}}
            row["worst"] = list(worst) if worst else None
            row["recovery"] = recovery(client, name, S)
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
        f"{args.max_cuts} cuts); step 2: {args.repeats} alternated rounds of 3 epochs (rebalance: 6, from the "
        f"slowest tried cut, rebalance={REBALANCE}); step 3: the last stage slowed 3x live",
    )
    title = "Cuts by parameter count, by measured time, the best tried, and automatic rebalancing"
    out, lines = results_head(args.out, title, meta)
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
            if name == "rebalance":
                name = f"rebalance from {tuple(row['worst'])}"
            cut = "; ".join(str(tuple(t)) for t in c["taken"])
            vs = f"{c['median'] / best:.2f}" if best == best else "-"
            lines.append(
                f"| {row['model']} | {row['stages']} | {name} | {cut} | {c['median']:.0f} "
                f"({min(c['samples_per_s']):.0f} - {max(c['samples_per_s']):.0f}) | {vs} |"
            )
    lines += [
        "",
        "Recovery (step 3): the last stage's compute slowed 3x while the run trains under `rebalance=True`; samples/s",
        "before the slowdown (the median of 2 epochs), in the epoch the slowdown came in (old cut), after the",
        "automatic re-cut (the median of 2 epochs from the second after it).",
        "",
        "| model | S | cut before | re-cut to | re-cut after (s) | before | slowed | after | reason |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        r = row["recovery"]
        if r.get("recut_after_s") is None:
            lines.append(f"| {row['model']} | {row['stages']} | {tuple(r['cut_before'])} | none within 60 s | - | "
                         f"{r['before']:.0f} | {r['slowed']:.0f} | - | - |")  # fmt: skip
            continue
        lines.append(
            f"| {row['model']} | {row['stages']} | {tuple(r['cut_before'])} | {tuple(r['cut_after'])} | "
            f"{r['recut_after_s']:.1f} | {r['before']:.0f} | {r['slowed']:.0f} | {r['after']:.0f} | {r['reason']} |"
        )
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())
    return 0


if __name__ == "__main__":
    t = time.time()
    code = main()
    print(f"{time.time() - t:.0f} s", file=sys.stderr)
    sys.exit(code)
