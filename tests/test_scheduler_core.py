"""Property tests of the pure group scheduler: no torch, no Dask, no clock."""

import heapq
import math
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sdpipe.core.policies import POLICY_PRESETS
from sdpipe.core.scheduler import (
    WINDOW_RULES,
    DisjointSet,
    GroupScheduler,
    Hurry,
    Join,
    Lost,
    Ready,
    Retune,
    SchedulerPolicy,
    ShardedScheduler,
    StageScheduler,
    Tick,
)


def check_open_rounds(sched):
    """The core's own invariants (GroupScheduler.validate), checked after every event."""
    sched.validate()


def drive(stages, speeds, policy, steps, losses=(), seed=0, global_every=None, jitter=0.5, joins=(), start=None):
    """Event-driven run of the scheduler: worker p of each stage computes for 1/speed[p] (x 1 +- jitter),
    sends Ready, waits for its group, repeats. ``losses``: (time, pipeline) pairs.  ``start``: the pipelines
    live at the start (default all); ``joins``: (time, pipeline, donor or None) triples, a donor being any
    live pipeline (``"any"``: the first live one); each join is logged as (time, None, (pipeline, donor)).
    Returns (decisions, log of (time, stage, group, live-before-decision, waiting-before))."""
    rng = random.Random(seed)
    D = len(speeds)
    start = range(D) if start is None else start
    sched = GroupScheduler(stages, D, policy)
    for p in set(range(D)) - set(start):  # not there yet: as a pipeline lost before the start
        sched.handle(Lost(p, 0.0))
    heap, seq = [], 0

    def push(t, kind, *args):
        nonlocal seq
        heapq.heappush(heap, (t, seq, kind, args))
        seq += 1

    step = {(s, p): 0 for s in range(stages) for p in range(D)}
    for s in range(stages):
        for p in start:
            push(rng.uniform(1 - jitter, 1 + jitter) / speeds[p], "ready", s, p, 0)
    for t, p in losses:
        push(t, "lost", p)
    for t, p, donor in joins:
        push(t, "join", p, donor)
    log = []
    lost = set(range(D)) - set(start)
    gen = dict.fromkeys(range(D), 0)  # a pipeline's life: ready signals of an earlier one are void
    now = 0.0

    def apply(decisions, before):
        for g in decisions:
            st_ = sched.stages[g.stage]
            after = (set(st_.live), st_.live - st_.global_waiting)
            log.append((now, g, before[g.stage] + after))
            if g.reason == "global":
                for m in g.members:  # a worker that did its last step leaves the run after the global group
                    if step[(g.stage, m)] >= steps:
                        push(now, "leave", g.stage, m)
                continue
            for m in g.members:
                push(now + rng.uniform(1 - jitter, 1 + jitter) / speeds[m], "ready", g.stage, m, gen[m])

    guard = 0
    while heap or sched.next_deadline() is not None:  # a round may still close at its deadline
        check_open_rounds(sched)
        guard += 1
        assert guard < 200_000, "scheduler simulation did not finish (deadlock?)"
        deadline = sched.next_deadline()
        if deadline is not None and (not heap or deadline <= heap[0][0]):
            now = deadline
            before = {
                s: (set(sched.stages[s].live), sched.stages[s].waiting | sched.stages[s].global_waiting)
                for s in range(stages)
            }
            apply(sched.handle(Tick(now)), before)
            continue
        now, _, kind, args = heapq.heappop(heap)
        before = {
            s: (set(sched.stages[s].live), sched.stages[s].waiting | sched.stages[s].global_waiting)
            for s in range(stages)
        }
        if kind == "lost":
            lost.add(args[0])
            gen[args[0]] += 1
            apply(sched.handle(Lost(args[0], now)), before)
            continue
        if kind == "leave":
            apply(sched.handle(Lost(args[1], now, stage=args[0])), before)
            continue
        if kind == "join":
            p, donor = args
            # a donor gives every stage's state: it is live in every stage (not one that left a stage already)
            live = set.intersection(*(sched.stages[s].live for s in range(stages)))
            if p not in lost or not live:  # still there, or nobody left to take a state from
                continue
            donor = min(live) if donor == "any" else donor
            if donor is not None and donor not in live:
                continue
            lost.discard(p)
            log.append((now, None, (p, donor)))
            apply(sched.handle(Join(p, now, donor)), before)
            for s in range(stages):  # its first step after taking the state
                push(now + rng.uniform(1 - jitter, 1 + jitter) / speeds[p], "ready", s, p, gen[p])
            continue
        s, p, life = args
        if p in lost or life != gen[p]:
            continue
        step[(s, p)] += 1
        # a worker that did its last step asks for the global group (the epoch end)
        g_sync = step[(s, p)] >= steps or (global_every is not None and step[(s, p)] % global_every == 0)
        before[s][1].add(p)
        if step[(s, p)] % 2:  # the runtime's path (an event object) and the simulator's (GroupScheduler.ready)
            apply(sched.handle(Ready(p, step[(s, p)], now, global_sync=g_sync, stage=s)), before)
        else:
            apply(sched.ready(s, p, now, g_sync, step[(s, p)]), before)
    # everything left open must be explained by lost workers
    for st_ in sched.stages:
        assert st_.open is None or not (set(st_.open.members) - lost)
    return sched, log, step, lost


speeds_st = st.lists(st.floats(min_value=0.05, max_value=5.0), min_size=1, max_size=12)


