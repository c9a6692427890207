"""The runtime's batch dispenser in simulated time: which pipeline takes the next batch of an epoch."""

from __future__ import annotations

import numpy as np

from sdpipe.data import TAIL_BATCHES_PER_PIPELINE, smoothed_step_time, tail_goes_faster

__all__ = []


class _Batches:
    """An epoch's ``steps x pipelines`` batches go to whichever pipeline asks next (lock step under allreduce:
    ``steps`` each), unless the epoch-tail rule (:func:`sdpipe.data.leaves_tail`) leaves its last batches to
    faster pipelines.  The rule counts the pipelines still in their epoch: their step times (0: not counted),
    their epochs, and per epoch the sum of their rates (a quick bound before the exact sum)."""

    def __init__(self, pipes: list, steps: int, epochs: int, lock_step: bool):
        D = len(pipes)
        self.pipes, self.steps, self.D, self.epochs, self.lock_step = pipes, steps, D, epochs, lock_step
        self.total = steps * D  # batches in an epoch
        self.taken: dict = {}  # epoch -> batches handed out
        self.tail_t = np.zeros(D)
        self.tail_epoch = np.zeros(D, dtype=np.int64)
        self.tail_rate: dict = {}

    def next(self, p: int, t: float) -> bool:
        """Whether pipeline p, asking at ``t``, gets a batch of its epoch.  Also keeps p's recent step time."""
        pipe = self.pipes[p]
        if pipe.last_start is not None:
            old = pipe.step_time
            new = pipe.step_time = smoothed_step_time(old, t - pipe.last_start)
            if new > 0 and not pipe.done:
                e = pipe.epoch
                self.tail_rate[e] = self.tail_rate.get(e, 0.0) + 1.0 / new - (1.0 / old if old else 0.0)
                self.tail_t[p] = new
        pipe.last_start = t
        if self.lock_step:
            return pipe.epoch_steps < self.steps
        e = pipe.epoch
        taken = self.taken.get(e, 0)
        remaining = self.total - taken
        if remaining > 0 and not (remaining <= TAIL_BATCHES_PER_PIPELINE * self.D and self._leaves_tail(p, remaining)):
            self.taken[e] = taken + 1
            return True
        return False

    def _leaves_tail(self, p: int, remaining: int) -> bool:
        """The epoch-tail rule on the pipelines still in p's epoch; their summed rates bound the faster ones'
        first, so most steps skip the exact sum."""
        mine = self.pipes[p].step_time
        if mine is None:
            return False
        e = self.pipes[p].epoch
        bound = self.tail_rate.get(e, 0.0) - (1.0 / mine if mine > 0 else 0.0)  # every other pipeline's rate
        if remaining >= mine * bound * (1 + 1e-9):
            return False
        t = self.tail_t
        faster = t[(t > 0) & (t < mine) & (self.tail_epoch == e)] if self.epochs > 1 else t[(t > 0) & (t < mine)]
        return tail_goes_faster(mine, float((1.0 / faster).sum()), remaining)

    def leave(self, p: int) -> None:
        """p no longer counts in its epoch's tail rule (its epoch ended, or it left)."""
        if self.tail_t[p] > 0:
            self.tail_rate[self.pipes[p].epoch] -= 1.0 / self.tail_t[p]
            self.tail_t[p] = 0.0

    def enter(self, p: int, epoch: int, counted: bool) -> None:
        """p is in ``epoch`` now; ``counted``: its recent step time counts in the epoch's tail rule at once."""
        self.tail_epoch[p] = epoch
        step_time = self.pipes[p].step_time
        if counted and step_time:
            self.tail_t[p] = step_time
            self.tail_rate[epoch] = self.tail_rate.get(epoch, 0.0) + 1.0 / step_time

    def exhausted(self, epoch: int) -> bool:
        """Every batch of ``epoch`` is handed out."""
        return self.taken.get(epoch, 0) >= self.total
