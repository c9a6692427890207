"""Rule "arrival" of the pure group scheduler: rounds that wait for the workers predicted to come, and no one else."""

import itertools
import math
import random
import statistics
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_scheduler_core import drive

from sdpipe.core.scheduler import GroupScheduler, Lost, Ready, SchedulerPolicy, StageScheduler, Tick

#: the workers of these tests wait for their group before their next step (``drive`` and the hand-made events),
#: as with blocking averaging; intervals then run from a worker's release to its next ready signal
BLOCKING = SchedulerPolicy(overlap=False)


def settle(s, period=1.0, rounds=3, workers=None):
    """Give every worker of ``s`` a history: all come together every ``period`` seconds for ``rounds`` rounds."""
    workers = sorted(workers if workers is not None else s.live)
    t = 0.0
    for _ in range(rounds):
        for w in workers:
            s.handle(Ready(w, 1, t))
        s.handle(Tick(t + 0.6 * period))  # the prototype's window, or rule arrival's horizon (0.5 x period)
        assert s.open is None
        t += period
    return t - period  # the time of the last ready


def with_overdue(D, late, period=1.0):
    """A stage whose ``late`` workers missed a step: the others are due at the returned time, the late ones
    are overdue by a whole step."""
    s = StageScheduler(0, range(D), BLOCKING)
    last = settle(s, period)
    for w in sorted(set(range(D)) - set(late)):
        s.handle(Ready(w, 2, last + period))
    [g] = s.handle(Tick(s.next_deadline()))
    assert set(g.members) == set(range(D)) - set(late) and g.wait == pytest.approx(0.5 * period)  # the horizon
    return s, g.closed + period


class Opened:
    """Drives a GroupScheduler like ``drive`` does and records, for every round opened under rule "arrival",
    the planned wait and the horizon it was planned under."""

    def __init__(self, sched):
        self.plans = []
        for st_ in sched.stages:
            plan = st_._plan

            def spy(r, opener, now, st_=st_, plan=plan):
                plan(r, opener, now)
                typical = st_.arrivals.typical()
                if r.expected is not None:
                    self.plans.append((r.deadline - now, st_.policy.horizon_fraction * typical, len(r.expected)))

            st_._plan = spy


def test_equal_speeds_fill_their_groups():
    """Four workers of equal speed, 5% jitter: after the first steps the rounds hold everyone."""
    policy = BLOCKING.updated(staleness=10)
    _sched, log, _, _ = drive(1, [1.0] * 4, policy, steps=40, jitter=0.05, seed=3)
    ordinary = [g for _, g, _ in log if g.reason not in ("graph", "global", "preempted")][4:]
    assert sum(len(g.members) == 4 for g in ordinary) >= 0.9 * len(ordinary), Counter(len(g.members) for g in ordinary)
    assert sum(g.reason in ("full", "arrived") for g in ordinary) >= 0.9 * len(ordinary)

    proto = BLOCKING.updated(window="prototype", staleness=10)
    _, log, _, _ = drive(1, [1.0] * 4, proto, steps=40, jitter=0.05, seed=3)
    ordinary = [g for _, g, _ in log if g.reason not in ("graph", "global", "preempted")][4:]
    assert sum(len(g.members) == 4 for g in ordinary) < 0.5 * len(ordinary)  # a 10 ms window misses 1 s steps


def test_a_straggler_is_not_waited_for():
    """Pipeline 3 four times slower: the fast three average together, the slow one joins few rounds."""
    _sched, log, _, _ = drive(1, [1.0, 1.0, 1.0, 0.25], BLOCKING, steps=60, jitter=0.05, seed=1)
    # while all four train (the fast ones end their 60 steps first and wait for the global group)
    ordinary = [g for _, g, state in log if g.reason not in ("graph", "global", "preempted") and len(state[3]) == 4]
    fast = [g for g in ordinary if set(g.members) & {0, 1, 2}]
    assert sum(len(g.members) >= 2 for g in fast) >= 0.8 * len(fast)
    assert sum(3 in g.members for g in ordinary) <= 0.3 * len(ordinary)
    # the fast workers' rounds close when the fast ones came, long before the straggler would
    assert max(g.wait for g in fast if 3 not in g.members) < 0.5


def test_round_closes_as_soon_as_the_expected_came():
    s = StageScheduler(0, range(3), BLOCKING)
    last = settle(s, period=1.0)
    assert s.handle(Ready(0, 2, last + 1.0)) == []
    assert s.open.expected == frozenset({1, 2})
    assert s.handle(Ready(2, 2, last + 1.01)) == []
    [g] = s.handle(Ready(1, 2, last + 1.02))
    assert (g.members, g.reason) == ((0, 1, 2), "full")  # everybody: full
    s, due = with_overdue(4, late=[3])  # worker 3 is a step overdue: not waited for
    s.handle(Ready(0, 3, due))
    assert s.open.expected == frozenset({1, 2})
    s.handle(Ready(1, 3, due + 0.01))
    [g] = s.handle(Ready(2, 3, due + 0.02))
    assert (g.members, g.reason, g.closed) == ((0, 1, 2), "arrived", due + 0.02)


