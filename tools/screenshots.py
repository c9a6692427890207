"""Screenshots of the real dashboard for the README: a 4x2 sdpipe run with one 4x straggler.

    python tools/screenshots.py [--out docs/images]
    python tools/screenshots.py --quickstart [--out docs/images]

Writes a small notebook to a temporary folder, runs it in JupyterLab (on
127.0.0.1) in headless Chromium, and photographs the live dashboard once its
group view has filled and three epochs are done.  ``--quickstart`` runs
``notebooks/01_quickstart.ipynb`` itself instead (Run All, as a reader would),
waits for every cell, fails on a cell's error, and photographs its dashboard
(``quickstart-dashboard.png``) and the cells that report who was left out
(``quickstart-left-out.png``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_notebook

sys.path.insert(0, str(Path(__file__).parent))
from lab_browser import (
    PLOTS_JS,
    chromium_page,
    copy_notebooks,
    jupyterlab,
    notebook_done,
    notebook_errors,
    run_notebook,
    wait_js,
)

CELLS = [
    """import sdpipe
from distributed import Client, LocalCluster
from sdpipe.data import digits, digits_cnn
from sdpipe.widgets import Dashboard
cluster = LocalCluster(n_workers=8, threads_per_worker=1, host="127.0.0.1", dashboard_address=None)
client = Client(cluster)
train_data, eval_data = digits()""",
    """run = sdpipe.train(digits_cnn(64), train_data, eval_data=eval_data, stages=2, pipelines=4, cuts=(6,),
                   policy="sdpipe", epochs=12, batch_size=64, heterogeneity=sdpipe.Heterogeneity(slowdown={3: 4.0}),
                   cluster=client)
dash = Dashboard(run)
dash""",
    """result = run.result(timeout=600)
dash.wait(30)
client.close()
cluster.close()""",
]

FILLED = f"""() => {{
    const dash = ({PLOTS_JS})().find(p => p.traces.some(t => t.type === 'heatmap'));
    if (!dash) return null;
    const members = dash.traces.filter(t => t.type === 'heatmap').reduce((a, t) => a + t.n, 0);
    const accuracy = dash.traces.filter(t => t.name === 'pipeline 0')[1];
    return members > 120 && accuracy && accuracy.n >= 3 && dash.drawn_heatmaps > 0 ? true : null;
}}"""


def quickstart(out: Path) -> None:
    """Notebook 01, run all in JupyterLab: its live dashboard and the cells that check who was left out."""
    root_dir = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        copy_notebooks(root_dir / "notebooks", root, ["01_quickstart.ipynb"])
        with jupyterlab(root) as (url, token), chromium_page() as page:
            run_notebook(page, url, token, "01_quickstart.ipynb")
            deadline = time.monotonic() + 900
            done = False
            while not done and time.monotonic() < deadline:
                time.sleep(1.0)
                done = notebook_done(page)  # (read once: the dashboard's messages keep the kernel busy a moment)
            errors = notebook_errors(page)
            if errors or not done:
                raise RuntimeError(f"notebook 01: {'; '.join(errors) or 'still running after 900 s'}")
            # the notebook scrolls inside its panel, which cuts an element's screenshot at the panel's edge: a page
            # tall enough to hold the whole dashboard, and then both checking cells with their output
            page.set_viewport_size({"width": page.viewport_size["width"], "height": 3400})
            time.sleep(2.0)
            dash = page.locator(".jp-OutputArea-output", has=page.locator(".js-plotly-plot")).first
            dash.scroll_into_view_if_needed()
            dash.screenshot(path=str(out / "quickstart-dashboard.png"))
            cell = page.locator(".jp-CodeCell", has_text="took part in").first
            cell.evaluate("e => e.scrollIntoView({block: 'start'})")  # its panel's top: the next cell fits below
            time.sleep(1.0)
            box = cell.bounding_box()
            following = page.locator(".jp-CodeCell", has_text="median round").first.bounding_box()
            page.screenshot(
                path=str(out / "quickstart-left-out.png"),
                clip={
                    "x": box["x"],
                    "y": box["y"],
                    "width": box["width"],
                    "height": following["y"] + following["height"] - box["y"],
                },
                full_page=True,
            )
    print(f"wrote {out / 'quickstart-dashboard.png'} and {out / 'quickstart-left-out.png'}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs" / "images"))
    ap.add_argument("--quickstart", action="store_true", help="run notebooks/01_quickstart.ipynb itself")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.quickstart:
        quickstart(out)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        nb = new_notebook(
            cells=[new_code_cell(c) for c in CELLS],
            metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
        )
        nbformat.write(nb, root / "straggler.ipynb")
        with jupyterlab(root) as (url, token), chromium_page() as page:
            run_notebook(page, url, token, "straggler.ipynb")
            wait_js(page, FILLED, 300, "a dashboard with 3 epochs of groups")
            time.sleep(1.0)
            area = page.locator(".jp-OutputArea-output", has=page.locator(".js-plotly-plot")).first
            area.screenshot(path=str(out / "dashboard-straggler.png"))
            deadline = time.monotonic() + 600
            while not notebook_done(page) and time.monotonic() < deadline:
                time.sleep(1.0)
    print(f"wrote {out / 'dashboard-straggler.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
