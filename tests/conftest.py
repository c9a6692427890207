import os
import time

import psutil
import pytest


def _children():
    try:
        return {p.pid for p in psutil.Process().children(recursive=True)}
    except psutil.Error:
        return set()


@pytest.fixture
def no_leaks():
    """Fails the test if it leaves a child process or a listening rendezvous store behind."""
    before = _children()
    yield
    deadline = time.monotonic() + 20
    while True:
        extra = _children() - before
        if not extra or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not extra, f"processes left running: {sorted(extra)}"


def port_closed(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.fixture(scope="session")
def shared_cluster():
    """One LocalCluster (4 single-threaded worker processes) for tests that pass cluster=..."""
    from distributed import Client, LocalCluster

    cluster = LocalCluster(
        n_workers=4, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=None,
        env={"OMP_NUM_THREADS": "1"},
    )
    client = Client(cluster, set_as_default=False)
    yield client
    client.close()
    cluster.close()


def live_process_groups(client) -> int:
    """How many torch process groups are alive in the cluster's worker processes."""

    def count():
        import gc

        import torch.distributed as dist

        gc.collect()
        kinds = (dist.ProcessGroupGloo,)
        return sum(1 for o in gc.get_objects() if isinstance(o, kinds))

    return sum(client.run(count).values())
