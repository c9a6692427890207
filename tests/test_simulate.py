"""The simulator: simulated time on the real scheduler core, the same records as a real run."""

import dataclasses
import itertools
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sdpipe
from sdpipe.core.schedule import build_plan, dry_run
from sdpipe.core.sync_rules import GLOBAL, STEP, ps_release
from sdpipe.simulation import SIM_POLICIES, Costs, Network, Proxy, ring_allreduce_seconds, simulate
from sdpipe.simulation.proxy import _Ssp
from sdpipe.wire import events

COSTS = Costs(forward=[0.002, 0.003], backward=[0.004, 0.006], weight_bytes=[4e5, 8e5], activation_bytes=[4e4])
COSTS4 = Costs(forward=[0.002] * 4, backward=[0.004] * 4, weight_bytes=[4e5] * 4, activation_bytes=[4e4] * 3)
STRAGGLES = sdpipe.Heterogeneity(straggle_prob=0.1, straggle_delay=0.02)
STRAGGLER = sdpipe.Heterogeneity(slowdown={3: 4.0})


def test_allreduce_step_is_the_overhead_the_plan_and_the_collective():
    """No scheduler round trip under allreduce: its collective needs no central decision."""
    import dataclasses

    net = Network(bandwidth=1e8, latency=1e-4, scheduler_rtt=1e-3)
    costs = dataclasses.replace(COSTS, step_overhead=2e-3)
    result = simulate(2, 2, epochs=1, costs=costs, policy="allreduce", steps=20, network=net)

    def cost(a):
        message = 4e4 / 1e8 + 1e-4 if a.op in ("SF", "SB") else 0.0
        return {"F": COSTS.forward[a.stage], "B": COSTS.backward[a.stage]}.get(a.op, message)

    run = dry_run(build_plan("1f1b", 2, 4), cost)
    ends = [max(e for a, _, e in run.spans if a.stage == s) for s in (0, 1)]
    step = max(2e-3 + ends[s] + ring_allreduce_seconds(COSTS.weight_bytes[s], 2, net) for s in (0, 1))
    final = max(ring_allreduce_seconds(COSTS.weight_bytes[s], 2, net) for s in (0, 1))  # the epoch's global sync
    assert result.wall_time == pytest.approx(20 * step + final, rel=1e-9)
    assert result.steps == {0: 20, 1: 20}


def test_sdpipe_leaves_the_straggler_out_and_beats_allreduce():
    sd = simulate(2, 4, epochs=1, costs=COSTS, policy="sdpipe", steps=60, heterogeneity=STRAGGLER)
    ar = simulate(2, 4, epochs=1, costs=COSTS, policy="allreduce", steps=60, heterogeneity=STRAGGLER)
    rate = lambda r: sum(h["samples"] for h in r.history) / r.wall_time
    assert rate(sd) > 1.8 * rate(ar)
    share = {h["pipeline"]: h["share"] for h in sd.history}
    assert share[3] < 0.5 * min(share[p] for p in (0, 1, 2)) and sum(share.values()) == pytest.approx(1.0)
    groups = [e for e in sd.events if e["kind"] == "group"]
    multi = [g for g in groups if len(g["group"]) > 1 and g["reason"] != "global"]
    assert multi and sum(3 not in g["group"] for g in multi) > len(multi) / 2
    assert {g["reason"] for g in groups} <= {"full", "arrived", "window", "alone", "graph", "global", "preempted"}
    assert any(g["reason"] == "global" and g["group"] == [0, 1, 2, 3] for g in groups)


def test_mixing_keeps_the_replicas_closer_than_no_sync():
    sd = simulate(
        2, 4, epochs=1, costs=COSTS, policy="sdpipe", steps=60, heterogeneity=STRAGGLER, proxy=Proxy(noise=2.0)
    )
    none = simulate(
        2, 4, epochs=1, costs=COSTS, policy="none", steps=60, heterogeneity=STRAGGLER, proxy=Proxy(noise=2.0)
    )
    assert max(h["loss"] for h in sd.history) < max(h["loss"] for h in none.history)


