"""What the driver, the group service and the workers say to each other, each message encoded in one place.

A run's processes talk over three channels::

    driver ──(Dask task args)──────────────► worker      WorkerSpec: everything a worker needs to start
    driver ──(rendezvous store: "ctl")─────► stage 0     Command: stop, pause; heterogeneity, policy, members
    stage 0 ──(pipeline link, 7 x int64)───► stage 1..   ControlMessage: run a batch, end the epoch, hold, stop, leave
    driver, workers ──(Dask scheduler)─────► service     GroupService routes, through GroupServiceClient
    workers ──(the service's own socket)───► service     ready signals and hurries: frames (encode_frame)

The store is the driver's ``TCPStore`` under the run's prefix (:func:`run_prefix`); every key a run uses is
built by :class:`Keys`, so the keys' layout is written once.  The group service's routes are listed, with
their arguments and answers, in :mod:`sdpipe.service`; :class:`GroupServiceClient` is the only caller, and
every failure of a route reaches its caller as one exception type, :class:`GroupServiceError`.

A worker's ready signal is the one message of every step: through a Dask route it cost the worker about 350 us
of CPU (its event loop relays the call from the training thread) against 17 us over a socket of its own
(``benchmarks/results/step_breakdown.md``).  So on a ``tcp://`` cluster the service also listens on a socket of
its own, on the scheduler's host, and a worker's ``ready`` and ``hurry`` go there as frames: a 4-byte
big-endian length, then a msgpack map (``{"op": "ready", "run_id": ..., ...}`` in, the route's answer or
``{"error": reason}`` out).  The routes stay, and serve a cluster on another transport (``tls://``).

Nothing here imports torch or Dask at import time: the Dask scheduler process imports this module too.
"""

from __future__ import annotations

import enum
import json
import pickle
import threading
from dataclasses import dataclass, field, replace
from typing import Any, Optional

__all__ = [
    "SERVICE_TIMEOUT",
    "Command",
    "ControlMessage",
    "CutChange",
    "GroupAnswer",
    "GroupServiceClient",
    "GroupServiceError",
    "Keys",
    "MembershipChange",
    "Op",
    "PairRequest",
    "PeerLost",
    "PolicyChange",
    "ServerRequest",
    "WorkerResult",
    "WorkerSpec",
    "decode_frame",
    "encode_frame",
    "run_prefix",
]

#: seconds a driver's call to the group service may take
SERVICE_TIMEOUT = 30.0


def encode_frame(message: dict) -> bytes:
    """A message of the service's socket: its msgpack length as 4 big-endian bytes, then the msgpack."""
    import msgpack

    body = msgpack.packb(message)
    return len(body).to_bytes(4, "big") + body


def decode_frame(body: bytes) -> dict:
    import msgpack

    return msgpack.unpackb(body)


# ------------------------------------------------------------------ the worker's start
def metric_name(metric) -> Optional[str]:
    """A metric's name in the epoch records: the string itself, a function's ``__name__`` ("metric" for a
    lambda), or None for none."""
    if metric is None or isinstance(metric, str):
        return metric
    name = getattr(metric, "__name__", "")
    return name if name.isidentifier() else "metric"


