"""Launching a run's workers, in the background while ``train`` has already returned the :class:`~sdpipe.Run`.

In order, each step shown in :attr:`Run.startup`: start the embedded Dask cluster (if the run has none),
open the rendezvous store where the workers reach it and the group service on the Dask scheduler, choose
one free Dask worker per rank, copy the data to the first and last stages' workers, submit one task per rank
(pinned to its worker, never retried elsewhere), and start the run's monitor (:class:`~sdpipe.driver.watch.RunWatcher`).
"""

from __future__ import annotations

import threading
import time
import uuid

from sdpipe.core.policies import record
from sdpipe.driver.cluster import (
    bound_store,
    connect,
    host_cores,
    pick_workers,
    quiet_run_failures,
    route_address,
    run_bounded,
)
from sdpipe.driver.control import ControlPlane
from sdpipe.driver.result import RunError
from sdpipe.driver.watch import RunWatcher
from sdpipe.service import ensure_service
from sdpipe.wire.protocol import GroupServiceClient, GroupServiceError, WorkerSpec, run_prefix
from sdpipe.worker.loop import worker_main

__all__ = ["Launcher", "check_loadable", "submit_rank"]


def _load_on_worker(blobs: list) -> list:
    """(On a worker) unpickle each ``(what, bytes)``; ``(what, error type, message, missing module)`` of the ones
    that fail."""
    import pickle

    failed = []
    for what, blob in blobs:
        try:
            pickle.loads(blob)
        except Exception as e:
            failed.append((what, type(e).__name__, str(e), getattr(e, "name", None)))
    return failed


def check_loadable(client, workers: list, spec: WorkerSpec, timeout: float) -> None:
    """Every host of ``workers`` can load what the driver sends its workers (the stage modules, ``loss_fn``,
    ``metric``); else one line naming what, where, and the remedy (``ValueError``), before any rank starts.

    Objects whose classes live in a module the driver imported are pickled by reference, so a worker that cannot
    import that module fails while it receives its task; Dask would print its traceback several times and the
    task would end without an error of its own.  One worker per host is asked: its environment is the host's.
    """
    import cloudpickle

    parts = [(f"stage {s}'s module", m) for s, m in enumerate(spec.stage_modules)]
    parts += [(name, obj) for name, obj in (("loss_fn", spec.loss_fn), ("metric", spec.metric)) if callable(obj)]
    blobs = [(what, cloudpickle.dumps(obj)) for what, obj in parts]
    hosts: dict = {}
    for addr in workers:
        hosts.setdefault(addr.rsplit(":", 1)[0], addr)
    answers = run_bounded(
        client, _load_on_worker, blobs, workers=list(hosts.values()), timeout=timeout, what="check-loadable"
    )
    for addr, failed in answers.items():
        if isinstance(failed, BaseException):
            hint = " (install sdpipe, the same version, on the workers)" if "sdpipe" in str(failed) else ""
            raise RuntimeError(
                f"cluster: worker {addr} cannot run sdpipe's own code ({type(failed).__name__}: {failed}){hint}"
            )
        if failed:
            what, kind, message, module = failed[0]
            field = "model" if what.startswith("stage") else what
            remedy = (
                f"the workers need module {module!r}: install it there, send it with "
                f"client.upload_file('{module.split('.')[0]}.py'), or define the classes in the notebook or script"
                if module
                else "define what it needs in the notebook or script, or install it on the workers"
            )
            raise ValueError(f"{field}: worker {addr} cannot load {what} ({kind}: {message}); {remedy}")


def submit_rank(run, spec: WorkerSpec, rank: int, addr: str, placed: list, resume=None, join=None):
    """Submit rank ``rank``'s task, pinned to worker ``addr`` (never re-run elsewhere); stage 0 gets the inputs
    of its pipeline's ``placed`` (the data's futures, per pipeline of the launch), the last stage the targets.
    ``join``: a pipeline joining a running run (its generation names the task); it takes the copies of a live
    pipeline of the launch (Dask copies them to its workers)."""
    S = run.config.stages
    p, s = divmod(rank, S)
    if join is not None:  # a live launch pipeline's copies that are still there (a lost worker's are gone)
        p = next(
            (
                q
                for q in range(len(placed))
                if q not in run._members.lost and all(f is None or f.status == "finished" for f in placed[q])
            ),
            0,
        )
    fX, fY, fEX, fEY = placed[p]
    key = f"sdpipe-{run.run_id}-rank{rank}" + (f"-g{join['generation']}" if join else "")
    return run._client.submit(
        worker_main,
        spec,
        rank,
        fX if s == 0 else None,
        fY if s == S - 1 else None,
        fEX if s == 0 else None,
        fEY if s == S - 1 else None,
        resume,
        join,
        key=key,
        workers=[addr],
        allow_other_workers=False,
        resources={"GPU": 1} if run.config.device == "cuda" else None,
        pure=False,
        retries=0,
    )


