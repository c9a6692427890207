"""Training data: normalizing inputs, the batch order, and the built-in example.

A *batch* is identified by ``(epoch, batch id)``: batch ``b`` of an epoch is
the slice ``[b * batch_size, (b + 1) * batch_size)`` of that epoch's
permutation of the training set, so any worker can find the samples of a
batch from its id alone.  With per-pipeline shards, pipeline ``p`` of ``D``
takes batches ``p, p + D, p + 2D, ...``.
"""

from __future__ import annotations

from functools import lru_cache

__all__ = [
    "MapSource",
    "ShardReader",
    "Source",
    "StreamSource",
    "TensorSource",
    "as_source",
    "batch_indices",
    "digits",
    "digits_mlp",
    "leaves_tail",
    "steps_per_epoch",
]


def collate(collate_fn, items: list) -> tuple:
    """``(inputs, targets)`` of a batch of dataset items, by ``collate_fn`` (default torch's ``default_collate``)."""
    from torch.utils.data import default_collate

    batch = (collate_fn or default_collate)(items)
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise ValueError("collate_fn: must return an (inputs, targets) pair")
    return batch[0], batch[1]


class Source:
    """A training or evaluation set as the workers read it: ``take(idx)`` gives the rows ``idx`` of a batch.

    A source holds inputs and targets, or one of them (:meth:`part`: stage 0 needs only the inputs, the last
    stage only the targets).  Inputs and targets are tensor structures (:mod:`sdpipe.worker.tree`) with the samples
    along dimension 0.
    """

    which: str = "both"

    def __len__(self) -> int:
        raise NotImplementedError

    def take(self, idx):
        """``(inputs, targets)`` of the rows ``idx`` (a 1-d int64 tensor); only one of them for a part."""
        raise NotImplementedError

    def part(self, which: str) -> "Source":
        """This source reading only ``"inputs"`` or ``"targets"``."""
        raise NotImplementedError

    def sample(self, k: int):
        """``(inputs, targets)`` of the first ``k`` samples (the driver's trial micro-batch)."""
        import torch

        return self.take(torch.arange(k))

    def _pick(self, inputs, targets):
        return {"both": (inputs, targets), "inputs": inputs, "targets": targets}[self.which]


class TensorSource(Source):
    """Inputs and targets held in memory as tensor structures; a batch is fancy indexing."""

    def __init__(self, inputs, targets, which: str = "both"):
        self.inputs, self.targets, self.which = inputs, targets, which
        from sdpipe.worker.tree import rows

        self._n = rows(inputs if inputs is not None else targets)

    def __len__(self) -> int:
        return self._n

    def take(self, idx):
        from sdpipe.worker.tree import index

        pick = lambda obj: None if obj is None else index(obj, idx)
        return self._pick(pick(self.inputs), pick(self.targets))

    def part(self, which: str) -> "TensorSource":
        return TensorSource(
            self.inputs if which != "targets" else None, self.targets if which != "inputs" else None, which
        )


class MapSource(Source):
    """A map-style ``Dataset``: a batch is ``collate_fn([dataset[i] for i in idx])``, an ``(inputs, targets)`` pair.

    Stage 0 and the last stage each read the batch's items (each takes its part), so a dataset that does work
    per item does it twice; a dataset held in memory costs nothing more.
    """

    def __init__(self, dataset, collate_fn=None, which: str = "both"):
        self.dataset, self.collate_fn, self.which = dataset, collate_fn, which

    def __len__(self) -> int:
        return len(self.dataset)

    def take(self, idx):
        return self._pick(*collate(self.collate_fn, [self.dataset[i] for i in idx.tolist()]))

    def part(self, which: str) -> "MapSource":
        return MapSource(self.dataset, self.collate_fn, which)


class StreamSource(Source):
    """An ``IterableDataset``, sharded per pipeline: pipeline ``p`` of ``D`` trains on items ``p, p + D, ...`` of
    each pass over it, in batches of consecutive items of its shard (:class:`ShardReader`).

    Only stage 0 reads the stream; it sends each batch's targets to its pipeline's last stage.  ``items``: the
    number of items of one pass (``len(dataset)``, else counted by one pass on the driver).
    """

    def __init__(self, dataset, collate_fn=None, items: int = 0, which: str = "both"):
        self.dataset, self.collate_fn, self.items, self.which = dataset, collate_fn, items, which

    def __len__(self) -> int:
        return self.items

    def sample(self, k: int):
        import itertools

        return collate(self.collate_fn, list(itertools.islice(iter(self.dataset), k)))

    def part(self, which: str):
        # stage 0 reads inputs and targets from the stream; the last stage receives the targets from it
        return self if which == "inputs" else None

    def shard_sizes(self, pipelines: int) -> list:
        """Items of each pipeline's shard in one pass."""
        return [len(range(p, self.items, pipelines)) for p in range(pipelines)]


