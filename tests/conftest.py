import time

import psutil
import pytest

# Python's own per-interpreter helpers: started once, they live as long as the interpreter.
_INTERPRETER_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def _children():
    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if not any(h in cmd for h in _INTERPRETER_HELPERS):
            out.add(p.pid)
    return out


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
    assert not extra, f"processes left running: {_describe(extra)}"


def _describe(pids):
    out = []
    for pid in sorted(pids):
        try:
            out.append(f"{pid}: {' '.join(psutil.Process(pid).cmdline())[:200]}")
        except psutil.Error:
            out.append(f"{pid}: (gone)")
    return out


@pytest.fixture(scope="session")
def shared_cluster():
    """One LocalCluster (4 single-threaded worker processes) for tests that pass cluster=..."""
    from distributed import Client, LocalCluster

    cluster = LocalCluster(
        n_workers=4,
        threads_per_worker=1,
        processes=True,
        host="127.0.0.1",
        dashboard_address=None,
        env={"OMP_NUM_THREADS": "1"},
    )
    client = Client(cluster, set_as_default=False)
    yield client
    client.close()
    cluster.close()
