"""Automatic re-cuts (``TrainConfig.rebalance``): a driver thread that re-cuts every pipeline when one stage stays
the bottleneck.

It reads the run's records as they arrive and keeps, for each worker, its own time of each step under the current
cut: the step's forwards and backwards and the sleep of an emulated slowdown (what the worker itself spends, not
its waits for the others).  Once every stage has a worker with ``steps`` whole steps since the last change (a
re-cut, or a change of the heterogeneity), each stage's time is the median over the pipelines of its workers'
means.  Worked case, 3 stages whose layers' measured times sum to ``C = (4, 4, 4)`` ms, stage 1 slowed 3x: its
times ``T = (4.4, 13.1, 4.5)`` ms make it the bottleneck (13.1 > 1.25 x the others' mean 4.45), its workers run
``T / C = (1.1, 3.3, 1.1)`` times slower than the measurement, and the cut whose slowest stage is fastest at those
speeds (:func:`sdpipe.core.partition.speed_cuts`) gives stage 1 fewer layers; it is taken if it makes the slowest
stage at least ``margin`` faster, at most once every ``every`` seconds.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from typing import Optional

from sdpipe.config import Rebalance
from sdpipe.core.partition import speed_cuts, stage_bounds

__all__ = ["Rebalancer", "StageTimes", "decide"]

log = logging.getLogger("sdpipe")

#: the span kinds that are a worker's own time in a step (a slowdown's sleep is a "straggle" of what="slowdown")
OWN = ("forward", "backward")


class StageTimes:
    """Each worker's own time per step since the last change, from the run's records."""

    def __init__(self, keep: int):
        self.keep = keep
        self.since = 0.0  # run time of the last change: spans that start before it do not count
        self._steps: dict = {}  # (pipeline, stage) -> {step: seconds}

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
            per[e["step"]] = per.get(e["step"], 0.0) + (e["end"] - e["start"])
            if len(per) > self.keep + 2:  # only the last steps count
                del per[min(per)]

    def stage_times(self, pipelines: list, stages: int) -> Optional[list]:
        """Each stage's time per step (the median over ``pipelines`` of their workers' means over their last
        ``keep`` whole steps), or None while a stage has no worker with that many."""
        out = []
        for s in range(stages):
            means = []
            for p in pipelines:
                per = self._steps.get((p, s), {})
                whole = sorted(per)[:-1]  # the latest step may still be running
                if len(whole) >= self.keep:
                    means.append(sum(per[k] for k in whole[-self.keep :]) / self.keep)
            if not means:
                return None
            out.append(statistics.median(means))
        return out


def decide(times: list, layer_seconds: list, cuts: tuple, margin: float) -> Optional[tuple]:
    """The re-cut to make for stage ``times`` under ``cuts`` (each layer measured at ``layer_seconds``), or None:
    only where the slowest stage exceeds the others' mean by ``margin`` and the new cut is predicted to make the
    slowest stage faster by ``margin`` (see the module's worked case)."""
    S = len(times)
    if S < 2:
        return None
    slow = max(range(S), key=lambda s: times[s])
    others = [t for s, t in enumerate(times) if s != slow]
    if times[slow] <= (1.0 + margin) * (sum(others) / len(others)):
        return None
    bounds = stage_bounds(list(cuts), len(layer_seconds))
    own = [max(sum(layer_seconds[a:b]), 1e-9) for a, b in bounds]
    factors = [t / c for t, c in zip(times, own, strict=True)]
    new = tuple(speed_cuts(layer_seconds, factors))
    predicted = max(
        f * sum(layer_seconds[a:b])
        for f, (a, b) in zip(factors, stage_bounds(list(new), len(layer_seconds)), strict=True)
    )
    if new == tuple(cuts) or predicted * (1.0 + margin) > times[slow]:
        return None
    return new


class Rebalancer:
    """The thread that makes a run's automatic re-cuts (started with the run; ends with it)."""

    def __init__(self, run, policy: Rebalance):
        self.run, self.policy = run, policy
        self.times = StageTimes(policy.steps)
        self._last = -float("inf")  # monotonic time of the last automatic re-cut
        self._thread = threading.Thread(target=self._loop, name=f"sdpipe-rebalance-{run.run_id}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _loop(self) -> None:
        run = self.run
        while not run._launched.wait(0.5):
            if run._done.is_set():
                return
        try:
            seconds = [c.seconds for c in run._layer_costs()]
        except Exception as e:  # the layers could not be timed: say so once, train on
            log.warning("sdpipe: run %s rebalances nothing: timing its layers failed (%s)", run.run_id, e)
            return
        cursor = 0
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
                continue
            cuts = decide(times, seconds, run.cuts, self.policy.margin)
            if cuts is None:
                continue
            slow = max(range(len(times)), key=lambda s: times[s])
            reason = f"stage {slow} took {times[slow] * 1e3:.1f} ms a step, the others {_listed(times, slow)}"
            try:
                run._recut(cuts, reason=reason)
            except (RuntimeError, ValueError) as e:  # a policy switch or a join not taken up yet: try again later
                log.info("sdpipe: run %s: automatic re-cut put off: %s", run.run_id, e)
                continue
            self._last = time.monotonic()


def _listed(times: list, slow: int) -> str:
    return ", ".join(f"{t * 1e3:.1f}" for s, t in enumerate(times) if s != slow) + " ms"
