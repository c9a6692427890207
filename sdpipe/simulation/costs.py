"""What a simulated run costs: per-stage compute and bytes (:class:`Costs`), the network (:class:`Network`), and a
ring all-reduce's time."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from sdpipe.config import Heterogeneity, TrainConfig
from sdpipe.core.checks import is_number
from sdpipe.core.schedule import ASYNC_SCHEDULES, build_plan, dry_run

__all__ = [
    "ALLREDUCE_MODELS",
    "Costs",
    "Network",
    "allreduce_seconds",
    "ring_allreduce_seconds",
    "tree_allreduce_seconds",
]

#: how a group's all-reduce can be priced (Network.allreduce)
ALLREDUCE_MODELS = ("best", "ring")


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
    cpu: tuple = ()
    """CPU seconds one step of each stage's worker asks of the cores, per stage: its compute and the rest of its
    process (the Python between its actions, its threads).  Used by ``simulate(cores=...)``, where the workers
    share the machine's cores (default: the compute, ``microbatches x (forward + backward) + optimizer``)."""
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
        if self.cpu != ():
            object.__setattr__(self, "cpu", _seconds("cpu", self.cpu, S))
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
        from sdpipe.simulation.calibrate import calibrate  # calibrate builds Costs

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
    allreduce: str = "best"
    """How a group's all-reduce is priced: "ring" (a flat ring: 2 (n - 1) messages one after another) or "best"
    (the cheaper of the ring and a pipelined binary tree, 2 log2 n messages deep, as NCCL chooses between
    them: a group of thousands is latency-bound in a ring)."""

    def __post_init__(self):
        if self.allreduce not in ALLREDUCE_MODELS:
            raise ValueError(f"network.allreduce: {self.allreduce!r} is not one of {', '.join(ALLREDUCE_MODELS)}")
        for name in ("bandwidth", "latency", "scheduler_rtt", "server_rtt"):
            v = getattr(self, name)
            if not is_number(v) or not v >= 0 or (name == "bandwidth" and v == 0):
                bound = "> 0" if name == "bandwidth" else ">= 0"
                raise ValueError(f"network.{name}: must be a number {bound}, got {v!r}")


def ring_allreduce_seconds(nbytes: float, members: int, net: Network) -> float:
    """Ring all-reduce: 2(n-1)/n x bytes / bandwidth plus 2(n-1) message latencies."""
    if members < 2:
        return 0.0
    return 2 * (members - 1) / members * nbytes / net.bandwidth + 2 * (members - 1) * net.latency


def tree_allreduce_seconds(nbytes: float, members: int, net: Network) -> float:
    """Pipelined binary-tree all-reduce (a reduce up the tree and a broadcast down it, the message pipelined
    through): 2 x bytes / bandwidth plus 2 ceil(log2 n) message latencies."""
    if members < 2:
        return 0.0
    return 2 * nbytes / net.bandwidth + 2 * math.ceil(math.log2(members)) * net.latency


def allreduce_seconds(nbytes: float, members: int, net: Network) -> float:
    """A group's all-reduce as ``net.allreduce`` prices it: the ring, or the cheaper of the ring and the tree."""
    ring = ring_allreduce_seconds(nbytes, members, net)
    return ring if net.allreduce == "ring" else min(ring, tree_allreduce_seconds(nbytes, members, net))


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


def _action_cost(costs: Costs, net: Network, slowdown: tuple):
    """Seconds of one action of a plan: a forward's or backward's (slowed), a send's transfer."""

    def cost(a):
        if a.op == "F":
            return costs.forward[a.stage] * slowdown[a.stage]
        if a.op == "B":
            return costs.backward[a.stage] * slowdown[a.stage]
        if a.op in ("SF", "SB"):
            boundary = a.stage if a.op == "SF" else a.stage - 1
            return costs.activation_bytes[boundary] / net.bandwidth + net.latency
        return 0.0

    return cost


def _computing(plan, costs: Costs, net: Network, slowdown: tuple, ends: list) -> list:
    """Per stage, the (start, end) seconds from a synchronous step's start in which its worker computes: each
    forward and backward without the sleep a compute slowdown adds after it (the runtime's), the optimizer at the
    step's end; the step's overhead before its start on stage 0."""
    out = [[] for _ in slowdown]
    for a, st, en in dry_run(plan, _action_cost(costs, net, slowdown)).spans:
        if a.op in ("F", "B"):
            out[a.stage].append((st, st + (en - st) / slowdown[a.stage]))
    for s, end in enumerate(ends):
        if costs.optimizer[s] > 0:
            out[s].append((end - costs.optimizer[s], end))
    if costs.step_overhead > 0:
        out[0].append((-costs.step_overhead, 0.0))
    return out


def _step_finish(plan, costs: Costs, net: Network, slowdown: tuple, microbatches: int) -> tuple:
    """(per-stage finish times of one step, per-stage compute seconds) of a pipeline slowed by ``slowdown``
    (one factor per stage), from the dry run of ``plan``.

    An asynchronous schedule's ``plan`` is ``((plan of n steps, n), plan of n + 1 steps)``: a step of the
    steady state lasts the difference of their makespans on every stage (no fill, no flush; the warm-up and
    drain of each epoch are left out), plus its updates' optimizer time.  A stage's updates within a step
    count as one ready signal at its end."""

    cost = _action_cost(costs, net, slowdown)
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


def stretch_compute(costs: Costs, factor: float) -> Costs:
    """``costs`` with every part a worker computes (forward, backward, optimizer, the step's overhead, a served
    request) taking ``factor`` times as long."""
    return dataclasses.replace(
        costs,
        forward=[v * factor for v in costs.forward],
        backward=[v * factor for v in costs.backward],
        optimizer=[v * factor for v in costs.optimizer],
        step_overhead=costs.step_overhead * factor,
        serve=costs.serve * factor,
    )


