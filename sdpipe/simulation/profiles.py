"""Workload profiles: per-stage costs of ResNet-50 and BERT-base on named GPUs, and cluster networks.

:func:`resnet50` and :func:`bert_base` return a :class:`sdpipe.Costs` for a model cut into
``stages`` contiguous pipeline stages, on a GPU type named in :data:`GPUS`; :func:`network`
returns a :class:`sdpipe.Network` of ``gbit`` Gbit/s links.  Together they let the simulator
answer "what would SDPipe do for this model on this cluster" without a cluster::

    import sdpipe

    costs = sdpipe.profiles.resnet50(stages=4, gpu="V100")
    result = sdpipe.simulate(4, 16, costs=costs, network=sdpipe.profiles.network(10), policy="sdpipe", epochs=1)

The costs are per micro-batch of ``microbatch`` samples (32 here); ``simulate`` counts samples by
its ``batch_size``, so pass ``batch_size=microbatch x microbatches`` (128 for its default 4
micro-batches) when its samples per second should be the model's.  :data:`LAYOUTS` and
:data:`BANDWIDTHS` are the clusters studied with these profiles.

The model
---------

Each model is a table of blocks (:data:`RESNET50_BLOCKS`, :data:`BERT_BASE_BLOCKS`): parameters,
forward FLOPs per sample and output elements per sample, counted once with torch (see the tables).
A stage boundary falls between blocks; ResNet-50's stem goes with its first bottleneck block and its
head with the last (16 cutting units), BERT-base's embeddings go with the first encoder layer and
its pooler and classifier with the last (12 cutting units).  The cut points minimize the heaviest
stage's forward FLOPs (:func:`sdpipe.core.partition.balanced_cuts`), so the stages are as equal as the
block granularity allows.

- **Compute.**  A GPU's time per training sample (forward + backward) comes from a published
  single-GPU training throughput (:data:`GPUS`): ``1 / images per second`` for ResNet-50; for
  BERT-base, NVIDIA publishes only BERT-large training figures, so the time per sequence is
  BERT-base's FLOPs at the GPU's FLOP rate on BERT-large (sequences/s x BERT-large's FLOPs per
  sequence at 128 tokens).  A stage gets its share of the model's forward FLOPs of that time, times
  the micro-batch.  ``backward = 2 x forward``: the backward pass computes the gradients of both a
  layer's inputs and its weights, each a matrix product the size of the forward one, so the usual
  convention counts it as twice the forward (a training step as 3 x the forward FLOPs).  Summed
  over the stages, forward + backward of one micro-batch is ``microbatch / throughput``.
- **Activations.**  ``activation_bytes[s]`` is the tensor leaving stage s for one micro-batch:
  the output elements of its last block x bytes per element.  ``fp32`` keeps 4-byte activations;
  ``amp`` (torch.autocast to float16) makes ResNet-50's block outputs float16 (2 bytes: its
  convolutions run in float16 and batch norm keeps its input's type), while BERT's hidden states
  leave each layer from a LayerNorm, which autocast runs in float32 (4 bytes).
- **Weights.**  ``weight_bytes[s]`` is the stage's parameters x 4 bytes: replicas average the fp32
  master weights, whatever precision the compute uses.
- **Optimizer.**  ``optimizer[s]`` streams the stage's optimizer state through GPU memory once:
  parameters x bytes read and written per parameter (:data:`OPTIMIZER_BYTES_PER_PARAM`) / the GPU's
  memory bandwidth (datasheet figure).
- **Step overhead.**  :data:`STEP_OVERHEAD` per step for taking the batch and the control message.

What the model leaves out: data loading (a step's samples are there when it starts);
differences in kernel efficiency between layers (every FLOP of a model costs the same time,
though early convolutions and attention run at a lower fraction of peak than large matrix
products); the efficiency lost at a micro-batch smaller than the batch a figure was measured at (a
small micro-batch is optimistic); overlap of communication with computation inside a stage (a
stage's costs are totals, so none of its communication starts before the compute it follows has
ended); the optimizer time already inside the measured throughputs (a fraction of a percent of
their iterations, which ran at large or accumulated batches); and, for BERT-base, the gap between
FLOP scaling from BERT-large and a measurement (smaller matrices run at a lower fraction of peak,
so the derived BERT-base times are on the fast side).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from sdpipe.core.checks import integer, is_number
from sdpipe.core.partition import balanced_cuts, stage_bounds
from sdpipe.simulation.costs import Costs, Network

__all__ = [
    "BANDWIDTHS",
    "BERT_BASE_BLOCKS",
    "BERT_BASE_PARAMS",
    "BERT_LARGE_FLOPS",
    "GPU",
    "GPUS",
    "LAYOUTS",
    "OPTIMIZER_BYTES_PER_PARAM",
    "PRECISIONS",
    "PROFILES",
    "RESNET50_BLOCKS",
    "RESNET50_PARAMS",
    "STEP_OVERHEAD",
    "Block",
    "Figure",
    "TokenBlock",
    "bert_base",
    "network",
    "profile",
    "resnet50",
    "stage_blocks",
]


# ---------------------------------------------------------------------------------------------
# Model tables
# ---------------------------------------------------------------------------------------------


class Block(NamedTuple):
    """One block of a model with a fixed input size: parameters, forward FLOPs and output elements per sample."""

    name: str
    params: int
    flops: int
    out: int


class TokenBlock(NamedTuple):
    """One block of a transformer, per sequence of ``L`` tokens.

    Forward FLOPs ``token_flops x L + pair_flops x L^2 + sequence_flops`` (the projections and the
    feed-forward per token, the attention scores and their weighted sum per pair of tokens, the
    pooler and classifier once); output elements ``out_per_token x L``.
    """

    name: str
    params: int
    token_flops: int
    pair_flops: int
    sequence_flops: int
    out_per_token: int

    def flops(self, seq_len: int) -> int:
        return self.token_flops * seq_len + self.pair_flops * seq_len**2 + self.sequence_flops


# ResNet-50 v1.5 (torchvision's definition: the stride-2 of a downsampling bottleneck in its 3x3
# convolution) at 224 x 224, per image.  Produced with torch 2.13: each block built from torch.nn
# layers as torchvision defines them, parameters counted with Module.parameters(), forward FLOPs
# with torch.utils.flop_counter.FlopCounterMode (2 x the multiply-adds of convolutions and linear
# layers; batch norm, ReLU, pooling and residual adds are not counted), output elements from the
# block's output shape.  tests/test_profiles.py rebuilds the blocks and checks every row.
# Totals: 25,557,032 parameters, 8.18 GFLOPs (4.09 G multiply-adds).
RESNET50_BLOCKS: tuple[Block, ...] = (
    Block("stem", 9_536, 236_027_904, 200_704),  # conv 7x7/2, bn, relu, max pool 3x3/2 -> 64 x 56 x 56
    Block("layer1.0", 75_008, 462_422_016, 802_816),  # -> 256 x 56 x 56
    Block("layer1.1", 70_400, 436_731_904, 802_816),
    Block("layer1.2", 70_400, 436_731_904, 802_816),
    Block("layer2.0", 379_392, 745_013_248, 401_408),  # -> 512 x 28 x 28
    Block("layer2.1", 280_064, 436_731_904, 401_408),
    Block("layer2.2", 280_064, 436_731_904, 401_408),
    Block("layer2.3", 280_064, 436_731_904, 401_408),
    Block("layer3.0", 1_512_448, 745_013_248, 200_704),  # -> 1024 x 14 x 14
    Block("layer3.1", 1_117_184, 436_731_904, 200_704),
    Block("layer3.2", 1_117_184, 436_731_904, 200_704),
    Block("layer3.3", 1_117_184, 436_731_904, 200_704),
    Block("layer3.4", 1_117_184, 436_731_904, 200_704),
    Block("layer3.5", 1_117_184, 436_731_904, 200_704),
    Block("layer4.0", 6_039_552, 745_013_248, 100_352),  # -> 2048 x 7 x 7
    Block("layer4.1", 4_462_592, 436_731_904, 100_352),
    Block("layer4.2", 4_462_592, 436_731_904, 100_352),
    Block("head", 2_049_000, 4_096_000, 1_000),  # global average pool, fc 2048 -> 1000
)

RESNET50_PARAMS = 25_557_032
"""ResNet-50 v1.5's published parameter count: torchvision's ``ResNet50_Weights.IMAGENET1K_V1``
(num_params 25557032, GFLOPS 4.09), https://pytorch.org/vision/stable/models/generated/torchvision.models.resnet50.html"""

