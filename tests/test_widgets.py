"""The notebook layer: the dashboard over real runs (live and replayed), and the core without it."""

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


def test_view_keeps_recent_spans_and_totals_of_all():
    from sdpipe.widgets import RunView

    v = RunView(1, 2, 32, window=1.0)
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
    assert v.shares()["compute"] == pytest.approx([2.0, 2.0])  # every span counts in the totals


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
    assert v.shares()["synchronization"] == [0.0, 0.0]
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
    assert dash.panel is None  # nothing to steer in a finished run
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
        await_events(dash, 200)
        t = time.monotonic()
        sum(range(1000))  # the caller's thread is free while the dashboard redraws
        assert time.monotonic() - t < 1.0
        time.sleep(3.0)
        assert dash.redraw_rate(3.0) >= 2.0
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
        assert narrow.ordered[0] == "timeline" and narrow.ordered[-1] == "shares"
        assert [narrow.pos[k][0] for k in narrow.ordered] == list(range(1, len(keys) + 1))
        assert len(wide.specs) == len(wide.heights) == stages + 3
        assert wide.height == sum(wide.heights) + layout.ROW_GAP * len(wide.heights) + 80
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
