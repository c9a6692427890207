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
        cfg, v = self.config, self.view
        labels = [v.label(w) for w in v.workers]
        self.timeline = go.FigureWidget(
            data=[go.Bar(name=c, orientation="h", y=[], x=[], base=[], marker_color=COLORS[c], hoverinfo="name+x") for c in CATEGORIES]
            + [go.Scatter(name="control", mode="markers+text", x=[], y=[], text=[], textposition="top center",
                          marker=dict(symbol="triangle-down", size=11, color="black"))],
            layout=go.Layout(title="Stage timeline (recent seconds)", barmode="overlay", height=90 + 26 * len(labels), width=1150,
                             margin=dict(l=130, r=10, t=40, b=30), xaxis_title="seconds since launch",
                             yaxis=dict(categoryorder="array", categoryarray=labels[::-1]), legend_orientation="h",
                             legend_y=-0.25),
        )
        self.shares = go.FigureWidget(
            data=[go.Bar(name=c, orientation="h", y=labels, x=[0] * len(labels), marker_color=COLORS[c], showlegend=False) for c in CATEGORIES],
            layout=go.Layout(title="Whole run: seconds by kind", barmode="stack", height=90 + 26 * len(labels), width=450,
                             margin=dict(l=130, r=10, t=40, b=30), yaxis=dict(categoryorder="array", categoryarray=labels[::-1])),
        )
        S = cfg.stages
        groups = make_subplots(rows=S, cols=2, column_widths=[0.72, 0.28], horizontal_spacing=0.08, vertical_spacing=0.12,
                               subplot_titles=sum(([f"stage {s}: who averaged together", f"stage {s}: group sizes"] for s in range(S)), []))
        for s in range(S):
            groups.add_trace(go.Heatmap(z=[[0]], x=[0], y=list(range(cfg.pipelines)), zmin=0, zmax=4, colorscale=STRIP,
                                        showscale=False, xgap=1, ygap=1, hovertemplate="round %{x}<br>pipeline %{y}<extra></extra>"),
                             row=s + 1, col=1)
            groups.add_trace(go.Bar(x=[str(k) for k in range(1, cfg.pipelines + 1)], y=[0] * cfg.pipelines, marker_color="#4C78A8",
                                    showlegend=False), row=s + 1, col=2)
            groups.update_yaxes(title_text="pipeline", dtick=1, row=s + 1, col=1)
            groups.update_xaxes(title_text="members", type="category", row=s + 1, col=2)
        groups.update_layout(height=60 + 170 * S, width=700, margin=dict(l=60, r=10, t=50, b=30),
                             title="Group formations (blue: group, red: graph sync, green: global sync, grey: alone)")
        self.groups = go.FigureWidget(groups)
        self.stragglers = go.FigureWidget(
            data=[go.Bar(name="compute per step", x=labels, y=[0] * len(labels), marker_color=["#4C78A8"] * len(labels)),
                  go.Scatter(name="median", x=labels, y=[0] * len(labels), mode="lines", line=dict(dash="dash", color="black"))],
            layout=go.Layout(title="Stragglers: compute per step (red: above 2x the median)", height=300, width=450,
                             margin=dict(l=50, r=10, t=40, b=90), yaxis_title="seconds", showlegend=False),
        )
        curves = make_subplots(rows=1, cols=2, subplot_titles=["training loss per step", "held-out accuracy per epoch"])
        for p in range(cfg.pipelines):
            color = PIPELINE_COLORS[p % len(PIPELINE_COLORS)]
            curves.add_trace(go.Scatter(name=f"pipeline {p}", x=[], y=[], mode="lines", line_color=color, legendgroup=str(p)), row=1, col=1)
            curves.add_trace(go.Scatter(name=f"pipeline {p}", x=[], y=[], mode="lines+markers", line_color=color,
                                        legendgroup=str(p), showlegend=False), row=1, col=2)
        curves.update_layout(height=300, width=700, margin=dict(l=50, r=10, t=40, b=30))
        curves.update_xaxes(title_text="step", row=1, col=1)
        curves.update_xaxes(title_text="epoch", row=1, col=2)
        self.curves = go.FigureWidget(curves)
        self.header = W.HTML()
        self.numbers = W.HTML()
        self.message = W.HTML()
        parts = [self.header, self.timeline, W.HBox([self.groups, W.VBox([self.numbers, self.stragglers])]),
                 W.HBox([self.curves, self.shares])]
        self.controls = self._controls() if controls else None
        if self.controls is not None:
            parts.insert(1, self.controls)
        self.widget = W.VBox(parts)

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
    def refresh(self, fetch: bool = True) -> int:
        """Take in new events and redraw; returns how many events were new."""
        with self._lock:
            new = 0
            if fetch and self.run is not None:
                events, self._cursor = self.run.events_since(self._cursor)
                self.view.add(events)
                self.view.status = self.run.status
                new = len(events)
            self._draw()
            self.redraws.append(time.monotonic())
            if len(self.redraws) > 1000:
                del self.redraws[:500]
            return new

    def _draw(self) -> None:
        v = self.view
        tl = v.timeline()
        with self.timeline.batch_update():
            for i, c in enumerate(CATEGORIES):
                self.timeline.data[i].update(y=tl[c]["y"], x=tl[c]["x"], base=tl[c]["base"])
            lo = v.now - v.window
            ctl = [(t, text) for t, text in v.controls if t >= lo]
            top = v.label(v.workers[0])
            self.timeline.data[-1].update(x=[t for t, _ in ctl], y=[top] * len(ctl), text=[x for _, x in ctl])
            self.timeline.layout.xaxis.range = [max(0.0, lo), max(v.now, v.window)]
        sh = v.shares()
        with self.shares.batch_update():
            for i, c in enumerate(CATEGORIES):
                self.shares.data[i].x = sh[c]
        with self.groups.batch_update():
            for s in range(v.stages):
                f = v.formations(s)
                xs = list(range(len(f["keys"])))
                self.groups.data[2 * s].update(z=f["z"] if xs else [[0]], x=xs or [0])
                sizes = v.sizes.get(s, {})
                self.groups.data[2 * s + 1].y = [sizes.get(k, 0) for k in range(1, v.pipelines + 1)]
        st = v.step_times()
        with self.stragglers.batch_update():
            self.stragglers.data[0].update(y=[st["compute"][w] or 0 for w in v.workers],
                                           marker_color=["#E45756" if st["flagged"][w] else "#4C78A8" for w in v.workers])
            self.stragglers.data[1].y = [st["median_compute"] or 0] * len(v.workers)
        with self.curves.batch_update():
            for p in range(v.pipelines):
                losses = v.losses.get(p, [])
                self.curves.data[2 * p].update(x=[s for s, _ in losses], y=[x for _, x in losses])
                ep = [m for m in v.epochs.get(p, []) if "accuracy" in m]
                self.curves.data[2 * p + 1].update(x=[m["epoch"] for m in ep], y=[m["accuracy"] for m in ep])
        tp = v.throughput()
        fmt = lambda x, f="{:.0f}": "-" if x is None else f.format(x)
        flagged = [v.label(w) for w in v.workers if st["flagged"][w]]
        graph = len(v.graph_syncs)
        self.numbers.value = (
            f"<b>samples/s</b> {fmt(tp['samples_per_s'])} &nbsp; <b>ideal</b> (sum of the pipelines' own speeds) "
            f"{fmt(tp['ideal'])} &nbsp; <b>ratio</b> {fmt(tp['ratio'], '{:.2f}')}<br>"
            f"<b>graph syncs</b> {graph} &nbsp; <b>stragglers</b> {', '.join(flagged) or 'none'}")
        cfg = self.config
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
            while not self._stopping.is_set():
                t = time.monotonic()
                done = self.run.done()
                self.refresh()
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