@settings(max_examples=150, deadline=None)
@given(
    speeds=speeds_st,
    staleness=st.integers(1, 12),
    max_group=st.one_of(st.none(), st.integers(1, 12)),
    window=st.floats(min_value=0.0, max_value=2.0),
    seed=st.integers(0, 10_000),
    n_losses=st.integers(0, 3),
    stages=st.integers(1, 3),
    rule=st.sampled_from(WINDOW_RULES),
    horizon=st.floats(min_value=0.01, max_value=3.0),
    overlap=st.booleans(),
)
def test_invariants_under_random_speeds_and_losses(
    speeds, staleness, max_group, window, seed, n_losses, stages, rule, horizon, overlap
):
    D = len(speeds)
    policy = SchedulerPolicy(
        window=rule,
        overlap=overlap,
        horizon=horizon,
        max_group=max_group,
        window_init=window,
        window_min=0.0,
        window_max=max(window, 4.0),
        staleness=staleness,
        pair_threshold=6,
    )
    rng = random.Random(seed)
    losses = [(rng.uniform(0, 30), rng.randrange(D)) for _ in range(min(n_losses, D - 1))]
    _sched, log, _, _lost = drive(stages, speeds, policy, steps=25, losses=losses, seed=seed)

    per_round = {}
    dsu = {s: DisjointSet(range(D)) for s in range(stages)}
    since = {s: 0 for s in range(stages)}
    last_round = {s: None for s in range(stages)}
    for i, (_now, g, (live, waiting, _live_after, available_after)) in enumerate(log):
        # members are live workers of that stage, and each was waiting for a group
        assert set(g.members) <= live, (g, live)
        assert set(g.members) <= waiting
        # a worker is never in two groups of one round
        seen = per_round.setdefault((g.stage, g.round), set())
        assert not (seen & set(g.members)), (g, seen)
        seen |= set(g.members)
        assert max_group is None or g.reason in ("graph", "global", "preempted") or len(g.members) <= max(max_group, 3)
        # connectivity bound: recompute the union independently, once all groups of the round are in
        # (updates before the connecting round stay below P x D; with losses D shrinks, so bound by the start's D)
        last_round[g.stage] = g.round
        dsu[g.stage].union(g.members)
        round_done = i + 1 == len(log) or (log[i + 1][1].stage, log[i + 1][1].round) != (g.stage, g.round)
        if g.connected:
            if round_done:
                assert dsu[g.stage].connects(available_after | set(g.members)), g
                dsu[g.stage] = DisjointSet(range(D))
                since[g.stage] = 0
            continue
        if stages == 1:
            assert since[g.stage] < staleness * D, (since[g.stage], staleness, D)
        if g.reason != "preempted":  # preempted: the global group follows
            since[g.stage] += len(g.members)


