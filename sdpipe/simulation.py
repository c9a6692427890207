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

The result is a :class:`sdpipe.RunResult` with the same event records and
history fields as a real run (times are simulated seconds), so
``Dashboard(result)`` replays a simulated run.

Policies ``sdpipe``, ``allreduce`` and ``none``; one epoch ending with a
global sync.  :func:`calibrate` measures the costs in a real run's events;
``docs/simulator.md`` has the model and its agreement with real runs.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

from .config import Heterogeneity, TrainConfig
from .data import TAIL_BATCHES_PER_PIPELINE, leaves_tail, smoothed_step_time
from .scheduler import POLICY_PRESETS, GroupScheduler, Ready

__all__ = ["Calibration", "Costs", "Network", "calibrate", "simulate", "ring_allreduce_seconds", "SIM_POLICIES"]

SIM_POLICIES = ("sdpipe", "allreduce", "none")


def _seconds(name: str, values, n: int) -> tuple:
    try:
        if isinstance(values, (str, bytes)):
            raise TypeError
        values = tuple(float(v) for v in values)
    except (TypeError, ValueError):
        raise ValueError(f"costs.{name}: needs {n} finite numbers >= 0 (one per stage), got {values!r}") from None
    if len(values) != n or any(not (v >= 0) or math.isinf(v) for v in values):
        raise ValueError(f"costs.{name}: needs {n} finite numbers >= 0 (one per stage), got {values!r}")
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
        object.__setattr__(self, "forward", _seconds("forward", self.forward, S))
        object.__setattr__(self, "backward", _seconds("backward", self.backward, S))
        object.__setattr__(self, "optimizer", _seconds("optimizer", self.optimizer or [0.0] * S, S))
        object.__setattr__(self, "activation_bytes", _seconds("activation_bytes", self.activation_bytes or [0.0] * max(S - 1, 0), max(S - 1, 0)))
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
                raise ValueError(f"network.{name}: must be a number {'> 0' if name == 'bandwidth' else '>= 0'}, got {v!r}")


