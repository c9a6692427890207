"""Structures of tensors: what a stage returns, what a batch's inputs and targets are.

A stage may return a tensor or any nesting of tuples, lists and dicts (string keys) of tensors, every tensor
with the micro-batch as dimension 0; the next stage receives the same structure as its one argument (as in
``nn.Sequential``).  A :class:`Layout` is the part that is fixed for a run: the nesting, probed on the driver
from one trial micro-batch (with each tensor's dtype and dimensions in the trial).  Each tensor's dtype and
sizes travel with every micro-batch (:meth:`sdpipe.worker.comm.Link.isend_tree`), so a smaller last batch and sequences
of different lengths cross a boundary without padding to one size.

Worked case: ``{"h": h, "mask": m}`` with ``h`` float32 of shape (4, 7, 16) and ``m`` bool of shape (4, 7)
flattens to the tensors ``[h, m]`` (dict keys in their order) with the skeleton ``("dict", (("h", None),
("mask", None)))``; its layout has dtypes ``("float32", "bool")`` and dimensions ``(3, 2)``, and its header
on the wire is the int64 tensor ``[0, 3, 4, 7, 16, 0, 0, 0, 0, 0,  9, 2, 4, 7, 0, 0, 0, 0, 0, 0]`` (per
tensor: its dtype's number, its dimensions, its sizes padded to eight): the receiver knows the header's length
from the layout, and the dtype and sizes of every tensor from the header.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Layout", "describe", "flatten", "index", "layout_of", "rows", "split", "to_device", "unflatten"]

# a skeleton: None for a tensor, ("tuple" | "list", (children...)) or ("dict", ((key, child), ...))


def flatten(obj, where: str = "output") -> tuple[list, object]:
    """``(tensors, skeleton)`` of a tensor structure; a ``TypeError`` naming the path of anything else."""
    import torch

    leaves: list = []

    def walk(x, path):
        if isinstance(x, torch.Tensor):
            leaves.append(x)
            return None
        if isinstance(x, (tuple, list)):
            return (
                "tuple" if isinstance(x, tuple) else "list",
                tuple(walk(v, f"{path}[{i}]") for i, v in enumerate(x)),
            )
        if isinstance(x, dict):
            if not all(isinstance(k, str) for k in x):
                raise TypeError(f"{path} is a dict with a key that is not a string")
            return ("dict", tuple((k, walk(v, f"{path}[{k!r}]")) for k, v in x.items()))
        raise TypeError(f"{path} is a {type(x).__name__}, not a tensor or a tuple, list or dict of tensors")

    skeleton = walk(obj, where)
    if not leaves:
        raise TypeError(f"{where} holds no tensor")
    return leaves, skeleton


def unflatten(skeleton, leaves) -> object:
    """The structure of ``skeleton`` with ``leaves`` in its tensors' places (the inverse of :func:`flatten`)."""
    it = iter(leaves)

    def build(sk):
        if sk is None:
            return next(it)
        kind, children = sk
        if kind == "dict":
            return {k: build(c) for k, c in children}
        built = [build(c) for c in children]
        return tuple(built) if kind == "tuple" else built

    return build(skeleton)


@dataclass(frozen=True)
class Layout:
    """The fixed part of a tensor structure: its nesting, and per tensor its dtype name and dimensions."""

    skeleton: object
    dtypes: tuple
    ndims: tuple
    #: per tensor, its sizes after dimension 0 in the probe (for estimates: a stage's activation bytes)
    probe_shapes: tuple = ()

    @property
    def header_size(self) -> int:
        """Length of the int64 header that carries every tensor's dtype and sizes (:func:`header`)."""
        return len(self.dtypes) * (2 + MAX_DIMS)

    def sample_bytes(self) -> int:
        """Bytes of one sample of this structure, at the probe's sizes."""
        import math

        import torch

        return sum(
            math.prod(shape) * torch.empty((), dtype=getattr(torch, dt)).element_size()
            for shape, dt in zip(self.probe_shapes, self.dtypes, strict=True)
        )


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


#: the most dimensions a tensor crossing a boundary may have
MAX_DIMS = 8
#: the dtypes a tensor crossing a boundary may have, by their number in a header
DTYPES = (
    "float32",
    "float64",
    "float16",
    "bfloat16",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "bool",
    "complex64",
    "complex128",
)


