"""The messages between driver, group service and workers: encodings, store keys, the handle, event records."""

import concurrent.futures
import json
import logging
import socket

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sdpipe.wire import events
from sdpipe.wire.protocol import (
    Command,
    ControlMessage,
    CutChange,
    GroupAnswer,
    GroupServiceClient,
    GroupServiceError,
    Keys,
    MembershipChange,
    Op,
    PairRequest,
    PeerLost,
    PolicyChange,
    ServerRequest,
    decode_frame,
    encode_frame,
    run_prefix,
)
from sdpipe.worker.tree import layout_of


@given(
    st.integers(0, 10**9),
    st.booleans(),
    st.integers(0, 10**6),
    st.integers(0, 10**6),
    st.booleans(),
    st.integers(0, 99),
    st.integers(0, 99),
)
def test_command_round_trips_through_its_encoding(seq, stop, hetero, policy, pause, members, cut):
    cmd = Command(seq, stop, hetero, policy, pause, members, cut)
    assert Command.decode(cmd.encode()) == cmd
    assert Command.decode(cmd.encode().encode()) == cmd  # as the store hands it back (bytes)


@given(
    st.integers(0, 2**31),
    st.lists(st.integers(0, 10**4), min_size=1, max_size=16, unique=True),
    st.sampled_from(["full", "window", "global", "graph"]),
    st.booleans(),
    st.booleans(),
)
def test_a_group_answer_round_trips_through_a_frame(round_, members, reason, overlap, stop):
    answer = GroupAnswer(
        round=round_, members=sorted(members), reason=reason, name="s0-" + "-".join(map(str, sorted(members))),
        policy="sdpipe", version=3, weighting="progress", overlap=overlap, stop=stop,
    )  # fmt: skip
    frame = encode_frame(answer.to_wire())
    assert GroupAnswer.from_wire(decode_frame(frame[4:])) == answer
    # a field the reader does not know (a newer service) is left aside
    assert GroupAnswer.from_wire({**answer.to_wire(), "later": 1}) == answer


def test_the_store_payloads_round_trip_through_their_encodings():
    """What the driver and the workers leave in the run's store and mailboxes, each typed with its encoding."""
    for change in (PolicyChange("scheduled", "allreduce"), PolicyChange("none", "none")):
        assert PolicyChange.decode(change.encode().encode()) == change
    for m in (MembershipChange("join", 5, 2), MembershipChange("leave", 3)):
        assert MembershipChange.decode(m.encode().encode()) == m
    with pytest.raises(ValueError, match=r"^kind: 'stay' is not 'join' or 'leave'$"):
        MembershipChange("stay", 1)
    for r in (ServerRequest("step", 3, 17), ServerRequest("global", 0, 40), ServerRequest("leave", 2)):
        assert ServerRequest.decode(r.encode()) == r
    assert ServerRequest.decode("leave,2") == ServerRequest("leave", 2)  # a leave says no step
    assert PairRequest.decode(PairRequest(4, 9).encode()) == PairRequest(4, 9)
    layout = layout_of(torch.zeros(2, 3), "output")
    change = CutChange((2, 5), [layout, layout])
    assert CutChange.decode(change.encode()) == change


def test_command_next_advances_the_sequence_and_keeps_the_rest():
    c = Command().next(hetero=3)
    assert c == Command(1, False, 3, 0, False)
    assert c.next(stop=True) == Command(2, True, 3, 0, False)
    assert Command(7, True, 2, 1, False, 4, 2).encode() == "7,1,2,1,0,4,2"  # the layout stage 0 reads


@given(st.sampled_from(list(Op)), *[st.integers(-1, 2**40) for _ in range(7)])
def test_control_message_round_trips_as_eight_integers(op, epoch, step, batch, hetero, policy, members, cut):
    msg = ControlMessage(op, epoch, step, batch, hetero, policy, members, cut)
    values = msg.encode()
    assert len(values) == ControlMessage.SIZE and all(isinstance(v, int) for v in values)
    assert ControlMessage.decode(values) == msg
    assert ControlMessage.decode(values).op is op


