"""What the live dashboard's time attribution and what-if panel cost while a run trains, per second of the run.

    python benchmarks/live_panels.py [--seconds 40] [--switch-at 20]

A 2 x 2 run of the digits MLP under allreduce, pipeline 1 slept 3x, on a LocalCluster of 4 single-threaded workers
(127.0.0.1), followed by ``Dashboard(run)`` (no browser: the figure's edits go nowhere, its threads do their
work); ``--switch-at`` seconds after it trains, ``run.set_policy("sdpipe")``.  Reported, each as CPU seconds of the
thread that spends them per second of the run:

- *attribution, slices*: the dashboard's own time attribution (each new slice of the run's clock once, summed);
- *attribution, whole window*: what the dashboard did before, measured beside it on the same records: every
  ``ATTRIBUTION_EVERY`` seconds, or as often as ``ATTRIBUTION_SHARE`` of a core allowed, ``attribute()`` over all
  the records of the last 30 s;
- *what-if*: the what-if panel's thread (``run.what_if`` every ``WHATIF_EVERY`` s or as its share allows, the
  switch's prediction and measurement), with its refresh interval, and what it costs the run's steps: the steps
  per second (stage 0's, all pipelines) while each of its predictions ran, against the same length of time just
  before and after it (the Dask scheduler, and with it the group service, runs in this process: its thread
  holds the interpreter's lock while it simulates);

and the switch's line: the prediction made just before it against what was measured after it.  Results:
``benchmarks/results/live_panels.md`` (and ``.json``).
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import statistics
import sys
import threading
import time
from pathlib import Path

from _common import meta_lines, run_meta


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=40.0, help="seconds the run trains, measured")
    ap.add_argument("--switch-at", type=float, default=20.0, help="seconds into the run of the policy switch")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "live_panels"))
    args = ap.parse_args(argv)

    from distributed import Client, LocalCluster

    import sdpipe
    from sdpipe.attribution import attribute
    from sdpipe.data import digits, digits_mlp
    from sdpipe.widgets import Dashboard
    from sdpipe.widgets.dashboard import ATTRIBUTION_EVERY, ATTRIBUTION_SHARE, ATTRIBUTION_WINDOW

    cluster = LocalCluster(
        n_workers=4, threads_per_worker=1, host="127.0.0.1", dashboard_address=None, env={"OMP_NUM_THREADS": "1"}
    )
    client = Client(cluster, set_as_default=False)
    train, held = digits()
    run = sdpipe.train(
        digits_mlp(),
        train,
        eval_data=held,
        stages=2,
        pipelines=2,
        policy="allreduce",
        epochs=1000,
        heterogeneity=sdpipe.Heterogeneity(slowdown={1: 3.0}),
        cluster=client,
    )
    dash = Dashboard(run)
    old = {"cpu": 0.0, "calls": 0, "records": 0}
    stop = threading.Event()

    def whole_window() -> None:
        """The dashboard's former attribution: every record of the window, at its former pace."""
        spans, cursor, due = collections.deque(), 0, 0.0
        while not stop.wait(0.25):
            new, cursor = run.events_since(cursor)
            spans.extend(e for e in new if e.get("pipeline") is not None and e.get("start") is not None)
            now = max((e["end"] for e in spans), default=0.0)
            while spans and spans[0]["end"] < now - ATTRIBUTION_WINDOW:
                spans.popleft()
            if time.monotonic() < due or not spans:
                continue
            t = time.thread_time()
            attribute(list(spans), since=now - ATTRIBUTION_WINDOW)
            cost = time.thread_time() - t
            old["cpu"], old["calls"], old["records"] = old["cpu"] + cost, old["calls"] + 1, len(spans)
            due = time.monotonic() + max(ATTRIBUTION_EVERY, cost / ATTRIBUTION_SHARE)

    try:
        while run.status != "running":
            assert not run.done(), run.status
            time.sleep(0.2)
        side = threading.Thread(target=whole_window, daemon=True)
        side.start()
        began, clock = time.monotonic(), time.time() - run.t0
        switched = None
        while time.monotonic() - began < args.seconds:
            if switched is None and time.monotonic() - began >= args.switch_at:
                run.set_policy("sdpipe")
                switched = time.time() - run.t0
            time.sleep(0.5)
        seconds = time.time() - run.t0 - clock
        spent = {"slices": dash.plot.attribution_spent, "whole_window": old["cpu"], "whatif": dash.whatif.cost}
        passes = [(a, b) for a, b in dash.whatif.passes if b > a]
        stop.set()
        side.join()
        # the switch predicted (as the panel's pace allows) and measured (its epochs after it trained)
        deadline = time.monotonic() + 180
        settled = lambda: dash.whatif.switches and dash.whatif.switches[0].predicted and dash.whatif.switches[0].settled
        while not settled() and time.monotonic() < deadline:
            time.sleep(0.5)
        line = dash.whatif.switches[0] if dash.whatif.switches else None
    finally:
        run.stop()
        events = run.result(timeout=120).events
        dash.stop()
        client.close()
        cluster.close()
    steps = sorted(e["end"] for e in events if e["kind"] == "optimizer" and e["stage"] == 0)
    count = lambda a, b: bisect.bisect_left(steps, b) - bisect.bisect_left(steps, a)
    ratios = []  # per prediction: its steps/s over those of as long before and after it
    for a, b in passes:
        d = b - a
        around = (count(a - d, a) + count(b, b + d)) / (2 * d)
        if around > 0 and b + d <= steps[-1]:
            ratios.append(count(a, b) / d / around)
    meta = run_meta("live_panels.py", argv, "2 x 2 digits MLP, allreduce then sdpipe, pipeline 1 slept 3x")
    result = {
        **meta,
        "seconds": round(seconds, 1),
        "records_per_s": round(dash.view.count / max(dash.view.now, 1e-9)),
        "cpu_per_s": {k: round(v / seconds, 4) for k, v in spent.items()},
        "whole_window": {"calls": old["calls"], "records": old["records"]},
        "whatif_every_s": round(dash.whatif.every, 1),
        "whatif_passes_s": [round(b - a, 2) for a, b in passes],
        "steps_during_whatif": [round(r, 3) for r in ratios],
        "switch": None
        if line is None
        else {
            "at": round(line.at, 2),
            "label": line.label,
            "before": line.before and line.before.measured,
            "expected": line.expected,
            "simulated": line.simulated,
            "measured": line.measured,
            "epochs": line.epochs,
            "error": line.error,
            "simulated_error": line.simulated_error,
        },
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    c = result["cpu_per_s"]
    lines = [
        "# The live dashboard's panels: CPU seconds per second of a 2 x 2 run",
        "",
        *meta_lines(meta),
        "",
        f"{seconds:.0f} s of the run measured, about {result['records_per_s']:,} records a second.",
        "",
        "| work | CPU s per s of run |",
        "|---|---:|",
        f"| time attribution, slices (now) | {c['slices']:.4f} |",
        f"| time attribution, whole 30 s window (before; {old['calls']} calls, last over {old['records']:,} records)"
        f" | {c['whole_window']:.4f} |",
        f"| what-if panel (refreshed every {result['whatif_every_s']:g} s at the end) | {c['whatif']:.4f} |",
    ]
    if ratios:
        took = statistics.median(result["whatif_passes_s"])
        each = ", ".join(f"{r:.0%}" for r in ratios)
        lines += [
            "",
            f"While each of the what-if panel's {len(ratios)} predictions ran (median {took:.1f} s), the run took "
            f"{statistics.median(ratios):.0%} of the steps a second it took as long before and after it (median; "
            f"each: {each}).",
        ]
    if line is not None:
        s = result["switch"]
        fmt = lambda x, f="{:,.0f}": "-" if x is None else f.format(x)
        lines += [
            "",
            f"Switch at t = {s['at']:.1f} s ({s['label']}): measured before {fmt(s['before'])}, expected "
            f"{fmt(s['expected'])} (simulated {fmt(s['simulated'])}), measured after {fmt(s['measured'])} over "
            f"epochs {s['epochs']}: error {fmt(s['error'], '{:+.0%}')} (simulated's "
            f"{fmt(s['simulated_error'], '{:+.0%}')}).",
        ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
