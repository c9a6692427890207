"""What a worker does at a step boundary: read the driver's command, agree with its pipeline, take a batch.

Every pipeline's stage 0 decides what the pipeline does next and sends it down as a
:class:`~sdpipe.wire.protocol.ControlMessage`; the other stages receive it, pass it on and do the same.  A worked
case, 3 stages, stage 0 at a boundary::

    stage 0: reads Command(stop=False, hetero=2, ...) -> batch 17 from the shared counter
             sends ControlMessage(RUN, epoch=1, step=40, batch=17, hetero=2, policy=0) to stage 1
    stage 1: receives it, sends it on to stage 2, takes heterogeneity version 2, trains batch 17
    stage 2: receives it, takes heterogeneity version 2, trains batch 17

:class:`PipelineControl` carries the messages (and holds the pipeline while the run is paused);
:class:`Dispenser` hands out each epoch's batches from the counter all pipelines share, so work follows speed.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Optional

import torch

from sdpipe.config import Heterogeneity
from sdpipe.data import TAIL_BATCHES_PER_PIPELINE, leaves_tail, smoothed_step_time
from sdpipe.wire.protocol import (
    Command,
    ControlMessage,
    Keys,
    MembershipChange,
    Op,
    PolicyChange,
    pipeline_ids,
    pipeline_lost,
)
from sdpipe.worker.comm import TAG_ACT, TAG_CTRL
from sdpipe.worker.handover import donate

__all__ = ["CTL_INTERVAL", "CTL_MAX_AGE", "CommandWatcher", "Dispenser", "PipelineControl", "membership"]

CTL_INTERVAL = 0.1  # seconds: how often a pipeline's stage 0 looks for the driver's commands
CTL_MAX_AGE = 2.5 * CTL_INTERVAL  # the oldest reading a step acts on


class CommandWatcher(threading.Thread):
    """Stage 0: reads the driver's command key every ``CTL_INTERVAL`` in the background.

    It has its own connection to the run's store, so a step never waits for
    a store round trip (or for this thread) to learn that nothing changed.
    """

    def __init__(self, store):
        super().__init__(name="sdpipe-ctl", daemon=True)
        self._store = store
        self._halt = threading.Event()
        self.latest = None  # (monotonic time, raw value) of the last reading

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                self.latest = (time.monotonic(), self._store.get(Keys.CTL))
            except Exception:  # the store is gone (the run ended): steps read it themselves, and fail at once
                self.latest = None
                return
            self._halt.wait(CTL_INTERVAL)

    def close(self) -> None:
        self._halt.set()
        self.join(timeout=10)


class PipelineControl:
    """One worker's side of the control messages: the driver's command (stage 0) and the pipeline's message."""

    def __init__(self, worker, watcher_store=None):
        self.worker = worker
        self._cache = None  # (monotonic time, raw value) of the last read
        self._send: list = []  # (work, tensor) of the control message in flight to the next stage
        #: a RUN's control integers still to send on: they ride on this step's first message to the next stage
        self.outgoing: tuple = ()
        #: the first micro-batch's input, received with the step's control message (see :meth:`exchange`)
        self.carried = None
        self.seen = worker.members_version  # stage 0: the last membership change looked at
        self._switch_epoch = (0, 0)  # stage 0: (policy version, the epoch every pipeline takes it from)
        self.watcher = None
        if watcher_store is not None:
            self.watcher = CommandWatcher(watcher_store)
            self.watcher.start()

    @property
    def carries(self) -> bool:
        """Whether a step's control message rides on its first micro-batch's message to the next stage: on a link
        that packs structures (gloo) under a flushing schedule, where the first message a stage sends in a step is
        its first micro-batch's output and the next stage's first receive takes it (an asynchronous schedule's
        stage may wait for a gradient before it sends anything in a step: its control message goes on its own)."""
        w = self.worker
        return w.link is not None and w.link.packed and w.stream is None

    def exchange(self, msg: Optional[ControlMessage]) -> ControlMessage:
        """Stage 0 sends ``msg`` down the pipeline; the others receive (``msg`` None) and pass it on.

        A RUN goes on with the step's first micro-batch where :attr:`carries` (its receiver gets that input with it,
        as :attr:`carried`, for the step's first receive); any other message, or any message elsewhere, at once.
        """
        w = self.worker
        if w.link is None:
            return msg
        start = time.time()
        carry = self.carries
        if w.first:
            ints = msg.encode()
        else:
            with w.pace.waiting():  # the previous stage's step and its slowdown: not this worker's own
                if carry:
                    ints, self.carried = w.link.recv_message(w.layout_in, w.stage - 1, TAG_ACT)
                else:
                    ints = w.link.recv((ControlMessage.SIZE,), torch.int64, w.stage - 1, TAG_CTRL).tolist()
        got = ControlMessage.decode(list(ints))
        if not w.last:
            if carry and got.op is Op.RUN:
                self.outgoing = tuple(ints)
            else:
                # not waited for here: a gloo send completes only once the next stage posted its receive,
                # i.e. once it finished its previous step; this stage starts its step meanwhile
                self.wait_sent()
                if carry:
                    self._send = w.link.isend_tree(None, w.stage + 1, TAG_ACT, control=tuple(ints))
                else:
                    self._send = [w.link.isend(torch.tensor(ints, dtype=torch.int64), w.stage + 1, TAG_CTRL)]
        if not w.first and got.op is not Op.PAUSE:
            w.span("wait", got.step, None, start, time.time())
        return got

    def take_outgoing(self) -> tuple:
        """The control integers to send with this step's first message to the next stage (then none)."""
        out, self.outgoing = self.outgoing, ()
        return out

    def take_carried(self):
        """The input that came with this step's control message, for the step's first receive (then None)."""
        x, self.carried = self.carried, None
        return x

    def wait_sent(self) -> None:
        """Wait for the last control message this stage sent down the pipeline to be received."""
        sends, self._send = self._send, []
        for work, _ in sends:
            work.wait()

    def read(self, max_age: float = 0.0) -> Command:
        """The driver's :class:`~sdpipe.wire.protocol.Command` as last written.

        ``max_age``: a reading at most this many seconds old is answered
        without asking the store (a round trip costs a millisecond or more on
        a busy machine); stage 0's :class:`CommandWatcher` keeps one fresh in the
        background, so steps never wait for it and the driver's commands act
        within about ``CTL_INTERVAL``.
        """
        now = time.monotonic()
        latest = self.watcher.latest if self.watcher else None
        readings = [r for r in (self._cache, latest) if r is not None]
        if not readings or now - max(r[0] for r in readings) > max_age:
            self._cache = (now, self.worker.store.get(Keys.CTL))
            readings.append(self._cache)
        # two connections' readings may arrive out of order: the driver numbers its writes
        return max((Command.decode(r[1]) for r in readings), key=lambda c: c.seq)

    def hold(self, step: int, hv: int, pv: int) -> tuple:
        """Stage 0: hold the pipeline at this step boundary while the run is paused.

        A heartbeat control message goes down the pipeline a few times a
        second, so the other stages' waits never run into their timeout.
        Returns (stop, heterogeneity version, policy version, cut version) once resumed, or at once when the
        driver published a re-cut the policy takes in a pause (:meth:`SyncPolicy.pending_cut`; the pipeline holds
        again after it).
        """
        start = time.time()
        while True:
            self.exchange(ControlMessage(Op.PAUSE, 0, step, -1, hv, pv))
            time.sleep(0.2)
            cmd = self.read()
            w = self.worker
            if cmd.stop or not cmd.pause or w.policy.pending_cut(w, cmd.cut) > w.cut_version:
                self.worker.span("pause", step, None, start, time.time())
                return cmd.stop, cmd.hetero, cmd.policy, cmd.cut

    def changes(self, version: int) -> bool:
        """Stage 0 at a step boundary: look at the membership changes up to ``version`` not seen yet.

        Returns whether the driver asked this pipeline to leave.  Unless it leaves, it claims each join it sees
        (compare-and-set: the first pipeline to claim a join donates); the claim is acted on by
        :meth:`take_members`, on every stage of the pipeline.
        """
        w = self.worker
        records = [membership(w.store, v) for v in range(self.seen + 1, version + 1)]
        leave = any(r.kind == "leave" and r.pipeline == w.pipeline for r in records)
        if not leave:
            for r in records:
                if r.kind == "join":
                    w.store.compare_set(Keys.join(r.pipeline, r.generation, "donor"), "", str(w.pipeline))
        self.seen = max(self.seen, version)
        return leave

    def take_members(self, step: int, epoch: int, j, members: int) -> None:
        """Take up the membership changes up to ``members``: give this stage's state to a joiner this pipeline
        claimed; a coupled policy changes its members at this step (``j``: the step of the epoch about to run,
        None at the epoch's end) and forms its group anew once the state is given (the joiner forms it too)."""
        w = self.worker
        if members <= w.members_version:
            return
        coupled = w.policy.coupled
        for v in range(w.members_version + 1, members + 1):
            rec = membership(w.store, v)
            if rec.kind == "join":
                key = Keys.join(rec.pipeline, rec.generation, "donor")
                if w.store.check([key]) and w.store.get(key).decode() == str(w.pipeline):
                    after = w.policy.changed(w, rec, epoch, j) if coupled else None
                    donate(w, rec.pipeline, rec.generation, v, epoch, step, after)
            if coupled:
                w.policy.change(w, rec, epoch, j)
        w.members_version = members
        if coupled:
            w.policy.connect(w, members)

    def switch_version(self, epoch: int, at_end: bool, pv: int) -> int:
        """Stage 0, at a boundary of ``epoch`` (``at_end``: its end): the policy version to send down.

        Out of a policy whose epochs end without a global sync (``none``), the pipelines may be in different
        epochs; one that took a switch to a policy with global syncs an epoch before another would wait at a
        global sync the other ends a different epoch with, and the last pipeline would wait for one nobody
        joins.  So such a switch is taken from one epoch ``E`` on by every pipeline: at its first boundary in
        ``E`` (or at ``E``'s end), so that the first global sync ends ``E`` for all of them.

        ``E`` is set once (compare-and-set) by the first pipeline to look: the latest epoch any pipeline has
        entered.  A pipeline raises its entered epoch at each epoch's end before it looks, and looks at every
        epoch's end once the switch exists, so none leaves ``E`` without it: one that left ``E`` before the
        switch existed raised its epoch past ``E`` first, and one that left it later saw the switch and set
        ``E`` itself (or found it set)."""
        w, store = self.worker, self.worker.store
        if w.policy.record.exchange != "nothing":
            return pv
        key = Keys.epochs_entered(w.pipeline)
        if at_end:
            store.add(key, epoch + 1 - store.add(key, 0))
        nxt = w.policy_version + 1
        if pv < nxt and not (at_end and store.check([Keys.policy(nxt)])):
            return pv
        if self._switch_epoch[0] != nxt:
            spot = Keys.switch_epoch(nxt)
            if store.check([spot]):
                chosen = store.get(spot)
            else:
                ids = pipeline_ids(store, w.pipelines)
                entered = max(store.add(Keys.epochs_entered(p), 0) for p in range(ids))
                chosen = store.compare_set(spot, "", str(max(entered, epoch)))
            self._switch_epoch = (nxt, int(chosen))
        if self._switch_epoch[1] > epoch:
            return w.policy_version  # not yet: this pipeline is in an earlier epoch
        return max(pv, nxt)

    def apply(self, step: int, hv: int, pv: int, epoch: int, j, members: int = 0) -> None:
        """Take up new heterogeneity, a new policy or a change of the pipelines present at this step boundary
        (same step on every stage).  A version older than the one taken is no change: the driver numbers its
        changes, and a stale reading must not undo one (a policy switch taken back on one pipeline only would
        leave its replicas in different policies, each waiting for the other)."""
        w = self.worker
        self.take_members(step, epoch, j, members)
        if hv > w.hetero_version:
            w.hetero = Heterogeneity.from_dict(json.loads(w.store.get(Keys.hetero(hv)).decode()))
            w.hetero_version = hv
            w.dispenser.forget()  # its step time was measured under the old heterogeneity
            now = time.time()
            w.span("control", step, None, now, now, what="heterogeneity", version=hv, applied_by="worker")
        if pv > w.policy_version:
            spec = PolicyChange.decode(w.store.get(Keys.policy(pv)))
            w.policy_version = pv
            if spec.mode != w.policy.name:
                if w.policy.coupled and j is not None:
                    # leaving the lock-step shards mid-epoch: the shared counter continues after the
                    # batches every pipeline has taken (this step's included)
                    w.dispenser.base[epoch] = w.policy.taken(w, epoch, j)
                w.switch_policy(spec.mode)
            now = time.time()
            w.span("control", step, None, now, now, what="policy", policy=spec.name, version=pv, applied_by="worker")

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.close()
        self._send, self.carried = [], None


