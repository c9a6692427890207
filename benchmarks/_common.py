"""What every benchmark script shares: its cluster and the header of its results file."""

from __future__ import annotations

import datetime
import os
import platform
import sys


def local_cluster(n_workers: int):
    """(client, cluster): single-threaded worker processes on 127.0.0.1, shared by all runs of a script."""
    from distributed import Client, LocalCluster

    cluster = LocalCluster(n_workers=n_workers, threads_per_worker=1, processes=True, host="127.0.0.1",
                           dashboard_address=None, env={"OMP_NUM_THREADS": "1"})
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
