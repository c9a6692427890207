"""The notebook layer: the dashboard over real runs (live and replayed), and the core without it."""

import html
import subprocess
import sys
import time

import pytest

import sdpipe
from sdpipe.data import digits, digits_mlp


@pytest.fixture(scope="module")
def data():
    return digits()


def test_core_imports_without_notebook_packages():
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('ipywidgets', 'plotly', 'anywidget', 'IPython'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import sdpipe, sdpipe.core.scheduler, sdpipe.worker.sync\n"
        "assert callable(sdpipe.train)\n"
        "try:\n"
        "    import sdpipe.widgets\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "sdpipe.widgets needs ipywidgets and plotly: pip install 'sdpipe[notebook]'" in out.stdout


def test_view_keeps_recent_spans_and_a_replay_attributes_all():
    from sdpipe.widgets import RunView

    v = RunView(1, 2, 32, window=1.0, attribution_window=None)
    spans = [
        {"kind": "forward", "pipeline": p, "stage": 0, "step": i, "start": i * 0.5, "end": i * 0.5 + 0.2}
        for i in range(10)
        for p in range(2)
    ]
    v.add(spans)
    tl = v.timeline(bins=100)
    assert len(tl["compute"]["x"]) == 2 * 2  # the last second holds the spans of steps 8 and 9 (and 7's end)
    assert min(tl["compute"]["base"]) >= v.now - 1.0
    assert sum(tl["compute"]["x"]) == pytest.approx(2 * 0.4, abs=0.05)
    a = v.attribution()  # a replay's covers every span
    assert [w["compute"] for w in a.workers] == pytest.approx([2.0, 2.0]) and a.window == (None, None)


def _two_stage_steps(seconds: int, heavy_from: float) -> list:
    """The records of one pipeline of two stages, a step each 0.5 s, per second as a live run's come: in batches
    per worker, not in order of their ends.  Stage 1 computes 0.4 s of each step (stage 0 waits for its gradients)
    until ``heavy_from``, then 0.1 s (stage 0 computes 0.3 s: the heavy one)."""
    batches = []
    for second in range(seconds):
        per_worker = {0: [], 1: []}
        for k in range(2 * second, 2 * second + 2):
            t = 0.5 * k
            c0, c1 = (0.05, 0.4) if t < heavy_from else (0.3, 0.1)
            span = lambda kind, s, a, b, k=k: {"kind": kind, "pipeline": 0, "stage": s, "step": k, "start": a, "end": b}
            per_worker[0] += [span("forward", 0, t, t + c0), span("recv", 0, t + c0, t + 0.45)]
            per_worker[0] += [span("backward", 0, t + 0.45, t + 0.5)]
            per_worker[1] += [span("recv", 1, t, t + c0), span("forward", 1, t + c0, t + c0 + c1)]
        batches.append([per_worker[1], per_worker[0]])
    return batches


def assert_attributed_alike(got, want, tol: float = 1e-9) -> None:
    for g, w in zip(got.workers, want.workers, strict=True):
        assert g == {k: pytest.approx(x, abs=tol) if isinstance(x, float) else x for k, x in w.items()}
    assert got.bottleneck == want.bottleneck


def test_a_live_view_attributes_each_slice_of_its_clock_once_and_sums_its_last_seconds():
    """A live view attributes each ``SLICE`` seconds of the run's clock once, ``LAG`` seconds after it ended, keeps
    only the records the next slices need, and sums the slices of its window: what
    :func:`sdpipe.attribution.attribute` finds over the same window of all the run's records."""
    from sdpipe.attribution import attribute
    from sdpipe.widgets import RunView
    from sdpipe.widgets.view import LAG, SLICE

    v = RunView(2, 1, 32, attribution_window=30.0)
    events, attributed = [], 0
    for second, batches in enumerate(_two_stage_steps(100, heavy_from=70.0)):
        for batch in batches:
            v.add(batch)
            events += batch
        if second % 2:  # the dashboard draws it every SLICE seconds
            attributed += v.attribute_slices()
            assert not v._slices or v._slices[-1][1] <= v.now - LAG
    a = v.attribution()
    assert v.now == pytest.approx(100.0) and a.window == (66.0, 96.0)  # the last slice that ended LAG before
    assert attributed + v.attribute_slices() == 96 / SLICE and len(v._slices) == 30 / SLICE  # each slice once
    assert len(v._spans) < 0.1 * len(events)  # the records of the slices to come only
    want = attribute(events, since=66.0, until=96.0)
    assert_attributed_alike(a, want)
    assert a.named["stage"] == 0 and attribute(events).named["stage"] == 1  # the window's heavy stage; the run's
    assert a.share(0, 0, "compute") == pytest.approx((4 * 0.2 + 26 * 0.7) / 30)  # 4 s before stage 0 got heavy
    v.status = "finished"  # every record has arrived: the last slices too
    a = v.attribution()
    assert a.window == (70.0, 100.0)
    assert_attributed_alike(a, attribute(events, since=70.0, until=100.0))


def test_a_live_view_waits_out_a_pause_whose_records_come_with_the_resume():
    """A pause's spans end, and their records travel, at the resume: the slices the run was paused in are
    attributed ``LAG`` seconds after it, with them (the paused time shows; meanwhile the time up to the pause is
    shown); a slice missing a record it waited longer than the lag for is attributed without it (there its
    worker's time is ``other``)."""
    from sdpipe.attribution import attribute
    from sdpipe.widgets import RunView

    def control(what, t):
        return {"kind": "control", "what": what, "applied_by": "driver", "start": t, "end": t}

    batches = _two_stage_steps(60, heavy_from=0.0)
    paused = [{"kind": "pause", "pipeline": 0, "stage": s, "step": 40, "start": 20.0, "end": 40.0} for s in (0, 1)]
    v = RunView(2, 1, 32, attribution_window=30.0)
    events = []
    for second, arriving in enumerate(batches):
        if 20 <= second < 40:  # paused: the workers send nothing (their steps of those seconds never ran)
            if second == 20:
                v.add([control("pause", 19.9)])
            v.attribute_slices()
            if second == 30:  # meanwhile: up to the pause, the time after the last slice attributed for now
                a = v.attribution()
                assert a.window == (0.0, 20.0) and v._slices[-1][1] == 16.0
                assert_attributed_alike(a, attribute(events, since=0.0, until=20.0))
            continue
        if second == 40:  # stage 1's records first (its pause's among them), a redraw, then stage 0's
            arriving = [[control("resume", 39.9), paused[1], *arriving[0]], [paused[0], *arriving[1]]]
        for batch in arriving:
            v.add(batch)
            events += [e for e in batch if e["kind"] != "control"]
            v.attribute_slices()
    a = v.attribution()
    assert a.window == (26.0, 56.0)
    want = attribute(events, since=26.0, until=56.0)
    assert_attributed_alike(a, want)
    assert a.workers[0]["paused"] == pytest.approx(14.0)  # from 26 s to the resume at 40 s
    # a record 5 s late (longer than LAG): its part in the slices attributed before it came is cut
    v = RunView(2, 1, 32, attribution_window=30.0)
    late = [e for e in batches[50][1] if e["kind"] == "backward"][-1]
    for second, arriving in enumerate(batches):
        for batch in arriving:
            v.add([e for e in batch if e is not late])
        if second == 55:
            v.add([late])
        v.attribute_slices()
    everything = [e for arriving in batches for batch in arriving for e in batch]
    a, want = v.attribution(), attribute(everything, since=26.0, until=56.0)
    got, exp = a.workers[0], want.workers[0]
    assert got["compute"] == pytest.approx(exp["compute"] - 0.05) and got["other"] == pytest.approx(exp["other"] + 0.05)


def test_view_rows_follow_pipelines_that_join_leave_and_are_lost():
    from sdpipe.widgets import RunView

    v = RunView(2, 2, 32, window=10.0)

    def spans(p, t):
        return [{"kind": "forward", "pipeline": p, "stage": s, "step": 0, "start": t, "end": t + 0.1} for s in (0, 1)]

    def control(what, p, t, by="driver"):
        return {"kind": "control", "what": what, "pipeline": p, "applied_by": by, "start": t, "end": t}

    v.add(spans(0, 0.0) + spans(1, 0.0) + spans(2, 0.5))  # a pipeline the view does not know yet: no row
    assert v.workers == [(0, 0), (0, 1), (1, 0), (1, 1)]
    v.add([control("joined", 2, 1.0), *spans(2, 1.2)])
    assert v.workers == [(p, s) for p in range(3) for s in range(2)] and v.pipelines == 3
    assert "pipeline 2 stage 1" in v.timeline()["compute"]["y"]
    v.add([control("left", 0, 2.0, by="worker")])  # its worker took the leave: its rows go
    lost = {"kind": "worker-lost", "pipeline": 1, "stage": 0, "worker": "w", "reason": "died", "start": 3.0, "end": 3.0}
    v.add([lost])
    assert v.workers == [(2, 0), (2, 1)]
    assert set(v.timeline()["compute"]["y"]) == {"pipeline 2 stage 0", "pipeline 2 stage 1"}
    v.add(spans(2, 8.0))  # the slices of the first 4 s due
    assert [(w["pipeline"], w["stage"]) for w in v.attribution().workers] == v.workers  # nor named the bottleneck
    v.add([control("joined", 1, 4.0)])  # it came back
    assert v.workers == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert [label for _, label in v.controls] == ["joined: pipeline 2", "lost: pipeline 1", "joined: pipeline 1"]


def test_overlapped_averaging_has_its_own_lane_and_the_histogram_counts_ordinary_groups():
    from sdpipe.widgets import RunView

    v = RunView(1, 2, 32, window=2.0)
    evs = []
    for i in range(4):
        for p in range(2):
            t = i * 0.5
            evs.append({"kind": "forward", "pipeline": p, "stage": 0, "step": i, "start": t, "end": t + 0.4})
            evs.append({"kind": "optimizer", "pipeline": p, "stage": 0, "step": i, "start": t + 0.4, "end": t + 0.41})
            # the group of step i averages in the background during step i + 1's forward
            evs.append(
                {
                    "kind": "sync",
                    "pipeline": p,
                    "stage": 0,
                    "step": i,
                    "start": t + 0.45,
                    "end": t + 0.6,
                    "group": [0, 1],
                    "round": i,
                    "lane": "background",
                }
            )
        reason = "global" if i == 3 else ("alone" if i == 1 else "full")
        for members in [[0], [1]] if reason == "alone" else [[0, 1]]:
            evs.append({"kind": "group", "stage": 0, "round": i, "group": members, "reason": reason, "end": i * 0.5})
    v.add(sorted(evs, key=lambda e: e["end"]))
    tl = v.timeline(bins=100)
    assert len(tl["background"]["x"]) == 2 * 4 and sum(tl["background"]["x"]) == pytest.approx(8 * 0.15)
    assert "synchronization" not in {c for c, d in tl.items() if d["x"]}  # background spans leave the step lanes
    assert sum(tl["compute"]["x"]) == pytest.approx(2 * 4 * 0.4, abs=0.05)  # compute bars keep their time
    v.status = "finished"  # every slice attributed (the run's clock ends before one is LAG old)
    a = v.attribution()  # overlapped averaging is no share of the wall time: it runs beside the compute
    assert [w["averaging"] for w in a.workers] == [0.0, 0.0]
    assert [w["background"] for w in a.workers] == pytest.approx([4 * 0.15] * 2)
    assert dict(v.sizes[0]) == {2: 2, 1: 2}  # the global sync aside; a round alone counts one group per worker


def test_ratio_to_the_ideal_is_the_steps_without_their_synchronization():
    from sdpipe.widgets import RunView

    # 2 pipelines x 2 stages; each step lasts 1 s on pipeline 0 and 2 s on pipeline 1, of which stage 0 waits
    # 0.25 s (pipeline 0) and 1.0 s (pipeline 1) for its group and averages 0.25 s; stage 1 is never held
    v = RunView(2, 2, 10, steps=12)
    events = []
    for p, step_s, wait_s in ((0, 1.0, 0.25), (1, 2.0, 1.0)):
        for k in range(13):
            end = (k + 1) * step_s
            for s in (0, 1):
                if s == 0:
                    events.append(
                        {
                            "kind": "wait",
                            "what": "group",
                            "pipeline": p,
                            "stage": s,
                            "step": k,
                            "start": end - wait_s - 0.3,
                            "end": end - 0.3,
                        }
                    )
                    events.append(
                        {"kind": "sync", "pipeline": p, "stage": s, "step": k, "start": end - 0.3, "end": end - 0.05}
                    )
                events.append(
                    {"kind": "optimizer", "pipeline": p, "stage": s, "step": k, "start": end - 0.05, "end": end}
                )
    v.add(sorted(events, key=lambda e: e["end"]))
    tp = v.throughput()
    # samples/s: 10/1 + 10/2; ideal: 10/(1 - 0.5) + 10/(2 - 1.25)
    assert tp["samples_per_s"] == pytest.approx(15.0)
    assert tp["ideal"] == pytest.approx(20.0 + 10 / 0.75)
    assert tp["ratio"] == pytest.approx(15.0 / (20.0 + 10 / 0.75)) and tp["ratio"] <= 1.0
    assert tp["spread"] == pytest.approx((tp["ratio"], tp["ratio"]))  # every block of steps alike


def test_control_panel_applies_the_values_sent_with_a_press_and_refuses_bad_ones():
    """A page's press carries every input's value (see widgets/controls.py); the kernel checks them first."""
    from sdpipe.widgets.controls import ControlPanel

    pressed = []
    panel = ControlPanel(
        lambda action, error=None: pressed.append((action, error)),
        policies=["sdpipe", "ps"],
        policy="sdpipe",
        pipelines=2,
        slowdown=[1.0, 1.0],
        staleness=4,
    )
    page = {
        "policy": "ps",
        "staleness": 8,
        "max_group": 2,
        "slowdown": [1.0, 2.5],
        "straggle_prob": 0.1,
        "straggle_delay": 0.05,
    }
    panel._on_message(panel, {"action": "slowdowns", "values": page}, [])
    assert pressed == [("slowdowns", None)]
    assert (panel.policy, panel.staleness, panel.max_group, panel.slowdown) == ("ps", 8, 2, [1.0, 2.5])
    for bad, field in (
        ({"slowdown": [1.0, 9.0]}, "slowdown of pipeline 1: must be a number from 1 to 8"),
        ({"slowdown": [2.0]}, "slowdown: must be 2 numbers"),
        ({"staleness": 0.5}, "P (staleness): must be a whole number from 1 to 1000"),
        ({"policy": "allreduce"}, "policy: must be one of sdpipe, ps"),
    ):
        pressed.clear()
        panel._on_message(panel, {"action": "policy", "values": bad}, [])
        [(action, error)] = pressed
        assert action == "policy" and field in str(error), (bad, error)
    assert panel.slowdown == [1.0, 2.5] and panel.staleness == 8  # nothing of a refused press was taken
    panel._on_message(panel, {"action": "reboot"}, [])  # not a button of the panel
    assert len(pressed) == 1
    with pytest.raises(ValueError, match="action: must be one of policy, slowdowns, pause, resume, stop, add"):
        panel.press("reboot")
    pressed.clear()
    panel._on_message(panel, {"action": "remove pipeline", "values": {"remove": 1.5}}, [])
    [(action, error)] = pressed
    assert action == "remove pipeline" and "pipeline: must be a whole number" in str(error)
    pressed.clear()
    panel._on_message(panel, {"action": "re-cut", "values": {"cuts": "3; 6 "}}, [])
    assert pressed == [("re-cut", None)] and panel.cuts == "3; 6"
    pressed.clear()
    panel._on_message(panel, {"action": "re-cut", "values": {"cuts": "3.5"}}, [])
    [(action, error)] = pressed
    assert action == "re-cut" and str(error) == (
        "cut at: must be cut points (the first layer of stages 1..S-1, e.g. 3, 6), params or time, got '3.5'"
    )
    assert panel.cuts == "3; 6"  # the refused entry was not taken


@pytest.mark.cluster
def test_replay_shows_timeline_groups_stragglers_and_curves(data, shared_cluster):
    from sdpipe.widgets import Dashboard

    train_data, eval_data = data
    result = sdpipe.train(
        digits_mlp(),
        train_data,
        eval_data=eval_data,
        stages=2,
        pipelines=2,
        policy="sdpipe",
        epochs=3,
        heterogeneity=sdpipe.Heterogeneity(slowdown={1: 4.0}),
        cluster=shared_cluster,
    ).result(timeout=300)
    dash = Dashboard(result)
    assert dash.panel is None and dash.whatif is None  # nothing to steer or predict in a finished run
    layout = dash.figure.layout[dash.plot.axes["timeline"][1]]
    rows = dict(zip(layout.tickvals, layout.ticktext, strict=True))
    compute = dash.trace("timeline/compute")
    # the slowed pipeline's stage 0 (its slowdown's sleep counts as its own work) spends most of its time computing
    assert compute.name == "compute" and "pipeline 1 stage 0" in {rows[y] for y in compute.y}
    shown = {
        rows[y]
        for c in ("compute", "communication", "synchronization", "waiting", "eval")
        for y in dash.trace(f"timeline/{c}").y
    }
    assert shown == {f"pipeline {p} stage {s}" for p in (0, 1) for s in (0, 1)}
    z = dash.trace("groups/0").z  # stage 0 membership strip
    assert any(4 in row for row in z) and len(z) == 2  # global syncs shown, one row per pipeline
    bars = dash.trace("stragglers")
    flagged = [label for label, color in zip(bars.x, bars.marker.color, strict=True) if color == "#E45756"]
    assert flagged and all(label.startswith("p1<br>") for label in flagged)
    assert len(dash.trace("loss/0").y) > 5 and list(dash.trace("accuracy/0").x) == [0, 1, 2]  # per step, per epoch
    assert "finished" in dash.header.value and "ideal" in dash.numbers.value
    # where each worker's time went, over the whole run: a bar per worker (the timeline's rows), its segments the
    # shares attribute() finds in the run's records, in the colours of the timeline's kinds in them
    from sdpipe.attribution import attribute
    from sdpipe.widgets.style import ATTRIBUTION_COLORS

    want = attribute(result.events)
    assert dash.plot.attribution.window == (None, None) and dash.plot.titles["attribution"].startswith(
        "Where each worker's time went, whole run: shares of its wall time"
    )
    assert dash.figure.layout[dash.plot.axes["attribution"][1]].ticktext == layout.ticktext
    ends = [0.0] * 4
    for c, color in ATTRIBUTION_COLORS.items():
        bar = dash.trace(f"attribution/{c}")
        assert bar.name == c and bar.marker.color == color and len(bar.x) == 4
        for y, x, base in zip(bar.y, bar.x, bar.base, strict=True):
            p, s = dash.view.workers[y]
            assert x == pytest.approx(want.share(p, s, c), abs=1e-5) and base == pytest.approx(ends[y], abs=1e-4)
            ends[y] = base + x
    assert ends == pytest.approx([1.0] * 4, abs=1e-4)  # each bar the worker's whole wall time
    timeline = lambda kind: dash.trace(f"timeline/{kind}").marker.color
    assert [dash.trace(f"attribution/{c}").marker.color for c in ("compute", "bubble", "group", "averaging")] == [
        timeline("compute"),
        timeline("communication"),  # receives and sends
        timeline("waiting"),  # group waits
        timeline("synchronization"),  # the syncs
    ]
    assert_slices_sum_to_the_window(result.events)
    # the bottleneck in a sentence under the figure: the 4x slower pipeline 1, which the other waits for in groups
    assert want.named["pipeline"] == 1 and dash.plot.attribution.bottleneck == want.bottleneck
    assert html.escape(want.bottleneck) in dash.bottleneck.value and "over the whole run" in dash.bottleneck.value
    assert dash.widget.children[-1] is dash.bottleneck
    # a page's answer (a custom message, as the width probe's page code sends it) counts only for the last redraw
    dash.figure._drawn.clear()
    last = dash._width.seq
    assert last >= 1 and dash.figure._drawn_at is None
    dash._width._on_width(None, {"drawn": last - 1}, [])
    assert dash.figure._drawn_at is not None and not dash.figure._drawn.is_set()  # a page attached, still behind
    dash._width._on_width(None, {"drawn": last}, [])
    assert dash.figure._drawn.is_set()
    # titles broken into lines that fit their panel at the figure's width, in both layouts; the words all kept
    from sdpipe.widgets.dashboard import TITLE_CHAR_PX

    for width, narrow in ((1400, False), (1000, False), (700, True)):
        dash.fit(width)
        assert dash.narrow is narrow
        plot = width - 16 - dash.figure.layout.margin.l - dash.figure.layout.margin.r
        for key, a in zip(dash.plot.title_keys, dash.figure.layout.annotations, strict=True):
            lo, hi = dash.figure.layout[dash.plot.axes[key][0]].domain
            lines = a.text.split("<br>")
            assert " ".join(lines) == dash.plot.titles[key]
            assert all(len(line) * TITLE_CHAR_PX <= (hi - lo) * plot for line in lines), (width, a.text)
    assert "<br>" in dash.figure.layout.annotations[dash.plot.title_keys.index("groups/0")].text  # long, at 700 px
    assert dash.plot.titles["accuracy"] == "held-out accuracy per epoch"  # (without eval_data: the training loss)


def assert_slices_sum_to_the_window(events: list) -> None:
    """On a real run's records, whose spans cross the slices' edges: the slices of its clock, each attributed with
    every record, merge into the attribution of their window (to the rounding of the sums); a live view fed the
    records in the order they arrived, attributing the slices due after each batch (a redraw's), finds the same
    less what it cut: the part of a record in a slice attributed before the record came (none, unless a record
    came more than LAG seconds of the run's clock late)."""
    import math
    from collections import defaultdict

    from sdpipe.attribution import CATEGORIES, Attribution, attribute
    from sdpipe.widgets import RunView
    from sdpipe.widgets.view import SLICE

    spans = [e for e in events if e.get("pipeline") is not None and e.get("start") is not None]
    spans = [e for e in spans if e["end"] > e["start"]]
    lo, hi = min(e["start"] for e in spans), max(e["end"] for e in spans)
    # slices a SLICE apart, one edge through the middle of the longest span (a run shorter than a slice may
    # have no edge of the view's grid inside it)
    longest = max(spans, key=lambda e: e["end"] - e["start"])
    mid = (longest["start"] + longest["end"]) / 2
    first = mid - SLICE * math.ceil((mid - lo) / SLICE)
    edges = [first + SLICE * i for i in range(math.ceil((hi - first) / SLICE) + 1)]
    assert edges[0] <= lo and edges[-1] >= hi and any(e["start"] < x < e["end"] for x in edges for e in spans)
    parts = [attribute(events, since=a, until=a + SLICE, part=True) for a in edges[:-1]]
    assert_attributed_alike(Attribution.merge(parts), attribute(events, since=edges[0], until=edges[-1]))
    # live: in batches as they arrived
    config = {"stages": max(e["stage"] for e in spans) + 1, "pipelines": max(e["pipeline"] for e in spans) + 1}
    v = RunView(config["stages"], config["pipelines"], 32, attribution_window=1000.0)
    cut = defaultdict(float)  # per worker: seconds of its records in slices attributed before they came
    ids = {id(e) for e in spans}
    for i in range(0, len(events), 300):
        batch = events[i : i + 300]
        for e in (e for e in batch if id(e) in ids):
            for a, b, _ in v._slices:
                cut[(e["pipeline"], e["stage"])] += max(0.0, min(b, e["end"]) - max(a, e["start"]))
        v.add(batch)
        v.attribute_slices()
    v.status = "finished"
    got = v.attribution()
    want = attribute(events, since=got.window[0], until=got.window[1])
    if not any(cut.values()):
        assert_attributed_alike(got, want)
    for g, w in zip(got.workers, want.workers, strict=True):
        for k in (*CATEGORIES, "wall"):
            assert abs(g[k] - w[k]) <= cut[(w["pipeline"], w["stage"])] + 1e-9, (k, g, w, cut)


def await_events(dash, count: int, timeout: float = 60) -> float:
    """Wait until the live dashboard took in ``count`` events; returns the wait's deadline (monotonic)."""
    run = dash.run
    deadline = time.monotonic() + timeout
    while dash.view.count < count:
        if run.done():
            run.result(timeout=10)  # a run that ended in an error raises it here, with its message
        assert time.monotonic() < deadline and not run.done(), run.status
        time.sleep(0.1)
    return deadline


@pytest.mark.cluster
def test_live_dashboard_redraws_and_steers_while_the_kernel_is_free(data, shared_cluster):
    from sdpipe.widgets import Dashboard

    train_data, _ = data
    run = sdpipe.train(
        digits_mlp(), train_data, stages=2, pipelines=2, policy="sdpipe", epochs=100, cluster=shared_cluster
    )
    dash = Dashboard(run, interval=0.25)
    try:
        deadline = await_events(dash, 200)
        t = time.monotonic()
        sum(range(1000))  # the caller's thread is free while the dashboard redraws
        assert time.monotonic() - t < 1.0
        attributed = []  # the time attribution is drawn every ATTRIBUTION_EVERY seconds, not at each redraw
        attribution = dash.view.attribution
        dash.view.attribution = lambda: attributed.append(time.monotonic()) or attribution()
        time.sleep(3.0)
        assert dash.redraw_rate(3.0) >= 2.0 and len(attributed) <= 2, attributed
        # over the last 30 s of the run's clock, a bar per worker, from the first slice LAG seconds after its end
        while not (dash.plot.attribution and len(dash.plot.attribution.workers) == 4):
            assert time.monotonic() < deadline + 30 and not run.done(), run.status
            time.sleep(0.2)
        a = dash.plot.attribution
        assert dash.plot.titles["attribution"].startswith("Where each worker's time went, last 30 s")
        assert a.window[0] is not None and len(a.workers) == 4 and "over the last 30 s" in dash.bottleneck.value
        assert html.escape(a.bottleneck) in dash.bottleneck.value
        # a change made from code shows in the panel at the next redraw
        run.set_heterogeneity(slowdown={0: 2.0}, straggle_prob=0.1, straggle_delay=0.02)
        run.set_policy("sdpipe", staleness=7)
        dash.refresh()
        p = dash.panel
        assert (p.slowdown, p.straggle_prob, p.straggle_delay, p.staleness) == ([2.0, 1.0], 0.1, 0.02, 7)
        assert p.status == "running"
        # a press changes only what was touched (a page sends None for an untouched slider)
        dash.panel.press("slowdowns", slowdown=[None, 3.0])
        assert "slowdowns applied at t = " in dash.message.value and "pipeline 1 x3," in dash.message.value
        assert run.heterogeneity.slowdown == {0: 2.0, 1: 3.0} and run.heterogeneity.straggle_prob == 0.1
        dash.panel.press("slowdowns", slowdown=[1.0, None], straggle_prob=0.0)
        assert run.heterogeneity.slowdown == {1: 3.0} and run.heterogeneity.straggle_prob == 0.0
        dash.panel.press("pause")
        assert run.status == "paused"
        dash.refresh()
        assert dash.panel.status == "paused"  # the page enables resume, not pause
        dash.panel.press("stop")
        assert dash.wait(60)
        result = run.result(timeout=60)
    finally:
        run.stop()
        dash.stop()
    assert result.stopped
    ctl = [e for e in result.events if e["kind"] == "control" and e["applied_by"] == "driver"]
    assert [e["what"] for e in ctl] == ["heterogeneity", "policy", "heterogeneity", "heterogeneity", "pause", "stop"]
    assert [e["heterogeneity"]["slowdown"] for e in ctl if e["what"] == "heterogeneity"] == [
        {"0": 2.0},
        {"0": 2.0, "1": 3.0},
        {"1": 3.0},
    ]
    assert any("pause" in label for _, label in dash.view.controls)
    assert "stopped" in dash.header.value
    assert dash.panel.status == "stopped"  # the page disables every button
    dash.panel.press("stop")  # a finished run answers like the other controls
    assert "stop not applied" in dash.message.value and "had already ended (stopped)" in dash.message.value


def wait_for(test, what: str, run, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not test():
        if run.done():
            run.result(timeout=10)  # a run that ended in an error raises it here, with its message
        assert time.monotonic() < deadline and not run.done(), f"{what}: not within {timeout:.0f} s ({run.status})"
        time.sleep(0.2)


@pytest.mark.cluster
def test_live_what_if_panel_shows_the_predictions_and_a_switch_against_what_it_brought(data, shared_cluster):
    """The what-if panel shows ``run.what_if``'s rows (the best change that keeps one model highlighted), paced
    within its share of a core; a live switch to sdpipe under a slept straggler gets a line: the prediction made on
    the records up to just before it (``run.what_if`` and ``run.predict`` with ``until``), the samples/s of the
    first whole epochs after it (``measured_rate``), and the errors.  (Their size depends on the machine.)"""
    from sdpipe.simulation.whatif import measured_rate
    from sdpipe.widgets import Dashboard
    from sdpipe.widgets.dashboard import ATTRIBUTION_WINDOW as W
    from sdpipe.widgets.whatif import BEFORE, EPOCHS_AFTER, SETTLE, WHATIF_SHARE, best

    train_data, eval_data = data
    run = sdpipe.train(
        digits_mlp(),
        train_data,
        eval_data=eval_data,
        stages=2,
        pipelines=2,
        policy="allreduce",
        epochs=300,
        heterogeneity=sdpipe.Heterogeneity(slowdown={1: 3.0}),
        cluster=shared_cluster,
    )
    dash = Dashboard(run)
    panel = dash.whatif
    try:
        assert panel.widget in dash.widget.children and "what if" in panel.widget.value
        began = time.monotonic()
        measured = lambda: panel.predictions is not None and panel.predictions.measured is not None
        wait_for(measured, "predictions beside a measured epoch", run, 120)
        w, value = panel.predictions, panel.widget.value
        assert [p.change for p in w.predictions] == [p.change for p in run.what_if(last=W).predictions]
        assert w.until - w.since == pytest.approx(W, abs=1e-6) and "policy sdpipe" in [p.change for p in w.predictions]
        for p in w.predictions:  # each row: its change, simulated, vs now, expected, time left
            assert html.escape(p.change) in value and f"{p.samples_per_s:,.0f}" in value
            assert f"{w.ratio(p.change):.2f}x" in value and f"{w.expected(p.change):,.0f}" in value
        top = best(w)
        assert top.change != "policy none" and top.samples_per_s == max(
            p.samples_per_s for p in w.predictions if p.change != "policy none"
        )
        if top is not w.predictions[0]:  # highlighted in the averaging's green, and named above the table
            row = value[value.index("#E3F0E1") :]
            assert row.index(html.escape(top.change)) < row.index("</tr>") and f"<b>{top.change}</b>" in value
        # the switch
        run.set_policy("sdpipe")
        wait_for(lambda: panel.switches and panel.switches[0].predicted, "the switch predicted", run, 120)
        wait_for(lambda: panel.switches[0].settled, "the switch measured", run, 120)
        s, value = panel.switches[0], panel.widget.value
        until = s.at - BEFORE
        assert s.label == "policy allreduce \u2192 sdpipe" and s.prediction is not None, s.why
        before = run.what_if(last=W, until=until)
        assert s.before.measured == before.measured and s.before.measured is not None
        assert s.simulated == run.predict(last=W, until=until, policy="sdpipe").samples_per_s
        assert s.as_it_ran == run.predict(last=W, until=until).samples_per_s == before.predictions[0].samples_per_s
        assert s.expected == pytest.approx(before.expected("policy sdpipe"))
        # measured after: the first EPOCHS_AFTER whole epochs from SETTLE s after the switch on, every pipeline's
        epochs = [e for e in run.events if e["kind"] == "epoch"]
        counted = [e for e in epochs if e["metrics"]["epoch"] in s.epochs]
        assert len(s.epochs) == EPOCHS_AFTER and len(counted) == 2 * EPOCHS_AFTER, s.epochs
        assert s.since == s.at + SETTLE and all(s.since <= e["start"] <= s.until for e in counted)
        previous = [e for e in epochs if e["metrics"]["epoch"] == min(s.epochs) - 1]
        assert len(previous) == 2 and min(e["start"] for e in previous) >= s.since  # began after the settling
        assert s.measured == measured_rate(counted)
        assert s.error == pytest.approx(s.expected / s.measured - 1)
        assert s.simulated_error == pytest.approx(s.simulated / s.measured - 1)
        line = value[value.index("after a switch") :]
        assert f"{s.at:.1f} s" in line and html.escape(s.label) in line
        assert f"{s.expected:,.0f} ({s.simulated:,.0f})" in line and f"{s.measured:,.0f} over 3 epochs" in line
        assert f"{100 * s.error:+.0f}% ({100 * s.simulated_error:+.0f}%)" in line
        # paced: its thread took at most its share of a core, but for the prediction it made last
        assert 0 < panel.cost <= WHATIF_SHARE * (time.monotonic() - began) + panel.spent
    finally:
        run.stop()
        dash.stop()
    run.result(timeout=120)
    assert dash.wait(30)


@pytest.mark.cluster
def test_live_dashboard_adds_and_removes_pipelines_and_its_rows_follow(data, shared_cluster):
    from sdpipe.widgets import Dashboard

    train_data, _ = data
    run = sdpipe.train(
        digits_mlp(), train_data, stages=1, pipelines=2, policy="sdpipe", epochs=200, cluster=shared_cluster
    )
    dash = Dashboard(run, interval=0.25)
    try:
        deadline = await_events(dash, 100)
        assert dash.panel.elastic
        dash.panel.press("add pipeline")
        assert "add pipeline applied at t = " in dash.message.value and "pipeline 2 joins" in dash.message.value
        while run.pipelines != [0, 1, 2]:
            assert time.monotonic() < deadline + 120 and not run.done(), run.status
            time.sleep(0.2)
        time.sleep(1.5)  # a few redraws
        ticks = lambda: dash.figure.layout[dash.plot.axes["timeline"][1]].ticktext
        assert ticks() == ("pipeline 0 stage 0", "pipeline 1 stage 0", "pipeline 2 stage 0")
        assert "1 stages x 3 pipelines" in dash.header.value
        dash.panel.press("remove pipeline", remove=0)
        assert "pipeline 0 leaves at its next step boundary" in dash.message.value
        while ticks() != ("pipeline 1 stage 0", "pipeline 2 stage 0"):
            assert time.monotonic() < deadline + 180 and not run.done(), run.status
            time.sleep(0.2)
        dash.panel.press("remove pipeline", remove=0)  # not there any more: said in the message line
        assert "remove pipeline not applied" in dash.message.value and "is not taking part" in dash.message.value
        labels = [label for _, label in dash.view.controls]
        assert "add: pipeline 2" in labels and "joined: pipeline 2" in labels and "leave: pipeline 0" in labels
        assert dash.trace("loss/2").x  # the joined pipeline's own loss curve
        run.stop()
        result = run.result(timeout=120)
    finally:
        run.stop()
        dash.stop()
    assert result.finished_pipelines == [1, 2] and list(result.left) == [0]


@pytest.mark.cluster
def test_live_dashboard_recuts_the_stages_and_marks_the_moment(data, shared_cluster):
    """The panel shows the run's cut; a press of "re-cut" moves the stages (the kernel goes on meanwhile) and
    says so, the panel then shows the new cut, the timeline marks the moment; a bad cut is said in one line."""
    from sdpipe.widgets import Dashboard

    train_data, _ = data
    run = sdpipe.train(
        digits_mlp(), train_data, stages=2, pipelines=2, cuts=(4,), policy="sdpipe", epochs=200, cluster=shared_cluster
    )
    dash = Dashboard(run, interval=0.25)
    try:
        deadline = await_events(dash, 100)
        assert dash.panel.recut_enabled and dash.panel.cuts == "4"
        dash.panel.press("re-cut", cuts="2")
        while "re-cut applied" not in dash.message.value:
            assert time.monotonic() < deadline + 120 and not run.done(), (run.status, dash.message.value)
            time.sleep(0.1)
        assert "stages start at layers 0, 2; every worker took it" in dash.message.value
        assert run.cuts == (2,)
        while "recut: stages start at layers 0, 2" not in [label for _, label in dash.view.controls]:
            assert time.monotonic() < deadline + 150, dash.view.controls
            time.sleep(0.2)
        time.sleep(0.6)  # a redraw or two: the panel follows the run
        assert dash.panel.cuts == "2"
        dash.panel.press("re-cut", cuts="7")
        while "re-cut not applied" not in dash.message.value:
            assert time.monotonic() < deadline + 160, dash.message.value
            time.sleep(0.1)
        assert "ValueError: cuts: must be strictly increasing integers in 1..4, got [7]" in dash.message.value
        run.stop()
        run.result(timeout=120)
    finally:
        run.stop()
        dash.stop()


@pytest.mark.cluster
def test_a_run_started_beside_another_says_so_in_its_repr_and_dashboard(data, shared_cluster):
    from sdpipe.widgets import Dashboard

    train_data, _ = data
    kw = dict(stages=1, pipelines=2, policy="none", epochs=2, batch_size=64, cluster=shared_cluster)
    first = sdpipe.train(digits_mlp(), train_data, **kw)
    second = sdpipe.train(digits_mlp(), train_data, **kw)
    dash = Dashboard(second, start=False)
    try:
        second.result(timeout=300)
        first.result(timeout=300)
    finally:
        first.stop()
        second.stop()
    for run, other in ((first, second), (second, first)):
        assert f"run {other.run_id} trained on the same Dask cluster while this one did" in repr(run)
    dash.refresh()
    assert first.run_id in dash.note.value and "samples/s" in dash.note.value
    # no eval_data: the per-epoch panel shows each epoch's training loss, and its title says so
    assert dash.plot.titles["accuracy"] == "training loss per epoch (no held-out data given)"
    assert list(dash.trace("accuracy/0").x) == [0, 1] and all(y > 0 for y in dash.trace("accuracy/0").y)
    alone = sdpipe.train(digits_mlp(), train_data, **kw)
    alone.result(timeout=300)
    assert alone.concurrent is None and "trained on" not in repr(alone)


# ------------------------------------------------------------------ the dashboard's pure parts: layout and actions
def test_the_grid_puts_every_panel_once_wide_or_in_one_column():
    from sdpipe.widgets import layout

    for stages, workers in [(1, 2), (2, 8), (4, 16)]:
        keys = set(layout.titles(stages, "accuracy", True))
        wide, narrow = layout.grid(stages, workers, narrow=False), layout.grid(stages, workers, narrow=True)
        assert set(wide.pos) == set(narrow.pos) == keys and sorted(wide.ordered) == sorted(keys)
        assert len(set(wide.pos.values())) == len(keys) and wide.cols == 3 and narrow.cols == 1
        assert narrow.ordered[0] == "timeline" and narrow.ordered[-1] == "attribution"
        assert [narrow.pos[k][0] for k in narrow.ordered] == list(range(1, len(keys) + 1))
        assert len(wide.specs) == len(wide.heights) == stages + 3
        assert wide.height == sum(wide.heights) + layout.ROW_GAP * len(wide.heights) + 40 + layout.BOTTOM
    assert layout.grid(2, 16, False).heights[0] > layout.grid(2, 4, False).heights[0]  # a row per worker
    assert layout.titles(1, "eval_loss", True)["accuracy"] == "held-out loss per epoch"
    assert layout.titles(1, "loss", False)["accuracy"] == "training loss per epoch (no held-out data given)"


def test_titles_wrap_to_their_subplots_and_the_legend_clears_the_first_title():
    from sdpipe.widgets import layout

    names = layout.titles(2, "accuracy", True)
    keys = ["timeline", "groups/0", "sizes/0", "loss"]
    domains = {"timeline": (0.0, 1.0), "groups/0": (0.0, 0.62), "sizes/0": (0.7, 1.0), "loss": (0.36, 0.64)}
    for width in (600, 1000, 1440):
        for key, text in zip(keys, layout.wrapped_titles(names, keys, domains, width, 130, 20), strict=True):
            fits = int((domains[key][1] - domains[key][0]) * max(100.0, width - 150) / layout.TITLE_CHAR_PX)
            lines = text.split("<br>")
            assert " ".join(lines) == names[key]
            assert all(len(line) <= fits or " " not in line for line in lines), (key, width, lines)
    assert layout.legend_place(False, 2000) == (40, 1.0)
    top, y = layout.legend_place(True, 2000)
    assert top == 130 and 1.0 < y < 1.1


def test_a_press_becomes_one_call_of_the_run_and_one_line():
    from types import SimpleNamespace

    from sdpipe import Heterogeneity
    from sdpipe.widgets import actions

    panel = SimpleNamespace(
        policy="allreduce", staleness=3, max_group=0, slowdown=[1.0, 3.0, 1.0, 1.0], straggle_prob=0.1,
        straggle_delay=0.05, remove=2,
    )  # fmt: skip
    h = Heterogeneity(slowdown={(3, 1): 4.0, 0: 2.0}, link_delay={1: 0.01})
    call = actions.plan("policy", panel, h)
    assert call == actions.Call("set_policy", ("allreduce",), {"staleness": 3, "max_group": None})
    call = actions.plan("slowdowns", panel, h)
    # pipeline 1's slider moved to 3x; pipeline 0's shows 1.0 against the run's 2.0: moved, so it goes; the
    # per-stage slowdown of pipeline 3 stays (its slider shows stage 0's 1.0, as the run has)
    assert call.method == "set_heterogeneity" and call.kwargs["slowdown"] == {(3, 1): 4.0, 1: 3.0}
    assert call.kwargs["link_delay"] == {1: 0.01} and call.kwargs["straggle_prob"] == 0.1
    assert actions.plan("add pipeline", panel, h) == actions.Call("add_pipelines", (1,))
    assert actions.plan("remove pipeline", panel, h) == actions.Call("remove_pipeline", (2,))
    assert actions.plan("pause", panel, h) == actions.Call("pause")
    for text, cuts in (("3, 6", (3, 6)), (" Time ", "time"), ("params", "params"), ("4", (4,))):
        assert actions.plan("re-cut", SimpleNamespace(cuts=text), h) == actions.Call("recut", (cuts,))
    said = actions.applied_text("re-cut", (3, 6), panel, 5.0, "c")
    assert said == "c re-cut applied at t = 5.0 s: stages start at layers 0, 3, 6; every worker took it"
    with pytest.raises(ValueError, match=r"^action: 'rewind' is not one of policy, slowdowns, pause"):
        actions.plan("rewind", panel, h)
    said = actions.applied_text("policy", None, panel, 12.34, "10:00:00")
    assert said == (
        "10:00:00 policy applied at t = 12.3 s: allreduce (P = 3, max group all); every worker takes it at its "
        "next step boundary"
    )
    said = actions.applied_text("slowdowns", None, panel, 1.0, "10:00:01")
    assert said.startswith("10:00:01 slowdowns applied at t = 1.0 s: pipeline 1 x3, straggle p 0.1, delay 0.05 s")
    joins = "pipeline 4 joins once its workers started (a live replica gives it its state)"
    assert actions.applied_text("add pipeline", [4], panel, 2.0, "c") == f"c add pipeline applied at t = 2.0 s: {joins}"
    err = actions.refused_text("stop", RuntimeError("run r had already ended (finished)"), "c")
    assert err == "c stop not applied: RuntimeError: run r had already ended (finished)"