def test_a_simulated_run_replays_in_the_dashboard():
    from sdpipe.widgets import Dashboard

    dash = Dashboard(simulate(2, 4, epochs=1, costs=COSTS, policy="sdpipe", steps=30, heterogeneity=STRAGGLER))
    assert len(dash.trace("timeline/compute").x) > 0 and any(any(row) for row in dash.trace("groups/0").z)
    assert len(dash.trace("loss/0").y) > 10


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(policy="gossip"),
            "policy: 'gossip' is not one of sdpipe, allreduce, ps, adpsgd, none",
        ),
        (dict(epochs=0), "epochs: must be an integer >= 1, got 0"),
        (dict(steps=0), "steps: must be an integer >= 1, got 0"),
        (dict(costs=Costs(forward=[0.1], backward=[0.1])), "costs: has 1 stages, the simulation 2"),
    ],
)
def test_bad_input_is_named(kwargs, message):
    args = {**dict(costs=COSTS, policy="sdpipe", steps=5, epochs=1), **kwargs}
    with pytest.raises(ValueError) as e:
        simulate(2, 2, **args)
    assert str(e.value) == message


def test_bad_costs_and_network_are_named():
    with pytest.raises(ValueError, match=r"costs.backward: needs 2 finite numbers >= 0 \(one per stage\)"):
        Costs(forward=[0.1, 0.1], backward=[0.1])
    with pytest.raises(ValueError, match=re.escape("network.bandwidth: must be a number > 0, got 0")):
        Network(bandwidth=0)


def test_jitter_makes_lock_step_wait_for_the_slowest():
    """With varying step times allreduce waits for the slowest each step; the mean step stays the same."""
    import dataclasses

    jittery = dataclasses.replace(COSTS, jitter=0.3)
    calm = simulate(2, 8, epochs=1, costs=COSTS, policy="allreduce", steps=40, record=False)
    ar = simulate(2, 8, epochs=1, costs=jittery, policy="allreduce", steps=40, record=False)
    alone = simulate(2, 8, epochs=1, costs=jittery, policy="none", steps=40, record=False, seed=3)
    assert ar.wall_time > 1.2 * calm.wall_time
    assert alone.wall_time < 1.15 * calm.wall_time
    with pytest.raises(ValueError, match=r"costs.jitter: needs 1 finite numbers >= 0 \(one per stage\), got \(-1.0,\)"):
        Costs(forward=[0.1], backward=[0.1], jitter=-1)


HETERO = sdpipe.Heterogeneity(
    slowdown={3: 4.0, (1, 0): 1.5}, link_delay={2: 2e-3}, straggle_prob=0.2, straggle_delay=0.01
)


@pytest.mark.parametrize("policy", SIM_POLICIES)
def test_every_record_of_a_simulated_run_fits_the_event_schema(policy):
    """Every record the simulator makes comes from sdpipe.wire.events; a group names the policy that decided it."""
    costs = dataclasses.replace(COSTS, jitter=0.2, step_overhead=1e-3, optimizer=[1e-4, 2e-4])
    result = simulate(2, 4, epochs=1, costs=costs, policy=policy, steps=30, heterogeneity=HETERO)
    for rec in result.events:
        assert events.problems(rec) == [], rec
        events.validate(rec)
    # ps syncs at its servers, not through the group service: no group records (as in a real run)
    synced = {"none": set(), "ps": {"sync"}}.get(policy, {"sync", "group"})
    kinds, base = {e["kind"] for e in result.events}, {"forward", "backward", "optimizer", "epoch"} | synced
    # wait: under sdpipe's overlapped averaging, a ready signal that waited for the last group's averaging
    assert base <= kinds <= base | ({"wait"} if policy == "sdpipe" else set())
    groups = [e for e in result.events if e["kind"] == "group"]
    assert all(g["policy"] == policy for g in groups) and (policy in ("none", "ps") or groups)
    reasons = {g["reason"] for g in groups}
    assert policy != "sdpipe" or {"window", "global"} <= reasons  # the core's deadlines closed some rounds


