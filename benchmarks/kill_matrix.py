"""A worker killed at every moment of a run, under every loss-tolerant policy, on a user's own cluster.

    python benchmarks/kill_matrix.py [--kills 5] [--policies sdpipe,adpsgd,none,allreduce] [--moments ...]

For each policy, one child process plays the user: its own ``LocalCluster`` of 10 nannied single-threaded
workers with Dask's default logging (a killed worker is restarted by its nanny; failed tasks are allowed to be
retried, as Dask's default), a 4 x 2 run of the digits MLP (3 epochs; 10 for mid-epoch, checkpoint and switch,
30 for join, 100 for those under ``none``, whose epochs take a fraction of a second; batch 32,
``checkpoint_every=1``), first once without a kill (the terminal's reference), then
``--kills`` runs per moment, each killing a random rank (any pipeline, any stage) with SIGKILL at a random
offset inside the moment:

* ``starting``: 0-0.2 s after the ranks were placed (``run.workers``), while the run is ``starting``;
* ``first-step``: 0-50 ms after the first forward span arrived;
* ``mid-epoch``: 0-1 s after the first epoch record arrived;
* ``global-sync``: the moment the group service holds the chosen worker waiting for its stage's global group
  (an epoch's end; polled every 5 ms; ``sdpipe``, ``adpsgd``);
* ``switch``: 0-0.3 s after ``run.set_policy`` to the other live policy (``sdpipe``, ``none``);
* ``join``: 0-1 s after ``run.add_pipelines(1)``, which joins on the two free workers (``sdpipe``, ``none``);
* ``checkpoint``: 0-0.2 s after the first epoch record (the workers write epoch 1's checkpoint then).

``allreduce`` (not loss-tolerant) is tried at ``starting`` alone: a worker lost before the stages' first groups
formed is replaced (a new pipeline under the same id joins once the killed worker's nanny restarted it), so its
runs train 30 epochs and ``ok`` means every pipeline finished, the replacement included.

Recorded per run: whether the kill landed in its moment (the run's status or the service's state at the kill),
how the run ended (``ok``: it finished with the killed pipeline lost and every other one finished; anything
else is a miss), the seconds from the kill to the end, and the terminal lines the run printed (the child's
stdout and stderr as one terminal shows them, between markers) against the reference run's.  Results:
``benchmarks/results/kill_matrix.md``, ``.json``, ``.jsonl`` (the rows as they came) and ``.terminal.txt`` (what
each run printed).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MOMENTS = ("starting", "first-step", "mid-epoch", "global-sync", "switch", "join", "checkpoint")
APPLIES = {
    "global-sync": ("sdpipe", "adpsgd"),  # under none there is no global sync
    "switch": ("sdpipe", "none"),  # adpsgd keeps its servers for the whole run
    "join": ("sdpipe", "none"),  # adpsgd's pairs are fixed at the start
    "first-step": ("sdpipe", "adpsgd", "none"),
    "mid-epoch": ("sdpipe", "adpsgd", "none"),
    "checkpoint": ("sdpipe", "adpsgd", "none"),
}
#: allreduce is not loss-tolerant: only its start-up kill (a replacement joins) is tried
BEGIN, END = "=== kill-matrix begin", "=== kill-matrix end"


# ------------------------------------------------------------------ the child: a user's script
def _events(run, kind):
    return [e for e in run.events_since(0)[0] if e["kind"] == kind]


def _wait(predicate, timeout=120.0, poll=0.005):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    return None


def _kill(client, run, rank):
    addr = run.workers[rank]
    pid = client.run(os.getpid, workers=[addr])[addr]
    os.kill(pid, signal.SIGKILL)
    return time.monotonic()


def _epochs(policy: str, moment: str) -> int:
    """Long enough for the kill to come while the run still trains: the later moments need more epochs, and
    under ``none`` (no averaging, a quarter of an epoch per pipeline) an epoch takes a fraction of a second."""
    if policy == "allreduce":
        return 30  # the replacement joins once the killed worker's nanny restarted it
    if moment in ("starting", "first-step", "global-sync"):
        return 3
    if policy == "none":
        return 100
    return {"join": 30}.get(moment, 10)


def _one(client, policy, moment, rng, data, folder):
    import sdpipe
    from sdpipe.data import digits_mlp

    # global-sync: pipeline 3 is 4x slow, so the global syncs of every epoch's end last long enough to be caught
    # (its workers, which take fewer batches, wait there longest).  Longer runs where the kill comes after the
    # first epoch (a kill after the run's end is not made), the longest for a joiner to join.
    rank = rng.randrange(8)
    other = {"sdpipe": "none", "none": "sdpipe"}.get(policy)
    run = sdpipe.train(
        digits_mlp(),
        data,
        stages=2,
        pipelines=4,
        policy=policy,
        epochs=_epochs(policy, moment),
        batch_size=32,
        cluster=client,
        timeout=60,
        checkpoint_every=1,
        checkpoint_dir=folder,
        heterogeneity=sdpipe.Heterogeneity(slowdown={3: 4.0}) if moment == "global-sync" else None,
    )
    landed, killed_at = None, None
    if moment == "none":
        pass
    elif moment == "starting":
        _ = run.workers  # placed: the ranks start and connect now
        time.sleep(rng.uniform(0, 0.2))
        landed = run.status == "starting"
        killed_at = _kill(client, run, rank)
    elif moment == "first-step":
        _wait(lambda: _events(run, "forward"))
        time.sleep(rng.uniform(0, 0.05))
        landed = not _events(run, "epoch")
        killed_at = _kill(client, run, rank)
    elif moment in ("mid-epoch", "checkpoint"):
        _wait(lambda: _events(run, "epoch"))
        time.sleep(rng.uniform(0, 1.0 if moment == "mid-epoch" else 0.2))
        landed = run.status == "running"
        killed_at = _kill(client, run, rank) if landed else None
    elif moment == "global-sync":
        p, s = divmod(rank, 2)

        def held():
            try:
                return (s, p) in {tuple(w) for w in run.scheduler_state().get("global", ())}
            except Exception:  # the run ended (the service no longer has it)
                return None

        landed = bool(_wait(held, timeout=60, poll=0.005))
        killed_at = _kill(client, run, rank) if landed else None
    elif moment == "switch":
        _wait(lambda: _events(run, "epoch"))
        run.set_policy(other)
        time.sleep(rng.uniform(0, 0.3))
        landed = run.status == "running"
        killed_at = _kill(client, run, rank) if landed else None
    elif moment == "join":
        _wait(lambda: _events(run, "epoch"))
        run.add_pipelines(1)
        time.sleep(rng.uniform(0, 1.0))
        landed = run.status == "running" and 4 not in run.pipelines
        killed_at = _kill(client, run, rank) if run.status == "running" else None
    try:
        result = run.result(timeout=600)
        end = time.monotonic()
        lost, finished = sorted(result.lost), result.finished_pipelines
        want = [q for q in range(4) if q != rank // 2]
        if killed_at is None or policy == "allreduce":  # allreduce: the killed pipeline's replacement finished
            ok = not lost and finished == [0, 1, 2, 3]
        else:  # a joiner (pipeline 4) may also have joined and finished, or have been left out: said apart
            ok = lost == [rank // 2] and [q for q in finished if q < 4] == want
        outcome = "ok" if ok else f"lost {lost}, finished {finished}"
        joiner = None
        if moment == "join":
            joiner = "finished" if 4 in finished else result.left.get(4) or result.lost.get(4) or "?"
    except Exception as e:
        end, joiner = time.monotonic(), None
        outcome = f"{type(e).__name__}: {str(e)[:300]}"
    return {
        "policy": policy,
        "moment": moment,
        "rank": rank,
        "landed": landed,
        "outcome": outcome,
        "after_kill_s": None if killed_at is None else round(end - killed_at, 1),
        "killed": killed_at is not None,
        "joiner": joiner,
    }


def _workers_back(client, n, cluster=None):
    """The cluster back at ``n`` running workers with torch imported (a killed one's nanny restarts it; now and
    then a nanny's restart never completes, and the cluster is topped up with a new worker after 30 s)."""
    deadline, topped = time.monotonic() + 180, False
    while time.monotonic() < deadline:
        try:
            client.wait_for_workers(n, timeout=30)
            answered = client.run(lambda: __import__("sdpipe.worker.loop") and None)
            if len(answered) >= n:
                return
        except TimeoutError:
            if cluster is not None and not topped:
                cluster.scale(len(cluster.worker_spec) + 1)
                topped = True
        except Exception:
            pass
        time.sleep(1.0)


def child(policy: str, moments: list, kills: int, seed: int) -> None:
    from distributed import Client, LocalCluster

    from sdpipe.data import digits

    data, _ = digits()
    rng = random.Random(seed)
    cluster = LocalCluster(n_workers=10, threads_per_worker=1, host="127.0.0.1", dashboard_address=None)
    client = Client(cluster)
    plan = ["none"] + [m for _ in range(kills) for m in moments]
    for i, moment in enumerate(plan):
        _workers_back(client, 10, cluster)
        with tempfile.TemporaryDirectory() as folder:
            print(f"{BEGIN} {i}", flush=True)
            row = _one(client, policy, moment, rng, data, folder)
            time.sleep(2.0)  # what the run's end prints comes before the marker
            print(f"{END} {i} {json.dumps(row)}", flush=True)
    client.close()
    cluster.close()


# ------------------------------------------------------------------ the parent
def parse(output: str) -> list:
    rows, lines = [], None
    for line in output.splitlines():
        if line.startswith(BEGIN):
            lines = 0
        elif line.startswith(END):
            row = json.loads(line.split(" ", 4)[4])
            row["lines"] = lines
            rows.append(row)
            lines = None
        elif lines is not None:
            lines += 1
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=5, help="kills per policy and moment")
    ap.add_argument("--policies", default="sdpipe,adpsgd,none,allreduce")
    ap.add_argument("--moments", default=",".join(MOMENTS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "kill_matrix.md"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    moments = [m for m in args.moments.split(",") if m]
    bad = [m for m in moments if m not in MOMENTS]
    if bad:
        ap.error(f"--moments: {', '.join(bad)} not one of {', '.join(MOMENTS)}")
    if args.child:
        child(args.child, moments, args.kills, args.seed)
        return 0

    from _common import results_head, run_meta

    meta = run_meta("kill_matrix.py", argv, "4 x 2 digits MLP, 3-30 epochs (see the docstring), batch 32, 10 workers")
    rows: list = []
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).with_suffix(".jsonl").write_text("")
    Path(args.out).with_suffix(".terminal.txt").write_text("")
    for k, policy in enumerate(args.policies.split(",")):
        mine = [m for m in moments if policy in APPLIES.get(m, (policy,))]
        cmd = [sys.executable, __file__, "--child", policy, "--moments", ",".join(mine)]
        cmd += ["--kills", str(args.kills), "--seed", str(args.seed + k)]
        # read as it comes: each run's row is kept (in the .jsonl beside the results) as soon as it ends
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tempfile.gettempdir()
        )
        seen: list = []
        for line in proc.stdout:
            seen.append(line.rstrip("\n"))
            if line.startswith(END):
                block = seen[max(i for i, x in enumerate(seen) if x.startswith(BEGIN)) :]
                (row,) = parse("\n".join(block))
                rows.append(row)
                with Path(args.out).with_suffix(".jsonl").open("a") as f:
                    f.write(json.dumps(row) + "\n")
                with Path(args.out).with_suffix(".terminal.txt").open("a") as f:  # what each run printed
                    f.write(f"### {row['policy']} / {row['moment']} / rank {row['rank']}: {row['lines']} lines\n")
                    f.write("".join(x + "\n" for x in block[1:-1]))
                print(row, flush=True)
        if proc.wait() != 0:
            print("\n".join(seen[-60:]), file=sys.stderr)
    path, head = results_head(args.out, "A worker killed at every moment, on a user's cluster", meta)
    Path(path).with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = [
        *head,
        "",
        "A random rank (any pipeline, any stage) SIGKILLed at a random offset inside each moment (see the",
        "script's docstring). ok: the run finished with the killed pipeline lost and every other one finished.",
        "landed: the kill came while the run was in that moment (as the run's status or the group service",
        "showed it). lines: what the run printed to the terminal, against the same run without a kill.",
        "",
        "| policy | moment | kills | landed | ok | seconds kill->end (median, range) | lines (median, max) "
        "| reference lines |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for policy in args.policies.split(","):
        ref = [r["lines"] for r in rows if r["policy"] == policy and r["moment"] == "none"]
        for moment in moments:
            cell = [r for r in rows if r["policy"] == policy and r["moment"] == moment and r.get("killed", True)]
            if not cell:
                continue
            secs = [r["after_kill_s"] for r in cell if r["after_kill_s"] is not None]
            span = f"{statistics.median(secs):.1f} ({min(secs):.1f}-{max(secs):.1f})" if secs else "-"
            counts = [r["lines"] for r in cell]
            lines.append(
                f"| {policy} | {moment} | {len(cell)} | {sum(bool(r['landed']) for r in cell)} | "
                f"{sum(r['outcome'] == 'ok' for r in cell)} | {span} | "
                f"{statistics.median(counts):.0f}, {max(counts)} | {ref[0] if ref else '-'} |"
            )
    misses = [r for r in rows if r["moment"] != "none" and r["outcome"] != "ok" and r.get("killed", True)]
    uncaught = [r for r in rows if r["moment"] != "none" and not r.get("killed", True)]
    joins = [r["joiner"] for r in rows if r["moment"] == "join" and r.get("killed", True)]
    designed = " (the stages' first groups had formed: the run stops in this one line, as designed)"
    lines += ["", "Runs that did not end ok:", ""] + (
        [
            f"- {r['policy']} / {r['moment']} / rank {r['rank']}: {r['outcome']}"
            + (designed if r["policy"] == "allreduce" and r["outcome"].startswith("LostWorker") else "")
            for r in misses
        ]
        or ["- none"]
    )
    lines += ["", f"Moments not caught (no kill made, the run ended first): {len(uncaught)}."]
    lines += [f"The joiner of the join moment's runs: {', '.join(str(j) for j in joins) or '-'}."]
    Path(path).write_text("\n".join(lines) + "\n")
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
