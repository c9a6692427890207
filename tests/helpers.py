"""Helpers shared by the cluster tests."""


def port_closed(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) != 0


def live_process_groups(client) -> int:
    """How many torch process groups are alive in the cluster's worker processes."""

    def count():
        import gc

        import torch.distributed as dist

        gc.collect()
        kinds = (dist.ProcessGroupGloo,)
        return sum(1 for o in gc.get_objects() if isinstance(o, kinds))

    return sum(client.run(count).values())


def server_threads(client) -> list:
    """Names of policy server threads (ps, adpsgd) still running in the cluster's worker processes."""

    def names():
        import threading

        return [t.name for t in threading.enumerate() if t.name.startswith(("ps-server", "adpsgd-server"))]

    return [n for ns in client.run(names).values() for n in ns]


def wait_for_epoch(run, epoch: int, timeout: float = 120) -> None:
    """Return once some pipeline of ``run`` finished ``epoch``; fail if the run ends first or ``timeout`` passes."""
    import time

    deadline = time.monotonic() + timeout
    while not any(e["kind"] == "epoch" and e["metrics"]["epoch"] >= epoch for e in list(run.events)):
        assert not run.done(), f"the run ended before epoch {epoch}: {run.status}"
        assert time.monotonic() < deadline, f"no epoch {epoch} within {timeout}s"
        time.sleep(0.05)


def assert_records_valid(events: list) -> None:
    """Every record fits ``sdpipe.wire.events.SCHEMA`` (whoever produced it: worker, service, driver, simulator)."""
    from sdpipe.wire.events import problems

    bad = [(e, problems(e)) for e in events if problems(e)]
    assert not bad, f"{len(bad)} of {len(events)} records do not fit the schema; first: {bad[0]}"


def train_on(cluster, *args, timeout: float = 300, **options):
    """``sdpipe.train(*args, cluster=cluster, **options)`` to its end: its records fit the schema, and it left
    no process group and no policy server thread in the cluster's workers; returns its result."""
    import sdpipe

    result = sdpipe.train(*args, cluster=cluster, **options).result(timeout=timeout)
    assert_records_valid(result.events)
    assert live_process_groups(cluster) == 0
    assert server_threads(cluster) == []
    return result
