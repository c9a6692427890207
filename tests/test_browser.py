"""The quickstart notebook in real JupyterLab, driven by headless Chromium: the *live* dashboard draws.

What a user sees is checked in the page itself: the live dashboard's figure
(the one with controls, not the replay) holds its traces, its timeline bars
are drawn in the fixed colour of their kind, it fits its output area, and
pressing its controls in the page pauses and resumes the run, and sliders moved
in the page apply what they show while the notebook awaits the run.  A page that
opens only after the run finished (a reload) still draws the figure.
Screenshots go to ``artifacts/browser`` (``SDPIPE_ARTIFACTS`` moves it).
"""

import json
import os
import sys
import time
from pathlib import Path

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

from sdpipe.widgets.dashboard import COLORS, SPARE_PIPELINES  # noqa: E402

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(
        not os.path.exists(CHROMIUM), reason=f"needs Chromium at {CHROMIUM} (Debian: apt-get install chromium)"
    ),
]

ARTIFACTS = Path(os.environ.get("SDPIPE_ARTIFACTS", ROOT / "artifacts")) / "browser"
NOTEBOOK = "01_quickstart.ipynb"
#: notebook 01: 2 stages x 4 pipelines (loss and metric curves for them and for pipelines that may join)
TRACES = len(COLORS) + 1 + 1 + 2 * 2 + 2 + 2 * (4 + SPARE_PIPELINES) + len(COLORS)  # timeline kinds, lane, control

# The live dashboard (the output with a "pause" button and a plot), as the page has it: the figure's traces,
# the timeline's drawn bars with their fill colours by trace name, sizes, and the dashboard's text.
LIVE_JS = """() => {
    const outs = Array.from(document.querySelectorAll('.jp-OutputArea-output'));
    const out = outs.find(o => o.querySelector('.js-plotly-plot')
        && Array.from(o.querySelectorAll('button')).some(b => b.textContent.trim() === 'pause'));
    if (!out) return null;
    const gd = out.querySelector('.js-plotly-plot');
    const rgb = s => s.replace(/\\s/g, '');
    const bars = Array.from(gd.querySelectorAll('.barlayer .trace')).map(g => {
        const cd = g.__data__, trace = cd && cd[0] && cd[0].trace;
        return {name: trace ? trace.name : null, n: g.querySelectorAll('path').length,
                fills: Array.from(new Set(Array.from(g.querySelectorAll('.point path')).map(p => rgb(p.style.fill))))};
    });
    const control = (gd.data || []).find(t => t.name === 'control');
    return {
        traces: (gd.data || []).length,
        points: (gd.data || []).filter(t => t.name === 'compute').reduce((a, t) => a + (t.x || []).length, 0),
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


def check_panels(page, where: str) -> dict:
    """Every subplot title drawn whole, inside the figure, clear of the others; no subplot without data."""
    state = page.evaluate(PANELS_JS)
    assert state is not None, f"{where}: no live dashboard in the page"
    assert state["drawn"] == state["full"], (where, state["drawn"], state["full"])
    assert state["inside"] and not state["overlaps"], (where, state)
    assert not state["empty"], (where, state)
    return state


def screenshot(page, name: str) -> Path:
    path = ARTIFACTS / name
    page.locator(".jp-OutputArea-output", has=page.locator("button", has_text="pause")).first.screenshot(path=str(path))
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
    marks = ("trained = {p: sum(", "rates = {")
    kept = [c for c in book["cells"] if not any(m in "".join(c["source"]) for m in marks)]
    assert len(book["cells"]) - len(kept) == len(marks), "notebook 01's comparison cells moved"
    book["cells"] = kept
    nb.write_text(json.dumps(book, indent=1))


def test_live_dashboard_draws_in_its_colours_fits_and_answers_its_controls(tmp_path, no_leaks):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    copy_notebooks(ROOT / "notebooks", tmp_path, [NOTEBOOK])
    # three times the epochs: on two cores the run's 8 workers leave the page little time, and the test must
    # press pause, and remove a pipeline, while the run still trains
    nb = tmp_path / NOTEBOOK
    assert "epochs=20," in nb.read_text()
    nb.write_text(nb.read_text().replace("epochs=20,", "epochs=60,"))
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
        shots = [screenshot(page, "live-1440-filebrowser.png")]
        page.set_viewport_size({"width": 1000, "height": 3000})
        fitted = (
            "s.svg_width <= s.area_width + 1 && s.svg_width >= s.area_width - 40"  # the figure takes the area's width
        )
        state = wait_live(page, f"{fitted} && s.area_width < 900", 30, "the figure fitted to 1000 px")
        check_drawn(state, bars=False)
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
        # the straggler removed from the page: it leaves at its next step boundary and its rows go
        page.evaluate("""() => {
            const input = document.querySelector('.sdpipe-controls input[title="the pipeline to remove"]');
            input.value = '3';
            input.dispatchEvent(new Event('input', {bubbles: true}));
        }""")
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
        shots.append(screenshot(page, "live-removed.png"))
        finish(page)
        # the run ended: no button applies any more, every panel has data, titles whole at both widths
        controls = page.evaluate(CONTROLS_JS)
        assert controls["enabled"] == [] and controls["inputs"] == 0, controls
        shots += views_after_the_end(page, "01")
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


def views_after_the_end(page, notebook: str) -> list:
    """At 1440 and 1000 px: the figure fitted, every panel drawn whole with data (check_panels); screenshots."""
    shots = []
    for width in (1440, 1000):
        page.set_viewport_size({"width": width, "height": 3000})
        wait_live(page, "s.svg_width <= s.area_width + 1 && s.svg_width >= s.area_width - 40", 30, f"{width} px")
        check_panels(page, f"notebook {notebook} at {width} px")
        shots.append(screenshot(page, f"nb{notebook}-{width}.png"))
    return shots


def test_steering_notebook_controls_follow_the_run_and_a_press_changes_only_what_was_touched(tmp_path, no_leaks):
    """Notebook 03 with Run All: its plan slows pipeline 3 down from code; the page's slider shows it, and a press
    after moving pipeline 1's slider keeps pipeline 3's slowdown.  After the end nothing can be pressed; every panel
    has data (no held-out data: the per-epoch panel shows the training loss) and every title is whole."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    name = "03_steering.ipynb"
    copy_notebooks(ROOT / "notebooks", tmp_path, [name])
    nb = tmp_path / name
    assert "PHASE = 8.0" in nb.read_text()
    nb.write_text(nb.read_text().replace("PHASE = 8.0", "PHASE = 15.0"))  # time for the presses in one phase
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
