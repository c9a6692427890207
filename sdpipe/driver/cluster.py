"""Reaching the Dask cluster and choosing its workers for a run (the driver's side; no training here).

``connect`` starts an embedded ``LocalCluster`` or reaches an existing scheduler, with every failure said
in one line; ``pick_workers`` chooses one free worker per rank; ``route_address`` and ``bound_store`` put
the run's rendezvous store on the address the workers reach.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from typing import Optional

from sdpipe.config import TrainConfig
from sdpipe.hosts import EmulatedHosts

__all__ = [
    "CONNECT_TIMEOUT",
    "bound_store",
    "close",
    "connect",
    "count_workers",
    "free_workers",
    "host_cores",
    "pick_workers",
    "route_address",
]

#: Seconds to reach an existing Dask scheduler before giving up.
CONNECT_TIMEOUT = 10.0


def connect(cluster, config: TrainConfig, security=None):
    """(client, embedded cluster or None, whether we own the client).

    ``security``: a ``distributed.Security`` (TLS certificates) for a scheduler
    address; without it Dask's configuration (``distributed.comm.tls.*``) applies.
    """
    import dask
    from distributed import Client, LocalCluster
    from distributed.security import Security

    secure = {} if security is None else {"security": security}
    if cluster is None:
        host = config.host or "127.0.0.1"
        kwargs = dict(
            n_workers=config.world_size,
            threads_per_worker=1,
            processes=True,
            host=host,
            dashboard_address=None,
            # the scheduler serves its HTTP routes (health, metrics) even without a dashboard, on 8787 unless told:
            # a random port on the cluster's host, so a second cluster on the machine starts without a warning
            scheduler_kwargs={"dashboard_address": f"{host}:0"} if ":" not in host else {},
            silence_logs=logging.ERROR,
            env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
        )
        if config.device == "cuda":
            kwargs["resources"] = {"GPU": 1}
        # A training rank must never be re-run on another worker after its worker died. Dask's statistical
        # profiler (it samples the training thread 100 times a second) is off: measured ~10% of a 2 x 2
        # run's samples/s on two cores (benchmarks/results/engine.md).
        with dask.config.set(
            {"distributed.scheduler.allowed-failures": 0, "distributed.worker.profile.enabled": False}
        ):
            lc = LocalCluster(**kwargs)
        try:
            client = Client(lc, set_as_default=False)
            client.run(quiet_run_failures)
            return client, lc, True
        except BaseException:
            lc.close()
            raise
    if isinstance(cluster, str):
        if cluster.startswith("tls://") and not (security or Security()).get_connection_args("client")["ssl_context"]:
            raise ValueError(
                f"security: {cluster!r} speaks TLS; pass security=distributed.Security(...) or set "
                "distributed.comm.tls.* in Dask's configuration"
            )
        return _client(cluster, security), None, True
    if isinstance(cluster, Client):
        return cluster, None, False
    if isinstance(cluster, EmulatedHosts):
        return _client(cluster.scheduler_address, None), None, True
    if hasattr(cluster, "scheduler_address"):
        return Client(cluster, set_as_default=False, **secure), None, True
    raise ValueError(
        f"cluster: must be None, a scheduler address string, a distributed.Client or a cluster object, "
        f"got {type(cluster).__name__}"
    )


def _client(address: str, security, attempts: int = 2):
    """A Dask client of the scheduler at ``address``, or one line saying why not.

    A client that failed to start still runs its IO thread; left to the
    garbage collector, its close runs on whichever thread the collector
    interrupts (once seen in CI right before the next client's IO thread
    missed Dask's 10 s start window), so it is closed here.  Dask's bare
    ``AssertionError`` for an IO thread that did not start in time is
    retried once.
    """
    from distributed import Client

    secure = {} if security is None else {"security": security}
    for attempt in range(attempts):
        try:
            return Client(address, timeout=CONNECT_TIMEOUT, set_as_default=False, **secure)
        except (OSError, TimeoutError, ValueError, AssertionError) as e:
            _close_half_built(e)
            if isinstance(e, AssertionError) and attempt + 1 < attempts:
                continue
            why = "its client's IO thread did not start" if isinstance(e, AssertionError) else type(e).__name__
            raise ConnectionError(
                f"cluster: cannot reach a Dask scheduler at {address!r} within {CONNECT_TIMEOUT:.0f}s ({why})"
            ) from None
        except TypeError as e:  # Dask: a plain connection to a TLS scheduler (or the other way round)
            _close_half_built(e)
            raise ValueError(f"security: {address!r} does not match the security given ({e})") from None


def _close_half_built(error: BaseException) -> None:
    """Close the ``distributed.Client`` whose constructor raised ``error`` (found in the traceback's frames)."""
    from distributed import Client

    tb = error.__traceback__
    while tb is not None:
        obj = tb.tb_frame.f_locals.get("self")
        if isinstance(obj, Client):
            try:
                obj.close(timeout=5)
                # a client that closed itself on failing leaves its IO thread running: Dask's close skips it then
                runner = getattr(obj, "_loop_runner", None)
                if runner is not None and runner.is_started():
                    runner.stop()
            except Exception:  # closing what never started is best effort
                pass
            return
        tb = tb.tb_next


def workers_now(client) -> dict:
    """The cluster's workers as the Dask scheduler knows them now (address -> its identity), asked anew.

    Not ``client.scheduler_info()``: that returns the client's shared cache, which the client's own periodic
    refresh (every few seconds, without per-worker entries) may overwrite between the fetch and the return, so
    it now and then reads as a cluster of no workers."""
    return dict(client.sync(client.scheduler.identity, n_workers=-1).get("workers", {}))


def count_workers(client, config: TrainConfig) -> list:
    """The addresses of the cluster's workers a rank can run on (with a "GPU" resource for device="cuda"),
    sorted; a one-line error when there are too few for the run (one call to the scheduler)."""
    info = workers_now(client)
    addrs = sorted(info)
    if config.device == "cuda":
        addrs = [a for a in addrs if info[a].get("resources", {}).get("GPU", 0) >= 1]
    if len(addrs) < config.world_size:
        what = "Dask workers with a 'GPU' resource" if config.device == "cuda" else "Dask workers"
        raise ValueError(f"cluster: needs {config.world_size} {what} (stages x pipelines), found {len(addrs)}")
    return addrs


def _cpu_count() -> int:
    import os

    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def host_cores(client, workers: list) -> dict:
    """host -> (workers of the run on it, its cores); cores None where a worker did not answer."""
    from urllib.parse import urlparse

    try:
        cores = client.run(_cpu_count, workers=list(set(workers)), on_error="return")
    except Exception:
        cores = {}
    hosts: dict = {}
    for addr in workers:
        host = urlparse(addr).hostname or addr
        n, c = hosts.get(host, (0, None))
        got = cores.get(addr)
        hosts[host] = (n + 1, got if isinstance(got, int) else c)
    return hosts


def _free_threads(dask_worker) -> int:
    """(On a Dask worker) threads not running a task, cancelled ones included: a task whose client left
    keeps its thread until the function returns."""
    return dask_worker.state.nthreads - len(dask_worker.state.executing) - len(dask_worker.state.long_running)


def pick_workers(client, config: TrainConfig) -> list:
    """Workers for the ranks, one with a free thread each.

    A worker still running an earlier run's task (its client left, the task
    ends at its next failing operation or its timeout) would start its rank
    late and the others' rendezvous would time out: such workers are passed
    over, or waited for (at most the run's ``timeout``).
    """
    need = config.world_size
    deadline = time.monotonic() + config.timeout
    while True:
        addrs = count_workers(client, config)
        free = client.run(_free_threads, workers=addrs, on_error="return")
        idle = [a for a in addrs if isinstance(free.get(a), int) and free[a] >= 1]
        if len(idle) >= need:
            return idle[:need]
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"cluster: {len(idle)} of the {need} workers needed have a free thread; the others "
                f"still run earlier tasks after {config.timeout:.0f}s"
            )
        time.sleep(0.5)


def free_workers(client, n: int, config: TrainConfig, embedded=None, more: int = 0, give_up=None) -> list:
    """``n`` workers with a free thread for a pipeline joining a running run.

    Waits (at most the run's ``timeout``) for workers to free up or to be added (``cluster.scale``); an
    embedded cluster (``embedded``, the run's own ``LocalCluster``) starts the missing worker processes itself,
    and ``more`` besides (the pipelines queued to join next start at the same time).  ``give_up()``: checked
    while waiting; when true, the wait ends with ``InterruptedError`` (the run ended meanwhile).
    """
    deadline = time.monotonic() + config.timeout
    scaled = False
    while True:
        info = workers_now(client)
        addrs = sorted(info)
        if config.device == "cuda":
            addrs = [a for a in addrs if info[a].get("resources", {}).get("GPU", 0) >= 1]
        free = client.run(_free_threads, workers=addrs, on_error="return") if addrs else {}
        idle = [a for a in addrs if isinstance(free.get(a), int) and free[a] >= 1]
        if len(idle) >= n:
            return idle[:n]
        if embedded is not None and not scaled:
            embedded.scale(len(addrs) + n + more - len(idle))
            scaled = True
        if give_up is not None and give_up():
            raise InterruptedError("the run ended while waiting for free workers")
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"cluster: {len(idle)} free worker(s) after {config.timeout:.0f}s, a pipeline needs {n} "
                f"(one per stage); add workers to the cluster (cluster.scale)"
            )
        time.sleep(0.25)


