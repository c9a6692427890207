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
  (:class:`_PsServer`), hosted by the stage's worker of pipeline 0 in a
  background thread (HetPipe-like).  After each step a worker pushes its
  update (weights minus the weights it last pulled) and pulls the global
  weights; a pull waits while the worker is more than ``staleness`` steps
  ahead of the slowest worker of its stage (stale synchronous parallel).  The
  epoch ends with every worker pulling the same global weights.

``Scheduled`` and ``GossipPairs`` share the group service's side (ask, average with a group, the global
sync) through :class:`_GroupPolicy`.  The decisions themselves (who the server answers, who pairs with
whom, the masses, the stop) are pure functions in :mod:`sdpipe.sync_rules`; the store keys come from
:class:`sdpipe.protocol.Keys`.

Every policy except ``allreduce`` hands out batches from a shared counter, so
a fast pipeline trains on more of each epoch than a slow one (work follows
speed).

``ps`` and ``adpsgd`` keep servers and request queues that live for the whole
run, so they are chosen when the run starts; live switches move between
``sdpipe``, ``allreduce`` and ``none``.
"""

from __future__ import annotations

import abc
import concurrent.futures
import importlib
import threading
import time
import traceback

import torch

from . import sync_rules as rules
from ._comm import CONNECT_TIMEOUT, RendezvousTimeout, allreduce_mean_, flatten, pipeline_lost, unflatten_
from .policies import PolicyRecord, of_mode
from .protocol import GroupAnswer, GroupServiceError, Keys

__all__ = [
    "AllReduce",
    "GossipPairs",
    "NoSync",
    "ParameterServer",
    "Scheduled",
    "SyncPolicy",
    "make_policy",
]

TAG_SERVE = 7  # point-to-point traffic of the gossip and parameter-server exchanges
#: seconds after stage 0 first read the driver's stop before a group policy takes it without its group's word
STOP_GRACE = 5.0


class SyncPolicy(abc.ABC):
    """How the replicas of a stage meet: the whole interface between the worker loop and a policy.

    **What the worker loop may use** (nothing else): the attributes :attr:`name`, :attr:`coupled`,
    :attr:`record` and :attr:`mass`, and the methods :meth:`setup`, :meth:`decide_stop`, :meth:`next_batch`,
    :meth:`after_backward`, :meth:`after_step`, :meth:`settle`, :meth:`epoch_end`, :meth:`stopping`, :meth:`leave`,
    :meth:`close`; plus :func:`make_policy` and :func:`_state_tensors` of this module.

    **What a policy may use of the worker** (nothing else):

    * ``worker.span(kind, step, microbatch, start, end, **fields)``: record an event (``time.time()`` values);
    * ``worker.ask_group(step, global_sync=..., waiting=True)``: the group service's answer, a
      :class:`sdpipe.protocol.GroupAnswer` (``round``, ``members``, ``reason``, ``name``, ``policy``,
      ``version``, ``weighting``, ``overlap``, ``stop``); ``waiting=False``: asked from a background thread, so
      no ``wait`` span is recorded;
    * ``worker.leave_service()``; ``worker.read_ctl()``: the driver's :class:`sdpipe.protocol.Command`;
    * ``worker.group(name, rank, size, connect_timeout=None, pipelines=None)``, ``worker.drop_group(g)``;
    * ``worker.delay_link()``: the emulated link's delay before a transfer; ``worker.dispense(epoch)``;
    * attributes ``store``, ``timeout``, ``stage``, ``pipeline``, ``pipelines``, ``module``,
      ``link_device``, ``rng``, ``cfg`` (the ``TrainConfig`` as a dict), ``steps_per_epoch``.

    Every policy says what its replicas do after a step and at an epoch's end (:meth:`after_step`,
    :meth:`epoch_end`, abstract), even when the answer is "nothing".
    """

    #: what this policy is (:class:`sdpipe.policies.PolicyRecord`; set by :func:`make_policy`)
    record: PolicyRecord
    #: the replica's mass (1 + its optimizer steps since the last global sync) under the policies that weigh
    #: replicas by it; a joiner takes its donor's. Policies without masses leave it at 1.
    mass = 1.0

    @property
    def name(self) -> str:
        """The mode this policy implements (:attr:`sdpipe.policies.PolicyRecord.mode`)."""
        return self.record.mode

    @property
    def coupled(self) -> bool:
        """The replicas move in lock step: fixed shards of each epoch, and stop / pause / policy version agreed
        in the step's collective (what :meth:`after_backward` returns), not through :meth:`decide_stop`."""
        return self.record.coupled

    def setup(self, worker) -> None:  # noqa: B027 (an optional hook: by default it does nothing)
        """Called once in the worker (or at a switch) before its first step."""

    def decide_stop(self, store_stop: bool) -> bool:
        """Stage 0 at a step boundary, for a policy that is not :attr:`coupled`: whether to stop now.

        ``store_stop``: the driver's stop flag as read from the run's store; the base takes it as it is.
        """
        return store_stop

    def next_batch(self, worker, epoch: int, j: int):
        """Stage 0: the batch id of the ``j``-th step of ``epoch`` for this pipeline, or None at the epoch's end."""
        return worker.dispense(epoch)

    def after_backward(
        self, worker, step: int, stop: bool, version: int, pause: bool = False, members: int = 0
    ) -> tuple:
        """After the backward of all micro-batches; returns the agreed ``(stop, policy version, pause, membership
        version)``.

        Stage 0 of a :attr:`coupled` policy passes its own reading of the driver's command (the others
        ``False, 0, False, 0``) and acts at the next step boundary on what comes back.
        """
        return stop, version, pause, members

    @abc.abstractmethod
    def after_step(self, worker, step: int) -> None:
        """After the local optimizer step."""

    @abc.abstractmethod
    def epoch_end(self, worker, step: int) -> None:
        """When the pipeline's epoch ends (all workers of a pipeline call it at the same step)."""

    def settle(self, worker, step=None, boundary: bool = True) -> None:  # noqa: B027 (an optional hook: by default it does nothing)
        """Before the weights must be this replica's own and complete (an epoch's end: its evaluation and
        checkpoint): finish any exchange still in flight.  Nothing to do for most policies."""

    def stopping(self, worker, step: int) -> None:  # noqa: B027 (an optional hook: by default it does nothing)
        """The run stops at this step boundary (before :meth:`leave`)."""

    def leave(self, worker) -> None:  # noqa: B027 (an optional hook: by default it does nothing)
        """The worker stops for good (stop or failure)."""

    def close(self, failed: bool = False) -> None:  # noqa: B027 (an optional hook: by default it does nothing)
        """Release groups; called once, also after an error (``failed``)."""