def test_nobody_predicted_closes_at_once():
    s = StageScheduler(0, range(3), BLOCKING)
    last = settle(s, period=1.0)
    # worker 0 comes early: the others are due in 0.9 s, beyond the horizon (0.5 x 1 s)
    [g] = s.handle(Ready(0, 2, last + 0.1))
    assert (g.members, g.reason, g.wait) == ((0,), "alone", 0.0)


def test_overdue_worker_is_not_waited_for():
    s, due = with_overdue(3, late=[2])
    s.handle(Ready(0, 3, due))
    assert s.open.expected == frozenset({1})


def test_workers_leaving_a_global_group_are_expected_within_the_horizon():
    """After a global group the workers evaluate: no prediction, but they come out together, so they are waited
    for up to the horizon, and their next interval (with the evaluation in it) is not learnt."""
    s = StageScheduler(0, range(3), BLOCKING)
    last = settle(s, period=1.0)
    for w in range(3):
        s.handle(Ready(w, 2, last + 1.0, global_sync=True))
    assert s.open is None
    s.handle(Ready(2, 3, last + 5.0))  # long after: the evaluation
    assert s.open.expected == frozenset({0, 1}) and s.next_deadline() == pytest.approx(last + 5.5)
    s.handle(Ready(0, 3, last + 5.1))
    [g] = s.handle(Ready(1, 3, last + 5.2))
    assert g.reason == "full" and s.arrivals.typical() == pytest.approx(1.0, rel=0.05)


def test_a_lost_expected_worker_releases_the_round():
    s, due = with_overdue(5, late=[4])
    s.handle(Ready(0, 3, due))
    s.handle(Ready(1, 3, due + 0.01))
    s.handle(Ready(2, 3, due + 0.01))
    [g] = s.handle(Lost(3, due + 0.02))
    assert (g.members, g.reason) == ((0, 1, 2), "arrived")


def test_global_sync_of_an_expected_worker_releases_the_round():
    s = StageScheduler(0, range(3), BLOCKING)
    last = settle(s, period=1.0)
    s.handle(Ready(0, 2, last + 1.0))
    s.handle(Ready(1, 2, last + 1.01))
    out = s.handle(Ready(2, 2, last + 1.02, global_sync=True))
    assert [(g.members, g.reason) for g in out] == [((0, 1), "preempted")]


def test_the_horizon_defaults_to_its_measured_value_for_the_averaging_mode():
    assert SchedulerPolicy().horizon_fraction == 0.8 and BLOCKING.horizon_fraction == 0.5
    assert SchedulerPolicy(horizon=0.3).horizon_fraction == 0.3
    s = StageScheduler(0, range(3))  # the defaults: overlap, horizon 0.8
    for k in range(4):
        for w in range(3):
            s.handle(Ready(w, k, k * 1.0 + 0.3 * w))
        s.handle(Tick(k * 1.0 + 0.95))
    s.handle(Ready(0, 4, 4.0))
    assert s.next_deadline() == pytest.approx(4.8)


def test_without_history_the_prototype_window_applies():
    s = StageScheduler(0, range(3), BLOCKING.updated(window_init=0.002))
    s.handle(Ready(0, 1, 0.0))
    assert s.open.expected is None and s.next_deadline() == 0.002


@settings(max_examples=80, deadline=None)
@given(
    speeds=st.lists(st.floats(min_value=0.1, max_value=5.0), min_size=2, max_size=10),
    horizon=st.floats(min_value=0.01, max_value=2.0),
    jitter=st.floats(min_value=0.0, max_value=0.6),
    seed=st.integers(0, 10_000),
    stages=st.integers(1, 3),
)
def test_a_round_never_waits_past_its_horizon(speeds, horizon, jitter, seed, stages):
    policy = BLOCKING.updated(horizon=horizon, staleness=1000)  # no graph syncs: every round is an ordinary one
    made = []
    real = GroupScheduler.__init__

    def init(self, *a, **k):
        real(self, *a, **k)
        made.append(Opened(self))

    GroupScheduler.__init__ = init
    try:
        _, log, _, _ = drive(stages, speeds, policy, steps=20, seed=seed, jitter=jitter)
    finally:
        GroupScheduler.__init__ = real
    [opened] = made
    assert opened.plans, "no round was planned by rule arrival"
    for wait, bound, _ in opened.plans:
        assert 0.0 <= wait <= bound + 1e-9
    assert all(g.wait <= max(b for _, b, _ in opened.plans) + policy.window_max for _, g, _ in log)


