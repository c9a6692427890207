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

import copy
import html
import threading
import time
from typing import Optional

import ipywidgets as W
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from sdpipe.config import LIVE_POLICIES
from sdpipe.core.policies import record
from sdpipe.widgets import actions, layout
from sdpipe.widgets.controls import MAX_STALENESS, ControlPanel
from sdpipe.widgets.figure import LiveFigure, WidthProbe
from sdpipe.widgets.layout import NARROW, TITLE_CHAR_PX, wrap_text
from sdpipe.widgets.style import COLORS, DASHES, PIPELINE_COLORS, STRIP, SYMBOLS, TEMPLATE, r_list
from sdpipe.widgets.view import CATEGORIES, RunView

__all__ = ["COLORS", "NARROW", "SPARE_PIPELINES", "TITLE_CHAR_PX", "Dashboard", "wrap_text"]

#: pipelines that can join a run beyond its first ones and still get their own loss and metric curves
SPARE_PIPELINES = 8
#: seconds a redraw waits at most for a browser to have drawn the previous one
BEHIND = 20.0
#: a browser that answered within this many seconds counts as attached (redraws wait for it)
ATTACHED = 30.0
#: seconds between full resends of the figure while a run is followed (see Dashboard.resync)
RESYNC = 10.0


class _Panels:
    """Adds traces to the panels of a figure being built (``pos``: panel -> (row, col)) and sets their axes; keeps
    each trace's index by key in ``idx``."""

    def __init__(self, fig, pos: dict, idx: dict):
        self.fig, self.pos, self.idx = fig, pos, idx

    def add(self, key: str, trace, at: str) -> None:
        self.idx[key] = len(self.fig.data)
        self.fig.add_trace(trace, row=self.pos[at][0], col=self.pos[at][1])

    def axes(self, at: str, **kw) -> None:
        row, col = self.pos[at]
        self.fig.update_xaxes(row=row, col=col, **{k[2:]: x for k, x in kw.items() if k.startswith("x_")})
        self.fig.update_yaxes(row=row, col=col, **{k[2:]: x for k, x in kw.items() if k.startswith("y_")})


