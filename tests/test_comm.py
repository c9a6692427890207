"""Averaging groups: a dead member cannot hold the others for the run timeout; operations keep the full timeout.

Real gloo process groups over a real TCPStore, one process per member.
"""

import datetime
import multiprocessing as mp
import socket
import time

import pytest
import torch
import torch.distributed as dist

from sdpipe.worker.comm import allreduce_mean_, make_group

RUN_TIMEOUT = 60.0
CONNECT = 2.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _member(rank: int, size: int, joining: int, port: int, delay: float, out, weights=None) -> None:
    store = dist.TCPStore("127.0.0.1", port, joining, rank == 0, timeout=datetime.timedelta(seconds=RUN_TIMEOUT))
    start = time.monotonic()
    try:
        pg = make_group(
            store,
            "avg/test",
            rank,
            size,
            backend="gloo",
            timeout=RUN_TIMEOUT,
            host="127.0.0.1",
            connect_timeout=CONNECT,
        )
    except RuntimeError as e:
        out.put((rank, "connect-failed", time.monotonic() - start, str(e)[:80]))
        return
    time.sleep(delay * rank)  # the last member arrives late at the collective
    t = [torch.full((3,), float(rank))]
    start = time.monotonic()
    try:
        if weights is None:
            allreduce_mean_(t, pg, size, timeout=RUN_TIMEOUT)
            out.put((rank, "ok", time.monotonic() - start, t[0].tolist()))
        else:
            sums = allreduce_mean_(t, pg, size, extras=(1.0,), timeout=RUN_TIMEOUT, weight=weights[rank])
            out.put((rank, "ok", time.monotonic() - start, t[0].tolist(), sums))
    except RuntimeError as e:
        out.put((rank, "op-failed", time.monotonic() - start, str(e)[:80]))
    time.sleep(0.5)


def _run(size: int, joining: int, delay: float, weights=None) -> list:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_member, args=(r, size, joining, port, delay, out, weights)) for r in range(joining)]
    for p in procs:
        p.start()
    try:
        return sorted(out.get(timeout=RUN_TIMEOUT) for _ in procs)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()


def test_a_member_that_never_connects_fails_the_group_within_the_connect_timeout(no_leaks):
    results = _run(size=3, joining=2, delay=0.0)
    assert [r[1] for r in results] == ["connect-failed", "connect-failed"]
    for _, _, waited, _ in results:
        assert CONNECT * 0.9 <= waited < RUN_TIMEOUT / 2


def test_operations_on_the_group_wait_longer_than_the_connect_timeout(no_leaks):
    delay = CONNECT * 1.5  # rank 1 reaches the collective 3 s after rank 0
    results = _run(size=2, joining=2, delay=delay)
    assert [r[1] for r in results] == ["ok", "ok"]
    assert results[0][2] >= delay * 0.9  # rank 0 waited past the connect timeout and still succeeded
    for r in results:
        assert r[3] == pytest.approx([0.5, 0.5, 0.5])


def test_a_weighted_average_counts_each_member_by_its_weight_and_returns_the_total(no_leaks):
    """The "progress" weighting: sum(w_i x_i) / sum(w_i) on every member, the extras and the summed weight come back."""
    weights = [1.0, 2.0, 5.0]  # member r holds the value r
    results = _run(size=3, joining=3, delay=0.0, weights=weights)
    assert [r[1] for r in results] == ["ok"] * 3
    expected = sum(w * r for r, w in enumerate(weights)) / sum(weights)  # 12 / 8, not the plain mean 1.0
    for r in results:
        assert r[3] == pytest.approx([expected] * 3)
        assert r[4] == pytest.approx([3.0, sum(weights)])
