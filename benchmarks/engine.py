"""Engine efficiency: sdpipe's allreduce against torch.distributed.pipelining, same work, gloo on the CPU.

    python benchmarks/engine.py [--models mlp,cnn,resnet,gpt] [--shapes 2x2,3x2,4x1] [--async] [--steps 40]
                                [--repeats 2] [--out benchmarks/results/engine.md]

Contenders, alternated within each cell (model, S x D) in every repeat, the order reversed every other repeat, so
that machine drift affects all alike:

- ``sdpipe-1f1b`` / ``sdpipe-gpipe``: ``sdpipe.train(policy="allreduce")`` on
  a LocalCluster of S x D single-threaded worker processes (127.0.0.1);
- ``torch-1f1b`` / ``torch-gpipe``: S x D processes (spawned, one thread
  each) in one gloo world; per pipeline a ``PipelineStage`` with
  ``Schedule1F1B`` / ``ScheduleGPipe`` over the pipeline's group, then the
  gradients all-reduced across pipelines per stage and an Adam step;
- with ``--async``, at D = 1: ``sdpipe-async-1f1b`` and ``sdpipe-async-2bw`` (sdpipe's asynchronous schedules).

Same model cut at the same layers, same micro-batching, same batches in the
same order (``sdpipe.data.batch_indices``), same optimizer (torch's Adam as constructed by default) and loss.
Models: the digits MLP, CNN and ResNet (cross entropy), and ``gpt``: ``sdpipe.examples.char_gpt``
on the standard library's text in windows of 64 characters (``lm_loss``, the
mean cross entropy of every position).  Measured:
samples/s of all pipelines over the steps after a warm-up epoch, and the peak
resident memory of each worker process (fresh processes per contender).
Results: ``benchmarks/results/engine.md`` and ``.json`` (written after every cell).
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import sys
import time
from pathlib import Path

from _common import local_cluster, meta_lines, run_meta, save_figure, status_kib

MODELS = ("mlp", "cnn", "resnet", "gpt")
DESCRIBED = {
    "mlp": "digits MLP 64-512-512-10",
    "cnn": "digits CNN, 32 channels",
    "resnet": "digits ResNet (sdpipe.examples.digits_resnet)",
    "gpt": "GPT-style character model (sdpipe.examples.char_gpt) on windows of 64 characters",
}


def make_model(name: str):
    from sdpipe.data import digits_cnn, digits_mlp

    if name == "gpt":
        from sdpipe.examples import char_gpt

        return char_gpt()
    if name == "resnet":
        from sdpipe.examples import digits_resnet

        return digits_resnet()
    return digits_cnn(32) if name == "cnn" else digits_mlp(hidden=512)


def cuts_for(name: str, stages: int):
    return {("cnn", 2): (6,), ("cnn", 4): (3, 5, 8)}.get((name, stages))


def load_data(name: str):
    """``(X, Y)`` training tensors of the model's data."""
    if name == "gpt":
        from sdpipe.examples import char_data

        windows, _ = char_data()
        return windows.tensors()
    from sdpipe.data import digits

    return digits()[0]


def loss_for(name: str):
    import torch

    if name == "gpt":
        from sdpipe.examples import lm_loss

        return lm_loss
    return torch.nn.CrossEntropyLoss()


