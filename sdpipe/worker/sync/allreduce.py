"""``allreduce``: gradients averaged over all replicas every step, in lock step."""

from __future__ import annotations

import time
from typing import Optional

import torch

from sdpipe.wire.protocol import Keys, MembershipChange
from sdpipe.worker.comm import RendezvousTimeout, allreduce_mean_
from sdpipe.worker.sync.base import SyncPolicy

__all__ = ["AllReduce", "stage_group"]


class AllReduce(SyncPolicy):
    """``allreduce``: average the gradients of all D replicas every step.

    All replicas start from the same weights and apply the same averaged
    gradient, so they stay identical (the synchronous baseline of PipeDream
    and DAPPLE style data parallelism).  Pipeline ``p`` reads batches
    ``p, p + D, ...`` of each epoch, so all pipelines take the same steps.

    Pipelines that join or leave (``Run.add_pipelines``, ``Run.remove_pipeline``): the membership version is
    agreed in the step's collective like the policy version, so every replica changes its members at the same
    step boundary; the group is formed anew over the new members (the joiner forms it once it holds a replica's
    state) and the rest of the epoch's batches are dealt out in lock step among them (:attr:`shard`).
    """

    def setup(self, worker, members=None, version: int = 0, shard=None) -> None:
        #: the pipelines averaging together, in rank order
        self.members = list(range(worker.pipelines)) if members is None else sorted(members)
        #: epoch -> (batches dealt before, the step from which the current members deal the rest)
        self.shard: dict = dict(shard or {})
        self.group = None
        self.bucket: Optional[GradBucket] = None
        self.connect(worker, version)

    def connect(self, worker, version: int) -> None:
        """Form the group of the current members (named after the membership version that made them).

        The first group is formed among the pipelines not marked lost: a worker lost before it formed (while
        the run starts) takes its pipeline out (the driver starts a replacement, which joins like an added
        pipeline); once it formed, a lost member ends the run."""
        self.group = None
        if version == 0 and self.members == list(range(worker.pipelines)) and worker.pipelines > 1:
            self.group, ranks = stage_group(worker, f"stage{worker.stage}")
            self.members = sorted(ranks)
            return
        if len(self.members) > 1 and worker.pipeline in self.members:
            name = f"stage{worker.stage}" + (f".m{version}" if version else "")
            rank, size = self.members.index(worker.pipeline), len(self.members)
            self.group = worker.group(name, rank, size, pipelines=self.members)

    def taken(self, worker, epoch: int, j: int) -> int:
        """Batches of ``epoch`` dealt out up to and with step ``j``."""
        base, j0 = self.shard.get(epoch, (0, 0))
        return base + (j - j0 + 1) * len(self.members)

    def next_batch(self, worker, epoch: int, j: int):
        if epoch not in self.shard and len(self.members) == worker.pipelines:  # the members the run started with
            return j * worker.pipelines + worker.pipeline if j < worker.steps_per_epoch else None
        base, j0 = self.shard.get(epoch, (0, 0))
        D = len(self.members)
        first = base + (j - j0) * D
        if first + D > worker.spec.batches_per_epoch:
            return None
        return first + self.members.index(worker.pipeline)

    def changed(self, worker, change: MembershipChange, epoch: int, j) -> dict:
        """The members and shards after ``change`` (a join or a leave) taken at the boundary of step ``j`` of
        ``epoch`` (None: at the epoch's end, so from the next epoch on).  Returns them as a joiner needs them."""
        shard = dict(self.shard)
        if j is not None:
            shard[epoch] = (self.taken(worker, epoch, j - 1), j)
        p = change.pipeline
        members = sorted(set(self.members) | {p}) if change.kind == "join" else [m for m in self.members if m != p]
        return {"members": members, "shard": shard, "j": j or 0}

    def change(self, worker, change: dict, epoch: int, j) -> None:
        """Take ``change`` (see :meth:`changed`); the group is formed again by :meth:`connect`."""
        after = self.changed(worker, change, epoch, j)
        self.members, self.shard = after["members"], after["shard"]
        old, self.group = self.group, None
        if old is not None:
            worker.drop_group(old)

    def after_backward(
        self, worker, step: int, stop: bool, version: int, pause: bool = False, members: int = 0
    ) -> tuple:
        if self.group is None:
            return stop, version, pause, members
        start = time.time()
        worker.delay_link()
        # Only the first member proposes a policy and a membership version, so the sums are those versions.
        first = worker.pipeline == self.members[0]
        extras = [float(stop), float(version if first else 0), float(pause), float(members if first else 0)]
        size = len(self.members)
        params = list(worker.module.parameters())
        if self.bucket is None or not self.bucket.holds(params):
            self.bucket = GradBucket.of(params, len(extras), worker.link_device)
        if self.bucket is not None:
            votes = self.bucket.allreduce_mean(self.group, size, extras)
        else:
            grads = []
            for p in params:
                if p.grad is None:
                    p.grad = p.detach().new_zeros(p.shape)
                grads.append(p.grad)
            votes = allreduce_mean_(grads, self.group, size, extras=extras, comm_device=worker.link_device)
        worker.span("sync", step, None, start, time.time(), group=self.members)
        return votes[0] > 0.5, round(votes[1]), votes[2] > 0.5, round(votes[3])

    def after_step(self, worker, step: int) -> None:
        """Nothing: the averaged gradients kept the replicas identical."""

    def epoch_end(self, worker, step: int) -> None:
        """Nothing: the replicas are identical already."""

    def close(self, failed: bool = False) -> None:
        self.group = self.bucket = None


