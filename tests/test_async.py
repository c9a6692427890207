"""The asynchronous schedules (PipeDream's weight stashing and PipeDream-2BW) on a real Dask LocalCluster.

The semantics test compares a real run with a single-process reference written from the definition, not from
the runtime: in 1F1B stage ``s`` runs ``S - 1 - s`` micro-batches ahead of its backwards, so its forward of
micro-batch ``g`` (numbered from the last drain) comes after ``max(0, g - (S - 1 - s))`` backwards, i.e. on the
weights of the ``max(0, g - (S - 1 - s)) // u``-th update of the epoch; the micro-batch's gradient is the
gradient of the whole model's loss at those stashed weights (each stage's own version), and every stage
updates after each ``u``-th micro-batch and after the epoch's last (the drain).  Equal final weights after
two epochs (352 or more updates of one stage, each an optimizer step on these gradients) mean every
micro-batch's gradient was the one computed with its stashed weights: one wrong version anywhere moves the
weights by far more than the tolerance (the flush schedule's weights, checked too, differ by ~0.1).
"""

import copy
import time

import pytest
import torch

import sdpipe
from sdpipe.core.partition import partition
from sdpipe.core.schedule import weight_versions
from sdpipe.data import batch_indices, digits, digits_mlp, steps_per_epoch

from helpers import live_process_groups

pytestmark = pytest.mark.cluster

EPOCHS, BATCH, M, LR = 2, 32, 4, 0.05


@pytest.fixture(scope="module")
def data():
    return digits()


