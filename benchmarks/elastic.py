"""Random kills with rejoin: a worker process killed at a random moment, its pipeline back once its nanny restarted it.

    python benchmarks/elastic.py [--runs 8] [--epochs 30]

One LocalCluster of 6 single-threaded worker processes on 127.0.0.1 (``allowed-failures`` 0, as the embedded
cluster has).  Alternated, ``--runs`` times each: a 2 x 3 ``sdpipe`` run of the digits MLP with ``rejoin=True``
and nothing killed (the reference), and the same run with a random worker (any pipeline, any stage) killed
(SIGKILL) at a random moment after its first epoch (0.5 s to half the reference's remaining length).
Recorded per killed run: whether it ended with all its pipelines, the seconds from the kill to the restarted
worker being in the cluster, from then to the pipeline's ``joined`` record, and its final held-out accuracy
(the lowest of the pipelines') against the reference run's next to it.  Results:
``benchmarks/results/elastic.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import time
from pathlib import Path

from _common import local_cluster, results_head, run_meta

WORKERS = 6


def final_accuracy(result) -> float:
    last = max(h["epoch"] for h in result.history)
    return min(h["accuracy"] for h in result.history if h["epoch"] == last)


def first_training(run) -> None:
    while not any(e["kind"] == "epoch" for e in list(run.events)) and not run.done():
        time.sleep(0.05)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "elastic.md"))
    args = ap.parse_args(argv)

    import sdpipe
    from sdpipe.data import digits, digits_mlp
    from sdpipe.driver.cluster import workers_now

    train_data, eval_data = digits()
    client, cluster = local_cluster(WORKERS, allowed_failures=0)
    rng = random.Random(args.seed)
    common = dict(
        stages=2,
        pipelines=3,
        policy="sdpipe",
        epochs=args.epochs,
        batch_size=32,
        lr=0.01,
        eval_data=eval_data,
        cluster=client,
        rejoin=True,
        timeout=60,
    )
    rows = []
    try:
        for k in range(args.runs):
            client.wait_for_workers(WORKERS, timeout=180)
            time.sleep(2.0)  # a restarted worker settles
            reference = sdpipe.train(digits_mlp(), train_data, **common).result(timeout=900)
            first = min(e["end"] for e in reference.events if e["kind"] == "epoch")
            length = reference.wall_time - first  # from the first epoch's end to the last (run clock)
            client.wait_for_workers(WORKERS, timeout=180)
            time.sleep(2.0)
            rank = rng.randrange(WORKERS)
            run = sdpipe.train(digits_mlp(), train_data, **common)
            first_training(run)
            delay = rng.uniform(0.5, max(1.0, length / 2))
            time.sleep(delay)
            before = set(workers_now(client))
            if run.done():  # the kill would come after the run: not a kill mid-run, said in the results
                rows.append({"run": k, "pipeline": rank // 2, "stage": rank % 2, "delay": round(delay, 2)})
                rows[-1].update(outcome="error", error="the run ended before the kill")
                continue
            addr = run.workers[rank]
            os.kill(client.run(os.getpid, workers=[addr])[addr], signal.SIGKILL)
            killed = time.monotonic()
            available = joined_at = None
            while not run.done():
                if available is None and set(workers_now(client)) - before:
                    available = time.monotonic()
                if joined_at is None and any(e.get("what") == "joined" for e in list(run.events)):
                    joined_at = time.monotonic()
                time.sleep(0.05)
            row = {"run": k, "pipeline": rank // 2, "stage": rank % 2, "delay": round(delay, 2)}
            try:
                result = run.result(timeout=10)
            except sdpipe.RunError as e:
                row.update(outcome="error", error=str(e)[:600])
                rows.append(row)
                print(json.dumps(row), file=sys.stderr)
                continue
            joined = [e for e in result.events if e["kind"] == "control" and e.get("what") == "joined"]
            lost = [e for e in result.events if e["kind"] == "worker-lost"]
            row.update(
                outcome="completed",
                all_pipelines=result.finished_pipelines == [0, 1, 2],
                finished=result.finished_pipelines,
                rejoined=len(joined),
                lost_records=len(lost),
                available_after_kill=None if available is None else round(available - killed, 2),
                accuracy=final_accuracy(result),
                reference_accuracy=final_accuracy(reference),
                identical=result.max_param_diff() == 0.0,
            )
            if joined_at is not None and available is not None:  # both seen by this script's polling
                row["joined_after_available"] = round(joined_at - available, 2)
                row["join_seconds"] = joined[0]["seconds"]
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    finally:
        client.close()
        cluster.close()

    meta = run_meta(
        "elastic.py",
        argv,
        f"digits MLP, 3 pipelines x 2 stages, sdpipe, rejoin=True, batch 32, {args.epochs} epochs, timeout 60 s; "
        f"{WORKERS} worker processes; a random worker killed with SIGKILL at a random moment",
    )
    out, lines = results_head(args.out, "Random kills with rejoin", meta)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    done = [r for r in rows if r["outcome"] == "completed"]
    lines += [
        "",
        "| run | killed | after (s) | ended with all pipelines | worker back after kill (s) | joined after "
        "worker back (s) | accuracy | reference | replicas identical |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["outcome"] != "completed":
            lines.append(f"| {r['run']} | p{r['pipeline']} s{r['stage']} | {r['delay']} | error: {r['error']} |||||")
            continue
        lines.append(
            f"| {r['run']} | p{r['pipeline']} s{r['stage']} | {r['delay']} | {r['all_pipelines']} | "
            f"{r['available_after_kill']} | {r.get('joined_after_available')} | {r['accuracy']:.4f} | "
            f"{r['reference_accuracy']:.4f} | {r['identical']} |"
        )
    if done:
        diffs = [r["accuracy"] - r["reference_accuracy"] for r in done]
        back = [r["joined_after_available"] for r in done if r.get("joined_after_available") is not None]
        lines += [
            "",
            f"- {sum(r['all_pipelines'] for r in done)} of {len(rows)} runs ended with all 3 pipelines",
            f"- accuracy minus the reference run's: median {statistics.median(diffs):+.4f}, "
            f"range {min(diffs):+.4f} to {max(diffs):+.4f}",
        ]
        if back:
            lines.append(
                f"- seconds from the restarted worker being in the cluster to the pipeline's joined record: "
                f"median {statistics.median(back):.1f}, range {min(back):.1f} to {max(back):.1f}"
            )
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