class ShardReader:
    """Stage 0 of one pipeline on a :class:`StreamSource`: the batches of its shard, a fresh pass each epoch.

    ``next(epoch)`` reads the next batch ahead and gives its number within the epoch (None when the shard is
    used up: a shorter last batch counts unless ``drop_last``, if it holds at least ``microbatches`` items);
    ``take(epoch)`` gives the batch read ahead, or reads one (a lock-step policy counts its steps itself).
    """

    def __init__(self, source: StreamSource, pipeline: int, pipelines: int, cfg: dict):
        self.source, self.pipeline, self.pipelines = source, pipeline, pipelines
        self.batch_size, self.drop_last, self.microbatches = cfg["batch_size"], cfg["drop_last"], cfg["microbatches"]
        self.epoch, self.items, self.read, self.ahead = None, None, 0, None

    def _start(self, epoch: int) -> None:
        import itertools

        if self.epoch != epoch:
            self.epoch, self.read, self.ahead = epoch, 0, None
            self.items = itertools.islice(iter(self.source.dataset), self.pipeline, None, self.pipelines)

    def _read(self):
        import itertools

        items = list(itertools.islice(self.items, self.batch_size))
        if len(items) < self.batch_size and (self.drop_last or len(items) < self.microbatches):
            return None
        self.read += 1
        return collate(self.source.collate_fn, items)

    def next(self, epoch: int):
        self._start(epoch)
        if self.ahead is None:
            self.ahead = self._read()
        return None if self.ahead is None else self.read - 1

    def take(self, epoch: int):
        self._start(epoch)
        batch, self.ahead = self.ahead, None
        if batch is None:
            batch = self._read()
        if batch is None:
            raise RuntimeError(f"pipeline {self.pipeline}: its shard of the stream ran out within epoch {epoch}")
        return batch


def _stream(data, name: str, collate_fn, shard: bool) -> Source:
    """An ``IterableDataset``: for training a :class:`StreamSource`; for evaluation its items, read once here
    (every pipeline evaluates all of them)."""
    import itertools

    try:
        items = None
        if not shard:
            items = list(iter(data))
            n = len(items)
        elif hasattr(data, "__len__"):
            n = len(data)
        else:  # one pass, counting: the progress and a lock-step policy's steps need the epoch's length
            n = sum(1 for _ in iter(data))
        first = list(itertools.islice(iter(data), 2))
        if first:
            collate(collate_fn, first)
    except Exception as e:
        raise ValueError(f"{name}: reading its first items fails: {type(e).__name__}: {e}") from None
    if n == 0:
        raise ValueError(f"{name}: the IterableDataset yields no items")
    return StreamSource(data, collate_fn, n) if shard else MapSource(items, collate_fn)


def as_source(data, name: str, collate_fn=None) -> Source:
    """A :class:`Source` from an ``(inputs, targets)`` pair of tensor structures, a map-style ``Dataset`` or an
    ``IterableDataset`` (training data: sharded per pipeline; evaluation data: read once on the driver).

    Checked here, each failure a one-line ``ValueError`` naming ``name``: the kind of data, that it holds
    samples, that inputs and targets hold as many, and that one batch of two items can be built.
    """
    import torch
    from torch.utils.data import Dataset, IterableDataset, TensorDataset

    from sdpipe.worker.tree import flatten, rows

    if isinstance(data, IterableDataset):
        return _stream(data, name, collate_fn, shard=name == "train_data")
    if isinstance(data, (tuple, list)) and len(data) == 2 and not isinstance(data, Dataset):
        try:
            counts = [rows(part, name) for part in data]
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"{name}: must be an (inputs, targets) pair of tensors or tensor structures ({e})"
            ) from None
        if counts[0] != counts[1]:
            raise ValueError(f"{name}: inputs hold {counts[0]} samples but targets hold {counts[1]}")
        if counts[0] == 0:
            raise ValueError(f"{name}: holds no samples")
        return TensorSource(data[0], data[1])
    if isinstance(data, TensorDataset) and len(data.tensors) == 2:
        return as_source(tuple(data.tensors), name)
    if isinstance(data, Dataset):
        try:
            n = len(data)
        except TypeError:
            raise ValueError(f"{name}: a Dataset must have a length (map-style)") from None
        if n == 0:
            raise ValueError(f"{name}: the Dataset is empty")
        source = MapSource(data, collate_fn)
        try:
            inputs, targets = source.take(torch.arange(min(2, n)))
            flatten(inputs, f"{name} inputs")
            flatten(targets, f"{name} targets")
        except Exception as e:
            raise ValueError(f"{name}: a batch of its first items fails: {type(e).__name__}: {e}") from None
        return source
    raise ValueError(
        f"{name}: must be a torch Dataset or an (inputs, targets) pair of tensors, got {type(data).__name__}"
    )


