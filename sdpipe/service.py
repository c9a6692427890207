"""The group scheduler as a service on the Dask scheduler.

:class:`GroupService` is a ``SchedulerPlugin``: it lives in the Dask
scheduler process, which every worker and the driver already reach, and it
hosts one :class:`~sdpipe.core.scheduler.GroupScheduler` per run.  Its routes
(Dask scheduler handlers):

``sdpipe_open(run_id, token, stages, pipelines, policy, policy_name, topic, t0, state=None)``
    start scheduling a run (driver), from a scheduler snapshot when resuming.
``sdpipe_ready(run_id, stage, pipeline, step, global_sync, timeout)``
    a worker is ready; answers with its group once decided (worker).
``sdpipe_leave(run_id, stage, pipeline, token=None)``
    a worker leaves its stage for good: stop or failure (worker); with
    ``stage=None`` a whole pipeline was lost (driver, with the run's token).
``sdpipe_hurry(run_id, stage, pipeline)``
    the worker reached its epoch's end while its ready signal waits in an open round: that round closes now
    (worker).
``sdpipe_join(run_id, stage, pipeline, donor)``
    a pipeline joins a stage holding a copy of the live ``donor``'s state (the donor's worker, at the step
    it copied its state); the joiner is in no group before its first ready signal.
``sdpipe_set_policy(run_id, token, policy, policy_name)``
    change the policy live (driver).
``sdpipe_pause(run_id, token, paused)``
    the run is paused or resumed (driver): while paused, waits for a group do not time out.
``sdpipe_stop(run_id, token)``
    the run is stopping (driver): every answer decided from now on says so, so the members
    of a round take the stop after the same round (pipelines that average together stop at one step).
``sdpipe_state(run_id)``
    a plain-data snapshot of the scheduler (anyone).
``sdpipe_endpoint()``
    ``{"endpoint": [host, port]}`` of the service's own socket, or ``{"endpoint": None}`` (anyone).
``sdpipe_close(run_id, token)``
    forget a run (driver).

Every route answers a dict on success and raises on failure: a
:class:`~sdpipe.wire.protocol.GroupServiceError` with a one-line reason (a run not
scheduled, a snapshot that is not one, a pipeline already waiting, no group
within the timeout, the run closed or the pipeline lost while waiting), or a
``PermissionError`` for a control call without the run's token.  Callers go
through :class:`~sdpipe.wire.protocol.GroupServiceClient`.

On a ``tcp://`` scheduler the service also listens on a socket of its own, on
the scheduler's host (``sdpipe_endpoint``): workers send ``ready`` and
``hurry`` there, one frame each way (:func:`sdpipe.wire.protocol.encode_frame`),
served by the same coroutines as the routes; it costs a step far less than a
Dask route does.

Handlers only touch in-memory state and futures: the scheduler's event loop
never blocks.  Windows end through timers on that loop.  Every decision is
logged to the run's event topic, which the driver subscribes to.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import time

from distributed.diagnostics.plugin import SchedulerPlugin, WorkerPlugin

from sdpipe.core.scheduler import GroupScheduler, Hurry, Join, Lost, Ready, Retune, SchedulerPolicy, Tick
from sdpipe.wire import events
from sdpipe.wire.protocol import GroupAnswer, GroupServiceError, decode_frame, encode_frame

log = logging.getLogger("sdpipe.service")

SERVICE_NAME = "sdpipe-groups"


def _refusal_answered(route):
    """A route whose refusal (``GroupServiceError``: a run that ended, a value it does not take) goes back as
    ``{"error": reason}``, which the caller raises in one line: raised in the Dask scheduler, Dask would log it
    with its traceback on the scheduler's terminal (a user's own LocalCluster: the notebook's)."""

    if inspect.iscoroutinefunction(route):  # Dask awaits a route by its kind

        @functools.wraps(route)
        async def answered_async(*args, **kwargs):
            try:
                return await route(*args, **kwargs)
            except GroupServiceError as e:
                return {"error": str(e)}

        return answered_async

    @functools.wraps(route)
    def answered(*args, **kwargs):
        try:
            return route(*args, **kwargs)
        except GroupServiceError as e:
            return {"error": str(e)}

    return answered


#: a waiter's answer when its timeout passed (see GroupService._answer)
_EXPIRED = {"error": "expired"}


class _RunState:
    def __init__(self, token, stages, pipelines, policy, policy_name, topic, t0):
        self.token = token
        self.core = GroupScheduler(stages, pipelines, policy)
        self.policy_name = policy_name
        self.version = 0
        self.topic = topic
        self.t0 = t0
        self.waiters: dict = {}
        self.timer = None
        self.timer_at = None  # the deadline the timer fires at
        self.seq = 0
        self.paused = False
        self.resumed_at = -1e9  # service clock of the last resume
        self.stopping = False
        self.joins: dict = {}  # (stage, pipeline) -> times it joined the stage while the run ran


