"""Steering a run while it trains: the driver's half of the control plane.

Two ways reach the workers, and every change takes both in the same order under one lock:

* the group service (:class:`~sdpipe.wire.protocol.GroupServiceClient`): the policy's parameters, pause and stop,
  so that the members of a round get the same answer;
* the run's store: the :class:`~sdpipe.wire.protocol.Command` under ``ctl``, which every pipeline's stage 0 reads
  at its step boundaries, with versioned heterogeneity and policy under their own keys.

:class:`ControlPlane` writes them; :class:`Steering` is the public side of :class:`~sdpipe.Run` (checks each
request in one line before anything is applied, applies it, records a ``control`` event).
"""

from __future__ import annotations

import copy
import json
import threading
import time
from typing import Optional

from sdpipe.config import LIVE_POLICIES, Heterogeneity
from sdpipe.core.checks import is_integer, number
from sdpipe.core.policies import SWITCHED_MODE, names, of_mode, record
from sdpipe.wire import events
from sdpipe.wire.protocol import Command, CutChange, GroupServiceClient, Keys, MembershipChange, PolicyChange

__all__ = ["ControlPlane", "Steering"]


class ControlPlane:
    """The driver's writes to the run's store and its control calls to the group service, one at a time.

    ``mode`` is the workers' policy implementation (:attr:`sdpipe.core.policies.PolicyRecord.mode`); a live switch
    moves a run to :data:`sdpipe.core.policies.SWITCHED_MODE` for the rest of the run.
    """

    def __init__(self, store, service: GroupServiceClient, mode: str, policy_name: str, heterogeneity: Heterogeneity):
        self._store = store
        self.service = service
        self.mode = mode
        self.lock = threading.Lock()
        self.command = Command()
        store.set(Keys.hetero(0), json.dumps(heterogeneity.to_dict()))
        store.set(Keys.policy(0), PolicyChange(mode, policy_name).encode())
        self._write()

    def set_pipeline_ids(self, n: int) -> None:
        """Publish how many pipeline ids the run has handed out (stage 0's tail rule looks at all of them)."""
        with self.lock:
            self._store.set(Keys.PIPELINE_IDS, str(n))

    def change_members(self, change: MembershipChange) -> int:
        """Publish one change of the pipelines present (a join or a leave) as the next version; returns it."""
        with self.lock:
            version = self.command.members + 1
            self._store.set(Keys.members(version), change.encode())
            self._write(members=version)
        return version

    def _write(self, **changes) -> None:
        # readers on several connections keep the reading with the highest sequence number
        self.command = self.command.next(**changes)
        self._store.set(Keys.CTL, self.command.encode())

    @property
    def paused(self) -> bool:
        return self.command.pause

    def close(self) -> None:
        """Drop the store (the run's cleanup: its listener closes with the last reference)."""
        self._store = None

    def set_heterogeneity(self, heterogeneity: Heterogeneity) -> int:
        """Publish ``heterogeneity`` as the next version; returns the version."""
        with self.lock:
            version = self.command.hetero + 1
            self._store.set(Keys.hetero(version), json.dumps(heterogeneity.to_dict()))
            self._write(hetero=version)
        return version

    def set_policy(self, params: dict, name: str) -> None:
        """The group service takes the new parameters; a static mode moves to scheduled groups."""
        with self.lock:
            self.service.set_policy(params, name)
            if self.mode != SWITCHED_MODE:
                version = self.command.policy + 1
                self._store.set(Keys.policy(version), PolicyChange(SWITCHED_MODE, name).encode())
                self._write(policy=version)
                self.mode = SWITCHED_MODE

    def pause(self, paused: bool) -> None:
        with self.lock:
            self.service.pause(paused)
            self._write(pause=bool(paused))

    def recut(self, change: CutChange, pause: bool = False) -> int:
        """Publish ``change`` as the next cut version (with ``pause``, the run paused in the same write: a coupled
        policy takes a re-cut in a pause); returns the version."""
        with self.lock:
            version = self.command.cut + 1
            self._store.set(Keys.cut(version), change.encode())
            if pause:
                self.service.pause(True)
            self._write(cut=version, pause=True if pause else self.command.pause)
        return version

    def stop(self) -> None:
        """The group service first: pipelines under a group policy take the stop from their groups' answers
        (the store's flag is their fallback), so the members of a round stop together."""
        try:
            self.service.stop()
        except Exception:  # the service or the run is already gone
            pass
        try:
            with self.lock:
                self._write(stop=True)
        except Exception:  # the store is gone: the run already ended
            pass