def _torch_worker(rank, args, port, out):
    import datetime

    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from sdpipe.core.partition import partition
    from sdpipe.data import batch_indices

    torch.set_num_threads(1)
    S, D, M, B = args["stages"], args["pipelines"], args["microbatches"], args["batch_size"]
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=S * D,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        p, s = divmod(rank, S)
        pipes = [dist.new_group([q * S + t for t in range(S)]) for q in range(D)]
        dps = [dist.new_group([q * S + t for q in range(D)]) for t in range(S)]
        module = partition(make_model(args["model"]), S, cuts_for(args["model"], S))[s]
        stage = PipelineStage(module, s, S, torch.device("cpu"), group=pipes[p])
        kind = Schedule1F1B if args["schedule"] == "1f1b" else ScheduleGPipe
        schedule = kind(stage, M, loss_fn=loss_for(args["model"]))
        params = [q for q in module.parameters()]
        opt = torch.optim.Adam(params, lr=0.002) if params else None  # (a stage of a lone activation: nothing)
        X, Y = load_data(args["model"])
        n = len(X)
        per_epoch = n // B // D
        warm, steps = per_epoch, args["steps"]
        t0 = None
        cpu = {"compute and messages": 0.0, "all-reduce": 0.0, "optimizer": 0.0}  # training thread, measured steps
        for k in range(warm + steps):
            if k == warm:
                dist.barrier()
                t0, c_start, p_start = time.perf_counter(), time.thread_time(), time.process_time()
            epoch, j = divmod(k, per_epoch)
            idx = batch_indices(n, B, 0, epoch, j * D + p)
            if opt is not None:
                opt.zero_grad()
            c0 = time.thread_time()
            if s == 0:
                schedule.step(X[idx])
            elif s == S - 1:
                schedule.step(target=Y[idx])
            else:
                schedule.step()
            c1 = time.thread_time()
            if params:
                flat = torch.cat([q.grad.reshape(-1) for q in params])
                dist.all_reduce(flat, group=dps[s])
                flat.div_(D)
                off = 0
                for q in params:
                    q.grad.copy_(flat[off : off + q.numel()].view_as(q))
                    off += q.numel()
            c2 = time.thread_time()
            if opt is not None:
                opt.step()
            if t0 is not None:
                c3 = time.thread_time()
                for key, c in zip(cpu, (c1 - c0, c2 - c1, c3 - c2), strict=True):
                    cpu[key] += c
        dist.barrier()
        elapsed = time.perf_counter() - t0
        cpu["training thread"] = time.thread_time() - c_start
        cpu["process"] = time.process_time() - p_start
        per_step = {key: 1000 * v / steps for key, v in cpu.items()}  # ms of CPU per step
        out.put((rank, elapsed, peak_rss_mib(), per_step))
    finally:
        dist.destroy_process_group()


def run_torch(args: dict) -> dict:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    world = args["stages"] * args["pipelines"]
    procs = [ctx.Process(target=_torch_worker, args=(r, args, port, out)) for r in range(world)]
    for p in procs:
        p.start()
    rows = []
    deadline = time.monotonic() + 900
    while len(rows) < world:  # a process that died (an error in it) ends the wait at once, not at the deadline
        try:
            rows.append(out.get(timeout=1.0))
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"torch.distributed.pipelining contender failed (exit codes {dead})") from None
    for p in procs:
        p.join(60)
        if p.is_alive():
            p.kill()
    elapsed = max(r[1] for r in rows)
    return {
        "samples_per_s": args["steps"] * args["pipelines"] * args["batch_size"] / elapsed,
        "peak_rss_mib": max(r[2] for r in rows),
        "cpu_ms_per_step": {r[0]: r[3] for r in rows},  # rank -> CPU ms per step by part
        "step_ms": 1000 * elapsed / args["steps"],
    }


def peak_rss_mib() -> float:
    """This process's peak resident memory (``VmHWM``), in MiB.  Not ``getrusage``'s ``ru_maxrss``: Linux carries
    that over a fork and an exec, so a spawned worker would report its parent's peak when it is higher, and the
    benchmark's own process grows from cell to cell."""
    return status_kib("VmHWM") / 1024