@pytest.mark.parametrize("policy", SIM_POLICIES)
def test_a_seed_replays_the_same_run_and_recording_changes_nothing(policy):
    kwargs = dict(costs=dataclasses.replace(COSTS, jitter=0.2), policy=policy, epochs=1, steps=25, heterogeneity=HETERO)
    a, b = simulate(2, 4, seed=7, **kwargs), simulate(2, 4, seed=7, **kwargs)
    quiet = simulate(2, 4, seed=7, record=False, **kwargs)
    assert a.events == b.events and a.history == b.history and a.wall_time == b.wall_time
    assert quiet.events == [] and quiet.history == a.history and quiet.wall_time == a.wall_time
    assert quiet.steps == a.steps == {h["pipeline"]: h["steps"] for h in a.history}
    assert simulate(2, 4, seed=8, **kwargs).wall_time != a.wall_time


@pytest.mark.cluster
@pytest.mark.parametrize("policy", ["sdpipe", "allreduce"])
def test_calibrate_reads_costs_sizes_and_slowdown_from_a_real_run(shared_cluster, policy):
    """Costs from a real 2 x 2 run with pipeline 1 slowed 3x; simulating with them lands near the real rate.  Under
    ``allreduce`` every pipeline steps at the slowed one's pace: its slowdown shows in its own step, not in the
    time between its steps."""
    import torch

    from sdpipe.data import digits, digits_cnn

    (train_data, _eval_data) = digits()
    result = sdpipe.train(
        digits_cnn(8),
        train_data,
        stages=2,
        pipelines=2,
        cuts=(6,),
        policy=policy,
        epochs=3,
        batch_size=64,
        heterogeneity=sdpipe.Heterogeneity(slowdown={1: 3.0}),
        cluster=shared_cluster,
    ).result(timeout=300)
    costs, net, shown = sdpipe.calibrate(result)
    stages = sdpipe.partition(digits_cnn(8), 2, (6,))
    assert costs.weight_bytes == tuple(float(sum(p.numel() * 4 for p in m.parameters())) for m in stages)
    assert costs.activation_bytes == (float(stages[0](torch.zeros(16, 64)).numel() * 4),)
    assert all(v > 0 for v in costs.forward + costs.backward + costs.optimizer)
    assert costs.step_overhead > 0 and net.latency > 0 and net.scheduler_rtt > 0
    # shown under the run's own key (a pipeline's key stretches its stage 0 alone); a sleeping worker hands its
    # core to the three others here, which then step faster, so the ratio shown is above the 3.0 asked for
    assert set(shown.slowdown) == {1} and 2.0 < shown.slowdown[1] < 12.0
    epochs = sorted({h["epoch"] for h in result.history})[1:]
    # the least disturbed epoch: the simulator gives every worker a core of its own, and four workers share two
    # here (a homogeneous run of this model is simulated up to 2x fast, docs/simulator.md)
    real = max(sum(h["samples_per_s"] for h in result.history if h["epoch"] == e) for e in epochs)
    sim = simulate(
        2,
        2,
        epochs=1,
        costs=costs,
        network=net,
        heterogeneity=shown,
        policy=policy,
        batch_size=64,
        steps=len(train_data[0]) // 64 // 2,
        record=False,
    )
    assert 0.5 < sum(h["samples_per_s"] for h in sim.history) / real < 2.5


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: sdpipe.calibrate("run"), "result: must be a sdpipe.RunResult of a real run (run.result()), got str"),
        (lambda: simulate(2, 2, costs=COSTS, network="fast"), "network: must be a sdpipe.Network, got str"),
        (lambda: simulate(2, 2, costs=COSTS, proxy=Proxy(lr="a")), "proxy.lr: must be a finite number >= 0, got 'a'"),
        (lambda: simulate(0, 2, costs=COSTS), "stages: must be an integer >= 1, got 0"),
        (
            lambda: Costs(forward="fast", backward=[0.1]),
            "costs.forward: needs one finite number >= 0 per stage, got 'fast'",
        ),
        (lambda: sdpipe.load_checkpoint(123), "resume_from: must be a folder path, got int"),
    ],
)
def test_public_entry_points_name_the_bad_field(call, message):
    with pytest.raises(ValueError) as e:
        call()
    assert str(e.value) == message