def steps_per_epoch(n: int, batch_size: int, pipelines: int) -> int:
    """Steps each pipeline takes per epoch when every pipeline reads its own shard."""
    return (n // batch_size) // pipelines


#: Batches per pipeline left in an epoch below which the tail rule applies.
TAIL_BATCHES_PER_PIPELINE = 8


def smoothed_step_time(old, dt: float) -> float:
    """A pipeline's recent seconds per step: an average leaning on the latest steps."""
    return dt if old is None else 0.7 * old + 0.3 * dt


def leaves_tail(mine, others, remaining: int) -> bool:
    """Whether a pipeline taking ``mine`` seconds per step leaves the ``remaining`` batches of an epoch's tail
    to the others (their step times ``others``): when the faster ones would take them all before it finished one.

    Only faster pipelines count, so the fastest one never leaves batches behind.
    """
    if mine is None:
        return False
    return tail_goes_faster(mine, sum(1.0 / t for t in others if 0 < t < mine), remaining)


def tail_goes_faster(mine: float, rate: float, remaining: int) -> bool:
    """:func:`leaves_tail` once the faster pipelines' summed rate (steps per second) is known."""
    return rate > 0 and remaining / rate < mine


@lru_cache(maxsize=2)
def _permutation(n: int, seed: int, epoch: int):
    import torch

    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


def batch_indices(n: int, batch_size: int, seed: int, epoch: int, batch: int):
    """Sample indices of batch ``batch`` of ``epoch`` (a fresh permutation per epoch); the last batch of an
    epoch is shorter when ``n`` is not a multiple of ``batch_size`` (kept unless the run drops it)."""
    return _permutation(n, seed, epoch)[batch * batch_size : (batch + 1) * batch_size]


def digits(test_fraction: float = 0.2, seed: int = 0):
    """scikit-learn's 8x8 digits as ``((X_train, y_train), (X_test, y_test))`` tensors.

    Pixels are scaled to [0, 1]; the split is stratified and fixed by ``seed``.
    """
    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    X, y = load_digits(return_X_y=True)
    Xtr, Xte, ytr, yte = train_test_split(X / 16.0, y, test_size=test_fraction, random_state=seed, stratify=y)
    features = lambda a: torch.tensor(a, dtype=torch.float32)
    labels = lambda a: torch.tensor(a, dtype=torch.int64)
    return (features(Xtr), labels(ytr)), (features(Xte), labels(yte))


def digits_mlp(hidden: int = 128, layers: int = 2, seed: int = 0):
    """The example model: an MLP for the 64-pixel digits, as an ``nn.Sequential``."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    mods, width = [], 64
    for _ in range(layers):
        mods += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    mods.append(nn.Linear(width, 10))
    return nn.Sequential(*mods)


def digits_cnn(channels: int = 32, seed: int = 0):
    """A small convolutional network for the 8x8 digits, as an ``nn.Sequential``.

    Its compute per parameter is far higher than the MLP's (every weight is
    used at 64 or 16 positions), which makes it the closer stand-in for the
    compute-bound workloads pipeline training is for.  It takes the flat
    64-pixel rows of :func:`digits`.  The two halves cost about the same, so
    ``cuts=(6,)`` splits it into two balanced stages.
    """
    import torch
    from torch import nn

    torch.manual_seed(seed)
    c = channels
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, c, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(c, 2 * c, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),  # 2c x 4 x 4
        nn.Conv2d(2 * c, 4 * c, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * c * 16, 10),
    )