def test_store_keys_keep_their_layout():
    """Keys are read by other processes of the same run: their strings are part of the protocol."""
    assert run_prefix("abc") == "sdpipe/abc/"
    assert Keys.CTL == "ctl" and Keys.RANKS_STARTED == "ranks/started" and Keys.RANKS_READY == "ranks/ready"
    assert (Keys.hetero(2), Keys.policy(3), Keys.lost(1), Keys.LOST_COUNT) == (
        "hetero/2",
        "policy/3",
        "lost/1",
        "lost/count",
    )
    assert (Keys.checkpoint_count(4), Keys.checkpoint_steps(4, 5)) == ("ckpt/4/n", "ckpt/4/rank5")
    assert (Keys.checkpoint_cut(4, 5), Keys.cut(2), Keys.cut_done(2, 5)) == ("ckpt/4/cut5", "cut/2", "cut/2/done5")
    assert (Keys.batches_taken(0), Keys.step_time(0, 2)) == ("epoch0/taken", "epoch0/steptime/2")
    assert Keys.verdict(1, 7, "s1-0-2") == Keys.arrivals(1, 7, "s1-0-2") + "/verdict" == "arrive/s1/r7/s1-0-2/verdict"
    box = Keys.ps_mailbox(1)
    assert (box, Keys.mailbox_count(box), Keys.mailbox_slot(box, 3)) == ("ps/1/", "ps/1/n", "ps/1/req/3")
    assert (Keys.gossip_mailbox(0, 3), Keys.gossip_left(0, 2)) == ("adpsgd/0/3/", "adpsgd/0/left/2")
    assert Keys.group("pipe0") == "group/pipe0/"


def test_event_constructors_make_records_that_fit_the_schema():
    made = [
        events.span("forward", 0, 1, 3, 2, 1.0, 1.5),
        events.span("sync", 0, 1, 3, None, 1.5, 1.6, group=[0, 2], round=4, reason="window", mass=1.5),
        events.group(1, 4, (0, 2), "window", 1.4, 1.5, 0.01, True, "sdpipe"),
        events.control("pause", 2.0, applied_by="driver"),
        events.epoch(1, 1, 30, 3.0, {"epoch": 0, "pipeline": 1, "loss": 0.5}),
        events.stage_info(0, 0, 0.5, 1000, 256, "127.0.0.1"),
        events.checkpoint(2, "/tmp/x/epoch-0002", 4.0),
        events.worker_lost(2, 1, 5.0, "tcp://127.0.0.1:1", "its worker process died"),
    ]
    for rec in made:
        assert events.validate(rec) is rec
        assert set(events.COMMON) <= set(rec)
    assert made[2]["group"] == [0, 2] and made[2]["start"] == 1.4 and made[2]["end"] == 1.5


@pytest.mark.parametrize(
    "record, problem",
    [
        ({"kind": "nap"}, "kind 'nap' is not one of"),
        (events.span("forward", 0, 0, 1, 0, 2.0, 1.0), "ends before it starts"),
        (events.span("sync", 0, 0, 1, None, 1.0, 2.0), "sync: no field 'group'"),
        (events.span("forward", 0, 0, 1, 0, 1.0, 2.0, colour="blue"), "unknown field 'colour'"),
        (events.span("forward", "0", 0, 1, 0, 1.0, 2.0), "pipeline must be an integer or None"),
        ({**events.span("recv", 0, 0, 1, 0, 1.0, 2.0), "start": "soon"}, "start must be a number"),
    ],
)
def test_a_record_that_does_not_fit_is_named_with_what_is_wrong(record, problem):
    assert any(problem in p for p in events.problems(record)), events.problems(record)
    with pytest.raises(ValueError, match="event record: "):
        events.validate(record)


@pytest.fixture(scope="module")
def scheduler():
    """A real Dask scheduler (in this process, no workers) with the group service installed."""
    from distributed import Client, LocalCluster

    from sdpipe.service import ensure_service

    with LocalCluster(
        n_workers=0,
        processes=False,
        protocol="tcp://",
        host="127.0.0.1",
        dashboard_address=None,
        scheduler_kwargs={"dashboard_address": "127.0.0.1:0"},
    ) as lc:
        with Client(lc, set_as_default=False) as client:
            ensure_service(client)
            yield client


