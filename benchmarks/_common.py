"""What every benchmark script shares: its cluster and the header of its results file."""

from __future__ import annotations

import datetime
import os
import platform
import sys

#: contenders that are a policy with other scheduler parameters: name -> (policy, scheduler)
VARIANTS = {
    "sdpipe-uniform": ("sdpipe", {"weighting": "uniform"}),
    "sdpipe-blocking": ("sdpipe", {"overlap": False}),  # arrival windows, averaging not overlapped
    "sdpipe-prototype": ("sdpipe", {"window": "prototype", "overlap": False}),  # the prototype's window, blocking
    "sdpipe-overlap": ("sdpipe", {"overlap": True}),
}


def status_kib(field: str) -> int:
    """A KiB figure of this process's ``/proc/self/status`` (``VmRSS``, ``VmHWM``: its peak resident set, which
    unlike ``getrusage``'s ``ru_maxrss`` does not carry a parent's peak over a fork and an exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


#: the small models the straggler benchmarks run (notebook 01's MLP, the digits CNN, the GPT example)
WORKLOAD_NAMES = ("mlp", "cnn", "gpt")


def workload(name: str, stages: int = 2) -> dict:
    """``sdpipe.train`` keywords of one of :data:`WORKLOAD_NAMES` (a fresh model each call: ``model``,
    ``train_data``, ``eval_data`` and what else it needs) and ``"text"``, its description."""
    if name in ("mlp", "mlp768"):  # mlp768: compute-bound, a step is mostly the two wide layers, not messages
        from sdpipe.data import digits, digits_mlp

        hidden = 768 if name == "mlp768" else 128
        train, held = digits()
        text = f"digits MLP 64-{hidden}-{hidden}-10"
        return dict(model=digits_mlp(hidden=hidden), train_data=train, eval_data=held, text=text)
    if name == "cnn":
        from sdpipe.data import digits, digits_cnn

        train, held = digits()
        return dict(
            model=digits_cnn(),
            train_data=train,
            eval_data=held,
            cuts=(6,) if stages == 2 else None,
            text="digits CNN (32/64/128 channels)",
        )
    if name == "gpt":
        from sdpipe.examples import char_data, char_gpt, lm_loss

        train, held = char_data(train_chars=100_000, eval_chars=10_000)
        return dict(
            model=char_gpt(),
            train_data=train,
            eval_data=held,
            loss_fn=lm_loss,
            metric="perplexity",
            text="GPT example (221k parameters) on 100,000 characters of the standard library's text",
        )
    raise ValueError(f"--models: {name!r} is not one of {', '.join((*WORKLOAD_NAMES, 'mlp768'))}")


def train_workload(name: str, stages: int, timeout: float = 3600, **kwargs):
    """The finished ``RunResult`` of ``sdpipe.train`` on workload ``name`` (no held-out data) with ``kwargs``."""
    import sdpipe

    w = workload(name, stages)
    w.pop("text"), w.pop("eval_data")
    model, data = w.pop("model"), w.pop("train_data")
    return sdpipe.train(model, data, stages=stages, **kwargs, **w).result(timeout=timeout)


def time_to_target(events, pipelines: int, target: float):
    """Seconds from the run's start until every pipeline's held-out accuracy had reached ``target`` at one epoch
    (that epoch's last evaluation), from its ``epoch`` records; None when it never did."""
    reports: dict = {}
    for e in events:
        if e["kind"] == "epoch":
            reports.setdefault(e["metrics"]["epoch"], []).append((e["end"], e["metrics"].get("accuracy", 0.0)))
    for epoch in sorted(reports):
        rows = reports[epoch]
        if len(rows) == pipelines and min(a for _, a in rows) >= target:
            return max(t for t, _ in rows)
    return None


def local_cluster(n_workers: int, allowed_failures=None):
    """(client, cluster): single-threaded worker processes on 127.0.0.1, shared by all runs of a script.

    ``allowed_failures=0`` makes Dask give up on a task whose worker died at once (as sdpipe's embedded cluster does).
    """
    import dask
    from distributed import Client, LocalCluster

    settings = {"distributed.worker.profile.enabled": False}  # as sdpipe's embedded cluster: no sampling profiler
    if allowed_failures is not None:
        settings["distributed.scheduler.allowed-failures"] = allowed_failures
    with dask.config.set(settings):
        cluster = LocalCluster(
            n_workers=n_workers,
            threads_per_worker=1,
            processes=True,
            host="127.0.0.1",
            dashboard_address=None,
            env={"OMP_NUM_THREADS": "1"},
        )
    return Client(cluster, set_as_default=False), cluster


def run_meta(script: str, argv, config: str) -> dict:
    """Date, the exact command, machine, versions and configuration of a benchmark run."""
    import dask
    import distributed
    import torch

    import sdpipe

    args = argv if argv is not None else sys.argv[1:]
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": f"python benchmarks/{script} {' '.join(args)}".strip(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        "versions": f"python {platform.python_version()}, torch {torch.__version__}, dask {dask.__version__}, "
        f"distributed {distributed.__version__}, sdpipe {sdpipe.__version__}",
        "config": config,
    }


def meta_lines(meta: dict) -> list:
    """The metadata as markdown list items (the command in backticks)."""
    return [f"- {k}: `{v}`" if k == "command" else f"- {k}: {v}" for k, v in meta.items()]


def results_head(out, title: str, meta: dict):
    """(the results file's path, its first lines): ``# title`` and the metadata; its folder is made."""
    from pathlib import Path

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    return out, [f"# {title}", "", *meta_lines(meta)]


def save_figure(fig, path, width: int = 900, height: int = 520) -> list:
    """Write a plotly figure as ``path.html`` (plotly.js from its CDN) and ``path.png``.

    The PNG is drawn by headless Chromium (``tools/lab_browser.py``'s browser
    and flags) from a page that inlines the plotly.js the Python package
    ships, so nothing is fetched.  Without Chromium or Playwright only the
    HTML is written and the reason is printed.  Returns the paths written.
    """
    import tempfile
    from pathlib import Path

    path = Path(path)
    html = path.with_suffix(".html")
    fig.write_html(html, include_plotlyjs="cdn")
    written = [html]
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    try:
        import lab_browser

        if not os.path.exists(lab_browser.CHROMIUM):
            raise FileNotFoundError(f"no Chromium at {lab_browser.CHROMIUM}")
        with tempfile.TemporaryDirectory() as tmp:
            page_file = Path(tmp) / "figure.html"
            fig.write_html(
                page_file,
                include_plotlyjs=True,
                full_html=True,
                default_width=f"{width}px",
                default_height=f"{height}px",
            )
            with lab_browser.chromium_page(width + 40, height + 40) as page:
                page.goto(page_file.as_uri())
                page.wait_for_selector(".js-plotly-plot .main-svg", timeout=30000)
                page.locator(".js-plotly-plot").first.screenshot(path=str(path.with_suffix(".png")))
        written.append(path.with_suffix(".png"))
    except Exception as exc:  # the HTML is the result; the PNG is a convenience
        print(f"{path.with_suffix('.png')}: not drawn ({type(exc).__name__}: {exc})", file=sys.stderr)
    return written