# BERT-base uncased (hidden 768, 12 layers, 12 heads, intermediate 3072, vocabulary 30,522,
# 512 positions, 2 token types) with a pooler and a 2-way sequence classifier.  Produced with
# torch 2.13 as the ResNet-50 table: each block built from torch.nn layers (an encoder layer as
# separate query/key/value/output projections, LayerNorm, 768 -> 3072 -> 768 feed-forward, LayerNorm),
# FLOPs counted by FlopCounterMode at 64, 128 and 256 tokens and split into the per-token and
# per-pair coefficients (attention: 2 matrix products of L x L x 768 multiply-adds).  Embedding
# look-ups, softmax, GELU and LayerNorm are not counted.
_BERT_LAYER = dict(params=7_087_872, token_flops=14_155_776, pair_flops=3_072, sequence_flops=0, out_per_token=768)
BERT_BASE_BLOCKS: tuple[TokenBlock, ...] = (
    TokenBlock("embeddings", 23_837_184, 0, 0, 0, 768),  # word, position and token-type tables, LayerNorm
    *(TokenBlock(f"layer{i}", **_BERT_LAYER) for i in range(12)),
    TokenBlock("head", 592_130, 0, 0, 1_182_720, 2),  # pooler 768 -> 768 on [CLS] (590,592), classifier 768 -> 2
)

