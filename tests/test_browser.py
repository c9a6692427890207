"""The quickstart notebook in real JupyterLab, driven by headless Chromium: the *live* dashboard draws.

What a user sees is checked in the page itself: the live dashboard's figure
(the one with controls, not the replay) holds its traces, its timeline bars
are drawn in the fixed colour of their kind, it fits its output area, and
pressing its controls in the page pauses and resumes the run, and sliders moved
in the page apply what they show while the notebook awaits the run; its what-if
panel draws its predictions and a line per live switch, in the figure's font and
colours, whole inside the output area.  A page that opens only after the run
finished (a reload) still draws the figure.
Screenshots go to ``artifacts/browser`` (``SDPIPE_ARTIFACTS`` moves it).
"""

import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from lab_browser import (  # noqa: E402 -- importable only once tools/ is on sys.path (above)
    CHROMIUM,
    chromium_page,
    copy_notebooks,
    jupyterlab,
    notebook_done,
    notebook_errors,
    run_notebook,
    wait_js,
)

from sdpipe.attribution import CATEGORIES as ATTRIBUTION  # noqa: E402
from sdpipe.widgets.dashboard import COLORS, SPARE_PIPELINES  # noqa: E402
from sdpipe.widgets.style import ATTRIBUTION_COLORS  # noqa: E402
from sdpipe.widgets.view import CATEGORIES as KINDS  # noqa: E402

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(
        not os.path.exists(CHROMIUM), reason=f"needs Chromium at {CHROMIUM} (Debian: apt-get install chromium)"
    ),
]

ARTIFACTS = Path(os.environ.get("SDPIPE_ARTIFACTS", ROOT / "artifacts")) / "browser"
NOTEBOOK = "01_quickstart.ipynb"
#: notebook 01: 2 stages x 4 pipelines (loss and metric curves for them and for pipelines that may join); the
#: timeline's kinds, its background lane and control marks, ..., the time attribution's categories
TRACES = len(KINDS) + 1 + 1 + 2 * 2 + 2 + 2 * (4 + SPARE_PIPELINES) + len(ATTRIBUTION)
#: notebook 01's what-if changes: as it runs, the two other live policies, no heterogeneity, the three other
#: schedules, a pipeline more and one fewer
WHATIF_ROWS = 9

# The live dashboard (the output with a "pause" button and a plot), as the page has it: the figure's traces,
# the timeline's drawn bars with their fill colours by trace name, sizes, and the dashboard's text.
LIVE_JS = """() => {
    const outs = Array.from(document.querySelectorAll('.jp-OutputArea-output'));
    const out = outs.find(o => o.querySelector('.js-plotly-plot')
        && Array.from(o.querySelectorAll('button')).some(b => b.textContent.trim() === 'pause'));
    if (!out) return null;
    const gd = out.querySelector('.js-plotly-plot');
    const rgb = s => s.replace(/\\s/g, '');
    // the timeline's bars (the time attribution's, named after its categories, have their own legend)
    const bars = Array.from(gd.querySelectorAll('.barlayer .trace')).map(g => {
        const cd = g.__data__, trace = cd && cd[0] && cd[0].trace;
        return {name: trace && trace.legend !== 'legend2' ? trace.name : null, n: g.querySelectorAll('path').length,
                fills: Array.from(new Set(Array.from(g.querySelectorAll('.point path')).map(p => rgb(p.style.fill))))};
    });
    const control = (gd.data || []).find(t => t.name === 'control');
    return {
        traces: (gd.data || []).length,
        points: (gd.data || []).filter(t => t.name === 'compute' && t.legend !== 'legend2')
            .reduce((a, t) => a + (t.x || []).length, 0),
        bars: bars,
        drawn: bars.filter(b => b.name === 'compute').reduce((a, b) => a + b.n, 0),
        markers: control ? (control.text || []) : [],
        figure_width: gd.getBoundingClientRect().width,
        svg_width: Math.max(...Array.from(gd.querySelectorAll('svg.main-svg'))
            .map(s => s.getBoundingClientRect().width)),
        area_width: out.getBoundingClientRect().width,
        rows: Array.from((gd.layout.yaxis && gd.layout.yaxis.ticktext) || []),
        text: Array.from(out.querySelectorAll('.widget-html')).map(e => e.textContent).join(' | '),
    };
}"""


HEADER_RUNNING = """() => Array.from(document.querySelectorAll('.widget-html'))
    .some(e => /status running, t = /.test(e.textContent))"""


def rgb(hex_color: str) -> str:
    h = hex_color.lstrip("#")
    return "rgb({},{},{})".format(*(int(h[i : i + 2], 16) for i in (0, 2, 4)))


def live(page):
    return page.evaluate(LIVE_JS)


def wait_live(page, test, timeout: float, what: str):
    """Poll the live dashboard until ``test(state)`` holds; returns the state (the last one seen in the error)."""
    try:
        return wait_js(
            page, f"() => {{ const s = ({LIVE_JS})(); return s && ({test}) ? s : null; }}", timeout, what, poll=1.0
        )
    except TimeoutError as e:
        state = live(page) or {}
        seen = {k: state.get(k) for k in ("traces", "drawn", "markers", "svg_width", "area_width", "text")}
        raise TimeoutError(
            f"{e}; the dashboard showed {seen}; the page's kernel connection: {connection(page)}"
        ) from None