@settings(max_examples=60, deadline=None)
@given(speeds=speeds_st, seed=st.integers(0, 10_000), staleness=st.integers(1, 6), rule=st.sampled_from(WINDOW_RULES))
def test_every_staleness_rounds_connect_the_stage(speeds, seed, staleness, rule):
    """Single stage, no losses: the updates before each connecting round stay below P x D."""
    D = len(speeds)
    policy = SchedulerPolicy(
        window=rule, window_init=0.05, window_min=0.0, window_max=0.2, staleness=staleness, max_group=max(1, D // 2)
    )
    _sched, log, _, _ = drive(1, speeds, policy, steps=30, seed=seed)
    rounds = {}
    for _, g, state in log:
        if len(state[3]) < D:  # a worker asked for the global group: the epoch ends, the global group connects
            break
        rounds.setdefault(g.round, []).append(g)
    assert rounds
    updates, dsu = 0, DisjointSet(range(D))
    for r in sorted(rounds):
        assert updates < staleness * D or D == 1, (updates, staleness, D)
        for g in rounds[r]:
            dsu.union(g.members)
        if dsu.connects(range(D)):
            assert all(g.connected for g in rounds[r])
            updates, dsu = 0, DisjointSet(range(D))
        else:
            assert not any(g.connected for g in rounds[r])
            updates += sum(len(g.members) for g in rounds[r])


def test_steps_a_worker_took_without_a_ready_signal_count_towards_the_bound():
    """Under overlapped averaging a worker whose last averaging is in flight goes on without a ready signal; the
    steps it took meanwhile still count as updates, so the bound stays one of steps."""

    def next_is_graph(step_gap):
        """Whether a graph-sync round opens by the fifth ready signal (sooner where steps were carried)."""
        st_ = StageScheduler(0, range(3), SchedulerPolicy(staleness=2, max_group=2, window="prototype"))
        # the same two twice, the second time after step_gap steps: {0, 1} leaves worker 2 out
        for w, step, t in ((0, 1, 0.0), (1, 1, 0.0), (0, 1 + step_gap, 1.0), (1, 1 + step_gap, 1.0)):
            st_.handle(Ready(w, step, t))
            if st_.open is not None and st_.open.graph:
                return True
        st_.handle(Ready(0, 2 + step_gap, 2.0))
        return st_.open.graph

    # two ready signals each (4 updates) reach (P - 1) x D = 3 either way; one each does not
    st_ = StageScheduler(0, range(3), SchedulerPolicy(staleness=10, max_group=2, window="prototype"))
    st_.handle(Ready(0, 1, 0.0))
    st_.handle(Ready(1, 1, 0.0))
    assert st_.since_reset == 2
    st_.handle(Ready(0, 5, 1.0))  # it went on for 3 steps without a ready signal: they count
    st_.handle(Ready(1, 2, 1.0))
    assert st_.since_reset == 2 + 4 + 1
    assert next_is_graph(1) and next_is_graph(4)
    st_.handle(Ready(2, 1, 2.0))
    assert not st_.open.graph or st_.since_reset >= 3


@settings(max_examples=80, deadline=None)
@given(
    speeds=speeds_st,
    seed=st.integers(0, 10_000),
    staleness=st.integers(1, 6),
    gaps=st.lists(st.integers(1, 4), min_size=1, max_size=20),
)
def test_the_bound_counts_the_steps_of_workers_that_skip_ready_signals(speeds, seed, staleness, gaps):
    """Workers whose ready signals come every few steps (random gaps; zero windows, so ordinary rounds are alone
    and only the bound connects the stage): the scheduler counts exactly the steps its groups' members took, and
    the steps before each connecting round stay below (P - 1) x D plus one ordinary round's."""
    D = len(speeds)
    rng = random.Random(seed)
    policy = SchedulerPolicy(staleness=staleness, window="prototype", window_init=0.0, window_min=0.0)
    st_ = StageScheduler(0, range(D), policy)
    step, last, since = [0] * D, [None] * D, 0  # a worker's first ready signal counts one step
    queue = [(rng.uniform(0.5, 1.5) / speeds[p], p) for p in range(D)]
    heapq.heapify(queue)
    for k in range(30 * D):
        now, p = heapq.heappop(queue)
        step[p] += gaps[k % len(gaps)]
        for g in st_.handle(Ready(p, step[p], now)):
            counted = sum(1 if last[m] is None else step[m] - last[m] for m in g.members)
            for m in g.members:
                last[m] = step[m]
                heapq.heappush(queue, (now + rng.uniform(0.5, 1.5) / speeds[m], m))
            if g.connected:
                assert since < (staleness - 1) * D + max(gaps) or D == 1, (since, staleness, D)
                since = 0
            else:
                since += counted
            assert st_.since_reset == since, (st_.since_reset, since, g)


@settings(max_examples=60, deadline=None)
@given(speeds=speeds_st, seed=st.integers(0, 10_000))
def test_full_groups_without_window_equal_allreduce(speeds, seed):
    D = len(speeds)
    _sched, log, _steps, _ = drive(2, speeds, POLICY_PRESETS["allreduce"], steps=10, seed=seed)
    assert all(g.members == tuple(range(D)) for _, g, _ in log)
    assert [g.reason for _, g, _ in log].count("global") == 2  # the last step of each stage
    assert all(g.reason in ("full", "graph") for _, g, _ in log if g.reason != "global")
    assert len(log) == 2 * 10  # one group per step per stage


@settings(max_examples=100, deadline=None)
@given(
    values=st.lists(st.lists(st.floats(-1e3, 1e3), min_size=3, max_size=3), min_size=2, max_size=10),
    groups=st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=10), max_size=30),
)
def test_group_averaging_conserves_the_sum(values, groups):
    """x_i <- mean(x_j, j in G) for i in G is doubly stochastic: the sum over replicas never changes."""
    D = len(values)
    x = [list(v) for v in values]
    total = [sum(col) for col in zip(*x, strict=True)]
    for g in groups:
        members = sorted({m % D for m in g})
        avg = [sum(x[m][k] for m in members) / len(members) for k in range(3)]
        for m in members:
            x[m] = list(avg)
    for k, col in enumerate(zip(*x, strict=True)):
        assert math.isclose(sum(col), total[k], rel_tol=1e-9, abs_tol=1e-6)


@settings(max_examples=100, deadline=None)
@given(
    values=st.lists(st.floats(-1e3, 1e3), min_size=2, max_size=10),
    events=st.lists(st.one_of(st.integers(0, 9), st.lists(st.integers(0, 9), min_size=1, max_size=10)), max_size=40),
)
def test_progress_weighting_conserves_the_mass_weighted_sum(values, events):
    """weighting="progress": a step adds 1 to a replica's mass; a group sets every member to
    sum(m_j x_j) / sum(m_j) and the mean mass: sum(m_i x_i) changes only by the steps' own updates."""
    D = len(values)
    x, m = list(values), [1.0] * D
    for ev in events:
        if isinstance(ev, int):  # a step of replica ev % D moving its value by 1
            i = ev % D
            x[i] += 1.0
            m[i] += 1.0
            continue
        members = sorted({k % D for k in ev})
        before = sum(m[k] * x[k] for k in members)
        mass = sum(m[k] for k in members)
        for k in members:
            x[k], m[k] = before / mass, mass / len(members)
        assert math.isclose(sum(m[k] * x[k] for k in members), before, rel_tol=1e-9, abs_tol=1e-6)
        assert min(values) - 50 <= x[members[0]] <= max(values) + 50  # a convex combination stays in range


def test_straggler_is_left_out_of_most_groups():
    speeds = [1.0, 1.0, 1.0, 0.25]
    policy = SchedulerPolicy(window="prototype", window_init=0.05, window_max=0.2, window_min=0.001, staleness=3)
    _sched, log, _, _ = drive(1, speeds, policy, steps=40)
    groups = [g for _, g, _ in log if len(g.members) > 1]
    with_slow = sum(3 in g.members for g in groups)
    assert with_slow < len(groups) / 2
    assert any(g.reason == "graph" for _, g, _ in log)  # the bound pulled the straggler in


def test_prototype_window_closes_rounds_and_adapts():
    policy = SchedulerPolicy(window="prototype", window_init=0.001, window_max=0.004, window_min=0.0005)
    s = StageScheduler(0, range(3), policy)
    assert s.handle(Ready(0, 1, 0.0)) == [] and s.next_deadline() == 0.001
    assert s.handle(Ready(2, 1, 0.0004)) == []
    [g] = s.handle(Tick(0.001))
    assert (g.members, g.reason, g.wait) == ((0, 2), "window", 0.001)
    assert dict(g.windows) == {0: pytest.approx(0.0009), 2: pytest.approx(0.0009)}
    [g] = s.handle(Ready(1, 1, 0.002)) or s.handle(Tick(0.003))
    assert (g.members, g.reason) == ((1,), "alone") and dict(g.windows)[1] == 0.002  # doubled
    s.handle(Ready(1, 2, 0.01))
    [g] = s.handle(Tick(0.02))
    assert dict(g.windows)[1] == 0.004  # doubled again, capped at window_max


