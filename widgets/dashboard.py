"""The live dashboard: ipywidgets and plotly ``FigureWidget`` views of a run, with its controls.

``Dashboard(run)`` follows a running :class:`sdpipe.Run` from a background
thread a few times a second (only trait values change there, inside
``batch_update``), while the kernel stays free for other cells.
``Dashboard(result)`` replays a finished run from its events.

A browser that attaches late (a reload of the page, a second view of the
output, a run that ended before the page drew) gets the figure as it is now:
the figure widget opens with its full state and answers every state request
with its current traces and layout (plotly's widget would otherwise hand out
the state it was created with).  The figure follows the width of its output
area: a small widget reports that width, and below ``NARROW`` pixels the
panels stack in one column.
"""

from __future__ import annotations

import html
import threading
import time
from typing import Optional

import ipywidgets as W

from sdpipe.config import LIVE_POLICIES
from sdpipe.core.policies import record
from sdpipe.widgets import actions
from sdpipe.widgets.controls import MAX_STALENESS, ControlPanel
from sdpipe.widgets.figure import WidthProbe
from sdpipe.widgets.layout import NARROW, TITLE_CHAR_PX, wrap_text
from sdpipe.widgets.plot import RunPlot
from sdpipe.widgets.style import COLORS
from sdpipe.widgets.view import SLICE, RunView
from sdpipe.widgets.whatif import WhatIfPanel

__all__ = ["COLORS", "NARROW", "SPARE_PIPELINES", "TITLE_CHAR_PX", "Dashboard", "wrap_text"]

#: pipelines that can join a run beyond its first ones and still get their own loss and metric curves
SPARE_PIPELINES = 8
#: seconds a redraw waits at most for a browser to have drawn the previous one
BEHIND = 20.0
#: a browser that answered within this many seconds counts as attached (redraws wait for it)
ATTACHED = 30.0
#: seconds between full resends of the figure while a run is followed (see Dashboard.resync)
RESYNC = 10.0
#: seconds of the run's clock a live run's time attribution covers (a replay's covers the whole run); also the
#: window the what-if panel's predictions calibrate on
ATTRIBUTION_WINDOW = 30.0
#: seconds between a live run's time attributions at the most often: one slice of the run's clock
#: (:data:`sdpipe.widgets.view.SLICE`), the bars move no more often
ATTRIBUTION_EVERY = SLICE
#: the share of a core the time attributions may take (their CPU seconds over the time between them): a new
#: slice's records cost 2.5-7 us each (a 2 x 2 run of the digits MLP records some 1,500-3,000 a second: 10-40 ms a
#: slice, 1-2% of a core), so this cap binds only where a run records tens of times more
ATTRIBUTION_SHARE = 0.1


