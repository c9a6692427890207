"""sdpipe: heterogeneity-aware pipeline-parallel training on Dask and torch.distributed.

``import sdpipe`` needs neither Jupyter nor plotly; the notebook layer lives
in ``sdpipe.widgets``.
"""

from sdpipe.checkpoint import Checkpoint, load_checkpoint
from sdpipe.config import Heterogeneity, Rebalance, TrainConfig
from sdpipe.core.partition import partition
from sdpipe.driver.cluster import close as close_cluster
from sdpipe.driver.run import Run, RunError, RunResult
from sdpipe.driver.train import train
from sdpipe.simulation import Costs, Network, Proxy, calibrate, profiles, simulate, spot_trace
from sdpipe.trace_export import export_trace

__all__ = [
    "Checkpoint",
    "Costs",
    "Heterogeneity",
    "Network",
    "Proxy",
    "Rebalance",
    "Run",
    "RunError",
    "RunResult",
    "TrainConfig",
    "calibrate",
    "close_cluster",
    "export_trace",
    "load_checkpoint",
    "partition",
    "profiles",
    "simulate",
    "spot_trace",
    "train",
]
__version__ = "0.1.0"
