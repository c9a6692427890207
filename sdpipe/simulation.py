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

The simulation is a timeline of ``(kind, data)`` events: a heap of the times that hold any and, per time, its
events in the order they were pushed (ties go first come, first served); each kind is handled by its own
method of ``_Simulation``, and the scheduler core's deadlines come in between them::

    kind    data                  handler
    start   p                     _on_start   pipeline p takes a batch: its step's spans and a ``ready`` per
                                              stage at the step's end (no batch of its epoch left: its epoch ends)
    ready   (p, s, step)          _on_ready   worker (p, s) stepped its optimizer; it syncs as its policy says
    ask     (p, s, step)          _on_ask     overlap: a ready signal that waited for the last averaging
    global  p                     _on_global  p's workers join the epoch's global sync (through the core)
    synced  (p, s, step)          _on_synced  (p, s)'s sync is done; once all of p's are, p's next ``start``
    epoch   p                     _on_epoch   every stage of p ended the epoch's global sync: its next epoch
    pushed  (p, s, delta, kind)   _on_pushed  ps: a push reached stage s's server; it answers what its bound lets go
    paired  (p, s, step, q, t)    _on_paired  adpsgd: active p's exchange with passive q ended
    (tick)  deadline              _on_tick    the core's deadline came first: windows that ran out close
    member  (what, p)             _on_member  the trace: pipeline p "leave"s (lost to the core, its events dropped)
                                              or "join"s (a live replica's state, then its next ``start``)

A group the core decides ends at ``closed + round trip + slowest link delay + ring
all-reduce`` and averages its members' proxies (weighted by progress under
``weighting="progress"``).  For example, with 2 pipelines and a 1 ms round trip,
``Group(stage=0, members=(0, 1), closed=0.010)`` of 4e5-byte weights on 1e9 B/s and
50 us latency ends at 0.010 + 0.001 + 2 x 1/2 x 4e5/1e9 + 2 x 50e-6 = 0.0115 s.

The result is a :class:`sdpipe.RunResult` with the same event records and
history fields as a real run (times are simulated seconds; every record is
made by :mod:`sdpipe.events`), so ``Dashboard(result)`` replays a simulated run.