def test_full_round_closes_at_once():
    s = StageScheduler(0, range(3), SchedulerPolicy(max_group=2))
    s.handle(Ready(1, 1, 0.0))
    [g] = s.handle(Ready(0, 1, 0.0001))
    assert (g.members, g.reason) == ((0, 1), "full")


def test_global_sync_waits_for_every_live_worker_and_preempts():
    s = StageScheduler(0, range(3))
    s.handle(Ready(0, 5, 0.0))
    out = s.handle(Ready(1, 5, 0.0001, global_sync=True))
    assert [(g.members, g.reason) for g in out] == [((0,), "preempted")]
    assert s.handle(Ready(0, 5, 0.0002, global_sync=True)) == []
    [g] = s.handle(Ready(2, 5, 0.0003, global_sync=True))
    assert (g.members, g.reason, g.connected) == ((0, 1, 2), "global", True)


def test_lost_worker_releases_a_waiting_global_group():
    s = StageScheduler(0, range(3))
    s.handle(Ready(0, 5, 0.0, global_sync=True))
    s.handle(Ready(1, 5, 0.0, global_sync=True))
    [g] = s.handle(Lost(2, 0.1))
    assert g.members == (0, 1) and g.reason == "global"
    assert s.live == {0, 1}


def test_pairs_above_threshold():
    """Neighbours: adjacent ids; across: the first half of the members (by component) with the second."""
    for pairing, pairs in (("neighbours", [(0, 2), (5, 7, 9)]), ("across", [(0, 5, 9), (2, 7)])):
        s = StageScheduler(0, range(10), SchedulerPolicy(pair_threshold=8, pairing=pairing, window="prototype"))
        for w in (7, 2, 5, 0, 9):
            s.handle(Ready(w, 1, 0.0))
        out = s.handle(Tick(1.0))
        assert [g.members for g in out] == pairs, pairing
        assert len({g.round for g in out}) == 1


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(4, 40),
    unions=st.lists(st.lists(st.integers(0, 39), min_size=2, max_size=6), max_size=30),
    data=st.data(),
)
def test_pairs_across_join_different_components_where_they_can(n, unions, data):
    """Across: every pair joins two components whenever the round's members lie in two or more and none holds
    more than half of them; it never joins fewer than the neighbours' pairs do."""
    from sdpipe.core.scheduler.stage import _split

    dsu = DisjointSet(range(n))
    for u in unions:
        dsu.union([w % n for w in u])
    members = sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=4, max_size=n)))
    across = _split(members, "across", dsu.find)
    assert sorted(w for g in across for w in g) == members and all(len(g) in (2, 3) for g in across)
    merges = lambda groups: sum(dsu.merges(g) for g in groups)  # each group on its own: the pairs are disjoint
    assert merges(across) >= merges(_split(members, "neighbours", dsu.find))
    sizes = Counter(dsu.find(m) for m in members)
    if len(sizes) > 1 and max(sizes.values()) <= len(members) // 2:
        assert all(dsu.merges(g) >= 1 for g in across), across


def test_bad_events_are_rejected():
    s = StageScheduler(0, range(2))
    s.handle(Ready(0, 1, 0.0))
    with pytest.raises(ValueError, match="already waiting"):
        s.handle(Ready(0, 1, 0.0))
    with pytest.raises(ValueError, match="not a live worker"):
        s.handle(Ready(7, 1, 0.0))
    with pytest.raises(ValueError, match=r"policy.staleness: 0 is not allowed"):
        SchedulerPolicy(staleness=0)
    with pytest.raises(ValueError, match="unknown parameter"):
        SchedulerPolicy().updated(wait=3)


def test_snapshot_restores_the_state():
    s = StageScheduler(1, range(4), SchedulerPolicy(staleness=3))
    s.handle(Ready(0, 1, 0.0))
    s.handle(Ready(1, 1, 0.0005))
    s.handle(Tick(0.01))
    r = StageScheduler.restore(s.snapshot())
    assert (r.round, r.since_reset, r.windows, r.live) == (s.round, s.since_reset, s.windows, s.live)
    assert r.dsu.connects([0, 1]) and not r.dsu.connects([0, 2])


@settings(max_examples=100, deadline=None)
@given(n=st.integers(1, 30), unions=st.lists(st.lists(st.integers(0, 29), min_size=1, max_size=5), max_size=40))
def test_disjoint_set_counts_its_components(n, unions):
    d = DisjointSet(range(n))
    for u in unions:
        u = [x % n for x in u]
        before = d.count
        merges = d.merges(u)
        d.union(u)
        assert d.count == before - merges
        assert d.count == len({d.find(i) for i in range(n)})
    assert d.copy().count == d.count


