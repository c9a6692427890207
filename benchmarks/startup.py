"""How long ``sdpipe.train(...)`` and ``Dashboard(run)`` hold the caller, while 8 workers train.

    python benchmarks/startup.py [--repeats 5]

The load: a 4-pipeline x 2-stage ``sdpipe`` run of the digits CNN on a
LocalCluster of 8 single-threaded workers (this machine's cores are shared by
them).  While it trains, the script alternates, ``--repeats`` times each:

* ``Dashboard(run)`` of the training run (the constructor's time in the
  calling thread: the figure, the widgets, the first data comes with the
  dashboard's thread);
* ``sdpipe.train(...)`` of a second 2 x 1 run on an embedded cluster (the
  call's time: it returns while its cluster starts), then that run is stopped
  and waited for;
* ``sdpipe.train(...)`` of a second 1 x 1 run on the same (busy) cluster's
  client with two extra workers added.

It also records how long each second run then took to start (status
``starting`` until every rank has joined) and which start-up steps it showed.
Results: ``benchmarks/results/startup.md`` (and ``.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from _common import local_cluster, meta_lines, run_meta


def started(run, timeout: float = 300.0) -> tuple:
    """(seconds until the run left 'starting', the start-up lines it showed)."""
    t, lines = time.perf_counter(), []
    while run.status == "starting" and time.perf_counter() - t < timeout:
        if run.startup and (not lines or lines[-1] != run.startup):
            lines.append(run.startup)
        time.sleep(0.05)
    return time.perf_counter() - t, lines


def spread(xs) -> str:
    xs = sorted(xs)
    return f"{statistics.median(xs) * 1000:.0f} ms (min {xs[0] * 1000:.0f}, max {xs[-1] * 1000:.0f}, n={len(xs)})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "startup.md"))
    args = ap.parse_args(argv)

    import sdpipe
    from sdpipe.data import digits, digits_cnn, digits_mlp

    t = time.perf_counter()
    from sdpipe.widgets import Dashboard  # loads plotly's figure classes (before the load, as a notebook's first cell)

    import_s = time.perf_counter() - t

    train_data, _ = digits()
    client, cluster = local_cluster(10)
    rows = {"dashboard": [], "train_embedded": [], "train_cluster": [], "started_embedded": [], "started_cluster": []}
    steps_seen = {}
    try:
        # the load: 8 of the 10 workers; the other 2 stay free for the 1 x 1 runs on the same cluster
        busy = sdpipe.train(
            digits_cnn(32),
            train_data,
            stages=2,
            pipelines=4,
            cuts=(6,),
            policy="sdpipe",
            epochs=1000,
            batch_size=64,
            heterogeneity=sdpipe.Heterogeneity(slowdown={3: 4.0}),
            cluster=client,
        )
        started(busy)
        while not any(e["kind"] == "optimizer" for e in busy.events_since(0)[0]):
            time.sleep(0.1)
        for _ in range(args.repeats):
            t = time.perf_counter()
            dash = Dashboard(busy)
            rows["dashboard"].append(time.perf_counter() - t)
            time.sleep(1.0)
            dash.stop()

            for where, kwargs in (("embedded", dict(stages=2)), ("cluster", dict(stages=1, cluster=client))):
                t = time.perf_counter()
                run = sdpipe.train(digits_mlp(), train_data, pipelines=1, epochs=1000, **kwargs)
                rows[f"train_{where}"].append(time.perf_counter() - t)
                took, steps_seen[where] = started(run)
                rows[f"started_{where}"].append(took)
                run.stop()
                run.result(timeout=120)
        contention = busy.contention
        busy.stop()
        busy.result(timeout=120)
    finally:
        client.close()
        cluster.close()

    meta = run_meta(
        "startup.py",
        argv,
        "load: sdpipe run, digits CNN, S=2, D=4, batch 64, pipeline 3 slowed 4x, on 8 of a "
        "LocalCluster's 10 single-threaded workers; measured in the calling thread",
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    L = [
        "# How long `sdpipe.train` and `Dashboard(run)` hold the caller while 8 workers train",
        "",
        *meta_lines(meta),
        "",
        "| call (in the caller's thread) | median (min, max) | target |",
        "|---|---|---|",
        f"| `Dashboard(run)` of the training run | {spread(rows['dashboard'])} | < 1 s |",
        "| `from sdpipe.widgets import Dashboard`, once, before the load (after `import sdpipe`) "
        f"| {import_s * 1000:.0f} ms | - |",
        f"| `sdpipe.train(...)`, embedded cluster (2 x 1) | {spread(rows['train_embedded'])} | < 1 s |",
        f"| `sdpipe.train(...)`, the busy cluster's client (1 x 1) | {spread(rows['train_cluster'])} | < 1 s |",
        "",
        "What followed the return (the run's status `starting`, in the background, until every rank joined):",
        "",
        "| run | seconds to start, median (min, max) |",
        "|---|---|",
        f"| embedded cluster (2 x 1) | {statistics.median(rows['started_embedded']):.1f} "
        f"({min(rows['started_embedded']):.1f}, "
        f"{max(rows['started_embedded']):.1f}) |",
        f"| the busy cluster (1 x 1) | {statistics.median(rows['started_cluster']):.1f} "
        f"({min(rows['started_cluster']):.1f}, "
        f"{max(rows['started_cluster']):.1f}) |",
        "",
        "Start-up steps the embedded run showed (`run.startup`): "
        + "; ".join(f"`{x}`" for x in steps_seen.get("embedded", [])),
        "",
        f"Note from the loaded run: {contention}" if contention else "",
    ]
    out.write_text("\n".join(L) + "\n")
    out.with_suffix(".json").write_text(
        json.dumps({"meta": meta, "seconds": rows, "import_widgets_s": import_s, "startup_steps": steps_seen}, indent=2)
        + "\n"
    )
    print("\n".join(L))
    return 0


if __name__ == "__main__":
    sys.exit(main())
