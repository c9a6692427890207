"""Pipelines joining and leaving a running run: the driver's half (the workers' half is in :mod:`sdpipe.worker.loop`).

A **join** (``Run.add_pipelines``, ``Run.scale``, or a lost pipeline coming back under ``rejoin=True``), in
the run's membership thread, one at a time::

    choose S free Dask workers (waiting, bounded, for workers the user adds; an embedded cluster grows)
    submit the new pipeline's S tasks: each connects, joins its pipeline's link, then waits for its state
    once all S connected: publish the join (a membership version in the Command)
    the first pipeline whose stage 0 reads it claims it (compare-and-set); at that step boundary each of
    its stages tells the group service the joiner joined (unioned with it) and hands over its weights,
    optimizer state, epoch and step through the store
    once all S took their state: a ``control`` record "joined"; the new pipeline takes its next batch

A **leave** (``Run.remove_pipeline``): publish it; the pipeline's stage 0 reads it at its next step boundary,
and each of its stages finishes the step, lands an averaging in flight and leaves the group service (so no
round waits for it); the shared batch counter hands its batches to the others.

Both work under the elastic policies (:attr:`sdpipe.core.policies.PolicyRecord.elastic`); under ``allreduce`` the
replicas agree on the step of the change in their gradient collective and form their group anew there
(:class:`~sdpipe.worker.sync.AllReduce`).  ``ps`` and ``adpsgd`` keep groups fixed at the start.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Optional

from sdpipe.config import ASYNC_SCHEDULE_NAMES
from sdpipe.core.checks import integer, is_integer
from sdpipe.core.membership import Membership
from sdpipe.core.policies import names, of_mode
from sdpipe.driver.cluster import free_workers, quiet_run_failures, run_bounded
from sdpipe.wire import events
from sdpipe.wire.protocol import Keys, MembershipChange, mark_lost

__all__ = ["Elastic"]

log = logging.getLogger("sdpipe")


def _listed(policies) -> str:
    """'a', 'b' and 'c'."""
    quoted = [repr(p) for p in policies]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} and {quoted[-1]}"


class _RunEnded(Exception):
    """The run ended (or is stopping) before a pipeline could join."""


class _NeverRan:
    """The task of a rank whose pipeline never started (its join failed before): counted as cancelled."""

    status = "cancelled"

    def release(self) -> None:
        pass


NEVER_RAN = _NeverRan()


class Elastic:
    """The membership calls of :class:`~sdpipe.Run` and the thread that carries out its joins."""

    def _init_membership(self) -> None:
        self._members = Membership(self.config.pipelines)  # which pipelines take part, and how each got there
        self._joins: queue.Queue = queue.Queue()
        self._member_thread: Optional[threading.Thread] = None
        self._member_lock = threading.Lock()
        self._spec = self._placed = None  # set by the launcher
        self._ending = False  # the monitor saw every other pipeline finish: no more joins

    # ------------------------------------------------------------ public
    @property
    def pipelines(self) -> list:
        """The pipelines taking part now: started or joined, not lost, not leaving (a join in progress is not)."""
        return self._members.present

    def add_pipelines(self, n: int = 1) -> list:
        """Add ``n`` pipelines to the running run; returns their ids at once, and they join in the background.

        Each new pipeline runs on free workers of the cluster (waiting, at most the run's ``timeout``, for
        workers added meanwhile; an embedded cluster starts them itself), takes the weights and optimizer state
        of a live replica of each stage at that replica's next step boundary, and trains from its next step. A
        ``control`` record ``what="joined"`` marks the moment; :attr:`pipelines` lists it from then on.
        """
        integer("n", n)
        self._check_elastic("add_pipelines")
        if self._spec is not None and self._spec.streamed:
            raise ValueError(
                "add_pipelines: the run reads an IterableDataset, sharded over the pipelines it started with; "
                "a new pipeline would have no shard of its own (a lost one can come back: rejoin=True)"
            )
        new = self._members.add(n)
        self._control.set_pipeline_ids(self._members.ids)
        for p in new:
            self._joins.put((p, "added"))
        self._record("add", pipelines=new)
        self._start_member_thread()
        return new

    def scale(self, pipelines: int) -> list:
        """Grow (or shrink) the run to ``pipelines`` pipelines: :meth:`add_pipelines` for the missing ones, or
        :meth:`remove_pipeline` for the newest ones beyond it.  Returns the pipelines added or removed."""
        integer("pipelines", pipelines)
        self._check_elastic("scale")
        now = self._members.expected
        if pipelines > now:
            return self.add_pipelines(pipelines - now)
        gone = sorted(self.pipelines)[pipelines:][::-1]
        for p in gone:
            self.remove_pipeline(p)
        return gone

    def remove_pipeline(self, pipeline: int) -> None:
        """Take ``pipeline`` out of the running run; the others go on.

        At its next step boundary each of its stages finishes the step, lands an averaging in flight and
        leaves the group service, so no round waits for it and no group is left half formed; its batches go
        to the others (the shared counter).  Its entry in ``RunResult.models`` is None and
        ``RunResult.left`` says when it left.
        """
        self._check_elastic("remove_pipeline")
        if not is_integer(pipeline) or pipeline not in self.pipelines:
            raise ValueError(f"pipeline: {pipeline!r} is not taking part in the run; it has {self.pipelines}")
        if len(self.pipelines) == 1:
            raise ValueError(f"pipeline: {pipeline} is the run's last pipeline; stop the run instead (run.stop())")
        self._members.ask_to_leave(pipeline)
        self._control.change_members(MembershipChange("leave", pipeline))
        self._record("leave", pipeline=pipeline)

    # ------------------------------------------------------------ checks
    def _check_elastic(self, what: str) -> None:
        self._require_running(what)
        mode = of_mode(self._control.mode)
        if not mode.elastic:
            raise ValueError(
                f"{what}: policy {self.policy!r} keeps a group of the pipelines fixed at the start; pipelines "
                f"join and leave a running run under {_listed(names(elastic=True))}"
            )
        if mode.coupled and self.config.schedule in ASYNC_SCHEDULE_NAMES:
            raise ValueError(
                f"{what}: under {mode.name!r} with the asynchronous schedule {self.config.schedule!r} micro-batches "
                f"cross the step where the members would change; use '1f1b' or 'gpipe', or "
                f"{_listed(names(elastic=True, coupled=False))}"
            )
        if mode.coupled and self._spec is not None and self._spec.streamed:
            raise ValueError(
                f"{what}: under {mode.name!r} the pipelines read fixed shards of the IterableDataset in lock step; "
                f"its pipelines cannot change (under {_listed(names(elastic=True, coupled=False))} they can leave)"
            )

    # ------------------------------------------------------------ the watcher's calls
    def _rejoin_later(self, pipeline: int) -> None:
        """(Monitor thread) a lost pipeline comes back once its old tasks ended and workers are free."""
        self._members.queue_rejoin(pipeline)
        self._joins.put((pipeline, "rejoin"))
        self._start_member_thread()

    def _joins_pending(self) -> bool:
        return self._members.pending

    def _cancel_joins(self) -> None:
        """(Monitor thread) the others finished: pipelines still waiting for their state give up."""
        for p in list(self._members.joining):
            self._give_up_join(p)

    def _give_up_join(self, pipeline: int) -> None:
        """Its workers (if launched) stop waiting for a state and end."""
        g = self._members.give_up_join(pipeline)
        if g is not None:
            try:
                self._run_store.set(Keys.join(pipeline, g, "cancel"), "1")
            except Exception:  # the store is gone: the run ended, its tasks fail at their next store call
                pass

    def _join_failed(self, pipeline: int, why: str) -> None:
        """A joining pipeline's task failed, or no replica gave it its state: it does not take part."""
        self._give_up_join(pipeline)
        said = self._members.join_failed(pipeline, why)
        at = time.time() - self.t0
        self._inbox.add(events.control("join-failed", at, applied_by="driver", pipeline=pipeline, reason=why))
        log.warning("sdpipe: %s", said)

        try:  # its workers still waiting stop pairing; the group service takes it out where it joined
            mark_lost(self._run_store, pipeline, why)
            self._control.service.lose_pipeline(pipeline)
        except Exception:
            pass

    # ------------------------------------------------------------ the membership thread
    def _start_member_thread(self) -> None:
        with self._member_lock:  # one thread; it ends only with nothing queued (decided under this lock)
            if self._member_thread is None:
                self._member_thread = threading.Thread(
                    target=self._member_loop, name=f"sdpipe-members-{self.run_id}", daemon=True
                )
                self._member_thread.start()

    def _member_loop(self) -> None:
        while not self._done.is_set() and not self._stop_requested:
            try:
                pipeline, why = self._joins.get(timeout=0.2)
            except queue.Empty:
                with self._member_lock:
                    if self._joins.empty():
                        self._member_thread = None
                        return
                continue
            try:
                try:
                    self._join(pipeline, why)
                finally:
                    self._members.unqueue(pipeline)
            except _RunEnded:
                self._give_up_join(pipeline)
                self._members.leave(pipeline, "the run ended before it joined")
            except Exception as e:  # the run goes on without it
                if not self._done.is_set():
                    self._join_failed(pipeline, f"{type(e).__name__}: {e}")

    def _join(self, p: int, why: str) -> None:
        S, cfg = self.config.stages, self.config
        ranks = [p * S + s for s in range(S)]
        if why == "rejoin":
            self._await_old_tasks(ranks)
            self._members.next_generation(p)
        ended = lambda: self._ending or self._stop_requested or self._done.is_set()
        try:
            more = S * len(self._members.queued - {p})  # the pipelines queued after it start their workers too
            workers = free_workers(self._client, S, cfg, self._cluster, more, give_up=ended)
        except InterruptedError:
            raise _RunEnded() from None
        if ended():
            raise _RunEnded()
        if why == "rejoin":
            self._run_store.delete_key(Keys.lost(p))  # its new workers pair again
        g = self._members.launch(p)
        self._run_stage_tasks(p, g, ranks, workers)
        if why == "rejoin":
            self._members.rejoined(p)
        start = time.monotonic()
        self._await_count(p, Keys.join(p, g, "ready"), S, ranks, "connect")
        version = self._control.change_members(MembershipChange("join", p, g))
        self._await_count(p, Keys.join(p, g, "loaded"), S, ranks, "take a replica's state")
        donor = int(self._run_store.get(Keys.join(p, g, "donor")))
        self._members.joined(p, int(self._run_store.get(Keys.join(p, g, "epoch"))))
        self._record(
            "joined",
            pipeline=p,
            donor=donor,
            generation=g,
            version=version,
            rejoin=why == "rejoin",
            seconds=round(time.monotonic() - start, 3),
            workers=workers,
        )

    def _await_old_tasks(self, ranks: list) -> None:
        """A lost pipeline's other workers end on their own (their peers are gone); bounded."""
        deadline = time.monotonic() + self.config.timeout + 10
        while any(self._futures[r].status == "pending" for r in ranks):
            if time.monotonic() > deadline or self._done.is_set():
                raise TimeoutError("its earlier workers were still running")
            time.sleep(0.1)

    def _run_stage_tasks(self, p: int, g: int, ranks: list, workers: list) -> None:
        """Submit the new pipeline's tasks, pinned to ``workers`` (never retried elsewhere)."""
        from sdpipe.driver.launch import submit_rank  # torch: not at ``import sdpipe``

        S = self.config.stages
        join = {"generation": g, "mode": self._control.mode, "policy": self._control.command.policy}
        # a worker process the nanny restarted has not run it yet; on a user's cluster, for this run only
        run_bounded(
            self._client,
            quiet_run_failures,
            *(() if self._cluster is not None else (self.run_id,)),
            workers=workers,
            timeout=self.config.timeout,
            what="quiet",
        )
        futures = list(self._futures) + [NEVER_RAN] * max(0, (p + 1) * S - len(self._futures))
        addresses = list(self._workers) + [None] * max(0, (p + 1) * S - len(self._workers))
        for rank, addr in zip(ranks, workers, strict=False):
            futures[rank] = submit_rank(self, self._spec, rank, addr, self._placed, join=join)
            addresses[rank] = addr
        self._workers, self._futures = addresses, futures  # the monitor reads them: whole lists at once

    def _await_count(self, p: int, key: str, n: int, ranks: list, what: str) -> None:
        """Wait until ``n`` of joiner ``p``'s workers added to ``key`` (bounded by the run's timeout, a pause
        not counted); a failed task of the joiner, or its loss, ends the wait (the monitor reports it)."""
        waited, last = 0.0, time.monotonic()
        while self._run_store.add(key, 0) < n:
            if self._done.is_set() or self._stop_requested or self._ending:
                raise _RunEnded()
            if p in self._members.lost:
                raise RuntimeError(f"it was lost: {self._members.lost[p]}")
            if any(self._futures[r].status != "pending" for r in ranks):
                raise RuntimeError(f"a worker of the pipeline ended before it could {what}")
            time.sleep(0.05)
            now = time.monotonic()
            waited += 0.0 if self.paused else now - last
            last = now
            if waited > self.config.timeout:
                raise TimeoutError(f"its workers did not {what} within the run's timeout ({self.config.timeout:g}s)")