def test_a_joiner_is_grouped_only_after_its_join_and_the_global_waits_for_it_from_then():
    st_ = StageScheduler(0, [0, 1], POLICY_PRESETS["allreduce"])
    with pytest.raises(ValueError, match="not a live worker"):
        st_.handle(Ready(2, 1, 0.1))
    with pytest.raises(ValueError, match="donor: 5 is not a live worker of stage 0"):
        st_.handle(Join(2, 0.1, donor=5))
    assert st_.handle(Join(2, 0.2, donor=0)) == []
    with pytest.raises(ValueError, match="worker: 2 already takes part in stage 0"):
        st_.handle(Join(2, 0.3))
    assert st_.dsu.connects([0, 2]) and not st_.dsu.connects([1, 2])  # it holds the donor's model
    # an allreduce round now waits for all three
    assert st_.handle(Ready(0, 1, 1.0)) == [] and st_.handle(Ready(1, 1, 1.1)) == []
    (g,) = st_.handle(Ready(2, 1, 1.2))
    assert g.members == (0, 1, 2) and g.reason == "full"
    # so does the global group
    assert st_.handle(Ready(0, 2, 2.0, global_sync=True)) == []
    assert st_.handle(Ready(1, 2, 2.0, global_sync=True)) == []
    (g,) = st_.handle(Ready(2, 2, 2.5, global_sync=True))
    assert g.members == (0, 1, 2) and g.reason == "global"
    # a worker lost and back: rejoins without a donor, as a component of its own
    st_.handle(Lost(1, 3.0))
    st_.handle(Join(1, 4.0))
    assert st_.live == {0, 1, 2} and not st_.dsu.connects([0, 1])


@settings(max_examples=120, deadline=None)
@given(
    speeds=st.lists(st.floats(min_value=0.1, max_value=5.0), min_size=2, max_size=10),
    joiners=st.integers(1, 4),
    seed=st.integers(0, 10_000),
    staleness=st.integers(2, 8),
    stages=st.integers(1, 3),
    rule=st.sampled_from(WINDOW_RULES),
    overlap=st.booleans(),
    n_losses=st.integers(0, 2),
)
def test_joins_under_random_speeds_losses_and_rejoins(
    speeds, joiners, seed, staleness, stages, rule, overlap, n_losses
):
    """Pipelines join (with a donor's state, or their own) and lost ones rejoin while the others train:
    nobody is grouped before its join, every global group holds every live worker, the union a connected round
    reports (joiners counted in their donor's component from the join) does connect, and nothing deadlocks."""
    D = len(speeds)
    first = max(1, D - joiners)
    rng = random.Random(seed)
    joins = [(rng.uniform(0, 20), p, rng.choice([None, "any"])) for p in range(first, D)]
    losses = [(rng.uniform(0, 20), rng.randrange(D)) for _ in range(n_losses)]
    joins += [(t + rng.uniform(0.5, 5), p, rng.choice([None, "any"])) for t, p in losses]  # and back
    policy = SchedulerPolicy(window=rule, overlap=overlap, staleness=staleness, window_init=0.01, pair_threshold=6)
    _sched, log, step, lost = drive(
        stages, speeds, policy, steps=20, losses=losses, joins=joins, seed=seed, start=range(first)
    )
    joined_at = {p: 0.0 for p in range(first)}
    dsu = {s: DisjointSet(range(first)) for s in range(stages)}
    for i, (now, g, info) in enumerate(log):
        if g is None:  # a join
            p, donor = info
            joined_at[p] = now
            for s in range(stages):
                dsu[s].find(p)
                if donor is not None:
                    dsu[s].union([donor, p])
            continue
        live, waiting, live_after, available_after = info
        assert set(g.members) <= live and set(g.members) <= waiting, (g, live, waiting)
        assert all(joined_at.get(m, math.inf) <= now for m in g.members), (g, joined_at)
        if g.reason == "global":  # every worker live once the event is applied (a leave may be what closed it)
            assert set(g.members) == live_after, (g, live_after)
            dsu[g.stage] = DisjointSet(live_after)
            continue
        dsu[g.stage].union(g.members)
        round_done = (
            i + 1 == len(log)
            or log[i + 1][1] is None
            or ((log[i + 1][1].stage, log[i + 1][1].round) != (g.stage, g.round))
        )
        if g.connected and round_done:
            assert dsu[g.stage].connects(available_after | set(g.members)), (g, available_after)
            dsu[g.stage] = DisjointSet(live_after)
    # every pipeline there at the end trained after its (last) join
    assert all(step[(s, p)] > 0 for s in range(stages) for p in range(D) if p not in lost)


def test_decided_groups_are_ordinary_frozen_groups():
    """The core builds a round's groups without the dataclass's __init__: they equal, hash and refuse changes as
    groups built by it do."""
    import dataclasses

    from sdpipe.core.scheduler import Group

    s = StageScheduler(0, range(8), SchedulerPolicy(pair_threshold=2))
    out = []
    for w in range(8):
        out += s.handle(Ready(w, 0, 0.01 * w))
    out += s.handle(Tick(10.0))
    assert out and all(type(g) is Group for g in out)
    for g in out:
        twin = Group(*(getattr(g, f.name) for f in dataclasses.fields(Group)))
        assert g == twin and hash(g) == hash(twin) and repr(g) == repr(twin) and g.to_dict() == twin.to_dict()
        with pytest.raises(dataclasses.FrozenInstanceError):
            g.reason = "changed"


def _pipelines_model(sched, stages, pipelines, held, rng, steps):
    """Blocking workers of real pipelines against ``sched``: a pipeline makes its next step only when none of
    its workers waits in a round (a stage's step needs its neighbours' activations and gradients of that
    step), then each of its workers (in a random order of stages) sends a ready signal at that step.  ``held``:
    per stage, the pipelines whose ready signal at their current step waits in the stage's open round; the
    others' was already grouped.  Returns every decided group; fails when no pipeline can move."""
    step = {p: 10 for p in range(pipelines)}
    decided = []
    t = 0.0
    for s in range(stages):  # the grouped ones' round, then the held ones' ready signals
        for p in range(pipelines):
            t += 0.001
            decided += sched.ready(s, p, t, False, step[p] - (p in held[s]))
        for p in sorted(held[s]):
            t += 0.001
            decided += sched.ready(s, p, t, False, step[p])
    for _ in range(steps):
        waiting = set().union(*(st_.waiting for st_ in sched.stages))
        free = [p for p in range(pipelines) if p not in waiting]
        assert free, [(st_.stage, sorted(st_.waiting)) for st_ in sched.stages]
        p = rng.choice(free)
        step[p] += 1
        for s in rng.sample(range(stages), stages):
            t += 0.001
            decided += sched.ready(s, p, t, False, step[p])
        check_open_rounds(sched)
    return decided


