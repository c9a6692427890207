"""A user's script for tests/test_faults.py: their own LocalCluster with Dask's default logging (nannies, a killed
worker restarted), a 4 x 2 run; pipeline 1 stage 1's worker is SIGKILLed once an epoch ended (``kill``), or as soon
as the ranks are placed, while they start and connect (``start``); ``none`` kills nothing.
Prints ``RESULT ...`` when the run's result is in (the lines after it are the cluster's own closing)."""

import os
import signal
import sys
import time

from distributed import Client, LocalCluster

import sdpipe
from sdpipe.data import digits, digits_mlp

if __name__ == "__main__":
    policy, kill = sys.argv[1], sys.argv[2]
    train_data, _ = digits()
    cluster = LocalCluster(n_workers=8, threads_per_worker=1, host="127.0.0.1", dashboard_address=None)
    client = Client(cluster)
    run = sdpipe.train(
        digits_mlp(), train_data, stages=2, pipelines=4, policy=policy, epochs=4, batch_size=32, cluster=client
    )
    if kill != "none":
        deadline = time.monotonic() + 300
        while kill == "kill" and not any(e["kind"] == "epoch" for e in run.events_since(0)[0]):
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        addr = run.workers[3]
        os.kill(client.run(os.getpid, workers=[addr])[addr], signal.SIGKILL)
    result = run.result(timeout=600)
    print("RESULT", sorted(result.lost), result.finished_pipelines, flush=True)
    for p, why in sorted(result.lost.items()):  # (after the result's line: for a failing test's message)
        print(f"LOST {p}: {why}", flush=True)
    client.close()
    cluster.close()
