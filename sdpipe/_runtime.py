"""The driver side of a run: validation, cluster, launch, monitoring, results.

``train`` checks everything it can before any worker starts, connects to (or
starts) a Dask cluster, hosts the run's rendezvous store, launches one task
per worker pinned to its own Dask worker, and returns a :class:`Run` handle at
once.  A monitor thread watches the tasks and the cluster; events arrive in
the background through the Dask event log, so reading them never waits on a
worker.
"""

from __future__ import annotations

import copy
import datetime
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from .config import Heterogeneity, TrainConfig
from .data import as_tensors, steps_per_epoch
from .partition import partition
from .schedule import build_plan

__all__ = ["train", "Run", "RunResult", "RunError"]

log = logging.getLogger("sdpipe")

#: Seconds to reach an existing Dask scheduler before giving up.
CONNECT_TIMEOUT = 10.0
#: seconds a call to the group service on the Dask scheduler may take
SERVICE_TIMEOUT = 30.0


class RunError(RuntimeError):
    """A run ended because a worker failed or was lost."""


class _LostWorker(RunError):
    pass


_COMM_FAILURES = ("Connection closed by peer", "Connection reset", "Timed out", "timed out", "Broken pipe", "aborted", "Socket closed")


def _is_comm_failure(exc) -> bool:
    return exc is not None and any(m in str(exc) for m in _COMM_FAILURES)


def _is_worker_death(exc) -> bool:
    """The task failed because its worker process died (Dask gives up on it: ``KilledWorker``)."""
    from distributed.scheduler import KilledWorker

    return isinstance(exc, KilledWorker)


#: Modes (the workers' policy implementations) whose remaining pipelines go on when one is lost.
_LOSS_TOLERANT = ("scheduled", "adpsgd", "none")
#: Seconds a communication failure waits for the loss of a worker of its own pipeline to show.
_LOSS_GRACE = 10.0


def stall_limit(timeout: float) -> float:
    """Seconds a running worker may send no event before it counts as stalled: longer than any of its waits
    (each is bounded by the run's ``timeout``) and a step or an evaluation on either side of one."""
    return 2 * timeout + 60.0


@dataclass
class RunResult:
    """What a finished run returns."""

    models: list
    """One full ``nn.Sequential`` per pipeline, on the CPU."""
    history: list
    """One dict per epoch and pipeline: epoch, pipeline, loss, accuracy (with eval data), samples_per_s, ..."""
    events: list
    """Every event record of the run, in arrival order."""
    config: TrainConfig
    wall_time: float
    """Seconds from launch to the last worker's end."""
    stopped: bool = False
    """True when the run ended early through ``Run.stop``."""
    steps: dict = field(default_factory=dict)
    """Steps each pipeline completed."""
    lost: dict = field(default_factory=dict)
    """Pipelines lost during the run (a worker process or its Dask worker died): pipeline -> what was lost.
    Their entry in ``models`` is None."""

    @property
    def finished_pipelines(self) -> list:
        """The pipelines that ran to the end."""
        return [p for p in range(self.config.pipelines) if p not in self.lost]

    def max_param_diff(self) -> float:
        """Largest absolute difference of any parameter between the first finished pipeline and the others."""
        models = [m for m in self.models if m is not None]
        ref = models[0].state_dict()
        worst = 0.0
        for m in models[1:]:
            for k, v in m.state_dict().items():
                worst = max(worst, float((v.float() - ref[k].float()).abs().max()))
        return worst


def _probe_shapes(stage_modules, sample):
    """Feature shape and dtype of each stage's output, from one micro-batch on the driver."""
    import torch

    shapes = []
    x = sample
    with torch.no_grad():
        for s, mod in enumerate(stage_modules):
            try:
                x = copy.deepcopy(mod)(x)
            except Exception as e:
                raise ValueError(f"model: stage {s} fails on a micro-batch of train_data: {type(e).__name__}: {e}") from None
            if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[0] != sample.shape[0]:
                raise ValueError(f"model: stage {s} must return one tensor with the micro-batch as dimension 0")
            shapes.append((tuple(x.shape[1:]), str(x.dtype).replace("torch.", "")))
    return shapes


def _connect(cluster, config: TrainConfig, security=None):
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
        with dask.config.set({"distributed.scheduler.allowed-failures": 0, "distributed.worker.profile.enabled": False}):
            lc = LocalCluster(**kwargs)
        try:
            return Client(lc, set_as_default=False), lc, True
        except BaseException:
            lc.close()
            raise
    if isinstance(cluster, str):
        if cluster.startswith("tls://") and not (security or Security()).get_connection_args("client")["ssl_context"]:
            raise ValueError(f"security: {cluster!r} speaks TLS; pass security=distributed.Security(...) or set "
                             "distributed.comm.tls.* in Dask's configuration")
        return _client(cluster, security), None, True
    if isinstance(cluster, Client):
        return cluster, None, False
    from .hosts import EmulatedHosts

    if isinstance(cluster, EmulatedHosts):
        return _client(cluster.scheduler_address, None), None, True
    if hasattr(cluster, "scheduler_address"):
        return Client(cluster, set_as_default=False, **secure), None, True
    raise ValueError(f"cluster: must be None, a scheduler address string, a distributed.Client or a cluster object, got {type(cluster).__name__}")


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


def _count_workers(client, config: TrainConfig) -> None:
    """A one-line error when an existing cluster has too few workers for the run (one call to the scheduler)."""
    info = client.scheduler_info(n_workers=-1)["workers"]
    if config.device == "cuda":
        info = {a: w for a, w in info.items() if w.get("resources", {}).get("GPU", 0) >= 1}
    if len(info) < config.world_size:
        what = "Dask workers with a 'GPU' resource" if config.device == "cuda" else "Dask workers"
        raise ValueError(f"cluster: needs {config.world_size} {what} (stages x pipelines), found {len(info)}")


def _cpu_count() -> int:
    import os

    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _host_cores(client, workers: list) -> dict:
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