Every policy: ``sdpipe`` and ``allreduce`` through the core; ``ps`` with a server per stage whose link carries
every push and pull of its stage, answering by the runtime's staleness rule; ``adpsgd`` with random pairs of an
active and a passive worker, the passive one serving one exchange at a time; ``none``.  ``epochs`` epochs, a
global sync every ``sync_every`` of them and after the last.  ``trace=`` makes pipelines leave and come back
at given times (under ``sdpipe`` and ``none``): a leaving pipeline is lost to the core (``Lost``) and its work
in flight is dropped; a returning one takes a live replica's state (the proxy's point, after the time its
weights take over the network) and the core hears ``Join`` with that donor; :func:`spot_trace` draws such a
trace from preemption and return rates, as spot instances behave.  :func:`calibrate` measures the costs in a
real run's events; ``docs/simulator.md`` has the model and its agreement with real runs.
"""

from __future__ import annotations

import dataclasses
import gc
import heapq
import itertools
import math
import random
import statistics
from dataclasses import dataclass
from typing import NamedTuple, Optional

import numpy as np

from . import events
from ._result import RunResult
from .checks import integer, is_number
from .config import Heterogeneity, TrainConfig
from .data import TAIL_BATCHES_PER_PIPELINE, smoothed_step_time, tail_goes_faster
from .policies import SIMULATED_POLICY, names
from .policies import record as policy_record
from .schedule import ASYNC_SCHEDULES, build_plan, dry_run
from .scheduler import GroupScheduler
from .sync_rules import GLOBAL, PAIR, SERVED, STEP, gossip_roles

__all__ = [
    "SIM_POLICIES",
    "Calibration",
    "Costs",
    "Network",
    "calibrate",
    "ring_allreduce_seconds",
    "simulate",
    "spot_trace",
]

SIM_POLICIES = names(simulated=True)


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
    serve: float = 0.0
    """Seconds of its worker's time a server thread takes per request it serves (``ps``: the stage's worker of
    pipeline 0 hosts the stage's server; ``adpsgd``: a passive worker serves its exchanges): the thread shares
    its worker's process, so the pipeline's next step starts that much later (default 0)."""
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
        for name in ("step_overhead", "serve"):
            v = getattr(self, name)
            if not is_number(v) or not (0 <= v < math.inf):
                raise ValueError(f"costs.{name}: must be a finite number >= 0, got {v!r}")
            object.__setattr__(self, name, float(v))
        j = self.jitter
        if is_number(j):
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
    server_rtt: float = 1e-3
    """Seconds from a ``ps`` push or an ``adpsgd`` exchange request until its server thread starts on it (the
    request goes through the run's store, as the scheduler's do)."""

    def __post_init__(self):
        for name in ("bandwidth", "latency", "scheduler_rtt", "server_rtt"):
            v = getattr(self, name)
            if not is_number(v) or not v >= 0 or (name == "bandwidth" and v == 0):
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
    - heterogeneity: the run's, with the slowdowns each slowed worker
      showed: a step slowdown as its pipeline's median step against the
      unslowed pipelines' (a sleeping pipeline hands its core to the others on
      a busy machine), a compute slowdown as its compute against the mean of
      its stage's other workers (a sleeping process wakes late);
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
      the end of a member's wait for it;
    - ``ps`` and ``adpsgd``: the server round trip, the lower quartile of the
      exchanges (a push and pull of a pipeline that does not host the
      server, an active worker's exchange) less their transfers; and what a
      served request takes from the serving worker (``serve``): how much
      longer the serving pipelines' steps are (the host's under ``ps``, the
      passive ones' under ``adpsgd``, less the active ones' own exchanges)
      per request each of them serves in a step.  Slowed pipelines are left
      out of both sides (none left: 0).

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
    shown = _shown_heterogeneity(by_kind, hetero, forward, backward, config.pipelines, S)
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
    net = _network(by_kind, weight_bytes)
    net = dataclasses.replace(net, server_rtt=_server_rtt(by_kind, weight_bytes, net))
    costs = dataclasses.replace(costs, serve=_serve(by_kind, config, hetero, costs, net))
    return Calibration(costs, net, shown)


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
    """Whether the worker of record ``e`` ran under a compute slowdown (its compute spans are stretched)."""
    return hetero.compute_slowdown_of(e["pipeline"], e["stage"]) != 1.0


def _stage_mean(by_kind: dict, kind: str, s: int, hetero: Heterogeneity) -> float:
    """Mean span of ``kind`` on stage s: over the workers without a compute slowdown (all, each divided by its
    slowdown, when every one had one); the optimizer's over all.  A step slowdown stretches no compute span."""
    spans = [e for e in by_kind.get(kind, ()) if e.get("stage") == s]
    if kind == "optimizer":
        return _mean(_dur(e) for e in spans)
    plain = [_dur(e) for e in spans if not _slowed(hetero, e)]
    return _mean(plain) if plain else _mean(_dur(e) / hetero.compute_slowdown_of(e["pipeline"], s) for e in spans)


def _shown_heterogeneity(
    by_kind: dict, hetero: Heterogeneity, forward: list, backward: list, pipelines: int, stages: int
) -> Heterogeneity:
    """``hetero`` with the slowdowns each slowed worker showed: a compute slowdown as its compute against its stage's
    mean over the others; a step slowdown as its pipeline's median step against the unslowed pipelines' (on a
    machine with fewer cores than workers a sleeping pipeline hands its core to the others, which then step
    faster, so the ratio shown can exceed the factor asked for)."""
    shown: dict = {}
    for kind, base in (("forward", forward), ("backward", backward)):
        for e in by_kind.get(kind, ()):
            if _slowed(hetero, e):
                acc = shown.setdefault((e["pipeline"], e["stage"]), [0.0, 0.0])
                acc[0] += _dur(e)
                acc[1] += base[e["stage"]]
    changes = {}
    measured = {key: max(1.0, spent / base) for key, (spent, base) in shown.items() if base > 0}
    if measured:
        changes["compute_slowdown"] = measured
    # the run's own keys: a pipeline's key stretches its stage 0 alone, in the runtime and the simulator alike
    pipeline_of = {key: key if isinstance(key, int) else key[0] for key, f in hetero.slowdown.items() if f != 1.0}
    slowed = {key: p for key, p in pipeline_of.items() if p < pipelines}
    plain = [p for p in range(pipelines) if p not in slowed.values()]
    base = _step_intervals(by_kind, plain)
    if slowed and base:
        typical, steps = statistics.median(base), {}
        for p in set(slowed.values()):
            mine = _step_intervals(by_kind, [p])
            steps[p] = max(1.0, statistics.median(mine) / typical) if mine and typical > 0 else None
        step = {key: steps[p] for key, p in slowed.items() if steps[p] is not None}
        if step:
            changes["slowdown"] = step
    return dataclasses.replace(hetero, **changes) if changes else hetero


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
        for a, b in itertools.pairwise(opt):
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
        # ring all-reduces only: not a parameter server's pushes and pulls (its global sync included), not pairs
        if n >= 2 and e.get("stage") is not None and e.get("reason") not in (SERVED, PAIR) and "server" not in e:
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


