"""A live re-cut in one worker: its pipeline's layers move to a new cut (``run.recut``).

Every stage of a pipeline takes the re-cut at the same step boundary (stage 0 sends :attr:`Op.RECUT
<sdpipe.wire.protocol.Op>` down the pipeline), after its asynchronous schedule drained and its policy settled,
so the weights are complete and no micro-batch is in flight.  Then each worker, with the cut it has and the one
published under :meth:`Keys.cut <sdpipe.wire.protocol.Keys.cut>`:

* sends every layer it gives up to the stage that holds it under the new cut: the layer's ``state_dict`` and its
  optimizer state (one message per receiving stage, over the pipeline's own process group);
* receives every layer it takes on, as a copy of that layer of the model it started from
  (``WorkerSpec.stage_modules``) with the received state loaded;
* rebuilds its stage (an ``nn.Sequential`` of its layers, in order), its optimizer (the optimizer state of every
  layer it keeps or takes, its hyperparameters unchanged) and the layouts of what crosses its boundaries
  (probed anew on the driver).

Worked case, 6 layers, stages 3, cut ``(2, 4)`` to ``(3, 5)``: stage 0 receives layer 2 from stage 1; stage 1
gives layer 2 to stage 0 and receives layer 4 from stage 2; stage 2 gives layer 4 to stage 1.
"""

from __future__ import annotations

import copy
import io

import torch

from sdpipe.core.partition import stage_bounds
from sdpipe.wire.protocol import CutChange

__all__ = ["TAG_RECUT", "move_layers", "owners"]

TAG_RECUT = 5  # point-to-point traffic of a re-cut (the pipeline's link)


def owners(cuts, layers: int) -> list:
    """The stage that holds each layer under ``cuts``."""
    out = []
    for s, (a, b) in enumerate(stage_bounds(list(cuts), layers)):
        out += [s] * (b - a)
    return out


def move_layers(w, change: CutChange) -> dict:
    """Take the cut ``change`` (every stage of the pipeline at once); returns what moved, for the ``control``
    record: ``{"sent": [layers], "received": [layers], "bytes": bytes sent}``."""
    template = [layer for m in w.spec.stage_modules for layer in m]  # the model the run started from
    n = len(template)
    old, new = owners(w.cuts, n), owners(change.cuts, n)
    mine_before = [i for i in range(n) if old[i] == w.stage]
    mine_after = [i for i in range(n) if new[i] == w.stage]
    layers = dict(zip(mine_before, w.module, strict=True))
    state = _optimizer_state(w, layers)
    outgoing: dict = {}  # stage -> the layers it takes from this one
    for i in mine_before:
        if new[i] != w.stage:
            outgoing.setdefault(new[i], []).append(i)
    incoming: dict = {}  # stage -> the layers this one takes from it
    for i in mine_after:
        if old[i] != w.stage:
            incoming.setdefault(old[i], []).append(i)
    sends, sent_bytes = [], 0
    for dst, ids in sorted(outgoing.items()):
        payload = _pack({i: {"model": layers[i].state_dict(), "optimizer": state.get(i, [])} for i in ids})
        sent_bytes += payload.numel()
        sends.append(w.link.isend(torch.tensor([payload.numel()], dtype=torch.int64), dst, TAG_RECUT))
        sends.append(w.link.isend(payload, dst, TAG_RECUT))
    for src, ids in sorted(incoming.items()):
        size = int(w.link.recv((1,), torch.int64, src, TAG_RECUT)[0])
        parts = _unpack(w.link.recv((size,), torch.uint8, src, TAG_RECUT))
        if sorted(parts) != ids:
            raise RuntimeError(f"re-cut: stage {src} sent layers {sorted(parts)}, stage {w.stage} expected {ids}")
        for i in ids:
            layer = copy.deepcopy(template[i]).to(w.device)
            layer.load_state_dict(parts[i]["model"])
            layers[i] = layer
            state[i] = parts[i]["optimizer"]
    for work, _ in sends:
        work.wait()
    module = torch.nn.Sequential(*[layers[i] for i in mine_after]).to(w.device)
    module.train()
    w.module = module
    w.optimizer = _rebuilt_optimizer(w, [layers[i] for i in mine_after], [state.get(i, []) for i in mine_after])
    w.cuts = tuple(change.cuts)
    w.layout_in = change.layouts[w.stage - 1] if not w.first else None
    w.layout_out = change.layouts[w.stage]
    gone = [i for ids in outgoing.values() for i in ids]
    return {"sent": sorted(gone), "received": sorted(i for ids in incoming.values() for i in ids), "bytes": sent_bytes}


def _optimizer_state(w, layers: dict) -> dict:
    """Layer -> its parameters' optimizer states, in the layer's parameter order (``{}`` for a parameter the
    optimizer has not stepped yet); empty without an optimizer."""
    if w.optimizer is None:
        return {}
    return {i: [dict(w.optimizer.state.get(p, {})) for p in _trained(layer)] for i, layer in layers.items()}


def _trained(layer) -> list:
    return [p for p in layer.parameters() if p.requires_grad]


def _rebuilt_optimizer(w, layers: list, states: list):
    """The stage's optimizer over its new parameters: the run's kind with the old one's hyperparameters, each
    parameter's state carried over (moved to the parameter's device by ``load_state_dict``)."""
    params = [p for layer in layers for p in _trained(layer)]
    if not params:
        return None
    old = w.optimizer
    opt = w._make_optimizer(w.cfg, params)
    if old is not None:  # hyperparameters as they are now (whatever changed them while training)
        for k, v in old.param_groups[0].items():
            if k != "params":
                opt.param_groups[0][k] = v
    carried, index = {}, 0
    for layer, layer_states in zip(layers, states, strict=True):
        for k, _ in enumerate(_trained(layer)):
            if layer_states and layer_states[k]:
                carried[index] = layer_states[k]
            index += 1
    sd = opt.state_dict()
    sd["state"] = carried
    opt.load_state_dict(sd)
    return opt


def _pack(obj) -> torch.Tensor:
    buf = io.BytesIO()
    torch.save(_to_cpu(obj), buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def _unpack(t: torch.Tensor):
    return torch.load(io.BytesIO(t.cpu().numpy().tobytes()), weights_only=True)


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj
