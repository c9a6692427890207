"""The live dashboard's what-if panel: the simulator's predictions for the run (``run.what_if``) beside what it
measured, and, after each live switch of policy or heterogeneity, the prediction made just before it against what
the run then measured.

Two tables in one HTML widget, in the figure's font and colours::

    what if (the simulator on the last 30 s, at t = 42.1 s): measured 2,935 samples/s; best keeping one model:
    no heterogeneity, 4,663 samples/s expected (1.59x)
    change                 simulated  vs now  expected  time left
    as it runs                 3,656   1.00x     2,935      7.8 min
    policy sdpipe              5,567   1.52x     4,470      5.2 min
    ...
    after a switch: the prediction made just before it, against what the run measured after it
    t       switch                      before  expected (simulated)  measured after       error (simulated's)
    31.0 s  policy allreduce -> sdpipe   2,935  4,470 (5,567)         4,120 over 3 epochs  +8% (+35%)

The predictions are :meth:`sdpipe.Run.what_if`'s (every other live policy, no heterogeneity, the other schedules,
one pipeline more or fewer), the best that keeps one model (not ``policy none``, whose pipelines never average)
highlighted in the averaging's green.  A switch's line: ``run.what_if(last, until=t - BEFORE)`` for the samples/s
measured before it and the run as it ran, ``run.predict(last, until=t - BEFORE, <the change>)`` for the change
(predicted once its records up to ``t`` have arrived); then, once the run trained ``EPOCHS_AFTER`` whole epochs
that began ``SETTLE`` seconds after it (or the next switch, or the end, came first), their samples/s
(:func:`sdpipe.simulation.whatif.measured_rate`) and the errors, expected / measured - 1 and simulated / measured
- 1.

Simulating takes a good part of a second, more as the run records more, so :class:`WhatIfPanel` works in a thread of
its own (the timeline's redraws do not wait for it), at most every ``WHATIF_EVERY`` seconds and within
``WHATIF_SHARE`` of a core (measured: its thread's CPU seconds), and not while the run starts or is paused.
"""

from __future__ import annotations

import dataclasses
import html
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import ipywidgets as W

from sdpipe.config import Heterogeneity
from sdpipe.core.policies import record
from sdpipe.simulation.whatif import measured_rate
from sdpipe.widgets.style import COLORS, TEMPLATE
from sdpipe.widgets.view import LAG, emulated_text

__all__ = [
    "BEFORE",
    "EPOCHS_AFTER",
    "SETTLE",
    "WHATIF_EVERY",
    "WHATIF_SHARE",
    "Switch",
    "WhatIfPanel",
    "best",
    "epochs_after",
    "switches_html",
    "table_html",
]

#: seconds between the panel's predictions at the most often
WHATIF_EVERY = 5.0
#: the share of a core the predictions may take (the thread's CPU seconds over the time between them).  One costs
#: 0.5-2 s on a 2 x 2 run of the digits MLP (more as it records more), so it is refreshed every 10-40 s there; on
#: a machine whose cores the workers keep busy, it takes their steps about half their rate while it runs (on 2
#: cores it takes one): at a twentieth of a core the run loses some 2-3% of its steps
WHATIF_SHARE = 0.05
#: seconds after a switch before its effect is measured (the workers take it at their next step boundary)
SETTLE = 1.0
#: whole epochs after a switch its measurement waits for
EPOCHS_AFTER = 3
#: a switch at t is predicted on the records that ended by t - BEFORE (the run as it ran just before it)
BEFORE = 1e-3
#: switch lines shown, the newest first
LINES = 3
#: seconds between the thread's looks at the run (whether a prediction is due, a switch measured)
TICK = 0.5

_FONT = '"Open Sans", verdana, arial, sans-serif'  # plotly's, the figure's
_TEXT = TEMPLATE["layout"]["font"]["color"]
_HEAD = TEMPLATE["layout"]["plot_bgcolor"]
_BEST = "#E3F0E1"  # the averaging's green (COLORS["synchronization"]), light
_MUTED = "#7f8c9e"


