"""One stage's compute: a step's micro-batches along the schedule plan, and the evaluation pass.

``train_step`` walks this stage's list of actions (:mod:`sdpipe.schedule`): receive a micro-batch's
activations (``RF``), forward it (``F``), send its output on (``SF``), receive its output's gradient (``RB``),
backward (``B``), send its input's gradient back (``SB``).  Sends do not wait; the step waits for them at
its end.  Every action is recorded as a span of the step.
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from ._comm import TAG_ACT, TAG_GRAD

__all__ = ["train_step", "evaluate"]


def train_step(w, step: int, xb, yb) -> Optional[float]:
    """Run this stage's share of one step (all micro-batches) and return the loss at the last stage."""
    M = w.cfg["microbatches"]
    mb = w.cfg["batch_size"] // M
    inputs, outputs, grads, pending = {}, {}, {}, []
    losses = []
    for a in w.plan:
        m = a.microbatch
        t = time.time()
        if a.op == "RF":
            x = w.link.recv((mb, *w.shapes.inp), w.shapes.in_dtype, w.stage - 1, TAG_ACT)
            if x.is_floating_point():
                x.requires_grad_(True)
            inputs[m] = x
            w.span("recv", step, m, t, time.time())
        elif a.op == "F":
            x = xb[m * mb : (m + 1) * mb] if w.first else inputs[m]
            out = w.module(x)
            if w.last:
                loss = w.loss_fn(out, yb[m * mb : (m + 1) * mb])
                losses.append(float(loss.detach()))
                outputs[m] = loss / M
            else:
                outputs[m] = out
            w.slow(time.time() - t)
            w.span("forward", step, m, t, time.time())
        elif a.op == "SF":
            pending.append(w.link.isend(outputs[m], w.stage + 1, TAG_ACT))
            w.span("send", step, m, t, time.time())
        elif a.op == "RB":
            grads[m] = w.link.recv((mb, *w.shapes.out), w.shapes.out_dtype, w.stage + 1, TAG_GRAD)
            w.span("recv", step, m, t, time.time())
        elif a.op == "B":
            out = outputs.pop(m)
            if w.last:
                out.backward()
            else:
                torch.autograd.backward(out, grads.pop(m))
            w.slow(time.time() - t)
            w.span("backward", step, m, t, time.time())
        elif a.op == "SB":
            g = inputs.pop(m).grad
            pending.append(w.link.isend(g, w.stage - 1, TAG_GRAD))
            w.span("send", step, m, t, time.time())
    if pending:
        t = time.time()
        for work, _ in pending:
            work.wait()
        w.span("wait", step, None, t, time.time())
    return sum(losses) / len(losses) if losses else None


def evaluate(w, step: int, X, Y) -> Optional[dict]:
    """Forward the eval data through this pipeline; the last stage returns loss and accuracy."""
    n = w.spec.eval_size
    bs = w.cfg["batch_size"]
    w.module.eval()
    loss_sum, correct, t = 0.0, 0, time.time()
    classify = w.spec.classify
    with torch.no_grad():
        for lo in range(0, n, bs):
            k = min(bs, n - lo)
            if w.first:
                x = X[lo : lo + k].to(w.device)
            else:
                x = w.link.recv((k, *w.shapes.inp), w.shapes.in_dtype, w.stage - 1, TAG_ACT)
            out = w.module(x)
            if not w.last:
                w.link.send(out, w.stage + 1, TAG_ACT)
                continue
            y = Y[lo : lo + k].to(w.device)
            loss_sum += float(w.loss_fn(out, y)) * k
            if classify:
                correct += int((out.argmax(dim=-1) == y).sum())
    w.module.train()
    w.span("eval", step, None, t, time.time())
    if not w.last:
        return None
    res = {"eval_loss": loss_sum / n}
    if classify:
        res["accuracy"] = correct / n
    return res
