"""The dashboard's look: the colours of the kinds of time (the timeline's and the time attribution's), of the
membership strip and of the pipelines, the figure's template, the per-pipeline dashes and symbols."""

from __future__ import annotations

__all__ = ["ATTRIBUTION_COLORS", "COLORS", "DASHES", "PIPELINE_COLORS", "STRIP", "SYMBOLS", "TEMPLATE", "r_list"]


def r_list(xs):
    """Numbers rounded for the wire (figure updates travel as JSON)."""
    return [round(x, 5) for x in xs]


COLORS = {
    "compute": "#4C78A8",
    "communication": "#F58518",
    "synchronization": "#54A24B",
    "waiting": "#BAB0AC",
    "eval": "#B279A2",
    "other": "#E2E2E2",  # time no span covers (a gap in the timeline)
}
#: the colour of each category of the time attribution (:data:`sdpipe.attribution.CATEGORIES`), in the order a
#: worker's bar stacks them: the timeline's colour of the span kinds in it (a pipeline bubble: receives and
#: sends; waiting for its group: the group waits; averaging: the syncs; a pause is drawn as waiting, and hatched
#: in the attribution to tell it from the group waits)
ATTRIBUTION_COLORS = {
    "compute": COLORS["compute"],
    "bubble": COLORS["communication"],
    "group": COLORS["waiting"],
    "averaging": COLORS["synchronization"],
    "eval": COLORS["eval"],
    "paused": COLORS["waiting"],
    "other": COLORS["other"],
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
