"""Costs and a network measured from a real run's event records (:func:`calibrate`)."""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from typing import NamedTuple, Optional

from sdpipe.config import Heterogeneity, TrainConfig
from sdpipe.core.policies import record as policy_record
from sdpipe.core.sync_rules import PAIR, SERVED, gossip_roles
from sdpipe.simulation.costs import Costs, Network, _step_finish, _step_plan

__all__ = ["Calibration", "calibrate", "cores_of"]


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


def calibrate(result, shared: bool = False) -> Calibration:
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

    ``shared=True``: costs for ``simulate(cores=...)``, where the workers share
    the machine's cores (:func:`cores_of` says how many the run's had).  The
    forward, backward and optimizer costs are then the spans' CPU seconds on
    the worker's training thread (its work alone: the spans' wall time also
    holds the waits for a core), the step overhead the thread's CPU per step
    on stage 0 beyond them, ``costs.cpu`` each stage's whole process's CPU
    per step (its other threads too), and the heterogeneity the run's own (a
    sleeping pipeline's gift of its core to the others is in the model).  On
    the later stages the training thread's CPU per step beyond its compute
    (its receives and sends, the Python between them: 3-5 ms a step on the
    4 x 2 digits CNN) is on the pipeline's path as much as the compute is, so
    it goes into their forward and backward costs, an equal share of it to
    each; a stage's process CPU beyond its training thread (the sends'
    threads, the Dask worker's loop, the records) stays the load beside it.
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
    if not shared:
        return Calibration(costs, net, shown)
    return Calibration(_cpu_costs(by_kind, costs, config), net, hetero)


def _cpu_costs(by_kind: dict, costs: Costs, config: TrainConfig) -> Costs:
    """``costs`` (from wall times) with a worker's own work in CPU seconds (see :func:`calibrate`'s ``shared``)."""
    S, M = config.stages, config.microbatches
    spans = {k: [e for e in by_kind.get(k, ()) if "cpu" in e] for k in ("forward", "backward", "optimizer")}
    if not spans["forward"]:
        raise ValueError(
            "result: its records hold no CPU times (a simulated run, or a run of an earlier sdpipe): "
            "calibrate it with shared=False"
        )
    forward, backward, optimizer = (
        [_mean(e["cpu"] for e in spans[k] if e["stage"] == s) for s in range(S)]
        for k in ("forward", "backward", "optimizer")
    )
    own = [M * (forward[s] + backward[s]) + optimizer[s] for s in range(S)]
    # per step: consecutive updates of one epoch only (an epoch's end holds the evaluation and the global sync)
    after = {(e["pipeline"], e["stage"], e["step"] + 1, e["epoch"]) for e in spans["optimizer"]}
    steps = [e for e in spans["optimizer"] if (e["pipeline"], e["stage"], e["step"], e["epoch"]) in after]
    thread = [_mean((e["step_cpu"] for e in steps if e["stage"] == s), own[s]) for s in range(S)]
    process = [_mean((e["process_cpu"] for e in steps if e["stage"] == s), own[s]) for s in range(S)]
    # the later stages' training thread beyond its compute, a share to each forward and backward (stage 0's is
    # the step's overhead, before its first forward)
    for s in range(1, S):
        around = max(0.0, thread[s] - own[s]) / (2 * M)
        forward[s], backward[s] = forward[s] + around, backward[s] + around
        own[s] += 2 * M * around
    return dataclasses.replace(
        costs,
        forward=forward,
        backward=backward,
        optimizer=optimizer,
        step_overhead=max(0.0, thread[0] - own[0]),
        cpu=[max(process[s], own[s]) for s in range(S)],
    )


def cores_of(result) -> int:
    """The cores a run's workers shared: per host (its workers' address), the most any of its workers' processes
    could run on, summed over the hosts (0: the records do not say)."""
    hosts: dict = {}
    for e in result.events:
        if e.get("kind") == "stage" and e.get("cores"):
            host = e.get("address") or ""
            hosts[host] = max(hosts.get(host, 0), e["cores"])
    return sum(hosts.values())


