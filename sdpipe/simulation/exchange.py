"""How the replicas meet in simulated time: one class per :attr:`~sdpipe.core.policies.PolicyRecord.exchange`.

The engine (:mod:`sdpipe.simulation.engine`) owns the timeline, the pipelines and the proxy; after a worker's
optimizer step it hands the worker's ``ready`` to its run's exchange, which syncs it as the policy says and
hands it back with the engine's ``_on_synced`` when its sync ended::

    exchange   class          a worker's ready                          the epoch's global sync
    nothing    _NoSync        goes on at once                           none
    groups     _CoreRounds    to the scheduler core, a group's ring     through the core (every stage)
    all        _CoreRounds    the same core, every worker each round    the same
    pairs      _PairSync      an even pipeline's exchange with a peer   through the core, as groups
    server     _ServerSync    a push to its stage's server, a pull back at the server, all pipelines at once

Each exchange also says what its events are (``handlers``), what a pipeline's end of epoch and a pipeline
leaving or joining mean to it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sdpipe.core.scheduler import GroupScheduler, Hurry, Join, Lost, Tick
from sdpipe.core.sync_rules import GLOBAL, PAIR, SERVED, STEP, gossip_roles
from sdpipe.simulation.costs import allreduce_seconds
from sdpipe.simulation.proxy import _Server
from sdpipe.wire import events

if TYPE_CHECKING:
    from sdpipe.simulation.engine import _Simulation

__all__ = []


class _NoSync:
    """``none``: a worker goes on at once, an epoch ends without a global sync."""

    core = None

    def __init__(self, sim: _Simulation):
        self.sim = sim
        self.on_ready = sim._on_synced

    def handlers(self) -> dict:
        return {}

    def epoch_end(self, t: float, p: int) -> None:  # pragma: no cover - the engine goes on without asking
        raise AssertionError("none has no global sync")

    def lost(self, p: int, t: float) -> None:
        pass

    def joined(self, p: int, t: float, donor) -> None:
        pass


class _CoreRounds:
    """``sdpipe`` and ``allreduce``: every ready signal goes to the group scheduler core (the real
    :class:`~sdpipe.core.scheduler.GroupScheduler`), whose groups each cost the round trip, the slowest member's
    link delay and a ring all-reduce of the stage's weights, and average their members' proxies.

    With ``SchedulerPolicy.overlap`` a worker goes on at its ready signal: its group's averaging runs meanwhile
    and must have ended before the worker's next ready signal (``averaging``), for fewer than ``max_lag`` steps
    (the staleness bound P, as ``Scheduled.max_lag``)."""

    def __init__(self, sim: _Simulation):
        self.sim = sim
        config, S, D = sim.config, sim.S, sim.D
        self.S = S
        self.core = GroupScheduler(S, D, config.scheduler_policy())
        sim.deadline = self.core.next_deadline()
        self.overlap = sim.exchange == "groups" and self.core.policy.overlap
        self.by_progress = self.core.policy.weighting == "progress"
        self.rtt = 0.0 if sim.exchange == "all" else sim.net.scheduler_rtt  # allreduce needs no scheduler
        self.fold_final = False  # the passive side of a gossip folds in what it served before a global sync
        self._ring: dict = {}  # (stage, members) -> seconds of a group: round trip and ring all-reduce
        #: by worker p * S + s: when its overlapped averaging ends (None: its group is undecided; 0: none yet)
        self.averaging: list = [0.0] * (D * S)
        #: by worker: the step of its last ready signal; a step goes on without one while that averaging is in flight,
        #: for fewer than ``max_lag`` steps
        self.asked: list = [0] * (D * S)
        self.max_lag = self.core.policy.staleness
        self.held: dict = {}  # worker -> (time, data) of a ready that waits for that averaging
        self.held_global: dict = {}  # p -> when it ran out of batches: its global sync waits for those averagings
        if self.overlap:
            self.on_ready = self._ready_overlapped

    def handlers(self) -> dict:
        return {"ask": self._on_ask, "global": self._on_global}

    def on_ready(self, t: float, data: tuple) -> None:
        p, s, _ = data
        self.apply(self.core.ready(s, p, t))

    def _ready_overlapped(self, t: float, data: tuple) -> None:
        p, s, step = data
        sim, w = self.sim, p * self.S + s
        averaging = self.averaging
        end = averaging[w]
        if (end is None or end > t) and step - self.asked[w] < self.max_lag:
            # its last group is undecided or still averaging: this step goes on without a ready signal
            # (Scheduled.after_step); the averaging lands at a later step
            sim._on_synced(t, data)
        elif end is None:  # lagging by the bound: the ready signal waits for its averaging
            self.held[w] = (t, data)
        elif end > t:  # its last averaging still runs
            self._hold(t, end, data)
        else:  # it tells the core it is ready and goes on with its next step at once (_on_ask, inlined)
            averaging[w] = None
            self.asked[w] = step
            decisions = self.core.ready(s, p, t, False, step)
            if decisions:
                self._groups(decisions)
            sim.deadline = self.core.next_deadline()
            sim._on_synced(t, data)

    def _hold(self, t: float, end: float, data: tuple) -> None:
        """An overlapped worker's ready waits until ``end``, when its last group's averaging ended."""
        sim = self.sim
        if end > t and sim.record:
            p, s, step = data
            sim.records.append(events.span("wait", p, s, step, None, t, end, what="group"))
        sim._push(max(t, end), "ask", data)

    def _on_ask(self, t: float, data: tuple) -> None:
        """Overlap: (p, s) tells the core it is ready and goes on with its next step at once."""
        p, s, step = data
        w = p * self.sim.S + s
        self.averaging[w] = None
        self.asked[w] = step
        self.apply(self.core.ready(s, p, t, False, step))
        self.sim._on_synced(t, data)

    def epoch_end(self, t: float, p: int) -> None:
        """p's workers join the epoch's global sync once their overlapped averagings ended (a round still open for
        one of their ready signals closes now: ``Hurry``)."""
        self.held_global[p] = t
        if self.overlap:
            S = self.sim.S
            for s in range(S):
                if self.averaging[p * S + s] is None:
                    self.apply(self.core.handle(Hurry(p, t, stage=s)))
        self._global_when_settled(p)

    def _global_when_settled(self, p: int) -> None:
        """Pipeline p's global sync, once every overlapped averaging of its workers is decided (and then ended)."""
        if p not in self.held_global:
            return
        S = self.sim.S
        ends = self.averaging[p * S : (p + 1) * S]
        if None not in ends:
            self.sim._push(max([self.held_global.pop(p), *ends]), "global", p)

    def _on_global(self, t: float, p: int) -> None:
        for s in range(self.sim.S):
            self.apply(self.core.ready(s, p, t, True))

    def tick(self, now: float) -> None:
        """The core's deadline: the rounds whose window ran out close."""
        self.sim.now = now
        self.apply(self.core.handle(Tick(now)))

    def apply(self, decisions) -> None:
        """What the core decided on one of its events (groups, if any), then its next deadline."""
        if decisions:  # most events decide nothing
            self._groups(decisions)
        self.sim.deadline = self.core.next_deadline()

    def lost(self, p: int, t: float) -> None:
        """p left: its overlapped averagings and held signals are gone, and the core takes it out."""
        S = self.sim.S
        for s in range(S):
            self.averaging[p * S + s] = 0.0
            self.held.pop(p * S + s, None)
        self.held_global.pop(p, None)
        self.apply(self.core.handle(Lost(p, t)))

    def joined(self, p: int, t: float, donor) -> None:
        self.apply(self.core.handle(Join(p, t, donor)))

    def _seconds(self, stage: int, n: int) -> float:
        cost = self._ring.get((stage, n))
        if cost is None:
            sim = self.sim
            cost = self._ring[(stage, n)] = self.rtt + allreduce_seconds(sim.costs.weight_bytes[stage], n, sim.net)
        return cost

    def _groups(self, decisions) -> None:
        """Each group ends at its close plus :meth:`_seconds` plus the slowest member's link delay; the proxy averages
        the members (pairs together, after the others before them); each member's ``synced`` comes at the end
        (its pipeline's ``epoch`` once every stage's global sync ended)."""
        sim = self.sim
        S, proxy, pipes = sim.S, sim.proxy, sim.pipes
        by_progress, delays = self.by_progress, sim.link_delay if sim._link_delays else None
        us: list = []  # pairs to average together: a round's groups are disjoint (only a round that a global
        vs: list = []  # sync preempted shares members, with that global group, which comes after it)
        for g in decisions:
            members, stage, final = g.members, g.stage, g.reason == "global"
            end = g.closed + self._seconds(stage, len(members))
            if delays:
                end += max([delays[m][stage] for m in members])
            if len(members) == 2 and not final:
                us.append(members[0] * S + stage)
                vs.append(members[1] * S + stage)
            else:
                if us:
                    proxy.mix_pairs(us, vs, by_progress)
                    us, vs = [], []
                workers = [m * S + stage for m in members]
                if final and self.fold_final:
                    for w in workers:
                        proxy.fold(w)
                proxy.mix(workers, by_progress, final)
            background = self.overlap and not final
            if sim.record:
                self._record(g, end, background)
            if background:
                self._averaging_ends(g.members, stage, end)
            elif final:
                for m in members:
                    sim._global_done(m, end)
            else:
                for m in members:
                    sim._push(end, "synced", (m, stage, pipes[m].step))
        if us:
            proxy.mix_pairs(us, vs, by_progress)

    def _record(self, g, end: float, background: bool) -> None:
        """The group's record and each member's sync span."""
        sim = self.sim
        keep, members = sim.records.append, list(g.members)
        keep(events.group(g.stage, g.round, members, g.reason, g.opened, g.closed, g.wait, g.connected, sim.policy))
        lane, sync, pipes = "background" if background else None, events.group_sync, sim.pipes
        for m in members:
            keep(sync(m, g.stage, pipes[m].step, g.closed, end, members, g.round, g.reason, lane))

    def _averaging_ends(self, members, stage: int, end: float) -> None:
        """Each member's overlapped averaging ends at ``end``: a ready signal (or a global sync) held for it goes on
        then."""
        S, averaging, held, held_global = self.sim.S, self.averaging, self.held, self.held_global
        for m in members:
            key = m * S + stage
            averaging[key] = end
            if key in held:
                t, data = held.pop(key)
                self._hold(t, end, data)
            if m in held_global:
                self._global_when_settled(m)


