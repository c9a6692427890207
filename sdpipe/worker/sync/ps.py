"""``ps``: a parameter server per stage, in a thread of pipeline 0's worker, with a staleness bound."""

from __future__ import annotations

import threading
import time

import torch

from sdpipe.core import sync_rules as rules
from sdpipe.wire.protocol import Keys, ServerRequest
from sdpipe.worker.comm import flatten, unflatten_
from sdpipe.worker.sync.base import TAG_SERVE, SyncPolicy, state_tensors
from sdpipe.worker.sync.mailbox import Mailbox, MailboxServer

__all__ = ["ParameterServer", "PsServer"]


class PsServer:
    """The parameter server of a stage (``ps``), hosted in a thread of the stage's pipeline-0 worker.

    It keeps the global weights ``w`` and, per client (pipeline), its clock (pushes since the last global
    sync).  A request in its mailbox is ``"kind,client,step"`` (``kind``: ``step`` or ``global``) or
    ``"leave,client"``; a push's delta comes over the stage's process group (the host's own in memory, see
    :meth:`exchange_local`).  After each request, :func:`sdpipe.core.sync_rules.ps_release` decides which
    waiting pulls are answered.  Owned by that worker's :class:`ParameterServer`.
    """

    def __init__(self, worker, pg, mailbox: "Mailbox", w, staleness: int):
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
        self.thread = MailboxServer(
            f"ps-server-{worker.stage}",
            Mailbox(worker.server_store(), mailbox.prefix),
            self._serve,
            idle=self._idle,
            door=mailbox,
        )
        self.thread.start()

    def _serve(self, text: str) -> None:
        request = ServerRequest.decode(text)
        kind, client = request.kind, request.client
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

    The server (:class:`PsServer`, a thread in the stage's pipeline-0 worker, owned by that worker's
    client) keeps the global weights ``w``.  Worker ``c`` sends ``x_c - x_c^pulled`` after each step;
    the server adds it to ``w`` and answers with ``w`` once ``c`` is at most
    ``staleness`` steps ahead of the slowest live worker of the stage that
    still trains this epoch.  At the epoch end every worker pushes and they
    all pull the same ``w`` (the global sync); step counts restart.
    """

    @property
    def tensors(self) -> list:
        """The stage's state, looked up at each use (see :attr:`GossipPairs.tensors`)."""
        return state_tensors(self.worker)

    def setup(self, worker) -> None:
        D, stage = worker.pipelines, worker.stage
        self.worker = worker
        self.device = worker.link_device
        self.pulled = flatten(self.tensors, self.device).clone()
        self.staleness = int(worker.cfg["scheduler"]["staleness"])
        self.pg = worker.group(f"ps-stage{stage}", worker.pipeline, D) if D > 1 else None
        self.mailbox = Mailbox(worker.store, Keys.ps_mailbox(stage))
        self.host = worker.pipeline == 0
        self.left = False
        self.server = None
        if self.pg is not None and self.host:
            self.server = PsServer(worker, self.pg, self.mailbox, self.pulled.clone(), self.staleness)

    def _exchange(self, worker, step: int, kind: str) -> None:
        if self.pg is None:
            return
        start = time.time()
        worker.delay_link()
        delta = flatten(self.tensors, self.device).sub_(self.pulled)
        if self.host:
            w = self.server.exchange_local(delta, ServerRequest(kind, 0, step).encode(), worker.timeout)
        else:
            self.mailbox.put(ServerRequest(kind, worker.pipeline, step).encode())
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
            self.mailbox.put(ServerRequest("leave", worker.pipeline).encode())

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
