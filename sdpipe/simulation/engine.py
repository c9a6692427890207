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
from sdpipe.driver.result import RunResult
from sdpipe.simulation.batches import _Batches
from sdpipe.simulation.costs import Costs, Network, _step_finish, _step_plan
from sdpipe.simulation.exchange import EXCHANGE_OF
from sdpipe.simulation.proxy import Proxy, _Proxy
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


def _price_steps(config: TrainConfig, costs: Costs, network: Network, hetero: Heterogeneity) -> tuple:
    """Heterogeneity holds still in a simulation: each pipeline's step costs, once per distinct slowdown, as
    ``(per-stage finish, compute, forward seconds of one step)``, and per pipeline what each stage sleeps after its
    step for a step slowdown f (``worker.pace``: f - 1 times its own step, the step overhead counted on stage 0; a
    pipeline's slowdown is stage 0's), or None."""
    S, M = config.stages, config.microbatches
    plan = _step_plan(config)
    finish: dict = {}
    step_costs, stretch = [], []
    for p in range(config.pipelines):
        k = tuple(hetero.compute_slowdown_of(p, s) for s in range(S))
        if k not in finish:
            ends, busy = _step_finish(plan, costs, network, k, M)
            finish[k] = (ends, busy, [M * costs.forward[s] * k[s] for s in range(S)])
        step_costs.append(finish[k])
        f = [hetero.stretch_of(p, s) for s in range(S)]
        ends = finish[k][0]
        own = [ends[s] + (costs.step_overhead if s == 0 else 0.0) for s in range(S)]
        stretch.append([(f[s] - 1.0) * own[s] for s in range(S)] if max(f) > 1.0 else None)
    return step_costs, stretch


class _Draws:
    """The random timing of the steps, drawn in blocks from its own stream: each stage's log-normal jitter (mean 1)
    and how many of a step's stages a transient straggle hits (S draws, as the runtime: each stage that straggles
    holds the pipeline's step back by the delay)."""

    def __init__(self, jitter: list, straggle_prob: float, seed: int):
        self.gen = np.random.default_rng([seed, 2])
        self.sigma = np.array([math.sqrt(math.log1p(j**2)) for j in jitter])
        self.p, self.S = straggle_prob, len(jitter)
        self.block: list = []

    def draw(self) -> tuple:
        """One step's draws: (each stage's jitter factor, how many of its stages a transient straggle hits)."""
        if not self.block:
            n, S, gen, sigma, p = 4096, self.S, self.gen, self.sigma, self.p
            scale = np.exp(gen.standard_normal((n, S)) * sigma - sigma**2 / 2).tolist()
            hits = (gen.random((n, S)) < p).sum(axis=1).tolist() if p > 0 else [0] * n
            self.block = list(zip(scale, hits, strict=True))
            self.block.reverse()
        return self.block.pop()


