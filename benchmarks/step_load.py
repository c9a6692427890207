"""Who runs, and who waits for a core, while each pipeline steps: the kernel's own per-thread counters.

    python benchmarks/step_load.py [--policy allreduce] [--slowdown 4] [--seconds 8]

One run of the digits CNN (4 x 2, 1F1B, 4 micro-batches, batch 64) on an embedded LocalCluster of 8
single-threaded workers on 127.0.0.1, pipeline 1 slept ``--slowdown`` x (``Heterogeneity(slowdown=...)``).  After
its first epoch and 5 s more, a separate sampler process reads every thread's ``/proc/<pid>/task/<tid>/schedstat``
(nanoseconds run on a core, nanoseconds waited in the run queue for one) of the workers' processes and the
driver's (which hosts the Dask scheduler and the group service) every 5 ms for ``--seconds``.  Then, over each
pipeline's own steps (stage 0's first forward to its optimizer's end, on the run's records), and over the whole
sampled time: the cores' worth each process ran and waited for a core, the machine's busy share.

What it is for: the simulator's shared-cores model (``simulate(cores=...)``) places the load of a worker's
threads beside its compute in time; this measures where that load really falls.  Results:
``benchmarks/results/step_load.md`` and ``.json``.  Needs Linux's schedstat (``/proc/<pid>/schedstat``).
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import local_cluster, results_head, run_meta


def sample(pids: list, seconds: float, every: float, out: str) -> None:
    """The sampler's process: (time, {(pid, tid): (run ns, wait ns)}) every ``every`` s for ``seconds``."""
    rows = []
    end = time.time() + seconds
    while time.time() < end:
        t, row = time.time(), {}
        for pid in pids:
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except FileNotFoundError:
                continue
            for tid in tids:
                try:
                    with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                        run, wait, _ = f.read().split()
                except (FileNotFoundError, ProcessLookupError, ValueError):
                    continue
                row[(pid, int(tid))] = (int(run), int(wait))
        rows.append((t, row))
        time.sleep(every)
    with open(out, "wb") as f:
        pickle.dump(rows, f)


def step_windows(events: list, t0: float, pipeline: int, lo: float, hi: float) -> list:
    """(start, end) in time.time() of ``pipeline``'s own steps within [lo, hi]: stage 0's first forward to its
    optimizer's end."""
    by = collections.defaultdict(list)
    for e in events:
        if e.get("pipeline") == pipeline and e.get("stage") == 0 and e.get("step") is not None:
            by[e["step"]].append(e)
    out = []
    for es in by.values():
        starts = [e["start"] for e in es if e["kind"] == "forward"]
        ends = [e["end"] for e in es if e["kind"] == "optimizer"]
        if starts and ends and lo < t0 + min(starts) and t0 + max(ends) < hi:
            out.append((t0 + min(starts), t0 + max(ends)))
    return sorted(out)


