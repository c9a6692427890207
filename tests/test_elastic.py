"""Pipelines joining and leaving a running run, on real Dask clusters: added, removed, and lost ones coming back."""

import json
import os
import signal
import statistics
import time

import pytest
from distributed import Client, LocalCluster

import sdpipe
from sdpipe.data import digits, digits_mlp
from sdpipe.driver.cluster import workers_now

from helpers import assert_records_valid, live_process_groups, port_closed, wait_for_epoch

pytestmark = pytest.mark.cluster

#: every worker sleeps this long per step: a pipeline is bound by it, not by the two cores (as on a machine
#: with a core per worker), so more pipelines can raise the run's samples/s
STEP_SLEEP = 0.08


@pytest.fixture(scope="module")
def data():
    return digits()


def user_cluster(n: int):
    """(cluster, client): a LocalCluster of ``n`` single-threaded workers on loopback, the user's own."""
    lc = LocalCluster(n_workers=n, threads_per_worker=1, host="127.0.0.1", dashboard_address=None)
    return lc, Client(lc, set_as_default=False)


def long_run(data, client, policy: str, **options):
    """A 2 x 2 run of the digits MLP on ``client``'s cluster, long enough to change its pipelines (then stopped)."""
    train_data, eval_data = data
    return sdpipe.train(
        digits_mlp(),
        train_data,
        eval_data=eval_data,
        stages=2,
        pipelines=2,
        policy=policy,
        epochs=200,
        batch_size=32,
        lr=0.01,
        cluster=client,
        **options,
    )


def close(lc, client) -> None:
    client.close()
    lc.close()


def controls(events, what):
    return [e for e in events if e["kind"] == "control" and e.get("what") == what]


def wait_until(cond, timeout, what):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"no {what} within {timeout}s"
        time.sleep(0.1)


def epoch_throughput(history, epoch) -> float:
    """The run's samples/s in ``epoch``: the pipelines' own, added."""
    return sum(h["samples_per_s"] for h in history if h["epoch"] == epoch)


def test_growing_from_2_to_4_pipelines_on_workers_the_user_adds(data, no_leaks):
    """add_pipelines(2) waits for free workers; the user scales the cluster; both join, each from a live
    replica; the run's samples/s rises; after the stop's global sync every replica is identical."""
    lc, client = user_cluster(4)
    try:
        run = long_run(
            data, client, "sdpipe", heterogeneity=sdpipe.Heterogeneity(straggle_prob=1.0, straggle_delay=STEP_SLEEP)
        )
        wait_for_epoch(run, 2)
        assert run.add_pipelines(2) == [2, 3]
        assert run.pipelines == [0, 1]  # they take part once joined
        time.sleep(1.0)
        assert not controls(run.events, "joined")  # no free worker yet: waiting for the user's
        lc.scale(8)
        wait_until(lambda: run.pipelines == [0, 1, 2, 3], 120, "join of pipelines 2 and 3")
        joined_in = max(h["epoch"] for h in run.history())
        wait_for_epoch(run, joined_in + 5)
        run.stop()
        result = run.result(timeout=300)
    finally:
        close(lc, client)
    assert_records_valid(result.events)
    joined = controls(result.events, "joined")
    assert sorted(e["pipeline"] for e in joined) == [2, 3]
    assert all(e["donor"] in (0, 1, 2) and e["donor"] != e["pipeline"] for e in joined)
    donated = controls(result.events, "donated")
    assert len(donated) == 4 and {e["to"] for e in donated} == {2, 3}  # every stage of each joiner
    assert result.finished_pipelines == [0, 1, 2, 3] and result.pipelines == 4
    assert result.max_param_diff() == 0.0
    # a joiner is in no group before its state arrived, and in groups after
    for e in joined:
        p = e["pipeline"]
        groups = [g for g in result.events if g["kind"] == "group" and p in g["group"]]
        assert groups and min(g["start"] for g in groups) >= min(d["start"] for d in donated if d["to"] == p)
    # samples/s recorded in the epochs before the joins and in those that started with all four pipelines
    # (epoch joined_in + 1 was under way as they joined; the last one is the stop's); on two cores the eight
    # workers' compute and the joiners' start-up still share them, so less than twice
    last = max(h["epoch"] for h in result.history)
    before = [epoch_throughput(result.history, e) for e in range(1, 3)]
    after = [epoch_throughput(result.history, e) for e in range(joined_in + 2, last)]
    assert all(len([h for h in result.history if h["epoch"] == e]) == 4 for e in range(joined_in + 2, last))
    print(f"samples/s per epoch: before the joins {before}, with four pipelines {after}")  # in CI's log
    assert len(after) >= 2 and statistics.median(after) > 1.4 * statistics.median(before), (before, after)
    assert [h["accuracy"] for h in result.history if "accuracy" in h][-1] > 0.9  # the stop's epoch: no evaluation