def pipedream_reference(model, X, Y, *, stages: int, update_every: int):
    """Weight stashing in one process, from the definition above (SGD with momentum per stage)."""
    u, mb = update_every, BATCH // M
    mods = partition(copy.deepcopy(model), stages)
    named = [list(m.named_parameters()) for m in mods]
    opts = [torch.optim.SGD(m.parameters(), lr=LR, momentum=0.9) for m in mods]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers: the same sums in the same order, so the weights agree exactly
    try:
        for epoch in range(EPOCHS):
            n = steps_per_epoch(len(X), BATCH, 1) * M
            versions = [[{k: p.detach().clone() for k, p in named[s]}] for s in range(stages)]  # by update
            for g in range(n):
                k, m = divmod(g, M)
                idx = batch_indices(len(X), BATCH, 0, epoch, k)[m * mb : (m + 1) * mb]
                used = [
                    {
                        k: t.clone().requires_grad_(True)
                        for k, t in versions[s][max(0, g - (stages - 1 - s)) // u].items()
                    }
                    for s in range(stages)
                ]
                x = X[idx]
                for s in range(stages):
                    x = torch.func.functional_call(mods[s], used[s], (x,))
                loss = torch.nn.functional.cross_entropy(x, Y[idx]) / u
                grads = iter(torch.autograd.grad(loss, [t for w in used for t in w.values()]))
                for s in range(stages):
                    for _, p in named[s]:
                        gp = next(grads)
                        p.grad = gp.clone() if p.grad is None else p.grad + gp
                if (g + 1) % u == 0 or g == n - 1:
                    for s in range(stages):
                        opts[s].step()
                        opts[s].zero_grad(set_to_none=False)
                        versions[s].append({k: p.detach().clone() for k, p in named[s]})
    finally:
        torch.set_num_threads(threads)
    return torch.nn.Sequential(*[layer for m in mods for layer in m])


def max_diff(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    return max(float((sa[k] - sb[k]).abs().max()) for k in sa)


def common(cluster, **kw):
    return dict(
        pipelines=1,
        epochs=EPOCHS,
        optimizer="sgd",
        lr=LR,
        momentum=0.9,
        batch_size=BATCH,
        microbatches=M,
        policy="none",
        cluster=cluster,
        **kw,
    )


@pytest.mark.parametrize("schedule", ["async-1f1b", "async-2bw"])
@pytest.mark.parametrize("stages", [2, 3])
def test_each_microbatch_gradient_is_the_one_of_its_stashed_weights(data, shared_cluster, stages, schedule):
    (X, Y), _ = data
    run = sdpipe.train(digits_mlp(), (X, Y), stages=stages, schedule=schedule, **common(shared_cluster))
    result = run.result(timeout=300)
    every = run.config.resolved_update_every
    assert every == (1 if schedule == "async-1f1b" else max(M, stages))
    ref = pipedream_reference(digits_mlp(), X, Y, stages=stages, update_every=every)
    assert max_diff(result.models[0], ref) < 1e-5
    # not the flush schedule's weights: the stashed versions made a difference
    flush = pipedream_reference(digits_mlp(), X, Y, stages=1, update_every=M)
    assert max_diff(result.models[0], flush) > 1e-3
    # every stage updated once per update window; the stashes stayed within what the schedule allows
    per_epoch = -(-steps_per_epoch(len(X), BATCH, 1) * M // every)
    updates = [e for e in result.events if e["kind"] == "optimizer"]
    for s in range(stages):
        mine = [e for e in updates if e["stage"] == s]
        assert len(mine) == EPOCHS * per_epoch
        copies = 1 + max(e["versions"] for e in mine)  # the live weights and the older versions stashed
        assert copies <= weight_versions(stages, every, s)
        if schedule == "async-2bw":
            assert copies <= 2
    assert 1 + max(e["versions"] for e in updates if e["stage"] == 0) == weight_versions(stages, every, 0)
    assert live_process_groups(shared_cluster) == 0


def test_no_flush_between_steps_and_a_drain_at_each_epoch_end(data, shared_cluster):
    """Stage 0's backward of a step's last micro-batch runs in the next step (after that step's first
    forward); the epoch's end drains it."""
    (X, Y), _ = data
    result = sdpipe.train(digits_mlp(), (X, Y), stages=2, schedule="async-1f1b", **common(shared_cluster)).result(
        timeout=300
    )
    spans = sorted(
        (e for e in result.events if e["stage"] == 0 and e["kind"] in ("forward", "backward")),
        key=lambda e: e["start"],
    )
    order = [(e["kind"][0].upper(), e["microbatch"]) for e in spans]
    i = order.index(("F", M))  # the second step's first forward
    assert ("B", M - 1) in order[i:] and ("B", M - 1) not in order[:i]
    n = steps_per_epoch(len(X), BATCH, 1) * M
    assert order.count(("B", n - 1)) == EPOCHS  # the drain took in each epoch's last micro-batch
    assert [r["epoch"] for r in result.history] == list(range(EPOCHS))
    # the dashboard replays it: every forward and backward on the timeline, each with its weight version
    from sdpipe.widgets import Dashboard

    dash = Dashboard(result)
    compute = [e for e in result.events if e["kind"] in ("forward", "backward")]
    # (the timeline's slots show the kind that fills most of each; with this small MLP that may be the
    # communication everywhere, so the compute is checked in the time attribution of the whole run)
    assert sum(dash.trace("attribution/compute").x) > 0
    assert all(isinstance(e["version"], int) for e in compute)


@pytest.mark.parametrize("policy", ["allreduce", "sdpipe", "ps", "adpsgd"])
def test_async_with_replicas(data, shared_cluster, policy):
    """Two pipelines under every policy: under allreduce the replicas average per update and stay identical;
    under the others each update is followed by the policy's exchange (a ready signal, a push and pull, a
    gossip pair), and the epoch's global sync (after the drain) makes the replicas identical."""
    train, held_out = data
    run = sdpipe.train(
        digits_mlp(),
        train,
        eval_data=held_out,
        stages=2,
        pipelines=2,
        epochs=3,
        schedule="async-2bw",
        policy=policy,
        batch_size=BATCH,
        microbatches=M,
        cluster=shared_cluster,
    )
    result = run.result(timeout=300)
    assert result.max_param_diff() < 1e-5
    assert result.history[-1]["accuracy"] > 0.85
    if policy == "sdpipe":
        readies = [e for e in result.events if e["kind"] == "group"]
        assert readies  # the scheduler formed rounds
    assert live_process_groups(shared_cluster) == 0


def wait_for(run, pred, timeout=120):
    deadline = time.monotonic() + timeout
    while not pred(run.events):
        assert not run.done(), f"the run ended: {run.status}"
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_live_control_under_an_asynchronous_schedule(data, shared_cluster):
    """Pause (longer than the run's timeout, micro-batches in flight), resume, a live switch allreduce ->
    sdpipe (a drain first), a slowdown, a stop: each taken up, and the run ends cleanly."""
    train, _ = data
    run = sdpipe.train(
        digits_mlp(),
        train,
        stages=2,
        pipelines=2,
        epochs=200,
        schedule="async-1f1b",
        policy="allreduce",
        timeout=3.0,
        cluster=shared_cluster,
    )
    opt = lambda evs: [e for e in evs if e["kind"] == "optimizer"]
    wait_for(run, lambda evs: len(opt(evs)) >= 8)
    run.pause()
    time.sleep(1.0)
    before = len(opt(run.events))
    time.sleep(4.0)  # longer than the timeout: the held pipelines' waits stay alive
    assert len(opt(run.events)) == before and not run.done()
    run.resume()
    wait_for(run, lambda evs: len(opt(evs)) >= before + 8)
    run.set_policy("sdpipe")
    wait_for(run, lambda evs: any(e["kind"] == "group" and e["reason"] != "global" for e in evs))
    run.set_heterogeneity(slowdown={1: 2.0})
    wait_for(run, lambda evs: sum(e["kind"] == "control" and e.get("what") == "heterogeneity" for e in evs) >= 4)
    run.stop()
    result = run.result(timeout=60)
    assert result.stopped
    driver = [e["what"] for e in result.events if e["kind"] == "control" and e["applied_by"] == "driver"]
    assert driver == ["pause", "resume", "policy", "heterogeneity", "stop"]
    assert {e["pipeline"] for e in result.events if e["kind"] == "pause"} == {0, 1}
    switch = [
        e for e in result.events if e["kind"] == "control" and e.get("what") == "policy" and e["pipeline"] is not None
    ]
    assert len(switch) == 4 and len({e["step"] for e in switch}) == 1  # allreduce's replicas switched together
    drains = [e for e in result.events if e["kind"] == "wait" and e.get("what") == "drain"]
    assert drains  # sends waited for at the drains
    assert live_process_groups(shared_cluster) == 0


def test_checkpoint_resume_equals_the_uninterrupted_run(data, shared_cluster, tmp_path):
    """A checkpoint follows an epoch's drain, so resuming from it continues the same run."""
    train, _ = data
    common = dict(stages=2, pipelines=2, policy="allreduce", schedule="async-2bw", epochs=3, cluster=shared_cluster)
    whole = sdpipe.train(digits_mlp(), train, checkpoint_every=1, checkpoint_dir=tmp_path, **common).result(timeout=300)
    resumed = sdpipe.train(digits_mlp(seed=1), train, resume_from=tmp_path / "epoch-0002", **common).result(timeout=300)
    assert resumed.steps == whole.steps
    for a, b in zip(whole.models, resumed.models, strict=True):
        assert max_diff(a, b) <= 1e-6


def test_stop_mid_run_drains_and_ends(data, shared_cluster, no_leaks):
    train, _ = data

    run = sdpipe.train(
        digits_mlp(),
        train,
        stages=2,
        pipelines=2,
        epochs=500,
        schedule="async-1f1b",
        policy="sdpipe",
        cluster=shared_cluster,
    )
    deadline = time.monotonic() + 120
    while sum(e["kind"] == "optimizer" for e in run.events_since(0)[0]) < 20:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    run.stop()
    result = run.result(timeout=60)
    assert result.stopped and run.status == "stopped"
    for m in result.models:
        assert all(torch.isfinite(p).all() for p in m.parameters())
    assert live_process_groups(shared_cluster) == 0