def test_the_service_handle_answers_and_fails_with_one_exception_type(scheduler):
    handle = GroupServiceClient("r-handle", client=scheduler, token="t" * 32, timeout=10)
    assert handle.open(stages=1, pipelines=2, policy={}, policy_name="sdpipe", topic="sdpipe-r-handle", t0=0.0)
    assert handle.state()["policy"] == "sdpipe"
    assert handle.pause(True)["ok"] and handle.state()["paused"]
    thief = GroupServiceClient("r-handle", client=scheduler, token="x" * 32, timeout=10)
    with pytest.raises(GroupServiceError, match="group service: token: does not match run"):
        thief.stop()
    with pytest.raises(GroupServiceError, match="state: not a scheduler snapshot"):
        handle.open(stages=1, pipelines=2, policy={}, policy_name="sdpipe", topic="t", t0=0.0, state={"nope": 1})
    assert handle.close()["ok"]
    # a run that ended: one line for the caller, and no traceback in the scheduler's log (the user's terminal,
    # for a LocalCluster in a notebook)
    logged = []
    catch = logging.Handler(logging.ERROR)
    catch.emit = logged.append
    logging.getLogger("distributed.core").addHandler(catch)
    try:
        with pytest.raises(GroupServiceError, match="no sdpipe run 'r-handle' is scheduled here"):
            handle.state()
    finally:
        logging.getLogger("distributed.core").removeHandler(catch)
    assert not logged, [r.getMessage() for r in logged]


def _call_socket(sock, message: dict) -> dict:
    from sdpipe.wire.protocol import decode_frame, encode_frame

    sock.sendall(encode_frame(message))
    size = int.from_bytes(sock.recv(4, socket.MSG_WAITALL), "big")
    return decode_frame(sock.recv(size, socket.MSG_WAITALL))


def test_ready_signals_over_the_services_own_socket_and_a_closed_runs_topic_goes(scheduler):
    """On a tcp:// scheduler the service listens on the scheduler's host; two workers' ready signals over their
    own connections get one group; a bad frame and an unknown run are answered in one line; closing the run drops
    its event topic from the scheduler."""
    endpoint = scheduler.run_on_scheduler(lambda dask_scheduler: dask_scheduler.handlers["sdpipe_endpoint"]())
    host, port = endpoint["endpoint"]
    assert host == "127.0.0.1"
    handle = GroupServiceClient("r-socket", client=scheduler, token="t" * 32, timeout=10)
    # a window of a minute: the round closes when both came (a full group), however far apart they are sent
    window = {"window": "prototype", "window_init": 60.0, "window_min": 60.0, "window_max": 60.0}
    handle.open(stages=1, pipelines=2, policy=window, policy_name="sdpipe", topic="sdpipe-r-socket", t0=0.0)
    scheduler.log_event("sdpipe-r-socket", {"rank": 0, "seq": 0, "events": []})
    has_topic = lambda: scheduler.run_on_scheduler(
        lambda dask_scheduler: "sdpipe-r-socket" in dask_scheduler._broker._topics
    )
    assert has_topic()
    socks = [socket.create_connection((host, port), timeout=10) for _ in range(2)]
    try:
        ready = lambda p: {"op": "sdpipe_ready", "run_id": "r-socket", "stage": 0, "pipeline": p, "step": 0}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda p: _call_socket(socks[p], ready(p)), range(2)))
        assert [a["members"] for a in answers] == [[0, 1], [0, 1]] and answers[0]["round"] == answers[1]["round"]
        assert _call_socket(socks[0], {"op": "nope"}) == {"error": "op: must be sdpipe_ready or sdpipe_hurry"}
        assert "not scheduled" in _call_socket(socks[0], {**ready(0), "run_id": "r-none"})["error"]
        assert _call_socket(socks[1], {"op": "sdpipe_hurry", "run_id": "r-socket", "stage": 0, "pipeline": 1}) == {
            "ok": True
        }
    finally:
        for sock in socks:
            sock.close()
    assert handle.close()["ok"]
    assert not has_topic()


