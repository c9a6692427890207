"""sdpipe: heterogeneity-aware pipeline-parallel training on Dask and torch.distributed.

``import sdpipe`` needs neither Jupyter nor plotly; the notebook layer lives
in ``sdpipe.widgets``.
"""

from . import profiles
from ._cluster import close as close_cluster
from ._runtime import Run, RunError, RunResult
from ._train import train
from .checkpoint import Checkpoint, load_checkpoint
from .config import Heterogeneity, TrainConfig
from .partition import partition
from .simulation import Costs, Network, calibrate, simulate, spot_trace

__all__ = [
    "Checkpoint",
    "Costs",
    "Heterogeneity",
    "Network",
    "Run",
    "RunError",
    "RunResult",
    "TrainConfig",
    "calibrate",
    "close_cluster",
    "load_checkpoint",
    "partition",
    "profiles",
    "simulate",
    "spot_trace",
    "train",
]
__version__ = "0.1.0"