def connection(page) -> dict:
    """The page's connection to the notebook's kernel, as JupyterLab has it (for failure messages)."""
    return page.evaluate("""() => {
        const w = window.jupyterapp.shell.currentWidget;
        const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
        if (!k) return null;
        return {status: k.status, connection: k.connectionStatus, pending: (k._pendingMessages || []).length};
    }""")


def check_drawn(state, bars: bool = True) -> None:
    """Every trace arrived, the timeline has drawn bars (``bars``), and every drawn bar has its kind's colour.

    (A run paused for a while can have a timeline window without compute bars: the fits after the pause
    check the colours of what is drawn, not how much.)
    """
    assert state["traces"] == TRACES, state["traces"]
    if bars:
        assert state["drawn"] > 10, state["drawn"]
        kinds = {b["name"] for b in state["bars"] if b["name"] in COLORS and b["fills"]}
        assert {"compute", "communication"} <= kinds, state["bars"]
    for b in state["bars"]:
        if b["name"] in COLORS and b["fills"]:
            assert b["fills"] == [rgb(COLORS[b["name"]])], b
    assert state["svg_width"] <= state["area_width"] + 1, (state["svg_width"], state["area_width"])


def click(page, name: str) -> None:
    """Press the live dashboard's button ``name`` (only the live dashboard has controls).

    A click event on the button in the page, as a mouse click makes, sent in one call: on two cores
    that the run's workers keep busy, Playwright's own click (scrolling, waiting for the layout to
    hold still over several frames) can take longer than the run lasts.
    """
    pressed = page.evaluate(
        """(name) => {
        const b = Array.from(document.querySelectorAll('button.sdpipe-button'))
            .find(b => b.textContent.trim() === name);
        if (b) b.click();
        return !!b;
    }""",
        name,
    )
    assert pressed, f"no {name!r} button in the page"


def slide(page, label: str, value: float) -> None:
    """Move the live dashboard's slider ``label`` to ``value`` as a user's drag does (the page's input events)."""
    moved = page.evaluate(
        """([label, value]) => {
        const row = Array.from(document.querySelectorAll('.sdpipe-controls label')).find(
            r => r.querySelector('span').textContent.trim() === label && r.querySelector('input[type=range]'));
        if (!row) return false;
        const input = row.querySelector('input[type=range]');
        input.value = String(value);
        input.dispatchEvent(new Event('input', {bubbles: true}));
        input.dispatchEvent(new Event('change', {bubbles: true}));
        return true;
    }""",
        [label, value],
    )
    assert moved, f"no slider {label!r} in the page"


def type_in(page, selector: str, value: str) -> None:
    """Type ``value`` into the live dashboard's input at ``selector`` as a user's typing does (its input event)."""
    typed = page.evaluate(
        """([selector, value]) => {
        const input = document.querySelector(selector);
        if (!input) return false;
        input.value = value;
        input.dispatchEvent(new Event('input', {bubbles: true}));
        return true;
    }""",
        [selector, value],
    )
    assert typed, f"no input {selector!r} in the page"


#: seconds from each press until the page showed what it did, by button (written to live.json)
SHOWN_AFTER: dict = {}


def press(page, name: str, test: str, what: str, wait: float = 20.0):
    """Press ``name`` once; the live dashboard must show ``test`` within ``wait`` seconds.

    The dashboard redraws only as fast as the page answers that it drew the
    last one, so a page on a loaded machine is never more than a redraw
    behind and what a press did shows at the next redraw, which it starts.
    """
    t = time.monotonic()
    click(page, name)
    state = wait_live(page, test, wait, what)
    SHOWN_AFTER.setdefault(name, []).append(round(time.monotonic() - t, 2))
    return state


# Every subplot of the live dashboard as drawn: its title (the text drawn, and the one the figure holds), whether
# the title's box lies inside the figure and clear of the other titles, and how many of its traces hold data.
PANELS_JS = """() => {
    const outs = Array.from(document.querySelectorAll('.jp-OutputArea-output'));
    const out = outs.find(o => o.querySelector('.js-plotly-plot')
        && Array.from(o.querySelectorAll('button')).some(b => b.textContent.trim() === 'pause'));
    if (!out) return null;
    const gd = out.querySelector('.js-plotly-plot');
    const svg = gd.querySelector('svg.main-svg').getBoundingClientRect();
    const drawn = Array.from(gd.querySelectorAll('g.annotation')).map(g => {
        const r = g.getBoundingClientRect();
        const lines = Array.from(g.querySelectorAll('text.annotation-text tspan.line'));
        const text = (lines.length ? lines.map(t => t.textContent) : [g.textContent]).join(' ');
        return {text: text.replace(/\\s+/g, ' ').trim(), left: r.left, right: r.right, top: r.top, bottom: r.bottom};
    });
    const full = (gd.layout.annotations || []).map(a => a.text.replace(/<br>/g, ' '));
    const inside = drawn.every(d => d.left >= svg.left - 1 && d.right <= svg.right + 1);
    const overlaps = [];
    for (let i = 0; i < drawn.length; i++) for (let j = i + 1; j < drawn.length; j++) {
        const a = drawn[i], b = drawn[j];
        if (a.left < b.right - 1 && b.left < a.right - 1 && a.top < b.bottom - 1 && b.top < a.bottom - 1)
            overlaps.push([a.text, b.text]);
    }
    // traces by subplot (their axes); a subplot with data has a trace with points (x, or z for the strips)
    const panels = {};
    for (const t of gd.data) {
        const key = (t.xaxis || 'x') + (t.yaxis || 'y');
        const n = (t.x || []).length * (t.type === 'heatmap' ? ((t.z || []).flat().some(v => v > 0) ? 1 : 0) : 1);
        panels[key] = (panels[key] || 0) + n;
    }
    return {drawn: drawn.map(d => d.text), full: full, inside: inside, overlaps: overlaps,
            empty: Object.entries(panels).filter(([k, n]) => n === 0).map(([k]) => k),
            width: svg.width};
}"""

