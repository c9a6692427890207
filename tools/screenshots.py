"""Screenshots of the real dashboard for the README: a 4x2 sdpipe run with one 4x straggler.

    python tools/screenshots.py [--out docs/images]

Writes a small notebook to a temporary folder, runs it in JupyterLab (on
127.0.0.1) in headless Chromium, and photographs the live dashboard once its
group view has filled and three epochs are done.
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
from lab_browser import PLOTS_JS, chromium_page, jupyterlab, notebook_done, run_notebook, wait_js  # noqa: E402

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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs" / "images"))
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
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
