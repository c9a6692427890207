"""The synchronization policies, one record each: every fact about a policy that the driver, the workers, the
group service, the simulator, the dashboard and the command line use, in this one place.

A policy has a *name* (what a user passes: ``train(policy="sdpipe")``) and runs a *mode* on the workers (the
worker-side sync implementation, :attr:`PolicyRecord.worker`): ``sdpipe`` runs ``"scheduled"``, the others their
own name. A live switch (:meth:`sdpipe.Run.set_policy`) moves a run to :data:`SWITCHED_MODE` for the rest of the
run, under the scheduler settings (:attr:`PolicyRecord.preset`) of the policy switched to.

Nothing else in sdpipe spells a policy's name: code asks a record (``record("allreduce").coupled``), and the
worker asks its sync object's record, never its type. Pure: no torch, Dask or store.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from sdpipe.core.scheduler import SchedulerPolicy

__all__ = [
    "DEFAULT",
    "EXCHANGES",
    "NAMES",
    "POLICY_PRESETS",
    "RECORDS",
    "SWITCHED_MODE",
    "PolicyRecord",
    "names",
    "of_mode",
    "record",
]

#: how a policy's replicas meet, as the simulator's engine and the docs tell them apart
EXCHANGES = ("groups", "all", "server", "pairs", "nothing")


@dataclass(frozen=True)
class PolicyRecord:
    """One synchronization policy."""

    #: what a user passes (``train(policy=...)``, ``--policy``)
    name: str
    #: one line for the command line's help and the docs
    summary: str
    #: the mode its workers run (:func:`sdpipe.worker.sync.make_policy` finds its record by it)
    mode: str
    #: how its replicas meet: "groups" (partial groups formed by the group service), "all" (every replica after
    #: every step), "server" (a parameter server per stage), "pairs" (gossip pairs), "nothing"
    exchange: str
    #: ``"module:Class"`` of its worker-side sync (imported on the worker only)
    worker: str
    #: the group scheduler's settings under it (None: it forms no groups; the default ``SchedulerPolicy()``
    #: is used where a run needs one, e.g. for its staleness bound)
    preset: Optional[SchedulerPolicy] = None
    #: ``Run.set_policy`` can switch a running run to and from it
    live: bool = False
    #: the other pipelines go on when one of its pipelines is lost
    loss_tolerant: bool = False
    #: pipelines can be added and removed while it runs
    elastic: bool = False
    #: a lost pipeline can come back (``rejoin=True``): the others go on without it meanwhile
    rejoin: bool = False
    #: its workers ask the group service (for their groups, or for the global syncs)
    uses_service: bool = False
    #: its replicas move in lock step (fixed shards of each epoch, every step averaged by all)
    coupled: bool = False
    #: ``Run.recut`` can move layers between the stages of a running run under it (not where servers or
    #: background peers hold a stage's weights for the whole run)
    recut: bool = False
    #: the simulator models it (``sdpipe.simulate``)
    simulated: bool = True
    #: its colour where a figure compares policies
    colour: str = "#7f7f7f"

    def __post_init__(self):
        if self.exchange not in EXCHANGES:
            raise ValueError(f"exchange: {self.exchange!r} is not one of {', '.join(EXCHANGES)}")

    @property
    def scheduler(self) -> SchedulerPolicy:
        """The group scheduler's settings a run under this policy starts with."""
        return self.preset if self.preset is not None else SchedulerPolicy()


_ALL = PolicyRecord(
    name="allreduce",
    summary="every replica averages with all others after every step (the synchronous baseline)",
    mode="allreduce",
    exchange="all",
    worker="sdpipe.worker.sync.allreduce:AllReduce",
    # the group service waits for every worker each round (no window, no pairing)
    preset=SchedulerPolicy(
        window="prototype",
        overlap=False,
        window_init=math.inf,
        window_min=math.inf,
        window_max=math.inf,
        pair_threshold=2**31,
        weighting="uniform",
    ),
    live=True,
    elastic=True,
    coupled=True,
    recut=True,
    colour="#d62728",
)

RECORDS: dict[str, PolicyRecord] = {
    r.name: r
    for r in (
        PolicyRecord(
            name="sdpipe",
            summary="partial-reduce groups of the replicas ready together, formed by the group service",
            mode="scheduled",
            exchange="groups",
            worker="sdpipe.worker.sync.scheduled:Scheduled",
            preset=SchedulerPolicy(),
            live=True,
            loss_tolerant=True,
            elastic=True,
            rejoin=True,
            uses_service=True,
            recut=True,
            colour="#1f77b4",
        ),
        _ALL,
        PolicyRecord(
            name="ps",
            summary="a parameter server per stage, hosted by pipeline 0's worker, with a staleness bound",
            mode="ps",
            exchange="server",
            worker="sdpipe.worker.sync.ps:ParameterServer",
            colour="#9467bd",
        ),
        PolicyRecord(
            name="adpsgd",
            summary="asynchronous gossip: each replica averages with one peer at a time",
            mode="adpsgd",
            exchange="pairs",
            worker="sdpipe.worker.sync.gossip:GossipPairs",
            loss_tolerant=True,
            uses_service=True,
            colour="#2ca02c",
        ),
        PolicyRecord(
            name="none",
            summary="no synchronization: each replica trains alone (the upper bound on speed)",
            mode="none",
            exchange="nothing",
            worker="sdpipe.worker.sync.nosync:NoSync",
            preset=SchedulerPolicy(
                max_group=1, window="prototype", overlap=False, window_init=0.0, window_min=0.0, staleness=2**31
            ),
            live=True,
            loss_tolerant=True,
            elastic=True,
            rejoin=True,
            recut=True,
            colour="#7f7f7f",
        ),
    )
}

#: the policy of a run that names none (every replica averaged after every step: the familiar baseline)
DEFAULT = "allreduce"

#: every policy's name, in the order the docs and the command line list them
NAMES: tuple = tuple(RECORDS)

#: the mode a live switch moves a run to (the group service forms every round under the new preset)
SWITCHED_MODE = RECORDS["sdpipe"].mode

#: the group scheduler's settings of the policies that have their own
POLICY_PRESETS: dict = {r.name: r.preset for r in RECORDS.values() if r.preset is not None}

_MODES: dict[str, PolicyRecord] = {r.mode: r for r in RECORDS.values()}


def record(name: str) -> PolicyRecord:
    """The record of policy ``name``; a one-line ``ValueError`` naming the allowed ones otherwise."""
    try:
        return RECORDS[name]
    except (KeyError, TypeError):
        raise ValueError(f"policy: {name!r} is not one of {', '.join(NAMES)}") from None


def of_mode(mode: str) -> PolicyRecord:
    """The record of the policy whose workers run ``mode`` (``"scheduled"`` is ``sdpipe``'s; a policy's name is
    also taken, so a worker started with ``cfg["policy"]`` finds its record)."""
    if mode in _MODES:
        return _MODES[mode]
    return record(mode)


def names(**facts) -> tuple:
    """The names of the policies whose records have every one of ``facts`` (``names(live=True)``)."""
    return tuple(r.name for r in RECORDS.values() if all(getattr(r, k) == v for k, v in facts.items()))