class _Controls:
    """The control panel bound to a live run: it shows the run's policy, heterogeneity and status as they are now
    (:meth:`follow_run`, at every redraw), a press becomes one call of the run (:func:`sdpipe.widgets.actions.plan`),
    and the message line says what was applied and when, or why not.  ``poke`` wakes the dashboard's redraws."""

    def __init__(self, run, message, lock, poke):
        self.run, self.message, self._lock, self._poke = run, message, lock, poke
        self._panel_state = self._run_state()
        #: the control panel; ``panel.press(...)`` presses a button
        self.panel = ControlPanel(
            self._press, policies=list(LIVE_POLICIES), pipelines=run.config.pipelines, **self._panel_state
        )

    def _run_state(self) -> dict:
        """What the control panel shows: the run's policy, heterogeneity and status as they are now (set from code
        or by a press alike)."""
        run = self.run
        sp, h = run.scheduler_policy, run.heterogeneity
        switchable = run.policy in LIVE_POLICIES and run.config.policy in LIVE_POLICIES
        return dict(
            policy=run.policy if switchable else "",
            policy_enabled=switchable,
            staleness=int(min(sp.staleness, MAX_STALENESS)),
            max_group=sp.max_group or 0,
            slowdown=[float(h.slowdown_of(p, 0)) for p in range(run.config.pipelines)],
            straggle_prob=float(h.straggle_prob),
            straggle_delay=float(h.straggle_delay),
            elastic=record(run.config.policy).elastic,  # pipelines can join and leave
            cuts=", ".join(map(str, run.cuts or ())),
            recut_enabled=run.cuts is not None and record(run.config.policy).recut,
            status=run.status,
        )

    def follow_run(self) -> None:
        """The control panel shows what the run has now: what changed since the last redraw (a change made from
        code, a plan's, or a press) is set on it; the page keeps the inputs the user is editing."""
        now = self._run_state()
        changed = {k: v for k, v in now.items() if self._panel_state.get(k) != v}
        if changed:
            with self.panel.hold_sync():
                for k, v in changed.items():
                    setattr(self.panel, k, v)
            self._panel_state = now

    def _press(self, action: str, error: Optional[Exception] = None) -> None:
        """A control panel button was pressed (its values are the panel's now): the run's call for it
        (:func:`sdpipe.widgets.actions.plan`), or the panel's own refusal (``error``)."""
        run = self.run
        if error is not None:

            def call():
                raise error

        else:
            planned = actions.plan(action, self.panel, run.heterogeneity)

            def call():
                return getattr(run, planned.method)(*planned.args, **planned.kwargs)

        if action == "re-cut" and error is None:  # it returns once every worker took it: the kernel goes on meanwhile
            at = time.strftime("%H:%M:%S")
            self.message.value = html.escape(f"{at} re-cut asked for: the layers move at the next step boundary")
            threading.Thread(target=self._act, args=(action, call), name="sdpipe-recut", daemon=True).start()
            return
        self._act(action, call)

    def _act(self, what: str, fn) -> None:
        """Run a control call; say in the message line what was applied and when, or why not (never raises)."""
        clock = time.strftime("%H:%M:%S")
        run = self.run
        try:
            if run.status == "starting" and run.startup and not run.launched:
                raise RuntimeError(f"the run is still starting ({run.startup}); try again in a moment")
            answer = fn()
            if what == "stop" and answer is False:
                raise RuntimeError(f"run {run.run_id} had already ended ({run.status})")
            text = actions.applied_text(what, answer, self.panel, time.time() - run.t0, clock)
            self.message.value = f"<span style='color:#1a7f37'>{html.escape(text)}</span>"
        except Exception as e:  # shown to the user, the run goes on
            text = actions.refused_text(what, e, clock)
            self.message.value = f"<span style='color:#b00; overflow-wrap:anywhere'>{html.escape(text)}</span>"
        with self._lock:  # the panel shows the run's values again (what a refused press sent is gone)
            self._panel_state = {}
            self.follow_run()
        self._poke.set()  # the header and the timeline show what the press did at the next redraw, now


