"""The driver's handle on a run: :class:`Run`, returned by ``sdpipe.train`` at once.

A run's jobs live in their own modules, and :class:`Run` holds what they share:

* launching (:mod:`sdpipe.driver.launch`): the cluster, the store, the group service, the workers' tasks, in a
  background thread, each step shown in :attr:`Run.startup`;
* steering (:mod:`sdpipe.driver.control`): pause, resume, stop, heterogeneity, policy, kernel shaping;
* watching (:mod:`sdpipe.driver.watch`): failures, lost workers, stalls and checkpoints, in the monitor thread;
* the result (:mod:`sdpipe.driver.result`), assembled once every worker ended.

Events arrive in the background through the Dask event log into an :class:`EventInbox`, so reading them
never waits on a worker.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import weakref
from typing import Optional

from sdpipe.config import Heterogeneity, TrainConfig
from sdpipe.core.policies import record
from sdpipe.driver.cluster import (
    _closing_quietly,
    connect,
    count_workers,
    run_bounded,
    unquiet_run_failures,
    workers_now,
)
from sdpipe.driver.control import Steering
from sdpipe.driver.elastic import Elastic
from sdpipe.driver.result import RunError, RunResult, history
from sdpipe.hosts import EmulatedHosts
from sdpipe.simulation.whatif import check_window, last_end
from sdpipe.wire.events import membership, unpack
from sdpipe.wire.protocol import WorkerSpec

__all__ = ["EventInbox", "Run", "RunError", "RunResult"]

log = logging.getLogger("sdpipe")

#: the runs this process started (each forgotten once its handle is dropped): a run that trains beside another
#: says so (:attr:`Run.concurrent`)
_RUNS: "weakref.WeakSet" = weakref.WeakSet()


class EventInbox:
    """The run's event records as they arrive, and when each rank was last heard from (thread-safe)."""

    def __init__(self):
        self._events: list = []
        self._lock = threading.Lock()
        self._received: dict = {}  # rank -> records received
        self._heard: dict = {}  # rank -> monotonic time its last batch arrived

    def on_event(self, event) -> None:
        """A batch from the Dask event log: ``(time, {"rank", "seq", "events"})``."""
        _, msg = event
        batch = unpack(msg["events"])
        for rec in batch:  # msgpack hands lists back as tuples
            if "group" in rec:
                rec["group"] = list(rec["group"])
        with self._lock:
            self._events.extend(batch)
            self._received[msg["rank"]] = self._received.get(msg["rank"], 0) + len(batch)
            self._heard[msg["rank"]] = time.monotonic()

    def add(self, record: dict) -> None:
        with self._lock:
            self._events.append(record)

    def since(self, cursor: int) -> tuple:
        with self._lock:
            new = self._events[cursor:]
        return new, cursor + len(new)

    def all(self) -> list:
        with self._lock:
            return list(self._events)

    def heard(self, rank: int) -> float:
        return self._heard.get(rank, 0.0)

    def wait_for(self, counts: dict, run_id: str, timeout: float = 10.0) -> None:
        """Wait (bounded) until ``counts[rank]`` records of each rank have arrived."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if all(self._received.get(r, 0) >= n for r, n in counts.items()):
                    return
            time.sleep(0.02)
        log.warning("sdpipe: some events of run %s did not arrive within %.0fs", run_id, timeout)


class Run(Steering, Elastic):
    """Handle of a running (or finished) training run.

    Usable from a notebook while training goes on: ``events_since`` returns the
    new events, ``stop`` ends the run at the next step boundary, ``result``
    blocks for the outcome; the steering calls are :class:`~sdpipe.driver.control.Steering`'s, and adding and removing
    pipelines while it runs :class:`~sdpipe.driver.elastic.Elastic`'s.
    """

    def __init__(
        self,
        config: TrainConfig,
        stage_modules,
        spec: WorkerSpec,
        data: tuple,
        cluster,
        from_sequential: bool = True,
        resume=None,
        security=None,
    ):
        from sdpipe.driver.launch import Launcher  # loads torch and Dask: not at ``import sdpipe``

        self.config = config
        self.run_id = spec.run_id
        #: The first epoch this run trains (later than 0 when resumed from a checkpoint).
        self.start_epoch = spec.start_epoch
        #: Folders of the checkpoints this run wrote, oldest first.
        self.checkpoints: list = []
        #: Steps each pipeline takes per epoch.
        self.steps_per_epoch = spec.steps_per_epoch
        #: Steps of all pipelines together in one epoch.
        self.updates_per_epoch = (
            spec.steps_per_epoch * config.pipelines if record(config.policy).coupled else spec.batches_per_epoch
        )
        #: Name of the metric the evaluation reports (its key in the epoch records), or None: the loss alone.
        self.metric = spec.metric_name
        #: Whether each epoch ends with an evaluation on held-out data (``eval_data`` given).
        self.held_out = bool(spec.eval_size)
        self.policy = config.policy
        self.scheduler_policy = config.scheduler_policy()
        self.heterogeneity = config.heterogeneity or Heterogeneity()
        #: Each layer's measured cost (:class:`sdpipe.driver.layers.LayerCost`) where the run was cut by time
        #: (``cuts="time"``; ``config.cuts`` holds the cut chosen), else None.
        self.layer_costs: Optional[list] = None
        #: Cores of the hosts the workers run on (known once the workers are chosen).
        self.cores: Optional[int] = None
        #: Address and port of the run's rendezvous store (``host=``, else the one routing to the Dask scheduler).
        self.store_host: Optional[str] = None
        self.store_port: Optional[int] = None
        self._t0 = spec.t0
        self._from_sequential = from_sequential
        self._stage_modules = stage_modules
        self._first_cuts = spec.cuts
        self._rebalancer = None  # its automatic re-cuts (TrainConfig.rebalance), set by train()
        self._emulated = cluster if isinstance(cluster, EmulatedHosts) else None
        self._init_state()
        _RUNS.add(self)
        self._init_membership()
        if cluster is not None:
            self._connect_existing(cluster, security)
        Launcher(self, spec, data, cluster, security, resume).start()

    def _init_state(self) -> None:
        """The run's own state: its events, its life (launched, done, result or error), its Dask and store handles."""
        self._inbox = EventInbox()
        self._done, self._launched = threading.Event(), threading.Event()
        self._result: Optional[RunResult] = None
        self._error: Optional[BaseException] = None
        self._stop_requested = False
        self._workers: list = []
        self._futures: list = []
        self._data_futures: list = []
        self._hosts: dict = {}
        self._ranks = {"started": 0, "ready": 0}
        self._client = self._cluster = self._store = self._run_store = self._control = self._topic = None
        self._own_client = False
        self._monitor_thread: Optional[threading.Thread] = None
        self._startup = "connecting to the Dask cluster"
        self._began, self._ended = time.monotonic(), None
        self._scheduler: Optional[str] = None  # the Dask scheduler's address, once connected
        self._probe: Optional[tuple] = None  # (a micro-batch, its targets, the loss): a re-cut probes with it
        self._recut_lock = threading.Lock()  # one re-cut at a time
        #: re-cut version -> its cut points, as the configuration names them (a checkpoint's manifest)
        self._cuts_by_version: dict = {0: self.config.cuts}

    def _connect_existing(self, cluster, security) -> None:
        """An existing cluster is reached (bounded) and checked here, so that a wrong address or too few workers
        raises from train() itself; an embedded cluster starts in the background."""
        self._client, self._cluster, self._own_client = connect(cluster, self.config, security)
        try:
            count_workers(self._client, self.config)
        except BaseException:
            self._cleanup()
            raise

    # ------------------------------------------------------------ start-up
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
    def cuts(self) -> Optional[tuple]:
        """Where the model's layers are cut into stages now (the first layer of stages 1..S-1; :meth:`recut` moves
        them), or None for a model given as a list of stage modules."""
        return self._spec.cuts if self._spec is not None else self._first_cuts

    @property
    def rebalancing(self) -> Optional[str]:
        """What the automatic re-cuts (``rebalance=``) are at, in one line: measuring, balanced (with the stages'
        times), a re-cut made or put off and why; None for a run without them."""
        return None if self._rebalancer is None else self._rebalancer.state

    @property
    def t0(self) -> float:
        """The run's time origin (seconds since the epoch): event times count from it."""
        return self._t0

    def _joined(self) -> bool:
        return self._launched.is_set() and (self._ranks["ready"] >= self.config.world_size or bool(self._members.lost))

    def _wait_launched(self, what: str) -> None:
        """Wait (at most the run's timeout) until the run's workers are launched."""
        deadline = time.monotonic() + self.config.timeout
        while not self._launched.wait(0.1):
            if self._done.is_set():
                raise RuntimeError(f"{what}: run {self.run_id} has already ended ({self.status})")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{what}: run {self.run_id} still starting after {self.config.timeout:.0f}s ({self.startup})"
                )

    @property
    def concurrent(self) -> Optional[str]:
        """One line when another run of this process trained while this one did (None otherwise): they took the
        same cores (on one cluster, or on an embedded cluster each), so neither's speed is what it would be alone."""
        end = self._ended or time.monotonic()
        others = [
            r for r in list(_RUNS) if r is not self and r._began < end and (r._ended or time.monotonic()) > self._began
        ]
        if not others:
            return None
        shared = [r for r in others if r._scheduler is not None and r._scheduler == self._scheduler]
        where = "on the same Dask cluster" if shared else "on its own cluster, on this machine's cores"
        names = ", ".join(r.run_id for r in others[:3]) + (" and more" if len(others) > 3 else "")
        return (
            f"run {names} trained {where} while this one did: they shared the cores, so this run's samples/s and "
            f"step times are lower than alone"
        )

    @property
    def contention(self) -> Optional[str]:
        """One line when the run has more workers on a host than the host has cores (None otherwise)."""
        over = [(h, n, c) for h, (n, c) in self._hosts.items() if c and n > c]
        if not over:
            return None
        h, n, c = over[0]
        where = f" on {h}" if len(self._hosts) > 1 else ""
        return (
            f"{n} workers share {c} cores{where}: samples/s measure the machine's contention (a slowed or "
            f"waiting worker's share goes to the others), not what each worker would do on its own core"
        )

    # ------------------------------------------------------------ what it did so far
    @property
    def workers(self) -> list:
        """The Dask worker address of each rank (rank = pipeline x stages + stage); waits (bounded) for them."""
        if not self._launched.is_set() and not self._done.is_set():
            self._wait_launched("workers")
        return list(self._workers)

    def events_since(self, cursor: int = 0) -> tuple[list, int]:
        """``(new events, new cursor)``: the records that arrived after ``cursor``."""
        return self._inbox.since(cursor)

    @property
    def events(self) -> list:
        return self._inbox.all()

    def history(self) -> list:
        """Per-epoch, per-pipeline metrics received so far."""
        return history(self.events)

    def attribution(self, last: Optional[float] = None):
        """Where each worker's time went so far (:func:`sdpipe.attribution.attribute`): compute, pipeline bubble,
        waiting for its group, averaging, ...; ``last``: only the last this many seconds.  ``print()`` it for a
        table and the bottleneck in one sentence."""
        from sdpipe.attribution import attribute

        if last is not None:
            check_window(last)
        since = None if last is None else time.time() - self.t0 - last
        return attribute(self.events, since=since)

    def export_trace(self, path) -> str:
        """The records so far as a Chrome trace at ``path`` (:func:`sdpipe.trace_export.export_trace`: a track per
        worker, its rounds linked, its controls and epochs marked); open it in ui.perfetto.dev or chrome://tracing.
        Returns the path written."""
        from sdpipe.trace_export import export_trace

        return export_trace(self, path)

    def _config_at(self, t: Optional[float]) -> TrainConfig:
        """The run's configuration as it ran at ``t`` on its clock (None: now): its policy and heterogeneity as
        the driver's controls up to then set them (a policy's parameters set live: only now's are known; an
        earlier policy is taken with its defaults)."""
        if t is None:
            return dataclasses.replace(
                self.config, policy=self.policy, heterogeneity=self.heterogeneity, scheduler=self.scheduler_policy
            )
        policy, hetero, changed = self.config.policy, self.config.heterogeneity, False
        for e in self.events:
            if e.get("kind") == "control" and e.get("applied_by") == "driver" and e["start"] <= t:
                if e["what"] == "policy":
                    policy, changed = e["policy"], True
                elif e["what"] == "heterogeneity":
                    hetero = Heterogeneity.from_dict(e["heterogeneity"])
        scheduler = self.config.scheduler if not changed else None
        return dataclasses.replace(self.config, policy=policy, heterogeneity=hetero, scheduler=scheduler)

    def _prediction_source(self, until: Optional[float] = None):
        """The run as it was at ``until`` (None: now), for :mod:`sdpipe.simulation.whatif`: its records, its
        configuration, its workers' cores, the samples and epochs it had left."""
        from sdpipe.simulation.whatif import Source, renumbered

        events = self.events
        config = self._config_at(until)
        before = events if until is None else [e for e in events if e.get("end") is not None and e["end"] <= until]
        last_stage = config.stages - 1
        trained = sum(1 for e in before if e.get("kind") == "optimizer" and e.get("stage") == last_stage)
        epochs = [e["metrics"]["epoch"] for e in before if e.get("kind") == "epoch"]
        done_epochs = max(epochs, default=self.start_epoch - 1) + 1
        total = (config.epochs - self.start_epoch) * self.updates_per_epoch
        source = Source(
            before,
            config,
            self.cores or 0,
            self.updates_per_epoch,
            max(0, total - trained) * config.batch_size,
            max(0, config.epochs - done_epochs),
        )
        return renumbered(source, self._pipelines_at(until))

    def _pipelines_at(self, t: Optional[float]) -> list:
        """The pipelines taking part at ``t`` on the run's clock (None: its last record), from its join, leave and
        loss records (also once the run ended)."""
        present = set(range(self.config.pipelines))
        for e in self.events:
            change = membership(e)
            if change is not None and e.get("start") is not None and (t is None or e["start"] <= t):
                (present.add if change[1] else present.discard)(change[0])
        return sorted(present)

    def predict(self, last: float = 30.0, until: Optional[float] = None, cores="measured", **changes):
        """The samples/s this run would train at with ``changes`` (``policy``, ``schedule``, ``heterogeneity``,
        ``pipelines``, ``microbatches``; none: as it runs), simulated on the costs it measured in the ``last``
        seconds before ``until`` (the run's clock; None: its latest record), its workers sharing ``cores``
        (default: the machine's less what the other processes took, measured; see
        :func:`sdpipe.simulation.whatif.predict`).  With ``until``, the run as it was then: a prediction made
        just before a live change, to set against what the change brought."""
        from sdpipe.simulation.whatif import check_cores, predict

        check_window(last)
        check_cores(cores)
        source = self._prediction_source(until)
        return predict(source, since=last_end(source.events) - last, cores=cores, **changes)

    def what_if(self, last: float = 30.0, until: Optional[float] = None, cores="measured"):
        """Predictions for this run as it runs and for each single change (every other live policy, no
        heterogeneity, the other schedules, one pipeline more or fewer), beside the samples/s it measured, from
        its ``last`` seconds before ``until`` (:func:`sdpipe.simulation.whatif.what_if`; see :meth:`predict`).
        ``print()`` it for a table."""
        from sdpipe.simulation.whatif import check_cores, what_if

        check_window(last)
        check_cores(cores)
        source = self._prediction_source(until)
        return what_if(source, since=last_end(source.events) - last, cores=cores)

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

    # ------------------------------------------------------------ its outcome
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
        note = "; ".join(x for x in (self.concurrent, self.contention) if x)
        return (
            f"<sdpipe.Run {self.run_id} {c.stages}x{c.pipelines} policy={self.policy} {status}"
            + (f" ({startup})" if startup else "")
            + (f"; note: {note}" if note else "")
            + ">"
        )

    def _cleanup(self) -> None:
        """Close everything this run opened; safe to call more than once."""
        self._ended = self._ended or time.monotonic()
        client, control = self._client, self._control
        if client is not None and control is not None and self._store is not None:
            try:
                control.service.close()
            except Exception:
                pass
        if client is not None:
            try:
                client.unsubscribe_topic(self._topic)
            except Exception:
                pass
            if self._cluster is None and self._workers:  # a user's cluster: what the launch installed goes
                try:
                    there = set(workers_now(client))  # not a lost one's old address
                    alive = [a for a in self._workers if a in there]
                    run_bounded(client, unquiet_run_failures, self.run_id, workers=alive, timeout=10, what="unquiet")
                except Exception:
                    pass
            for f in self._futures + self._data_futures:
                if f is None:
                    continue
                try:
                    f.release()
                except Exception:
                    pass
            if self._cluster is not None:  # the embedded cluster closes next: its workers quietly (see close)
                try:
                    run_bounded(client, _closing_quietly, workers=None, timeout=5, what="close")
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
        if control is not None:
            control.close()
        self._run_store = None
        self._store = None  # dropping the last reference shuts the store's listener