def test_snapshot_keeps_the_arrival_history_and_old_snapshots_restore():
    s = StageScheduler(0, range(3), BLOCKING)
    settle(s, period=0.5)
    snap = s.snapshot()
    r = StageScheduler.restore(snap)
    assert r.arrivals.typical() == s.arrivals.typical() == pytest.approx(0.5)
    assert r.arrivals.stats(1) == s.arrivals.stats(1)
    assert r.arrivals.released == {}  # release times are of the checkpointed run's clock: not carried over
    del snap["arrivals"]
    old = StageScheduler.restore(snap)
    assert old.arrivals.typical() is None  # starts learning again, with the prototype window meanwhile


@pytest.mark.parametrize(
    "field,value,allowed",
    [("window", "fixed", "'arrival', 'prototype'"), ("horizon", 0, "None or a fraction"), ("history", 1, "[2, 1000]")],
)
def test_bad_arrival_parameters_are_named(field, value, allowed):
    with pytest.raises(ValueError) as err:
        SchedulerPolicy(**{field: value})
    assert str(err.value).startswith(f"policy.{field}: {value!r} is not allowed; ") and allowed in str(err.value)


def test_policy_switch_between_rules_replans_the_open_round():
    s = StageScheduler(0, range(3), BLOCKING)
    last = settle(s, period=1.0)
    s.handle(Ready(0, 2, last + 1.0))
    assert s.open.expected is not None
    s.set_policy(BLOCKING.updated(window="prototype", window_init=0.004), last + 1.001)
    assert s.open.expected is None and s.next_deadline() == pytest.approx(last + 1.004)
    s.set_policy(BLOCKING.updated(history=4), last + 1.002)
    assert s.open.expected == frozenset({1, 2}) and s.arrivals.history == 4


def test_random_speeds_mix_mostly_in_groups():
    """Statistical sanity over many seeds: with equal mean speeds and 20% jitter, most rounds have 3 or more of 4."""
    rng = random.Random(7)
    shares = []
    for _ in range(5):
        _, log, _, _ = drive(1, [1.0] * 4, BLOCKING, steps=40, jitter=0.2, seed=rng.randrange(10**6))
        ordinary = [g for _, g, _ in log if g.reason not in ("graph", "global", "preempted")][4:]
        shares.append(sum(len(g.members) >= 3 for g in ordinary) / len(ordinary))
    assert sorted(shares)[2] >= 0.6, shares
    assert not any(math.isnan(x) for x in shares)


def test_under_overlap_intervals_run_ready_to_ready():
    """With overlapped averaging a worker goes on at its ready signal, so its next one follows its last ready,
    however late its group closed."""
    s = StageScheduler(0, range(3), SchedulerPolicy(overlap=True))
    for k in range(4):
        for w in range(3):
            s.handle(Ready(w, k, k * 1.0 + 0.01 * w))
        s.handle(Tick(k * 1.0 + 0.6))  # the round closes late: under overlap that does not move the prediction
    assert s.arrivals.typical() == pytest.approx(1.0)
    s.handle(Ready(0, 4, 4.0))
    assert s.open.expected == frozenset({1, 2})  # due at 4.01 and 4.02
    s.set_policy(SchedulerPolicy(overlap=False), 4.001)
    assert s.arrivals.typical() is None  # release-based intervals are learnt afresh


@settings(max_examples=60, deadline=None)
@given(
    signals=st.lists(st.tuples(st.integers(0, 9), st.floats(0.0, 0.5)), min_size=1, max_size=120),
    history=st.integers(2, 6),
    reads=st.lists(st.integers(0, 119), max_size=6),
)
def test_logged_ready_signals_are_taken_in_as_if_one_by_one(signals, history, reads):
    """Under overlapped averaging a ready signal is logged and the log taken in (in numpy) when the state is read:
    the intervals, medians, spreads, release times and plans are those of taking each signal in at once."""
    from sdpipe.core.scheduler.arrivals import _Arrivals

    batched, single = _Arrivals(history, overlap=True), _Arrivals(history, overlap=True)
    now = 0.0
    for i, (w, gap) in enumerate(signals):
        now += gap
        batched.ready(w, now)
        single.ready(w, now)
        single._take_in()
        if i in reads:  # read in between: the log is taken in part by part
            assert batched.typical() == single.typical()
    assert batched.snapshot() == single.snapshot()
    assert batched.released == single.released and batched.typical() == single.typical()
    for w in range(10):
        assert batched.stats(w) == single.stats(w)
    if single.typical() is not None:  # the core plans a round only then
        candidates = np.ones(10, dtype=bool)
        assert batched.plan(now, candidates, 0.3) == single.plan(now, candidates, 0.3)
    # a worker's row holds its last ``history`` intervals: their median is the one of the plain list
    for w in range(10):
        gaps = [b - a for a, b in itertools.pairwise(t for v, t in _times(signals) if v == w)]
        if gaps:
            assert batched.stats(w)[0] == pytest.approx(statistics.median(gaps[-history:]), abs=1e-12)


def _times(signals):
    now, out = 0.0, []
    for w, gap in signals:
        now += gap
        out.append((w, now))
    return out