class Steering:
    """The calls that steer a running :class:`~sdpipe.Run` (its public control methods)."""

    def _record(self, what: str, **fields) -> None:
        self._inbox.add(events.control(what, time.time() - self.t0, applied_by="driver", **fields))

    def _require_running(self, what: str) -> None:
        if not self._done.is_set() and not self._launched.is_set():
            self._wait_launched(what)
        if self._done.is_set() or self._store is None:
            raise RuntimeError(f"{what}: run {self.run_id} has already ended ({self.status})")

    def set_heterogeneity(self, heterogeneity: Optional[Heterogeneity] = None, **fields) -> None:
        """Replace the emulated heterogeneity; every worker takes it up at its next step boundary.

        ``run.set_heterogeneity(sdpipe.Heterogeneity(slowdown={3: 4.0}))`` or
        ``run.set_heterogeneity(slowdown={3: 4.0})``; None (or no argument) removes it.
        """
        if heterogeneity is not None and fields:
            raise ValueError("heterogeneity: pass a Heterogeneity or its fields, not both")
        if heterogeneity is None:
            heterogeneity = Heterogeneity(**fields)
        if not isinstance(heterogeneity, Heterogeneity):
            raise ValueError(f"heterogeneity: must be a sdpipe.Heterogeneity, got {type(heterogeneity).__name__}")
        heterogeneity.check_workers(self._members.ids, self.config.stages)  # pipelines added while running included
        self._require_running("set_heterogeneity")
        version = self._control.set_heterogeneity(heterogeneity)
        self.heterogeneity = heterogeneity
        self._record("heterogeneity", version=version, heterogeneity=heterogeneity.to_dict())

    def shape(self, host: Optional[int] = None, *, pipeline: Optional[int] = None, bandwidth=..., cpu=...) -> dict:
        """Limit a host's link and CPU by the kernel while the run goes on (on :class:`sdpipe.hosts.EmulatedHosts`).

        The host is ``host`` (its index) or the one ``pipeline``'s workers run
        on.  ``bandwidth``: bytes/s each way (a token bucket on its link);
        ``cpu``: cores (a quota of its cgroup); None lifts a limit, an argument
        left out keeps it.  Unlike :meth:`set_heterogeneity` (slept, per
        worker) this shapes the host: every process on it, all its traffic.
        Recorded as a ``control`` event (``what="shaped"``); returns the host's
        shaping now.
        """
        hosts = self._emulated
        if hosts is None:
            raise ValueError(
                "shape: needs a run on emulated hosts (cluster=sdpipe.hosts.EmulatedHosts(...)); "
                "use set_heterogeneity for slept slowdowns on any cluster"
            )
        if (host is None) == (pipeline is None):
            raise ValueError("shape: pass one of host (an index) or pipeline (the host its workers run on)")
        self._require_running("shape")
        on: dict = {}  # host index -> pipelines with a worker there
        for rank, addr in enumerate(self._workers):
            on.setdefault(hosts.host_of(addr), set()).add(rank // self.config.stages)
        if pipeline is not None:
            if not is_integer(pipeline) or not 0 <= pipeline < self.config.pipelines:
                raise ValueError(f"pipeline: must be 0..{self.config.pipelines - 1}, got {pipeline!r}")
            where = sorted(h for h, ps in on.items() if pipeline in ps)
            if len(where) != 1:
                raise ValueError(
                    f"pipeline: pipeline {pipeline}'s workers run on hosts {where}; shape one host= at a time"
                )
            host = where[0]
        now = hosts.shape(host, bandwidth=bandwidth, cpu=cpu)
        self._record(
            "shaped",
            host=host,
            address=hosts.addresses[host],
            pipelines=sorted(on.get(host, ())),
            bandwidth=now["bandwidth"],
            cpu=now["cpu"],
        )
        return now

    def set_policy(self, policy: Optional[str] = None, **params) -> None:
        """Switch the synchronization policy and/or change its parameters while training.

        ``policy`` is "sdpipe", "allreduce" or "none" (a run started with "ps" or
        "adpsgd" keeps it, as their servers live for the whole run); ``params`` are fields of
        :class:`sdpipe.core.scheduler.SchedulerPolicy` (``staleness``, ``max_group``,
        ``window_init``, ``window_min``, ``window_max``, ...).  Every worker takes
        the change up at its next step boundary, replicas that synchronize
        together at the same step.  A run that started with the static
        ``allreduce`` or ``none`` moves to scheduled groups; from then on
        "allreduce" means every replica averages with all others after every step.
        Out of ``none`` (whose pipelines may be an epoch apart: an epoch ends without a global sync) every
        pipeline takes the switch from one epoch on, the latest any of them is in when the first one sees it,
        so that their first global sync ends the same epoch.
        """
        name = policy or self.policy
        if not record(name).live or not record(self.config.policy).live:
            which = name if not record(name).live else self.config.policy
            raise ValueError(
                f"policy: {which!r} cannot be switched to or from while training; live switches are "
                f"between {', '.join(LIVE_POLICIES)}"
            )
        base = self.scheduler_policy if policy is None or policy == self.policy else record(name).scheduler
        new = base.updated(**params)
        D = self._members.ids  # the pipeline ids handed out, added ones included
        if new.max_group is not None and new.max_group > D:
            raise ValueError(f"policy.max_group: {new.max_group} exceeds the {D} pipelines; allowed 1..{D} or None")
        self._require_running("set_policy")
        self._control.set_policy(new.to_dict(), name)
        self.policy, self.scheduler_policy = name, new
        params = {k: (None if v == float("inf") else v) for k, v in new.to_dict().items()}
        self._record("policy", policy=name, params=params)

    def recut(self, cuts, wait: bool = True, timeout: Optional[float] = None) -> tuple:
        """Move layers between the stages of every pipeline while the run trains; returns the new cut.

        ``cuts``: the cut points (the start layer of stages 1..S-1), ``"params"`` (balanced by parameter count,
        the default cut) or ``"time"`` (by each layer's forward and backward time measured on the driver, as
        ``cuts="time"``).  Every stage of a pipeline takes it at one step boundary, an asynchronous schedule
        drained first: the moved layers' weights and optimizer state go with them, and the layouts of what crosses
        each boundary are probed anew.  No averaging mixes the two cuts: under ``allreduce`` the run is paused for
        the re-cut (its replicas hold at the same step) and resumed after; under ``sdpipe`` every pipeline takes it
        right after the next global sync (an epoch's end, every ``sync_every`` epochs), whose members agree on it;
        under ``none`` each pipeline takes it at its next step boundary.  With ``wait`` it returns once every
        worker took it (at most ``timeout`` seconds, by default the run's ``timeout``; a ``TimeoutError`` says it is
        still to be taken), else at once.  Recorded as ``control`` events ``what="recut"``: the driver's, and each
        worker's with the layers it sent and received.  Checked in one line before anything moves: the cut, the
        model (an ``nn.Sequential``), the policy (not ``ps`` or ``adpsgd``, whose servers and peers hold a stage's
        weights for the whole run), a pipeline joining, a policy switch or another re-cut not yet taken up, a
        wait that a paused run under ``sdpipe`` would never end.
        """
        from sdpipe.core.partition import cut_points
        from sdpipe.driver.layers import time_cut

        if not self._from_sequential:
            raise ValueError("recut: the model was given as a list of stage modules; only an nn.Sequential is re-cut")
        S = self.config.stages
        layers = self._layers()
        allowed = (
            f"'params', 'time' or {S - 1} cut points in 1..{len(layers) - 1} (the start layer of stages 1..{S - 1})"
        )
        if isinstance(cuts, str):
            if cuts not in ("params", "time"):
                raise ValueError(f"cuts: must be {allowed}, got {cuts!r}")
        elif not isinstance(cuts, (list, tuple)) or not all(is_integer(c) for c in cuts):
            raise ValueError(f"cuts: must be {allowed}, got {cuts!r}")
        else:
            cuts = [int(c) for c in cuts]
        if timeout is not None:
            number("timeout", timeout, 0.0)
        mode = of_mode(self._control.mode) if self._control is not None else record(self.config.policy)
        if not mode.recut:
            raise ValueError(
                f"recut: policy {self.policy!r} keeps a stage's weights in servers or peers for the whole run; a run "
                f"is re-cut under {', '.join(names(recut=True))}"
            )
        if cuts != "time":
            cuts = tuple(cut_points(layers, S, None if cuts == "params" else cuts))
        self._require_running("recut")
        if cuts == "time":
            cuts = tuple(time_cut(self._layer_costs(), S))
        return self._recut(cuts, wait=wait, timeout=timeout)

    def _recut(
        self, cuts: tuple, wait: bool = True, timeout: Optional[float] = None, reason: Optional[str] = None
    ) -> tuple:
        """A checked cut made (see :meth:`recut`; ``reason``: an automatic re-cut's, in its record)."""
        import dataclasses

        from torch import nn

        from sdpipe.core.partition import partition
        from sdpipe.driver.train import _probe_layouts

        if cuts == tuple(self.cuts):
            return cuts
        if self._cut_pending():
            raise RuntimeError("recut: another re-cut is still being taken up; re-cut once it has been")
        joining = sorted(self._members.joining)
        if joining:
            raise RuntimeError(f"recut: pipeline {joining[0]} is joining the run; re-cut once it has joined")
        pending = self._policy_pending()
        if pending:
            raise RuntimeError(f"recut: {pending}; re-cut once every pipeline has taken it")
        mode = of_mode(self._control.mode)
        at_sync = mode.exchange == "groups" and not mode.coupled  # taken after the next global sync
        if wait and at_sync and self.paused:
            raise ValueError(
                f"recut: under {self.policy!r} the pipelines take a re-cut after their next global sync, which a "
                "paused run does not reach; resume first, or pass wait=False"
            )
        if not self._recut_lock.acquire(blocking=False):
            raise RuntimeError("recut: another re-cut is still being taken up; re-cut once it returned")
        try:
            S = self.config.stages
            modules = [copy.deepcopy(m) for m in partition(nn.Sequential(*self._layers()), S, cuts)]
            layouts, _ = _probe_layouts(modules, self._probe[0])
            previous = tuple(self.cuts)
            paused_here = mode.coupled and not self.paused
            start = time.monotonic()
            version = self._control.recut(CutChange(cuts, layouts), pause=paused_here)
            # the run's cut from now on (every worker takes it; a pipeline that joins starts from it)
            self._cuts_by_version[version] = cuts
            self.config = dataclasses.replace(self.config, cuts=cuts)
            self._stage_modules = modules
            self._spec = dataclasses.replace(
                self._spec, stage_modules=modules, layouts=layouts, cuts=cuts, cut_version=version,
                config=self.config.to_dict(),
            )  # fmt: skip
            fields = {"reason": reason} if reason else {}
            try:
                if wait or paused_here:
                    self._await_recut(version, self.config.timeout if timeout is None else timeout)
                    fields["seconds"] = round(time.monotonic() - start, 3)
            finally:
                if paused_here and not self._done.is_set():
                    self._control.pause(False)
                self._record("recut", cuts=list(cuts), previous=list(previous), version=version, **fields)
        finally:
            self._recut_lock.release()
        return cuts

    def _layers(self) -> list:
        """The layers of the model (an ``nn.Sequential``) in order, as its stage modules hold them."""
        return [layer for m in self._stage_modules for layer in m]

    def _layer_costs(self) -> list:
        """Each layer's measured cost (:func:`sdpipe.driver.layers.measure`), timed at the first re-cut by time
        where the run was not cut by time."""
        if self.layer_costs is None:
            from sdpipe.driver.layers import measure

            sample, targets, loss_fn = self._probe
            self.layer_costs = measure(self._layers(), sample, targets, loss_fn)
        return self.layer_costs

    def _policy_pending(self) -> Optional[str]:
        """What a live policy switch still waits for (every present worker's ``control`` record of it), or None."""
        version = self._control.command.policy
        if version == 0:
            return None
        took = {
            (e["pipeline"], e["stage"])
            for e in self._inbox.all()
            if e.get("kind") == "control" and e.get("what") == "policy" and e.get("version") == version
        }
        if all((p, s) in took for p in self.pipelines for s in range(self.config.stages)):
            return None
        return f"the switch to policy {self.policy!r} is still being taken up"

    def _not_taken(self, version: int) -> list:
        """The ranks of the pipelines present that have not taken re-cut ``version`` yet (all of them once the run
        ended: its store went with it)."""
        S = self.config.stages
        ranks = [p * S + s for p in self.pipelines for s in range(S)]
        store = self._run_store
        if store is None:
            return ranks
        return [r for r in ranks if not store.check([Keys.cut_done(version, r)])]

    def _cut_pending(self) -> bool:
        """Whether the last re-cut published is not yet taken by every worker of the pipelines present."""
        version = self._control.command.cut
        return version > 0 and bool(self._not_taken(version))

    def _await_recut(self, version: int, timeout: float) -> None:
        """Until every worker of the pipelines present took re-cut ``version`` (bounded)."""
        deadline = time.monotonic() + timeout
        while True:
            missing = self._not_taken(version)
            if not missing:
                return
            if self._done.is_set() or self._run_store is None:
                raise RuntimeError(
                    f"recut: run {self.run_id} ended ({self.status}) before every worker took the re-cut"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"recut: workers {missing} (rank = pipeline x stages + stage) did not take the re-cut within "
                    f"{timeout:g} s; it stays asked for, and they take it as the policy lets them"
                )
            time.sleep(0.05)

    def scheduler_state(self) -> dict:
        """A snapshot of the group service's state for this run (rounds, windows, disjoint sets)."""
        self._require_running("scheduler_state")
        return self._control.service.state()

    def stop(self) -> bool:
        """Ask every pipeline to stop at its next step boundary (pipelines that sync together stop together).

        Under ``sdpipe`` (and the live presets) the group service says so in
        its answers, the members of a round stop after it, and the stop ends
        with a global sync, so every stage's replicas end identical.  Returns
        False when the run had already ended (nothing to stop), else True; a
        run still starting stops at its first step.
        """
        if self._done.is_set():
            return False
        self._request_stop()
        self._record("stop")
        return True

    def _request_stop(self) -> None:
        self._stop_requested = True
        control = self._control
        if not self._done.is_set() and self._launched.is_set() and control is not None:
            control.stop()

    def pause(self) -> None:
        """Hold every pipeline at its next step boundary until :meth:`resume` (or :meth:`stop`).

        Replicas that synchronize every step pause at the same step.  Waits do
        not time out while the run is paused.
        """
        self._set_pause(True)

    def resume(self) -> None:
        """Let a paused run go on."""
        self._set_pause(False)

    def _set_pause(self, paused: bool) -> None:
        what = "pause" if paused else "resume"
        self._require_running(what)
        self._control.pause(paused)
        self._record(what)

    @property
    def paused(self) -> bool:
        return self._control is not None and self._control.paused
