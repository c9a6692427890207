"""Process groups among chosen workers, built without a global collective.

A group is a ``ProcessGroupGloo`` (or ``ProcessGroupNCCL``) over a prefix of
the run's shared store: only its members take part in building it, so groups
of some workers can be formed at any time, in any order, by name.
"""

from __future__ import annotations

import datetime
import math
import threading
import time
from typing import Optional

import torch
import torch.distributed as dist

from sdpipe.wire.protocol import ARRIVED, VERDICT, Keys, PeerLost
from sdpipe.worker import tree as _tree

TAG_CTRL, TAG_ACT, TAG_GRAD, TAG_TARGET = 0, 1, 2, 3


# How long the members of a new averaging group may take to connect. They meet in the run's store
# first, so a live member connects within milliseconds; a member that dies after that meeting would
# otherwise hold the others inside the (uninterruptible) gloo rendezvous for the whole run timeout, and
# their pipeline neighbours' sends would time out meanwhile. Operations on the group get the full timeout.
CONNECT_TIMEOUT = 20.0


def make_group(
    store,
    name: str,
    rank: int,
    size: int,
    *,
    backend: str,
    timeout: float,
    host: str,
    connect_timeout: float | None = None,
    give_up=None,
):
    """A process group of ``size`` members named ``name``; this worker is ``rank``.

    With gloo, ``connect_timeout`` (default ``timeout``) bounds building the
    group and is the default for its operations; pass an operation's own
    timeout (:func:`allreduce_mean_`'s ``timeout``) to wait longer.
    ``give_up``: asked every 0.1 s while the rendezvous waits; a reason
    (a string) ends the wait with :class:`RendezvousTimeout` (e.g. a member's
    pipeline was lost). It must not use ``store``'s connection, which the
    rendezvous holds while it waits.
    """
    td = datetime.timedelta(seconds=timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = td
        return dist.ProcessGroupNCCL(dist.PrefixStore(Keys.group(name), store), rank, size, opts)
    # gloo waits on the store for each member's address: through an AbortableStore, a rendezvous given up on ends
    # that wait (its helper thread ends) instead of leaving it blocked in C++ until the run's store closes
    abortable = AbortableStore(store)
    prefixed = dist.PrefixStore(Keys.group(name), abortable)
    seconds = min(timeout, connect_timeout or timeout)
    # Every member first says it is here, in Python: gloo's rendezvous waits in C++ on the store for each peer's
    # address, and a peer that died before it came (a worker lost while the run starts) leaves that wait blocked
    # until the store closes (a thread given up on then prints torch's connection warnings at the run's end).
    deadline = time.monotonic() + seconds
    _meet(prefixed, size, deadline, name, give_up)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=seconds)
    # Bind gloo's listener to the configured address (loopback by default).
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return _bounded(
        lambda: dist.ProcessGroupGloo(prefixed, rank, size, opts),
        max(1.0, deadline - time.monotonic()) + RENDEZVOUS_MARGIN,
        name,
        give_up,
        abortable.abort,
    )


class AbortableStore(dist.Store):
    """The run's store for one group's rendezvous, with waits that poll (every 2 ms) and end at once when
    :attr:`abort` is set: torch's own store waits block in C++, and a wait for a member that died (killed while
    the run started) would last until the store closes, when torch prints its connection warnings."""

    POLL = 0.002

    def __init__(self, inner):
        super().__init__()
        self.inner, self.abort = inner, threading.Event()

    def wait(self, keys, timeout=None):
        deadline = time.monotonic() + (timeout.total_seconds() if timeout is not None else 300.0)
        while not self.inner.check(keys):
            if self.abort.is_set():
                raise RuntimeError("the rendezvous was given up")
            if time.monotonic() >= deadline:
                raise RuntimeError(f"waited {keys} longer than the rendezvous's timeout")
            time.sleep(self.POLL)

    def get(self, key):
        self.wait([key])
        return self.inner.get(key)

    def set(self, key, value):
        self.inner.set(key, value)

    def add(self, key, amount):
        return self.inner.add(key, amount)

    def check(self, keys):
        return self.inner.check(keys)

    def compare_set(self, key, expected, desired):
        return self.inner.compare_set(key, expected, desired)

    def delete_key(self, key):
        return self.inner.delete_key(key)

    def num_keys(self):
        return self.inner.num_keys()

    def set_timeout(self, timeout):
        self.inner.set_timeout(timeout)


#: seconds past its own timeout that a gloo rendezvous may take before the caller gives up on it
RENDEZVOUS_MARGIN = 5.0


