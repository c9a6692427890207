"""Time attribution (sdpipe.attribution): on recorded event lists, and on real runs whose bottleneck is known by
construction (a slept straggler pipeline, a stage slept heavy in every pipeline, allreduce against none)."""

import itertools

import pytest

import sdpipe
from sdpipe.attribution import CATEGORIES, attribute
from sdpipe.data import digits, digits_mlp
from sdpipe.wire import events


def span(kind, p, s, a, b, step=0, mb=None, **kw):
    return events.span(kind, p, s, step, mb, a, b, **kw)


def assert_adds_up(att):
    for w in att.workers:
        assert sum(w[c] for c in CATEGORIES) == pytest.approx(w["wall"], abs=1e-9), w


def test_an_allreduce_waits_for_its_last_member_and_names_it():
    """Two pipelines of one stage: pipeline 1 sleeps 0.8 s, then both all-reduce; pipeline 0 waited 0.8 s of its
    sync for it, and the 0.1 s the collective took after pipeline 1 came is averaging for both."""
    evs = [
        span("forward", 0, 0, 0.0, 0.1),
        span("sync", 0, 0, 0.1, 1.0, group=[0, 1]),
        span("forward", 1, 0, 0.0, 0.1),
        span("straggle", 1, 0, 0.1, 0.9, what="slowdown"),
        span("sync", 1, 0, 0.9, 1.0, group=[0, 1]),
    ]
    att = attribute(evs)
    assert_adds_up(att)
    w0, w1 = att.workers
    assert w0["group"] == pytest.approx(0.8) and w0["averaging"] == pytest.approx(0.1)
    assert w0["waited_on"] == {(1, 0): pytest.approx(0.8)}
    assert w1["compute"] == pytest.approx(0.9) and w1["slowdown"] == pytest.approx(0.8) and w1["group"] == 0
    assert att.named["pipeline"] == 1 and att.named["how"] == "group"
    assert att.bottleneck.startswith("pipeline 1 is the straggler: the other pipelines wait 80% of their time")
    # the critical path: pipeline 1's forward and sleep, then the averaging; pipeline 0's wait is not on it
    assert [(p, s, c) for p, s, c, _, _ in att.path] == [(1, 0, "compute"), (1, 0, "compute"), (1, 0, "averaging")]
    assert att.on_path()[0] == ((1, 0, "compute"), pytest.approx(0.9), pytest.approx(0.9))


def test_a_heavy_stage_is_what_its_neighbours_wait_for():
    """One pipeline of two stages: stage 1 computes 0.8 s of each step; stage 0 waits for its gradients, stage 1
    only for the control message and the activations (short)."""
    evs = []
    for k in range(3):
        t = k * 1.0
        evs += [
            span("forward", 0, 0, t, t + 0.05, k, 0),
            span("send", 0, 0, t + 0.05, t + 0.06, k, 0),
            span("recv", 0, 0, t + 0.06, t + 0.95, k, 0),
            span("backward", 0, 0, t + 0.95, t + 1.0, k, 0),
            span("wait", 0, 1, t, t + 0.05, k),
            span("recv", 0, 1, t + 0.05, t + 0.06, k, 0),
            span("forward", 0, 1, t + 0.06, t + 0.5, k, 0),
            span("backward", 0, 1, t + 0.5, t + 0.94, k, 0),
            span("send", 0, 1, t + 0.94, t + 0.95, k, 0),
        ]
    att = attribute(evs)
    assert_adds_up(att)
    assert att.share(0, 0, "bubble") == pytest.approx(0.9 / 1.0, abs=0.01)
    assert att.share(0, 1, "compute") == pytest.approx(3 * 0.88 / 2.95)
    first = att.workers[0]
    assert first["waited_on"][(0, 1)] == pytest.approx(3 * 0.89)  # its receives come before backwards
    assert (att.named["pipeline"], att.named["stage"]) == (0, 1)
    assert att.bottleneck.startswith("pipeline 0 is slow at stage 1: its other stages wait")
    # the critical path runs through stage 1's compute (0.88 s of every second), its hand-offs between, and
    # covers the whole window without a gap or an overlap
    assert att.on_path()[0] == ((0, 1, "compute"), pytest.approx(3 * 0.88), pytest.approx(0.88))
    assert att.path[0][3] == 0.0 and att.path[-1][4] == 3.0
    assert all(a[4] == pytest.approx(b[3]) for a, b in itertools.pairwise(att.path))
    assert "critical path: pipeline 0 stage 1 compute 88%" in att.table()