#: how close a shared simulation's stretch must come to the one its timeline asks for (relative), in how many runs
SHARE_TOLERANCE, SHARE_RUNS = 0.01, 12


def share_cores(run, costs: Costs, cores: float, config: TrainConfig, network: Network):
    """The result of ``run(stretch, record)`` (a simulation with every compute ``stretch`` times as long) whose
    stretch is the one its own timeline asks for on ``cores`` cores.

    The kernel shares the cores evenly among the threads that want one: at an instant when n workers compute and
    the workers' other threads (``costs.cpu`` beyond their compute: the Python between actions, the Dask worker's
    loop, an averaging's thread) keep b cores busy on average, each computing worker runs at ``cores / (n + b)``
    of a core when that is below 1.  Its compute, over its time, is stretched by the mean of
    ``max(1, (n + b) / cores)`` over the instants it computes; a simulation stretched by k has compute at other
    instants than one stretched by k', so the stretch is found as a fixed point (a few runs).  The instants come
    from each step's start in the records and the schedule's dry run (when each stage computes within a step); an
    asynchronous schedule, whose steady state has no such plan here, is taken as computing evenly over its
    steps (the demand's mean: the stretch at which the workers' CPU over the simulated time comes to ``cores``).
    """
    S, M = costs.stages, config.microbatches
    own = [M * (costs.forward[s] + costs.backward[s]) + costs.optimizer[s] for s in range(S)]
    own[0] += costs.step_overhead
    cpu = costs.cpu or tuple(own)
    if config.schedule in ASYNC_SCHEDULES:
        return _share_evenly(run, cpu, cores)
    extra = [max(0.0, cpu[s] - own[s]) for s in range(S)]  # per step, beyond its compute
    plan = _step_plan(config)
    hetero = config.heterogeneity or Heterogeneity()
    stretch, lo, hi = 1.0, 1.0, math.inf  # the fixed point lies in [lo, hi]
    for _ in range(SHARE_RUNS):
        result = run(stretch, True)
        stretched = stretch_compute(costs, stretch)
        wanted = _wanted_stretch(result, stretched, network, plan, hetero, extra, cores)
        if abs(wanted - stretch) <= SHARE_TOLERANCE * stretch:
            break
        lo, hi = (max(lo, stretch), hi) if wanted > stretch else (lo, min(hi, stretch))
        # the stretch the timeline asks for, unless it leaves the bracket (a timeline that asks for less the more
        # it is stretched swings about its fixed point): then the bracket's middle
        stretch = wanted if lo < wanted < hi else (lo + hi) / 2
    return result


def _wanted_stretch(result, costs: Costs, net: Network, plan, hetero, extra: list, cores: float) -> float:
    """The mean of ``max(1, (n + b) / cores)`` over the computing instants of ``result``'s workers (see
    :func:`share_cores`): n the workers computing at the instant, b the cores their other threads keep busy then.
    A worker's other threads work while its own step runs (the Python between its actions, its sends' and
    receives' threads, its records): its ``extra`` CPU seconds of a step are spread over that step (from its start
    to its end, not the waits for other pipelines after it nor a slowdown's sleep)."""
    S = costs.stages
    offsets: dict = {}
    marks = []  # (time, change of n, change of b)
    for e in result.events:
        if e["kind"] != "forward" or e.get("microbatch") is not None:
            continue
        p, s = e["pipeline"], e["stage"]
        k = tuple(hetero.compute_slowdown_of(p, x) for x in range(S))
        if k not in offsets:
            ends, _ = _step_finish(plan, costs, net, k, 0)
            offsets[k] = (_computing(plan, costs, net, k, ends), ends)
        computing, ends = offsets[k]
        begin = e["start"]
        for a, b in computing[s]:
            marks.append((begin + a, 1, 0.0))
            marks.append((begin + b, -1, 0.0))
        if extra[s] > 0 and ends[s] > 0:
            rate = extra[s] / ends[s]
            marks.append((begin, 0, rate))
            marks.append((begin + ends[s], 0, -rate))
    if not any(dn for _, dn, _ in marks) or result.wall_time <= 0:
        return 1.0
    marks.sort()
    n, b, last, num, den = 0, 0.0, marks[0][0], 0.0, 0.0
    for t, dn, db in marks:
        if n > 0 and t > last:
            num += n * (t - last) * max(1.0, (n + b) / cores)
            den += n * (t - last)
        n, b, last = n + dn, b + db, t
    return num / den if den > 0 else 1.0


def _share_evenly(run, cpu, cores: float):
    """:func:`share_cores` for an asynchronous schedule: the stretch at which the workers' CPU per step over the
    simulated time comes to ``cores`` (1 when it fits), found by the secant method (the simulated time grows about
    linearly in the stretch)."""
    per_step = sum(cpu)
    result = run(1.0, False)
    target = per_step * sum(result.steps.values()) / cores
    if result.wall_time >= target or target <= 0:
        return result
    k0, t0 = 1.0, result.wall_time
    k1 = target / t0  # T(k) <= k T(1): the stretch is at least this
    for _ in range(SHARE_RUNS):
        result = run(k1, False)
        t1 = result.wall_time
        target = per_step * sum(result.steps.values()) / cores
        if abs(t1 - target) <= SHARE_TOLERANCE * target or t1 == t0:
            break
        k0, t0, k1 = k1, t1, max(1.0, k1 + (target - t1) * (k1 - k0) / (t1 - t0))
    return result