def _pick_workers(client, config: TrainConfig) -> list:
    """Workers for the ranks, one with a free thread each.

    A worker still running an earlier run's task (its client left, the task
    ends at its next failing operation or its timeout) would start its rank
    late and the others' rendezvous would time out: such workers are passed
    over, or waited for (at most the run's ``timeout``).
    """
    need = config.world_size
    deadline = time.monotonic() + config.timeout
    while True:
        info = client.scheduler_info(n_workers=-1)["workers"]
        addrs = sorted(info)
        if config.device == "cuda":
            addrs = [a for a in addrs if info[a].get("resources", {}).get("GPU", 0) >= 1]
        if len(addrs) < need:
            what = "Dask workers with a 'GPU' resource" if config.device == "cuda" else "Dask workers"
            raise ValueError(f"cluster: needs {need} {what} (stages x pipelines), found {len(addrs)}")
        free = client.run(_free_threads, workers=addrs, on_error="return")
        idle = [a for a in addrs if isinstance(free.get(a), int) and free[a] >= 1]
        if len(idle) >= need:
            return idle[:need]
        if time.monotonic() > deadline:
            raise RuntimeError(f"cluster: {len(idle)} of the {need} workers needed have a free thread; the others "
                               f"still run earlier tasks after {config.timeout:.0f}s")
        time.sleep(0.5)


