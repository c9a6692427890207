"""Automatic re-cuts (``TrainConfig.rebalance``): a driver thread that re-cuts every pipeline when one stage stays
the bottleneck.

It reads the run's records as they arrive and keeps, for each worker and each step under the current cut, its
own time (its forwards and backwards, and the sleep of an emulated slowdown: not its waits for the others), the
CPU time of its forwards and backwards, and how many micro-batches they ran.  Once every stage has a worker with
``steps`` whole steps since the last change (a re-cut, or a change of the heterogeneity), a stage's figures are
those of the median pipeline.  A stage is modelled as running ``f = time / CPU time`` slower than its CPU work (an
emulated slowdown sleeps; two workers sharing a core wait for it), its CPU work as its layers' times measured on
the driver (``cuts="time"``'s) once per micro-batch, times one factor ``k`` for all stages, plus what it spends
whatever layers it holds (the CPU time beyond them: the loss, autograd, the framework).  ``k`` is the stages' CPU
time over the driver's time for the layers they hold: the driver times each layer alone, with its own threads,
perhaps on another machine, so the workers' time for the same layers may be twice it or half.  Worked case, 10
layers, cut ``(9,)``, 4 micro-batches a step: stage 0 holds 3.98 ms of layers and spends 17.8 ms a step at 16.9 ms
of CPU (``f = 1.05``), stage 1 holds 0.24 ms and spends 2.1 ms at 2.0 ms of CPU; ``k = 18.9 / (4 x 4.22) = 1.12``,
so stage 0 spends nothing beyond its layers and stage 1 0.9 ms a step: stage 0 is the bottleneck
(17.8 > 1.25 x 2.1), and the cut whose slowest stage is fastest under that model
(:func:`sdpipe.core.partition.speed_cuts`) is taken if it makes the slowest stage ``margin`` faster, at most once
every ``every`` seconds.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from typing import Optional

from sdpipe.config import Rebalance
from sdpipe.core.partition import speed_cuts, stage_bounds

__all__ = ["Rebalancer", "StageTimes", "decide", "predict"]

log = logging.getLogger("sdpipe")

#: the span kinds of a worker's own compute in a step (a slowdown's sleep is a "straggle" of what="slowdown")
OWN = ("forward", "backward")


class StageTimes:
    """Each worker's own time, CPU time and micro-batches per step since the last change, from the run's records."""

    def __init__(self, keep: int):
        self.keep = keep
        self.since = 0.0  # run time of the last change: spans that start before it do not count
        self._steps: dict = {}  # (pipeline, stage) -> {step: [seconds, cpu seconds, micro-batches]}

    def reset(self, at: float) -> None:
        self.since = at
        self._steps.clear()

    def take(self, records: list) -> None:
        for e in records:
            kind = e["kind"]
            own = kind in OWN or (kind == "straggle" and e.get("what") == "slowdown")
            if not own or e["start"] < self.since or e.get("step") is None:
                continue
            per = self._steps.setdefault((e["pipeline"], e["stage"]), {})
            row = per.setdefault(e["step"], [0.0, 0.0, 0])
            row[0] += e["end"] - e["start"]
            if kind in OWN:
                row[1] += e.get("cpu") or 0.0
                row[2] += kind == "forward"
            if len(per) > self.keep + 2:  # only the last steps count
                del per[min(per)]

    def stage_times(self, pipelines: list, stages: int) -> Optional[list]:
        """Per stage ``(seconds, CPU seconds, micro-batches)`` a step: of the pipeline whose worker's mean time
        over its last ``keep`` whole steps is the median; None while a stage has no worker with that many."""
        out = []
        for s in range(stages):
            means = []
            for p in pipelines:
                per = self._steps.get((p, s), {})
                whole = sorted(per)[:-1][-self.keep :]  # the latest step may still be running
                if len(whole) >= self.keep:
                    means.append(tuple(sum(per[k][i] for k in whole) / self.keep for i in range(3)))
            if not means:
                return None
            median = statistics.median_low([m[0] for m in means])
            out.append(next(m for m in means if m[0] == median))
        return out


def decide(times: list, layer_seconds: list, cuts: tuple, margin: float) -> Optional[tuple]:
    """The re-cut to make for the stages' ``times`` (``(seconds, CPU seconds, micro-batches)`` a step each) under
    ``cuts``, each layer measured at ``layer_seconds`` a micro-batch; or None: only where the slowest stage takes
    more than the others' mean by ``margin`` and the new cut is predicted to make the slowest stage that much
    faster (the model of the module's docstring)."""
    return predict(times, layer_seconds, cuts, margin)[0]


def predict(times: list, layer_seconds: list, cuts: tuple, margin: float) -> tuple:
    """``(cut, why)``: :func:`decide`'s cut (or None) and, where it is None, why in a few words (the model's
    slowest stage under the best cut against under ``cuts``, where it got that far)."""
    S = len(times)
    if S < 2:
        return None, "one stage"
    wall = [t[0] for t in times]
    slow = max(range(S), key=lambda s: wall[s])
    others = [w for s, w in enumerate(wall) if s != slow]
    if wall[slow] <= (1.0 + margin) * (sum(others) / len(others)):
        return None, f"within {margin:.0%} of the others' mean"
    n = len(layer_seconds)
    held = [sum(layer_seconds[a:b]) for a, b in stage_bounds(list(cuts), n)]
    mbs = max(1.0, statistics.median([t[2] for t in times]))  # micro-batches a step (all stages run as many)
    speed = [max(1.0, w / c) if c > 0 else 1.0 for w, (_, c, _) in zip(wall, times, strict=True)]
    cpu = sum(t[1] for t in times)
    k = cpu / (mbs * sum(held)) if cpu > 0 and sum(held) > 0 else 1.0  # the workers' CPU over the driver's timing
    fixed = [max(0.0, c - mbs * k * h) for (_, c, _), h in zip(times, held, strict=True)]
    scale = [f * mbs * k for f in speed]
    offset = [f * x for f, x in zip(speed, fixed, strict=True)]
    new = tuple(speed_cuts(layer_seconds, scale, offset))

    def slowest(c) -> float:
        bounds = stage_bounds(list(c), n)
        return max(x * sum(layer_seconds[a:b]) + o for x, o, (a, b) in zip(scale, offset, bounds, strict=True))

    now, then = slowest(cuts), slowest(new)
    if new == tuple(cuts) or then * (1.0 + margin) > now:
        return None, (
            f"the model's best cut {new} takes its slowest stage to {then * 1e3:.1f} ms from {now * 1e3:.1f} ms, "
            f"not {margin:.0%} faster"
        )
    return new, ""


class Rebalancer:
    """The thread that makes a run's automatic re-cuts (started with the run; ends with it)."""

    def __init__(self, run, policy: Rebalance):
        self.run, self.policy = run, policy
        self.times = StageTimes(policy.steps)
        self._last = -float("inf")  # monotonic time of the last automatic re-cut
        #: what it is at, in one line (:attr:`sdpipe.Run.rebalancing`)
        self.state = "waiting for the run's workers"
        self._thread = threading.Thread(target=self._loop, name=f"sdpipe-rebalance-{run.run_id}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _loop(self) -> None:
        """Follow the run until it ends; whatever goes wrong here is one log line, never the run's failure."""
        try:
            self._follow()
        except Exception as e:
            self.state = f"stopped: {type(e).__name__}: {e}"
            if not self.run._done.is_set():  # (as a run ends its store closes under a call: nothing to say)
                log.warning("sdpipe: run %s stopped rebalancing: %s: %s", self.run.run_id, type(e).__name__, e)

    def _follow(self) -> None:
        run = self.run
        while not run._launched.wait(0.5):
            if run._done.is_set():
                return
        try:
            seconds = [c.seconds for c in run._layer_costs()]
        except Exception as e:  # the layers could not be timed: say so once, train on
            self.state = f"off: timing the layers failed ({e})"
            log.warning("sdpipe: run %s rebalances nothing: timing its layers failed (%s)", run.run_id, e)
            return
        cursor = 0
        self.state = "measuring the stages"
        while not run._done.wait(0.5):
            new, cursor = run.events_since(cursor)
            for e in new:  # a change the times must be measured anew after
                if (
                    e["kind"] == "control"
                    and e.get("applied_by") == "driver"
                    and e["what"] in ("recut", "heterogeneity")
                ):
                    self.times.reset(e["start"])
            self.times.take(new)
            if time.monotonic() - self._last < self.policy.every or run.paused:
                continue
            times = self.times.stage_times(run.pipelines, run.config.stages)
            if times is None:
                self.state = f"measuring the stages ({self.policy.steps} whole steps each since the last change)"
                continue
            cuts, why = predict(times, seconds, run.cuts, self.policy.margin)
            wall = [t[0] for t in times]
            slow = max(range(len(wall)), key=lambda s: wall[s])
            reason = f"stage {slow} took {wall[slow] * 1e3:.1f} ms a step, the others {_listed(wall, slow)}"
            if cuts is None:
                self.state = f"cut {tuple(run.cuts)} kept: {reason}; {why}"
                continue
            try:
                run._recut(cuts, reason=reason)
            except (RuntimeError, ValueError, TimeoutError) as e:  # a switch or a join not taken up yet: later
                self.state = f"re-cut to {cuts} put off: {e}"
                log.info("sdpipe: run %s: automatic re-cut put off: %s", run.run_id, e)
                continue
            self.state = f"re-cut to {cuts}: {reason}"
            self._last = time.monotonic()


def _listed(times: list, slow: int) -> str:
    return ", ".join(f"{t * 1e3:.1f}" for s, t in enumerate(times) if s != slow) + " ms"
