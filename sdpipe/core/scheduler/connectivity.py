"""One stage's connectivity bound: whether the groups since the last reset connect its available workers."""

from __future__ import annotations

import itertools

from sdpipe.core.scheduler.arrivals import _Round
from sdpipe.core.scheduler.dsu import DisjointSet

__all__ = ["Connectivity"]


class Connectivity:
    """The union of a stage's groups since the sync graph last connected its available workers (live, not waiting
    for the global group), and the updates (the members' steps) counted since.  Past ``(P - 1) x available``
    updates without connecting, the stage's next round is a graph-sync round, which closes once its members
    would connect the union (the staleness bound P of the paper).

    ``live`` and ``global_waiting`` are the stage's own sets, read here and changed only by the stage."""

    def __init__(self, live: set, global_waiting: set):
        self.live, self.global_waiting = live, global_waiting
        self.dsu = DisjointSet(live)
        self.since_reset = 0  # updates (the members' steps since their last ready signals) since the union connected
        #: the most updates the union went without connecting the stage (the count before a connecting round, or the
        #: count now): the longest unconnected stretch, which the bound keeps below P x D
        self.longest = 0
        #: the most steps one ready signal carried beyond its own in the last stretch and in this one (a worker
        #: goes on without ready signals while its overlapped averaging is in flight): a graph sync starts that
        #: many steps of every worker earlier, so that the steps its members bring stay within the bound
        self.lag, self._lag_now = 0, 0

    def reset(self) -> None:
        """The union connected (or a global group averaged everyone): each live worker a component of its own."""
        self.dsu = DisjointSet(self.live)
        self.since_reset = 0
        self.lag, self._lag_now = self._lag_now, 0

    def carried(self, steps: int) -> None:
        """A ready signal carried ``steps`` steps beyond its own."""
        if steps > self._lag_now:
            self._lag_now = steps

    def joined(self, w: int, donor) -> None:
        """``w`` joins: a component of its own, or (with a donor) the donor's: its model is the donor's."""
        self.dsu.find(w)
        if donor is not None:
            self.dsu.union([donor, w])

    def closed(self, groups: list, updates: int, cut_short: bool = False) -> bool:
        """A round closed into ``groups`` of ``updates`` updates in all; whether they connected the union (which then
        starts again).  ``cut_short``: a round a global group preempted (the epoch ends: the global group, which
        follows, connects everyone): its updates count towards the bound, not towards the longest stretch."""
        for g in groups:
            self.dsu.union(g)
        if self.connected():  # the members are available workers, already in the union
            self.reset()
            return True
        self.since_reset += updates
        if self.since_reset > self.longest and not cut_short:
            self.longest = self.since_reset
        return False

    def needs_graph_sync(self, staleness: int) -> bool:
        """Past ``(P - 1 - lag) x available`` updates without connecting (``lag``: see :attr:`lag`)."""
        lag = max(self.lag, self._lag_now)
        return self.since_reset >= max(0, staleness - 1 - lag) * self._available_count() and not self.connected()

    def _available_count(self) -> int:
        """The available workers (global waiters are always live)."""
        return len(self.live) - len(self.global_waiting)

    def _surely_split(self, components: int) -> bool:
        """True when a union with ``components`` components cannot connect the available workers.

        Each item that is not available (gone, or waiting for the global
        group) can account for at most one component, so more components than
        that plus one means split.  This spares an O(D) check per event.
        """
        unavailable = len(self.dsu.parent) - self._available_count()
        return components - unavailable > 1

    def connected(self, extra=()) -> bool:
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

    def _one_component(self, dsu: DisjointSet, extra=()) -> bool:
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

    def graph_connected(self, r: _Round) -> bool:
        """``connected(r.members)`` for an open graph-sync round, from a union built once and extended by each
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
        # some items are not available (gone, or waiting for the global group): look for an available worker
        # outside the members' component, first the one found last time (a round waiting for its last slow
        # workers finds one at once; a full scan only once that one has joined: amortized over the merges)
        find, root, w = trial.find, trial.find(members[0]), r.witness
        if w is not None and w in self.live and w not in self.global_waiting and find(w) != root:
            return False
        global_waiting = self.global_waiting
        for w in self.live:
            if w not in global_waiting and find(w) != root:
                r.witness = w
                return False
        return True
