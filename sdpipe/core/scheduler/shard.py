"""The group scheduler in shards: some stages' rounds decided in each, the waits across stages learnt by messages.

One :class:`~sdpipe.core.scheduler.GroupScheduler` decides every stage's rounds in one place; at thousands of
pipelines its ready signals come faster than one process answers them.  Each stage's rounds depend on the other
stages' in one way only: a round without a deadline (a graph sync, a round of the ``allreduce`` preset) can wait
for a worker whose sibling is held in another stage's such round (see "Rounds that wait on each other" in
:mod:`sdpipe.core.scheduler`), and a cycle of such waits must be broken.  So a :class:`StageShard` decides its own
stages' rounds alone and tells every other shard, by plain messages, only about its rounds without a deadline:

``["open", stage, round, opened, {pipeline: step}]``
    a round without a deadline opened (or changed its members by an event of a whole pipeline): the step each
    member is held at.
``["join", stage, round, pipeline, step]``
    a worker joined it.
``["close", stage, round]``
    it closed.
``["edges", stage, round, {other stage: its round}]``
    the rounds it waits for now: those holding a worker's sibling at a step the worker already reached (sent
    when that set changes).

A shard keeps the other shards' held rounds and edges as told, and its own stages' waits on every held round
(the rule of :func:`~sdpipe.core.scheduler.group._blocks`, kept as events and messages come).  When the waits it
knows form a cycle, the shard owning the cycle's first-opened round closes it ("preempted"); the others leave it
to that shard.  Messages between two shards must arrive in the order sent (one stream each way); they may arrive
any time later.  A cycle of rounds that wait on each other is stable (none of its waited workers can come), so
once the messages about it arrived its owner sees it and breaks it: no deadlock, whatever the delays.  A view
that is behind can show a cycle that is already gone; the round then closes early with the members it holds,
which is always allowed (a smaller group).  Edges name the round they point at, so an edge to a round that
closed is never taken for one to its successor.

:class:`ShardedScheduler` puts shards behind the interface of ``GroupScheduler`` with the messages in FIFO
queues, delivered at once or when the caller says (the tests deliver them late, in random orders).
"""

from __future__ import annotations

from typing import Iterable, Optional

from sdpipe.core.scheduler.group import DEFAULT_POLICY, _blocks, _cycle, _held_steps, _holds, bounds_of
from sdpipe.core.scheduler.policy import SchedulerPolicy
from sdpipe.core.scheduler.signals import Event, Hurry, Join, Lost, Ready, Retune, Tick
from sdpipe.core.scheduler.stage import StageScheduler

__all__ = ["ShardedScheduler", "StageShard"]


