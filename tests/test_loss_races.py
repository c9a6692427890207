"""What survivors wait for when a worker dies or leaves at an awkward moment, on a real TCPStore.

Moments that a SIGKILL or a leave at a random time hits now and then (``benchmarks/faults.py
--random-kills`` tries them end to end):

* a writer dies between claiming a mailbox slot and filling it: the server must still serve
  the requests after it, and an epoch's end must not wait for the hole;
* a lost pipeline's worker that is still alive reaches a new group after another member
  saw the loss: every member must take the same verdict (go or skip), or the ones that go
  sit in a rendezvous the others never join;
* a worker waits in a group's rendezvous for a member that will never come (its worker was
  killed while it was still starting): the wait ends once the driver marks that pipeline lost;
* a pipeline asked to leave reaches its epoch's end before it sees the leave and writes its
  part of a checkpoint the driver is finishing without it.
"""

import datetime
import os
import threading
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from sdpipe.checkpoint import claim_part, close_parts, finish, part_written, write_rank
from sdpipe.wire.protocol import GroupAnswer, first_lost, mark_lost
from sdpipe.worker.comm import RendezvousTimeout, make_group
from sdpipe.worker.sync import Scheduled
from sdpipe.worker.sync.mailbox import Mailbox, MailboxServer


@pytest.fixture
def store():
    s = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    yield s
    del s


