"""The quickstart notebook in real JupyterLab, driven by headless Chromium: the dashboard renders with data."""

import os
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from lab_browser import CHROMIUM, PLOTS_JS, chromium_page, copy_notebooks, jupyterlab, notebook_done, notebook_errors, run_notebook, wait_js  # noqa: E402

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"needs Chromium at {CHROMIUM} (Debian: apt-get install chromium)"),
]

ARTIFACTS = Path(os.environ.get("SDPIPE_ARTIFACTS", ROOT / "artifacts")) / "browser"

DASHBOARD_READY = f"""() => {{
    const plots = ({PLOTS_JS})();
    const timeline = plots.find(p => String(p.title).startsWith('Stage timeline'));
    const groups = plots.find(p => String(p.title).startsWith('Group formations'));
    if (!timeline || !groups) return null;
    const bars = timeline.traces.filter(t => t.type === 'bar').reduce((a, t) => a + t.n, 0);
    const members = groups.traces.filter(t => t.type === 'heatmap').reduce((a, t) => a + t.n, 0);
    // data in the figures, and drawn on the page
    return bars > 20 && members > 4 && timeline.drawn_bars > 20 && groups.drawn_heatmaps > 0
        ? {{bars, members, drawn: timeline.drawn_bars, plots: plots.length}} : null;
}}"""


def test_quickstart_renders_a_live_dashboard_in_jupyterlab(tmp_path, no_leaks):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    copy_notebooks(ROOT / "notebooks", tmp_path, ["01_quickstart.ipynb"])
    with jupyterlab(tmp_path) as (url, token), chromium_page() as page:
        run_notebook(page, url, token, "01_quickstart.ipynb")
        seen = wait_js(page, DASHBOARD_READY, 240, "a dashboard whose timeline and group views hold data")
        time.sleep(1.0)
        dashboard = page.locator(".jp-OutputArea-output", has=page.locator(".js-plotly-plot")).first
        dashboard.screenshot(path=str(ARTIFACTS / "quickstart-live.png"))
        assert seen["bars"] > 20 and seen["members"] > 4
        deadline = time.monotonic() + 300
        while not notebook_done(page):
            assert time.monotonic() < deadline, "the notebook did not finish"
            time.sleep(1.0)
        page.screenshot(path=str(ARTIFACTS / "quickstart-done.png"), full_page=True)
        assert notebook_errors(page) == []
    assert (ARTIFACTS / "quickstart-live.png").stat().st_size > 10_000
