"""Where a step's CPU time goes, per stage, in sdpipe and in torch.distributed.pipelining on the same work.

    python benchmarks/engine_breakdown.py [--cells mlp:3x2,gpt:4x1] [--schedule 1f1b] [--steps 40]
                                          [--out benchmarks/results/engine_breakdown.md]
    python benchmarks/engine_breakdown.py --heap --repeats 3 [--cells gpt:4x1]
                                          [--out benchmarks/results/engine_heap.md]

Runs ``benchmarks/engine.py``'s two contenders once per cell (sdpipe's ``allreduce`` on a LocalCluster, torch's
``PipelineStage`` in plain processes) and prints, for pipeline 0's stages over the measured steps, milliseconds
per step: the step's wall time, the CPU time of the thread that trains (split into forward and backward, the
optimizer, and the rest: messages, the all-reduce, Python between them), and the CPU time of the process's
other threads (gloo's network thread, Dask's event loop).  sdpipe's figures come from its own records
(``forward``/``backward``/``optimizer`` spans' ``cpu``, the ``step_cpu`` and ``process_cpu`` of its
``optimizer`` records, epochs after the first); torch's from ``time.thread_time`` around each part of its step.
Machine-wide CPU of the driver (sdpipe's Dask scheduler and client) is not in it.

``--heap`` compares sdpipe with itself instead: as it is (glibc's thresholds raised while a worker trains,
:mod:`sdpipe.worker.allocator`) and with the thresholds Dask's nanny fixed, the two alternated ``--repeats`` times;
it prints each stage's CPU in forward and backward and the samples/s, medians with every repeat.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
from collections import Counter
from pathlib import Path

from _common import meta_lines, run_meta
from engine import MODELS, parse_shape, run_sdpipe, run_torch


def sdpipe_rows(events: list, stages: int) -> list:
    rows = []
    first = min(e["step"] for e in events if e["kind"] == "optimizer" and e["epoch"] >= 1)
    for s in range(stages):
        opt = sorted(
            (e for e in events if e["kind"] == "optimizer" and e["pipeline"] == 0 and e["stage"] == s),
            key=lambda e: e["step"],
        )
        opt = [e for e in opt if e["step"] > first]
        steps = len(opt)
        cpu = Counter()
        for e in events:
            if e.get("pipeline") == 0 and e.get("stage") == s and "cpu" in e and (e.get("step") or -1) > first:
                cpu[e["kind"]] += e["cpu"]
        train = sum(e["step_cpu"] for e in opt) / steps
        process = sum(e["process_cpu"] for e in opt) / steps
        compute = (cpu["forward"] + cpu["backward"]) / steps
        optimizer = cpu["optimizer"] / steps
        wall = statistics.median(b["end"] - a["end"] for a, b in itertools.pairwise(opt))
        rows.append((s, wall, train, compute, optimizer, train - compute - optimizer, process - train))
    return [(s, *(1000 * x for x in r)) for s, *r in rows]


def torch_rows(result: dict, stages: int) -> list:
    rows = []
    for s in range(stages):
        c = result["cpu_ms_per_step"][s]
        rows.append(
            (s, result["step_ms"], c["training thread"], c["compute and messages"], c["optimizer"],
             c["training thread"] - c["compute and messages"] - c["optimizer"], c["process"] - c["training thread"])
        )  # fmt: skip
    return rows


def busy_lines(rows: list, pipelines: int, schedule: str) -> list:
    """What a step of sdpipe's workers asks of the machine: their CPU per step (pipeline 0's stages, times the
    pipelines) against the step's wall time times the machine's cores.  A schedule that does the same work (an
    asynchronous one fills the bubble and does no less) can be at most the inverse of that share faster."""
    cores = os.cpu_count() or 1
    cpu = pipelines * sum(train + other for _, _, train, _, _, _, other in rows)
    wall = statistics.median(r[1] for r in rows)
    share = cpu / (wall * cores)
    return [
        f"Machine: sdpipe's workers used {cpu:.1f} ms of CPU per step of {wall:.1f} ms on {cores} cores: "
        f"{share:.0%} of the machine; a schedule doing the same work could be at most {1 / share:.2f}x as fast as "
        f"this {schedule} here (the driver's process not counted)."
    ]


def _spread(values: list, fmt: str) -> str:
    return f"{format(statistics.median(values), fmt)} ({', '.join(format(v, fmt) for v in values)})"


def heap_lines(args: dict, repeats: int) -> list:
    """sdpipe with glibc's thresholds raised while training and as Dask's nanny fixed them, alternated."""
    S = args["stages"]
    got: dict = {"raised": [], "fixed": []}
    for _ in range(repeats):
        for heap in got:
            sd = run_sdpipe({**args, "heap": heap})
            got[heap].append((sd["samples_per_s"], sdpipe_rows(sd["events"], S), sd["peak_rss_mib"]))
    lines = [
        "",
        f"## {args['model']} {S}x{args['pipelines']}, {args['schedule']}: glibc's thresholds while training",
        "",
        "| thresholds | samples/s | " + " | ".join(f"stage {s} forward + backward CPU ms" for s in range(S))
        + " | peak RSS MiB |",
        "|---|---|" + "---|" * S + "---|",
    ]  # fmt: skip
    for heap, runs in got.items():
        name = "raised while training (sdpipe)" if heap == "raised" else "fixed by Dask's nanny"
        cells = [_spread([r[0] for r in runs], ".0f")]
        cells += [_spread([r[1][s][3] for r in runs], ".1f") for s in range(S)]
        cells.append(_spread([r[2] for r in runs], ".0f"))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default="mlp:3x2,gpt:4x1", help="MODEL:SxD, comma-separated")
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--heap", action="store_true", help="sdpipe with and without its allocator thresholds")
    ap.add_argument("--repeats", type=int, default=3, help="with --heap: alternated runs of each")
    ap.add_argument("--out", default=None, help="default: results/engine_breakdown.md (engine_heap.md with --heap)")
    a = ap.parse_args(argv)
    if a.repeats < 1:
        raise SystemExit(f"--repeats: at least 1, got {a.repeats}")
    out = a.out or str(Path(__file__).parent / "results" / ("engine_heap.md" if a.heap else "engine_breakdown.md"))
    lines = []
    for cell in a.cells.split(","):
        model, _, shape = cell.partition(":")
        if model not in MODELS:
            raise SystemExit(f"--cells: {model!r} is not one of {', '.join(MODELS)} (MODEL:SxD, e.g. mlp:3x2)")
        S, D = parse_shape(shape, "--cells")
        args = dict(
            stages=S, pipelines=D, model=model, microbatches=4, batch_size=64, steps=a.steps, schedule=a.schedule
        )
        if a.heap:
            lines += heap_lines(args, a.repeats)
            print("\n".join(lines[-4:]), file=sys.stderr)
            continue
        sd, tr = run_sdpipe(args), run_torch(args)
        lines += [
            "",
            f"## {model} {S}x{D}, {a.schedule}: sdpipe {sd['samples_per_s']:.0f} samples/s, "
            f"torch.distributed.pipelining {tr['samples_per_s']:.0f}",
            "",
            "| engine | stage | step (wall) | training thread | forward + backward | optimizer | the rest | "
            "other threads |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, rows in (("sdpipe", sdpipe_rows(sd["events"], S)), ("torch", torch_rows(tr, S))):
            for s, wall, train, compute, opt, rest, other in rows:
                comp = f"{compute:.1f}" + ("*" if name == "torch" else "")
                lines.append(
                    f"| {name} | {s} | {wall:.1f} | {train:.1f} | {comp} | {opt:.1f} | {rest:.1f} | {other:.1f} |"
                )
        lines += ["", *busy_lines(sdpipe_rows(sd["events"], S), D, a.schedule)]
        print("\n".join(lines[-(6 + 2 * S) :]), file=sys.stderr)
    meta = run_meta("engine_breakdown.py", argv, f"cells {a.cells}, {a.schedule}, batch 64 in 4 micro-batches, Adam")
    if a.heap:
        head = [
            "# glibc's thresholds while a worker trains: sdpipe with and without sdpipe.worker.allocator",
            "",
            *meta_lines(meta),
            "",
            f"Medians of {a.repeats} runs each, alternated (every run in brackets).  forward + backward CPU: "
            "milliseconds per step of pipeline 0's stage in its forwards and backwards (the CPU the page faults "
            "of fresh allocations land in).",
        ]
    else:
        head = [
            "# Where a step's CPU time goes: sdpipe and torch.distributed.pipelining",
            "",
            *meta_lines(meta),
            "",
            "Milliseconds per step, pipeline 0's stages over the measured steps.  training thread: CPU of the thread "
            "that trains; forward + backward and optimizer: its CPU in them (* torch's with the step's messages: "
            "its schedule does both); the rest: its CPU in messages, the all-reduce and Python between them; other "
            "threads: the process's other threads (gloo's network thread, Dask's event loop).",
        ]
    text = [*head, *lines]
    Path(out).write_text("\n".join(text) + "\n")
    print("\n".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