def test_a_waiter_nobody_answers_is_taken_out_but_a_paused_runs_waiters_wait(scheduler):
    """Rounds that close only when full (the allreduce preset): a ready signal nobody joins within its timeout
    is answered with one line and its pipeline taken out of the stage; while the run is paused, a waiter's
    timeout passes without that (its timer re-armed) and its group still comes."""
    import select

    from sdpipe.core.policies import POLICY_PRESETS

    endpoint = scheduler.run_on_scheduler(lambda dask_scheduler: dask_scheduler.handlers["sdpipe_endpoint"]())
    host, port = endpoint["endpoint"]
    handle = GroupServiceClient("r-expire", client=scheduler, token="t" * 32, timeout=10)
    policy = POLICY_PRESETS["allreduce"].to_dict()
    handle.open(stages=1, pipelines=3, policy=policy, policy_name="allreduce", topic="sdpipe-r-expire", t0=0.0)
    socks = [socket.create_connection((host, port), timeout=10) for _ in range(3)]
    ready = lambda p: {
        "op": "sdpipe_ready", "run_id": "r-expire", "stage": 0, "pipeline": p, "step": 1, "timeout": 0.3
    }  # fmt: skip
    try:
        assert _call_socket(socks[0], ready(0)) == {"error": "no group for pipeline 0 stage 0 within 0s"}
        assert list(handle.state()["stages"][0]["live"]) == [1, 2]
        assert handle.pause(True)["ok"]
        socks[1].sendall(encode_frame(ready(1)))
        assert select.select([socks[1]], [], [], 1.5)[0] == []  # five timeouts passed: still waiting
        assert list(handle.state()["stages"][0]["live"]) == [1, 2]
        answer = _call_socket(socks[2], ready(2))
        size = int.from_bytes(socks[1].recv(4, socket.MSG_WAITALL), "big")
        assert answer["members"] == [1, 2] == decode_frame(socks[1].recv(size, socket.MSG_WAITALL))["members"]
    finally:
        for sock in socks:
            sock.close()
    assert handle.close()["ok"]


