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
    port = _free_port()
    return sorted(_spawned(joining, lambda r, out: (_member, (r, size, joining, port, delay, out, weights))))


def _spawned(n: int, task) -> list:
    """What ``n`` spawned processes put on their queue (one item each): ``task(rank, queue)`` gives the target and
    its arguments; every process is joined (killed past 10 s) before this returns."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=t, args=a) for t, a in (task(r, out) for r in range(n))]
    for p in procs:
        p.start()
    try:
        return [out.get(timeout=RUN_TIMEOUT) for _ in procs]
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


# --------------------------------------------------------------------------- the pipeline link's messages


def _structures():
    """What one stage sends the next, in order: sizes that shrink, grow (a message announced by a smaller one),
    change dtype, a tensor too large to travel inside the message, an empty one, a control message alone."""
    g = torch.Generator().manual_seed(0)
    return [
        {"h": torch.randn(4, 7, 16, generator=g), "m": torch.rand(4, 7, generator=g) > 0.5},
        {"h": torch.randn(2, 9, 16, generator=g, dtype=torch.float64), "m": torch.rand(2, 9, generator=g) > 0.5},
        {"h": torch.randn(300, 300, generator=g), "m": torch.ones(300, 2, dtype=torch.bool)},  # 360 kB: after it
        {"h": torch.randn(3, 1, generator=g), "m": torch.zeros(3, 0, dtype=torch.bool)},
        None,
        {"h": torch.randn(4, 7, 16, generator=g)[:, ::2], "m": torch.rand(4, 4, generator=g) > 0.5},  # not contiguous
    ]


def _link_end(rank: int, port: int, backend_packs: bool, out) -> None:
    from sdpipe.worker.comm import Link
    from sdpipe.worker.tree import layout_of

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=RUN_TIMEOUT))
    pg = make_group(store, "pipe/test", rank, 2, backend="gloo", timeout=RUN_TIMEOUT, host="127.0.0.1")
    link = Link(pg, torch.device("cpu"), "gloo")
    link.packed = backend_packs  # False: the NCCL path's messages (a header, then each tensor), over gloo here
    structures = _structures()
    layout = layout_of(structures[0])
    if rank == 0:
        sends = []
        for i, obj in enumerate(structures):
            control = (i, -7, 2**40) if (obj is None or i % 2) and backend_packs else ()
            if obj is not None or control:
                sends += link.isend_tree(obj, 1, 1, layout, control=control)
        for work, _ in sends:
            work.wait()
        out.put(("sent", len(sends), dict(link._room)))
    else:
        got = []
        for obj in structures:
            if obj is None and not backend_packs:
                continue
            control, x = link.recv_message(layout, 0, 1)
            same = (obj is None and x is None) or all(
                x[k].dtype == obj[k].dtype and torch.equal(x[k], obj[k]) for k in obj
            )
            if x is not None:  # a received input takes its gradient like any tensor
                x["h"].requires_grad_(True)
                (3 * x["h"]).sum().backward()
                same = same and torch.equal(x["h"].grad, torch.full_like(obj["h"], 3.0))
            got.append((list(control), same))
        out.put(("received", got, dict(link._room)))
    time.sleep(0.5)


@pytest.mark.parametrize("packs", [True, False], ids=["packed", "header-first"])
def test_a_link_carries_structures_of_any_sizes_and_the_control_numbers_exactly(packs, no_leaks):
    """Each structure arrives as sent (values, dtypes, shapes), with its control integers; packed, sender and
    receiver agree on the receiving buffer's size throughout (a larger message announced first)."""
    port = _free_port()
    results = {r[0]: r[1:] for r in _spawned(2, lambda r, out: (_link_end, (r, port, packs, out)))}
    got, room = results["received"]
    assert all(same for _, same in got), got
    if packs:
        assert [c for c, _ in got] == [[], [1, -7, 2**40], [], [3, -7, 2**40], [4, -7, 2**40], [5, -7, 2**40]]
        assert room == {(0, 1): max(room.values())} and results["sent"][1] == {(1, 1): room[(0, 1)]}
        # one message per structure, a tensor past INLINE_BYTES after it, and the announcements of larger ones
        assert 6 + 1 <= results["sent"][0] <= 6 + 1 + 3
    else:
        assert [c for c, _ in got] == [[]] * 5
        assert results["sent"][0] == 5 * 3  # a header and two tensors each
