"""A discrete-event simulator of pipeline-parallel training on the real scheduler core.

``sdpipe.simulate(...)`` replays S stages x D pipelines step by step in simulated
time: each pipeline's step costs what the schedule plan costs with per-action
costs (``sdpipe.core.schedule.dry_run``) scaled by the same
:class:`~sdpipe.Heterogeneity` the runtime applies; after its step every
worker is ready for its group, and the groups come from the very
:class:`~sdpipe.core.scheduler.GroupScheduler` the group service runs.  A group
costs a scheduler round trip plus an all-reduce of the stage's weights (``Network.allreduce``: the cheaper of
a ring and a tree, or the ring).
A convergence proxy (one quadratic per worker, averaged with its groups)
shows the effect of stale mixing.

The simulation is a timeline of ``(kind, data)`` events: a heap of the times that hold any and, per time, its
events in the order they were pushed (ties go first come, first served); each kind is handled by its own
method of ``_Simulation``, and the scheduler core's deadlines come in between them::

    kind    data                  handler
    start   p                     _on_start   pipeline p takes a batch: its step's spans and a ``ready`` per
                                              stage at the step's end (no batch of its epoch left: its epoch ends)
    ready   (p, s, step)          _on_ready   worker (p, s) stepped its optimizer; it syncs as its policy says
    ask     (p, s, step)          _on_ask     overlap: a ready signal that waited for the last averaging
    global  p                     _on_global  p's workers join the epoch's global sync (through the core)
    synced  (p, s, step)          _on_synced  (p, s)'s sync is done; once all of p's are, p's next ``start``
    epoch   p                     _on_epoch   every stage of p ended the epoch's global sync: its next epoch
    pushed  (p, s, delta, kind)   _on_pushed  ps: a push reached stage s's server; it answers what its bound lets go
    paired  (p, s, step, q, t)    _on_paired  adpsgd: active p's exchange with passive q ended
    (tick)  deadline              _on_tick    the core's deadline came first: windows that ran out close
    member  (what, p)             _on_member  the trace: pipeline p "leave"s (lost to the core, its events dropped)
                                              or "join"s (a live replica's state, then its next ``start``)

A group the core decides ends at ``closed + round trip + slowest link delay + ring
all-reduce`` and averages its members' proxies (weighted by progress under
``weighting="progress"``).  For example, with 2 pipelines and a 1 ms round trip,
``Group(stage=0, members=(0, 1), closed=0.010)`` of 4e5-byte weights on 1e9 B/s and
50 us latency ends at 0.010 + 0.001 + 2 x 1/2 x 4e5/1e9 + 2 x 50e-6 = 0.0115 s.

The result is a :class:`sdpipe.RunResult` with the same event records and
history fields as a real run (times are simulated seconds; every record is
made by :mod:`sdpipe.wire.events`), so ``Dashboard(result)`` replays a simulated run.

Every policy: ``sdpipe`` and ``allreduce`` through the core; ``ps`` with a server per stage whose link carries
every push and pull of its stage, answering by the runtime's staleness rule; ``adpsgd`` with random pairs of an
active and a passive worker, the passive one serving one exchange at a time; ``none``.  ``epochs`` epochs, a
global sync every ``sync_every`` of them and after the last.  ``trace=`` makes pipelines leave and come back
at given times (under ``sdpipe`` and ``none``): a leaving pipeline is lost to the core (``Lost``) and its work
in flight is dropped; a returning one takes a live replica's state (the proxy's point, after the time its
weights take over the network) and the core hears ``Join`` with that donor; :func:`spot_trace` draws such a
trace from preemption and return rates, as spot instances behave.  :func:`calibrate` measures the costs in a
real run's events; ``docs/simulator.md`` has the model and its agreement with real runs.
"""

from __future__ import annotations

import gc
import math

from sdpipe.config import TrainConfig, config_keywords
from sdpipe.core.checks import integer, is_number
from sdpipe.core.policies import names
from sdpipe.simulation.calibrate import Calibration, calibrate, cores_of, others_cores
from sdpipe.simulation.costs import Costs, Network, ring_allreduce_seconds, share_cores, stretch_compute
from sdpipe.simulation.proxy import Proxy
from sdpipe.simulation.trace import _check_trace, spot_trace

__all__ = [
    "SIMULATED_FIELDS",
    "SIM_POLICIES",
    "Calibration",
    "Costs",
    "Network",
    "Proxy",
    "calibrate",
    "cores_of",
    "others_cores",
    "ring_allreduce_seconds",
    "simulate",
    "spot_trace",
]