def membership(store, version: int) -> MembershipChange:
    """Membership change ``version`` (the driver's, under :meth:`Keys.members`)."""
    return MembershipChange.decode(store.get(Keys.members(version)))


class Dispenser:
    """Stage 0: the batches of each epoch, from the counter shared by all pipelines.

    Each pipeline publishes its step time (an average over recent steps).
    In the epoch's tail a pipeline leaves the last batches to the others
    when they would finish all of them before it finished one: so the
    epoch, and the global sync that ends it, does not wait for a slow
    pipeline's last step (:func:`sdpipe.data.leaves_tail`).

    A pipeline so slow that the others finish a whole epoch before its one
    step leaves whole epochs: its estimate, measured in an earlier epoch,
    counts for ``MAX_AGE`` epochs, after which it takes a batch again to
    measure itself anew (its speed may have changed); a change of the run's
    heterogeneity drops the estimate at once (:meth:`forget`).  A pipeline
    out of an epoch publishes its estimate for the next one, so whoever
    starts that epoch first already sees the others' speeds.
    """

    MAX_AGE = 2  # epochs an earlier epoch's step time still decides what a pipeline leaves

    def __init__(self, store, pipeline: int, pipelines: int, batches_per_epoch: int):
        self.store, self.pipeline, self.pipelines = store, pipeline, pipelines
        self.batches_per_epoch = batches_per_epoch
        self.base: dict = {}  # epoch -> batches taken before the shared counter started (a switch mid-epoch)
        self._last = None  # (epoch, time) of this pipeline's last batch
        self._step_time = None  # recent seconds per step of this pipeline, all waits included
        self._step_time_epoch = None  # the epoch it was last measured in

    def forget(self) -> None:
        """Drop the step-time estimate (the heterogeneity changed): the next batches measure it anew."""
        self._step_time = self._step_time_epoch = None

    def next(self, epoch: int) -> Optional[int]:
        """The next batch of ``epoch``, or None when it is used up (or left to the others)."""
        now = time.monotonic()
        last = self._last
        if last is not None and last[0] == epoch:
            self._step_time = smoothed_step_time(self._step_time, now - last[1])
            self._step_time_epoch = epoch
        if self._step_time is not None:
            self.store.set(Keys.step_time(epoch, self.pipeline), repr(self._step_time))
        base = self.base.get(epoch, 0)
        taken = self.store.add(Keys.batches_taken(epoch), 0)
        remaining = self.batches_per_epoch - base - taken
        b = None
        in_tail = remaining <= TAIL_BATCHES_PER_PIPELINE * self.pipelines
        if remaining > 0 and not (in_tail and self._leave_tail(epoch, remaining)):
            b = base + self.store.add(Keys.batches_taken(epoch), 1) - 1
        if b is None or b >= self.batches_per_epoch:
            self.store.set(Keys.step_time(epoch, self.pipeline), "inf")  # out of this epoch
            if self._step_time is not None:  # ready for whoever starts the next epoch first
                self.store.set(Keys.step_time(epoch + 1, self.pipeline), repr(self._step_time))
            self._last = None
            return None
        self._last = (epoch, now)
        return b

    def _leave_tail(self, epoch: int, remaining: int) -> bool:
        """The tail rule against the step times the other pipelines still in ``epoch`` published."""
        if self._step_time_epoch is None or epoch - self._step_time_epoch > self.MAX_AGE:
            # never measured, or too long ago: a pipeline that fell behind would otherwise keep a
            # stale estimate, leave every epoch and never measure itself again
            return False
        ids = pipeline_ids(self.store, self.pipelines)
        keys = [
            Keys.step_time(epoch, p) for p in range(ids) if p != self.pipeline and not pipeline_lost(self.store, p)
        ]  # a lost pipeline takes nothing
        keys = [k for k in keys if self.store.check([k])]
        times = [float(v) for v in self.store.multi_get(keys)] if keys else []
        return leaves_tail(self._step_time, times, remaining)
