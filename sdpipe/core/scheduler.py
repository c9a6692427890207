"""The SDPipe group scheduler, as a pure state machine.

No torch, no Dask, no clock: time comes in with each event.  The Dask service
(:mod:`sdpipe.service`), the tests and a simulator all drive this same code.

Per stage, following the SDPipe paper (Miao et al., PVLDB 2023, Sec. 4) and
its prototype's constants::

    worker ready  ->  no round open?  open one, deadline = now + that worker's window
                      round open?     join it
    a round closes when it holds max_group workers ("full") or its window ends
    ("window"); its members average together (a group of one skips averaging).
    Each member's window then adapts: doubled (<= window_max) when the group
    had fewer than min_group members, else times 0.9 (>= window_min).

Rule "arrival" (``policy.window``, the default; ours, not the prototype's).  A
constant window does not follow step times: with steps of 200 ms, workers
seldom come within 10 ms of each other, and most rounds close alone.  So the
scheduler keeps, per worker, when it was last released from a group and its
recent compute intervals (release to next ready; median and median absolute
deviation of the last ``history``).  When a round opens at ``now`` it predicts
every computing worker's next ready time and waits only for those predicted
within ``horizon x typical`` of ``now`` (typical: the stage's typical
interval; a worker overdue by more than that is stalled) and for those not
released since a global group, at most until ``now + horizon x typical``; it
closes ("arrived") as soon as they all came, and at once ("alone") when
nobody is predicted.  A worker predicted beyond the horizon (a straggler) is
never waited for: it forms its own rounds, joins whoever is open when it
comes, or is pulled in by the connectivity bound.  Until a stage has seen one
interval, the prototype's window applies.  Rule "prototype" keeps the
prototype's window throughout.

Connectivity bound: as in the SDPipe prototype, updates are counted per
stage (a worker's steps: one per member of each group, or, for a member whose
ready signal carries a step number, the steps it took since its last one: under
overlapped averaging a worker goes on without a ready signal while its last
averaging is in flight) and the groups since
the last reset are kept in a disjoint set.  When the union connects every
live worker of the stage the count resets.  Otherwise, once the count reaches
``(staleness - 1) * D`` (D live workers: P - 1 steps of every worker), the
next round is a *graph-sync* round: it ignores window and size and closes
only once its members join the union into one component.  So every worker's
model mixes with every other's, directly or transitively, within P steps'
worth of updates, ``P * D`` (the last ordinary round may overshoot the
threshold by less than one round).  Counting updates rather than rounds keeps
the bound about steps: a fast worker's many small groups do not bring the
next graph sync forward.  One stage holds a graph sync at a time: a stage
whose graph sync would start while another stage holds one keeps forming
ordinary rounds (so its bound stretches by those rounds) and starts its
graph sync with its first round after the token is free.  Holding workers of two stages at
once can deadlock: a held worker of stage 1 may be the one its pipeline's
stage-0 worker needs to finish the step that stage 0's graph sync waits for.

Rounds that wait on each other: a round without a deadline (a graph-sync round,
or any round under the ``allreduce`` preset's infinite window) holds its members
until the workers it waits for come.  The workers of one pipeline depend on each
other: a stage's next step needs its neighbours' activations or gradients of that
step, which a neighbour held at an earlier step's ready signal cannot send.  When
the stages' rounds are formed from ready signals at different steps of the same
pipelines (after a live switch from overlapped averaging, where workers went on
without ready signals, to the ``allreduce`` preset), stage 0's round can wait
for a worker blocked by its sibling in stage 1's round, which waits for a worker
blocked by its sibling in stage 0's round: nobody would ever come.  A worker
``w`` of a stage counts as blocked by another stage's round when its sibling is
held there at a step ``w`` has already reached (its last ready signal's step is
at least that one); a cycle of such waits closes its first-opened round at once
with the members it holds ("preempted").  Ready signals that keep their steps in
line never form one (the worker a round waits for is then still finishing the
step its sibling waits at), so the ``allreduce`` preset's groups stay whole.

Global sync: a worker may ask for the global group instead (at an epoch end).
Such a worker takes part in no ordinary round; when every live worker of the
stage asked, they form one group with reason "global".  A pending round is
closed at once when a worker asks for the global group, so nobody waits on a
worker that will not come; and when a worker that waits in it reaches its
epoch's end (``Hurry``: under overlapped averaging its ready signal is still
in the round while its next step found no batch), so its global sync does not
wait out the round's window.

Joining (elastic pipelines): a worker that was not live, or was lost, joins a stage with ``Join`` once it
holds a live replica's state (its ``donor``): it is in no group before that, and from then on a live worker
like any other.  Its model equals the donor's, so the union counts it in the donor's component from its join
(the connectivity bound counts it from there); without a donor it is a component of its own.  A global group
waits for it from its join on, not before.

Pairing: above ``pair_threshold`` live workers an ordinary round splits its
sorted members into adjacent pairs (a trailing odd worker joins the last pair).

Worked case, D=3, window 1 ms, max_group 3::

    t=0.0000 Ready(0)  -> round 0 opens, deadline 0.0010
    t=0.0004 Ready(2)  -> joins
    t=0.0010 Tick      -> Group(round 0, members (0, 2), reason "window")
    t=0.0030 Ready(1)  -> round 1 opens ... worker 1 waits alone, its window doubles
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Iterable, Optional, Union

import numpy as np

from sdpipe.core.checks import is_number

__all__ = [
    "WINDOW_RULES",
    "DisjointSet",
    "Group",
    "GroupScheduler",
    "Hurry",
    "Join",
    "Lost",
    "Ready",
    "Retune",
    "SchedulerPolicy",
    "StageScheduler",
    "Tick",
]


#: how the members of a group weight their models (SchedulerPolicy.weighting)
WEIGHTINGS = ("progress", "uniform")
#: how a round decides whom to wait for (SchedulerPolicy.window)
WINDOW_RULES = ("arrival", "prototype")


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

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    def updated(self, **changes) -> "SchedulerPolicy":
        unknown = set(changes) - set(self.__dataclass_fields__)
        if unknown:
            raise ValueError(
                f"policy: unknown parameter(s) {sorted(unknown)}; allowed {sorted(self.__dataclass_fields__)}"
            )
        return replace(self, **changes)


# ------------------------------------------------------------------ events
@dataclass(frozen=True)
class Ready:
    """Worker (a pipeline id) finished a step and waits for its group."""

    worker: int
    step: int
    time: float
    global_sync: bool = False
    #: the stage whose worker it is (for :meth:`GroupScheduler.handle`; a :class:`StageScheduler` is one stage)
    stage: Optional[int] = None


@dataclass(frozen=True)
class Lost:
    """Worker left the stage for good (failure or stop); with no ``stage``, a whole pipeline is gone (every stage's
    worker ``worker``)."""

    worker: int
    time: float
    stage: Optional[int] = None


@dataclass(frozen=True)
class Tick:
    """Time passed; closes a round whose window ended."""

    time: float


@dataclass(frozen=True)
class Join:
    """Worker (a pipeline id) joined the stage, holding the state it took from the live worker ``donor`` (None:
    a state of its own); it takes part in rounds from its next Ready."""

    worker: int
    time: float
    donor: Optional[int] = None
    #: the stage it joined; None: a whole pipeline joined (every stage took ``donor``'s state)
    stage: Optional[int] = None


@dataclass(frozen=True)
class Hurry:
    """Worker (a pipeline id) reached the end of its epoch with a ready signal in the open round: the round closes
    at once with the members it holds (reason "preempted"), as a global sync's first ready signal closes it, so
    the worker's global sync does not wait out the round's window."""

    worker: int
    time: float
    stage: Optional[int] = None


@dataclass(frozen=True)
class Retune:
    """The scheduler's parameters change (a live policy change) from now on, in every stage."""

    policy: SchedulerPolicy
    time: float


