"""What the policies that average through the group service share: asking it, and averaging with a group."""

from __future__ import annotations

import time
from typing import Optional

from sdpipe.core import sync_rules as rules
from sdpipe.wire.protocol import GroupAnswer, Keys, pipeline_lost
from sdpipe.worker.comm import CONNECT_TIMEOUT, allreduce_max, allreduce_mean_
from sdpipe.worker.sync.base import SyncPolicy, failure, state_tensors

__all__ = ["GroupPolicy", "all_arrive"]


def all_arrive(worker, answer: GroupAnswer) -> bool:
    """Before a new group's rendezvous: whether every member came; every member gets the same verdict.

    A rendezvous cannot be interrupted, and a member that died right
    after the service answered it would hold the others for the whole
    timeout; this wait can give up. The verdict is one atomic
    compare-and-set in the run's store, "go" once every member arrived or
    "skip" once a member's pipeline is marked lost, whichever comes first:
    a member of a lost pipeline that is still alive (its other stage died)
    may arrive after another member saw the mark, and deciding each for
    itself would send some members into a rendezvous the others skip. A
    member that dies after a "go", during the rendezvous, holds the others
    for ``CONNECT_TIMEOUT`` at most (the rendezvous then fails, and the
    group is skipped like a broken one).
    """
    members, store = answer.members, worker.store
    key = Keys.arrivals(worker.stage, answer.round, answer.name)
    verdict = Keys.verdict(worker.stage, answer.round, answer.name)
    store.add(key, 1)
    deadline = time.monotonic() + worker.timeout
    while True:
        if store.check([verdict]):
            return store.get(verdict) == b"go"
        if store.add(key, 0) >= len(members):
            proposal = "go"
        elif any(pipeline_lost(store, m) for m in members if m != worker.pipeline):
            proposal = "skip"
        elif time.monotonic() > deadline:
            raise TimeoutError(f"group {answer.name}: not every member arrived within {worker.timeout:.0f}s")
        else:
            time.sleep(0.002)
            continue
        return store.compare_set(verdict, "", proposal) == b"go"


class GroupPolicy(SyncPolicy):
    """What the policies that average through the group service share: asking it, and averaging with a group.

    The members of a group average their stage's weights (and floating
    buffers) with a collective among the members only; groups of one skip it.
    Under the scheduler's ``weighting="progress"`` each member counts with its
    mass (1 + its optimizer steps since the last global sync; a group leaves
    each member the mean mass of the group), so a replica that fell behind
    pulls the average back less; ``"uniform"`` is the plain mean
    (:func:`sdpipe.core.sync_rules.member_weight` and the ``mass_after_*`` rules).

    A subclass decides when to ask (its :meth:`after_step`, :meth:`epoch_end`); nothing here is switched off.
    """

    all_arrive = staticmethod(all_arrive)

    def setup(self, worker) -> None:
        self.groups: dict = {}  # group name -> its process group
        self.mass = 1.0
        #: the re-cut the members of this worker's global syncs agreed on (see :meth:`pending_cut`)
        self.agreed_cut = worker.cut_version

    def _ask(self, worker, step: int, global_sync: bool) -> GroupAnswer:
        """The group service's answer for this worker at ``step``."""
        return worker.ask_group(step, global_sync=global_sync)

    def _average(self, worker, answer: GroupAnswer, step: int, cut: Optional[int] = None) -> bool:
        """Average with the answer's group; False when the group was skipped because a member's pipeline was
        lost first.  ``cut`` (a global sync): the newest re-cut this member knows of; the members agree on the
        newest any of them knows (:attr:`agreed_cut`)."""
        ok, self.mass = self._exchange(worker, answer, step, state_tensors(worker), self.mass, cut=cut)
        return ok

    def _exchange(
        self, worker, answer: GroupAnswer, step: int, tensors: list, mass: float, cut: Optional[int] = None, **extra
    ) -> tuple:
        """Average ``tensors`` (in place) with the answer's group, this member counting with ``mass``;
        returns ``(False when a member's pipeline was lost before the group formed, the mass after)``.
        ``cut``: see :meth:`_average`.  ``extra``: more fields of the ``sync`` span."""
        members, weighting = answer.members, answer.weighting
        if len(members) < 2:
            if cut is not None:
                self.agreed_cut = max(self.agreed_cut, cut)
            return True, rules.mass_after_round(mass, answer.reason)
        start = time.time()
        fields = dict(group=members, round=answer.round, reason=answer.reason, **extra)
        try:
            pg = self.groups.get(answer.name)
            if pg is None:
                if not self.all_arrive(worker, answer):
                    worker.span(
                        "sync",
                        step,
                        None,
                        start,
                        time.time(),
                        **fields,
                        failed="a member's pipeline was lost before the group formed",
                    )
                    return False, mass
                pg = worker.group(
                    f"avg/{answer.name}/r{answer.round}",
                    members.index(worker.pipeline),
                    len(members),
                    connect_timeout=CONNECT_TIMEOUT,
                    pipelines=members,
                )
                self.groups[answer.name] = pg
            worker.delay_link()
            # the masses travel as an extra under either weighting; "uniform" weights every member 1
            total = allreduce_mean_(
                tensors,
                pg,
                len(members),
                extras=(mass,),
                comm_device=worker.link_device,
                timeout=worker.timeout,
                weight=rules.member_weight(mass, weighting),
            )[0]
            after = rules.mass_after_round(rules.mass_after_group(total, len(members)), answer.reason)
            if cut is not None:
                agreed = allreduce_max(pg, cut, worker.link_device, worker.timeout)
                self.agreed_cut = max(self.agreed_cut, int(agreed))
        except RuntimeError as e:
            # a member died during the collective (its pipeline is being lost): this worker keeps its own
            # weights (allreduce_mean_ writes them back only after the collective returned), forgets the
            # group and goes on; the scheduler takes the lost pipeline out
            broken = self.groups.pop(answer.name, None)
            if broken is not None:
                # its connections close once unreferenced, so a member still waiting in it fails now too
                worker.drop_group(broken)
                del broken
            pg = None
            worker.span("sync", step, None, start, time.time(), **fields, failed=failure(e))
            return True, mass  # not retried: some members may have completed the collective
        worker.span("sync", step, None, start, time.time(), **fields, mass=round(mass, 4), weighting=weighting)
        return True, after

    def _global_sync(self, worker, step: int, answer: GroupAnswer) -> None:
        """Average with a global sync's answer; when a member's pipeline was lost before the group formed
        (every member then skips it: one verdict), the survivors ask for a global sync among themselves again.
        The members also agree on the newest re-cut any of them knows of (see :meth:`pending_cut`)."""
        cut = max(worker.cut_version, worker.read_ctl().cut)
        for _ in range(4 * worker.pipelines + 8):  # each retry follows a loss (rejoined pipelines can be lost again)
            if self._average(worker, answer, step, cut=cut):
                return
            answer = self._ask(worker, step, True)

    def pending_cut(self, worker, published: int) -> int:
        """A re-cut is taken after a global sync (an epoch's end): every member of one reads the newest re-cut the
        driver published and the members agree on the newest any of them read, which every replica of the stage
        then takes at its next step boundary, before it averages again.  A global sync holds every replica
        whatever each came for, so no averaging has one replica on the old cut and another on the new."""
        return max(worker.cut_version, self.agreed_cut)

    def leave(self, worker) -> None:
        worker.leave_service()

    def close(self, failed: bool = False) -> None:
        self.groups.clear()
