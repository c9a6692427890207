"""One stage's compute: a step's micro-batches along the schedule plan, and the evaluation pass.

``train_step`` walks this stage's list of actions (:mod:`sdpipe.schedule`): receive a micro-batch's
activations (``RF``), forward it (``F``), send its output on (``SF``), receive its output's gradient (``RB``),
backward (``B``), send its input's gradient back (``SB``).  Sends do not wait; the step waits for them at
its end.  Every action is recorded as a span of the step.

The asynchronous schedules (``async-1f1b``, ``async-2bw``) keep an :class:`AsyncStream` per worker instead:
micro-batches stay in flight from one step to the next, each forward runs on the weight version current
at that moment, stashed until the micro-batch's backward (PipeDream's weight stashing), and the stage
updates (``U``) after every ``update_every`` backwards; the run drains it where it needs consistent weights.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from ._comm import TAG_ACT, TAG_GRAD
from .schedule import async_drain, async_step, stage_communication

__all__ = ["train_step", "evaluate", "AsyncStream"]


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
    must look the tensors up at each use (``sdpipe.policy._state_tensors``): a list kept from earlier may
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
        mb = w.cfg["batch_size"] // M
        step_losses = []
        for a in stage_communication(actions, w.stage, w.stages):
            g = a.microbatch
            t = time.time()
            if a.op == "RF":
                x = w.link.recv((mb, *w.shapes.inp), w.shapes.in_dtype, w.stage - 1, TAG_ACT)
                if x.is_floating_point():
                    x.requires_grad_(True)
                self.inputs[g] = x
                w.span("recv", step_of(), g, t, time.time())
            elif a.op == "F":
                m = g - first
                x = xb[m * mb : (m + 1) * mb] if w.first else self.inputs[g]
                out = self._forward(g, x)
                if w.last:
                    loss = w.loss_fn(out, yb[m * mb : (m + 1) * mb])
                    step_losses.append(float(loss.detach()))
                    self.losses.append(step_losses[-1])
                    out = loss / self.update_every
                self.outputs[g] = out
                w.slow(time.time() - t)
                w.span("forward", step_of(), g, t, time.time(), version=self.version_of[g])
            elif a.op == "SF":
                self.pending.append(w.link.isend(self.outputs[g], w.stage + 1, TAG_ACT))
                w.span("send", step_of(), g, t, time.time())
            elif a.op == "RB":
                self.grads[g] = w.link.recv((mb, *w.shapes.out), w.shapes.out_dtype, w.stage + 1, TAG_GRAD)
                w.span("recv", step_of(), g, t, time.time())
            elif a.op == "B":
                v = self.version_of[g]
                self.input_grads[g] = self._backward(g)
                w.slow(time.time() - t)
                w.span("backward", step_of(), g, t, time.time(), version=v)
            elif a.op == "SB":
                self.pending.append(w.link.isend(self.input_grads.pop(g), w.stage - 1, TAG_GRAD))
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

    def _backward(self, g: int):
        """The gradient of micro-batch ``g`` on the weights its forward used, added to the live weights' own;
        the gradient of its input (stages after the first), or None."""
        w = self.w
        out = self.outputs.pop(g)
        stash = self.stash[self.version_of.pop(g)]
        x = self.inputs.pop(g, None) if not w.first else None
        wants = list(stash.values()) + ([x] if x is not None and x.requires_grad else [])
        grad_out = None if w.last else self.grads.pop(g)
        got = torch.autograd.grad(out, wants, grad_outputs=grad_out, allow_unused=True) if wants else ()
        for (_, p), gp in zip(self.named, got):
            if gp is None:
                continue
            if p.grad is None:
                p.grad = gp.detach().clone()
            else:
                p.grad.add_(gp)
        return got[len(stash)] if len(got) > len(stash) else None

    def _release(self) -> None:
        """Drop the older versions no micro-batch in flight needs."""
        used = set(self.version_of.values())
        for v in [v for v in self.stash if v not in used]:
            del self.stash[v]


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
