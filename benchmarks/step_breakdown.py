"""Where a step's time goes: milliseconds per step by span kind and stage, from a real run's events.

    python benchmarks/step_breakdown.py [--policy allreduce] [--schedules 1f1b,gpipe] [--stages 2] [--pipelines 2]
                                        [--channels 32] [--epochs 6] [--overlap off|on|off,on] [--repeats 1]

Trains the digits CNN (batch 64, 4 micro-batches, 6 epochs) on a LocalCluster
of single-threaded worker processes and prints, for pipeline 0 over the
epochs after the first: the step time, the samples/s measured per epoch and
per step, and the milliseconds per step of each span kind on each stage;
"untraced" is the part of a step no span covers (the control message, the
store round trips, bookkeeping).  Results: ``benchmarks/results/step_breakdown.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter
from pathlib import Path

from _common import local_cluster, meta_lines, run_meta


def breakdown(result, pipeline: int = 0) -> dict:
    S = result.config.stages
    D, B = result.config.pipelines, result.config.batch_size
    opt = sorted(
        (
            e
            for e in result.events
            if e["kind"] == "optimizer" and e["pipeline"] == pipeline and e["stage"] == 0 and e["epoch"] >= 1
        ),
        key=lambda e: e["end"],
    )
    lo, hi = opt[0]["step"], opt[-1]["step"]
    step_s = (opt[-1]["end"] - opt[0]["end"]) / (hi - lo)
    spent = Counter()
    global_rounds = {
        (e["stage"], e["round"]) for e in result.events if e["kind"] == "group" and e["reason"] == "global"
    }
    for e in result.events:
        if (
            e.get("pipeline") == pipeline
            and e.get("step") is not None
            and lo < e["step"] <= hi
            and e["kind"] not in ("epoch", "stage")
        ):
            kind = "sync (background)" if e.get("lane") == "background" else e["kind"]
            if kind == "wait" and e.get("what") in ("group", "drain"):
                if (e["stage"], e.get("round")) in global_rounds:
                    kind = "wait (global sync)"  # the epoch's end waits for every pipeline: not an ordinary group
                else:
                    kind = f"wait ({e['what']})"
            spent[(e["stage"], kind)] += e["end"] - e["start"]
    per_step = {k: v / (hi - lo) for k, v in spent.items()}
    for s in range(S):  # overlapped averaging runs beside the step's spans: not part of the step's own time
        own = sum(v for (st, k), v in per_step.items() if st == s and k != "sync (background)")
        per_step[(s, "untraced")] = step_s - own
    epochs = sorted({h["epoch"] for h in result.history})[1:]
    return {
        "step_ms": step_s * 1e3,
        "per_step_ms": {f"{s}/{k}": v * 1e3 for (s, k), v in sorted(per_step.items())},
        "epoch_rate": statistics.median(
            sum(h["samples_per_s"] for h in result.history if h["epoch"] == e) for e in epochs
        ),
        "step_rate": D * B / step_s,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="allreduce")
    ap.add_argument("--schedules", default="1f1b,gpipe")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--pipelines", type=int, default=2)
    ap.add_argument("--channels", type=int, default=32, help="width of the digits CNN")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument(
        "--overlap", default="off", help="sdpipe's averaging overlapped with compute: off, on, or off,on (contenders)"
    )
    ap.add_argument("--repeats", type=int, default=1, help="runs per contender, alternated; medians reported")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "step_breakdown.md"))
    a = ap.parse_args(argv)
    overlaps = a.overlap.split(",")
    if not set(overlaps) <= {"off", "on"}:
        raise SystemExit(f"--overlap: {a.overlap!r}; use off, on or off,on")

    import sdpipe
    from sdpipe.data import digits, digits_cnn

    (X, Y), _ = digits()
    client, cluster = local_cluster(a.stages * a.pipelines)
    rows = {}
    contenders = [(sch, ov) for sch in a.schedules.split(",") for ov in overlaps]
    label = lambda sch, ov: sch if len(overlaps) == 1 else f"{sch}, overlap {ov}"
    runs = {label(*c): [] for c in contenders}
    try:
        for rep in range(a.repeats):
            for schedule, ov in contenders if rep % 2 == 0 else contenders[::-1]:
                r = sdpipe.train(
                    digits_cnn(a.channels),
                    (X, Y),
                    stages=a.stages,
                    pipelines=a.pipelines,
                    policy=a.policy,
                    schedule=schedule,
                    microbatches=4,
                    batch_size=64,
                    epochs=a.epochs,
                    cuts={2: (6,), 4: (3, 5, 8)}.get(a.stages),
                    scheduler={"overlap": ov == "on"} if a.policy == "sdpipe" else None,
                    cluster=client,
                ).result(timeout=900)
                runs[label(schedule, ov)].append(breakdown(r))
                print(label(schedule, ov), f"{runs[label(schedule, ov)][-1]['step_ms']:.1f} ms/step", flush=True)
    finally:
        client.close()
        cluster.close()
    med = statistics.median
    for name, rs in runs.items():
        keys = {k for r in rs for k in r["per_step_ms"]}
        rows[name] = {
            "step_ms": med(r["step_ms"] for r in rs),
            "epoch_rate": med(r["epoch_rate"] for r in rs),
            "step_rate": med(r["step_rate"] for r in rs),
            "per_step_ms": {k: med(r["per_step_ms"].get(k, 0.0) for r in rs) for k in keys},
            "wait_share": [
                med(r["per_step_ms"].get(f"{s}/wait (group)", 0.0) / r["step_ms"] for r in rs) for s in range(a.stages)
            ],
            "spread": (min(r["step_ms"] for r in rs), max(r["step_ms"] for r in rs)),
        }
    meta = run_meta(
        "step_breakdown.py",
        argv,
        f"digits CNN ({a.channels} channels), {a.stages} x {a.pipelines}, policy {a.policy}, batch 64, "
        f"4 micro-batches, {a.epochs} epochs, {a.repeats} run(s) per contender (alternated, medians); "
        "pipeline 0, epochs after the first",
    )
    kinds = sorted({k for row in rows.values() for k in row["per_step_ms"]})
    lines = [
        "# Where a step's time goes",
        "",
        *meta_lines(meta),
        "",
        "| | " + " | ".join(rows) + " |",
        "|---|" + "---|" * len(rows),
        "| step (ms) | "
        + " | ".join(f"{r['step_ms']:.1f} [{r['spread'][0]:.1f}-{r['spread'][1]:.1f}]" for r in rows.values())
        + " |",
        "| samples/s per epoch | " + " | ".join(f"{r['epoch_rate']:.0f}" for r in rows.values()) + " |",
        "| samples/s per step | " + " | ".join(f"{r['step_rate']:.0f}" for r in rows.values()) + " |",
    ]
    for k in kinds:
        lines.append(
            f"| stage {k.replace('/', ': ')} (ms/step) | "
            + " | ".join(f"{r['per_step_ms'].get(k, 0.0):.2f}" for r in rows.values())
            + " |"
        )
    for st in range(a.stages):
        lines.append(
            f"| stage {st}: waiting for its group (% of the step) | "
            + " | ".join(f"{100 * r['wait_share'][st]:.1f}" for r in rows.values())
            + " |"
        )
    lines += [
        "",
        "A span's ms/step sums its durations over pipeline 0's steps after the first epoch; `wait (group)` is the"
        " time a step waited for an ordinary group (the service's answer, or an overlapped averaging still running"
        " at the next boundary), `wait (drain)` an epoch's end waiting for the last overlapped averaging,"
        " `wait (global sync)` the epochs' ends waiting for every pipeline, `wait` a stage waiting for its"
        " step's last sends to complete; `sync (background)`"
        " is overlapped averaging, which runs beside the step's own spans and so"
        " is not part of `untraced` (the step's time no span covers).",
    ]
    Path(a.out).write_text("\n".join(lines) + "\n")
    print(Path(a.out).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
