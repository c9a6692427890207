"""Training on a real Dask LocalCluster with torch.distributed (gloo) on the CPU."""

import importlib
import re
import sys
import time

import pytest
import torch

import sdpipe
from sdpipe.data import batch_indices, digits, digits_mlp, steps_per_epoch

from helpers import assert_records_valid, live_process_groups, port_closed

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def data():
    return digits()


def reference_training(model, X, Y, *, epochs, batch_size, lr, seed=0):
    """Plain single-process training on the very batches a 1-pipeline run reads."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for epoch in range(epochs):
        for b in range(steps_per_epoch(len(X), batch_size, 1)):
            idx = batch_indices(len(X), batch_size, seed, epoch, b)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(X[idx]), Y[idx]).backward()
            opt.step()
    return model


def reference_averaging(model, X, Y, *, pipelines, epochs, batch_size, lr, seed=0):
    """One process, one step per step of ``allreduce``: the mean of the gradients of the batches the pipelines read
    (pipeline p reads batch j x D + p at step j), then the optimizer."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for epoch in range(epochs):
        for j in range(steps_per_epoch(len(X), batch_size, pipelines)):
            opt.zero_grad()
            for p in range(pipelines):
                idx = batch_indices(len(X), batch_size, seed, epoch, j * pipelines + p)
                (torch.nn.functional.cross_entropy(model(X[idx]), Y[idx]) / pipelines).backward()
            opt.step()
    return model