class Launcher:
    """Launches one :class:`~sdpipe.Run` (it writes the run's cluster, store, control, workers and tasks)."""

    def __init__(self, run, spec: WorkerSpec, data: tuple, cluster, security, resume):
        self.run = run
        self._pending = [spec, data, cluster]  # dropped by the thread once used (see run())
        self._security, self._resume = security, resume

    def start(self) -> None:
        threading.Thread(target=self.run_thread, name=f"sdpipe-start-{self.run.run_id}", daemon=True).start()

    def run_thread(self) -> None:
        """(Background) launch; the run ends with the error if that fails.

        The data (tensors on numpy buffers) is dropped before the run is marked
        launched or done: this thread must not free them while the interpreter
        finalizes (see :meth:`RunWatcher.watch`).
        """
        run = self.run
        try:
            args, self._pending = self._pending, None
            try:
                self._launch(*args)
            finally:
                del args
        except BaseException as e:  # the run ends with it: result() raises it, status says "error"
            run._error = (
                e if isinstance(e, Exception) else RunError(f"the run's start was interrupted ({type(e).__name__})")
            )
            run._cleanup()
            run._done.set()
            return
        run._launched.set()
        if run._stop_requested:
            run._request_stop()

    def _launch(self, spec: WorkerSpec, data: tuple, cluster) -> None:
        import torch.distributed as dist

        run, cfg = self.run, self.run.config
        try:
            if run._client is None:
                run._startup = f"starting an embedded Dask cluster of {cfg.world_size} worker processes"
                run._client, run._cluster, run._own_client = connect(cluster, cfg, self._security)
            run._scheduler = run._client.scheduler.address
            run._startup = "opening the rendezvous store and the group service"
            run.store_host = cfg.host or route_address(run._client.scheduler.address)
            run._store = bound_store(run.store_host, cfg.timeout)
            run._run_store = dist.PrefixStore(run_prefix(run.run_id), run._store)
            run.store_port = run._store.port
            spec = spec.with_store(run.store_host, run._store.port)
            run._topic = spec.topic
            run._client.subscribe_topic(run._topic, run._inbox.on_event)
            self._open_control(spec)
            run._startup = "choosing the workers and copying the data to them (they load torch to take it)"
            workers, placed = self._place_data(data)
            run._workers = workers
            run._hosts = host_cores(run._client, workers)
            run.cores = sum(c for _, c in run._hosts.values() if c) or None
            run._startup = "checking that the workers can load the model"
            check_loadable(run._client, workers, spec, cfg.timeout)
            if run._cluster is None:  # a user's cluster: Dask's records of this run's failed ranks, until it ends
                quiet = dict(workers=workers, timeout=cfg.timeout, what="quiet")
                run_bounded(run._client, quiet_run_failures, run.run_id, **quiet)
            run._startup = "submitting the workers' tasks"
            run._futures = self._submit(spec, workers, placed)
            run._data_futures = [f for four in placed for f in four if f is not None]
            run._spec, run._placed = spec, placed  # pipelines that join later start from them
        except BaseException:
            run._cleanup()
            raise
        watcher = RunWatcher(run)
        run._monitor_thread = threading.Thread(target=watcher.watch, name=f"sdpipe-monitor-{run.run_id}", daemon=True)
        run._monitor_thread.start()

    def _open_control(self, spec: WorkerSpec) -> None:
        """The group service opens the run (from the checkpoint's scheduler when resuming); the store gets the
        first command."""
        run, cfg = self.run, self.run.config
        ensure_service(run._client)
        service = GroupServiceClient(run.run_id, client=run._client, token=uuid.uuid4().hex)
        state = self._resume.scheduler_for(cfg.pipelines) if self._resume is not None else None
        try:
            service.open(
                stages=cfg.stages,
                pipelines=cfg.pipelines,
                policy=run.scheduler_policy.to_dict(),
                policy_name=cfg.policy,
                topic=spec.topic,
                t0=run.t0,
                state=state,
            )
        except GroupServiceError as e:
            if state is None:
                raise
            raise ValueError(f"resume_from: the group service rejected the checkpoint's scheduler ({e})") from None
        run._control = ControlPlane(run._run_store, service, record(cfg.policy).mode, cfg.policy, run.heterogeneity)
        run._control.set_pipeline_ids(cfg.pipelines)

    def _submit(self, spec: WorkerSpec, workers: list, placed: tuple) -> list:
        run, S = self.run, self.run.config.stages
        return [
            submit_rank(
                run,
                spec,
                rank,
                addr,
                placed,
                resume=self._resume.stage_state(*divmod(rank, S)) if self._resume is not None else None,
            )
            for rank, addr in enumerate(workers)
        ]

    def _place_data(self, data) -> tuple:
        """Choose the workers and copy the data to the first and last stages' ones.

        A worker that leaves the cluster meanwhile (one that just died and is
        being restarted by its nanny) makes the copy fail: choose again, up
        to three times.
        """
        run, cfg, S = self.run, self.run.config, self.run.config.stages
        source, eval_source = data
        # stage 0 reads the inputs of a batch, the last stage its targets
        X, Y = source.part("inputs"), source.part("targets")
        EX, EY = (None, None) if eval_source is None else (eval_source.part("inputs"), eval_source.part("targets"))

        def scatter(obj, where):
            # one copy per worker, each its own key: a broadcast's replicas are dropped again by Dask's active
            # memory manager (down to one, within seconds, before the tasks hold them), and the ranks would then
            # fetch the data from that one worker, whose loss would lose the data for every rank
            if obj is None:
                return [None] * len(where)
            return [run._client.scatter(obj, workers=[w], hash=False) for w in where]

        for attempt in range(3):
            workers = pick_workers(run._client, cfg)
            first = [workers[p * S] for p in range(cfg.pipelines)]
            last = [workers[p * S + S - 1] for p in range(cfg.pipelines)]
            try:
                # per pipeline: (inputs, targets, eval inputs, eval targets) on its first and last stages' workers
                return workers, list(
                    zip(scatter(X, first), scatter(Y, last), scatter(EX, first), scatter(EY, last), strict=True)
                )
            except KeyError as e:  # the scheduler no longer knows a chosen worker
                if attempt == 2:
                    raise RuntimeError(f"cluster: worker {e} left the cluster while the run started") from None
                time.sleep(1.0)
