"""The group scheduler's parameters (:class:`SchedulerPolicy`): window rule and horizon, the connectivity bound,
group sizes, weighting, overlap."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from sdpipe.core.checks import is_number

__all__ = ["PAIRINGS", "WEIGHTINGS", "WINDOW_RULES", "SchedulerPolicy"]


#: how the members of a group weight their models (SchedulerPolicy.weighting)
WEIGHTINGS = ("progress", "uniform")
#: how a round decides whom to wait for (SchedulerPolicy.window)
WINDOW_RULES = ("arrival", "prototype")
#: how a large round's members are paired (SchedulerPolicy.pairing)
PAIRINGS = ("across", "neighbours")


@dataclass(frozen=True, kw_only=True)
class SchedulerPolicy:
    """Parameters of the group scheduler (defaults: the SDPipe prototype's, but for ``window``, ``overlap`` and
    ``weighting``)."""

    max_group: Optional[int] = None
    """Largest group; None means all live workers of the stage."""
    min_group: int = 2
    """A group smaller than this doubles its members' windows."""
    window_init: float = 0.001
    """Initial window of every worker, seconds; math.inf waits until the group is full."""
    window_min: float = 0.00001
    """Floor of the adaptive window, seconds."""
    window_max: float = 0.010
    """Cap of the adaptive window, seconds."""
    grow: float = 2.0
    """Factor of the window after a too-small group."""
    shrink: float = 0.9
    """Factor of the window after a large enough group."""
    staleness: int = 10
    """P: the groups of every P x D updates of a stage connect all its D live workers (for "ps": steps a worker
    may run ahead)."""
    pair_threshold: int = 8
    """Above this many live workers, ordinary rounds pair their members."""
    pairing: str = "across"
    """How a paired round's members are paired: "across" (each pair joins two components of the union of the
    groups since the sync graph last connected the stage, where the round holds members of two: the union
    connects in a few rounds, and the connectivity bound seldom needs a graph sync) or "neighbours" (the
    prototype's: adjacent worker ids)."""
    window: str = "arrival"
    """How a round decides whom to wait for: "arrival" (predict each worker's next ready time from its
    recent ones and wait, at most ``horizon`` x the stage's typical step time, only for the workers
    predicted inside that horizon) or "prototype" (the SDPipe prototype's adaptive constant window,
    ``window_init`` / ``window_min`` / ``window_max`` / ``grow`` / ``shrink``)."""
    horizon: Optional[float] = None
    """Rule "arrival": the longest wait of a round, as a fraction of the stage's typical interval (release to
    next ready; ready to ready under ``overlap``).  None: 0.8 with ``overlap`` (a round's wait then costs no
    step, as long as it and its averaging end within one), 0.5 without (each member waits it out); both
    measured, see ``benchmarks/results/group_sizes.md``."""
    history: int = 8
    """Rule "arrival": how many of a worker's recent intervals its prediction uses (median and median
    absolute deviation)."""
    overlap: bool = True
    """Averaging overlapped with compute (ours, not the prototype's): a worker sends its ready signal and goes
    on with its next step; its group averages the weights as they were at the ready signal in the background,
    and each member then moves its weights by the group's average minus its own snapshot (a correction), at
    its next step boundary.  Global syncs, checkpoints, evaluations, stops and policy switches wait for it
    first.  False: the prototype's blocking averaging, the better choice where each worker is held to a CPU
    quota (the background averaging then takes its CPU from the same worker's compute)."""
    weighting: str = "progress"
    """How a group averages: "uniform" (x_i <- mean of the members, the paper's doubly stochastic
    mixing) or "progress" (each member weighted by its mass: 1 + its optimizer steps since the last
    global sync, carried through earlier groups, which leave every member the mean mass; a replica
    that fell behind pulls the average back less; the mass-weighted sum over the replicas is conserved)."""

    def __post_init__(self):
        def check(name, ok, allowed):
            if not ok:
                raise ValueError(f"policy.{name}: {getattr(self, name)!r} is not allowed; {allowed}")

        num = is_number
        check(
            "max_group",
            self.max_group is None or (isinstance(self.max_group, int) and self.max_group >= 1),
            "use None or an integer >= 1",
        )
        check("min_group", isinstance(self.min_group, int) and self.min_group >= 1, "use an integer >= 1")
        check("window_min", num(self.window_min) and self.window_min >= 0, "use seconds >= 0")
        check("window_max", num(self.window_max) and self.window_max >= self.window_min, "use seconds >= window_min")
        check(
            "window_init",
            num(self.window_init) and self.window_min <= self.window_init <= self.window_max,
            "use seconds within [window_min, window_max]",
        )
        check("grow", num(self.grow) and self.grow >= 1, "use a factor >= 1")
        check("shrink", num(self.shrink) and 0 < self.shrink <= 1, "use a factor in (0, 1]")
        check("staleness", isinstance(self.staleness, int) and self.staleness >= 1, "use an integer >= 1")
        check(
            "pair_threshold", isinstance(self.pair_threshold, int) and self.pair_threshold >= 2, "use an integer >= 2"
        )
        check("pairing", self.pairing in PAIRINGS, f"use one of {', '.join(map(repr, PAIRINGS))}")
        check("window", self.window in WINDOW_RULES, f"use one of {', '.join(map(repr, WINDOW_RULES))}")
        check(
            "horizon",
            self.horizon is None or (num(self.horizon) and 0 < self.horizon <= 10),
            "use None or a fraction of a step in (0, 10]",
        )
        check("history", isinstance(self.history, int) and 2 <= self.history <= 1000, "use an integer in [2, 1000]")
        check("overlap", isinstance(self.overlap, bool), "use True or False")
        check("weighting", self.weighting in WEIGHTINGS, f"use one of {', '.join(map(repr, WEIGHTINGS))}")

    @property
    def horizon_fraction(self) -> float:
        """The horizon in force: ``horizon``, or its default for ``overlap``."""
        if self.horizon is not None:
            return self.horizon
        return 0.8 if self.overlap else 0.5

    def next_window(self, window: float, group_size: int) -> float:
        """A worker's window after a group of ``group_size``: grown (from ``window_min`` if it was 0) when the group
        was smaller than ``min_group``, else shrunk, within the bounds."""
        if group_size < self.min_group:
            return min(window * self.grow, self.window_max) if window > 0 else self.window_min
        return max(window * self.shrink, self.window_min)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    def updated(self, **changes) -> "SchedulerPolicy":
        unknown = set(changes) - set(self.__dataclass_fields__)
        if unknown:
            raise ValueError(
                f"policy: unknown parameter(s) {sorted(unknown)}; allowed {sorted(self.__dataclass_fields__)}"
            )
        return replace(self, **changes)