class NoSync(SyncPolicy):
    """``none``: independent pipelines, no synchronization."""

    def after_step(self, worker, step: int) -> None:
        """Nothing: the replicas drift apart."""

    def epoch_end(self, worker, step: int) -> None:
        """Nothing: the replicas drift apart."""


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
        self.connect(worker, version)

    def connect(self, worker, version: int) -> None:
        """Form the group of the current members (named after the membership version that made them).

        The first group is formed among the pipelines not marked lost: a worker lost before it formed (while
        the run starts) takes its pipeline out (the driver starts a replacement, which joins like an added
        pipeline); once it formed, a lost member ends the run."""
        self.group = None
        if version == 0 and self.members == list(range(worker.pipelines)) and worker.pipelines > 1:
            self.group, ranks = _stage_group(worker, f"stage{worker.stage}")
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

    def changed(self, worker, change: dict, epoch: int, j) -> dict:
        """The members and shards after ``change`` (a join or a leave) taken at the boundary of step ``j`` of
        ``epoch`` (None: at the epoch's end, so from the next epoch on).  Returns them as a joiner needs them."""
        shard = dict(self.shard)
        if j is not None:
            shard[epoch] = (self.taken(worker, epoch, j - 1), j)
        p = change["pipeline"]
        members = sorted(set(self.members) | {p}) if change["kind"] == "join" else [m for m in self.members if m != p]
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
        grads = []
        for p in worker.module.parameters():
            if p.grad is None:
                p.grad = p.detach().new_zeros(p.shape)
            grads.append(p.grad)
        start = time.time()
        worker.delay_link()
        # Only the first member proposes a policy and a membership version, so the sums are those versions.
        first = worker.pipeline == self.members[0]
        extras = [float(stop), float(version if first else 0), float(pause), float(members if first else 0)]
        size = len(self.members)
        votes = allreduce_mean_(grads, self.group, size, extras=extras, comm_device=worker.link_device)
        worker.span("sync", step, None, start, time.time(), group=self.members)
        return votes[0] > 0.5, round(votes[1]), votes[2] > 0.5, round(votes[3])

    def after_step(self, worker, step: int) -> None:
        """Nothing: the averaged gradients kept the replicas identical."""

    def epoch_end(self, worker, step: int) -> None:
        """Nothing: the replicas are identical already."""

    def close(self, failed: bool = False) -> None:
        self.group = None


def _state_tensors(worker) -> list:
    """What replicas of a stage keep in step: parameters and floating buffers."""
    return [p.data for p in worker.module.parameters()] + [b for b in worker.module.buffers() if b.is_floating_point()]


def _stage_group(worker, name: str) -> tuple:
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


def _failure(e: BaseException) -> str:
    """An exchange's failure as an event field."""
    return f"{type(e).__name__}: {str(e)[:200]}"


def _all_arrive(worker, answer: GroupAnswer) -> bool:
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


