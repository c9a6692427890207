"""The dashboard's one figure (:class:`RunPlot`): every view of a run a subplot, laid out by
:mod:`sdpipe.widgets.layout`, built once and redrawn from a :class:`~sdpipe.widgets.view.RunView`."""

from __future__ import annotations

import copy
import time
from typing import Optional

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from sdpipe.widgets import layout
from sdpipe.widgets.figure import LiveFigure
from sdpipe.widgets.layout import BOTTOM, NARROW
from sdpipe.widgets.style import ATTRIBUTION_COLORS, COLORS, DASHES, PIPELINE_COLORS, STRIP, SYMBOLS, TEMPLATE, r_list
from sdpipe.widgets.view import CATEGORIES, RunView

__all__ = ["RunPlot"]


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


def build_timeline(panels: _Panels, labels: list) -> dict:
    """The stage timeline: a bar per kind of time, overlapped averaging and control markers; returns its
    rows."""
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


def build_groups(panels: _Panels, stages: int, pipelines: int) -> None:
    """Per stage: who averaged together (a strip of formations) and the groups' sizes."""
    S = stages
    for s in range(S):
        panels.add(
            f"groups/{s}",
            go.Heatmap(
                z=[[0]],
                x=[0],
                y=list(range(pipelines)),
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
                marker_color=["#D8D8D8"] + ["#4C78A8"] * (pipelines - 1),
                showlegend=False,
                hovertemplate="%{y} groups of %{x}<extra></extra>",
            ),
            f"sizes/{s}",
        )
        panels.axes(f"groups/{s}", y_title_text="pipeline", y_dtick=1)
        panels.axes(f"sizes/{s}", x_title_text="members", x_type="category")


def build_curves(panels: _Panels, slots: int) -> None:
    """The stragglers (compute per step against the median), the loss per step and the per-epoch curves."""
    panels.add(
        "stragglers", go.Bar(x=[], y=[], marker_color=[], showlegend=False, name="compute per step"), "stragglers"
    )
    panels.add(
        "stragglers/median",
        go.Scatter(x=[], y=[], mode="lines", line=dict(dash="dash", color="black"), showlegend=False, name="median"),
        "stragglers",
    )
    panels.axes(
        "stragglers", y_title_text="seconds", x_title_text="p: pipeline, s: stage", x_tickangle=0, x_automargin=True
    )
    for p in range(slots):  # the run's pipelines, and room for pipelines that join it
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


def build_attribution(panels: _Panels, rows: dict) -> None:
    """Where each worker's time went: a bar per worker (the timeline's rows), stacked from its categories' shares
    of its wall time (:mod:`sdpipe.attribution`), the share written inside where it fits; its own legend, under
    the panel (the names differ from the timeline's kinds; the colours are theirs)."""
    for c, color in ATTRIBUTION_COLORS.items():
        light = color in (COLORS["waiting"], COLORS["other"])
        panels.add(
            f"attribution/{c}",
            go.Bar(
                name=c,
                orientation="h",
                y=[],
                x=[],
                base=[],
                text=[],
                customdata=[],
                marker=dict(
                    color=color,
                    line=dict(width=1, color="white"),
                    # a pause has the group waits' colour (both are waiting in the timeline): hatched apart
                    pattern=dict(shape="/", fillmode="overlay", fgcolor="white", size=7) if c == "paused" else None,
                ),
                textposition="inside",
                insidetextanchor="middle",
                textangle=0,
                insidetextfont=dict(color="#2a3f5f" if light else "white"),
                hovertemplate=f"{c}: %{{x:.1%}} of its wall time (%{{customdata:.1f}} s)<extra></extra>",
                legend="legend2",
            ),
            "attribution",
        )
    panels.axes("attribution", **rows, x_range=[0, 1], x_tickformat=".0%", x_dtick=0.1)