@dataclass(frozen=True, kw_only=True)
class WorkerSpec:
    """Everything a worker task needs, built once by the driver (``train``) and sent with every rank's task."""

    run_id: str
    """Ten hex digits naming the run: its store prefix, its event topic, its Dask task keys."""
    config: dict
    """The run's :class:`~sdpipe.config.TrainConfig` as plain data (``TrainConfig.to_dict()``)."""
    backend: str
    """torch.distributed backend of every group: "gloo" or "nccl"."""
    stage_modules: list
    """One ``nn.Module`` per stage, with the initial weights."""
    loss_fn: Any
    """``loss_fn(output, target) -> loss`` at the last stage."""
    layouts: list
    """Per stage: the :class:`~sdpipe.worker.tree.Layout` of its output (nesting, dtypes, dimensions), probed on the
    driver."""
    plan: dict
    """The schedule: stage -> its list of actions (:mod:`sdpipe.core.schedule`)."""
    train_size: int
    eval_size: int
    steps_per_epoch: int
    """Steps each pipeline takes per epoch when all take the same (lock-step shards)."""
    batches_per_epoch: int
    """Batches in one epoch, handed out from the shared counter (work follows speed)."""
    metric: Any
    """What the evaluation reports next to its loss: "accuracy", "perplexity", a function (output, targets) ->
    number, or None."""
    streamed: bool = False
    """The training data is an ``IterableDataset``: stage 0 reads its pipeline's shard and sends each batch's
    targets to the last stage."""
    target_layout: Any = None
    """With ``streamed``: the layout of a batch's targets (what the last stage receives)."""
    t0: float
    """The run's time origin (seconds since the epoch): every event time counts from it."""
    start_epoch: int = 0
    """The first epoch to train (later than 0 when resumed from a checkpoint)."""
    start_steps: dict = field(default_factory=dict)
    """When resumed: pipeline (as a string) -> steps it had taken."""
    store_host: Optional[str] = None
    """Address of the run's rendezvous store (set once it listens)."""
    store_port: Optional[int] = None
    cuts: Optional[tuple] = None
    """Where ``stage_modules`` cut the model's layers (the start layer of stages 1..S-1), when the model is an
    ``nn.Sequential``; None for a list of stage modules (it cannot be re-cut)."""
    cut_version: int = 0
    """The re-cut (:attr:`Command.cut`) ``stage_modules`` and ``layouts`` come from: 0 for the run's first cut; a
    pipeline that joins after a re-cut starts from the current one."""

    @property
    def metric_name(self) -> Optional[str]:
        """The metric's name in the epoch records (a function's ``__name__``), or None."""
        return metric_name(self.metric)

    @property
    def topic(self) -> str:
        """The Dask event topic the run's records go to."""
        return f"sdpipe-{self.run_id}"

    def with_store(self, host: str, port: int) -> "WorkerSpec":
        return replace(self, store_host=host, store_port=port)


def run_prefix(run_id: str) -> str:
    """The prefix of every key of run ``run_id`` in the rendezvous store."""
    return f"sdpipe/{run_id}/"


# ------------------------------------------------------------------ the driver's command
@dataclass(frozen=True)
class Command:
    """What the driver asks of the run, under the store key :attr:`Keys.CTL`, read by every pipeline's stage 0.

    ``seq`` numbers the driver's writes: a reader holding readings from two connections keeps the newest.
    ``hetero``, ``policy``, ``members`` and ``cut`` are versions whose content is stored under :meth:`Keys.hetero`,
    :meth:`Keys.policy`, :meth:`Keys.members` (one change of the pipelines present per version: a join or
    a leave) and :meth:`Keys.cut` (a re-cut).  Encoded as ``"seq,stop,hetero,policy,pause,members,cut"``.
    """

    seq: int = 0
    stop: bool = False
    hetero: int = 0
    policy: int = 0
    pause: bool = False
    members: int = 0
    cut: int = 0

    def encode(self) -> str:
        return f"{self.seq},{int(self.stop)},{self.hetero},{self.policy},{int(self.pause)},{self.members},{self.cut}"

    @classmethod
    def decode(cls, raw) -> "Command":
        text = raw.decode() if isinstance(raw, (bytes, bytearray)) else str(raw)
        seq, stop, hetero, policy, pause, members, cut = text.split(",")
        return cls(int(seq), stop == "1", int(hetero), int(policy), pause == "1", int(members), int(cut))

    def next(self, **changes) -> "Command":
        """The next write: ``changes`` applied and the sequence number advanced."""
        return replace(self, seq=self.seq + 1, **changes)


# ------------------------------------------------------------------ store payloads
@dataclass(frozen=True)
class PolicyChange:
    """Under :meth:`Keys.policy` (a version): the mode the workers run from that version on and the policy's name
    (the driver writes it, every worker reads it at its next step boundary)."""

    mode: str
    name: str

    def encode(self) -> str:
        return json.dumps({"mode": self.mode, "name": self.name})

    @classmethod
    def decode(cls, raw) -> "PolicyChange":
        d = json.loads(raw.decode() if isinstance(raw, (bytes, bytearray)) else raw)
        return cls(d["mode"], d["name"])


@dataclass(frozen=True)
class CutChange:
    """Under :meth:`Keys.cut` (a version): the cut every pipeline's layers move to, and the layout of each stage's
    output under it (probed on the driver); pickled (layouts are dataclasses)."""

    cuts: tuple
    layouts: list

    def encode(self) -> bytes:
        return pickle.dumps(self)

    @staticmethod
    def decode(raw) -> "CutChange":
        return pickle.loads(bytes(raw))