def run_sdpipe(args: dict) -> dict:
    import sdpipe

    X, Y = load_data(args["model"])
    S, D, B = args["stages"], args["pipelines"], args["batch_size"]
    per_epoch = len(X) // B // D
    epochs = 1 + -(-args["steps"] // per_epoch)  # a warm-up epoch, then at least ``steps`` steps
    client, cluster = local_cluster(S * D)  # fresh worker processes: their peak memory is this run's
    try:
        if args.get("heap") == "fixed":  # the contender without sdpipe.worker.allocator (engine_breakdown --heap)
            client.run(_heap_fixed)
        result = sdpipe.train(
            make_model(args["model"]),
            (X, Y),
            loss_fn=loss_for(args["model"]),
            stages=S,
            pipelines=D,
            policy="allreduce",
            schedule=args["schedule"],
            microbatches=args["microbatches"],
            batch_size=B,
            epochs=epochs,
            cuts=cuts_for(args["model"], S),
            cluster=client,
        ).result(timeout=1800)
        rss = client.run(peak_rss_mib)
        events = result.events
    finally:
        client.close()
        cluster.close()
    # epochs after the first: samples of all pipelines over the epoch time (as the torch side: after a warm-up epoch)
    rates = [sum(h["samples_per_s"] for h in result.history if h["epoch"] == e) for e in range(1, epochs)]
    return {"samples_per_s": statistics.median(rates), "peak_rss_mib": max(rss.values()), "events": events}


def _heap_fixed() -> None:
    """On a worker: train with glibc's thresholds as Dask's nanny left them (no raise while training)."""
    import contextlib

    import sdpipe.worker.loop

    sdpipe.worker.loop.training_thresholds = contextlib.nullcontext


def parse_shape(text: str, flag: str) -> tuple:
    """``(stages, pipelines)`` of ``"SxD"``; one line naming ``flag`` for anything else."""
    try:
        S, D = (int(x) for x in text.split("x"))
    except ValueError:
        raise SystemExit(f"{flag}: {text!r} is not STAGESxPIPELINES (e.g. 3x2)") from None
    return S, D


def _cells(a) -> list:
    """``[(model, stages, pipelines), ...]`` from ``--models`` and ``--shapes`` (or the single ``--model``,
    ``--stages``, ``--pipelines``)."""
    models = a.models.split(",") if a.models else [a.model]
    shapes = a.shapes.split(",") if a.shapes else [f"{a.stages}x{a.pipelines}"]
    cells = []
    for m in models:
        if m not in MODELS:
            raise SystemExit(f"--models: {m!r} is not one of {', '.join(MODELS)}")
        cells += [(m, *parse_shape(shape, "--shapes")) for shape in shapes]
    return cells


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--pipelines", type=int, default=2)
    ap.add_argument("--model", choices=MODELS, default="cnn")
    ap.add_argument("--models", help="comma-separated models, each measured at every --shapes (overrides --model)")
    ap.add_argument(
        "--shapes", help="comma-separated STAGESxPIPELINES, e.g. 2x2,3x2,4x1 (overrides --stages/--pipelines)"
    )
    ap.add_argument(
        "--async", dest="async_", action="store_true", help="at D = 1 also sdpipe's async-1f1b and async-2bw schedules"
    )
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=60, help="measured steps per pipeline (after a warm-up epoch)")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "engine.md"))
    ap.add_argument("--from-json", metavar="PATH", help="redraw the results file and figure from a recorded .json")
    a = ap.parse_args(argv)
    if a.from_json:
        recorded = json.loads(Path(a.from_json).read_text())
        # a record from before the matrix holds one cell's table under "results"
        cells = recorded.get("cells") or {recorded["meta"]["config"].split(",")[0]: recorded["results"]}
        write_results(recorded["meta"], cells, Path(a.out))
        return 0
    cells = _cells(a)
    out = Path(a.out)
    meta = run_meta(
        "engine.py",
        argv,
        f"models: {'; '.join(f'{m}: {DESCRIBED[m]}' for m in MODELS if any(c[0] == m for c in cells))}"
        f"; S x D in {', '.join(sorted({f'{S}x{D}' for _, S, D in cells}))}, batch {a.batch_size}, "
        f"{a.microbatches} micro-batches, Adam 0.002, gloo on the CPU, {a.steps} measured steps per pipeline "
        f"after a warm-up epoch, {a.repeats} repeats alternated within each cell",
    )
    results: dict = {}
    for model, S, D in cells:
        contenders = [("sdpipe", "1f1b"), ("torch", "1f1b"), ("sdpipe", "gpipe"), ("torch", "gpipe")]
        if a.async_ and D == 1:
            contenders += [("sdpipe", "async-1f1b"), ("sdpipe", "async-2bw")]
        base = dict(
            stages=S, pipelines=D, model=model, microbatches=a.microbatches, batch_size=a.batch_size, steps=a.steps
        )
        samples: dict = {}
        for rep in range(a.repeats):
            for engine, schedule in contenders if rep % 2 == 0 else contenders[::-1]:
                t = time.time()
                args = {**base, "schedule": schedule}
                row = run_sdpipe(args) if engine == "sdpipe" else run_torch(args)
                for detail in ("events", "cpu_ms_per_step"):  # what engine_breakdown.py reads
                    row.pop(detail, None)
                samples.setdefault(f"{engine}-{schedule}", []).append(row)
                print(
                    f"{model} {S}x{D} #{rep} {engine}-{schedule}: {row['samples_per_s']:.0f} samples/s, "
                    f"peak RSS {row['peak_rss_mib']:.0f} MiB ({time.time() - t:.0f} s)",
                    file=sys.stderr,
                )
        results[f"{model} {S}x{D}"] = {
            k: {
                "samples_per_s": statistics.median(r["samples_per_s"] for r in rows),
                "samples_per_s_each": [r["samples_per_s"] for r in rows],
                "peak_rss_mib": statistics.median(r["peak_rss_mib"] for r in rows),
                "peak_rss_mib_each": [r["peak_rss_mib"] for r in rows],
            }
            for k, rows in samples.items()
        }
        # written after every cell: a long matrix interrupted keeps what it measured
        out.with_suffix(".json").write_text(json.dumps({"meta": meta, "cells": results}, indent=1))
    write_results(meta, results, out)
    return 0


def _ratio(table: dict, a: str, b: str) -> float:
    return table[a]["samples_per_s"] / table[b]["samples_per_s"]


