"""The code one worker (one stage of one pipeline) runs inside a Dask task.

``worker_main`` builds the :class:`Worker` (its stage's module, optimizer, links and policy) and runs
:class:`Training`: epochs of steps, each step preceded by the pipeline's agreement on what comes next
(:mod:`sdpipe.worker.boundary`) and followed by the policy's synchronization (:mod:`sdpipe.worker.sync`)::

    for each epoch:
        at each step boundary: stage 0 decides RUN batch b | EPOCH_END | STOP | PAUSE, the pipeline follows
        RUN:       the stage's share of the step (sdpipe.worker.stage.train_step)
                   policy.after_backward (coupled replicas agree on stop/pause/policy here)
                   optimizer step, policy.after_step (averaging with its group, a gossip pair, a server)
        EPOCH_END: policy.settle, policy.epoch_end (the global sync, every sync_every epochs), evaluation, checkpoint
        STOP:      policy.stopping, policy.leave

The loop asks its policy (``coupled``, ``decide_stop``), never its type.
"""

from __future__ import annotations

import os
import random
import time
import traceback
from typing import Optional

import torch

from sdpipe.checkpoint import claim_part, part_written, write_rank
from sdpipe.config import Heterogeneity
from sdpipe.core.schedule import ASYNC_SCHEDULES, default_update_every
from sdpipe.data import ShardReader, batch_indices
from sdpipe.wire import events
from sdpipe.wire.protocol import (
    ControlMessage,
    CutChange,
    GroupAnswer,
    GroupServiceClient,
    GroupServiceError,
    Keys,
    Op,
    WorkerResult,
    WorkerSpec,
    first_lost,
)
from sdpipe.worker.allocator import training_thresholds
from sdpipe.worker.boundary import CTL_MAX_AGE, Dispenser, PipelineControl
from sdpipe.worker.comm import TAG_TARGET, Link, as_peer_lost, make_group
from sdpipe.worker.connect import connect_store, nccl_interface, own_address
from sdpipe.worker.handover import await_state
from sdpipe.worker.pace import Pace
from sdpipe.worker.recut import move_layers
from sdpipe.worker.sink import EventSink
from sdpipe.worker.stage import AsyncStream, evaluate, train_step
from sdpipe.worker.sync import make_policy, state_tensors
from sdpipe.worker.tree import rows, to_device

__all__ = ["Training", "Worker", "worker_main"]