class GradBucket:
    """A stage's gradients as views of one flat buffer, with room for a few numbers after them (as DDP's
    ``gradient_as_bucket_view``): the backward accumulates into the buffer, the all-reduce averages it in place,
    and the optimizer reads the averaged gradients from it, with no copy into or out of a buffer at each step.

    A parameter whose gradient was replaced since (set to None, or assigned) has it copied in and its view put
    back at the next :meth:`allreduce_mean`.  Used where the gradients live on the device that communicates, in one
    dtype (else :func:`~sdpipe.worker.comm.allreduce_mean_` flattens them at each step).
    """

    def __init__(self, params: list, extras: int):
        self.params = params
        self.n = sum(p.numel() for p in params)
        self.flat = torch.zeros(self.n + extras, dtype=params[0].dtype, device=params[0].device)
        self.views, offset = [], 0
        for p in params:
            self.views.append(self.flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        self._bind()

    @classmethod
    def of(cls, params: list, extras: int, comm_device) -> Optional["GradBucket"]:
        """A bucket for ``params``, or None where they are not all of one dtype on ``comm_device``."""
        if not params or any(p.dtype != params[0].dtype or p.device != comm_device for p in params):
            return None
        return cls(params, extras)

    def holds(self, params: list) -> bool:
        """Whether this bucket is of exactly ``params`` (a re-cut rebuilds the stage's module)."""
        return len(params) == len(self.params) and all(a is b for a, b in zip(params, self.params, strict=True))

    def _bind(self) -> None:
        """Every parameter's gradient is its view again (a gradient held elsewhere is copied in; none is zero)."""
        with torch.no_grad():
            for p, v in zip(self.params, self.views, strict=True):
                g = p.grad
                if g is None:
                    v.zero_()
                elif g.data_ptr() != v.data_ptr():
                    v.copy_(g)
                else:
                    continue
                p.grad = v

    def allreduce_mean(self, group, size: int, extras: list) -> list:
        """Average the gradients over ``group`` of ``size`` members in place; returns ``extras`` summed over it."""
        self._bind()
        tail = self.flat[self.n :]
        tail.copy_(torch.tensor(extras, dtype=torch.float64))
        group.allreduce([self.flat]).wait()
        sums = tail.tolist()
        self.flat[: self.n].div_(size)
        return sums


def stage_group(worker, name: str) -> tuple:
    """The stage's first process group: of this stage's workers of every pipeline never marked lost (one that was
    lost and came back joins later, by a membership change), and each member pipeline's rank in it (``(None,
    ranks)`` for fewer than two).  A member lost during the rendezvous (a worker killed while the run starts) ends
    it for every member; the survivors then form it again among themselves, under a name that lists them, so they
    all meet in the same one whatever order they noticed the loss in."""
    D = worker.pipelines
    gone = lambda p: worker.store.check([Keys.ever_lost(p)])
    for _ in range(D):
        members = [p for p in range(D) if not gone(p)]
        if worker.pipeline not in members:
            raise RendezvousTimeout(f"group {name}: gave up the rendezvous: pipeline {worker.pipeline} was lost")
        ranks = {p: i for i, p in enumerate(members)}
        if len(members) < 2:
            return None, ranks
        label = name if len(members) == D else f"{name}-of-" + "-".join(map(str, members))
        try:
            return worker.group(label, ranks[worker.pipeline], len(members), pipelines=members), ranks
        except RendezvousTimeout:
            if not any(gone(p) for p in members):
                raise
    raise RendezvousTimeout(f"group {name}: every other pipeline was lost while it formed")
