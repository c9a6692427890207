"""Clean shutdown on an embedded cluster: stop, a worker exception, an interrupt, a closed client.

After each, nothing is left: no child process (``no_leaks``), no listening
rendezvous store, no process group or policy server thread on the workers;
and the next run in the same interpreter works.
"""

import os
import signal
import threading
import time
import warnings

import pytest
import torch

import sdpipe
from sdpipe.data import digits, digits_mlp

from helpers import live_process_groups, port_closed, server_threads

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def data():
    return digits()


def wait_for_training(run, timeout=120):
    deadline = time.monotonic() + timeout
    while not any(e["kind"] == "optimizer" for e in run.events):
        assert time.monotonic() < deadline and not run.done(), "training did not start"
        time.sleep(0.05)


def second_run_works(train_data):
    result = sdpipe.train(digits_mlp(), train_data, stages=2, pipelines=2, epochs=1).result(timeout=300)
    assert sorted(h["pipeline"] for h in result.history) == [0, 1]


@pytest.mark.parametrize("policy", ["sdpipe", "ps"])
def test_stop_closes_the_embedded_cluster(data, no_leaks, policy):
    train_data, _ = data
    run = sdpipe.train(digits_mlp(), train_data, stages=2, pipelines=2, policy=policy, epochs=500)
    wait_for_training(run)
    t = time.monotonic()
    run.stop()
    result = run.result(timeout=120)
    assert result.stopped and time.monotonic() - t < 60
    assert port_closed(run.store_port)
    second_run_works(train_data)


def test_worker_exception_closes_everything(data, no_leaks):
    (X, Y), _ = data

    class Boom(torch.nn.Module):
        calls = 0

        def forward(self, x):
            if self.training and torch.is_grad_enabled():
                Boom.calls += 1
                if Boom.calls > 30 and getattr(self, "armed", False):
                    raise RuntimeError("boom after some steps")
            return x

    boom = Boom()
    model = [
        torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU()),
        torch.nn.Sequential(boom, torch.nn.Linear(32, 10)),
    ]
    boom.armed = True
    run = sdpipe.train(model, (X, Y), stages=2, pipelines=2, policy="sdpipe", epochs=50)
    t = time.monotonic()
    with pytest.raises(sdpipe.RunError, match="boom after some steps"):
        run.result(timeout=300)
    assert time.monotonic() - t < 120 and run.status == "error"
    assert port_closed(run.store_port)
    second_run_works((X, Y))


def test_keyboard_interrupt_while_waiting_stops_the_run(data, no_leaks):
    train_data, _ = data
    # Python's own Ctrl-C handling (a KeyboardInterrupt in the main thread), whatever this process started with: a
    # pytest started in the background of a non-interactive shell (`cmd &`) inherits SIGINT ignored, and Python
    # then keeps it ignored (the signal went unanswered once and the run trained all its epochs)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        run = sdpipe.train(digits_mlp(), train_data, stages=2, pipelines=2, policy="allreduce", epochs=500)
        wait_for_training(run)
        # SIGINT is what Ctrl-C and the notebook's interrupt button deliver
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
        t = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            run.result(timeout=300)
    finally:
        signal.signal(signal.SIGINT, previous)
    if previous is not signal.default_int_handler:  # said in the summary
        warnings.warn(f"SIGINT was handled by {previous!r} in this process before the test", stacklevel=1)
    assert run.done() and time.monotonic() - t < 60
    assert run.status in ("stopped", "finished")
    assert port_closed(run.store_port)
    second_run_works(train_data)


def test_closing_the_client_ends_the_run(data, no_leaks):
    from distributed import Client, LocalCluster

    train_data, _ = data
    cluster = LocalCluster(n_workers=4, threads_per_worker=1, host="127.0.0.1", dashboard_address=None)
    try:
        client = Client(cluster, set_as_default=False)
        run = sdpipe.train(digits_mlp(), train_data, stages=2, pipelines=2, policy="adpsgd", epochs=500, cluster=client)
        wait_for_training(run)
        t = time.monotonic()
        client.close()
        with pytest.raises(sdpipe.RunError):
            run.result(timeout=120)
        assert time.monotonic() - t < 60
        assert port_closed(run.store_port)
        # the workers let go of the run: no process group, no server thread, and the cluster takes the next run
        with Client(cluster, set_as_default=False) as again:
            deadline = time.monotonic() + 60
            while live_process_groups(again) or server_threads(again):
                assert time.monotonic() < deadline, "the workers still hold the closed run's groups"
                time.sleep(0.5)
            result = sdpipe.train(digits_mlp(), train_data, stages=2, pipelines=2, epochs=1, cluster=again).result(
                timeout=300
            )
            assert len(result.history) == 2
    finally:
        cluster.close()
