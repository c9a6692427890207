"""The dashboard's figure in the browser: plotly's ``FigureWidget`` opened with its full state (:class:`LiveFigure`) and
a probe that reports the output area's width and when the page has drawn a redraw (:class:`WidthProbe`)."""

from __future__ import annotations

import copy
import threading
import time

import anywidget
import plotly.graph_objects as go
import traitlets
from plotly.subplots import make_subplots

from sdpipe.widgets.style import STRIP, TEMPLATE

__all__ = ["LiveFigure", "WidthProbe"]


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


class LiveFigure(go.FigureWidget):
    """plotly's FigureWidget, opened with its full state and answering state requests with its current one.

    plotly syncs the traces and layout only when the widget is created and
    later sends edits as one-off messages, so a front end that builds the
    model late (or misses the creation's update) draws an empty figure.
    """

    def __init__(self, figure, lock):
        self._deferred = True  # open the comm once the figure holds its data (see open)
        self._state_lock = lock
        #: set when a browser has drawn the last redraw (plotly's views answer every edit while the kernel is idle;
        #: the width probe answers also while a cell runs: see WidthProbe)
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


class WidthProbe(anywidget.AnyWidget):
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