def test_a_killed_worker_rejoins_once_its_nanny_restarted_it(data, no_leaks):
    """rejoin=True on the embedded cluster: the killed worker's pipeline is lost, its nanny restarts the
    process, and the pipeline comes back, takes a live replica's state and trains on.  Then one more pipeline
    is added: the embedded cluster starts its workers itself."""
    train_data, eval_data = data
    run = sdpipe.train(
        digits_mlp(),
        train_data,
        eval_data=eval_data,
        stages=2,
        pipelines=3,
        policy="sdpipe",
        epochs=200,
        batch_size=32,
        lr=0.01,
        rejoin=True,
    )
    wait_for_epoch(run, 1)
    addr = run.workers[3]  # pipeline 1, stage 1
    os.kill(run._client.run(os.getpid, workers=[addr])[addr], signal.SIGKILL)
    wait_until(lambda: controls(run.events, "joined"), 180, "rejoin")
    assert run.add_pipelines(1) == [3]
    wait_until(lambda: run.pipelines == [0, 1, 2, 3], 180, "pipeline 3 on workers the embedded cluster started")
    assert len(workers_now(run._client)) == 8
    wait_for_epoch(run, max(h["epoch"] for h in run.history()) + 2)
    store_port = run.store_port
    run.stop()
    result = run.result(timeout=600)
    assert_records_valid(result.events)
    lost = [e for e in result.events if e["kind"] == "worker-lost"]
    assert [(e["pipeline"], e["stage"]) for e in lost] == [(1, 1)]
    back, added = controls(result.events, "joined")
    assert back["pipeline"] == 1 and back["rejoin"] and back["generation"] == 1
    assert added["pipeline"] == 3 and not added["rejoin"] and added["generation"] == 0
    assert back["start"] > lost[0]["start"]
    # it ends with all its pipelines, identical after the stop's global sync, and pipeline 1 trained again
    assert result.lost == {} and result.finished_pipelines == [0, 1, 2, 3]
    assert result.max_param_diff() == 0.0
    again = [h for h in result.history if h["pipeline"] == 1 and h["epoch"] > 2 and "accuracy" in h]  # after the kill
    assert again and again[-1]["accuracy"] > 0.9
    # its old groups were not reused: no group with pipeline 1 failed after it came back
    failed = [e for e in result.events if e["kind"] == "sync" and e.get("failed") and e["start"] > back["start"]]
    assert not failed, failed[:2]
    assert port_closed(store_port)