BERT_BASE_PARAMS = 109_482_240
"""BERT-base uncased's parameter count with its pooler (Hugging Face ``BertModel`` of
``bert-base-uncased``; the BERT paper rounds it to 110M).  The profile adds a 2-way classifier
(1,538 parameters)."""

BERT_LARGE_FLOPS = 78_922_125_312
"""Forward FLOPs of one 128-token sequence through BERT-large (hidden 1024, 24 layers, 16 heads,
intermediate 4096) with a pooler and a 2-way classifier, counted as :data:`BERT_BASE_BLOCKS`
(24 x (25,165,824 x 128 + 4,096 x 128^2) + 2,101,248).  The pre-training heads NVIDIA's figures
include (masked-token prediction on about 20 of 128 positions, next-sentence prediction) would add
about 1.6% and are left out, as in the BERT-base profile."""

# ---------------------------------------------------------------------------------------------
# GPUs and their published figures
# ---------------------------------------------------------------------------------------------


class Figure(NamedTuple):
    """A published number: its value, what it measures, and where it is published."""

    value: float
    what: str
    source: str


@dataclass(frozen=True)
class GPU:
    """A GPU type: its memory bandwidth and its published single-GPU training throughputs.

    ``resnet50`` and ``bert_large`` map a precision (``fp32``, ``amp``) to samples per second.
    """

    name: str
    memory_bandwidth: Figure
    resnet50: dict
    bert_large: dict


_DLE = "NVIDIA DeepLearningExamples (https://github.com/NVIDIA/DeepLearningExamples, read at commit 729963dd)"
_RN50 = f"{_DLE}, PyTorch/Classification/ConvNets/resnet50v1.5/README.md, Training performance results"
_RN50_BATCH = "batch per GPU from PyTorch/Classification/ConvNets/configs.yml"
_BERT = f"{_DLE}, PyTorch/LanguageModeling/BERT/README.md, Training performance results"