Event = Union[Ready, Lost, Tick, Join, Hurry, Retune]


@dataclass(frozen=True)
class Group:
    """Decision: ``members`` average together now."""

    stage: int
    round: int
    members: tuple
    reason: str  # "full" | "arrived" | "window" | "graph" | "global" | "preempted" | "alone"
    opened: float
    closed: float
    windows: tuple = ()  # ((member, new window), ...)
    connected: bool = False  # this round completed a connected union (the count resets)

    @property
    def wait(self) -> float:
        """Seconds the first member waited for the round to close."""
        return self.closed - self.opened

    def to_dict(self) -> dict:
        return {
            "stage": self.stage,
            "round": self.round,
            "members": list(self.members),
            "reason": self.reason,
            "opened": self.opened,
            "closed": self.closed,
            "wait": self.wait,
            "connected": self.connected,
        }


def _decided(
    stage: int, round_: int, members: tuple, reason: str, opened: float, closed: float, windows: tuple, connected: bool
) -> Group:
    """``Group(stage, round_, ...)`` without the frozen dataclass's field-by-field ``__init__`` (half the time): a
    round at 16,384 pipelines decides thousands of pairs."""
    g = object.__new__(Group)
    object.__setattr__(
        g,
        "__dict__",
        {
            "stage": stage,
            "round": round_,
            "members": members,
            "reason": reason,
            "opened": opened,
            "closed": closed,
            "windows": windows,
            "connected": connected,
        },
    )
    return g


class DisjointSet:
    """Union-find over worker ids; ``count`` is the number of components among its items."""

    def __init__(self, items: Iterable[int] = ()):
        self.parent = {i: i for i in items}
        self.count = len(self.parent)

    def find(self, x: int) -> int:
        if x not in self.parent:
            self.parent[x] = x
            self.count += 1
        root = x
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[x] != root:
            self.parent[x], x = root, self.parent[x]
        return root

    def union(self, members: Iterable[int]) -> None:
        members = members if isinstance(members, (list, tuple)) else list(members)
        if not members:
            return
        find, a = self.find, self.find(members[0])  # stays the root: the others' roots go under it
        for m in members[1:]:
            b = find(m)
            if a != b:
                self.parent[b] = a
                self.count -= 1

    def merges(self, members: Iterable[int]) -> int:
        """How many components ``union(members)`` would join away (without changing anything)."""
        roots = {self.find(m) for m in members}
        return max(0, len(roots) - 1)

    def connects(self, items: Iterable[int]) -> bool:
        roots = {self.find(i) for i in items}
        return len(roots) <= 1

    def copy(self) -> "DisjointSet":
        d = DisjointSet()
        d.parent = dict(self.parent)
        d.count = self.count
        return d


@dataclass
class _Round:
    members: list
    opened: float
    deadline: float
    graph: bool = False
    expected: Optional[frozenset] = None  # rule "arrival": the workers this round waits for
    missing: set = field(default_factory=set)  # of those, the live ones not in it and not waiting for the global group
    trial: Optional["DisjointSet"] = None  # a graph-sync round: the union with its members so far (built lazily)
    trial_members: int = 0  # how many of ``members`` ``trial`` holds


def _median(xs) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


