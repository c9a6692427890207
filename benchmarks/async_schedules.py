"""Samples/s of the flush schedule (1F1B) against the asynchronous ones (PipeDream's weight stashing, 2BW).

    python benchmarks/async_schedules.py [--repeats 3] [--epochs 4] [--out benchmarks/results/async_schedules.md]

The digits CNN (64 channels), batch 64 in 4 micro-batches, on one embedded LocalCluster of single-threaded
workers shared by every run.  Configurations: S = 2 x D = 1 (cut at layer 6, policy ``none``), S = 2 x D = 2
(``sdpipe``) and S = 4 x D = 1 (balanced cuts).  The schedules are alternated within each repeat (the order
reversed every other repeat); a run's samples/s is the median over its epochs after the first.

Next to each measurement stands the dry run's prediction (``sdpipe.core.schedule.dry_run``): the flush step's
makespan over the steady-state step of the asynchronous plan, with every action costed at the median
forward and backward of each stage measured in the same configuration's 1F1B runs (sends free), plus the
optimizer's median time per update.  "kept" is the share of the predicted gain measured: on two cores the
other workers' processes fill some of a flush's bubble, so part of the gain is there already.

Memory is counted from what each stage holds, as CPU tensors have no allocator statistics: the weight
versions stashed at most (the ``versions`` field of the runs' ``optimizer`` records) on top of the live
weights, times the stage's weight bytes, and the micro-batches in flight at most (forwarded, backward not
yet done) from the forward and backward spans.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from _common import local_cluster, meta_lines, run_meta, status_kib

SCHEDULES = ("1f1b", "async-1f1b", "async-2bw")
CONFIGS = ((2, 1, "none"), (2, 2, "sdpipe"), (4, 1, "none"))


def _median_costs(events, stages):
    """Per stage: median forward and backward seconds of one micro-batch, median optimizer seconds."""
    out = []
    for s in range(stages):
        d = {
            k: [e["end"] - e["start"] for e in events if e["kind"] == k and e["stage"] == s]
            for k in ("forward", "backward", "optimizer")
        }
        out.append({k: statistics.median(v) if v else 0.0 for k, v in d.items()})
    return out


def predicted_speedup(name, S, M, costs, update_every):
    """The dry run's flush step over the asynchronous steady-state step, with the measured costs."""
    from sdpipe.core.schedule import build_plan, dry_run

    def cost(a):
        c = costs[a.stage]
        return {"F": c["forward"], "B": c["backward"]}.get(a.op, 0.0)

    opt = max(c["optimizer"] for c in costs)
    flush = dry_run(build_plan("1f1b", S, M), cost).makespan + opt
    n = 8
    short = dry_run(build_plan(name, S, M, steps=n, update_every=update_every), cost).makespan
    longer = dry_run(build_plan(name, S, M, steps=n + 1, update_every=update_every), cost).makespan
    steady = (longer - short) + opt * M / update_every
    return flush / steady


def in_flight_peak(events, stages):
    """Per stage: the most micro-batches forwarded whose backward had not ended, over all pipelines."""
    peaks = []
    for s in range(stages):
        worst = 0
        for p in {e["pipeline"] for e in events if e["stage"] == s and e["kind"] == "forward"}:
            marks = [(e["end"], 1) for e in events if e["kind"] == "forward" and e["stage"] == s and e["pipeline"] == p]
            marks += [
                (e["end"], -1) for e in events if e["kind"] == "backward" and e["stage"] == s and e["pipeline"] == p
            ]
            alive = 0
            for _, d in sorted(marks, key=lambda x: (x[0], x[1])):
                alive += d
                worst = max(worst, alive)
        peaks.append(worst)
    return peaks