@dataclass(frozen=True)
class MembershipChange:
    """Under :meth:`Keys.members` (a version): one change of the pipelines present, a join (with the joiner's
    generation) or a leave."""

    kind: str  # "join" | "leave"
    pipeline: int
    generation: int = 0

    def __post_init__(self):
        if self.kind not in ("join", "leave"):
            raise ValueError(f"kind: {self.kind!r} is not 'join' or 'leave'")

    def encode(self) -> str:
        return json.dumps({"kind": self.kind, "pipeline": self.pipeline, "generation": self.generation})

    @classmethod
    def decode(cls, raw) -> "MembershipChange":
        d = json.loads(raw.decode() if isinstance(raw, (bytes, bytearray)) else raw)
        return cls(d["kind"], int(d["pipeline"]), int(d.get("generation", 0)))


@dataclass(frozen=True)
class ServerRequest:
    """A request in a parameter server's mailbox: a worker's push and pull after a step (``kind`` "step") or at an
    epoch's global sync ("global"), or its leaving ("leave"). Encoded ``"kind,client,step"``."""

    kind: str
    client: int
    step: int = -1

    def encode(self) -> str:
        return f"{self.kind},{self.client},{self.step}"

    @classmethod
    def decode(cls, text: str) -> "ServerRequest":
        kind, client, *rest = text.split(",")
        return cls(kind, int(client), int(rest[0]) if rest else -1)


@dataclass(frozen=True)
class PairRequest:
    """A request in a passive gossip worker's mailbox: active pipeline ``active`` asks to average after its
    ``step``. Encoded ``"active,step"``."""

    active: int
    step: int

    def encode(self) -> str:
        return f"{self.active},{self.step}"

    @classmethod
    def decode(cls, text: str) -> "PairRequest":
        active, step = text.split(",")
        return cls(int(active), int(step))


# ------------------------------------------------------------------ a worker's failure
class PeerLost(RuntimeError):
    """A worker's exchange with a peer failed on the wire: the connection closed, reset or timed out (the peer's
    process may have died). Raised by the worker in place of torch's error (its text in the message); the
    driver waits a moment for a loss to show before it counts as the run's error."""


# ------------------------------------------------------------------ a worker's result
@dataclass
class WorkerResult:
    """What a worker's task returns to the driver when it ends without an error."""

    rank: int
    #: its pipeline's generation (a rejoin launches new tasks under a new one)
    generation: int = 0
    #: the stage's weights at the end (on the CPU); None for a joiner that gave its join up
    state: Optional[dict] = None
    #: the steps it took
    steps: int = 0
    #: it stopped because the driver asked (``Run.stop``), not at the run's end
    stopped: bool = False
    #: its pipeline left the run (``Run.remove_pipeline``)
    left: bool = False
    #: False for a joiner whose join the driver gave up before a replica gave it its state
    joined: bool = True
    #: the event records it sent (the driver waits until it has received them all)
    events: int = 0
    #: where its pipeline's layers were cut as it ended (a re-cut asked late may not have been taken); None for
    #: a model given as stage modules
    cuts: Optional[tuple] = None


# ------------------------------------------------------------------ the group service's answer
@dataclass(frozen=True)
class GroupAnswer:
    """The group service's answer to a worker's ready signal: the group it averages with in this round.

    Made by the service (in the Dask scheduler) for every member of a decided group; travels as a dict
    (:meth:`to_wire`, msgpack), read back by the worker's :class:`GroupServiceClient` (:meth:`from_wire`).
    """

    #: the stage's round number
    round: int
    #: the pipelines averaging together, sorted
    members: list
    #: why the group formed: "full", "window", "global", ... (:class:`sdpipe.core.scheduler.Group`)
    reason: str
    #: the group's name: the members' process group is cached by it
    name: str
    #: the policy in force (its name, for the records)
    policy: str = ""
    #: the service's policy version: a live change of the scheduler parameters counts one up
    version: int = 0
    #: how the members weigh each other: "uniform" or "progress" (by mass)
    weighting: str = "uniform"
    #: overlapped averaging is on (from the next step on)
    overlap: bool = False
    #: the run is stopping: the members stop after this round
    stop: bool = False

    def to_wire(self) -> dict:
        return {
            "round": self.round,
            "members": list(self.members),
            "reason": self.reason,
            "name": self.name,
            "policy": self.policy,
            "version": self.version,
            "weighting": self.weighting,
            "overlap": self.overlap,
            "stop": self.stop,
        }

    @classmethod
    def from_wire(cls, message: dict) -> "GroupAnswer":
        fields_ = {k: message[k] for k in cls.__dataclass_fields__ if k in message}
        fields_["members"] = list(fields_.get("members", ()))
        return cls(**fields_)