class Worker:
    """State of one worker during a run (what policies see as ``worker``).

    ``join``: this worker's pipeline joins a running run (``{"generation", "mode", "policy"}``: its generation,
    the policy mode and version in force); it takes its state from a live replica (:meth:`await_state`)
    before its first step.
    """

    def __init__(self, spec: WorkerSpec, rank: int, sink: EventSink, join: Optional[dict] = None):
        cfg = spec.config
        self.spec, self.cfg, self.rank, self.sink = spec, cfg, rank, sink
        self.stages, self.pipelines = cfg["stages"], cfg["pipelines"]
        self.pipeline, self.stage = divmod(rank, self.stages)
        self.first, self.last = self.stage == 0, self.stage == self.stages - 1
        self.t0, self.backend, self.timeout, self.run_id = spec.t0, spec.backend, cfg["timeout"], spec.run_id
        #: this worker's own address: its gloo device binds to it (never to the driver's)
        self.host = own_address()
        if self.backend == "nccl" and "NCCL_SOCKET_IFNAME" not in os.environ:
            iface = nccl_interface(self.host)
            if iface:
                os.environ["NCCL_SOCKET_IFNAME"] = f"={iface}"  # exact name: NCCL's bootstrap uses this host's address
        self.device = self._pick_device(cfg["device"])
        self.link_device = self.device if self.backend == "nccl" else torch.device("cpu")
        self.hetero = Heterogeneity.from_dict(cfg["heterogeneity"]) if cfg["heterogeneity"] else Heterogeneity()
        self.rng = random.Random(cfg["seed"] * 100003 + rank)
        #: the emulated slowdown and straggles inside a step (sdpipe.worker.pace): stretches this worker's own work
        self.pace = Pace()
        self._groups: list = []

        self.generation = join["generation"] if join else 0
        #: the last change of the pipelines present this worker took up (a joiner: its own join's, with its state)
        self.members_version = 0
        self.store = connect_store(spec, self.timeout)
        if join is None:
            self.store.add(Keys.RANKS_STARTED, 1)  # the driver shows the start-up: started, then connected (below)
        # rendezvous wait on their own connection, so the wait can be watched on self.store meanwhile; made now,
        # next to the first (made at the first group, it could come after the run was stopped and then try a
        # closed store for the whole connect timeout)
        self._rendezvous_store = connect_store(spec, self.timeout)
        self._server_store = None
        self.service = GroupServiceClient(self.run_id, worker=sink._worker)

        self._build_stage(spec, cfg)
        self.steps_per_epoch = spec.steps_per_epoch
        self.hetero_version = 0
        self.policy_version = 0
        #: where the model's layers are cut now (None: the run was given stage modules) and the re-cut it came from
        self.cuts = tuple(spec.cuts) if spec.cuts is not None else None
        self.cut_version = spec.cut_version
        self.dispenser = Dispenser(self.store, self.pipeline, self.pipelines, spec.batches_per_epoch)
        self.reader = None  # stage 0 on a stream: its pipeline's shard (set with the data, in Training)
        self.ctl = PipelineControl(self, connect_store(spec, self.timeout) if self.first else None)
        self._take_policy(cfg, join)
        self.store.add(Keys.join(self.pipeline, self.generation, "ready") if join else Keys.RANKS_READY, 1)

    # ----------------------------------------------------------- set-up
    def _build_stage(self, spec: WorkerSpec, cfg: dict) -> None:
        """This worker's stage: its module on its device, its optimizer, the layouts and plan of its schedule, and the
        link to its pipeline's neighbours."""
        self.module = spec.stage_modules[self.stage].to(self.device)
        self.module.train()
        self.loss_fn = spec.loss_fn
        self.optimizer = self._make_optimizer(cfg)
        #: the layouts (sdpipe.worker.tree) of what this stage receives and returns; sizes travel with each micro-batch
        self.layout_in = spec.layouts[self.stage - 1] if not self.first else None
        self.layout_out = spec.layouts[self.stage]
        self.plan = spec.plan[self.stage]
        self._new_stream(cfg)
        self.link = None
        if self.stages > 1:
            name = f"pipe{self.pipeline}" + (f".g{self.generation}" if self.generation else "")
            self.link = Link(
                self.group(name, self.stage, self.stages, pipelines=[self.pipeline]),
                self.device,
                self.backend,
            )

    def _new_stream(self, cfg: dict) -> None:
        """An asynchronous schedule's micro-batches in flight across steps (None under a flushing schedule)."""
        self.stream = None
        if cfg["schedule"] in ASYNC_SCHEDULES:
            every = cfg["update_every"] or default_update_every(cfg["schedule"], self.stages, cfg["microbatches"])
            self.stream = AsyncStream(self, every)

    def recut(self, version: int, step: int, epoch: int, j: int) -> None:
        """Take re-cut ``version`` (every stage of the pipeline at this step boundary, the stream drained, an
        averaging in flight landed): the layers move (:func:`sdpipe.worker.recut.move_layers`); recorded as a
        ``control`` event (``epoch``, and ``j``: the batches of the epoch this pipeline trained before it),
        counted in the store."""
        start = time.time()
        self.policy.settle(self, step)
        moved = move_layers(self, CutChange.decode(self.store.get(Keys.cut(version))))
        self.cut_version = version
        self._new_stream(self.cfg)  # its weight versions referred to the old stage's parameters
        self.describe()
        now = time.time()
        self.span(
            "control", step, None, now, now, what="recut", cuts=list(self.cuts), version=version, applied_by="worker",
            epoch=epoch, batches=j, seconds=round(now - start, 4), **moved,
        )  # fmt: skip
        self.store.set(Keys.cut_done(version, self.rank), "1")

    def _take_policy(self, cfg: dict, join: Optional[dict]) -> None:
        """The sync policy in force (a joiner's: the one its join names) set up; the command watcher closed if not."""
        try:
            # a joiner takes the policy in force (a live switch may have changed it since the start)
            self.policy = make_policy(join["mode"] if join else cfg["policy"])
            if join:
                self.policy_version = join["policy"]
            if not (join and self.policy.coupled):  # a coupled joiner forms its group once it holds its state
                self.policy.setup(self)
        except BaseException:
            # (a stage's first group given up: its pipeline was lost while the run started) the command watcher
            # thread would otherwise read the store until the run's store closes, and torch would print its
            # connection warning then
            self.ctl.close()
            raise

    def _make_optimizer(self, cfg: dict, params: Optional[list] = None):
        """The run's optimizer over ``params`` (default: the stage's trainable parameters); None without any."""
        if params is None:
            params = [p for p in self.module.parameters() if p.requires_grad]
        if not params:  # a stage of parameter-free layers (a lone activation) has nothing to update
            return None
        # foreach: torch's multi-tensor path (its default on a GPU, not on the CPU): one call per operation over all
        # the stage's tensors, not a Python loop over them; the same arithmetic
        opt, lr, wd = cfg["optimizer"], cfg["lr"], cfg["weight_decay"]
        if opt == "sgd":
            return torch.optim.SGD(params, lr=lr, momentum=cfg["momentum"], weight_decay=wd, foreach=True)
        if opt == "adam":
            return torch.optim.Adam(params, lr=lr, weight_decay=wd, foreach=True)
        return torch.optim.AdamW(params, lr=lr, weight_decay=wd, foreach=True)

    def _pick_device(self, name: str) -> torch.device:
        if name == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError(f"device: 'cuda' requested but worker rank {self.rank} sees no GPU")
            index = self.rank % torch.cuda.device_count()
            torch.cuda.set_device(index)
            return torch.device("cuda", index)
        return torch.device("cpu")

    def switch_policy(self, mode: str) -> None:
        """A live switch: the old policy releases its groups, the new one sets up (same step on every stage)."""
        self.policy.close()
        self.policy = make_policy(mode)
        self.policy.setup(self)

    # ----------------------------------------------------------- what policies call
    def group(self, name: str, rank: int, size: int, connect_timeout: Optional[float] = None, pipelines=None):
        """A process group of the workers of ``pipelines`` (default: every pipeline); its rendezvous is given up
        on as soon as one of those pipelines is marked lost (a dead member never comes)."""
        watched = list(range(self.pipelines)) if pipelines is None else list(pipelines)

        def lost_member():
            gone = first_lost(self.store, watched)
            return None if gone is None else f"pipeline {gone} was lost"

        g = make_group(
            self._rendezvous_store,
            name,
            rank,
            size,
            backend=self.backend,
            timeout=self.timeout,
            host=self.host,
            connect_timeout=connect_timeout,
            give_up=lost_member,
        )
        self._groups.append(g)
        return g

    def drop_group(self, g) -> None:
        """Forget a broken group. Once the caller drops its last reference too, the group's connections
        close, and members still waiting in it fail then instead of at their timeout (gloo's
        ``abort()`` does not close them: checked)."""
        self._groups = [x for x in self._groups if x is not g]

    def span(self, kind: str, step, microbatch, start: float, end: float, **fields) -> None:
        """Record a span of this worker's work (``start``/``end``: ``time.time()`` values)."""
        self.sink.add(
            events.span(kind, self.pipeline, self.stage, step, microbatch, start - self.t0, end - self.t0, **fields)
        )

    def read_ctl(self, max_age: float = 0.0):
        """The driver's :class:`~sdpipe.wire.protocol.Command` (see :meth:`PipelineControl.read`)."""
        return self.ctl.read(max_age)

    def dispense(self, epoch: int) -> Optional[int]:
        """Stage 0: the next batch of ``epoch`` from the shared counter (see :class:`Dispenser`), or from this
        pipeline's shard of a stream (:class:`~sdpipe.data.ShardReader`); None at the epoch's end."""
        if self.reader is not None:
            return self.reader.next(epoch)
        return self.dispenser.next(epoch)

    def ask_group(self, step: int, global_sync: bool, waiting: bool = True) -> GroupAnswer:
        """Tell the group service this worker is ready; wait (bounded) for its group.  ``waiting=False``: asked
        from a background thread while the step goes on (overlapped averaging), so no ``wait`` span."""
        start = time.time()
        answer = self.service.ready(
            stage=self.stage, pipeline=self.pipeline, step=step, global_sync=global_sync, timeout=self.timeout
        )
        if waiting:
            kw = dict(what="group", group=answer.members, round=answer.round)
            self.span("wait", step, None, start, time.time(), **kw)
        return answer

    def leave_service(self) -> None:
        try:
            self.service.leave(stage=self.stage, pipeline=self.pipeline)
        except GroupServiceError:  # the service or the run is already gone
            pass

    def server_store(self):
        """A connection to the run's store for a server thread's waits (``ps``, ``adpsgd``), made at its first
        use: a connection serves one call at a time, so a thread waiting on ``self.store`` for its next request
        would hold up every call the training thread makes on it meanwhile (up to a wait's 0.2 s each)."""
        if self._server_store is None:
            self._server_store = connect_store(self.spec, self.timeout)
        return self._server_store

    def delay_link(self) -> None:
        d = self.hetero.link_delay_of(self.pipeline, self.stage)
        if d > 0:
            time.sleep(d)

    def slow(self, elapsed: float) -> None:
        """After a forward or backward of ``elapsed`` seconds: the emulated compute slowdown k (sleep ``(k - 1) x
        elapsed``), then a transient straggle this step drew (:class:`~sdpipe.worker.pace.Pace`)."""
        k = self.hetero.compute_slowdown_of(self.pipeline, self.stage)
        if k > 1.0:
            time.sleep((k - 1.0) * elapsed)
        self.pace.computed()

    # ----------------------------------------------------------- state
    def restore(self, state: dict) -> None:
        """Weights, optimizer state and random states from a checkpoint."""
        self.module.load_state_dict(state["model"])
        if self.optimizer is not None and state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        self.rng.setstate(state["rng"])
        torch.set_rng_state(state["torch_rng"])

    def checkpoint(self, epoch: int, step: int) -> None:
        """Write this worker's part of the checkpoint after ``epoch`` epochs, then count it in the store.

        Not if the driver closed the part: the pipeline left (or was lost) before the checkpoint, and the driver
        may have finished it without this part (a leave this pipeline had not seen when its epoch ended)."""
        t = time.time()
        if not claim_part(self.store, epoch, self.rank):
            return
        state = {
            "model": {k: v.detach().cpu().clone() for k, v in self.module.state_dict().items()},
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "optimizer_name": self.cfg["optimizer"],
            "rng": self.rng.getstate(),
            "torch_rng": torch.get_rng_state(),
            "step": step,
            "epoch": epoch,
        }
        write_rank(self.cfg["checkpoint_dir"], epoch, self.run_id, self.rank, state)
        self.store.set(Keys.checkpoint_steps(epoch, self.rank), str(step))
        self.store.set(Keys.checkpoint_cut(epoch, self.rank), str(self.cut_version))
        part_written(self.store, epoch, self.rank)
        self.store.add(Keys.checkpoint_count(epoch), 1)
        self.span("save", step, None, t, time.time(), epoch=epoch)

    def describe(self) -> None:
        """A ``stage`` record: bytes of this stage's synchronized state and of one micro-batch's output."""
        weight_bytes = sum(t.numel() * t.element_size() for t in state_tensors(self))
        mb = self.cfg["batch_size"] // self.cfg["microbatches"]
        activation_bytes = 0 if self.last else mb * self.layout_out.sample_bytes()
        now = time.time() - self.t0
        self.sink.add(
            events.stage_info(
                self.pipeline, self.stage, now, weight_bytes, activation_bytes, self.host, len(os.sched_getaffinity(0))
            )
        )

    def close(self, failed: bool) -> None:
        """Drop every group (their connections close, so peers still waiting in one fail fast instead of timing out)."""
        try:
            self.ctl.close()
            self.policy.close(failed)
        finally:
            self.service.close_sockets()
            if self.link is not None:
                self.link.group = None  # a failed operation's traceback may still hold the Link
            self.link = None
            if failed:
                for g in self._groups:
                    try:
                        g.abort()
                    except Exception:
                        pass
            self._groups.clear()


