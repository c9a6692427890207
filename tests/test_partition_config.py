"""Partitioning and configuration checks: no torch.distributed, no Dask."""

import inspect
import re
from dataclasses import fields

import pytest

from sdpipe.config import Heterogeneity, TrainConfig, config_keywords, field_docs
from sdpipe.core.partition import balanced_cuts, check_cuts, speed_cuts, stage_bounds, time_cuts


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
        cost = lambda cuts, w=w, n=n: max(sum(x + 1 for x in w[a:b]) for a, b in stage_bounds(cuts, n))
        best = min(cost(list(c)) for c in itertools.combinations(range(1, n), S - 1))
        got = balanced_cuts(w, S)
        assert len(got) == S - 1 and cost(got) == best


def test_time_cuts_minimize_the_slowest_stage_within_the_memory_limit():
    """Against every cut tried: the slowest stage's seconds least (with ``boundary``: a stage also pays for the
    cuts at its ends), among the cuts whose stages all fit ``limit`` (none fits: one line naming memory_limit)."""
    import itertools
    import random

    rng = random.Random(1)
    for _ in range(300):
        n = rng.randint(1, 8)
        t = [rng.choice([0.0, 0.001, 0.004, 0.02]) for _ in range(n)]
        mem = [rng.choice([1.0, 10.0, 100.0]) for _ in range(n)]
        S = rng.randint(1, n)
        limit = rng.choice([None, 50.0, 120.0, 1000.0])
        bd = rng.choice([None, [rng.choice([0.0, 0.002, 0.01]) for _ in range(n)]])

        def fits(cuts, n=n, mem=mem, limit=limit):
            return limit is None or all(sum(mem[a:b]) <= limit for a, b in stage_bounds(list(cuts), n))

        def slowest(cuts, n=n, t=t, bd=bd):
            edge = [0.0] * (n + 1) if bd is None else [0.0, *bd[:-1], 0.0]
            return max(sum(t[a:b]) + edge[a] + edge[b] for a, b in stage_bounds(list(cuts), n))

        allowed = [c for c in itertools.combinations(range(1, n), S - 1) if fits(c)]
        if not allowed:
            with pytest.raises(ValueError, match=r"^memory_limit: no cut into \d+ stages fits"):
                time_cuts(t, S, mem, limit, bd)
            continue
        got = time_cuts(t, S, mem, limit, bd)
        assert len(got) == S - 1 and fits(got) and slowest(got) == pytest.approx(min(slowest(c) for c in allowed))
    assert time_cuts([0.001, 0.001, 0.01, 0.001], 2) == [2]  # the heavy layer and the light last one: 11 ms
    # the cut after layer 1 (stages of 4 and 12 ms) sends a large output: with its 5 ms they take 9 and 17 ms, so the
    # cut after layer 0 (2 and 14 ms) is faster
    assert time_cuts([0.002, 0.002, 0.01, 0.002], 2, boundary=[0.0, 0.005, 0.0, 0.0]) == [1]
    with pytest.raises(ValueError, match=r"^boundary: needs one number of seconds per layer$"):
        time_cuts([0.001, 0.001], 2, boundary=[0.0])


def test_speed_cuts_minimize_the_slowest_stage_at_each_stages_speed():
    """Against every cut tried: stage k takes factors[k] times its layers' seconds; the slowest stage least."""
    import itertools
    import random

    rng = random.Random(2)
    for _ in range(300):
        n = rng.randint(1, 8)
        t = [rng.choice([0.0, 0.001, 0.004, 0.02]) for _ in range(n)]
        S = rng.randint(1, n)
        f = [rng.choice([1.0, 1.5, 3.0]) for _ in range(S)]

        def slowest(cuts, n=n, t=t, f=f):
            return max(k * sum(t[a:b]) for k, (a, b) in zip(f, stage_bounds(list(cuts), n), strict=True))

        got = speed_cuts(t, f)
        best = min(slowest(c) for c in itertools.combinations(range(1, n), S - 1))
        assert len(got) == S - 1 and slowest(got) == pytest.approx(best)
    assert speed_cuts([1.0] * 6, [1.0, 1.0, 1.0]) == time_cuts([1.0] * 6, 3) == [2, 4]
    assert speed_cuts([1.0] * 6, [1.0, 4.0, 1.0]) == [1, 2]  # the slowed stage keeps one layer (ties: earliest)