# The memory bandwidths are the datasheets' figures as quoted by pages that reproduce them (the
# whitepaper's V100 summary, the A100 datasheet's table); the throughputs were read in the READMEs.
GPUS: dict[str, GPU] = {
    "V100": GPU(
        name="NVIDIA Tesla V100 SXM2 (DGX-1)",
        memory_bandwidth=Figure(
            900e9,
            "bytes/s, HBM2",
            "NVIDIA Tesla V100 GPU Architecture whitepaper (2017) and V100 datasheet: 900 GB/s",
        ),
        resnet50={
            "fp32": Figure(
                367.0,
                "images/s, 1 GPU, FP32, batch 112, pytorch-21.03 NGC container",
                f"{_RN50}, table 'NVIDIA DGX-1 16GB (8x V100 16GB)' (the 32GB table: 356); {_RN50_BATCH} (DGX1V)",
            ),
            "amp": Figure(
                1200.0,
                "images/s, 1 GPU, mixed precision, batch 256, pytorch-21.03 NGC container",
                f"{_RN50}, table 'NVIDIA DGX-1 16GB (8x V100 16GB)' (the 32GB table: 1156); {_RN50_BATCH} (DGX1V)",
            ),
        },
        bert_large={
            "fp32": Figure(
                50.0,
                "sequences/s, BERT-large pre-training phase 1 (128 tokens), 1 GPU, FP32, 4,096 sequences per update "
                "in 128 accumulation steps, pytorch:21.11-py3",
                f"{_BERT}, table 'Pre-training NVIDIA DGX-1 With 32G' (V100 32GB)",
            ),
            "amp": Figure(
                224.0,
                "sequences/s, BERT-large pre-training phase 1 (128 tokens), 1 GPU, mixed precision, 4,096 sequences "
                "per update in 64 accumulation steps, pytorch:21.11-py3",
                f"{_BERT}, table 'Pre-training NVIDIA DGX-1 With 32G' (V100 32GB)",
            ),
        },
    ),
    "A100": GPU(
        name="NVIDIA A100 80GB SXM (DGX A100)",
        memory_bandwidth=Figure(
            2039e9,
            "bytes/s, HBM2e",
            "NVIDIA A100 Tensor Core GPU datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf): 2,039 GB/s",
        ),
        resnet50={
            "fp32": Figure(
                938.0,
                "images/s, 1 GPU, TF32, batch 256, pytorch-21.03 NGC container",
                f"{_RN50}, table 'NVIDIA DGX A100 (8x A100 80GB)'; {_RN50_BATCH} (DGXA100)",
            ),
            "amp": Figure(
                2470.0,
                "images/s, 1 GPU, mixed precision, batch 256, pytorch-21.03 NGC container",
                f"{_RN50}, table 'NVIDIA DGX A100 (8x A100 80GB)'; {_RN50_BATCH} (DGXA100)",
            ),
        },
        bert_large={
            "fp32": Figure(
                317.0,
                "sequences/s, BERT-large pre-training phase 1 (128 tokens), 1 GPU, TF32, batch 128, pytorch:21.11-py3",
                f"{_BERT}, table 'Pre-training NVIDIA DGX A100 (8x A100 80GB)'",
            ),
            "amp": Figure(
                580.0,
                "sequences/s, BERT-large pre-training phase 1 (128 tokens), 1 GPU, mixed precision, batch 256, "
                "pytorch:21.11-py3",
                f"{_BERT}, table 'Pre-training NVIDIA DGX A100 (8x A100 80GB)'",
            ),
        },
    ),
}
"""The GPU types a profile can name, each with its published figures and their sources.  ``fp32``
on the A100 is NVIDIA's TF32 column: float32 tensors with TF32 tensor-core math (PyTorch's default
for convolutions; for matrix products with ``torch.backends.cuda.matmul.allow_tf32``)."""

PRECISIONS = ("fp32", "amp")
"""``fp32``: float32 compute (TF32 math on the A100); ``amp``: mixed precision (torch.autocast to float16)."""

