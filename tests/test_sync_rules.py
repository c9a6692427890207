"""The synchronization policies' decisions (sdpipe.core.sync_rules, sdpipe.data.leaves_tail), without a cluster.

Plain values in, a decision out: unit cases with the worked examples, and hypothesis properties
(random arrival orders and speeds, then the invariants).  The last tests check the worker-side
interface of sdpipe.worker.sync that the worker loop codes against, on bare objects.
"""

import math
import random
import subprocess
import sys
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sdpipe.core.sync_rules import (
    GLOBAL,
    STEP,
    PsRelease,
    choose_peer,
    gossip_roles,
    group_stop,
    held_step_pulls,
    mass_after_group,
    mass_after_round,
    mass_after_step,
    member_weight,
    ps_release,
)
from sdpipe.data import leaves_tail
from sdpipe.wire.protocol import GroupAnswer

FAST = settings(max_examples=100, deadline=None)


def test_the_rules_import_neither_torch_nor_dask():
    code = (
        "import sys, sdpipe.core.sync_rules;"
        "print(sorted(m for m in ('torch', 'distributed', 'dask') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ------------------------------------------------------------------ parameter server: stale synchronous parallel
def test_ps_answers_the_pulls_within_the_staleness_bound_in_arrival_order():
    # the module docstring's case: the slowest running clock is 1, so 2 (1 ahead) and 1 go, 0 (2 ahead) waits
    r = ps_release({0: 3, 1: 1, 2: 2}, {0, 1, 2}, set(), {2: STEP, 0: STEP, 1: STEP}, staleness=1)
    assert r == PsRelease((2, 1), False, {0: 3, 1: 1, 2: 2})


def test_ps_staleness_zero_is_lock_step():
    r = ps_release({0: 2, 1: 1}, {0, 1}, set(), {0: STEP}, staleness=0)
    assert r.replies == () and not r.global_sync
    r = ps_release({0: 2, 1: 2}, {0, 1}, set(), {0: STEP, 1: STEP}, staleness=0)
    assert r.replies == (0, 1)


def test_ps_global_sync_waits_for_every_live_client_then_answers_them_in_order_and_restarts_clocks():
    clock = {0: 5, 1: 3, 2: 4}
    r = ps_release(clock, {0, 1, 2}, {2, 0}, {2: GLOBAL, 0: GLOBAL, 1: STEP}, staleness=0)
    assert not r.global_sync and r.replies == (1,)  # 1 is the only one running: it is the slowest
    r = ps_release(clock, {0, 1, 2}, {2, 0, 1}, {2: GLOBAL, 0: GLOBAL, 1: GLOBAL}, staleness=0)
    assert r == PsRelease((0, 1, 2), True, {0: 0, 1: 0, 2: 0})
    assert clock == {0: 5, 1: 3, 2: 4}  # the inputs are not changed


def test_ps_a_client_that_left_neither_holds_the_global_sync_nor_the_others():
    r = ps_release({0: 9, 1: 0, 2: 7}, {0, 2}, {0, 2}, {0: GLOBAL, 2: GLOBAL}, staleness=1)
    assert r.global_sync and r.replies == (0, 2) and r.clock == {0: 0, 1: 0, 2: 0}
    r = ps_release({0: 9, 1: 0, 2: 8}, {0, 2}, set(), {0: STEP}, staleness=1)
    assert r.replies == (0,)  # 1 left at clock 0: it does not count as the slowest


def test_ps_no_global_sync_without_anyone_at_it():
    r = ps_release({0: 0, 1: 0}, set(), set(), {}, staleness=2)
    assert r == PsRelease((), False, {0: 0, 1: 0})


def test_ps_held_step_pulls_are_the_step_kinds_in_arrival_order():
    assert held_step_pulls({3: STEP, 1: GLOBAL, 0: STEP}) == (3, 0)
    assert held_step_pulls({1: GLOBAL}) == ()


def _simulate_ps(data, clients: int, staleness: int, epochs: int, leave_prob: float):
    """A parameter server driven by random arrival orders, mirroring sdpipe.worker.sync.ps.PsServer; checks each
    release."""
    steps = {c: data.draw(st.integers(0, 6), label=f"steps of {c}") for c in range(clients)}
    clock = {c: 0 for c in range(clients)}
    live, at_global, waiting = set(range(clients)), set(), {}
    epoch = {c: 0 for c in range(clients)}
    done_steps = {c: 0 for c in range(clients)}
    while live:
        ready = sorted(c for c in live if c not in waiting)
        assert ready, f"deadlock: every live client waits {waiting} (clocks {clock})"
        c = data.draw(st.sampled_from(ready))
        if data.draw(st.floats(0, 1)) < leave_prob or epoch[c] == epochs:
            live.discard(c)
            waiting.pop(c, None)
            at_global.discard(c)
        elif done_steps[c] < steps[c]:
            clock[c] += 1
            done_steps[c] += 1
            waiting[c] = STEP
        else:
            at_global.add(c)
            waiting[c] = GLOBAL
        running = [clock[x] for x in live if x not in at_global]
        slowest = min(running) if running else 0
        everyone_at_global = bool(at_global) and at_global >= live
        r = ps_release(clock, live, at_global, waiting, staleness)
        assert r.global_sync == everyone_at_global
        if r.global_sync:
            assert r.replies == tuple(sorted(at_global)) and set(r.clock.values()) == {0}
            for x in r.replies:
                epoch[x] += 1
                done_steps[x] = 0
            at_global.clear()
        else:
            assert r.clock == clock
            for x in r.replies:
                assert waiting[x] == STEP, "a global pull is answered only by the global sync"
                assert clock[x] - slowest <= staleness, f"released {x} at {clock[x]}, slowest running {slowest}"
            held = [x for x, k in waiting.items() if k == STEP and x not in r.replies]
            assert all(clock[x] - slowest > staleness for x in held), "a pull within the bound was held"
        for x in r.replies:
            waiting.pop(x, None)
        clock = r.clock


@FAST
@given(st.data(), st.integers(1, 5), st.integers(0, 3), st.integers(1, 3))
def test_ps_property_bound_global_sync_and_no_deadlock(data, clients, staleness, epochs):
    _simulate_ps(data, clients, staleness, epochs, leave_prob=0.0)


@FAST
@given(st.data(), st.integers(1, 5), st.integers(0, 3))
def test_ps_property_clients_leaving_at_any_time(data, clients, staleness):
    _simulate_ps(data, clients, staleness, epochs=2, leave_prob=0.1)


# ------------------------------------------------------------------ gossip pairs
def test_gossip_roles_of_five_pipelines():
    assert gossip_roles(5) == ([0, 2, 4], [1, 3])
    assert gossip_roles(1) == ([0], [])


@FAST
@given(st.integers(0, 40))
def test_gossip_roles_are_a_bipartite_split(pipelines):
    actives, passives = gossip_roles(pipelines)
    assert sorted(actives + passives) == list(range(pipelines))
    assert all(p % 2 == 0 for p in actives) and all(p % 2 == 1 for p in passives)
    assert len(actives) - len(passives) in (0, 1)


def _reference_peer(passives, lost, rng):
    """The draw as sdpipe.worker.sync.GossipPairs made it before the rule was pulled out (draw, drop if lost, again)."""
    passives = list(passives)
    while passives:
        peer = rng.choice(passives)
        if peer in lost:
            passives.remove(peer)
            continue
        return peer, passives
    return None, passives


@FAST
@given(st.integers(1, 20), st.sets(st.integers(0, 20)), st.integers(0, 2**32))
def test_choose_peer_skips_lost_pipelines_and_draws_as_before(pipelines, lost, seed):
    _, passives = gossip_roles(pipelines)
    asked = []

    def is_lost(p):
        asked.append(p)
        return p in lost

    peer, left = choose_peer(passives, is_lost, random.Random(seed))
    assert (peer, left) == _reference_peer(passives, lost, random.Random(seed))
    assert set(asked) <= set(passives) and len(asked) == len(set(asked))  # each drawn peer looked at once
    assert (peer is None) == all(p in lost for p in passives)
    if peer is not None:
        assert peer not in lost and peer in left
    assert set(passives) - set(left) <= lost  # only lost pipelines are dropped
    assert left == [p for p in passives if p in left]  # the order is kept


def test_choose_peer_without_losses_draws_every_passive_and_keeps_the_list():
    passives = [1, 3, 5, 7]
    rng = random.Random(0)
    seen = set()
    for _ in range(200):
        peer, left = choose_peer(passives, lambda p: False, rng)
        assert left == passives
        seen.add(peer)
    assert seen == set(passives)


def test_choose_peer_does_not_change_its_input():
    passives = [1, 3]
    assert choose_peer(passives, lambda p: True, random.Random(1)) == (None, [])
    assert passives == [1, 3]


# ------------------------------------------------------------------ mass weighting
def test_member_weight_under_each_weighting():
    assert member_weight(3.5, "progress") == 3.5
    assert member_weight(3.5, "uniform") == 1.0


def test_mass_after_a_step_a_group_and_a_round():
    assert mass_after_step(1.0) == 2.0
    assert mass_after_group(2.0 + 4.0 + 6.0, 3) == 4.0
    assert mass_after_round(4.0, "global") == 1.0
    assert mass_after_round(4.0, "ready") == 4.0


masses = st.lists(st.floats(1.0, 1e6, allow_nan=False), min_size=1, max_size=12)


@FAST
@given(masses)
def test_a_group_leaves_each_member_the_mean_and_conserves_the_sum(group):
    kept = mass_after_group(math.fsum(group), len(group))
    assert min(group) - 1e-6 <= kept <= max(group) + 1e-6
    assert kept >= 1.0 - 1e-9  # a mass never drops below 1, so a replica that just synced keeps mass 1
    assert math.isclose(kept * len(group), math.fsum(group), rel_tol=1e-12)


@FAST
@given(masses, st.sampled_from(["progress", "uniform"]), st.sampled_from(["global", "ready", "timeout"]))
def test_weights_and_the_reset_at_a_global_sync(group, weighting, reason):
    weights = [member_weight(m, weighting) for m in group]
    assert weights == (group if weighting == "progress" else [1.0] * len(group))
    after = mass_after_round(mass_after_group(math.fsum(group), len(group)), reason)
    assert (after == 1.0) if reason == "global" else after >= 1.0 - 1e-9


@FAST
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3)), max_size=30), st.integers(2, 4))
def test_masses_count_steps_since_the_last_global_sync(events, replicas):
    # replicas step (a) or average in a pair (b, b+1); the total mass is the replicas plus the steps taken
    mass = [1.0] * replicas
    steps = 0
    for a, b in events:
        a, b = a % replicas, b % (replicas - 1)
        mass[a] = mass_after_step(mass[a])
        steps += 1
        kept = mass_after_group(mass[b] + mass[b + 1], 2)
        mass[b] = mass[b + 1] = kept
        assert math.isclose(sum(mass), replicas + steps)
    mass = [mass_after_round(m, "global") for m in mass]
    assert mass == [1.0] * replicas


