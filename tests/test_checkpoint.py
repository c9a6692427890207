"""Checkpoints written by real runs, read back, and resumed."""

import json
import os

import pytest

import sdpipe
from sdpipe.data import digits, digits_mlp

from helpers import assert_records_valid

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def data():
    return digits()


def max_diff(a, b) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return max(float((sa[k].float() - sb[k].float()).abs().max()) for k in sa)


def test_allreduce_resumed_from_a_checkpoint_equals_the_uninterrupted_run(data, shared_cluster, tmp_path):
    train_data, eval_data = data
    common = dict(
        stages=2, pipelines=2, policy="allreduce", epochs=4, batch_size=32, eval_data=eval_data, cluster=shared_cluster
    )
    whole = sdpipe.train(digits_mlp(), train_data, checkpoint_every=2, checkpoint_dir=tmp_path, **common)
    uninterrupted = whole.result(timeout=300)
    assert_records_valid(uninterrupted.events)  # checkpoint and save records among them
    assert [os.path.basename(p) for p in whole.checkpoints] == ["epoch-0002", "epoch-0004"]
    assert sorted(os.listdir(tmp_path)) == ["epoch-0002", "epoch-0004", "latest"]  # no staging folder left
    assert (tmp_path / "latest").read_text().strip() == "epoch-0004"
    assert sorted(os.listdir(tmp_path / "epoch-0002")) == [
        "manifest.json",
        "rank0.pt",
        "rank1.pt",
        "rank2.pt",
        "rank3.pt",
    ]
    assert [e["epoch"] for e in uninterrupted.events if e["kind"] == "checkpoint"] == [2, 4]

    ck = sdpipe.load_checkpoint(tmp_path / "epoch-0002")
    steps_per_epoch = whole.steps_per_epoch
    assert ck.epoch == 2 and ck.steps == {0: 2 * steps_per_epoch, 1: 2 * steps_per_epoch}
    assert ck.config["policy"] == "allreduce" and set(ck.states) == {(0, 0), (0, 1), (1, 0), (1, 1)}
    assert ck.states[(0, 1)]["optimizer"]["state"]  # Adam's moments are in it

    resumed = sdpipe.train(digits_mlp(seed=1), train_data, resume_from=tmp_path / "epoch-0002", **common).result(
        timeout=300
    )
    assert sorted({h["epoch"] for h in resumed.history}) == [2, 3]
    assert resumed.steps == uninterrupted.steps == {0: 4 * steps_per_epoch, 1: 4 * steps_per_epoch}
    for a, b in zip(uninterrupted.models, resumed.models, strict=True):
        assert max_diff(a, b) <= 1e-6
    # a fresh start from other initial weights does not land there: the comparison can fail
    fresh = sdpipe.train(digits_mlp(seed=1), train_data, **{**common, "epochs": 2}).result(timeout=300)
    assert max_diff(fresh.models[0], uninterrupted.models[0]) > 1e-3


def test_sdpipe_checkpoint_keeps_the_scheduler_and_resumes_from_latest(data, shared_cluster, tmp_path):
    train_data, _ = data
    common = dict(stages=2, pipelines=2, policy="sdpipe", batch_size=32, cluster=shared_cluster)
    sdpipe.train(digits_mlp(), train_data, epochs=2, checkpoint_every=1, checkpoint_dir=tmp_path, **common).result(
        timeout=300
    )
    manifest = json.loads((tmp_path / "epoch-0002" / "manifest.json").read_text())
    core = manifest["scheduler"]
    assert [st["stage"] for st in core["stages"]] == [0, 1] and all(st["round"] > 0 for st in core["stages"])
    resumed = sdpipe.train(digits_mlp(), train_data, epochs=3, resume_from=tmp_path, **common).result(timeout=300)
    assert sorted({h["epoch"] for h in resumed.history}) == [2]
    rounds = [e["round"] for e in resumed.events if e["kind"] == "group" and e["stage"] == 0]
    assert min(rounds) >= core["stages"][0]["round"]  # the rounds go on from the checkpoint's


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(resume_from="/nonexistent/ck"), "resume_from: no checkpoint at '/nonexistent/ck'"),
        (dict(checkpoint_every=2), "checkpoint_dir: needed when checkpoint_every > 0"),
        (dict(checkpoint_every=-1, checkpoint_dir="x"), "checkpoint_every: must be an integer >= 0"),
        (
            dict(checkpoint_every=3, sync_every=2, checkpoint_dir="x", policy="sdpipe"),
            "checkpoint_every: 3 is not a multiple of sync_every=2",
        ),
    ],
)
def test_bad_checkpoint_input_is_named_before_anything_starts(data, kwargs, message):
    with pytest.raises(ValueError) as e:
        sdpipe.train(digits_mlp(), data[0], cluster="tcp://127.0.0.1:1", **kwargs)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_a_checkpoint_that_does_not_fit_is_refused(data, shared_cluster, tmp_path):
    train_data, _ = data
    sdpipe.train(
        digits_mlp(),
        train_data,
        stages=2,
        pipelines=2,
        epochs=1,
        checkpoint_every=1,
        checkpoint_dir=tmp_path,
        cluster=shared_cluster,
    ).result(timeout=300)
    cases = [
        (dict(stages=1), "stages: the checkpoint at"),
        (dict(epochs=1), "epochs: the checkpoint at"),
        (dict(model=digits_mlp(hidden=64)), "model: stage 0 parameter"),
        (dict(optimizer="sgd"), "optimizer: the checkpoint at"),
    ]
    for change, message in cases:
        kwargs = dict(stages=2, pipelines=2, epochs=3, resume_from=tmp_path, cluster="tcp://127.0.0.1:1")
        kwargs.update(change)
        model = kwargs.pop("model", digits_mlp())
        with pytest.raises(ValueError) as e:
            sdpipe.train(model, train_data, **kwargs)
        assert str(e.value).startswith(message), str(e.value)