def test_a_pipeline_slower_than_a_whole_epoch_leaves_whole_epochs_and_measures_itself_again(monkeypatch):
    """The dispenser over a real store: pipeline 1 needs 3 s a step, pipeline 0 finishes an epoch's 10
    batches in 1 s. After one measured step, pipeline 1 leaves whole epochs (so no global sync waits for
    its one batch) for ``MAX_AGE`` epochs, then takes one to measure itself again; a heterogeneity change
    drops its estimate at once."""
    import types

    import torch.distributed as dist

    from sdpipe.worker import boundary as _boundary
    from sdpipe.worker.boundary import Dispenser

    now = [0.0]
    monkeypatch.setattr(_boundary, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    store = dist.HashStore()
    fast, slow = Dispenser(store, 0, 2, 10), Dispenser(store, 1, 2, 10)

    def epoch(e):
        """Both pipelines through epoch ``e``; the batches the slow one took."""
        took, busy_until = 0, now[0]
        while True:  # the slow one asks first: it sees the fast one's speed published at the last epoch's end
            if now[0] >= busy_until:
                if slow.next(e) is None:
                    busy_until = float("inf")
                else:
                    took, busy_until = took + 1, now[0] + 3.0
            if fast.next(e) is None:
                break
            now[0] += 0.1
        if busy_until != float("inf"):  # the epoch ends when the slow one's batch does
            now[0] = max(now[0], busy_until)
            assert slow.next(e) is None
        return took

    assert epoch(0) == 1  # not measured yet: takes one
    assert slow._step_time == pytest.approx(3.0)
    left = [epoch(e) for e in range(1, 1 + Dispenser.MAX_AGE)]
    assert left == [0] * Dispenser.MAX_AGE  # the others finish an epoch (1 s) before its one step (3 s)
    assert epoch(1 + Dispenser.MAX_AGE) == 1  # its estimate got too old: it measures itself again
    assert epoch(2 + Dispenser.MAX_AGE) == 0
    slow.forget()  # the heterogeneity changed
    assert epoch(3 + Dispenser.MAX_AGE) == 1
    assert fast._step_time == pytest.approx(0.1)


def test_a_stale_reading_of_the_command_never_takes_a_change_back():
    """Under ``allreduce`` the step's collective agrees on the highest policy version its replicas read, so a
    pipeline whose own reading (up to ``CTL_MAX_AGE`` old) lags switches with the others and then reads the
    version before at its next boundary. Taking that up switched it back to ``allreduce`` alone, whose group
    waited for replicas that had moved on (a run stalled on a fresh clone this way, about 1 in 8 tries of
    the live-switch test). At a step boundary an older version than the one taken is no change."""
    import types

    import torch.distributed as dist

    from sdpipe.config import Heterogeneity
    from sdpipe.core.policies import SWITCHED_MODE
    from sdpipe.worker.boundary import PipelineControl

    store = dist.HashStore()
    store.set(Keys.policy(0), PolicyChange("allreduce", "allreduce").encode())
    store.set(Keys.policy(1), PolicyChange(SWITCHED_MODE, "sdpipe").encode())
    store.set(Keys.hetero(0), json.dumps(Heterogeneity().to_dict()))
    store.set(Keys.hetero(1), json.dumps(Heterogeneity(slowdown={1: 3.0}).to_dict()))
    switched, spans = [], []
    worker = types.SimpleNamespace(
        store=store,
        members_version=0,
        hetero_version=0,
        policy_version=0,
        hetero=Heterogeneity(),
        policy=types.SimpleNamespace(name="allreduce", coupled=True, taken=lambda w, epoch, j: 2 * (j + 1)),
        dispenser=types.SimpleNamespace(forget=lambda: None, base={}),
        span=lambda kind, *a, **kw: spans.append(kw["what"]),
    )
    worker.switch_policy = lambda mode: (switched.append(mode), worker.policy.__dict__.update(name=mode, coupled=False))
    ctl = PipelineControl(worker)
    ctl.apply(step=5, hv=1, pv=1, epoch=0, j=5)  # what the collective agreed
    ctl.apply(step=6, hv=0, pv=0, epoch=0, j=6)  # this stage's older reading
    ctl.apply(step=7, hv=1, pv=1, epoch=0, j=7)
    assert switched == [SWITCHED_MODE] and spans == ["heterogeneity", "policy"]
    assert (worker.hetero_version, worker.policy_version) == (1, 1)
    assert worker.hetero.slowdown == {1: 3.0} and worker.dispenser.base == {0: 12}


def test_a_peers_failure_is_typed_where_torch_says_it_and_keeps_its_step():
    """gloo raises a plain RuntimeError with its text; the worker turns it into PeerLost (the driver tests the
    type), keeping the step the driver's line names; other errors pass as they are."""
    from sdpipe.driver.watch import is_comm_failure
    from sdpipe.worker.comm import as_peer_lost

    torch_error = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:15257")
    torch_error.sdpipe_step = (12, 1)
    lost = as_peer_lost(torch_error)
    assert isinstance(lost, PeerLost) and is_comm_failure(lost) and lost.sdpipe_step == (12, 1)
    assert str(lost) == f"RuntimeError: {torch_error}"
    assert as_peer_lost(lost) is lost
    own = ValueError("stage 1's output is NaN")
    assert as_peer_lost(own) is own and not is_comm_failure(own)


def test_membership_reads_joins_leaves_and_losses_from_records():
    assert events.membership(events.control("joined", 1.0, applied_by="driver", pipeline=4)) == (4, True)
    assert events.membership(events.control("left", 1.0, applied_by="worker", pipeline=2)) == (2, False)
    assert events.membership(events.worker_lost(1, 0, 2.0, "tcp://127.0.0.1:1", "died")) == (1, False)
    assert events.membership(events.control("leave", 1.0, applied_by="driver", pipeline=2)) is None  # asked only
    assert events.membership(events.control("pause", 1.0, applied_by="driver")) is None