def write_results(meta: dict, cells: dict, out: Path) -> None:
    """The results file and figure from the measured cells (also: ``--from-json``, to redraw without re-measuring)."""
    lines = [
        "# Engine efficiency: sdpipe's allreduce against torch.distributed.pipelining",
        "",
        *meta_lines(meta),
        "",
        "Samples/s of all pipelines, median of the repeats [min-max]; x torch: sdpipe's median over "
        "torch.distributed.pipelining's with the same schedule; RSS: peak resident memory of the largest worker "
        "process, median of the repeats (sdpipe's workers are Dask worker processes, torch's plain processes).",
        "",
        "| model S x D | sdpipe 1F1B | torch 1F1B | x torch | sdpipe GPipe | torch GPipe | x torch "
        "| RSS MiB sdpipe / torch |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def cell(v):
        return f"{v['samples_per_s']:.0f} [{min(v['samples_per_s_each']):.0f}-{max(v['samples_per_s_each']):.0f}]"

    for key, t in cells.items():
        rss = max(t["sdpipe-1f1b"]["peak_rss_mib"], t["sdpipe-gpipe"]["peak_rss_mib"])
        rss_t = max(t["torch-1f1b"]["peak_rss_mib"], t["torch-gpipe"]["peak_rss_mib"])
        r1, rg = _ratio(t, "sdpipe-1f1b", "torch-1f1b"), _ratio(t, "sdpipe-gpipe", "torch-gpipe")
        lines.append(
            f"| {key} | {cell(t['sdpipe-1f1b'])} | {cell(t['torch-1f1b'])} | **{r1:.2f}** "
            f"| {cell(t['sdpipe-gpipe'])} | {cell(t['torch-gpipe'])} | **{rg:.2f}** | {rss:.0f} / {rss_t:.0f} |"
        )
    asyncs = [(k, t) for k, t in cells.items() if "sdpipe-async-1f1b" in t]
    if asyncs:
        lines += [
            "",
            "The asynchronous schedules against sdpipe's 1F1B in the same cell (x 1F1B: ratio of the medians):",
            "",
            "| model S x D | 1F1B | async-1f1b | x 1F1B | async-2bw | x 1F1B |",
            "|---|---|---|---|---|---|",
        ]
        for key, t in asyncs:
            lines.append(
                f"| {key} | {cell(t['sdpipe-1f1b'])} | {cell(t['sdpipe-async-1f1b'])} | "
                f"**{_ratio(t, 'sdpipe-async-1f1b', 'sdpipe-1f1b'):.2f}** | {cell(t['sdpipe-async-2bw'])} | "
                f"**{_ratio(t, 'sdpipe-async-2bw', 'sdpipe-1f1b'):.2f}** |"
            )
    spread = max(
        (max(v["samples_per_s_each"]) - min(v["samples_per_s_each"])) / v["samples_per_s"]
        for t in cells.values()
        for v in t.values()
    )
    lines += [
        "",
        f"- noise: the repeats of one contender differ by up to {100 * spread:.0f}% of its median on this machine "
        "(S x D single-threaded worker processes share its cores); `benchmarks/results/engine_breakdown.md` says "
        "where a step's CPU time goes",
    ]
    written = save_figure(figure(cells), out.with_suffix(""), width=900, height=440)
    lines += ["", "Figure: " + ", ".join(f"[{w.name}]({w.name})" for w in written)]
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())


def figure(cells: dict):
    """Per cell, sdpipe over torch.distributed.pipelining with each schedule (each repeat's ratio to the other's
    median as points)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    keys = list(cells)
    for schedule, color in (("1f1b", "#1f77b4"), ("gpipe", "#ff7f0e")):
        mine, theirs = f"sdpipe-{schedule}", f"torch-{schedule}"
        fig.add_trace(
            go.Bar(
                x=keys,
                y=[_ratio(cells[k], mine, theirs) for k in keys],
                name=schedule,
                marker_color=color,
                offsetgroup=schedule,
            )
        )
        fig.add_trace(
            go.Scatter(
                x=[k for k in keys for _ in cells[k][mine]["samples_per_s_each"]],
                y=[v / cells[k][theirs]["samples_per_s"] for k in keys for v in cells[k][mine]["samples_per_s_each"]],
                mode="markers",
                marker=dict(color="black", size=6),
                offsetgroup=schedule,
                showlegend=False,
            )
        )
    fig.add_hline(y=1.0, line_dash="dot")
    fig.update_layout(
        template="plotly_white",
        width=900,
        height=440,
        barmode="group",
        scattermode="group",
        yaxis_title="sdpipe / torch.distributed.pipelining (samples/s)",
    )
    return fig


if __name__ == "__main__":
    sys.exit(main())
