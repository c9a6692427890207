"""Training data: normalizing inputs, the batch order, and the built-in example.

A *batch* is identified by ``(epoch, batch id)``: batch ``b`` of an epoch is
the slice ``[b * batch_size, (b + 1) * batch_size)`` of that epoch's
permutation of the training set, so any worker can find the samples of a
batch from its id alone.  With per-pipeline shards, pipeline ``p`` of ``D``
takes batches ``p, p + D, p + 2D, ...``.
"""

from __future__ import annotations

from functools import lru_cache

__all__ = ["as_tensors", "batch_indices", "steps_per_epoch", "leaves_tail", "digits", "digits_mlp"]


def as_tensors(data, name: str):
    """``(inputs, targets)`` tensors from a torch Dataset or a pair of tensors."""
    import torch
    from torch.utils.data import Dataset

    if isinstance(data, (tuple, list)) and len(data) == 2 and all(isinstance(t, torch.Tensor) for t in data):
        X, Y = data
    elif isinstance(data, Dataset):
        try:
            n = len(data)
        except TypeError:
            raise ValueError(f"{name}: a Dataset must have a length (map-style)") from None
        if n == 0:
            raise ValueError(f"{name}: the Dataset is empty")
        items = [data[i] for i in range(n)]
        if not all(isinstance(it, (tuple, list)) and len(it) == 2 for it in items[:1]):
            raise ValueError(f"{name}: a Dataset must yield (input, target) pairs")
        X = torch.stack([torch.as_tensor(it[0]) for it in items])
        Y = torch.stack([torch.as_tensor(it[1]) for it in items])
    else:
        raise ValueError(
            f"{name}: must be a torch Dataset or an (inputs, targets) pair of tensors, got {type(data).__name__}"
        )
    if X.shape[0] != Y.shape[0]:
        raise ValueError(f"{name}: inputs hold {X.shape[0]} samples but targets hold {Y.shape[0]}")
    if X.shape[0] == 0:
        raise ValueError(f"{name}: holds no samples")
    return X, Y


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
    rate = sum(1.0 / t for t in others if 0 < t < mine)
    return rate > 0 and remaining / rate < mine


@lru_cache(maxsize=2)
def _permutation(n: int, seed: int, epoch: int):
    import torch

    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


def batch_indices(n: int, batch_size: int, seed: int, epoch: int, batch: int):
    """Sample indices of batch ``batch`` of ``epoch`` (a fresh permutation per epoch)."""
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
