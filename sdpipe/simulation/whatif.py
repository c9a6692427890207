"""What a run would do under another setting, from its own records: the simulator on the costs it measured.

:func:`predict` calibrates the simulator on a window of a run's records (``calibrate(shared=True)``: the
workers' CPU seconds, their network, on the cores the run's workers share) and simulates one epoch of the run's
configuration as it is now, with the changes asked (another policy, schedule, heterogeneity, number of pipelines
or micro-batches).  :func:`what_if` asks it for every such change at once and sets the answers beside what the
run measured::

    >>> print(run.what_if())                                     # doctest: +SKIP
    measured: 1,146 samples/s over the last 15 s
    change                        simulated  vs now   expected  time left
    as it runs                        1,496   1.00x      1,146      17 s
    policy sdpipe                     3,491   2.33x      2,674       7 s
    ...

The simulated figure for the run as it runs shows the model's own error (here the machine was busy with other
work too): a change is best read against it, ``vs now``, and ``expected`` is the measured figure times that
ratio.  Time left: the epochs' samples still to train at the expected rate (the simulated one before any epoch
ended), plus each epoch's evaluation as long as the run's last ones took.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass
from typing import Optional

from sdpipe.config import LIVE_POLICIES, SCHEDULE_NAMES, Heterogeneity, TrainConfig
from sdpipe.core.checks import is_number

__all__ = ["Prediction", "WhatIf", "predict", "what_if"]

#: the changes :func:`predict` takes, and what each must be
CHANGES = ("policy", "schedule", "heterogeneity", "pipelines", "microbatches")
#: seconds of records a prediction calibrates on by default
WINDOW = 30.0


@dataclass(frozen=True)
class Prediction:
    """One simulated setting: what changed, the predicted samples/s (all pipelines together, evaluation apart),
    the seconds the run would still take, how much the shared cores stretch its compute, the configuration, the
    cores' worth it was simulated on."""

    change: str
    samples_per_s: float
    time_left: Optional[float]
    stretch: float
    config: TrainConfig
    cores: Optional[float] = None


