"""All stages of a run (:class:`GroupScheduler`): the one entry point, rounds that wait on each other across stages
broken."""

from __future__ import annotations

import math
from typing import Optional

from sdpipe.core.scheduler.policy import SchedulerPolicy
from sdpipe.core.scheduler.signals import Event, Hurry, Join, Lost, Ready, Retune, Tick
from sdpipe.core.scheduler.stage import StageScheduler

__all__ = ["GroupScheduler", "bounds_of"]


#: the parameters of a scheduler given none (a frozen value: one instance serves every scheduler)
DEFAULT_POLICY = SchedulerPolicy()


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


def bounds_of(snapshot: dict) -> list:
    """Per stage of a scheduler's ``snapshot`` (:meth:`GroupScheduler.snapshot`, also the group service's
    ``state()["core"]``): ``{"stage", "longest", "now", "bound"}``: the most updates its sync graph went without
    connecting the stage (the longest unconnected stretch: the count before a connecting round, or now), the
    updates since it last connected, and the bound P x D (D: the stage's live workers now) the stretch stays
    below."""
    out = []
    for st in snapshot["stages"]:
        staleness = st["policy"]["staleness"]
        out.append(
            {
                "stage": st["stage"],
                "longest": st.get("longest", 0),
                "now": st["since_reset"],
                "bound": staleness * len(st["live"]),
            }
        )
    return out


def _holds(st: StageScheduler) -> bool:
    """Whether ``st``'s open round has no deadline (a graph sync, or any round under an infinite window)."""
    r = st.open
    return r is not None and (r.graph or r.deadline == math.inf)


def _held_steps(st: StageScheduler) -> dict:
    """``{member: the step it is held at}`` of ``st``'s open round (members without a step are never waited on)."""
    last = st._last_step
    return {v: last[v] for v in st.open.members if v in last}


def _blocks(a: StageScheduler, v: int, k: int) -> bool:
    """Whether ``a``'s round waits for ``v`` whose sibling is held in another stage's round at step ``k``, which
    ``a``'s worker ``v`` already reached (so ``v`` cannot come before that round closes)."""
    if v in a.waiting or v in a.global_waiting or v not in a.live:
        return False
    last = a._last_step.get(v)
    return last is not None and last >= k


def _waited(a: StageScheduler, b: StageScheduler) -> set:
    """The pipelines ``a``'s round waits for whose worker in ``b`` is held in ``b``'s round at a step ``a``'s
    worker already reached (both rounds without a deadline)."""
    return {v for v, k in _held_steps(b).items() if _blocks(a, v, k)}


def _stage_of(event) -> int:
    if event.stage is None:
        raise ValueError(f"event: {event!r} needs the stage of its worker")
    return event.stage