def test_overlaps_resolve_by_category_and_a_window_clips():
    """A background averaging is no share of the wall time; where a wait and a compute span overlap, the wait
    wins; a pause wins over everything; a window clips every span; time no span covers is "other"."""
    evs = [
        span("forward", 0, 0, 0.0, 1.0),
        span("wait", 0, 0, 0.5, 1.5, what="group", group=[0], round=3),
        span("sync", 0, 0, 0.2, 0.9, group=[0, 1], round=2, lane="background"),
        span("pause", 0, 0, 1.4, 2.0),
        span("optimizer", 0, 0, 2.5, 3.0, epoch=0),
    ]
    att = attribute(evs)
    assert_adds_up(att)
    (w,) = att.workers
    assert (w["compute"], w["group"], w["paused"], w["other"]) == pytest.approx((1.0, 0.9, 0.6, 0.5))
    assert w["background"] == pytest.approx(0.7) and w["wall"] == pytest.approx(3.0)
    (w,) = attribute(evs, since=0.75, until=2.75).workers
    assert (w["wall"], w["compute"], w["group"], w["paused"]) == pytest.approx((2.0, 0.25, 0.65, 0.6))
    assert attribute([]).bottleneck == "no worker's spans recorded yet"


# ------------------------------------------------------------------ real runs


@pytest.fixture(scope="module")
def train_data():
    return digits()[0]


def _run(train_data, cluster, policy, slowdown, pipelines=2):
    return sdpipe.train(
        digits_mlp(),
        train_data,
        stages=2,
        pipelines=pipelines,
        policy=policy,
        epochs=2,
        cluster=cluster,
        heterogeneity=sdpipe.Heterogeneity(slowdown=slowdown),
    ).result(timeout=300)


@pytest.mark.cluster
def test_real_runs_name_the_bottleneck_they_were_built_with(train_data, shared_cluster):
    """A pipeline slept 4x under allreduce: it is named, and the other waits for it in their collectives far
    more than under none, where they wait for nobody's groups; stage 1 slept 4x in every pipeline: named the
    bottleneck.  Every worker's shares add up to its wall time."""
    slow = _run(train_data, shared_cluster, "allreduce", {1: 4.0})
    alone = _run(train_data, shared_cluster, "none", {1: 4.0})
    heavy = _run(train_data, shared_cluster, "none", {(p, 1): 4.0 for p in range(2)})
    atts = [r.attribution() for r in (slow, alone, heavy)]
    for att in atts:
        assert_adds_up(att)
        assert {(w["pipeline"], w["stage"]) for w in att.workers} == {(p, s) for p in range(2) for s in range(2)}
    a, n, h = atts
    assert a.named["pipeline"] == 1, a.bottleneck
    assert min(a.share(0, s, "group") for s in (0, 1)) > 0.2, a.table()
    assert max(n.share(0, s, "group") for s in (0, 1)) < 0.05, n.table()
    assert n.named is None or n.named.get("groups", 0) < 0.05, n.bottleneck
    assert h.named is not None and h.named.get("stage") == 1 and h.named["how"] == "stage", h.table()
    # the critical path runs most through the slept worker: pipeline 1's stage 0; stage 1 where it is heavy
    assert a.on_path()[0][0] == (1, 0, "compute"), a.on_path()
    assert h.on_path()[0][0][1:] == (1, "compute"), h.on_path()
