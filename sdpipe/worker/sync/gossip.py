"""``adpsgd``: asynchronous gossip between an active and a passive replica at a time."""

from __future__ import annotations

import threading
import time

import torch

from sdpipe.core import sync_rules as rules
from sdpipe.wire.protocol import Keys, PairRequest, pipeline_lost
from sdpipe.worker.comm import flatten, unflatten_
from sdpipe.worker.sync.allreduce import stage_group
from sdpipe.worker.sync.base import TAG_SERVE, failure, state_tensors
from sdpipe.worker.sync.groups import GroupPolicy
from sdpipe.worker.sync.mailbox import Mailbox, MailboxServer

__all__ = ["GossipPairs"]


class GossipPairs(GroupPolicy):
    """``adpsgd``: random pairs, no central view (AD-PSGD, Lian et al. 2018).

    Pipeline ``p`` is active when ``p`` is even (:func:`sdpipe.core.sync_rules.gossip_roles`).  An active worker,
    after its optimizer step, picks a passive worker of its stage at random
    (:func:`sdpipe.core.sync_rules.choose_peer`) and the two set their weights to the pair's mean: the active one
    in its main thread, the passive one by adding ``(x_active - x_passive) / 2`` at its next step
    boundary (so autograd never sees weights change under it and the sum over
    the replicas is conserved).  The epoch ends with a global sync through the group service
    (:class:`GroupPolicy`), the only time it asks the service: the stop is the driver's flag.
    """

    @property
    def tensors(self) -> list:
        """The stage's state, looked up at each use: an asynchronous schedule moves the live weights to new
        storage at an update (:class:`sdpipe.worker.stage.AsyncStream`), so a list kept from set-up would go stale."""
        return state_tensors(self.worker)

    def setup(self, worker) -> None:
        super().setup(worker)
        D, stage = worker.pipelines, worker.stage
        self.worker = worker
        self.device = worker.link_device
        self.active = worker.pipeline % 2 == 0
        self.store = worker.store
        # the stage's workers of the pipelines not lost (a loss while the run starts leaves the others pairing);
        # ranks in the group by pipeline
        self.pg, self.rank = stage_group(worker, f"adpsgd-stage{stage}") if D > 1 else (None, {})
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
            self.server = MailboxServer(
                f"adpsgd-server-{stage}-{worker.pipeline}",
                Mailbox(worker.server_store(), prefix),
                self._serve,
                door=Mailbox(self.store, prefix),
            )
            self.server.start()

    def _serve(self, text: str) -> None:
        active = PairRequest.decode(text).active
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
            failed = failure(e)
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
        Mailbox(self.store, Keys.gossip_mailbox(worker.stage, peer)).put(PairRequest(worker.pipeline, step).encode())
        mine = flatten(self.tensors, self.device)
        theirs = torch.empty_like(mine)
        pair = sorted((worker.pipeline, peer))
        try:
            work = self.pg.send([mine], self.rank[peer], TAG_SERVE)
            self.pg.recv([theirs], self.rank[peer], TAG_SERVE).wait()
            work.wait()
        except RuntimeError as e:  # the passive worker died mid-exchange: keep our weights, drop the peer
            self.passives.remove(peer)
            worker.span("sync", step, None, start, time.time(), group=pair, reason=rules.PAIR, failed=failure(e))
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
