"""What every synchronization policy is: the interface between the worker loop and a policy (:class:`SyncPolicy`),
and the helpers the policies share."""

from __future__ import annotations

import abc

from sdpipe.core.policies import PolicyRecord

__all__ = ["STOP_GRACE", "TAG_SERVE", "SyncPolicy", "failure", "state_tensors"]

TAG_SERVE = 7  # point-to-point traffic of the gossip and parameter-server exchanges
#: seconds after stage 0 first read the driver's stop before a group policy takes it without its group's word
STOP_GRACE = 5.0


class SyncPolicy(abc.ABC):
    """How the replicas of a stage meet: the whole interface between the worker loop and a policy.

    **What the worker loop may use** (nothing else): the attributes :attr:`name`, :attr:`coupled`,
    :attr:`record` and :attr:`mass`, and the methods :meth:`setup`, :meth:`decide_stop`, :meth:`next_batch`,
    :meth:`after_backward`, :meth:`after_step`, :meth:`settle`, :meth:`epoch_end`, :meth:`pending_cut`,
    :meth:`stopping`, :meth:`leave`, :meth:`close`; plus :func:`make_policy` and
    :func:`state_tensors` of this module.

    **What a policy may use of the worker** (nothing else):

    * ``worker.span(kind, step, microbatch, start, end, **fields)``: record an event (``time.time()`` values);
    * ``worker.ask_group(step, global_sync=..., waiting=True)``: the group service's answer, a
      :class:`sdpipe.wire.protocol.GroupAnswer` (``round``, ``members``, ``reason``, ``name``, ``policy``,
      ``version``, ``weighting``, ``overlap``, ``stop``); ``waiting=False``: asked from a background thread, so
      no ``wait`` span is recorded;
    * ``worker.leave_service()``; ``worker.read_ctl()``: the driver's :class:`sdpipe.wire.protocol.Command`;
    * ``worker.group(name, rank, size, connect_timeout=None, pipelines=None)``, ``worker.drop_group(g)``;
    * ``worker.delay_link()``: the emulated link's delay before a transfer; ``worker.dispense(epoch)``;
    * attributes ``store``, ``timeout``, ``stage``, ``pipeline``, ``pipelines``, ``module``,
      ``link_device``, ``rng``, ``cfg`` (the ``TrainConfig`` as a dict), ``steps_per_epoch``, ``cut_version`` (the
      re-cut its stage is cut by).

    Every policy says what its replicas do after a step and at an epoch's end (:meth:`after_step`,
    :meth:`epoch_end`, abstract), even when the answer is "nothing".
    """

    #: what this policy is (:class:`sdpipe.core.policies.PolicyRecord`; set by :func:`make_policy`)
    record: PolicyRecord
    #: the replica's mass (1 + its optimizer steps since the last global sync) under the policies that weigh
    #: replicas by it; a joiner takes its donor's. Policies without masses leave it at 1.
    mass = 1.0

    @property
    def name(self) -> str:
        """The mode this policy implements (:attr:`sdpipe.core.policies.PolicyRecord.mode`)."""
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

    def pending_cut(self, worker, published: int) -> int:
        """Stage 0 at a step boundary (or held in a pause): the re-cut its pipeline takes now, given the newest the
        driver ``published`` (its own cut version: none).  By default the published one, at once: a policy whose
        replicas never average, or that takes it only in a pause, where its replicas hold at one step (a coupled
        one: the driver pauses such a run for its re-cut)."""
        return published

    def stopping(self, worker, step: int) -> None:  # noqa: B027 (an optional hook: by default it does nothing)
        """The run stops at this step boundary (before :meth:`leave`)."""

    def leave(self, worker) -> None:  # noqa: B027 (an optional hook: by default it does nothing)
        """The worker stops for good (stop or failure)."""

    def close(self, failed: bool = False) -> None:  # noqa: B027 (an optional hook: by default it does nothing)
        """Release groups; called once, also after an error (``failed``)."""


def state_tensors(worker) -> list:
    """What replicas of a stage keep in step: parameters and floating buffers."""
    return [p.data for p in worker.module.parameters()] + [b for b in worker.module.buffers() if b.is_floating_point()]


def failure(e: BaseException) -> str:
    """An exchange's failure as an event field."""
    return f"{type(e).__name__}: {str(e)[:200]}"