def test_a_run_goes_on_while_every_worker_waits_in_an_open_round():
    """Workers of both stages can all be waiting in open rounds with nothing else pending: the core's deadline
    must still be ticked (a simulation once ended there, with batches left and no global sync)."""
    S, D, steps = 2, 4, 300
    costs = Costs(
        forward=[0.01] * S,
        backward=[0.02] * S,
        weight_bytes=[1e7] * S,
        activation_bytes=[1e5],
        step_overhead=0.02,
        jitter=0.05,
    )
    result = simulate(S, D, policy="sdpipe", epochs=1, costs=costs, microbatches=4, steps=steps)
    assert sum(h["samples"] for h in result.history) == steps * D * 32
    assert sum(e["kind"] == "group" and e["reason"] == "global" for e in result.events) == S


@pytest.mark.parametrize("schedule", ["async-1f1b", "async-2bw"])
def test_an_asynchronous_schedule_steps_at_its_steady_state_without_flush(schedule):
    """A pipeline alone: a step of an asynchronous schedule lasts the slowest stage's M forwards and backwards
    (no fill, no flush) and its updates; 1F1B's lasts its flushed plan."""
    costs = Costs(forward=[0.002, 0.003], backward=[0.004, 0.006], optimizer=[1e-3, 1e-3])
    net = Network(latency=0.0)  # sends free
    flush = simulate(2, 1, epochs=1, costs=costs, policy="none", schedule="1f1b", steps=40, network=net)
    steady = simulate(2, 1, epochs=1, costs=costs, policy="none", schedule=schedule, steps=40, network=net)
    updates = 4 if schedule == "async-1f1b" else 1  # per step of 4 micro-batches
    assert steady.wall_time == pytest.approx(40 * (4 * (0.003 + 0.006) + updates * 1e-3), rel=1e-6)
    flushed = dry_run(build_plan("1f1b", 2, 4), {"F": 0.0025, "B": 0.005}).makespan  # at least this much
    assert flush.wall_time > 40 * flushed > steady.wall_time - 40 * updates * 1e-3


@pytest.mark.parametrize("overlap", [False, True])
def test_a_trace_of_preemptions_and_returns_follows_the_scheduler_core(overlap):
    """Pipelines leave and come back (spot instances): an absent pipeline is in no group, a returning one takes
    a live replica's state first, the epoch's global group holds exactly the pipelines present, and only the
    batches in flight at a preemption go untrained."""
    trace = sdpipe.spot_trace(8, preemptions_per_min=20, mean_down=1.0, duration=30, seed=3)
    assert {p for _, _, p in trace} <= set(range(1, 8)) and trace == sorted(trace)
    for p in range(1, 8):  # each pipeline alternates: leave, join, leave, ...
        whats = [w for _, w, q in trace if q == p]
        assert whats == ["leave", "join"] * (len(whats) // 2)
    result = simulate(
        2,
        8,
        epochs=1,
        costs=COSTS,
        policy="sdpipe",
        steps=150,
        trace=trace,
        scheduler={"overlap": overlap},
        proxy=Proxy(noise=0.5),
    )
    assert not [e for e in result.events if events.problems(e)]
    changes = sorted(
        (e["start"], e["what"], e["pipeline"], e["donor"]) for e in result.events if e["kind"] == "control"
    )
    assert len(changes) >= 4 and {w for _, w, _, _ in changes} == {"left", "joined"}
    absent, present_at = set(), []
    for t, what, p, donor in changes:
        if what == "left":
            absent.add(p)
        else:
            assert donor not in absent and donor != p  # a live replica gives the state
            absent.discard(p)
        present_at.append((t, set(range(8)) - absent))

    def present(t):
        now = set(range(8))
        for when, members in present_at:
            if when <= t:
                now = members
        return now

    groups = [e for e in result.events if e["kind"] == "group"]
    for g in groups:
        assert set(g["group"]) <= present(g["end"]), (g, present(g["end"]))
    final = [g for g in groups if g["reason"] == "global"]
    assert final and all(set(g["group"]) == present(g["end"]) for g in final)
    # a returned pipeline trained again; the batches lost are at most one per preemption
    lefts = sum(1 for c in changes if c[1] == "left" and c[0] < result.wall_time)
    samples = sum(h["samples"] for h in result.history)
    assert 150 * 8 * 32 - lefts * 32 <= samples < 150 * 8 * 32
    assert sorted(result.lost) == sorted(set(range(8)) - present(result.wall_time))


def test_bad_traces_are_named_in_one_line():
    for kwargs, message in [
        (dict(policy="allreduce", trace=[(1.0, "leave", 1)]), "trace: pipelines join and leave under 'sdpipe'"),
        (dict(trace=[(1.0, "go", 1)]), "trace: needs (seconds >= 0, 'leave' or 'join', pipeline 0..3)"),
        (dict(trace=[(1.0, "leave", 4)]), "trace: needs (seconds >= 0"),
        (dict(trace=[(-1, "leave", 1)]), "trace: needs (seconds >= 0"),
    ]:
        with pytest.raises(ValueError) as e:
            simulate(2, 4, costs=COSTS, steps=10, **{"policy": "sdpipe", "epochs": 1, **kwargs})
        assert str(e.value).startswith(message) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"^mean_down: must be a finite number > 0, got 0$"):
        sdpipe.spot_trace(4, preemptions_per_min=1, mean_down=0, duration=10)