# ------------------------------------------------------------------ the group policy's stop
def test_group_stop_cases():
    assert group_stop(True, False, None, 10.0, 5.0) == (True, None)  # the group's word: at once
    assert group_stop(False, False, None, 10.0, 5.0) == (False, None)
    assert group_stop(False, True, None, 10.0, 5.0) == (False, 10.0)  # first seen now
    assert group_stop(False, True, 10.0, 15.0, 5.0) == (False, 10.0)  # not yet past the grace
    assert group_stop(False, True, 10.0, 15.5, 5.0) == (True, 10.0)


@FAST
@given(
    st.lists(st.floats(0, 3, allow_nan=False), min_size=1, max_size=30),
    st.floats(0, 10, allow_nan=False),
    st.floats(0, 100, allow_nan=False),
)
def test_group_stop_takes_the_store_flag_exactly_after_the_grace(gaps, grace, t0):
    # the driver's flag stays set (it is never cleared); no group answer says stop
    first_seen, now, stopped = None, t0, False
    for gap in gaps:
        now += gap
        stop, first_seen = group_stop(False, True, first_seen, now, grace)
        assert first_seen == t0 + gaps[0]  # the first reading's time, kept
        assert stop == (now - first_seen > grace)
        assert stop or not stopped  # once stopping, it stays so
        stopped = stop


