"""Time attribution (sdpipe.attribution): on recorded event lists, and on real runs whose bottleneck is known by
construction (a slept straggler pipeline, a stage slept heavy in every pipeline, allreduce against none)."""

import itertools

import pytest

import sdpipe
from sdpipe.attribution import CATEGORIES, Attribution, attribute
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


def _allreduce_steps(steps: int) -> list:
    """Two pipelines of two stages, a step a second from t = 0: stage 0 computes, hands its activations to stage 1
    and waits for its gradients; pipeline 1 is slept 0.3 s a step; each stage all-reduces with the other pipeline's
    (the fast one waits for the slow one), stage 1 then averages in the background while stage 0 waits for its
    group's round.  Every step's spans lie in [k, k + 0.95]."""
    evs = []
    for k in range(steps):
        for p in (0, 1):
            t, slow = float(k), 0.3 * p
            evs += [
                span("forward", p, 0, t, t + 0.1, k, 0),
                span("send", p, 0, t + 0.1, t + 0.12, k, 0),
                span("recv", p, 1, t, t + 0.12, k, 0),
                span("forward", p, 1, t + 0.12, t + 0.3, k, 0),
                span("backward", p, 1, t + 0.3, t + 0.45, k, 0),
                span("recv", p, 0, t + 0.12, t + 0.47, k, 0),
                span("backward", p, 0, t + 0.47, t + 0.55, k, 0),
                span("straggle", p, 1, t + 0.45, t + 0.45 + slow, k, what="slowdown"),
                span("sync", p, 1, t + 0.45 + slow, t + 0.8, k, group=[0, 1]),
                span("sync", p, 1, t + 0.8, t + 0.95, k, group=[0, 1], round=k, lane="background"),
                span("wait", p, 0, t + 0.55 + slow, t + 0.85, k, what="group", group=[0, 1], round=k),
                span("sync", p, 0, t + 0.85, t + 0.9, k, group=[0, 1], round=k),
            ]
    return evs


def assert_same(got, want, tol: float) -> None:
    """Two attributions alike: every worker's seconds, wall, waits and first and last instant within ``tol``, the
    same bottleneck."""
    assert [(w["pipeline"], w["stage"]) for w in got.workers] == [(w["pipeline"], w["stage"]) for w in want.workers]
    for g, w in zip(got.workers, want.workers, strict=True):
        for k in (*CATEGORIES, "wall", "slowdown", "background", "start", "end"):
            assert g[k] == pytest.approx(w[k], abs=tol), (k, g, w)
        assert g["waited_on"].keys() == w["waited_on"].keys()
        assert all(g["waited_on"][k] == pytest.approx(v, abs=tol) for k, v in w["waited_on"].items())
    assert got.bottleneck == want.bottleneck
    assert got.named == {k: pytest.approx(v, abs=tol) if isinstance(v, float) else v for k, v in want.named.items()}


@pytest.mark.parametrize("offset", [0.0, 0.5, 0.83])
def test_slices_of_a_window_merge_into_its_attribution(offset):
    """:meth:`Attribution.merge` of a window's slices, each attributed with every record, is :func:`attribute`
    over the window: with slices whose edges cut no span (offset 0: the time between spans at an edge is
    ``other``, counted once), and with edges through spans (0.5: the slow pipeline's sleep and syncs, 0.83: the
    group waits and the collectives, split where their last member came, then clipped)."""
    evs = _allreduce_steps(12)
    edges = [offset + 2 * i for i in range(6)]
    crossing = sum(any(e["start"] < x < e["end"] for x in edges) for e in evs)
    assert (crossing == 0) == (offset == 0.0)
    parts = [attribute(evs, since=a, until=a + 2, part=True) for a in edges[:-1]]
    merged = Attribution.merge(parts)
    want = attribute(evs, since=edges[0], until=edges[-1])
    assert_same(merged, want, 1e-12)
    assert merged.window == (edges[0], edges[-1]) and merged.path == [] and parts[0].path == []
    # pipeline 1 is slept: the straggler (stage 1 is the slowest stage of both pipelines, but the slept pipeline's
    # groups hold the other pipeline back by more)
    assert want.named["pipeline"] == 1 and merged.bottleneck.startswith("pipeline 1 is the straggler")
    assert_adds_up(merged)
    # a sync cut by a window's edge is split where its last member came, then clipped: pipeline 0's stage 1
    # waits 0.3 s for pipeline 1 in each step's all-reduce (from 0.45 to 0.75), then averages 0.05 s
    (w,) = [w for w in attribute(evs, since=0.6, until=0.78).workers if (w["pipeline"], w["stage"]) == (0, 1)]
    assert (w["group"], w["averaging"]) == pytest.approx((0.15, 0.03))


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
    assert (1, 0, "compute") in [k for k, _, _ in a.on_path()[:3]], a.on_path()
    computing = [k for k, _, _ in h.on_path() if k[2] == "compute"]
    assert computing[0][1] == 1, h.on_path()
