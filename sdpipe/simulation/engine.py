"""The simulator's engine: the real group scheduler core driven in simulated time by the pipelines' steps."""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass
from typing import Optional

import numpy as np

from sdpipe.config import Heterogeneity, TrainConfig
from sdpipe.core.policies import record as policy_record
from sdpipe.core.scheduler import GroupScheduler, Hurry, Join, Lost, Tick
from sdpipe.core.sync_rules import GLOBAL, PAIR, SERVED, STEP, gossip_roles
from sdpipe.data import TAIL_BATCHES_PER_PIPELINE, smoothed_step_time, tail_goes_faster
from sdpipe.driver.result import RunResult
from sdpipe.simulation.costs import Costs, Network, _step_finish, _step_plan, ring_allreduce_seconds
from sdpipe.simulation.proxy import Proxy, _Proxy, _Server
from sdpipe.wire import events

__all__ = []


@dataclass(slots=True)
class _Pipe:
    """One pipeline's progress in the simulation."""

    step: int = 0  # steps taken in the run (all epochs)
    epoch: int = 0
    epoch_steps: int = 0  # steps taken in the current epoch
    epoch_start: float = 0.0
    synced: int = 0  # stages whose sync of the current step ended ...
    synced_at: float = 0.0  # ... the latest at
    last_start: Optional[float] = None
    step_time: Optional[float] = None  # recent seconds per step, as the runtime's dispenser keeps it
    done: bool = False  # no batch of its epoch is left for it (or it left in the trace)
    finished: bool = False  # every epoch done
    global_done: int = 0  # stages whose global sync of this epoch ended ...
    global_end: float = 0.0  # ... the latest at


#: events of pipeline p whose data is p itself (the others' data start with p)
_WHOLE_PIPELINE = ("start", "global", "epoch")


def _concerns(event: tuple, p: int) -> bool:
    """Whether an event is pipeline p's work (its start, a worker's ready, ask or synced, its global sync)."""
    kind, data = event
    if kind == "member":
        return False
    return data == p if kind in _WHOLE_PIPELINE else data[0] == p


