"""One stage's compute: a step's micro-batches along the schedule plan, and the evaluation pass.

``train_step`` walks this stage's list of actions (:mod:`sdpipe.core.schedule`): receive a micro-batch's
activations (``RF``), forward it (``F``), send its output on (``SF``), receive its output's gradient (``RB``),
backward (``B``), send its input's gradient back (``SB``).  Sends do not wait; the step waits for them at
its end.  Every action is recorded as a span of the step.

The asynchronous schedules (``async-1f1b``, ``async-2bw``) keep an :class:`AsyncStream` per worker instead:
micro-batches stay in flight from one step to the next, each forward runs on the weight version current
at that moment, stashed until the micro-batch's backward (PipeDream's weight stashing), and the stage
updates (``U``) after every ``update_every`` backwards; the run drains it where it needs consistent weights.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Optional

import torch

from sdpipe.core.schedule import async_drain, async_step, stage_communication
from sdpipe.worker.comm import TAG_ACT, TAG_GRAD
from sdpipe.worker.tree import flatten, rows, split, to_device

__all__ = ["AsyncStream", "evaluate", "train_step"]


def train_step(w, step: int, xb, yb) -> Optional[float]:
    """Run this stage's share of one step (all micro-batches) and return the loss at the last stage.

    ``xb`` (stage 0) and ``yb`` (the last stage) are the batch's inputs and targets, tensor structures cut
    into the step's micro-batches along dimension 0.  A micro-batch's loss counts its share of the batch's
    samples, so a step minimizes the batch's loss as one process would (for a mean-reducing ``loss_fn``).
    """
    M = w.cfg["microbatches"]
    xs = split(xb, M) if w.first else None
    ys = split(yb, M) if w.last else None
    n = rows(yb) if w.last else 0
    inputs, outputs, grads, pending = {}, {}, {}, []
    loss_sum = None
    for a in w.plan:
        m = a.microbatch
        t, c = time.time(), time.thread_time()
        if a.op == "RF":
            inputs[m] = _receive(w)
            w.span("recv", step, m, t, time.time())
        elif a.op == "F":
            out = w.module(xs[m] if w.first else inputs[m])
            if w.last:
                loss = w.loss_fn(out, ys[m])
                parts = n / rows(ys[m])  # M when the micro-batches are equal
                loss_sum = (loss_sum or 0.0) + float(loss.detach()) / parts
                outputs[m] = loss / parts
            else:
                outputs[m] = out
            w.slow(time.time() - t)
            w.span("forward", step, m, t, time.time(), cpu=time.thread_time() - c)
        elif a.op == "SF":  # the first carries the step's control message on (PipelineControl.exchange)
            pending += w.link.isend_tree(
                outputs[m], w.stage + 1, TAG_ACT, w.layout_out, f"model: stage {w.stage}'s output",
                w.ctl.take_outgoing(),
            )  # fmt: skip
            w.span("send", step, m, t, time.time())
        elif a.op == "RB":
            grads[m] = w.link.recv_like(differentiable(outputs[m]), w.stage + 1, TAG_GRAD)
            w.span("recv", step, m, t, time.time())
        elif a.op == "B":
            out = outputs.pop(m)
            if w.last:
                out.backward()
            else:
                _backward(out, grads.pop(m))
            w.slow(time.time() - t)
            w.span("backward", step, m, t, time.time(), cpu=time.thread_time() - c)
        elif a.op == "SB":
            pending += _send_input_grads(w, input_grads(inputs.pop(m)))
            w.span("send", step, m, t, time.time())
    if pending:
        t = time.time()
        for work, _ in pending:
            work.wait()
        w.span("wait", step, None, t, time.time(), what="sends")
    return loss_sum


def differentiable(obj) -> list:
    """The floating-point tensors of a structure: the ones a gradient flows back through, in order."""
    return [t for t in flatten(obj)[0] if t.is_floating_point()]


def _receive(w):
    """A micro-batch's input from the previous stage (the step's first came with its control message); its
    floating-point tensors will want their gradients."""
    x = w.ctl.take_carried()
    if x is None:
        x = w.link.recv_tree(w.layout_in, w.stage - 1, TAG_ACT)
    for t in differentiable(x):
        t.requires_grad_(True)
    return x


def input_grads(x) -> list:
    """The gradients of a received input's floating-point tensors (zeros for one the stage did not use)."""
    return [t.grad if t.grad is not None else torch.zeros_like(t) for t in differentiable(x)]


def _send_input_grads(w, grads: list) -> list:
    return [w.link.isend(g, w.stage - 1, TAG_GRAD) for g in grads]


