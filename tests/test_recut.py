"""Live re-cuts (``run.recut``) on a real Dask LocalCluster: layers, their weights and their optimizer state move
between the stages of every pipeline at one step boundary while the run trains.

Exactness: one pipeline re-cut mid-run trains as one process on the same batches.  The reference is written from
the schedules' definitions, not from the runtime: under 1F1B every micro-batch of a step runs on the step's
weights and the stages update together after it; under async-1F1B (PipeDream's weight stashing) stage ``s`` runs
``S - 1 - s`` micro-batches ahead of its backwards, so micro-batch ``g`` (numbered from the last drain) runs
through each layer on the weights of update ``max(0, g - (S - 1 - s)) // u`` of the stage holding that layer, and
a re-cut drains the schedule first: from it the numbering starts again, under the new stages.  So under
async-1F1B the moment of the re-cut changes the result (a lag differs for every moved layer), and the reference
takes it from the workers' own ``control`` records; SGD with momentum makes a lost optimizer state show as well.
"""

import copy
import time

import pytest
import torch
from torch import nn

import sdpipe
from sdpipe.core.partition import stage_bounds
from sdpipe.data import batch_indices, digits, digits_cnn, digits_mlp, steps_per_epoch

from helpers import assert_records_valid

pytestmark = pytest.mark.cluster

BATCH, M, LR, EPOCHS = 32, 4, 0.05, 3


def gpt_case():
    from sdpipe.examples import char_data, char_gpt, lm_loss

    train, _ = char_data(train_chars=12_000, eval_chars=2_000)
    X, Y = train.tensors()
    return char_gpt(width=32, heads=2, layers=3), X, Y, lm_loss, (2, 4), (1, 3)


def mlp_case():
    (X, Y), _ = digits()
    return digits_mlp(), X, Y, nn.functional.cross_entropy, (2, 4), (1, 3)


def cnn_case():
    (X, Y), _ = digits()
    return digits_cnn(channels=8), X, Y, nn.functional.cross_entropy, (3, 6), (5, 8)


CASES = {"mlp": mlp_case, "cnn": cnn_case, "gpt": gpt_case}