class _GroupPolicy(SyncPolicy):
    """What the policies that average through the group service share: asking it, and averaging with a group.

    The members of a group average their stage's weights (and floating
    buffers) with a collective among the members only; groups of one skip it.
    Under the scheduler's ``weighting="progress"`` each member counts with its
    mass (1 + its optimizer steps since the last global sync; a group leaves
    each member the mean mass of the group), so a replica that fell behind
    pulls the average back less; ``"uniform"`` is the plain mean
    (:func:`sdpipe.sync_rules.member_weight` and the ``mass_after_*`` rules).

    A subclass decides when to ask (its :meth:`after_step`, :meth:`epoch_end`); nothing here is switched off.
    """

    _all_arrive = staticmethod(_all_arrive)

    def setup(self, worker) -> None:
        self.groups: dict = {}  # group name -> its process group
        self.mass = 1.0

    def _ask(self, worker, step: int, global_sync: bool) -> dict:
        """The group service's answer for this worker at ``step``."""
        return worker.ask_group(step, global_sync=global_sync)

    def _average(self, worker, answer: GroupAnswer, step: int) -> bool:
        """Average with the answer's group; False when the group was skipped because a member's pipeline was
        lost first."""
        ok, self.mass = self._exchange(worker, answer, step, _state_tensors(worker), self.mass)
        return ok

    def _exchange(self, worker, answer: GroupAnswer, step: int, tensors: list, mass: float, **extra) -> tuple:
        """Average ``tensors`` (in place) with the answer's group, this member counting with ``mass``;
        returns ``(False when a member's pipeline was lost before the group formed, the mass after)``.
        ``extra``: more fields of the ``sync`` span."""
        members, weighting = answer.members, answer.weighting
        if len(members) < 2:
            return True, rules.mass_after_round(mass, answer.reason)
        start = time.time()
        fields = dict(group=members, round=answer.round, reason=answer.reason, **extra)
        try:
            pg = self.groups.get(answer.name)
            if pg is None:
                if not self._all_arrive(worker, answer):
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
            worker.span("sync", step, None, start, time.time(), **fields, failed=_failure(e))
            return True, mass  # not retried: some members may have completed the collective
        worker.span("sync", step, None, start, time.time(), **fields, mass=round(mass, 4), weighting=weighting)
        return True, after

    def _global_sync(self, worker, step: int, answer: GroupAnswer) -> None:
        """Average with a global sync's answer; when a member's pipeline was lost before the group formed
        (every member then skips it: one verdict), the survivors ask for a global sync among themselves again."""
        for _ in range(4 * worker.pipelines + 8):  # each retry follows a loss (rejoined pipelines can be lost again)
            if self._average(worker, answer, step):
                return
            answer = self._ask(worker, step, True)

    def leave(self, worker) -> None:
        worker.leave_service()

    def close(self, failed: bool = False) -> None:
        self.groups.clear()