@FAST
@given(st.booleans(), st.one_of(st.none(), st.floats(0, 100)), st.floats(0, 200), st.floats(0, 10))
def test_group_stop_an_answered_stop_wins_and_no_flag_never_stops(store_stop, first_seen, now, grace):
    assert group_stop(True, store_stop, first_seen, now, grace) == (True, first_seen)
    assert group_stop(False, False, first_seen, now, grace) == (False, first_seen)


# ------------------------------------------------------------------ the epoch-tail rule (sdpipe.data.leaves_tail)
step_time = st.floats(1e-3, 10.0, allow_nan=False)


def test_leaves_tail_cases():
    assert not leaves_tail(None, [0.1], 1)  # not measured yet
    assert not leaves_tail(1.0, [], 1)  # alone
    assert leaves_tail(1.0, [0.1], 5)  # the other takes 5 batches in 0.5 s < 1 s
    assert not leaves_tail(1.0, [0.1], 20)  # 2 s: better take one


@FAST
@given(step_time, st.lists(step_time, max_size=8), st.integers(0, 64))
def test_the_fastest_or_a_lone_pipeline_never_leaves_the_tail(mine, others, remaining):
    fastest = [t for t in others if t >= mine]
    assert not leaves_tail(mine, fastest, remaining)
    assert not leaves_tail(mine, [], remaining)
    assert not leaves_tail(None, others, remaining)


