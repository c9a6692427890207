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
    const dash = plots.find(p => p.traces.some(t => t.name === 'compute') && p.traces.some(t => t.type === 'heatmap'));
    if (!dash) return null;
    const bars = dash.traces.filter(t => t.type === 'bar' && t.name === 'compute' || t.name === 'communication').reduce((a, t) => a + t.n, 0);
    const members = dash.traces.filter(t => t.type === 'heatmap').reduce((a, t) => a + t.n, 0);
    // data in the timeline and group views, and drawn on the page
    return bars > 20 && members > 4 && dash.drawn_bars > 20 && dash.drawn_heatmaps > 0
        ? {{bars, members, drawn: dash.drawn_bars}} : null;
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
