"""Live predictions against what a switch then measured: ``run.predict`` before a live change, samples/s after it.

    python benchmarks/what_if.py [--stages 4] [--pipelines 2] [--repeats 2] [--window 10] [--settle 3]

Each repeat is one run of the digits CNN (S x D, 1F1B, 4 micro-batches, batch 64, evaluation each epoch) on an
embedded LocalCluster of S x D single-threaded workers on 127.0.0.1, that goes through a chain of live changes,
``--window`` seconds apart after ``--settle`` seconds of settling (the first after the warm-up)::

    allreduce, pipeline D-1 slept 4x  ->  sdpipe  ->  no heterogeneity  ->  pipeline D-1 slept 4x
        ->  allreduce  ->  none  ->  allreduce, no heterogeneity

Just before each change: ``run.predict(last=window)`` for the run as it runs and ``run.predict(last=window,
<change>)``, and the samples/s the run measured in that window (the epochs that ended there: each pipeline's
samples over its epoch time, evaluation apart, summed over the pipelines; the median over the epochs).  After it:
the same measure over the next window, once the change settled.  Two predictions per change:

- *simulated*: the model's samples/s for the changed run (the simulator on the costs calibrated in the window,
  the workers sharing the machine's cores);
- *expected*: the measured samples/s before the change times the model's ratio (changed over as it runs), what
  ``run.what_if()`` shows as ``expected``.

``run.predict`` simulates on the measured cores (the machine's less what the processes beside the workers took,
from the records' ``machine_cpu`` and ``process_cpu``: :func:`sdpipe.simulation.others_cores`); also on the
fitted cores (``cores="fitted"``: those on which the run as it runs simulates at its measured samples/s), and each
without the cores in the model (``cores`` None: a core per worker, costs in wall time, as ``simulate`` had
before), to show what the cores model changes.  Results: ``benchmarks/results/what_if.md`` and
``.json``: per change the errors, and over all changes the median absolute error with its spread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from _common import local_cluster, meta_lines, run_meta


def chain(D: int) -> list:
    """(label, change for run.predict, how to apply it) of each live change, in order."""
    import sdpipe

    slow = sdpipe.Heterogeneity(slowdown={D - 1: 4.0})
    none = sdpipe.Heterogeneity()
    return [
        ("allreduce -> sdpipe (straggler)", {"policy": "sdpipe"}, lambda r: r.set_policy("sdpipe")),
        ("straggler -> none (sdpipe)", {"heterogeneity": none}, lambda r: r.set_heterogeneity(none)),
        ("none -> straggler (sdpipe)", {"heterogeneity": slow}, lambda r: r.set_heterogeneity(slow)),
        ("sdpipe -> allreduce (straggler)", {"policy": "allreduce"}, lambda r: r.set_policy("allreduce")),
        ("allreduce -> none (straggler)", {"policy": "none"}, lambda r: r.set_policy("none")),
        ("none -> allreduce, straggler -> none", {"policy": "allreduce", "heterogeneity": none}, None),
    ]


def wall_model(run, window: float, **changes) -> float:
    """The prediction without the cores in the model: wall-time costs, a core per worker."""
    from sdpipe.driver.result import RunResult
    from sdpipe.simulation import calibrate, simulate
    from sdpipe.simulation.whatif import _changed, _window, last_end

    source = run._prediction_source()
    events, _, _ = _window(source.events, last_end(source.events) - window, None)
    costs, network, _ = calibrate(RunResult(models=[], history=[], events=events, config=source.config, wall_time=0))
    target = _changed(source.config, changes)
    sim = simulate(
        target.stages,
        target.pipelines,
        costs=costs,
        network=network,
        steps=max(1, source.batches_per_epoch // target.pipelines),
        epochs=1,
        record=False,
        **{f: getattr(target, f) for f in ("policy", "schedule", "microbatches", "batch_size", "heterogeneity")},
    )
    return sum(h["samples_per_s"] for h in sim.history)


def fitted_model(run, window: float, change: dict) -> tuple:
    """(as it runs, changed, the fitted cores, the cores' worth of the other processes): the cores in the model
    fitted (those on which the run as it runs simulates at its measured samples/s) instead of measured."""
    from sdpipe.simulation.whatif import _Model, last_end

    source = run._prediction_source()
    model = _Model(source, last_end(source.events) - window, None)
    cores = model.fit_cores()
    return model.predict({}, cores).samples_per_s, model.predict(change, cores).samples_per_s, cores, model.others


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--pipelines", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--window", type=float, default=10.0)
    ap.add_argument("--settle", type=float, default=3.0)
    ap.add_argument("--warm-up", type=float, default=12.0)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "what_if.md"))
    args = ap.parse_args(argv)

    import sdpipe
    from sdpipe.data import digits, digits_cnn
    from sdpipe.simulation.whatif import last_end, measured_rate

    S, D = args.stages, args.pipelines
    train_data, eval_data = digits()
    cuts = {1: None, 2: (6,), 3: (3, 6), 4: (3, 5, 8)}[S]
    client, cluster = local_cluster(S * D)
    rows = []

    def measured(run, since: float) -> float:
        events = [e for e in run.events if e.get("start") is not None and e["start"] >= since]
        return measured_rate(events)

    try:
        for rep in range(args.repeats):
            run = sdpipe.train(
                digits_cnn(32),
                train_data,
                stages=S,
                pipelines=D,
                policy="allreduce",
                epochs=10_000,
                batch_size=64,
                microbatches=4,
                cuts=cuts,
                eval_data=eval_data,
                heterogeneity=sdpipe.Heterogeneity(slowdown={D - 1: 4.0}),
                cluster=client,
            )
            try:
                deadline = time.monotonic() + 300
                while not any(e.get("kind") == "epoch" for e in run.events):  # started and trained an epoch
                    if time.monotonic() > deadline or run.done():
                        raise RuntimeError(f"the run trained no epoch in 300 s: {run.status}")
                    time.sleep(0.5)
                time.sleep(args.warm_up)
                for label, change, apply in chain(D):
                    now = last_end(run.events)
                    before = measured(run, now - args.window)
                    t = time.perf_counter()
                    as_is, changed = run.predict(last=args.window), run.predict(last=args.window, **change)
                    cost = time.perf_counter() - t
                    wall_as_is, wall_changed = wall_model(run, args.window), wall_model(run, args.window, **change)
                    fitted_as_is, fitted_changed, fitted, others = fitted_model(run, args.window, change)
                    if apply is None:  # two changes at once
                        run.set_policy(change["policy"])
                        run.set_heterogeneity(change["heterogeneity"])
                    else:
                        apply(run)
                    switched = time.time() - run.t0
                    time.sleep(args.settle + args.window)
                    after = measured(run, switched + args.settle)
                    row = {
                        "repeat": rep,
                        "change": label,
                        "before": before,
                        "after": after,
                        "as_is": as_is.samples_per_s,
                        "simulated": changed.samples_per_s,
                        "expected": before * changed.samples_per_s / as_is.samples_per_s,
                        "simulated_wall": wall_changed,
                        "expected_wall": before * wall_changed / wall_as_is,
                        "simulated_fitted": fitted_changed,
                        "expected_fitted": before * fitted_changed / fitted_as_is,
                        "stretch": changed.stretch,
                        "cores": changed.cores,
                        "fitted_cores": fitted,
                        "others": others,
                        "predict_seconds": cost,
                    }
                    for k in ("simulated", "expected", "simulated_wall", "expected_wall", "simulated_fitted",
                              "expected_fitted"):  # fmt: skip
                        row[k + "_error"] = row[k] / after - 1.0
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
            finally:
                run.stop()
                run.result(timeout=300)
    finally:
        client.close()
        cluster.close()

    meta = run_meta(
        "what_if.py",
        argv,
        f"digits CNN (32 channels), {S} x {D}, batch 64, 4 micro-batches, 1F1B, straggler: pipeline {D - 1} "
        f"slept 4x; window {args.window:g} s, settle {args.settle:g} s",
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))

    def pct(v):
        return "-" if v is None else f"{100 * v:+.1f}%"

    def num(v, f="{:.0f}"):
        return "-" if v is None else f.format(v)

    def spread(key):
        errs = sorted(abs(r[key]) for r in rows if r[key] is not None) or [float("nan")]
        return statistics.median(errs), errs[0], errs[-1]

    lines = [
        "# Live predictions against the measurement after a switch",
        "",
        *meta_lines(meta),
        "",
        f"{args.repeats} runs, each through the chain of live changes below; before each change `run.predict` on "
        f"the last {args.window:g} s, after it the samples/s measured over the next {args.window:g} s (after "
        f"{args.settle:g} s of settling). *simulated*: the model's figure; *expected*: the measured figure before "
        "the change times the model's ratio (what `run.what_if()` shows); both on the measured cores (the "
        "machine's less the *others*' share, what `run.predict` takes). *fitted*: the same on the fitted cores. "
        "*wall*: without the cores in the model (a core per worker, wall-time costs).",
        "",
        "| run | change | before | simulated before (error) | after | simulated | error | expected | error | "
        "wall: simulated | error | wall: expected | error | fitted: simulated | error | expected | error "
        "| stretch | cores (measured) | cores (fitted) | others |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['repeat']} | {r['change']} | {r['before']:.0f} | {r['as_is']:.0f} "
            f"({pct(r['as_is'] / r['before'] - 1.0)}) | {r['after']:.0f} | {r['simulated']:.0f} | "
            f"{pct(r['simulated_error'])} | {r['expected']:.0f} | {pct(r['expected_error'])} | "
            f"{r['simulated_wall']:.0f} | {pct(r['simulated_wall_error'])} | {r['expected_wall']:.0f} | "
            f"{pct(r['expected_wall_error'])} | {num(r['simulated_fitted'])} | {pct(r['simulated_fitted_error'])} "
            f"| {num(r['expected_fitted'])} | {pct(r['expected_fitted_error'])} | {r['stretch']:.2f} | "
            f"{r['cores']:.2f} | {r['fitted_cores']:.2f} | {num(r['others'], '{:.2f}')} |"
        )
    lines += ["", "Median absolute error over every change (smallest - largest):", ""]
    for key, name in (
        ("simulated_error", "simulated, measured cores (the machine's less the other processes'; `run.predict`)"),
        ("expected_error", "expected, measured cores"),
        ("simulated_fitted_error", "simulated, fitted cores"),
        ("expected_fitted_error", "expected, fitted cores"),
        ("simulated_wall_error", "simulated, a core per worker"),
        ("expected_wall_error", "expected, a core per worker"),
    ):
        med, lo, hi = spread(key)
        lines.append(f"- {name}: {100 * med:.1f}% ({100 * lo:.1f}% - {100 * hi:.1f}%)")
    costs = [r["predict_seconds"] for r in rows]
    lines += [
        "",
        f"Two `run.predict` calls took {1000 * statistics.median(costs):.0f} ms (median; "
        f"{1000 * min(costs):.0f}-{1000 * max(costs):.0f} ms) in the notebook's process.",
    ]
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