@FAST
@given(step_time, st.lists(step_time, min_size=1, max_size=8), st.integers(1, 64))
def test_leaves_the_tail_when_the_faster_ones_finish_it_before_one_own_step(mine, others, remaining):
    faster = [t for t in others if t < mine]
    rate = sum(1.0 / t for t in faster)
    finish = remaining / rate if rate else math.inf
    if not math.isclose(finish, mine, rel_tol=1e-9):
        assert leaves_tail(mine, others, remaining) == (finish < mine)


@FAST
@given(step_time, st.lists(step_time, max_size=8), st.integers(1, 64), step_time)
def test_leaving_the_tail_is_monotone_and_slower_pipelines_do_not_count(mine, others, remaining, extra):
    leaves = leaves_tail(mine, others, remaining)
    if leaves:
        assert leaves_tail(mine, others, remaining - 1)  # fewer batches left: still leaves them
        assert leaves_tail(mine, [*others, min(extra, mine / 2)], remaining)  # one more fast pipeline too
    slower = mine + extra
    assert leaves_tail(mine, [*others, slower, math.inf], remaining) == leaves  # out of the epoch: "inf"


# ------------------------------------------------------------------ the interface the worker loop codes against
def test_policy_interface_coupled_and_decide_stop():
    from sdpipe.worker import sync as policy

    with pytest.raises(TypeError):
        policy.SyncPolicy()  # abstract: every policy says what it does after a step and at an epoch's end
    modes = ("allreduce", "none", "sdpipe", "scheduled", "adpsgd", "ps")
    assert {mode: policy.make_policy(mode).coupled for mode in modes} == {
        "allreduce": True,
        "none": False,
        "sdpipe": False,
        "scheduled": False,
        "adpsgd": False,
        "ps": False,
    }
    for mode in modes:
        p = policy.make_policy(mode)
        assert isinstance(p, policy.SyncPolicy) and p.mass == 1.0
        assert not hasattr(p, "carries_stop") and not hasattr(p, "stop_now")
    assert type(policy.make_policy("sdpipe")) is policy.Scheduled and policy.make_policy("sdpipe").name == "scheduled"
    with pytest.raises(ValueError, match="policy: 'gossip' is not one of sdpipe, allreduce, ps, adpsgd, none"):
        policy.make_policy("gossip")
    assert not issubclass(policy.GossipPairs, policy.Scheduled)
    for name in ("none", "adpsgd", "ps", "allreduce"):
        p = policy.make_policy(name)
        assert p.decide_stop(True) is True and p.decide_stop(False) is False  # the driver's flag as read
    s = policy.make_policy("sdpipe")
    s.setup(SimpleNamespace(cfg={}, cut_version=0))
    assert s.decide_stop(True) is False  # the store flag first seen: the group's word is awaited a while
    s.stop_seen_at -= policy.STOP_GRACE + 1
    assert s.decide_stop(True) is True
    s = policy.make_policy("sdpipe")
    s.setup(SimpleNamespace(cfg={}, cut_version=0))
    answer = GroupAnswer(round=0, members=[0], reason="full", name="s0-0", stop=True)
    s._ask(SimpleNamespace(ask_group=lambda step, global_sync: answer), 3, False)
    assert s.decide_stop(False) is True  # an answer said stop