# ---------------------------------------------------------------- ps, adpsgd, several epochs
@settings(max_examples=300, deadline=None)
@given(
    D=st.integers(1, 6),
    staleness=st.integers(1, 4),
    requests=st.lists(st.tuples(st.integers(0, 5), st.booleans()), max_size=80),
)
def test_the_simulated_servers_answer_as_the_runtimes_rule(D, staleness, requests):
    """The simulator's parameter server keeps its bookkeeping incrementally; every answer is the one the
    runtime's server gets from sync_rules.ps_release, kept as the runtime's server keeps its state."""
    ssp = _Ssp(range(D), staleness)
    clock, at_global, waiting = dict.fromkeys(range(D), 0), set(), {}
    for c, final in requests:
        c %= D
        if c in waiting:  # a client waits for its pull before it pushes again
            continue
        kind = GLOBAL if final else STEP
        if kind == GLOBAL:
            at_global.add(c)
        else:
            clock[c] += 1
        waiting[c] = kind
        want = ps_release(clock, set(range(D)), at_global, waiting, staleness)
        for x in want.replies:
            waiting.pop(x, None)
        if want.global_sync:
            at_global.clear()
        clock = want.clock
        assert ssp.push(c, kind) == (want.replies, want.global_sync)


def test_ps_is_bound_by_its_server_links_where_sdpipe_is_not():
    """Every step each worker pushes and pulls its stage's weights over the server's one link: from 8 pipelines
    on, a run lasts about as long as its server link is busy, and sdpipe's pairs leave it far behind."""
    costs = Costs(forward=[1e-3] * 2, backward=[2e-3] * 2, weight_bytes=[1e7, 1e7])
    net = Network(bandwidth=1e9, latency=0.0, scheduler_rtt=1e-4)
    for D in (8, 16):
        ps = simulate(2, D, epochs=1, costs=costs, network=net, policy="ps", steps=40)
        sd = simulate(2, D, epochs=1, costs=costs, network=net, policy="sdpipe", steps=40)
        # the host (pipeline 0) pushes in memory; every other push takes 1e7 / 1e9 s of the link into the server
        pushes = [e for e in ps.events if e["kind"] == "sync" and e["stage"] == 0 and e["pipeline"] != 0]
        busy = len(pushes) * 1e7 / 1e9
        assert busy <= ps.wall_time <= 1.1 * busy
        assert sd.wall_time < ps.wall_time / 3
        assert {e["reason"] for e in ps.events if e["kind"] == "sync"} == {"ps", "global"}