class Dashboard:
    """Live (``Dashboard(run)``) or replayed (``Dashboard(result)``) view of a training run.

    ``interval`` is the seconds between redraws (default 0.25: four a
    second); ``window`` the seconds of the scrolling timeline.  Display it as
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
        self.view = RunView(cfg.stages, cfg.pipelines, cfg.batch_size, window=window)
        #: pipelines with their own loss and metric curves: the run's and up to SPARE_PIPELINES that join it
        self._slots = cfg.pipelines + SPARE_PIPELINES
        self._rows = None  # the timeline's rows as last drawn (they change as pipelines join and leave)
        self._cursor = 0
        self._lock = threading.RLock()  # the figure's edits (this thread, the follow thread, width changes)
        self._thread = None
        self._stopping = threading.Event()
        #: set by a press: the follow thread redraws at once (not after its wait for a slow browser)
        self._poke = threading.Event()
        self.redraws: list = []  # monotonic times of redraws (for measuring the rate)
        self.error = None
        self.narrow = False
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
    def _grid(self, narrow: bool):
        """(template figure, key -> (row, col), height) of the wide (3 columns) or the narrow (1 column) layout
        (:func:`sdpipe.widgets.layout.grid`)."""
        S = self.config.stages
        g = layout.grid(S, len(self.view.workers), narrow)
        names = layout.titles(S, self.metric, self.held_out)
        fig = make_subplots(
            rows=len(g.heights),
            cols=g.cols,
            specs=g.specs,
            subplot_titles=[names[k] for k in g.ordered],
            row_heights=g.heights,
            vertical_spacing=g.spacing,
            horizontal_spacing=0.07 if g.cols > 1 else 0.0,
            figure=go.Figure(layout={"template": TEMPLATE}),
        )
        self._titles, self._title_keys = names, g.ordered
        return fig, g.pos, g.height

    def _wrap_titles(self, width: float) -> None:
        """Break each subplot title into lines that fit its subplot at a figure ``width`` pixels wide (a title
        wider than its subplot runs into its neighbour's, or out of the figure)."""
        margin = self.figure.layout.margin
        domains = {k: self.figure.layout[self._axes[k][0]].domain for k in self._title_keys}
        wrapped = layout.wrapped_titles(self._titles, self._title_keys, domains, width, margin.l or 0, margin.r or 0)
        if [a.text for a in self.figure.layout.annotations] != wrapped:
            for a, text in zip(self.figure.layout.annotations, wrapped, strict=False):
                a.text = text

    def _build(self, controls: bool) -> None:
        """One FigureWidget with every view as a subplot (the browser loads and draws one plot), plus widgets."""
        fig, pos, height = self._grid(narrow=False)
        self._pos = pos
        self._idx = {}
        panels = _Panels(fig, pos, self._idx)
        rows = self._build_timeline(panels)
        self._build_groups(panels)
        self._build_curves(panels)
        self._build_shares(panels, rows)
        fig.update_layout(
            height=height,
            barmode="overlay",
            margin=dict(l=130, r=20, t=40, b=40),
            legend=dict(orientation="h", y=1.0, yanchor="bottom"),
        )
        fig.update_annotations(font_size=13)
        self._axes = {
            k: (fig.get_subplot(*rc).xaxis.plotly_name, fig.get_subplot(*rc).yaxis.plotly_name) for k, rc in pos.items()
        }
        self._timeline_xaxis = self._axes["timeline"][0]
        self._shares_xaxis = self._axes["shares"][0]
        self.figure = LiveFigure(fig, self._lock)
        self.figure._first_drawn = self.resync
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
        parts = [self.header, self.numbers, self.hetero, self.note, self._width, self.figure]
        #: the control panel (None for a replay or controls=False); ``panel.press(...)`` presses a button
        self.panel = self._controls() if controls else None
        if self.panel is not None:
            parts[1:1] = [self.panel, self.message]
        self.widget = W.VBox(parts, layout=W.Layout(width="100%"))

    def _build_timeline(self, panels: _Panels) -> dict:
        """The stage timeline: a bar per kind of time, overlapped averaging and control markers; returns its
        rows."""
        labels = [self.view.label(w) for w in self.view.workers]
        n = len(labels)
        for c in CATEGORIES:  # rows are worker indices (small messages); the axis shows their labels
            panels.add(
                f"timeline/{c}",
                go.Bar(
                    name=c,
                    orientation="h",
                    y=[],
                    x=[],
                    base=[],
                    marker_color=COLORS[c],
                    hoverinfo="name+x",
                    legendgroup="kinds",
                ),
                "timeline",
            )
        # overlapped averaging: a thin bar along the bottom of its worker's row, beside the compute it overlaps
        panels.add(
            "timeline/background",
            go.Bar(
                name="averaging (background)",
                orientation="h",
                y=[],
                x=[],
                base=[],
                width=0.22,
                offset=0.2,
                marker_color=COLORS["synchronization"],
                marker_line=dict(width=1, color="#2E6B2A"),
                hoverinfo="name+x",
                legendgroup="kinds",
            ),
            "timeline",
        )
        panels.add(
            "timeline/control",
            go.Scatter(
                name="control",
                mode="markers+text",
                x=[],
                y=[],
                text=[],
                textposition="top center",
                marker=dict(symbol="triangle-down", size=11, color="black"),
            ),
            "timeline",
        )
        # every worker's row always shown (a paused run's recent window has no bars in most rows)
        rows = dict(y_tickvals=list(range(n)), y_ticktext=labels, y_range=[n - 0.5, -0.5], y_autorange=False)
        panels.axes("timeline", **rows, x_title_text="seconds since launch")
        return rows

    def _build_groups(self, panels: _Panels) -> None:
        """Per stage: who averaged together (a strip of formations) and the groups' sizes."""
        cfg = self.config
        S = cfg.stages
        for s in range(S):
            panels.add(
                f"groups/{s}",
                go.Heatmap(
                    z=[[0]],
                    x=[0],
                    y=list(range(cfg.pipelines)),
                    zmin=0,
                    zmax=4,
                    colorscale=STRIP,
                    showscale=False,
                    xgap=1,
                    ygap=1,
                    hovertemplate="formation %{x}<br>pipeline %{y}<extra></extra>",
                ),
                f"groups/{s}",
            )
            panels.add(
                f"sizes/{s}",
                go.Bar(  # groups of the ordinary rounds (global and graph syncs aside); alone in grey, as in the strip
                    name=f"stage {s} groups by size",
                    x=[],
                    y=[],
                    marker_color=["#D8D8D8"] + ["#4C78A8"] * (cfg.pipelines - 1),
                    showlegend=False,
                    hovertemplate="%{y} groups of %{x}<extra></extra>",
                ),
                f"sizes/{s}",
            )
            panels.axes(f"groups/{s}", y_title_text="pipeline", y_dtick=1)
            panels.axes(f"sizes/{s}", x_title_text="members", x_type="category")

    def _build_curves(self, panels: _Panels) -> None:
        """The stragglers (compute per step against the median), the loss per step and the per-epoch curves."""
        panels.add(
            "stragglers", go.Bar(x=[], y=[], marker_color=[], showlegend=False, name="compute per step"), "stragglers"
        )
        panels.add(
            "stragglers/median",
            go.Scatter(
                x=[], y=[], mode="lines", line=dict(dash="dash", color="black"), showlegend=False, name="median"
            ),
            "stragglers",
        )
        panels.axes(
            "stragglers", y_title_text="seconds", x_title_text="p: pipeline, s: stage", x_tickangle=0, x_automargin=True
        )
        for p in range(self._slots):  # the run's pipelines, and room for pipelines that join it
            color = PIPELINE_COLORS[p % len(PIPELINE_COLORS)]
            panels.add(
                f"loss/{p}",
                go.Scatter(name=f"pipeline {p}", x=[], y=[], mode="lines", line_color=color, legendgroup=str(p)),
                "loss",
            )
            panels.add(
                f"accuracy/{p}",
                go.Scatter(  # pipelines with the same value each epoch (after a global sync) stay told apart
                    name=f"pipeline {p}",
                    x=[],
                    y=[],
                    mode="lines+markers",
                    line=dict(color=color, dash=DASHES[p % len(DASHES)]),
                    marker=dict(symbol=SYMBOLS[p % len(SYMBOLS)], size=7),
                    legendgroup=str(p),
                    showlegend=False,
                ),
                "accuracy",
            )
        panels.axes("loss", x_title_text="step")
        panels.axes("accuracy", x_title_text="epoch", x_tick0=0, x_dtick=1)

    def _build_shares(self, panels: _Panels, rows: dict) -> None:
        """Whole run: seconds by kind, per worker (the timeline's rows)."""
        for c in CATEGORIES:
            panels.add(
                f"shares/{c}",
                go.Bar(name=c, orientation="h", y=[], x=[], marker_color=COLORS[c], showlegend=False),
                "shares",
            )
        panels.axes("shares", **rows, x_title_text="seconds")

    def fit(self, width: int) -> None:
        """Size the figure to an output area ``width`` pixels wide: three columns from ``NARROW`` up, else one."""
        if not width or width < 200 or abs(width - 16 - (self.figure.layout.width or 0)) < 8:
            return
        narrow = width < NARROW
        with self._lock, self.figure.batch_update():
            if narrow != self.narrow:
                fig, pos, height = self._grid(narrow)
                for key, (xa, ya) in self._axes.items():
                    sub = fig.get_subplot(*pos[key])
                    self.figure.layout[xa].domain = sub.xaxis.domain
                    self.figure.layout[ya].domain = sub.yaxis.domain
                self.figure.layout.annotations = [
                    dict(a.to_plotly_json(), font_size=13) for a in fig.layout.annotations
                ]
                self.figure.layout.height = height
                self.figure.layout.margin.t, self.figure.layout.legend.y = layout.legend_place(narrow, height)
                self.narrow = narrow
            self.figure.layout.width = width - 16  # the output area's padding and a scroll bar
        with self._lock:  # after the batch: inside it the layout still reads as before (the domains above)
            self._wrap_titles(width - 16)

    def _page_drew(self, seq: int) -> None:
        """A page answered the redraw numbered ``seq`` (it has drawn everything sent before it)."""
        self.figure.answered(seq >= self._width.seq)

    def resync(self) -> None:
        """Send the whole figure to the browser again.

        A browser builds its copy of the figure from the state it is sent when
        the widget opens and applies later edits to it; edits that arrive while
        it still loads the widget's code are lost, and a finished run's replay
        sends none after.  This sends every trace (grouped by the properties
        they set) and the layout again; it runs when a browser first answers
        and every ``RESYNC`` seconds while the run is followed.
        """
        with self._lock:
            fig = self.figure
            groups: dict = {}
            for i, t in enumerate(fig._data):
                props = {k: v for k, v in t.items() if k not in ("type", "uid")}
                groups.setdefault(tuple(sorted(props)), []).append((i, props))
            for keys, members in groups.items():
                fig._send_restyle_msg(
                    {k: [m[1][k] for m in members] for k in keys}, trace_indexes=[m[0] for m in members]
                )
            fig._send_relayout_msg({k: v for k, v in copy.deepcopy(fig._layout).items() if k != "template"})

    def trace(self, key: str):
        """A trace of the dashboard's figure: "timeline/compute", "groups/0", "sizes/0", "stragglers",
        "stragglers/median", "loss/0", "accuracy/0", "shares/compute", ..."""
        return self.figure.data[self._idx[key]]

    def _controls(self) -> ControlPanel:
        self._panel_state = self._run_state()
        return ControlPanel(
            self._press, policies=list(LIVE_POLICIES), pipelines=self.config.pipelines, **self._panel_state
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
            slowdown=[float(h.slowdown_of(p, 0)) for p in range(self.config.pipelines)],
            straggle_prob=float(h.straggle_prob),
            straggle_delay=float(h.straggle_delay),
            elastic=record(run.config.policy).elastic,  # pipelines can join and leave
            status=run.status,
        )

    def _follow_run(self) -> None:
        """The control panel shows what the run has now: what changed since the last redraw (a change made from
        code, a plan's, or a press) is set on it; the page keeps the inputs the user is editing."""
        if self.panel is None:
            return
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
        if self.panel is not None:  # the panel shows the run's values again (what a refused press sent is gone)
            with self._lock:
                self._panel_state = {}
                self._follow_run()
        self._poke.set()  # the header and the timeline show what the press did at the next redraw, now

    # ------------------------------------------------------------ updates
    def refresh(self, fetch: bool = True, full: bool = True) -> int:
        """Take in new events and redraw; returns how many events were new."""
        with self._lock:
            new = 0
            if fetch and self.run is not None:
                events, self._cursor = self.run.events_since(self._cursor)
                self.view.add(events)
                self.view.status = self.run.status
                new = len(events)
            self._draw(full)
            self._width.seq += 1  # the page answers it when drawn (see WidthProbe)
            self.redraws.append(time.monotonic())
            if len(self.redraws) > 1000:
                del self.redraws[:500]
            return new

    def _draw(self, full: bool = True) -> None:
        """Redraw the timeline and header; with ``full`` also the slower-moving views.

        Each batch edits traces that all set the same properties: a batch
        leaves the properties one trace does not set "undefined" for it,
        which the browser's copy of the figure (what a view drawn later
        starts from) takes as "delete" (colours would fall back to plotly's).
        """
        v, T = self.view, self.trace
        tl = v.timeline(bins=120)
        row = {v.label(w): i for i, w in enumerate(v.workers)}
        if self._rows != list(v.workers):  # pipelines joined or left: the rows follow
            self._draw_rows()
        r4 = lambda xs: [round(x, 4) for x in xs]
        lo = v.now - v.window
        with self.figure.batch_update():  # bars: x, y, base
            for c in (*CATEGORIES, "background"):
                T(f"timeline/{c}").update(y=[row[y] for y in tl[c]["y"]], x=r4(tl[c]["x"]), base=r4(tl[c]["base"]))
            if full:
                sh = v.shares()
                base = [0.0] * len(v.workers)  # stacked by hand: the figure's bar mode overlays (for the timeline)
                for c in CATEGORIES:
                    T(f"shares/{c}").update(y=list(range(len(v.workers))), x=r_list(sh[c]), base=r_list(base))
                    base = [b + x for b, x in zip(base, sh[c], strict=True)]
            self.figure.layout[self._timeline_xaxis].range = [max(0.0, lo), max(v.now, v.window)]
        ctl = [(t, text) for t, text in v.controls if t >= lo]
        with self.figure.batch_update():  # x, y, text
            T("timeline/control").update(x=[t for t, _ in ctl], y=[0] * len(ctl), text=[x for _, x in ctl])
        steps = self._draw_views() if full else None
        self._draw_header()
        if full:
            self._draw_numbers(steps)

    def _draw_rows(self) -> None:
        """The timeline's and the whole-run panel's rows, and the group strips' pipelines, as they are now."""
        v = self.view
        self._rows = list(v.workers)
        n = len(v.workers)
        ticks = dict(tickvals=list(range(n)), ticktext=[v.label(w) for w in v.workers], range=[n - 0.5, -0.5])
        # one batch per property set (see _draw)
        with self.figure.batch_update():
            for key in ("timeline", "shares"):
                self.figure.layout[self._axes[key][1]].update(**ticks)
        with self.figure.batch_update():
            for s in range(v.stages):
                self.trace(f"groups/{s}").update(y=list(range(v.pipelines)))
        with self.figure.batch_update():
            for s in range(v.stages):
                self.trace(f"sizes/{s}").update(marker_color=["#D8D8D8"] + ["#4C78A8"] * max(v.pipelines - 1, 0))

    def _draw_views(self) -> dict:
        v, T = self.view, self.trace
        with self.figure.batch_update():  # heatmaps: z, x
            for s in range(v.stages):
                f = v.formations(s)
                xs = list(range(len(f["keys"])))
                T(f"groups/{s}").update(z=f["z"] if xs else [[0]], x=xs or [0])
        st = v.step_times()
        short = [f"p{p}<br>s{s}" for p, s in v.workers]  # short, on two lines: level and apart in a third of the width
        with self.figure.batch_update():  # x, y
            for s in range(v.stages):
                sizes = v.sizes.get(s, {})
                T(f"sizes/{s}").update(
                    x=[str(k) for k in range(1, v.pipelines + 1)],
                    y=[sizes.get(k, 0) for k in range(1, v.pipelines + 1)],
                )
            T("stragglers/median").update(x=short, y=[round(st["median_compute"] or 0, 5)] * len(v.workers))
            for p in range(min(v.pipelines, self._slots)):
                losses = v.losses.get(p, [])
                T(f"loss/{p}").update(x=[s for s, _ in losses], y=r_list([x for _, x in losses]))
                ep = [m for m in v.epochs.get(p, []) if self.metric in m]
                T(f"accuracy/{p}").update(x=[m["epoch"] for m in ep], y=[m[self.metric] for m in ep])
        last = max((m["epoch"] for ms in v.epochs.values() for m in ms), default=0)
        dtick = max(1, -(-(last + 1) // 8))  # whole epochs, eight ticks at most
        if self.figure.layout[self._axes["accuracy"][0]].dtick != dtick:
            self.figure.layout[self._axes["accuracy"][0]].dtick = dtick
        with self.figure.batch_update():  # x, y, marker colours
            T("stragglers").update(
                x=short,
                y=r_list([st["compute"][w] or 0 for w in v.workers]),
                marker_color=["#E45756" if st["flagged"][w] else "#4C78A8" for w in v.workers],
            )
        return st

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
        if run is not None:
            self._follow_run()
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

    def stop(self, timeout: float = 5.0) -> None:
        """Stop following (the run itself goes on)."""
        self._stopping.set()
        self._poke.set()
        if self._thread is not None:
            self._thread.join(timeout)

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
            last_full = 0.0
            last_resync = time.monotonic()
            while not self._stopping.is_set():
                t = time.monotonic()
                done = self.run.done()
                if t - last_resync >= RESYNC:
                    self.resync()
                    last_resync = t
                # the timeline every time; the other views about once a second (they move slowly)
                full = t - last_full >= 1.0
                self.figure._drawn.clear()
                self._poke.clear()
                self.refresh(full=full)
                last_full = t if full else last_full
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
        """Block until the dashboard has drawn the run's end (live) ; True if it did within ``timeout``."""
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def redraw_rate(self, seconds: float = 5.0) -> float:
        """Redraws per second over the last ``seconds``."""
        now = time.monotonic()
        recent = [t for t in self.redraws if t >= now - seconds]
        if len(recent) < 2:
            return 0.0
        return (len(recent) - 1) / (recent[-1] - recent[0])

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)
