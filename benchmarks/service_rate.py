"""What the group service itself sustains: ready signals per second through its socket, and its CPU per signal.

    python benchmarks/service_rate.py [--stages 4] [--pipelines 64,256,1024] [--seconds 8] [--repeats 3]

A LocalCluster's scheduler alone (no workers, 127.0.0.1) with the group service (``sdpipe.service``) and a run
opened under the ``sdpipe`` preset, S stages x D pipelines.  One emulator process (spawned) holds one connection
per worker (S x D) to the service's own socket, the one real workers use, and each sends the ready signal of its
next step as soon as the last was answered: no compute, so the service is saturated and decides every group
(the windows of rule "arrival" see workers that are always due).  Over ``--seconds`` after two seconds of
warm-up: the ready signals answered per second, and the CPU time of the process hosting the Dask scheduler (this
one: a LocalCluster's scheduler runs in it; its client thread is idle) per signal: the service's whole cost of a
ready signal (its socket, frames, the event loop, the scheduler core, the answer to every member and every
decision logged to the run's topic).  One service process takes at most 1e6 / (that cost in us) signals a second
on one core of this machine.  Sizes alternate within each repeat (order reversed every repeat): medians and
range.  Results: ``benchmarks/results/service_rate.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import sys
import time
import uuid
from pathlib import Path

from _common import results_head, run_meta

HERE = Path(__file__).parent


def emulate(endpoint, run_id: str, stages: int, pipelines: int, warm: float, seconds: float, out) -> None:
    """The emulator process: S x D connections, each a worker that sends its next ready signal once answered.
    Puts ("warm", count) after ``warm`` seconds, then ("end", count, errors) after ``seconds`` more."""
    from sdpipe.wire.protocol import decode_frame, encode_frame

    async def main():
        count, errors = [0], []
        stop = asyncio.Event()

        async def worker(stage: int, pipeline: int):
            reader, writer = await asyncio.open_connection(*endpoint)
            step = 0
            try:
                while not stop.is_set():
                    step += 1
                    frame = {"op": "sdpipe_ready", "run_id": run_id, "stage": stage, "pipeline": pipeline}
                    writer.write(encode_frame(frame | {"step": step, "global_sync": False, "timeout": 30.0}))
                    size = int.from_bytes(await reader.readexactly(4), "big")
                    answer = decode_frame(await reader.readexactly(size))
                    if "error" in answer:
                        errors.append(answer["error"])
                        return
                    count[0] += 1
            finally:
                writer.close()

        tasks = [asyncio.create_task(worker(s, p)) for s in range(stages) for p in range(pipelines)]
        await asyncio.sleep(warm)
        out.put(("warm", count[0], time.time()))
        await asyncio.sleep(seconds)
        out.put(("end", count[0], time.time(), errors[:3]))
        stop.set()
        await asyncio.wait(tasks, timeout=35)  # a worker waiting in an open round is answered by its window

    asyncio.run(main())


def measure(client, stages: int, pipelines: int, warm: float, seconds: float) -> dict:
    from sdpipe.core.policies import POLICY_PRESETS
    from sdpipe.service import ensure_service
    from sdpipe.wire.protocol import GroupServiceClient

    ensure_service(client)
    run_id = f"rate-{uuid.uuid4().hex[:8]}"
    service = GroupServiceClient(run_id, client=client, token=uuid.uuid4().hex)
    policy = POLICY_PRESETS["sdpipe"].to_dict()
    service.open(stages=stages, pipelines=pipelines, policy=policy, policy_name="sdpipe", topic=run_id, t0=time.time())
    endpoint = service._call("sdpipe_endpoint", within=10)["endpoint"]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=emulate, args=(endpoint, run_id, stages, pipelines, warm, seconds, q), daemon=True)
    proc.start()
    try:
        _, n0, t0 = q.get(timeout=warm + 60)
        cpu0 = time.process_time()
        msg = q.get(timeout=seconds + 60)
        cpu1 = time.process_time()
        _, n1, t1, errors = msg
        proc.join(timeout=60)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=10)
        service.close()
    if errors:
        raise SystemExit(f"service_rate: the service refused a ready signal: {errors[0]}")
    signals = n1 - n0
    return {
        "stages": stages,
        "pipelines": pipelines,
        "signals": signals,
        "signals_per_s": signals / (t1 - t0),
        "cpu_us_per_signal": 1e6 * (cpu1 - cpu0) / max(signals, 1),
        "cpu_share": (cpu1 - cpu0) / (t1 - t0),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--pipelines", default="64,256,1024")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--warm", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(HERE / "results" / "service_rate.md"))
    args = ap.parse_args(argv)
    sizes = [int(v) for v in args.pipelines.split(",")]
    from distributed import Client, LocalCluster

    rows = []
    with LocalCluster(n_workers=0, host="127.0.0.1", dashboard_address=None) as cluster:
        with Client(cluster) as client:
            for r in range(args.repeats):
                for D in sizes if r % 2 == 0 else sizes[::-1]:
                    row = measure(client, args.stages, D, args.warm, args.seconds) | {"repeat": r}
                    rows.append(row)
                    print(
                        f"{args.stages} x {D}: {row['signals_per_s']:,.0f} signals/s, "
                        f"{row['cpu_us_per_signal']:.1f} us each ({row['cpu_share']:.2f} of a core)",
                        file=sys.stderr,
                        flush=True,
                    )
    meta = run_meta(
        "service_rate.py",
        argv,
        f"the group service on a LocalCluster's scheduler (127.0.0.1, no workers), policy sdpipe (its preset), "
        f"{args.stages} stages; one emulator process, one socket per worker, no compute; "
        f"{args.warm:g} s warm-up, {args.seconds:g} s measured, {args.repeats} repeats (sizes alternated)",
    )
    title = "The group service's own rate: ready signals per second, CPU per signal"
    out, lines = results_head(args.out, title, meta)
    lines += [
        "",
        "| pipelines x stages | workers | signals/s answered, median [min-max] | service CPU per signal, us | "
        "CPU share of the scheduler's process | one service process at most, signals/s |",
        "|---|---|---|---|---|---|",
    ]
    for D in sizes:
        got = [r for r in rows if r["pipelines"] == D]
        rate = [r["signals_per_s"] for r in got]
        cost = statistics.median(r["cpu_us_per_signal"] for r in got)
        share = statistics.median(r["cpu_share"] for r in got)
        lines.append(
            f"| {D} x {args.stages} | {D * args.stages} | {statistics.median(rate):,.0f} [{min(rate):,.0f}-"
            f"{max(rate):,.0f}] | {cost:.1f} | {share:.2f} | {1e6 / cost:,.0f} |"
        )
    out.write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
