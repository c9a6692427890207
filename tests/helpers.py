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