def _reset_peak() -> int:
    """Reset this process's peak resident set (Linux: ``/proc/self/clear_refs``); its resident KiB now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_kib("VmRSS")


def _peak_kib() -> int:
    return status_kib("VmHWM")


def measured_memory(hidden: int, repeats: int) -> list:
    """Peak resident memory each worker added during one epoch of a wide MLP (64-H-H-H-10, S = 3, D = 1), per
    schedule, each run on fresh worker processes after a warm-up epoch: the peak resident set (``VmHWM``,
    reset through ``/proc/self/clear_refs`` just before the run) minus the resident set then."""
    import sdpipe
    from sdpipe.data import digits, digits_mlp

    train_data, _ = digits()
    rows = []
    for r in range(repeats):
        for name in SCHEDULES if r % 2 == 0 else SCHEDULES[::-1]:
            client, cluster = local_cluster(3)
            try:
                warm = sdpipe.train(
                    digits_mlp(hidden=hidden, layers=3),
                    train_data,
                    stages=3,
                    cuts=(4, 6),
                    pipelines=1,
                    epochs=1,
                    batch_size=64,
                    policy="none",
                    schedule="1f1b",
                    cluster=client,
                )
                warm.result(timeout=600)  # imports and the first allocations, under the flush schedule
                before = client.run(_reset_peak)
                run = sdpipe.train(
                    digits_mlp(hidden=hidden, layers=3),
                    train_data,
                    stages=3,
                    cuts=(4, 6),
                    pipelines=1,
                    epochs=1,
                    batch_size=64,
                    policy="none",
                    schedule=name,
                    cluster=client,
                )
                res = run.result(timeout=600)
                after = client.run(_peak_kib)
                rank_of = {addr: rank for rank, addr in enumerate(run.workers)}
                rise = {rank_of[a]: (after[a] - before[a]) / 1024 for a in after if a in rank_of}
                info = {e["stage"]: e["weight_bytes"] for e in res.events if e["kind"] == "stage"}
                rows.append(
                    {
                        "schedule": name,
                        "repeat": r,
                        "rise_mib": [rise.get(k, 0.0) for k in range(3)],
                        "weight_mib": [info.get(k, 0) / 2**20 for k in range(3)],
                    }
                )
                print(f"memory {name} r{r}: {rows[-1]['rise_mib']}", flush=True)
            finally:
                client.close()
                cluster.close()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--channels", type=int, default=64)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "async_schedules.md"))
    ap.add_argument("--from-json", metavar="FILE", help="write the results file again from a recorded .json")
    ap.add_argument("--memory-hidden", type=int, default=2048, help="width of the MLP whose memory is measured")
    ap.add_argument("--memory-only", action="store_true", help="measure the memory only, into --out's .json")
    args = ap.parse_args(argv)
    if args.from_json or args.memory_only:
        recorded = json.loads(Path(args.from_json or Path(args.out).with_suffix(".json")).read_text())
        memory = recorded.get("memory")
        if args.memory_only:
            memory = {
                "meta": run_meta(
                    "async_schedules.py",
                    argv,
                    f"digits MLP 64-{args.memory_hidden}-{args.memory_hidden}-{args.memory_hidden}"
                    "-10, S=3 x D=1 cut at layers 4 and 6, batch 64 in 4 micro-batches, one epoch per run, "
                    "fresh workers",
                ),
                "rows": measured_memory(args.memory_hidden, 2),
            }
        write(recorded["meta"], recorded["rows"], 4, Path(args.out), memory)
        return 0

    import sdpipe
    from sdpipe.data import digits, digits_cnn

    train_data, _ = digits()
    M, batch = 4, 64
    client, cluster = local_cluster(4)
    rows = []
    try:
        sdpipe.train(
            digits_cnn(args.channels), train_data, stages=2, pipelines=1, epochs=1, batch_size=batch, cluster=client
        ).result(timeout=600)  # warm-up, not recorded
        for S, D, policy in CONFIGS:
            for r in range(args.repeats):
                for name in SCHEDULES if r % 2 == 0 else SCHEDULES[::-1]:
                    t = time.time()
                    run = sdpipe.train(
                        digits_cnn(args.channels),
                        train_data,
                        stages=S,
                        pipelines=D,
                        cuts=(6,) if S == 2 else None,
                        policy=policy,
                        schedule=name,
                        microbatches=M,
                        batch_size=batch,
                        epochs=args.epochs,
                        cluster=client,
                    )
                    res = run.result(timeout=900)
                    per_epoch = [
                        sum(h["samples_per_s"] for h in res.history if h["epoch"] == e) for e in range(1, args.epochs)
                    ]
                    info = {e["stage"]: e["weight_bytes"] for e in res.events if e["kind"] == "stage"}
                    versions = [
                        max(
                            [e.get("versions", 0) for e in res.events if e["kind"] == "optimizer" and e["stage"] == s]
                            or [0]
                        )
                        for s in range(S)
                    ]
                    rows.append(
                        {
                            "stages": S,
                            "pipelines": D,
                            "policy": policy,
                            "schedule": name,
                            "repeat": r,
                            "update_every": run.config.resolved_update_every,
                            "samples_per_s": statistics.median(per_epoch),
                            "accuracy_loss": res.history[-1]["loss"],
                            "costs": _median_costs(res.events, S),
                            "weight_bytes": [info.get(s, 0) for s in range(S)],
                            "stashed_versions": versions,
                            "in_flight": in_flight_peak(res.events, S),
                            "wall_s": time.time() - t,
                        }
                    )
                    print(f"S={S} D={D} {name} r{r}: {rows[-1]['samples_per_s']:.0f} samples/s", flush=True)
    finally:
        client.close()
        cluster.close()

    meta = run_meta(
        "async_schedules.py",
        argv,
        f"digits CNN ({args.channels} channels), batch {batch} in {M} micro-batches per pipeline, {args.epochs} "
        f"epochs, {args.repeats} repeats alternated; S=2 cut at layer 6; gloo on CPU",
    )
    memory = {
        "meta": run_meta(
            "async_schedules.py",
            argv,
            f"digits MLP 64-{args.memory_hidden}-{args.memory_hidden}-{args.memory_hidden}-10, "
            "S=3 x D=1 cut at layers 4 and 6, batch 64 in 4 micro-batches, one epoch per run, fresh workers",
        ),
        "rows": measured_memory(args.memory_hidden, 2),
    }
    write(meta, rows, M, Path(args.out), memory)
    return 0


def write(meta, rows, M, out: Path, memory=None) -> None:
    lines = ["# Flush (1F1B) against the asynchronous schedules", "", *meta_lines(meta)]
    lines += [
        "",
        "Samples/s of all pipelines, median over the repeats [min-max]; x 1F1B: the ratio of the medians; "
        "predicted: the dry run with the costs measured in the 1F1B runs; kept: (measured - 1) / (predicted - 1).",
        "",
        "| S x D (policy) | schedule | update every | samples/s | x 1F1B | predicted | kept |",
        "|---|---|---|---|---|---|---|",
    ]
    summary = []
    for S, D, policy in CONFIGS:
        mine = [r for r in rows if r["stages"] == S and r["pipelines"] == D]
        if not mine:
            continue
        base = [r for r in mine if r["schedule"] == "1f1b"]
        costs = [
            {k: statistics.median(r["costs"][s][k] for r in base) for k in ("forward", "backward", "optimizer")}
            for s in range(S)
        ]
        b = statistics.median(r["samples_per_s"] for r in base)
        for name in SCHEDULES:
            rs = [r for r in mine if r["schedule"] == name]
            v = [r["samples_per_s"] for r in rs]
            med = statistics.median(v)
            if name == "1f1b":
                pred = ratio = kept = None
            else:
                pred = predicted_speedup(name, S, M, costs, rs[0]["update_every"])
                ratio = med / b
                kept = (ratio - 1) / (pred - 1) if pred > 1.05 else None  # no gain to keep below
            summary.append(
                {
                    "stages": S,
                    "pipelines": D,
                    "schedule": name,
                    "samples_per_s": med,
                    "x_1f1b": ratio,
                    "predicted": pred,
                    "kept": kept,
                }
            )
            lines.append(
                f"| {S} x {D} ({policy}) | {name} | {rs[0]['update_every']} | {med:.0f} [{min(v):.0f}-{max(v):.0f}] | "
                + ("-" if ratio is None else f"{ratio:.2f}")
                + " | "
                + ("-" if pred is None else f"{pred:.2f}")
                + " | "
                + ("-" if kept is None else f"{kept:.0%}")
                + " |"
            )
    cores = meta.get("cores") or os.cpu_count()
    lines += [
        "",
        f"Every worker is a single-threaded process; this machine has {cores} cores. Where S x D exceeds them, a "
        "flush's idle workers hand their cores to the others' compute, so part of the predicted gain is there "
        "already under 1F1B; kept is left out where the prediction is below 1.05.",
    ]
    lines += [
        "",
        "Memory each stage holds (stage 0 / stage 1 / ...): weight copies = the live weights plus the versions "
        "stashed at most; micro-batches in flight at most (forwarded, backward not done); weight bytes per copy.",
        "",
        "| S x D | schedule | weight copies | micro-batches in flight | bytes of weights held |",
        "|---|---|---|---|---|",
    ]
    for S, D, _ in CONFIGS:
        for name in SCHEDULES:
            rs = [r for r in rows if r["stages"] == S and r["pipelines"] == D and r["schedule"] == name]
            if not rs:
                continue
            copies = [1 + max(r["stashed_versions"][s] for r in rs) for s in range(S)]
            flight = [max(r["in_flight"][s] for r in rs) for s in range(S)]
            held = [c * rs[0]["weight_bytes"][s] for s, c in enumerate(copies)]
            lines.append(
                f"| {S} x {D} | {name} | {' / '.join(map(str, copies))} | {' / '.join(map(str, flight))} | "
                f"{' / '.join(f'{h / 1e6:.2f} MB' for h in held)} |"
            )
    if memory:
        mm = memory["meta"]
        lines += [
            "",
            "Measured: the peak resident memory each worker added during one epoch, "
            f"median over the runs [min-max] ({mm['config']}; `{mm['command']}`, {mm['date']}): the peak resident "
            "set (VmHWM, reset through /proc/self/clear_refs just before the run) minus the resident set then, "
            "each run on fresh worker processes after an unrecorded warm-up epoch under 1F1B. Weights per copy: "
            + " / ".join(f"{w:.1f} MiB" for w in memory["rows"][0]["weight_mib"])
            + ".",
            "",
            "| schedule | stage 0 MiB | stage 1 MiB | stage 2 MiB |",
            "|---|---|---|---|",
        ]
        for name in SCHEDULES:
            rs = [r for r in memory["rows"] if r["schedule"] == name]
            cells = []
            for k in range(3):
                v = [r["rise_mib"][k] for r in rs]
                cells.append(f"{statistics.median(v):.1f} [{min(v):.1f}-{max(v):.1f}]")
            lines.append(f"| {name} | {' | '.join(cells)} |")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    record = {"meta": meta, "rows": rows, "summary": summary}
    if memory:
        record["memory"] = memory
    out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