def _mean(values, default=0.0) -> float:
    values = list(values)
    return sum(values) / len(values) if values else default


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
        raise ValueError(f"result: must be a sdpipe.RunResult of a real run (run.result()), got {type(result).__name__}")
    config = result.config
    S = config.stages
    hetero = config.heterogeneity or Heterogeneity()
    # the first epoch warms up (process groups, caches): measure the later ones when there are
    epoch_of = {(e["pipeline"], e["stage"], e["step"]): e.get("epoch", 0)
                for e in result.events if e.get("kind") == "optimizer"}
    warm = max(epoch_of.values(), default=0) > 0
    by_kind: dict = {}
    for e in result.events:
        if warm and e.get("step") is not None and e.get("pipeline") is not None and \
                epoch_of.get((e["pipeline"], e.get("stage"), e["step"]), 1) == 0:
            continue
        by_kind.setdefault(e.get("kind"), []).append(e)

    def dur(e):
        return e["end"] - e["start"]

    def slowed(e):
        return hetero.slowdown_of(e["pipeline"], e["stage"]) != 1.0

    def stage_mean(kind, s):
        spans = [e for e in by_kind.get(kind, ()) if e.get("stage") == s]
        if kind == "optimizer":
            return _mean(dur(e) for e in spans)
        plain = [dur(e) for e in spans if not slowed(e)]
        return _mean(plain) if plain else _mean(dur(e) / hetero.slowdown_of(e["pipeline"], s) for e in spans)

    forward = [stage_mean("forward", s) for s in range(S)]
    backward = [stage_mean("backward", s) for s in range(S)]
    optimizer = [stage_mean("optimizer", s) for s in range(S)]
    # the slowdown each slowed worker showed: its compute against its stage's unslowed mean
    shown: dict = {}
    for kind, base in (("forward", forward), ("backward", backward)):
        for e in by_kind.get(kind, ()):
            if slowed(e):
                acc = shown.setdefault((e["pipeline"], e["stage"]), [0.0, 0.0])
                acc[0] += dur(e)
                acc[1] += base[e["stage"]]
    measured = {key: max(1.0, spent / base) for key, (spent, base) in shown.items() if base > 0}
    shown_hetero = dataclasses.replace(hetero, slowdown=measured) if measured else hetero
    weight_bytes, activation_bytes = [0.0] * S, [0.0] * max(S - 1, 0)
    for e in by_kind.get("stage", ()):
        weight_bytes[e["stage"]] = float(e["weight_bytes"])
        if e["stage"] < S - 1:
            activation_bytes[e["stage"]] = float(e["activation_bytes"])

    # jitter: a worker's compute per step relative to its mean, pooled per stage
    compute: dict = {}
    for kind in ("forward", "backward"):
        for e in by_kind.get(kind, ()):
            key = (e["pipeline"], e["stage"], e["step"])
            compute[key] = compute.get(key, 0.0) + dur(e)
    per_worker: dict = {}
    for (p, st, _), v in compute.items():
        per_worker.setdefault((p, st), []).append(v)
    rel: dict = {s: [] for s in range(S)}
    for (_, s), vals in per_worker.items():
        m = _mean(vals)
        if m > 0:
            rel[s] += [v / m for v in vals]
    jitter = [math.sqrt(_mean((r - 1.0) ** 2 for r in rel[s])) if len(rel[s]) > 1 else 0.0 for s in range(S)]

    # untraced time per step on stage 0: between consecutive optimizer ends, minus every span inside
    covered = ("forward", "backward", "send", "recv", "wait", "sync", "straggle", "pause", "eval", "optimizer")
    untraced = []
    for p in range(config.pipelines):
        opt = sorted((e for e in by_kind.get("optimizer", ()) if e["pipeline"] == p and e["stage"] == 0),
                     key=lambda e: e["start"])
        spans = sorted(((e["start"], e["end"]) for k in covered for e in by_kind.get(k, ())
                        if e.get("pipeline") == p and e.get("stage") == 0), key=lambda x: x[0])
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
    costs = Costs(forward=forward, backward=backward, optimizer=optimizer, weight_bytes=weight_bytes,
                  activation_bytes=activation_bytes, step_overhead=_mean(untraced), jitter=jitter)

    default = Network()
    sends = [dur(e) for e in by_kind.get("send", ())]
    latency = _mean(sends, default.latency)
    # a collective's span also holds the wait for members that arrive late: the lower quartile
    # of each (stage, size) is the transfer
    spans: dict = {}
    for e in by_kind.get("sync", ()):
        n = len(e.get("group") or ())
        if n >= 2 and e.get("stage") is not None and e.get("reason") not in ("ps", "pair"):
            spans.setdefault((e["stage"], n), []).append(dur(e))
    xs = []
    for (stage, n), vals in spans.items():
        vals.sort()
        xs.append((2 * (n - 1) / n * weight_bytes[stage], vals[len(vals) // 4] - 2 * (n - 1) * latency))
    bandwidth = default.bandwidth
    if xs:
        num, den = sum(x * x for x, _ in xs), sum(x * y for x, y in xs)
        bandwidth = num / den if den > 0 and num > 0 else 1e15  # all latency: as good as unlimited
    decided = {(e["stage"], e["round"]): e["end"] for e in by_kind.get("group", ())}
    trips = [max(0.0, e["end"] - decided[(e["stage"], e["round"])]) for e in by_kind.get("wait", ())
             if e.get("what") == "group" and (e.get("stage"), e.get("round")) in decided]
    rtt = 2 * _mean(trips) if trips else default.scheduler_rtt
    return Calibration(costs, Network(bandwidth=bandwidth, latency=latency, scheduler_rtt=rtt), shown_hetero)


def ring_allreduce_seconds(nbytes: float, members: int, net: Network) -> float:
    """Ring all-reduce: 2(n-1)/n x bytes / bandwidth plus 2(n-1) message latencies."""
    if members < 2:
        return 0.0
    return 2 * (members - 1) / members * nbytes / net.bandwidth + 2 * (members - 1) * net.latency


@dataclass
class _Pipe:
    step: int = 0
    synced: dict = field(default_factory=dict)  # stage -> time its sync of this step ended
    last_start: Optional[float] = None
    step_time: Optional[float] = None  # recent seconds per step, as the runtime's dispenser keeps it
    done: bool = False


def simulate(stages: int, pipelines: int, *, costs: Costs, policy: str = "sdpipe", schedule: str = "1f1b",
             microbatches: int = 4, batch_size: int = 32, steps: int = 100, heterogeneity: Optional[Heterogeneity] = None,
             network: Network = Network(), scheduler=None, seed: int = 0, record: bool = True, lr: float = 0.1,
             noise: float = 1.0):
    """Simulate ``steps`` steps' worth of batches per pipeline; returns a :class:`sdpipe.RunResult`.

    Under ``allreduce`` every pipeline takes ``steps`` steps; under ``sdpipe``
    and ``none`` the ``steps x pipelines`` batches go to whichever pipeline
    asks next (work follows speed).  ``record=False`` keeps only the history
    (for very large simulations).
    """
    from ._runtime import RunResult
    from .schedule import build_plan, dry_run

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
    config = TrainConfig(stages=stages, pipelines=pipelines, policy=policy, schedule=schedule, microbatches=microbatches,
                         batch_size=batch_size, epochs=1, heterogeneity=heterogeneity, scheduler=scheduler, seed=seed)
    hetero = heterogeneity or Heterogeneity()
    S, D, M = stages, pipelines, microbatches
    rng = random.Random(seed)
    plan = build_plan(schedule, S, M)  # with its sends and receives
    net = network

    finish_cache: dict = {}
    jitter_sigma = [math.sqrt(math.log1p(j ** 2)) for j in costs.jitter]  # log-normal, mean 1, spread costs.jitter

    def stage_finish(p: int) -> tuple:
        """(per-stage finish times of one step of pipeline p, per-stage compute seconds)."""
        k = tuple(hetero.slowdown_of(p, s) for s in range(S))
        if k not in finish_cache:
            def cost(a):
                if a.op == "F":
                    return costs.forward[a.stage] * k[a.stage]
                if a.op == "B":
                    return costs.backward[a.stage] * k[a.stage]
                if a.op in ("SF", "SB"):
                    boundary = a.stage if a.op == "SF" else a.stage - 1
                    return costs.activation_bytes[boundary] / net.bandwidth + net.latency
                return 0.0
            run = dry_run(plan, cost)
            # a stage's step ends when its own actions are done and the receives of what it sent
            # completed (the runtime waits for its sends at the end of the step)
            ends = [max((e for a, _, e in run.spans if a.stage == s or (a.op == "RF" and a.stage == s + 1)
                         or (a.op == "RB" and a.stage == s - 1)), default=0.0) + costs.optimizer[s] for s in range(S)]
            busy = [M * (costs.forward[s] + costs.backward[s]) * k[s] for s in range(S)]
            finish_cache[k] = (ends, busy)
        return finish_cache[k]

    sched_policy = config.scheduler_policy() if policy != "none" else POLICY_PRESETS["none"]
    core = GroupScheduler(S, D, sched_policy) if policy != "none" else None
    total = steps * D
    taken = 0
    pipes = [_Pipe() for _ in range(D)]
    events: list = []
    heap: list = []
    seq = 0
    init = {s: [rng.gauss(0, 3) for _ in range(4)] for s in range(S)}  # convergence proxy: replicas start equal
    x = {(p, s): list(init[s]) for p in range(D) for s in range(S)}
    mass = {(p, s): 1.0 for p in range(D) for s in range(S)}  # weighting="progress": 1 + steps since the global sync

    def push(t, kind, data):
        nonlocal seq
        heapq.heappush(heap, (t, seq, kind, data))
        seq += 1

    def span(kind, p, s, step, start, end, **extra):
        if record:
            rec = {"kind": kind, "pipeline": p, "stage": s, "step": step, "microbatch": None, "start": start, "end": end}
            rec.update(extra)
            events.append(rec)

    def leave_tail(p: int) -> bool:
        """The runtime's epoch-tail rule, on the simulated pipelines still in the epoch."""
        others = [q.step_time for i, q in enumerate(pipes) if i != p and not q.done and q.step_time is not None]
        return leaves_tail(pipes[p].step_time, others, total - taken)

    def next_batch(p: int, t: float) -> bool:
        nonlocal taken
        pipe = pipes[p]
        if pipe.last_start is not None:
            dt = t - pipe.last_start
            pipe.step_time = smoothed_step_time(pipe.step_time, dt)
        pipe.last_start = t
        if policy == "allreduce":
            return pipe.step < steps
        remaining = total - taken
        if remaining > 0 and not (remaining <= TAIL_BATCHES_PER_PIPELINE * D and leave_tail(p)):
            taken += 1
            return True
        pipe.done = True
        return False

    def start_step(p: int, t: float) -> None:
        pipe = pipes[p]
        if not next_batch(p, t):
            if core is not None:  # the epoch ends with a global sync
                for s in range(S):
                    ready(p, s, t, pipe.step, global_sync=True)
            return
        pipe.synced = {}
        ends, busy = stage_finish(p)
        scale = [rng.lognormvariate(-sg ** 2 / 2, sg) if sg > 0 else 1.0 for sg in jitter_sigma]
        extra = costs.step_overhead
        if hetero.straggle_prob > 0:
            hits = [rng.random() < hetero.straggle_prob for _ in range(S)]
            extra += hetero.straggle_delay if any(hits) else 0.0
        for s in range(S):
            push(t + extra + ends[s] + busy[s] * (scale[s] - 1.0), "ready", (p, s, pipe.step))
            f = M * costs.forward[s] * hetero.slowdown_of(p, s) * scale[s]
            span("forward", p, s, pipe.step, t + extra, t + extra + f)
            span("backward", p, s, pipe.step, t + extra + f, t + extra + busy[s] * scale[s])

    def learn(p: int, s: int) -> None:
        v = x[(p, s)]
        mass[(p, s)] += 1.0
        for i in range(len(v)):
            v[i] -= lr * (v[i] + noise * rng.gauss(0, 1))

    def ready(p: int, s: int, t: float, step: int, global_sync: bool = False) -> None:
        if not global_sync:
            learn(p, s)
            span("optimizer", p, s, step, t, t, epoch=0, **({"loss": _loss(p)} if s == S - 1 else {}))
        if core is None:
            synced(p, s, t, step)
            return
        apply(t, core.handle(s, Ready(p, step, t, global_sync)))

    def apply(t: float, decisions) -> None:
        for g in decisions:
            members = list(g.members)
            delay = max(hetero.link_delay_of(m, g.stage) for m in members)
            rtt = 0.0 if policy == "allreduce" else net.scheduler_rtt  # allreduce needs no scheduler
            end = g.closed + rtt + delay + ring_allreduce_seconds(costs.weight_bytes[g.stage], len(members), net)
            if len(members) > 1:
                w = {m: mass[(m, g.stage)] if core.policy.weighting == "progress" else 1.0 for m in members}
                mean = [sum(w[m] * x[(m, g.stage)][i] for m in members) / sum(w.values())
                        for i in range(len(x[(members[0], g.stage)]))]
                shared = sum(mass[(m, g.stage)] for m in members) / len(members)
                for m in members:
                    x[(m, g.stage)] = list(mean)
                    mass[(m, g.stage)] = shared
            if g.reason == "global":
                for m in members:
                    mass[(m, g.stage)] = 1.0
            if record:
                events.append({"kind": "group", "pipeline": None, "stage": g.stage, "step": None, "microbatch": None,
                               "start": g.opened, "end": g.closed, "round": g.round, "group": members, "reason": g.reason,
                               "wait": g.wait, "connected": g.connected})
            for m in members:
                step = pipes[m].step
                span("sync", m, g.stage, step, g.closed, end, group=members, round=g.round, reason=g.reason)
                if g.reason != "global":
                    push(end, "synced", (m, g.stage, step))

    def synced(p: int, s: int, t: float, step: int) -> None:
        pipe = pipes[p]
        pipe.synced[s] = t
        if len(pipe.synced) == S:
            pipe.step += 1
            push(max(pipe.synced.values()), "start", p)

    def _loss(p: int) -> float:
        return sum(sum(v * v for v in x[(p, s)]) / len(x[(p, s)]) for s in range(S)) / S

    for p in range(D):
        push(0.0, "start", p)
    now = 0.0
    while heap:
        t = heap[0][0]
        deadline = core.next_deadline() if core is not None else None
        if deadline is not None and deadline <= t:
            now = deadline
            apply(now, core.tick(now))
            continue
        now, _, kind, data = heapq.heappop(heap)
        if kind == "start":
            start_step(data, now)
        elif kind == "ready":
            p, s, step = data
            ready(p, s, now, step)
        elif kind == "synced":
            p, s, step = data
            synced(p, s, now, step)
    end = now
    history = []
    for p in range(D):
        samples = pipes[p].step * batch_size
        metrics = {"epoch": 0, "pipeline": p, "loss": _loss(p), "samples": samples, "share": samples / (total * batch_size),
                   "samples_per_s": samples / end if end > 0 else 0.0, "steps": pipes[p].step, "complete": True}
        history.append(metrics)
        if record:
            events.append({"kind": "epoch", "pipeline": p, "stage": S - 1, "step": pipes[p].step, "microbatch": None,
                           "start": end, "end": end, "metrics": metrics})
    return RunResult(models=[], history=history, events=events, config=config, wall_time=end, stopped=False,
                     steps={p: pipes[p].step for p in range(D)})