def test_ps_holds_a_fast_pipeline_within_the_staleness_bound_of_a_slow_one():
    """Every pull the server answers while the slow pipeline still trains leaves the puller at most ``staleness``
    steps ahead of it: the slow one had sent that many pushes before the answer arrived."""
    costs = Costs(forward=[1e-3] * 2, backward=[2e-3] * 2, weight_bytes=[1e6, 1e6])
    slow = sdpipe.Heterogeneity(slowdown={2: 5.0})
    ahead = {}
    for staleness in (1, 4):
        r = simulate(
            2, 3, epochs=1, costs=costs, policy="ps", steps=60, scheduler={"staleness": staleness}, heterogeneity=slow
        )
        syncs = [e for e in r.events if e["kind"] == "sync" and e["stage"] == 0]
        sent = sorted(e["start"] for e in syncs if e["pipeline"] == 2 and e["reason"] == "ps")
        running_until = min(e["start"] for e in syncs if e["pipeline"] == 2 and e["reason"] == "global")
        ahead[staleness] = 0
        for e in syncs:
            if e["reason"] == "ps" and e["pipeline"] != 2 and e["end"] < running_until:
                behind = sum(1 for t in sent if t < e["end"])  # the slow one's pushes sent before the answer came
                ahead[staleness] = max(ahead[staleness], e["step"] + 1 - behind)
        assert 0 < ahead[staleness] <= staleness
    assert ahead[1] < ahead[4]


def test_adpsgd_pairs_an_active_with_a_passive_and_serves_one_exchange_at_a_time():
    result = simulate(2, 8, epochs=1, costs=COSTS, policy="adpsgd", steps=40, heterogeneity=HETERO)
    pairs = [e for e in result.events if e["kind"] == "sync" and e["reason"] == "pair"]
    assert pairs and all(sorted(p % 2 for p in e["group"]) == [0, 1] for e in pairs)
    served = {}
    for e in pairs:
        if e.get("served"):
            served.setdefault((e["pipeline"], e["stage"]), []).append((e["start"], e["end"]))
            assert e["pipeline"] % 2 == 1
    for spans in served.values():  # a passive worker's exchanges end one after another
        ends = sorted(end for _, end in spans)
        assert all(b > a for a, b in itertools.pairwise(ends))
    final = [e for e in result.events if e["kind"] == "group"]
    assert [g["reason"] for g in final] == ["global", "global"] and all(g["group"] == list(range(8)) for g in final)