# ------------------------------------------------------------------ the message down a pipeline
class Op(enum.IntEnum):
    """What a pipeline does at a step boundary (stage 0 decides, the others follow)."""

    STOP = 0
    RUN = 1
    EPOCH_END = 2
    PAUSE = 3  # stage 0 holds the pipeline; sent a few times a second as a heartbeat
    LEAVE = 4  # this pipeline leaves the run (run.remove_pipeline); the others go on
    RECUT = 5  # the pipeline's layers move to the cut of version ``cut`` (run.recut) before its next step


@dataclass(frozen=True)
class ControlMessage:
    """The step's control message, sent by stage 0 down its pipeline as eight int64 values.

    ``[op, epoch, step, batch (-1: none), heterogeneity version, policy version, membership version, cut version]``
    """

    op: Op
    epoch: int = 0
    step: int = 0
    batch: int = -1
    hetero: int = 0
    policy: int = 0
    members: int = 0
    cut: int = 0

    SIZE = 8

    def encode(self) -> list:
        return [int(self.op), self.epoch, self.step, self.batch, self.hetero, self.policy, self.members, self.cut]

    @classmethod
    def decode(cls, values) -> "ControlMessage":
        op, epoch, step, batch, hetero, policy, members, cut = (int(v) for v in values)
        return cls(Op(op), epoch, step, batch, hetero, policy, members, cut)


