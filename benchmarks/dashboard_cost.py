"""What a live dashboard costs the training: samples/s with and without ``Dashboard(run)``, alternated.

    python benchmarks/dashboard_cost.py [--pairs 4] [--seconds 25] [--stages 2] [--pipelines 2]

Each pair is two runs of the digits CNN (S x D, ``sdpipe``, pipeline D-1 slept 3x, evaluation each epoch) on one
embedded LocalCluster of S x D single-threaded workers on 127.0.0.1, one with a live ``Dashboard(run)`` following
it (its redraws, the time attribution of the last 30 s and the what-if panel, all in this process as in a
notebook's kernel; no browser attached) and one without; which one goes first alternates from pair to pair.
Each run trains ``--seconds`` after its first epoch; its samples/s is measured over that time (each epoch's
samples over its time, evaluation apart, summed over the pipelines; the median over the epochs), and the
dashboard's process CPU over the same time is read too.  Results: ``benchmarks/results/dashboard_cost.md`` and
``.json``: per pair the ratio with/without, and their median with the spread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from _common import local_cluster, meta_lines, run_meta


def one_run(client, args, dashboard: bool) -> dict:
    import sdpipe
    from sdpipe.data import digits, digits_cnn
    from sdpipe.simulation.whatif import measured_rate

    S, D = args.stages, args.pipelines
    train_data, eval_data = digits()
    run = sdpipe.train(
        digits_cnn(32),
        train_data,
        eval_data=eval_data,
        stages=S,
        pipelines=D,
        cuts={2: (6,), 4: (3, 5, 8)}[S],
        policy="sdpipe",
        epochs=100_000,
        batch_size=64,
        heterogeneity=sdpipe.Heterogeneity(slowdown={D - 1: 3.0}),
        cluster=client,
    )
    dash = None
    try:
        if dashboard:
            from sdpipe.widgets import Dashboard

            dash = Dashboard(run)
        deadline = time.monotonic() + 300
        while not any(e.get("kind") == "epoch" for e in run.events):
            if time.monotonic() > deadline or run.done():
                raise RuntimeError(f"the run trained no epoch in 300 s: {run.status}")
            time.sleep(0.2)
        start, cpu0 = time.time() - run.t0, time.process_time()
        time.sleep(args.seconds)
        cpu = time.process_time() - cpu0
        rate = measured_rate([e for e in run.events if e.get("start") is not None and e["start"] >= start])
    finally:
        if dash is not None:
            dash.stop()
        run.stop()
        run.result(timeout=300)
    return {"dashboard": dashboard, "samples_per_s": rate, "process_cpu": cpu / args.seconds}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=25.0)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--pipelines", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "dashboard_cost.md"))
    args = ap.parse_args(argv)
    client, cluster = local_cluster(args.stages * args.pipelines)
    pairs = []
    try:
        for i in range(args.pairs):
            order = (True, False) if i % 2 == 0 else (False, True)
            got = {flag: one_run(client, args, flag) for flag in order}
            pair = {"with": got[True], "without": got[False], "first": "with" if order[0] else "without"}
            pair["ratio"] = got[True]["samples_per_s"] / got[False]["samples_per_s"]
            pairs.append(pair)
            print(json.dumps(pair), file=sys.stderr, flush=True)
    finally:
        client.close()
        cluster.close()
    meta = run_meta(
        "dashboard_cost.py",
        argv,
        f"digits CNN (32 channels), {args.stages} x {args.pipelines}, sdpipe, pipeline {args.pipelines - 1} slept 3x, "
        f"batch 64, {args.seconds:g} s measured per run after the first epoch",
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "pairs": pairs}, indent=1))
    ratios = sorted(p["ratio"] for p in pairs)
    cpu = [p["with"]["process_cpu"] - p["without"]["process_cpu"] for p in pairs]
    lines = [
        "# What a live dashboard costs the training",
        "",
        *meta_lines(meta),
        "",
        "Pairs of runs, one with a live `Dashboard(run)` in this process (no browser attached) and one without, "
        "the order alternating. samples/s: each epoch's samples over its time, evaluation apart, summed over the "
        "pipelines; the median over the epochs of the measured seconds. CPU: this process's CPU seconds per second "
        "(the driver's own work included).",
        "",
        "| pair | first | with dashboard | without | ratio | CPU with | CPU without |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, p in enumerate(pairs):
        lines.append(
            f"| {i} | {p['first']} | {p['with']['samples_per_s']:.0f} | {p['without']['samples_per_s']:.0f} | "
            f"{p['ratio']:.3f} | {p['with']['process_cpu']:.3f} | {p['without']['process_cpu']:.3f} |"
        )
    lines += [
        "",
        f"Median ratio {statistics.median(ratios):.3f} ({ratios[0]:.3f} - {ratios[-1]:.3f}): the dashboard costs "
        f"{100 * (1 - statistics.median(ratios)):+.1f}% of the samples/s (goal: at most 3%). It took "
        f"{statistics.median(cpu):.3f} cores' worth more of this process (median).",
    ]
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