class _Arrivals:
    """What rule "arrival" knows of a stage's workers: when each was last released from a group and its
    recent compute intervals (release to next ready signal), with median and median absolute deviation.

    A worker's next ready signal is predicted at ``released + median`` (under overlapped averaging, where a
    worker does not wait for its group, at its last ready signal + the median ready-to-ready interval), give
    or take ``spread``
    (3 x the median absolute deviation, at least 2% of the median); a worker without a release to predict
    from (it has not been in a group since the start or since a global group, after which workers evaluate)
    is expected within the horizon, without a time.  The stage's typical interval is the
    median of its last ``4 x history`` intervals of any worker, so fast workers, who step more often,
    weigh more, and one straggler does not stretch every round's horizon.

    Kept by worker id in arrays: release times, each worker's last ``history`` intervals as a row (in no
    order: a median needs none) with their count and the slot the next one goes to, medians and spreads.
    Under overlapped averaging a ready signal is only logged; the log is taken in, in numpy and in its
    order, when anything reads the state (a round's plan, mostly), so a ready signal costs two appends.
    """

    #: ready signals logged before they are taken in regardless (a stage whose rule never plans a round)
    LOG_MAX = 1 << 16

    def __init__(self, history: int, overlap: bool = False):
        self.history = history
        #: under overlapped averaging a worker goes on at its ready signal: its next one follows its last one,
        #: not its release, so the intervals run ready to ready
        self.overlap = overlap
        self.recent: deque = deque(maxlen=4 * history)
        self._typical: Optional[float] = None
        self._rel = np.full(16, np.nan)  # by worker id: time of its last release (overlap: ready), NaN: none
        self._med = np.full(16, np.nan)  # median and spread of its intervals, NaN: none or out of date
        self._spr = np.full(16, np.nan)
        self._ring = np.zeros((16, history))  # its last ``history`` intervals
        self._count = np.zeros(16, dtype=np.int64)  # how many of the row hold one (at most ``history``)
        self._slot = np.zeros(16, dtype=np.int64)  # the slot of its next interval
        self._dirty: set = set()  # workers with intervals newer than their median and spread
        self._log_w: list = []  # overlap: ready signals (worker, time) not yet taken in
        self._log_t: list = []

    def _grow(self, worker: int) -> None:
        n = len(self._rel)
        if worker >= n:
            m = max(worker + 1, 2 * n)
            for name, fill in (("_rel", np.nan), ("_med", np.nan), ("_spr", np.nan), ("_count", 0), ("_slot", 0)):
                old = getattr(self, name)
                a = np.full(m, fill, dtype=old.dtype)
                a[:n] = old
                setattr(self, name, a)
            ring = np.zeros((m, self.history))
            ring[:n] = self._ring
            self._ring = ring

    @property
    def released(self) -> dict:
        """worker -> time of its last release (overlap: of its last ready signal)."""
        self._take_in()
        at = np.flatnonzero(~np.isnan(self._rel))
        return dict(zip(at.tolist(), self._rel[at].tolist(), strict=True))

    def ready(self, worker: int, now: float) -> None:
        if self.overlap:  # the simulator's hot path: logged, taken in by _take_in
            self._log_w.append(worker)
            self._log_t.append(now)
            if len(self._log_w) >= self.LOG_MAX:
                self._take_in()
            return
        if worker >= len(self._rel):
            self._grow(worker)
        last = float(self._rel[worker])
        if last != last:  # NaN: not released since the start or a global group
            return
        self._rel[worker] = np.nan
        dt = max(0.0, now - last)
        self.recent.append(dt)
        self._typical = None
        slot = int(self._slot[worker])
        self._ring[worker, slot] = dt
        self._slot[worker] = (slot + 1) % self.history
        self._count[worker] = min(int(self._count[worker]) + 1, self.history)
        self._dirty.add(worker)

    def _take_in(self) -> None:
        """The logged ready signals, in their order: each worker's interval since its previous one."""
        if not self._log_w:
            return
        W = np.array(self._log_w, dtype=np.int64)
        T = np.array(self._log_t, dtype=np.float64)
        self._log_w, self._log_t = [], []
        self._grow(int(W.max()))
        n, h = len(W), self.history
        order = np.argsort(W, kind="stable")  # by worker, each worker's signals in time order
        Ws, Ts = W[order], T[order]
        first = np.ones(n, dtype=bool)
        first[1:] = Ws[1:] != Ws[:-1]
        prev = np.empty(n)
        prev[1:] = Ts[:-1]
        prev[first] = self._rel[Ws[first]]
        last = np.ones(n, dtype=bool)
        last[:-1] = first[1:]
        self._rel[Ws[last]] = Ts[last]
        valid = ~np.isnan(prev)
        if not valid.any():
            return
        dt = np.maximum(Ts - prev, 0.0)
        in_order = np.zeros(n, dtype=bool)  # the intervals in the log's order, for the stage's recent ones
        in_order[order] = valid
        recent = np.empty(n)
        recent[order] = dt
        self.recent.extend(recent[in_order][-self.recent.maxlen :].tolist())
        self._typical = None
        # each worker's new intervals into its row, after the ones it holds (only its last ``history``)
        Wv, Dv = Ws[valid], dt[valid]
        m = len(Wv)
        start = np.ones(m, dtype=bool)
        start[1:] = Wv[1:] != Wv[:-1]
        starts = np.flatnonzero(start)
        sizes = np.diff(np.append(starts, m))
        rank = np.arange(m) - np.repeat(starts, sizes)
        total = np.repeat(sizes, sizes)
        keep = rank >= total - h
        workers = Wv[starts]
        slot0 = self._slot[Wv]
        self._ring[Wv[keep], (slot0[keep] + rank[keep]) % h] = Dv[keep]
        self._slot[workers] = (self._slot[workers] + sizes) % h
        self._count[workers] = np.minimum(self._count[workers] + sizes, h)
        self._dirty.update(workers.tolist())

    def release(self, workers, now: float) -> None:
        if self.overlap:
            return
        for w in workers:
            if w >= len(self._rel):
                self._grow(w)
            self._rel[w] = now

    def release_global(self, workers) -> None:
        """After a global group the workers evaluate or checkpoint: their next interval says nothing of a step."""
        self._take_in()
        for w in workers:
            if w < len(self._rel):
                self._rel[w] = np.nan

    def forget(self, worker: int) -> None:
        self._take_in()
        if worker < len(self._rel):
            self._rel[worker] = self._med[worker] = self._spr[worker] = np.nan
            self._count[worker] = self._slot[worker] = 0
        self._dirty.discard(worker)

    def _update_stats(self) -> None:
        """Median and spread of every worker with new intervals, the workers with as many intervals together (a
        sort per row in numpy; the median of an even count is the mean of the middle two, as is the median
        absolute deviation's)."""
        self._take_in()
        if not self._dirty:
            return
        dirty = np.fromiter(self._dirty, dtype=np.int64, count=len(self._dirty))
        self._dirty.clear()
        counts = self._count[dirty]
        for n in np.unique(counts[counts > 0]).tolist():
            rows = dirty[counts == n]
            xs = np.sort(self._ring[rows, :n], axis=1)
            k = n >> 1
            med = xs[:, k] if n & 1 else 0.5 * (xs[:, k - 1] + xs[:, k])
            ds = np.sort(np.abs(xs - med[:, None]), axis=1)
            mad = ds[:, k] if n & 1 else 0.5 * (ds[:, k - 1] + ds[:, k])
            self._med[rows] = med
            self._spr[rows] = np.maximum(3.0 * mad, 0.02 * med)

    def typical(self) -> Optional[float]:
        self._take_in()
        if self._typical is None and self.recent:
            self._typical = _median(self.recent)
        return self._typical

    def stats(self, worker: int):
        """(median, spread) of the worker's recent intervals; None before its first."""
        self._update_stats()
        if worker >= len(self._count) or not self._count[worker]:
            return None
        return float(self._med[worker]), float(self._spr[worker])

    def plan(self, now: float, candidates, horizon: float):
        """The workers among ``candidates`` (a boolean array by worker id) predicted ready within the horizon,
        ``now +- horizon`` (give or take their spread: due up to a horizon ago counts, a worker overdue by more is
        stalled), and the time the round stops waiting for them: ``now + horizon``, or ``now`` when nobody is
        expected.  A worker not released since the start or a global group is expected, without a time; one
        released without an interval yet is predicted from the stage's typical interval (give or take a quarter
        of it).  One pass in numpy over every worker id (a round at 16,384 pipelines looks at them all)."""
        typical = self.typical()
        end = now + horizon
        self._update_stats()
        n = len(candidates)
        self._grow(n - 1)
        rel, med, spr = self._rel[:n], self._med[:n], self._spr[:n]
        unknown = np.isnan(med)
        if unknown.any():
            med = np.where(unknown, typical, med)
            spr = np.where(unknown, 0.25 * typical, spr)
        pred = rel + med
        ok = np.isnan(rel) | ((now - horizon - spr <= pred) & (pred <= end + spr))
        expected = np.flatnonzero(candidates & ok).tolist()
        return frozenset(expected), (end if expected else now)

    def renewed(self, policy) -> "_Arrivals":
        """These arrivals under ``policy``: the same, or (another history length or overlap) relearnt from the
        recent intervals that still mean the same thing."""
        if (policy.history, policy.overlap) == (self.history, self.overlap):
            return self
        fresh = _Arrivals(policy.history, policy.overlap)
        if policy.overlap == self.overlap:
            fresh.restore(self.snapshot())
        return fresh

    def _row(self, worker: int) -> list:
        """A worker's intervals, oldest first."""
        c, s = int(self._count[worker]), int(self._slot[worker])
        row = self._ring[worker].tolist()
        return row[:c] if c < self.history else row[s:] + row[:s]

    def snapshot(self) -> dict:
        self._take_in()
        return {
            "released": {str(k): v for k, v in self.released.items()},
            "intervals": {str(w): self._row(w) for w in np.flatnonzero(self._count).tolist()},
            "recent": list(self.recent),
        }

    def restore(self, snap: dict) -> None:
        for k, v in snap.get("released", {}).items():
            w = int(k)
            self._grow(w)
            self._rel[w] = v
        h = self.history
        for k, v in snap.get("intervals", {}).items():
            w, v = int(k), list(v)[-h:]
            self._grow(w)
            if v:
                self._ring[w, : len(v)] = v
                self._count[w] = len(v)
                self._slot[w] = len(v) % h
                self._dirty.add(w)
        self.recent.extend(snap.get("recent", ()))