_ACTIVATION_BYTES = {
    "resnet50": {"fp32": 4, "amp": 2},  # batch norm and ReLU keep float16 under autocast
    "bert-base": {"fp32": 4, "amp": 4},  # autocast runs LayerNorm, the last op of a layer, in float32
}

OPTIMIZER_BYTES_PER_PARAM = {"resnet50": 20, "bert-base": 28}
"""Bytes of float32 state the optimizer reads and writes per parameter per step: SGD with momentum
(ResNet-50's recipe) reads weight, gradient and momentum and writes weight and momentum (5 x 4);
Adam or LAMB (BERT's) reads weight, gradient and two moments and writes weight and both moments (7 x 4)."""

STEP_OVERHEAD = 1e-3
"""Seconds per step outside the stages' compute: taking the batch and the step's control message.
An assumed figure (not measured on these GPUs); it is about 1% of a 4-stage ResNet-50 step on a V100."""

# ---------------------------------------------------------------------------------------------
# Cluster networks and layouts
# ---------------------------------------------------------------------------------------------

BANDWIDTHS = (10, 25, 100)
"""Link speeds studied, in Gbit/s: 10 and 25 Gbit Ethernet, 100 Gbit/s (100 GbE or InfiniBand EDR)."""

LAYOUTS = ((4, 4), (8, 4), (16, 4), (64, 4), (256, 4), (1024, 4))
"""Cluster layouts studied, as (pipelines, stages): 16, 32 and 64 GPUs as in the SDPipe paper's
clusters, then 256, 1,024 and 4,096 GPUs beyond them (``simulate(stages, pipelines, ...)``)."""


def network(gbit: float = 10, *, latency: float = 50e-6, scheduler_rtt: float = 0.5e-3) -> Network:
    """A cluster network of ``gbit`` Gbit/s links (``gbit x 1e9 / 8`` bytes/s), ``latency`` seconds
    per message and a ``scheduler_rtt`` round trip to the group scheduler (and to a ``ps`` or ``adpsgd``
    server thread: both go through the run's store)."""
    if not is_number(gbit) or not (0 < gbit < math.inf):
        raise ValueError(f"gbit: must be a finite number > 0 (Gbit/s per link), got {gbit!r}")
    return Network(bandwidth=gbit * 1e9 / 8, latency=latency, scheduler_rtt=scheduler_rtt, server_rtt=scheduler_rtt)


# ---------------------------------------------------------------------------------------------
# Profiles
# ---------------------------------------------------------------------------------------------


_int = integer


def _choice(name: str, v, options) -> str:
    if not isinstance(v, str) or v not in options:
        raise ValueError(f"{name}: {v!r} is not one of {', '.join(options)}")
    return v


def _units(names, params, flops, out) -> tuple[list, list, list, list]:
    """Fold the first block into the second and the last into the one before: the cutting units."""

    def fold(values, merge):
        return [merge(values[0], values[1]), *values[2:-2], merge(values[-2], values[-1])]

    return (
        fold(names, lambda a, b: (*a, *b)),
        fold(params, lambda a, b: a + b),
        fold(flops, lambda a, b: a + b),
        fold(out, lambda a, b: b),
    )


def _plan(model: str, stages: int, seq_len: int):
    if model == "resnet50":
        blocks = RESNET50_BLOCKS
        names, params, flops, out = _units(
            [(b.name,) for b in blocks], [b.params for b in blocks], [b.flops for b in blocks], [b.out for b in blocks]
        )
    else:
        blocks = BERT_BASE_BLOCKS
        names, params, flops, out = _units(
            [(b.name,) for b in blocks],
            [b.params for b in blocks],
            [b.flops(seq_len) for b in blocks],
            [b.out_per_token * seq_len for b in blocks],
        )
    _int("stages", stages, 1, len(names), f" (the blocks of {'ResNet-50' if model == 'resnet50' else 'BERT-base'})")
    bounds = stage_bounds(balanced_cuts(flops, stages), len(names))
    return [
        (
            tuple(n for unit in names[a:b] for n in unit),
            sum(params[a:b]),
            sum(flops[a:b]),
            out[b - 1],
        )
        for a, b in bounds
    ], sum(flops)


