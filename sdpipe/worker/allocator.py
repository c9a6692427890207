"""The C allocator's thresholds while a worker trains.

Dask's nanny starts its worker processes with ``MALLOC_TRIM_THRESHOLD_=65536`` (its config
``distributed.nanny.pre-spawn-environ``), so that a worker hands freed memory back to the system soon.  Setting it
also fixes glibc's mmap threshold at its 128 KiB default (it no longer adapts to what a program frees): every
allocation of 128 KiB or more is then a fresh ``mmap``, whose pages fault in anew each time.  A training step
allocates its activations and gradients anew at every micro-batch, so a compute-bound stage spent about a third of
its CPU time on page faults (the GPT example, 4 stages on one machine: 53 ms of CPU per step, 35 ms without).

While a worker trains, :func:`training_thresholds` raises both thresholds (allocations below 4 MiB reuse the
heap; larger ones are rarer and their page faults small beside their compute), then puts the process's setting
back and hands the freed memory back (``malloc_trim``).  It does nothing where the C library is not glibc or the
process never had its trim threshold set (glibc then adapts by itself).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os

__all__ = ["training_thresholds"]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
_GLIBC_MMAP_DEFAULT = 128 * 1024
#: allocations below this come from the heap while training (4, 8 and 32 MiB measured alike on the GPT example;
#: the peak resident memory did not change with it)
MMAP_THRESHOLD = 4 * 1024 * 1024
#: free memory at the heap's top kept while training (glibc's own rule: twice the mmap threshold)
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD


def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


@contextlib.contextmanager
def training_thresholds():
    """Within: glibc's mmap and trim thresholds raised where ``MALLOC_TRIM_THRESHOLD_`` had fixed them; after:
    the process's own setting again, and the memory freed meanwhile handed back."""
    fixed = os.environ.get("MALLOC_TRIM_THRESHOLD_")
    libc = _libc() if fixed is not None else None
    if libc is None:
        yield
        return
    libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    try:
        yield
    finally:
        try:
            trim = int(fixed)
        except ValueError:
            trim = 128 * 1024
        libc.mallopt(_M_MMAP_THRESHOLD, _GLIBC_MMAP_DEFAULT)
        libc.mallopt(_M_TRIM_THRESHOLD, trim)
        libc.malloc_trim(0)
