"""The baselines ``adpsgd`` and ``ps`` in the same harness, on a real LocalCluster (gloo)."""

import time
from collections import Counter

import pytest

import sdpipe
from sdpipe.data import digits, digits_mlp

from helpers import live_process_groups, server_threads, train_on

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def data():
    return digits()


def _final(result):
    last = max(h["epoch"] for h in result.history)
    return [h for h in result.history if h["epoch"] == last]


def test_adpsgd_pairs_active_with_passive_and_ends_epochs_in_sync(data, shared_cluster):
    train_data, eval_data = data
    result = train_on(
        shared_cluster,
        digits_mlp(),
        train_data,
        eval_data=eval_data,
        stages=2,
        pipelines=2,
        policy="adpsgd",
        epochs=6,
    )
    assert all(h["accuracy"] >= 0.88 for h in _final(result)), _final(result)
    assert result.max_param_diff() < 1e-6  # the global sync at each epoch end
    syncs = [e for e in result.events if e["kind"] == "sync"]
    pairs = [e for e in syncs if e["reason"] == "pair"]
    # the active side (pipeline 0) starts every exchange, the passive side (pipeline 1) serves it
    started = Counter(e["stage"] for e in pairs if not e.get("served"))
    served = Counter(e["stage"] for e in pairs if e.get("served"))
    assert started == served and started[0] > 10
    assert all(e["pipeline"] == (1 if e.get("served") else 0) and e["group"] == [0, 1] for e in pairs)
    assert sum(e["reason"] == "global" for e in syncs) == 2 * 2 * 6  # two workers per stage, each epoch
    for e in range(6):
        assert sum(h["share"] for h in result.history if h["epoch"] == e) == pytest.approx(1.0, abs=0.03)
    assert server_threads(shared_cluster) == []
    assert live_process_groups(shared_cluster) == 0


def test_ps_bounds_staleness_and_pulls_the_same_weights_at_epoch_end(data, shared_cluster):
    train_data, eval_data = data
    s = 1
    hetero = sdpipe.Heterogeneity(slowdown={1: 6.0})
    result = train_on(
        shared_cluster,
        digits_mlp(),
        train_data,
        eval_data=eval_data,
        stages=1,
        pipelines=3,
        policy="ps",
        epochs=4,
        heterogeneity=hetero,
        scheduler={"staleness": s},
    )
    assert all(h["accuracy"] >= 0.88 for h in _final(result)), _final(result)
    assert result.max_param_diff() < 1e-6
    # while the slow pipeline trains an epoch, no pipeline starts a step more than s steps (plus the one in flight)
    # ahead of it; once it is out of the epoch (its global sync began) the others finish the epoch's batches
    opt = [e for e in result.events if e["kind"] == "optimizer"]
    slow_out = sorted(
        e["start"] for e in result.events if e["kind"] == "sync" and e["reason"] == "global" and e["pipeline"] == 1
    )
    checked = 0
    for epoch in range(4):
        slow_ends = sorted(e["end"] for e in opt if e["pipeline"] == 1 and e["epoch"] == epoch)
        for p in (0, 2):
            mine = sorted(opt_e["start"] for opt_e in opt if opt_e["pipeline"] == p and opt_e["epoch"] == epoch)
            for k, t in enumerate(mine):
                if t < slow_out[epoch]:
                    assert k <= sum(x <= t for x in slow_ends) + s + 1, (epoch, p, k)
                    checked += 1
    assert checked > 20
    ps = [e for e in result.events if e["kind"] == "sync" and e["reason"] == "ps"]
    assert ps and all(e["server"] == 0 and e["group"] == [e["pipeline"]] for e in ps)
    assert server_threads(shared_cluster) == []
    assert live_process_groups(shared_cluster) == 0


def test_ps_without_bound_pressure_lets_the_fast_pipelines_train_more(data, shared_cluster):
    train_data, _ = data
    hetero = sdpipe.Heterogeneity(slowdown={1: 6.0})
    result = sdpipe.train(
        digits_mlp(),
        train_data,
        stages=1,
        pipelines=3,
        policy="ps",
        epochs=2,
        heterogeneity=hetero,
        scheduler={"staleness": 100},
        cluster=shared_cluster,
    ).result(timeout=300)
    share = Counter()
    for h in result.history:
        share[h["pipeline"]] += h["samples"]
    assert share[1] < 0.6 * min(share[0], share[2]), share


@pytest.mark.parametrize("policy", ["ps", "adpsgd"])
def test_server_policies_are_not_switched_live(data, shared_cluster, policy):
    train_data, _ = data
    run = sdpipe.train(digits_mlp(), train_data, stages=1, pipelines=2, policy=policy, epochs=1, cluster=shared_cluster)
    try:
        with pytest.raises(ValueError, match=f"policy: '{policy}' cannot be switched to or from while training"):
            run.set_policy("sdpipe")
    finally:
        run.result(timeout=120)
    run = sdpipe.train(
        digits_mlp(), train_data, stages=1, pipelines=2, policy="sdpipe", epochs=1, cluster=shared_cluster
    )
    try:
        with pytest.raises(ValueError, match=f"policy: '{policy}' cannot be switched"):
            run.set_policy(policy)
    finally:
        run.result(timeout=120)


@pytest.mark.parametrize("policy", ["ps", "adpsgd"])
def test_stop_mid_epoch_ends_servers_and_groups(data, shared_cluster, policy, no_leaks):
    train_data, _ = data
    run = sdpipe.train(
        digits_mlp(),
        train_data,
        stages=1,
        pipelines=3,
        policy=policy,
        epochs=200,
        heterogeneity=sdpipe.Heterogeneity(slowdown={2: 3.0}),
        cluster=shared_cluster,
    )
    deadline = time.monotonic() + 120
    while not any(e["kind"] == "sync" for e in run.events):
        assert time.monotonic() < deadline and not run.done()
        time.sleep(0.05)
    run.stop()
    result = run.result(timeout=60)
    assert result.stopped and all(s > 0 for s in result.steps.values())
    assert server_threads(shared_cluster) == []
    assert live_process_groups(shared_cluster) == 0