# ------------------------------------------------------------------ store keys
class Keys:
    """Every key of a run in its rendezvous store (relative to :func:`run_prefix`), and who writes it."""

    #: the driver's :class:`Command`
    CTL = "ctl"
    #: counters the workers add to as they start and as they connect (the driver shows the start-up)
    RANKS_STARTED = "ranks/started"
    RANKS_READY = "ranks/ready"
    #: counter of the pipelines marked lost (one look answers "any?")
    LOST_COUNT = "lost/count"

    @staticmethod
    def hetero(version: int) -> str:
        """The driver: a :class:`~sdpipe.config.Heterogeneity` as JSON, for :attr:`Command.hetero`."""
        return f"hetero/{version}"

    @staticmethod
    def policy(version: int) -> str:
        """The driver: ``{"mode", "name"}`` as JSON, for :attr:`Command.policy`."""
        return f"policy/{version}"

    #: how many pipeline ids the run has handed out (the first ``pipelines``, then one per added pipeline)
    PIPELINE_IDS = "pipelines/ids"

    @staticmethod
    def members(version: int) -> str:
        """The driver: one change of the pipelines present (:class:`MembershipChange`), for
        :attr:`Command.members`."""
        return f"members/{version}"

    @staticmethod
    def join(pipeline: int, generation: int, what: str) -> str:
        """A joining pipeline's keys: ``ready`` (its workers that connected, a counter), ``donor`` (the pipeline
        that gives it its state, set once by compare-and-set), ``state/<stage>`` (that stage's state, set by the
        donor), ``epoch`` (the epoch it joined in), ``loaded`` (its workers that took their state, a counter),
        ``cancel`` (the driver: give up)."""
        return f"join/{pipeline}/g{generation}/{what}"

    @staticmethod
    def lost(pipeline: int) -> str:
        """The driver, when ``pipeline`` was lost (its value says why); deleted when it rejoins."""
        return f"lost/{pipeline}"

    @staticmethod
    def ever_lost(pipeline: int) -> str:
        """The driver, when ``pipeline`` was lost; kept when it rejoins: the stages' first groups never take it
        (its replacement joins them by a membership change)."""
        return f"lost-ever/{pipeline}"

    @staticmethod
    def checkpoint_count(epoch: int) -> str:
        """Workers that wrote their part of the checkpoint after ``epoch`` epochs."""
        return f"ckpt/{epoch}/n"

    @staticmethod
    def checkpoint_part(epoch: int, rank: int) -> str:
        """Rank ``rank``'s part of that checkpoint: ``writing`` and ``done`` (the worker's), or ``closed`` (the
        driver's, for a pipeline not in the checkpoint: it left or was lost; a part it had not begun is not written,
        one it had begun is waited for, then left out)."""
        return f"ckpt/{epoch}/part{rank}"

    @staticmethod
    def checkpoint_steps(epoch: int, rank: int) -> str:
        """Steps rank ``rank`` had taken when it wrote its part of that checkpoint."""
        return f"ckpt/{epoch}/rank{rank}"

    @staticmethod
    def checkpoint_cut(epoch: int, rank: int) -> str:
        """The cut version (:attr:`Command.cut`) rank ``rank``'s part of that checkpoint is cut by."""
        return f"ckpt/{epoch}/cut{rank}"

    @staticmethod
    def cut(version: int) -> str:
        """The driver: a re-cut (:class:`CutChange`, pickled), for :attr:`Command.cut`."""
        return f"cut/{version}"

    @staticmethod
    def cut_done(version: int, rank: int) -> str:
        """Rank ``rank`` took re-cut ``version`` (set once its layers moved)."""
        return f"cut/{version}/done{rank}"

    @staticmethod
    def batches_taken(epoch: int) -> str:
        """The shared batch counter of ``epoch`` (every pipeline's stage 0 adds to it)."""
        return f"epoch{epoch}/taken"

    @staticmethod
    def step_time(epoch: int, pipeline: int) -> str:
        """Seconds per step ``pipeline`` published in ``epoch`` ("inf" once it is out of the epoch)."""
        return f"epoch{epoch}/steptime/{pipeline}"

    @staticmethod
    def epochs_entered(pipeline: int) -> str:
        """Under a policy whose epochs end without a global sync: the epoch ``pipeline``'s stage 0 is in (a
        counter it raises at each epoch's end, before it looks for a policy switch)."""
        return f"entered/{pipeline}"

    @staticmethod
    def switch_epoch(version: int) -> str:
        """The epoch from which every pipeline runs policy switch ``version`` (out of a policy whose epochs end
        without a global sync), set once by compare-and-set (see :meth:`PipelineControl.switch_version`)."""
        return f"policy/{version}/epoch"

    @staticmethod
    def group(name: str) -> str:
        """Prefix of the rendezvous of process group ``name``."""
        return f"group/{name}/"

    @staticmethod
    def arrivals(stage: int, round_: int, group: str) -> str:
        """Members of a new averaging group that arrived at its rendezvous (a counter)."""
        return f"arrive/s{stage}/r{round_}/{group}"

    @staticmethod
    def verdict(stage: int, round_: int, group: str) -> str:
        """ "go" or "skip" for that group, set once by compare-and-set."""
        return f"arrive/s{stage}/r{round_}/{group}/verdict"

    @staticmethod
    def gossip_mailbox(stage: int, pipeline: int) -> str:
        """Prefix of the requests to ``pipeline``'s passive gossip server of ``stage``."""
        return f"adpsgd/{stage}/{pipeline}/"

    @staticmethod
    def gossip_left(stage: int, pipeline: int) -> str:
        """Set when active ``pipeline`` of ``stage`` sends no more gossip requests."""
        return f"adpsgd/{stage}/left/{pipeline}"

    @staticmethod
    def ps_mailbox(stage: int) -> str:
        """Prefix of the requests to ``stage``'s parameter server."""
        return f"ps/{stage}/"

    @staticmethod
    def mailbox_count(prefix: str) -> str:
        """The counter that hands out a mailbox's request slots."""
        return prefix + "n"

    @staticmethod
    def mailbox_slot(prefix: str, slot: int) -> str:
        return f"{prefix}req/{slot}"


# ------------------------------------------------------------------ the group service's handle
class GroupServiceError(RuntimeError):
    """A call to the group service failed: the route refused it, the run is not scheduled, or it timed out."""


