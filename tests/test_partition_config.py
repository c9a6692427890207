"""Partitioning and configuration checks: no torch.distributed, no Dask."""

import pytest

from sdpipe.config import Heterogeneity, TrainConfig
from sdpipe.partition import balanced_cuts, check_cuts, stage_bounds


def test_balanced_cuts_minimizes_heaviest_stage():
    assert balanced_cuts([8256, 0, 16512, 0, 1290], 2) == [2]
    assert balanced_cuts([1, 1, 1, 1], 4) == [1, 2, 3]
    assert balanced_cuts([10, 10, 10, 10], 2) == [2]
    assert balanced_cuts([100, 1, 1, 1, 100], 2) in ([2], [3])
    assert balanced_cuts([5], 1) == []


def test_balanced_cuts_brute_force_agreement():
    import itertools
    import random

    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 7)
        w = [rng.choice([0, 1, 5, 50, 300]) for _ in range(n)]
        S = rng.randint(1, n)
        cost = lambda cuts: max(sum(x + 1 for x in w[a:b]) for a, b in stage_bounds(cuts, n))
        best = min(cost(list(c)) for c in itertools.combinations(range(1, n), S - 1))
        got = balanced_cuts(w, S)
        assert len(got) == S - 1 and cost(got) == best


def test_partition_errors():
    with pytest.raises(ValueError, match=r"stages: 5 exceeds the 4 layers of the model; allowed 1\.\.4"):
        balanced_cuts([1, 1, 1, 1], 5)
    with pytest.raises(ValueError, match="cuts: 3 stages need 2 cut points"):
        check_cuts([2], 5, 3)
    with pytest.raises(ValueError, match="strictly increasing"):
        check_cuts([3, 2], 5, 3)
    with pytest.raises(ValueError, match="strictly increasing"):
        check_cuts([0, 2], 5, 3)


def test_partition_sequential_and_list():
    from torch import nn

    from sdpipe.data import digits_mlp
    from sdpipe.partition import partition

    model = digits_mlp()
    parts = partition(model, 2)
    assert [len(p) for p in parts] == [2, 3]
    assert sum(len(p) for p in partition(model, 2, cuts=[4])) == 5 and len(partition(model, 2, cuts=[4])[0]) == 4
    mods = [nn.Linear(2, 2), nn.Linear(2, 2)]
    assert partition(mods, 2) == mods
    with pytest.raises(ValueError, match="stages: 3 given but the model is a list of 2"):
        partition(mods, 3)
    with pytest.raises(ValueError, match="model: must be an nn.Sequential"):
        partition(nn.Linear(2, 2), 1)
    with pytest.raises(ValueError, match="stages: 6 exceeds the 5 layers"):
        partition(model, 6)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(pipelines=0), "pipelines: must be an integer >= 1, got 0"),
        (dict(stages=0), "stages: must be an integer >= 1"),
        (dict(policy="gossip"), "policy: 'gossip' is not one of sdpipe, allreduce, ps, adpsgd, none"),
        (dict(schedule="zigzag"), "schedule: 'zigzag' is not one of 1f1b, gpipe"),
        (dict(batch_size=30, microbatches=4), "batch_size: 30 is not divisible into 4 micro-batches"),
        (dict(optimizer="lbfgs"), "optimizer: 'lbfgs' is not one of sgd, adam, adamw"),
        (dict(lr=0), "lr: must be > 0.0"),
        (dict(device="tpu"), "device: 'tpu' is not one of cpu, cuda"),
        (dict(backend="nccl"), "backend: 'nccl' needs device='cuda'"),
        (dict(timeout=-1), "timeout: must be > 0.0"),
        (dict(heterogeneity=Heterogeneity(slowdown={5: 2.0})), r"heterogeneity.slowdown: key 5 names no worker"),
        (dict(scheduler={"weighting": "by-speed"}), r"policy.weighting: 'by-speed' is not allowed; use one of 'progress', 'uniform'"),
    ],
)
def test_config_rejects_bad_input_with_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message) as err:
        TrainConfig(**kwargs)
    assert "\n" not in str(err.value)


def test_heterogeneity_checks_and_round_trip():
    with pytest.raises(ValueError, match=r"heterogeneity.slowdown\[1\]: must be >= 1.0"):
        Heterogeneity(slowdown={1: 0.5})
    with pytest.raises(ValueError, match="straggle_prob: must be >= 0.0 and <= 1.0"):
        Heterogeneity(straggle_prob=2)
    h = Heterogeneity(slowdown={1: 4.0, (0, 1): 2.0}, straggle_prob=0.1, straggle_delay=0.05, link_delay={2: 0.01})
    assert Heterogeneity.from_dict(h.to_dict()) == h
    assert h.slowdown_of(1, 0) == 4.0 and h.slowdown_of(0, 1) == 2.0 and h.slowdown_of(0, 0) == 1.0
    assert h.link_delay_of(2, 1) == 0.01
