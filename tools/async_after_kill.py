"""Repeat two fault runs back to back on one nannied 8-worker LocalCluster: a 4 x 2 sdpipe run whose rank 5 is
SIGKILLed after its first epoch, then (the cluster back to 8) an async-2bw run that must reach its first epoch
within 120 s, whose rank 5 is killed too. A run that reaches no first epoch in time gets every worker process
dumped with py-spy (to /tmp/hang_dump.txt) and the loop stops.

    python tools/async_after_kill.py 60      # 60 pairs; one line per pair
"""

import os
import signal
import subprocess
import sys
import time

import dask
from distributed import Client, LocalCluster

import sdpipe
from sdpipe.data import digits, digits_mlp
from sdpipe.driver.cluster import workers_now


def epoch_done(run, epoch):
    return any(e["kind"] == "epoch" and e["metrics"]["epoch"] >= epoch for e in list(run.events))


def wait_epoch(run, epoch, timeout):
    deadline = time.monotonic() + timeout
    while not epoch_done(run, epoch):
        if run.done():
            return "ended"
        if time.monotonic() > deadline:
            return "timeout"
        time.sleep(0.05)
    return "ok"


def ready(client):
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            client.wait_for_workers(8, timeout=60)
            answered = client.run(lambda: __import__("sdpipe.worker.loop") and os.getpid())
            time.sleep(1.0)
            if len(answered) >= 8 and set(workers_now(client)) == set(answered):
                return
        except Exception:
            pass
    raise SystemExit("cluster did not get back to 8 workers")


def dump(client, why):
    pids = client.run(os.getpid)
    with open("/tmp/hang_dump.txt", "w") as f:
        f.write(why + "\n")
        for addr, pid in pids.items():
            out = subprocess.run(["py-spy", "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60)
            f.write(f"==== {addr} pid {pid}\n{out.stdout}\n{out.stderr}\n")
    print("dumped to /tmp/hang_dump.txt", flush=True)


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    (X, Y), (EX, EY) = digits()
    with dask.config.set({"distributed.scheduler.allowed-failures": 0}):
        lc = LocalCluster(
            n_workers=8, threads_per_worker=1, host="127.0.0.1", dashboard_address=None, env={"OMP_NUM_THREADS": "1"}
        )
    client = Client(lc, set_as_default=False)
    try:
        for i in range(n):
            ready(client)
            run = sdpipe.train(
                digits_mlp(), (X, Y), stages=2, pipelines=4, policy="sdpipe", epochs=4, batch_size=32, cluster=client
            )
            w = wait_epoch(run, 1, 120)
            if w == "timeout":
                dump(client, f"iteration {i}: 1f1b run reached no epoch 1")
                break
            addr = run.workers[5]
            os.kill(client.run(os.getpid, workers=[addr])[addr], signal.SIGKILL)
            r = run.result(timeout=600)
            ready(client)
            t = time.monotonic()
            run = sdpipe.train(
                digits_mlp(),
                (X, Y),
                eval_data=(EX, EY),
                stages=2,
                pipelines=4,
                policy="sdpipe",
                schedule="async-2bw",
                epochs=5,
                batch_size=32,
                cluster=client,
            )
            w = wait_epoch(run, 1, 120)
            print(
                f"iteration {i}: first run lost {sorted(r.lost)}; async run epoch 1: {w} after "
                f"{time.monotonic() - t:.1f} s, status {run.status}",
                flush=True,
            )
            if w == "timeout":
                dump(client, f"iteration {i}: async-2bw run reached no epoch 1 ({run.status}, {run.startup})")
                break
            addr = run.workers[5]
            os.kill(client.run(os.getpid, workers=[addr])[addr], signal.SIGKILL)
            run.result(timeout=600)
    finally:
        client.close()
        lc.close()