class Run:
    """Handle of a running (or finished) training run.

    Usable from a notebook while training goes on: ``events_since`` returns the
    new events, ``stop`` ends the run at the next step boundary, ``result``
    blocks for the outcome.
    """

    def __init__(self, config: TrainConfig, stage_modules, spec: dict, data: tuple, cluster, from_sequential: bool = True,
                 resume=None, security=None):
        self.config = config
        self._security = security
        self._resume = resume  # a sdpipe.checkpoint.Checkpoint or None
        #: The first epoch this run trains (later than 0 when resumed from a checkpoint).
        self.start_epoch = spec.get("start_epoch", 0)
        self._ckpt_next = self._first_checkpoint(self.start_epoch)
        #: Folders of the checkpoints this run wrote, oldest first.
        self.checkpoints: list = []
        self._from_sequential = from_sequential
        self.run_id = spec["run_id"]
        self._stage_modules = stage_modules
        self._events: list = []
        self._lock = threading.Lock()
        self._received: dict = {}
        self._heard: dict = {}  # rank -> monotonic time its last batch of events arrived
        self._done = threading.Event()
        self._result: Optional[RunResult] = None
        self._error: Optional[BaseException] = None
        self._stop_requested = False
        self._t0 = spec["t0"]
        #: Steps each pipeline takes per epoch.
        self.steps_per_epoch = spec["steps_per_epoch"]
        #: Steps of all pipelines together in one epoch.
        self.updates_per_epoch = spec["steps_per_epoch"] * config.pipelines if config.policy == "allreduce" else spec["batches_per_epoch"]
        self.policy = config.policy
        self.scheduler_policy = config.scheduler_policy()
        self.heterogeneity = config.heterogeneity or Heterogeneity()
        from .hosts import EmulatedHosts

        self._emulated = cluster if isinstance(cluster, EmulatedHosts) else None
        self._workers: list = []
        self._futures: list = []
        self._lost: dict = {}
        self._client = self._cluster = None
        self._own_client = False
        self._store = self._run_store = None
        self._launched = threading.Event()
        self._ranks = {"started": 0, "ready": 0}
        #: Cores of the hosts the workers run on (known once the workers are chosen).
        self.cores: Optional[int] = None
        self._hosts: dict = {}
        self._startup = "connecting to the Dask cluster"
        if cluster is not None:
            # an existing cluster: reached (bounded) and checked here, so a wrong address or too few workers
            # raises from train() itself; an embedded cluster starts in the background
            self._client, self._cluster, self._own_client = _connect(cluster, config, security)
            try:
                _count_workers(self._client, config)
            except BaseException:
                self._cleanup()
                raise
        self._pending = [spec, data, cluster]  # handed to the starting thread, which drops them (see _start)
        self._starter = threading.Thread(target=self._start, name=f"sdpipe-start-{self.run_id}", daemon=True)
        self._starter.start()

    # ------------------------------------------------------------ start-up
    def _start(self) -> None:
        """(Background) start the embedded cluster if any, choose the workers, launch the ranks.

        The data (tensors on numpy buffers) is dropped before the run is marked
        launched or done: this thread must not free them while the interpreter
        finalizes (see _monitor).
        """
        try:
            args, self._pending = self._pending, None
            try:
                self._launch(*args)
            finally:
                del args
        except BaseException as e:  # the run ends with it: result() raises it, status says "error"
            self._error = e if isinstance(e, Exception) else RunError(f"the run's start was interrupted ({type(e).__name__})")
            self._cleanup()
            self._done.set()
            return
        self._launched.set()
        if self._stop_requested:
            self._request_stop()

    @property
    def startup(self) -> Optional[str]:
        """What the run is doing to start (None once every worker has joined, or after the run ended)."""
        if self._done.is_set() or self._joined():
            return None
        if not self._launched.is_set():
            return self._startup
        r, n = self._ranks, self.config.world_size
        if r["started"] < n:
            return f"workers starting: {r['started']} of {n} running, {r['ready']} connected"
        return f"workers connecting: {r['ready']} of {n} connected (rendezvous)"

    @property
    def launched(self) -> bool:
        """Whether the run's workers were launched: from then on controls apply without waiting."""
        return self._launched.is_set()

    @property
    def t0(self) -> float:
        """The run's time origin (seconds since the epoch): event times count from it."""
        return self._t0

    def _joined(self) -> bool:
        return self._launched.is_set() and (self._ranks["ready"] >= self.config.world_size or bool(self._lost))

    def _wait_launched(self, what: str) -> None:
        """Wait (at most the run's timeout) until the run's workers are launched."""
        deadline = time.monotonic() + self.config.timeout
        while not self._launched.wait(0.1):
            if self._done.is_set():
                raise RuntimeError(f"{what}: run {self.run_id} has already ended ({self.status})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: run {self.run_id} still starting after {self.config.timeout:.0f}s ({self.startup})")

    @property
    def contention(self) -> Optional[str]:
        """One line when the run has more workers on a host than the host has cores (None otherwise)."""
        over = [(h, n, c) for h, (n, c) in self._hosts.items() if c and n > c]
        if not over:
            return None
        h, n, c = over[0]
        where = f" on {h}" if len(self._hosts) > 1 else ""
        return (f"{n} workers share {c} cores{where}: samples/s measure the machine's contention (a slowed or waiting "
                f"worker's share goes to the others), not what each worker would do on its own core")

    # ------------------------------------------------------------ launch
    def _launch(self, spec, data, cluster) -> None:
        import torch.distributed as dist

        cfg = self.config
        try:
            if self._client is None:
                self._startup = f"starting an embedded Dask cluster of {cfg.world_size} worker processes"
                self._client, self._cluster, self._own_client = _connect(cluster, cfg, self._security)
            self._startup = "opening the rendezvous store and the group service"
            #: Address the run's rendezvous store listens on (``host=``, else the one routing to the Dask scheduler).
            self.store_host = cfg.host or route_address(self._client.scheduler.address)
            self._store = _bound_store(self.store_host, cfg.timeout)
            self._run_store = dist.PrefixStore(f"sdpipe/{self.run_id}/", self._store)
            spec["store_host"], spec["store_port"] = self.store_host, self._store.port
            #: Port of the run's rendezvous store (closed when the run ends).
            self.store_port = self._store.port
            self._topic = spec["topic"]
            self._client.subscribe_topic(self._topic, self._on_event)
            self._init_control(spec)
            S = cfg.stages
            self._startup = "choosing the workers and copying the data to them (they load torch to take it)"
            workers, (fX, fY, fEX, fEY) = self._place_data(data)
            self._workers = workers
            self._hosts = _host_cores(self._client, workers)
            self.cores = sum(c for _, c in self._hosts.values() if c) or None
            self._startup = "submitting the workers' tasks"
            from ._worker import worker_main

            resources = {"GPU": 1} if cfg.device == "cuda" else None
            self._futures = []
            for rank, addr in enumerate(workers):
                s = rank % S
                self._futures.append(
                    self._client.submit(
                        worker_main,
                        spec,
                        rank,
                        fX if s == 0 else None,
                        fY if s == S - 1 else None,
                        fEX if s == 0 else None,
                        fEY if s == S - 1 else None,
                        self._resume.stage_state(*divmod(rank, S)) if self._resume is not None else None,
                        key=f"sdpipe-{self.run_id}-rank{rank}",
                        workers=[addr],
                        allow_other_workers=False,
                        resources=resources,
                        pure=False,
                        retries=0,
                    )
                )
            self._data_futures = [f for f in (fX, fY, fEX, fEY) if f is not None]
        except BaseException:
            self._cleanup()
            raise
        self._monitor_thread = threading.Thread(target=self._monitor, name=f"sdpipe-monitor-{self.run_id}", daemon=True)
        self._monitor_thread.start()

    def _place_data(self, data) -> tuple:
        """Choose the workers and copy the data to the first and last stages' ones.

        A worker that leaves the cluster meanwhile (one that just died and is
        being restarted by its nanny) makes the copy fail: choose again, up
        to three times.
        """
        cfg, S = self.config, self.config.stages
        X, Y, EX, EY = data
        for attempt in range(3):
            workers = _pick_workers(self._client, cfg)
            first = [workers[p * S] for p in range(cfg.pipelines)]
            last = [workers[p * S + S - 1] for p in range(cfg.pipelines)]
            scatter = lambda obj, ws: self._client.scatter(obj, workers=ws, broadcast=True, hash=False) if obj is not None else None
            try:
                return workers, (scatter(X, first), scatter(Y, last), scatter(EX, first), scatter(EY, last))
            except KeyError as e:  # the scheduler no longer knows a chosen worker
                if attempt == 2:
                    raise RuntimeError(f"cluster: worker {e} left the cluster while the run started") from None
                time.sleep(1.0)

    # ------------------------------------------------------------ control
    def _init_control(self, spec) -> None:
        from ._service import ensure_service

        cfg = self.config
        self._token = uuid.uuid4().hex
        self._ctl_lock = threading.Lock()
        self._ctl = {"seq": 0, "stop": 0, "hetero": 0, "policy": 0, "pause": 0}
        self._mode = "scheduled" if cfg.policy == "sdpipe" else cfg.policy
        self._run_store.set("hetero/0", json.dumps(self.heterogeneity.to_dict()))
        self._run_store.set("policy/0", json.dumps({"mode": self._mode, "name": cfg.policy}))
        self._write_ctl()
        ensure_service(self._client)
        state = self._resume.scheduler if self._resume is not None else None
        answer = self._service("sdpipe_open", token=self._token, stages=cfg.stages, pipelines=cfg.pipelines,
                               policy=self.scheduler_policy.to_dict(), policy_name=cfg.policy, topic=self._topic,
                               t0=self._t0, state=state)
        if "error" in answer:
            raise ValueError(f"resume_from: the group service rejected the checkpoint's scheduler {answer['error']}")
        self._service_open = True

    def _service(self, route: str, **kwargs):
        client = self._client
        return client.sync(getattr(client.scheduler, route), run_id=self.run_id, callback_timeout=SERVICE_TIMEOUT, **kwargs)

    def _write_ctl(self) -> None:
        c = self._ctl
        c["seq"] += 1  # readers on several connections keep the reading with the highest sequence number
        self._run_store.set("ctl", f"{c['seq']},{c['stop']},{c['hetero']},{c['policy']},{c['pause']}")

    def _record(self, what: str, **extra) -> None:
        now = time.time() - self._t0
        rec = {"kind": "control", "pipeline": None, "stage": None, "step": None, "microbatch": None,
               "start": now, "end": now, "what": what, "applied_by": "driver"}
        rec.update(extra)
        with self._lock:
            self._events.append(rec)

    def _require_running(self, what: str) -> None:
        if not self._done.is_set() and not self._launched.is_set():
            self._wait_launched(what)
        if self._done.is_set() or self._store is None:
            raise RuntimeError(f"{what}: run {self.run_id} has already ended ({self.status})")

    def set_heterogeneity(self, heterogeneity: Optional[Heterogeneity] = None, **fields) -> None:
        """Replace the emulated heterogeneity; every worker takes it up at its next step boundary.

        ``run.set_heterogeneity(sdpipe.Heterogeneity(slowdown={3: 4.0}))`` or
        ``run.set_heterogeneity(slowdown={3: 4.0})``; None (or no argument) removes it.
        """
        if heterogeneity is not None and fields:
            raise ValueError("heterogeneity: pass a Heterogeneity or its fields, not both")
        if heterogeneity is None:
            heterogeneity = Heterogeneity(**fields)
        if not isinstance(heterogeneity, Heterogeneity):
            raise ValueError(f"heterogeneity: must be a sdpipe.Heterogeneity, got {type(heterogeneity).__name__}")
        heterogeneity.check_workers(self.config.pipelines, self.config.stages)
        self._require_running("set_heterogeneity")
        with self._ctl_lock:
            v = self._ctl["hetero"] + 1
            self._run_store.set(f"hetero/{v}", json.dumps(heterogeneity.to_dict()))
            self._ctl["hetero"] = v
            self._write_ctl()
            self.heterogeneity = heterogeneity
        self._record("heterogeneity", version=v, heterogeneity=heterogeneity.to_dict())

    def shape(self, host: Optional[int] = None, *, pipeline: Optional[int] = None, bandwidth=..., cpu=...) -> dict:
        """Limit a host's link and CPU by the kernel while the run goes on (runs on :class:`sdpipe.hosts.EmulatedHosts`).

        The host is ``host`` (its index) or the one ``pipeline``'s workers run
        on.  ``bandwidth``: bytes/s each way (a token bucket on its link);
        ``cpu``: cores (a quota of its cgroup); None lifts a limit, an argument
        left out keeps it.  Unlike :meth:`set_heterogeneity` (slept, per
        worker) this shapes the host: every process on it, all its traffic.
        Recorded as a ``control`` event (``what="shaped"``); returns the host's
        shaping now.
        """
        hosts = self._emulated
        if hosts is None:
            raise ValueError("shape: needs a run on emulated hosts (cluster=sdpipe.hosts.EmulatedHosts(...)); "
                             "use set_heterogeneity for slept slowdowns on any cluster")
        if (host is None) == (pipeline is None):
            raise ValueError("shape: pass one of host (an index) or pipeline (the host its workers run on)")
        self._require_running("shape")
        S = self.config.stages
        on = {}  # host index -> pipelines with a worker there
        for rank, addr in enumerate(self._workers):
            on.setdefault(hosts.host_of(addr), set()).add(rank // S)
        if pipeline is not None:
            if isinstance(pipeline, bool) or not isinstance(pipeline, int) or not 0 <= pipeline < self.config.pipelines:
                raise ValueError(f"pipeline: must be 0..{self.config.pipelines - 1}, got {pipeline!r}")
            where = sorted(h for h, ps in on.items() if pipeline in ps)
            if len(where) != 1:
                raise ValueError(f"pipeline: pipeline {pipeline}'s workers run on hosts {where}; shape one host= at a time")
            host = where[0]
        now = hosts.shape(host, bandwidth=bandwidth, cpu=cpu)
        address = hosts.addresses[host]
        pipes = sorted(on.get(host, ()))
        self._record("shaped", host=host, address=address, pipelines=pipes, bandwidth=now["bandwidth"], cpu=now["cpu"])
        return now

    def set_policy(self, policy: Optional[str] = None, **params) -> None:
        """Switch the synchronization policy and/or change its parameters while training.

        ``policy`` is "sdpipe", "allreduce" or "none" (a run started with "ps" or
        "adpsgd" keeps it, as their servers live for the whole run); ``params`` are fields of
        :class:`sdpipe.scheduler.SchedulerPolicy` (``staleness``, ``max_group``,
        ``window_init``, ``window_min``, ``window_max``, ...).  Every worker takes
        the change up at its next step boundary, replicas that synchronize
        together at the same step.  A run that started with the static
        ``allreduce`` or ``none`` moves to scheduled groups; from then on
        "allreduce" means every replica averages with all others after every step.
        """
        from .config import LIVE_POLICIES, POLICIES
        from .scheduler import POLICY_PRESETS

        name = policy or self.policy
        if name not in POLICIES:
            raise ValueError(f"policy: {name!r} is not one of {', '.join(POLICIES)}")
        if name not in LIVE_POLICIES or self.config.policy not in LIVE_POLICIES:
            which = name if name not in LIVE_POLICIES else self.config.policy
            raise ValueError(f"policy: {which!r} cannot be switched to or from while training; live switches are between {', '.join(LIVE_POLICIES)}")
        base = self.scheduler_policy if policy is None or policy == self.policy else POLICY_PRESETS[name]
        new = base.updated(**params)
        if new.max_group is not None and new.max_group > self.config.pipelines:
            raise ValueError(f"policy.max_group: {new.max_group} exceeds the {self.config.pipelines} pipelines; allowed 1..{self.config.pipelines} or None")
        self._require_running("set_policy")
        with self._ctl_lock:
            self._service("sdpipe_set_policy", token=self._token, policy=new.to_dict(), policy_name=name)
            self.policy, self.scheduler_policy = name, new
            if self._mode != "scheduled":
                v = self._ctl["policy"] + 1
                self._run_store.set(f"policy/{v}", json.dumps({"mode": "scheduled", "name": name}))
                self._ctl["policy"] = v
                self._write_ctl()
                self._mode = "scheduled"
        self._record("policy", policy=name, params={k: (None if v == float("inf") else v) for k, v in new.to_dict().items()})

    def scheduler_state(self) -> dict:
        """A snapshot of the group service's state for this run (rounds, windows, disjoint sets)."""
        self._require_running("scheduler_state")
        return self._service("sdpipe_state")

    def _on_event(self, event) -> None:
        _, msg = event
        batch = msg["events"]
        for rec in batch:  # msgpack hands lists back as tuples
            if "group" in rec:
                rec["group"] = list(rec["group"])
        with self._lock:
            self._events.extend(batch)
            self._received[msg["rank"]] = self._received.get(msg["rank"], 0) + len(msg["events"])
            self._heard[msg["rank"]] = time.monotonic()

    # ------------------------------------------------------------ public
    @property
    def workers(self) -> list:
        """The Dask worker address of each rank (rank = pipeline x stages + stage); waits (bounded) for them to be chosen."""
        if not self._launched.is_set() and not self._done.is_set():
            self._wait_launched("workers")
        return list(self._workers)

    def events_since(self, cursor: int = 0) -> tuple[list, int]:
        """``(new events, new cursor)``: the records that arrived after ``cursor``."""
        with self._lock:
            new = self._events[cursor:]
        return new, cursor + len(new)

    @property
    def events(self) -> list:
        with self._lock:
            return list(self._events)

    def history(self) -> list:
        """Per-epoch, per-pipeline metrics received so far."""
        return _history(self.events)

    def stop(self) -> bool:
        """Ask every pipeline to stop at its next step boundary (pipelines that sync together stop together).

        Under ``sdpipe`` (and the live presets) the group service says so in
        its answers, the members of a round stop after it, and the stop ends
        with a global sync, so every stage's replicas end identical.  Returns
        False when the run had already ended (nothing to stop), else True; a
        run still starting stops at its first step.
        """
        if self._done.is_set():
            return False
        self._request_stop()
        self._record("stop")
        return True

    def _request_stop(self) -> None:
        self._stop_requested = True
        if not self._done.is_set() and self._launched.is_set() and self._store is not None:
            try:
                # the group service first: pipelines under a group policy take the stop from their
                # groups' answers (the store's flag is their fallback), so the members of a round stop together
                self._service("sdpipe_stop", token=self._token)
            except Exception:  # the service or the run is already gone
                pass
            try:
                with self._ctl_lock:
                    self._ctl["stop"] = 1
                    self._write_ctl()
            except Exception:  # the store is gone: the run already ended
                pass

    def pause(self) -> None:
        """Hold every pipeline at its next step boundary until :meth:`resume` (or :meth:`stop`).

        Replicas that synchronize every step pause at the same step.  Waits do
        not time out while the run is paused.
        """
        self._set_pause(True)

    def resume(self) -> None:
        """Let a paused run go on."""
        self._set_pause(False)

    def _set_pause(self, paused: bool) -> None:
        what = "pause" if paused else "resume"
        self._require_running(what)
        with self._ctl_lock:
            self._service("sdpipe_pause", token=self._token, paused=paused)
            self._ctl["pause"] = int(paused)
            self._write_ctl()
        self._record(what)

    @property
    def paused(self) -> bool:
        return bool(getattr(self, "_ctl", {}).get("pause"))

    def done(self) -> bool:
        return self._done.is_set()

    @property
    def status(self) -> str:
        """starting, running, paused, stopping, finished, stopped or error (see :attr:`startup` while starting)."""
        if not self._done.is_set():
            if self._stop_requested:
                return "stopping"
            if not self._joined():
                return "starting"
            return "paused" if self.paused else "running"
        return "error" if self._error else ("stopped" if self._result and self._result.stopped else "finished")

    async def wait_async(self, timeout: Optional[float] = None) -> RunResult:
        """``await run.wait_async()`` (or ``await run``): the result, without holding the kernel.

        In Jupyter a cell that awaits leaves the kernel free for widget
        callbacks (the dashboard's controls answer while it waits), unlike a
        cell blocked in :meth:`result`.
        """
        import asyncio

        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._done.is_set():
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"run {self.run_id} still running after {timeout}s")
            await asyncio.sleep(0.1)
        return self.result(0)

    def __await__(self):
        return self.wait_async().__await__()

    def result(self, timeout: Optional[float] = None) -> RunResult:
        """Block until the run ends; return its :class:`RunResult` or raise its error.

        A KeyboardInterrupt while waiting stops the run and waits (bounded) for
        it to wind down before re-raising.
        """
        try:
            deadline = None if timeout is None else time.monotonic() + timeout
            # short waits: an interrupt gets through between them on every platform
            while not self._done.wait(0.2 if deadline is None else max(0.0, min(0.2, deadline - time.monotonic()))):
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"run {self.run_id} still running after {timeout}s")
        except KeyboardInterrupt:
            self._request_stop()
            self._done.wait(self.config.timeout)
            raise
        if self._error is not None:
            raise self._error
        return self._result

    def __repr__(self) -> str:
        c = self.config
        status = self.status
        startup = self.startup if status == "starting" else None
        note = self.contention
        return (f"<sdpipe.Run {self.run_id} {c.stages}x{c.pipelines} policy={self.policy} {status}"
                + (f" ({startup})" if startup else "") + (f"; note: {note}" if note else "") + ">")

    # ------------------------------------------------------------ monitor
    def _monitor(self) -> None:
        cfg = self.config
        S = cfg.stages
        error: Optional[BaseException] = None
        grace_until = None
        results = {}
        lost_at = None
        comm_seen: dict = {}  # rank -> when its communication failure was first seen
        try:
            last_check = time.monotonic()
            while True:
                if not self._joined():
                    self._count_ranks()
                statuses = [f.status for f in self._futures]
                live = [r for r in range(len(statuses)) if r // S not in self._lost]
                if all(statuses[r] == "finished" for r in live):
                    # the lost pipelines' other workers fail on their own (their peers are gone); bounded
                    gone = [r for r in range(len(statuses)) if r // S in self._lost]
                    if all(statuses[r] != "pending" for r in gone) or time.monotonic() > lost_at + cfg.timeout + 10:
                        break
                if error is None and self._ckpt_next is not None:
                    error = self._poll_checkpoint()
                if error is None:
                    for rank in live:
                        if statuses[rank] not in ("error", "cancelled"):
                            continue
                        failure = self._describe_failure(rank, self._futures[rank])
                        if _is_worker_death(failure.__cause__):
                            error = self._on_lost(rank, "its worker process died")
                        elif _is_comm_failure(failure.__cause__):
                            # a peer of its pipeline may have died: give that loss time to show
                            if time.monotonic() - comm_seen.setdefault(rank, time.monotonic()) > _LOSS_GRACE:
                                error = failure
                        else:
                            error = failure
                        if error is not None:
                            break
                    if error is None and time.monotonic() - last_check > 1.0:
                        last_check = time.monotonic()
                        error, missing = self._check_workers()
                        for rank in missing:
                            if error is None and rank // S not in self._lost:
                                error = self._on_lost(rank, "its Dask worker left the cluster")
                    if error is None:
                        error = self._check_stalls(statuses, live)
                    if self._lost and lost_at is None:
                        lost_at = time.monotonic()
                    if error is not None:
                        self._request_stop()
                        grace_until = time.monotonic() + min(10.0, cfg.timeout)
                elif all(s != "pending" for s in statuses) or time.monotonic() > grace_until:
                    break
                time.sleep(0.05)
            if error is None and self._ckpt_next is not None:  # the last epoch's, written as the workers ended
                error = self._poll_checkpoint()
            for rank, f in enumerate(self._futures):
                if f.status == "finished" and rank // S not in self._lost:
                    results[rank] = f.result(timeout=cfg.timeout)
            if error is not None and not isinstance(error, _LostWorker):
                error = self._root_cause() or error
            self._await_events(results)
            if error is None:
                self._result = self._assemble(results)
        except BaseException as e:  # keep the handle usable whatever happened
            error = error or e
        finally:
            # the workers' weights (tensors on numpy buffers) are dropped here, before the run is done: a caller
            # that exits right after result() must not leave this thread freeing them while the interpreter
            # finalizes (freeing one takes the GIL there, which kills the thread and aborts the process)
            results = None
            self._error = error
            self._cleanup()
            self._done.set()

    def _check_stalls(self, statuses: list, live: list) -> Optional[BaseException]:
        """A live worker still running that sent no event for :func:`stall_limit` seconds since the launch (the
        run not paused) is stalled: in a wait that neither ends nor fails.  It is treated as lost (its pipeline drops out where the
        policy allows, else the run stops with an error naming it), so a run never waits for it for ever."""
        now = time.monotonic()
        # from the launch (a worker can stall while it starts: in its rendezvous, say); a paused pipeline
        # records nothing while it holds
        if not self._launched.is_set() or self._ctl.get("pause"):
            self._stall_base = now
            return None
        base = getattr(self, "_stall_base", now)
        self._stall_base = base
        limit = stall_limit(self.config.timeout)
        for rank in live:
            last = max(self._heard.get(rank, 0.0), base)
            if statuses[rank] == "pending" and now - last > limit:
                return self._on_lost(rank, f"it sent nothing for {now - last:.0f}s, stalled in a wait that neither "
                                           f"ended nor failed (each wait's bound is timeout={self.config.timeout:g}s)")
        return None

    def _count_ranks(self) -> None:
        """How many ranks started and connected (counters the workers add to in the run's store)."""
        try:
            self._ranks = {k: self._run_store.add(f"ranks/{k}", 0) for k in ("started", "ready")}
        except Exception:  # the store is closing: the run is ending
            pass

    def _first_checkpoint(self, after: int) -> Optional[int]:
        every = self.config.checkpoint_every
        if not every:
            return None
        e = (after // every + 1) * every
        return e if e <= self.config.epochs else None

    def _poll_checkpoint(self) -> Optional[BaseException]:
        """Once every live worker wrote its part of the next checkpoint: the manifest, then the folder into place."""
        from .checkpoint import finish

        cfg = self.config
        epoch = self._ckpt_next
        ranks = [r for r in range(cfg.world_size) if r // cfg.stages not in self._lost]
        try:
            if self._run_store.add(f"ckpt/{epoch}/n", 0) < len(ranks):
                return None
            steps = {str(p): int(self._run_store.get(f"ckpt/{epoch}/rank{p * cfg.stages}"))
                     for p in range(cfg.pipelines) if p not in self._lost}
            scheduler = None
            if self._mode in ("scheduled", "adpsgd"):
                scheduler = self._service("sdpipe_state")["core"]
            folder = finish(cfg.checkpoint_dir, epoch, self.run_id, {
                "run_id": self.run_id, "ranks": ranks, "steps": steps, "config": _plain_config(cfg),
                "policy": self.policy, "scheduler": scheduler, "lost": {str(p): w for p, w in self._lost.items()}})
        except Exception as e:
            return RunError(f"checkpoint_dir: could not write the checkpoint of epoch {epoch} ({type(e).__name__}: {e})")
        self.checkpoints.append(str(folder))
        now = time.time() - self._t0
        with self._lock:
            self._events.append({"kind": "checkpoint", "pipeline": None, "stage": None, "step": None, "microbatch": None,
                                 "start": now, "end": now, "epoch": epoch, "path": str(folder)})
        self._ckpt_next = self._first_checkpoint(epoch)
        return None

    def _on_lost(self, rank: int, why: str) -> Optional[BaseException]:
        """A worker is gone.  Returns the run's error, or None when the other pipelines go on without its pipeline."""
        cfg = self.config
        p, s = divmod(rank, cfg.stages)
        what = f"worker pipeline {p} stage {s} (rank {rank}, {self._workers[rank]})"
        if self._mode not in _LOSS_TOLERANT:
            return _LostWorker(f"{what} was lost ({why}); policy {self.policy!r} cannot go on without it")
        self._lost[p] = f"{what} was lost ({why})"
        now = time.time() - self._t0
        with self._lock:
            self._events.append({"kind": "worker-lost", "pipeline": p, "stage": s, "step": None, "microbatch": None,
                                 "start": now, "end": now, "worker": self._workers[rank], "reason": why})
        log.warning("sdpipe: %s; the run goes on with %d pipeline(s)", self._lost[p], cfg.pipelines - len(self._lost))
        if len(self._lost) == cfg.pipelines:
            return RunError(f"every pipeline was lost; last: {self._lost[p]}")
        from ._comm import mark_lost

        try:  # the others stop pairing with it, the scheduler takes it out of every stage
            mark_lost(self._run_store, p, why)
            self._service("sdpipe_leave", stage=None, pipeline=p, token=self._token)
        except Exception as e:
            log.warning("sdpipe: could not tell the group service that pipeline %d was lost: %s", p, e)
        return None

    def _root_cause(self) -> Optional[BaseException]:
        """The failure that started it: peers of a failed worker fail after it with communication errors."""
        failed = [(r, f) for r, f in enumerate(self._futures) if f.status == "error"]
        if not failed:
            return None
        errors = [(r, self._describe_failure(r, f)) for r, f in failed]
        primary = next((e for r, e in errors if not _is_comm_failure(e.__cause__)), errors[0][1])
        if len(errors) > 1:
            others = "; ".join(f"rank {r}: {str(e.__cause__ or e)[:160]}" for r, e in errors if e is not primary)
            primary.args = (f"{primary.args[0]} ({len(errors) - 1} other worker(s) failed after it: {others})".replace("\n", " "),)
        return primary

    def _describe_failure(self, rank: int, future) -> BaseException:
        p, s = divmod(rank, self.config.stages)
        try:
            exc = future.exception(timeout=5)
        except Exception as e:  # cancelled futures raise here
            exc = e
        err = RunError(f"worker pipeline {p} stage {s} (rank {rank}, {self._workers[rank]}) failed: {type(exc).__name__}: {exc}")
        err.__cause__ = exc if isinstance(exc, BaseException) else None
        return err

    def _check_workers(self) -> tuple:
        """(error, lost ranks): a worker whose Dask worker left the cluster in two checks in a row (a second apart) is lost."""
        try:
            alive = set(self._client.scheduler_info(n_workers=-1)["workers"])
        except Exception as e:
            return RunError(f"lost the Dask scheduler: {type(e).__name__}: {e}"), []
        missing = {r for r, addr in enumerate(self._workers) if addr not in alive and self._futures[r].status == "pending"}
        confirmed = missing & getattr(self, "_missing", set())
        self._missing = missing
        return None, sorted(confirmed)

    def _await_events(self, results: dict, timeout: float = 10.0) -> None:
        """Wait (bounded) until every finished worker's events have arrived."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if all(self._received.get(r, 0) >= res["events"] for r, res in results.items()):
                    return
            time.sleep(0.02)
        log.warning("sdpipe: some events of run %s did not arrive within %.0fs", self.run_id, timeout)

    def _assemble(self, results: dict) -> RunResult:
        from torch import nn

        cfg = self.config
        models = []
        for p in range(cfg.pipelines):
            if p in self._lost:
                models.append(None)
                continue
            parts = []
            for s in range(cfg.stages):
                mod = copy.deepcopy(self._stage_modules[s])
                mod.load_state_dict(results[p * cfg.stages + s]["state"])
                parts.append(mod)
            # An nn.Sequential comes back with its original layer names; a list of stages as one module per stage.
            layers = [layer for part in parts for layer in part] if self._from_sequential else parts
            models.append(nn.Sequential(*layers))
        events = self.events
        return RunResult(
            models=models,
            history=_history(events),
            events=events,
            config=cfg,
            wall_time=max([e["end"] for e in events] + [0.0]),
            stopped=any(r["stopped"] for r in results.values()),
            steps={p: results[p * cfg.stages]["steps"] for p in range(cfg.pipelines) if p not in self._lost},
            lost=dict(self._lost),
        )

    def _cleanup(self) -> None:
        """Close everything this run opened; safe to call more than once."""
        client = getattr(self, "_client", None)
        if client is not None and getattr(self, "_service_open", False):
            try:
                self._service("sdpipe_close", token=self._token)
            except Exception:
                pass
            self._service_open = False
        if client is not None:
            try:
                client.unsubscribe_topic(self._topic)
            except Exception:
                pass
            for f in getattr(self, "_futures", []) + getattr(self, "_data_futures", []):
                try:
                    f.release()
                except Exception:
                    pass
            if self._own_client:
                try:
                    client.close(timeout=10)
                except Exception:
                    pass
            self._client = None
        if self._cluster is not None:
            try:
                self._cluster.close(timeout=20)
            except Exception:
                pass
            self._cluster = None
        self._run_store = None
        self._store = None  # dropping the last reference shuts the store's listener


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


def _bound_store(host: str, timeout: float):
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
        store = dist.TCPStore(host, sock.getsockname()[1], is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout), master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the socket now
    return store


def _plain_config(config: TrainConfig) -> dict:
    """The configuration as JSON data (a checkpoint's manifest)."""
    return json.loads(json.dumps(config.to_dict(), default=str))


def _history(events: list) -> list:
    rows = [e["metrics"] for e in events if e.get("kind") == "epoch"]
    return sorted(rows, key=lambda r: (r["epoch"], r["pipeline"]))


def train(
    model,
    train_data,
    *,
    stages: int = 2,
    pipelines: int = 2,
    policy: str = "allreduce",
    schedule: str = "1f1b",
    microbatches: int = 4,
    batch_size: int = 32,
    epochs: int = 10,
    sync_every: int = 1,
    optimizer: str = "adam",
    lr: float = 0.002,
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    eval_data=None,
    loss_fn=None,
    cuts=None,
    cluster=None,
    device: str = "cpu",
    backend: Optional[str] = None,
    seed: int = 0,
    heterogeneity: Optional[Heterogeneity] = None,
    scheduler=None,
    timeout: float = 120.0,
    host: Optional[str] = None,
    checkpoint_every: int = 0,
    checkpoint_dir=None,
    resume_from=None,
    security=None,
) -> Run:
    """Train ``model`` with ``stages`` x ``pipelines`` workers; returns a :class:`Run` at once.

    ``model`` is an ``nn.Sequential`` (cut into ``stages`` contiguous stages,
    balanced by parameter count unless ``cuts`` is given) or a list of stage
    modules.  ``train_data``/``eval_data`` are a torch Dataset or an
    ``(inputs, targets)`` pair.  ``cluster=None`` starts an embedded
    ``LocalCluster`` (one single-threaded process per worker, closed at the
    end); a scheduler address or a ``distributed.Client`` uses an existing one.

    ``checkpoint_every=N`` writes a checkpoint to ``checkpoint_dir`` after
    every N-th epoch (see :mod:`sdpipe.checkpoint`); ``resume_from`` (a
    checkpoint folder, or a checkpoint_dir for its latest) starts at that
    checkpoint's epoch with its weights, optimizer and random states.

    ``host``: the address the run's rendezvous store listens on, which every
    worker must reach.  By default it is this machine's address on the
    interface that routes to the Dask scheduler (127.0.0.1 for an embedded or
    loopback cluster).  Each worker binds its own tensors' sockets to its own
    host's address (the host part of its Dask worker address).

    ``security`` (a ``distributed.Security``) connects to a TLS-secured
    scheduler address (``tls://...``).  Dask's TLS covers the control plane;
    tensors and the rendezvous store go over torch.distributed (plain TCP), so
    the store and the workers should stay on a trusted network.

    Everything is checked before any worker starts; bad input raises a
    one-line ``ValueError`` naming the field.
    """
    import torch
    from torch import nn

    config = TrainConfig(
        stages=stages,
        pipelines=pipelines,
        policy=policy,
        schedule=schedule,
        microbatches=microbatches,
        batch_size=batch_size,
        epochs=epochs,
        sync_every=sync_every,
        optimizer=optimizer,
        lr=lr,
        momentum=momentum,
        weight_decay=weight_decay,
        cuts=cuts,
        device=device,
        backend=backend,
        seed=seed,
        heterogeneity=heterogeneity,
        scheduler=scheduler,
        timeout=timeout,
        host=host,
        checkpoint_every=checkpoint_every,
        checkpoint_dir=checkpoint_dir,
    )
    if cluster is None:
        _check_main_guard()
    if config.device == "cuda" and cluster is None and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' requested but this machine has no GPU; use device='cpu'")
    if (config.device == "cuda" and cluster is None and config.resolved_backend == "nccl"
            and torch.cuda.device_count() < config.world_size):
        # NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), seen on a 1-GPU machine after 14 s
        raise ValueError(f"device: NCCL needs one GPU per worker: {config.world_size} workers (stages x pipelines), "
                         f"{torch.cuda.device_count()} GPU(s) here; pass backend='gloo' to share GPUs")
    stage_modules = [copy.deepcopy(m) for m in partition(model, stages, cuts)]
    X, Y = as_tensors(train_data, "train_data")
    EX = EY = None
    if eval_data is not None:
        EX, EY = as_tensors(eval_data, "eval_data")
    steps = steps_per_epoch(len(X), batch_size, pipelines)
    if steps < 1 and config.policy == "allreduce" or len(X) < batch_size:
        raise ValueError(
            f"batch_size: {batch_size} x {pipelines} pipelines exceeds the {len(X)} training samples; no full step per epoch"
        if len(X) >= batch_size
        else f"batch_size: {batch_size} exceeds the {len(X)} training samples"
        )
    if loss_fn is None:
        loss_fn = nn.CrossEntropyLoss()
    elif not callable(loss_fn):
        raise ValueError(f"loss_fn: must be callable (output, target) -> loss, got {type(loss_fn).__name__}")
    shapes = _probe_shapes(stage_modules, X[: config.microbatch_size])
    classify = not Y.is_floating_point()
    plan = build_plan(schedule, stages, microbatches)
    run_id = uuid.uuid4().hex[:10]
    spec: dict[str, Any] = {
        "run_id": run_id,
        "topic": f"sdpipe-{run_id}",
        "config": config.to_dict(),
        "backend": config.resolved_backend,
        "stage_modules": stage_modules,
        "loss_fn": loss_fn,
        "shapes": shapes,
        "plan": plan,
        "train_size": len(X),
        "eval_size": 0 if EX is None else len(EX),
        "steps_per_epoch": steps,
        "batches_per_epoch": len(X) // batch_size,
        "classify": classify,
        "t0": time.time(),
    }
    resume = None
    if resume_from is not None:
        resume = _check_resume(resume_from, config, stage_modules)
        spec["start_epoch"] = resume.epoch
        most = max(resume.steps.values())
        spec["start_steps"] = {str(p): resume.steps.get(p, most) for p in range(pipelines)}
    if security is not None:
        from distributed.security import Security

        if not isinstance(security, Security):
            raise ValueError(f"security: must be a distributed.Security or None, got {type(security).__name__}")
        if not isinstance(cluster, str) and not hasattr(cluster, "scheduler_address"):
            raise ValueError("security: applies to a scheduler address or a cluster object; a Client brings its own")
    return Run(config, stage_modules, spec, (X, Y, EX, EY), cluster, from_sequential=isinstance(model, nn.Sequential),
               resume=resume, security=security)


def _unguarded_main_line() -> Optional[tuple]:
    """(script, line) when this call comes from a script's top-level code outside ``if __name__ == "__main__":``.

    The embedded cluster's worker processes start by spawn, which imports the
    script again in each of them (as ``__mp_main__``): unguarded, that import
    trains again, and Dask only says "Nanny failed to start" after pages of
    tracebacks. Scripts run as files are checked (their source, parsed);
    notebooks, ``python -c`` and interactive sessions have nothing to re-import.
    """
    import ast
    import sys
    from pathlib import Path

    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not path or not str(path).endswith(".py"):
        return None
    frame, top = sys._getframe(1), None
    while frame is not None:
        if frame.f_globals is vars(main) and frame.f_code.co_name == "<module>":
            top = frame
        frame = frame.f_back
    if top is None:
        return None
    line = top.f_lineno
    try:
        tree = ast.parse(Path(path).read_text(), filename=str(path))
    except (OSError, SyntaxError, ValueError):
        return None

    def is_guard(test) -> bool:
        if not isinstance(test, ast.Compare) or len(test.ops) != 1 or not isinstance(test.ops[0], ast.Eq):
            return False
        sides = [test.left, test.comparators[0]]
        return (any(isinstance(x, ast.Name) and x.id == "__name__" for x in sides)
                and any(isinstance(x, ast.Constant) and x.value == "__main__" for x in sides))

    for node in ast.walk(tree):
        if isinstance(node, ast.If) and is_guard(node.test) and node.body:
            if node.body[0].lineno <= line <= (node.body[-1].end_lineno or node.body[-1].lineno):
                return None
    return str(path), line


def _check_main_guard() -> None:
    from pathlib import Path

    found = _unguarded_main_line()
    if found is not None:
        path, line = found
        # a plain message and exit status 1, no traceback: the fix is one line in the user's script
        raise SystemExit(
            f"sdpipe: {Path(path).name} line {line} trains at the top level of the script; put that code under "
            f"'if __name__ == \"__main__\":' (the embedded Dask cluster starts its workers by importing the script again)")


def _check_resume(path, config: TrainConfig, stage_modules):
    """The checkpoint at ``path``, after checking it fits this run (one-line ValueErrors naming the field)."""
    from .checkpoint import load_checkpoint

    ck = load_checkpoint(path)
    saved = ck.config
    for name in ("stages", "pipelines"):
        if saved[name] != getattr(config, name):
            raise ValueError(f"{name}: the checkpoint at {ck.path} has {name}={saved[name]}, this run {getattr(config, name)}")
    if ck.epoch >= config.epochs:
        raise ValueError(f"epochs: the checkpoint at {ck.path} is at epoch {ck.epoch}; ask for more than {ck.epoch} epochs to resume")
    for s, module in enumerate(stage_modules):
        state = ck.stage_state(0, s)
        if state.get("optimizer_name") != config.optimizer:
            raise ValueError(f"optimizer: the checkpoint at {ck.path} used {state.get('optimizer_name')!r}, this run {config.optimizer!r}")
        mine = module.state_dict()
        theirs = state["model"]
        for key in sorted(set(mine) | set(theirs)):
            if key not in mine or key not in theirs or tuple(mine[key].shape) != tuple(theirs[key].shape):
                have = tuple(theirs[key].shape) if key in theirs else "missing"
                want = tuple(mine[key].shape) if key in mine else "missing"
                raise ValueError(f"model: stage {s} parameter {key!r} is {have} in the checkpoint at {ck.path}, {want} in this model")
    return ck