class GroupServiceClient:
    """The driver's and the workers' handle on the group service of one run (routes in :mod:`sdpipe.service`).

    From the driver: ``GroupServiceClient(run_id, client=dask_client, token=token)``; from inside a Dask
    worker: ``GroupServiceClient(run_id, worker=get_worker())``.  Each method calls one route and returns
    its answer; every failure raises :class:`GroupServiceError` with a one-line reason: the route's own
    refusal (a control call without the run's token among them), a timeout, or a scheduler that is gone.
    """

    def __init__(
        self, run_id: str, *, client=None, worker=None, token: Optional[str] = None, timeout: float = SERVICE_TIMEOUT
    ):
        if (client is None) == (worker is None):
            raise ValueError("GroupServiceClient: pass one of client (the driver's) or worker (inside a task)")
        self.run_id, self.token, self.timeout = run_id, token, timeout
        self._client, self._worker = client, worker
        self._endpoint = False  # the service's own socket, (host, port); None: none (the routes serve); False: unasked
        self._local = threading.local()  # this thread's connection to it (a connection serves one call at a time)
        self._sockets: list = []  # every thread's, closed by close()
        self._lock = threading.Lock()

    def _call(self, route: str, within: Optional[float] = None, **kwargs):
        timeout = self.timeout if within is None else within
        try:
            if self._client is not None:
                c = self._client
                out = c.sync(getattr(c.scheduler, route), run_id=self.run_id, callback_timeout=timeout, **kwargs)
            else:
                from distributed.utils import sync

                w = self._worker
                out = sync(w.loop, getattr(w.scheduler, route), run_id=self.run_id, callback_timeout=timeout, **kwargs)
            if isinstance(out, dict) and "error" in out:  # the route's refusal, answered (see the service)
                raise GroupServiceError(out["error"])
            return out
        except (GroupServiceError, PermissionError) as e:  # the route's own refusal, one line
            raise GroupServiceError(f"group service: {e}") from None
        except Exception as e:  # the call itself failed: timed out, or the scheduler is gone
            raise GroupServiceError(
                f"group service: {route.removeprefix('sdpipe_')}: {type(e).__name__}: {e}"
            ) from None

    # driver routes
    def open(
        self,
        *,
        stages: int,
        pipelines: int,
        policy: dict,
        policy_name: str,
        topic: str,
        t0: float,
        state: Optional[dict] = None,
    ) -> dict:
        return self._call(
            "sdpipe_open",
            token=self.token,
            stages=stages,
            pipelines=pipelines,
            policy=policy,
            policy_name=policy_name,
            topic=topic,
            t0=t0,
            state=state,
        )

    def set_policy(self, policy: dict, policy_name: str) -> dict:
        return self._call("sdpipe_set_policy", token=self.token, policy=policy, policy_name=policy_name)

    def pause(self, paused: bool) -> dict:
        return self._call("sdpipe_pause", token=self.token, paused=paused)

    def stop(self) -> dict:
        return self._call("sdpipe_stop", token=self.token)

    def lose_pipeline(self, pipeline: int) -> dict:
        """A whole pipeline was lost: take it out of every stage (driver, with the token)."""
        return self._call("sdpipe_leave", stage=None, pipeline=pipeline, token=self.token)

    def close(self) -> dict:
        return self._call("sdpipe_close", token=self.token)

    def state(self, within: Optional[float] = None) -> dict:
        """A plain-data snapshot of the run's scheduler; ``within``: seconds to wait at most (default the client's)."""
        return self._call("sdpipe_state", within=within)

    # worker routes
    def ready(self, *, stage: int, pipeline: int, step: int, global_sync: bool, timeout: float) -> GroupAnswer:
        """This worker is ready; its group once decided (waits up to ``timeout``, the route's own bound)."""
        answer = self._fast(
            "sdpipe_ready",
            within=timeout + 10,
            stage=stage,
            pipeline=pipeline,
            step=step,
            global_sync=global_sync,
            timeout=timeout,
        )
        return GroupAnswer.from_wire(answer)

    def _fast(self, route: str, within: float, **kwargs) -> dict:
        """A worker's call over the service's own socket where it has one (see the module docstring), else the
        route.  Each thread has its connection; a broken one is dropped and the call fails in one line."""
        if self._endpoint is False:
            try:
                self._endpoint = self._call("sdpipe_endpoint", within=10).get("endpoint")
            except GroupServiceError:  # a service without the socket: the routes serve
                self._endpoint = None
        if not self._endpoint:
            return self._call(route, within=within, **kwargs)
        import socket

        sock = getattr(self._local, "sock", None)
        try:
            if sock is None:
                sock = socket.create_connection(tuple(self._endpoint), timeout=10)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._local.sock = sock
                with self._lock:
                    self._sockets.append(sock)
            sock.settimeout(within)
            sock.sendall(encode_frame({"op": route, "run_id": self.run_id, **kwargs}))
            size = int.from_bytes(_read_exactly(sock, 4), "big")
            answer = decode_frame(_read_exactly(sock, size))
        except OSError as e:  # refused, reset, timed out: this connection is done
            self._drop_socket(sock)
            raise GroupServiceError(
                f"group service: {route.removeprefix('sdpipe_')}: {type(e).__name__}: {e or 'no answer'}"
            ) from None
        if "error" in answer:
            raise GroupServiceError(f"group service: {answer['error']}")
        return answer

    def _drop_socket(self, sock) -> None:
        self._local.sock = None
        if sock is None:
            return
        with self._lock:
            if sock in self._sockets:
                self._sockets.remove(sock)
        try:
            sock.close()
        except OSError:
            pass

    def close_sockets(self) -> None:
        """Close every thread's connection to the service's socket (the worker's end of a run)."""
        with self._lock:
            socks, self._sockets = self._sockets, []
        for sock in socks:
            try:
                sock.close()
            except OSError:
                pass

    def leave(self, *, stage: int, pipeline: int) -> dict:
        return self._call("sdpipe_leave", within=10, stage=stage, pipeline=pipeline)

    def hurry(self, *, stage: int, pipeline: int) -> dict:
        """This worker reached its epoch's end: the open round that holds its ready signal closes now."""
        return self._fast("sdpipe_hurry", within=10, stage=stage, pipeline=pipeline)

    def join(self, *, stage: int, pipeline: int, donor: int) -> dict:
        """(The donor's worker of ``stage``) ``pipeline`` takes part in ``stage`` from now on, holding a copy of
        ``donor``'s state: it is in no group before its first ready signal."""
        return self._call("sdpipe_join", within=10, stage=stage, pipeline=pipeline, donor=donor)