def _outputs_with_grads(out, grads: list) -> tuple:
    """``(tensors, their gradients)``: the floating-point tensors of a stage's output that need a gradient, and
    the received gradients that go with them (``grads`` follows :func:`differentiable`'s order)."""
    pairs = [(t, g) for t, g in zip(differentiable(out), grads, strict=False) if t.requires_grad]
    return [t for t, _ in pairs], [g for _, g in pairs]


def _backward(out, grads: list) -> None:
    """Backward from a stage's output given the gradients of its floating-point tensors (those that need one)."""
    outs, grad_outs = _outputs_with_grads(out, grads)
    if outs:
        torch.autograd.backward(outs, grad_outs)


class AsyncStream:
    """One stage's micro-batches in flight across the steps of an asynchronous schedule.

    ``update(loss, versions=n)`` is the run's weight update (the policy's hooks and the optimizer); it is
    called at every ``U`` of the schedule with the last stage's mean loss since the previous one and the
    number of older weight versions stashed then (its ``optimizer`` span records it).

    Weight versions are numbered by the updates since the stream started.  Forwards on the current version
    run on the live weights' storage (``functional_call`` with tensors that share it but keep their own
    autograd version counters); just before an update, if a micro-batch in flight ran its forward on the
    current version, the live weights move to a fresh copy and that version keeps the old storage (a copy on
    update, as PipeDream-2BW's double buffer), so the update, and any averaging the policy does in it, never
    touches weights a backward still needs.  A micro-batch's backward differentiates the version its forward
    used and adds the gradient to the live weights; a version goes once no micro-batch in flight needs it.
    All changes to the live weights happen inside ``update`` or after a drain, and code that changes them
    must look the tensors up at each use (``sdpipe.worker.sync.state_tensors``): a list kept from earlier may
    point at a version's stash.
    """

    def __init__(self, w, update_every: int):
        self.w, self.update_every = w, update_every
        self.steps = 0  # steps since the last drain
        self.version = 0  # updates so far
        self.named = [(n, p) for n, p in w.module.named_parameters() if p.requires_grad]
        self.inputs, self.outputs, self.grads, self.input_grads = {}, {}, {}, {}
        self.version_of: dict = {}  # micro-batch -> the weight version its forward ran on
        self.stash: dict = {}  # version -> {name: tensor}
        self.pending: list = []  # (work, tensor) of the sends not known to be complete
        self.losses: list = []  # last stage: losses since the last update

    @property
    def idle(self) -> bool:
        """Nothing in flight: the weights are consistent (after a drain, or before the first step)."""
        return self.steps == 0 and not self.version_of

    def step(self, step_of: Callable[[], int], xb, yb, update) -> Optional[float]:
        """One step: the forwards of this batch and the backwards and updates that fall between them."""
        w = self.w
        actions = async_step(w.stage, w.stages, w.cfg["microbatches"], self.steps, self.update_every)
        first = self.steps * w.cfg["microbatches"]
        self.steps += 1
        return self._walk(actions, step_of, xb, yb, first, update)

    def drain(self, step_of: Callable[[], int], update) -> None:
        """The backwards still owed and the updates that take them in; then every send is waited for."""
        w = self.w
        if self.steps:
            actions = async_drain(w.stage, w.stages, w.cfg["microbatches"], self.steps, self.update_every)
            self._walk(actions, step_of, None, None, None, update)
        t = time.time()
        for work, _ in self.pending:
            work.wait()
        if self.pending:
            w.span("wait", step_of(), None, t, time.time(), what="drain")
        self.pending.clear()
        self.steps = 0
        self.stash.clear()

    def _walk(self, actions, step_of, xb, yb, first, update) -> Optional[float]:
        w = self.w
        M = w.cfg["microbatches"]
        xs = split(xb, M) if w.first and xb is not None else None
        ys = split(yb, M) if w.last and yb is not None else None
        step_losses = []
        for a in stage_communication(actions, w.stage, w.stages):
            g = a.microbatch
            t, c = time.time(), time.thread_time()
            if a.op == "RF":
                self.inputs[g] = _receive(w)
                w.span("recv", step_of(), g, t, time.time())
            elif a.op == "F":
                m = g - first
                out = self._forward(g, xs[m] if w.first else self.inputs[g])
                if w.last:
                    loss = w.loss_fn(out, ys[m])
                    step_losses.append(float(loss.detach()))
                    self.losses.append(step_losses[-1])
                    out = loss / self.update_every
                self.outputs[g] = out
                w.slow(time.time() - t)
                w.span("forward", step_of(), g, t, time.time(), version=self.version_of[g], cpu=time.thread_time() - c)
            elif a.op == "SF":
                self.pending += w.link.isend_tree(
                    self.outputs[g], w.stage + 1, TAG_ACT, w.layout_out, f"model: stage {w.stage}'s output"
                )
                w.span("send", step_of(), g, t, time.time())
            elif a.op == "RB":
                self.grads[g] = w.link.recv_like(differentiable(self.outputs[g]), w.stage + 1, TAG_GRAD)
                w.span("recv", step_of(), g, t, time.time())
            elif a.op == "B":
                v = self.version_of[g]
                self.input_grads[g] = self._backward(g)
                w.slow(time.time() - t)
                w.span("backward", step_of(), g, t, time.time(), version=v, cpu=time.thread_time() - c)
            elif a.op == "SB":
                self.pending += _send_input_grads(w, self.input_grads.pop(g))
                w.span("send", step_of(), g, t, time.time())
            elif a.op == "U":
                self._keep_current()
                losses, self.losses = self.losses, []
                update(sum(losses) / len(losses) if losses else None, versions=len(self.stash))
                self.version += 1
                self._release()
        self.pending = [(work, x) for work, x in self.pending if not work.is_completed()]
        return sum(step_losses) / len(step_losses) if step_losses else None

    def _forward(self, g: int, x):
        v = self.version
        if v not in self.stash:  # the live weights' storage, not a copy
            self.stash[v] = {n: p.data.requires_grad_(True) for n, p in self.named}
        self.version_of[g] = v
        return torch.func.functional_call(self.w.module, self.stash[v], (x,))

    def _keep_current(self) -> None:
        """Before an update: versions no micro-batch in flight needs go; the live weights move to a copy if a
        micro-batch in flight used them."""
        self._release()
        if self.version in self.stash:
            with torch.no_grad():
                for _, p in self.named:
                    p.data = p.data.clone()  # the stash keeps the old storage

    def _backward(self, g: int) -> list:
        """The gradient of micro-batch ``g`` on the weights its forward used, added to the live weights' own;
        the gradients of its input's floating-point tensors (stages after the first; zeros for one not used)."""
        w = self.w
        out = self.outputs.pop(g)
        stash = self.stash[self.version_of.pop(g)]
        xs = differentiable(self.inputs.pop(g)) if not w.first else []
        if w.last:
            outs, grad_outs = [out], None
        else:
            outs, grad_outs = _outputs_with_grads(out, self.grads.pop(g))
        wants = list(stash.values()) + xs
        got = (
            torch.autograd.grad(outs, wants, grad_outputs=grad_outs, allow_unused=True) if outs else [None] * len(wants)
        )
        for (_, p), gp in zip(self.named, got, strict=False):
            if gp is None:
                continue
            if p.grad is None:
                p.grad = gp.detach().clone()
            else:
                p.grad.add_(gp)
        return [gx if gx is not None else torch.zeros_like(x) for x, gx in zip(xs, got[len(stash) :], strict=False)]

    def _release(self) -> None:
        """Drop the older versions no micro-batch in flight needs."""
        used = set(self.version_of.values())
        for v in [v for v in self.stash if v not in used]:
            del self.stash[v]