# The control panel as the page shows it: each slider's value, and which buttons and inputs are enabled.
CONTROLS_JS = """() => {
    const root = document.querySelector('.sdpipe-controls');
    if (!root) return null;
    const sliders = {};
    for (const row of root.querySelectorAll('label')) {
        const input = row.querySelector('input[type=range]');
        if (input) sliders[row.querySelector('span').textContent.trim()] = Number(input.value);
    }
    const enabled = Array.from(root.querySelectorAll('button')).filter(b => !b.disabled).map(b => b.textContent.trim());
    const inputs = Array.from(root.querySelectorAll('input, select')).filter(e => !e.disabled).length;
    return {sliders: sliders, enabled: enabled, inputs: inputs, status: root.dataset.status};
}"""


# The time attribution as drawn: each segment of the workers' bars (its category, row, share, drawn width and fill;
# a hatched one's fill is its pattern's background), the panel's rows and length, its legend's box and entries and
# the tick labels' boxes above it, the titles' boxes, and the bottleneck's line (its box and whether its text fits).
ATTRIBUTION_JS = """() => {
    const outs = Array.from(document.querySelectorAll('.jp-OutputArea-output'));
    const out = outs.find(o => o.querySelector('.js-plotly-plot')
        && Array.from(o.querySelectorAll('button')).some(b => b.textContent.trim() === 'pause'));
    if (!out) return null;
    const gd = out.querySelector('.js-plotly-plot');
    const box = e => { const r = e.getBoundingClientRect();
        return {left: r.left, right: r.right, top: r.top, bottom: r.bottom, width: r.width, height: r.height}; };
    const fill = p => {
        const m = /url\\(["']?[^#]*#([^"')]+)/.exec(p.style.fill);
        if (!m) return p.style.fill.replace(/\\s/g, '');
        const rect = document.getElementById(m[1]) && document.getElementById(m[1]).querySelector('rect');
        return 'pattern ' + (rect ? rect.getAttribute('fill').replace(/\\s/g, '') : '?');
    };
    const segments = [];
    for (const g of gd.querySelectorAll('.barlayer .trace')) {
        const cd = g.__data__, trace = cd && cd[0] && cd[0].trace;
        if (!trace || trace.legend !== 'legend2') continue;
        for (const pt of g.querySelectorAll('.point')) {
            const path = pt.querySelector('path');
            if (path) segments.push({name: trace.name, row: pt.__data__.p, share: pt.__data__.s,
                                     width: path.getBoundingClientRect().width, fill: fill(path)});
        }
    }
    const first = gd.data.find(t => t.legend === 'legend2');
    const xa = gd._fullLayout[first.xaxis.replace('x', 'xaxis')];
    const ya = gd._fullLayout[first.yaxis.replace('y', 'yaxis')];
    const legend = gd.querySelector('g.legend2');
    const line = Array.from(out.querySelectorAll('.widget-html')).find(e => /^\\s*bottleneck/.test(e.textContent));
    const content = line && (line.querySelector('.widget-html-content') || line);
    return {
        segments: segments, rows: Array.from(ya.ticktext || []), length: xa._length,
        svg: box(gd.querySelector('svg.main-svg')), area: box(out),
        legend: legend && box(legend),
        entries: legend ? Array.from(legend.querySelectorAll('g.traces')).map(g => g.textContent.trim()) : [],
        ticks: Array.from(gd.querySelectorAll('g.' + first.xaxis + 'tick text')).map(box),
        titles: Array.from(gd.querySelectorAll('g.annotation')).map(box),
        sentence: line && {text: line.textContent.replace(/\\s+/g, ' ').trim(), box: box(line),
            fits: content.scrollWidth <= content.clientWidth + 1 && content.scrollHeight <= content.clientHeight + 1,
            shown: line.checkVisibility({checkOpacity: true, checkVisibilityCSS: true})},
    };
}"""


