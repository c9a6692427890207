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

import anywidget
import ipywidgets as W
import plotly.graph_objects as go
import traitlets
from plotly.subplots import make_subplots

from sdpipe.config import LIVE_POLICIES
from sdpipe.core.policies import record
from sdpipe.widgets.controls import MAX_STALENESS, ControlPanel
from sdpipe.widgets.view import CATEGORIES, RunView

__all__ = ["Dashboard"]

#: below this output width (pixels) the panels stack in one column
NARROW = 900
#: pipelines that can join a run beyond its first ones and still get their own loss and metric curves
SPARE_PIPELINES = 8
#: seconds a redraw waits at most for a browser to have drawn the previous one
BEHIND = 20.0
#: a browser that answered within this many seconds counts as attached (redraws wait for it)
ATTACHED = 30.0
#: seconds between full resends of the figure while a run is followed (see Dashboard.resync)
RESYNC = 10.0


#: pixels per character of a subplot title (13 px Open Sans averages about 7; a little more to be safe)
TITLE_CHAR_PX = 7.5


def wrap_text(text: str, width: int) -> str:
    """``text`` broken at spaces into lines of at most ``width`` characters (plotly's ``<br>``); a word longer than
    a line keeps its own line."""
    lines: list = []
    for word in text.split(" "):
        if lines and len(lines[-1]) + 1 + len(word) <= max(width, 1):
            lines[-1] += " " + word
        else:
            lines.append(word)
    return "<br>".join(lines)


def r_list(xs):
    """Numbers rounded for the wire (figure updates travel as JSON)."""
    return [round(x, 5) for x in xs]


COLORS = {
    "compute": "#4C78A8",
    "communication": "#F58518",
    "synchronization": "#54A24B",
    "waiting": "#BAB0AC",
    "eval": "#B279A2",
}
#: membership strip: not in a group, alone, in a group, graph sync, global sync
STRIP = [
    [0.0, "#FFFFFF"],
    [0.2, "#FFFFFF"],
    [0.2, "#D8D8D8"],
    [0.4, "#D8D8D8"],
    [0.4, "#4C78A8"],
    [0.6, "#4C78A8"],
    [0.6, "#E45756"],
    [0.8, "#E45756"],
    [0.8, "#54A24B"],
    [1.0, "#54A24B"],
]
#: the figure's look: plotly's default background and grid, without its per-trace-type defaults (building
#: those is a third of a first Dashboard's time; every trace here sets its colours)
TEMPLATE = {
    "layout": {
        "plot_bgcolor": "#E5ECF6",
        "paper_bgcolor": "white",
        "font": {"color": "#2a3f5f"},
        "hovermode": "closest",
        "xaxis": {
            "gridcolor": "white",
            "linecolor": "white",
            "zerolinecolor": "white",
            "ticks": "",
            "automargin": True,
            "title": {"standoff": 6},
        },
        "yaxis": {
            "gridcolor": "white",
            "linecolor": "white",
            "zerolinecolor": "white",
            "ticks": "",
            "automargin": True,
        },
    }
}
#: line dashes and marker symbols of the per-epoch curves, by pipeline
DASHES = ["solid", "dot", "dash", "dashdot", "longdash", "longdashdot"]
SYMBOLS = ["circle", "square", "diamond", "triangle-up", "x", "star", "cross", "triangle-down"]
PIPELINE_COLORS = [
    "#4C78A8",
    "#F58518",
    "#54A24B",
    "#E45756",
    "#72B7B2",
    "#EECA3B",
    "#B279A2",
    "#FF9DA6",
    "#9D755D",
    "#BAB0AC",
]


