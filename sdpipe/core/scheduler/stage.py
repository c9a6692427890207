"""One stage's group scheduler (:class:`StageScheduler`): its rounds, windows and connectivity bound."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Optional

import numpy as np

from sdpipe.core.scheduler.arrivals import _Arrivals, _Round
from sdpipe.core.scheduler.connectivity import Connectivity
from sdpipe.core.scheduler.dsu import DisjointSet
from sdpipe.core.scheduler.policy import SchedulerPolicy
from sdpipe.core.scheduler.signals import Event, Group, Hurry, Join, Lost, Ready, Retune, Tick, _decided

__all__ = ["StageScheduler"]


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
        self.global_waiting: set = set()
        #: the connectivity bound: the union of the groups since the last reset, and the updates since
        self.bound = Connectivity(self.live, self.global_waiting)
        #: worker -> the step of its last ready signal, and how many steps the one waiting now counts for (a worker
        #: whose averaging was still in flight goes on without ready signals: its steps still count as updates)
        self._last_step: dict = {}
        self._updates: dict = {}
        self.waiting: set = set()  # workers inside the open round
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

    @property
    def dsu(self) -> DisjointSet:
        """The union of the groups since the sync graph last connected the stage (:class:`Connectivity`)."""
        return self.bound.dsu

    @property
    def longest(self) -> int:
        """The longest unconnected stretch of the stage so far, in updates (:attr:`Connectivity.longest`)."""
        return self.bound.longest

    @property
    def since_reset(self) -> int:
        """Updates since the sync graph last connected the stage."""
        return self.bound.since_reset

    def needs_graph_sync(self) -> bool:
        return self.bound.needs_graph_sync(self.policy.staleness)

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
        _check(self)

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
        self.bound.joined(w, donor)
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
                self.bound.carried(step - last - 1)
        self.arrivals.ready(w, now)
        if global_sync:
            self.global_waiting.add(w)
            decisions = self._close(now, "preempted") if self.open is not None else []
            return decisions + self._try_global(now)
        waiting.add(w)
        r = self.open
        if r is None:
            graph = self.needs_graph_sync()
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
        self.bound.reset()
        return [g]

    def _try_close(self, now: float) -> list:
        r = self.open
        if r is None:
            return []
        if r.graph:
            if self.bound.graph_connected(r):
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

    def _close(self, now: float, reason: str) -> list:
        r, self.open = self.open, None
        members = sorted(r.members)
        self.waiting.difference_update(members)
        self.arrivals.release(members, now)
        available = len(self.live) - len(self.global_waiting)
        pair = reason != "graph" and available > self.policy.pair_threshold and len(members) > 3
        groups = _split(members, self.policy.pairing, self.bound.dsu.find) if pair else [members]
        updates = self._updates
        count = len(members) + (sum(updates.get(m, 1) - 1 for m in members) if updates else 0)
        connected = self.bound.closed(groups, count, cut_short=reason == "preempted")
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
                    windows[m] = policy.next_window(windows[m], len(g))
                news = tuple([(m, windows[m]) for m in g])
            why = "alone" if len(g) == 1 and reason == "window" else reason
            out.append(_decided(self.stage, self.round, tuple(g), why, r.opened, now, news, connected))
        self.round += 1
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
            "longest": self.bound.longest,
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
        s.bound.since_reset = snap["since_reset"]
        s.bound.longest = snap.get("longest", 0)  # snapshots from before it was kept have none
        s.bound.dsu.parent = {int(k): v for k, v in snap["dsu"].items()}
        s.bound.dsu.count = sum(1 for k, v in s.bound.dsu.parent.items() if k == v)
        return s


def _split(members: list, pairing: str, find) -> list:
    """A large round's members in pairs (:attr:`SchedulerPolicy.pairing`), each sorted; an odd one out joins a
    pair (a group of three)."""
    if pairing == "neighbours":
        return _pairs(members)
    return _across(members, find)


def _pairs(members: list) -> list:
    """A large round's members in pairs of neighbours (the last three together when their number is odd)."""
    groups = [members[i : i + 2] for i in range(0, len(members) - 1, 2)]
    if len(members) % 2:
        groups[-1].append(members[-1])
    return groups


def _across(members: list, find) -> list:
    """Pairs that join two components of the union where they can: the members sorted by component, each of the
    first half with its counterpart in the second (no component of at most half the members holds both); an odd
    one out joins the first pair it adds a component to (the last pair if none)."""
    by = sorted(members, key=lambda m: (find(m), m))
    half = len(by) // 2
    groups = [[by[i], by[i + half]] for i in range(half)]
    if len(by) % 2:
        odd = by[-1]
        root = find(odd)
        at = next((g for g in groups if find(g[0]) != root and find(g[1]) != root), groups[-1])
        at.append(odd)
    return [sorted(g) for g in groups]


def _check(st: "StageScheduler") -> None:
    """The invariants :meth:`StageScheduler.validate` checks."""
    r = st.open
    members = set(r.members) if r is not None else set()
    assert st.waiting == members, f"stage {st.stage}: waiting {st.waiting} != round members {members}"
    assert members <= st.live, f"stage {st.stage}: round members {members - st.live} are not live"
    assert not (st.waiting & st.global_waiting), f"stage {st.stage}: in a round and the global group"
    assert st.global_waiting <= st.live, f"stage {st.stage}: {st.global_waiting - st.live} not live"
    assert st.live <= set(st.dsu.parent), f"stage {st.stage}: live workers missing from the disjoint sets"
    assert all(st._live_mask[w] for w in st.live), f"stage {st.stage}: live mask behind live"
    assert int(st._live_mask.sum()) == len(st.live), f"stage {st.stage}: live mask ahead of live"
    if r is not None:
        if r.expected is not None:
            outstanding = {w for w in r.expected if w not in members and w in st.live}
            outstanding -= st.global_waiting
            assert r.missing == outstanding, f"stage {st.stage}: missing {r.missing} != {outstanding}"
        if r.graph:
            assert st.bound.graph_connected(r) == st.bound.connected(r.members), f"stage {st.stage}: trial"
    assert st.since_reset >= 0, f"stage {st.stage}: negative update count"