#: pipelines of 2 to 4 stages, 2 to 6 of them, a draw of which are held where, and a seed for their order
PIPELINE_SHAPES = dict(
    stages=st.integers(2, 4), pipelines=st.integers(2, 6), data=st.data(), seed=st.integers(0, 2**16)
)


@settings(max_examples=150, deadline=None)
@given(**PIPELINE_SHAPES)
def test_rounds_without_a_deadline_never_wait_on_each_other_across_stages(stages, pipelines, data, seed):
    """Under the allreduce preset (rounds close only when full), stages whose rounds were formed from ready
    signals at different steps of the same pipelines (a live switch from overlapped averaging) never deadlock:
    a cycle of rounds that wait for workers blocked by their siblings in the other rounds is broken."""
    held = [
        data.draw(st.sets(st.integers(0, pipelines - 1), max_size=pipelines - 1), label=f"held {s}")
        for s in range(stages)
    ]
    sched = GroupScheduler(stages, pipelines, POLICY_PRESETS["allreduce"])
    _pipelines_model(sched, stages, pipelines, held, random.Random(seed), 30 * pipelines)


@settings(max_examples=100, deadline=None)
@given(**PIPELINE_SHAPES)
def test_ready_signals_in_step_keep_the_allreduce_groups_whole(stages, pipelines, data, seed):
    """The same pipelines whose stages' rounds hold the same pipelines (ready signals in line, as from the
    start of a run): every group holds every worker; the cycle rule never closes one early."""
    same = data.draw(st.sets(st.integers(0, pipelines - 1), max_size=pipelines - 1))
    sched = GroupScheduler(stages, pipelines, POLICY_PRESETS["allreduce"])
    decided = _pipelines_model(sched, stages, pipelines, [same] * stages, random.Random(seed), 30 * pipelines)
    assert decided and all(g.reason == "full" and len(g.members) == pipelines for g in decided), decided


def test_a_cycle_of_rounds_across_stages_closes_the_first_opened():
    """Stage 0 waits for pipeline 1 (blocked by its stage-1 worker, held at step 2), stage 1 waits for
    pipeline 0 (blocked by its stage-0 worker, held at step 6): stage 0's round, opened first, closes."""
    sched = GroupScheduler(2, 2, POLICY_PRESETS["allreduce"])
    sched.ready(0, 0, 0.0, False, 5)
    sched.ready(0, 1, 0.1, False, 2)
    sched.ready(1, 0, 0.2, False, 6)
    sched.ready(1, 1, 0.3, False, 1)
    assert sched.ready(0, 0, 0.4, False, 6) == []
    (g,) = sched.ready(1, 1, 0.5, False, 2)
    assert (g.stage, g.members, g.reason) == (0, (0,), "preempted")
    assert sched.stages[1].waiting == {1} and sched.stages[0].open is None


def test_stages_hold_graph_syncs_at_once():
    """Each stage starts its graph sync on its own: stage 1 opens one while stage 0 holds one."""
    sched = GroupScheduler(2, 2, SchedulerPolicy(staleness=1, window_init=0.001))
    assert sched.handle(Ready(0, 1, 0.0, stage=0)) == []  # P = 1: every round a graph sync
    assert sched.handle(Ready(0, 1, 0.0, stage=1)) == []
    assert sched.graph_stages() == [0, 1] and sched.tick(0.5) == []  # no window: they wait for worker 1
    [g] = sched.handle(Ready(1, 1, 0.6, stage=0))
    assert (g.stage, g.reason, g.members) == (0, "graph", (0, 1)) and sched.graph_stages() == [1]
    [g] = sched.handle(Ready(1, 1, 0.7, stage=1))
    assert (g.stage, g.reason, g.members) == (1, "graph", (0, 1)) and sched.graph_stages() == []


@settings(max_examples=150, deadline=None)
@given(**PIPELINE_SHAPES)
def test_graph_syncs_of_several_stages_never_wait_on_each_other(stages, pipelines, data, seed):
    """Every round a graph sync (P = 1) in every stage at once, the stages' rounds formed from ready signals at
    different steps of the same pipelines: no pipeline is ever blocked for good (a cycle of graph syncs that wait
    for workers blocked by their siblings in the others is broken), and every graph sync that closes as one
    connects its stage."""
    held = [
        data.draw(st.sets(st.integers(0, pipelines - 1), max_size=pipelines - 1), label=f"held {s}")
        for s in range(stages)
    ]
    sched = GroupScheduler(stages, pipelines, SchedulerPolicy(staleness=1))
    decided = _pipelines_model(sched, stages, pipelines, held, random.Random(seed), 30 * pipelines)
    assert all(g.reason in ("graph", "preempted") for g in decided), {g.reason for g in decided}
    since = {s: DisjointSet(range(pipelines)) for s in range(stages)}  # per stage, the groups since it connected
    for g in decided:
        since[g.stage].union(g.members)
        if g.reason == "graph":
            assert since[g.stage].count == 1, g
            since[g.stage] = DisjointSet(range(pipelines))