def _wait(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_server_serves_past_a_slot_whose_writer_died_and_settles(store):
    box = Mailbox(store, "adpsgd/1/3/")
    served = []
    # the server waits on a connection of its own, as a worker's does (a connection serves one call at a time)
    server = MailboxServer("test-server", Mailbox(store.clone(), "adpsgd/1/3/"), served.append, door=box)
    server.start()
    try:
        box.put("0,1")
        assert _wait(lambda: served == ["0,1"])
        store.add("adpsgd/1/3/n", 1)  # a writer claims slot 1 and dies before filling it
        box.put("2,7")
        box.put("0,8")
        # the requests after the hole are served, each within a fraction of a second
        assert _wait(lambda: sorted(served) == ["0,1", "0,8", "2,7"], timeout=2.0), served
        # an epoch's end: every live writer is done, so the hole is given up on, quickly
        start = time.monotonic()
        assert server.settle(box.issued(), timeout=5.0)
        assert time.monotonic() - start < 1.0
        # back to in-order waiting: a new request is served at once
        box.put("0,9")
        assert _wait(lambda: "0,9" in served, timeout=2.0)
        # everything served, the server waiting for its next slot: a settle wakes it, it does not sit out the wait
        time.sleep(0.05)
        start = time.monotonic()
        assert server.settle(box.issued(), timeout=5.0)
        assert time.monotonic() - start < 0.1, time.monotonic() - start
        assert server.settle(box.issued(), timeout=0.0)  # its wake is settled too: asking again puts no new one
        issued = box.issued()
        assert server.settle(box.issued(), timeout=0.0) and box.issued() == issued
        assert _wait(lambda: "0,9" in served, timeout=2.0)
        # a slot given up on that is filled after all (its writer was slow, not dead) is still served
        store.set("adpsgd/1/3/req/1", "2,6")
        assert _wait(lambda: "2,6" in served, timeout=2.0), served
        assert server.error is None and server.served == 5  # the wakes are not requests
    finally:
        server.finish(0.0)
    assert not server.is_alive()


def _member(store, pipeline, answer, out):
    worker = SimpleNamespace(store=store, stage=1, pipeline=pipeline, timeout=20.0)
    out[pipeline] = Scheduled.all_arrive(worker, answer)


def test_every_member_of_a_new_group_takes_the_same_verdict(store):
    # members 0, 1 and 2; 0 and 1 arrive, then the driver marks pipeline 2 lost (its other stage
    # died), then 2's worker of this stage, still alive, arrives too
    answer = GroupAnswer(round=4, members=[0, 1, 2], reason="full", name="s1-0-1-2")
    out = {}
    early = [threading.Thread(target=_member, args=(store, p, answer, out)) for p in (0, 1)]
    for t in early:
        t.start()
    time.sleep(0.3)
    mark_lost(store, 2, "its worker process died")
    assert _wait(lambda: len(out) == 2)
    _member(store, 2, answer, out)
    for t in early:
        t.join(5)
    assert out == {0: False, 1: False, 2: False}


def test_members_that_all_arrive_go_together(store):
    answer = GroupAnswer(round=5, members=[0, 1, 3], reason="full", name="s1-0-1-3")
    out = {}
    threads = [threading.Thread(target=_member, args=(store, p, answer, out)) for p in (0, 1, 3)]
    for t in threads:
        t.start()
        time.sleep(0.1)
    for t in threads:
        t.join(5)
    assert out == {0: True, 1: True, 3: True}
    # a mark that comes after the verdict changes nothing for a member that asks late
    mark_lost(store, 3, "its worker process died")
    out2 = {}
    _member(store, 0, answer, out2)
    assert out2 == {0: True}


def _member_0_of_2(store, rendezvous, name: str):
    """Member 0 of group ``name`` (2 members; its rendezvous on ``rendezvous``), given up on once pipeline 1, the
    other member's, is marked lost in ``store``."""
    return make_group(
        rendezvous,
        name,
        0,
        2,
        backend="gloo",
        timeout=60.0,
        host="127.0.0.1",
        give_up=lambda: None if first_lost(store, [1]) is None else "pipeline 1 was lost",
    )


def test_a_rendezvous_gives_up_once_a_member_pipeline_is_marked_lost(store):
    # the rendezvous waits on its own connection; the loss is watched on another
    rendezvous = dist.TCPStore("127.0.0.1", store.port, 1, False, timeout=datetime.timedelta(seconds=30))
    threading.Timer(0.5, mark_lost, args=(store, 1, "its worker process died")).start()
    start = time.monotonic()
    with pytest.raises(RendezvousTimeout, match="pipeline 1 was lost"):
        _member_0_of_2(store, rendezvous, "pipe1")
    assert time.monotonic() - start < 5.0  # not the 60 s timeout


def _rendezvous_threads() -> list:
    return [t for t in threading.enumerate() if t.name.startswith("sdpipe-rendezvous-") and t.is_alive()]


def test_a_rendezvous_given_up_before_a_member_came_leaves_no_wait_behind(store):
    # gloo's rendezvous waits in C++ on the store for each member's address; a member killed before it came
    # would leave that wait blocked until the store closes (torch then prints its connection warnings)
    before = _rendezvous_threads()
    threading.Timer(0.3, mark_lost, args=(store, 1, "its worker process died")).start()
    with pytest.raises(RendezvousTimeout, match="pipeline 1 was lost"):
        _member_0_of_2(store, store.clone(), "pipe1-early")
    assert _rendezvous_threads() == before


def test_the_members_of_a_rendezvous_take_one_verdict(store):
    # member 0 gives up (it saw a loss) while members 1 and 2 came: whichever verdict was set first, all three
    # take it; here member 0 decided first, so the two who came skip too instead of waiting in gloo for it
    lost = threading.Event()
    out = {}

    def member(rank, give_up):
        try:
            make_group(
                store.clone(), "avg/verdict", rank, 3, backend="gloo", timeout=10.0, host="127.0.0.1", give_up=give_up
            )
            out[rank] = "go"
        except RendezvousTimeout as e:
            out[rank] = "skip" if "gave up" in str(e) else str(e)

    first = threading.Thread(target=member, args=(0, lambda: "pipeline 2 was lost" if lost.is_set() else None))
    first.start()
    time.sleep(0.2)
    lost.set()
    first.join(5)
    others = [threading.Thread(target=member, args=(r, None)) for r in (1, 2)]
    for t in others:
        t.start()
    for t in others:
        t.join(15)
    assert out == {0: "skip", 1: "skip", 2: "skip"}


def test_a_rendezvous_given_up_inside_gloo_ends_its_wait(store):
    # member 1 came to the meeting (its count is in) and died before gloo's rendezvous: member 0 is in gloo's C++
    # wait for member 1's address when the loss is marked; giving up ends that wait too (no helper thread left
    # blocked until the store closes)
    from sdpipe.wire.protocol import ARRIVED, Keys

    before = _rendezvous_threads()
    dist.PrefixStore(Keys.group("pipe7"), store).add(ARRIVED, 1)
    threading.Timer(0.5, mark_lost, args=(store, 1, "its worker process died")).start()
    with pytest.raises(RendezvousTimeout, match="pipeline 1 was lost"):
        _member_0_of_2(store, store.clone(), "pipe7")
    assert _rendezvous_threads() == before


def test_the_driver_closes_a_groups_rendezvous_under_the_members_own_key():
    """close_group (the driver, on the plain store) sets the verdict the members read under their group's prefix."""
    from sdpipe.wire.protocol import VERDICT, Keys, close_group

    store = dist.HashStore()
    assert close_group(store, "stage0")  # no verdict yet: closed to its members
    assert dist.PrefixStore(Keys.group("stage0"), store).get(VERDICT) == b"skip"
    dist.PrefixStore(Keys.group("stage1"), store).compare_set(VERDICT, "", "go")
    assert not close_group(store, "stage1")  # the members decided first: it formed


def test_a_leaving_pipelines_checkpoint_part_is_waited_for_or_never_written(store, tmp_path):
    """A pipeline asked to leave may reach its epoch's end before it sees the leave and write its part of the
    checkpoint while the driver finishes that checkpoint without it: the driver waits for a part begun, closes one
    not begun (never written then), and the folder holds only the parts of the pipelines in it."""
    state = {"w": torch.ones(3)}
    for r in (0, 1):  # pipeline 0 (stages 0, 1) is in the checkpoint after epoch 1
        assert claim_part(store, 1, r)
        write_rank(tmp_path, 1, "run", r, state)
        part_written(store, 1, r)
    assert claim_part(store, 1, 2)  # pipeline 1 left: its stage 0 began its part before the driver looked
    assert not close_parts(store, tmp_path, 1, "run", [2, 3])
    assert not claim_part(store, 1, 3)  # its stage 1 had not: closed, it writes nothing
    write_rank(tmp_path, 1, "run", 2, state)
    part_written(store, 1, 2)
    assert close_parts(store, tmp_path, 1, "run", [2, 3])
    final = finish(tmp_path, 1, "run", {"ranks": [0, 1]})
    assert sorted(os.listdir(final)) == ["manifest.json", "rank0.pt", "rank1.pt"]
    assert sorted(os.listdir(tmp_path)) == ["epoch-0001", "latest"]  # no staging folder left behind
    # a lost pipeline's worker may never finish a part it began: not waited for
    assert claim_part(store, 2, 2)
    assert close_parts(store, tmp_path, 2, "run", [2, 3], writing_ok=[2, 3])