class Scheduled(_GroupPolicy):
    """Partial-reduce with groups decided by the central group service (SDPipe).

    After each optimizer step a worker asks for its group and averages with it (see :class:`_GroupPolicy`);
    an epoch's end, and a stop, end with a global sync.  The stop comes with the service's answers
    (:meth:`decide_stop`).
    """

    def setup(self, worker) -> None:
        super().setup(worker)
        self.stop_answered = False  # an answer of the group service said the run is stopping
        self.stop_seen_at = None  # when stage 0 first read the driver's stop from the store (monotonic)
        # averaging overlapped with the next step (SchedulerPolicy.overlap): the run's setting until the service's
        # answers say otherwise (a live policy change)
        self.overlap = bool((worker.cfg.get("scheduler") or {}).get("overlap"))
        self.pool = None  # its one thread, made at the first overlapped step
        self.in_flight = None  # (future, step) of the averaging in flight
        #: steps an overlapped averaging may stay in flight before a step waits for it: the run's staleness bound
        #: P, as the connectivity bound's (within P steps of a worker its model has mixed)
        self.max_lag = int((worker.cfg.get("scheduler") or {}).get("staleness") or 10)
        self.worker = worker

    def decide_stop(self, store_stop: bool) -> bool:
        """Stage 0, at a step boundary: whether to stop (:func:`sdpipe.sync_rules.group_stop`).

        The group service says so in every answer decided after ``run.stop()``,
        and the members of a round get the same answer, so pipelines that
        average together stop after the same round (under the ``allreduce``
        preset: at the same step, and the replicas end identical).  The
        driver's flag in the run's store is the fallback, taken
        ``STOP_GRACE`` seconds after this worker first read it.
        """
        stop, self.stop_seen_at = rules.group_stop(
            self.stop_answered, store_stop, self.stop_seen_at, time.monotonic(), STOP_GRACE
        )
        return stop

    def _ask(self, worker, step: int, global_sync: bool) -> dict:
        answer = super()._ask(worker, step, global_sync)
        self.stop_answered = self.stop_answered or answer.stop
        return answer

    def after_step(self, worker, step: int) -> None:
        self.mass = rules.mass_after_step(self.mass)
        if self.in_flight is not None:
            future, asked = self.in_flight
            if not future.done() and step - asked < self.max_lag:
                # the group of an earlier step is still forming or averaging (it may be waiting for a slow
                # member): this step goes on without a ready signal of its own instead of waiting for it, and
                # the averaging lands as a correction at a later step boundary
                return
        # the last averaging first: its answer may also turn overlap off (a live policy change), and this step's
        # ready signal must not reach the service while that one's is still there
        self.settle(worker, step, boundary=False)
        if not self.overlap:
            answer = self._ask(worker, step, False)
            self._average(worker, answer, step)
            self.overlap = answer.overlap  # the service's policy, from the next step on
            return
        if self.pool is None:
            self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sdpipe-overlap")
        snapshot = [t.detach().clone() for t in _state_tensors(worker)]
        self.in_flight = (self.pool.submit(self._background, worker, step, snapshot, self.mass), step)

    def _background(self, worker, step: int, snapshot: list, mass: float) -> tuple:
        """Overlapped averaging, in this policy's thread: the group service's answer, then the group's average
        of the weights as they were at the ready signal.  Returns ``(answer, snapshot, average, mass at the
        snapshot, mass after)``; ``average`` is None for a group of one.  A group that a lost member broke
        leaves ``average`` equal to the snapshot: no correction."""
        if worker.device.type == "cuda":  # the current device is per thread
            torch.cuda.set_device(worker.device)
        answer = worker.ask_group(step, global_sync=False, waiting=False)
        if len(answer.members) < 2:
            return answer, snapshot, None, mass, rules.mass_after_round(mass, answer.reason)
        average = [t.clone() for t in snapshot]
        _, after = self._exchange(worker, answer, step, average, mass, lane="background")
        return answer, snapshot, average, mass, after

    def settle(self, worker, step=None, boundary: bool = True) -> None:
        """Wait for the overlapped averaging in flight (if any) and apply it: the weights move by the group's
        average minus this replica's snapshot, and the mass by the group's mean mass minus the snapshot's.

        The wait is bounded by the run's timeout and recorded as a ``wait`` span when there was one: what
        ``"group"`` at a step (the next step's ready signal waited for it), ``"drain"`` at an epoch's end, a
        stop or a switch (``boundary``: the last group's whole round is waited for there)."""
        if self.in_flight is None:
            return
        future, asked = self.in_flight
        self.in_flight = None
        if boundary and not future.done():
            # an epoch's end (or a stop, a leave, a switch): a round still open for this ready signal closes now
            # with the members it holds, instead of the global sync waiting out its window
            try:
                worker.service.hurry(stage=worker.stage, pipeline=worker.pipeline)
            except GroupServiceError:  # the run or the service is gone: the wait below says so
                pass
        start = time.time()
        try:
            answer, snapshot, average, mass, after = future.result(timeout=worker.timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(
                f"stage {worker.stage} pipeline {worker.pipeline}: the group of step {asked} did not answer "
                f"and average within the run's timeout ({worker.timeout:.0f}s)"
            ) from None
        end = time.time()
        if end - start > 1e-4:
            what = "drain" if boundary else "group"
            worker.span("wait", step, None, start, end, what=what, group=answer.members, round=answer.round)
        self.stop_answered = self.stop_answered or answer.stop
        self.overlap = answer.overlap
        if average is not None:
            with torch.no_grad():
                for t, s0, avg in zip(_state_tensors(worker), snapshot, average, strict=True):
                    t.add_(avg.sub_(s0))
        self.mass += after - mass

    def epoch_end(self, worker, step: int) -> None:
        self.settle(worker, step)
        self._global_sync(worker, step, self._ask(worker, step, True))

    def stopping(self, worker, step: int) -> None:
        """A last global sync, so a stopped run's replicas of a stage end identical (as after an epoch).

        Skipped when no step reached this replica since the last global sync: its mass is still 1
        (a step adds 1, a group leaves the mean of masses of at least 1, a global sync restarts it).
        """
        self.settle(worker, step)
        if self.mass != 1.0:
            self.epoch_end(worker, step)

    def close(self, failed: bool = False) -> None:
        """Finish the averaging in flight (a live switch away), or abandon it (a failure), then release."""
        if self.in_flight is not None and not failed:
            self.settle(self.worker)
        self.in_flight = None
        if self.pool is not None:
            self.pool.shutdown(wait=not failed, cancel_futures=True)
            self.pool = None
        super().close(failed)


# ---------------------------------------------------------------- servers
class _Mailbox:
    """Requests to one server, through the run's store: a counter hands out slots in order.

    Putting a request takes two store calls (claim a slot, fill it), so a
    writer that dies between them leaves a slot that is never filled (a hole):
    the server serves the filled slots past a hole (:class:`_Server`).
    """

    def __init__(self, store, prefix: str):
        self.store, self.prefix = store, prefix

    def put(self, text: str) -> int:
        i = self.store.add(Keys.mailbox_count(self.prefix), 1) - 1
        self.store.set(Keys.mailbox_slot(self.prefix, i), text)
        return i

    def issued(self) -> int:
        """Slots claimed so far (filled or not)."""
        return self.store.add(Keys.mailbox_count(self.prefix), 0)

    def get(self, i: int, timeout: float):
        """Slot ``i``'s request once it is filled (waiting at most ``timeout`` seconds), or None.

        It looks every ``MAILBOX_POLL`` seconds at most rather than waiting in the store: a store wait that
        expires makes torch print a warning on the terminal (once per connection, on every worker that
        serves), and an idle server's waits expire."""
        key = Keys.mailbox_slot(self.prefix, i)
        deadline = time.monotonic() + timeout
        pause = MAILBOX_POLL / 8
        while not self.store.check([key]):
            if time.monotonic() >= deadline:
                return None
            time.sleep(pause)
            pause = min(MAILBOX_POLL, pause * 2)
        return self._pop(key)

    def take(self, i: int):
        """Slot ``i``'s request if it is filled now, else None (no wait)."""
        key = Keys.mailbox_slot(self.prefix, i)
        return self._pop(key) if self.store.check([key]) else None

    def _pop(self, key: str) -> str:
        text = self.store.get(key).decode()
        self.store.delete_key(key)
        return text


#: seconds between looks at an idle server's next slot, at most (see :meth:`_Mailbox.get`)
MAILBOX_POLL = 0.001
#: seconds between looks at the slots past a hole (see :class:`_Server`)
HOLE_POLL = 0.002
#: a request that only wakes a server waiting for its next slot (:meth:`_Server.settle` puts one)
WAKE = "wake"


class _Server(threading.Thread):
    """Serves a mailbox until stopped; an error is kept for the main thread to raise.

    Slots are served in order while they are filled in order.  A slot that
    stays empty while later ones were claimed (its writer may have died
    between claiming and filling it) does not hold up the others: the server
    then looks at every claimed slot every ``HOLE_POLL`` seconds and serves
    the filled ones.  :meth:`settle` gives up on the holes below a count once
    every live writer is known to be done with them (the caller knows when);
    a slot given up on that is filled after all is still served.
    """

    def __init__(self, name: str, mailbox: _Mailbox, handle, idle=None, door=None):
        super().__init__(name=name, daemon=True)
        self.mailbox, self.handle, self.idle = mailbox, handle, idle
        #: the same mailbox on the connection of the threads that are not this one (settle's wake, issued()): a
        #: store connection serves one call at a time, and this thread's waits would hold their calls up
        self.door = door if door is not None else mailbox
        self.stopping = threading.Event()
        self.error = None
        self.served = 0
        self.next = 0  # every slot below it is served or given up on
        self.ahead: set = set()  # slots above ``next`` already served (past a hole)
        self.given_up: set = set()  # empty slots below ``next``: still served if they are filled after all
        self.claimed = 0  # the mailbox's count of claimed slots, as last read
        self.settle_to = 0  # set by settle(): give up on the empty slots below it once the filled ones are served
        self.settled = 0
        self.woken = 0  # the highest settle target a wake was put for

    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                if not self._serve_one() and self.idle is not None:
                    self.idle()
        except BaseException as e:  # surfaced by check() in the worker's main thread
            traceback.clear_frames(e.__traceback__)  # kept: its frames must not keep a process group open
            self.error = e

    def _serve_one(self) -> bool:
        """Serve one filled slot if there is one (waiting a little); whether one was served."""
        behind = self.claimed > self.next or self.settle_to > self.settled
        text = self.mailbox.take(self.next) if behind else self.mailbox.get(self.next, 0.2)
        if text is not None:
            self._served(self.next, text)
            return True
        self.claimed = self.mailbox.issued()
        for i in sorted(self.given_up) + list(range(self.next + 1, self.claimed)):
            if i not in self.ahead:
                text = self.mailbox.take(i)
                if text is not None:
                    self.given_up.discard(i)
                    self._served(i, text)
                    return True
        if self.settle_to > self.settled:
            # every filled slot below settle_to is served: the empty ones are holes
            self.given_up.update(i for i in range(self.next, self.settle_to) if i not in self.ahead)
            self._advance(self.settle_to)
            self.settled = self.settle_to
        elif self.claimed > self.next:
            time.sleep(HOLE_POLL)
        return False

    def _served(self, i: int, text: str) -> None:
        if text == WAKE:  # settle() put it: the settle target takes it in, so the next look settles
            self.settle_to = max(self.settle_to, i + 1)
        else:
            self.handle(text)
            self.served += 1
        self.ahead.add(i)
        self._advance(self.next)

    def _advance(self, to: int) -> None:
        self.next = max(self.next, to)
        self.ahead = {i for i in self.ahead if i >= self.next}
        while self.next in self.ahead:
            self.ahead.discard(self.next)
            self.next += 1

    def settle(self, upto: int, timeout: float) -> bool:
        """Serve every filled slot below ``upto`` and give up on the empty ones; whether done within ``timeout``.

        Call it once every live writer has filled the slots it claimed below
        ``upto`` (e.g. every one of them is waiting for this worker).  A server that served everything waits
        for its next slot (up to 0.2 s a look): a wake request in that slot ends the wait at once.
        """
        self.settle_to = max(self.settle_to, upto)
        if self.settled < upto and self.woken < upto:
            self.woken = upto
            self.door.put(WAKE)
        return self.wait_until(lambda: self.settled >= upto, timeout, poll=0.001)

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"{self.name}: {type(self.error).__name__}: {self.error}") from self.error

    def wait_until(self, until, timeout: float, poll: float = 0.02) -> bool:
        """Wait (at most ``timeout`` seconds) until ``until()`` holds or the server failed; whether it holds."""
        deadline = time.monotonic() + timeout
        while not until():
            if self.error is not None or time.monotonic() >= deadline:
                return False
            time.sleep(poll)
        return True

    def finish(self, timeout: float, until=None) -> None:
        """Stop once ``until()`` holds (or at once), waiting at most ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        if until is not None:
            self.wait_until(until, timeout)
        self.stopping.set()
        self.join(max(0.0, deadline - time.monotonic()) + 1.0)


class GossipPairs(_GroupPolicy):
    """``adpsgd``: random pairs, no central view (AD-PSGD, Lian et al. 2018).

    Pipeline ``p`` is active when ``p`` is even (:func:`sdpipe.sync_rules.gossip_roles`).  An active worker,
    after its optimizer step, picks a passive worker of its stage at random
    (:func:`sdpipe.sync_rules.choose_peer`) and the two set their weights to the pair's mean: the active one
    in its main thread, the passive one by adding ``(x_active - x_passive) / 2`` at its next step
    boundary (so autograd never sees weights change under it and the sum over
    the replicas is conserved).  The epoch ends with a global sync through the group service
    (:class:`_GroupPolicy`), the only time it asks the service: the stop is the driver's flag.
    """

    @property
    def tensors(self) -> list:
        """The stage's state, looked up at each use: an asynchronous schedule moves the live weights to new
        storage at an update (:class:`sdpipe._stage.AsyncStream`), so a list kept from set-up would go stale."""
        return _state_tensors(self.worker)

    def setup(self, worker) -> None:
        super().setup(worker)
        D, stage = worker.pipelines, worker.stage
        self.worker = worker
        self.device = worker.link_device
        self.active = worker.pipeline % 2 == 0
        self.store = worker.store
        # the stage's workers of the pipelines not lost (a loss while the run starts leaves the others pairing);
        # ranks in the group by pipeline
        self.pg, self.rank = _stage_group(worker, f"adpsgd-stage{stage}") if D > 1 else (None, {})
        actives, passives = rules.gossip_roles(D)
        self.actives = [p for p in actives if p in self.rank]
        self.passives = [p for p in passives if p in self.rank]
        self.lock = threading.Lock()
        self.held = False  # whether the training thread holds the lock (from after_backward to after_step)
        self.pending = None  # sum of the deltas served but not yet applied
        self.left = False
        self.server = None
        self.worker = worker
        if self.pg is not None and not self.active:
            prefix = Keys.gossip_mailbox(stage, worker.pipeline)
            self.server = _Server(
                f"adpsgd-server-{stage}-{worker.pipeline}",
                _Mailbox(worker.server_store(), prefix),
                self._serve,
                door=_Mailbox(self.store, prefix),
            )
            self.server.start()

    def _serve(self, text: str) -> None:
        active, _step = (int(x) for x in text.split(","))
        start = time.time()
        with self.lock:
            mine = flatten(self.tensors, self.device)
        theirs = torch.empty_like(mine)
        w = self.worker
        pair = sorted((active, w.pipeline))
        try:
            self.pg.recv([theirs], self.rank[active], TAG_SERVE).wait()
            self.pg.send([mine], self.rank[active], TAG_SERVE).wait()
        except RuntimeError as e:  # the active worker died: nothing to fold in
            failed = _failure(e)
            w.span("sync", None, None, start, time.time(), group=pair, reason=rules.PAIR, served=True, failed=failed)
            return
        delta = (theirs - mine).div_(2)
        with self.lock:
            self.pending = delta if self.pending is None else self.pending.add_(delta)
        w.span("sync", None, None, start, time.time(), group=pair, reason=rules.PAIR, served=True)

    def _apply_pending(self) -> None:
        if self.server is None:
            return
        self.server.check()
        with self.lock:
            pending, self.pending = self.pending, None
            if pending is not None:
                flat = flatten(self.tensors, self.device).add_(pending)
                unflatten_(self.tensors, flat.to(self.tensors[0].device))

    def after_backward(
        self, worker, step: int, stop: bool, version: int, pause: bool = False, members: int = 0
    ) -> tuple:
        if self.server is not None:
            self.lock.acquire()  # the optimizer step must not interleave with a snapshot being served
            self.held = True
        return stop, version, pause, members

    def after_step(self, worker, step: int) -> None:
        if self.server is not None:
            self.held = False
            self.lock.release()
            self._apply_pending()
            return
        if self.pg is None or not self.passives:
            return
        # a peer whose pipeline was lost is dropped: pair with the others from now on
        peer, self.passives = rules.choose_peer(self.passives, lambda p: pipeline_lost(self.store, p), worker.rng)
        if peer is None:
            return
        start = time.time()
        worker.delay_link()
        _Mailbox(self.store, Keys.gossip_mailbox(worker.stage, peer)).put(f"{worker.pipeline},{step}")
        mine = flatten(self.tensors, self.device)
        theirs = torch.empty_like(mine)
        pair = sorted((worker.pipeline, peer))
        try:
            work = self.pg.send([mine], self.rank[peer], TAG_SERVE)
            self.pg.recv([theirs], self.rank[peer], TAG_SERVE).wait()
            work.wait()
        except RuntimeError as e:  # the passive worker died mid-exchange: keep our weights, drop the peer
            self.passives.remove(peer)
            worker.span("sync", step, None, start, time.time(), group=pair, reason=rules.PAIR, failed=_failure(e))
            return
        unflatten_(self.tensors, mine.add_(theirs).div_(2).to(self.tensors[0].device))
        worker.span("sync", step, None, start, time.time(), group=pair, reason=rules.PAIR)

    def epoch_end(self, worker, step: int) -> None:
        answer = self._ask(worker, step, True)
        if self.server is not None:
            # every live active worker is waiting for this one in the global sync, so each has filled every
            # slot it claimed: serve the filled ones, give up on the holes a dead one left, fold in, average
            issued = self.server.door.issued()
            if not self.server.settle(issued, worker.timeout):
                self.server.check()
                raise TimeoutError(
                    f"adpsgd: stage {worker.stage} pipeline {worker.pipeline} served "
                    f"{self.server.served} of {issued} exchanges within {worker.timeout:.0f}s"
                )
            self._apply_pending()
        self._global_sync(worker, step, answer)

    def _leave_pairs(self) -> None:
        if self.active and self.pg is not None and not self.left:
            self.left = True
            self.store.set(Keys.gossip_left(self.worker.stage, self.worker.pipeline), "1")

    def leave(self, worker) -> None:
        self._leave_pairs()
        super().leave(worker)

    def close(self, failed: bool = False) -> None:
        try:
            self._close_server(failed)
        finally:
            self.pg = None  # its connections close: a peer waiting in an exchange with this worker fails now
            super().close(failed)

    def _close_server(self, failed: bool) -> None:
        try:
            self._leave_pairs()
        except Exception:
            pass
        if self.server is not None:
            if self.held:  # a step ended by an error between after_backward and after_step
                # (not lock.locked(): the server thread may hold the lock right now, serving a request)
                self.held = False
                self.lock.release()
            if failed:
                self.server.finish(0.0)
            else:
                # serve until every active worker of the stage has left (or its pipeline was lost) and every
                # request is answered (a lost one's hole given up on)
                stage = self.worker.stage

                def done():
                    if not all(
                        self.store.check([Keys.gossip_left(stage, p)]) or pipeline_lost(self.store, p)
                        for p in self.actives
                    ):
                        return False
                    return self.server.settle(self.server.door.issued(), 0.0)

                self.server.finish(self.worker.timeout, done)
                self.server.check()
            self.server = None


class _PsServer:
    """The parameter server of a stage (``ps``), hosted in a thread of the stage's pipeline-0 worker.

    It keeps the global weights ``w`` and, per client (pipeline), its clock (pushes since the last global
    sync).  A request in its mailbox is ``"kind,client,step"`` (``kind``: ``step`` or ``global``) or
    ``"leave,client"``; a push's delta comes over the stage's process group (the host's own in memory, see
    :meth:`exchange_local`).  After each request, :func:`sdpipe.sync_rules.ps_release` decides which
    waiting pulls are answered.  Owned by that worker's :class:`ParameterServer`.
    """

    def __init__(self, worker, pg, mailbox: "_Mailbox", w, staleness: int):
        D = worker.pipelines
        self.worker, self.pg, self.mailbox, self.staleness = worker, pg, mailbox, staleness
        self.w = w
        self.clock = {c: 0 for c in range(D)}
        self.live = set(range(D))
        self.at_global: set = set()
        self.waiting: dict = {}  # client -> kind of its pending pull
        self.local_reply = None
        self.local_event = threading.Event()
        self.local_delta = None
        self.thread = _Server(
            f"ps-server-{worker.stage}",
            _Mailbox(worker.server_store(), mailbox.prefix),
            self._serve,
            idle=self._idle,
            door=mailbox,
        )
        self.thread.start()

    def _serve(self, text: str) -> None:
        kind, client = text.split(",")[:2]
        client = int(client)
        if kind == "leave":
            self.live.discard(client)
            self.waiting.pop(client, None)
            self.at_global.discard(client)
        else:
            if client == 0:
                delta = self.local_delta
            else:
                delta = torch.empty_like(self.w)
                self.pg.recv([delta], client, TAG_SERVE).wait()
            self.w.add_(delta)
            if kind == rules.GLOBAL:
                self.at_global.add(client)
            else:
                self.clock[client] += 1
            self.waiting[client] = kind
        self._release()

    def _idle(self) -> None:
        """While the run is paused, pulls held by the staleness bound are answered: paused workers do not catch up."""
        if rules.held_step_pulls(self.waiting) and self.worker.read_ctl().pause:
            for c in rules.held_step_pulls(self.waiting):
                del self.waiting[c]
                self._reply(c)

    def _reply(self, client: int) -> None:
        if client == 0:
            self.local_reply = self.w.clone()
            self.local_event.set()
        else:
            self.pg.send([self.w], client, TAG_SERVE).wait()

    def _release(self) -> None:
        release = rules.ps_release(self.clock, self.live, self.at_global, self.waiting, self.staleness)
        for c in release.replies:
            self.waiting.pop(c, None)
            self._reply(c)
        if release.global_sync:
            # everyone still training pulled the same weights: clocks restart
            self.at_global.clear()
        self.clock = release.clock

    def exchange_local(self, delta, request: str, timeout: float):
        """The host worker's own push and pull: the delta in memory, the request in the mailbox (in order
        with the others' requests); the global weights once the server answers."""
        self.thread.check()
        self.local_event.clear()
        self.local_delta = delta
        self.mailbox.put(request)
        if not self.local_event.wait(timeout):
            self.thread.check()
            raise TimeoutError(f"ps: stage {self.worker.stage} got no reply from its server within {timeout} s")
        return self.local_reply

    def finish(self, failed: bool, timeout: float) -> None:
        """Stop serving: at once after a failure, else once every client has left (at most ``timeout`` s)."""
        if failed:
            self.thread.finish(0.0)
        else:
            self.thread.finish(timeout, lambda: not self.live)
            self.thread.check()


