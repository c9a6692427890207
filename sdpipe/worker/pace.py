"""Emulated heterogeneity inside one worker's steps: a slower machine, and transient straggles.

``Heterogeneity(slowdown={3: 4.0})`` means that pipeline 3's own step, what it takes measured without waiting
for any other pipeline, lasts 4x as long, whatever share of it is compute.  On a small model most of a step is
communication, the control message and Python between the sends; stretching the compute alone (what
``compute_slowdown`` does) makes such a step barely longer.  So a :class:`Pace` stretches the whole step: the
pipeline's stage 0, which leads each of its steps (its control message starts the step on every stage, and its
own step spans the pipeline's: it sends the first micro-batch and takes the last gradient), measures its step
from its start to its end, less the time it waited for other pipelines (its group, a collective, a server, an
averaging in flight) or held the pipeline while the run was paused, and then sleeps ``f - 1`` times that before
its next step; the later stages wait for its next control message meanwhile::

    stage 0:  |ctl F0 F1 .. RB1 B1 opt| sync |........ sleep (f-1) x own ........| ctl F0 ...
    stage 1:    |ctl| RF0 F0 .. SB1 opt | sync |     wait for the control message  | RF0 ...

Only one worker of the pipeline sleeps, so nothing compounds: had every stage stretched its own step, a later
stage still asleep when stage 0 began its next step would have made stage 0 wait for it, and that wait would
have counted as stage 0's own time and been stretched in turn.  ``slowdown={(3, 1): 2.0}`` slows one worker:
it stretches its own step (from its control message to its end) the same way, and its pipeline waits for it.

A transient straggle (``straggle_prob`` p, ``straggle_delay`` d): at each step each worker independently, with
probability p, spends d more seconds in it, slept right after its first forward or backward so that it holds
its pipeline's step back by d.

``benchmarks/results/heterogeneity.md`` measures both under policy ``none``, within one run each: a slowed
pipeline's step against its own step without the slowdown, and the steps a straggle hit against those it did not.
"""

from __future__ import annotations

import contextlib
import time

__all__ = ["Pace"]


class Pace:
    """One worker's emulated slowdown and transient straggles, applied while a training step runs."""

    def __init__(self) -> None:
        self.factor = 1.0  # this step's slowdown (Heterogeneity.slowdown_of this worker)
        self._start = None  # perf_counter at the step's start; None outside a step or when nothing is emulated
        self._waited = 0.0  # seconds of the step spent waiting for other pipelines or the control message
        self._extra = 0.0  # a straggle's seconds, slept after the step's next forward or backward
        self._record = None  # the straggle's record(start, end), time.time() values
        self.slept = 0.0  # seconds the last step slept for its slowdown
        self._late = 0.0  # seconds the last sleep overran: taken off the next one

    def begin(self, factor: float) -> None:
        """A step starts, slowed by ``factor``."""
        self.factor, self._waited, self._extra = factor, 0.0, 0.0
        self._start = time.perf_counter() if factor > 1.0 else None

    @contextlib.contextmanager
    def waiting(self):
        """A wait for someone outside this worker's own step (other pipelines, the control message)."""
        if self._start is None:
            yield
            return
        t = time.perf_counter()
        try:
            yield
        finally:
            self._waited += time.perf_counter() - t

    def straggle(self, seconds: float, record=None) -> None:
        """A transient straggle hits this step: ``seconds`` more, slept after its next forward or backward;
        ``record(start, end)`` gets the sleep's ``time.time()`` bounds."""
        self._extra, self._record = self._extra + seconds, record

    def _sleep(self, seconds: float) -> float:
        """Sleep ``seconds`` less what earlier sleeps overran; returns the seconds slept.  On a machine with more
        runnable processes than cores a sleeper wakes late (it waits for a core: about 5 ms with 8 workers on 2),
        which would add that much to every stretched step; paying it back keeps the stretch f on average."""
        want = seconds - self._late
        if want <= 0:
            self._late = -want
            return 0.0
        t = time.perf_counter()
        time.sleep(want)
        took = time.perf_counter() - t
        self._late = max(0.0, took - want)
        return took

    def computed(self) -> None:
        """A forward or backward just ended: a pending straggle is slept now."""
        if self._extra > 0:
            start = time.time()
            self._sleep(self._extra)
            self._extra = 0.0
            if self._record is not None:
                self._record(start, time.time())
                self._record = None

    def end(self) -> float:
        """The step's end: sleep ``factor - 1`` times its own time; returns the seconds slept."""
        self.computed()  # a straggle drawn for a step without compute (none: a stage of no micro-batch)
        self.slept = 0.0
        if self._start is not None:
            own = time.perf_counter() - self._start - self._waited
            self._start = None
            owed = (self.factor - 1.0) * max(0.0, own)
            if owed > 0:
                self.slept = self._sleep(owed)
        return self.slept
