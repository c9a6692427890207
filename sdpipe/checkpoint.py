"""Checkpoints: per-stage weights, optimizer state, the scheduler's state and the data position.

A run with ``checkpoint_every=N`` (epochs) writes, after every N-th epoch's
global sync, a folder ``<checkpoint_dir>/epoch-NNNN``::

    manifest.json      epoch reached, the pipelines present and their steps, configuration, scheduler state
    rank<r>.pt         one per worker: stage weights, optimizer state, random states

Every file is written under a temporary name and renamed; the folder itself
is assembled as ``.epoch-NNNN.tmp-<run>`` and renamed into place once every
worker's file and the manifest are there, so a reader sees a whole checkpoint
or none.  ``latest`` (also replaced atomically) names the newest one.

``sdpipe.load_checkpoint(path)`` reads one; ``sdpipe.train(..., resume_from=path)``
starts a run at the checkpoint's epoch with its weights, optimizer states,
random states and step counts (the data order of an epoch depends only on
the seed and the epoch, so an ``allreduce`` run resumed this way retraces the
uninterrupted one).  A run may resume with another number of pipelines than the checkpoint's (pipelines
joined or left since, or a different ``pipelines=``): each of its pipelines starts from a pipeline the
checkpoint holds (its own where present; they are identical after the global sync that precedes every
checkpoint), and its group scheduler starts afresh.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

__all__ = ["Checkpoint", "load_checkpoint", "resolve"]

FORMAT = 1


@dataclass
class Checkpoint:
    """A checkpoint read back: ``states[(pipeline, stage)]`` holds ``model``, ``optimizer`` and random states."""

    path: str
    epoch: int
    """Epochs completed; a resumed run starts with this epoch index."""
    steps: dict
    """Steps each pipeline had completed (pipeline -> steps)."""
    config: dict
    scheduler: Optional[dict]
    """The group service's state (stage schedulers), or None for policies without it."""
    lost: dict
    """Pipelines lost before the checkpoint (their workers wrote nothing)."""
    states: dict
    pipelines: list = None
    """The pipelines present at the checkpoint (the ids of those that wrote it)."""

    def scheduler_for(self, pipelines: int) -> Optional[dict]:
        """The scheduler's state for a run of ``pipelines`` pipelines resuming here: the checkpoint's when the
        run's pipelines are those present at the checkpoint, else None (it starts afresh)."""
        return self.scheduler if sorted(self.steps) == list(range(pipelines)) else None

    def stage_state(self, pipeline: int, stage: int) -> dict:
        """The state of (pipeline, stage), or of the first pipeline that has one (a pipeline lost before the
        checkpoint)."""
        if (pipeline, stage) in self.states:
            return self.states[(pipeline, stage)]
        for p in sorted({p for p, _ in self.states}):
            if (p, stage) in self.states:
                return self.states[(p, stage)]
        raise KeyError(f"checkpoint {self.path}: no state for stage {stage}")