def check_attribution(page, where: str, workers: int) -> dict:
    """The time attribution drawn: a bar per worker (the timeline's rows) with non-zero segments across the whole
    panel, each in its category's colour (the timeline's kinds'; a pause hatched), its legend clear of the tick
    labels and the titles; the bottleneck's sentence (of the last 30 s) under the figure, whole, inside the output
    area."""
    drawn = "new Set(s.segments.filter(x => x.share > 0).map(x => x.row)).size"
    test = f"s.rows.length == {workers} && {drawn} == {workers}"
    state = wait_js(
        page,
        f"() => {{ const s = ({ATTRIBUTION_JS})(); return s && ({test}) ? s : null; }}",
        30,
        f"{where}: the time attribution's bars drawn for every worker",
    )
    rows = {}
    for seg in state["segments"]:
        if seg["share"] > 0:
            rows.setdefault(seg["row"], []).append(seg)
            want = rgb(ATTRIBUTION_COLORS[seg["name"]])
            assert seg["fill"] == (f"pattern {want}" if seg["name"] == "paused" else want), (where, seg)
    assert sorted(rows) == list(range(workers)), (where, rows)
    for row, segs in rows.items():
        assert sum(x["share"] for x in segs) == pytest.approx(1.0, abs=0.01), (where, row, segs)
        assert sum(x["width"] for x in segs) >= 0.97 * state["length"], (where, row, segs, state["length"])
    legend, svg = state["legend"], state["svg"]
    assert state["entries"] == list(ATTRIBUTION_COLORS), (where, state["entries"])
    assert svg["left"] - 1 <= legend["left"] and legend["right"] <= svg["right"] + 1, (where, legend, svg)
    assert legend["bottom"] <= svg["bottom"] + 1 and legend["top"] >= max(t["bottom"] for t in state["ticks"]) - 1
    assert not [t for t in state["titles"] if t["top"] < legend["bottom"] - 1 and legend["top"] < t["bottom"] - 1]
    line, area = state["sentence"], state["area"]
    assert line and line["text"].startswith("bottleneck (over the last 30 s): "), (where, line)
    assert line["fits"] and line["shown"] and line["box"]["height"] > 10, (where, line)
    assert line["box"]["top"] >= svg["bottom"] - 1, (where, line, svg)  # under the figure
    assert area["left"] - 1 <= line["box"]["left"] and line["box"]["right"] <= area["right"] + 1, (where, line, area)
    return state


# The what-if panel as drawn: its box and the output area's, whether it overflows, its font and colour, and its two
# tables (the predictions, headed "change"; the switches, headed "t"): their boxes, header background, and per row
# its cells' text, background and whether a cell's text is clipped.
WHATIF_JS = """() => {
    const outs = Array.from(document.querySelectorAll('.jp-OutputArea-output'));
    const out = outs.find(o => o.querySelector('.js-plotly-plot')
        && Array.from(o.querySelectorAll('button')).some(b => b.textContent.trim() === 'pause'));
    const panel = out && out.querySelector('.sdpipe-whatif');
    if (!panel) return null;
    const box = e => { const r = e.getBoundingClientRect();
        return {left: r.left, right: r.right, top: r.top, bottom: r.bottom, width: r.width, height: r.height}; };
    const style = getComputedStyle(panel);
    const tables = {};
    for (const t of panel.querySelectorAll('table')) {
        const rows = Array.from(t.rows);
        tables[rows[0].cells[0].textContent.trim()] = {
            box: box(t), head: getComputedStyle(rows[0]).backgroundColor,
            rows: rows.slice(1).map(r => ({cells: Array.from(r.cells).map(c => c.textContent.trim()),
                background: getComputedStyle(r).backgroundColor,
                clipped: Array.from(r.cells).some(c => c.scrollWidth > c.clientWidth + 1)})),
        };
    }
    return {box: box(panel), area: box(out), scroll: panel.scrollWidth, client: panel.clientWidth,
            font: style.fontFamily, color: style.color, text: panel.textContent.replace(/\\s+/g, ' ').trim(),
            shown: panel.checkVisibility({checkOpacity: true, checkVisibilityCSS: true}), tables: tables,
            numbers: box(Array.from(out.querySelectorAll('.widget-html')).find(e => /samples\\/s/.test(e.textContent)
                && /ideal/.test(e.textContent)))};
}"""


# The what-if panel of the live dashboard scrolled to the top of the notebook: its box in the page, or null.
PANEL_BOX_JS = """() => {
    const out = Array.from(document.querySelectorAll('.jp-OutputArea-output'))
        .find(o => Array.from(o.querySelectorAll('button')).some(b => b.textContent.includes('pause')));
    const panel = out && out.querySelector('.sdpipe-whatif');
    if (!panel) return null;
    panel.scrollIntoView({block: 'start'});
    const r = panel.getBoundingClientRect();
    return {x: r.left, y: r.top, width: r.width, height: r.height};  // in the viewport, as a clip takes it
}"""


