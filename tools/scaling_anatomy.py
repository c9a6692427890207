"""What happens in a simulated sdpipe run as the pipelines grow: rounds, graph syncs, who waits for whom.

    python tools/scaling_anatomy.py [--pipelines 128,256] [--steps 200] [--seed-from-size]

The workload of ``benchmarks/sim_scaling.py`` (4 stages, the digits CNN's calibrated costs, every 8th
pipeline 4x slower, transient straggles p = 0.05 of one step, 10 Gbit/s), recorded.  Per size: samples/s
against the ideal (policy ``none``), and per stage the rounds by reason, the graph syncs (how many, how long
each stayed open, how many members it held, whether the slow pipelines were what it waited for), the updates
between resets of the connectivity bound against its bound, and the seconds workers were held (a ready signal
waiting for its last averaging: ``wait`` spans, fast and slow pipelines apart).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))


def anatomy(D: int, steps: int, costs, net, step_s: float, scheduler=None) -> dict:
    import sdpipe

    slow = set(range(7, D, 8))
    hetero = sdpipe.Heterogeneity(slowdown={p: 4.0 for p in slow}, straggle_prob=0.05, straggle_delay=step_s)
    common = dict(
        epochs=1,
        costs=costs,
        network=net,
        steps=steps,
        batch_size=64,
        microbatches=4,
        heterogeneity=hetero,
        seed=D,
    )
    ideal = sdpipe.simulate(4, D, policy="none", record=False, **common)
    r = sdpipe.simulate(4, D, policy="sdpipe", scheduler=scheduler, **common)
    rate = lambda res: sum(h["samples"] for h in res.history) / res.wall_time
    out = {"pipelines": D, "ratio": rate(r) / rate(ideal), "samples_per_s": rate(r), "ideal": rate(ideal)}
    groups = [e for e in r.events if e["kind"] == "group"]
    waits = [e for e in r.events if e["kind"] == "wait"]
    per_stage = []
    for s in range(4):
        g = [e for e in groups if e["stage"] == s]
        graph = [e for e in g if e["reason"] == "graph"]
        reasons = Counter(e["reason"] for e in g)
        sizes = [len(e["group"]) for e in g if e["reason"] not in ("graph", "global")]
        open_s = [e["end"] - e["start"] for e in graph]
        slow_in = [len(set(e["group"]) & slow) for e in graph]
        connected = sum(1 for e in g if e["connected"])
        per_stage.append(
            {
                "stage": s,
                "rounds": dict(reasons),
                "mean_group": statistics.mean(sizes) if sizes else 0,
                "graph_syncs": len(graph),
                "graph_open_s_median": statistics.median(open_s) if open_s else 0,
                "graph_open_s_max": max(open_s, default=0),
                "graph_members_median": statistics.median([len(e["group"]) for e in graph]) if graph else 0,
                "graph_slow_members_median": statistics.median(slow_in) if slow_in else 0,
                "resets": connected,
            }
        )
    held = Counter()
    for w in waits:
        held["slow" if w["pipeline"] in slow else "fast"] += w["end"] - w["start"]
    out["stages"] = per_stage
    out["held_s"] = {k: round(v, 3) for k, v in held.items()}
    out["wall_s"] = r.wall_time
    out["fast_steps_median"] = statistics.median(r.steps[p] for p in range(D) if p not in slow)
    out["slow_steps_median"] = statistics.median(r.steps[p] for p in slow) if slow else 0
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pipelines", default="128,256")
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args(argv)

    from sim_scaling import load_costs

    import sdpipe
    from sdpipe.core.schedule import build_plan, dry_run

    costs = load_costs(Path(__file__).resolve().parent.parent / "benchmarks/results/sim_agreement.json", 4)
    net = sdpipe.Network(bandwidth=1.25e9, latency=50e-6, scheduler_rtt=0.5e-3)
    step = dry_run(
        build_plan("1f1b", 4, 4, communication=False),
        lambda a: (costs.forward if a.op == "F" else costs.backward)[a.stage],
    ).makespan
    for D in (int(x) for x in args.pipelines.split(",")):
        a = anatomy(D, args.steps, costs, net, step)
        print(
            f"D={D}: sdpipe/ideal {a['ratio']:.2f} ({a['samples_per_s']:.0f} of {a['ideal']:.0f} samples/s), "
            f"{a['wall_s']:.2f} simulated s; steps fast {a['fast_steps_median']}, slow {a['slow_steps_median']}; "
            f"held (s, summed) {a['held_s']}"
        )
        for st in a["stages"]:
            print(f"   {st}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
