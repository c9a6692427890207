"""Each layer's measured cost, for a cut by time (``cuts="time"``): measured on the driver with the probe's
micro-batch before any worker starts.

:func:`measure` runs an ``nn.Sequential``'s layers one by one on a micro-batch of the training data, single-threaded
as a worker runs (each worker is a single-threaded process): each layer's forward (with autograd recording, as in
training) and its backward (from the gradient the loss sends back through the later layers), the median of
``repeats`` after one unmeasured pass; its weights' bytes and its output's bytes.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

__all__ = ["BOUNDARY_SECONDS_PER_BYTE", "LayerCost", "boundary_seconds", "measure", "memory_of", "time_cut"]

#: seconds per byte of a layer's output that a cut after it costs each of the two stages it separates, per
#: micro-batch, once for the activation and once for its gradient (sender's and receiver's copies, gloo over
#: loopback, Python between them).  Fitted on ``benchmarks/cuts.py``'s every-cut runs of the digits CNN on a 2-core
#: machine: with 2 to 4 ns a byte the time cut picks the fastest cut tried at S = 2 and 3 (without it, at S = 2 one
#: that sends four times the bytes; with 1 ns, at S = 3 the second fastest).
BOUNDARY_SECONDS_PER_BYTE = 2e-9


@dataclass(frozen=True)
class LayerCost:
    """One layer's seconds per micro-batch (forward, backward) and bytes (its weights, its output)."""

    forward: float
    backward: float
    weight_bytes: int
    activation_bytes: int

    @property
    def seconds(self) -> float:
        return self.forward + self.backward


def boundary_seconds(costs: list) -> list:
    """Per layer: the seconds a cut just after it adds to each stage beside the cut, per micro-batch (its output
    sent forward and its gradient back; see :data:`BOUNDARY_SECONDS_PER_BYTE`): ``time_cuts``'s ``boundary``."""
    return [2 * BOUNDARY_SECONDS_PER_BYTE * c.activation_bytes for c in costs]


def time_cut(costs: list, stages: int, memory=None, limit=None) -> list:
    """``cuts="time"``'s cut points for layers measured at ``costs``: :func:`sdpipe.core.partition.time_cuts` on
    their seconds, each cut counting its :func:`boundary_seconds` (``memory``/``limit``: as there)."""
    from sdpipe.core.partition import time_cuts

    return time_cuts([c.seconds for c in costs], stages, memory, limit, boundary_seconds(costs))


def memory_of(cost: LayerCost, microbatches: int) -> float:
    """Bytes a layer asks of its worker: its weights, their gradients and up to two optimizer states (4x the
    weights), and its output kept for the backward of every micro-batch of a step (the most a schedule holds)."""
    return 4.0 * cost.weight_bytes + microbatches * cost.activation_bytes


def _leaves(obj) -> list:
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [x for v in obj for x in _leaves(v)]
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in _leaves(v)]
    return []


def _detached(obj):
    """``obj`` with every floating tensor detached and asking for its gradient (a layer's input)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().requires_grad_(obj.is_floating_point())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_detached(v) for v in obj)
    if isinstance(obj, dict):
        return {k: _detached(v) for k, v in obj.items()}
    return obj


def _timed(fn, repeats: int) -> float:
    fn()  # warm-up: first-call allocations and kernel choices
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(layers: list, sample, targets, loss_fn, repeats: int = 5) -> list:
    """:class:`LayerCost` of each of ``layers`` (modules in order) on the micro-batch ``sample`` with ``targets``
    and ``loss_fn`` (see the module's docstring).  The layers' weights and gradients are left as they were."""
    import torch

    threads = torch.get_num_threads()
    saved = [[None if p.grad is None else p.grad.clone() for p in layer.parameters()] for layer in layers]
    torch.set_num_threads(1)
    try:
        inputs = [sample]
        with torch.no_grad():
            for layer in layers:
                inputs.append(layer(inputs[-1]))
        forward = []
        for layer, x in zip(layers, inputs, strict=False):
            forward.append(_timed(lambda layer=layer, x=x: layer(x), repeats))
        out = _detached(inputs[-1])
        loss_fn(out, targets).backward()
        grads = [t.grad for t in _leaves(out)]
        backward = [0.0] * len(layers)
        for i in range(len(layers) - 1, -1, -1):
            x = _detached(inputs[i])

            def step(i=i, x=x, grads=grads):
                for t in _leaves(x):
                    t.grad = None
                pairs = [(y, g) for y, g in zip(_leaves(layers[i](x)), grads, strict=False) if y.requires_grad]
                pairs = [(y, g) for y, g in pairs if g is not None]
                if pairs:
                    torch.autograd.backward([y for y, _ in pairs], [g for _, g in pairs])

            # the backward alone: the forward it needs is timed apart and taken off
            backward[i] = max(0.0, _timed(step, repeats) - forward[i])
            grads = [t.grad if t.is_floating_point() else None for t in _leaves(x)]
    finally:
        torch.set_num_threads(threads)
        for layer, grads_before in zip(layers, saved, strict=True):
            for p, g in zip(layer.parameters(), grads_before, strict=True):
                p.grad = g
    return [
        LayerCost(
            forward=forward[i],
            backward=backward[i],
            weight_bytes=sum(p.numel() * p.element_size() for p in layers[i].parameters()),
            activation_bytes=sum(t.numel() * t.element_size() for t in _leaves(inputs[i + 1])),
        )
        for i in range(len(layers))
    ]