class StageShard:
    """The rounds of ``stages`` (a part of a run's), decided here; the rest of the run known by messages.

    ``handle(event, now)`` and ``receive(message, now)`` return the groups decided; the messages to send to
    every other shard collect in :attr:`outbox` (the caller empties it)."""

    def __init__(self, stages: Iterable[int], pipelines: int, policy: SchedulerPolicy = DEFAULT_POLICY):
        self.policy = policy
        self.local = {s: StageScheduler(s, range(pipelines), policy) for s in stages}
        self.outbox: list = []
        #: other shards' held rounds: stage -> [round, opened, {pipeline: step}]
        self.remote: dict = {}
        #: other shards' edges as they said: stage -> (its round, {stage: round})
        self.remote_edges: dict = {}
        #: this shard's held rounds: stage -> round number
        self.held: dict = {}
        #: (local held stage a, held stage b) -> the pipelines a's round waits for that b's round holds
        self.wit: dict = {}
        self._sent: dict = {}  # local held stage -> the edges last sent

    # ---------------------------------------------------------------- the held rounds this shard knows
    def _rounds(self) -> dict:
        """Every held round known here: stage -> (round, opened)."""
        out = {a: (r, self.local[a].open.opened) for a, r in self.held.items()}
        out.update({b: (m[0], m[1]) for b, m in self.remote.items()})
        return out

    def _steps(self, b: int) -> dict:
        return _held_steps(self.local[b]) if b in self.held else self.remote[b][2]

    def _waits(self, a: int, b: int) -> set:
        st = self.local[a]
        return {v for v, k in self._steps(b).items() if _blocks(st, v, k)}

    def _recompute(self) -> None:
        """Every wait of this shard's held rounds, from scratch (after an event that may change any of them)."""
        others = list(self.held) + list(self.remote)
        self.wit = {(a, b): self._waits(a, b) for a in self.held for b in others if b != a}

    # ---------------------------------------------------------------- events of this shard's stages
    def handle(self, event: Event) -> list:
        kind = type(event)
        if kind is Ready:
            return self.ready(event.stage, event.worker, event.time, event.global_sync, event.step)
        now = event.time
        before = {a: (r, len(self.local[a].open.members)) for a, r in self.held.items()}
        if kind is Tick:
            out = [g for st in self.local.values() for g in st.handle(event)]
        elif kind is Retune:
            self.policy = event.policy
            out = [g for st in self.local.values() for g in st.set_policy(event.policy, now)]
        elif kind is Hurry:
            out = self.local[event.stage].hurry(event.worker, now) if event.stage in self.local else []
        elif kind in (Lost, Join):
            if kind is Join and event.stage is None:
                for st in self.local.values():
                    st.check_join(event.worker, event.donor)
            targets = self.local.values() if event.stage is None else [self.local[event.stage]]
            out = [g for st in targets for g in st.handle(event)]
        else:
            raise TypeError(f"event: {event!r} is not Ready, Lost, Tick, Join, Hurry or Retune")
        for a, st in self.local.items():  # rounds without a deadline whose members an event changed: said anew
            now_held = (st.round, len(st.open.members)) if _holds(st) else None
            if before.get(a) != now_held:
                if a in before:
                    self._close_held(a, before[a][0])
                if now_held is not None:
                    self._open_held(a)
        self._recompute()
        return out + self._after(now)

    def ready(self, stage: int, worker: int, now: float, global_sync: bool = False, step: Optional[int] = None):
        st = self.local[stage]
        before = st.open
        out = st.ready(worker, now, global_sync, step)
        held = _holds(st)
        if not (held or stage in self.held):
            return out
        if out or st.open is not before:
            if stage in self.held:
                self._close_held(stage, self.held[stage])
            if held:
                self._open_held(stage)
        else:
            self._joined(stage, worker)
        return out + self._after(now)

    def _open_held(self, a: int) -> None:
        st = self.local[a]
        self.held[a] = st.round
        for b in list(self.held) + list(self.remote):
            if b == a:
                continue
            self.wit[(a, b)] = self._waits(a, b)
            if b in self.held:
                self.wit[(b, a)] = self._waits(b, a)
        self.outbox.append(["open", a, st.round, st.open.opened, _held_steps(st)])

    def _close_held(self, a: int, round_: int) -> None:
        del self.held[a]
        self._sent.pop(a, None)
        self.wit = {k: v for k, v in self.wit.items() if a not in k}
        self.outbox.append(["close", a, round_])

    def _joined(self, a: int, w: int) -> None:
        """``w`` joined ``a``'s held round: ``a`` no longer waits for it; held rounds here whose ``w`` passed the
        step it is held at in ``a`` now wait on ``a``."""
        st = self.local[a]
        k = st._last_step.get(w)
        for (x, _), who in self.wit.items():
            if x == a:
                who.discard(w)
        if k is None:
            return
        for b in self.held:
            if b != a and _blocks(self.local[b], w, k):
                self.wit[(b, a)].add(w)
        self.outbox.append(["join", a, st.round, w, k])

    # ---------------------------------------------------------------- messages from other shards
    def receive(self, msg: list, now: float) -> list:
        """Apply another shard's message (see the module docstring); returns the groups it made this shard
        decide (a round of a cycle it now sees, preempted)."""
        kind, b = msg[0], msg[1]
        if kind == "open":
            _, _, round_, opened, steps = msg
            self.remote[b] = [round_, opened, {int(v): k for v, k in steps.items()}]
            self.remote_edges.pop(b, None)
            for a in self.held:
                self.wit[(a, b)] = self._waits(a, b)
        elif kind == "join":
            _, _, round_, w, k = msg
            m = self.remote.get(b)
            if m is None or m[0] != round_:
                return []
            m[2][w] = k
            for a in self.held:
                if _blocks(self.local[a], w, k):
                    self.wit[(a, b)].add(w)
        elif kind == "close":
            m = self.remote.get(b)
            if m is None or m[0] != msg[2]:
                return []
            del self.remote[b]
            self.remote_edges.pop(b, None)
            self.wit = {k: v for k, v in self.wit.items() if k[1] != b}
        elif kind == "edges":
            _, _, round_, targets = msg
            m = self.remote.get(b)
            if m is None or m[0] != round_:
                return []
            self.remote_edges[b] = (round_, {int(s): r for s, r in targets.items()})
        else:
            raise ValueError(f"message: {kind!r} is not open, join, close or edges")
        return self._after(now)

    # ---------------------------------------------------------------- edges and cycles
    def _edges(self, rounds: dict) -> dict:
        """The waits between held rounds this shard knows (``rounds``: :meth:`_rounds`; an edge to a round that
        closed since is left out)."""
        edges: dict = {}
        for (a, b), who in self.wit.items():
            if who:
                edges.setdefault(a, set()).add(b)
        for b, (_, targets) in self.remote_edges.items():
            for c, r in targets.items():
                if rounds.get(c, (None,))[0] == r:
                    edges.setdefault(b, set()).add(c)
        return edges

    def _after(self, now: float) -> list:
        """Say the edges of this shard's held rounds that changed, then break a cycle whose first-opened round
        is this shard's."""
        rounds = self._rounds()
        for a in self.held:
            targets = {b: rounds[b][0] for (x, b), who in self.wit.items() if x == a and who}
            if self._sent.get(a) != targets:
                self._sent[a] = targets
                self.outbox.append(["edges", a, self.held[a], dict(targets)])
        cycle = _cycle(self._edges(rounds)) if len(rounds) > 1 else []
        if not cycle:
            return []
        first = min(cycle, key=lambda s: (rounds[s][1], s))
        if first not in self.held:
            return []  # its shard breaks it
        st = self.local[first]
        out = st._close(now, "preempted")
        self._close_held(first, self.held[first])
        return out + self._after(now)

    def validate(self) -> None:
        for st in self.local.values():
            st.validate()
        held = {a: st.round for a, st in self.local.items() if _holds(st)}
        assert held == self.held, f"held rounds kept {self.held}, are {held}"
        others = list(self.held) + list(self.remote)
        scratch = {(a, b): self._waits(a, b) for a in self.held for b in others if b != a}
        kept = {k: v for k, v in self.wit.items() if v}
        assert kept == {k: v for k, v in scratch.items() if v}, f"waits kept {kept}, are {scratch}"


