"""The run's membership state machine on its own (sdpipe/core/membership.py): named transitions, the sets they keep."""

from hypothesis import given, settings
from hypothesis import strategies as st

from sdpipe.core.membership import Membership


def test_an_added_pipeline_is_queued_then_joining_then_present():
    m = Membership(2)
    assert m.present == [0, 1] and not m.pending and m.expected == 2
    assert m.add(2) == [2, 3] and m.ids == 4
    assert m.present == [0, 1] and m.pending and m.expected == 4
    assert m.launch(2) == 0 and m.joining == {2: 0} and m.queued == {3}
    m.joined(2, epoch=5)
    assert m.present == [0, 1, 2] and m.joined_in == {2: 5}
    assert m.give_up_join(3) is None  # never launched
    m.unqueue(3)
    assert m.present == [0, 1, 2, 3] and not m.pending


def test_a_lost_pipeline_stays_lost_until_its_new_tasks_were_submitted():
    m = Membership(3)
    m.lose(1, "worker pipeline 1 stage 0 was lost (its worker process died)")
    assert m.present == [0, 2] and 1 in m.lost
    m.queue_rejoin(1)
    assert m.next_generation(1) == 1
    assert m.launch(1) == 1 and 1 in m.lost and m.joining == {1: 1}  # the result still says lost if it ends now
    m.rejoined(1)
    assert 1 not in m.lost and m.present == [0, 2]
    m.joined(1, epoch=2)
    assert m.present == [0, 1, 2]


def test_leaving_and_failing_to_join():
    m = Membership(3)
    m.ask_to_leave(2)
    assert m.present == [0, 1] and m.leaving == {2}
    m.leave(2, "removed at step 7")
    m.leave(2, "the run ended before it joined")  # the first reason stays
    assert m.left == {2: "removed at step 7"} and not m.leaving
    m.ask_to_leave(1)
    m.lose(1, "lost while leaving")
    assert not m.leaving and m.lost == {1: "lost while leaving"}
    (p,) = m.add(1)
    m.launch(p)
    assert m.join_failed(p, "TimeoutError: no state") == "pipeline 3 could not join: TimeoutError: no state"
    assert not m.joining and m.present == [0]


OPS = st.lists(
    st.tuples(
        st.sampled_from(["add", "rejoin", "launch", "rejoined", "joined", "give_up", "fail", "ask", "lose", "leave"]),
        st.integers(0, 7),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_any_sequence_keeps_the_states_apart(ops):
    """Whatever happens in whatever order, present is exactly the ids in no other state, and ids only grow."""
    m = Membership(3)
    for op, p in ops:
        p = p % m.ids
        if op == "add":
            m.add(1)
        elif op == "rejoin" and p in m.lost:
            m.queue_rejoin(p)
            m.next_generation(p)
        elif op == "launch" and p in m.queued:
            m.launch(p)
        elif op == "rejoined" and p in m.joining:
            m.rejoined(p)
        elif op == "joined" and p in m.joining:
            m.joined(p, 0)
        elif op == "give_up":
            m.give_up_join(p)
            m.unqueue(p)
        elif op == "fail" and p in m.joining:
            m.join_failed(p, "x")
        elif op == "ask" and p in m.present:
            m.ask_to_leave(p)
        elif op == "lose":
            m.lose(p, "x")
        elif op == "leave" and p in m.leaving:
            m.leave(p, "x")
        others = set(m.lost) | set(m.left) | m.leaving | set(m.joining) | m.queued
        assert set(m.present) == set(range(m.ids)) - others
        assert not m.leaving & set(m.lost)
        assert m.pending == bool(m.joining or m.queued)
