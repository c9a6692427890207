"""Where the dashboard's panels go: the grid of subplots (three columns, or one below ``NARROW`` pixels), their
titles and heights, titles wrapped to their subplots, the legend's place. Pure: no plotly, no widgets; the
dashboard hands :class:`Grid` to plotly's ``make_subplots``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BOTTOM", "NARROW", "TITLE_CHAR_PX", "Grid", "grid", "legend_place", "titles", "wrap_text", "wrapped_titles"]

#: below this output width (pixels) the panels stack in one column
NARROW = 900
#: pixels per character of a subplot title (13 px Open Sans averages about 7; a little more to be safe)
TITLE_CHAR_PX = 7.5
#: pixels between rows: room for a row's tick labels (two lines under the stragglers), its axis title and the
#: next row's title
ROW_GAP = 90
#: pixels under the last panel (the time attribution): its tick labels and its legend (two rows in one column)
BOTTOM = 80


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


def titles(stages: int, metric: str, held_out: bool, attribution_window=None) -> dict:
    """Each panel's title by key ("timeline", "groups/0", "sizes/0", ..., "stragglers", "loss", "accuracy",
    "attribution"); ``metric``: the per-epoch panel's value ("accuracy", "eval_loss", ...);
    ``attribution_window``: the seconds the time attribution covers (None: the whole run)."""
    covered = "whole run" if attribution_window is None else f"last {attribution_window:g} s"
    out = {
        "timeline": "Stage timeline (recent seconds)",
        "stragglers": "Stragglers: compute per step (red: above 2x the median)",
        "loss": "training loss per step",
        "accuracy": f"held-out {metric.replace('eval_loss', 'loss')} per epoch"
        if held_out
        else "training loss per epoch (no held-out data given)",
        "attribution": f"Where each worker's time went, {covered}: shares of its wall time",
    }
    for s in range(stages):
        out[f"groups/{s}"] = (
            f"stage {s}: who averaged together (blue: group, red: graph sync, green: global, grey: alone)"
        )
        out[f"sizes/{s}"] = f"stage {s}: groups by size"
    return out


@dataclass(frozen=True)
class Grid:
    """A layout of the panels: ``pos`` key -> (row, col) (1-based), plotly's ``specs``, the rows' ``heights`` and
    the figure's ``height`` (pixels), the panels in the order plotly numbers their titles (``ordered``)."""

    pos: dict
    specs: list
    heights: list
    cols: int
    ordered: list
    height: int

    @property
    def spacing(self) -> float:
        """plotly's ``vertical_spacing``: the gap between rows as a share of the figure's height."""
        return ROW_GAP / self.height


def grid(stages: int, workers: int, narrow: bool) -> Grid:
    """The wide layout (three columns: the timeline across, per stage its group strip and sizes, then the
    stragglers, loss and per-epoch panels, then the time attribution across) or the narrow one (one column, the same
    order); rows of a panel with one row per worker grow with ``workers``."""
    S = stages
    tall = {"timeline": 30 * workers + 40, "attribution": 24 * workers + 20}
    if narrow:
        keys = (
            ["timeline"]
            + [key for s in range(S) for key in (f"groups/{s}", f"sizes/{s}")]
            + ["stragglers", "loss", "accuracy", "attribution"]
        )
        pos = {k: (i + 1, 1) for i, k in enumerate(keys)}
        specs = [[{}] for _ in keys]
        heights = [tall.get(k, 150 if k.startswith(("groups", "sizes")) else 220) for k in keys]
        ordered, cols = keys, 1
    else:
        pos = {
            "timeline": (1, 1),
            "stragglers": (S + 2, 1),
            "loss": (S + 2, 2),
            "accuracy": (S + 2, 3),
            "attribution": (S + 3, 1),
        }
        for s in range(S):
            pos[f"groups/{s}"], pos[f"sizes/{s}"] = (2 + s, 1), (2 + s, 3)
        specs = (
            [[{"colspan": 3}, None, None]]
            + [[{"colspan": 2}, None, {}] for _ in range(S)]
            + [[{}, {}, {}]]
            + [[{"colspan": 3}, None, None]]
        )
        heights = [tall["timeline"]] + [150] * S + [260] + [tall["attribution"]]
        ordered, cols = sorted(pos, key=lambda k: pos[k]), 3
    height = sum(heights) + ROW_GAP * len(heights) + 40 + BOTTOM
    return Grid(pos=pos, specs=specs, heights=heights, cols=cols, ordered=ordered, height=height)


def wrapped_titles(titles_: dict, ordered: list, domains: dict, width: float, margin_l: float, margin_r: float) -> list:
    """The titles of ``ordered`` panels, each broken into lines that fit its subplot (``domains``: key -> the
    x domain ``(lo, hi)`` as a share of the plot area) in a figure ``width`` pixels wide."""
    plot = max(100.0, width - margin_l - margin_r)
    return [wrap_text(titles_[k], int((domains[k][1] - domains[k][0]) * plot / TITLE_CHAR_PX)) for k in ordered]


def legend_place(narrow: bool, height: int) -> tuple:
    """(top margin, legend y) of a figure ``height`` pixels tall: in one column the legend (above the plots)
    would sit on the first title, centred above it, so it goes above that title, with room in the top margin
    for its rows."""
    top = 130 if narrow else 40
    return top, (1 + 36 / max(1, height - top - 40) if narrow else 1.0)