def _load_plotly() -> None:
    """Load the plotly classes and validators the dashboard's figure uses.

    plotly imports each on first use; done here, at ``import sdpipe.widgets``
    (before a run loads the machine), the first ``Dashboard(run)`` does not
    pay for it while the workers train.
    """
    fig = make_subplots(rows=1, cols=2, figure=go.Figure(layout={"template": TEMPLATE}))
    fig.add_trace(
        go.Bar(x=[0], y=[0], base=[0], orientation="h", marker_color="#000000", hoverinfo="name+x"), row=1, col=1
    )
    fig.add_trace(
        go.Scatter(
            x=[0], y=[0], mode="markers+text", text=[""], marker=dict(symbol="triangle-down"), line=dict(dash="dash")
        ),
        row=1,
        col=1,
    )
    fig.add_trace(go.Heatmap(z=[[0]], colorscale=STRIP, hovertemplate="%{x}"), row=1, col=2)
    fig.update_xaxes(title_text="x", tickangle=0, type="category")
    fig.update_yaxes(tickvals=[0], ticktext=["a"], autorange="reversed", dtick=1)
    fig.update_layout(legend=dict(orientation="h"), margin=dict(l=1))
    fig.update_annotations(font_size=13)


_load_plotly()


class _Figure(go.FigureWidget):
    """plotly's FigureWidget, opened with its full state and answering state requests with its current one.

    plotly syncs the traces and layout only when the widget is created and
    later sends edits as one-off messages, so a front end that builds the
    model late (or misses the creation's update) draws an empty figure.
    """

    def __init__(self, figure, lock):
        self._deferred = True  # open the comm once the figure holds its data (see open)
        self._state_lock = lock
        #: set when a browser has drawn the last redraw (plotly's views answer every edit while the kernel is idle;
        #: the width probe answers also while a cell runs: see _Width)
        self._drawn = threading.Event()
        self._drawn_at = None  # monotonic time of the last answer from a browser
        self._first_drawn = None  # called once, when a browser first answers (see resync)
        super().__init__(figure)
        self._deferred = False
        self.open()

    @traitlets.observe("_js2py_traceDeltas")
    def _handler_js2py_traceDeltas(self, change):
        msg = change["new"]
        with self._state_lock:  # plotly's handler reads the traces the dashboard's thread edits
            super()._handler_js2py_traceDeltas(change)
        if msg:
            self.answered(msg.get("trace_edit_id") == self._last_trace_edit_id)

    def answered(self, last: bool) -> None:
        """A browser answered that it drew an edit (``last``: the last one sent): plotly's view, or the width probe."""
        first = self._drawn_at is None
        self._drawn_at = time.monotonic()
        if first and self._first_drawn is not None:
            self._first_drawn()
        if last:
            self._drawn.set()

    def open(self):
        if not getattr(self, "_deferred", False):
            super().open()

    def get_state(self, key=None, drop_defaults=False):
        state = super().get_state(key=key, drop_defaults=drop_defaults)
        if key is None or "_widget_data" in key or "_widget_layout" in key:
            with self._state_lock:  # the dashboard's thread edits the figure under this lock
                current = {"_widget_data": copy.deepcopy(self._data), "_widget_layout": copy.deepcopy(self._layout)}
            for k, value in current.items():
                if k in state:
                    state[k] = self.trait_metadata(k, "to_json")(value, self)
        return state