def test_gossip_mixes_slower_than_scheduled_groups():
    """The convergence proxy over the second half of the epoch, averaged over seeds: random pairs keep the
    replicas further apart (a higher loss) than sdpipe's groups, and far closer than no mixing."""

    def late_loss(policy, seed):
        r = simulate(4, 16, epochs=1, costs=COSTS4, policy=policy, steps=100, heterogeneity=STRAGGLES, seed=seed)
        losses = [e["loss"] for e in r.events if e["kind"] == "optimizer" and "loss" in e]
        return sum(losses[len(losses) // 2 :]) / (len(losses) - len(losses) // 2)

    mean = {p: sum(late_loss(p, seed) for seed in range(3)) / 3 for p in ("sdpipe", "adpsgd", "none")}
    assert mean["sdpipe"] < mean["adpsgd"] < mean["none"], mean


@pytest.mark.parametrize("policy", SIM_POLICIES)
def test_several_epochs_sync_every_second_one(policy):
    """Four epochs, a global sync after the second and the fourth (none under 'none'); every epoch hands out
    all its batches, and each pipeline has a row per epoch."""
    r = simulate(2, 4, costs=COSTS, policy=policy, steps=10, epochs=4, sync_every=2, heterogeneity=HETERO)
    rows = {(h["epoch"], h["pipeline"]) for h in r.history}
    assert rows == {(e, p) for e in range(4) for p in range(4)}
    for e in range(4):
        assert sum(h["samples"] for h in r.history if h["epoch"] == e) == 10 * 4 * 32
    finals = [e for e in r.events if e["kind"] == "sync" and e.get("reason") == "global"]
    # two global syncs: every worker (4 pipelines x 2 stages) takes part in each
    assert len(finals) == (0 if policy == "none" else 2 * 4 * 2)
    for p in range(4):
        ends = sorted(e["end"] for e in finals if e["pipeline"] == p)
        epochs = sorted((h["epoch"], h["samples"]) for h in r.history if h["pipeline"] == p)
        assert len(ends) == (0 if policy == "none" else 4) and len(epochs) == 4


@pytest.mark.parametrize("policy", SIM_POLICIES)
def test_every_policy_steps_faster_without_the_flush_of_a_synchronous_schedule(policy):
    """An asynchronous schedule's steady-state step has no fill and drain: under every policy the same work
    takes less simulated time than under 1F1B, and every batch is still trained."""
    costs = Costs(forward=[0.002] * 4, backward=[0.004] * 4, weight_bytes=[1e5] * 4, activation_bytes=[1e4] * 3)
    flushed = simulate(4, 4, epochs=1, costs=costs, policy=policy, schedule="1f1b", steps=30)
    steady = simulate(4, 4, epochs=1, costs=costs, policy=policy, schedule="async-1f1b", steps=30)
    assert steady.wall_time < 0.8 * flushed.wall_time
    assert sum(h["samples"] for h in steady.history) == sum(h["samples"] for h in flushed.history) == 30 * 4 * 32


@settings(max_examples=40, deadline=None)
@given(
    steps=st.lists(st.integers(0, 11), min_size=1, max_size=200),
    settle_at=st.lists(st.integers(0, 199), max_size=5),
    by_progress=st.booleans(),
)
def test_proxy_steps_taken_in_together_equal_steps_one_at_a_time(steps, settle_at, by_progress):
    """The proxy logs a worker's step and takes the log in (in numpy, repeats of a worker one after another)
    when a point is read; a round's pairs average together: the points, progress and the noise drawn are those
    of stepping and averaging one at a time, bit for bit."""
    from sdpipe.simulation.proxy import _Proxy

    together, alone = _Proxy(3, 4, 7, Proxy(0.1, 1.0)), _Proxy(3, 4, 7, Proxy(0.1, 1.0))
    for i, w in enumerate(steps):
        together.learn(w)
        alone.learn(w)
        alone.settle()
        if i in settle_at:
            together.settle()
    pairs = [(0, 3), (6, 9), (1, 4)]  # of stage 0, 0 and 1: disjoint
    together.mix_pairs([u for u, _ in pairs], [v for _, v in pairs], by_progress)
    for u, v in pairs:
        alone.mix([u, v], by_progress, False)
    together.mix([2, 5, 8], by_progress, True)
    alone.mix([2, 5, 8], by_progress, True)
    assert together.x.tolist() == alone.x.tolist() and together.mass.tolist() == alone.mass.tolist()
    assert together._normals(4).tolist() == alone._normals(4).tolist()
    expected_mass = 1.0 + steps.count(7)  # not in any group
    assert together.mass[7] == expected_mass
    assert [together.loss(p) for p in range(4)] == [alone.loss(p) for p in range(4)]


def test_a_proxy_step_is_the_formula_on_the_streams_next_numbers():
    from sdpipe.simulation.proxy import _Proxy

    proxy, twin = _Proxy(2, 3, 5, Proxy(0.2, 0.5)), _Proxy(2, 3, 5, Proxy(0.2, 0.5))
    before = proxy.x[4].tolist()
    proxy.learn(4)
    proxy.settle()
    z = twin._normals(4).tolist()
    assert proxy.x[4].tolist() == [0.8 * x - 0.2 * 0.5 * n for x, n in zip(before, z, strict=True)]
    assert proxy.mass.tolist() == [1.0, 1.0, 1.0, 1.0, 2.0, 1.0]


def test_simulate_takes_the_runs_fields_with_their_defaults_and_only_those_it_models():
    """The run's fields are train()'s (one home per default: TrainConfig); the fields the simulator does not model
    are refused in one line, naming what it takes."""
    import inspect

    from sdpipe.config import TrainConfig
    from sdpipe.simulation import SIMULATED_FIELDS

    params = inspect.signature(simulate).parameters
    defaults = TrainConfig()
    assert all(params[name].default == getattr(defaults, name) for name in SIMULATED_FIELDS)
    assert list(params)[:2] == ["stages", "pipelines"] and "optimizer" not in params
    with pytest.raises(TypeError) as e:
        simulate(2, 2, costs=COSTS, optimizer="sgd")
    assert str(e.value).startswith("simulate() does not take the TrainConfig field 'optimizer'; keywords are costs,")
    r = simulate(2, 2, costs=COSTS, steps=3)  # the defaults: allreduce, 10 epochs
    assert {g["policy"] for g in r.events if g["kind"] == "group"} == {"allreduce"}
    assert {h["epoch"] for h in r.history} == set(range(defaults.epochs))
    with pytest.raises(ValueError, match=r"^proxy.noise: must be a finite number >= 0, got -1$"):
        Proxy(noise=-1)


def test_a_scheduler_dict_changes_the_chosen_policys_preset():
    from sdpipe.config import TrainConfig
    from sdpipe.core.policies import record

    for policy in ("sdpipe", "allreduce", "none"):
        config = TrainConfig(policy=policy, scheduler={"staleness": 3})
        assert config.scheduler_policy() == record(policy).scheduler.updated(staleness=3)


def test_a_groups_allreduce_is_the_ring_or_the_cheaper_of_ring_and_tree():
    """ "best" (the default) prices a group at the cheaper of the flat ring and the pipelined binary tree; "ring"
    keeps the ring.  Small groups are bandwidth-bound (the ring wins); a group of thousands is latency-bound in a
    ring (2 (n - 1) messages) and takes 2 log2 n in the tree."""
    from sdpipe.simulation.costs import allreduce_seconds, tree_allreduce_seconds

    net, ring_net = Network(bandwidth=1.25e9, latency=50e-6), Network(bandwidth=1.25e9, latency=50e-6, allreduce="ring")
    for n in (1, 2, 3, 8, 64, 4096):
        ring, tree = ring_allreduce_seconds(4e5, n, net), tree_allreduce_seconds(4e5, n, net)
        assert allreduce_seconds(4e5, n, ring_net) == ring
        assert allreduce_seconds(4e5, n, net) == min(ring, tree)
    assert allreduce_seconds(4e5, 2, net) == ring_allreduce_seconds(4e5, 2, net)  # a pair: the ring's
    assert tree_allreduce_seconds(4e5, 4096, net) == pytest.approx(2 * 4e5 / 1.25e9 + 2 * 12 * 50e-6)
    assert ring_allreduce_seconds(4e5, 4096, net) > 0.4  # 8,190 latencies
    with pytest.raises(ValueError, match=r"^network.allreduce: 'tree' is not one of best, ring$"):
        Network(allreduce="tree")


def test_pairs_across_components_connect_the_sync_graph_sooner_than_neighbours():
    """With a straggler above the pairing threshold, pairing across the union's components connects each stage in
    fewer updates than pairing neighbours (the longest unconnected stretch, RunResult.bounds), within the bound."""
    hetero = sdpipe.Heterogeneity(slowdown={3: 4.0}, straggle_prob=0.05, straggle_delay=0.01)
    longest = {}
    for pairing in ("across", "neighbours"):
        r = simulate(
            2,
            16,
            costs=COSTS,
            policy="sdpipe",
            epochs=1,
            steps=50,
            heterogeneity=hetero,
            scheduler={"pairing": pairing},
        )
        assert [b["bound"] for b in r.bounds] == [10 * 16] * 2
        longest[pairing] = max(b["longest"] for b in r.bounds)
    assert longest["across"] < 10 * 16 and longest["across"] < longest["neighbours"] / 2, longest
    assert simulate(2, 4, costs=COSTS, policy="none", epochs=1, steps=5).bounds == []
