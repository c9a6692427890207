"""How a worker reaches the run: the rendezvous store, its own address, the NCCL interface."""

from __future__ import annotations

import datetime

import torch.distributed as dist

from sdpipe.wire.protocol import WorkerSpec, run_prefix

__all__ = ["STORE_CONNECT_TIMEOUT", "connect_store", "nccl_interface", "own_address"]


#: seconds a worker may take to reach the run's rendezvous store (a live store answers in milliseconds)
STORE_CONNECT_TIMEOUT = 20.0


def connect_store(spec: WorkerSpec, timeout: float):
    """A new connection to the run's store (the driver's ``TCPStore``), under the run's key prefix.

    Connecting is bounded by :data:`STORE_CONNECT_TIMEOUT`, not the run's
    timeout: a store this worker cannot reach is a setting to change, said
    in one line.  Waits on the connection get the run's timeout.
    """
    host, port = spec.store_host, spec.store_port
    connect = min(timeout, STORE_CONNECT_TIMEOUT)
    try:
        base = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=connect))
    except (RuntimeError, OSError) as e:  # torch's DistNetworkError / DistStoreError are RuntimeErrors
        raise ConnectionError(
            f"cannot reach the run's rendezvous store at {host}:{port} from {own_address()} within {connect:.0f}s "
            f"({type(e).__name__}); set host= in sdpipe.train to an address of the driver's machine that every "
            f"worker can reach (and open its port between the machines)"
        ) from None
    base.set_timeout(datetime.timedelta(seconds=timeout))
    return dist.PrefixStore(run_prefix(spec.run_id), base)


def own_address() -> str:
    """The address of this worker's host: the host part of its Dask worker address (its tensors' sockets bind to it)."""
    from urllib.parse import urlparse

    from distributed import get_worker

    try:
        addr = get_worker().address
    except ValueError:  # not inside a Dask worker (a test calling worker code directly)
        return "127.0.0.1"
    host = urlparse(addr).hostname if "://" in addr else None
    return host or "127.0.0.1"


def nccl_interface(address: str):
    """The name of the network interface that holds ``address`` (NCCL's bootstrap binds to it), or None."""
    import ipaddress

    import psutil

    try:
        want = ipaddress.ip_address(address)
    except ValueError:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            try:
                if ipaddress.ip_address(a.address.split("%")[0]) == want:
                    return name
            except ValueError:
                continue
    return None