class GroupService(SchedulerPlugin):
    """Scheduler-side home of the SDPipe group schedulers (see the module docstring for routes)."""

    name = SERVICE_NAME

    def __init__(self):
        self.runs: dict = {}
        self.scheduler = None
        self.server = None  # the service's own socket (see the module docstring)
        self.endpoint = None

    async def start(self, scheduler) -> None:
        self.scheduler = scheduler
        await self._listen(scheduler)
        routes = {
            "sdpipe_open": self.open,
            "sdpipe_ready": self.ready,
            "sdpipe_leave": self.leave,
            "sdpipe_hurry": self.hurry,
            "sdpipe_join": self.join,
            "sdpipe_set_policy": self.set_policy,
            "sdpipe_pause": self.pause,
            "sdpipe_stop": self.stop,
            "sdpipe_state": self.state,
            "sdpipe_close": self.close_run,
            "sdpipe_endpoint": self.endpoint_route,
        }
        scheduler.handlers.update({name: _refusal_answered(fn) for name, fn in routes.items()})

    async def _listen(self, scheduler) -> None:
        """The service's own socket, on the host of a ``tcp://`` scheduler (an ephemeral port)."""
        from urllib.parse import urlparse

        address = urlparse(scheduler.address or "")
        if address.scheme != "tcp" or not address.hostname:
            return
        self.server = await asyncio.start_server(self._serve, address.hostname, 0)
        self.endpoint = [address.hostname, self.server.sockets[0].getsockname()[1]]

    def endpoint_route(self, run_id=None):
        return {"endpoint": self.endpoint}

    async def _serve(self, reader, writer) -> None:
        """One worker thread's connection: a frame in, the route's answer (or ``{"error": ...}``) out, until it
        closes."""
        routes = {"sdpipe_ready": self.ready, "sdpipe_hurry": self.hurry}
        try:
            while True:
                try:
                    size = int.from_bytes(await reader.readexactly(4), "big")
                    msg = decode_frame(await reader.readexactly(size))
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                route = routes.get(msg.pop("op", None))
                try:
                    if route is None:
                        raise GroupServiceError("op: must be sdpipe_ready or sdpipe_hurry")
                    answer = route(**msg)
                    if asyncio.iscoroutine(answer):
                        answer = await answer
                except (GroupServiceError, PermissionError) as e:
                    answer = {"error": str(e)}
                except Exception as e:  # a bad frame: said to the caller in one line
                    answer = {"error": f"{type(e).__name__}: {e}"}
                writer.write(encode_frame(answer))
                await writer.drain()
        except ConnectionError:  # the worker went away while its call waited
            return
        finally:
            writer.close()

    async def close(self) -> None:
        """Scheduler shutdown: release every waiting worker."""
        for run_id in list(self.runs):
            self._drop(run_id)
        if self.server is not None:
            self.server.close()
            self.server = None

    # ------------------------------------------------------------- helpers
    def _run(self, run_id: str) -> _RunState:
        st = self.runs.get(run_id)
        if st is None:
            raise GroupServiceError(f"run_id: no sdpipe run {run_id!r} is scheduled here")
        return st

    def _owned(self, run_id: str, token) -> _RunState:
        """The run, for a control call: only with the token its driver holds."""
        st = self._run(run_id)
        if not isinstance(token, str) or token != st.token:
            raise PermissionError(f"token: does not match run {run_id!r}")
        return st

    def _now(self, st: _RunState) -> float:
        return time.time() - st.t0

    def _log(self, st: _RunState, records: list) -> None:
        if records and self.scheduler is not None:
            self.scheduler.log_event(st.topic, {"rank": -1, "seq": st.seq, "events": records})
            st.seq += 1

    def _dispatch(self, run_id: str, st: _RunState, decisions: list) -> None:
        records = []
        for g in decisions:
            # a rejoined pipeline is a new member: its groups get new names (members cache groups by name)
            name = f"s{g.stage}-" + "-".join(
                f"{m}" + (f"j{st.joins[g.stage, m]}" if (g.stage, m) in st.joins else "") for m in g.members
            )
            answer = GroupAnswer(
                round=g.round,
                members=list(g.members),
                reason=g.reason,
                name=name,
                policy=st.policy_name,
                version=st.version,
                weighting=st.core.policy.weighting,
                overlap=st.core.policy.overlap,
                stop=st.stopping,
            ).to_wire()
            for m in g.members:
                fut = st.waiters.pop((g.stage, m), None)
                if fut is not None and not fut.done():
                    fut.set_result(answer)
            records.append(
                events.group(
                    g.stage, g.round, g.members, g.reason, g.opened, g.closed, g.wait, g.connected, st.policy_name
                )
            )
        self._log(st, records)
        self._arm_timer(run_id, st)

    def _arm_timer(self, run_id: str, st: _RunState) -> None:
        """The timer at the core's next deadline (kept when that did not move: most events leave it)."""
        deadline = st.core.next_deadline()
        if st.timer is not None:
            if deadline == st.timer_at:
                return
            st.timer.cancel()
            st.timer = None
        if deadline is not None:
            delay = max(0.0, deadline - self._now(st))
            st.timer = asyncio.get_running_loop().call_later(delay, self._on_timer, run_id)
            st.timer_at = deadline

    def _on_timer(self, run_id: str) -> None:
        st = self.runs.get(run_id)
        if st is None:
            return
        st.timer = None
        self._dispatch(run_id, st, st.core.handle(Tick(self._now(st))))

    def _drop(self, run_id: str) -> None:
        st = self.runs.pop(run_id, None)
        if st is None:
            return
        if st.timer is not None:
            st.timer.cancel()
        for fut in st.waiters.values():
            if not fut.done():
                fut.set_result({"error": f"run {run_id!r} was closed"})

    # ------------------------------------------------------------- routes
    def open(self, run_id, token, stages, pipelines, policy, policy_name, topic, t0, state=None):
        self._drop(run_id)
        st = _RunState(token, stages, pipelines, SchedulerPolicy(**policy), policy_name, topic, t0)
        if state is not None:  # resumed from a checkpoint: its windows, rounds and connectivity
            try:
                st.core = GroupScheduler.restore(state)
            except (KeyError, TypeError, ValueError) as e:
                raise GroupServiceError(f"state: not a scheduler snapshot ({type(e).__name__}: {e})") from None
        self.runs[run_id] = st
        return {"ok": True}

    async def ready(self, run_id, stage, pipeline, step, global_sync=False, timeout=60.0):
        st = self.runs.get(run_id)
        if st is None:
            raise GroupServiceError(f"run {run_id!r} is not scheduled (closed or never opened)")
        key = (stage, pipeline)
        if key in st.waiters:
            raise GroupServiceError(f"pipeline {pipeline} of stage {stage} is already waiting for a group")
        fut = asyncio.get_running_loop().create_future()
        st.waiters[key] = fut
        try:
            decisions = st.core.handle(Ready(pipeline, step, self._now(st), bool(global_sync), stage=stage))
        except ValueError as e:
            st.waiters.pop(key, None)
            raise GroupServiceError(str(e)) from None
        self._dispatch(run_id, st, decisions)
        answer = await self._answer(run_id, st, key, fut, timeout)
        if "error" in answer:  # the run was closed or the pipeline lost while this worker waited
            raise GroupServiceError(answer["error"])
        return answer

    async def _answer(self, run_id, st: _RunState, key: tuple, fut, timeout: float) -> dict:
        """The waiter's answer; a pipeline nobody answered within ``timeout`` (the run not paused) is taken out.

        One timer per waiter, re-armed while the run is paused or was resumed less than ``timeout`` ago (a paused
        run holds pipelines at their step boundaries: their groups wait with them); no task per waiter: this is
        every ready signal's path."""
        loop = asyncio.get_running_loop()
        timer = None

        def expire() -> None:
            nonlocal timer
            if fut.done():
                return
            if st.paused or st.resumed_at > self._now(st) - timeout:
                timer = loop.call_later(timeout, expire)
                return
            fut.set_result(_EXPIRED)

        timer = loop.call_later(timeout, expire)
        try:
            answer = await fut
        finally:
            timer.cancel()
        if answer is not _EXPIRED:
            return answer
        # Nobody came: take the pipeline out so the others do not wait on it, and fail this worker.
        stage, pipeline = key
        if st.waiters.get(key) is fut:
            del st.waiters[key]
        if run_id in self.runs:
            self._dispatch(run_id, st, st.core.handle(Lost(pipeline, self._now(st))))
        return {"error": f"no group for pipeline {pipeline} stage {stage} within {timeout:.0f}s"}

    def leave(self, run_id, stage, pipeline, token=None):
        st = self.runs.get(run_id)
        if st is None:
            return {"ok": False}
        if stage is None and token != st.token:  # taking a whole pipeline out is the driver's call
            raise PermissionError(f"token: does not match run {run_id!r}")
        now = self._now(st)
        decisions = st.core.handle(Lost(pipeline, now, stage=stage))  # stage None: the whole pipeline
        if stage is None:  # the whole pipeline is gone: its workers still waiting get no group
            for (s, p), fut in list(st.waiters.items()):
                if p == pipeline and not fut.done():
                    st.waiters.pop((s, p), None)
                    fut.set_result({"error": f"pipeline {pipeline} was lost"})
        self._dispatch(run_id, st, decisions)
        return {"ok": True}

    def hurry(self, run_id, stage, pipeline):
        st = self._run(run_id)
        self._dispatch(run_id, st, st.core.handle(Hurry(pipeline, self._now(st), stage=stage)))
        return {"ok": True}

    def join(self, run_id, stage, pipeline, donor):
        st = self._run(run_id)
        try:
            decisions = st.core.handle(Join(pipeline, self._now(st), donor, stage=stage))
        except ValueError as e:
            raise GroupServiceError(str(e)) from None
        st.joins[stage, pipeline] = st.joins.get((stage, pipeline), 0) + 1
        self._dispatch(run_id, st, decisions)
        return {"ok": True}

    def set_policy(self, run_id, token, policy, policy_name):
        st = self._owned(run_id, token)
        st.policy_name = policy_name
        st.version += 1
        decisions = st.core.handle(Retune(SchedulerPolicy(**policy), self._now(st)))
        self._log(
            st,
            [
                events.control(
                    "policy", self._now(st), applied_by="scheduler", policy=policy_name, params=_plain(policy)
                )
            ],
        )
        self._dispatch(run_id, st, decisions)
        return {"ok": True, "version": st.version}

    def pause(self, run_id, token, paused):
        st = self._owned(run_id, token)
        st.paused = bool(paused)
        if not st.paused:
            st.resumed_at = self._now(st)
        return {"ok": True}

    def stop(self, run_id, token):
        self._owned(run_id, token).stopping = True
        return {"ok": True}

    def state(self, run_id):
        st = self._run(run_id)
        return {
            "policy": st.policy_name,
            "version": st.version,
            "stages": [s.snapshot() for s in st.core.stages],
            "waiting": sorted([list(k) for k in st.waiters]),
            # [stage, pipeline] of the workers waiting for their stage's global group (an epoch's end, a stop)
            "global": sorted([[s.stage, w] for s in st.core.stages for w in s.global_waiting]),
            "graph_stages": st.core.graph_stages(),  # the stages holding a graph-sync round now
            "paused": st.paused,
            "core": st.core.snapshot(),
        }

    def close_run(self, run_id, token):
        if run_id in self.runs:
            self._owned(run_id, token)
            topic = self.runs[run_id].topic
            self._drop(run_id)
            self._forget_topic(topic)
        return {"ok": True}

    def _forget_topic(self, topic: str) -> None:
        """Drop the closed run's event topic from the scheduler's event log (its driver has every record by
        now): the scheduler keeps each topic's batches (up to ``distributed.scheduler.events-log-length``), so a
        long-lived cluster would hold every run's records and its process collect them again and again.  Dask's
        broker has no public way to drop a topic; where its layout differs the topic stays."""
        topics = getattr(getattr(self.scheduler, "_broker", None), "_topics", None)
        if isinstance(topics, dict):
            topics.pop(topic, None)


def _plain(d: dict) -> dict:
    """msgpack-safe copy (infinite windows become None)."""
    return {k: (None if isinstance(v, float) and v == float("inf") else v) for k, v in d.items()}


class QuietExit(WorkerPlugin):
    """Lets a worker process that trained exit in time when its cluster closes.

    A worker process that imported torch holds millions of objects, and the
    interpreter's garbage collection at exit scans them all; eight such
    processes on two cores took more than the nanny's 4 s, and the nanny then
    killed each with a warning. Frozen objects are not scanned: the worker's
    teardown freezes them just before the process ends.
    """

    name = "sdpipe-quiet-exit"

    def teardown(self, worker) -> None:
        import gc

        gc.freeze()


def ensure_service(client) -> None:
    """Install the service on the cluster's scheduler, and :class:`QuietExit` on its workers, once
    (never replaces a running one)."""

    def installed(dask_scheduler=None):
        return SERVICE_NAME in dask_scheduler.plugins, QuietExit.name in dask_scheduler.worker_plugins

    service, quiet = client.run_on_scheduler(installed)
    if not service:
        client.register_plugin(GroupService(), name=SERVICE_NAME)
    if not quiet:
        client.register_plugin(QuietExit(), name=QuietExit.name)
