"""Cutting a model into pipeline stages.

:func:`balanced_cuts` is pure (no torch): it picks contiguous cut points that
minimize the heaviest stage.  :func:`partition` applies cut points to an
``nn.Sequential`` (torch is imported lazily, so the planning helpers work
without it).

Worked case: layer weights ``[8256, 0, 16512, 0, 1290]`` (Linear, ReLU,
Linear, ReLU, Linear) into 2 stages gives cut point ``[2]``: stage 0 holds
layers 0-1 (8,257 with the per-layer unit), stage 1 holds layers 2-4.
"""

from __future__ import annotations

import itertools
from typing import Sequence

__all__ = ["balanced_cuts", "check_cuts", "partition", "stage_bounds"]


def balanced_cuts(weights: Sequence[float], stages: int) -> list[int]:
    """Cut points (start index of stages 1..S-1) minimizing the heaviest stage.

    Every stage gets at least one layer.  Each layer counts its weight plus one,
    so layers without parameters still spread out; ties go to the earliest cut.
    """
    n = len(weights)
    if not isinstance(stages, int) or stages < 1:
        raise ValueError(f"stages: must be an integer >= 1, got {stages!r}")
    if stages > n:
        raise ValueError(f"stages: {stages} exceeds the {n} layers of the model; allowed 1..{n}")
    w = [float(x) + 1.0 for x in weights]
    prefix = [0.0]
    for x in w:
        prefix.append(prefix[-1] + x)
    inf = float("inf")
    # best[k][i]: minimal max-stage weight of layers[:i] split into k stages
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    arg = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                v = max(best[k - 1][j], prefix[i] - prefix[j])
                if v < best[k][i]:
                    best[k][i], arg[k][i] = v, j
    cuts, i = [], n
    for k in range(stages, 0, -1):
        i = arg[k][i]
        cuts.append(i)
    return sorted(cuts)[1:]


def check_cuts(cuts: Sequence[int], layers: int, stages: int) -> list[int]:
    """Validate explicit cut points; returns them as a list."""
    cuts = list(cuts)
    if len(cuts) != stages - 1:
        raise ValueError(f"cuts: {stages} stages need {stages - 1} cut points, got {len(cuts)}")
    if (
        any(not isinstance(c, int) for c in cuts)
        or cuts != sorted(set(cuts))
        or (cuts and (cuts[0] < 1 or cuts[-1] > layers - 1))
    ):
        raise ValueError(f"cuts: must be strictly increasing integers in 1..{layers - 1}, got {cuts}")
    return cuts


def stage_bounds(cuts: Sequence[int], layers: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` layer ranges of each stage."""
    edges = [0, *cuts, layers]
    return list(itertools.pairwise(edges))


def partition(model, stages: int, cuts: Sequence[int] | None = None) -> list:
    """Split ``model`` into ``stages`` modules.

    ``model`` is an ``nn.Sequential`` (cut into contiguous ranges, balanced by
    parameter count unless ``cuts`` is given) or a list of exactly ``stages``
    modules (taken as they are).
    """
    from torch import nn

    if isinstance(model, (list, tuple)):
        if not model or not all(isinstance(m, nn.Module) for m in model):
            raise ValueError("model: a list of stages must hold nn.Module objects only")
        if len(model) != stages:
            raise ValueError(f"stages: {stages} given but the model is a list of {len(model)} stage modules")
        if cuts is not None:
            raise ValueError("cuts: only applies when model is an nn.Sequential, not a list of stages")
        return list(model)
    if not isinstance(model, nn.Sequential):
        raise ValueError(f"model: must be an nn.Sequential or a list of nn.Module stages, got {type(model).__name__}")
    layers = list(model)
    if cuts is None:
        cuts = balanced_cuts([sum(p.numel() for p in m.parameters()) for m in layers], stages)
    else:
        if stages > len(layers):
            raise ValueError(
                f"stages: {stages} exceeds the {len(layers)} layers of the model; allowed 1..{len(layers)}"
            )
        cuts = check_cuts(cuts, len(layers), stages)
    return [nn.Sequential(*layers[a:b]) for a, b in stage_bounds(cuts, len(layers))]