def reference(model, X, Y, loss_fn, *, stages: int, schedule: str, every: int, recut: tuple) -> nn.Sequential:
    """One process, from the definition in the module's docstring; ``recut``: (epoch, batches of it trained
    before, cut before, cut after)."""
    layers = list(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    asynchronous = schedule.startswith("async")
    u = every if asynchronous else M
    mb, n = BATCH // M, len(X)
    steps = steps_per_epoch(n, BATCH, 1)
    at_epoch, at_j, before, after = recut
    names = [[k for k, _ in layer.named_parameters()] for layer in layers]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers
    try:
        for epoch in range(EPOCHS):
            bounds = [(0, steps)] if epoch != at_epoch else [(0, at_j), (at_j, steps)]
            for k0, k1 in bounds:
                if k1 <= k0:
                    continue
                cuts = before if (epoch, k0) < (at_epoch, at_j) else after
                stage_of = [s for s, (a, b) in enumerate(stage_bounds(list(cuts), len(layers))) for _ in range(a, b)]
                lag = [stages - 1 - s if asynchronous else 0 for s in stage_of]
                versions = [[[p.detach().clone() for p in layer.parameters()] for layer in layers]]
                total = (k1 - k0) * M
                for g in range(total):
                    k, m = divmod(g, M)
                    idx = batch_indices(n, BATCH, 0, epoch, k0 + k)[m * mb : (m + 1) * mb]
                    used = [
                        [t.clone().requires_grad_(True) for t in versions[max(0, g - lag[i]) // u][i]]
                        for i in range(len(layers))
                    ]
                    x = X[idx]
                    for i, layer in enumerate(layers):
                        x = torch.func.functional_call(layer, dict(zip(names[i], used[i], strict=True)), (x,))
                    loss = loss_fn(x, Y[idx]) / u
                    flat = [t for ts in used for t in ts]
                    grads = iter(torch.autograd.grad(loss, flat))
                    for layer in layers:
                        for p in layer.parameters():
                            gp = next(grads)
                            p.grad = gp.clone() if p.grad is None else p.grad + gp
                    if (g + 1) % u == 0 or g == total - 1:
                        opt.step()
                        opt.zero_grad(set_to_none=False)
                        versions.append([[p.detach().clone() for p in layer.parameters()] for layer in layers])
    finally:
        torch.set_num_threads(threads)
    return model


def wait_for_step(run, step: int, timeout: float = 120) -> None:
    """Until some worker recorded the update of ``step`` (the run trains)."""
    deadline = time.monotonic() + timeout
    while not any(e["kind"] == "optimizer" and e["step"] >= step for e in run.events):
        assert time.monotonic() < deadline, f"no update {step} within {timeout} s"
        assert not run.done(), run.status
        time.sleep(0.05)


def recut_records(result) -> list:
    return [e for e in result.events if e["kind"] == "control" and e.get("what") == "recut"]


def max_diff(a: nn.Module, b: nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    return max(float((sa[k] - sb[k]).abs().max()) for k in sa)


@pytest.mark.parametrize("schedule", ["1f1b", "async-1f1b"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_recut_mid_run_trains_as_one_process(case, schedule, shared_cluster, no_leaks):
    model, X, Y, loss_fn, before, after = CASES[case]()
    fresh = lambda: copy.deepcopy(model)  # the reference trains its copy in place
    run = sdpipe.train(
        fresh(),
        (X, Y),
        loss_fn=loss_fn,
        stages=3,
        pipelines=1,
        policy="allreduce",
        schedule=schedule,
        cuts=before,
        optimizer="sgd",
        lr=LR,
        momentum=0.9,
        batch_size=BATCH,
        microbatches=M,
        epochs=EPOCHS,
        cluster=shared_cluster,
    )
    wait_for_step(run, 2)  # the records arrive in batches: early, so that the run cannot end before the re-cut
    assert run.recut(after) == after
    assert run.config.cuts == after and not run.paused  # paused for the re-cut (allreduce), resumed after
    result = run.result(timeout=600)
    assert_records_valid(result.events)
    mine = [e for e in recut_records(result) if e["applied_by"] == "worker"]
    assert sorted(e["stage"] for e in mine) == [0, 1, 2]
    assert len({(e["epoch"], e["batches"]) for e in mine}) == 1  # one step boundary for the whole pipeline
    epoch, j = mine[0]["epoch"], mine[0]["batches"]
    # what moved is what the two cuts differ by: every layer whose stage changed, sent once and received once
    old, new = (
        [s for s, (a, b) in enumerate(stage_bounds(list(c), len(model))) for _ in range(a, b)] for c in (before, after)
    )
    moved = sorted(i for i in range(len(model)) if old[i] != new[i])
    assert sorted(i for e in mine for i in e["sent"]) == moved == sorted(i for e in mine for i in e["received"])
    driver = [e for e in recut_records(result) if e["applied_by"] == "driver"]
    assert [(tuple(e["cuts"]), tuple(e["previous"])) for e in driver] == [(after, before)]
    every = run.config.resolved_update_every
    ref = reference(fresh(), X, Y, loss_fn, stages=3, schedule=schedule, every=every, recut=(epoch, j, before, after))
    assert max_diff(result.models[0], ref) < 1e-5
    assert max_diff(ref, model) > 1e-3  # the comparison could fail: training changed the weights
    assert result.config.cuts == after
    if schedule.startswith("async"):  # the moment mattered: the same re-cut one step later is another result
        moment = (epoch, j + 1, before, after)
        later = reference(fresh(), X, Y, loss_fn, stages=3, schedule=schedule, every=every, recut=moment)
        assert max_diff(later, ref) > 1e-6


def common(cluster, **kw) -> dict:
    base = dict(stages=2, batch_size=BATCH, microbatches=M, epochs=EPOCHS, optimizer="sgd", lr=LR, cluster=cluster)
    return {**base, **kw}


def test_replicas_stay_identical_across_a_recut_under_allreduce(shared_cluster, no_leaks):
    """Two pipelines: the run pauses for the re-cut at one step agreed in the collective, both re-cut there, and
    their replicas are identical at the end."""
    (X, Y), (EX, EY) = digits()
    run = sdpipe.train(digits_cnn(channels=8), (X, Y), eval_data=(EX, EY), pipelines=2, policy="allreduce",
                       cuts=(3,), **common(shared_cluster))  # fmt: skip
    wait_for_step(run, 6)
    assert run.recut((8,)) == (8,)
    result = run.result(timeout=600)
    assert_records_valid(result.events)
    mine = [e for e in recut_records(result) if e["applied_by"] == "worker"]
    assert len(mine) == 4 and len({e["step"] for e in mine}) == 1, mine
    assert result.max_param_diff() < 1e-6
    assert result.history[-1]["accuracy"] > 0.8
    assert [type(m).__name__ for m in result.models[0]] == [type(m).__name__ for m in digits_cnn(channels=8)]


def test_under_sdpipe_a_recut_is_taken_after_a_global_sync_and_waits_for_a_policy_switch(shared_cluster, no_leaks):
    """Paused, the pipelines hold: a switch from ``none`` to ``sdpipe`` asked for now is not taken up yet, and a
    re-cut says so in one line.  Once the resume took it up and the run is paused again, a re-cut that would wait
    for a global sync a paused run never reaches is refused in one line; asked without waiting, it is taken after
    the resume: every worker takes it at the first step boundary of an epoch, right after the global sync that
    ended the last one (its stage's two replicas, who agreed on it there), and the replicas end identical."""
    (X, Y), (EX, EY) = digits()
    # six epochs: the run is paused for the re-cut an epoch or two after the switch, and the re-cut needs a global
    # sync after that pause with a step boundary after it (an epoch of this run lasts about half a second)
    slow = sdpipe.Heterogeneity(slowdown={1: 2.0})
    run = sdpipe.train(digits_mlp(), (X, Y), eval_data=(EX, EY), pipelines=2, policy="none", heterogeneity=slow,
                       **common(shared_cluster, epochs=6))  # fmt: skip
    wait_for_step(run, 4)
    run.pause()
    run.set_policy("sdpipe")
    with pytest.raises(RuntimeError, match=r"^recut: the switch to policy 'sdpipe' is still being taken up; re-cut"):
        run.recut((4,))
    run.resume()
    deadline = time.monotonic() + 60
    while run._policy_pending():
        assert time.monotonic() < deadline and not run.done(), run.status
        time.sleep(0.1)
    run.pause()
    with pytest.raises(ValueError, match=r"^recut: under 'sdpipe' the pipelines take a re-cut after their next global"):
        run.recut((4,))
    assert run.recut((4,), wait=False) == (4,) and run.cuts == (4,) and run.paused
    with pytest.raises(RuntimeError, match=r"^recut: another re-cut is still being taken up"):
        run.recut((3,), wait=False)
    run.resume()
    result = run.result(timeout=600)
    assert_records_valid(result.events)
    mine = [e for e in recut_records(result) if e["applied_by"] == "worker"]
    assert sorted((e["pipeline"], e["stage"]) for e in mine) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for e in mine:
        assert e["batches"] == 0, e  # an epoch's first boundary
        own = [x for x in result.events if (x["pipeline"], x["stage"]) == (e["pipeline"], e["stage"])]
        syncs = [x for x in own if x["kind"] == "sync" and x["end"] <= e["start"] + 1e-6]
        last = max(syncs, key=lambda x: x["end"])  # the last averaging before it: the global sync
        assert last.get("reason") == "global" and sorted(last["group"]) == [0, 1], last
    assert len({e["epoch"] for e in mine}) == 1  # the same epoch's end for both pipelines
    assert result.max_param_diff() < 1e-5  # the last epoch's global sync
    assert result.config.cuts == (4,)
    assert [len(m) for m in result.models] == [5, 5]


def test_pipelines_under_none_recut_each_at_its_own_boundary(shared_cluster, no_leaks):
    (X, Y), _ = digits()
    run = sdpipe.train(digits_mlp(), (X, Y), pipelines=2, policy="none", cuts=(4,), **common(shared_cluster))
    wait_for_step(run, 4)
    assert run.recut("params") == (2,)
    result = run.result(timeout=600)
    mine = [e for e in recut_records(result) if e["applied_by"] == "worker"]
    assert sorted((e["pipeline"], e["stage"]) for e in mine) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for p in (0, 1):  # every stage of a pipeline at the same boundary
        assert len({(e["epoch"], e["batches"]) for e in mine if e["pipeline"] == p}) == 1
    assert all(h["loss"] < 1.0 for h in result.history if h["epoch"] == EPOCHS - 1)


def test_bad_recuts_get_one_line_before_anything_moves(shared_cluster, no_leaks):
    (X, Y), _ = digits()
    run = sdpipe.train(digits_mlp(), (X, Y), pipelines=1, **common(shared_cluster, epochs=1))
    run.result(timeout=300)
    allowed = r"'params', 'time' or 1 cut points in 1\.\.4 \(the start layer of stages 1\.\.1\)"
    for cuts, message in [
        ((5,), r"cuts: must be strictly increasing integers in 1\.\.4, got \[5\]"),
        ((0,), r"cuts: must be strictly increasing integers in 1\.\.4, got \[0\]"),
        ((1, 3), r"cuts: 2 stages need 1 cut points, got 2"),
        ("fast", rf"cuts: must be {allowed}, got 'fast'"),
        (2.5, rf"cuts: must be {allowed}, got 2\.5"),
        ([1.5], rf"cuts: must be {allowed}, got \[1\.5\]"),
        ([True], rf"cuts: must be {allowed}, got \[True\]"),
    ]:
        with pytest.raises(ValueError, match=f"^{message}$"):
            run.recut(cuts)
    with pytest.raises(ValueError, match=r"^timeout: "):
        run.recut((3,), timeout=-1)
    with pytest.raises(RuntimeError, match=rf"^recut: run {run.run_id} has already ended \(finished\)$"):
        run.recut((3,))
    ps = sdpipe.train(digits_mlp(), (X, Y), pipelines=1, policy="ps", **common(shared_cluster, epochs=1))
    ps.result(timeout=300)
    with pytest.raises(ValueError, match=r"^recut: policy 'ps' keeps a stage's weights in servers or peers for the "
                                         r"whole run; a run is re-cut under sdpipe, allreduce, none$"):  # fmt: skip
        ps.recut((3,))
    stages = [nn.Sequential(*list(digits_mlp())[:2]), nn.Sequential(*list(digits_mlp())[2:])]
    listed = sdpipe.train(stages, (X, Y), pipelines=1, **common(shared_cluster, epochs=1))
    listed.result(timeout=300)
    with pytest.raises(ValueError, match=r"^recut: the model was given as a list of stage modules; only an "):
        listed.recut((3,))
    with pytest.raises(ValueError, match=r"^rebalance: re-cuts an nn.Sequential; the model is list$"):
        sdpipe.train(stages, (X, Y), pipelines=1, rebalance=True, **common(shared_cluster, epochs=1))


def test_automatic_rebalancing_moves_layers_off_the_stage_that_stays_the_bottleneck(shared_cluster, no_leaks):
    """Started from a bad cut (stage 1 holds the last layer alone), the run re-cuts itself toward stage 1; after a
    live slowdown of stage 1 of every pipeline, it re-cuts again, moving layers back to stage 0.  Each automatic
    re-cut is a driver ``control`` record with its reason, every worker took it, and the run trains on."""
    (X, Y), (EX, EY) = digits()
    run = sdpipe.train(digits_cnn(channels=32), (X, Y), eval_data=(EX, EY), pipelines=2, policy="sdpipe", cuts=(9,),
                       rebalance={"steps": 8, "every": 2.0}, **common(shared_cluster, epochs=1000))  # fmt: skip

    def automatic(n: int, timeout: float = 120) -> list:
        deadline = time.monotonic() + timeout
        while True:
            made = [e for e in recut_records(run) if e["applied_by"] == "driver" and e.get("reason")]
            if len(made) >= n:
                return made
            assert time.monotonic() < deadline and not run.done(), (run.status, made, run.rebalancing)
            time.sleep(0.2)

    try:
        first = automatic(1)[0]
        assert run.rebalancing.startswith(("re-cut to ", "measuring the stages", "cut ")), run.rebalancing
        assert first["previous"] == [9] and first["cuts"][0] < 9, first
        assert first["reason"].startswith("stage 0 took "), first
        run.set_heterogeneity(compute_slowdown={(0, 1): 4.0, (1, 1): 4.0})
        second = automatic(2)[1]
        assert second["cuts"][0] > first["cuts"][0] and second["reason"].startswith("stage 1 took "), second
        assert run.cuts == tuple(automatic(2)[-1]["cuts"])
    finally:
        run.stop()
    result = run.result(timeout=300)
    assert_records_valid(result.events)
    for e in recut_records(result):
        if e["applied_by"] == "driver":
            took = [w for w in recut_records(result) if w["applied_by"] == "worker" and w["version"] == e["version"]]
            assert len(took) == 4, (e, took)


def test_a_checkpoint_after_a_recut_resumes_with_its_cut(shared_cluster, tmp_path, no_leaks):
    from sdpipe.checkpoint import load_checkpoint

    (X, Y), _ = digits()
    opts = dict(pipelines=1, policy="allreduce", checkpoint_every=1, checkpoint_dir=str(tmp_path))
    run = sdpipe.train(digits_mlp(), (X, Y), cuts=(4,), **common(shared_cluster, epochs=2), **opts)
    wait_for_step(run, 4)
    assert run.rebalancing is None  # no automatic re-cuts asked for
    assert run.recut((2,)) == (2,)
    run.result(timeout=300)
    assert load_checkpoint(tmp_path).config["cuts"] == [2]
    again = sdpipe.train(digits_mlp(), (X, Y), resume_from=str(tmp_path), **common(shared_cluster, epochs=3), **opts)
    assert again.config.cuts == (2,)  # the checkpoint's cut: its stages' weights are cut that way
    result = again.result(timeout=300)
    assert [h["epoch"] for h in result.history] == [2] and result.history[0]["loss"] < 0.5
