"""Engine efficiency: sdpipe's allreduce against torch.distributed.pipelining, same work, gloo on the CPU.

    python benchmarks/engine.py [--stages 2] [--pipelines 2] [--model cnn|mlp|gpt] [--steps 60] [--repeats 3]

Contenders, alternated in every repeat so that machine drift affects all alike:

- ``sdpipe-1f1b`` / ``sdpipe-gpipe``: ``sdpipe.train(policy="allreduce")`` on
  a LocalCluster of S x D single-threaded worker processes (127.0.0.1);
- ``torch-1f1b`` / ``torch-gpipe``: S x D processes (spawned, one thread
  each) in one gloo world; per pipeline a ``PipelineStage`` with
  ``Schedule1F1B`` / ``ScheduleGPipe`` over the pipeline's group, then the
  gradients all-reduced across pipelines per stage and an Adam step.

Same model cut at the same layers, same micro-batching, same batches in the
same order (``sdpipe.data.batch_indices``), same optimizer and loss.  Models:
the digits CNN or MLP (cross entropy), or ``gpt``: ``sdpipe.examples.char_gpt``
on the standard library's text in windows of 64 characters (``lm_loss``, the
mean cross entropy of every position; results ``engine_gpt.md`` with
``--out``).  Measured:
samples/s of all pipelines over the steps after a warm-up epoch, and the peak
resident memory of each worker process (fresh processes per contender).
Results: ``benchmarks/results/engine.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

from _common import local_cluster, meta_lines, run_meta, save_figure


def make_model(name: str):
    from sdpipe.data import digits_cnn, digits_mlp

    if name == "gpt":
        from sdpipe.examples import char_gpt

        return char_gpt()
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

    from sdpipe.core import partition
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
        opt = torch.optim.Adam(module.parameters(), lr=0.002)
        X, Y = load_data(args["model"])
        n = len(X)
        per_epoch = n // B // D
        warm, steps = per_epoch, args["steps"]
        params = [q for q in module.parameters()]
        t0 = None
        for k in range(warm + steps):
            if k == warm:
                dist.barrier()
                t0 = time.perf_counter()
            epoch, j = divmod(k, per_epoch)
            idx = batch_indices(n, B, 0, epoch, j * D + p)
            opt.zero_grad()
            if s == 0:
                schedule.step(X[idx])
            elif s == S - 1:
                schedule.step(target=Y[idx])
            else:
                schedule.step()
            flat = torch.cat([q.grad.reshape(-1) for q in params])
            dist.all_reduce(flat, group=dps[s])
            flat.div_(D)
            off = 0
            for q in params:
                q.grad.copy_(flat[off : off + q.numel()].view_as(q))
                off += q.numel()
            opt.step()
        dist.barrier()
        elapsed = time.perf_counter() - t0
        out.put((rank, elapsed, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))
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
    rows = [out.get(timeout=900) for _ in range(world)]
    for p in procs:
        p.join(60)
        if p.is_alive():
            p.kill()
    elapsed = max(r[1] for r in rows)
    return {
        "samples_per_s": args["steps"] * args["pipelines"] * args["batch_size"] / elapsed,
        "peak_rss_mib": max(r[2] for r in rows),
    }


def run_sdpipe(args: dict) -> dict:
    import sdpipe

    X, Y = load_data(args["model"])
    S, D, B = args["stages"], args["pipelines"], args["batch_size"]
    per_epoch = len(X) // B // D
    epochs = 1 + -(-args["steps"] // per_epoch)  # a warm-up epoch, then at least ``steps`` steps
    client, cluster = local_cluster(S * D)  # fresh worker processes: their peak memory is this run's
    try:
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
        rss = client.run(lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    finally:
        client.close()
        cluster.close()
    # epochs after the first: samples of all pipelines over the epoch time (as the torch side: after a warm-up epoch)
    rates = [sum(h["samples_per_s"] for h in result.history if h["epoch"] == e) for e in range(1, epochs)]
    return {"samples_per_s": statistics.median(rates), "peak_rss_mib": max(rss.values())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--pipelines", type=int, default=2)
    ap.add_argument("--model", choices=["cnn", "mlp", "gpt"], default="cnn")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=60, help="measured steps per pipeline (after a warm-up epoch)")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "engine.md"))
    ap.add_argument("--from-json", metavar="PATH", help="redraw the results file and figure from a recorded .json")
    a = ap.parse_args(argv)
    if a.from_json:
        recorded = json.loads(Path(a.from_json).read_text())
        write_results(recorded["meta"], recorded["results"], Path(a.out))
        return 0
    base = dict(
        stages=a.stages,
        pipelines=a.pipelines,
        model=a.model,
        microbatches=a.microbatches,
        batch_size=a.batch_size,
        steps=a.steps,
    )
    contenders = [("sdpipe", "1f1b"), ("torch", "1f1b"), ("sdpipe", "gpipe"), ("torch", "gpipe")]
    samples: dict = {}
    for rep in range(a.repeats):
        for engine, schedule in contenders if rep % 2 == 0 else contenders[::-1]:
            t = time.time()
            args = {**base, "schedule": schedule}
            row = run_sdpipe(args) if engine == "sdpipe" else run_torch(args)
            samples.setdefault(f"{engine}-{schedule}", []).append(row)
            print(
                f"#{rep} {engine}-{schedule}: {row['samples_per_s']:.0f} samples/s, "
                f"peak RSS {row['peak_rss_mib']:.0f} MiB "
                f"({time.time() - t:.0f} s)",
                file=sys.stderr,
            )
    meta = run_meta(
        "engine.py",
        argv,
        f"{'GPT-style character model (sdpipe.examples.char_gpt)' if a.model == 'gpt' else 'digits ' + a.model.upper()}"
        f", {a.stages} stages x {a.pipelines} pipelines, batch {a.batch_size}, "
        f"{a.microbatches} micro-batches, Adam 0.002, gloo on the CPU, {a.steps} measured steps per pipeline "
        f"after a warm-up epoch, {a.repeats} repeats alternated",
    )
    table = {
        k: {
            "samples_per_s": statistics.median(r["samples_per_s"] for r in rows),
            "samples_per_s_each": [r["samples_per_s"] for r in rows],
            "peak_rss_mib": statistics.median(r["peak_rss_mib"] for r in rows),
        }
        for k, rows in samples.items()
    }
    out = Path(a.out)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": table}, indent=1))
    write_results(meta, table, out)
    return 0


def write_results(meta: dict, table: dict, out: Path) -> None:
    """The results file and figure from the measured table (also: ``--from-json``, to redraw without re-measuring)."""
    lines = [
        "# Engine efficiency: sdpipe's allreduce against torch.distributed.pipelining",
        "",
        *meta_lines(meta),
        "",
        "| contender | samples/s (median) | each repeat | peak RSS per worker (MiB) |",
        "|---|---|---|---|",
    ]
    for k, v in table.items():
        lines.append(
            f"| {k} | {v['samples_per_s']:.0f} | {', '.join(f'{x:.0f}' for x in v['samples_per_s_each'])} | "
            f"{v['peak_rss_mib']:.0f} |"
        )
    for schedule in ("1f1b", "gpipe"):
        ratio = table[f"sdpipe-{schedule}"]["samples_per_s"] / table[f"torch-{schedule}"]["samples_per_s"]
        lines.append("")
        lines.append(f"- {schedule}: sdpipe / torch.distributed.pipelining = **{ratio:.2f}x**")
    spread = max(
        (max(v["samples_per_s_each"]) - min(v["samples_per_s_each"])) / v["samples_per_s"] for v in table.values()
    )
    lines += [
        "",
        f"- noise: the repeats of one contender differ by up to {100 * spread:.0f}% of its median on this machine "
        "(S x D worker processes share its cores); where sdpipe falls short, its per-step extras are a 6-integer "
        "control message from stage 0 down the pipeline and the event records (`benchmarks/step_breakdown.py` shows "
        "where a step's time goes), and its workers are Dask worker processes (an event loop next to the training "
        "thread)",
    ]
    written = save_figure(figure(table), out.with_suffix(""), width=800, height=440)
    lines += ["", "Figure: " + ", ".join(f"[{w.name}]({w.name})" for w in written)]
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())


def figure(table: dict):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    names = list(table)
    fig = make_subplots(
        rows=1,
        cols=2,
        column_widths=[0.65, 0.35],
        horizontal_spacing=0.12,
        subplot_titles=("samples/s (bar: median, points: each repeat)", "peak RSS per worker (MiB)"),
    )
    colors = ["#1f77b4" if n.startswith("sdpipe") else "#ff7f0e" for n in names]
    fig.add_trace(
        go.Bar(x=names, y=[table[n]["samples_per_s"] for n in names], marker_color=colors, showlegend=False),
        row=1,
        col=1,
    )
    fig.add_trace(
        go.Scatter(
            x=[n for n in names for _ in table[n]["samples_per_s_each"]],
            y=[v for n in names for v in table[n]["samples_per_s_each"]],
            mode="markers",
            marker=dict(color="black", size=7),
            showlegend=False,
        ),
        row=1,
        col=1,
    )
    fig.add_trace(
        go.Bar(x=names, y=[table[n]["peak_rss_mib"] for n in names], marker_color=colors, showlegend=False),
        row=1,
        col=2,
    )
    fig.update_layout(template="plotly_white", width=800, height=440)
    return fig


if __name__ == "__main__":
    sys.exit(main())
