"""``sdpipe``: partial-reduce groups formed by the group service (and any policy switched to while training)."""

from __future__ import annotations

import concurrent.futures
import time

import torch

from sdpipe.core import sync_rules as rules
from sdpipe.wire.protocol import GroupServiceError
from sdpipe.worker.sync.base import STOP_GRACE, state_tensors
from sdpipe.worker.sync.groups import GroupPolicy

__all__ = ["Scheduled"]


class Scheduled(GroupPolicy):
    """Partial-reduce with groups decided by the central group service (SDPipe).

    After each optimizer step a worker asks for its group and averages with it (see :class:`GroupPolicy`);
    an epoch's end, and a stop, end with a global sync.  The stop comes with the service's answers
    (:meth:`decide_stop`).
    """

    def setup(self, worker) -> None:
        super().setup(worker)
        self.stop_answered = False  # an answer of the group service said the run is stopping
        self.stop_seen_at = None  # when stage 0 first read the driver's stop from the store (monotonic)
        # averaging overlapped with the next step (SchedulerPolicy.overlap): the run's setting until the service's
        # answers say otherwise (a live policy change)
        self.overlap = bool((worker.cfg.get("scheduler") or {}).get("overlap"))
        self.pool = None  # its one thread, made at the first overlapped step
        self.in_flight = None  # (future, step) of the averaging in flight
        #: steps an overlapped averaging may stay in flight before a step waits for it: the run's staleness bound
        #: P, as the connectivity bound's (within P steps of a worker its model has mixed)
        self.max_lag = int((worker.cfg.get("scheduler") or {}).get("staleness") or 10)
        self.worker = worker

    def decide_stop(self, store_stop: bool) -> bool:
        """Stage 0, at a step boundary: whether to stop (:func:`sdpipe.core.sync_rules.group_stop`).

        The group service says so in every answer decided after ``run.stop()``,
        and the members of a round get the same answer, so pipelines that
        average together stop after the same round (under the ``allreduce``
        preset: at the same step, and the replicas end identical).  The
        driver's flag in the run's store is the fallback, taken
        ``STOP_GRACE`` seconds after this worker first read it.
        """
        stop, self.stop_seen_at = rules.group_stop(
            self.stop_answered, store_stop, self.stop_seen_at, time.monotonic(), STOP_GRACE
        )
        return stop

    def _ask(self, worker, step: int, global_sync: bool) -> dict:
        answer = super()._ask(worker, step, global_sync)
        self.stop_answered = self.stop_answered or answer.stop
        return answer

    def after_step(self, worker, step: int) -> None:
        self.mass = rules.mass_after_step(self.mass)
        if self.in_flight is not None:
            future, asked = self.in_flight
            if not future.done() and step - asked < self.max_lag:
                # the group of an earlier step is still forming or averaging (it may be waiting for a slow
                # member): this step goes on without a ready signal of its own instead of waiting for it, and
                # the averaging lands as a correction at a later step boundary
                return
        # the last averaging first: its answer may also turn overlap off (a live policy change), and this step's
        # ready signal must not reach the service while that one's is still there
        self.settle(worker, step, boundary=False)
        if not self.overlap:
            answer = self._ask(worker, step, False)
            self._average(worker, answer, step)
            self.overlap = answer.overlap  # the service's policy, from the next step on
            return
        if self.pool is None:
            self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sdpipe-overlap")
        snapshot = [t.detach().clone() for t in state_tensors(worker)]
        self.in_flight = (self.pool.submit(self._background, worker, step, snapshot, self.mass), step)

    def _background(self, worker, step: int, snapshot: list, mass: float) -> tuple:
        """Overlapped averaging, in this policy's thread: the group service's answer, then the group's average
        of the weights as they were at the ready signal.  Returns ``(answer, snapshot, average, mass at the
        snapshot, mass after)``; ``average`` is None for a group of one.  A group that a lost member broke
        leaves ``average`` equal to the snapshot: no correction."""
        if worker.device.type == "cuda":  # the current device is per thread
            torch.cuda.set_device(worker.device)
        answer = worker.ask_group(step, global_sync=False, waiting=False)
        if len(answer.members) < 2:
            return answer, snapshot, None, mass, rules.mass_after_round(mass, answer.reason)
        average = [t.clone() for t in snapshot]
        _, after = self._exchange(worker, answer, step, average, mass, lane="background")
        return answer, snapshot, average, mass, after

    def settle(self, worker, step=None, boundary: bool = True) -> None:
        """Wait for the overlapped averaging in flight (if any) and apply it: the weights move by the group's
        average minus this replica's snapshot, and the mass by the group's mean mass minus the snapshot's.

        The wait is bounded by the run's timeout and recorded as a ``wait`` span when there was one: what
        ``"group"`` at a step (the next step's ready signal waited for it), ``"drain"`` at an epoch's end, a
        stop or a switch (``boundary``: the last group's whole round is waited for there)."""
        if self.in_flight is None:
            return
        future, asked = self.in_flight
        self.in_flight = None
        if boundary and not future.done():
            # an epoch's end (or a stop, a leave, a switch): a round still open for this ready signal closes now
            # with the members it holds, instead of the global sync waiting out its window
            try:
                worker.service.hurry(stage=worker.stage, pipeline=worker.pipeline)
            except GroupServiceError:  # the run or the service is gone: the wait below says so
                pass
        start = time.time()
        try:
            answer, snapshot, average, mass, after = future.result(timeout=worker.timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(
                f"stage {worker.stage} pipeline {worker.pipeline}: the group of step {asked} did not answer "
                f"and average within the run's timeout ({worker.timeout:.0f}s)"
            ) from None
        end = time.time()
        if end - start > 1e-4:
            what = "drain" if boundary else "group"
            worker.span("wait", step, None, start, end, what=what, group=answer.members, round=answer.round)
        self.stop_answered = self.stop_answered or answer.stop
        self.overlap = answer.overlap
        if average is not None:
            with torch.no_grad():
                for t, s0, avg in zip(state_tensors(worker), snapshot, average, strict=True):
                    t.add_(avg.sub_(s0))
        self.mass += after - mass

    def epoch_end(self, worker, step: int) -> None:
        self.settle(worker, step)
        self._global_sync(worker, step, self._ask(worker, step, True))

    def stopping(self, worker, step: int) -> None:
        """A last global sync, so a stopped run's replicas of a stage end identical (as after an epoch).

        Skipped when no step reached this replica since the last global sync: its mass is still 1
        (a step adds 1, a group leaves the mean of masses of at least 1, a global sync restarts it).
        """
        self.settle(worker, step)
        if self.mass != 1.0:
            self.epoch_end(worker, step)

    def close(self, failed: bool = False) -> None:
        """Finish the averaging in flight (a live switch away), or abandon it (a failure), then release."""
        if self.in_flight is not None and not failed:
            self.settle(self.worker)
        self.in_flight = None
        if self.pool is not None:
            self.pool.shutdown(wait=not failed, cancel_futures=True)
            self.pool = None
        super().close(failed)
