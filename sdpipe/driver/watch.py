"""Watching a launched run until every worker ended: failures, lost workers, stalls, checkpoints.

:class:`RunWatcher` runs in the run's monitor thread.  Every 50 ms it looks at the workers' Dask tasks; once a
second it asks the Dask scheduler which workers are still there.  What it finds decides how the run goes on:

* a task that failed because its worker process died, a Dask worker that left the cluster in two checks in a
  row, or a worker that sent no event for :func:`stall_limit` seconds: the worker is **lost**.  Under a
  loss-tolerant policy its pipeline drops out (a ``worker-lost`` record, the store's mark, the group service
  told) and the others go on; otherwise the run stops with an error naming it;
* a communication failure: a peer of its pipeline may have died; the loss gets ``LOSS_GRACE`` seconds to show
  before the failure counts as the run's error;
* any other failure: the run stops; its error is the first failure that was not a communication failure.

Once every live worker finished, the watcher collects their results, waits (bounded) for their last events
and assembles the :class:`~sdpipe.RunResult`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import shutil
import time
from typing import Optional

from sdpipe.checkpoint import close_parts, finish, staging
from sdpipe.core.policies import of_mode
from sdpipe.core.scheduler import bounds_of
from sdpipe.driver.cluster import workers_now
from sdpipe.driver.result import RunError, assemble, plain_config
from sdpipe.wire import events
from sdpipe.wire.protocol import Keys, PeerLost, close_group, mark_lost

__all__ = ["RunWatcher", "stall_limit"]

log = logging.getLogger("sdpipe")

#: Seconds a communication failure waits for the loss of a worker of its own pipeline to show.
LOSS_GRACE = 10.0


class LostWorker(RunError):
    """The run cannot go on without a lost worker."""


def stall_limit(timeout: float) -> float:
    """Seconds a running worker may send no event before it counts as stalled: longer than any of its waits
    (each is bounded by the run's ``timeout``) and a step or an evaluation on either side of one."""
    return 2 * timeout + 60.0


def is_cancelled(exc) -> bool:
    """The task was cancelled (Dask's ``FutureCancelledError`` is a ``concurrent.futures.CancelledError``), not
    failed by an exception of its own."""
    return isinstance(exc, (concurrent.futures.CancelledError, asyncio.CancelledError))


def is_comm_failure(exc) -> bool:
    """The worker's exchange with a peer failed on the wire (:class:`~sdpipe.wire.protocol.PeerLost`)."""
    return isinstance(exc, PeerLost)


def is_worker_death(exc) -> bool:
    """The task failed because its worker process died (Dask gives up on it: ``KilledWorker``)."""
    from distributed.scheduler import KilledWorker

    return isinstance(exc, KilledWorker)


def first_checkpoint(after: int, every: int, epochs: int) -> Optional[int]:
    """The epoch of the next checkpoint after epoch ``after`` (None: no more)."""
    if not every:
        return None
    e = (after // every + 1) * every
    return e if e <= epochs else None


class CheckpointWriter:
    """The driver's part of a checkpoint: once every worker present wrote its part of the next one, the manifest,
    then the folder into place (:func:`sdpipe.checkpoint.finish`), a ``checkpoint`` record and the run's list."""

    def __init__(self, run):
        self.run = run
        #: the epoch of the next checkpoint (None: no more)
        self.next = first_checkpoint(run.start_epoch, run.config.checkpoint_every, run.config.epochs)

    def _skip(self, epoch: int, folder, versions: set) -> None:
        """The checkpoint of ``epoch`` is left out: its parts were written on both sides of a re-cut."""
        shutil.rmtree(folder, ignore_errors=True)
        why = f"its parts were written on both sides of a re-cut (cut versions {sorted(versions)})"
        log.warning("sdpipe: run %s wrote no checkpoint after epoch %d: %s", self.run.run_id, epoch, why)
        at = time.time() - self.run.t0
        self.run._inbox.add(events.control("checkpoint-skipped", at, applied_by="driver", epoch=epoch, reason=why))
        self.next = first_checkpoint(epoch, self.run.config.checkpoint_every, self.run.config.epochs)

    def poll(self) -> Optional[BaseException]:
        """Once every live worker wrote its part of the next checkpoint: the manifest, then the folder into place."""
        run, cfg, epoch = self.run, self.run.config, self.next
        # the checkpoint after `epoch` epochs is written at the end of epoch `epoch - 1`: by the pipelines
        # there then, not by one that joined later (it would never write this one)
        present = [p for p in run.pipelines if run._members.joined_in.get(p, -1) < epoch]
        ranks = [p * cfg.stages + s for p in present for s in range(cfg.stages)]
        try:
            if run._run_store.add(Keys.checkpoint_count(epoch), 0) < len(ranks):
                return None
            # the count also holds the parts of a pipeline that wrote and then left: wait for each present worker's
            # own part (finishing before one is in place moved the folder away under its rename)
            folder = staging(cfg.checkpoint_dir, epoch, run.run_id)
            if not all((folder / f"rank{r}.pt").exists() for r in ranks):
                return None
            # the parts of the pipelines not in it: one that left before it saw its leave may be writing its part
            gone = [r for r in range(run._members.ids * cfg.stages) if r // cfg.stages not in present]
            lost = [r for r in gone if r // cfg.stages in run._members.lost]
            if not close_parts(run._run_store, cfg.checkpoint_dir, epoch, run.run_id, gone, lost):
                return None
            versions = {int(run._run_store.get(Keys.checkpoint_cut(epoch, r))) for r in ranks}
            if len(versions) > 1:  # a re-cut fell between pipelines' ends of that epoch: its parts are cut two ways
                self._skip(epoch, folder, versions)
                return None
            cfg = dataclasses.replace(cfg, cuts=run._cuts_by_version.get(versions.pop(), cfg.cuts))
            steps = {str(p): int(run._run_store.get(Keys.checkpoint_steps(epoch, p * cfg.stages))) for p in present}
            scheduler = None
            if of_mode(run._control.mode).uses_service:
                scheduler = run._control.service.state()["core"]
            folder = finish(
                cfg.checkpoint_dir,
                epoch,
                run.run_id,
                {
                    "run_id": run.run_id,
                    "ranks": ranks,
                    "pipelines": present,
                    "steps": steps,
                    "config": plain_config(cfg),
                    "policy": run.policy,
                    "scheduler": scheduler,
                    "lost": {str(p): w for p, w in run._members.lost.items()},
                },
            )
        except Exception as e:
            return RunError(
                f"checkpoint_dir: could not write the checkpoint of epoch {epoch} ({type(e).__name__}: {e})"
            )
        run.checkpoints.append(str(folder))
        run._inbox.add(events.checkpoint(epoch, str(folder), time.time() - run.t0))
        self.next = first_checkpoint(epoch, cfg.checkpoint_every, cfg.epochs)
        return None


class RunWatcher:
    """The monitor of one :class:`~sdpipe.Run` (it reads the run's tasks and writes its outcome)."""

    def __init__(self, run):
        self.run = run
        self.config = run.config
        self.checkpoints = CheckpointWriter(run)
        self._missing: set = set()  # ranks whose Dask worker was missing at the last check
        self._comm_seen: dict = {}  # rank -> when its communication failure was first seen
        self._stall_base: Optional[float] = None  # from when silence counts (the launch, or the last resume)

    def watch(self) -> None:
        """(The monitor thread) until the run ended: then its result or error, its cleanup, done."""
        run = self.run
        error: Optional[BaseException] = None
        results: Optional[dict] = {}
        try:
            error = self._until_ended()
            # the checkpoints written as the workers ended: every one still to finish (the last epochs of a fast run
            # can end between two of the monitor's looks, and a look finishes one checkpoint)
            while error is None and self.checkpoints.next is not None:
                waiting = self.checkpoints.next
                error = self.checkpoints.poll()
                if self.checkpoints.next == waiting:
                    break
            results = self._collect()
            if error is not None and not isinstance(error, LostWorker):
                error = root_cause(run) or error
            run._inbox.wait_for({r: res.events for r, res in results.items()}, run.run_id)
            bounds = self._bounds() if error is None else []
            if error is None:
                run._result = assemble(
                    run.config,  # its cut as the run ended (a re-cut changes it)
                    run._stage_modules,
                    results,
                    run._members.lost,
                    run.events,
                    run._from_sequential,
                    left=run._members.left,
                    pipelines=run._members.ids,
                    bounds=bounds,
                )
        except BaseException as e:  # keep the handle usable whatever happened
            error = error or e
        finally:
            # the workers' weights (tensors on numpy buffers) are dropped here, before the run is done: a caller
            # that exits right after result() must not leave this thread freeing them while the interpreter
            # finalizes (freeing one takes the GIL there, which kills the thread and aborts the process)
            results = None
            run._error = error
            run._cleanup()
            run._done.set()

    def _bounds(self) -> list:
        """The connectivity bound per stage at the end (:attr:`sdpipe.RunResult.bounds`), from the group service's
        state under a policy that uses it; empty otherwise or when the service does not answer."""
        run = self.run
        try:
            if not of_mode(run._control.mode).uses_service:
                return []
            # bounded well inside the run's end: a slow answer leaves the result without them, not the run waiting
            return bounds_of(run._control.service.state(within=5.0)["core"])
        except Exception as e:  # the result goes on without it
            log.warning("sdpipe: run %s: no scheduler state at the end (%s)", run.run_id, e)
            return []

    def _until_ended(self) -> Optional[BaseException]:
        run, S = self.run, self.config.stages
        error: Optional[BaseException] = None
        grace_until = lost_at = None
        last_check = time.monotonic()
        while True:
            if not run._joined():
                self._count_ranks()
            futures = run._futures
            statuses = [f.status for f in futures]
            live = [r for r in range(len(statuses)) if r // S not in run._members.lost]
            trained = [r for r in live if r // S not in run._members.joining]
            if run._joins_pending() and all(statuses[r] == "finished" for r in trained):
                # the others finished: a pipeline still waiting for its state gives up (bounded: it polls)
                run._ending = True
                run._cancel_joins()
            if all(statuses[r] == "finished" for r in live) and not (run._joins_pending() and not run._ending):
                # the lost pipelines' other workers fail on their own (their peers are gone); bounded
                gone = [r for r in range(len(statuses)) if r // S in run._members.lost]
                if all(statuses[r] != "pending" for r in gone) or (
                    lost_at is not None and time.monotonic() > lost_at + self.config.timeout + 10
                ):
                    return error
            if error is None:
                error = self.checkpoints.poll() if self.checkpoints.next is not None else None
                error = error or self._failures(statuses, live)
                if error is None and time.monotonic() - last_check > 1.0:
                    last_check = time.monotonic()
                    error = self._departures()
                error = error or self._check_stalls(statuses, live)
                if run._members.lost and lost_at is None:
                    lost_at = time.monotonic()
                if error is not None:
                    run._request_stop()
                    grace_until = time.monotonic() + min(10.0, self.config.timeout)
            elif all(s != "pending" for s in statuses) or time.monotonic() > grace_until:
                return error
            time.sleep(0.05)

    def _count_ranks(self) -> None:
        """How many ranks started and connected (counters the workers add to in the run's store)."""
        run = self.run
        try:
            run._ranks = {
                "started": run._run_store.add(Keys.RANKS_STARTED, 0),
                "ready": run._run_store.add(Keys.RANKS_READY, 0),
            }
        except Exception:  # the store is closing: the run is ending
            pass

    def _failures(self, statuses: list, live: list) -> Optional[BaseException]:
        """The run's error from a live worker's failed task, if any (a dead worker's is a loss instead)."""
        run = self.run
        for rank in live:
            if statuses[rank] not in ("error", "cancelled"):
                continue
            failure = describe_failure(run, rank, run._futures[rank])
            p = rank // self.config.stages
            if p in run._members.joining:  # a pipeline that had not joined yet: the run goes on without it
                run._join_failed(p, str(failure.__cause__ or failure))
                continue
            if is_worker_death(failure.__cause__):
                error = self._on_lost(rank, "its worker process died")
            elif failure.__cause__ is None or is_cancelled(failure.__cause__):
                # the Dask scheduler dropped the task without an exception of its own: its worker left (a worker
                # killed while its task was still being handed to it, on a cluster that allows failures)
                error = self._dropped(rank, failure)
            elif is_comm_failure(failure.__cause__):
                # a peer of its pipeline may have died: give that loss time to show
                error = (
                    failure
                    if time.monotonic() - self._comm_seen.setdefault(rank, time.monotonic()) > LOSS_GRACE
                    else None
                )
            else:
                error = failure
            if error is not None:
                return error
        return None

    def _alive(self):
        """The addresses of the cluster's workers now, or the run's error when the Dask scheduler is gone."""
        try:
            return set(workers_now(self.run._client))
        except Exception as e:
            return RunError(f"lost the Dask scheduler: {type(e).__name__}: {e}")

    def _dropped(self, rank: int, failure: BaseException) -> Optional[BaseException]:
        """A task that ended with no exception (cancelled, or erred without one, by the Dask scheduler): lost when
        its Dask worker left the cluster, looked for during ``LOSS_GRACE`` seconds; else the run's error."""
        alive = self._alive()
        if isinstance(alive, RunError):
            return alive
        if self.run._workers[rank] not in alive:
            return self._on_lost(rank, "its Dask worker left the cluster")
        if time.monotonic() - self._comm_seen.setdefault(rank, time.monotonic()) <= LOSS_GRACE:
            return None
        p, s = divmod(rank, self.config.stages)
        return RunError(
            f"worker pipeline {p} stage {s} (rank {rank}, {self.run._workers[rank]}): the Dask scheduler dropped "
            "its task without an error of its own (cancelled, or its worker restarted)"
        )

    def _departures(self) -> Optional[BaseException]:
        """A worker whose Dask worker left the cluster in two checks in a row (a second apart) is lost."""
        run = self.run
        alive = self._alive()
        if isinstance(alive, RunError):
            return alive
        missing = {
            r
            for r, addr in enumerate(run._workers)
            if addr is not None and addr not in alive and run._futures[r].status == "pending"
        }
        confirmed, self._missing = sorted(missing & self._missing), missing
        for rank in confirmed:
            if rank // self.config.stages not in run._members.lost:
                error = self._on_lost(rank, "its Dask worker left the cluster")
                if error is not None:
                    return error
        return None

    def _check_stalls(self, statuses: list, live: list) -> Optional[BaseException]:
        """A live worker still running that sent no event for :func:`stall_limit` seconds since the launch (the
        run not paused) is stalled: in a wait that neither ends nor fails.  It is treated as lost (its pipeline
        drops out where the policy allows, else the run stops with an error naming it), so a run never waits for
        it for ever."""
        run, now = self.run, time.monotonic()
        # from the launch (a worker can stall while it starts: in its rendezvous, say); a paused pipeline
        # records nothing while it holds
        if not run._launched.is_set() or run.paused or self._stall_base is None:
            self._stall_base = now
            return None
        limit = stall_limit(self.config.timeout)
        for rank in live:
            last = max(run._inbox.heard(rank), self._stall_base)
            if statuses[rank] == "pending" and now - last > limit:
                return self._on_lost(
                    rank,
                    f"it sent nothing for {now - last:.0f}s, stalled in a wait that neither "
                    f"ended nor failed (each wait's bound is timeout={self.config.timeout:g}s)",
                )
        return None

    def _on_lost(self, rank: int, why: str) -> Optional[BaseException]:
        """A worker is gone.  Returns the run's error, or None when the other pipelines go on without its pipeline."""
        run, cfg = self.run, self.config
        p, s = divmod(rank, cfg.stages)
        what = f"worker pipeline {p} stage {s} (rank {rank}, {run._workers[rank]})"
        replace = False
        if not of_mode(run._control.mode).loss_tolerant:
            replace = self._replaceable(p, why)
            if not replace:
                return LostWorker(f"{what} was lost ({why}); policy {run.policy!r} cannot go on without it")
        run._members.lose(p, f"{what} was lost ({why})")
        run._give_up_join(p)  # lost while joining: its other workers stop waiting for a state
        if run._futures[rank].status == "pending":
            # its worker is gone: without this, a cluster that allows failures would run the rank again on
            # another worker, where it could only wait for a pipeline that is no more
            run._futures[rank].cancel()
        run._inbox.add(events.worker_lost(p, s, time.time() - run.t0, run._workers[rank], why))
        rejoin = (cfg.rejoin or replace) and not run._stop_requested
        log.warning(
            "sdpipe: %s; the run goes on with %d pipeline(s)%s",
            run._members.lost[p],
            len(run.pipelines),
            " and a replacement that joins once workers are free (it was lost before the first step)"
            if replace
            else " and takes it back once workers are free (rejoin)"
            if rejoin
            else "",
        )
        if not run.pipelines and not run._joins_pending():
            return RunError(f"every pipeline was lost; last: {run._members.lost[p]}")
        try:  # the others stop pairing with it, the scheduler takes it out of every stage
            mark_lost(run._run_store, p, why)
            run._control.service.lose_pipeline(p)
        except Exception as e:
            log.warning("sdpipe: could not tell the group service that pipeline %d was lost: %s", p, e)
        if rejoin:
            run._rejoin_later(p)
        return None

    def _replaceable(self, p: int, why: str) -> bool:
        """Under ``allreduce``, whether lost pipeline ``p`` can be replaced: it was lost before any stage's first
        group formed (then the others form it without ``p``, and a replacement joins them like an added pipeline).

        ``p`` is marked lost first, then each stage's first group is closed to it: one compare-and-set on that
        group's verdict (:func:`sdpipe.worker.comm.make_group`), so either the group formed already (the run cannot go
        on) or it never forms with ``p``, whatever the members saw first."""
        from sdpipe.config import ASYNC_SCHEDULE_NAMES

        run, cfg = self.run, self.config
        coupled = of_mode(run._control.mode).coupled
        if not coupled or cfg.pipelines < 2 or run._members.ids != cfg.pipelines or run._stop_requested:
            return False
        if cfg.schedule in ASYNC_SCHEDULE_NAMES or (run._spec is not None and run._spec.streamed):
            return False  # a pipeline cannot join such a run (Run.add_pipelines says why)
        try:
            mark_lost(run._run_store, p, why)
            return all([close_group(run._run_store, f"stage{s}") for s in range(cfg.stages)])
        except Exception:  # the store is gone: the run is ending
            return False

    def _collect(self) -> dict:
        run, S = self.run, self.config.stages
        results = {
            rank: f.result(timeout=self.config.timeout)
            for rank, f in enumerate(run._futures)
            if f.status == "finished" and rank // S not in run._members.lost
        }
        for rank, res in results.items():  # pipelines that left, or gave their join up as the run ended
            p = rank // S
            if res.left:
                run._members.leave(p, f"removed at step {res.steps}")
            elif not res.joined:
                run._members.leave(p, "the run ended before it joined")
            run._members.ended(p)
        finished = {rank // S for rank in results}
        members = run._members
        for p in range(members.ids):
            # a join still waiting for workers as the run ended: its thread may say so only after this point
            if p not in finished and p not in members.lost and p not in members.left:
                members.leave(p, "the run ended before it joined")
        return results


def root_cause(run) -> Optional[BaseException]:
    """The failure that started it: peers of a failed worker fail after it with communication errors."""
    failed = [(r, f) for r, f in enumerate(run._futures) if f.status == "error"]
    if not failed:
        return None
    errors = [(r, describe_failure(run, r, f)) for r, f in failed]
    primary = next((e for r, e in errors if not is_comm_failure(e.__cause__)), errors[0][1])
    if len(errors) > 1:
        others = "; ".join(f"rank {r}: {str(e.__cause__ or e)[:160]}" for r, e in errors if e is not primary)
        primary.args = (
            f"{primary.args[0]} ({len(errors) - 1} other worker(s) failed after it: {others})".replace("\n", " "),
        )
    return primary


def describe_failure(run, rank: int, future) -> BaseException:
    """The run's error for worker ``rank``'s failed task: who, at which step, and the task's exception as its cause."""
    p, s = divmod(rank, run.config.stages)
    try:
        exc = future.exception(timeout=5)
    except Exception as e:  # cancelled futures raise here
        exc = e
    at = getattr(exc, "sdpipe_step", None)  # the worker's step and epoch when it failed
    when = f" at step {at[0]} (epoch {at[1]})" if isinstance(at, tuple) and len(at) == 2 else ""
    err = RunError(
        f"worker pipeline {p} stage {s} (rank {rank}, {run._workers[rank]}) failed{when}: {type(exc).__name__}: {exc}"
    )
    err.__cause__ = exc if isinstance(exc, BaseException) else None
    return err