def _costs(model: str, stages: int, gpu: str, microbatch: int, precision: str, seq_len: int) -> Costs:
    plan, total_flops = _plan(model, stages, seq_len)
    spec = GPUS[gpu]
    if model == "resnet50":
        per_sample = 1.0 / spec.resnet50[precision].value
    else:
        per_sample = total_flops / (spec.bert_large[precision].value * BERT_LARGE_FLOPS)
    forward = [per_sample * microbatch * flops / total_flops / 3 for _, _, flops, _ in plan]
    act = _ACTIVATION_BYTES[model][precision]
    bandwidth = spec.memory_bandwidth.value
    return Costs(
        forward=forward,
        backward=[2 * f for f in forward],
        optimizer=[params * OPTIMIZER_BYTES_PER_PARAM[model] / bandwidth for _, params, _, _ in plan],
        activation_bytes=[microbatch * out * act for _, _, _, out in plan[:-1]],
        weight_bytes=[4 * params for _, params, _, _ in plan],
        step_overhead=STEP_OVERHEAD,
    )


def resnet50(stages: int = 4, *, gpu: str = "V100", microbatch: int = 32, precision: str = "fp32") -> Costs:
    """ResNet-50 v1.5 at 224 x 224 in ``stages`` stages (1..16) on a ``gpu`` of :data:`GPUS`.

    ``microbatch``: images per micro-batch; ``precision``: ``fp32`` or ``amp`` (see :data:`PRECISIONS`).
    Compute from NVIDIA's published images/s on that GPU and precision (:data:`GPUS`).
    """
    _choice("gpu", gpu, tuple(GPUS))
    _int("microbatch", microbatch, 1)
    _choice("precision", precision, PRECISIONS)
    return _costs("resnet50", stages, gpu, microbatch, precision, 0)


def bert_base(
    stages: int = 4, *, gpu: str = "V100", microbatch: int = 8, seq_len: int = 128, precision: str = "fp32"
) -> Costs:
    """BERT-base uncased with a 2-way classifier in ``stages`` stages (1..12) on a ``gpu`` of :data:`GPUS`.

    ``microbatch``: sequences per micro-batch; ``seq_len``: tokens per sequence (1..512);
    ``precision``: ``fp32`` or ``amp``.  Compute from NVIDIA's published BERT-large sequences/s on
    that GPU and precision, scaled by FLOPs (see the module docstring); at lengths other than 128
    the time follows BERT-base's FLOPs at that length.
    """
    _choice("gpu", gpu, tuple(GPUS))
    _int("microbatch", microbatch, 1)
    _int("seq_len", seq_len, 1, 512, " (BERT-base's positions)")
    _choice("precision", precision, PRECISIONS)
    return _costs("bert-base", stages, gpu, microbatch, precision, seq_len)


PROFILES = {"resnet50": resnet50, "bert-base": bert_base}
"""The named workload profiles: name -> function returning a :class:`sdpipe.Costs`."""


def profile(name: str, stages: int = 4, **kw) -> Costs:
    """The costs of the profile ``name`` (a key of :data:`PROFILES`); ``kw`` go to its function."""
    _choice("name", name, tuple(PROFILES))
    return PROFILES[name](stages, **kw)


def stage_blocks(name: str, stages: int = 4, *, seq_len: int = 128) -> tuple[tuple[str, ...], ...]:
    """The block names (of :data:`RESNET50_BLOCKS` or :data:`BERT_BASE_BLOCKS`) each stage of a profile holds."""
    _choice("name", name, tuple(PROFILES))
    if name == "bert-base":
        _int("seq_len", seq_len, 1, 512, " (BERT-base's positions)")
    plan, _ = _plan(name, stages, seq_len)
    return tuple(names for names, _, _, _ in plan)