def test_an_automatic_recut_follows_a_slowed_stage_and_only_where_it_pays():
    """The rebalancer's rule (sdpipe.driver.rebalance): per stage (time, CPU time, micro-batches) a step; a re-cut
    only where one stage exceeds the others' mean by the margin and the model (each stage's speed its time over its
    CPU time; its CPU work its layers' driver-measured times, scaled by one factor for all stages, plus a fixed
    cost) predicts a cut that much faster."""
    from sdpipe.driver.rebalance import StageTimes, decide, predict

    seconds = [1.0] * 6  # six layers of 1 ms a micro-batch, 4 micro-batches a step, cut (2, 4): 8 ms of CPU each
    slowed = [(8.0, 8.0, 4), (24.0, 8.0, 4), (8.0, 8.0, 4)]  # stage 1 sleeps twice its compute
    assert decide(slowed, seconds, (2, 4), 0.25) == (2, 3)  # one layer left on it: 12 ms, not 24
    # the driver timed the layers at a quarter of the workers' time (alone, on more threads): the same cut, where
    # taking the CPU beyond a quarter as a fixed cost would predict one layer at 21 ms, not 25% faster than 24
    assert decide(slowed, [0.25] * 6, (2, 4), 0.25) == (2, 3)
    assert decide([(8.0, 8.0, 4), (9.0, 8.8, 4), (8.0, 8.0, 4)], seconds, (2, 4), 0.25) is None  # no bottleneck
    # the bottleneck holds a single layer: no cut makes it faster
    assert decide([(4.0, 4.0, 4), (20.0, 4.0, 4), (4.0, 4.0, 4)], [1.0] * 3, (1, 2), 0.25) is None
    # why not, as Run.rebalancing says it (these figures are in seconds: 20 s a step is "20000.0 ms")
    assert predict([(8.0, 8.0, 4), (9.0, 8.8, 4), (8.0, 8.0, 4)], seconds, (2, 4), 0.25) == (
        None,
        "within 25% of the others' mean",
    )
    _, why = predict([(4.0, 4.0, 4), (20.0, 4.0, 4), (4.0, 4.0, 4)], [1.0] * 3, (1, 2), 0.25)
    assert why == "the model's best cut (1, 2) takes its slowest stage to 20000.0 ms from 20000.0 ms, not 25% faster"
    assert predict(slowed, seconds, (2, 4), 0.25) == ((2, 3), "")
    # a bad cut: stage 1 holds one layer and spends 4 ms a step whatever it holds (the loss, autograd); its own
    # time over its layers' (8 / 4) is not a 2x slower worker, and the re-cut evens the stages out
    bad = [(36.0, 36.0, 4), (8.0, 8.0, 4)]
    assert decide(bad, [1.0] * 10, (9,), 0.25) == (5,)  # 20 and 24 ms: the best of 10 layers and 4 ms fixed
    times = StageTimes(keep=2)

    def span(kind, p, s, step, t0, t1, **kw):
        return dict(kind=kind, pipeline=p, stage=s, step=step, start=t0, end=t1, **kw)

    records = []
    for p in range(3):
        for step in range(4):
            t = 10.0 + step
            records += [span("forward", p, 0, step, t, t + 0.1, cpu=0.1)]
            records += [span("backward", p, 0, step, t, t + 0.2, cpu=0.2)]
            slow = 3.0 if p < 2 else 1.0  # stage 1 slowed in two of the three pipelines
            records += [span("forward", p, 1, step, t, t + 0.1 * slow, cpu=0.1), span("wait", p, 1, step, t, t + 5.0)]
            records += [span("straggle", p, 1, step, t, t + 0.2 * slow, what="slowdown")]
    records.append(span("forward", 0, 0, 0, 1.0, 9.0, cpu=8.0))  # before the last change: left out
    times.reset(5.0)
    times.take(records)
    got = times.stage_times([0, 1, 2], 2)
    # waits never count; the median pipeline is a slowed one; CPU time only from forwards and backwards
    assert [tuple(round(x, 6) for x in t) for t in got] == [(0.3, 0.3, 1.0), (0.9, 0.1, 1.0)]
    assert times.stage_times([0, 1, 2, 3], 3) is None  # a stage with no worker measured yet


