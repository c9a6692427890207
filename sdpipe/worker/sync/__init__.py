"""Synchronization policies in the worker: how the D replicas of a stage stay in step.

A policy object lives in each worker.  The worker loop calls it at fixed points, and nothing else of
it (see :class:`SyncPolicy`)::

    policy.setup(worker)                              # once, or when a live switch brings this policy in
    each step boundary, at stage 0:
        stop = policy.decide_stop(store_stop)         # not coupled: the driver's stop read from the store
        batch = policy.next_batch(worker, epoch, j)   # None ends the epoch
    forward/backward of all micro-batches
    stop, version, pause = policy.after_backward(worker, step, stop, version, pause)   # gradient sync
    optimizer.step()
    policy.after_step(worker, step)                   # model averaging
    ...
    policy.settle(worker, step)                       # at an epoch's end: finish an exchange still in flight
    policy.epoch_end(worker, step)                    # at an epoch's end (every sync_every epochs): global sync
    cut = policy.pending_cut(worker, published)       # stage 0: the re-cut its pipeline takes at this boundary
    policy.stopping(worker, step)                     # the run stops at this step boundary, then
    policy.leave(worker)                              # ... leave; on a failure only leave
    policy.close(failed)                              # once: at a switch away, or when the worker closes

A *coupled* policy (:attr:`SyncPolicy.coupled`, only ``allreduce``) moves its replicas in lock step:
stage 0 acts on the stop, pause and policy version that :meth:`~SyncPolicy.after_backward` returned
(agreed in the step's collective) instead of asking :meth:`~SyncPolicy.decide_stop`.

Five kinds of worker-side behaviour cover the policies:

* :class:`AllReduce` -- ``allreduce``: gradients averaged over all D replicas
  every step in one static group; pipelines read fixed shards in lock step.
  The stop vote and a requested policy version ride along in the same
  collective, so every replica agrees on the step at which either happens.
* :class:`NoSync` -- ``none``: independent pipelines.
* :class:`Scheduled` -- ``sdpipe`` (and any policy switched to at run time):
  after its optimizer step a worker asks the group service for its group and
  averages weights with exactly those members (partial-reduce), over a
  process group cached by member set.
* :class:`GossipPairs` -- ``adpsgd``: asynchronous decentralized gossip with
  no central view.  Even pipelines are active, odd ones passive (a bipartite
  split, so no deadlock); after each step an active worker picks a passive
  one at random and the two average their weights.  A passive worker serves
  such requests from a background thread while it trains, so it never waits
  for the active side and the active side never waits for the passive one's
  step.  The epoch ends with a global sync through the group service.
* :class:`ParameterServer` -- ``ps``: a parameter server per stage
  (:class:`PsServer`), hosted by the stage's worker of pipeline 0 in a
  background thread (HetPipe-like).  After each step a worker pushes its
  update (weights minus the weights it last pulled) and pulls the global
  weights; a pull waits while the worker is more than ``staleness`` steps
  ahead of the slowest worker of its stage (stale synchronous parallel).  The
  epoch ends with every worker pulling the same global weights.

``Scheduled`` and ``GossipPairs`` share the group service's side (ask, average with a group, the global
sync) through :class:`GroupPolicy`.  The decisions themselves (who the server answers, who pairs with
whom, the masses, the stop) are pure functions in :mod:`sdpipe.core.sync_rules`; the store keys come from
:class:`sdpipe.wire.protocol.Keys`.

Every policy except ``allreduce`` hands out batches from a shared counter, so
a fast pipeline trains on more of each epoch than a slow one (work follows
speed).

``ps`` and ``adpsgd`` keep servers and request queues that live for the whole
run, so they are chosen when the run starts; live switches move between
``sdpipe``, ``allreduce`` and ``none``.
"""

from __future__ import annotations

import importlib

from sdpipe.core.policies import of_mode
from sdpipe.worker.sync.allreduce import AllReduce
from sdpipe.worker.sync.base import STOP_GRACE, SyncPolicy, state_tensors
from sdpipe.worker.sync.gossip import GossipPairs
from sdpipe.worker.sync.nosync import NoSync
from sdpipe.worker.sync.ps import ParameterServer
from sdpipe.worker.sync.scheduled import Scheduled

__all__ = [
    "STOP_GRACE",
    "AllReduce",
    "GossipPairs",
    "NoSync",
    "ParameterServer",
    "Scheduled",
    "SyncPolicy",
    "make_policy",
    "state_tensors",
]


def make_policy(mode: str) -> SyncPolicy:
    """The worker-side policy object of ``mode`` (a policy's mode or name, :func:`sdpipe.core.policies.of_mode`), before
    its setup: the class its record names (:attr:`sdpipe.core.policies.PolicyRecord.worker`)."""
    rec = of_mode(mode)
    module, _, cls = rec.worker.partition(":")
    policy = getattr(importlib.import_module(module), cls)()
    policy.record = rec
    return policy