class _Simulation:
    """One simulated run: a timeline of ``(kind, data)`` events, one handler per kind, and the scheduler core's
    deadlines as ticks in between (see the package's docstring).  The pipelines, the batches, the proxy and the
    timing are here; how the replicas meet is the run's exchange (:mod:`sdpipe.simulation.exchange`)."""

    def __init__(self, config: TrainConfig, *, costs: Costs, network: Network, proxy: Proxy, steps: int, record: bool):
        S, D = config.stages, config.pipelines
        self.config, self.costs, self.net = config, costs, network
        self.S, self.D, self.steps, self.record, self.policy = S, D, steps, record, config.policy
        #: how the replicas meet (:attr:`sdpipe.core.policies.PolicyRecord.exchange`)
        self.exchange = exchange = policy_record(config.policy).exchange
        self.epochs, self.sync_every = config.epochs, config.sync_every
        self.hetero = hetero = config.heterogeneity or Heterogeneity()
        self.pipes = [_Pipe() for _ in range(D)]
        self.batches = _Batches(self.pipes, steps, config.epochs, lock_step=exchange == "all")
        self.heap: list = []  # the times that hold events (each once) ...
        self.at: dict = {}  # ... and time -> its events in the order pushed
        self._due: list = []  # the current time's events ...
        self._cursor = 0  # ... and how many of them were taken (see _on_member)
        self.records: list = []
        self.history: list = []
        self.now = 0.0
        self.end = 0.0  # the last event's time, the trace's own aside
        self.proxy = _Proxy(S, D, config.seed, proxy)
        self.rng = random.Random(config.seed)  # adpsgd's peers
        self._draw = _Draws(costs.jitter, hetero.straggle_prob, config.seed).draw
        self.step_costs, self.stretch = _price_steps(config, costs, network, hetero)
        self.link_delay = [[hetero.link_delay_of(p, s) for s in range(S)] for p in range(D)]
        self._link_delays = any(any(row) for row in self.link_delay)
        self.present = set(range(D))  # pipelines taking part (the trace takes some out and back)
        self.changes: list = []  # (time, what, pipeline, donor) of the trace's changes, as applied
        # seconds each worker's server thread took from it since its pipeline's last step started (Costs.serve)
        self.serving = costs.serve > 0 and exchange in ("server", "pairs")
        self.owed = [0.0] * (D * S)
        # the core's next deadline (None: nothing to time), a function of its state: asked again after each of
        # its events (see _CoreRounds.apply), not at every one of ours
        self.deadline: Optional[float] = None
        self.sync = EXCHANGE_OF[exchange](self)
        self._sync_ready = self.sync.on_ready  # bound once: a call per worker step

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
            "synced": self._on_synced,
            "member": self._on_member,
            "epoch": self._on_epoch,
            **self.sync.handlers(),
        }
        heap, at, pop, pipes, tick = self.heap, self.at, heapq.heappop, self.pipes, getattr(self.sync, "tick", None)
        ready = self._on_ready
        # a pending deadline is ticked also when nothing else is left: workers of different stages can all be
        # waiting in open rounds at once (each pipeline's step needs every stage's group)
        while heap or self.deadline is not None:
            deadline = self.deadline
            if deadline is not None and (not heap or deadline <= heap[0]):
                tick(deadline)
                if not heap and self.deadline == deadline:
                    raise RuntimeError(f"simulation: the scheduler's deadline {deadline} did not pass when ticked")
                continue
            now = pop(heap)
            due = self._due = at.pop(now)  # what its events push for ``now`` comes after them, as a time of its own
            i = 0
            while i < len(due):
                deadline = self.deadline
                if deadline is not None and deadline <= now:
                    tick(deadline)
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

    def _on_start(self, t: float, p: int) -> None:
        """Pipeline p asks for a batch: with one, its step's spans and each stage's ``ready`` at the step's end;
        without, its epoch ends (see :meth:`_epoch_done`)."""
        pipe = self.pipes[p]
        if not self.batches.next(p, t):
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

    def _epoch_done(self, p: int, t: float) -> None:
        """No batch of its epoch is left for pipeline p: at an epoch that ends with a global sync (every
        ``sync_every`` epochs and the last) its workers join it as the exchange says (none under ``none``), else p
        goes on with its next epoch at once."""
        pipe = self.pipes[p]
        pipe.done = True
        self.batches.leave(p)
        e = pipe.epoch
        if self.exchange == "nothing" or not ((e + 1) % self.sync_every == 0 or e == self.epochs - 1):
            self._next_epoch(t, p)
        else:
            self.sync.epoch_end(t, p)

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
        self.batches.enter(p, pipe.epoch, counted=True)
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
            "share": samples / (self.batches.total * bs),
            "samples_per_s": samples / took if took > 0 else 0.0,
            "steps": pipe.epoch_steps,
            "complete": complete,
        }
        self.history.append(metrics)
        pipe.epoch_steps = 0
        if self.record:
            self.records.append(events.epoch(p, self.S - 1, pipe.step, t, metrics))

    def _on_ready(self, t: float, data: tuple) -> None:
        """Worker (p, s) stepped its optimizer (the proxy learns) and syncs as its exchange says."""
        p, s, step = data
        self.proxy.learn(p * self.S + s)
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
        self._sync_ready(t, data)

    def _global_done(self, p: int, end: float) -> None:
        """One of p's stages ends the epoch's global sync at ``end``; after the last, p's ``epoch``."""
        pipe = self.pipes[p]
        pipe.global_done += 1
        pipe.global_end = max(pipe.global_end, end)
        if pipe.global_done == self.S:
            pipe.global_done = 0
            self._push(pipe.global_end, "epoch", p)

    # ------------------------------------------------------------------ the trace
    def _on_member(self, t: float, data: tuple) -> None:
        """The trace: pipeline p leaves (lost: the exchange takes it out, its work in flight is dropped) or joins
        (it takes the proxy state of the lowest live pipeline, the donor, once the stages' weights crossed the
        network; the exchange hears of it with that donor; then its next step in the donor's epoch).  A change
        that does not apply (leaving when gone, joining when there or when no batch of the donor's epoch is
        left) is skipped."""
        what, p = data
        if (what == "leave") != (p in self.present):
            return
        if what == "leave":
            self._leave(t, p)
            donor = None
        else:
            donor = min(self.present) if self.present else None
            epoch = self.pipes[donor].epoch if donor is not None else self.pipes[p].epoch
            if donor is not None and (self.pipes[donor].finished or self.batches.exhausted(epoch)):
                return  # no batch left for a joiner (the epoch ends with its global sync)
            self._join(t, p, donor, epoch)
        self.changes.append((t, what, p, donor))
        if self.record:
            self.records.append(
                events.control("joined" if what == "join" else "left", t, applied_by="driver", pipeline=p, donor=donor)
            )

    def _leave(self, t: float, p: int) -> None:
        """p leaves: its events are dropped (those of the current time in place: run() holds the list), its row
        of the epoch so far is written, and the exchange takes it out."""
        pipe = self.pipes[p]
        self.present.discard(p)
        for due in self.at.values():
            due[:] = [e for e in due if not _concerns(e, p)]
        due, taken = self._due, self._cursor
        due[taken:] = [e for e in due[taken:] if not _concerns(e, p)]
        self.batches.leave(p)
        if pipe.epoch_steps:
            self._epoch_row(p, t, False)
        pipe.done = True
        self.sync.lost(p, t)

    def _join(self, t: float, p: int, donor: Optional[int], epoch: int) -> None:
        """p joins in ``epoch`` with the donor's proxy state; its first step once the weights crossed the network."""
        pipe = self.pipes[p]
        self.present.add(p)
        pipe.done = pipe.finished = False
        pipe.synced, pipe.last_start, pipe.epoch, pipe.epoch_start, pipe.global_done = 0, None, epoch, t, 0
        self.batches.enter(p, epoch, counted=False)
        if donor is not None:
            self.proxy.copy(donor, p)
        self.sync.joined(p, t, donor)
        net = self.net
        transfer = max(net.latency + b / net.bandwidth for b in self.costs.weight_bytes) if donor is not None else 0
        self._push(t + transfer, "start", p)

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
            bounds=self.sync.core.bounds() if self.sync.core is not None else [],
            simulated=True,
        )
