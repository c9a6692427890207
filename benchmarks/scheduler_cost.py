"""What one scheduler decision costs as the number of workers per stage grows.

    python benchmarks/scheduler_cost.py [--events 20000] [--workers 8,32,128,512,1024,2048,4096]

Drives the pure group scheduler of one stage (``sdpipe.core.scheduler.StageScheduler``,
the prototype's default policy: 1-10 ms adaptive windows, P = 10, pairs above
8 workers) with workers of random speeds, and times every call that handles a
ready signal or a window's end.  Results: ``benchmarks/results/scheduler_cost.md``,
``.json`` and a plot, ``scheduler_cost.html`` and ``.png``.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import statistics
import sys
import time
from pathlib import Path

from _common import meta_lines, run_meta, save_figure


def measure(workers: int, events: int, seed: int = 0) -> dict:
    from sdpipe.core.scheduler import Ready, SchedulerPolicy, StageScheduler, Tick

    rng = random.Random(seed)
    st = StageScheduler(0, range(workers), SchedulerPolicy())
    speed = [rng.uniform(0.25, 1.0) for _ in range(workers)]  # up to 4x slower workers
    step_time = 0.05  # seconds per step of the fastest worker
    heap = [(rng.uniform(0, step_time) / speed[p], p) for p in range(workers)]
    heapq.heapify(heap)
    steps = [0] * workers
    costs, groups = [], 0

    def call(event):
        nonlocal groups
        t0 = time.perf_counter()
        out = st.handle(event)
        costs.append(time.perf_counter() - t0)
        groups += len(out)
        for g in out:
            for m in g.members:
                heapq.heappush(heap, (event.time + rng.uniform(0.8, 1.2) * step_time / speed[m], m))

    while len(costs) < events and heap:
        t, p = heapq.heappop(heap)
        deadline = st.next_deadline()
        while deadline is not None and deadline <= t:
            call(Tick(deadline))
            deadline = st.next_deadline()
        call(Ready(p, steps[p], t))
        steps[p] += 1
    costs.sort()
    return {
        "workers": workers,
        "calls": len(costs),
        "groups": groups,
        "mean_us": statistics.mean(costs) * 1e6,
        "median_us": costs[len(costs) // 2] * 1e6,
        "p99_us": costs[int(0.99 * (len(costs) - 1))] * 1e6,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=20000)
    ap.add_argument("--workers", default="8,32,128,512,1024,2048,4096")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "scheduler_cost.md"))
    args = ap.parse_args(argv)
    rows = []
    for n in (int(x) for x in args.workers.split(",")):
        rows.append(measure(n, args.events))
        print(json.dumps(rows[-1]), flush=True)
    meta = run_meta(
        "scheduler_cost.py",
        argv,
        f"one stage, default SchedulerPolicy, worker speeds uniform in [0.25, 1], {args.events} calls per size",
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    L = [
        "# Cost of one scheduler decision (per ready signal or window end)",
        "",
        *meta_lines(meta),
        "",
        "| workers per stage | calls | groups decided | mean (us) | median (us) | 99th percentile (us) |",
        "|---|---|---|---|---|---|",
    ]
    L += [
        f"| {r['workers']} | {r['calls']} | {r['groups']} | "
        f"{r['mean_us']:.1f} | {r['median_us']:.1f} | {r['p99_us']:.1f} |"
        for r in rows
    ]
    L += [
        "",
        "Target: under 50 us per ready signal at 4,096 workers per stage. The disjoint set keeps a count of its",
        "components, so most events skip the O(D) connectivity check; the check runs only when a union could connect.",
        "Plot: [`scheduler_cost.html`](scheduler_cost.html).",
    ]
    out.write_text("\n".join(L) + "\n")
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    try:
        import plotly.graph_objects as go

        fig = go.Figure(
            [
                go.Scatter(
                    x=[r["workers"] for r in rows],
                    y=[r[k] for r in rows],
                    name=k.replace("_us", ""),
                    mode="lines+markers",
                )
                for k in ("mean_us", "median_us", "p99_us")
            ]
        )
        fig.update_layout(
            title="scheduler cost per call vs workers per stage",
            xaxis_type="log",
            xaxis_title="workers per stage",
            yaxis_title="microseconds",
        )
        save_figure(fig, out.with_suffix(""))
    except ImportError:
        print("plotly is not installed: no plot")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