@dataclass
class StageScheduler:
    """Group formation for the D workers of one stage."""

    stage: int
    workers: Iterable[int]
    policy: SchedulerPolicy = field(default_factory=SchedulerPolicy)

    def __post_init__(self):
        self.live = set(self.workers)
        self.windows = {w: self.policy.window_init for w in self.live}
        self.round = 0
        self.open: Optional[_Round] = None
        self.dsu = DisjointSet(self.live)
        self.since_reset = 0  # updates (the members' steps since their last ready signals) since the union connected
        #: worker -> the step of its last ready signal, and how many steps the one waiting now counts for (a worker
        #: whose averaging was still in flight goes on without ready signals: its steps still count as updates)
        self._last_step: dict = {}
        self._updates: dict = {}
        self.global_waiting: set = set()
        self.waiting: set = set()  # workers inside the open round
        #: set by GroupScheduler: whether this stage holds (or may take) the graph-sync token
        self.may_graph_sync = True
        self.arrivals = _Arrivals(self.policy.history, self.policy.overlap)
        self._live_mask = np.zeros(max(self.live, default=-1) + 1, dtype=bool)  # ``live`` by worker id
        for w in self.live:
            self._mark(w, True)

    # -------------------------------------------------------------- helpers
    def _mark(self, worker: int, live: bool) -> None:
        if worker < 0:
            raise ValueError(f"worker: must be an id >= 0, got {worker}")
        mask = self._live_mask
        if worker >= len(mask):
            mask = self._live_mask = np.concatenate([mask, np.zeros(max(worker + 1, 2 * len(mask)) - len(mask), bool)])
        mask[worker] = live

    def _available(self) -> set:
        return self.live - self.global_waiting

    def _available_count(self) -> int:
        """``len(self._available())`` without building the set (global waiters are always live)."""
        return len(self.live) - len(self.global_waiting)

    def _surely_split(self, components: int) -> bool:
        """True when a union with ``components`` components cannot connect the available workers.

        Each item that is not available (gone, or waiting for the global
        group) can account for at most one component, so more components than
        that plus one means split.  This spares an O(D) check per event.
        """
        unavailable = len(self.dsu.parent) - self._available_count()
        return components - unavailable > 1

    def _connected(self, extra=()) -> bool:
        """Whether the groups since the last reset (plus a group of ``extra``) connect the available workers."""
        trial = self.dsu
        if extra:
            if self._surely_split(self.dsu.count - self.dsu.merges(extra)):
                return False
            trial = self.dsu.copy()
            trial.union(extra)
        elif self._surely_split(self.dsu.count):
            return False
        if len(self.dsu.parent) == self._available_count():
            # every item of the union is available (live workers are always items), and extra ones are too
            return trial.count <= 1
        return self._one_component(trial, extra)

    def _one_component(self, dsu: "DisjointSet", extra=()) -> bool:
        """Whether ``dsu`` holds the available workers and ``extra`` in one component (``dsu.connects`` of them,
        stopping at the first worker outside the first one's component)."""
        root, find, global_waiting = None, dsu.find, self.global_waiting
        for w in itertools.chain(self.live, extra):
            if w in global_waiting:
                continue
            r = find(w)
            if root is None:
                root = r
            elif r != root:
                return False
        return True

    def needs_graph_sync(self) -> bool:
        return self.since_reset >= (self.policy.staleness - 1) * self._available_count() and not self._connected()

    def next_deadline(self) -> Optional[float]:
        """When a Tick could close the open round (None: nothing to time)."""
        if self.open is None or self.open.graph or math.isinf(self.open.deadline):
            return None
        return self.open.deadline

    def set_policy(self, policy: SchedulerPolicy, now: float) -> list:
        """Change parameters; windows are reset to the new initial window.

        A pending round is re-examined under the new parameters at once.
        """
        self.policy = policy
        self.windows = {w: policy.window_init for w in self.live}
        self.arrivals = self.arrivals.renewed(policy)
        if self.open is not None and not self.open.graph:
            self._plan(self.open, self.open.members[0], self.open.opened)
        return self._try_close(now)

    def _plan(self, r: _Round, opener: int, now: float) -> None:
        """Set the open round's deadline (and, under rule "arrival", whom it waits for)."""
        typical = self.arrivals.typical() if self.policy.window == "arrival" else None
        if typical is None:  # rule "prototype", or no interval seen yet: the opener's adaptive window
            r.expected, r.deadline = None, now + self.windows[opener]
            r.missing = set()
            return
        candidates = self._live_mask.copy()  # live, not in the round, not waiting for the global group
        for busy in (self.waiting, self.global_waiting):
            if busy:
                candidates[list(busy)] = False
        r.expected, r.deadline = self.arrivals.plan(now, candidates, self.policy.horizon_fraction * typical)
        r.missing = set(r.expected)  # candidates are neither in the round nor waiting for the global group

    # -------------------------------------------------------------- events
    def handle(self, event: Event) -> list:
        """Apply one event; returns the decided groups (possibly none)."""
        if isinstance(event, Ready):
            return self._ready(event)
        if isinstance(event, Lost):
            return self._lost(event)
        if isinstance(event, Tick):
            return self._try_close(event.time)
        if isinstance(event, Join):
            return self._join(event)
        if isinstance(event, Hurry):
            return self.hurry(event.worker, event.time)
        if isinstance(event, Retune):
            return self.set_policy(event.policy, event.time)
        raise TypeError(f"event: {event!r} is not Ready, Lost, Tick, Join, Hurry or Retune")

    def validate(self) -> None:
        """Check the stage's invariants; an ``AssertionError`` names the first one broken.

        The workers inside the open round are live and are its members; none waits for both its round and the
        global group; what the stage keeps incrementally about its open round agrees with its definition (the
        workers rule "arrival" still waits for; whether a graph-sync round's members would connect the stage);
        the disjoint sets hold every live worker; the windows stay within the policy's bounds."""
        r = self.open
        members = set(r.members) if r is not None else set()
        assert self.waiting == members, f"stage {self.stage}: waiting {self.waiting} != round members {members}"
        assert members <= self.live, f"stage {self.stage}: round members {members - self.live} are not live"
        assert not (self.waiting & self.global_waiting), f"stage {self.stage}: in a round and the global group"
        assert self.global_waiting <= self.live, f"stage {self.stage}: {self.global_waiting - self.live} not live"
        assert self.live <= set(self.dsu.parent), f"stage {self.stage}: live workers missing from the disjoint sets"
        assert all(self._live_mask[w] for w in self.live), f"stage {self.stage}: live mask behind live"
        assert int(self._live_mask.sum()) == len(self.live), f"stage {self.stage}: live mask ahead of live"
        if r is not None:
            if r.expected is not None:
                outstanding = {w for w in r.expected if w not in members and w in self.live}
                outstanding -= self.global_waiting
                assert r.missing == outstanding, f"stage {self.stage}: missing {r.missing} != {outstanding}"
            if r.graph:
                assert self._graph_connected(r) == self._connected(r.members), f"stage {self.stage}: graph trial"
        assert self.since_reset >= 0, f"stage {self.stage}: negative update count"

    def hurry(self, w: int, now: float) -> list:
        """``handle(Hurry(w, now))``: the open round closes now if ``w`` is in it (else nothing changes)."""
        r = self.open
        if r is None or w not in self.waiting:
            return []
        return self._close(now, "preempted")

    def check_join(self, w: int, donor: Optional[int]) -> None:
        """A one-line ``ValueError`` when ``w`` cannot join this stage with ``donor``'s state."""
        if w in self.live:
            raise ValueError(f"worker: {w} already takes part in stage {self.stage}")
        if donor is not None and donor not in self.live:
            raise ValueError(f"donor: {donor} is not a live worker of stage {self.stage} (live: {sorted(self.live)})")

    def _join(self, ev: Join) -> list:
        w, donor = ev.worker, ev.donor
        self.check_join(w, donor)
        self.live.add(w)
        self._mark(w, True)
        self.windows[w] = self.policy.window_init
        self.dsu.find(w)  # a component of its own, or (with a donor) the donor's: its model is the donor's
        if donor is not None:
            self.dsu.union([donor, w])
        r = self.open
        if r is not None:
            r.trial = None  # the union changed under a graph-sync round's trial
            if r.expected is not None and w in r.expected and w not in r.members:
                r.missing.add(w)  # expected before it was lost: waited for again
        return self._try_close(ev.time)

    def _ready(self, ev: Ready) -> list:
        return self.ready(ev.worker, ev.time, ev.global_sync, ev.step)

    def ready(self, w: int, now: float, global_sync: bool = False, step: Optional[int] = None) -> list:
        """``handle(Ready(w, step, now, global_sync))`` without building the event (the simulator's hot path);
        ``step`` None counts the ready signal as one update."""
        if w not in self.live:
            raise ValueError(f"worker: {w} is not a live worker of stage {self.stage} (live: {sorted(self.live)})")
        waiting = self.waiting
        if w in waiting or w in self.global_waiting:
            raise ValueError(f"worker: {w} of stage {self.stage} is already waiting for a group")
        if step is not None:
            last = self._last_step.get(w)
            self._last_step[w] = step
            if last is not None and step - last > 1:
                self._updates[w] = step - last
        self.arrivals.ready(w, now)
        if global_sync:
            self.global_waiting.add(w)
            decisions = self._close(now, "preempted") if self.open is not None else []
            return decisions + self._try_global(now)
        waiting.add(w)
        r = self.open
        if r is None:
            # a graph-sync round needs the token; without it the stage forms an ordinary round meanwhile
            graph = self.may_graph_sync and self.needs_graph_sync()
            r = self.open = _Round([w], now, now, graph=graph)
            if not graph:
                self._plan(r, w, now)
        else:
            r.members.append(w)
            r.missing.discard(w)
        return self._try_close(now)

    def _lost(self, ev: Lost) -> list:
        w = ev.worker
        if w not in self.live:
            return []
        self.live.discard(w)
        self._mark(w, False)
        self.global_waiting.discard(w)
        self.waiting.discard(w)
        self.windows.pop(w, None)
        self._last_step.pop(w, None)
        self._updates.pop(w, None)
        self.arrivals.forget(w)
        decisions = []
        r = self.open
        if r is not None:
            r.missing.discard(w)
            if w in r.members:
                r.members.remove(w)
                r.trial = None  # the trial union held it
                if not r.members:
                    self.open = None
        decisions += self._try_global(ev.time)
        decisions += self._try_close(ev.time)
        return decisions

    def _try_global(self, now: float) -> list:
        if not self.global_waiting or self.global_waiting != self.live:
            return []
        members = tuple(sorted(self.global_waiting))
        self.global_waiting.clear()
        for m in members:
            self._updates.pop(m, None)
        self.arrivals.release_global(members)
        g = Group(
            self.stage, self.round, members, "global", now, now, tuple((m, self.windows[m]) for m in members), True
        )
        self.round += 1
        self.dsu = DisjointSet(self.live)
        self.since_reset = 0
        return [g]

    def _try_close(self, now: float) -> list:
        r = self.open
        if r is None:
            return []
        if r.graph:
            if self._graph_connected(r):
                return self._close(now, "graph")
            return []
        avail = len(self.live) - len(self.global_waiting)  # the largest group: max_group of the available workers
        cap = self.policy.max_group or avail
        if len(r.members) >= max(1, cap if cap < avail else avail):
            return self._close(now, "full")
        if r.expected is not None and len(r.members) > 1 and not r.missing:
            return self._close(now, "arrived")
        if now >= r.deadline:
            return self._close(now, "window")
        return []

    def _graph_connected(self, r: _Round) -> bool:
        """``_connected(r.members)`` for an open graph-sync round, from a union built once and extended by each
        member that came since (the round's members only grow until it closes, unless one is lost or joins)."""
        trial = r.trial
        if trial is None:
            trial = r.trial = self.dsu.copy()
            r.trial_members = 0
        members = r.members
        for m in members[r.trial_members :]:
            trial.union((members[0], m))
        r.trial_members = len(members)
        unavailable = len(self.dsu.parent) - self._available_count()
        if trial.count - unavailable > 1:  # _surely_split
            return False
        if unavailable == 0:  # the union's items are exactly the available workers
            return trial.count <= 1
        return self._one_component(trial, members)

    def _close(self, now: float, reason: str) -> list:
        r, self.open = self.open, None
        members = sorted(r.members)
        self.waiting.difference_update(members)
        self.arrivals.release(members, now)
        if reason != "graph" and self._available_count() > self.policy.pair_threshold and len(members) > 3:
            groups = [members[i : i + 2] for i in range(0, len(members) - 1, 2)]
            if len(members) % 2:
                groups[-1].append(members[-1])
        else:
            groups = [members]
        for g in groups:
            self.dsu.union(g)
        connected = self._connected()  # members are available workers, already in the union
        out = []
        windows, policy = self.windows, self.policy
        planned = r.deadline - r.opened if r.expected is not None else None
        for g in groups:
            if planned is not None:  # the rule "arrival" keeps no per-worker window: report the round's planned wait
                for m in g:
                    windows[m] = planned
                news = tuple([(m, planned) for m in g])
            else:
                for m in g:
                    wnd = windows[m]
                    if len(g) < policy.min_group:
                        wnd = min(wnd * policy.grow, policy.window_max) if wnd > 0 else policy.window_min
                    else:
                        wnd = max(wnd * policy.shrink, policy.window_min)
                    windows[m] = wnd
                news = tuple([(m, windows[m]) for m in g])
            why = (
                reason
                if len(g) > 1 or reason in ("graph", "preempted")
                else ("alone" if reason == "window" else reason)
            )
            out.append(_decided(self.stage, self.round, tuple(g), why, r.opened, now, news, connected))
        self.round += 1
        if connected:
            self.dsu = DisjointSet(self.live)
            self.since_reset = 0
        else:
            updates = self._updates
            self.since_reset += len(members) + (sum(updates.pop(m, 1) - 1 for m in members) if updates else 0)
        if self._updates:
            for m in members:
                self._updates.pop(m, None)
        return out

    # -------------------------------------------------------------- state
    def snapshot(self) -> dict:
        """A plain-data copy of the state, enough to rebuild the machine."""
        return {
            "stage": self.stage,
            "live": sorted(self.live),
            "windows": {str(k): v for k, v in self.windows.items()},
            "round": self.round,
            "since_reset": self.since_reset,
            "dsu": {str(k): v for k, v in self.dsu.parent.items()},
            "policy": self.policy.to_dict(),
            "arrivals": self.arrivals.snapshot(),
        }

    @classmethod
    def restore(cls, snap: dict) -> "StageScheduler":
        s = cls(snap["stage"], snap["live"], SchedulerPolicy(**snap["policy"]))
        # intervals carry over; release times do not: they are of the checkpointed run's clock, and a resumed
        # run's clock starts again (snapshots from before rule "arrival" have no arrivals at all)
        s.arrivals.restore({k: v for k, v in snap.get("arrivals", {}).items() if k != "released"})
        s.windows = {int(k): v for k, v in snap["windows"].items()}
        s.round = snap["round"]
        s.since_reset = snap["since_reset"]
        s.dsu.parent = {int(k): v for k, v in snap["dsu"].items()}
        s.dsu.count = sum(1 for k, v in s.dsu.parent.items() if k == v)
        return s