def test_ps_server_applies_the_release_rule():
    """The server half on its own (no thread, no store): pushes in, replies out as ps_release decides."""
    import torch

    from sdpipe.worker import sync as policy

    class Pg:
        def __init__(self):
            self.sent = []

        def recv(self, tensors, src, tag):
            tensors[0].fill_(1.0)
            return SimpleNamespace(wait=lambda: None)

        def send(self, tensors, dst, tag):
            self.sent.append(dst)
            return SimpleNamespace(wait=lambda: None)

    client = policy.make_policy("ps")
    for attr in ("_serve", "_idle", "_release", "_reply", "w", "clock", "live", "at_global", "waiting"):
        assert not hasattr(client, attr)  # the client holds none of the server's state
    server = object.__new__(policy.ps.PsServer)
    server.pg, server.staleness, server.w = Pg(), 0, torch.zeros(2)
    server.clock, server.live, server.at_global, server.waiting = {1: 0, 2: 0}, {1, 2}, set(), {}
    server.worker = SimpleNamespace(read_ctl=lambda: SimpleNamespace(pause=False))
    server._serve("step,1,0")
    assert server.pg.sent == [] and server.waiting == {1: "step"}  # 1 step ahead of 2, bound 0
    server._idle()
    assert server.pg.sent == []  # not paused: held
    server._serve("step,2,0")
    assert server.pg.sent == [1, 2] and server.waiting == {} and server.clock == {1: 1, 2: 1}
    server._serve("global,2,1")
    server._serve("step,1,1")
    assert server.pg.sent == [1, 2, 1]  # 2 is at the global sync: 1 is the slowest running
    server._serve("global,1,2")
    assert server.pg.sent == [1, 2, 1, 1, 2] and server.clock == {1: 0, 2: 0} and not server.at_global
    assert server.w.tolist() == [5.0, 5.0]
    server._serve("step,1,0")
    server.worker = SimpleNamespace(read_ctl=lambda: SimpleNamespace(pause=True))
    server._idle()  # paused: the held pull is answered
    assert server.pg.sent[-1] == 1 and server.waiting == {}
    server._serve("leave,2")
    assert server.live == {1}
