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

This is the first part of the simulator: policies ``sdpipe``, ``allreduce``
and ``none``; one epoch ending with a global sync.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field
from typing import Optional

from .config import Heterogeneity, TrainConfig
from .scheduler import POLICY_PRESETS, GroupScheduler, Ready

__all__ = ["Costs", "Network", "simulate", "ring_allreduce_seconds", "SIM_POLICIES"]

SIM_POLICIES = ("sdpipe", "allreduce", "none")


def _seconds(name: str, values, n: int) -> tuple:
    values = tuple(float(v) for v in values)
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

    def __post_init__(self):
        S = len(self.forward)
        if S < 1:
            raise ValueError("costs.forward: needs one number per stage")
        object.__setattr__(self, "forward", _seconds("forward", self.forward, S))
        object.__setattr__(self, "backward", _seconds("backward", self.backward, S))
        object.__setattr__(self, "optimizer", _seconds("optimizer", self.optimizer or [0.0] * S, S))
        object.__setattr__(self, "activation_bytes", _seconds("activation_bytes", self.activation_bytes or [0.0] * max(S - 1, 0), max(S - 1, 0)))
        object.__setattr__(self, "weight_bytes", _seconds("weight_bytes", self.weight_bytes or [0.0] * S, S))

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


def ring_allreduce_seconds(nbytes: float, members: int, net: Network) -> float:
    """Ring all-reduce: 2(n-1)/n x bytes / bandwidth plus 2(n-1) message latencies."""
    if members < 2:
        return 0.0
    return 2 * (members - 1) / members * nbytes / net.bandwidth + 2 * (members - 1) * net.latency


@dataclass
class _Pipe:
    step: int = 0
    synced: dict = field(default_factory=dict)  # stage -> time its sync of this step ended


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
            ends = [max((e for a, _, e in run.spans if a.stage == s), default=0.0) + costs.optimizer[s] for s in range(S)]
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

    def push(t, kind, data):
        nonlocal seq
        heapq.heappush(heap, (t, seq, kind, data))
        seq += 1

    def span(kind, p, s, step, start, end, **extra):
        if record:
            rec = {"kind": kind, "pipeline": p, "stage": s, "step": step, "microbatch": None, "start": start, "end": end}
            rec.update(extra)
            events.append(rec)

    def next_batch(p: int) -> bool:
        nonlocal taken
        if policy == "allreduce":
            return pipes[p].step < steps
        if taken < total:
            taken += 1
            return True
        return False

    def start_step(p: int, t: float) -> None:
        pipe = pipes[p]
        if not next_batch(p):
            if core is not None:  # the epoch ends with a global sync
                for s in range(S):
                    ready(p, s, t, pipe.step, global_sync=True)
            return
        pipe.synced = {}
        ends, busy = stage_finish(p)
        extra = 0.0
        if hetero.straggle_prob > 0:
            hits = [rng.random() < hetero.straggle_prob for _ in range(S)]
            extra = hetero.straggle_delay if any(hits) else 0.0
        for s in range(S):
            push(t + extra + ends[s], "ready", (p, s, pipe.step))
            f = M * costs.forward[s] * hetero.slowdown_of(p, s)
            span("forward", p, s, pipe.step, t + extra, t + extra + f)
            span("backward", p, s, pipe.step, t + extra + f, t + extra + busy[s])

    def learn(p: int, s: int) -> None:
        v = x[(p, s)]
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
            end = g.closed + net.scheduler_rtt + delay + ring_allreduce_seconds(costs.weight_bytes[g.stage], len(members), net)
            if len(members) > 1:
                mean = [sum(x[(m, g.stage)][i] for m in members) / len(members) for i in range(len(x[(members[0], g.stage)]))]
                for m in members:
                    x[(m, g.stage)] = list(mean)
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