def _meet(store, size: int, deadline: float, name: str, give_up=None) -> None:
    """Count this member in at the group's rendezvous and wait, polling (never blocked in a store wait), for the
    members' one verdict: "go" once all ``size`` came, "skip" once one of them saw ``give_up()`` give a reason or
    its ``deadline`` pass, whichever was set first (one compare-and-set), so no member goes into a rendezvous
    another skipped.  "skip" raises :class:`RendezvousTimeout`."""
    came = store.add(ARRIVED, 1)
    pause = 0.002
    while True:
        if came >= size:
            proposal, why = "go", ""
        else:
            why = give_up() if give_up is not None else None
            if not why and time.monotonic() >= deadline:
                why = f"{came} of {size} members came in time"
            proposal = "skip" if why else None
        if proposal is not None:  # the first proposal set is the verdict
            verdict = store.compare_set(VERDICT, "", proposal).decode()
        elif store.check([VERDICT]):  # another member decided
            verdict = store.get(VERDICT).decode()
        else:
            verdict = None
        if verdict == "go":
            return
        if verdict is not None:
            raise RendezvousTimeout(f"group {name}: gave up the rendezvous: {why or 'another member gave it up'}")
        time.sleep(pause)
        pause = min(0.05, pause * 1.5)
        came = store.add(ARRIVED, 0)


class RendezvousTimeout(RuntimeError):
    """A group's rendezvous did not end (neither connected nor failed) within its timeout, or was given up on."""


def _bounded(build, seconds: float, name: str, give_up=None, abort: Optional[threading.Event] = None):
    """``build()`` in a helper thread, given up on after ``seconds`` or once ``give_up()`` gives a reason; then
    ``abort`` is set (an :class:`AbortableStore`'s: the helper's wait on the store ends).

    gloo's rendezvous has its own timeout, but a peer that dies during the
    connection handshake can leave it waiting past that (seen: a stage's
    worker stuck for minutes in ``Pair::waitUntilConnected`` after its
    pipeline neighbour was killed), which would hold the Dask worker's thread
    after the run ended. The caller gets an error in time; a helper thread
    stuck in the C++ call is left to end with the process.
    """
    box: dict = {}

    def target():
        try:
            box["group"] = build()
        except BaseException as e:  # handed to the caller
            box["error"] = e

    t = threading.Thread(target=target, name=f"sdpipe-rendezvous-{name}", daemon=True)
    t.start()
    deadline = time.monotonic() + seconds
    while t.is_alive() and time.monotonic() < deadline:
        t.join(min(0.1, max(0.0, deadline - time.monotonic())))
        reason = give_up() if give_up is not None and t.is_alive() else None
        if reason:
            _abort(abort, t)
            raise RendezvousTimeout(f"group {name}: gave up the rendezvous: {reason}")
    if t.is_alive():
        _abort(abort, t)
        raise RendezvousTimeout(f"group {name}: the rendezvous neither connected nor failed within {seconds:.0f}s")
    if "error" in box:
        raise box.pop("error")
    return box.pop("group")


def _abort(abort: Optional[threading.Event], helper: threading.Thread) -> None:
    """End a given-up rendezvous's waits on the store, and give its helper thread a moment to end."""
    if abort is not None:
        abort.set()
        helper.join(1.0)


#: a structure's tensors travel inside its one message up to this many bytes in all (a copy on the sender), in their
#: order as long as each fits what is left; the others follow it, a message each (no copy: a message's own cost is
#: small beside theirs)
INLINE_BYTES = 256 * 1024
#: the first word of a packed message: a structure (with or without tensors), or "the next message is larger"
_DATA, _GROW = 1, 2
#: bytes of a packed message's fixed words: kind, control integers, tensors
_FIXED = 3 * 8
#: bytes a receiver's buffer holds before any message grew it (any control message fits)
_FIRST_ROOM = 1024
#: int64 words per tensor in a packed message's header: its tree.row (dtype, dimensions, sizes), inside or after
_PER_TENSOR = 2 + _tree.MAX_DIMS + 1


