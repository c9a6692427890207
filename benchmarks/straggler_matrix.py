"""The runs people make: every policy on small models, with one slow pipeline or none, at 4 and 8 pipelines.

    python benchmarks/straggler_matrix.py [--models mlp,cnn,gpt] [--pipelines 4,8] [--scenarios 1,2,4]
                                          [--policies sdpipe,allreduce,ps,none] [--repeats 3] [--stages 2]

For each model (notebook 01's digits MLP, the digits CNN, the GPT example; ``_common.workload``, which also
has ``mlp768``, a compute-bound MLP of 768 hidden units) and number of
pipelines D, one LocalCluster of S x D single-threaded worker processes on 127.0.0.1 serves every run.  Per
repeat and scenario (pipeline D-1 slowed f times, ``Heterogeneity(slowdown={D-1: f})``, or f = 1: homogeneous)
the policies run one after the other, their order reversed every other repeat, so that the machine's drift
affects all alike.  Batch 32 per pipeline, 4 micro-batches, every policy at its defaults (sdpipe: overlapped
averaging, P = 10, a global sync every epoch), no held-out data.

Per run: samples/s (the median over the epochs after the first of the pipelines' own samples/s added, as the
dashboard and the history report them: each pipeline's samples of an epoch over its time in the epoch,
global sync included), the slow pipeline's share of the samples trained after the first epoch, and under
sdpipe the ordinary (not global) rounds of stage 0 and how many held the slow pipeline, the graph syncs and
whether the connectivity bound held.  The goals (issue 34): with a straggler, sdpipe >= 1.3x allreduce and
>= 0.85x none, and the slow pipeline's share under sdpipe <= 1.25x its share under none; homogeneous, sdpipe
>= 0.97x allreduce.

Results: ``benchmarks/results/straggler_matrix.md`` and ``.json``; every run's row is appended to
``straggler_matrix.rows.jsonl`` as it ends (a long run that stops keeps what it measured; `--resume` measures the rest).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from _common import VARIANTS, WORKLOAD_NAMES, local_cluster, results_head, run_meta, train_workload, workload

#: epochs per run by model: enough steps after the first epoch for a median (an epoch of the digits is 45
#: batches, of the GPT example's 100,000 characters 48)
EPOCHS = {"mlp": 8, "mlp768": 5, "cnn": 5, "gpt": 3}


def measure(result, slow: int, D: int, staleness: int) -> dict:
    """What one run showed (see the module's docstring)."""
    hist = [h for h in result.history if h["epoch"] >= 1]
    epochs = sorted({h["epoch"] for h in hist})
    sps = statistics.median(sum(h["samples_per_s"] for h in hist if h["epoch"] == e) for e in epochs)
    total = sum(h["samples"] for h in hist)
    share = {p: sum(h["samples"] for h in hist if h["pipeline"] == p) / total for p in range(D)}
    row = {"samples_per_s": sps, "share": share, "slow_share": share[slow]}
    groups = [e for e in result.events if e["kind"] == "group"]
    if groups:
        ordinary = [g for g in groups if g["stage"] == 0 and g["reason"] not in ("global", "preempted")]
        since, longest = {}, 0
        for g in sorted(groups, key=lambda g: (g["stage"], g["round"])):
            if g["reason"] == "preempted":
                continue
            if g["connected"]:
                since[g["stage"]] = 0
                continue
            since[g["stage"]] = since.get(g["stage"], 0) + len(g["group"])
            longest = max(longest, since[g["stage"]])
        row.update(
            rounds=len(ordinary),
            rounds_with_slow=sum(slow in g["group"] for g in ordinary),
            multi_rounds=sum(len(g["group"]) > 1 for g in ordinary),
            graph_syncs=sum(g["reason"] == "graph" for g in groups),
            longest_unconnected=longest,
            bound_held=longest < staleness * D,
        )
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(WORKLOAD_NAMES))
    ap.add_argument("--pipelines", default="4,8")
    ap.add_argument("--scenarios", default="1,2,4", help="slowdown factors of the last pipeline (1: homogeneous)")
    ap.add_argument("--policies", default="sdpipe,allreduce,ps,none")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=None, help="epochs per run (default: by model, EPOCHS)")
    ap.add_argument("--sync-every", type=int, default=1, help="epochs between global syncs (TrainConfig.sync_every)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "straggler_matrix.md"))
    ap.add_argument("--report", action="store_true", help="only write the results from the rows file")
    ap.add_argument("--resume", action="store_true", help="keep the rows file's runs and measure only the others")
    args = ap.parse_args(argv)
    rows_path = Path(args.out).with_suffix(".rows.jsonl")
    if args.report:
        made = Path(args.out).with_suffix(".json")
        meta = json.loads(made.read_text())["meta"] if made.exists() else None  # the command that measured them
        return report([json.loads(line) for line in rows_path.read_text().splitlines()], args, argv, meta)

    import sdpipe

    S, P = args.stages, 10
    policies = args.policies.split(",")
    factors = [float(x) for x in args.scenarios.split(",")]
    kept = rows_path.read_text().splitlines() if args.resume and rows_path.exists() else []
    rows = [json.loads(line) for line in kept]
    have = {(r["model"], r["D"], r["f"], r["policy"], r["repeat"]) for r in rows}
    rows_path.write_text("".join(json.dumps(r) + "\n" for r in rows))  # a new run starts the file afresh
    for name in args.models.split(","):
        for D in (int(x) for x in args.pipelines.split(",")):
            slow = D - 1
            client, cluster = local_cluster(D * S)
            try:
                text = workload(name, S)["text"]
                for rep in range(args.repeats):
                    for f in factors:
                        order = policies if rep % 2 == 0 else policies[::-1]
                        for policy in order:
                            if (name, D, f, policy, rep) in have:
                                continue
                            t = time.time()
                            result = train_workload(
                                name,
                                S,
                                pipelines=D,
                                policy=VARIANTS.get(policy, (policy,))[0],
                                scheduler=VARIANTS[policy][1] if policy in VARIANTS else None,
                                epochs=args.epochs or EPOCHS[name],
                                batch_size=32,
                                sync_every=args.sync_every,
                                heterogeneity=sdpipe.Heterogeneity(slowdown={slow: f}) if f > 1 else None,
                                cluster=client,
                            )
                            row = {"model": name, "text": text, "D": D, "f": f, "policy": policy, "repeat": rep}
                            row.update(measure(result, slow, D, P), wall_s=time.time() - t)
                            rows.append(row)
                            with rows_path.open("a") as fh:
                                fh.write(json.dumps(row) + "\n")
                            print(json.dumps({k: v for k, v in row.items() if k != "share"}), flush=True)
            finally:
                client.close()
                cluster.close()
    return report(rows, args, argv)


def report(rows: list, args, argv, meta=None) -> int:
    meta = meta or run_meta(
        "straggler_matrix.py",
        argv,
        f"S={args.stages}, batch 32 per pipeline, 4 micro-batches, epochs per run {args.epochs or EPOCHS}, every "
        f"policy at its defaults but a global sync every {getattr(args, 'sync_every', 1)} epoch(s), pipeline D-1 "
        f"slowed (slept heterogeneity, sdpipe.worker.pace), gloo on CPU, {args.repeats} repeats",
    )
    Path(args.out).with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    out, L = results_head(args.out, "Stragglers in the runs people make: every policy, small models", meta)

    def pick(**kw):
        return [r for r in rows if all(r[k] == v for k, v in kw.items())]

    def med(rs, key="samples_per_s"):
        return statistics.median(r[key] for r in rs)

    L += [
        "",
        "Samples/s: the median over the repeats, the range in brackets; ratios are of the medians (*none / "
        "allreduce* is the ceiling of *sdpipe / allreduce*: sdpipe steps at most as fast as none).  *slow share*: "
        "the slow pipeline's share of the samples (epochs after the first) under sdpipe, and that share over its "
        "share under none.  *rounds with it*: the ordinary rounds of stage 0 that held the slow pipeline, as a "
        "fraction of all, next to 1/f.",
        "",
        "| model | D | f | sdpipe | allreduce | ps | none | sdpipe / allreduce | none / allreduce | sdpipe / none | "
        "slow share (/ none) | rounds with it (1/f) | graph syncs | bound held | goals |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    verdicts = {}
    for name in dict.fromkeys(r["model"] for r in rows):
        for D in sorted({r["D"] for r in rows if r["model"] == name}):
            for f in sorted({r["f"] for r in rows}):
                cell = {p: pick(model=name, D=D, f=f, policy=p) for p in ("sdpipe", "allreduce", "ps", "none")}
                if not cell["sdpipe"]:
                    continue

                def txt(p, cell=cell):
                    rs = cell[p]
                    if not rs:
                        return "-"
                    v = [r["samples_per_s"] for r in rs]
                    return f"{statistics.median(v):.0f} [{min(v):.0f}-{max(v):.0f}]"

                sd = med(cell["sdpipe"])
                to_ar = sd / med(cell["allreduce"]) if cell["allreduce"] else None
                ceiling = med(cell["none"]) / med(cell["allreduce"]) if cell["none"] and cell["allreduce"] else None
                to_none = sd / med(cell["none"]) if cell["none"] else None
                goals = []
                if f > 1:
                    share = med(cell["sdpipe"], "slow_share")
                    share_ratio = share / med(cell["none"], "slow_share") if cell["none"] else None
                    rounds = sum(r["rounds"] for r in cell["sdpipe"])
                    with_slow = sum(r["rounds_with_slow"] for r in cell["sdpipe"]) / max(1, rounds)
                    if to_ar is not None:
                        # sdpipe steps at most as fast as none: where none itself is below 1.3x allreduce, so is it
                        below = ceiling is not None and ceiling < 1.3
                        goals.append(
                            ("x allreduce >= 1.3" + (" (none reached 1.3x neither)" if below else ""), to_ar >= 1.3)
                        )
                    if to_none is not None:
                        goals.append(("x none >= 0.85", to_none >= 0.85))
                    if share_ratio is not None:
                        goals.append(("share <= 1.25x none's", share_ratio <= 1.25))
                    share_txt = f"{share:.3f} ({share_ratio:.2f})" if share_ratio is not None else f"{share:.3f}"
                    rounds_txt = f"{with_slow:.2f} ({1 / f:.2f})"
                else:
                    if to_ar is not None:
                        goals.append(("x allreduce >= 0.97", to_ar >= 0.97))
                    share_txt = rounds_txt = "-"
                graphs = sum(r["graph_syncs"] for r in cell["sdpipe"])
                held = all(r["bound_held"] for r in cell["sdpipe"])
                verdicts[(name, D, f)] = goals
                gtxt = ", ".join(("met: " if ok else "MISSED: ") + g for g, ok in goals)
                ratio = lambda x: "-" if x is None else f"{x:.2f}"
                L.append(
                    f"| {name} | {D} | {f:g} | {txt('sdpipe')} | {txt('allreduce')} | {txt('ps')} | {txt('none')} | "
                    f"{ratio(to_ar)} | {ratio(ceiling)} | {ratio(to_none)} | {share_txt} | {rounds_txt} | {graphs} | "
                    f"{held} | {gtxt} |"
                )
    met = sum(ok for goals in verdicts.values() for _, ok in goals)
    total = sum(len(goals) for goals in verdicts.values())
    L += ["", f"Goals met: {met} of {total}."]
    variants = [v for v in dict.fromkeys(r["policy"] for r in rows) if v in VARIANTS]
    if variants:
        L += [
            "",
            "Variants (`benchmarks/_common.py` VARIANTS: sdpipe with other scheduler parameters), against `none` of "
            "the same cells:",
            "",
            "| model | D | f | variant | samples/s | / none | slow share (/ none) | rounds with it (1/f) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for v in variants:
            for name in dict.fromkeys(r["model"] for r in rows):
                for D in sorted({r["D"] for r in rows if r["model"] == name}):
                    for f in sorted({r["f"] for r in rows}):
                        rs, base = pick(model=name, D=D, f=f, policy=v), pick(model=name, D=D, f=f, policy="none")
                        if not rs:
                            continue
                        sps = [r["samples_per_s"] for r in rs]
                        to_none = f"{med(rs) / med(base):.2f}" if base else "-"
                        share = med(rs, "slow_share")
                        share_txt = f"{share:.3f} ({share / med(base, 'slow_share'):.2f})" if base and f > 1 else "-"
                        rounds = sum(r["rounds"] for r in rs)
                        with_slow = sum(r["rounds_with_slow"] for r in rs) / max(1, rounds)
                        L.append(
                            f"| {name} | {D} | {f:g} | {v} | {statistics.median(sps):.0f} [{min(sps):.0f}-"
                            f"{max(sps):.0f}] | {to_none} | {share_txt} | {with_slow:.2f} ({1 / f:.2f}) |"
                        )
    out.write_text("\n".join(L) + "\n")
    print(out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
