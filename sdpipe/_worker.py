"""The code one worker (one stage of one pipeline) runs inside a Dask task.

The worker walks its stage's list of the schedule plan each step; every
pipeline's stage 0 drives its pipeline with a small control message at each
step boundary (run this batch, or stop), so all stages of a pipeline agree on
what the next step is without a central coordinator.
"""

from __future__ import annotations

import datetime
import math
import os
import random
import threading
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ._comm import TAG_ACT, TAG_CTRL, TAG_GRAD, Link, first_lost, make_group, pipeline_lost
from .config import Heterogeneity
from .data import TAIL_BATCHES_PER_PIPELINE, batch_indices, leaves_tail, smoothed_step_time
from .policy import AllReduce, _state_tensors, make_policy

CMD_STOP, CMD_RUN, CMD_EPOCH_END, CMD_PAUSE = 0, 1, 2, 3
CTL_INTERVAL = 0.1  # seconds: how often a pipeline's stage 0 looks for the driver's commands
CTL_MAX_AGE = 2.5 * CTL_INTERVAL  # the oldest reading a step acts on


class EventSink:
    """Buffers event records and ships them to the driver in batches.

    Batches go through the Dask worker's event log (``log_event``), which the
    driver subscribes to; the worker never waits for the driver.
    """

    def __init__(self, topic: str, rank: int, interval: float = 0.1, max_buffer: int = 500):
        from distributed import get_worker

        self._worker = get_worker()
        self.topic, self.rank = topic, rank
        self.interval, self.max_buffer = interval, max_buffer
        self.buffer: list = []
        self._lock = threading.Lock()  # policies' server threads add records too
        self.sent = 0
        self.batches = 0
        self._last = time.monotonic()

    def add(self, record: dict) -> None:
        with self._lock:
            self.buffer.append(record)
            due = len(self.buffer) >= self.max_buffer or time.monotonic() - self._last >= self.interval
        if due:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            self._last = time.monotonic()
            if not self.buffer:
                return
            batch, self.buffer = self.buffer, []
            seq = self.batches
            self.batches += 1
            self.sent += len(batch)
        self._worker.log_event(self.topic, {"rank": self.rank, "seq": seq, "events": batch})


#: seconds a worker may take to reach the run's rendezvous store (a live store answers in milliseconds)
STORE_CONNECT_TIMEOUT = 20.0


def _run_store(spec: dict, timeout: float):
    """A new connection to the run's store (the driver's ``TCPStore``), under the run's key prefix.

    Connecting is bounded by :data:`STORE_CONNECT_TIMEOUT`, not the run's
    timeout: a store this worker cannot reach is a setting to change, said
    in one line.  Waits on the connection get the run's timeout.
    """
    host, port = spec["store_host"], spec["store_port"]
    connect = min(timeout, STORE_CONNECT_TIMEOUT)
    try:
        base = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=connect))
    except (RuntimeError, OSError) as e:  # torch's DistNetworkError / DistStoreError are RuntimeErrors
        raise ConnectionError(
            f"cannot reach the run's rendezvous store at {host}:{port} from {own_address()} within {connect:.0f}s "
            f"({type(e).__name__}); set host= in sdpipe.train to an address of the driver's machine that every "
            f"worker can reach (and open its port between the machines)"
        ) from None
    base.set_timeout(datetime.timedelta(seconds=timeout))
    return dist.PrefixStore(f"sdpipe/{spec['run_id']}/", base)


def own_address() -> str:
    """The address of this worker's host: the host part of its Dask worker address (its tensors' sockets bind to it)."""
    from urllib.parse import urlparse

    from distributed import get_worker

    try:
        addr = get_worker().address
    except ValueError:  # not inside a Dask worker (a test calling worker code directly)
        return "127.0.0.1"
    host = urlparse(addr).hostname if "://" in addr else None
    return host or "127.0.0.1"


def nccl_interface(address: str):
    """The name of the network interface that holds ``address`` (NCCL's bootstrap binds to it), or None."""
    import ipaddress

    import psutil

    try:
        want = ipaddress.ip_address(address)
    except ValueError:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            try:
                if ipaddress.ip_address(a.address.split("%")[0]) == want:
                    return name
            except ValueError:
                continue
    return None