class _Simulation:
    """One simulated run: a timeline of ``(kind, data)`` events, one handler per kind, and the scheduler core's
    deadlines as ticks in between (see the module's docstring)."""

    def __init__(self, config: TrainConfig, *, costs: Costs, network: Network, proxy: Proxy, steps: int, record: bool):
        S, D, M = config.stages, config.pipelines, config.microbatches
        self.config, self.costs, self.net = config, costs, network
        self.S, self.D, self.steps, self.record, self.policy = S, D, steps, record, config.policy
        #: how the replicas meet (:attr:`sdpipe.core.policies.PolicyRecord.exchange`)
        self.exchange = exchange = policy_record(config.policy).exchange
        self.epochs, self.sync_every = config.epochs, config.sync_every
        self.hetero = hetero = config.heterogeneity or Heterogeneity()
        # the group service's core: every round under sdpipe and allreduce, the global syncs under adpsgd
        self.core = GroupScheduler(S, D, config.scheduler_policy()) if exchange not in ("nothing", "server") else None
        self.total = steps * D  # batches in an epoch
        self.taken: dict = {}  # epoch -> batches handed out
        self.pipes = [_Pipe() for _ in range(D)]
        self.heap: list = []  # the times that hold events (each once) ...
        self.at: dict = {}  # ... and time -> its events in the order pushed
        self._due: list = []  # the current time's events ...
        self._cursor = 0  # ... and how many of them were taken (see _on_member)
        self.records: list = []
        self.history: list = []
        self.now = 0.0
        # the core's next deadline (None: nothing to time), a function of its state: asked again after each of
        # its events (see _apply), not at every one of ours
        self.deadline: Optional[float] = self.core.next_deadline() if self.core is not None else None
        self.proxy = _Proxy(S, D, config.seed, proxy)
        self.rng = random.Random(config.seed)  # adpsgd's peers
        self._timing = np.random.default_rng([config.seed, 2])  # jitter and straggles, drawn in blocks
        self._draws: list = []
        self._jitter_sigma = np.array([math.sqrt(math.log1p(j**2)) for j in costs.jitter])
        self._straggles = hetero.straggle_prob > 0
        self._no_jitter = [1.0] * S
        # heterogeneity holds still in a simulation: each pipeline's step costs and each worker's link delay, once
        plan = _step_plan(config)
        finish: dict = {}
        self.step_costs = []  # per pipeline: (per-stage finish, compute, forward seconds of one step)
        #: per pipeline, what each stage sleeps after its step for a step slowdown f (worker.pace: f - 1 times its
        #: own step, the step overhead counted on stage 0; a pipeline's slowdown is stage 0's), or None
        self.stretch: list = []
        for p in range(D):
            k = tuple(hetero.compute_slowdown_of(p, s) for s in range(S))
            if k not in finish:
                ends, busy = _step_finish(plan, costs, network, k, M)
                finish[k] = (ends, busy, [M * costs.forward[s] * k[s] for s in range(S)])
            self.step_costs.append(finish[k])
            f = [hetero.stretch_of(p, s) for s in range(S)]
            ends = finish[k][0]
            own = [ends[s] + (costs.step_overhead if s == 0 else 0.0) for s in range(S)]
            self.stretch.append([(f[s] - 1.0) * own[s] for s in range(S)] if max(f) > 1.0 else None)
        self.link_delay = [[hetero.link_delay_of(p, s) for s in range(S)] for p in range(D)]
        self._link_delays = any(any(row) for row in self.link_delay)
        self._ring: dict = {}  # (stage, members) -> seconds of a group: round trip and ring all-reduce
        # averaging overlapped with compute (SchedulerPolicy.overlap): a worker goes on at its ready signal; its
        # group's averaging runs meanwhile and must have ended before the worker's next ready signal
        self.overlap = exchange == "groups" and self.core.policy.overlap
        self.mode = "overlap" if self.overlap else exchange
        #: by worker p * S + s: when its overlapped averaging ends (None: its group is undecided; 0: none yet)
        self.averaging: list = [0.0] * (D * S)
        #: by worker: the step of its last ready signal; a step goes on without one while that averaging is in flight,
        #: for fewer than ``max_lag`` steps (the staleness bound P, as Scheduled.max_lag)
        self.asked: list = [0] * (D * S)
        self.max_lag = self.core.policy.staleness if self.core is not None else 0
        self.held: dict = {}  # worker -> (time, data) of a ready that waits for that averaging
        self.held_global: dict = {}  # p -> when it ran out of batches: its global sync waits for those averagings
        self.present = set(range(D))  # pipelines taking part (the trace takes some out and back)
        self.changes: list = []  # (time, what, pipeline, donor) of the trace's changes, as applied
        self.end = 0.0  # the last event's time, the trace's own aside
        # the epoch-tail rule: step times of the pipelines still in their epoch (0: not counted), their epochs,
        # and per epoch the sum of their rates (a quick bound before the exact sum)
        self.tail_t = np.zeros(D)
        self.tail_epoch = np.zeros(D, dtype=np.int64)
        self.tail_rate: dict = {}
        if exchange == "server":  # a server per stage, hosted by pipeline 0's worker (its own push and pull stay local)
            staleness = config.scheduler_policy().staleness
            self.servers = [_Server(self.proxy.x[s].tolist(), range(D), staleness) for s in range(S)]
            self.pulled = self.proxy.x.tolist()
        if exchange == "pairs":  # even pipelines start exchanges with odd ones, who serve them one at a time
            self.actives, self.passives = gossip_roles(D)
            self.serve_free = [0.0] * (D * S)
        # seconds each worker's server thread took from it since its pipeline's last step started (Costs.serve)
        self.serving = costs.serve > 0 and exchange in ("server", "pairs")
        self.owed = [0.0] * (D * S)

    def _push(self, t: float, kind: str, data) -> None:
        due = self.at.get(t)
        if due is None:
            self.at[t] = [(kind, data)]
            heapq.heappush(self.heap, t)
        else:
            due.append((kind, data))

    def run(self, trace=()) -> "_Simulation":
        """Every pipeline starts at 0; events in time order (ties in the order pushed), a tick first when the
        core's deadline comes no later than the next event.  ``trace``: ``(time, "leave" | "join", pipeline)``."""
        for p in range(self.D):
            self._push(0.0, "start", p)
        for t, what, p in trace:
            self._push(float(t), "member", (what, p))
        handlers = {
            "start": self._on_start,
            "ready": self._on_ready,
            "ask": self._on_ask,
            "global": self._on_global,
            "synced": self._on_synced,
            "member": self._on_member,
            "epoch": self._on_epoch,
            "pushed": self._on_pushed,
            "paired": self._on_paired,
        }
        heap, at, pop, pipes = self.heap, self.at, heapq.heappop, self.pipes
        ready = self._on_ready
        # a pending deadline is ticked also when nothing else is left: workers of different stages can all be
        # waiting in open rounds at once (each pipeline's step needs every stage's group)
        while heap or self.deadline is not None:
            deadline = self.deadline
            if deadline is not None and (not heap or deadline <= heap[0]):
                self._on_tick(deadline)
                if not heap and self.deadline == deadline:
                    raise RuntimeError(f"simulation: the scheduler's deadline {deadline} did not pass when ticked")
                continue
            now = pop(heap)
            due = self._due = at.pop(now)  # what its events push for ``now`` comes after them, as a time of its own
            i = 0
            while i < len(due):
                deadline = self.deadline
                if deadline is not None and deadline <= now:
                    self._on_tick(deadline)
                    continue
                kind, data = due[i]
                i += 1
                self.now = now
                if kind == "ready":  # most events
                    ready(now, data)
                elif kind == "member":
                    self._cursor = i
                    self._on_member(now, data)
                    continue
                else:
                    handlers[kind](now, data)
                    if kind == "start" and pipes[data].done:
                        continue
                self.end = now  # the trace (and its joiners finding no batch) may go on after the work
        return self

    def _draw(self) -> tuple:
        """One step's draws: (each stage's jitter factor, how many of its stages a transient straggle hits)."""
        if not self._draws:
            n, S, gen = 4096, self.S, self._timing
            sigma = self._jitter_sigma
            scale = np.exp(gen.standard_normal((n, S)) * sigma - sigma**2 / 2).tolist()  # log-normal, mean 1
            p = self.hetero.straggle_prob
            # S draws, as the runtime: each stage that straggles holds the pipeline's step back by the delay
            hits = (gen.random((n, S)) < p).sum(axis=1).tolist() if p > 0 else [0] * n
            self._draws = list(zip(scale, hits, strict=True))
            self._draws.reverse()
        return self._draws.pop()

    def _on_start(self, t: float, p: int) -> None:
        """Pipeline p asks for a batch: with one, its step's spans and each stage's ``ready`` at the step's end;
        without, its epoch ends (see :meth:`_epoch_done`)."""
        pipe = self.pipes[p]
        if not self._next_batch(p, t):
            self._epoch_done(p, t)
            return
        pipe.synced, pipe.synced_at = 0, t
        ends, busy, forward = self.step_costs[p]
        scale, hit = self._draw()
        begin = t + self.costs.step_overhead + (self.hetero.straggle_delay * hit if hit else 0.0)
        if self.serving:  # what its server threads took from its workers since its last step
            owed, first = self.owed, p * self.S
            begin += max(owed[first : first + self.S])
            owed[first : first + self.S] = [0.0] * self.S
        push, step, S = self._push, pipe.step, self.S
        for s in range(S):
            push(begin + ends[s] + busy[s] * (scale[s] - 1.0), "ready", (p, s, step))
        if self.record:
            keep, compute = self.records.append, events.compute
            for s in range(S):
                f = begin + forward[s] * scale[s]
                keep(compute("forward", p, s, step, begin, f))
                keep(compute("backward", p, s, step, f, begin + busy[s] * scale[s]))

    def _next_batch(self, p: int, t: float) -> bool:
        """The runtime's dispenser: lock step under allreduce, else the next of the epoch's batches unless p
        leaves the tail to faster pipelines.  Also keeps p's recent step time."""
        pipe = self.pipes[p]
        if pipe.last_start is not None:
            old = pipe.step_time
            new = pipe.step_time = smoothed_step_time(old, t - pipe.last_start)
            if new > 0 and not pipe.done:
                e = pipe.epoch
                self.tail_rate[e] = self.tail_rate.get(e, 0.0) + 1.0 / new - (1.0 / old if old else 0.0)
                self.tail_t[p] = new
        pipe.last_start = t
        if self.exchange == "all":
            return pipe.epoch_steps < self.steps
        e = pipe.epoch
        taken = self.taken.get(e, 0)
        remaining = self.total - taken
        if remaining > 0 and not (remaining <= TAIL_BATCHES_PER_PIPELINE * self.D and self._leaves_tail(p, remaining)):
            self.taken[e] = taken + 1
            return True
        return False

    def _leaves_tail(self, p: int, remaining: int) -> bool:
        """The runtime's epoch-tail rule (:func:`sdpipe.data.leaves_tail`) on the simulated pipelines still in
        p's epoch; their summed rates bound the faster ones' first, so most steps skip the exact sum."""
        mine = self.pipes[p].step_time
        if mine is None:
            return False
        e = self.pipes[p].epoch
        bound = self.tail_rate.get(e, 0.0) - (1.0 / mine if mine > 0 else 0.0)  # every other pipeline's rate
        if remaining >= mine * bound * (1 + 1e-9):
            return False
        t = self.tail_t
        faster = t[(t > 0) & (t < mine) & (self.tail_epoch == e)] if self.epochs > 1 else t[(t > 0) & (t < mine)]
        return tail_goes_faster(mine, float((1.0 / faster).sum()), remaining)

    def _untail(self, p: int) -> None:
        """p no longer counts in its epoch's tail rule."""
        pipe = self.pipes[p]
        if self.tail_t[p] > 0:
            self.tail_rate[pipe.epoch] -= 1.0 / self.tail_t[p]
            self.tail_t[p] = 0.0

    def _epoch_done(self, p: int, t: float) -> None:
        """No batch of its epoch is left for pipeline p: at an epoch that ends with a global sync (every
        ``sync_every`` epochs and the last) its workers join it (once overlapped averagings ended; at the server
        under ps; none under ``none``), else p goes on with its next epoch at once."""
        pipe = self.pipes[p]
        pipe.done = True
        self._untail(p)
        e = pipe.epoch
        if self.exchange == "nothing" or not ((e + 1) % self.sync_every == 0 or e == self.epochs - 1):
            self._next_epoch(t, p)
        elif self.exchange == "server":
            for s in range(self.S):
                self._ps_push(t, p, s, pipe.step, GLOBAL)
        else:
            self.held_global[p] = t
            if self.overlap:  # a round still open for one of its ready signals closes now (Hurry)
                for s in range(self.S):
                    if self.averaging[p * self.S + s] is None:
                        self._apply(self.core.handle(Hurry(p, t, stage=s)))
            self._global_when_settled(p)

    def _on_epoch(self, t: float, p: int) -> None:
        """Every stage of p ended the epoch's global sync."""
        self._next_epoch(t, p)

    def _next_epoch(self, t: float, p: int) -> None:
        """p's epoch is complete (its history row); it starts the next one, if any."""
        pipe = self.pipes[p]
        self._epoch_row(p, t, True)
        if pipe.epoch + 1 >= self.epochs:
            pipe.finished = True
            return
        pipe.epoch += 1
        pipe.done, pipe.last_start, pipe.epoch_start, pipe.global_done = False, None, t, 0
        self.tail_epoch[p] = pipe.epoch
        if pipe.step_time:
            self.tail_t[p] = pipe.step_time
            self.tail_rate[pipe.epoch] = self.tail_rate.get(pipe.epoch, 0.0) + 1.0 / pipe.step_time
        self._push(t, "start", p)

    def _epoch_row(self, p: int, t: float, complete: bool) -> None:
        """Pipeline p's row of the history for its current epoch (and its ``epoch`` record), at time ``t``."""
        pipe, bs = self.pipes[p], self.config.batch_size
        samples = pipe.epoch_steps * bs
        took = t - pipe.epoch_start
        metrics = {
            "epoch": pipe.epoch,
            "pipeline": p,
            "loss": self.proxy.loss(p),
            "samples": samples,
            "share": samples / (self.total * bs),
            "samples_per_s": samples / took if took > 0 else 0.0,
            "steps": pipe.epoch_steps,
            "complete": complete,
        }
        self.history.append(metrics)
        pipe.epoch_steps = 0
        if self.record:
            self.records.append(events.epoch(p, self.S - 1, pipe.step, t, metrics))

    def _on_ready(self, t: float, data: tuple) -> None:
        """Worker (p, s) stepped its optimizer (the proxy learns) and syncs as the policy says."""
        p, s, step = data
        w = p * self.S + s
        self.proxy.learn(w)
        if self.record:
            rec = {
                "kind": "optimizer",
                "pipeline": p,
                "stage": s,
                "step": step,
                "microbatch": None,
                "start": t,
                "end": t,
                "epoch": self.pipes[p].epoch,
            }  # events.span("optimizer", ..., epoch=, loss=) spelled out: one per worker and step
            if s == self.S - 1:
                rec["loss"] = self.proxy.loss(p)
            self.records.append(rec)
        mode = self.mode
        if mode == "overlap":
            averaging = self.averaging
            end = averaging[w]
            if (end is None or end > t) and step - self.asked[w] < self.max_lag:
                # its last group is undecided or still averaging: this step goes on without a ready signal
                # (Scheduled.after_step); the averaging lands at a later step
                self._on_synced(t, data)
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
                self.deadline = self.core.next_deadline()
                self._on_synced(t, data)
        elif mode == "groups" or mode == "all":
            self._apply(self.core.ready(s, p, t))
        elif mode == "nothing":
            self._on_synced(t, data)
        elif mode == "server":
            self._ps_push(t, p, s, step, STEP)
        elif p % 2 == 0 and self.passives:  # adpsgd's active side
            self._gossip(t, p, s, step)
        else:  # adpsgd's passive side folds in what it served, and goes on
            self.proxy.fold(w)
            self._on_synced(t, data)

    def _hold(self, t: float, end: float, data: tuple) -> None:
        """An overlapped worker's ready waits until ``end``, when its last group's averaging ended."""
        if end > t and self.record:
            p, s, step = data
            self.records.append(events.span("wait", p, s, step, None, t, end, what="group"))
        self._push(max(t, end), "ask", data)

    def _on_ask(self, t: float, data: tuple) -> None:
        """Overlap: (p, s) tells the core it is ready and goes on with its next step at once."""
        p, s, step = data
        self.averaging[p * self.S + s] = None
        self.asked[p * self.S + s] = step
        self._apply(self.core.ready(s, p, t, False, step))
        self._on_synced(t, data)

    def _global_when_settled(self, p: int) -> None:
        """Pipeline p's global sync, once every overlapped averaging of its workers is decided (and then ended)."""
        if p not in self.held_global:
            return
        ends = self.averaging[p * self.S : (p + 1) * self.S]
        if None not in ends:
            self._push(max([self.held_global.pop(p), *ends]), "global", p)

    def _on_global(self, t: float, p: int) -> None:
        for s in range(self.S):
            self._apply(self.core.ready(s, p, t, True))

    def _on_tick(self, now: float) -> None:
        """The core's deadline: the rounds whose window ran out close."""
        self.now = now
        self._apply(self.core.handle(Tick(now)))

    def _apply(self, decisions) -> None:
        """What the core decided on one of its events (groups, if any), then its next deadline."""
        if decisions:  # most events decide nothing
            self._groups(decisions)
        self.deadline = self.core.next_deadline()

    def _groups(self, decisions) -> None:
        """Each group costs the round trip (none under allreduce: it needs no scheduler), the slowest member's link
        delay and a ring all-reduce; the proxy averages the members; each member's ``synced`` comes at the end
        (its pipeline's ``epoch`` once every stage's global sync ended)."""
        costs, net, pipes, record, keep = self.costs, self.net, self.pipes, self.record, self.records.append
        S, proxy, push = self.S, self.proxy, self._push
        rtt = 0.0 if self.exchange == "all" else net.scheduler_rtt
        by_progress = self.core.policy.weighting == "progress"
        ring, delays = self._ring, self.link_delay if self._link_delays else None
        us: list = []  # pairs to average together: a round's groups are disjoint (only a round that a global
        vs: list = []  # sync preempted shares members, with that global group, which comes after it)
        for g in decisions:
            members, stage, reason = g.members, g.stage, g.reason
            final = reason == "global"
            n = len(members)
            cost = ring.get((stage, n))
            if cost is None:
                cost = ring[(stage, n)] = rtt + ring_allreduce_seconds(costs.weight_bytes[stage], n, net)
            end = g.closed + cost + (max([delays[m][stage] for m in members]) if delays else 0.0)
            if n == 2 and not final:  # pairs average together, after the others before them
                us.append(members[0] * S + stage)
                vs.append(members[1] * S + stage)
            else:
                if us:
                    proxy.mix_pairs(us, vs, by_progress)
                    us, vs = [], []
                workers = [m * S + stage for m in members]
                if final and self.exchange == "pairs":  # the passive side folds in what it served first
                    for w in workers:
                        proxy.fold(w)
                proxy.mix(workers, by_progress, final)
            if record:
                members = list(members)
                keep(
                    events.group(stage, g.round, members, reason, g.opened, g.closed, g.wait, g.connected, self.policy)
                )
            background = self.overlap and not final
            if record:
                lane, closed, rnd, sync = "background" if background else None, g.closed, g.round, events.group_sync
                for m in members:
                    keep(sync(m, stage, pipes[m].step, closed, end, members, rnd, reason, lane))
            if background:  # each member's averaging ends at ``end``: a ready signal held for it goes on then
                averaging, held, held_global = self.averaging, self.held, self.held_global
                for m in members:
                    key = m * S + stage
                    averaging[key] = end
                    if key in held:
                        t, data = held.pop(key)
                        self._hold(t, end, data)
                    if m in held_global:
                        self._global_when_settled(m)
            elif final:
                for m in members:
                    self._global_done(m, end)
            else:
                for m in members:
                    push(end, "synced", (m, stage, pipes[m].step))
        if us:
            proxy.mix_pairs(us, vs, by_progress)

    def _global_done(self, p: int, end: float) -> None:
        """One of p's stages ends the epoch's global sync at ``end``; after the last, p's ``epoch``."""
        pipe = self.pipes[p]
        pipe.global_done += 1
        pipe.global_end = max(pipe.global_end, end)
        if pipe.global_done == self.S:
            pipe.global_done = 0
            self._push(pipe.global_end, "epoch", p)

    # ------------------------------------------------------------------ ps
    def _ps_push(self, t: float, p: int, s: int, step: int, kind: str) -> None:
        """Worker (p, s) sends its update (its point minus the one it last pulled) over its stage's server link
        (one transfer at a time, in the order sent) and waits for its pull; the host's own stays in memory."""
        srv, w = self.servers[s], p * self.S + s
        self.proxy.settle()
        delta = [a - b for a, b in zip(self.proxy.x[w].tolist(), self.pulled[w], strict=True)]
        srv.asked[p] = (t, step, kind)
        self.owed[s] += self.costs.serve  # the host (pipeline 0's worker of stage s) serves every request
        if p == 0:
            arrive = t + self.net.server_rtt
        else:
            start = max(t + self.net.server_rtt + self.link_delay[p][s], srv.in_free)
            srv.in_free = start + self.costs.weight_bytes[s] / self.net.bandwidth
            arrive = srv.in_free + self.net.latency
        self._push(arrive, "pushed", (p, s, delta, kind))

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
            self._ps_reply(t, c, s, final)

    def _ps_reply(self, t: float, c: int, s: int, final: bool) -> None:
        """The server sends its weights to client c (over its link's other direction; in memory to the host)."""
        srv, w = self.servers[s], c * self.S + s
        self.proxy.settle()
        self.proxy.x[w] = srv.w
        self.pulled[w] = list(srv.w)
        asked, step, _ = srv.asked.pop(c)
        if c == 0:
            end = t
        else:
            start = max(t, srv.out_free)
            srv.out_free = start + self.costs.weight_bytes[s] / self.net.bandwidth
            end = srv.out_free + self.net.latency
        if self.record:
            group = list(range(self.D)) if final else [c]
            reason = GLOBAL if final else SERVED
            self.records.append(events.span("sync", c, s, step, None, asked, end, group=group, reason=reason, server=0))
        if final:
            self.proxy.mass[w] = 1.0
            self._global_done(c, end)
        else:
            self._push(end, "synced", (c, s, step))

    # ------------------------------------------------------------------ adpsgd
    def _gossip(self, t: float, p: int, s: int, step: int) -> None:
        """Active worker (p, s) picks a passive peer at random; the peer's server thread serves one exchange at a
        time (both directions at once); p waits for its exchange."""
        q = self.rng.choice(self.passives)
        i = q * self.S + s
        self.owed[i] += self.costs.serve
        start = max(t + self.net.server_rtt + self.link_delay[p][s], self.serve_free[i])
        end = self.serve_free[i] = start + self.costs.weight_bytes[s] / self.net.bandwidth + self.net.latency
        self._push(end, "paired", (p, s, step, q, t))

    def _on_paired(self, t: float, data: tuple) -> None:
        p, s, step, q, asked = data
        S = self.S
        self.proxy.pair(p * S + s, q * S + s)
        if self.record:
            pair = sorted((p, q))
            keep, span = self.records.append, events.span
            keep(span("sync", p, s, step, None, asked, t, group=pair, reason=PAIR))
            keep(span("sync", q, s, None, None, asked, t, group=pair, reason=PAIR, served=True))
        self._on_synced(t, (p, s, step))

    # ------------------------------------------------------------------ the trace
    def _on_member(self, t: float, data: tuple) -> None:
        """The trace: pipeline p leaves (lost: the core takes it out of every stage, its work in flight is dropped)
        or joins (it takes the proxy state of the lowest live pipeline, the donor, once the stages' weights crossed
        the network; the core hears ``Join`` with that donor; then its next step in the donor's epoch).  A change
        that does not apply (leaving when gone, joining when there or when no batch of the donor's epoch is
        left) is skipped."""
        what, p = data
        if (what == "leave") != (p in self.present):
            return
        pipe = self.pipes[p]
        if what == "leave":
            self.present.discard(p)
            for due in self.at.values():
                due[:] = [e for e in due if not _concerns(e, p)]
            due, taken = self._due, self._cursor  # in place: run() holds the current time's list
            due[taken:] = [e for e in due[taken:] if not _concerns(e, p)]
            for s in range(self.S):
                self.averaging[p * self.S + s] = 0.0
                self.held.pop(p * self.S + s, None)
            self.held_global.pop(p, None)
            self._untail(p)
            if pipe.epoch_steps:
                self._epoch_row(p, t, False)
            pipe.done = True
            if self.core is not None:
                self._apply(self.core.handle(Lost(p, t)))
            donor = None
        else:
            donor = min(self.present) if self.present else None
            epoch = self.pipes[donor].epoch if donor is not None else pipe.epoch
            if donor is not None and (self.pipes[donor].finished or self.taken.get(epoch, 0) >= self.total):
                return  # no batch left for a joiner (the epoch ends with its global sync)
            self.present.add(p)
            pipe.done = pipe.finished = False
            pipe.synced, pipe.last_start, pipe.epoch, pipe.epoch_start, pipe.global_done = 0, None, epoch, t, 0
            self.tail_epoch[p] = epoch
            if donor is not None:
                self.proxy.copy(donor, p)
            if self.core is not None:
                self._apply(self.core.handle(Join(p, t, donor)))
            net = self.net
            transfer = max(net.latency + b / net.bandwidth for b in self.costs.weight_bytes) if donor is not None else 0
            self._push(t + transfer, "start", p)
        self.changes.append((t, what, p, donor))
        if self.record:
            self.records.append(
                events.control("joined" if what == "join" else "left", t, applied_by="driver", pipeline=p, donor=donor)
            )

    def _on_synced(self, t: float, data: tuple) -> None:
        """Worker (p, s)'s sync ended (and its step slowdown's sleep after it); once every stage of p's did, p starts
        its next step."""
        pipe = self.pipes[data[0]]
        stretch = self.stretch[data[0]]
        if stretch is not None:
            t += stretch[data[1]]
        pipe.synced += 1
        if t > pipe.synced_at:
            pipe.synced_at = t
        if pipe.synced == self.S:
            pipe.step += 1
            pipe.epoch_steps += 1
            self._push(pipe.synced_at, "start", data[0])

    def _absent_at(self, t: float) -> set:
        """The pipelines the trace had taken out at time ``t`` (and not yet back)."""
        absent: set = set()
        for when, what, p, _ in self.changes:
            if when <= t:
                (absent.add if what == "leave" else absent.discard)(p)
        return absent

    def result(self) -> RunResult:
        """The run's history (a row per pipeline and epoch, with an ``epoch`` record each; a pipeline the trace
        took out mid-epoch has a row of what it trained, ``complete`` False) at the last event's time."""
        end = self.end
        for p, pipe in enumerate(self.pipes):
            if not pipe.finished and pipe.epoch_steps:
                self._epoch_row(p, end, False)
        return RunResult(
            models=[],
            history=self.history,
            events=self.records,
            config=self.config,
            wall_time=end,
            stopped=False,
            steps={p: pipe.step for p, pipe in enumerate(self.pipes)},
            lost={p: "left in the trace" for p in sorted(self._absent_at(end))},
            pipelines=self.D,
        )