@pytest.mark.parametrize("policy", ["sdpipe", "none"])
def test_removing_a_pipeline_hands_its_batches_to_the_others(data, policy, tmp_path, no_leaks):
    """... and its checkpoints record the two pipelines present; a run resumes from them with three."""
    train_data, eval_data = data
    lc, client = user_cluster(6)
    common = dict(stages=2, policy=policy, batch_size=32, lr=0.01, cluster=client, checkpoint_dir=tmp_path)
    try:
        run = sdpipe.train(
            digits_mlp(), train_data, eval_data=eval_data, pipelines=3, epochs=5, checkpoint_every=1, **common
        )
        wait_for_epoch(run, 0)
        run.remove_pipeline(1)
        assert run.pipelines == [0, 2]
        with pytest.raises(ValueError, match=r"^pipeline: 1 is not taking part in the run; it has \[0, 2\]$"):
            run.remove_pipeline(1)
        result = run.result(timeout=300)
        assert live_process_groups(client) == 0
        manifest = json.loads((tmp_path / "epoch-0005" / "manifest.json").read_text())
        assert manifest["pipelines"] == [0, 2] and sorted(manifest["steps"]) == ["0", "2"]
        resumed = sdpipe.train(
            digits_mlp(), train_data, eval_data=eval_data, pipelines=3, epochs=6, resume_from=tmp_path, **common
        ).result(timeout=300)
    finally:
        close(lc, client)
    # every pipeline of the resumed run starts from the checkpoint's weights: as good as the run it resumes (its
    # pipelines' last epoch; under none each pipeline's model is its own, and they differ by a few points)
    assert resumed.finished_pipelines == [0, 1, 2] and {h["epoch"] for h in resumed.history} == {5}
    last = [h["accuracy"] for h in result.history if h["epoch"] == 4]
    assert min(h["accuracy"] for h in resumed.history) >= min(last) - 0.05, (resumed.history, last)
    assert_records_valid(result.events)
    assert list(result.left) == [1] and result.models[1] is None and result.lost == {}
    assert result.finished_pipelines == [0, 2] and not result.stopped
    left = controls(result.events, "left")  # each of its stages took it at the same step boundary
    assert {(e["pipeline"], e["stage"], e["applied_by"]) for e in left} == {(1, 0, "worker"), (1, 1, "worker")}
    assert len({e["step"] for e in left}) == 1
    # predictions take the run as it was: three pipelines before it left, then 0 and 2 (the simulator's 0 and 1)
    before, now = run.what_if(last=1e6, until=min(e["start"] for e in left) - 1e-3), run.what_if(last=1e6)
    assert before.predictions[0].config.pipelines == 3 and before.predictions[-1].change == "pipelines 2 (without 2)"
    assert now.predictions[0].config.pipelines == 2 and now.predictions[-1].change == "pipelines 1 (without 2)"
    # every later epoch: the two pipelines trained all of its batches between them
    per_epoch = 1437 // 32 * 32
    for epoch in range(2, 5):
        rows = [h for h in result.history if h["epoch"] == epoch]
        assert sorted(h["pipeline"] for h in rows) == [0, 2]
        assert sum(h["samples"] for h in rows) == per_epoch
    if policy == "sdpipe":  # no round waited for it once it left; the global syncs were the two's
        groups = [g for g in result.events if g["kind"] == "group" and g["start"] > max(e["end"] for e in left)]
        assert groups and all(1 not in g["group"] for g in groups)
        assert result.max_param_diff() == 0.0


def test_policies_with_fixed_groups_refuse_in_one_line(data, no_leaks):
    train_data, _ = data
    with pytest.raises(ValueError, match=r"^rejoin: policy 'allreduce' stops the run when a pipeline is lost"):
        sdpipe.train(digits_mlp(), train_data, stages=2, pipelines=2, policy="allreduce", rejoin=True)
    run = sdpipe.train(digits_mlp(), train_data, stages=2, pipelines=2, policy="ps", epochs=30)
    try:
        wait_for_epoch(run, 0)
        for call in (lambda: run.add_pipelines(1), lambda: run.remove_pipeline(0), lambda: run.scale(3)):
            with pytest.raises(ValueError) as info:
                call()
            msg = str(info.value)
            assert "\n" not in msg and "policy 'ps' keeps a group of the pipelines fixed at the start" in msg
        with pytest.raises(ValueError, match=r"^n: must be an integer >= 1, got 0$"):
            run.add_pipelines(0)
    finally:
        run.stop()
    run.result(timeout=300)
    # allreduce under an asynchronous schedule: micro-batches cross the step where the members would change
    run = sdpipe.train(
        digits_mlp(), train_data, stages=2, pipelines=2, policy="allreduce", schedule="async-1f1b", epochs=30
    )
    try:
        wait_for_epoch(run, 0)
        with pytest.raises(ValueError, match=r"^remove_pipeline: under 'allreduce' with the asynchronous schedule"):
            run.remove_pipeline(1)
    finally:
        run.stop()
    run.result(timeout=300)