class _CtlWatcher(threading.Thread):
    """Stage 0: reads the driver's command key every ``CTL_INTERVAL`` in the background.

    It has its own connection to the run's store, so a step never waits for
    a store round trip (or for this thread) to learn that nothing changed.
    """

    def __init__(self, spec: dict, timeout: float):
        super().__init__(name="sdpipe-ctl", daemon=True)
        self._store = _run_store(spec, timeout)
        self._halt = threading.Event()
        self.latest = None  # (monotonic time, raw value) of the last reading

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                self.latest = (time.monotonic(), self._store.get("ctl"))
            except Exception:  # the store is gone (the run ended): steps read it themselves, and fail at once
                self.latest = None
                return
            self._halt.wait(CTL_INTERVAL)

    def close(self) -> None:
        self._halt.set()
        self.join(timeout=10)


@dataclass
class _Shapes:
    inp: tuple  # feature shape entering this stage (None for stage 0)
    out: tuple  # feature shape leaving this stage
    in_dtype: torch.dtype
    out_dtype: torch.dtype


class Worker:
    """State of one worker during a run (what policies see as ``worker``)."""

    def __init__(self, spec: dict, rank: int, sink: EventSink):
        cfg = spec["config"]
        self.spec, self.cfg, self.rank, self.sink = spec, cfg, rank, sink
        self.stages, self.pipelines = cfg["stages"], cfg["pipelines"]
        self.pipeline, self.stage = divmod(rank, self.stages)
        self.first, self.last = self.stage == 0, self.stage == self.stages - 1
        self.t0 = spec["t0"]
        self.backend = spec["backend"]
        self.timeout = cfg["timeout"]
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
        self._groups: list = []

        self.store = _run_store(spec, self.timeout)
        self.store.add("ranks/started", 1)  # the driver shows the start-up: started, then connected (below)
        # rendezvous wait on their own connection, so the wait can be watched on self.store meanwhile; made now,
        # next to the first (made at the first group, it could come after the run was stopped and then try a
        # closed store for the whole connect timeout)
        self._rendezvous_store = _run_store(spec, self.timeout)

        self.module = spec["stage_modules"][self.stage].to(self.device)
        self.module.train()
        self.loss_fn = spec["loss_fn"]
        self.optimizer = self._make_optimizer(cfg)
        shapes = spec["shapes"]
        self.shapes = _Shapes(
            inp=tuple(shapes[self.stage - 1][0]) if not self.first else None,
            out=tuple(shapes[self.stage][0]),
            in_dtype=getattr(torch, shapes[self.stage - 1][1]) if not self.first else None,
            out_dtype=getattr(torch, shapes[self.stage][1]),
        )
        self.plan = spec["plan"][self.stage]
        self.link = None
        if self.stages > 1:
            self.link = Link(self.group(f"pipe{self.pipeline}", self.stage, self.stages, pipelines=[self.pipeline]),
                             self.device, self.backend)
        self.steps_per_epoch = spec["steps_per_epoch"]
        self.batches_per_epoch = spec["batches_per_epoch"]
        self.run_id = spec["run_id"]
        self._dask_worker = sink._worker
        self.hetero_version = 0
        self.policy_version = 0
        self.dispense_base: dict = {}
        self._last_dispense = None  # (epoch, time) of this pipeline's last batch
        self._ctl_cache = None  # (monotonic time, value) of the last read_ctl
        self._ctl_send = None  # (work, tensor) of the control message in flight to the next stage
        self._ctl_watcher = None
        self._step_time = None  # recent seconds per step of this pipeline, all waits included
        self._step_time_epoch = None  # the epoch it was last measured in
        self.policy = make_policy(cfg["policy"])
        self.policy.setup(self)
        if self.first:
            self._ctl_watcher = _CtlWatcher(spec, self.timeout)
            self._ctl_watcher.start()
        self.store.add("ranks/ready", 1)

    # ----------------------------------------------------------- helpers
    def _make_optimizer(self, cfg: dict):
        params = [p for p in self.module.parameters() if p.requires_grad]
        if not params:  # a stage of parameter-free layers (a lone activation) has nothing to update
            return None
        opt, lr, wd = cfg["optimizer"], cfg["lr"], cfg["weight_decay"]
        if opt == "sgd":
            return torch.optim.SGD(params, lr=lr, momentum=cfg["momentum"], weight_decay=wd)
        if opt == "adam":
            return torch.optim.Adam(params, lr=lr, weight_decay=wd)
        return torch.optim.AdamW(params, lr=lr, weight_decay=wd)

    def _pick_device(self, name: str) -> torch.device:
        if name == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError(f"device: 'cuda' requested but worker rank {self.rank} sees no GPU")
            index = self.rank % torch.cuda.device_count()
            torch.cuda.set_device(index)
            return torch.device("cuda", index)
        return torch.device("cpu")

    def group(self, name: str, rank: int, size: int, connect_timeout: float | None = None, pipelines=None):
        """A process group of the workers of ``pipelines`` (default: every pipeline); its rendezvous is given up
        on as soon as one of those pipelines is marked lost (a dead member never comes)."""
        watched = list(range(self.pipelines)) if pipelines is None else list(pipelines)

        def lost_member():
            gone = first_lost(self.store, watched)
            return None if gone is None else f"pipeline {gone} was lost"

        g = make_group(self._rendezvous_store, name, rank, size, backend=self.backend, timeout=self.timeout,
                       host=self.host, connect_timeout=connect_timeout, give_up=lost_member)
        self._groups.append(g)
        return g

    def drop_group(self, g) -> None:
        """Forget a broken group. Once the caller drops its last reference too, the group's connections
        close, and members still waiting in it fail then instead of at their timeout (gloo's
        ``abort()`` does not close them: checked)."""
        self._groups = [x for x in self._groups if x is not g]

    def now(self) -> float:
        return time.time() - self.t0

    def span(self, kind: str, step, microbatch, start: float, end: float, **extra) -> None:
        rec = {
            "kind": kind,
            "pipeline": self.pipeline,
            "stage": self.stage,
            "step": step,
            "microbatch": microbatch,
            "start": start - self.t0,
            "end": end - self.t0,
        }
        rec.update(extra)
        self.sink.add(rec)

    def restore(self, state: dict) -> None:
        """Weights, optimizer state and random states from a checkpoint."""
        self.module.load_state_dict(state["model"])
        if self.optimizer is not None and state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        self.rng.setstate(state["rng"])
        torch.set_rng_state(state["torch_rng"])

    def checkpoint(self, epoch: int, step: int) -> None:
        """Write this worker's part of the checkpoint after ``epoch`` epochs, then count it in the store."""
        from .checkpoint import write_rank

        t = time.time()
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
        self.store.set(f"ckpt/{epoch}/rank{self.rank}", str(step))
        self.store.add(f"ckpt/{epoch}/n", 1)
        self.span("save", step, None, t, time.time(), epoch=epoch)

    def describe(self) -> None:
        """A ``stage`` record: bytes of this stage's synchronized state and of one micro-batch's output."""
        weight_bytes = sum(t.numel() * t.element_size() for t in _state_tensors(self))
        mb = self.cfg["batch_size"] // self.cfg["microbatches"]
        activation_bytes = 0
        if not self.last:
            activation_bytes = mb * math.prod(self.shapes.out) * torch.empty((), dtype=self.shapes.out_dtype).element_size()
        now = time.time()
        self.span("stage", None, None, now, now, weight_bytes=int(weight_bytes), activation_bytes=int(activation_bytes),
                  address=self.host)

    def delay_link(self) -> None:
        d = self.hetero.link_delay_of(self.pipeline, self.stage)
        if d > 0:
            time.sleep(d)

    def _slow(self, elapsed: float) -> None:
        k = self.hetero.slowdown_of(self.pipeline, self.stage)
        if k > 1.0:
            time.sleep((k - 1.0) * elapsed)

    # ----------------------------------------------------------- control
    def control(self, msg: list) -> list:
        """Stage 0 sends the step's control message down the pipeline; the others receive and forward it.

        ``[command, epoch, step, batch, heterogeneity version, policy version]``
        """
        if self.link is None:
            return msg
        start = time.time()
        if self.first:
            t = torch.tensor(msg, dtype=torch.int64)
        else:
            t = self.link.recv((len(msg),), torch.int64, self.stage - 1, TAG_CTRL)
        if not self.last:
            # not waited for here: a gloo send completes only once the next stage posted its receive,
            # i.e. once it finished its previous step; this stage starts its step meanwhile
            self.wait_control()
            self._ctl_send = self.link.isend(t, self.stage + 1, TAG_CTRL)
        if not self.first and int(t[0]) != CMD_PAUSE:
            self.span("wait", int(t[2]), None, start, time.time())
        return [int(x) for x in t.tolist()]

    def wait_control(self) -> None:
        """Wait for the last control message this stage sent down the pipeline to be received."""
        if self._ctl_send is not None:
            work, _ = self._ctl_send
            self._ctl_send = None
            work.wait()

    def read_ctl(self, max_age: float = 0.0) -> tuple:
        """(stop requested, heterogeneity version, policy version, paused) as the driver last set them.

        ``max_age``: a reading at most this many seconds old is answered
        without asking the store (a round trip costs a millisecond or more on
        a busy machine); stage 0's :class:`_CtlWatcher` keeps one fresh in the
        background, so steps never wait for it and the driver's commands act
        within about ``CTL_INTERVAL``.
        """
        now = time.monotonic()
        readings = [r for r in (self._ctl_cache, self._ctl_watcher.latest if self._ctl_watcher else None) if r is not None]
        if not readings or now - max(r[0] for r in readings) > max_age:
            self._ctl_cache = (now, self.store.get("ctl"))
            readings.append(self._ctl_cache)
        # two connections' readings may arrive out of order: the driver numbers its writes
        raw = max((r[1].decode().split(",") for r in readings), key=lambda f: int(f[0]))
        _, stop, hv, pv, pause = raw
        return stop == "1", int(hv), int(pv), pause == "1"

    def hold(self, step: int, hv: int, pv: int) -> tuple:
        """Stage 0: hold the pipeline at this step boundary while the run is paused.

        A heartbeat control message goes down the pipeline a few times a
        second, so the other stages' waits never run into their timeout.
        Returns (stop, heterogeneity version, policy version) once resumed.
        """
        start = time.time()
        while True:
            self.control([CMD_PAUSE, 0, step, -1, hv, pv])
            time.sleep(0.2)
            stop, hv, pv, pause = self.read_ctl()
            if stop or not pause:
                self.span("pause", step, None, start, time.time())
                return stop, hv, pv

    def apply_ctl(self, step: int, hv: int, pv: int, epoch: int, j) -> None:
        """Take up new heterogeneity or a new policy at this step boundary (same step on every stage)."""
        import json

        if hv != self.hetero_version:
            self.hetero = Heterogeneity.from_dict(json.loads(self.store.get(f"hetero/{hv}").decode()))
            self.hetero_version = hv
            now = time.time()
            self.span("control", step, None, now, now, what="heterogeneity", version=hv, applied_by="worker")
        if pv != self.policy_version:
            spec = json.loads(self.store.get(f"policy/{pv}").decode())
            self.policy_version = pv
            if spec["mode"] != self.policy.name:
                if isinstance(self.policy, AllReduce) and j is not None:
                    # leaving the lock-step shards mid-epoch: the shared counter continues after the
                    # batches every pipeline has taken (this step's included)
                    self.dispense_base[epoch] = (j + 1) * self.pipelines
                self.policy.close()
                self.policy = make_policy(spec["mode"])
                self.policy.setup(self)
            now = time.time()
            self.span("control", step, None, now, now, what="policy", policy=spec["name"], version=pv, applied_by="worker")

    def dispense(self, epoch: int):
        """Stage 0: the next batch of ``epoch`` from the counter shared by all pipelines, or None when it is used up.

        Each pipeline publishes its step time (an average over recent steps).
        In the epoch's tail a pipeline leaves the last batches to the others
        when they would finish all of them before it finished one: so the
        epoch, and the global sync that ends it, does not wait for a slow
        pipeline's last step.
        """
        now = time.monotonic()
        last = self._last_dispense
        if last is not None and last[0] == epoch:
            dt = now - last[1]
            self._step_time = smoothed_step_time(self._step_time, dt)
            self._step_time_epoch = epoch
        if self._step_time is not None:
            self.store.set(f"epoch{epoch}/steptime/{self.pipeline}", repr(self._step_time))
        base = self.dispense_base.get(epoch, 0)
        taken = self.store.add(f"epoch{epoch}/taken", 0)
        remaining = self.batches_per_epoch - base - taken
        b = None
        if remaining > 0 and not (remaining <= TAIL_BATCHES_PER_PIPELINE * self.pipelines and self._leave_tail(epoch, remaining)):
            b = base + self.store.add(f"epoch{epoch}/taken", 1) - 1
        if b is None or b >= self.batches_per_epoch:
            self.store.set(f"epoch{epoch}/steptime/{self.pipeline}", "inf")  # out of this epoch
            self._last_dispense = None
            return None
        self._last_dispense = (epoch, now)
        return b

    def _leave_tail(self, epoch: int, remaining: int) -> bool:
        """The tail rule (:func:`sdpipe.data.leaves_tail`) against the step times the other pipelines still in ``epoch`` published."""
        if self._step_time_epoch != epoch:
            # measured in an earlier epoch (or never): a pipeline that fell behind would otherwise
            # keep a stale estimate, leave every tail and never measure itself again
            return False
        keys = [f"epoch{epoch}/steptime/{p}" for p in range(self.pipelines)
                if p != self.pipeline and not pipeline_lost(self.store, p)]  # a lost pipeline takes nothing
        keys = [k for k in keys if self.store.check([k])]
        times = [float(v) for v in self.store.multi_get(keys)] if keys else []
        return leaves_tail(self._step_time, times, remaining)

    def ask_group(self, step: int, global_sync: bool) -> dict:
        """Tell the group service this worker is ready; wait (bounded) for its group."""
        from distributed.utils import sync

        start = time.time()
        answer = sync(
            self._dask_worker.loop,
            self._dask_worker.scheduler.sdpipe_ready,
            run_id=self.run_id,
            stage=self.stage,
            pipeline=self.pipeline,
            step=step,
            global_sync=global_sync,
            timeout=self.timeout,
            callback_timeout=self.timeout + 10,
        )
        if "error" in answer:
            raise RuntimeError(f"group service: {answer['error']}")
        self.span("wait", step, None, start, time.time(), what="group", group=answer["members"], round=answer["round"])
        return answer

    def leave_service(self) -> None:
        from distributed.utils import sync

        try:
            sync(self._dask_worker.loop, self._dask_worker.scheduler.sdpipe_leave, run_id=self.run_id,
                 stage=self.stage, pipeline=self.pipeline, callback_timeout=10)
        except Exception:  # the service or the run is already gone
            pass

    # ----------------------------------------------------------- one step
    def train_step(self, step: int, xb, yb) -> float | None:
        """Run this stage's share of one step (all micro-batches) and return the loss at the last stage."""
        M = self.spec["config"]["microbatches"]
        mb = self.spec["config"]["batch_size"] // M
        inputs, outputs, grads, pending = {}, {}, {}, []
        losses = []
        for a in self.plan:
            m = a.microbatch
            t = time.time()
            if a.op == "RF":
                x = self.link.recv((mb, *self.shapes.inp), self.shapes.in_dtype, self.stage - 1, TAG_ACT)
                if x.is_floating_point():
                    x.requires_grad_(True)
                inputs[m] = x
                self.span("recv", step, m, t, time.time())
            elif a.op == "F":
                x = xb[m * mb : (m + 1) * mb] if self.first else inputs[m]
                out = self.module(x)
                if self.last:
                    loss = self.loss_fn(out, yb[m * mb : (m + 1) * mb])
                    losses.append(float(loss.detach()))
                    outputs[m] = loss / M
                else:
                    outputs[m] = out
                self._slow(time.time() - t)
                self.span("forward", step, m, t, time.time())
            elif a.op == "SF":
                pending.append(self.link.isend(outputs[m], self.stage + 1, TAG_ACT))
                self.span("send", step, m, t, time.time())
            elif a.op == "RB":
                grads[m] = self.link.recv((mb, *self.shapes.out), self.shapes.out_dtype, self.stage + 1, TAG_GRAD)
                self.span("recv", step, m, t, time.time())
            elif a.op == "B":
                out = outputs.pop(m)
                if self.last:
                    out.backward()
                else:
                    torch.autograd.backward(out, grads.pop(m))
                self._slow(time.time() - t)
                self.span("backward", step, m, t, time.time())
            elif a.op == "SB":
                g = inputs.pop(m).grad
                pending.append(self.link.isend(g, self.stage - 1, TAG_GRAD))
                self.span("send", step, m, t, time.time())
        if pending:
            t = time.time()
            for work, _ in pending:
                work.wait()
            self.span("wait", step, None, t, time.time())
        return sum(losses) / len(losses) if losses else None

    def evaluate(self, step: int, X, Y) -> dict | None:
        """Forward the eval data through this pipeline; the last stage returns loss and accuracy."""
        n = self.spec["eval_size"]
        bs = self.spec["config"]["batch_size"]
        self.module.eval()
        loss_sum, correct, t = 0.0, 0, time.time()
        classify = self.spec["classify"]
        with torch.no_grad():
            for lo in range(0, n, bs):
                k = min(bs, n - lo)
                if self.first:
                    x = X[lo : lo + k].to(self.device)
                else:
                    x = self.link.recv((k, *self.shapes.inp), self.shapes.in_dtype, self.stage - 1, TAG_ACT)
                out = self.module(x)
                if not self.last:
                    self.link.send(out, self.stage + 1, TAG_ACT)
                    continue
                y = Y[lo : lo + k].to(self.device)
                loss_sum += float(self.loss_fn(out, y)) * k
                if classify:
                    correct += int((out.argmax(dim=-1) == y).sum())
        self.module.train()
        self.span("eval", step, None, t, time.time())
        if not self.last:
            return None
        res = {"eval_loss": loss_sum / n}
        if classify:
            res["accuracy"] = correct / n
        return res

    def close(self, failed: bool) -> None:
        """Drop every group (their connections close, so peers still waiting in one fail fast instead of timing out)."""
        try:
            if self._ctl_watcher is not None:
                self._ctl_watcher.close()
            self.policy.close(failed)
        finally:
            if self.link is not None:
                self.link.group = None  # a failed operation's traceback may still hold the Link
            self.link = None
            self._ctl_send = None
            if failed:
                for g in self._groups:
                    try:
                        g.abort()
                    except Exception:
                        pass
            self._groups.clear()