def check_whatif(
    page, where: str, rows: Optional[int] = None, switches: int = 0, measured: bool = False, shot: str = ""
) -> dict:
    """The what-if panel drawn under the numbers line, in the figure's font and colours: with ``rows``, its
    predictions table with that many changes (the best that keeps one model, if one beats the run as it runs, in
    the averaging's green and named above); at least ``switches`` switch lines (``measured``: each measured, or
    said to have no whole epoch); inside the output area, nothing clipped, no scroll bar.  ``shot``: a
    screenshot of the panel alone, by that name."""
    switch = f"s.tables.t && s.tables.t.rows.length >= {switches}" if switches else "true"
    if measured:
        switch += " && s.tables.t.rows.every(r => / over \\d+ epochs?|no whole epoch/.test(r.cells[4]))"
    table = f"s.tables.change && s.tables.change.rows.length == {rows}" if rows else "true"
    test = f"{table} && {switch}"
    state = wait_js(
        page,
        f"() => {{ const s = ({WHATIF_JS})(); return s && ({test}) ? s : null; }}",
        240,
        f"{where}: the what-if panel's predictions ({rows} changes) and {switches} switch lines",
    )
    text = state["text"]
    assert state["shown"] and state["box"]["height"] > 40, (where, state["box"])
    assert state["font"].startswith('"Open Sans"') and state["color"] == "rgb(42, 63, 95)", (where, state)
    assert state["box"]["top"] >= state["numbers"]["bottom"] - 1, (where, state["box"], state["numbers"])
    area = state["area"]
    assert state["scroll"] <= state["client"] + 1, (where, state["scroll"], state["client"])
    for name, table in state["tables"].items():
        assert table["head"] == "rgb(229, 236, 246)", (where, name, table["head"])
        box = table["box"]
        assert area["left"] - 1 <= box["left"] and box["right"] <= area["right"] + 1, (where, name, box, area)
        assert not [r for r in table["rows"] if r["clipped"]], (where, name, table["rows"])
    table = state["tables"].get("change")
    if rows:
        assert table["rows"][0]["cells"][0] == "as it runs" and all(len(r["cells"]) == 5 for r in table["rows"])
        green = [r["cells"][0] for r in table["rows"] if r["background"] == "rgb(227, 240, 225)"]
        if "best keeping one model: " in text:
            named = text.split("best keeping one model: ")[1].split(",")[0]
            assert green == [named] and named != "policy none", (where, green, named)
        else:
            assert green == [] and "no change that keeps one model is predicted faster" in text, (where, text)
    if switches:
        assert text.count("after a switch") == 1 and all(len(r["cells"]) == 6 for r in state["tables"]["t"]["rows"])
    if shot:  # the panel as drawn now: a clip of the page, found, scrolled to and measured in one evaluation (the
        # panel is drawn anew with each prediction while the dashboard redraws four times a second: an element's
        # screenshot waits for it to hold still, and a locator's evaluation could keep finding a panel just replaced)
        box = page.evaluate(PANEL_BOX_JS)
        assert box is not None and box["width"] > 0 and box["height"] > 0, (where, box)
        page.screenshot(path=str(ARTIFACTS / shot), clip=box, timeout=60_000)
    return state


def check_panels(page, where: str) -> dict:
    """Every subplot title drawn whole, inside the figure, clear of the others; no subplot without data."""
    state = page.evaluate(PANELS_JS)
    assert state is not None, f"{where}: no live dashboard in the page"
    assert state["drawn"] == state["full"], (where, state["drawn"], state["full"])
    assert state["inside"] and not state["overlaps"], (where, state)
    assert not state["empty"], (where, state)
    return state


# The output area scrolled to the top of the notebook's scroll box: whether all of it is in that box now.
IN_VIEW_JS = """e => {
    let box = e.parentElement;
    while (box && !/(auto|scroll)/.test(getComputedStyle(box).overflowY)) box = box.parentElement;
    e.scrollIntoView({block: 'start'});
    return !box || e.getBoundingClientRect().bottom <= box.getBoundingClientRect().bottom + 1;
}"""


def screenshot(page, name: str) -> Path:
    """The live dashboard's output area, all of it: the viewport made taller than it where it is not, and the
    area scrolled to the top of the notebook (what lies outside the notebook's scroll box photographs blank: in
    one column, eight workers' dashboard is some 3,400 pixels tall)."""
    path = ARTIFACTS / name
    out = page.locator(".jp-OutputArea-output", has=page.locator("button", has_text="pause")).first
    size = page.viewport_size
    tall = int(out.evaluate("e => e.getBoundingClientRect().height")) + 300
    if tall > size["height"]:
        page.set_viewport_size({"width": size["width"], "height": tall})
    deadline = time.monotonic() + 10
    while not out.evaluate(IN_VIEW_JS):  # JupyterLab lays its panels out for the new size in a moment
        assert time.monotonic() < deadline, f"{name}: the dashboard does not fit the notebook's scroll box"
        time.sleep(0.2)
    out.screenshot(path=str(path))
    return path