class Dashboard:
    """Live (``Dashboard(run)``) or replayed (``Dashboard(result)``) view of a training run.

    ``interval`` is the seconds between redraws (default 0.25: four a
    second); ``window`` the seconds of the scrolling timeline.  Where each
    worker's time went (:mod:`sdpipe.attribution`) is drawn over the last
    ``ATTRIBUTION_WINDOW`` seconds of a live run, summed from slices of its
    clock each attributed once (:meth:`RunView.attribute_slices`), every
    ``ATTRIBUTION_EVERY`` seconds (within ``ATTRIBUTION_SHARE`` of a core),
    and over the whole of a replayed one.  A live run also gets the what-if
    panel (:mod:`sdpipe.widgets.whatif`, ``whatif``; None in a replay, whose
    run can no longer change): the simulator's predictions under each change,
    in a thread of its own, and after each live switch of policy or
    heterogeneity its prediction against what was measured.  Display it as
    the last expression of a cell or with ``display(dashboard)``.  The
    constructor only builds the widgets (well under a second, also while the
    run's workers load the machine); the first data arrives with the first
    redraw.
    """

    def __init__(
        self, source, *, interval: float = 0.25, window: float = 4.0, controls: bool = True, start: bool = True
    ):
        from sdpipe import Run, RunResult

        if not isinstance(source, (Run, RunResult)):
            raise ValueError(f"source: must be a sdpipe.Run or a sdpipe.RunResult, got {type(source).__name__}")
        if not (isinstance(interval, (int, float)) and interval > 0):
            raise ValueError(f"interval: must be seconds > 0, got {interval!r}")
        self.run = source if isinstance(source, Run) else None
        self.result = source if isinstance(source, RunResult) else None
        cfg = source.config
        self.config = cfg
        #: whether the epochs end with an evaluation on held-out data (else the per-epoch panel shows the
        #: epochs' training loss: a panel never stays empty for want of data it cannot get)
        self.held_out = source.held_out if isinstance(source, Run) else any("eval_loss" in h for h in source.history)
        #: the key of the per-epoch panel's value in the epoch records: the held-out metric ("accuracy",
        #: "perplexity", ...) or loss, else the training loss
        self.metric = (source.metric or "eval_loss") if self.held_out else "loss"
        self.interval = interval
        self.view = RunView(
            cfg.stages,
            cfg.pipelines,
            cfg.batch_size,
            window=window,
            attribution_window=ATTRIBUTION_WINDOW if self.run is not None else None,
        )
        #: pipelines with their own loss and metric curves: the run's and up to SPARE_PIPELINES that join it
        self._slots = cfg.pipelines + SPARE_PIPELINES
        self._cursor = 0
        self._lock = threading.RLock()  # the figure's edits (this thread, the follow thread, width changes)
        self._thread = None
        self._stopping = threading.Event()
        #: set by a press: the follow thread redraws at once (not after its wait for a slow browser)
        self._poke = threading.Event()
        self.redraws: list = []  # monotonic times of redraws (for measuring the rate)
        self.error = None
        #: seconds the browser took to draw the last redraw (None: no browser answered within BEHIND)
        self.lag = None
        self._build(controls and self.run is not None)
        if self.result is not None:
            self.view.add(self.result.events)
            self.view.status = "stopped" if self.result.stopped else "finished"
            self.refresh(fetch=False)
        elif start:
            self.start()

    # ------------------------------------------------------------ figures
    def _build(self, controls: bool) -> None:
        """One figure with every view as a subplot (the browser loads and draws one plot), plus widgets."""
        #: the figure (:class:`sdpipe.widgets.plot.RunPlot`)
        self.plot = RunPlot(self.view, metric=self.metric, held_out=self.held_out, slots=self._slots, lock=self._lock)
        self.figure = self.plot.figure
        self.figure._first_drawn = self.plot.resync
        self._width = WidthProbe(on_drawn=self._page_drew, reveal=self.run is not None and not self.run.done())
        self._width.observe(lambda change: self.fit(change["new"]), "width")
        # The header is one line (cut with an ellipsis where the output is narrow) and the lines whose length
        # changes come after the controls, so the controls never move while the run goes on.
        one_line = W.Layout(width="100%", height="1.7em", overflow="hidden")
        self.header = W.HTML(layout=one_line)
        self.note = W.HTML()
        self.numbers = W.HTML()
        #: the heterogeneity in force: slept ("emulated") per worker, or "shaped" by the kernel per host
        self.hetero = W.HTML()
        #: the answer to the last control: what was applied and when, or why not
        self.message = W.HTML(layout=W.Layout(min_height="1.7em", width="100%"))
        #: the bottleneck in a sentence (:attr:`sdpipe.attribution.Attribution.bottleneck`), under the figure (its
        #: last panel is the time attribution it sums up), where its length changes move nothing
        self.bottleneck = W.HTML()
        #: the what-if panel of a live run (:class:`sdpipe.widgets.whatif.WhatIfPanel`; None in a replay), under
        #: the measured samples/s
        self.whatif = (
            WhatIfPanel(self.run, self.view, ATTRIBUTION_WINDOW, ended=self._ended) if self.run is not None else None
        )
        parts = [self.header, self.numbers, self.hetero, self.note, self._width, self.figure, self.bottleneck]
        if self.whatif is not None:
            parts.insert(2, self.whatif.widget)
        #: the control panel (None for a replay or controls=False); ``panel.press(...)`` presses a button
        self._controls = _Controls(self.run, self.message, self._lock, self._poke) if controls else None
        self.panel = self._controls.panel if controls else None
        if self.panel is not None:
            parts[1:1] = [self.panel, self.message]
        self.widget = W.VBox(parts, layout=W.Layout(width="100%"))

    def fit(self, width: int) -> None:
        """Size the figure to an output area ``width`` pixels wide: three columns from ``NARROW`` up, else one."""
        self.plot.fit(width)

    @property
    def narrow(self) -> bool:
        """Whether the figure is laid out in one column (its output area narrower than ``NARROW``)."""
        return self.plot.narrow

    def resync(self) -> None:
        """Send the whole figure to the browser again (:meth:`sdpipe.widgets.plot.RunPlot.resync`)."""
        self.plot.resync()

    def trace(self, key: str):
        """A trace of the dashboard's figure: "timeline/compute", "groups/0", "sizes/0", "stragglers",
        "stragglers/median", "loss/0", "accuracy/0", "attribution/compute", ..."""
        return self.plot.trace(key)

    def _page_drew(self, seq: int) -> None:
        """A page answered the redraw numbered ``seq`` (it has drawn everything sent before it)."""
        self.figure.answered(seq >= self._width.seq)

    # ------------------------------------------------------------ updates
    def refresh(self, fetch: bool = True, full: bool = True, attribution: Optional[bool] = None) -> int:
        """Take in new events and redraw; returns how many events were new.  ``full``: also the slower-moving
        views; ``attribution`` (default: ``full``): also the time attribution and the bottleneck."""
        with self._lock:
            new = 0
            if fetch and self.run is not None:
                events, self._cursor = self.run.events_since(self._cursor)
                self.view.add(events)
                self.view.status = self.run.status
                new = len(events)
            self._draw(full, full if attribution is None else attribution)
            self._width.seq += 1  # the page answers it when drawn (see WidthProbe)
            self.redraws.append(time.monotonic())
            if len(self.redraws) > 1000:
                del self.redraws[:500]
            return new

    def _draw(self, full: bool = True, attribution: bool = True) -> None:
        """Redraw the figure's timeline and header; with ``full`` also the slower-moving views and the numbers,
        with ``attribution`` the time attribution and the bottleneck."""
        steps = self.plot.draw(full, attribution)
        self._draw_header()
        if full:
            self._draw_numbers(steps)
        if attribution:
            self._draw_bottleneck()

    def _draw_bottleneck(self) -> None:
        """The bottleneck's sentence, over the time attribution's window; wrapped, never cut."""
        a, w = self.plot.attribution, self.view.attribution_window
        covered = "over the whole run" if w is None else f"over the last {w:g} s"
        value = (
            "<div style='white-space:normal; overflow-wrap:anywhere; line-height:1.4'>"
            f"<b>bottleneck</b> ({covered}): {html.escape(a.bottleneck)}</div>"
        )
        if self.bottleneck.value != value:
            self.bottleneck.value = value

    def _draw_numbers(self, st: dict) -> None:
        """The numbers line; ``st`` is the view's step_times() the views were drawn with."""
        v = self.view
        tp = v.throughput()
        fmt = lambda x, f="{:.0f}": "-" if x is None else f.format(x)
        flagged = [v.label(w) for w in v.workers if st["flagged"][w]]
        spread = tp["spread"]
        ratio = fmt(tp["ratio"], "{:.2f}") + (f" ({spread[0]:.2f}-{spread[1]:.2f})" if spread else "")
        explain = (
            "the pipelines' last steps as they ran, against the same steps without the time spent synchronizing "
            "(averaging, group waits); in brackets the lowest and highest ratio over three blocks of those steps"
        )
        self.numbers.value = (
            f'<span title="{explain}"><b>samples/s</b> {fmt(tp["samples_per_s"])} &nbsp; <b>ideal</b> (the same steps '
            f"without synchronization) {fmt(tp['ideal'])} &nbsp; <b>ratio</b> {ratio}</span> &nbsp; "
            f"<b>graph syncs</b> {len(v.graph_syncs)} &nbsp; <b>stragglers</b> {', '.join(flagged) or 'none'}"
        )
        configured = self.config.heterogeneity.to_dict() if self.config.heterogeneity else None
        hetero = f"<b>heterogeneity</b> {html.escape(v.heterogeneity(configured))}"
        if self.hetero.value != hetero:
            self.hetero.value = hetero

    def _draw_header(self) -> None:
        v, cfg, run = self.view, self.config, self.run
        if self._controls is not None:
            self._controls.follow_run()
        source = "live" if run is not None else "replay"
        policy = run.policy if run is not None else cfg.policy
        status = v.status or "-"
        startup = run.startup if run is not None and status == "starting" else None
        # what changes first (a narrow output cuts the end of the line)
        text = (
            f"<b>sdpipe</b> status <b>{status}</b>, t = {v.now:.1f} s, policy <b>{policy}</b>, {cfg.stages} stages x "
            f"{len(v.active)} pipelines ({source}, {v.count} events)" + (f"; {html.escape(startup)}" if startup else "")
        )
        self.header.value = f"<div style='white-space:nowrap; overflow:hidden; text-overflow:ellipsis'>{text}</div>"
        note = "; ".join(x for x in (run.concurrent, run.contention) if x) if run is not None else None
        value = f"<span style='color:#666'>note: {html.escape(note)}</span>" if note else ""
        if value != self.note.value:
            self.note.value = value

    # ------------------------------------------------------------ thread
    def start(self) -> None:
        """Follow the run from a background thread until it ends (started by the constructor)."""
        if self.run is None or (self._thread is not None and self._thread.is_alive()):
            return
        self._stopping.clear()
        self._thread = threading.Thread(target=self._follow, name="sdpipe-dashboard", daemon=True)
        self._thread.start()
        self.whatif.start()

    def _ended(self) -> bool:
        """Whether the run ended and the follow thread took in its last records (what-if's last look)."""
        return self.run.done() and (self._thread is None or not self._thread.is_alive())

    def stop(self, timeout: float = 5.0) -> None:
        """Stop following (the run itself goes on)."""
        self._stopping.set()
        self._poke.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self.whatif is not None:
            self.whatif.stop(timeout)

    def _follow(self) -> None:
        """Redraw every ``interval`` seconds, but never faster than a browser draws.

        A browser that draws slower than the edits come (a small machine
        whose cores the workers take) would queue them and fall ever further
        behind: while a browser answers, the next edit waits (at most
        ``BEHIND`` seconds) until one has drawn the last, and then as long
        again.  Without a browser the figure stays current at the interval,
        for one that attaches.
        """
        try:
            last_full = last_attribution = 0.0
            last_resync = time.monotonic()
            while not self._stopping.is_set():
                t = time.monotonic()
                done = self.run.done()
                if t - last_resync >= RESYNC:
                    self.resync()
                    last_resync = t
                # the timeline every time; the other views about once a second (they move slowly), the time
                # attribution every ATTRIBUTION_EVERY seconds, or as often as ATTRIBUTION_SHARE of the time allows
                full = t - last_full >= 1.0
                every = max(ATTRIBUTION_EVERY, self.plot.attribution_cost / ATTRIBUTION_SHARE)
                attribution = full and t - last_attribution >= every
                self.figure._drawn.clear()
                self._poke.clear()
                self.refresh(full=full, attribution=attribution)
                last_full = t if full else last_full
                last_attribution = t if attribution else last_attribution
                if done:
                    self.refresh()  # the last records
                    self.resync()
                    break
                # wait for a browser to have drawn it, then as long again: a browser that needs longer than the
                # interval to draw stays idle half the time (its page answers clicks), and never has more than one
                # redraw waiting (a page that fell behind for a minute and a half lost its connection to the kernel)
                sent = time.monotonic()
                answered = self.figure._drawn_at
                if answered is not None and sent - answered < ATTACHED:  # a browser is drawing (none: no wait)
                    while (
                        not self.figure._drawn.is_set()
                        and not self._stopping.is_set()
                        and not self._poke.is_set()
                        and time.monotonic() < sent + BEHIND
                    ):
                        self.figure._drawn.wait(0.02)
                self.lag = time.monotonic() - sent if self.figure._drawn.is_set() else None
                pause = max(self.interval - (time.monotonic() - t), self.lag or 0.0)
                # a press wakes it: what the user did shows at once, also while a slow browser holds the redraws back
                if not self._poke.wait(pause):
                    continue
                self._stopping.wait(0.05)  # the press's own control record first
        except Exception as e:  # keep the kernel alive; show what went wrong
            self.error = e
            self.header.value = f"<b>dashboard stopped</b>: {html.escape(f'{type(e).__name__}: {e}')}"

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until the dashboard has drawn the run's end (live), the what-if panel's last switch measured
        included; True if it did within ``timeout``."""
        if self._thread is None:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        self._thread.join(timeout)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        return not self._thread.is_alive() and self.whatif.join(left)

    def redraw_rate(self, seconds: float = 5.0) -> float:
        """Redraws per second over the last ``seconds``."""
        now = time.monotonic()
        recent = [t for t in self.redraws if t >= now - seconds]
        if len(recent) < 2:
            return 0.0
        return (len(recent) - 1) / (recent[-1] - recent[0])

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)