def resolve(path) -> Path:
    """The checkpoint folder ``path`` names: a folder with a manifest, or a checkpoint_dir (its ``latest``)."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"resume_from: must be a folder path, got {type(path).__name__}")
    p = Path(os.fspath(path)).expanduser()
    if (p / "manifest.json").is_file():
        return p
    latest = p / "latest"
    if latest.is_file():
        q = p / latest.read_text().strip()
        if (q / "manifest.json").is_file():
            return q
    raise ValueError(
        f"resume_from: no checkpoint at {str(p)!r} (neither a manifest.json nor a 'latest' file naming one)"
    )


def load_checkpoint(path, *, states: bool = True) -> Checkpoint:
    """Read the checkpoint at ``path`` (a checkpoint folder, or the checkpoint_dir for its latest)."""
    import torch

    folder = resolve(path)
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"resume_from: {folder}/manifest.json is unreadable ({type(e).__name__}: {e})") from None
    if manifest.get("format") != FORMAT:
        raise ValueError(
            f"resume_from: {folder} has checkpoint format {manifest.get('format')!r}; this sdpipe reads {FORMAT}"
        )
    loaded = {}
    if states:
        S = manifest["config"]["stages"]
        for rank in manifest["ranks"]:
            loaded[divmod(rank, S)] = torch.load(folder / f"rank{rank}.pt", map_location="cpu", weights_only=False)
    return Checkpoint(
        path=str(folder),
        epoch=manifest["epoch"],
        steps={int(k): v for k, v in manifest["steps"].items()},
        config=manifest["config"],
        scheduler=manifest.get("scheduler"),
        lost={int(k): v for k, v in manifest.get("lost", {}).items()},
        states=loaded,
        pipelines=manifest.get("pipelines", sorted(int(k) for k in manifest["steps"])),
    )


def staging(checkpoint_dir: str, epoch: int, run_id: str) -> Path:
    return Path(checkpoint_dir) / f".epoch-{epoch:04d}.tmp-{run_id}"


def claim_part(store, epoch: int, rank: int) -> bool:
    """A worker, before it writes its part of the checkpoint after ``epoch`` epochs: False where the driver closed
    the part (:func:`close_parts`: it finished, or is finishing, that checkpoint without this worker's pipeline)."""
    from sdpipe.wire.protocol import Keys

    return store.compare_set(Keys.checkpoint_part(epoch, rank), "", "writing") == b"writing"


def part_written(store, epoch: int, rank: int) -> None:
    """A worker, once its part is in place (after :func:`write_rank`)."""
    from sdpipe.wire.protocol import Keys

    store.set(Keys.checkpoint_part(epoch, rank), "done")


def close_parts(store, checkpoint_dir: str, epoch: int, run_id: str, ranks, writing_ok=()) -> bool:
    """The driver, before it finishes the checkpoint after ``epoch`` epochs: close the parts of ``ranks``, the
    workers of pipelines not in it (left or lost), so that one not begun is never written.  A pipeline may have
    reached the epoch's end before it saw its leave: False while such a part is being written (except the ranks in
    ``writing_ok``: their pipeline was lost, the part may never be finished); True once none is, with the parts
    written taken out of the folder."""
    from sdpipe.wire.protocol import Keys

    ranks = list(ranks)
    parts = {r: store.compare_set(Keys.checkpoint_part(epoch, r), "", "closed") for r in ranks}
    if any(part == b"writing" and r not in writing_ok for r, part in parts.items()):
        return False
    folder = staging(checkpoint_dir, epoch, run_id)
    for r in ranks:
        (folder / f"rank{r}.pt").unlink(missing_ok=True)
    return True


def write_rank(checkpoint_dir: str, epoch: int, run_id: str, rank: int, state: dict) -> None:
    """A worker's part (written, then renamed)."""
    import torch

    folder = staging(checkpoint_dir, epoch, run_id)
    folder.mkdir(parents=True, exist_ok=True)
    part = folder / f"rank{rank}.pt.part"
    torch.save(state, part)
    os.replace(part, folder / f"rank{rank}.pt")


def finish(checkpoint_dir: str, epoch: int, run_id: str, manifest: dict) -> Path:
    """The driver's part once every worker's file is there: the manifest, the folder's rename, ``latest``."""
    folder = staging(checkpoint_dir, epoch, run_id)
    manifest = {"format": FORMAT, "epoch": epoch, **manifest}
    tmp = folder / "manifest.json.part"
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, folder / "manifest.json")
    final = Path(checkpoint_dir) / f"epoch-{epoch:04d}"
    if final.exists():  # an older run's checkpoint of the same epoch: replace it
        import shutil

        shutil.rmtree(final)
    os.replace(folder, final)
    latest = Path(checkpoint_dir) / "latest.part"
    latest.write_text(final.name + "\n")
    os.replace(latest, Path(checkpoint_dir) / "latest")
    return final