class NotFinite(FloatingPointError):
    """A stage's gradients or weights hold NaN or infinite values: the run ends before they reach an average."""


def check_finite(named: list, what: str, step: int, loss) -> None:
    """Raise :class:`NotFinite` when a tensor of ``named`` (``(name, tensor)`` pairs) holds a NaN or an infinity
    (one fused norm per tensor, one sync)."""
    if not named:
        return
    norms = torch._foreach_norm([t for _, t in named])
    if bool(torch.stack(norms).isfinite().all()):
        return
    bad = next(name for (name, _), n in zip(named, norms, strict=True) if not bool(n.isfinite()))
    said = "" if loss is None else f", the step's loss {loss:.4g}"
    after = "backward pass" if what == "gradients" else "optimizer step"
    raise NotFinite(
        f"the {what} are not finite (NaN or infinite) after step {step}'s {after} (first: {bad}{said}); they "
        "were kept out of every average: lower the learning rate, or check the data and the loss"
    )


class Training:
    """One worker's epochs: at each step boundary the pipeline agrees what comes next, then it acts on it.

    Every way a run ends for a worker goes through :meth:`run`: its epochs run out, or stage 0 says STOP
    (the driver's stop, read from the store or, under a group policy, from the group service's answers); a
    failure raises out of it (``worker_main`` cleans up).
    """

    def __init__(self, worker: Worker, X, Y, EX, EY, step: int, start_epoch: Optional[int] = None, first_j: int = 0):
        self.w, self.step = worker, step
        self.start_epoch = worker.spec.start_epoch if start_epoch is None else start_epoch
        self.first_j = first_j  # steps of the first epoch already taken (a joiner of a coupled policy)
        self.left = False  # the driver asked this pipeline to leave the run (Op.LEAVE)
        self.X, self.Y, self.EX, self.EY = X, Y, EX, EY
        if worker.spec.streamed and worker.first:
            worker.reader = ShardReader(X, worker.pipeline, worker.pipelines, worker.cfg)
        # what coupled replicas agreed in their last collective: stop, policy version, pause
        self.agreed = (False, 0, False, 0)
        self.stopped = False
        self.batch_rows = 0  # samples of the last batch trained
        self.cpu_mark: Optional[tuple] = None  # (thread, process, machine) CPU seconds at the last update's end

    def run(self) -> dict:
        w, cfg = self.w, self.w.cfg
        for epoch in range(self.start_epoch, cfg["epochs"]):
            try:
                self._epoch(epoch)
            except Exception as e:  # the driver's one line names the step (the attribute travels with the pickle)
                if not hasattr(e, "sdpipe_step"):
                    e.sdpipe_step = (self.step, epoch)
                raise
            if self.stopped:
                break
        w.ctl.wait_sent()
        state = {k: v.detach().cpu().clone() for k, v in w.module.state_dict().items()}
        return WorkerResult(
            rank=w.rank,
            generation=w.generation,
            state=state,
            steps=self.step,
            stopped=self.stopped and not self.left,
            left=self.left,
            cuts=w.cuts,
        )

    def _epoch(self, epoch: int) -> None:
        w, cfg = self.w, self.w.cfg
        started = time.time()
        losses, samples, j = [], 0, self.first_j
        self.first_j = 0
        while True:
            w.pace.begin(w.hetero.stretch_of(w.pipeline, w.stage))
            msg = self._boundary(epoch, j)
            if msg.op is not Op.RUN:
                w.pace.end()
            if msg.op is Op.PAUSE:  # stage 0 holds the pipeline; this is its heartbeat
                continue
            if msg.op is Op.RECUT:  # the layers move before the next step (a drained stream: see below)
                if w.stream is not None and not w.stream.idle:
                    w.stream.drain(lambda: self.step, lambda loss, **kw: self._update(epoch, loss, **kw))
                w.recut(msg.cut, self.step, epoch, j)
                continue
            changes = msg.policy > w.policy_version or msg.members > w.members_version
            if w.stream is not None and not w.stream.idle and (msg.op is not Op.RUN or changes):
                # an asynchronous schedule drains where the run needs consistent weights: the epoch's end (its
                # global sync, evaluation and checkpoint), a stop, a policy change, a state given to a joiner
                w.stream.drain(lambda: self.step, lambda loss, **kw: self._update(epoch, loss, **kw))
            w.ctl.apply(self.step, msg.hetero, msg.policy, epoch, j if msg.op is Op.RUN else None, msg.members)
            if msg.op is Op.LEAVE:  # this pipeline leaves; the others go on (its batches are theirs now)
                self.stopped = self.left = True
                w.policy.settle(w, self.step)
                w.policy.leave(w)
                now = time.time()
                w.span("control", self.step, None, now, now, what="left", applied_by="worker")
                break
            if msg.op is Op.STOP:
                self.stopped = True
                w.policy.stopping(w, self.step)
                w.policy.leave(w)
                break
            if msg.op is Op.EPOCH_END:
                w.policy.settle(w, self.step)  # the evaluation and a checkpoint see complete weights
                if (epoch + 1) % cfg["sync_every"] == 0 or epoch == cfg["epochs"] - 1:
                    w.policy.epoch_end(w, self.step)
                break
            loss = self._train(epoch, msg.batch)
            self._stretch()
            if loss is not None:
                losses.append(loss)
            samples += self.batch_rows
            j += 1
        if samples:
            self._report(epoch, time.time() - started, losses, samples)
        every = cfg["checkpoint_every"]
        if every and (epoch + 1) % every == 0 and not self.stopped:
            w.checkpoint(epoch + 1, self.step)

    def _boundary(self, epoch: int, j: int) -> ControlMessage:
        """Stage 0 decides what the pipeline does next and sends it down; the other stages receive it."""
        w = self.w
        if not w.first:
            return w.ctl.exchange(None)
        # a reading up to CTL_MAX_AGE old (the watcher keeps one)
        cmd = w.read_ctl(CTL_MAX_AGE)
        stop, hv, pv, pause = cmd.stop, cmd.hetero, cmd.policy, cmd.pause
        coupled = w.policy.coupled
        mv = cmd.members
        agreed_stop, agreed_version, agreed_pause, agreed_members = self.agreed
        if coupled:  # coupled replicas act on what they agreed in the last collective
            stop, pv, pause = agreed_stop, agreed_version or w.policy_version, agreed_pause
            mv = max(agreed_members, w.ctl.seen)
        else:  # a group policy takes the stop from its groups' answers (same round, same word)
            stop = w.policy.decide_stop(stop)
        cut = w.policy.pending_cut(w, cmd.cut)
        if not stop and not coupled and cut > w.cut_version:
            return self._recut_now(epoch, cut)
        if pause and not stop:
            with w.pace.waiting():  # a pause is no part of the pipeline's own step: a slowdown never stretches it
                stop, hv, pv, cut = w.ctl.hold(self.step, hv, pv)
            cut = w.policy.pending_cut(w, cut)
            if not stop and cut > w.cut_version:  # taken in the pause, where coupled replicas hold at one step
                return self._recut_now(epoch, cut)
            self.agreed = (agreed_stop, agreed_version, False, agreed_members)
            if coupled:
                stop, pv = stop or agreed_stop, agreed_version or w.policy_version
        leave = False
        if not stop and mv > w.ctl.seen:
            leave = w.ctl.changes(mv)
        if coupled and not stop and not leave:  # the new members deal this step's batches already
            w.ctl.take_members(self.step, epoch, j, w.ctl.seen)
        batch = None if stop or leave else w.policy.next_batch(w, epoch, j)
        op = Op.STOP if stop else Op.LEAVE if leave else (Op.EPOCH_END if batch is None else Op.RUN)
        if op is Op.RUN or op is Op.EPOCH_END:
            pv = w.ctl.switch_version(epoch, op is Op.EPOCH_END, pv)
        mv = w.ctl.seen
        return w.ctl.exchange(ControlMessage(op, epoch, self.step, -1 if batch is None else batch, hv, pv, mv))

    def _recut_now(self, epoch: int, version: int) -> ControlMessage:
        """Stage 0: the pipeline takes re-cut ``version`` at this boundary.

        The stages' replicas must change their cut together, so that no averaging mixes layers of two cuts
        (:meth:`SyncPolicy.pending_cut`): a coupled policy takes it only in a pause (its replicas agreed that step
        in their collective; the driver pauses such a run for its re-cut), a group policy right after a global
        sync (whose members agreed on it), a policy whose replicas never average at once."""
        w = self.w
        msg = ControlMessage(
            Op.RECUT, epoch, self.step, -1, w.hetero_version, w.policy_version, w.members_version, version
        )
        return w.ctl.exchange(msg)

    def _train(self, epoch: int, batch: int) -> Optional[float]:
        """One step on ``batch``: the stage's compute, the policy's sync, the optimizer; the last stage's loss."""
        w, cfg, step = self.w, self.w.cfg, self.step
        h = w.hetero
        if h.straggle_prob > 0 and w.rng.random() < h.straggle_prob:
            w.pace.straggle(h.straggle_delay, lambda a, b: w.span("straggle", step, None, a, b))
        sent = []
        if w.spec.streamed:
            xb, yb, sent = self._stream_batch(epoch)
        else:
            idx = batch_indices(w.spec.train_size, cfg["batch_size"], cfg["seed"], epoch, batch)
            xb = to_device(self.X.take(idx), w.device) if w.first else None
            yb = to_device(self.Y.take(idx), w.device) if w.last else None
            self.batch_rows = len(idx)
        if w.stream is not None:  # its updates come where the schedule puts them
            loss = w.stream.step(lambda: self.step, xb, yb, lambda loss, **kw: self._update(epoch, loss, **kw))
        else:
            loss = train_step(w, step, xb, yb)
        for work, _ in sent:  # a stream's targets, sent to the last stage
            work.wait()
        if w.stream is None:
            self._update(epoch, loss)
        return loss

    def _stretch(self) -> None:
        """The step's end under an emulated slowdown: its own time stretched, as a ``straggle`` span of what
        ``"slowdown"`` under the number of the step it holds back (the next: it lies between this step's optimizer
        and the next one's, where step times are measured)."""
        w = self.w
        t = time.time()
        if w.pace.end() > 0:
            w.span("straggle", self.step, None, t, time.time(), what="slowdown")

    def _stream_batch(self, epoch: int) -> tuple:
        """``(inputs, targets, sends)`` of a stream's batch: stage 0 reads it from its shard and sends the targets
        to the last stage (``sends`` to wait for), which receives them."""
        w = self.w
        xb = yb = None
        sent: list = []
        self.batch_rows = w.cfg["batch_size"]  # a middle stage's count; the first and last know the batch's
        if w.first:
            xb, yb = w.reader.take(epoch)
            self.batch_rows = rows(xb)
            xb = to_device(xb, w.device)
            if w.last:
                yb = to_device(yb, w.device)
            else:
                sent = w.link.isend_tree(yb, w.stages - 1, TAG_TARGET)
                yb = None
        elif w.last:
            yb = w.link.recv_tree(w.spec.target_layout, 0, TAG_TARGET)
            self.batch_rows = rows(yb)
        return xb, yb, sent

    def _update(self, epoch: int, loss: Optional[float], **fields) -> None:
        """One weight update: the policy's sync of the gradients (coupled replicas also agree on stop, policy
        and pause), the optimizer, the policy's sync of the weights.  ``loss``: the last stage's, since the
        last update."""
        w, step = self.w, self.step
        proposal = (False, 0, False, 0)
        if w.first and w.policy.coupled:
            cmd = w.read_ctl(CTL_MAX_AGE)
            proposal = (cmd.stop, cmd.policy, cmd.pause, cmd.members)
        if w.optimizer is not None:  # before any average: a gradient average (allreduce) would spread it
            grads = [(n, p.grad) for n, p in w.module.named_parameters() if p.grad is not None]
            check_finite(grads, "gradients", step, loss)
        with w.pace.waiting():  # the policy's collectives and groups wait for other pipelines
            self.agreed = w.policy.after_backward(w, step, *proposal)
        t, c = time.time(), time.thread_time()
        if w.optimizer is not None:
            w.optimizer.step()
            w.optimizer.zero_grad(set_to_none=False)
            if not w.policy.coupled:  # before the weights' group average
                check_finite([(n, p.detach()) for n, p in w.module.named_parameters()], "weights", step, loss)
        if loss is not None:
            fields["loss"] = loss
        # CPU seconds: the optimizer's, and since the last update's end the training thread's and the process's
        # (every thread: the Dask worker's event loop, an averaging's, gloo's): what the worker asks of the cores
        # and the machine's, every process's (what the processes beside the workers took is that less the workers')
        now = (time.thread_time(), time.process_time(), machine_busy())
        if self.cpu_mark is not None:
            fields["step_cpu"], fields["process_cpu"] = now[0] - self.cpu_mark[0], now[1] - self.cpu_mark[1]
            if now[2] is not None and self.cpu_mark[2] is not None:
                fields["machine_cpu"] = now[2] - self.cpu_mark[2]
        self.cpu_mark = now
        w.span("optimizer", step, None, t, time.time(), epoch=epoch, cpu=now[0] - c, **fields)
        with w.pace.waiting():
            w.policy.after_step(w, step)
        self.step += 1

    def _report(self, epoch: int, train_time: float, losses: list, samples: int) -> None:
        """The evaluation pass (every stage of the pipeline takes part) and the last stage's ``epoch`` record."""
        w = self.w
        metrics = evaluate(w, self.step, self.EX, self.EY) if w.spec.eval_size and not self.stopped else None
        if not w.last:
            return
        bs = w.cfg["batch_size"]
        rec = {
            "epoch": epoch,
            "pipeline": w.pipeline,
            "loss": sum(losses) / len(losses),
            "samples": samples,
            "share": samples / min(w.spec.train_size, w.spec.batches_per_epoch * bs),
            "samples_per_s": samples / train_time,
            "steps": len(losses),
            "complete": not self.stopped,
        }
        if metrics:
            rec.update(metrics)
        w.sink.add(events.epoch(w.pipeline, w.stage, self.step, time.time() - w.t0, rec))