def route_address(scheduler_address: str) -> str:
    """This machine's address on the interface that routes to ``scheduler_address`` (127.0.0.1 for a loopback one).

    Workers reach the driver the way the driver reaches their scheduler, so
    the run's store listens there.  No packet is sent: a UDP socket's
    ``connect`` only asks the kernel for the route.
    """
    import ipaddress
    import socket
    from urllib.parse import urlparse

    parsed = urlparse(scheduler_address) if "://" in scheduler_address else None
    host = parsed.hostname if parsed else None
    if not host or host == "localhost":
        return "127.0.0.1"
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, parsed.port or 8786, type=socket.SOCK_DGRAM)[0]
        if ipaddress.ip_address(addr[0]).is_loopback:
            return "127.0.0.1" if family == socket.AF_INET else "::1"
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            return s.getsockname()[0]
    except (OSError, ValueError):
        return "127.0.0.1"


def bound_store(host: str, timeout: float):
    """The run's rendezvous store, listening on ``host`` only.

    ``TCPStore`` itself listens on every interface; handed a socket already
    bound to ``host`` it serves that one (and closes it with the store).
    """
    import socket

    import torch.distributed as dist

    family, kind, proto, _, addr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.bind(addr)
        sock.listen(1024)
        store = dist.TCPStore(
            host,
            sock.getsockname()[1],
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout),
            master_listen_fd=sock.fileno(),
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the socket now
    return store


