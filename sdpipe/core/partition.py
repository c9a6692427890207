"""Cutting a model into pipeline stages.

:func:`balanced_cuts` is pure (no torch): it picks contiguous cut points that
minimize the heaviest stage.  :func:`partition` applies cut points to an
``nn.Sequential`` (torch is imported lazily, so the planning helpers work
without it).

Worked case: layer weights ``[8256, 0, 16512, 0, 1290]`` (Linear, ReLU,
Linear, ReLU, Linear) into 2 stages gives cut point ``[2]``: stage 0 holds
layers 0-1 (8,257 with the per-layer unit), stage 1 holds layers 2-4.

:func:`time_cuts` is the same search on measured seconds per layer (forward and backward, from
:func:`sdpipe.driver.layers.measure`): the cut whose slowest stage is fastest, optionally only among cuts
whose every stage fits a memory limit.
"""

from __future__ import annotations

import itertools
from typing import Sequence

__all__ = ["balanced_cuts", "check_cuts", "cut_points", "partition", "speed_cuts", "stage_bounds", "time_cuts"]


def balanced_cuts(weights: Sequence[float], stages: int) -> list[int]:
    """Cut points (start index of stages 1..S-1) minimizing the heaviest stage.

    Every stage gets at least one layer.  Each layer counts its weight plus one,
    so layers without parameters still spread out; ties go to the earliest cut.
    """
    return _min_max_cuts([float(x) + 1.0 for x in weights], stages)


def time_cuts(
    seconds: Sequence[float],
    stages: int,
    memory: Sequence[float] | None = None,
    limit=None,
    boundary: Sequence[float] | None = None,
) -> list[int]:
    """Cut points (start index of stages 1..S-1) minimizing the slowest stage's seconds (``seconds``: each layer's
    forward and backward time).  With ``boundary`` (one value per layer: the seconds a cut just after that layer
    adds to each of the two stages it separates, for sending and receiving its output and gradient), a stage's
    seconds count the cuts at its ends.  With ``memory`` (bytes per layer) and ``limit`` (bytes per worker), only
    among cuts whose every stage holds at most ``limit``; a ValueError in one line when none does.  Ties go to the
    earliest cut."""
    fits = None
    if limit is not None:
        if memory is None or len(memory) != len(seconds):
            raise ValueError("memory: needs one number of bytes per layer to cut within a limit")
        mem_prefix = _prefix([float(x) for x in memory])

        def fits(j: int, i: int) -> bool:
            return mem_prefix[i] - mem_prefix[j] <= limit

    if boundary is not None and len(boundary) != len(seconds):
        raise ValueError("boundary: needs one number of seconds per layer")
    edge = None if boundary is None else [0.0, *(float(x) for x in boundary[:-1]), 0.0]
    cuts = _min_max_cuts([float(x) for x in seconds], stages, fits, edge=edge)
    if cuts is None:
        most = max(memory) if memory else 0.0
        raise ValueError(
            f"memory_limit: no cut into {stages} stages fits {limit:,.0f} bytes per worker (the largest layer alone "
            f"needs {most:,.0f})"
        )
    return cuts


def _prefix(values: list) -> list:
    out = [0.0]
    for x in values:
        out.append(out[-1] + x)
    return out


def speed_cuts(seconds: Sequence[float], factors: Sequence[float], fixed: Sequence[float] | None = None) -> list[int]:
    """Cut points (start index of stages 1..S-1, S = ``len(factors)``) minimizing the slowest stage when stage ``k``
    takes ``factors[k]`` times the sum of its layers' ``seconds`` plus ``fixed[k]`` (what it spends whatever layers
    it holds).  Ties go to the earliest cut."""
    return _min_max_cuts(
        [float(x) for x in seconds], len(factors), scale=[float(f) for f in factors], offset=fixed and list(fixed)
    )


def _min_max_cuts(cost: list, stages: int, fits=None, scale=None, offset=None, edge=None):
    """The contiguous cut of ``cost`` (one value per layer) into ``stages`` stages of at least one layer whose
    largest stage sum is least (``fits(j, i)``: whether layers j..i-1 may form a stage; stage k's sum counts
    ``scale[k]`` times, plus ``offset[k]``, plus ``edge[j] + edge[i]``: what its cuts at j and i cost it, ``edge``
    having n + 1 values); None when no cut fits."""
    n = len(cost)
    if not isinstance(stages, int) or stages < 1:
        raise ValueError(f"stages: must be an integer >= 1, got {stages!r}")
    if stages > n:
        raise ValueError(f"stages: {stages} exceeds the {n} layers of the model; allowed 1..{n}")
    prefix = _prefix(cost)
    inf = float("inf")
    # best[k][i]: minimal max-stage sum of layers[:i] split into k stages
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    arg = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                if fits is not None and not fits(j, i):
                    continue
                own = (scale[k - 1] if scale else 1.0) * (prefix[i] - prefix[j]) + (offset[k - 1] if offset else 0.0)
                if edge is not None:
                    own += edge[j] + edge[i]
                v = max(best[k - 1][j], own)
                if v < best[k][i]:
                    best[k][i], arg[k][i] = v, j
    if best[stages][n] == inf:
        return None
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
    parameter count unless ``cuts`` gives cut points) or a list of exactly
    ``stages`` modules (taken as they are).
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
    cuts = cut_points(layers, stages, cuts)
    return [nn.Sequential(*layers[a:b]) for a, b in stage_bounds(cuts, len(layers))]


def cut_points(layers: list, stages: int, cuts=None) -> list[int]:
    """The cut points ``partition`` cuts the ``layers`` of an ``nn.Sequential`` at: balanced by parameter count
    for None or ``"params"``, else ``cuts`` checked (:func:`check_cuts`)."""
    if isinstance(cuts, str) and cuts != "params":  # "time" is measured and chosen before (sdpipe.train)
        raise ValueError(f"cuts: {cuts!r} must be resolved to cut points before the model is cut")
    if cuts is None or cuts == "params":
        return balanced_cuts([sum(p.numel() for p in m.parameters()) for m in layers], stages)
    if stages > len(layers):
        raise ValueError(f"stages: {stages} exceeds the {len(layers)} layers of the model; allowed 1..{len(layers)}")
    return check_cuts(cuts, len(layers), stages)