def worker_main(spec: WorkerSpec, rank: int, X=None, Y=None, EX=None, EY=None, resume=None, join=None) -> WorkerResult:
    """Entry point of a worker task; returns its :class:`~sdpipe.wire.protocol.WorkerResult` (its final stage
    weights among it).

    ``resume``: this rank's state from a checkpoint (weights, optimizer, random states).  ``join``: the rank's
    pipeline joins the running run (see :class:`Worker`); its result says ``joined=False`` when the driver gave
    the join up before a replica gave it its state.  The C allocator keeps freed tensors' memory for reuse while
    it trains (:mod:`sdpipe.worker.allocator`).
    """
    with training_thresholds():
        return _run_worker(spec, rank, X, Y, EX, EY, resume, join)


def _run_worker(spec: WorkerSpec, rank: int, X, Y, EX, EY, resume, join) -> WorkerResult:
    torch.set_num_threads(1)
    torch.manual_seed(spec.config["seed"] + 1 + rank)
    sink = EventSink(spec.topic, rank)
    worker = result = None
    try:
        worker = Worker(spec, rank, sink, join)
        step, start_epoch = 0, None
        if resume is not None:
            worker.restore(resume)
            step = spec.start_steps[str(worker.pipeline)]
        if join is not None:
            state = await_state(worker)
            if state is None:
                result = WorkerResult(rank=rank, generation=worker.generation, joined=False)
                return result
            step, start_epoch = state.step, state.epoch
        first_j = state.policy["j"] if join is not None and state.policy else 0
        worker.describe()
        result = Training(worker, X, Y, EX, EY, step, start_epoch, first_j).run()
        return result
    except BaseException as e:
        result = None
        # Dask keeps a failed task's exception, and its traceback's frames would keep their locals (a
        # process group among them) and so its connections open: a peer still waiting in it would sit out
        # its whole timeout instead of failing now
        traceback.clear_frames(e.__traceback__)
        lost = as_peer_lost(e)
        if lost is not e:
            raise lost from None  # typed for the driver; torch's text is in its message
        raise
    finally:
        if worker is not None:
            if result is None:
                worker.policy.leave(worker)
            worker.close(result is None)
        sink.flush()
        if result is not None:
            result.events = sink.sent  # counted after closing: policy server threads record too


def machine_busy() -> Optional[float]:
    """CPU seconds the machine's cores have been busy since it booted, every process's (None where the system
    does not say): ``psutil.cpu_times()``'s user, system and interrupt time (a guest's is in user's already)."""
    try:
        import psutil

        t = psutil.cpu_times()
    except Exception:  # psutil comes with distributed; a system without the counters has no figure
        return None
    return sum(getattr(t, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq", "steal", "interrupt"))
