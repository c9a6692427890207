"""Kill a worker process mid-training under every policy, and record what happened.

    python benchmarks/faults.py [--epochs 8] [--policies sdpipe,adpsgd,none,allreduce,ps] [--random-kills N]

One LocalCluster of 8 single-threaded worker processes on 127.0.0.1
(``allowed-failures`` 0, as the embedded cluster has).  For each policy: a
4 x 2 run of the digits MLP without a fault (the reference), then the same
run with the worker process of pipeline 2, stage 1 killed (SIGKILL) once
epoch 1 is done.  Recorded: how the run ended and how long after the kill,
which pipelines finished, the held-out accuracy against the reference, and
what was left behind on the cluster (process groups, policy server threads,
the rendezvous store's port).  Results: ``benchmarks/results/faults.md``
and ``.json``.

``--random-kills N``: then N more runs of each loss-tolerant policy among
``--policies`` (``sdpipe``, ``adpsgd``, ``none``), alternated, each with a
randomly chosen worker (any pipeline, any stage) killed at a random moment
(after epoch 1 plus 0-2 s), to catch the kill landing inside an exchange, a
group's formation, its collective or a global sync's rendezvous; recorded is
how many completed with the 3 other pipelines and how long each took after
its kill.  ``--fixed-rank`` kills pipeline 2, stage 1 every time instead.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import sys
import time
from pathlib import Path

from _common import local_cluster, meta_lines, run_meta

KILLED_RANK = 5  # pipeline 2, stage 1


def leftovers(client, port: int) -> dict:
    def count():
        import gc
        import threading

        import torch.distributed as dist

        gc.collect()
        return (
            sum(1 for o in gc.get_objects() if isinstance(o, dist.ProcessGroupGloo)),
            sum(1 for t in threading.enumerate() if t.name.startswith(("ps-server", "adpsgd-server"))),
        )

    counts = list(client.run(count).values())
    with socket.socket() as s:
        s.settimeout(1)
        store_open = s.connect_ex(("127.0.0.1", port)) == 0
    return {
        "process_groups": sum(c[0] for c in counts),
        "server_threads": sum(c[1] for c in counts),
        "store_open": store_open,
    }


def kill_after_epoch_1(client, run, delay: float = 0.0, rank: int = KILLED_RANK) -> float:
    """SIGKILL the worker process of ``rank`` ``delay`` seconds after epoch 1 is done.

    Returns the monotonic time of the kill.
    """
    while not any(e["kind"] == "epoch" and e["metrics"]["epoch"] >= 1 for e in run.events) and not run.done():
        time.sleep(0.05)
    time.sleep(delay)
    addr = run.workers[rank]
    pid = client.run(os.getpid, workers=[addr])[addr]
    os.kill(pid, signal.SIGKILL)
    return time.monotonic()


def final_accuracy(result):
    last = max(h["epoch"] for h in result.history)
    return min(h["accuracy"] for h in result.history if h["epoch"] == last)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--policies", default="sdpipe,adpsgd,none,allreduce,ps")
    ap.add_argument(
        "--random-kills",
        type=int,
        default=0,
        help="more runs of each loss-tolerant policy, a random worker killed at a random moment",
    )
    ap.add_argument("--fixed-rank", action="store_true", help="random kills always kill pipeline 2, stage 1")
    ap.add_argument("--timeout", type=float, default=120.0, help="the runs' timeout (seconds)")
    ap.add_argument(
        "--no-reference", action="store_true", help="skip the one-kill runs of every policy (random kills only)"
    )
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "faults.md"))
    args = ap.parse_args(argv)

    import sdpipe
    from sdpipe.data import digits, digits_mlp

    train_data, eval_data = digits()
    client, cluster = local_cluster(8, allowed_failures=0)
    rows, random_rows = [], []
    try:
        for policy in args.policies.split(","):
            common = dict(
                stages=2,
                pipelines=4,
                policy=policy,
                epochs=args.epochs,
                batch_size=32,
                eval_data=eval_data,
                cluster=client,
                timeout=args.timeout,
            )
            if args.no_reference:
                break
            client.wait_for_workers(8, timeout=60)
            reference = sdpipe.train(digits_mlp(), train_data, **common).result(timeout=900)
            client.wait_for_workers(8, timeout=60)
            run = sdpipe.train(digits_mlp(), train_data, **common)
            killed = kill_after_epoch_1(client, run)
            row = {"policy": policy, "reference_accuracy": final_accuracy(reference)}
            try:
                result = run.result(timeout=900)
                row.update(
                    outcome="completed",
                    finished=result.finished_pipelines,
                    lost=result.lost,
                    accuracy=final_accuracy(result),
                    epochs=max(h["epoch"] for h in result.history) + 1,
                )
            except sdpipe.RunError as e:
                row.update(outcome="error", error=str(e))
            row["seconds_after_kill"] = time.monotonic() - killed
            time.sleep(1.0)
            row.update(leftovers(client, run.store_port))
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
        rng = random.Random(0)
        tolerant = [p for p in args.policies.split(",") if p in ("sdpipe", "adpsgd", "none")]
        for k in range(args.random_kills):
            for policy in tolerant:  # alternated, so each policy sees the same machine
                rank = KILLED_RANK if args.fixed_rank else rng.randrange(8)
                delay = rng.uniform(0.0, 2.0)
                client.wait_for_workers(8, timeout=180)
                time.sleep(2.0)  # the restarted worker settles
                run = sdpipe.train(
                    digits_mlp(),
                    train_data,
                    stages=2,
                    pipelines=4,
                    policy=policy,
                    epochs=args.epochs,
                    batch_size=32,
                    eval_data=eval_data,
                    cluster=client,
                    timeout=args.timeout,
                )
                killed = kill_after_epoch_1(client, run, delay=delay, rank=rank)
                pipeline, stage = divmod(rank, 2)
                row = {
                    "policy": policy,
                    "kill": k,
                    "pipeline": pipeline,
                    "stage": stage,
                    "delay": round(delay, 3),
                    "trained_before_kill": sorted({e["pipeline"] for e in list(run.events) if e["kind"] == "epoch"}),
                }
                try:
                    result = run.result(timeout=900)
                    row.update(outcome="completed", finished=result.finished_pipelines, lost=sorted(result.lost))
                except sdpipe.RunError as e:
                    row.update(outcome="error", error=str(e)[:600])
                row["seconds_after_kill"] = time.monotonic() - killed
                random_rows.append(row)
                print(json.dumps(row), file=sys.stderr)
    finally:
        client.close()
        cluster.close()

    killed = "pipeline 2 stage 1" if args.fixed_rank or not random_rows else "a random worker (any pipeline and stage)"
    meta = run_meta(
        "faults.py",
        argv,
        f"digits MLP, 4 pipelines x 2 stages, batch 32, {args.epochs} epochs, "
        f"timeout {args.timeout:.0f} s; worker process of {killed} killed with SIGKILL after epoch 1",
    )
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows, "random_kills": random_rows}, indent=1))
    lines = ["# A worker process killed mid-training", "", *meta_lines(meta), ""]
    if rows:
        lines += [
            "| policy | outcome | ended after the kill | pipelines finished | accuracy (no fault) | left behind |",
            "|---|---|---|---|---|---|",
        ]
    for r in rows:
        if r["outcome"] == "completed":
            outcome = f"completed all {r['epochs']} epochs"
            finished = ", ".join(map(str, r["finished"]))
            acc = f"{r['accuracy']:.3f} ({r['reference_accuracy']:.3f})"
        else:
            outcome = f"RunError: {r['error']}"
            finished, acc = "-", f"- ({r['reference_accuracy']:.3f})"
        left = [f"{r['process_groups']} process groups"] if r["process_groups"] else []
        left += [f"{r['server_threads']} server threads"] if r["server_threads"] else []
        left += ["the store's port"] if r["store_open"] else []
        lines.append(
            f"| `{r['policy']}` | {outcome} | {r['seconds_after_kill']:.1f} s | {finished} | {acc} | "
            f"{', '.join(left) or 'nothing'} |"
        )
    if random_rows:
        what = "pipeline 2 stage 1" if args.fixed_rank else "a random worker"
        lines += [
            "",
            f"Kills at random moments ({what}, after epoch 1 plus 0-2 s, timeout {args.timeout:.0f} s), "
            "the policies alternated:",
            "",
            "| policy | completed with the 3 other pipelines | ended after the kill: median [min-max] |",
            "|---|---|---|",
        ]
        for policy in dict.fromkeys(r["policy"] for r in random_rows):
            mine = [r for r in random_rows if r["policy"] == policy]
            done = [r for r in mine if r["outcome"] == "completed" and len(r["finished"]) == 3]
            secs = sorted(r["seconds_after_kill"] for r in mine)
            lines.append(
                f"| `{policy}` | {len(done)} of {len(mine)} | {secs[len(secs) // 2]:.1f} s "
                f"[{secs[0]:.1f}-{secs[-1]:.1f}] |"
            )
        lines += ["", "Every kill (pipeline, stage, seconds after epoch 1):", ""]
        lines += [
            f"- `{r['policy']}` kill {r['kill']}: pipeline {r['pipeline']} stage {r['stage']} at +{r['delay']:.2f} s: "
            + (
                f"completed with {r['finished']} in {r['seconds_after_kill']:.1f} s"
                if r["outcome"] == "completed"
                else f"**error** after {r['seconds_after_kill']:.1f} s: {r['error']}"
            )
            for r in random_rows
        ]
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
