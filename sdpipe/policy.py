"""Synchronization policies in the worker: how the D replicas of a stage stay in step.

A policy object lives in each worker.  The worker calls its hooks at fixed
points::

    batch = policy.next_batch(worker, epoch, j)           # stage 0: None ends the epoch
    forward/backward of all micro-batches
    stop, version = policy.after_backward(worker, step, stop, version)   # gradient sync
    optimizer.step()
    policy.after_step(worker, step)                       # model averaging
    ...
    policy.epoch_end(worker, step)                        # global sync
    policy.leave(worker)                                  # on stop or failure

Three kinds of worker-side behaviour cover the policies:

* :class:`AllReduce` -- ``allreduce``: gradients averaged over all D replicas
  every step in one static group; pipelines read fixed shards in lock step.
  The stop vote and a requested policy version ride along in the same
  collective, so every replica agrees on the step at which either happens.
* :class:`NoSync` -- ``none``: independent pipelines.
* :class:`Scheduled` -- ``sdpipe`` (and any policy switched to at run time):
  after its optimizer step a worker asks the group service for its group and
  averages weights with exactly those members (partial-reduce), over a
  process group cached by member set.

``NoSync`` and ``Scheduled`` hand out batches from a shared counter, so a fast
pipeline trains on more of each epoch than a slow one (work follows speed).
"""

from __future__ import annotations

import time

__all__ = ["SyncPolicy", "AllReduce", "NoSync", "Scheduled", "make_policy", "WORKER_MODES"]


class SyncPolicy:
    """Base class: no synchronization, batches from the shared counter."""

    name = "base"

    def setup(self, worker) -> None:
        """Called once in the worker (or at a switch) before its first step."""

    def next_batch(self, worker, epoch: int, j: int):
        """Stage 0: the batch id of the ``j``-th step of ``epoch`` for this pipeline, or None at the epoch's end."""
        return worker.dispense(epoch)

    def after_backward(self, worker, step: int, stop: bool, version: int) -> tuple:
        """After the backward of all micro-batches; returns the agreed (stop, policy version)."""
        return stop, version

    def after_step(self, worker, step: int) -> None:
        """After the local optimizer step."""

    def epoch_end(self, worker, step: int) -> None:
        """When the pipeline's epoch ends (all workers of a pipeline call it at the same step)."""

    def leave(self, worker) -> None:
        """The worker stops for good (stop or failure)."""

    def close(self) -> None:
        """Release groups; called once, also after an error."""


class NoSync(SyncPolicy):
    """``none``: independent pipelines, no synchronization."""

    name = "none"


class AllReduce(SyncPolicy):
    """``allreduce``: average the gradients of all D replicas every step.

    All replicas start from the same weights and apply the same averaged
    gradient, so they stay identical (the synchronous baseline of PipeDream
    and DAPPLE style data parallelism).  Pipeline ``p`` reads batches
    ``p, p + D, ...`` of each epoch, so all pipelines take the same steps.
    """

    name = "allreduce"

    def setup(self, worker) -> None:
        self.group = None
        if worker.pipelines > 1:
            self.group = worker.group(f"stage{worker.stage}", worker.pipeline, worker.pipelines)
        self.members = list(range(worker.pipelines))

    def next_batch(self, worker, epoch: int, j: int):
        return j * worker.pipelines + worker.pipeline if j < worker.steps_per_epoch else None

    def after_backward(self, worker, step: int, stop: bool, version: int) -> tuple:
        if self.group is None:
            return stop, version
        from ._comm import allreduce_mean_

        grads = []
        for p in worker.module.parameters():
            if p.grad is None:
                p.grad = p.detach().new_zeros(p.shape)
            grads.append(p.grad)
        start = time.time()
        worker.delay_link()
        # Only pipeline 0 proposes a policy version, so the sum is that version exactly.
        extras = [float(stop), float(version if worker.pipeline == 0 else 0)]
        votes = allreduce_mean_(grads, self.group, worker.pipelines, extras=extras, comm_device=worker.link_device)
        worker.span("sync", step, None, start, time.time(), group=self.members)
        return votes[0] > 0.5, int(round(votes[1]))

    def close(self) -> None:
        self.group = None


class Scheduled(SyncPolicy):
    """Partial-reduce with groups decided by the central group service (SDPipe).

    The members of a group average their stage's weights (and floating
    buffers) with a collective among the members only; groups of one skip it.
    """

    name = "scheduled"

    def setup(self, worker) -> None:
        self.groups: dict = {}

    def _average(self, worker, answer: dict, step: int) -> None:
        members = answer["members"]
        if len(members) < 2:
            return
        from ._comm import allreduce_mean_

        start = time.time()
        pg = self.groups.get(answer["name"])
        if pg is None:
            pg = worker.group(f"avg/{answer['name']}", members.index(worker.pipeline), len(members))
            self.groups[answer["name"]] = pg
        worker.delay_link()
        tensors = [p.data for p in worker.module.parameters()]
        tensors += [b for b in worker.module.buffers() if b.is_floating_point()]
        allreduce_mean_(tensors, pg, len(members), comm_device=worker.link_device)
        worker.span("sync", step, None, start, time.time(), group=members, round=answer["round"], reason=answer["reason"])

    def after_step(self, worker, step: int) -> None:
        self._average(worker, worker.ask_group(step, global_sync=False), step)

    def epoch_end(self, worker, step: int) -> None:
        self._average(worker, worker.ask_group(step, global_sync=True), step)

    def leave(self, worker) -> None:
        worker.leave_service()

    def close(self) -> None:
        self.groups.clear()


#: worker-side behaviour by policy name
WORKER_MODES = {"allreduce": AllReduce, "none": NoSync, "sdpipe": Scheduled, "scheduled": Scheduled}


def make_policy(name: str) -> SyncPolicy:
    if name not in WORKER_MODES:
        raise ValueError(f"policy: {name!r} is not one of {', '.join(WORKER_MODES)}")
    return WORKER_MODES[name]()