def others_cores(result) -> Optional[float]:
    """The cores' worth that processes beside the run's workers took over ``result``'s records (the Dask scheduler,
    the notebook's kernel, the nannies, anything else on the machine): the machine's busy CPU seconds per second
    (``machine_cpu``, as one worker saw it: the median over the workers) less the workers' own (``process_cpu``,
    summed).  None where the records do not say: no such CPU times, or workers on more than one host."""
    if len({e.get("address") for e in result.events if e.get("kind") == "stage"}) > 1:
        return None
    by_worker: dict = {}
    for e in result.events:
        if e.get("kind") == "optimizer" and "machine_cpu" in e and "process_cpu" in e:
            by_worker.setdefault((e["pipeline"], e["stage"]), []).append(e)
    machine, own = [], 0.0
    for spans in by_worker.values():
        spans.sort(key=lambda e: e["end"])
        covered = spans[-1]["end"] - spans[0]["end"]  # each span's CPU times are since the previous one's end
        if len(spans) < 2 or covered <= 0:
            continue
        machine.append(sum(e["machine_cpu"] for e in spans[1:]) / covered)
        own += sum(e["process_cpu"] for e in spans[1:]) / covered
    if not machine:
        return None
    return max(0.0, statistics.median(machine) - own)


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
    mean over the others; a step slowdown as the slowed worker's median own step against the unslowed pipelines'
    workers of its stage (:func:`_own_steps`: its step less its waits for other pipelines, so that a policy whose
    pipelines step together, as ``allreduce``'s do, still shows it; on a machine with fewer cores than workers a
    sleeping pipeline hands its core to the others, which then step faster, so the ratio shown can exceed the
    factor asked for)."""
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
    worker_of = {key: key if isinstance(key, tuple) else (key, 0) for key, f in hetero.slowdown.items() if f != 1.0}
    slowed = {key: w for key, w in worker_of.items() if w[0] < pipelines and w[1] < stages}
    plain = [p for p in range(pipelines) if p not in {w[0] for w in slowed.values()}]
    step = {}
    for key, (p, s) in slowed.items():
        mine, base = _own_steps(by_kind, [(p, s)]), _own_steps(by_kind, [(q, s) for q in plain])
        if mine and base and statistics.median(base) > 0:
            step[key] = max(1.0, statistics.median(mine) / statistics.median(base))
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
        spans = sorted(_spans_of(by_kind, p, 0, _COVERED), key=lambda x: x[0])
        untraced += _outside(_optimizers(by_kind, p, 0), spans)
    return untraced


def _optimizers(by_kind: dict, p: int, s: int) -> list:
    """Worker (p, s)'s optimizer spans in order."""
    return sorted(
        (e for e in by_kind.get("optimizer", ()) if e["pipeline"] == p and e["stage"] == s), key=lambda e: e["start"]
    )


def _spans_of(by_kind: dict, p: int, s: int, kinds, background: bool = True) -> list:
    """(start, end) of worker (p, s)'s spans of ``kinds`` (without an overlapped averaging's, ``lane="background"``,
    when ``background`` is False)."""
    return [
        (e["start"], e["end"])
        for k in kinds
        for e in by_kind.get(k, ())
        if e.get("pipeline") == p and e.get("stage") == s and (background or e.get("lane") != "background")
    ]


def _outside(opt: list, spans: list) -> list:
    """Per pair of consecutive optimizer spans ``opt`` of one worker (one epoch, consecutive steps): the seconds
    between their ends outside ``spans`` ((start, end) sorted by start; overlapping ones count twice; at least 0)."""
    out, j = [], 0
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
        out.append(max(0.0, (hi - lo) - inside))
    return out


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


#: spans in which a worker waits for other pipelines (its group, a collective, a server, an averaging in flight)
_WAITING = ("wait", "sync", "pause", "eval")


def _own_steps(by_kind: dict, workers) -> list:
    """Seconds each of ``workers`` ((pipeline, stage) pairs) took for its own steps: between consecutive optimizer
    ends of one epoch, less the spans in which it waited for other pipelines (:data:`_WAITING`; not an overlapped
    averaging's, ``lane="background"``, which runs beside its steps)."""
    out = []
    for p, s in workers:
        merged: list = []  # the waiting spans, sorted and merged (a drain's wait may hold a collective)
        for st, en in sorted(_spans_of(by_kind, p, s, _WAITING, background=False)):
            if merged and st <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], en)
            else:
                merged.append([st, en])
        out += _outside(_optimizers(by_kind, p, s), merged)
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
