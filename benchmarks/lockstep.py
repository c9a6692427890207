"""Notebook 01's run, measured: does sdpipe leave the slow pipeline out, or do the pipelines go in lock step?

    python benchmarks/lockstep.py [--hetero slowdown|compute_slowdown] [--factor 4] [--epochs 20] [--repeats 2]

Notebook 01's settings: ``digits_mlp(hidden=128)``, 4 pipelines x 2 stages, batch 32, pipeline 3 slowed
``--factor`` times, on an 8-worker LocalCluster made as the notebook makes it (Dask's defaults).  Per repeat,
``sdpipe``, ``allreduce`` and ``none`` run one after the other (the order reversed every other repeat).
Printed per run, as one JSON line: samples/s (the median over the epochs after the first of the pipelines'
samples/s added), each pipeline's share of the samples, the slow pipeline's step against the others' (stage 0's
median interval between optimizer steps of an epoch), and under sdpipe the ordinary rounds of stage 0, how many
held the slow pipeline and how many held every pipeline, and the seconds per step the fast workers waited for
a group of an earlier step before going on (``wait`` spans of what ``"group"`` outside the global syncs).

It uses only what every revision since the straggler notebook has, so the same command measures an older one:
``git worktree add /tmp/old REV && PYTHONPATH=/tmp/old python benchmarks/lockstep.py`` (before
``compute_slowdown`` existed, ``slowdown`` stretched compute alone).  ``docs/stragglers.md`` gives the numbers.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys


def measure(result, slow: int, D: int) -> dict:
    hist = [h for h in result.history if h["epoch"] >= 1]
    epochs = sorted({h["epoch"] for h in hist})
    sps = statistics.median(sum(h["samples_per_s"] for h in hist if h["epoch"] == e) for e in epochs)
    total = sum(h["samples"] for h in hist)
    share = [round(sum(h["samples"] for h in hist if h["pipeline"] == p) / total, 3) for p in range(D)]
    ends: dict = {}
    for e in result.events:
        if e["kind"] == "optimizer" and e["stage"] == 0:
            ends.setdefault((e["pipeline"], e.get("epoch")), []).append(e["end"])
    steps: dict = {}
    for (p, _), v in ends.items():
        v.sort()
        steps.setdefault(p, []).extend(b - a for a, b in itertools.pairwise(v))
    med = {p: statistics.median(v) for p, v in steps.items() if v}
    fast = statistics.median(v for p, v in med.items() if p != slow)
    row = {"samples_per_s": round(sps), "share": share, "slow_step_ratio": round(med.get(slow, float("nan")) / fast, 2)}
    groups = [e for e in result.events if e["kind"] == "group"]
    if groups:
        global_rounds = {(g["stage"], g["round"]) for g in groups if g["reason"] == "global"}
        ordinary = [g for g in groups if g["stage"] == 0 and g["reason"] not in ("global", "preempted")]
        waits = [
            e["end"] - e["start"]
            for e in result.events
            if e["kind"] == "wait"
            and e.get("what") == "group"
            and e["pipeline"] != slow
            and (e["stage"], e.get("round")) not in global_rounds
        ]
        fast_steps = sum(1 for e in result.events if e["kind"] == "optimizer" and e["pipeline"] != slow)
        row.update(
            rounds=len(ordinary),
            rounds_with_slow=sum(slow in g["group"] for g in ordinary),
            rounds_of_all=sum(len(g["group"]) == D for g in ordinary),
            graph_syncs=sum(g["reason"] == "graph" for g in groups),
            fast_wait_ms_per_step=round(1000 * sum(waits) / max(1, fast_steps), 2),
        )
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hetero", choices=["slowdown", "compute_slowdown"], default="slowdown")
    ap.add_argument("--factor", type=float, default=4.0)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)

    from distributed import Client, LocalCluster

    import sdpipe
    from sdpipe.data import digits, digits_mlp

    D, slow = 4, 3
    train_data, eval_data = digits()
    cluster = LocalCluster(n_workers=8, threads_per_worker=1, host="127.0.0.1", dashboard_address=None)
    client = Client(cluster)
    try:
        for rep in range(args.repeats):
            order = ["sdpipe", "allreduce", "none"]
            for policy in order if rep % 2 == 0 else order[::-1]:
                result = sdpipe.train(
                    digits_mlp(hidden=128),
                    train_data,
                    eval_data=eval_data,
                    stages=2,
                    pipelines=D,
                    policy=policy,
                    epochs=args.epochs,
                    batch_size=32,
                    heterogeneity=sdpipe.Heterogeneity(**{args.hetero: {slow: args.factor}}),
                    cluster=client,
                ).result(timeout=1800)
                row = {"sdpipe": sdpipe.__file__, "hetero": args.hetero, "factor": args.factor, "policy": policy}
                print(json.dumps({**row, **measure(result, slow, D)}), flush=True)
    finally:
        client.close()
        cluster.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
