"""The live dashboard: ipywidgets and plotly ``FigureWidget`` views of a run, with its controls.

``Dashboard(run)`` follows a running :class:`sdpipe.Run` from a background
thread a few times a second (only trait values change there, inside
``batch_update``), while the kernel stays free for other cells.
``Dashboard(result)`` replays a finished run from its events.
"""

from __future__ import annotations

import threading
import time

import ipywidgets as W
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from sdpipe.config import LIVE_POLICIES

from .view import CATEGORIES, RunView

__all__ = ["Dashboard"]


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
STRIP = [[0.0, "#FFFFFF"], [0.2, "#FFFFFF"], [0.2, "#D8D8D8"], [0.4, "#D8D8D8"], [0.4, "#4C78A8"], [0.6, "#4C78A8"],
         [0.6, "#E45756"], [0.8, "#E45756"], [0.8, "#54A24B"], [1.0, "#54A24B"]]
PIPELINE_COLORS = ["#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#EECA3B", "#B279A2", "#FF9DA6", "#9D755D", "#BAB0AC"]


class Dashboard:
    """Live (``Dashboard(run)``) or replayed (``Dashboard(result)``) view of a training run.

    ``interval`` is the seconds between redraws (default 0.25: four a
    second); ``window`` the seconds of the scrolling timeline.  Display it as
    the last expression of a cell or with ``display(dashboard)``.
    """

    def __init__(self, source, *, interval: float = 0.25, window: float = 4.0, controls: bool = True, start: bool = True):
        from sdpipe import Run, RunResult

        if not isinstance(source, (Run, RunResult)):
            raise ValueError(f"source: must be a sdpipe.Run or a sdpipe.RunResult, got {type(source).__name__}")
        if not (isinstance(interval, (int, float)) and interval > 0):
            raise ValueError(f"interval: must be seconds > 0, got {interval!r}")
        self.run = source if isinstance(source, Run) else None
        self.result = source if isinstance(source, RunResult) else None
        cfg = source.config
        self.config = cfg
        self.interval = interval
        self.view = RunView(cfg.stages, cfg.pipelines, cfg.batch_size, window=window)
        self._cursor = 0
        self._lock = threading.Lock()
        self._thread = None
        self._stopping = threading.Event()
        self.redraws: list = []  # monotonic times of redraws (for measuring the rate)
        self.error = None
        self._build(controls and self.run is not None)
        if self.result is not None:
            self.view.add(self.result.events)
            self.view.status = "stopped" if self.result.stopped else "finished"
            self.refresh(fetch=False)
        elif start:
            self.start()

    # ------------------------------------------------------------ figures
    def _build(self, controls: bool) -> None:
        """One FigureWidget with every view as a subplot (the browser loads and draws one plot), plus widgets."""
        cfg, v = self.config, self.view
        labels = [v.label(w) for w in v.workers]
        S, n = cfg.stages, len(labels)
        specs = ([[{"colspan": 3}, None, None]] + [[{"colspan": 2}, None, {}] for _ in range(S)]
                 + [[{}, {}, {}]] + [[{"colspan": 3}, None, None]])
        titles = (["Stage timeline (recent seconds)"]
                  + sum(([f"stage {s}: who averaged together (blue: group, red: graph sync, green: global sync, grey: alone)",
                          f"stage {s}: group sizes"] for s in range(S)), [])
                  + ["Stragglers: compute per step (red: above 2x the median)", "training loss per step", "held-out accuracy per epoch",
                     "Whole run: seconds by kind"])
        heights = [30 * n + 40] + [150] * S + [260] + [22 * n + 30]
        fig = make_subplots(rows=S + 3, cols=3, specs=specs, subplot_titles=titles, row_heights=heights,
                            vertical_spacing=0.25 / (S + 3), horizontal_spacing=0.07)
        self._idx = {}

        def add(key, trace, row, col):
            self._idx[key] = len(fig.data)
            fig.add_trace(trace, row=row, col=col)

        for c in CATEGORIES:  # rows are worker indices (small messages); the axis shows their labels
            add(f"timeline/{c}", go.Bar(name=c, orientation="h", y=[], x=[], base=[], marker_color=COLORS[c], hoverinfo="name+x",
                                        legendgroup="kinds"), 1, 1)
        add("timeline/control", go.Scatter(name="control", mode="markers+text", x=[], y=[], text=[], textposition="top center",
                                           marker=dict(symbol="triangle-down", size=11, color="black")), 1, 1)
        fig.update_yaxes(tickvals=list(range(n)), ticktext=labels, autorange="reversed", row=1, col=1)
        fig.update_xaxes(title_text="seconds since launch", row=1, col=1)
        for s in range(S):
            add(f"groups/{s}", go.Heatmap(z=[[0]], x=[0], y=list(range(cfg.pipelines)), zmin=0, zmax=4, colorscale=STRIP,
                                          showscale=False, xgap=1, ygap=1, hovertemplate="formation %{x}<br>pipeline %{y}<extra></extra>"),
                2 + s, 1)
            add(f"sizes/{s}", go.Bar(x=[], y=[], marker_color="#4C78A8", showlegend=False), 2 + s, 3)
            fig.update_yaxes(title_text="pipeline", dtick=1, row=2 + s, col=1)
            fig.update_xaxes(title_text="members", type="category", row=2 + s, col=3)
        r = S + 2
        add("stragglers", go.Bar(x=[], y=[], marker_color=[], showlegend=False, name="compute per step"), r, 1)
        add("stragglers/median", go.Scatter(x=[], y=[], mode="lines", line=dict(dash="dash", color="black"), showlegend=False,
                                            name="median"), r, 1)
        fig.update_yaxes(title_text="seconds", row=r, col=1)
        for p in range(cfg.pipelines):
            color = PIPELINE_COLORS[p % len(PIPELINE_COLORS)]
            add(f"loss/{p}", go.Scatter(name=f"pipeline {p}", x=[], y=[], mode="lines", line_color=color, legendgroup=str(p)), r, 2)
            add(f"accuracy/{p}", go.Scatter(name=f"pipeline {p}", x=[], y=[], mode="lines+markers", line_color=color,
                                            legendgroup=str(p), showlegend=False), r, 3)
        fig.update_xaxes(title_text="step", row=r, col=2)
        fig.update_xaxes(title_text="epoch", row=r, col=3)
        for c in CATEGORIES:
            add(f"shares/{c}", go.Bar(name=c, orientation="h", y=[], x=[], marker_color=COLORS[c], showlegend=False), r + 1, 1)
        fig.update_yaxes(tickvals=list(range(n)), ticktext=labels, autorange="reversed", row=r + 1, col=1)
        fig.update_xaxes(title_text="seconds", row=r + 1, col=1)
        fig.update_layout(height=sum(heights) + 60 * (S + 3) + 80, width=1150, barmode="overlay",
                          margin=dict(l=130, r=20, t=40, b=40), legend=dict(orientation="h", y=1.0, yanchor="bottom"))
        fig.update_annotations(font_size=13)
        self._timeline_xaxis = fig.get_subplot(1, 1).xaxis.plotly_name
        self._shares_xaxis = fig.get_subplot(r + 1, 1).xaxis.plotly_name
        self.figure = go.FigureWidget(fig)
        self.header = W.HTML()
        self.numbers = W.HTML()
        self.message = W.HTML()
        parts = [self.header, self.numbers, self.figure]
        self.controls = self._controls() if controls else None
        if self.controls is not None:
            parts.insert(1, self.controls)
        self.widget = W.VBox(parts)

    def trace(self, key: str):
        """A trace of the dashboard's figure: "timeline/compute", "groups/0", "sizes/0", "stragglers",
        "stragglers/median", "loss/0", "accuracy/0", "shares/compute", ..."""
        return self.figure.data[self._idx[key]]

    def _controls(self):
        run, cfg = self.run, self.config
        sp = run.scheduler_policy
        self.w_policy = W.Dropdown(options=list(LIVE_POLICIES), value=run.policy if run.policy in LIVE_POLICIES else None,
                                   description="policy", disabled=run.policy not in LIVE_POLICIES)
        self.w_staleness = W.BoundedIntText(value=min(sp.staleness, 1000), min=1, max=1000, description="P")
        self.w_max_group = W.BoundedIntText(value=sp.max_group or 0, min=0, max=cfg.pipelines, description="max group",
                                            tooltip="0: all pipelines")
        apply_policy = W.Button(description="apply policy", disabled=self.w_policy.disabled)
        apply_policy.on_click(lambda _: self._act(lambda: run.set_policy(
            self.w_policy.value, staleness=self.w_staleness.value, max_group=self.w_max_group.value or None)))
        h = run.heterogeneity
        self.w_slow = [W.FloatSlider(value=h.slowdown_of(p, 0), min=1.0, max=8.0, step=0.5, description=f"pipeline {p}",
                                     continuous_update=False) for p in range(cfg.pipelines)]
        self.w_prob = W.FloatSlider(value=h.straggle_prob, min=0.0, max=0.5, step=0.05, description="straggle p", continuous_update=False)
        self.w_delay = W.FloatSlider(value=h.straggle_delay, min=0.0, max=0.5, step=0.01, description="delay (s)", continuous_update=False)
        apply_het = W.Button(description="apply slowdowns")

        def set_het():
            slow = {p: w.value for p, w in enumerate(self.w_slow) if w.value > 1.0}
            run.set_heterogeneity(slowdown=slow, straggle_prob=self.w_prob.value, straggle_delay=self.w_delay.value,
                                  link_delay=dict(run.heterogeneity.link_delay))

        apply_het.on_click(lambda _: self._act(set_het))
        buttons = []
        for name, fn in (("pause", run.pause), ("resume", run.resume), ("stop", run.stop)):
            b = W.Button(description=name, button_style="danger" if name == "stop" else "")
            b.on_click(lambda _, fn=fn: self._act(fn))
            buttons.append(b)
        return W.HBox([
            W.VBox([W.HTML("<b>policy</b>"), self.w_policy, self.w_staleness, self.w_max_group, apply_policy]),
            W.VBox([W.HTML("<b>heterogeneity (slowdown per pipeline)</b>")] + self.w_slow + [self.w_prob, self.w_delay, apply_het]),
            W.VBox([W.HTML("<b>run</b>")] + buttons + [self.message]),
        ])

    def _act(self, fn) -> None:
        """Run a control call; show its error in one line instead of raising into the widget callback."""
        try:
            fn()
            self.message.value = "<span style='color:green'>done</span>"
        except Exception as e:  # shown to the user, the run goes on
            self.message.value = f"<span style='color:#b00'>{type(e).__name__}: {e}</span>"

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
            self.redraws.append(time.monotonic())
            if len(self.redraws) > 1000:
                del self.redraws[:500]
            return new

    def _draw(self, full: bool = True) -> None:
        """Redraw the timeline and header; with ``full`` also the slower-moving views."""
        v, T = self.view, self.trace
        tl = v.timeline(bins=120)
        row = {v.label(w): i for i, w in enumerate(v.workers)}
        r4 = lambda xs: [round(x, 4) for x in xs]
        with self.figure.batch_update():
            for c in CATEGORIES:
                T(f"timeline/{c}").update(y=[row[y] for y in tl[c]["y"]], x=r4(tl[c]["x"]), base=r4(tl[c]["base"]))
            lo = v.now - v.window
            ctl = [(t, text) for t, text in v.controls if t >= lo]
            T("timeline/control").update(x=[t for t, _ in ctl], y=[0] * len(ctl), text=[x for _, x in ctl])
            self.figure.layout[self._timeline_xaxis].range = [max(0.0, lo), max(v.now, v.window)]
            steps = self._draw_views() if full else None
        self._draw_header()
        if full:
            self._draw_numbers(steps)

    def _draw_views(self) -> dict:
        v, T = self.view, self.trace
        sh = v.shares()
        base = [0.0] * len(v.workers)  # stacked by hand: the figure's bar mode overlays (for the timeline)
        for c in CATEGORIES:
            T(f"shares/{c}").update(y=list(range(len(v.workers))), x=r_list(sh[c]), base=r_list(base))
            base = [b + x for b, x in zip(base, sh[c])]
        for s in range(v.stages):
            f = v.formations(s)
            xs = list(range(len(f["keys"])))
            T(f"groups/{s}").update(z=f["z"] if xs else [[0]], x=xs or [0])
            sizes = v.sizes.get(s, {})
            T(f"sizes/{s}").update(x=[str(k) for k in range(1, v.pipelines + 1)], y=[sizes.get(k, 0) for k in range(1, v.pipelines + 1)])
        st = v.step_times()
        labels = [v.label(w) for w in v.workers]
        T("stragglers").update(x=labels, y=r_list([st["compute"][w] or 0 for w in v.workers]),
                               marker_color=["#E45756" if st["flagged"][w] else "#4C78A8" for w in v.workers])
        T("stragglers/median").update(x=labels, y=[round(st["median_compute"] or 0, 5)] * len(v.workers))
        for p in range(v.pipelines):
            losses = v.losses.get(p, [])
            T(f"loss/{p}").update(x=[s for s, _ in losses], y=r_list([x for _, x in losses]))
            ep = [m for m in v.epochs.get(p, []) if "accuracy" in m]
            T(f"accuracy/{p}").update(x=[m["epoch"] for m in ep], y=[m["accuracy"] for m in ep])
        return st

    def _draw_numbers(self, st: dict) -> None:
        """The numbers line; ``st`` is the view's step_times() the views were drawn with."""
        v = self.view
        tp = v.throughput()
        fmt = lambda x, f="{:.0f}": "-" if x is None else f.format(x)
        flagged = [v.label(w) for w in v.workers if st["flagged"][w]]
        self.numbers.value = (
            f"<b>samples/s</b> {fmt(tp['samples_per_s'])} &nbsp; <b>ideal</b> (sum of the pipelines' own speeds) "
            f"{fmt(tp['ideal'])} &nbsp; <b>ratio</b> {fmt(tp['ratio'], '{:.2f}')} &nbsp; "
            f"<b>graph syncs</b> {len(v.graph_syncs)} &nbsp; <b>stragglers</b> {', '.join(flagged) or 'none'}")

    def _draw_header(self) -> None:
        v, cfg = self.view, self.config
        source = "live" if self.run is not None else "replay"
        policy = self.run.policy if self.run is not None else cfg.policy
        self.header.value = (f"<b>sdpipe</b> {cfg.stages} stages x {cfg.pipelines} pipelines, policy <b>{policy}</b>, "
                             f"status <b>{v.status}</b> ({source}, {v.count} events, t = {v.now:.1f} s)")

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
        if self._thread is not None:
            self._thread.join(timeout)

    def _follow(self) -> None:
        try:
            n = 0
            while not self._stopping.is_set():
                t = time.monotonic()
                done = self.run.done()
                # the timeline every time; the other views about once a second (they move slowly)
                self.refresh(full=n % max(1, round(1.0 / self.interval)) == 0)
                n += 1
                if done:
                    self.refresh()  # the last records
                    break
                self._stopping.wait(max(0.0, self.interval - (time.monotonic() - t)))
        except Exception as e:  # keep the kernel alive; show what went wrong
            self.error = e
            self.header.value = f"<b>dashboard stopped</b>: {type(e).__name__}: {e}"

    def wait(self, timeout: float = None) -> bool:
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