class _Width(anywidget.AnyWidget):
    """Reports the width (pixels) of the output area it is shown in, and when the page has drawn a redraw.

    Both go as custom messages, which a page sends at once; state updates
    (plotly's own answers to its edits among them) wait in the page while
    the kernel runs a cell, e.g. a notebook's cell that awaits the run.
    ``seq`` is set by the dashboard after each redraw; the page answers it
    once it has handled every message before it and drawn a frame.
    """

    _esm = """
    export default {
      render({ model, el }) {
        el.style.width = "100%";
        el.style.height = "0px";
        el.dataset.sdpipeWidth = "";
        // the output area (JupyterLab, Notebook 7) sets the width; elsewhere the widget's container
        const area = () => el.closest(".jp-OutputArea-output") || el.parentElement || el;
        let last = 0;
        const send = () => {
          // a custom message, as a button's click: state updates wait in the front end while the kernel runs a cell
          const w = Math.round(area().clientWidth);
          if (w > 0 && w !== last) { last = w; model.send({ width: w }); }
        };
        const observer = new ResizeObserver(() => send());
        observer.observe(el);
        requestAnimationFrame(() => { observer.observe(area()); send(); });
        // the redraw numbered seq has reached this page (messages arrive in order) and a frame was drawn after it
        const drawn = () => { const n = model.get("seq"); requestAnimationFrame(() => requestAnimationFrame(
            () => model.send({ drawn: n }))); };
        model.on("change:seq", drawn);
        // a live run's dashboard comes into view once, when first shown: after Run All the notebook shows its
        // last cell, and the dashboard, cells above, would train unseen
        if (model.get("reveal")) requestAnimationFrame(() => {
          const box = el.closest(".jp-OutputArea-output") || el.parentElement;
          if (box && box.scrollIntoView) box.scrollIntoView({ block: "start" });
          model.send({ revealed: true });
        });
        return () => { observer.disconnect(); model.off("change:seq", drawn); };
      }
    };
    """
    width = traitlets.Int(0)
    #: the number of the dashboard's last redraw (the page answers it when drawn)
    seq = traitlets.Int(0).tag(sync=True)
    #: bring the dashboard into view when a page first shows it (a live run's; cleared once a page did)
    reveal = traitlets.Bool(False).tag(sync=True)

    def __init__(self, on_drawn=None, **kwargs):
        super().__init__(**kwargs)
        self._on_drawn = on_drawn
        self.on_msg(self._on_width)

    def _on_width(self, _, content, buffers):
        if not isinstance(content, dict):
            return
        if isinstance(content.get("width"), int):
            self.width = content["width"]
        if content.get("revealed"):
            self.reveal = False
        if isinstance(content.get("drawn"), int) and self._on_drawn is not None:
            self._on_drawn(content["drawn"])


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
        """(template figure, key -> (row, col), height) of the wide (3 columns) or the narrow (1 column) layout."""
        cfg, n = self.config, len(self.view.workers)
        S = cfg.stages
        titles = {
            "timeline": "Stage timeline (recent seconds)",
            "stragglers": "Stragglers: compute per step (red: above 2x the median)",
            "loss": "training loss per step",
            "accuracy": f"held-out {self.metric.replace('eval_loss', 'loss')} per epoch"
            if self.held_out
            else "training loss per epoch (no held-out data given)",
            "shares": "Whole run: seconds by kind",
        }
        for s in range(S):
            titles[f"groups/{s}"] = (
                f"stage {s}: who averaged together (blue: group, red: graph sync, green: global, grey: alone)"
            )
            titles[f"sizes/{s}"] = f"stage {s}: groups by size"
        tall = {"timeline": 30 * n + 40, "shares": 22 * n + 30}
        if narrow:
            keys = (
                ["timeline"]
                + [key for s in range(S) for key in (f"groups/{s}", f"sizes/{s}")]
                + ["stragglers", "loss", "accuracy", "shares"]
            )
            pos = {k: (i + 1, 1) for i, k in enumerate(keys)}
            specs = [[{}] for _ in keys]
            heights = [tall.get(k, 150 if k.startswith(("groups", "sizes")) else 220) for k in keys]
            ordered = keys
            cols = 1
        else:
            pos = {
                "timeline": (1, 1),
                "stragglers": (S + 2, 1),
                "loss": (S + 2, 2),
                "accuracy": (S + 2, 3),
                "shares": (S + 3, 1),
            }
            for s in range(S):
                pos[f"groups/{s}"], pos[f"sizes/{s}"] = (2 + s, 1), (2 + s, 3)
            specs = (
                [[{"colspan": 3}, None, None]]
                + [[{"colspan": 2}, None, {}] for _ in range(S)]
                + [[{}, {}, {}]]
                + [[{"colspan": 3}, None, None]]
            )
            heights = [tall["timeline"]] + [150] * S + [260] + [tall["shares"]]
            ordered = sorted(pos, key=lambda k: pos[k])
            cols = 3
        # pixels between rows: room for a row's tick labels (two lines under the stragglers), its axis title and
        # the next row's title
        gap = 90
        height = sum(heights) + gap * len(heights) + 80
        fig = make_subplots(
            rows=len(heights),
            cols=cols,
            specs=specs,
            subplot_titles=[titles[k] for k in ordered],
            row_heights=heights,
            vertical_spacing=gap / height,
            horizontal_spacing=0.07 if cols > 1 else 0.0,
            figure=go.Figure(layout={"template": TEMPLATE}),
        )
        self._titles, self._title_keys = titles, ordered
        return fig, pos, height

    def _wrap_titles(self, width: float) -> None:
        """Break each subplot title into lines that fit its subplot at a figure ``width`` pixels wide (a title
        wider than its subplot runs into its neighbour's, or out of the figure)."""
        margin = self.figure.layout.margin
        plot = max(100.0, width - (margin.l or 0) - (margin.r or 0))
        wrapped = []
        for key in self._title_keys:
            lo, hi = self.figure.layout[self._axes[key][0]].domain
            wrapped.append(wrap_text(self._titles[key], int((hi - lo) * plot / TITLE_CHAR_PX)))
        if [a.text for a in self.figure.layout.annotations] != wrapped:
            for a, text in zip(self.figure.layout.annotations, wrapped, strict=False):
                a.text = text

    def _build(self, controls: bool) -> None:
        """One FigureWidget with every view as a subplot (the browser loads and draws one plot), plus widgets."""
        cfg, v = self.config, self.view
        labels = [v.label(w) for w in v.workers]
        S, n = cfg.stages, len(labels)
        fig, pos, height = self._grid(narrow=False)
        self._pos = pos
        self._idx = {}

        def add(key, trace, at):
            self._idx[key] = len(fig.data)
            fig.add_trace(trace, row=pos[at][0], col=pos[at][1])

        def axes(at, **kw):
            fig.update_xaxes(row=pos[at][0], col=pos[at][1], **{k[2:]: x for k, x in kw.items() if k.startswith("x_")})
            fig.update_yaxes(row=pos[at][0], col=pos[at][1], **{k[2:]: x for k, x in kw.items() if k.startswith("y_")})

        for c in CATEGORIES:  # rows are worker indices (small messages); the axis shows their labels
            add(
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
        add(  # overlapped averaging: a thin bar along the bottom of its worker's row, beside the compute it overlaps
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
        add(
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
        axes("timeline", **rows, x_title_text="seconds since launch")
        for s in range(S):
            add(
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
            add(
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
            axes(f"groups/{s}", y_title_text="pipeline", y_dtick=1)
            axes(f"sizes/{s}", x_title_text="members", x_type="category")
        add("stragglers", go.Bar(x=[], y=[], marker_color=[], showlegend=False, name="compute per step"), "stragglers")
        add(
            "stragglers/median",
            go.Scatter(
                x=[], y=[], mode="lines", line=dict(dash="dash", color="black"), showlegend=False, name="median"
            ),
            "stragglers",
        )
        axes(
            "stragglers", y_title_text="seconds", x_title_text="p: pipeline, s: stage", x_tickangle=0, x_automargin=True
        )
        for p in range(self._slots):  # the run's pipelines, and room for pipelines that join it
            color = PIPELINE_COLORS[p % len(PIPELINE_COLORS)]
            add(
                f"loss/{p}",
                go.Scatter(name=f"pipeline {p}", x=[], y=[], mode="lines", line_color=color, legendgroup=str(p)),
                "loss",
            )
            add(
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
        axes("loss", x_title_text="step")
        axes("accuracy", x_title_text="epoch", x_tick0=0, x_dtick=1)
        for c in CATEGORIES:
            add(
                f"shares/{c}",
                go.Bar(name=c, orientation="h", y=[], x=[], marker_color=COLORS[c], showlegend=False),
                "shares",
            )
        axes("shares", **rows, x_title_text="seconds")
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
        self.figure = _Figure(fig, self._lock)
        self.figure._first_drawn = self.resync
        self._width = _Width(on_drawn=self._page_drew, reveal=self.run is not None and not self.run.done())
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
                # one column: the legend (above the plots) would sit on the first title, centred above it: it goes
                # above that title, with room in the top margin for its rows
                top = 130 if narrow else 40
                self.figure.layout.margin.t = top
                self.figure.layout.legend.y = 1 + 36 / max(1, height - top - 40) if narrow else 1.0
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
        """A control panel button was pressed (its values are the panel's now)."""
        run, panel = self.run, self.panel
        if error is not None:

            def refuse():
                raise error

            self._act(action, refuse)
        elif action == "policy":
            self._act(
                "policy",
                lambda: run.set_policy(panel.policy, staleness=panel.staleness, max_group=panel.max_group or None),
            )
        elif action == "slowdowns":
            # the run's slowdowns, with those of the pipelines whose slider now shows another value replaced (a
            # per-stage slowdown set from code stays unless its pipeline's slider was moved)
            h = run.heterogeneity
            moved = {p: x for p, x in enumerate(panel.slowdown) if x != h.slowdown_of(p, 0)}
            slow = {k: x for k, x in h.slowdown.items() if (k[0] if isinstance(k, tuple) else k) not in moved}
            slow.update({p: x for p, x in moved.items() if x > 1.0})
            self._act(
                "slowdowns",
                lambda: run.set_heterogeneity(
                    slowdown=slow,
                    straggle_prob=panel.straggle_prob,
                    straggle_delay=panel.straggle_delay,
                    link_delay=dict(run.heterogeneity.link_delay),
                    compute_slowdown=dict(run.heterogeneity.compute_slowdown),
                ),
            )
        elif action == "add pipeline":
            self._act(action, lambda: run.add_pipelines(1))
        elif action == "remove pipeline":
            self._act(action, lambda: run.remove_pipeline(panel.remove))
        else:
            self._act(action, {"pause": run.pause, "resume": run.resume, "stop": run.stop}[action])

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
            t = time.time() - run.t0
            text = f"{clock} {what} applied at t = {t:.1f} s: " + (
                "the pipelines stop at their next step boundary"
                if what == "stop"
                else "every worker holds at its next step boundary"
                if what == "pause"
                else "the workers go on from where they held"
                if what == "resume"
                else f"pipeline {answer[0]} joins once its workers started (a live replica gives it its state)"
                if what == "add pipeline"
                else f"pipeline {self.panel.remove} leaves at its next step boundary"
                if what == "remove pipeline"
                else f"{self._applied(what)}; every worker takes it at its next step boundary"
            )
            self.message.value = f"<span style='color:#1a7f37'>{html.escape(text)}</span>"
        except Exception as e:  # shown to the user, the run goes on
            text = f"{clock} {what} not applied: {type(e).__name__}: {e}"
            self.message.value = f"<span style='color:#b00; overflow-wrap:anywhere'>{html.escape(text)}</span>"
        if self.panel is not None:  # the panel shows the run's values again (what a refused press sent is gone)
            with self._lock:
                self._panel_state = {}
                self._follow_run()
        self._poke.set()  # the header and the timeline show what the press did at the next redraw, now

    def _applied(self, what: str) -> str:
        """What a policy or slowdowns press applied, in a few words."""
        p = self.panel
        if what == "policy":
            return f"{p.policy} (P = {p.staleness}, max group {p.max_group or 'all'})"
        slow = ", ".join(f"pipeline {i} x{x:g}" for i, x in enumerate(p.slowdown) if x > 1.0) or "no slowdown"
        return f"{slow}, straggle p {p.straggle_prob:g}, delay {p.straggle_delay:g} s"

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
            self._width.seq += 1  # the page answers it when drawn (see _Width)
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