class Link:
    """Point-to-point traffic of one worker with its pipeline neighbours.

    With gloo (tensors staged on the CPU) a structure of tensors travels as one message: a header (what the
    receiver must know: each tensor's dtype and sizes, and the control integers a step boundary carries) and the
    tensors' bytes, packed (:meth:`isend_tree`).  gloo takes a message into a buffer at least as large, so the
    receiver posts one of the size the sender's messages on that tag had so far; both sides keep that size (a
    "room" per peer and tag), and a larger message is announced by a small one first.  A message costs tens of
    microseconds of CPU on each side whatever its size, so one message instead of a header and a tensor is most of
    what a small model's step pays for its communication.  With NCCL, tensors travel on the GPU and a receive
    must know its size ahead: the header goes as a message of its own, then each tensor.
    """

    def __init__(self, group, device: torch.device, backend: str):
        self.group = group
        self.device = device
        self.comm_device = device if backend == "nccl" else torch.device("cpu")
        #: structures travel packed (gloo); else a header message and a message per tensor (NCCL)
        self.packed = backend != "nccl"
        self._room: dict = {}  # (peer, tag) -> bytes of the receiver's buffer (the same figure on both sides)

    def isend(self, tensor: torch.Tensor, dst: int, tag: int):
        t = tensor.detach().to(self.comm_device).contiguous()
        return self.group.send([t], dst, tag), t

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        work, _ = self.isend(tensor, dst, tag)
        work.wait()

    def recv(self, shape, dtype, src: int, tag: int) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=self.comm_device)
        self.group.recv([buf], src, tag).wait()
        return buf.to(self.device)

    def isend_tree(
        self, obj, dst: int, tag: int, layout: Optional[_tree.Layout] = None, where: str = "output", control=()
    ) -> list:
        """Send a tensor structure (:mod:`sdpipe.worker.tree`) with every tensor's dtype and sizes, and ``control``
        (integers: a step boundary's message, received by :meth:`recv_message`).  With ``layout``, a structure
        unlike it is a ``ValueError`` naming ``where`` (nothing is sent).  ``obj`` None: the control alone.

        Returns the ``(work, tensor)`` pairs of the sends, which must be waited for (or kept) until complete.
        """
        leaves, skeleton = _tree.flatten(obj, where) if obj is not None else ([], None)
        if layout is not None and obj is not None and skeleton != layout.skeleton:
            raise ValueError(
                f"{where} {_tree.describe(obj)} is not structured as on the trial micro-batch; a stage must return "
                f"the same nesting of tensors every time"
            )
        if not self.packed:
            if control:
                raise ValueError("a control message travels inside a structure's message on gloo links only")
            header = torch.tensor(_tree.header(leaves), dtype=torch.int64)
            return [self.isend(header, dst, tag)] + [self.isend(t, dst, tag) for t in leaves]
        leaves = [t.detach() for t in leaves]
        sizes = [t.numel() * t.element_size() for t in leaves]
        inside, budget = [], INLINE_BYTES  # the smaller tensors first, as long as they fit the budget
        for n in sizes:
            inside.append(n <= budget)
            budget -= n if n <= budget else 0
        words = [_DATA, len(control), len(leaves), *control]
        for t, inline in zip(leaves, inside, strict=True):
            words += [*_tree.row(t), int(inline)]
        head = 8 * len(words)
        total = _aligned(head) + sum(_aligned(n) for n, inline in zip(sizes, inside, strict=True) if inline)
        sends = []
        room = self._room.get((dst, tag), _FIRST_ROOM)
        if total > room:  # announced in a message that fits the receiver's buffer; both sides take the new size
            grow = torch.tensor([_GROW, total, 0], dtype=torch.int64)
            sends.append((self.group.send([grow], dst, tag), grow))
            self._room[(dst, tag)] = total
        buf = torch.empty(total, dtype=torch.uint8)
        buf[:head].view(torch.int64).copy_(torch.tensor(words, dtype=torch.int64))
        offset = _aligned(head)
        for t, n, inline in zip(leaves, sizes, inside, strict=True):
            if inline:
                buf[offset : offset + n].view(t.dtype).view(t.shape).copy_(t)
                offset += _aligned(n)
        sends.append((self.group.send([buf], dst, tag), buf))
        return sends + [self.isend(t, dst, tag) for t, inline in zip(leaves, inside, strict=True) if not inline]

    def recv_tree(self, layout: _tree.Layout, src: int, tag: int):
        """Receive a structure of ``layout`` sent by :meth:`isend_tree` (without control integers)."""
        control, obj = self.recv_message(layout, src, tag)
        if control or obj is None:
            raise RuntimeError(f"expected a structure from rank {src} (tag {tag}), got a control message {control}")
        return obj

    def recv_message(self, layout: Optional[_tree.Layout], src: int, tag: int) -> tuple:
        """``(control integers, structure or None)`` of the next message :meth:`isend_tree` sent on ``tag``."""
        if not self.packed:
            header = self.recv((layout.header_size,), torch.int64, src, tag).tolist()
            leaves = [self.recv(shape, getattr(torch, dtype), src, tag) for dtype, shape in _tree.read_header(header)]
            return (), _tree.unflatten(layout.skeleton, leaves)
        while True:
            buf = torch.empty(self._room.get((src, tag), _FIRST_ROOM), dtype=torch.uint8)
            self.group.recv([buf], src, tag).wait()
            kind, c, n = buf[:_FIXED].view(torch.int64).tolist()
            if kind != _GROW:
                break
            self._room[(src, tag)] = c  # the next message's size, announced
        if kind != _DATA:
            raise RuntimeError(f"a message from rank {src} (tag {tag}) is not one of sdpipe's (kind {kind})")
        head = _FIXED + 8 * (c + n * _PER_TENSOR)
        words = buf[_FIXED:head].view(torch.int64).tolist()
        control = tuple(words[:c])
        if not n:
            return control, None
        offset, leaves, after = _aligned(head), [], []
        for i in range(n):
            row = words[c + i * _PER_TENSOR : c + (i + 1) * _PER_TENSOR]
            name, shape = _tree.read_row(row)
            dtype = getattr(torch, name)
            if row[-1]:
                t = buf[offset : offset + _nbytes(shape, dtype)].view(dtype).view(shape)
                leaves.append(t.to(self.device))
                offset += _aligned(_nbytes(shape, dtype))
            else:
                leaves.append(None)
                after.append((i, shape, dtype))
        for i, shape, dtype in after:
            leaves[i] = self.recv(shape, dtype, src, tag)
        return control, _tree.unflatten(layout.skeleton, leaves)

    def recv_like(self, tensors: list, src: int, tag: int) -> list:
        """Receive one tensor of each of ``tensors``' shapes and dtypes (the gradients of tensors sent before)."""
        return [self.recv(tuple(t.shape), t.dtype, src, tag) for t in tensors]


