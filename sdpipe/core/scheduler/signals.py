"""What the group scheduler hears (:class:`Ready`, :class:`Lost`, :class:`Tick`, :class:`Join`, :class:`Hurry`,
:class:`Retune`) and what it decides (:class:`Group`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from sdpipe.core.scheduler.policy import SchedulerPolicy

__all__ = ["Event", "Group", "Hurry", "Join", "Lost", "Ready", "Retune", "Tick"]


@dataclass(frozen=True)
class Ready:
    """Worker (a pipeline id) finished a step and waits for its group."""

    worker: int
    step: int
    time: float
    global_sync: bool = False
    #: the stage whose worker it is (for :meth:`GroupScheduler.handle`; a :class:`StageScheduler` is one stage)
    stage: Optional[int] = None


@dataclass(frozen=True)
class Lost:
    """Worker left the stage for good (failure or stop); with no ``stage``, a whole pipeline is gone (every stage's
    worker ``worker``)."""

    worker: int
    time: float
    stage: Optional[int] = None


@dataclass(frozen=True)
class Tick:
    """Time passed; closes a round whose window ended."""

    time: float


@dataclass(frozen=True)
class Join:
    """Worker (a pipeline id) joined the stage, holding the state it took from the live worker ``donor`` (None:
    a state of its own); it takes part in rounds from its next Ready."""

    worker: int
    time: float
    donor: Optional[int] = None
    #: the stage it joined; None: a whole pipeline joined (every stage took ``donor``'s state)
    stage: Optional[int] = None


@dataclass(frozen=True)
class Hurry:
    """Worker (a pipeline id) reached the end of its epoch with a ready signal in the open round: the round closes
    at once with the members it holds (reason "preempted"), as a global sync's first ready signal closes it, so
    the worker's global sync does not wait out the round's window."""

    worker: int
    time: float
    stage: Optional[int] = None


@dataclass(frozen=True)
class Retune:
    """The scheduler's parameters change (a live policy change) from now on, in every stage."""

    policy: SchedulerPolicy
    time: float


Event = Union[Ready, Lost, Tick, Join, Hurry, Retune]


@dataclass(frozen=True)
class Group:
    """Decision: ``members`` average together now."""

    stage: int
    round: int
    members: tuple
    reason: str  # "full" | "arrived" | "window" | "graph" | "global" | "preempted" | "alone"
    opened: float
    closed: float
    windows: tuple = ()  # ((member, new window), ...)
    connected: bool = False  # this round completed a connected union (the count resets)

    @property
    def wait(self) -> float:
        """Seconds the first member waited for the round to close."""
        return self.closed - self.opened

    def to_dict(self) -> dict:
        return {
            "stage": self.stage,
            "round": self.round,
            "members": list(self.members),
            "reason": self.reason,
            "opened": self.opened,
            "closed": self.closed,
            "wait": self.wait,
            "connected": self.connected,
        }


def _decided(
    stage: int, round_: int, members: tuple, reason: str, opened: float, closed: float, windows: tuple, connected: bool
) -> Group:
    """``Group(stage, round_, ...)`` without the frozen dataclass's field-by-field ``__init__`` (half the time): a
    round at 16,384 pipelines decides thousands of pairs."""
    g = object.__new__(Group)
    object.__setattr__(
        g,
        "__dict__",
        {
            "stage": stage,
            "round": round_,
            "members": members,
            "reason": reason,
            "opened": opened,
            "closed": closed,
            "windows": windows,
            "connected": connected,
        },
    )
    return g
