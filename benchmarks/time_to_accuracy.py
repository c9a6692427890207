"""Time to a target held-out accuracy, every policy under heterogeneity scenarios, several seeds.

    python benchmarks/time_to_accuracy.py [--scenarios none,straggler2x,straggler4x,transient,slowlink]
                                          [--policies sdpipe,allreduce,adpsgd,ps,none] [--seeds 3]
                                          [--target 0.95] [--max-epochs 20] [--pipelines 4] [--stages 2] [--channels 64]

The digits CNN (``--channels``, default 64) on one LocalCluster of S x D single-threaded
worker processes (127.0.0.1), evaluated after every epoch.  A run stops once
every pipeline's held-out accuracy reached the target (``run.stop()``); its
time to accuracy is the time of that epoch's last evaluation, from launch.
Policies alternate within each scenario and seed; an unrecorded
warm-up run comes first.  Scenarios: ``none``;
``straggler2x`` / ``straggler4x`` (the last pipeline persistently slower);
``transient`` (every worker straggles with probability 0.1 per step for
0.07 s, about a step); ``slowlink`` (the last pipeline's synchronization
delayed 0.05 s).  Results: ``benchmarks/results/time_to_accuracy.md`` and
``.json`` (median and range over seeds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from _common import local_cluster, meta_lines, run_meta


def scenario(name: str, D: int):
    import sdpipe

    return {
        "none": None,
        "straggler2x": sdpipe.Heterogeneity(slowdown={D - 1: 2.0}),
        "straggler4x": sdpipe.Heterogeneity(slowdown={D - 1: 4.0}),
        "transient": sdpipe.Heterogeneity(straggle_prob=0.1, straggle_delay=0.07),
        "slowlink": sdpipe.Heterogeneity(link_delay={D - 1: 0.05}),
    }[name]


def time_to_target(run, D: int, target: float, timeout: float = 1800) -> tuple:
    """(seconds, epochs) when every pipeline's accuracy first reached ``target``; stops the run then."""
    deadline = time.monotonic() + timeout
    reports: dict = {}
    cursor = 0
    while time.monotonic() < deadline:
        events, cursor = run.events_since(cursor)
        for e in events:
            if e["kind"] == "epoch":
                reports.setdefault(e["metrics"]["epoch"], []).append((e["end"], e["metrics"].get("accuracy", 0.0)))
        for epoch in sorted(reports):
            rows = reports[epoch]
            if len(rows) == D and min(a for _, a in rows) >= target:
                run.stop()
                return max(t for t, _ in rows), epoch + 1
        if run.done():
            return None, None
        time.sleep(0.05)
    run.stop()
    return None, None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", default="none,straggler2x,straggler4x,transient,slowlink")
    ap.add_argument("--policies", default="sdpipe,allreduce,adpsgd,ps,none")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--target", type=float, default=0.95)
    ap.add_argument("--max-epochs", type=int, default=20)
    ap.add_argument("--pipelines", type=int, default=4)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--channels", type=int, default=64, help="width of the CNN")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "time_to_accuracy.md"))
    a = ap.parse_args(argv)

    import sdpipe
    from sdpipe.data import digits, digits_cnn

    S, D = a.stages, a.pipelines
    policies = a.policies.split(",")
    client, cluster = local_cluster(S * D)
    rows = []
    try:
        # warm-up: the worker processes' first run pays for imports and first-time allocations
        sdpipe.train(digits_cnn(a.channels), digits()[0], stages=S, pipelines=D, cuts=(6,) if S == 2 else None, policy="sdpipe",
                     epochs=1, batch_size=64, cluster=client).result(timeout=600)
        for name in a.scenarios.split(","):
            for seed in range(a.seeds):
                train_data, eval_data = digits(seed=seed)
                order = policies if seed % 2 == 0 else policies[::-1]
                for policy in order:
                    run = sdpipe.train(digits_cnn(a.channels, seed=seed), train_data, eval_data=eval_data, stages=S, pipelines=D,
                                       cuts=(6,) if S == 2 else None, policy=policy, epochs=a.max_epochs, batch_size=64,
                                       seed=seed, heterogeneity=scenario(name, D), cluster=client)
                    seconds, epochs = time_to_target(run, D, a.target)
                    run.result(timeout=600)
                    row = {"scenario": name, "seed": seed, "policy": policy, "seconds": seconds, "epochs": epochs}
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr)
    finally:
        client.close()
        cluster.close()

    meta = run_meta("time_to_accuracy.py", argv, f"digits CNN ({a.channels} channels), {S} stages x {D} pipelines, batch 64, "
                    f"target {a.target} held-out accuracy on every pipeline, at most {a.max_epochs} epochs, {a.seeds} seeds")
    out = Path(a.out)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = ["# Time to accuracy", "", *meta_lines(meta), "",
             "Seconds from launch until every pipeline reached the target: median [min-max] over seeds "
             "(a run that never reached it counts as missing); in brackets below the policy: x allreduce (median).", "",
             "| scenario | " + " | ".join(policies) + " |", "|---|" + "---|" * len(policies)]
    for name in a.scenarios.split(","):
        cells = []
        base = [r["seconds"] for r in rows if r["scenario"] == name and r["policy"] == "allreduce" and r["seconds"]]
        for policy in policies:
            vals = [r["seconds"] for r in rows if r["scenario"] == name and r["policy"] == policy and r["seconds"]]
            missed = sum(1 for r in rows if r["scenario"] == name and r["policy"] == policy and not r["seconds"])
            if not vals:
                cells.append("not reached")
                continue
            med = statistics.median(vals)
            speed = f", {statistics.median(base) / med:.2f}x" if base else ""
            cells.append(f"{med:.1f} [{min(vals):.1f}-{max(vals):.1f}{speed}]" + (f" ({missed} missed)" if missed else ""))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
