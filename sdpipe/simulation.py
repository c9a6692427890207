"""A discrete-event simulator of pipeline-parallel training on the real scheduler core.

``sdpipe.simulate(...)`` replays S stages x D pipelines step by step in simulated
time: each pipeline's step costs what the schedule plan costs with per-action
costs (``sdpipe.schedule.dry_run``) scaled by the same
:class:`~sdpipe.Heterogeneity` the runtime applies; after its step every
worker is ready for its group, and the groups come from the very
:class:`~sdpipe.scheduler.GroupScheduler` the group service runs.  A group
costs a scheduler round trip plus a ring all-reduce of the stage's weights.
A convergence proxy (one quadratic per worker, averaged with its groups)
shows the effect of stale mixing.

The simulation is a heap of ``(time, seq, kind, data)`` events, each kind handled by its
own method of ``_Simulation``; the scheduler core's deadlines come in between them::

    kind    data           handler
    start   p              _on_start   pipeline p takes a batch: its step's spans and a ``ready`` per
                                       stage at the step's end (no batch left: a global sync)
    ready   (p, s, step)   _on_ready   worker (p, s) stepped its optimizer; the core hears ``Ready``
    synced  (p, s, step)   _on_synced  (p, s)'s group is done; once all of p's are, p's next ``start``
    (tick)  deadline       _on_tick    the core's deadline came first: windows that ran out close
    member  (what, p)      _on_member  the trace: pipeline p "leave"s (lost to the core, its events dropped)
                                       or "join"s (a live replica's state, then its next ``start``)

A group the core decides ends at ``closed + round trip + slowest link delay + ring
all-reduce`` and averages its members' proxies (weighted by progress under
``weighting="progress"``).  For example, with 2 pipelines and a 1 ms round trip,
``Group(stage=0, members=(0, 1), closed=0.010)`` of 4e5-byte weights on 1e9 B/s and
50 us latency ends at 0.010 + 0.001 + 2 x 1/2 x 4e5/1e9 + 2 x 50e-6 = 0.0115 s.

The result is a :class:`sdpipe.RunResult` with the same event records and
history fields as a real run (times are simulated seconds; every record is
made by :mod:`sdpipe.events`), so ``Dashboard(result)`` replays a simulated run.

Policies ``sdpipe``, ``allreduce`` and ``none``; one epoch ending with a
global sync.  ``trace=`` makes pipelines leave and come back at given times (under ``sdpipe`` and ``none``):
a leaving pipeline is lost to the core (``Lost``) and its work in flight is dropped; a returning one takes a
live replica's state (the proxy's point, after the time its weights take over the network) and the core hears
``Join`` with that donor; :func:`spot_trace` draws such a trace from preemption and return rates, as spot
instances behave.  :func:`calibrate` measures the costs in a real run's events;
``docs/simulator.md`` has the model and its agreement with real runs.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import random
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

from . import events
from ._result import RunResult
from .config import Heterogeneity, TrainConfig
from .data import TAIL_BATCHES_PER_PIPELINE, leaves_tail, smoothed_step_time
from .schedule import ASYNC_SCHEDULES, build_plan, dry_run
from .scheduler import GroupScheduler, Ready

__all__ = [
    "Calibration",
    "Costs",
    "Network",
    "calibrate",
    "simulate",
    "spot_trace",
    "ring_allreduce_seconds",
    "SIM_POLICIES",
]

SIM_POLICIES = ("sdpipe", "allreduce", "none")


def _seconds(name: str, values, n: int, per: str = "one per stage") -> tuple:
    try:
        if isinstance(values, (str, bytes)):
            raise TypeError
        values = tuple(float(v) for v in values)
    except (TypeError, ValueError):
        raise ValueError(f"costs.{name}: needs {n} finite numbers >= 0 ({per}), got {values!r}") from None
    if len(values) != n or any(not (v >= 0) or math.isinf(v) for v in values):
        raise ValueError(f"costs.{name}: needs {n} finite numbers >= 0 ({per}), got {values!r}")
    return values


@dataclass(frozen=True, kw_only=True)
class Costs:
    """Per-stage costs: seconds per micro-batch of forward and backward, bytes on the wire."""

    forward: tuple
    backward: tuple
    optimizer: tuple = ()
    """Seconds of the optimizer step per stage (default 0)."""
    activation_bytes: tuple = ()
    """Bytes of one micro-batch's activation leaving stages 0..S-2 (default 0)."""
    weight_bytes: tuple = ()
    """Bytes of a stage's weights, averaged by its groups (default 0)."""
    step_overhead: float = 0.0
    """Seconds per step outside the plan's actions: the batch, control messages, bookkeeping."""
    jitter: tuple = ()
    """Relative spread (coefficient of variation) of a stage's compute per step, per stage (or one
    number for all): each simulated step's compute on a stage is scaled by its own log-normal
    factor with mean 1 and this spread (default 0: none)."""

    def __post_init__(self):
        if isinstance(self.forward, (str, bytes)) or not hasattr(self.forward, "__len__"):
            raise ValueError(f"costs.forward: needs one finite number >= 0 per stage, got {self.forward!r}")
        S = len(self.forward)
        if S < 1:
            raise ValueError("costs.forward: needs one number per stage")
        links = max(S - 1, 0)
        object.__setattr__(self, "forward", _seconds("forward", self.forward, S))
        object.__setattr__(self, "backward", _seconds("backward", self.backward, S))
        object.__setattr__(self, "optimizer", _seconds("optimizer", self.optimizer or [0.0] * S, S))
        object.__setattr__(
            self,
            "activation_bytes",
            _seconds("activation_bytes", self.activation_bytes or [0.0] * links, links, "one per link between stages"),
        )
        object.__setattr__(self, "weight_bytes", _seconds("weight_bytes", self.weight_bytes or [0.0] * S, S))
        v = self.step_overhead
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 <= v < math.inf):
            raise ValueError(f"costs.step_overhead: must be a finite number >= 0, got {v!r}")
        object.__setattr__(self, "step_overhead", float(v))
        j = self.jitter
        if isinstance(j, (int, float)) and not isinstance(j, bool):
            j = [j] * S
        object.__setattr__(self, "jitter", _seconds("jitter", j or [0.0] * S, S))

    @classmethod
    def from_run(cls, result) -> "Costs":
        """Per-stage costs measured in a real run's events (see :func:`calibrate`)."""
        return calibrate(result).costs

    @property
    def stages(self) -> int:
        return len(self.forward)