def test_layer_costs_find_the_heavy_layer_and_leave_the_weights_as_they_were():
    import torch
    from torch import nn

    from sdpipe.driver.layers import measure, memory_of

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1024), nn.Linear(1024, 1024), nn.Linear(1024, 4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
    costs = measure(list(model), x, y, nn.CrossEntropyLoss())
    assert len(costs) == 5 and all(c.forward >= 0 and c.backward >= 0 for c in costs)
    assert max(range(5), key=lambda i: costs[i].seconds) == 3  # the 1024 x 1024 layer
    assert costs[3].weight_bytes == (1024 * 1024 + 1024) * 4 and costs[3].activation_bytes == 32 * 1024 * 4
    assert memory_of(costs[3], 4) == 4 * costs[3].weight_bytes + 4 * costs[3].activation_bytes
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


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

    from sdpipe.core.partition import partition
    from sdpipe.data import digits_mlp

    model = digits_mlp()
    parts = partition(model, 2)
    assert [len(p) for p in parts] == [2, 3]
    assert sum(len(p) for p in partition(model, 2, cuts=[4])) == 5 and len(partition(model, 2, cuts=[4])[0]) == 4
    mods = [nn.Linear(2, 2), nn.Linear(2, 2)]
    assert partition(mods, 2) == mods
    with pytest.raises(ValueError, match="stages: 3 given but the model is a list of 2"):
        partition(mods, 3)
    with pytest.raises(ValueError, match=re.escape("model: must be an nn.Sequential")):
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
        (
            dict(scheduler={"weighting": "by-speed"}),
            r"policy.weighting: 'by-speed' is not allowed; use one of 'progress', 'uniform'",
        ),
        (dict(momentum=1.5), r"momentum: must be a number from 0 to 1, got 1.5"),
        (dict(lr="fast"), r"lr: must be a number, got 'fast'"),
        (dict(cuts="fast"), r"cuts: must be one of params, time or cut points \(the start layer of stages"),
        (dict(cuts=3), r"cuts: must be one of params, time or cut points"),
        (dict(memory_limit=1e9), r"memory_limit: applies to cuts='time' only, got cuts=None"),
        (dict(cuts="time", memory_limit=0), r"memory_limit: must be > 0.0, got 0"),
        (dict(rebalance=3), r"rebalance: must be True, a sdpipe.Rebalance, a dict of its fields or None, got int"),
        (dict(rebalance={"margin": 0}), r"rebalance.margin: must be > 0.0, got 0"),
        (dict(rebalance={"slack": 1}), r"rebalance: unknown field 'slack'; the fields are margin, steps, every"),
        (dict(rebalance=True, policy="adpsgd"), r"rebalance: policy 'adpsgd' keeps a stage's weights in servers or"),
    ],
)
def test_config_rejects_bad_input_with_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message) as err:
        TrainConfig(**kwargs)
    assert "\n" not in str(err.value)


def test_heterogeneity_checks_and_round_trip():
    with pytest.raises(ValueError, match=r"heterogeneity.slowdown\[1\]: must be >= 1.0"):
        Heterogeneity(slowdown={1: 0.5})
    with pytest.raises(ValueError, match="straggle_prob: must be a number from 0 to 1, got 2"):
        Heterogeneity(straggle_prob=2)
    h = Heterogeneity(slowdown={1: 4.0, (0, 1): 2.0}, straggle_prob=0.1, straggle_delay=0.05, link_delay={2: 0.01})
    assert Heterogeneity.from_dict(h.to_dict()) == h
    assert h.slowdown_of(1, 0) == 4.0 and h.slowdown_of(0, 1) == 2.0 and h.slowdown_of(0, 0) == 1.0
    assert h.link_delay_of(2, 1) == 0.01


def test_field_docs_are_the_strings_under_the_fields():
    docs = field_docs(TrainConfig)
    assert list(docs) == [f.name for f in fields(TrainConfig)] and all(docs.values())
    assert docs["stages"] == "Number of stages S the model is cut into."
    assert docs["sync_every"].startswith(
        "Epochs between global syncs (every pipeline stops at one step and the replicas are averaged) under"
    )  # two source lines, one line here
    assert docs["policy"] == (
        "How the D replicas of a stage synchronize: one of POLICIES (sdpipe, allreduce, ps, adpsgd, none)."
    )
    assert field_docs(Heterogeneity)["straggle_delay"] == (
        "Seconds a transient straggle adds to the worker's step (slept after its first forward or backward)."
    )


@config_keywords
def _train(model, data, *, eval_data=None, loss_fn=None, **options):
    """Train a dummy."""
    return model, data, eval_data, options


def test_config_keywords_lists_the_fields_and_passes_only_them():
    params = list(inspect.signature(_train).parameters.values())
    assert [p.name for p in params] == ["model", "data", "eval_data", "loss_fn", *(f.name for f in fields(TrainConfig))]
    for p, f in zip(params[4:], fields(TrainConfig), strict=True):
        assert p.kind is p.KEYWORD_ONLY and p.default == f.default, p
    assert str(params[4]) == "stages: int = 2" and str(params[-1]) == "checkpoint_dir: Optional[str] = None"
    doc = " ".join(_train.__doc__.split())
    assert doc.startswith("Train a dummy. Options (TrainConfig fields)")
    assert all(f"{name} : " in doc and text in doc for name, text in field_docs(TrainConfig).items())
    assert _train(1, 2, eval_data=3, stages=4, lr=0.1) == (1, 2, 3, {"stages": 4, "lr": 0.1})
    with pytest.raises(TypeError) as err:
        _train(1, 2, stagez=4)
    assert str(err.value).startswith(
        "_train() got an unexpected keyword argument 'stagez' (did you mean 'stages'?); "
        "keywords are eval_data, loss_fn, stages, pipelines, policy,"
    )
    assert "\n" not in str(err.value)
    with pytest.raises(TypeError, match=r"^_train\(\) got an unexpected keyword argument 'xyz'; keywords are "):
        _train(1, 2, xyz=4)
    with pytest.raises(TypeError, match="has parameters that are TrainConfig fields: stages"):
        config_keywords(lambda *, stages=2, **options: None)
    with pytest.raises(TypeError, match=r"needs a \*\*options parameter"):
        config_keywords(lambda *, eval_data=None: None)