@dataclass(frozen=True)
class WhatIf:
    """:func:`what_if`'s answers: ``measured`` samples/s in the window, ``predictions`` (the first is the run as it
    runs), the window's ``since`` and ``until`` on the run's clock."""

    measured: Optional[float]
    predictions: list
    since: float
    until: float
    cores: Optional[float] = None
    """The cores' worth the workers got in the window, the predictions' (see :func:`predict`'s ``cores``)."""
    machine_cores: Optional[float] = None
    """The cores of the machines the workers run on."""
    others: Optional[float] = None
    """The cores' worth the processes beside the workers took in the window (measured: the machine's busy CPU
    less the workers'; :func:`sdpipe.simulation.others_cores`), None where the records do not say."""
    cores_from: str = "measured"
    """How :attr:`cores` was found: "measured" (the machine's less :attr:`others`), "fitted" (asked for, or where
    the records do not say what the other processes took: the cores on which the run as it runs simulates at its
    measured samples/s), "machine" (all of them, asked for) or "given" (a number asked for)."""

    def __getitem__(self, change: str) -> Prediction:
        for p in self.predictions:
            if p.change == change:
                return p
        raise KeyError(f"change: no prediction {change!r}; there are {', '.join(p.change for p in self.predictions)}")

    def ratio(self, change: str) -> float:
        """The change's predicted samples/s over the prediction for the run as it runs."""
        base = self.predictions[0].samples_per_s
        return self[change].samples_per_s / base if base > 0 else math.nan

    def expected(self, change: str) -> Optional[float]:
        """The samples/s to expect after ``change``: the measured figure times the model's :meth:`ratio` (the
        model's error on the run as it runs, a machine busy with other work for one, cancels out), or None before
        the run measured any."""
        return None if self.measured is None else self.measured * self.ratio(change)

    def table(self) -> str:
        span = self.until - self.since
        head = (
            f"measured: {self.measured:,.0f} samples/s over the last {span:.0f} s"
            if self.measured is not None
            else "measured: no epoch ended in the window yet"
        )
        if self.cores is not None and self.machine_cores:
            head += f"; the workers got {self.cores:.1f} of the {self.machine_cores:g} cores"
            if self.cores_from == "measured":
                head += f" (other processes took {self.others:.1f}, measured)"
            else:
                head += {"fitted": " (fitted)", "machine": " (all of them, as asked)"}.get(
                    self.cores_from, " (as given)"
                )
        lines = [
            head,
            f"{'change':<28} {'simulated':>10} {'vs now':>7} {'expected':>10} {'time left':>10}",
        ]
        for p in self.predictions:
            expected = self.expected(p.change)
            left = "-" if p.time_left is None else f"{p.time_left:,.0f} s"
            shown = "-" if expected is None else f"{expected:,.0f}"
            lines.append(
                f"{p.change:<28} {p.samples_per_s:>10,.0f} {self.ratio(p.change):>6.2f}x {shown:>10} {left:>10}"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def _repr_pretty_(self, p, cycle) -> None:  # IPython
        p.text(self.table())


@dataclass
class Source:
    """What a prediction reads: the run's records, its configuration as it runs now, the cores its workers share,
    the batches of one epoch (all pipelines together) and the samples it still has to train."""

    events: list
    config: TrainConfig
    cores: int
    batches_per_epoch: int
    samples_left: Optional[float] = None
    epochs_left: int = 0
    ids: Optional[list] = None
    """The run's ids of the simulated pipelines 0, 1, ... (None: the same; see :func:`renumbered`)."""


#: the fields of a record that hold pipeline ids (lists, or one id)
ID_LISTS, ID_ONE = ("group", "connected"), ("server",)


def renumbered(source: Source, present: list) -> Source:
    """``source`` as the simulator takes a run: its pipelines numbered 0..D-1.  A run that a pipeline left (or
    one joined with a new id) has other ids: ``present`` (the pipelines taking part, in order) become 0, 1, ...,
    their records and heterogeneity entries with them; the records of the others are left out."""
    present = sorted(present)
    if not present or (present == list(range(len(present))) and len(present) == source.config.pipelines):
        return source
    index = {p: i for i, p in enumerate(present)}

    def one(e: dict) -> Optional[dict]:
        p = e.get("pipeline")
        if p is None and e.get("kind") == "epoch":
            p = (e.get("metrics") or {}).get("pipeline")
        if p is not None and p not in index:
            return None
        out = dict(e)
        if e.get("pipeline") is not None:
            out["pipeline"] = index[e["pipeline"]]
        if e.get("kind") == "epoch" and isinstance(e.get("metrics"), dict) and "pipeline" in e["metrics"]:
            out["metrics"] = {**e["metrics"], "pipeline": index[p]}
        for f in ID_LISTS:
            if isinstance(e.get(f), (list, tuple)):
                out[f] = [index[q] for q in e[f] if q in index]
        for f in ID_ONE:
            if isinstance(e.get(f), int) and not isinstance(e.get(f), bool) and e[f] in index:
                out[f] = index[e[f]]
        return out

    h = source.config.heterogeneity
    if h is not None:
        h = _remapped(h, index)
    config = dataclasses.replace(source.config, pipelines=len(present), heterogeneity=h)
    events = [x for x in map(one, source.events) if x is not None]
    return dataclasses.replace(source, events=events, config=config, ids=present)


def last_end(events: list) -> float:
    """The latest end of a record (0 without any)."""
    return max((e["end"] for e in events if e.get("end") is not None), default=0.0)


def _window(events: list, since: Optional[float], until: Optional[float]) -> tuple:
    """The records inside [since, until] (default: the last :data:`WINDOW` seconds to the last record's end)."""
    hi = last_end(events) if until is None else until
    lo = hi - WINDOW if since is None else since
    return [e for e in events if e.get("start") is not None and lo <= e["start"] and e["end"] <= hi], lo, hi


def measured_rate(events: list) -> Optional[float]:
    """Samples/s of all pipelines together over the epochs that ended among ``events`` (each pipeline's epoch:
    its samples over its time, evaluation apart; summed over the pipelines of each epoch; the median over the
    epochs), or None when no epoch ended there."""
    by_epoch: dict = {}
    for e in events:
        if e.get("kind") == "epoch":
            m = e["metrics"]
            by_epoch.setdefault(m["epoch"], []).append(m.get("samples_per_s", 0.0))
    if not by_epoch:
        return None
    return statistics.median(sum(v) for v in by_epoch.values())


def _eval_seconds(events: list) -> float:
    """Seconds an epoch's evaluation held a pipeline, the median of the evaluation spans (0 without any)."""
    spans = [e["end"] - e["start"] for e in events if e.get("kind") == "eval"]
    return statistics.median(spans) if spans else 0.0


class _Model:
    """The simulator calibrated once on a window of a run's records, for any number of predictions."""

    def __init__(self, source: Source, since, until, seed: int = 0):
        from sdpipe.driver.result import RunResult
        from sdpipe.simulation import calibrate, others_cores

        window, lo, hi = _window(source.events, since, until)
        if not any(e.get("kind") == "forward" and "cpu" in e for e in window):
            raise ValueError(
                f"window: no forward span with its CPU time from {lo:.1f} s to {hi:.1f} s to measure the costs on "
                "(has the run trained yet?)"
            )
        self.source, self.window, self.since, self.until, self.seed = source, window, lo, hi, seed
        run = RunResult(models=[], history=[], events=window, config=source.config, wall_time=hi - lo)
        self.costs, self.network, _ = calibrate(run, shared=True)
        self.measured = measured_rate(window)
        self.cores = source.cores or None
        self.others = others_cores(run)

    def rate(self, target: TrainConfig, cores) -> tuple:
        """(samples/s, stretch) of one simulated epoch of ``target`` on ``cores``."""
        from sdpipe.simulation import simulate

        D = target.pipelines
        sim = simulate(
            target.stages,
            D,
            costs=self.costs,
            network=self.network,
            steps=max(1, self.source.batches_per_epoch // D),
            epochs=1,
            record=False,
            cores=cores,
            seed=self.seed,
            **{f: getattr(target, f) for f in ("policy", "schedule", "microbatches", "batch_size", "heterogeneity")},
        )
        return sum(h["samples_per_s"] for h in sim.history), sim.stretch

    def fit_cores(self):
        """The cores' worth the workers got: the number of cores (at most the machine's) on which the run as it
        runs simulates at the samples/s it measured (other processes, the Dask scheduler and the notebook's
        among them, take the rest).  The machine's cores when nothing was measured, or when even those simulate
        slower than measured."""
        if self.cores is None or not self.measured:
            return self.cores
        config = self.source.config
        hi = float(self.cores)
        if self.rate(config, hi)[0] <= self.measured:
            return hi
        lo = hi * FIT_LOWEST
        if self.rate(config, lo)[0] >= self.measured:
            return lo
        for _ in range(FIT_STEPS):  # the rate grows with the cores
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if self.rate(config, mid)[0] < self.measured else (lo, mid)
        return (lo + hi) / 2

    def measured_cores(self):
        """The machine's cores less what the processes beside the workers took in the window (see
        :func:`sdpipe.simulation.others_cores`); None where the records do not say."""
        if self.cores is None or self.others is None:
            return None
        return max(self.cores * FIT_LOWEST, self.cores - self.others)

    def choose_cores(self, how) -> tuple:
        """(cores, how they were found) for :func:`predict`'s ``cores``."""
        if how == "measured":
            measured = self.measured_cores()
            if measured is not None:
                return measured, "measured"
            how = "fitted"
        if how == "fitted":
            return self.fit_cores(), "fitted"
        if how == "machine":
            return self.cores, "machine"
        return float(how), "given"

    def predict(self, changes: dict, cores) -> Prediction:
        config = self.source.config
        target = _changed(config, changes)
        rate, stretch = self.rate(target, cores)
        left = None
        if self.source.samples_left is not None and rate > 0:
            left = self.source.samples_left / rate + self.source.epochs_left * _eval_seconds(self.window)
        return Prediction(_name(changes, config.pipelines, self.source.ids), rate, left, stretch, target, cores)


#: the fitted cores' lowest share of the machine's, and the bisection's steps (to 1.6% of the range)
FIT_LOWEST, FIT_STEPS = 0.1, 6


def predict(source: Source, *, since=None, until=None, seed: int = 0, cores="measured", **changes) -> Prediction:
    """The simulated samples/s of ``source``'s run with ``changes`` (see :data:`CHANGES`), its costs calibrated on
    its records in [``since``, ``until``] (default: the last 30 s).

    ``cores``: the cores' worth the workers share in the simulation.  "measured" (the default): the machine's
    cores less what the processes beside the workers took in the window (the records' busy CPU: see
    :func:`sdpipe.simulation.others_cores`), or "fitted" where the records do not say (workers on more than one
    host, records without the machine's CPU); "fitted": the cores on which the run as it runs simulates at the
    samples/s it measured (what the model gets wrong is then folded into the cores); "machine": all the
    machine's cores; or a number."""
    check_cores(cores)
    for name in changes:
        if name not in CHANGES:
            raise ValueError(f"{name}: not a change a prediction takes; it takes {', '.join(CHANGES)}")
    model = _Model(source, since, until, seed)
    return model.predict(changes, model.choose_cores(cores)[0])


#: how :func:`predict` can find the cores' worth the workers share (or a number)
CORES_FROM = ("measured", "fitted", "machine")


def check_cores(cores) -> None:
    if cores in CORES_FROM or (is_number(cores) and 0 < cores < math.inf):
        return
    raise ValueError(f"cores: must be one of {', '.join(CORES_FROM)} or a number of cores > 0, got {cores!r}")


def _changed(config: TrainConfig, changes: dict) -> TrainConfig:
    """``config`` with ``changes``, checked as the run's own fields are (one-line errors)."""
    out = {}
    for name, value in changes.items():
        if name == "heterogeneity" and value is None:
            value = Heterogeneity()
        if name == "pipelines" and not (isinstance(value, int) and value >= 1):
            raise ValueError(f"pipelines: must be a whole number >= 1, got {value!r}")
        out[name] = value
    if "policy" in out and out["policy"] != config.policy:
        out["scheduler"] = None  # the other policy's own parameters
    D = out.get("pipelines", config.pipelines)
    h = out.get("heterogeneity", config.heterogeneity)
    if h is not None and D < config.pipelines:  # the pipelines left out take their heterogeneity with them
        out["heterogeneity"] = _within(h, D)
    return dataclasses.replace(config, **out)


def _within(h: Heterogeneity, pipelines: int) -> Heterogeneity:
    """``h`` without its entries for pipelines ``pipelines`` and later."""
    return _remapped(h, {p: p for p in range(pipelines)})


def _remapped(h: Heterogeneity, index: dict) -> Heterogeneity:
    """``h`` with its per-pipeline entries (a pipeline's, or a worker's ``(pipeline, stage)``) moved to pipeline
    ``index[p]``; the entries of pipelines not in ``index`` left out."""

    def keys(table):
        out = {}
        for k, v in table.items():
            p = k[0] if isinstance(k, tuple) else k
            if p in index:
                out[(index[p], k[1]) if isinstance(k, tuple) else index[p]] = v
        return out

    return dataclasses.replace(
        h, slowdown=keys(h.slowdown), compute_slowdown=keys(h.compute_slowdown), link_delay=keys(h.link_delay)
    )


def heterogeneous(h: Optional[Heterogeneity]) -> bool:
    """Whether ``h`` slows, delays or makes straggle any worker."""
    return h is not None and bool(
        any(v != 1.0 for v in h.slowdown.values())
        or any(v != 1.0 for v in h.compute_slowdown.values())
        or (h.straggle_prob > 0 and h.straggle_delay > 0)
        or any(v > 0 for v in h.link_delay.values())
    )


def _name(changes: dict, pipelines: int, ids: Optional[list] = None) -> str:
    """A change's label; ``ids``: the run's ids of the simulated pipelines (a pipeline left out is named by its id)."""
    if not changes:
        return "as it runs"
    ids = ids or list(range(pipelines))
    parts = []
    for name, value in changes.items():
        if name == "heterogeneity":
            parts.append("heterogeneity as given" if heterogeneous(value) else "no heterogeneity")
        elif name == "pipelines" and value < pipelines:
            parts.append(f"pipelines {value} (without {', '.join(str(ids[p]) for p in range(value, pipelines))})")
        else:
            parts.append(f"{name} {value}")
    return ", ".join(parts)


def what_if(source: Source, *, since=None, until=None, cores="measured") -> WhatIf:
    """Predictions for the run as it runs and for each single change: every other live policy, no heterogeneity
    (when it has some), every other schedule, one pipeline more and one fewer; with the measured samples/s.
    ``cores``: as :func:`predict`'s."""
    check_cores(cores)
    config = source.config
    variants: list = [{}]
    variants += [{"policy": p} for p in LIVE_POLICIES if p != config.policy]
    if heterogeneous(config.heterogeneity):
        variants.append({"heterogeneity": None})
    variants += [{"schedule": s} for s in SCHEDULE_NAMES if s != config.schedule]
    variants += [{"pipelines": config.pipelines + 1}]
    if config.pipelines > 1:
        variants.append({"pipelines": config.pipelines - 1})
    model = _Model(source, since, until)
    cores, how = model.choose_cores(cores)
    predictions = [model.predict(v, cores) for v in variants]
    measured, base = model.measured, predictions[0].samples_per_s
    if measured is not None and base > 0 and source.samples_left is not None:  # time left at the expected rate
        evals = source.epochs_left * _eval_seconds(model.window)
        predictions = [
            dataclasses.replace(p, time_left=source.samples_left / (measured * p.samples_per_s / base) + evals)
            if p.samples_per_s > 0
            else p
            for p in predictions
        ]
    return WhatIf(measured, predictions, model.since, model.until, cores, model.cores, model.others, how)


def check_window(last) -> None:
    if not is_number(last) or not (0 < last < math.inf):  # is_number refuses a bool
        raise ValueError(f"last: must be a number of seconds > 0, got {last!r}")
