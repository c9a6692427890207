"""Workload profiles: model tables recomputed with torch, per-stage costs against the cited figures."""

import itertools
import math

import pytest

import sdpipe
from sdpipe.simulation.profiles import (
    BANDWIDTHS,
    BERT_BASE_BLOCKS,
    BERT_BASE_PARAMS,
    BERT_LARGE_FLOPS,
    GPUS,
    LAYOUTS,
    OPTIMIZER_BYTES_PER_PARAM,
    PRECISIONS,
    PROFILES,
    RESNET50_BLOCKS,
    RESNET50_PARAMS,
    STEP_OVERHEAD,
    bert_base,
    network,
    profile,
    resnet50,
    stage_blocks,
)

CLASSIFIER = 768 * 2 + 2  # the BERT-base profile's 2-way classifier, outside the public total
BERT_LARGE_PARAMS = 335_141_888  # bert-large-uncased with its pooler (Hugging Face BertModel)


def compute(costs):
    return [f + b for f, b in zip(costs.forward, costs.backward, strict=True)]


# --- the tables, rebuilt with torch ------------------------------------------------------------


def _resnet50_blocks():
    """ResNet-50 v1.5 as torchvision defines it, as (name, module) blocks."""
    from torch import nn

    class Bottleneck(nn.Module):
        def __init__(self, inp, width, stride):
            super().__init__()
            out = 4 * width
            self.conv1, self.bn1 = nn.Conv2d(inp, width, 1, bias=False), nn.BatchNorm2d(width)
            self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
            self.conv3, self.bn3 = nn.Conv2d(width, out, 1, bias=False), nn.BatchNorm2d(out)
            self.down = None
            if stride != 1 or inp != out:
                self.down = nn.Sequential(nn.Conv2d(inp, out, 1, stride, bias=False), nn.BatchNorm2d(out))

        def forward(self, x):
            identity = x if self.down is None else self.down(x)
            y = self.bn1(self.conv1(x)).relu()
            y = self.bn2(self.conv2(y)).relu()
            return (self.bn3(self.conv3(y)) + identity).relu()

    stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
    blocks = [("stem", stem)]
    inp = 64
    for layer, (width, n, stride) in enumerate([(64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)], 1):
        for i in range(n):
            blocks.append((f"layer{layer}.{i}", Bottleneck(inp, width, stride if i == 0 else 1)))
            inp = 4 * width
    blocks.append(("head", nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2048, 1000))))
    return blocks