def evaluate(w, step: int, X, Y) -> Optional[dict]:
    """Forward the eval data through this pipeline; the last stage returns the loss and the run's metric."""
    n = w.spec.eval_size
    bs = w.cfg["batch_size"]
    metric, name = w.spec.metric, w.spec.metric_name
    w.module.eval()
    loss_sum, metric_sum, elements, t = 0.0, 0.0, 0, time.time()
    with torch.no_grad():
        for lo in range(0, n, bs):
            idx = torch.arange(lo, min(n, lo + bs))
            x = to_device(X.take(idx), w.device) if w.first else w.link.recv_tree(w.layout_in, w.stage - 1, TAG_ACT)
            out = w.module(x)
            if not w.last:
                for work, _ in w.link.isend_tree(
                    out, w.stage + 1, TAG_ACT, w.layout_out, f"model: stage {w.stage}'s output"
                ):
                    work.wait()
                continue
            y = to_device(Y.take(idx), w.device)
            loss_sum += float(w.loss_fn(out, y)) * len(idx)
            if metric == "accuracy":  # per target element: a token of a sequence, a label of a sample
                metric_sum += int((out.argmax(dim=-1) == y).sum())
                elements += y.numel()
            elif callable(metric):
                metric_sum += float(metric(out, y)) * len(idx)
    w.module.train()
    w.span("eval", step, None, t, time.time())
    if not w.last:
        return None
    res = {"eval_loss": loss_sum / n}
    if metric == "accuracy":
        res[name] = metric_sum / elements
    elif metric == "perplexity":
        res[name] = math.exp(min(res["eval_loss"], 700.0))
    elif callable(metric):
        res[name] = metric_sum / n
    if name:
        res["metric"] = name  # which key holds it, for whoever shows the records
    return res