def max_diff(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    return max(float((sa[k] - sb[k]).abs().max()) for k in sa)


def test_allreduce_demo_accuracy_identical_models(data, no_leaks):
    (train_data, eval_data) = data
    run = sdpipe.train(
        digits_mlp(), train_data, eval_data=eval_data, stages=2, pipelines=2, policy="allreduce", epochs=10
    )
    result = run.result(timeout=300)
    assert_records_valid(result.events)
    final = [h for h in result.history if h["epoch"] == 9]
    assert len(final) == 2 and all(h["accuracy"] >= 0.95 for h in final), final
    assert result.max_param_diff() < 1e-6
    assert {h["pipeline"] for h in result.history} == {0, 1} and len(result.history) == 20
    assert all(h["samples_per_s"] > 0 and h["loss"] > 0 for h in result.history)
    # the trained models really are the ones that scored: evaluate them here
    EX, EY = eval_data
    with torch.no_grad():
        acc = float((result.models[0](EX).argmax(1) == EY).float().mean())
    assert acc == pytest.approx(final[0]["accuracy"])
    # events: spans of every kind, on one clock, sync spans name their group
    kinds = {e["kind"] for e in result.events}
    assert {"forward", "backward", "send", "recv", "optimizer", "sync", "wait"} <= kinds
    syncs = [e for e in result.events if e["kind"] == "sync"]
    assert syncs and all(e["group"] == [0, 1] for e in syncs)
    spans = [e for e in result.events if e["kind"] in ("forward", "backward")]
    assert all(0 <= e["start"] <= e["end"] <= result.wall_time + 1e-6 for e in spans)
    assert {(e["pipeline"], e["stage"]) for e in spans} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    assert all(e["microbatch"] in range(4) for e in spans)
    # forward of a micro-batch on stage 1 starts after stage 0 finished it (same step)
    f = {(e["pipeline"], e["stage"], e["step"], e["microbatch"]): e for e in result.events if e["kind"] == "forward"}
    assert all(f[(p, 1, st, m)]["start"] >= f[(p, 0, st, m)]["end"] for (p, s, st, m) in f if s == 0)
    assert port_closed(run.store_port)


def test_none_policy_models_differ(data, shared_cluster, no_leaks):
    train_data, _ = data
    result = sdpipe.train(
        digits_mlp(), train_data, stages=2, pipelines=2, policy="none", epochs=1, cluster=shared_cluster
    ).result(timeout=300)
    assert_records_valid(result.events)
    assert result.max_param_diff() > 1e-3
    assert not any(e["kind"] == "sync" for e in result.events)
    assert live_process_groups(shared_cluster) == 0


@pytest.mark.parametrize("stages", [2, 4])
def test_gpipe_and_1f1b_match_single_process(data, shared_cluster, stages):
    (X, Y), _ = data
    common = dict(
        stages=stages,
        pipelines=1,
        epochs=2,
        optimizer="sgd",
        lr=0.05,
        momentum=0.9,
        batch_size=32,
        microbatches=4,
        cluster=shared_cluster,
    )
    r1 = sdpipe.train(digits_mlp(), (X, Y), schedule="1f1b", **common).result(timeout=300)
    r2 = sdpipe.train(digits_mlp(), (X, Y), schedule="gpipe", **common).result(timeout=300)
    ref = reference_training(digits_mlp(), X, Y, epochs=2, batch_size=32, lr=0.05)
    assert max_diff(r1.models[0], r2.models[0]) < 1e-5
    assert max_diff(r1.models[0], ref) < 1e-5
    assert max_diff(digits_mlp(), ref) > 1e-2  # training moved the weights
    assert live_process_groups(shared_cluster) == 0


def test_allreduce_over_pipelines_matches_one_process_averaging_their_batches(data, shared_cluster, no_leaks):
    """D = 2 replicas of a 2-stage pipeline: every step's averaged gradient (taken in place in the stage's flat
    gradient buffer) is the one process's mean over the two batches, step after step."""
    (X, Y), _ = data
    run = sdpipe.train(
        digits_mlp(), (X, Y), stages=2, pipelines=2, policy="allreduce", epochs=2, optimizer="sgd", lr=0.05,
        momentum=0.9, batch_size=32, microbatches=4, cluster=shared_cluster,
    )  # fmt: skip
    result = run.result(timeout=300)
    ref = reference_averaging(digits_mlp(), X, Y, pipelines=2, epochs=2, batch_size=32, lr=0.05)
    assert max_diff(result.models[0], ref) < 1e-5 and max_diff(result.models[1], ref) < 1e-5
    assert max_diff(digits_mlp(), ref) > 1e-2  # training moved the weights


def test_existing_cluster_by_address_and_stop(data, shared_cluster, no_leaks):
    train_data, _ = data
    addr = shared_cluster.scheduler.address
    run = sdpipe.train(digits_mlp(), train_data, stages=2, pipelines=2, epochs=500, cluster=addr)
    deadline = time.monotonic() + 120
    while not any(e["kind"] == "optimizer" for e in run.events_since(0)[0]):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    run.stop()
    result = run.result(timeout=60)
    assert result.stopped and run.status == "stopped"
    # every pipeline stopped after the same number of steps (allreduce couples them)
    assert len(set(result.steps.values())) == 1 and 0 < result.steps[0] < 500 * 22
    assert result.max_param_diff() < 1e-6
    assert live_process_groups(shared_cluster) == 0
    assert port_closed(run.store_port)
    # the cluster stays usable for the next run
    assert (
        sdpipe.train(digits_mlp(), train_data, stages=1, pipelines=4, epochs=1, cluster=shared_cluster)
        .result(timeout=120)
        .history
    )


def test_events_stream_while_running(data, shared_cluster):
    train_data, _ = data
    run = sdpipe.train(digits_mlp(), train_data, stages=2, pipelines=2, epochs=3, cluster=shared_cluster)
    seen, cursor, polls = [], 0, 0
    while not run.done():
        new, cursor = run.events_since(cursor)
        seen += new
        polls += 1
        time.sleep(0.05)
    result = run.result()
    seen += run.events_since(cursor)[0]
    assert len(seen) == len(result.events) and polls > 3
    assert len([e for e in seen if e["kind"] == "epoch"]) == 6


def test_unreachable_scheduler_fails_before_launch(data):
    """One line, and the half-started Dask client is closed: no IO thread of it is left for the collector."""
    import threading

    train_data, _ = data
    loops = {t for t in threading.enumerate() if t.name == "IO loop"}
    t = time.monotonic()
    with pytest.raises(
        ConnectionError, match=re.escape("cluster: cannot reach a Dask scheduler at 'tcp://127.0.0.1:9'")
    ):
        sdpipe.train(digits_mlp(), train_data, cluster="tcp://127.0.0.1:9")
    assert time.monotonic() - t < 30
    assert {t for t in threading.enumerate() if t.name == "IO loop" and t.is_alive()} <= loops


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(stages=6), "stages: 6 exceeds the 5 layers"),
        (dict(pipelines=0), "pipelines: must be an integer >= 1"),
        (dict(policy="gossip"), "policy: 'gossip' is not one of"),
        (dict(schedule="zigzag"), "schedule: 'zigzag' is not one of"),
        (dict(batch_size=30), "batch_size: 30 is not divisible into 4 micro-batches"),
        (dict(batch_size=1024), "batch_size: 1024 x 2 pipelines exceeds the 1437 training samples"),
        (dict(batch_size=2048, policy="sdpipe"), "batch_size: 2048 exceeds the 1437 training samples"),
        (dict(cluster=3.5), "cluster: must be None, a scheduler address"),
    ],
)
def test_bad_input_fails_before_any_worker_starts(data, kwargs, message, no_leaks):
    train_data, _ = data
    with pytest.raises(ValueError, match=message):
        sdpipe.train(digits_mlp(), train_data, **kwargs)


