"""Drive a notebook in real JupyterLab from headless Chromium (Playwright), for tests and screenshots.

JupyterLab listens on 127.0.0.1 with a random token; Chromium is Debian's
(``/usr/bin/chromium``, or ``SDPIPE_CHROMIUM``) started with the flags that
keep it off the network.  Everything is torn down on exit, also after an
error: the browser, the server and its kernels (a process group).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

CHROMIUM = os.environ.get("SDPIPE_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
    "--disable-quic",
]

# JavaScript run in the page: the plotly graphs of the dashboard, by title, with their data
PLOTS_JS = """() => Array.from(document.querySelectorAll('.js-plotly-plot')).map(gd => ({
    title: (gd.layout && gd.layout.title && (gd.layout.title.text || gd.layout.title)) || '',
    drawn_bars: gd.querySelectorAll('.barlayer .point').length,
    drawn_heatmaps: gd.querySelectorAll('.heatmaplayer image, .hm image').length,
    traces: (gd.data || []).map(t => ({type: t.type, name: t.name || '',
        n: t.type === 'heatmap'
            ? (t.z || []).reduce((a, row) => a + row.filter(v => v > 0).length, 0)
            : (t.x || []).length}))
}))"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def jupyterlab(root: Path, timeout: float = 90.0):
    """A JupyterLab server on 127.0.0.1 serving ``root``; yields (base url, token)."""
    port, token = free_port(), secrets.token_hex(16)
    settings = root / ".lab-settings"  # user settings of this server only: no news pop-up
    (settings / "@jupyterlab" / "apputils-extension").mkdir(parents=True, exist_ok=True)
    (settings / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings").write_text(
        '{"fetchNews": "false"}'
    )
    env = {
        **os.environ,
        "JUPYTERLAB_SETTINGS_DIR": str(settings),
        "JUPYTERLAB_WORKSPACES_DIR": str(root / ".lab-workspaces"),
    }
    log = open(root / "jupyterlab.log", "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            "--allow-root",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={root}",
            "--LabApp.expose_app_in_browser=True",
            "--LabApp.news_url=None",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"jupyterlab did not start: see {root / 'jupyterlab.log'}") from None
                time.sleep(0.3)
        yield url, token
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()


@contextlib.contextmanager
def chromium_page(width: int = 1500, height: int = 2000):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            yield page
        finally:
            browser.close()


def wait_js(page, expression: str, timeout: float, what: str, poll: float = 0.5):
    """Poll a JavaScript function until it returns something truthy; returns that value."""
    deadline = time.monotonic() + timeout
    while True:
        value = page.evaluate(expression)
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"browser: {what} not reached within {timeout:.0f} s")
        time.sleep(poll)


def run_notebook(page, url: str, token: str, name: str, timeout: float = 120.0) -> None:
    """Open ``name`` in JupyterLab, wait for an idle connected kernel, and run all cells (not waiting for them)."""
    page.goto(f"{url}/lab/tree/{name}?token={token}", timeout=timeout * 1000)
    wait_js(
        page,
        """() => {
        const app = window.jupyterapp; if (!app) return false;
        const w = app.shell.currentWidget; if (!w || !w.sessionContext) return false;
        const k = w.sessionContext.session && w.sessionContext.session.kernel;
        return !!k && k.connectionStatus === 'connected' && k.status === 'idle';
    }""",
        timeout,
        "an idle kernel",
    )
    page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); return true; }")


def notebook_done(page) -> bool:
    """All cells ran: no cell is queued or running and the kernel is idle."""
    return page.evaluate("""() => {
        const w = window.jupyterapp.shell.currentWidget;
        const k = w.sessionContext.session && w.sessionContext.session.kernel;
        const busy = Array.from(document.querySelectorAll('.jp-InputPrompt')).some(p => p.textContent.includes('*'));
        return !!k && k.status === 'idle' && !busy;
    }""")


def notebook_errors(page) -> list:
    return page.evaluate("""() => Array.from(document.querySelectorAll(
            '.jp-RenderedText[data-mime-type="application/vnd.jupyter.stderr"], .jp-OutputArea-output pre'))
        .map(e => e.textContent).filter(t => /Traceback|Error:/.test(t)).map(t => t.slice(0, 500))""")


def copy_notebooks(src: Path, dst: Path, names) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for n in names:
        shutil.copy(src / n, dst / n)