def _aligned(n: int) -> int:
    """``n`` bytes rounded up to 16: where the next tensor of a packed message starts (any dtype's alignment)."""
    return (n + 15) & ~15


def _nbytes(shape: tuple, dtype) -> int:
    return math.prod(shape) * dtype.itemsize


#: what torch's errors say when a peer's connection failed (gloo raises a plain RuntimeError with its message)
PEER_FAILURES = (
    "Connection closed by peer",
    "Connection reset",
    "Timed out",
    "timed out",
    "Broken pipe",
    "aborted",
    "Socket closed",
)


def as_peer_lost(error: BaseException) -> BaseException:
    """``error`` as a :class:`~sdpipe.wire.protocol.PeerLost` when torch's text says a peer's connection failed
    (the one place sdpipe reads torch's messages), else ``error`` itself."""
    if isinstance(error, PeerLost) or not any(m in str(error) for m in PEER_FAILURES):
        return error
    lost = PeerLost(f"{type(error).__name__}: {error}")
    if hasattr(error, "sdpipe_step"):  # the driver's one line names the step
        lost.sdpipe_step = error.sdpipe_step
    return lost


def flatten(tensors: list, device) -> torch.Tensor:
    """The tensors as one flat buffer on ``device`` (a copy)."""
    if not tensors:
        return torch.zeros(0, device=device)
    return torch.cat([t.detach().reshape(-1) for t in tensors]).to(device)


def unflatten_(tensors: list, flat: torch.Tensor) -> None:
    """Copy consecutive slices of ``flat`` back into ``tensors``, in place."""
    offset = 0
    for t in tensors:
        k = t.numel()
        t.copy_(flat[offset : offset + k].view_as(t))
        offset += k


def allreduce_mean_(
    tensors: list,
    group,
    size: int,
    extras=(),
    comm_device=None,
    timeout: float | None = None,
    weight: float | None = None,
) -> list:
    """Average ``tensors`` in place over ``group``; returns ``extras`` summed over it.

    The tensors travel as one flat buffer with the ``extras`` appended (used to
    agree on a stop vote or a policy version in the same collective).
    ``timeout`` (seconds) overrides the group's default for this operation.
    With ``weight``, the average is weighted (each member's tensors count
    ``weight`` times; weights > 0) and the summed weight is returned after the extras.
    """
    device = tensors[0].device if tensors else torch.device("cpu")
    dtype = tensors[0].dtype if tensors else torch.float32
    comm_device = comm_device or device
    extras = list(extras) + ([weight] if weight is not None else [])
    tail = torch.tensor([float(x) for x in extras], device=device, dtype=torch.float64).to(dtype)
    flat = torch.cat([t.reshape(-1) for t in tensors] + [tail]).to(comm_device)
    n = flat.numel() - len(extras)
    if weight is not None:
        flat[:n].mul_(weight)
    if timeout is None:
        group.allreduce([flat]).wait()
    else:
        opts = dist.AllreduceOptions()
        opts.timeout = datetime.timedelta(seconds=timeout)
        group.allreduce([flat], opts).wait()
    sums = [float(x) for x in flat[n:]]
    unflatten_(tensors, flat[:n].div_(sums[-1] if weight is not None else size).to(device))
    return sums


def allreduce_max(group, value: float, comm_device, timeout: float) -> float:
    """The largest of the members' ``value`` over ``group`` (one number: a re-cut's version agreed in a global
    sync)."""
    t = torch.tensor([float(value)], dtype=torch.float64, device=comm_device)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    opts.timeout = datetime.timedelta(seconds=timeout)
    group.allreduce([t], opts).wait()
    return float(t[0])