class _PairSync(_CoreRounds):
    """``adpsgd``: random pairs of an active (even) and a passive (odd) worker, the passive one's server thread
    serving one exchange at a time (both directions at once); the epoch's global syncs through the core."""

    def __init__(self, sim: _Simulation):
        super().__init__(sim)
        self.fold_final = True
        self.actives, self.passives = gossip_roles(sim.D)
        self.serve_free = [0.0] * (sim.D * sim.S)

    def handlers(self) -> dict:
        return {**super().handlers(), "paired": self._on_paired}

    def on_ready(self, t: float, data: tuple) -> None:
        p, s, step = data
        sim = self.sim
        if p % 2 == 0 and self.passives:  # the active side
            self._gossip(t, p, s, step)
        else:  # the passive side folds in what it served, and goes on
            sim.proxy.fold(p * sim.S + s)
            sim._on_synced(t, data)

    def _gossip(self, t: float, p: int, s: int, step: int) -> None:
        """Active worker (p, s) picks a passive peer at random; p waits for its exchange."""
        sim = self.sim
        net = sim.net
        q = sim.rng.choice(self.passives)
        i = q * sim.S + s
        sim.owed[i] += sim.costs.serve
        start = max(t + net.server_rtt + sim.link_delay[p][s], self.serve_free[i])
        end = self.serve_free[i] = start + sim.costs.weight_bytes[s] / net.bandwidth + net.latency
        sim._push(end, "paired", (p, s, step, q, t))

    def _on_paired(self, t: float, data: tuple) -> None:
        p, s, step, q, asked = data
        sim = self.sim
        sim.proxy.pair(p * sim.S + s, q * sim.S + s)
        if sim.record:
            pair = sorted((p, q))
            keep, span = sim.records.append, events.span
            keep(span("sync", p, s, step, None, asked, t, group=pair, reason=PAIR))
            keep(span("sync", q, s, None, None, asked, t, group=pair, reason=PAIR, served=True))
        sim._on_synced(t, (p, s, step))