def test_too_small_cluster_is_rejected(data, shared_cluster):
    train_data, _ = data
    with pytest.raises(ValueError, match="cluster: needs 6 Dask workers"):
        sdpipe.train(digits_mlp(), train_data, stages=3, pipelines=2, cluster=shared_cluster)


def test_model_that_does_not_fit_the_data(data):
    (X, Y), _ = data
    with pytest.raises(ValueError, match="model: stage 0 fails on a micro-batch of train_data"):
        sdpipe.train(torch.nn.Sequential(torch.nn.Linear(10, 4), torch.nn.Linear(4, 2)), (X, Y))
    with pytest.raises(ValueError, match="train_data: inputs hold 1437 samples but targets hold 3"):
        sdpipe.train(digits_mlp(), (X, Y[:3]))


class FailsMidRun(torch.nn.Module):
    """Passes its input through, until its ``at``-th training forward (4 micro-batches a step: step ``at // 4``),
    where it raises (``how="raise"``) or turns its output NaN (``how="nan"``)."""

    def __init__(self, at: int, how: str):
        super().__init__()
        self.at, self.how, self.calls = at, how, 0

    def forward(self, x):
        if self.training and torch.is_grad_enabled():
            self.calls += 1
            if self.calls > self.at:
                if self.how == "raise":
                    raise RuntimeError("boom in stage 1")
                return x * float("nan")
        return x


def test_worker_exception_ends_the_run_with_its_error(data, shared_cluster):
    """A stage that raises on one batch mid-run: one line naming the stage, the pipeline, the step and the cause."""
    (X, Y), _ = data
    model = [
        torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU()),
        torch.nn.Sequential(FailsMidRun(at=20, how="raise"), torch.nn.Linear(32, 10)),
    ]
    run = sdpipe.train(model, (X, Y), stages=2, pipelines=2, epochs=1, cluster=shared_cluster)
    t = time.monotonic()
    with pytest.raises(
        sdpipe.RunError, match=r"pipeline \d stage 1 .* failed at step 5 \(epoch 0\): RuntimeError: boom in stage 1"
    ) as err:
        run.result(timeout=120)
    assert "\n" not in str(err.value)
    assert time.monotonic() - t < 60
    assert run.status == "error"
    assert live_process_groups(shared_cluster) == 0


@pytest.mark.parametrize("policy", ["allreduce", "sdpipe"])
def test_a_nan_ends_the_run_before_it_reaches_an_average(data, shared_cluster, policy):
    """Stage 1's output turns NaN at step 5: the gradients are found not finite before the policy averages them
    (allreduce averages gradients, sdpipe weights), and the run ends with one line naming where and when."""
    (X, Y), _ = data
    model = [
        torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU()),
        torch.nn.Sequential(FailsMidRun(at=20, how="nan"), torch.nn.Linear(32, 10)),
    ]
    run = sdpipe.train(model, (X, Y), stages=2, pipelines=2, epochs=1, policy=policy, cluster=shared_cluster)
    with pytest.raises(
        sdpipe.RunError, match=r"stage \d .* failed at step 5 \(epoch 0\): NotFinite: the gradients"
    ) as e:
        run.result(timeout=120)
    assert "\n" not in str(e.value) and "learning rate" in str(e.value)
    # no sync span of step 5 or later completed: nothing not finite was averaged
    assert not [
        ev for ev in run.events_since(0)[0] if ev["kind"] == "sync" and ev["step"] is not None and ev["step"] >= 5
    ]
    assert live_process_groups(shared_cluster) == 0


def test_a_model_whose_module_the_workers_cannot_import_ends_in_one_line_with_the_remedy(
    data, shared_cluster, tmp_path, monkeypatch
):
    """A stage's class lives in a module the driver imported after the workers started (a user's models.py that
    is not on the workers' path): the run ends before any rank starts, naming the module and the remedy."""
    (X, Y), _ = data
    name = f"usermodels_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(
        "import torch\n\n\nclass Scale(torch.nn.Module):\n    def forward(self, x):\n        return x * 1.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    user = importlib.import_module(name)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), user.Scale(), torch.nn.Linear(32, 10))
        run = sdpipe.train(model, (X, Y), stages=2, pipelines=2, epochs=1, cluster=shared_cluster)
        with pytest.raises(
            ValueError,
            match=(
                rf"model: worker .* cannot load stage 1's module \(ModuleNotFoundError: No module named '{name}'\); "
                rf".*client.upload_file\('{name}.py'\)"
            ),
        ) as err:
            run.result(timeout=120)
        assert "\n" not in str(err.value)
        assert run._futures == []  # no rank was submitted
    finally:
        sys.modules.pop(name, None)