@dataclass
class Switch:
    """One live switch of the run's policy or heterogeneity (a driver's ``control`` record), what was predicted
    for it and what it brought.

    ``before``: ``run.what_if`` over the window up to just before it (its ``measured`` samples/s and its first
    prediction, the run as it ran); ``prediction``: ``run.predict`` of the change on the same window; ``why``:
    why there is none.  ``since``, ``until``: the measurement's window after it, ``epochs`` the whole epochs
    measured there, ``measured`` their samples/s; ``settled``: measured for good."""

    at: float
    label: str
    change: dict
    before: object = None
    prediction: object = None
    why: Optional[str] = None
    since: Optional[float] = None
    until: Optional[float] = None
    epochs: list = field(default_factory=list)
    measured: Optional[float] = None
    settled: bool = False

    @property
    def predicted(self) -> bool:
        return self.prediction is not None or self.why is not None

    @property
    def simulated(self) -> Optional[float]:
        """The simulator's samples/s after the change."""
        return None if self.prediction is None else self.prediction.samples_per_s

    @property
    def as_it_ran(self) -> Optional[float]:
        """The simulator's samples/s of the run as it ran before the switch."""
        return None if self.before is None else self.before.predictions[0].samples_per_s

    @property
    def expected(self) -> Optional[float]:
        """The samples/s measured before the switch times the simulator's ratio (change over as it ran)."""
        if self.before is None or self.prediction is None:
            return None
        both = dataclasses.replace(self.before, predictions=[self.before.predictions[0], self.prediction])
        return both.expected(self.prediction.change)

    @property
    def error(self) -> Optional[float]:
        """expected / measured - 1."""
        return _error(self.expected, self.measured)

    @property
    def simulated_error(self) -> Optional[float]:
        """simulated / measured - 1."""
        return _error(self.simulated, self.measured)


def _error(predicted, measured) -> Optional[float]:
    return None if predicted is None or not measured else predicted / measured - 1


def switch_of(rec: dict, policy: str) -> Switch:
    """The :class:`Switch` of a driver's ``control`` record of a policy or heterogeneity change; ``policy``: the
    policy before it."""
    if rec["what"] == "policy":
        return Switch(rec["start"], f"policy {policy} \u2192 {rec['policy']}", {"policy": rec["policy"]})
    h = Heterogeneity.from_dict(rec["heterogeneity"])
    return Switch(
        rec["start"], f"heterogeneity \u2192 {emulated_text(rec['heterogeneity']) or 'none'}", {"heterogeneity": h}
    )


def epochs_after(records: list, since: float, until: float, pipelines) -> list:
    """The epochs that each of ``pipelines`` trained wholly in [``since``, ``until``] (its record of the epoch
    before ended at ``since`` or later, its record of this one by ``until``), in order: per epoch its records,
    ``{pipeline: record}`` (other pipelines' records of it too).  ``records``: the run's epoch records."""
    last, by_epoch = {}, defaultdict(dict)
    for e in sorted(records, key=lambda e: e["start"]):
        p = e["pipeline"]
        if last.get(p, -1.0) >= since and e["start"] <= until:
            by_epoch[e["metrics"]["epoch"]][p] = e
        last[p] = e["start"]
    return [recs for _, recs in sorted(by_epoch.items()) if set(pipelines) <= recs.keys()]


def best(w) -> object:
    """The prediction of ``w`` (a :class:`~sdpipe.simulation.whatif.WhatIf`) with the most samples/s among those
    whose policy averages the pipelines' models (not ``none``): the run as it runs when no change beats it."""
    keeps = [p for p in w.predictions if record(p.config.policy).exchange != "nothing"]
    return max(keeps, key=lambda p: p.samples_per_s, default=None)


def _n(x, f="{:,.0f}") -> str:
    return "-" if x is None else f.format(x)


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:+.0f}%"


def _duration(s) -> str:
    if s is None:
        return "-"
    if s < 100:
        return f"{s:.0f} s"
    return f"{s / 60:.1f} min" if s < 6000 else f"{s / 3600:.1f} h"