def worker_main(spec: dict, rank: int, X=None, Y=None, EX=None, EY=None, resume=None) -> dict:
    """Entry point of a worker task; returns its final stage weights.

    ``resume``: this rank's state from a checkpoint (weights, optimizer, random states).
    """
    torch.set_num_threads(1)
    torch.manual_seed(spec["config"]["seed"] + 1 + rank)
    sink = EventSink(spec["topic"], rank)
    worker = None
    failed = True
    stopped = False
    step = 0
    try:
        worker = Worker(spec, rank, sink)
        cfg = spec["config"]
        if resume is not None:
            worker.restore(resume)
            step = spec["start_steps"][str(worker.pipeline)]
        worker.describe()
        bs = cfg["batch_size"]
        pending_stop, pending_version, pending_pause = False, 0, False
        for epoch in range(spec.get("start_epoch", 0), cfg["epochs"]):
            epoch_start = time.time()
            losses, samples, j = [], 0, 0
            while True:
                if worker.first:
                    # a reading up to CTL_MAX_AGE old (the watcher keeps one): coupled replicas agree on stop and
                    # policy in their collective, group policies take the stop from their groups' answers
                    coupled = isinstance(worker.policy, AllReduce)
                    stop, hv, pv, pause = worker.read_ctl(CTL_MAX_AGE)
                    if coupled:
                        # coupled replicas act on what they agreed in the last collective
                        stop, pv, pause = pending_stop, pending_version or worker.policy_version, pending_pause
                    elif getattr(worker.policy, "carries_stop", False):
                        # group policies: the stop comes with the group service's answers (same round, same word)
                        stop = worker.policy.stop_now(stop)
                    if pause and not stop:
                        stop, hv, pv = worker.hold(step, hv, pv)
                        pending_pause = False
                        if coupled:
                            stop, pv = stop or pending_stop, pending_version or worker.policy_version
                    batch = None if stop else worker.policy.next_batch(worker, epoch, j)
                    cmd = CMD_STOP if stop else (CMD_EPOCH_END if batch is None else CMD_RUN)
                    msg = [cmd, epoch, step, -1 if batch is None else batch, hv, pv]
                else:
                    msg = [0] * 6
                cmd, _, _, batch, hv, pv = worker.control(msg)
                if cmd == CMD_PAUSE:  # stage 0 holds the pipeline; this is its heartbeat
                    continue
                worker.apply_ctl(step, hv, pv, epoch, j if cmd == CMD_RUN else None)
                if cmd == CMD_STOP:
                    stopped = True
                    worker.policy.stopping(worker, step)
                    worker.policy.leave(worker)
                    break
                if cmd == CMD_EPOCH_END:
                    if (epoch + 1) % cfg["sync_every"] == 0 or epoch == cfg["epochs"] - 1:
                        worker.policy.epoch_end(worker, step)
                    break
                t = time.time()
                h = worker.hetero
                if h.straggle_prob > 0 and worker.rng.random() < h.straggle_prob:
                    time.sleep(h.straggle_delay)
                    worker.span("straggle", step, None, t, time.time())
                idx = batch_indices(spec["train_size"], bs, cfg["seed"], epoch, batch)
                xb = X[idx].to(worker.device) if worker.first else None
                yb = Y[idx].to(worker.device) if worker.last else None
                loss = worker.train_step(step, xb, yb)
                local_stop, local_version, local_pause = False, 0, False
                if worker.first and isinstance(worker.policy, AllReduce):
                    local_stop, _, local_version, local_pause = worker.read_ctl(CTL_MAX_AGE)
                pending_stop, pending_version, pending_pause = worker.policy.after_backward(
                    worker, step, local_stop, local_version, local_pause)
                t = time.time()
                if worker.optimizer is not None:
                    worker.optimizer.step()
                    worker.optimizer.zero_grad(set_to_none=False)
                worker.span("optimizer", step, None, t, time.time(), epoch=epoch, **({"loss": loss} if loss is not None else {}))
                worker.policy.after_step(worker, step)
                if loss is not None:
                    losses.append(loss)
                samples += bs
                step += 1
                j += 1
            train_time = time.time() - epoch_start
            if samples:
                metrics = worker.evaluate(step, EX, EY) if spec["eval_size"] and not stopped else None
                if worker.last and samples:
                    rec = {
                        "epoch": epoch,
                        "pipeline": worker.pipeline,
                        "loss": sum(losses) / len(losses),
                        "samples": samples,
                        "share": samples / (spec["batches_per_epoch"] * bs),
                        "samples_per_s": samples / train_time,
                        "steps": len(losses),
                        "complete": not stopped,
                    }
                    if metrics:
                        rec.update(metrics)
                    now = time.time()
                    worker.span("epoch", step, None, now, now, metrics=rec)
            every = cfg["checkpoint_every"]
            if every and (epoch + 1) % every == 0 and not stopped:
                worker.checkpoint(epoch + 1, step)
            if stopped:
                break
        worker.wait_control()
        state = {k: v.detach().cpu().clone() for k, v in worker.module.state_dict().items()}
        failed = False
        result = {"rank": rank, "state": state, "steps": step, "stopped": stopped}
        return result
    except BaseException as e:
        # Dask keeps a failed task's exception, and its traceback's frames would keep their locals (a
        # process group among them) and so its connections open: a peer still waiting in it would sit out
        # its whole timeout instead of failing now
        traceback.clear_frames(e.__traceback__)
        raise
    finally:
        if worker is not None:
            if failed:
                worker.policy.leave(worker)
            worker.close(failed)
        sink.flush()
        if not failed:
            result["events"] = sink.sent  # counted after closing: policy server threads record too