@dataclass(frozen=True, kw_only=True)
class Network:
    """Links and the scheduler: bandwidth (bytes/s), per-message latency (s), scheduler round trip (s)."""

    bandwidth: float = 1e9
    latency: float = 50e-6
    scheduler_rtt: float = 1e-3

    def __post_init__(self):
        for name in ("bandwidth", "latency", "scheduler_rtt"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 or (name == "bandwidth" and v == 0):
                bound = "> 0" if name == "bandwidth" else ">= 0"
                raise ValueError(f"network.{name}: must be a number {bound}, got {v!r}")


def _mean(values, default=0.0) -> float:
    values = list(values)
    return sum(values) / len(values) if values else default


def _dur(e) -> float:
    return e["end"] - e["start"]


class Calibration(NamedTuple):
    """What :func:`calibrate` measured: ``costs, network, heterogeneity = sdpipe.calibrate(result)``."""

    costs: Costs
    network: Network
    heterogeneity: Heterogeneity
    """The run's heterogeneity with each slowed worker's slowdown as its spans showed it."""


def calibrate(result) -> Calibration:
    """Costs, network and heterogeneity measured in the events of a real run (a :class:`sdpipe.RunResult`).

    Means, not medians: a throughput is a sum of times, and on a shared
    machine their distributions have long tails.

    - forward / backward: the mean span per micro-batch and stage over the
      workers the run did not slow (over all, each divided by its slowdown,
      when every worker of a stage was slowed);
    - heterogeneity: the run's, with the slowdown each slowed worker showed
      (its compute against the unslowed mean of its stage; the runtime's
      emulated slowdown k sleeps k - 1 times the compute, and a sleeping
      process wakes late on a busy machine);
    - optimizer: the mean optimizer span per stage;
    - jitter: per stage, the spread of a worker's compute per step (forward
      and backward) around its mean;
    - weight and activation bytes: from each worker's ``stage`` record;
    - step overhead: the mean time of a step on stage 0 that no span covers
      (the batch from the shared counter, the control message, bookkeeping);
    - latency: the mean point-to-point send span (one message);
    - bandwidth: a least-squares fit of the ring all-reduce model (with that
      latency) to the lower quartile of the sync spans of each stage and
      group size (a collective's span also holds the wait for late members);
    - scheduler round trip: twice the mean time from a group's decision to
      the end of a member's wait for it.

    Spans of the first epoch (warm-up) are left out when the run has more.
    Heterogeneity is taken from the run's configuration (changes made live
    are not undone).  Costs no event measured keep their defaults.
    """
    if not all(hasattr(result, a) for a in ("config", "events")) or not isinstance(result.config, TrainConfig):
        raise ValueError(
            f"result: must be a sdpipe.RunResult of a real run (run.result()), got {type(result).__name__}"
        )
    config = result.config
    S = config.stages
    hetero = config.heterogeneity or Heterogeneity()
    by_kind = _after_warm_up(result.events)
    forward, backward, optimizer = (
        [_stage_mean(by_kind, kind, s, hetero) for s in range(S)] for kind in ("forward", "backward", "optimizer")
    )
    shown = _shown_heterogeneity(by_kind, hetero, forward, backward)
    weight_bytes, activation_bytes = _stage_bytes(by_kind, S)
    costs = Costs(
        forward=forward,
        backward=backward,
        optimizer=optimizer,
        weight_bytes=weight_bytes,
        activation_bytes=activation_bytes,
        step_overhead=_mean(_untraced(by_kind, config.pipelines)),
        jitter=_jitter(by_kind, S),
    )
    return Calibration(costs, _network(by_kind, weight_bytes), shown)


def _after_warm_up(records) -> dict:
    """kind -> records, without the first epoch's spans (it warms up process groups and caches) when there are more."""
    epoch_of = {
        (e["pipeline"], e["stage"], e["step"]): e.get("epoch", 0) for e in records if e.get("kind") == "optimizer"
    }
    warm = max(epoch_of.values(), default=0) > 0
    by_kind: dict = {}
    for e in records:
        if (
            warm
            and e.get("step") is not None
            and e.get("pipeline") is not None
            and epoch_of.get((e["pipeline"], e.get("stage"), e["step"]), 1) == 0
        ):
            continue
        by_kind.setdefault(e.get("kind"), []).append(e)
    return by_kind


def _slowed(hetero: Heterogeneity, e) -> bool:
    return hetero.slowdown_of(e["pipeline"], e["stage"]) != 1.0


def _stage_mean(by_kind: dict, kind: str, s: int, hetero: Heterogeneity) -> float:
    """Mean span of ``kind`` on stage s: over the unslowed workers (all, each divided by its slowdown, when
    every one was slowed); the optimizer's over all."""
    spans = [e for e in by_kind.get(kind, ()) if e.get("stage") == s]
    if kind == "optimizer":
        return _mean(_dur(e) for e in spans)
    plain = [_dur(e) for e in spans if not _slowed(hetero, e)]
    return _mean(plain) if plain else _mean(_dur(e) / hetero.slowdown_of(e["pipeline"], s) for e in spans)


def _shown_heterogeneity(by_kind: dict, hetero: Heterogeneity, forward: list, backward: list) -> Heterogeneity:
    """``hetero`` with the slowdown each slowed worker showed: its compute against its stage's unslowed mean."""
    shown: dict = {}
    for kind, base in (("forward", forward), ("backward", backward)):
        for e in by_kind.get(kind, ()):
            if _slowed(hetero, e):
                acc = shown.setdefault((e["pipeline"], e["stage"]), [0.0, 0.0])
                acc[0] += _dur(e)
                acc[1] += base[e["stage"]]
    measured = {key: max(1.0, spent / base) for key, (spent, base) in shown.items() if base > 0}
    return dataclasses.replace(hetero, slowdown=measured) if measured else hetero


def _stage_bytes(by_kind: dict, S: int) -> tuple:
    """(weight bytes per stage, activation bytes per stage boundary) from the workers' ``stage`` records."""
    weight_bytes, activation_bytes = [0.0] * S, [0.0] * max(S - 1, 0)
    for e in by_kind.get("stage", ()):
        weight_bytes[e["stage"]] = float(e["weight_bytes"])
        if e["stage"] < S - 1:
            activation_bytes[e["stage"]] = float(e["activation_bytes"])
    return weight_bytes, activation_bytes


def _jitter(by_kind: dict, S: int) -> list:
    """Per stage: the spread of a worker's compute per step relative to its mean, pooled over the stage's workers."""
    compute: dict = {}
    for kind in ("forward", "backward"):
        for e in by_kind.get(kind, ()):
            key = (e["pipeline"], e["stage"], e["step"])
            compute[key] = compute.get(key, 0.0) + _dur(e)
    per_worker: dict = {}
    for (p, st, _), v in compute.items():
        per_worker.setdefault((p, st), []).append(v)
    rel: dict = {s: [] for s in range(S)}
    for (_, s), vals in per_worker.items():
        m = _mean(vals)
        if m > 0:
            rel[s] += [v / m for v in vals]
    return [math.sqrt(_mean((r - 1.0) ** 2 for r in rel[s])) if len(rel[s]) > 1 else 0.0 for s in range(S)]


#: the kinds of span a worker's step is made of; the rest of a step is untraced overhead
_COVERED = ("forward", "backward", "send", "recv", "wait", "sync", "straggle", "pause", "eval", "optimizer")


def _untraced(by_kind: dict, pipelines: int) -> list:
    """Untraced seconds of each step on stage 0: between consecutive optimizer ends, minus every span inside."""
    untraced = []
    for p in range(pipelines):
        opt = sorted(
            (e for e in by_kind.get("optimizer", ()) if e["pipeline"] == p and e["stage"] == 0),
            key=lambda e: e["start"],
        )
        spans = sorted(
            (
                (e["start"], e["end"])
                for k in _COVERED
                for e in by_kind.get(k, ())
                if e.get("pipeline") == p and e.get("stage") == 0
            ),
            key=lambda x: x[0],
        )
        j = 0
        for a, b in zip(opt, opt[1:]):
            if b["step"] != a["step"] + 1 or b.get("epoch") != a.get("epoch"):
                continue
            lo, hi = a["end"], b["end"]
            while j < len(spans) and spans[j][1] <= lo:
                j += 1
            inside, k = 0.0, j
            while k < len(spans) and spans[k][0] < hi:  # sorted by start: later ones lie past this step
                st, en = spans[k]
                if en > lo:
                    inside += min(en, hi) - max(st, lo)
                k += 1
            untraced.append(max(0.0, (hi - lo) - inside))
    return untraced


def _network(by_kind: dict, weight_bytes: list) -> Network:
    """Latency from the sends, bandwidth from the syncs, the scheduler's round trip from the group waits."""
    default = Network()
    latency = _mean((_dur(e) for e in by_kind.get("send", ())), default.latency)
    # a collective's span also holds the wait for members that arrive late: the lower quartile
    # of each (stage, size) is the transfer
    spans: dict = {}
    for e in by_kind.get("sync", ()):
        n = len(e.get("group") or ())
        if n >= 2 and e.get("stage") is not None and e.get("reason") not in ("ps", "pair"):
            spans.setdefault((e["stage"], n), []).append(_dur(e))
    xs = []
    for (stage, n), vals in spans.items():
        vals.sort()
        xs.append((2 * (n - 1) / n * weight_bytes[stage], vals[len(vals) // 4] - 2 * (n - 1) * latency))
    bandwidth = default.bandwidth
    if xs:
        num, den = sum(x * x for x, _ in xs), sum(x * y for x, y in xs)
        bandwidth = num / den if den > 0 and num > 0 else 1e15  # all latency: as good as unlimited
    decided = {(e["stage"], e["round"]): e["end"] for e in by_kind.get("group", ())}
    trips = [
        max(0.0, e["end"] - decided[(e["stage"], e["round"])])
        for e in by_kind.get("wait", ())
        if e.get("what") == "group" and (e.get("stage"), e.get("round")) in decided
    ]
    rtt = 2 * _mean(trips) if trips else default.scheduler_rtt
    return Network(bandwidth=bandwidth, latency=latency, scheduler_rtt=rtt)


def ring_allreduce_seconds(nbytes: float, members: int, net: Network) -> float:
    """Ring all-reduce: 2(n-1)/n x bytes / bandwidth plus 2(n-1) message latencies."""
    if members < 2:
        return 0.0
    return 2 * (members - 1) / members * nbytes / net.bandwidth + 2 * (members - 1) * net.latency


def _step_finish(plan, costs: Costs, net: Network, slowdown: tuple, microbatches: int) -> tuple:
    """(per-stage finish times of one step, per-stage compute seconds) of a pipeline slowed by ``slowdown``
    (one factor per stage), from the dry run of ``plan``.

    An asynchronous schedule's ``plan`` is ``((plan of n steps, n), plan of n + 1 steps)``: a step of the
    steady state lasts the difference of their makespans on every stage (no fill, no flush; the warm-up and
    drain of each epoch are left out), plus its updates' optimizer time.  A stage's updates within a step
    count as one ready signal at its end."""

    def cost(a):
        if a.op == "F":
            return costs.forward[a.stage] * slowdown[a.stage]
        if a.op == "B":
            return costs.backward[a.stage] * slowdown[a.stage]
        if a.op in ("SF", "SB"):
            boundary = a.stage if a.op == "SF" else a.stage - 1
            return costs.activation_bytes[boundary] / net.bandwidth + net.latency
        return 0.0

    if isinstance(plan, tuple):  # an asynchronous schedule: the steady state's step, one period for every stage
        (short, steps), longer = plan
        period = dry_run(longer, cost).makespan - dry_run(short, cost).makespan
        S = len(slowdown)
        updates = sum(a.op == "U" for a in longer[0]) / (steps + 1)  # per step, on average
        ends = [period + costs.optimizer[s] * updates for s in range(S)]
        return ends, [microbatches * (costs.forward[s] + costs.backward[s]) * slowdown[s] for s in range(S)]
    run = dry_run(plan, cost)
    S = len(slowdown)
    # a stage's step ends when its own actions are done and the receives of what it sent
    # completed (the runtime waits for its sends at the end of the step)
    ends = [
        max(
            (
                e
                for a, _, e in run.spans
                if a.stage == s or (a.op == "RF" and a.stage == s + 1) or (a.op == "RB" and a.stage == s - 1)
            ),
            default=0.0,
        )
        + costs.optimizer[s]
        for s in range(S)
    ]
    busy = [microbatches * (costs.forward[s] + costs.backward[s]) * slowdown[s] for s in range(S)]
    return ends, busy


@dataclass(slots=True)
class _Pipe:
    """One pipeline's progress in the simulation."""

    step: int = 0
    synced: dict = field(default_factory=dict)  # stage -> time its sync of this step ended
    last_start: Optional[float] = None
    step_time: Optional[float] = None  # recent seconds per step, as the runtime's dispenser keeps it
    done: bool = False


def _concerns(entry: tuple, p: int) -> bool:
    """Whether a heap entry is pipeline p's work (its start, a worker's ready, ask or synced, its global sync)."""
    kind, data = entry[2], entry[3]
    if kind == "member":
        return False
    return data == p if kind in ("start", "global") else data[0] == p


class _Proxy:
    """The convergence proxy: each worker (p, s) holds a point x (4 numbers) of the bowl ``mean(x ** 2)`` and
    steps ``x -= lr * (x + noise * N(0, 1))`` per step; groups average their members' points.

    ``mass`` is a worker's progress (1 + steps since the last global sync), the weight of ``weighting="progress"``.
    Replicas of a stage start equal.  A pipeline's loss is the mean of its stages' quadratics.
    """

    __slots__ = ("stages", "lr", "noise", "rng", "x", "mass")

    def __init__(self, stages: int, pipelines: int, rng: random.Random, lr: float, noise: float):
        self.stages, self.lr, self.noise, self.rng = stages, lr, noise, rng
        init = {s: [rng.gauss(0, 3) for _ in range(4)] for s in range(stages)}
        self.x = {(p, s): list(init[s]) for p in range(pipelines) for s in range(stages)}
        self.mass = {(p, s): 1.0 for p in range(pipelines) for s in range(stages)}

    def learn(self, p: int, s: int) -> None:
        v = self.x[(p, s)]
        self.mass[(p, s)] += 1.0
        lr, noise, gauss = self.lr, self.noise, self.rng.gauss
        for i in range(len(v)):
            v[i] -= lr * (v[i] + noise * gauss(0, 1))

    def mix(self, stage: int, members: list, by_progress: bool, restart: bool) -> None:
        """``members`` of ``stage`` average (by progress or uniformly); a global sync (``restart``) resets progress."""
        x, mass = self.x, self.mass
        if len(members) > 1:
            w = {m: mass[(m, stage)] if by_progress else 1.0 for m in members}
            total = sum(w.values())
            mean = [sum(w[m] * x[(m, stage)][i] for m in members) / total for i in range(len(x[(members[0], stage)]))]
            shared = sum(mass[(m, stage)] for m in members) / len(members)
            for m in members:
                x[(m, stage)] = list(mean)
                mass[(m, stage)] = shared
        if restart:
            for m in members:
                mass[(m, stage)] = 1.0

    def copy(self, donor: int, p: int) -> None:
        """Pipeline p takes the donor's points and progress (a joiner's state)."""
        for s in range(self.stages):
            self.x[(p, s)] = list(self.x[(donor, s)])
            self.mass[(p, s)] = self.mass[(donor, s)]

    def loss(self, p: int) -> float:
        x = self.x
        return sum(sum(v * v for v in x[(p, s)]) / len(x[(p, s)]) for s in range(self.stages)) / self.stages


class _Simulation:
    """One simulated epoch: a heap of ``(time, seq, kind, data)`` events, one handler per kind, and the
    scheduler core's deadlines as ticks in between (see the module's docstring)."""

    def __init__(
        self, config: TrainConfig, *, costs: Costs, network: Network, steps: int, record: bool, lr: float, noise: float
    ):
        S, D, M = config.stages, config.pipelines, config.microbatches
        self.config, self.costs, self.net = config, costs, network
        self.S, self.D, self.steps, self.record, self.policy = S, D, steps, record, config.policy
        self.hetero = hetero = config.heterogeneity or Heterogeneity()
        self.rng = random.Random(config.seed)
        self.core = GroupScheduler(S, D, config.scheduler_policy()) if config.policy != "none" else None
        self.total = steps * D  # batches in the epoch
        self.taken = 0
        self.pipes = [_Pipe() for _ in range(D)]
        self.heap: list = []
        self._seq = itertools.count()
        self.records: list = []
        self.now = 0.0
        # the core's next deadline (None: nothing to time), a function of its state: asked again after each of
        # its events (see _apply), not at every one of ours
        self.deadline: Optional[float] = self.core.next_deadline() if self.core is not None else None
        self.proxy = _Proxy(S, D, self.rng, lr, noise)
        self.jitter_sigma = [math.sqrt(math.log1p(j**2)) for j in costs.jitter]  # log-normal, mean 1
        # heterogeneity holds still in a simulation: each pipeline's step costs and each worker's link delay, once
        if config.schedule in ASYNC_SCHEDULES:  # a step's span in the steady state, from 8 and 9 steps
            every = config.resolved_update_every
            plan = (build_plan(config.schedule, S, M, steps=8, update_every=every), 8)
            plan = (plan, build_plan(config.schedule, S, M, steps=9, update_every=every))
        else:
            plan = build_plan(config.schedule, S, M)  # with its sends and receives
        finish: dict = {}
        self.step_costs = []  # per pipeline: (per-stage finish, compute, forward seconds of one step)
        for p in range(D):
            k = tuple(hetero.slowdown_of(p, s) for s in range(S))
            if k not in finish:
                finish[k] = _step_finish(plan, costs, network, k, M)
            ends, busy = finish[k]
            self.step_costs.append((ends, busy, [M * costs.forward[s] * k[s] for s in range(S)]))
        self.link_delay = [[hetero.link_delay_of(p, s) for s in range(S)] for p in range(D)]
        # averaging overlapped with compute (SchedulerPolicy.overlap): a worker goes on at its ready signal; its
        # group's averaging runs meanwhile and must have ended before the worker's next ready signal
        self.overlap = self.core is not None and config.policy != "allreduce" and self.core.policy.overlap
        self.averaging: dict = {}  # (p, s) -> when its overlapped averaging ends (None: its group is undecided)
        self.held: dict = {}  # (p, s) -> (time, data) of a ready that waits for that averaging
        self.held_global: dict = {}  # p -> when it ran out of batches: its global sync waits for those averagings
        self.present = set(range(D))  # pipelines taking part (the trace takes some out and back)
        self.changes: list = []  # (time, what, pipeline, donor) of the trace's changes, as applied
        self.end = 0.0  # the last event's time, the trace's own aside

    def _push(self, t: float, kind: str, data) -> None:
        heapq.heappush(self.heap, (t, next(self._seq), kind, data))

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
        }
        heap, pop = self.heap, heapq.heappop
        # a pending deadline is ticked also when nothing else is left: workers of different stages can all be
        # waiting in open rounds at once (each pipeline's step needs every stage's group)
        while heap or self.deadline is not None:
            deadline = self.deadline
            if deadline is not None and (not heap or deadline <= heap[0][0]):
                self._on_tick(deadline)
                if not heap and self.deadline == deadline:
                    raise RuntimeError(f"simulation: the scheduler's deadline {deadline} did not pass when ticked")
                continue
            self.now, _, kind, data = pop(heap)
            handlers[kind](self.now, data)
            if kind != "member" and (kind != "start" or not self.pipes[data].done):
                self.end = self.now  # the trace (and its joiners finding no batch) may go on after the work
        return self

    def _on_start(self, t: float, p: int) -> None:
        """Pipeline p asks for a batch: with one, its step's spans and each stage's ``ready`` at the step's end;
        without, its workers join the epoch's global sync."""
        pipe = self.pipes[p]
        if not self._next_batch(p, t):
            if self.core is not None:  # the epoch ends with a global sync, once overlapped averagings ended
                self.held_global[p] = t
                self._global_when_settled(p)
            return
        pipe.synced = {}
        ends, busy, forward = self.step_costs[p]
        rng, hetero, step = self.rng, self.hetero, pipe.step
        scale = [rng.lognormvariate(-(sg**2) / 2, sg) if sg > 0 else 1.0 for sg in self.jitter_sigma]
        extra = self.costs.step_overhead
        if hetero.straggle_prob > 0:
            hits = [rng.random() < hetero.straggle_prob for _ in range(self.S)]  # all S draws, as the runtime's
            extra += hetero.straggle_delay if any(hits) else 0.0
        begin, push = t + extra, self._push
        for s in range(self.S):
            push(begin + ends[s] + busy[s] * (scale[s] - 1.0), "ready", (p, s, step))
        if self.record:
            keep, span = self.records.append, events.span
            for s in range(self.S):
                f = begin + forward[s] * scale[s]
                keep(span("forward", p, s, step, None, begin, f))
                keep(span("backward", p, s, step, None, f, begin + busy[s] * scale[s]))

    def _next_batch(self, p: int, t: float) -> bool:
        """The runtime's dispenser: lock step under allreduce, else the next of the epoch's batches unless p
        leaves the tail to faster pipelines.  Also keeps p's recent step time."""
        pipe = self.pipes[p]
        if pipe.last_start is not None:
            pipe.step_time = smoothed_step_time(pipe.step_time, t - pipe.last_start)
        pipe.last_start = t
        if self.policy == "allreduce":
            return pipe.step < self.steps
        remaining = self.total - self.taken
        if remaining > 0 and not (remaining <= TAIL_BATCHES_PER_PIPELINE * self.D and self._leaves_tail(p)):
            self.taken += 1
            return True
        pipe.done = True
        return False

    def _leaves_tail(self, p: int) -> bool:
        """The runtime's epoch-tail rule, on the simulated pipelines still in the epoch."""
        others = [q.step_time for i, q in enumerate(self.pipes) if i != p and not q.done and q.step_time is not None]
        return leaves_tail(self.pipes[p].step_time, others, self.total - self.taken)

    def _on_ready(self, t: float, data: tuple) -> None:
        """Worker (p, s) stepped its optimizer (the proxy learns) and is ready for its group (none: synced)."""
        p, s, step = data
        self.proxy.learn(p, s)
        if self.record:
            loss = {"loss": self.proxy.loss(p)} if s == self.S - 1 else {}
            self.records.append(events.span("optimizer", p, s, step, None, t, t, epoch=0, **loss))
        if self.core is None:
            self._on_synced(t, data)
        elif not self.overlap:
            self._apply(self.core.handle(s, Ready(p, step, t, False)))
        elif (p, s) not in self.averaging:
            self._on_ask(t, data)
        else:  # its last averaging is still undecided or running: the ready signal waits for it
            end = self.averaging[(p, s)]
            if end is None:
                self.held[(p, s)] = (t, data)
            else:
                self._hold(t, end, data)

    def _hold(self, t: float, end: float, data: tuple) -> None:
        """An overlapped worker's ready waits until ``end``, when its last group's averaging ended."""
        if end > t and self.record:
            p, s, step = data
            self.records.append(events.span("wait", p, s, step, None, t, end, what="group"))
        self._push(max(t, end), "ask", data)

    def _on_ask(self, t: float, data: tuple) -> None:
        """Overlap: (p, s) tells the core it is ready and goes on with its next step at once."""
        p, s, step = data
        self.averaging[(p, s)] = None
        self._apply(self.core.handle(s, Ready(p, step, t, False)))
        self._on_synced(t, data)

    def _global_when_settled(self, p: int) -> None:
        """Pipeline p's global sync, once every overlapped averaging of its workers is decided (and then ended)."""
        ends = [self.averaging.get((p, s), 0.0) for s in range(self.S)]
        if p in self.held_global and None not in ends:
            self._push(max([self.held_global.pop(p)] + ends), "global", p)

    def _on_global(self, t: float, p: int) -> None:
        for s in range(self.S):
            self._apply(self.core.handle(s, Ready(p, self.pipes[p].step, t, True)))

    def _on_tick(self, now: float) -> None:
        """The core's deadline: the rounds whose window ran out close."""
        self.now = now
        self._apply(self.core.tick(now))

    def _apply(self, decisions) -> None:
        """What the core decided on one of its events (groups, if any), then its next deadline."""
        if decisions:  # most events decide nothing
            self._groups(decisions)
        self.deadline = self.core.next_deadline()

    def _groups(self, decisions) -> None:
        """Each group costs the round trip (none under allreduce: it needs no scheduler), the slowest member's link
        delay and a ring all-reduce; the proxy averages the members; each member's ``synced`` comes at the end."""
        costs, net, pipes, record, keep = self.costs, self.net, self.pipes, self.record, self.records.append
        rtt = 0.0 if self.policy == "allreduce" else net.scheduler_rtt
        by_progress = self.core.policy.weighting == "progress"
        for g in decisions:
            members, stage = list(g.members), g.stage
            delay = max(self.link_delay[m][stage] for m in members)
            end = g.closed + rtt + delay + ring_allreduce_seconds(costs.weight_bytes[stage], len(members), net)
            self.proxy.mix(stage, members, by_progress, g.reason == "global")
            if record:
                keep(
                    events.group(
                        stage, g.round, members, g.reason, g.opened, g.closed, g.wait, g.connected, self.policy
                    )
                )
            background = self.overlap and g.reason != "global"
            lane = {"lane": "background"} if background else {}
            for m in members:
                step = pipes[m].step
                if record:
                    keep(
                        events.span(
                            "sync",
                            m,
                            stage,
                            step,
                            None,
                            g.closed,
                            end,
                            group=members,
                            round=g.round,
                            reason=g.reason,
                            **lane,
                        )
                    )
                if background:
                    self.averaging[(m, stage)] = end
                    held = self.held.pop((m, stage), None)
                    if held is not None:
                        self._hold(held[0], end, held[1])
                    self._global_when_settled(m)
                elif g.reason != "global":
                    self._push(end, "synced", (m, stage, step))

    def _on_member(self, t: float, data: tuple) -> None:
        """The trace: pipeline p leaves (lost: the core takes it out of every stage, its work in flight is dropped)
        or joins (it takes the proxy state of the lowest live pipeline, the donor, once the stages' weights crossed
        the network; the core hears ``Join`` with that donor; then its next step).  A change that does not apply
        (leaving when gone, joining when there or once every batch is taken) is skipped."""
        what, p = data
        if (what == "leave") != (p in self.present) or (what == "join" and self.taken >= self.total):
            return  # nothing to change; or no batch left for a joiner (the epoch ends with its global sync)
        if what == "leave":
            self.present.discard(p)
            self.heap[:] = [e for e in self.heap if not _concerns(e, p)]  # in place: run() holds the list
            heapq.heapify(self.heap)
            for s in range(self.S):
                self.averaging.pop((p, s), None)
                self.held.pop((p, s), None)
            self.held_global.pop(p, None)
            self.pipes[p].done = True
            if self.core is not None:
                self._apply(self.core.lost(p, t))
            donor = None
        else:
            donor = min(self.present) if self.present else None
            self.present.add(p)
            pipe = self.pipes[p]
            pipe.done, pipe.synced, pipe.last_start = False, {}, None
            if donor is not None:
                self.proxy.copy(donor, p)
            if self.core is not None:
                self._apply(self.core.join(p, t, donor))
            net = self.net
            transfer = max(net.latency + b / net.bandwidth for b in self.costs.weight_bytes) if donor is not None else 0
            self._push(t + transfer, "start", p)
        self.changes.append((t, what, p, donor))
        if self.record:
            self.records.append(
                events.control("joined" if what == "join" else "left", t, applied_by="driver", pipeline=p, donor=donor)
            )

    def _on_synced(self, t: float, data: tuple) -> None:
        """Worker (p, s)'s sync ended; once every stage of p's did, p starts its next step."""
        p, s, _ = data
        pipe = self.pipes[p]
        pipe.synced[s] = t
        if len(pipe.synced) == self.S:
            pipe.step += 1
            self._push(max(pipe.synced.values()), "start", p)

    def _absent_at(self, t: float) -> set:
        """The pipelines the trace had taken out at time ``t`` (and not yet back)."""
        absent: set = set()
        for when, what, p, _ in self.changes:
            if when <= t:
                (absent.add if what == "leave" else absent.discard)(p)
        return absent

    def result(self) -> RunResult:
        """The run's history (one row per pipeline, with an ``epoch`` record each) at the last event's time."""
        end, share_of = self.end, self.total * self.config.batch_size
        history = []
        for p, pipe in enumerate(self.pipes):
            samples = pipe.step * self.config.batch_size
            metrics = {
                "epoch": 0,
                "pipeline": p,
                "loss": self.proxy.loss(p),
                "samples": samples,
                "share": samples / share_of,
                "samples_per_s": samples / end if end > 0 else 0.0,
                "steps": pipe.step,
                "complete": True,
            }
            history.append(metrics)
            if self.record:
                self.records.append(events.epoch(p, self.S - 1, pipe.step, end, metrics))
        return RunResult(
            models=[],
            history=history,
            events=self.records,
            config=self.config,
            wall_time=end,
            stopped=False,
            steps={p: pipe.step for p, pipe in enumerate(self.pipes)},
            lost={p: "left in the trace" for p in sorted(self._absent_at(end))},
            pipelines=self.D,
        )


def simulate(
    stages: int,
    pipelines: int,
    *,
    costs: Costs,
    policy: str = "sdpipe",
    schedule: str = "1f1b",
    microbatches: int = 4,
    batch_size: int = 32,
    steps: int = 100,
    heterogeneity: Optional[Heterogeneity] = None,
    network: Network = Network(),
    scheduler=None,
    seed: int = 0,
    record: bool = True,
    lr: float = 0.1,
    noise: float = 1.0,
    trace=None,
):
    """Simulate ``steps`` steps' worth of batches per pipeline; returns a :class:`sdpipe.RunResult`.

    Under ``allreduce`` every pipeline takes ``steps`` steps; under ``sdpipe``
    and ``none`` the ``steps x pipelines`` batches go to whichever pipeline
    asks next (work follows speed).  ``record=False`` keeps only the history
    (for very large simulations).  ``trace``: ``(seconds, "leave" | "join", pipeline)`` changes of the pipelines
    present (see :func:`spot_trace`); pipelines absent at the end are in ``result.lost``, and ``control``
    records ``left`` / ``joined`` mark the changes.
    """
    if policy not in SIM_POLICIES:
        raise ValueError(f"policy: {policy!r} is not one of {', '.join(SIM_POLICIES)} (the simulator's policies)")
    for name, v in (("stages", stages), ("pipelines", pipelines)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: must be an integer >= 1, got {v!r}")
    if not isinstance(network, Network):
        raise ValueError(f"network: must be a sdpipe.Network, got {type(network).__name__}")
    for name, v in (("lr", lr), ("noise", noise)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 <= v < math.inf):
            raise ValueError(f"{name}: must be a finite number >= 0, got {v!r}")
    if not isinstance(costs, Costs):
        raise ValueError(f"costs: must be a sdpipe.Costs, got {type(costs).__name__}")
    if costs.stages != stages:
        raise ValueError(f"costs: has {costs.stages} stages, the simulation {stages}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps: must be an integer >= 1, got {steps!r}")
    config = TrainConfig(
        stages=stages,
        pipelines=pipelines,
        policy=policy,
        schedule=schedule,
        microbatches=microbatches,
        batch_size=batch_size,
        epochs=1,
        heterogeneity=heterogeneity,
        scheduler=scheduler,
        seed=seed,
    )
    changes = _check_trace(trace, pipelines, policy)
    sim = _Simulation(config, costs=costs, network=network, steps=steps, record=record, lr=lr, noise=noise)
    return sim.run(changes).result()


def _check_trace(trace, pipelines: int, policy: str) -> list:
    if trace is None:
        return []
    if policy not in ("sdpipe", "none"):
        raise ValueError(f"trace: pipelines join and leave under 'sdpipe' and 'none', not {policy!r}")
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
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < v < math.inf):
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