def _read_exactly(sock, n: int) -> bytes:
    """``n`` bytes from ``sock`` (its timeout bounds each wait); a closed connection is a ConnectionError."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the service closed the connection")
        buf += chunk
    return bytes(buf)


# ---------------------------------------------------------------------------------------------
# Lost pipelines and closed groups in the run's store (the driver writes them, the workers read them)
# ---------------------------------------------------------------------------------------------

#: keys under a group's prefix: the count of its members who came to its rendezvous, and their verdict
ARRIVED, VERDICT = "sdpipe-arrived", "sdpipe-verdict"


def mark_lost(store, pipeline: int, why: str) -> None:
    """(Driver) mark ``pipeline`` lost in the run's store."""
    store.set(Keys.lost(pipeline), why)
    store.set(Keys.ever_lost(pipeline), why)
    store.add(Keys.LOST_COUNT, 1)


def first_lost(store, pipelines) -> int | None:
    """The first of ``pipelines`` marked lost, or None (one store call while none is lost)."""
    if store.add(Keys.LOST_COUNT, 0) == 0:
        return None
    return next((p for p in pipelines if pipeline_lost(store, p)), None)


def pipeline_ids(store, default: int) -> int:
    """How many pipeline ids the run has handed out (:attr:`Keys.PIPELINE_IDS`; ``default``, the pipelines it
    started with, before the driver wrote it)."""
    return int(store.get(Keys.PIPELINE_IDS)) if store.check([Keys.PIPELINE_IDS]) else default


def pipeline_lost(store, pipeline: int) -> bool:
    """Whether the driver marked ``pipeline`` lost in the run's store."""
    return store.check([Keys.lost(pipeline)])


def close_group(store, name: str) -> bool:
    """(Driver) close group ``name``'s rendezvous: its members' verdict becomes "skip" unless they set one first
    (one compare-and-set); whether it is "skip" now.  The key is the one the members use under their group's
    prefix (a torch ``PrefixStore`` joins its prefix and a key with "/")."""
    return store.compare_set(f"{Keys.group(name)}/{VERDICT}", "", "skip") == b"skip"