class ShardedScheduler:
    """Shards of a run's group scheduler behind :class:`~sdpipe.core.scheduler.GroupScheduler`'s interface.

    ``shards``: how many (the stages dealt round-robin; default one per stage).  Messages between shards wait
    in one FIFO queue per ordered pair until :meth:`deliver` (``immediate=True``: after every event, so every
    shard's view is current whenever an event comes)."""

    def __init__(self, stages: int, pipelines: int, policy=DEFAULT_POLICY, shards=None, immediate: bool = True):
        n = stages if shards is None else max(1, min(int(shards), stages))
        self.shards = [StageShard(range(i, stages, n), pipelines, policy) for i in range(n)]
        self.owner = {s: sh for sh in self.shards for s in sh.local}
        #: every stage's scheduler, by stage (as ``GroupScheduler.stages``)
        self.stages = [self.owner[s].local[s] for s in range(stages)]
        self.queues = {(i, j): [] for i in range(n) for j in range(n) if i != j}
        self.immediate = immediate
        self.policy = policy
        self.sent = 0  # messages sent between shards

    def _post(self, i: int) -> None:
        sh = self.shards[i]
        if sh.outbox:
            for j in range(len(self.shards)):
                if j != i:
                    self.queues[(i, j)].extend(sh.outbox)
            self.sent += len(sh.outbox) * (len(self.shards) - 1)
            sh.outbox = []

    def _done(self, i: int, out: list, now: float) -> list:
        self._post(i)
        return out + self.deliver(now) if self.immediate else out

    def ready(self, stage: int, worker: int, now: float, global_sync: bool = False, step=None) -> list:
        sh = self.owner[stage]
        return self._done(self.shards.index(sh), sh.ready(stage, worker, now, global_sync, step), now)

    def handle(self, event: Event) -> list:
        if type(event) is Ready:
            return self.ready(event.stage, event.worker, event.time, event.global_sync, event.step)
        if type(event) is Retune:
            self.policy = event.policy
        stage = getattr(event, "stage", None)
        if type(event) is Join and stage is None:  # checked in every shard before any changes
            for sh in self.shards:
                for st in sh.local.values():
                    st.check_join(event.worker, event.donor)
        out = []
        for i, sh in enumerate(self.shards):
            if stage is None or stage in sh.local:
                out += sh.handle(event)
                self._post(i)
        return out + self.deliver(event.time) if self.immediate else out

    def tick(self, now: float) -> list:
        return self.handle(Tick(now))

    def pending(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def deliver(self, now: float, count: Optional[int] = None, rng=None) -> list:
        """Deliver queued messages (all, until none is left; or ``count`` of them, each from a queue ``rng``
        picks, in order within the queue); returns the groups they made shards decide."""
        out = []
        while count is None or count > 0:
            busy = [k for k, q in self.queues.items() if q]
            if not busy:
                break
            i, j = rng.choice(busy) if rng is not None else busy[0]
            msg = self.queues[(i, j)].pop(0)
            out += self.shards[j].receive(msg, now)
            self._post(j)
            if count is not None:
                count -= 1
        return out

    def snapshot(self) -> dict:
        """Plain data, as :meth:`GroupScheduler.snapshot <sdpipe.core.scheduler.GroupScheduler.snapshot>`."""
        return {"stages": [st.snapshot() for st in self.stages], "policy": self.policy.to_dict()}

    def bounds(self) -> list:
        return bounds_of(self.snapshot())

    def next_deadline(self) -> Optional[float]:
        ds = [st.next_deadline() for st in self.stages]
        ds = [d for d in ds if d is not None]
        return min(ds) if ds else None

    def graph_stages(self) -> list:
        return [st.stage for st in self.stages if st.open is not None and st.open.graph]

    def validate(self) -> None:
        """Every shard's invariants; once every message arrived, every view equals the others' truth and no
        cycle is left open."""
        for sh in self.shards:
            sh.validate()
        if self.pending():
            return
        truth = {}
        for sh in self.shards:
            for a in sh.held:
                truth[a] = [sh.held[a], sh.local[a].open.opened, _held_steps(sh.local[a])]
        edges: dict = {}
        for sh in self.shards:
            assert sh.remote == {b: m for b, m in truth.items() if b not in sh.local}, (sh.remote, truth)
            for (a, b), who in sh.wit.items():
                if who:
                    edges.setdefault(a, set()).add(b)
        assert not _cycle(edges), f"rounds of stages {_cycle(edges)} wait on each other"