def load(samples: list, windows: list, role) -> tuple:
    """(cores' worth run per role, cores' worth waited per role, seconds covered) over ``windows``."""
    ts = [t for t, _ in samples]
    ran, waited, covered = collections.Counter(), collections.Counter(), 0.0
    for a, b in windows:
        i, j = bisect.bisect_left(ts, a), bisect.bisect_right(ts, b) - 1
        if j <= i:
            continue
        covered += ts[j] - ts[i]
        for key, (r, w) in samples[j][1].items():
            before = samples[i][1].get(key)
            if before is not None:
                ran[role(key)] += (r - before[0]) / 1e9
                waited[role(key)] += (w - before[1]) / 1e9
    if covered <= 0:
        return {}, {}, 0.0
    return {k: v / covered for k, v in ran.items()}, {k: v / covered for k, v in waited.items()}, covered


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="allreduce")
    ap.add_argument("--slowdown", type=float, default=4.0)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--sample", nargs="+", help=argparse.SUPPRESS)  # the sampler's process: seconds every out pids
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "step_load.md"))
    args = ap.parse_args(argv)
    if args.sample:
        seconds, every, out, *pids = args.sample
        sample([int(p) for p in pids], float(seconds), float(every), out)
        return 0
    if not os.path.exists(f"/proc/{os.getpid()}/schedstat"):
        print("step_load: this kernel has no /proc/<pid>/schedstat", file=sys.stderr)
        return 1

    import sdpipe
    from sdpipe.data import digits, digits_cnn

    S, D = 4, 2
    train_data, eval_data = digits()
    client, cluster = local_cluster(S * D)
    try:
        run = sdpipe.train(
            digits_cnn(32),
            train_data,
            stages=S,
            pipelines=D,
            policy=args.policy,
            epochs=10_000,
            batch_size=64,
            microbatches=4,
            cuts=(3, 5, 8),
            eval_data=eval_data,
            heterogeneity=sdpipe.Heterogeneity(slowdown={D - 1: args.slowdown}),
            cluster=client,
        )
        try:
            deadline = time.monotonic() + 300
            while not any(e.get("kind") == "epoch" for e in run.events):
                if time.monotonic() > deadline or run.done():
                    raise RuntimeError(f"the run trained no epoch in 300 s: {run.status}")
                time.sleep(0.5)
            time.sleep(5)
            pids = client.run(os.getpid)  # Dask address -> pid
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "samples.pkl")
                cmd = [sys.executable, __file__, "--sample", str(args.seconds), "0.005", out, str(os.getpid())]
                subprocess.run(cmd + [str(p) for p in pids.values()], check=True, timeout=args.seconds + 60)
                with open(out, "rb") as f:
                    samples = pickle.load(f)
            events, t0, placed = list(run.events), run.t0, list(run._workers)
        finally:
            run.stop()
            run.result(timeout=300)
    finally:
        client.close()
        cluster.close()

    worker = {pids[address]: divmod(rank, S) for rank, address in enumerate(placed)}

    def role(key):
        pid, _ = key
        if pid in worker:
            return f"pipeline {worker[pid][0]} stage {worker[pid][1]}"
        return "driver (Dask scheduler, group service, records)"

    lo, hi = samples[0][0], samples[-1][0]
    parts = []
    for p in range(D):
        windows = step_windows(events, t0, p, lo, hi)
        ran, waited, covered = load(samples, windows, role)
        step = statistics.median(b - a for a, b in windows) if windows else None
        parts.append((f"pipeline {p}'s own steps", len(windows), step, ran, waited, covered))
    ran, waited, covered = load(samples, [(lo, hi)], role)
    parts.append(("the whole sampled time", 1, None, ran, waited, covered))

    meta = run_meta(
        "step_load.py",
        argv,
        f"digits CNN (32 channels), {S} x {D}, batch 64, 4 micro-batches, 1F1B, policy {args.policy}, pipeline 1 "
        f"slept {args.slowdown:g}x; schedstat sampled every 5 ms for {args.seconds:g} s",
    )
    out, lines = results_head(args.out, "Who runs, and who waits for a core, while each pipeline steps", meta)
    keys = ("when", "steps", "median_step", "ran", "waited", "covered")
    parts_json = [dict(zip(keys, x, strict=True)) for x in parts]
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "parts": parts_json}, indent=1))
    roles = sorted({r for part in parts for r in part[3]})
    lines += [
        "",
        "The kernel's per-thread counters (`/proc/<pid>/task/<tid>/schedstat`), summed per process: *ran* the cores' "
        "worth it ran on, *waited* the cores' worth of its threads waiting in the run queue for a core (2 cores: "
        "2.0 is the machine full). A pipeline's own step: its stage 0's first forward to its optimizer's end (a "
        "slept pipeline's sleep and the waits for the other pipeline's steps are outside it). The sampler runs in a "
        "process of its own, not counted.",
        "",
    ]
    for when, n, step, ran_, waited_, covered_ in parts:
        head = f"## {when}: {n} steps, median {1000 * step:.1f} ms" if step is not None else f"## {when}"
        lines += [
            f"{head} ({covered_:.2f} s sampled)",
            "",
            f"Machine busy: {sum(ran_.values()):.2f} of 2 cores; threads waiting for a core: "
            f"{sum(waited_.values()):.2f} cores' worth.",
            "",
            "| process | ran (cores) | waited for a core (cores) |",
            "|---|---|---|",
        ]
        lines += [f"| {r} | {ran_.get(r, 0.0):.2f} | {waited_.get(r, 0.0):.2f} |" for r in roles]
        lines.append("")
    out.write_text("\n".join(lines))
    print(out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