def _server_rtt(by_kind: dict, weight_bytes: list, net: Network) -> float:
    """The lower quartile of ps and adpsgd exchanges less their transfers (both ways: a push then a pull; a
    pair's two directions at once); the default when the run had none."""
    extra = []
    for e in by_kind.get("sync", ()):
        reason, stage = e.get("reason"), e.get("stage")
        if stage is None or e.get("served"):
            continue
        transfer = weight_bytes[stage] / net.bandwidth + net.latency
        if reason == SERVED and e.get("pipeline") != 0:  # the host's own exchange stays in memory
            extra.append(_dur(e) - 2 * transfer)
        elif reason == PAIR:
            extra.append(_dur(e) - transfer)
    if not extra:
        return Network().server_rtt
    extra.sort()
    return max(0.0, extra[len(extra) // 4])


def _step_intervals(by_kind: dict, pipelines) -> list:
    """Seconds between a worker's consecutive optimizer steps of one epoch, over the workers of ``pipelines``."""
    ends: dict = {}
    for e in by_kind.get("optimizer", ()):
        if e["pipeline"] in pipelines:
            ends.setdefault((e["pipeline"], e["stage"], e.get("epoch")), []).append(e["end"])
    out = []
    for v in ends.values():
        v.sort()
        out += [b - a for a, b in itertools.pairwise(v)]
    return out


def _serve(by_kind: dict, config: TrainConfig, hetero: Heterogeneity, costs: Costs, net: Network) -> float:
    """Seconds a served request takes from the serving worker (see :func:`calibrate`); 0 for other policies.

    The serving pipelines' median step against the step the model gives a pipeline that serves nothing (the
    plan's dry run with ``costs``, the step overhead and its own exchange), per request served in a step."""
    D, S = config.pipelines, config.stages
    plain = [p for p in range(D) if all(hetero.slowdown_of(p, s) == 1.0 for s in range(S))]
    syncs = by_kind.get("sync", ())
    exchange = policy_record(config.policy).exchange
    if exchange == "server":
        # the host serves every pipeline's request of a round; the staleness bound holds every pipeline to the
        # host's rate over a run, so a host's step serves D requests
        serving, own = [0], 0.0
        rounds = lambda slow, fast: D
    elif exchange == "pairs":
        # nothing holds the active pipelines back: in one of its steps a passive worker serves its share of their
        # steps in that time
        actives, passives = gossip_roles(D)
        serving = [p for p in passives if p in plain]
        own = _mean(_dur(e) for e in syncs if e.get("reason") == PAIR and not e.get("served"))
        rounds = lambda slow, fast: len(actives) / max(1, len(passives)) * slow / fast
    else:
        return 0.0
    slow = _step_intervals(by_kind, serving)
    if not slow:
        return 0.0
    M = config.microbatches
    ends, _ = _step_finish(_step_plan(config), costs, net, (1.0,) * S, M)
    fast = max(ends) + costs.step_overhead + own  # a step of a pipeline that serves nothing
    slow = statistics.median(slow)
    return max(0.0, (slow - fast) / rounds(slow, fast))


def ring_allreduce_seconds(nbytes: float, members: int, net: Network) -> float:
    """Ring all-reduce: 2(n-1)/n x bytes / bandwidth plus 2(n-1) message latencies."""
    if members < 2:
        return 0.0
    return 2 * (members - 1) / members * nbytes / net.bandwidth + 2 * (members - 1) * net.latency


def _step_plan(config: TrainConfig):
    """The plan :func:`_step_finish` prices for ``config``: its schedule's plan with sends and receives, or for an
    asynchronous schedule ``((plan of 8 steps, 8), plan of 9 steps)`` (a step's span in the steady state)."""
    S, M = config.stages, config.microbatches
    if config.schedule not in ASYNC_SCHEDULES:
        return build_plan(config.schedule, S, M)
    every = config.resolved_update_every
    return (
        (build_plan(config.schedule, S, M, steps=8, update_every=every), 8),
        build_plan(config.schedule, S, M, steps=9, update_every=every),
    )


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


class _Proxy:
    """The convergence proxy: each worker (p, s) holds a point x (4 numbers) of the bowl ``mean(x ** 2)`` and
    steps ``x -= lr * (x + noise * N(0, 1))`` per step; groups average their members' points.

    ``mass`` is a worker's progress (1 + steps since the last global sync), the weight of ``weighting="progress"``.
    Replicas of a stage start equal.  A pipeline's loss is the mean of its stages' quadratics.  Workers are
    numbered ``p * stages + s`` (the rows of ``x``); the noise has its own random stream (drawn in blocks), apart
    from the timing's.

    A step is only logged (:meth:`learn`); every other method first takes the logged steps in, together and in
    their order (:meth:`settle`), so the points and the noise they drew are those of stepping at once.  The
    pairs of a round average together (:meth:`mix_pairs`).
    """

    __slots__ = ("a", "b", "buf", "gen", "i", "log", "mass", "pending", "stages", "x")

    def __init__(self, stages: int, pipelines: int, seed: int, lr: float, noise: float):
        self.stages, self.a, self.b = stages, 1.0 - lr, lr * noise
        self.gen = np.random.default_rng([seed, 1])
        init = self.gen.normal(0.0, 3.0, size=(stages, 4))
        self.x = init[np.arange(pipelines * stages) % stages]  # by worker: its point
        self.mass = np.ones(pipelines * stages)
        self.buf, self.i = np.empty(0), 0
        self.pending: dict = {}  # worker -> correction served to it (adpsgd's passive side) not yet applied
        self.log: list = []  # workers that stepped, in order, not yet taken in

    def learn(self, w: int) -> None:
        """Worker w stepped (taken in by the next :meth:`settle`)."""
        self.log.append(w)

    def _normals(self, k: int):
        """The noise stream's next k numbers."""
        parts = []
        while k:
            if self.i >= len(self.buf):
                self.buf, self.i = self.gen.standard_normal(1 << 16), 0
            take = min(k, len(self.buf) - self.i)
            parts.append(self.buf[self.i : self.i + take])
            self.i += take
            k -= take
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def settle(self) -> None:
        """Take the logged steps in, in their order: ``x = a x - b z`` with the stream's next 4 numbers z and one
        more step of progress each."""
        log = self.log
        if not log:
            return
        self.log = []
        n, a, b, x, mass = len(log), self.a, self.b, self.x, self.mass
        Z = self._normals(4 * n).reshape(n, 4)
        W = np.array(log)
        if len(set(log)) == n:  # each stepped once
            x[W] = a * x[W] - b * Z
            mass[W] += 1.0
            return
        # a worker's steps one after another: every worker's k-th one together
        order = np.argsort(W, kind="stable")
        ws = W[order]
        first = np.ones(n, dtype=bool)
        first[1:] = ws[1:] != ws[:-1]
        starts = np.flatnonzero(first)
        rank = np.empty(n, dtype=np.int64)
        rank[order] = np.arange(n) - np.repeat(starts, np.diff(np.append(starts, n)))
        for k in range(int(rank.max()) + 1):
            sel = rank == k
            rows = W[sel]
            x[rows] = a * x[rows] - b * Z[sel]
            mass[rows] += 1.0

    def mix_pairs(self, us: list, vs: list, by_progress: bool) -> None:
        """Each pair ``(us[i], vs[i])`` (distinct workers of one stage, each in one pair) averages, as :meth:`mix`
        does two."""
        self.settle()
        x, mass = self.x, self.mass
        U, V = np.array(us), np.array(vs)
        MU, MV = mass[U], mass[V]
        if by_progress:
            mean = (MU[:, None] * x[U] + MV[:, None] * x[V]) / (MU + MV)[:, None]
        else:
            mean = (x[U] + x[V]) / 2.0  # (1 x_u + 1 x_v) / 2
        x[U] = mean
        x[V] = mean
        mass[U] = mass[V] = (MU + MV) / 2

    def mix(self, workers: list, by_progress: bool, restart: bool) -> None:
        """``workers`` (of one stage) average (by progress or uniformly), in the order listed; a global sync
        (``restart``) resets their progress."""
        n = len(workers)
        if n == 2:
            self.mix_pairs(workers[:1], workers[1:], by_progress)
        elif n > 2:
            self.settle()
            x, mass = self.x, self.mass
            w = mass[workers].tolist() if by_progress else [1.0] * n
            total = sum(w)
            points = x[workers].tolist()
            mean = [sum(wi * pt[k] for wi, pt in zip(w, points, strict=True)) / total for k in range(4)]
            x[workers] = mean
            mass[workers] = sum(mass[workers].tolist()) / n
        if restart:
            self.mass[workers] = 1.0

    def pair(self, active: int, passive: int) -> None:
        """adpsgd: the active worker takes the pair's mean; the passive one is owed ``(x_a - x_p) / 2`` (folded in
        at its next step boundary, :meth:`fold`), so the sum over the replicas is conserved."""
        self.settle()
        xa, xp = self.x[active].tolist(), self.x[passive].tolist()
        half = [(xa[k] - xp[k]) / 2 for k in range(4)]
        self.x[active] = [xa[k] - half[k] for k in range(4)]
        owed = self.pending.get(passive)
        self.pending[passive] = half if owed is None else [owed[k] + half[k] for k in range(4)]

    def fold(self, w: int) -> None:
        owed = self.pending.pop(w, None)
        if owed is not None:
            self.settle()
            v = self.x[w].tolist()
            self.x[w] = [v[k] + owed[k] for k in range(4)]

    def copy(self, donor: int, p: int) -> None:
        """Pipeline p takes the donor's points and progress (a joiner's state)."""
        self.settle()
        S = self.stages
        self.x[p * S : p * S + S] = self.x[donor * S : donor * S + S]
        self.mass[p * S : p * S + S] = self.mass[donor * S : donor * S + S]

    def loss(self, p: int) -> float:
        self.settle()
        S = self.stages
        total = 0.0
        for v in self.x[p * S : p * S + S].tolist():
            total += v[0] * v[0] + v[1] * v[1] + v[2] * v[2] + v[3] * v[3]
        return total / (4 * S)


class _Ssp:
    """A stage's parameter server's stale synchronous parallel bookkeeping, kept incrementally: the decisions of
    :func:`sdpipe.sync_rules.ps_release` (which the runtime's server calls after every request) in O(1) per
    request where that function looks at every client (``tests/test_simulate.py`` holds the two to the same
    answers)."""

    __slots__ = ("at_global", "clock", "count", "held", "live", "seq", "slowest", "staleness")

    def __init__(self, clients, staleness: int):
        self.staleness = staleness
        self.live = set(clients)
        self.clock = {c: 0 for c in self.live}
        self.at_global: set = set()
        self.count = {0: len(self.live)}  # clock -> running clients (live, not at the global sync) at it
        self.slowest = 0  # the slowest running client's clock
        self.held: dict = {}  # clock -> [(arrival, client)] of the step-pulls held by the bound
        self.seq = 0

    def _advance(self) -> None:
        count, top = self.count, max(self.count, default=0)
        while self.slowest < top and not count.get(self.slowest):
            self.slowest += 1

    def push(self, client: int, kind: str) -> tuple:
        """Client ``client`` pushed (``kind`` "step" or "global") and waits for its pull: ``(the clients answered
        now in order, whether the global sync completed)``."""
        self.seq += 1
        k = self.clock[client]
        self.count[k] -= 1
        if kind == GLOBAL:
            self.at_global.add(client)
            if self.at_global >= self.live:
                replies = tuple(sorted(self.at_global))
                self.clock = dict.fromkeys(self.clock, 0)
                self.count, self.slowest, self.at_global, self.held = {0: len(self.live)}, 0, set(), {}
                return replies, True
            self._advance()
            return self._release(()), False
        self.clock[client] = k + 1
        self.count[k + 1] = self.count.get(k + 1, 0) + 1
        self._advance()
        return self._release(((self.seq, client),)), False

    def _release(self, new: tuple) -> tuple:
        """The held step-pulls within the bound now (in arrival order), then the new one if it is; the rest held."""
        bound, held = self.slowest + self.staleness, self.held
        out = []
        for k in [k for k in held if k <= bound]:
            out += held.pop(k)
        for arrival, c in new:
            k = self.clock[c]
            if k <= bound:
                out.append((arrival, c))
            else:
                held.setdefault(k, []).append((arrival, c))
        out.sort()
        return tuple(c for _, c in out)


class _Server:
    """A parameter server of one stage: its weights (the proxy's point), its link's two directions (each one
    transfer at a time), its clients' last pull and the time each is waiting since."""

    __slots__ = ("asked", "in_free", "out_free", "ssp", "w")

    def __init__(self, point: list, clients, staleness: int):
        self.w = list(point)
        self.in_free = self.out_free = 0.0
        self.ssp = _Ssp(clients, staleness)
        self.asked: dict = {}  # client -> (ready time, step, kind) of its pending pull


class _Simulation:
    """One simulated run: a timeline of ``(kind, data)`` events, one handler per kind, and the scheduler core's
    deadlines as ticks in between (see the module's docstring)."""

    def __init__(
        self, config: TrainConfig, *, costs: Costs, network: Network, steps: int, record: bool, lr: float, noise: float
    ):
        S, D, M = config.stages, config.pipelines, config.microbatches
        self.config, self.costs, self.net = config, costs, network
        self.S, self.D, self.steps, self.record, self.policy = S, D, steps, record, config.policy
        #: how the replicas meet (:attr:`sdpipe.policies.PolicyRecord.exchange`)
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
        self.proxy = _Proxy(S, D, config.seed, lr, noise)
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
        #: per pipeline, what each stage sleeps after its step for a step slowdown f (sdpipe._pace: f - 1 times its
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
                        self._apply(self.core.hurry(s, p, t))
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
        self._apply(self.core.tick(now))

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
                self._apply(self.core.lost(p, t))
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


def simulate(
    stages: int,
    pipelines: int,
    *,
    costs: Costs,
    policy: str = SIMULATED_POLICY,
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
    epochs: int = 1,
    sync_every: int = 1,
):
    """Simulate ``epochs`` epochs of ``steps`` steps' worth of batches per pipeline; returns a
    :class:`sdpipe.RunResult`.

    Under ``allreduce`` every pipeline takes ``steps`` steps per epoch; under the other policies the ``steps x
    pipelines`` batches of an epoch go to whichever pipeline asks next (work follows speed).  Every
    ``sync_every`` epochs, and after the last, the epoch ends with a global sync (none under ``none``).
    ``record=False`` keeps only the history
    (for very large simulations).  ``trace``: ``(seconds, "leave" | "join", pipeline)`` changes of the pipelines
    present (see :func:`spot_trace`); pipelines absent at the end are in ``result.lost``, and ``control``
    records ``left`` / ``joined`` mark the changes.
    """
    if policy not in SIM_POLICIES:
        raise ValueError(f"policy: {policy!r} is not one of {', '.join(SIM_POLICIES)} (the simulator's policies)")
    integer("stages", stages)
    integer("pipelines", pipelines)
    if not isinstance(network, Network):
        raise ValueError(f"network: must be a sdpipe.Network, got {type(network).__name__}")
    for name, v in (("lr", lr), ("noise", noise)):
        if not is_number(v) or not (0 <= v < math.inf):
            raise ValueError(f"{name}: must be a finite number >= 0, got {v!r}")
    if not isinstance(costs, Costs):
        raise ValueError(f"costs: must be a sdpipe.Costs, got {type(costs).__name__}")
    if costs.stages != stages:
        raise ValueError(f"costs: has {costs.stages} stages, the simulation {stages}")
    integer("steps", steps)
    config = TrainConfig(
        stages=stages,
        pipelines=pipelines,
        policy=policy,
        schedule=schedule,
        microbatches=microbatches,
        batch_size=batch_size,
        epochs=epochs,
        sync_every=sync_every,
        heterogeneity=heterogeneity,
        scheduler=scheduler,
        seed=seed,
    )
    changes = _check_trace(trace, pipelines, policy)
    sim = _Simulation(config, costs=costs, network=network, steps=steps, record=record, lr=lr, noise=noise)
    collecting = gc.isenabled()
    gc.disable()  # millions of records and no cycles among them: the cyclic collector would scan them over and over
    try:
        return sim.run(changes).result()
    finally:
        if collecting:
            gc.enable()


def _check_trace(trace, pipelines: int, policy: str) -> list:
    if trace is None:
        return []
    if not policy_record(policy).rejoin:
        listed = " and ".join(repr(n) for n in names(rejoin=True))
        raise ValueError(f"trace: pipelines join and leave under {listed}, not {policy!r}")
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
        if not is_number(v) or not (0 < v < math.inf):
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
