"""Synchronization policies: how the D replicas of a stage stay in step.

A policy object lives in each worker.  The worker calls its hooks at fixed
points of every step::

    forward/backward of all micro-batches
    agreed_stop = policy.after_backward(worker, step, stop_vote)   # gradient sync
    optimizer.step()
    policy.after_step(worker, step)                                # model averaging

``after_backward`` also carries a stop vote so that replicas that synchronize
every step agree on the step at which a run stops; a policy without such
coupling returns the worker's own vote.
"""

from __future__ import annotations

import time

__all__ = ["SyncPolicy", "AllReduce", "NoSync", "make_policy"]


class SyncPolicy:
    """Base class; the default does no synchronization at all."""

    name = "base"
    #: True when every pipeline reads its own fixed shard each epoch.
    shards_data = True

    def setup(self, worker) -> None:
        """Called once in the worker before the first step."""

    def after_backward(self, worker, step: int, stop_vote: bool) -> bool:
        """Called after the backward of all micro-batches; returns the agreed stop vote."""
        return stop_vote

    def after_step(self, worker, step: int) -> None:
        """Called after the local optimizer step."""

    def close(self) -> None:
        """Release groups; called once, also after an error."""


class NoSync(SyncPolicy):
    """``none``: independent pipelines, no synchronization."""

    name = "none"


class AllReduce(SyncPolicy):
    """``allreduce``: average the gradients of all D replicas every step.

    All replicas start from the same weights and apply the same averaged
    gradient, so they stay identical (the synchronous baseline of PipeDream
    and DAPPLE style data parallelism).
    """

    name = "allreduce"

    def setup(self, worker) -> None:
        self.group = None
        if worker.pipelines > 1:
            self.group = worker.group(f"stage{worker.stage}", worker.pipeline, worker.pipelines)
        self.members = list(range(worker.pipelines))

    def after_backward(self, worker, step: int, stop_vote: bool) -> bool:
        if self.group is None:
            return stop_vote
        grads = []
        for p in worker.module.parameters():
            if p.grad is None:
                p.grad = p.detach().new_zeros(p.shape)
            grads.append(p.grad)
        start = time.time()
        worker.delay_link()
        from ._comm import allreduce_mean_

        votes = allreduce_mean_(grads, self.group, worker.pipelines, extra=float(stop_vote), comm_device=worker.link_device)
        worker.span("sync", step, None, start, time.time(), group=self.members)
        return votes > 0.5

    def close(self) -> None:
        self.group = None


_POLICIES = {"allreduce": AllReduce, "none": NoSync}


def make_policy(name: str) -> SyncPolicy:
    if name not in _POLICIES:
        raise ValueError(f"policy: {name!r} is not one of {', '.join(_POLICIES)}")
    return _POLICIES[name]()