def finish(page, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not notebook_done(page):
        assert time.monotonic() < deadline, "the notebook did not finish"
        time.sleep(1.0)
    assert notebook_errors(page) == []


def without_speed_claims(nb: Path) -> None:
    """Notebook 01 copied without its two cells that compare speeds and shares (who trained how much, the
    policies' samples/s): nbval checks those in a kernel of their own, while here Chromium draws beside the run
    on the same cores (and the live test pauses the run and removes pipeline 3), which moves what they measure."""
    book = json.loads(nb.read_text())
    marks = ('print(f"pipeline {p} trained', 'print(f"median round')
    kept = [c for c in book["cells"] if not any(m in "".join(c["source"]) for m in marks)]
    assert len(book["cells"]) - len(kept) == len(marks), "notebook 01's comparison cells moved"
    book["cells"] = kept
    nb.write_text(json.dumps(book, indent=1))


def test_live_dashboard_draws_in_its_colours_fits_and_answers_its_controls(tmp_path, no_leaks):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    copy_notebooks(ROOT / "notebooks", tmp_path, [NOTEBOOK])
    # ten times the epochs: on two cores the run's 8 workers leave the page little time (its first steps were
    # drawn over a minute late once, and the 100 epochs this test had were over before it could press pause), and
    # the test must press pause, and remove a pipeline, while the run still trains, and after the resume the
    # what-if panel predicts both switches and the run (its thread takes a twentieth of a core: some 30 s each)
    nb = tmp_path / NOTEBOOK
    assert "epochs=20," in nb.read_text()
    nb.write_text(nb.read_text().replace("epochs=20,", "epochs=200,"))
    without_speed_claims(nb)
    # a viewport of a screen's height while the run trains (a taller one makes the browser draw more each
    # redraw), a tall one for the screenshots (a dashboard taller than the viewport photographs cut off)
    with jupyterlab(tmp_path) as (url, token), chromium_page(width=1440, height=1000) as page:
        run_notebook(page, url, token, NOTEBOOK)
        page.evaluate(
            "() => window.jupyterapp.shell.activateById('filebrowser')"
        )  # the file browser open, as users have it
        # pause as soon as the run trains (a cheap look at the header: the run lasts under a minute)
        try:
            wait_js(page, HEADER_RUNNING, 240, "the live dashboard's header saying the run is running", poll=0.25)
        except TimeoutError as e:
            headers = page.evaluate(
                "() => Array.from(document.querySelectorAll('.widget-html')).map(e => e.textContent).slice(0, 3)"
            )
            raise TimeoutError(f"{e}; the page showed {headers}; its kernel connection: {connection(page)}") from None
        # and once its timeline has drawn some steps (on a loaded machine the first redraws come steps apart)
        wait_live(page, "s.drawn > 10", 120, "the live timeline drawing its first steps")
        state = press(
            page,
            "pause",
            "/status paused/.test(s.text) && s.markers.includes('pause') && /pause applied at t = /.test(s.text)",
            "the run paused from the page, with its control event in the timeline",
        )
        check_drawn(state)
        page.set_viewport_size({"width": 1440, "height": 3000})
        check_attribution(page, "paused, 1440 px", 8)
        shots = [screenshot(page, "live-1440-filebrowser.png")]
        page.set_viewport_size({"width": 1000, "height": 3000})
        fitted = (
            "s.svg_width <= s.area_width + 1 && s.svg_width >= s.area_width - 40"  # the figure takes the area's width
        )
        state = wait_live(page, f"{fitted} && s.area_width < 900", 30, "the figure fitted to 1000 px")
        check_drawn(state, bars=False)
        check_attribution(page, "paused, 1000 px", 8)
        shots.append(screenshot(page, "live-1000-filebrowser.png"))
        page.evaluate("() => window.jupyterapp.shell.collapseLeft()")
        state = wait_live(
            page, f"{fitted} && s.area_width > 700", 30, "the figure fitted to 1000 px without the file browser"
        )
        check_drawn(state, bars=False)
        shots.append(screenshot(page, "live-1000.png"))
        page.set_viewport_size({"width": 1000, "height": 1000})
        # sliders moved while the notebook's cell awaits the run reach the kernel with the press (twice: with
        # ipywidgets' sliders the page held every change after the first until the cell ended)
        slide(page, "pipeline 1", 3.0)
        press(
            page,
            "slowdowns",
            "/slowdowns applied at t = [0-9.]+ s: pipeline 1 x3, /.test(s.text)",
            "the slowdown set in the page applied",
        )
        slide(page, "pipeline 1", 1.0)
        slide(page, "pipeline 2", 2.5)
        press(
            page,
            "slowdowns",
            "/slowdowns applied at t = [0-9.]+ s: pipeline 2 x2\\.5, /.test(s.text)",
            "the second slowdown set in the page applied",
        )
        press(
            page,
            "resume",
            "/status running/.test(s.text) && s.markers.includes('resume')",
            "the run resumed from the page, with its control event in the timeline",
        )
        # the two slowdowns pressed are live switches of its heterogeneity: a line each in the what-if panel
        check_whatif(page, "after the switches, 1000 px", switches=2)
        # the straggler removed from the page: it leaves at its next step boundary and its rows go
        type_in(page, '.sdpipe-controls input[title="the pipeline to remove"]', "3")
        press(
            page,
            "remove pipeline",
            "/remove pipeline applied at t = [0-9.]+ s: pipeline 3 leaves/.test(s.text)",
            "the removal acknowledged",
        )
        state = wait_live(
            page,
            "s.rows.length == 6 && !s.rows.includes('pipeline 3 stage 0') && / x 3 pipelines/.test(s.text)",
            60,
            "the removed pipeline's rows gone from the timeline",
        )
        assert state["rows"] == [f"pipeline {p} stage {s}" for p in range(3) for s in range(2)], state["rows"]
        check_whatif(page, "training, 1000 px", WHATIF_ROWS, switches=2, shot="whatif-live-1000.png")
        shots.append(screenshot(page, "live-removed.png"))
        finish(page)
        # the run ended: no button applies any more, every panel has data, titles whole at both widths
        controls = page.evaluate(CONTROLS_JS)
        assert controls["enabled"] == [] and controls["inputs"] == 0, controls
        shots += views_after_the_end(page, "01", workers=6, switches=2)  # pipeline 3 removed
        (ARTIFACTS / "live.json").write_text(
            json.dumps({**{k: v for k, v in state.items() if k != "bars"}, "shown_after_s": SHOWN_AFTER}, indent=1)
        )
    for shot in shots:
        assert shot.stat().st_size > 20_000, shot


def test_a_page_opened_after_the_run_finished_still_draws_the_live_figure(tmp_path, no_leaks):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    copy_notebooks(ROOT / "notebooks", tmp_path, [NOTEBOOK])
    without_speed_claims(tmp_path / NOTEBOOK)
    with jupyterlab(tmp_path) as (url, token):
        with chromium_page(width=1440, height=1000) as page:
            run_notebook(page, url, token, NOTEBOOK)
            finish(page)
            page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
            wait_js(page, "() => !window.jupyterapp.shell.currentWidget.context.model.dirty", 30, "the notebook saved")
        # a new page, as after a reload: the kernel and its widgets live on, the run is over
        with chromium_page(width=1440, height=3000) as page:
            page.goto(f"{url}/lab/tree/{NOTEBOOK}?token={token}", timeout=120_000)
            state = wait_live(page, "s.drawn > 10", 120, "the finished run's live figure drawn in a new page")
            check_drawn(state)
            assert state["points"] > 10 and "status finished" in state["text"]
            screenshot(page, "live-after-reload.png")


def controls(page) -> dict:
    return page.evaluate(CONTROLS_JS)


def views_after_the_end(page, notebook: str, workers: Optional[int] = None, switches: Optional[int] = None) -> list:
    """At 1440 and 1000 px: the figure fitted, every panel drawn whole with data (check_panels), with ``workers``
    the time attribution of that many workers (check_attribution), with ``switches`` the what-if panel with as many
    switch lines, each measured (check_whatif); screenshots."""
    shots = []
    for width in (1440, 1000):
        page.set_viewport_size({"width": width, "height": 3000})
        wait_live(page, "s.svg_width <= s.area_width + 1 && s.svg_width >= s.area_width - 40", 30, f"{width} px")
        check_panels(page, f"notebook {notebook} at {width} px")
        if workers is not None:
            check_attribution(page, f"notebook {notebook} at {width} px", workers)
        if switches is not None:
            at = f"notebook {notebook} at {width} px"
            check_whatif(page, at, WHATIF_ROWS, switches, measured=True, shot=f"whatif-nb{notebook}-{width}.png")
        shots.append(screenshot(page, f"nb{notebook}-{width}.png"))
    return shots


PRESSES_DONE = "presses.done"


def hold_stop(nb: Path) -> None:
    """Notebook 03's plan stops the run 4 phases after its first step.  A test that presses the page's controls in a
    phase cannot know how long the page takes to answer on a loaded machine, so its copy of the notebook makes the
    plan's stop wait (up to 5 minutes) for a file the test writes when its presses are done; the phases' lengths
    and every other cell stay as they are."""
    import nbformat

    book = nbformat.read(nb, as_version=4)
    cell = next(c for c in book.cells if '("stopped", run.stop)' in c.source)
    cell.source = cell.source.replace('("stopped", run.stop)', '("stopped", lambda: stop_after_the_presses())')
    cell.source += f"""


def stop_after_the_presses():  # added by the test
    import os

    deadline = time.time() + 300
    while not os.path.exists({PRESSES_DONE!r}) and time.time() < deadline:
        time.sleep(0.25)
    run.stop()
"""
    nbformat.write(book, nb)


def test_steering_notebook_controls_follow_the_run_and_a_press_changes_only_what_was_touched(tmp_path, no_leaks):
    """Notebook 03 with Run All: its plan slows pipeline 3 down from code; the page's slider shows it, and a press
    after moving pipeline 1's slider keeps pipeline 3's slowdown.  After the end nothing can be pressed; every panel
    has data (no held-out data: the per-epoch panel shows the training loss) and every title is whole."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    name = "03_steering.ipynb"
    copy_notebooks(ROOT / "notebooks", tmp_path, [name])
    nb = tmp_path / name
    assert "PHASE = 8.0" in nb.read_text()
    nb.write_text(nb.read_text().replace("PHASE = 8.0", "PHASE = 15.0"))  # phases long enough to measure with presses
    hold_stop(nb)  # and the plan's stop waits for the presses, however slowly the machine lets the page answer
    with jupyterlab(tmp_path) as (url, token), chromium_page(width=1440, height=1000) as page:
        run_notebook(page, url, token, name)
        wait_js(page, HEADER_RUNNING, 240, "the live dashboard's header saying the run is running", poll=0.25)
        # Run All shows the notebook's last cell; the live dashboard brought itself into view when it was shown
        in_view = page.evaluate("""() => {
            const b = Array.from(document.querySelectorAll('button.sdpipe-button'))
                .find(b => b.textContent === 'pause');
            const r = b.closest('.jp-OutputArea-output').getBoundingClientRect();
            return r.top < window.innerHeight && r.bottom > 0;
        }""")
        assert in_view, "the live dashboard is not in view after Run All"
        # before the plan's change: running, resume the only button that does not apply
        state = wait_js(
            page,
            f"() => {{ const c = ({CONTROLS_JS})(); return c && c.status === 'running' ? c : null; }}",
            30,
            "the controls of a running run",
        )
        assert "resume" not in state["enabled"] and {"pause", "stop", "slowdowns"} <= set(state["enabled"]), state
        # the plan sets pipeline 3 to 4x from code: the slider shows it
        state = wait_js(
            page,
            f"() => {{ const c = ({CONTROLS_JS})(); return c && c.sliders['pipeline 3'] === 4 ? c : null; }}",
            90,
            "pipeline 3's slider showing the slowdown the plan set from code",
        )
        assert state["sliders"]["pipeline 1"] == 1, state
        slide(page, "pipeline 1", 3.0)
        press(
            page,
            "slowdowns",
            "/slowdowns applied at t = [0-9.]+ s: pipeline 1 x3, pipeline 3 x4, /.test(s.text)",
            "pipeline 1 slowed from the page, pipeline 3 still 4x",
        )
        slide(page, "pipeline 1", 1.0)
        press(
            page,
            "slowdowns",
            "/slowdowns applied at t = [0-9.]+ s: pipeline 3 x4, /.test(s.text)",
            "pipeline 1 back to full speed, pipeline 3 still 4x",
        )
        (tmp_path / PRESSES_DONE).touch()
        finish(page)
        state = controls(page)
        assert state["enabled"] == [] and state["inputs"] == 0 and state["status"] == "stopped", state
        shots = views_after_the_end(page, "03")
    for shot in shots:
        assert shot.stat().st_size > 20_000, shot


def test_transformer_notebook_after_run_all_fits_with_every_panel_drawn(tmp_path, no_leaks):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    name = "05_transformer.ipynb"
    copy_notebooks(ROOT / "notebooks", tmp_path, [name])
    with jupyterlab(tmp_path) as (url, token), chromium_page(width=1440, height=1000) as page:
        run_notebook(page, url, token, name)
        finish(page, timeout=900)
        state = controls(page)
        assert state["enabled"] == [] and state["status"] == "finished", state
        shots = views_after_the_end(page, "05")
    for shot in shots:
        assert shot.stat().st_size > 20_000, shot


def test_the_recut_control_moves_the_stages_and_the_timeline_marks_the_moment(tmp_path, no_leaks):
    """Notebook 08's first run (the digits CNN cut badly: stage 1 holds the last layer alone), awaited in its cell:
    the control panel shows the run's cut; a cut typed in the page and pressed is applied (the message line says
    so), the panel then shows the new cut, and the timeline marks the moment; stop ends the run."""
    import nbformat

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    nb = nbformat.read(ROOT / "notebooks" / "08_recut.ipynb", as_version=4)
    cells = nb.cells
    start = next(i for i, c in enumerate(cells) if "run = sdpipe.train(" in c.source)
    close = next(c for c in cells if "sdpipe.close_cluster(" in c.source)
    awaited = nbformat.v4.new_code_cell("result = await run.wait_async(timeout=900)\nprint(result.config.cuts)")
    nb.cells = [*cells[: start + 1], awaited, close]
    assert "cuts=(9,)" in cells[start].source
    name = "recut.ipynb"
    nbformat.write(nb, tmp_path / name)
    with jupyterlab(tmp_path) as (url, token), chromium_page(width=1440, height=1000) as page:
        run_notebook(page, url, token, name)
        wait_js(page, HEADER_RUNNING, 240, "the live dashboard's header saying the run is running", poll=0.25)
        wait_live(page, "s.drawn > 10", 120, "the live timeline drawing its first steps")
        cut_input = """() => {
            const i = document.querySelector('.sdpipe-controls .sdpipe-stages input');
            const b = Array.from(document.querySelectorAll('button.sdpipe-button'))
                .find(b => b.textContent === 're-cut');
            return i && b ? {value: i.value, disabled: i.disabled || b.disabled} : null;
        }"""
        shown = wait_js(page, f"() => {{ const s = ({cut_input})(); return s && !s.disabled ? s : null; }}", 60,
                        "the re-cut control enabled")  # fmt: skip
        assert shown["value"] == "9", shown
        type_in(page, ".sdpipe-controls .sdpipe-stages input", "6")
        press(
            page,
            "re-cut",
            "/re-cut applied at t = [0-9.]+ s: stages start at layers 0, 6; every worker took it/.test(s.text)"
            " && s.markers.includes('recut: stages start at layers 0, 6')",
            "the re-cut applied and its moment in the timeline",
            wait=120,
        )
        wait_js(page, f"() => {{ const s = ({cut_input})(); return s && s.value === '6' ? s : null; }}", 30,
                "the panel showing the run's new cut")  # fmt: skip
        page.set_viewport_size({"width": 1440, "height": 3000})
        shot = screenshot(page, "recut-1440.png")
        press(page, "stop", "/status (stopped|finished)/.test(s.text)", "the run stopped from the page", wait=120)
        finish(page)
    assert shot.stat().st_size > 20_000
