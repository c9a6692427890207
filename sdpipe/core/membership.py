"""Which pipelines take part in a run, as one small state machine with named transitions (driver side).

A pipeline id is handed out once (the run's first ``pipelines``, then :meth:`Membership.add`). Each id is in
one of these states::

    present --ask_to_leave--> leaving --leave--> left
    present --lose--> lost --queue_rejoin--> lost and queued --launch--> lost and joining --rejoined--> joining
    (added) queued --launch--> joining --joined--> present
    joining --give_up_join / join_failed--> (not joining; join_failed: lost)

``present`` is every id in none of the other sets. A rejoining pipeline stays ``lost`` until its new tasks
were submitted (:meth:`rejoined` forgets the loss), so the run's result names it lost if the run ends
before then. Two threads change it (the run's monitor and its membership thread), one transition at a time:
each is a few dict and set operations, atomic under the GIL, and every query reads whole sets.

Pure: no torch, Dask or store.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["Membership"]


class Membership:
    """The pipelines of one run and where each stands."""

    def __init__(self, pipelines: int):
        #: pipeline ids handed out so far
        self.ids = pipelines
        #: pipeline -> its generation: counts its launches (a rejoin launches new tasks under a new one)
        self.generation: dict = {p: 0 for p in range(pipelines)}
        #: added or to rejoin, not launched yet
        self.queued: set = set()
        #: pipeline -> generation, from its launch until it took a replica's state
        self.joining: dict = {}
        #: asked to leave, its tasks not yet ended
        self.leaving: set = set()
        #: pipeline -> why it left
        self.left: dict = {}
        #: pipeline -> why it was lost
        self.lost: dict = {}
        #: pipeline -> the epoch it (last) joined in
        self.joined_in: dict = {}

    # ------------------------------------------------------------ queries
    @property
    def present(self) -> list:
        """The pipelines taking part now: started or joined, not lost, not leaving (a join in progress is not)."""
        gone = set(self.lost) | set(self.left) | set(self.leaving) | set(self.joining) | set(self.queued)
        return [p for p in range(self.ids) if p not in gone]

    @property
    def pending(self) -> bool:
        """A join is queued or in progress."""
        return bool(self.joining) or bool(self.queued)

    @property
    def expected(self) -> int:
        """The pipelines present and those on their way in (what ``Run.scale`` counts)."""
        return len(self.present) + len(self.joining) + len(self.queued)

    # ------------------------------------------------------------ transitions
    def add(self, n: int) -> list:
        """``n`` new pipeline ids, queued to join; returns them."""
        new = list(range(self.ids, self.ids + n))
        self.ids += n
        for p in new:
            self.generation[p] = 0
            self.queued.add(p)
        return new

    def queue_rejoin(self, pipeline: int) -> None:
        """A lost pipeline is to come back once workers are free."""
        self.queued.add(pipeline)

    def unqueue(self, pipeline: int) -> None:
        """Its join was carried out or given up (no longer waiting for workers)."""
        self.queued.discard(pipeline)

    def next_generation(self, pipeline: int) -> int:
        """A rejoin launches new tasks: the pipeline's next generation."""
        self.generation[pipeline] += 1
        return self.generation[pipeline]

    def launch(self, pipeline: int) -> int:
        """Its tasks are being submitted: queued -> joining. Returns its generation."""
        g = self.generation[pipeline]
        self.joining[pipeline] = g
        self.queued.discard(pipeline)
        return g

    def rejoined(self, pipeline: int) -> None:
        """A rejoining pipeline's new tasks were submitted: its loss is forgotten (it is joining)."""
        self.lost.pop(pipeline, None)

    def joined(self, pipeline: int, epoch: int) -> None:
        """It took a replica's state in ``epoch``: joining -> present."""
        self.joined_in[pipeline] = epoch
        self.joining.pop(pipeline, None)

    def give_up_join(self, pipeline: int) -> Optional[int]:
        """It no longer joins (the run ends, or its join failed); the generation it was launched under, if any."""
        return self.joining.pop(pipeline, None)

    def join_failed(self, pipeline: int, why: str) -> str:
        """Its join failed: it is lost; returns the reason as recorded."""
        self.give_up_join(pipeline)
        self.lost[pipeline] = f"pipeline {pipeline} could not join: {why}"
        return self.lost[pipeline]

    def ask_to_leave(self, pipeline: int) -> None:
        """``Run.remove_pipeline``: present -> leaving."""
        self.leaving.add(pipeline)

    def lose(self, pipeline: int, why: str) -> None:
        """A worker of the pipeline was lost: -> lost (no longer leaving)."""
        self.lost[pipeline] = why
        self.leaving.discard(pipeline)

    def ended(self, pipeline: int) -> None:
        """Its tasks ended (finished): no longer leaving."""
        self.leaving.discard(pipeline)

    def leave(self, pipeline: int, why: str) -> None:
        """Its tasks ended after it left (or the run ended before it joined): -> left; the first reason stays."""
        self.left.setdefault(pipeline, why)
        self.leaving.discard(pipeline)