class GroupScheduler:
    """All stages of a run: each stage's rounds (graph syncs included) on their own, a cycle of rounds that wait on
    each other across stages broken (see the module docstring)."""

    def __init__(self, stages: int, pipelines: int, policy: SchedulerPolicy = DEFAULT_POLICY):
        self.stages = [StageScheduler(s, range(pipelines), policy) for s in range(stages)]
        self.policy = policy
        self._deadline: Optional[float] = None  # next_deadline's answer, while ``_deadline_ok``
        self._deadline_ok = False
        #: the waits across stages (:meth:`_unlock`), kept as events come: (a, b) -> the pipelines that stage a's
        #: round without a deadline waits for whose stage-b worker is held in b's such round at a step a's worker
        #: already reached; and each stage with such a round, by the round they were built for
        self._wit: dict = {}
        self._held: dict = {}

    def snapshot(self) -> dict:
        """Plain data: every stage's state and the policy."""
        return {"stages": [st.snapshot() for st in self.stages], "policy": self.policy.to_dict()}

    @classmethod
    def restore(cls, snap: dict) -> "GroupScheduler":
        g = cls.__new__(cls)
        g.stages = [StageScheduler.restore(st) for st in snap["stages"]]
        g.policy = SchedulerPolicy(**snap["policy"])
        g._deadline, g._deadline_ok = None, False
        g._rebuild()
        return g

    def bounds(self) -> list:
        """Per stage, the connectivity bound against what it held: :func:`bounds_of` of :meth:`snapshot`."""
        return bounds_of(self.snapshot())

    def graph_stages(self) -> list:
        """The stages whose open round is a graph sync (several may hold one at once)."""
        return [st.stage for st in self.stages if st.open is not None and st.open.graph]

    def validate(self) -> None:
        """Check every stage's invariants (:meth:`StageScheduler.validate`) and that no cycle of rounds waiting on
        each other across stages is left open (:meth:`_unlock` closed it).  The tests run it after every event."""
        for st in self.stages:
            st.validate()
        held = {st.stage: st.open for st in self.stages if _holds(st)}
        assert self._held == held or len(self.stages) == 1, f"held rounds kept {sorted(self._held)}, are {sorted(held)}"
        kept = {k: v for k, v in self._wit.items() if v}
        scratch = {k: v for k, v in self._witnesses().items() if v}
        assert kept == scratch or len(self.stages) == 1, f"waits across stages kept {kept}, are {scratch}"
        assert not _cycle(self._edges()), f"rounds of stages {_cycle(self._edges())} wait on each other"

    def _apply(self, now: float, fn) -> list:
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
        if len(self.stages) > 1 and (self._held or _holds(st)):
            out = out + self._track(st, worker, before, bool(out), now)
        return out

    def _track(self, st: StageScheduler, w: int, before, closed: bool, now: float) -> list:
        """Keep the waits across stages after ``w``'s ready signal to ``st`` (only ``st``'s round changed), and
        break a cycle they close: O(stages) when ``w`` joined a round without a deadline; O(members of such
        rounds) when one opened; nothing for ordinary rounds."""
        held = _holds(st)
        if closed or st.open is not before:  # st's round closed or opened: its waits anew
            self._drop(st.stage)
            if not held:
                return []
            self._add(st)
        elif held:
            self._joined(st, w)
        else:
            return []
        return self._unlock(now)

    def _add(self, st: StageScheduler) -> None:
        """``st``'s round without a deadline opened: its waits on the others' and theirs on it."""
        a = st.stage
        self._held[a] = st.open
        for b, other in ((b, self.stages[b]) for b in self._held if b != a):
            self._wit[(a, b)] = _waited(st, other)
            self._wit[(b, a)] = _waited(other, st)

    def _drop(self, a: int) -> None:
        if self._held.pop(a, None) is not None:
            for b in self._held:
                self._wit.pop((a, b), None)
                self._wit.pop((b, a), None)

    def _joined(self, st: StageScheduler, w: int) -> None:
        """``w`` joined ``st``'s round without a deadline: ``st`` no longer waits for it; the others' rounds that
        wait for their own ``w`` whose step passed the one ``w`` is held at here now wait on ``st``."""
        a, k = st.stage, st._last_step.get(w)
        for b in self._held:
            if b == a:
                continue
            self._wit[(a, b)].discard(w)
            if k is not None and _blocks(self.stages[b], w, k):
                self._wit[(b, a)].add(w)

    def _rebuild(self) -> None:
        """The waits across stages from scratch (after an event that may have changed any stage)."""
        self._held = {st.stage: st.open for st in self.stages if _holds(st)} if len(self.stages) > 1 else {}
        self._wit = self._witnesses()

    def _witnesses(self) -> dict:
        held = [st for st in self.stages if _holds(st)] if len(self.stages) > 1 else []
        return {(a.stage, b.stage): _waited(a, b) for a in held for b in held if a is not b}

    def _edges(self) -> dict:
        edges: dict = {}
        for (a, b), who in self._wit.items():
            if who:
                edges.setdefault(a, set()).add(b)
        return edges

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
        """After an event that may have changed any stage: the waits across stages anew, and a cycle broken."""
        if len(self.stages) == 1:
            return []
        if self._held or any(_holds(st) for st in self.stages):
            self._rebuild()
        return self._unlock(now)

    def _unlock(self, now: float) -> list:
        """Close a round that waits, across stages, on itself (see "Rounds that wait on each other" in the module
        docstring): among the stages' open rounds without a deadline (graph syncs of any number of stages, rounds
        of the ``allreduce`` preset), a round waits for another when a worker it waits for has a sibling (the same
        pipeline's worker of another stage) held in the other one at a step the worker has already reached, which
        it must pass before the worker's next step can be made.  The first-opened round of a cycle closes at once
        with the members it holds ("preempted"); then the next cycle, if one is left.  The waits are kept as
        events come (:attr:`_wit`), so finding a cycle is O(stages^2)."""
        cycle = _cycle(self._edges()) if len(self._held) > 1 else []
        if not cycle:
            return []
        first = min(cycle, key=lambda s: (self.stages[s].open.opened, s))
        st = self.stages[first]
        self._deadline_ok = False
        out = st._close(now, "preempted")
        self._drop(first)
        return out + self._unlock(now)

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