def _cycle(edges: dict) -> list:
    """The nodes of one cycle of the directed graph ``edges`` (node -> successors), or [] when it has none."""
    state: dict = {}  # node -> 1 on the current path, 2 done
    for root in edges:
        if root in state:
            continue
        path, stack = [], [(root, iter(edges.get(root, ())))]
        state[root] = 1
        path.append(root)
        while stack:
            node, succ = stack[-1]
            nxt = next(succ, None)
            if nxt is None:
                stack.pop()
                path.pop()
                state[node] = 2
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append((nxt, iter(edges.get(nxt, ()))))
    return []


def _stage_of(event) -> int:
    if event.stage is None:
        raise ValueError(f"event: {event!r} needs the stage of its worker")
    return event.stage


class GroupScheduler:
    """All stages of a run, with the one-graph-sync-at-a-time token (see the module docstring)."""

    def __init__(self, stages: int, pipelines: int, policy: SchedulerPolicy = SchedulerPolicy()):
        self.stages = [StageScheduler(s, range(pipelines), policy) for s in range(stages)]
        self.policy = policy
        self.graph_holder: Optional[int] = None
        self._deadline: Optional[float] = None  # next_deadline's answer, while ``_deadline_ok``
        self._deadline_ok = False

    def snapshot(self) -> dict:
        """Plain data: every stage's state and the graph-sync token."""
        return {
            "stages": [st.snapshot() for st in self.stages],
            "graph_holder": self.graph_holder,
            "policy": self.policy.to_dict(),
        }

    @classmethod
    def restore(cls, snap: dict) -> "GroupScheduler":
        g = cls.__new__(cls)
        g.stages = [StageScheduler.restore(st) for st in snap["stages"]]
        g.policy = SchedulerPolicy(**snap["policy"])
        g.graph_holder = snap["graph_holder"]
        g._deadline, g._deadline_ok = None, False
        g._flags()
        return g

    def validate(self) -> None:
        """Check every stage's invariants (:meth:`StageScheduler.validate`) and the graph-sync token's: at most
        one stage holds an open graph-sync round, it is the holder, and the stages' flags follow the holder.
        The tests run it after every event."""
        for st in self.stages:
            st.validate()
        graph = [st.stage for st in self.stages if st.open is not None and st.open.graph]
        assert len(graph) <= 1, f"stages {graph} hold graph-sync rounds at once"
        assert self.graph_holder == (graph[0] if graph else None), f"token at {self.graph_holder}, rounds {graph}"
        for st in self.stages:
            assert st.may_graph_sync == (self.graph_holder in (None, st.stage)), f"stage {st.stage}'s flag"

    def _flags(self) -> None:
        for st in self.stages:
            st.may_graph_sync = self.graph_holder is None or self.graph_holder == st.stage

    def _apply(self, now: float, fn) -> list:
        self._flags()
        self._deadline_ok = False
        out = fn()
        return out + self._settle(now)

    def handle(self, event: Event) -> list:
        """The one entry point of the group service and the simulator: apply ``event`` (to its ``stage``, or to
        every stage where an event of a whole pipeline has none) and return every decided group (any stage).

        :meth:`ready` is ``handle(Ready(...))`` without building the event (the simulator's hot path: tens of
        millions of ready signals in a large simulation)."""
        kind = type(event)
        if kind is Ready:
            return self.ready(_stage_of(event), event.worker, event.time, event.global_sync, event.step)
        if kind is Tick:
            return self.tick(event.time)
        if kind is Lost:
            if event.stage is None:
                return self.lost(event.worker, event.time)
            return self.leave(event.stage, event.worker, event.time)
        if kind is Join:
            if event.stage is None:
                return self.join(event.worker, event.time, event.donor)
            st = self.stages[event.stage]
            return self._apply(event.time, lambda: st.handle(event))
        if kind is Hurry:
            return self.hurry(_stage_of(event), event.worker, event.time)
        if kind is Retune:
            return self.set_policy(event.policy, event.time)
        raise TypeError(f"event: {event!r} is not Ready, Lost, Tick, Join, Hurry or Retune")

    def ready(self, stage: int, worker: int, now: float, global_sync: bool = False, step: Optional[int] = None) -> list:
        """``handle(stage, Ready(worker, step, now, global_sync))`` without building the event (the simulator's
        hot path)."""
        st = self.stages[stage]
        before = st.open
        out = st.ready(worker, now, global_sync, step)
        if out or st.open is not before:  # a round opened or closed: the deadlines changed (an open one's stays)
            self._deadline_ok = False
        # _settle, for an event of one stage: only this stage's round changed, and no other stage can hold an open
        # graph-sync round (the token keeps the others from opening one while a stage holds it)
        r, holder = st.open, self.graph_holder
        graph = r is not None and r.graph
        if (holder is None and graph) or (holder == stage and not graph):
            out = out + self._settle(now)  # with _unlock
        elif r is not None and (graph or r.deadline == math.inf) and len(self.stages) > 1:
            if self._may_lock(st, worker):
                out = out + self._unlock(now)
        return out

    def _may_lock(self, st: StageScheduler, w: int) -> bool:
        """Whether ``w``'s ready signal into ``st``'s open round without a deadline may have closed a cycle of
        rounds (:meth:`_unlock`): the round just opened (its waits are new), or a sibling of ``w`` that another
        such round waits for has reached the step ``w`` waits at (a new wait for this round).  O(stages): a run
        whose ready signals keep their steps in line never goes further."""
        if len(st.open.members) == 1:
            return True
        k = st._last_step.get(w)
        if k is None:
            return False
        for other in self.stages:
            o = other.open
            if other is st or o is None or not (o.graph or o.deadline == math.inf):
                continue
            if w in other.waiting or w in other.global_waiting or w not in other.live:
                continue
            last = other._last_step.get(w)
            if last is not None and last >= k:
                return True
        return False

    def tick(self, now: float) -> list:
        return self._apply(now, lambda: [g for st in self.stages for g in st.handle(Tick(now))])

    def lost(self, worker: int, now: float) -> list:
        """A whole pipeline is gone: remove it from every stage."""
        return self._apply(now, lambda: [g for st in self.stages for g in st.handle(Lost(worker, now))])

    def join(self, worker: int, now: float, donor: Optional[int] = None) -> list:
        """A whole pipeline joins (or rejoins): every stage's worker ``worker`` took the state of ``donor``'s.
        Checked in every stage before any changes: a refused join changes nothing."""
        for st in self.stages:
            st.check_join(worker, donor)
        return self._apply(now, lambda: [g for st in self.stages for g in st.handle(Join(worker, now, donor))])

    def hurry(self, stage: int, worker: int, now: float) -> list:
        """``worker`` of ``stage`` reached its epoch's end: its open round closes now (see :class:`Hurry`)."""
        return self._apply(now, lambda: self.stages[stage].hurry(worker, now))

    def leave(self, stage: int, worker: int, now: float) -> list:
        """One worker left its stage (its pipeline stopped)."""
        return self._apply(now, lambda: self.stages[stage].handle(Lost(worker, now)))

    def set_policy(self, policy: SchedulerPolicy, now: float) -> list:
        self.policy = policy
        return self._apply(now, lambda: [g for st in self.stages for g in st.set_policy(policy, now)])

    def _settle(self, now: float) -> list:
        """Track which stage holds the graph-sync token (the stages' flags follow it)."""
        holder = self.graph_holder
        if holder is not None:
            r = self.stages[holder].open
            if r is None or not r.graph:
                holder = None
        if holder is None:
            for st in self.stages:
                if st.open is not None and st.open.graph:
                    holder = st.stage
                    break
        if holder != self.graph_holder:
            self.graph_holder = holder
            self._flags()
        return self._unlock(now) if len(self.stages) > 1 else []

    def _unlock(self, now: float) -> list:
        """Close a round that waits, across stages, on itself (see "Rounds that wait on each other" in the module
        docstring): among the stages' open rounds without a deadline, a round waits for another when a worker it
        waits for has a sibling (the same pipeline's worker of another stage) held in the other one at a step
        the worker has already reached, which it must pass before the worker's next step can be made.  The
        first-opened round of a cycle closes at once with the members it holds ("preempted")."""
        held = [st for st in self.stages if st.open is not None and (st.open.graph or st.open.deadline == math.inf)]
        if len(held) < 2:
            return []
        where: dict = {}  # pipeline -> [(stage, the step its worker there waits at)]
        for st in held:
            steps = st._last_step
            for w in st.open.members:
                k = steps.get(w)
                if k is not None:
                    where.setdefault(w, []).append((st.stage, k))
        waits: dict = {}  # stage -> the stages whose rounds hold a worker that its round waits for
        for st in held:
            steps, out = st._last_step, set()
            for w, holds in where.items():
                if w in st.waiting or w not in st.live or w in st.global_waiting:
                    continue
                last = steps.get(w)
                if last is None:
                    continue
                out.update(s for s, k in holds if s != st.stage and last >= k)
            waits[st.stage] = out
        cycle = _cycle(waits)
        if not cycle:
            return []
        first = min(cycle, key=lambda s: (self.stages[s].open.opened, s))
        st = self.stages[first]
        self._deadline_ok = False
        out = st._close(now, "preempted")
        return out + self._settle(now)

    def next_deadline(self) -> Optional[float]:
        """The earliest of the stages' deadlines (``StageScheduler.next_deadline``, inlined: asked after every
        event; kept from the last time until a round opens or closes, or an event other than a ready signal
        comes: the stages are driven through this object)."""
        if self._deadline_ok:
            return self._deadline
        best = None
        for st in self.stages:
            r = st.open
            if r is None or r.graph:
                continue
            d = r.deadline
            if d != math.inf and (best is None or d < best):
                best = d
        self._deadline, self._deadline_ok = best, True
        return best
