"""``none``: independent pipelines, no synchronization."""

from __future__ import annotations

from sdpipe.worker.sync.base import SyncPolicy

__all__ = ["NoSync"]


class NoSync(SyncPolicy):
    """``none``: independent pipelines, no synchronization."""

    def after_step(self, worker, step: int) -> None:
        """Nothing: the replicas drift apart."""

    def epoch_end(self, worker, step: int) -> None:
        """Nothing: the replicas drift apart."""