class _ServerSync:
    """``ps``: a server per stage, hosted by pipeline 0's worker (its own push and pull stay local), whose link
    carries every push and pull of its stage, one transfer at a time per direction; it answers the pulls its
    staleness bound lets go, and the epoch's global sync once every pipeline is at it."""

    core = None

    def __init__(self, sim: _Simulation):
        self.sim = sim
        staleness = sim.config.scheduler_policy().staleness
        self.servers = [_Server(sim.proxy.x[s].tolist(), range(sim.D), staleness) for s in range(sim.S)]
        self.pulled = sim.proxy.x.tolist()

    def handlers(self) -> dict:
        return {"pushed": self._on_pushed}

    def on_ready(self, t: float, data: tuple) -> None:
        p, s, step = data
        self._push(t, p, s, step, STEP)

    def epoch_end(self, t: float, p: int) -> None:
        for s in range(self.sim.S):
            self._push(t, p, s, self.sim.pipes[p].step, GLOBAL)

    def lost(self, p: int, t: float) -> None:  # pragma: no cover - trace checks refuse ps
        raise AssertionError("ps takes no trace")

    joined = lost

    def _push(self, t: float, p: int, s: int, step: int, kind: str) -> None:
        """Worker (p, s) sends its update (its point minus the one it last pulled) over its stage's server link
        and waits for its pull; the host's own stays in memory."""
        sim = self.sim
        net, srv, w = sim.net, self.servers[s], p * sim.S + s
        sim.proxy.settle()
        delta = [a - b for a, b in zip(sim.proxy.x[w].tolist(), self.pulled[w], strict=True)]
        srv.asked[p] = (t, step, kind)
        sim.owed[s] += sim.costs.serve  # the host (pipeline 0's worker of stage s) serves every request
        if p == 0:
            arrive = t + net.server_rtt
        else:
            start = max(t + net.server_rtt + sim.link_delay[p][s], srv.in_free)
            srv.in_free = start + sim.costs.weight_bytes[s] / net.bandwidth
            arrive = srv.in_free + net.latency
        sim._push(arrive, "pushed", (p, s, delta, kind))

    def _on_pushed(self, t: float, data: tuple) -> None:
        """A push reached stage s's server: it adds the update and answers the pulls the staleness bound lets go
        (all of them, once every pipeline is at the global sync)."""
        p, s, delta, kind = data
        srv = self.servers[s]
        v = srv.w
        for k in range(4):
            v[k] += delta[k]
        replies, final = srv.ssp.push(p, kind)
        for c in replies:
            self._reply(t, c, s, final)

    def _reply(self, t: float, c: int, s: int, final: bool) -> None:
        """The server sends its weights to client c (over its link's other direction; in memory to the host)."""
        sim = self.sim
        srv, w = self.servers[s], c * sim.S + s
        sim.proxy.settle()
        sim.proxy.x[w] = srv.w
        self.pulled[w] = list(srv.w)
        asked, step, _ = srv.asked.pop(c)
        if c == 0:
            end = t
        else:
            start = max(t, srv.out_free)
            srv.out_free = start + sim.costs.weight_bytes[s] / sim.net.bandwidth
            end = srv.out_free + sim.net.latency
        if sim.record:
            group = list(range(sim.D)) if final else [c]
            reason = GLOBAL if final else SERVED
            sim.records.append(events.span("sync", c, s, step, None, asked, end, group=group, reason=reason, server=0))
        if final:
            sim.proxy.mass[w] = 1.0
            sim._global_done(c, end)
        else:
            sim._push(end, "synced", (c, s, step))


#: the exchange of each :attr:`~sdpipe.core.policies.PolicyRecord.exchange`
EXCHANGE_OF = {"nothing": _NoSync, "groups": _CoreRounds, "all": _CoreRounds, "pairs": _PairSync, "server": _ServerSync}