class RunPlot:
    """The figure of a :class:`~sdpipe.widgets.view.RunView`: built for the run's stages and pipelines (``slots``
    loss and metric curves: the run's pipelines and room for pipelines that join it), sized to its output area
    (:meth:`fit`) and redrawn (:meth:`draw`).  ``lock`` guards its edits (the follow thread, width changes)."""

    def __init__(self, view: RunView, *, metric: str, held_out: bool, slots: int, lock):
        self.view, self.metric, self.held_out, self._slots, self._lock = view, metric, held_out, slots, lock
        self.narrow = False
        self._rows = None  # the timeline's rows as last drawn (they change as pipelines join and leave)
        #: the time attribution last drawn (:class:`sdpipe.attribution.Attribution`; None before the first), the
        #: CPU seconds it took, and those all the time attributions took
        self.attribution, self.attribution_cost, self.attribution_spent = None, 0.0, 0.0
        fig, pos, height = self._grid(narrow=False)
        #: each trace's index by key ("timeline/compute", "groups/0", ...)
        self.idx: dict = {}
        panels = _Panels(fig, pos, self.idx)
        rows = build_timeline(panels, [view.label(w) for w in view.workers])
        build_groups(panels, view.stages, view.pipelines)
        build_curves(panels, slots)
        build_attribution(panels, rows)
        fig.update_layout(
            height=height,
            barmode="overlay",
            margin=dict(l=130, r=20, t=40, b=BOTTOM),
            legend=dict(orientation="h", y=1.0, yanchor="bottom"),
            # the time attribution's categories, at the foot of the figure (under its panel, the last one)
            legend2=dict(orientation="h", x=0, xanchor="left", yref="container", y=0, yanchor="bottom"),
            uniformtext=dict(minsize=10, mode="hide"),  # a share's number only where it fits its segment
        )
        fig.update_annotations(font_size=13)
        #: each panel's x and y axes by key (their names in the figure's layout)
        self.axes = {
            k: (fig.get_subplot(*rc).xaxis.plotly_name, fig.get_subplot(*rc).yaxis.plotly_name) for k, rc in pos.items()
        }
        self.figure = LiveFigure(fig, lock)

    def _grid(self, narrow: bool):
        """(template figure, key -> (row, col), height) of the wide (3 columns) or the narrow (1 column) layout
        (:func:`sdpipe.widgets.layout.grid`)."""
        S = self.view.stages
        g = layout.grid(S, len(self.view.workers), narrow)
        names = layout.titles(S, self.metric, self.held_out, self.view.attribution_window)
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
        #: the panels' titles by key, and the keys in the order of the figure's titles
        self.titles, self.title_keys = names, g.ordered
        return fig, g.pos, g.height

    def _wrap_titles(self, width: float) -> None:
        """Break each subplot title into lines that fit its subplot at a figure ``width`` pixels wide (a title
        wider than its subplot runs into its neighbour's, or out of the figure)."""
        margin = self.figure.layout.margin
        domains = {k: self.figure.layout[self.axes[k][0]].domain for k in self.title_keys}
        wrapped = layout.wrapped_titles(self.titles, self.title_keys, domains, width, margin.l or 0, margin.r or 0)
        if [a.text for a in self.figure.layout.annotations] != wrapped:
            for a, text in zip(self.figure.layout.annotations, wrapped, strict=False):
                a.text = text

    def fit(self, width: int) -> None:
        """Size the figure to an output area ``width`` pixels wide: three columns from ``NARROW`` up, else one."""
        if not width or width < 200 or abs(width - 16 - (self.figure.layout.width or 0)) < 8:
            return
        narrow = width < NARROW
        with self._lock, self.figure.batch_update():
            if narrow != self.narrow:
                fig, pos, height = self._grid(narrow)
                for key, (xa, ya) in self.axes.items():
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
        "stragglers/median", "loss/0", "accuracy/0", "attribution/compute", ..."""
        return self.figure.data[self.idx[key]]

    def draw(self, full: bool = True, attribution: Optional[bool] = None):
        """Redraw the timeline; with ``full`` also the slower-moving views, then returns the view's
        ``step_times()`` they were drawn with (None without ``full``); with ``attribution`` (default: ``full``)
        also the time attribution (the costliest view: a live dashboard draws it every few seconds).

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
            self.figure.layout[self.axes["timeline"][0]].range = [max(0.0, lo), max(v.now, v.window)]
        ctl = [(t, text) for t, text in v.controls if t >= lo]
        with self.figure.batch_update():  # x, y, text
            T("timeline/control").update(x=[t for t, _ in ctl], y=[0] * len(ctl), text=[x for _, x in ctl])
        if full if attribution is None else attribution:
            self._draw_attribution()
        return self._draw_views() if full else None

    def _draw_attribution(self) -> None:
        """Each worker's bar: its categories' shares of its wall time, stacked in ``ATTRIBUTION_COLORS``' order."""
        v = self.view
        t = time.thread_time()  # the share of a core it takes (not the time other threads and processes had)
        self.attribution = a = v.attribution()
        self.attribution_cost = time.thread_time() - t
        self.attribution_spent += self.attribution_cost
        found = {(w["pipeline"], w["stage"]): w for w in a.workers}
        base = [0.0] * len(v.workers)  # stacked by hand: the figure's bar mode overlays (for the timeline)
        with self.figure.batch_update():  # x, y, base, text, customdata
            for c in ATTRIBUTION_COLORS:
                seconds = [found[w][c] if w in found else 0.0 for w in v.workers]
                x = [t / found[w]["wall"] if t else 0.0 for t, w in zip(seconds, v.workers, strict=True)]
                self.trace(f"attribution/{c}").update(
                    y=list(range(len(v.workers))),
                    x=r_list(x),
                    base=r_list(base),
                    text=[f"{share:.0%}" if share >= 0.005 else "" for share in x],
                    customdata=r_list(seconds),
                )
                base = [b + share for b, share in zip(base, x, strict=True)]

    def _draw_rows(self) -> None:
        """The timeline's and the time attribution's rows, and the group strips' pipelines, as they are now."""
        v = self.view
        self._rows = list(v.workers)
        n = len(v.workers)
        ticks = dict(tickvals=list(range(n)), ticktext=[v.label(w) for w in v.workers], range=[n - 0.5, -0.5])
        # one batch per property set (see _draw)
        with self.figure.batch_update():
            for key in ("timeline", "attribution"):
                self.figure.layout[self.axes[key][1]].update(**ticks)
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
        if self.figure.layout[self.axes["accuracy"][0]].dtick != dtick:
            self.figure.layout[self.axes["accuracy"][0]].dtick = dtick
        with self.figure.batch_update():  # x, y, marker colours
            T("stragglers").update(
                x=short,
                y=r_list([st["compute"][w] or 0 for w in v.workers]),
                marker_color=["#E45756" if st["flagged"][w] else "#4C78A8" for w in v.workers],
            )
        return st