def _cell(text, *, left=False, title=None, wrap=False, style="") -> str:
    align = "left" if left else "right"
    space = "normal" if wrap else "nowrap"
    tip = f' title="{html.escape(title)}"' if title else ""
    return f"<td style='padding:1px 8px; text-align:{align}; white-space:{space};{style}'{tip}>{text}</td>"


def _head(columns: list) -> str:
    """The header row of ``columns``: (name, what it means, aligned left)."""
    cells = "".join(
        f"<th style='padding:2px 8px; font-weight:600; text-align:{'left' if left else 'right'}; white-space:nowrap'"
        f' title="{html.escape(tip)}">{html.escape(name)}</th>'
        for name, tip, left in columns
    )
    return f"<tr style='background:{_HEAD}'>{cells}</tr>"


def _box(inner: str) -> str:
    return (
        f"<div class='sdpipe-whatif' style='font-family:{html.escape(_FONT)}; color:{_TEXT}; font-size:12px; "
        f"line-height:1.45; max-width:100%; overflow-x:auto; margin:4px 0'>{inner}</div>"
    )


_TABLE = "border-collapse:collapse; font-variant-numeric:tabular-nums; margin:2px 0 6px"
#: the tables' columns: (name, what it means, aligned left)
_PREDICTION_COLUMNS = (
    ("change", "each change alone, the rest of the run as it runs now", True),
    ("simulated", "the simulator's samples/s (all pipelines, evaluation apart) on the window's costs", False),
    ("vs now", "over the simulated run as it runs: the model's own error cancels", False),
    ("expected", "the measured samples/s times vs now", False),
    ("time left", "the epochs left at the expected rate, their evaluations included", False),
)
_SWITCH_COLUMNS = (
    ("t", "when the switch was applied (the run's clock)", True),
    ("switch", "the live change", True),
    ("before", "samples/s measured in the window before it", False),
    ("expected (simulated)", "predicted just before it: measured x the simulator's ratio (its own figure)", False),
    ("measured after", f"samples/s of the first {EPOCHS_AFTER} whole epochs from {SETTLE:g} s after it", False),
    ("error (simulated's)", "expected / measured - 1 (simulated / measured - 1)", False),
)


def table_html(w, window: float, every: Optional[float]) -> str:
    """The predictions ``w`` (``run.what_if(last=window)``) as a table, the best change that keeps one model
    highlighted; ``every``: the seconds between refreshes now."""
    top = best(w)
    base = w.predictions[0]
    if top is None or top is base:
        verdict = "no change that keeps one model is predicted faster"
    else:
        verdict = (
            f"best keeping one model: <b>{html.escape(top.change)}</b>, "
            f"{_n(w.expected(top.change))} samples/s expected ({w.ratio(top.change):.2f}x)"
        )
    measured = (
        f"measured <b>{_n(w.measured)}</b> samples/s"
        if w.measured is not None
        else "no epoch ended in the window yet (expected: -)"
    )
    refreshed = f", refreshed every {every:.0f} s" if every else ""
    head = (
        f"<div style='white-space:normal; overflow-wrap:anywhere'><b>what if</b> (the simulator on the last "
        f"{window:g} s of records, at t = {w.until:.1f} s{refreshed}): {measured}; {verdict}</div>"
    )
    rows = [_head(_PREDICTION_COLUMNS)]
    for p in w.predictions:
        style, tip = f"border-top:1px solid {_HEAD};", None
        if p is top and top is not base:
            style += f" background:{_BEST}; font-weight:600; box-shadow:inset 3px 0 {COLORS['synchronization']};"
        if record(p.config.policy).exchange == "nothing":
            style += f" color:{_MUTED};"
            tip = "never averages: every pipeline trains a model of its own"
        rows.append(
            f"<tr style='{style}'>"
            + _cell(html.escape(p.change), left=True, wrap=True, title=tip)
            + _cell(_n(p.samples_per_s))
            + _cell(f"{w.ratio(p.change):.2f}x")
            + _cell(_n(w.expected(p.change)))
            + _cell(_duration(p.time_left))
            + "</tr>"
        )
    return head + f"<table style='{_TABLE}'>{''.join(rows)}</table>"