class QuietRunFailures(logging.Filter):
    """Drops Dask's "Compute Failed" record of a training rank's task (key ``sdpipe-...``, or ``sdpipe-<run>-...``
    for one run's).

    The run reports a failed rank itself, as one line naming the worker and its error (``RunError``), or as the
    loss of its pipeline; Dask's record would add the rank's traceback to the user's terminal or notebook.
    """

    def __init__(self, prefix: str = "sdpipe-"):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        msg, args = record.msg, record.args
        failed = isinstance(msg, str) and msg.startswith("Compute Failed") and isinstance(args, tuple) and args
        return not (failed and str(args[0]).startswith(self.prefix))


def quiet_run_failures(run_id: Optional[str] = None) -> None:
    """(In a worker process) install :class:`QuietRunFailures` once: for every run's tasks (the embedded
    cluster's workers), or for ``run_id``'s only (a user's cluster; :func:`unquiet_run_failures` removes it)."""
    log = logging.getLogger("distributed.worker")
    prefix = "sdpipe-" if run_id is None else f"sdpipe-{run_id}-"
    if not any(isinstance(f, QuietRunFailures) and prefix.startswith(f.prefix) for f in log.filters):
        log.addFilter(QuietRunFailures(prefix))


def unquiet_run_failures(run_id: str) -> None:
    """(In a worker process) remove what :func:`quiet_run_failures` installed for ``run_id``."""
    log = logging.getLogger("distributed.worker")
    for f in [f for f in log.filters if isinstance(f, QuietRunFailures) and f.prefix == f"sdpipe-{run_id}-"]:
        log.removeFilter(f)


class QuietClosing(logging.Filter):
    """Drops a worker's report that its heartbeat found the scheduler's connection closed: while a cluster closes,
    the scheduler drops each worker's connections while that worker's last heartbeat may still be on its way (a
    race Dask's own comments call common), and the worker logs it with a traceback."""

    def filter(self, record) -> bool:
        msg = record.msg if isinstance(record.msg, str) else ""
        return not msg.startswith(("Failed to communicate with scheduler during heartbeat", "Heartbeat to scheduler"))


def _closing_quietly() -> None:
    """(In a worker process that is about to close) install :class:`QuietClosing`."""
    log = logging.getLogger("distributed.worker")
    if not any(isinstance(f, QuietClosing) for f in log.filters):
        log.addFilter(QuietClosing())


def close(client, cluster=None, timeout: float = 30.0) -> None:
    """Close a Dask ``client`` and the ``cluster`` it was made for (a ``LocalCluster``), printing nothing that is
    not about a problem: the workers, which close first, no longer report a heartbeat that raced the scheduler's
    closing of their connections (a Dask race, harmless then, that prints a traceback now and then)."""
    try:
        if client.status == "running":
            run_bounded(client, _closing_quietly, workers=None, timeout=min(timeout, 10.0), what="close")
    except Exception:  # a cluster that no longer answers closes all the same
        pass
    client.close(timeout=timeout)
    if cluster is not None:
        cluster.close(timeout=timeout)


def run_bounded(client, function, *args, workers: list, timeout: float, what: str):
    """``client.run(function, *args, workers=workers, on_error="return")``, given up on after ``timeout`` seconds
    (``client.run`` has no bound of its own): its answers by worker, or a one-line ``RuntimeError``."""
    box: dict = {}

    def ask():
        try:
            box["answers"] = client.run(function, *args, workers=workers, on_error="return")
        except Exception as e:  # the workers cannot even take the function
            box["error"] = e

    asker = threading.Thread(target=ask, name=f"sdpipe-{what}", daemon=True)
    asker.start()
    asker.join(timeout)
    if asker.is_alive():
        raise RuntimeError(f"cluster: the workers did not answer ({what}) within {timeout:.0f}s (timeout)")
    if "error" in box:
        e = box["error"]
        raise RuntimeError(f"cluster: the workers cannot run sdpipe's own code ({type(e).__name__}: {e})")
    return box["answers"]