def test_a_join_still_waiting_for_workers_ends_with_the_run(data, no_leaks):
    """No free worker comes: a stop ends the run at once, and the pipeline that never joined is said to have left."""
    train_data, _ = data
    lc, client = user_cluster(4)
    try:
        run = sdpipe.train(
            digits_mlp(), train_data, stages=2, pipelines=2, policy="sdpipe", epochs=100, timeout=60, cluster=client
        )
        wait_for_epoch(run, 0)
        assert run.add_pipelines(1) == [2] and run.scale(3) == []  # already asked for
        time.sleep(2.0)
        t = time.monotonic()
        run.stop()
        result = run.result(timeout=120)
        assert time.monotonic() - t < 30  # not the join's wait for workers (the run's timeout, 60 s)
    finally:
        close(lc, client)
    assert result.left == {2: "the run ended before it joined"} and result.finished_pipelines == [0, 1]
    assert result.max_param_diff() == 0.0 and result.pipelines == 3


def test_allreduce_replicas_agree_on_the_step_a_pipeline_joins_and_leaves(data, no_leaks):
    """Under allreduce the change is agreed in the gradient collective: every replica averages with the new
    members from the same step, the joiner included, and the replicas stay identical throughout."""
    lc, client = user_cluster(4)
    try:
        run = long_run(data, client, "allreduce")
        wait_for_epoch(run, 1)
        with pytest.raises(ValueError, match=r"^pipeline: 5 is not taking part in the run; it has \[0, 1\]$"):
            run.remove_pipeline(5)
        assert run.add_pipelines(1) == [2]
        lc.scale(6)
        wait_until(lambda: run.pipelines == [0, 1, 2], 120, "join of pipeline 2")
        joined_in = max(h["epoch"] for h in run.history())
        wait_for_epoch(run, joined_in + 2)
        run.remove_pipeline(0)
        wait_until(lambda: controls(run.events, "left"), 60, "pipeline 0 leaving")
        wait_for_epoch(run, max(h["epoch"] for h in run.history()) + 2)
        run.stop()
        result = run.result(timeout=300)
        assert live_process_groups(client) == 0
    finally:
        close(lc, client)
    assert_records_valid(result.events)
    assert result.finished_pipelines == [1, 2] and list(result.left) == [0]
    assert result.max_param_diff() == 0.0 and result.steps[1] == result.steps[2]
    syncs = [e for e in result.events if e["kind"] == "sync" and e["stage"] == 0]
    joined_step = min(e["step"] for e in syncs if e["pipeline"] == 2)  # the joiner's first collective
    (donated,) = [e for e in controls(result.events, "donated") if e["stage"] == 0]
    assert donated["step"] == joined_step  # it took the state at the boundary of the step it joined in
    for e in syncs:  # every replica averaged with the new members from the same step on
        assert e["group"] == ([0, 1] if e["step"] < joined_step else e["group"]), e
        if e["step"] >= joined_step:
            assert e["group"] in ([0, 1, 2], [1, 2]), e
    left_step = min(e["step"] for e in syncs if e["group"] == [1, 2])
    assert all(e["group"] == [1, 2] for e in syncs if e["step"] >= left_step)
    assert all(e["group"] == [0, 1, 2] for e in syncs if joined_step <= e["step"] < left_step)
    # every epoch the lock-step members trained the same number of steps (the joiner's first epoch began at
    # its join, the leaver's last ended at its leave: not complete)
    for epoch in range(joined_in + 2, max(h["epoch"] for h in result.history)):
        rows = [h for h in result.history if h["epoch"] == epoch and h["complete"]]
        assert len(rows) >= 2 and len({h["steps"] for h in rows}) == 1, rows
