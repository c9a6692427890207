"""Pipelines that leave and come back during a simulated run (spot instances)."""

from __future__ import annotations

import math
import random

from sdpipe.core.checks import is_number
from sdpipe.core.policies import names
from sdpipe.core.policies import record as policy_record

__all__ = ["spot_trace"]


def _check_trace(trace, pipelines: int, policy: str) -> list:
    if trace is None:
        return []
    if not policy_record(policy).rejoin:
        listed = " and ".join(repr(n) for n in names(rejoin=True))
        raise ValueError(f"trace: pipelines join and leave under {listed}, not {policy!r}")
    out = []
    try:
        for t, what, p in trace:
            ok = what in ("leave", "join") and isinstance(p, int) and 0 <= p < pipelines and 0 <= float(t) < math.inf
            if not ok:
                raise ValueError
            out.append((float(t), what, p))
    except (TypeError, ValueError):
        raise ValueError(
            f"trace: needs (seconds >= 0, 'leave' or 'join', pipeline 0..{pipelines - 1}) entries, got {trace!r}"[:300]
        ) from None
    return sorted(out, key=lambda c: c[0])


def spot_trace(pipelines: int, *, preemptions_per_min: float, mean_down: float, duration: float, seed: int = 0):
    """A trace for :func:`simulate`: each pipeline is preempted at ``preemptions_per_min`` (a Poisson process
    while it is up) and comes back after an exponential time of mean ``mean_down`` seconds, over ``duration``
    seconds; pipeline 0 is never preempted (somebody holds the state to give)."""
    for name, v in (("preemptions_per_min", preemptions_per_min), ("mean_down", mean_down), ("duration", duration)):
        if not is_number(v) or not (0 < v < math.inf):
            raise ValueError(f"{name}: must be a finite number > 0, got {v!r}")
    rng = random.Random(seed)
    trace = []
    for p in range(1, pipelines):
        t = rng.expovariate(preemptions_per_min / 60.0)
        while t < duration:
            back = t + rng.expovariate(1.0 / mean_down)
            trace += [(t, "leave", p), (back, "join", p)]
            t = back + rng.expovariate(preemptions_per_min / 60.0)
    return sorted(trace)