SIM_POLICIES = names(simulated=True)
#: the TrainConfig fields a simulation models (besides stages and pipelines); the others (the optimizer, the
#: device, the cut, ...) have no part in simulated time, and ``simulate`` does not take them
SIMULATED_FIELDS = (
    "policy",
    "schedule",
    "microbatches",
    "update_every",
    "batch_size",
    "epochs",
    "sync_every",
    "heterogeneity",
    "scheduler",
    "seed",
)
#: the network and the proxy a simulation assumes when given none (frozen values: one instance serves every call)
DEFAULT_NETWORK = Network()
DEFAULT_PROXY = Proxy()


@config_keywords(only=SIMULATED_FIELDS)
def simulate(
    stages: int,
    pipelines: int,
    *,
    costs: Costs,
    steps: int = 100,
    network: Network = DEFAULT_NETWORK,
    proxy: Proxy = DEFAULT_PROXY,
    record: bool = True,
    trace=None,
    cores=None,
    **options,
):
    """Simulate ``epochs`` epochs of ``steps`` steps' worth of batches per pipeline; returns a
    :class:`sdpipe.RunResult`.

    The run's fields are :func:`sdpipe.train`'s, with the same defaults and checks (a ``TrainConfig``); the
    simulation's own parts are the ``costs`` of each stage, the ``network``, the convergence ``proxy`` and
    ``steps``.  Under ``allreduce`` every pipeline takes ``steps`` steps per epoch; under the other policies the
    ``steps x pipelines`` batches of an epoch go to whichever pipeline asks next (work follows speed).  Every
    ``sync_every`` epochs, and after the last, the epoch ends with a global sync (none under ``none``).
    ``record=False`` keeps only the history (for very large simulations).  ``trace``: ``(seconds, "leave" |
    "join", pipeline)`` changes of the pipelines present (see :func:`spot_trace`); pipelines absent at the end
    are in ``result.lost``, and ``control`` records ``left`` / ``joined`` mark the changes.

    ``cores``: the cores every worker shares (a laptop's, a host's: a number, 1.5 for a machine whose other
    processes keep half a core busy), or None for a core (a device) of its own.  With it, the costs are a worker's
    alone (``calibrate(result, shared=True)`` measures them in CPU seconds) and its compute is stretched, the
    kernel sharing the cores among the workers that compute at each instant and the other threads of their
    processes (``costs.cpu``); ``result.stretch`` says by how much on the whole (:func:`share_cores`).  For
    example, 8 workers of a lock-step run that all compute at once on 2 cores compute about 4x slower than
    alone, and not at all slower while a sleeping straggler holds them.
    """
    config = TrainConfig(stages=stages, pipelines=pipelines, **options)
    if config.policy not in SIM_POLICIES:
        raise ValueError(
            f"policy: {config.policy!r} is not one of {', '.join(SIM_POLICIES)} (the simulator's policies)"
        )
    for name, value, kind in (("costs", costs, Costs), ("network", network, Network), ("proxy", proxy, Proxy)):
        if not isinstance(value, kind):
            raise ValueError(f"{name}: must be a sdpipe.{kind.__name__}, got {type(value).__name__}")
    if costs.stages != stages:
        raise ValueError(f"costs: has {costs.stages} stages, the simulation {stages}")
    integer("steps", steps)
    changes = _check_trace(trace, pipelines, config.policy)
    if cores is not None and not (is_number(cores) and 0 < cores < math.inf):
        raise ValueError(f"cores: must be a number > 0 (the cores the workers share) or None, got {cores!r}")
    from sdpipe.simulation.engine import _Simulation  # the engine loads with the first simulation, not with the costs

    def run(stretch: float, records: bool = record):
        stretched = costs if stretch == 1.0 else stretch_compute(costs, stretch)
        sim = _Simulation(config, costs=stretched, network=network, proxy=proxy, steps=steps, record=records)
        result = sim.run(changes).result()
        result.stretch = stretch
        return result

    collecting = gc.isenabled()
    gc.disable()  # millions of records and no cycles among them: the cyclic collector would scan them over and over
    try:
        if cores is None:
            return run(1.0)
        result = share_cores(run, costs, cores, config, network)
        if not record:
            result.events = []
        return result
    finally:
        if collecting:
            gc.enable()