class ParameterServer(SyncPolicy):
    """``ps``: one parameter server per stage with a staleness bound (HetPipe-like), the client side.

    The server (:class:`_PsServer`, a thread in the stage's pipeline-0 worker, owned by that worker's
    client) keeps the global weights ``w``.  Worker ``c`` sends ``x_c - x_c^pulled`` after each step;
    the server adds it to ``w`` and answers with ``w`` once ``c`` is at most
    ``staleness`` steps ahead of the slowest live worker of the stage that
    still trains this epoch.  At the epoch end every worker pushes and they
    all pull the same ``w`` (the global sync); step counts restart.
    """

    @property
    def tensors(self) -> list:
        """The stage's state, looked up at each use (see :attr:`GossipPairs.tensors`)."""
        return _state_tensors(self.worker)

    def setup(self, worker) -> None:
        D, stage = worker.pipelines, worker.stage
        self.worker = worker
        self.device = worker.link_device
        self.pulled = flatten(self.tensors, self.device).clone()
        self.staleness = int(worker.cfg["scheduler"]["staleness"])
        self.pg = worker.group(f"ps-stage{stage}", worker.pipeline, D) if D > 1 else None
        self.mailbox = _Mailbox(worker.store, Keys.ps_mailbox(stage))
        self.host = worker.pipeline == 0
        self.left = False
        self.server = None
        if self.pg is not None and self.host:
            self.server = _PsServer(worker, self.pg, self.mailbox, self.pulled.clone(), self.staleness)

    def _exchange(self, worker, step: int, kind: str) -> None:
        if self.pg is None:
            return
        start = time.time()
        worker.delay_link()
        delta = flatten(self.tensors, self.device).sub_(self.pulled)
        if self.host:
            w = self.server.exchange_local(delta, f"{kind},0,{step}", worker.timeout)
        else:
            self.mailbox.put(f"{kind},{worker.pipeline},{step}")
            self.pg.send([delta], 0, TAG_SERVE).wait()
            w = torch.empty_like(delta)
            self.pg.recv([w], 0, TAG_SERVE).wait()
        unflatten_(self.tensors, w.to(self.tensors[0].device))
        self.pulled = w
        members = list(range(worker.pipelines)) if kind == rules.GLOBAL else [worker.pipeline]
        worker.span(
            "sync",
            step,
            None,
            start,
            time.time(),
            group=members,
            reason=kind if kind == rules.GLOBAL else rules.SERVED,
            server=0,
        )

    def after_step(self, worker, step: int) -> None:
        self._exchange(worker, step, rules.STEP)

    def epoch_end(self, worker, step: int) -> None:
        self._exchange(worker, step, rules.GLOBAL)

    def leave(self, worker) -> None:
        if self.pg is not None and not self.left:
            self.left = True
            self.mailbox.put(f"leave,{worker.pipeline}")

    def close(self, failed: bool = False) -> None:
        try:
            self.leave(self.worker)
        except Exception:
            pass
        try:
            if self.server is not None:
                self.server.finish(failed, self.worker.timeout)
                self.server = None
        finally:
            self.pg = None


def make_policy(mode: str) -> SyncPolicy:
    """The worker-side policy object of ``mode`` (a policy's mode or name, :func:`sdpipe.policies.of_mode`), before
    its setup: the class its record names (:attr:`sdpipe.policies.PolicyRecord.worker`)."""
    rec = of_mode(mode)
    module, _, cls = rec.worker.partition(":")
    policy = getattr(importlib.import_module(module), cls)()
    policy.record = rec
    return policy