def switches_html(switches: list) -> str:
    """One line per switch, the newest first (at most ``LINES``): the prediction made just before it (the expected
    samples/s, the simulated in brackets) against the samples/s measured after it, and their errors."""
    if not switches:
        return ""
    rows = [_head(_SWITCH_COLUMNS)]
    for s in sorted(switches, key=lambda s: -s.at)[:LINES]:
        if not s.predicted:
            predicted = f"<span style='color:{_MUTED}'>once its records arrived</span>"
        elif s.prediction is None:
            predicted = f"<span style='color:{_MUTED}'>none: {html.escape(s.why)}</span>"
        else:
            predicted = f"{_n(s.expected)} ({_n(s.simulated)})"
        if s.measured is not None:
            n = len(s.epochs)
            after = f"{_n(s.measured)} over {n} epoch{'s' if n != 1 else ''}"
        elif s.settled:
            after = f"<span style='color:{_MUTED}'>no whole epoch</span>"
        else:
            after = f"<span style='color:{_MUTED}'>measuring ({len(s.epochs)} of {EPOCHS_AFTER} epochs)</span>"
        errors = f"{_pct(s.error)} ({_pct(s.simulated_error)})" if s.measured is not None else "-"
        rows.append(
            f"<tr style='border-top:1px solid {_HEAD}'>"
            + _cell(f"{s.at:.1f} s", left=True)
            + _cell(html.escape(s.label), left=True, wrap=True)
            + _cell(_n(None if s.before is None else s.before.measured))
            + _cell(predicted, wrap=s.prediction is None)
            + _cell(after, wrap=True)
            + _cell(errors)
            + "</tr>"
        )
    head = (
        "<div style='white-space:normal'><b>after a switch</b>: the prediction made just before it, against what "
        "the run measured after it</div>"
    )
    return head + f"<table style='{_TABLE}'>{''.join(rows)}</table>"