_DTYPE_NUMBERS: dict = {}  # torch dtype -> its number in DTYPES (filled at the first use)


def dtype_number(dtype) -> int:
    """A torch dtype's number in :data:`DTYPES` (how a header names it)."""
    number = _DTYPE_NUMBERS.get(dtype)
    if number is None:
        number = _DTYPE_NUMBERS[dtype] = DTYPES.index(_dtype_name(dtype))
    return number


def row(t) -> list:
    """One tensor's words in a header: its dtype's number in :data:`DTYPES`, its number of dimensions and its
    sizes, padded to :data:`MAX_DIMS` (``2 + MAX_DIMS`` words; :func:`read_row` reads them)."""
    return [dtype_number(t.dtype), t.dim(), *t.shape, *([0] * (MAX_DIMS - t.dim()))]


def read_row(words) -> tuple:
    """``(dtype name, shape)`` from a :func:`row` (extra words after it are ignored)."""
    return DTYPES[words[0]], tuple(words[2 : 2 + words[1]])


def header(leaves) -> list:
    """What travels ahead of a structure's tensors: a :func:`row` per tensor (a fixed length,
    :attr:`Layout.header_size`)."""
    return [w for t in leaves for w in row(t)]


def read_header(values: list) -> list:
    """``[(dtype name, shape), ...]`` from a :func:`header`."""
    step = 2 + MAX_DIMS
    return [read_row(values[i : i + step]) for i in range(0, len(values), step)]


def layout_of(obj, where: str = "output") -> Layout:
    """The layout of a tensor structure whose tensors all have a dimension 0 of one size (``ValueError`` else)."""
    try:
        leaves, skeleton = flatten(obj, where)
    except TypeError as e:
        raise ValueError(str(e)) from None
    rows(leaves, where)
    for i, t in enumerate(leaves):
        if _dtype_name(t.dtype) not in DTYPES or t.dim() > MAX_DIMS:
            raise ValueError(
                f"{where}: tensor {i} is {_dtype_name(t.dtype)} with {t.dim()} dimensions; a boundary carries "
                f"{', '.join(DTYPES)} with up to {MAX_DIMS}"
            )
    return Layout(
        skeleton,
        tuple(_dtype_name(t.dtype) for t in leaves),
        tuple(t.dim() for t in leaves),
        tuple(tuple(t.shape[1:]) for t in leaves),
    )


def rows(obj, where: str = "output") -> int:
    """The size of dimension 0 shared by the tensors of a structure (a list of tensors is one); a
    ``ValueError`` naming ``where`` if they disagree."""
    sizes = {t.shape[0] if t.dim() else None for t in flatten(obj, where)[0]}
    if None in sizes or len(sizes) != 1:
        raise ValueError(
            f"{where}: every tensor must have the micro-batch as dimension 0 (sizes {sorted(map(str, sizes))})"
        )
    return sizes.pop()


def split(obj, parts: int) -> list:
    """``obj`` cut along dimension 0 into ``parts`` structures (sizes differ by at most one, as ``tensor_split``)."""
    import torch

    leaves, skeleton = flatten(obj, "batch")
    pieces = [torch.tensor_split(t, parts) for t in leaves]
    return [unflatten(skeleton, [p[i] for p in pieces]) for i in range(parts)]


def index(obj, idx):
    """The rows ``idx`` of every tensor of ``obj``."""
    leaves, skeleton = flatten(obj, "data")
    return unflatten(skeleton, [t[idx] for t in leaves])


def to_device(obj, device):
    """``obj`` with every tensor moved to ``device``."""
    leaves, skeleton = flatten(obj, "batch")
    return unflatten(skeleton, [t.to(device) for t in leaves])


def describe(obj) -> str:
    """A short text of a structure's shapes, for messages: ``(float32[4, 16], int64[4])``."""
    try:
        leaves, skeleton = flatten(obj)
    except TypeError:
        return type(obj).__name__
    text = [f"{_dtype_name(t.dtype)}{list(t.shape)}" for t in leaves]
    return text[0] if skeleton is None else "(" + ", ".join(text) + ")"