def _bert_blocks(hidden, inter, heads, vocab=30522, positions=512):
    """BERT's embeddings, one encoder layer, and the pooler with a 2-way classifier."""
    import torch
    from torch import nn

    class Embeddings(nn.Module):
        def __init__(self):
            super().__init__()
            self.word, self.position = nn.Embedding(vocab, hidden), nn.Embedding(positions, hidden)
            self.segment, self.norm = nn.Embedding(2, hidden), nn.LayerNorm(hidden)

        def forward(self, ids):
            pos = torch.arange(ids.shape[1], device=ids.device)[None]
            return self.norm(self.word(ids) + self.position(pos) + self.segment(torch.zeros_like(ids)))

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden) for _ in range(4))
            self.up, self.down = nn.Linear(hidden, inter), nn.Linear(inter, hidden)
            self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)

        def forward(self, x):
            b, n, _ = x.shape
            split = lambda t: t.view(b, n, heads, hidden // heads).transpose(1, 2)
            scores = split(self.q(x)) @ split(self.k(x)).transpose(-1, -2) / math.sqrt(hidden // heads)
            context = (scores.softmax(-1) @ split(self.v(x))).transpose(1, 2).reshape(b, n, hidden)
            x = self.norm1(x + self.o(context))
            return self.norm2(x + self.down(nn.functional.gelu(self.up(x))))

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.pool, self.classify = nn.Linear(hidden, hidden), nn.Linear(hidden, 2)

        def forward(self, x):
            return self.classify(self.pool(x[:, 0]).tanh())

    return Embeddings(), Layer(), Head()


def _count(module, x):
    """(parameters, forward FLOPs, output) of ``module`` on ``x`` (meta tensors: shapes only)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        y = module(x)
    return sum(p.numel() for p in module.parameters()), counter.get_total_flops(), y


def test_resnet50_table_is_what_torch_counts():
    torch = pytest.importorskip("torch")
    with torch.device("meta"):
        x = torch.empty(1, 3, 224, 224)
        for (name, module), row in zip(_resnet50_blocks(), RESNET50_BLOCKS, strict=True):
            params, flops, x = _count(module, x)
            assert (name, params, flops, x.numel()) == tuple(row)
    assert sum(b.params for b in RESNET50_BLOCKS) == RESNET50_PARAMS == 25_557_032
    # torchvision's "GFLOPS 4.09" are multiply-adds: half the FLOPs counted here
    assert sum(b.flops for b in RESNET50_BLOCKS) / 2 == pytest.approx(4.09e9, rel=2e-3)


def test_bert_tables_are_what_torch_counts():
    torch = pytest.importorskip("torch")
    embeddings_row, layer_row, head_row = BERT_BASE_BLOCKS[0], BERT_BASE_BLOCKS[1], BERT_BASE_BLOCKS[-1]
    assert len(BERT_BASE_BLOCKS) == 14 and all(row[1:] == layer_row[1:] for row in BERT_BASE_BLOCKS[1:13])
    with torch.device("meta"):
        embeddings, layer, head = _bert_blocks(768, 3072, 12)
        for seq_len in (64, 128):  # two lengths pin both the per-token and the per-pair coefficient
            params, flops, x = _count(embeddings, torch.zeros(1, seq_len, dtype=torch.long))
            assert (params, flops, x.numel()) == (embeddings_row.params, embeddings_row.flops(seq_len), 768 * seq_len)
            params, flops, x = _count(layer, x)
            assert (params, flops, x.numel()) == (layer_row.params, layer_row.flops(seq_len), 768 * seq_len)
            params, flops, _ = _count(head, x)
            assert (params, flops) == (head_row.params, head_row.flops(seq_len))
        assert sum(b.params for b in BERT_BASE_BLOCKS) == BERT_BASE_PARAMS + CLASSIFIER
        assert BERT_BASE_PARAMS == 109_482_240

        embeddings, layer, head = _bert_blocks(1024, 4096, 16)
        e_params, _, x = _count(embeddings, torch.zeros(1, 128, dtype=torch.long))
        l_params, l_flops, x = _count(layer, x)
        h_params, h_flops, _ = _count(head, x)
    assert 24 * l_flops + h_flops == BERT_LARGE_FLOPS
    assert e_params + 24 * l_params + h_params == BERT_LARGE_PARAMS + 1024 * 2 + 2


# --- the costs -----------------------------------------------------------------------------------


@pytest.mark.parametrize("stages", range(1, 9))
def test_weight_bytes_are_four_bytes_per_public_parameter(stages):
    for costs, public in ((resnet50(stages), RESNET50_PARAMS), (bert_base(stages), BERT_BASE_PARAMS)):
        assert costs.stages == stages
        assert sum(costs.weight_bytes) == pytest.approx(4 * public, rel=1e-3)
    assert sum(resnet50(stages).weight_bytes) == 4 * RESNET50_PARAMS


def test_stages_hold_every_block_once_in_order():
    for name, blocks, units in (("resnet50", RESNET50_BLOCKS, 16), ("bert-base", BERT_BASE_BLOCKS, 12)):
        for stages in range(1, units + 1):
            held = stage_blocks(name, stages)
            assert len(held) == stages and all(held)
            assert [n for stage in held for n in stage] == [b.name for b in blocks]
            assert held[0][:2] == (blocks[0].name, blocks[1].name)  # the stem / embeddings never alone
            assert held[-1][-2:] == (blocks[-2].name, blocks[-1].name)  # nor the head


def test_stages_are_balanced_by_compute():
    """The heaviest stage is the lightest any contiguous cut at block boundaries gives.

    Such a cut always exists with its heaviest stage under mean + heaviest unit (fill each stage
    up to the mean, then add one more unit), which bounds the imbalance at every stage count.  For
    4 stages, ResNet-50's 16 units of 0.44-0.75 GFLOPs against a 2.04 GFLOPs mean stage leave the
    best cut 13% above the mean (its first stage, the stem to layer2.0, 2.32 GFLOPs); BERT-base's
    12 equal layers split evenly whenever the stage count divides 12.
    """
    units = {
        "resnet50": [RESNET50_BLOCKS[0].flops + RESNET50_BLOCKS[1].flops]
        + [b.flops for b in RESNET50_BLOCKS[2:-2]]
        + [RESNET50_BLOCKS[-2].flops + RESNET50_BLOCKS[-1].flops],
        "bert-base": [b.flops(128) for b in BERT_BASE_BLOCKS[1:13]],
    }
    units["bert-base"][-1] += BERT_BASE_BLOCKS[-1].flops(128)
    for name, flops in units.items():
        for stages in range(1, len(flops) + 1):
            load = compute(profile(name, stages))
            mean = sum(load) / stages
            assert max(load) <= mean * (1 + max(flops) / (sum(flops) / stages)) * (1 + 1e-12)
        best = min(
            max(sum(flops[a:b]) for a, b in zip((0, *cuts), (*cuts, len(flops)), strict=True))
            for cuts in itertools.combinations(range(1, len(flops)), 3)
        )
        load = compute(profile(name, 4))
        assert max(load) / sum(load) == pytest.approx(best / sum(flops), rel=1e-9)
    load = compute(resnet50(4))
    assert max(load) / (sum(load) / 4) < 1.14
    for stages in (1, 2, 3, 4, 6, 12):
        load = compute(bert_base(stages))
        assert max(load) / (sum(load) / stages) < 1.002


@pytest.mark.parametrize("gpu", ["V100", "A100"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_resnet50_time_per_image_is_the_cited_throughput(gpu, precision):
    figure = GPUS[gpu].resnet50[precision]
    assert "DeepLearningExamples" in figure.source and "images/s" in figure.what
    for stages, microbatch in ((1, 32), (4, 32), (4, 7), (8, 64)):
        costs = resnet50(stages, gpu=gpu, microbatch=microbatch, precision=precision)
        assert costs.backward == pytest.approx([2 * f for f in costs.forward], rel=1e-12)
        assert sum(compute(costs)) / microbatch == pytest.approx(1 / figure.value, rel=1e-9)


@pytest.mark.parametrize("gpu", ["V100", "A100"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_bert_base_time_per_sequence_is_the_bert_large_figure_scaled_by_flops(gpu, precision):
    """BERT-base's sequences/s = BERT-large's cited sequences/s x the FLOP ratio of the two at 128 tokens."""

    def forward_flops(hidden, layers, seq_len):  # projections, feed-forward, attention; pooler, classifier
        layer = 12 * hidden**2 * seq_len + 2 * hidden * seq_len**2
        return 2 * (layers * layer + hidden**2 + 2 * hidden)

    figure = GPUS[gpu].bert_large[precision]
    assert "DeepLearningExamples" in figure.source and "sequences/s" in figure.what
    ratio = forward_flops(1024, 24, 128) / forward_flops(768, 12, 128)
    assert ratio == pytest.approx(3.53, abs=0.01)
    for stages, microbatch in ((1, 8), (4, 8), (6, 3)):
        costs = bert_base(stages, gpu=gpu, microbatch=microbatch, precision=precision)
        assert costs.backward == pytest.approx([2 * f for f in costs.forward], rel=1e-12)
        assert sum(compute(costs)) / microbatch == pytest.approx(1 / (figure.value * ratio), rel=1e-9)
    # other lengths follow BERT-base's FLOPs at that length
    ratio_512 = forward_flops(768, 12, 512) / forward_flops(768, 12, 128)
    assert sum(compute(bert_base(4, gpu=gpu, seq_len=512, precision=precision))) == pytest.approx(
        ratio_512 * sum(compute(bert_base(4, gpu=gpu, precision=precision))), rel=1e-9
    )


def test_a100_is_faster_and_amp_faster_than_fp32():
    for fn in (resnet50, bert_base):
        v100, a100 = fn(4, gpu="V100"), fn(4, gpu="A100")
        assert all(a < v for a, v in zip(compute(a100), compute(v100), strict=True))
        assert all(a < v for a, v in zip(a100.optimizer, v100.optimizer, strict=True))
        assert all(a < f for a, f in zip(compute(fn(4, precision="amp")), compute(fn(4)), strict=True))


def test_activation_bytes_are_the_boundary_tensors():
    by_name = {b.name: b for b in RESNET50_BLOCKS}
    for precision, size in (("fp32", 4), ("amp", 2)):
        for stages, microbatch in ((4, 32), (8, 5)):
            costs = resnet50(stages, microbatch=microbatch, precision=precision)
            held = stage_blocks("resnet50", stages)
            assert costs.activation_bytes == tuple(microbatch * by_name[stage[-1]].out * size for stage in held[:-1])
    # 4 stages: after layer2.0 (512 x 28 x 28), layer3.0 and layer3.4 (1024 x 14 x 14)
    assert resnet50(4).activation_bytes == (32 * 512 * 28 * 28 * 4, 32 * 1024 * 14 * 14 * 4, 32 * 1024 * 14 * 14 * 4)
    # BERT: the hidden states, microbatch x seq_len x 768, float32 under both precisions (LayerNorm's output)
    for precision in PRECISIONS:
        for stages, microbatch, seq_len in ((4, 8, 128), (3, 2, 384), (12, 1, 64)):
            costs = bert_base(stages, microbatch=microbatch, seq_len=seq_len, precision=precision)
            assert costs.activation_bytes == (microbatch * seq_len * 768 * 4,) * (stages - 1)
    assert resnet50(1).activation_bytes == () and all(v > 0 for v in resnet50(16).activation_bytes)


def test_optimizer_streams_its_state_at_memory_bandwidth():
    for gpu, bandwidth in (("V100", 900e9), ("A100", 2039e9)):
        assert GPUS[gpu].memory_bandwidth.value == bandwidth and "datasheet" in GPUS[gpu].memory_bandwidth.source
        assert resnet50(1, gpu=gpu).optimizer[0] == pytest.approx(RESNET50_PARAMS * 20 / bandwidth)
        costs = bert_base(4, gpu=gpu)
        assert sum(costs.optimizer) == pytest.approx((BERT_BASE_PARAMS + CLASSIFIER) * 28 / bandwidth)
        assert costs.optimizer == pytest.approx([w / 4 * 28 / bandwidth for w in costs.weight_bytes])
    assert OPTIMIZER_BYTES_PER_PARAM == {"resnet50": 20, "bert-base": 28}
    assert resnet50().step_overhead == bert_base().step_overhead == STEP_OVERHEAD


def test_profile_names_the_functions():
    assert PROFILES == {"resnet50": resnet50, "bert-base": bert_base}
    assert profile("bert-base", 2, gpu="A100", seq_len=256) == bert_base(2, gpu="A100", seq_len=256)
    assert profile("resnet50") == resnet50(4)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: resnet50(4, gpu="H100"), "gpu: 'H100' is not one of V100, A100"),
        (lambda: bert_base(4, gpu="v100"), "gpu: 'v100' is not one of V100, A100"),
        (lambda: resnet50(0), "stages: must be an integer in 1..16"),
        (lambda: resnet50(17), "stages: must be an integer in 1..16"),
        (lambda: resnet50(True), "stages: must be an integer in 1..16"),
        (lambda: bert_base(13), "stages: must be an integer in 1..12"),
        (lambda: bert_base(2.0), "stages: must be an integer in 1..12"),
        (lambda: resnet50(4, microbatch=0), "microbatch: must be an integer >= 1"),
        (lambda: bert_base(4, microbatch=8.0), "microbatch: must be an integer >= 1"),
        (lambda: resnet50(4, precision="fp16"), "precision: 'fp16' is not one of fp32, amp"),
        (lambda: bert_base(4, seq_len=513), "seq_len: must be an integer in 1..512"),
        (lambda: bert_base(4, seq_len=0), "seq_len: must be an integer in 1..512"),
        (lambda: profile("gpt2"), "name: 'gpt2' is not one of resnet50, bert-base"),
        (lambda: stage_blocks("bert"), "name: 'bert' is not one of resnet50, bert-base"),
        (lambda: network(0), "gbit: must be a finite number > 0"),
        (lambda: network(-10), "gbit: must be a finite number > 0"),
        (lambda: network(math.inf), "gbit: must be a finite number > 0"),
        (lambda: network("10"), "gbit: must be a finite number > 0"),
        (lambda: network(10, latency=-1.0), "network.latency: must be a number >= 0"),
    ],
)
def test_bad_input_is_a_one_line_error_naming_the_field(call, message):
    with pytest.raises(ValueError) as info:
        call()
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_network_and_layouts():
    net = network(10)
    assert net.bandwidth == 1.25e9 and net.latency == 50e-6 and net.scheduler_rtt == 0.5e-3
    assert network(25).bandwidth == 3.125e9 and network(100, latency=1e-6).latency == 1e-6
    assert BANDWIDTHS == (10, 25, 100)
    assert LAYOUTS == ((4, 4), (8, 4), (16, 4), (64, 4), (256, 4), (1024, 4))


def test_a_profile_runs_in_the_simulator():
    costs = resnet50(4)
    result = sdpipe.simulate(4, 4, epochs=1, costs=costs, network=network(10), steps=5, policy="sdpipe")
    assert result.steps == {0: 5, 1: 5, 2: 5, 3: 5}
    # each step runs its 4 micro-batches through the heaviest stage at least
    assert result.wall_time >= 5 * 4 * max(compute(costs))
    result = sdpipe.simulate(4, 4, epochs=1, costs=bert_base(4), network=network(25), steps=3, policy="allreduce")
    assert result.steps == {0: 3, 1: 3, 2: 3, 3: 3} and result.wall_time > 0