def test_one_entry_point_takes_every_event_and_says_which_stage_it_needs():
    """handle(event) routes by the event's type and stage: a Lost or Join without a stage is a whole pipeline's,
    with one a single worker's; Ready and Hurry name their stage; Retune changes every stage's parameters."""
    sched = GroupScheduler(2, 3, SchedulerPolicy(window="prototype", window_init=10.0, window_max=10.0))
    sched.handle(Lost(2, 0.0))
    assert all(st_.live == {0, 1} for st_ in sched.stages)
    sched.handle(Join(2, 0.1, donor=0, stage=1))
    assert [st_.live for st_ in sched.stages] == [{0, 1}, {0, 1, 2}]
    with pytest.raises(ValueError, match="worker: 2 already takes part in stage 1"):
        sched.handle(Join(2, 0.2, donor=0))  # every stage: stage 1 has it already
    sched.handle(Lost(2, 0.3, stage=1))
    sched.handle(Join(2, 0.4, donor=0))
    assert all(st_.live == {0, 1, 2} for st_ in sched.stages)
    with pytest.raises(ValueError, match="needs the stage of its worker"):
        sched.handle(Ready(0, 1, 0.5))
    assert sched.handle(Ready(0, 1, 0.5, stage=0)) == []
    [g] = sched.handle(Hurry(0, 0.6, stage=0))  # its epoch's end: the round closes with what it holds
    assert (g.stage, g.members, g.reason) == (0, (0,), "preempted")
    sched.handle(Retune(SchedulerPolicy(max_group=2), 0.7))
    assert all(st_.policy.max_group == 2 for st_ in sched.stages) and sched.policy.max_group == 2
    with pytest.raises(TypeError, match="is not Ready, Lost, Tick, Join, Hurry or Retune"):
        sched.handle("ready")
    sched.validate()


@settings(max_examples=80, deadline=None)
@given(
    fast=st.lists(st.floats(min_value=0.5, max_value=2.0), min_size=9, max_size=24),
    slow=st.lists(st.floats(min_value=0.02, max_value=0.5), min_size=0, max_size=3),
    seed=st.integers(0, 10_000),
    staleness=st.integers(2, 8),
    pairing=st.sampled_from(["across", "neighbours"]),
    rule=st.sampled_from(WINDOW_RULES),
)
def test_the_longest_unconnected_stretch_stays_below_the_bound(fast, slow, seed, staleness, pairing, rule):
    """Random speeds (fast workers and up to three stragglers of up to 50x) and arrival orders, above the pairing
    threshold: the scheduler's own count of the longest unconnected stretch (``bounds()``) agrees with an
    independent count over its groups, and stays within the bound."""
    speeds = fast + slow
    D = len(speeds)
    policy = SchedulerPolicy(window=rule, staleness=staleness, pairing=pairing, window_init=0.05, window_max=0.2)
    sched, log, _, _ = drive(1, speeds, policy, steps=12, seed=seed)
    since, longest, dsu = 0, 0, DisjointSet(range(D))
    rounds: dict = {}
    for _, g, _state in log:
        rounds.setdefault(g.round, []).append(g)
    for r in sorted(rounds):
        groups = rounds[r]
        if groups[0].reason == "global":
            since, dsu = 0, DisjointSet(range(D))
            continue
        for g in groups:
            dsu.union(g.members)
        if groups[0].connected:
            since, dsu = 0, DisjointSet(range(D))
        else:
            since += sum(len(g.members) for g in groups)
            if groups[0].reason != "preempted":  # cut short by the epoch's end: the global group follows
                longest = max(longest, since)
    (b,) = sched.bounds()
    assert b["bound"] == staleness * len(sched.stages[0].live)
    # below P x D before the stretch's last round (which may be a round that a global group cut short), so with it
    # below P x D plus one round's members
    assert b["longest"] == longest and longest < staleness * D + D, (b, longest)


def test_a_graph_sync_starts_earlier_by_the_steps_ready_signals_carry():
    """Ready signals that carry steps taken without one (overlapped averaging in flight) move the graph sync
    earlier by that many steps of every worker, so the steps its members bring stay within the bound; the lag
    seen in one stretch still counts in the next, then is forgotten."""

    def stage(staleness):
        return StageScheduler(0, range(10), SchedulerPolicy(staleness=staleness, max_group=2, window="prototype"))

    st_ = stage(6)
    for w in range(10):  # one step each, in pairs that connect nothing across pairs: 10 updates
        st_.handle(Ready(w, 1, 0.0))
        st_.handle(Tick(0.0 + 1e-9 * w)) if w % 2 else None
    assert st_.since_reset == 10 and not st_.needs_graph_sync()  # (P - 1) x D = 50 is far
    st_.handle(Ready(0, 5, 1.0))  # it carried 3 steps beyond its own: the graph sync is due at (6 - 1 - 3) x 10
    st_.handle(Ready(1, 2, 1.0))
    st_.handle(Tick(2.0))
    assert st_.bound.lag == 0 and st_.bound._lag_now == 3
    assert st_.since_reset == 10 + 4 + 1 and not st_.needs_graph_sync()
    st_.bound.since_reset = 20
    assert st_.needs_graph_sync()
    st_.bound.reset()  # the stretch ends: its lag counts in the next one, then goes
    assert (st_.bound.lag, st_.bound._lag_now) == (3, 0) and st_.needs_graph_sync() is False
    st_.bound.since_reset = 20
    assert st_.needs_graph_sync()
    st_.bound.reset()
    st_.bound.since_reset = 20
    assert not st_.needs_graph_sync()


# ------------------------------------------------------------------ the scheduler in shards (one per stage)