class WhatIfPanel:
    """The what-if panel of a live run (``widget``: its HTML), kept by a thread of its own (:meth:`start`).

    ``predictions``: the last ``run.what_if(last=window)`` (None before the first); ``switches``: a
    :class:`Switch` per live switch so far; ``cost``: the CPU seconds its thread took, ``spent`` those of its last
    prediction (or switch's), ``every``: the seconds between its predictions now (``spent / WHATIF_SHARE``, at
    least ``WHATIF_EVERY``)."""

    def __init__(self, run, view, window: float, ended: Optional[Callable[[], bool]] = None):
        self.run, self.view, self.window = run, view, window
        #: whether the run ended and the view has all its records (default: the run ended)
        self.ended = ended or run.done
        self.widget = W.HTML()
        self.predictions = None
        self.switches: list = []
        self.note: Optional[str] = None  # why there is no table (yet)
        self.cost, self.spent, self.every, self.refreshed = 0.0, 0.0, WHATIF_EVERY, None
        #: (start, end) on the run's clock of its last predictions (and switches'): what they cost the run's steps
        self.passes: deque = deque(maxlen=100)
        self._count = -1  # the view's records at the last prediction
        self._thread: Optional[threading.Thread] = None
        self._stopping = threading.Event()
        self._draw()

    # ------------------------------------------------------------ thread
    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stopping.clear()
        self._thread = threading.Thread(target=self._follow, name="sdpipe-whatif", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self.join(timeout)

    def join(self, timeout: Optional[float] = None) -> bool:
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def _follow(self) -> None:
        """Every ``TICK``: measure the switches that settled; when due and the run trains, predict (a switch's
        prediction first); the time until the next prediction keeps the thread within ``WHATIF_SHARE`` of a
        core.  Once the run ended, the switches are predicted and measured on what there is, and the thread ends.
        An error is shown in the panel, and the next prediction tried as one would be."""
        due = time.monotonic() + WHATIF_EVERY / 2
        while True:
            ended = self.ended()
            work = ended or (time.monotonic() >= due and self.run.status == "running")
            t, began = time.thread_time(), time.time() - self.run.t0
            try:
                if not self.follow_switches(predict=work, ended=ended) and work and not ended:
                    self.predict()
            except Exception as e:  # shown in the panel; the dashboard and the run go on
                self.note = f"{type(e).__name__}: {e}"
            spent = time.thread_time() - t
            self.cost += spent
            if work and not ended:
                self.spent, self.every = spent, max(WHATIF_EVERY, spent / WHATIF_SHARE)
                due = time.monotonic() + self.every
                self.passes.append((began, time.time() - self.run.t0))
            self._draw()
            if ended or self._stopping.wait(TICK):
                return

    # ------------------------------------------------------------ work
    def predict(self) -> None:
        """``run.what_if(last=window)`` now (skipped when no record came since the last)."""
        if self.view.count == self._count:
            return
        self._count = self.view.count
        try:
            self.predictions, self.note = self.run.what_if(last=self.window), None
            self.refreshed = time.monotonic()
        except ValueError as e:  # no costs measured in the window yet (the run has not trained)
            self.note = str(e)

    def follow_switches(self, predict: bool = True, ended: bool = False) -> bool:
        """New switches get their line; with ``predict`` the oldest one whose records up to it have all arrived
        (``LAG`` seconds of the run's clock after it; all of them once the run ended) is predicted; each is
        measured once ``EPOCHS_AFTER`` whole epochs ran after it (or the next switch or the run's end came).
        Returns whether a prediction was made."""
        view, run = self.view, self.run
        records = list(view.switches)
        policy = run.config.policy
        for i, rec in enumerate(records):
            if i == len(self.switches):
                self.switches.append(switch_of(rec, policy))
            if rec["what"] == "policy":
                policy = rec["policy"]
        made = False
        for i, s in enumerate(self.switches):
            if not s.predicted and predict and (ended or (not made and view.now >= s.at + LAG)):
                self._predict_switch(s)
                made = True
            if not s.settled:
                nxt = self.switches[i + 1].at if i + 1 < len(self.switches) else None
                self._measure(s, nxt, ended)
        return made

    def _predict_switch(self, s: Switch) -> None:
        until = s.at - BEFORE
        try:
            s.before = self.run.what_if(last=self.window, until=until)
            s.prediction = self.run.predict(last=self.window, until=until, **s.change)
        except Exception as e:  # no costs measured before it (a ValueError), or the model failed: said in its line
            s.before, s.why = None, str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"

    def _measure(self, s: Switch, nxt: Optional[float], ended: bool) -> None:
        """The samples/s of the first ``EPOCHS_AFTER`` whole epochs that began ``SETTLE`` seconds after the switch
        (after the resume, when it came while the run was paused) and ended before the next switch (fewer, once
        that switch's records arrived, or the run ended)."""
        view = self.view
        start = s.at
        for pause, resume in list(view.pauses):
            if pause <= s.at and (resume is None or s.at < resume):
                if resume is None:
                    return
                start = resume
        since, limit = start + SETTLE, nxt if nxt is not None else float("inf")
        epochs = epochs_after(list(view.epoch_records), since, limit, set(view.active))[:EPOCHS_AFTER]
        s.since, s.epochs = since, [next(iter(recs.values()))["metrics"]["epoch"] for recs in epochs]
        if len(epochs) < EPOCHS_AFTER and not ended and (nxt is None or view.now < nxt + LAG):
            return  # more to come, or the records up to the next switch still on their way
        s.until = max((e["start"] for recs in epochs for e in recs.values()), default=None)
        s.measured = measured_rate([e for recs in epochs for e in recs.values()])
        s.settled = True

    # ------------------------------------------------------------ drawing
    def _draw(self) -> None:
        if self.predictions is not None:
            body = table_html(self.predictions, self.window, self.every)
            if self.note:
                body += f"<div style='color:{_MUTED}'>{html.escape(self.note)}</div>"
        else:
            waiting = self.note or (
                "the simulator predicts the run's samples/s under each change once it has trained a few seconds "
                f"(every {WHATIF_EVERY:g} s or less often, not while it starts or is paused)"
            )
            body = f"<div style='white-space:normal'><b>what if</b>: {html.escape(waiting)}</div>"
        value = _box(body + switches_html(self.switches))
        if self.widget.value != value:
            self.widget.value = value
