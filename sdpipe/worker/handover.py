"""A pipeline that joins a running run takes a live replica's state: what the donor gives (:class:`DonorState`), how
it gives it (:func:`donate`, at a step boundary) and how the joiner waits for and takes it (:func:`await_state`).

The state travels through the run's store (``torch.save`` of a :class:`DonorState`) under the joiner's
generation's key (:meth:`sdpipe.wire.protocol.Keys.join`).
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass
from typing import Optional

import torch

from sdpipe.wire.protocol import Keys

__all__ = ["DonorState", "await_state", "donate"]


@dataclass
class DonorState:
    """What a live replica of a stage gives the same stage of a joining pipeline."""

    #: the stage's weights (on the CPU)
    model: dict
    #: the optimizer's state, or None without an optimizer
    optimizer: Optional[dict]
    #: where the run is: the epoch and the donor's step
    epoch: int
    step: int
    #: the donor's mass (the policies that weigh replicas by it)
    mass: float
    #: the batches of the epoch already handed out before the shared counter (0: none)
    base: int
    #: the donor's pipeline
    donor: int
    #: the membership changes the joiner has taken up (up to its own join)
    members: int
    #: a coupled policy's members and shards with the joiner (``AllReduce.changed``), else None
    policy: Optional[dict] = None


def donate(worker, joiner: int, generation: int, version: int, epoch: int, step: int, after=None) -> None:
    """Give this stage's state to pipeline ``joiner`` (it joins the run): weights, optimizer state, where the
    run is (epoch, step), the policy's mass.  At a step boundary; the group service counts the joiner from
    now on, unioned with this replica (its model is this one's).  ``after``: a coupled policy's members and
    shards with the joiner (:meth:`AllReduce.changed`)."""
    t = time.time()
    worker.policy.settle(worker, step)  # an overlapped averaging in flight lands first
    state = DonorState(
        model={k: v.detach().cpu().clone() for k, v in worker.module.state_dict().items()},
        optimizer=worker.optimizer.state_dict() if worker.optimizer is not None else None,
        epoch=epoch,
        step=step,
        mass=worker.policy.mass,
        base=worker.dispenser.base.get(epoch, 0),
        donor=worker.pipeline,
        members=version,  # the joiner has taken up the membership changes up to its own join
        policy=after,
    )
    buf = io.BytesIO()
    torch.save(state, buf)
    if worker.policy.record.uses_service:
        worker.service.join(stage=worker.stage, pipeline=joiner, donor=worker.pipeline)
    worker.store.set(Keys.join(joiner, generation, f"state/{worker.stage}"), buf.getvalue())
    worker.span("control", step, None, t, time.time(), what="donated", to=joiner, bytes=buf.tell())


def await_state(worker) -> Optional[DonorState]:
    """A joiner: wait for the state its donor gives (bounded by the run's timeout, not counting a pause);
    None when the driver gave the join up (the run ended first)."""
    key = Keys.join(worker.pipeline, worker.generation, f"state/{worker.stage}")
    cancel = Keys.join(worker.pipeline, worker.generation, "cancel")
    waited, last = 0.0, time.monotonic()
    while not worker.store.check([key]):
        if worker.store.check([cancel]):
            return None
        time.sleep(0.05)
        now = time.monotonic()
        waited += 0.0 if worker.read_ctl(1.0).pause else now - last
        last = now
        if waited > worker.timeout:
            raise TimeoutError(
                f"pipeline {worker.pipeline} stage {worker.stage}: no live replica gave its state within the run's "
                f"timeout ({worker.timeout:.0f}s) to join"
            )
    state: DonorState = torch.load(io.BytesIO(worker.store.get(key)), weights_only=False)
    worker.store.delete_key(key)
    worker.module.load_state_dict(state.model)
    if worker.optimizer is not None and state.optimizer is not None:
        worker.optimizer.load_state_dict(state.optimizer)
    worker.policy.mass = state.mass
    if state.base:
        worker.dispenser.base[state.epoch] = state.base
    worker.members_version = worker.ctl.seen = state.members
    if worker.policy.coupled:  # the members form their new group at this step: so does the joiner
        after = state.policy
        worker.policy.setup(worker, members=after["members"], version=state.members, shard=after["shard"])
    worker.store.set(Keys.join(worker.pipeline, worker.generation, "epoch"), str(state.epoch))
    worker.store.add(Keys.join(worker.pipeline, worker.generation, "loaded"), 1)
    return state