def _sharded_model(stages, pipelines, held, rng, steps, policy, shards=None):
    """:func:`_pipelines_model` against shards whose messages arrive late and in random orders (FIFO per pair of
    shards): after each ready signal 0 to 3 queued messages arrive; when no pipeline can move, every message
    arrives first.  Returns every decided group and the scheduler."""
    sched = ShardedScheduler(stages, pipelines, policy, shards=shards, immediate=False)
    step = {p: 10 for p in range(pipelines)}
    decided, t = [], 0.0

    def ready(s, p, k):
        nonlocal t, decided
        t += 0.001
        decided += sched.ready(s, p, t, False, k)
        decided += sched.deliver(t, count=rng.randint(0, 3), rng=rng)

    for s in range(stages):
        for p in range(pipelines):
            ready(s, p, step[p] - (p in held[s]))
        for p in sorted(held[s]):
            ready(s, p, step[p])
    for _ in range(steps):
        free = [p for p in range(pipelines) if not any(p in st_.waiting for st_ in sched.stages)]
        if not free:  # the views behind: every message arrives, then some pipeline must move
            decided += sched.deliver(t)
            sched.validate()
            free = [p for p in range(pipelines) if not any(p in st_.waiting for st_ in sched.stages)]
        assert free, [(st_.stage, sorted(st_.waiting)) for st_ in sched.stages]
        p = rng.choice(free)
        step[p] += 1
        for s in rng.sample(range(stages), stages):
            ready(s, p, step[p])
        sched.validate()
    decided += sched.deliver(t)
    sched.validate()
    return decided, sched


@settings(max_examples=150, deadline=None)
@given(**PIPELINE_SHAPES, graph=st.booleans(), grouped=st.booleans())
def test_shards_whose_messages_come_late_never_deadlock(stages, pipelines, data, seed, graph, grouped):
    """The cases of the two tests above (rounds of the allreduce preset, or graph syncs in every stage) with the
    stages' rounds decided in shards (one per stage, or two shards for all stages) that learn each other's
    waits only by messages, late and in random orders: no pipeline is ever blocked for good, and every graph
    sync that closes as one connects its stage."""
    held = [
        data.draw(st.sets(st.integers(0, pipelines - 1), max_size=pipelines - 1), label=f"held {s}")
        for s in range(stages)
    ]
    policy = SchedulerPolicy(staleness=1) if graph else POLICY_PRESETS["allreduce"]
    decided, _ = _sharded_model(
        stages, pipelines, held, random.Random(seed), 30 * pipelines, policy, shards=2 if grouped else None
    )
    since = {s: DisjointSet(range(pipelines)) for s in range(stages)}
    for g in decided:
        since[g.stage].union(g.members)
        if g.reason == "graph":
            assert since[g.stage].count == 1, g
            since[g.stage] = DisjointSet(range(pipelines))


@settings(max_examples=60, deadline=None)
@given(**PIPELINE_SHAPES)
def test_shards_keep_the_allreduce_groups_whole_when_ready_signals_are_in_step(stages, pipelines, data, seed):
    """Ready signals in line: however late the shards' messages, no round is closed early (no cycle that is not
    there is ever broken)."""
    same = data.draw(st.sets(st.integers(0, pipelines - 1), max_size=pipelines - 1))
    decided, _ = _sharded_model(
        stages, pipelines, [same] * stages, random.Random(seed), 30 * pipelines, POLICY_PRESETS["allreduce"]
    )
    assert decided and all(g.reason == "full" and len(g.members) == pipelines for g in decided), decided


def test_a_cycle_across_shards_is_broken_by_the_shard_of_its_first_opened_round():
    """The case of ``test_a_cycle_of_rounds_across_stages_closes_the_first_opened`` in two shards: the cycle
    closes with stage 1's ready signal; stage 0's shard breaks it once stage 1's edge reaches it, and its
    message that the round closed reaches stage 1's shard."""
    sched = ShardedScheduler(2, 2, POLICY_PRESETS["allreduce"], immediate=False)
    for s, p, t, k in ((0, 0, 0.0, 5), (0, 1, 0.1, 2), (1, 0, 0.2, 6), (1, 1, 0.3, 1), (0, 0, 0.4, 6)):
        sched.ready(s, p, t, False, k)
    sched.deliver(0.4)
    assert sched.ready(1, 1, 0.5, False, 2) == []  # stage 1's shard sees the cycle, but it is not its round's to break
    [g] = sched.deliver(0.6)
    assert (g.stage, g.members, g.reason) == (0, (0,), "preempted")
    assert sched.stages[1].waiting == {1} and sched.stages[0].open is None and sched.pending() == 0
    assert sched.shards[1].remote == {} and sched.sent > 0
    sched.validate()


@settings(max_examples=100, deadline=None)
@given(**PIPELINE_SHAPES, graph=st.booleans())
def test_shards_whose_messages_arrive_at_once_decide_the_groups_of_one_scheduler(stages, pipelines, data, seed, graph):
    """The cycle tests' cases on one scheduler and on shards whose messages arrive at once: the same groups (each
    stage's, in its order; the preempted rounds included)."""
    held = [data.draw(st.sets(st.integers(0, pipelines - 1), max_size=pipelines - 1)) for _ in range(stages)]
    policy = SchedulerPolicy(staleness=1) if graph else POLICY_PRESETS["allreduce"]
    runs = [
        _pipelines_model(sched, stages, pipelines, held, random.Random(seed), 20 * pipelines)
        for sched in (GroupScheduler(stages, pipelines, policy), ShardedScheduler(stages, pipelines, policy))
    ]
    by_stage = [sorted((g.stage, g.round, g.members, g.reason) for g in run) for run in runs]
    assert by_stage[0] == by_stage[1]
