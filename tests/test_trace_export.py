"""Chrome traces of a run (sdpipe.trace_export): on recorded event lists, on a real 2 x 2 run and on a simulated
one (every span one complete event on its worker's track, no two overlapping in part on a thread, a round's
members linked by one flow, controls and epochs as instants), and the trace of the real run drawn by
tools/trace_view.py in headless Chromium (its screenshot goes to ``artifacts/browser``)."""

import json
import os
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path

import pytest

import sdpipe
from sdpipe.data import digits, digits_mlp
from sdpipe.trace_export import SPANS, _lanes
from sdpipe.wire import events

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import trace_view  # noqa: E402 -- importable only once tools/ is on sys.path (above)
from lab_browser import CHROMIUM, chromium_page  # noqa: E402

ARTIFACTS = Path(os.environ.get("SDPIPE_ARTIFACTS", ROOT / "artifacts")) / "browser"


def span(kind, p, s, a, b, step=0, mb=None, **kw):
    return events.span(kind, p, s, step, mb, a, b, **kw)


def us(t: float) -> int:
    return round(t * 1e6)


def load(source, tmp_path, name="trace.json") -> dict:
    """Export ``source`` and read the file back as strict JSON (a NaN or Infinity would fail, as in a browser)."""
    path = sdpipe.export_trace(source, tmp_path / name)
    assert path == str(tmp_path / name)
    with open(path) as f:
        return json.load(f, parse_constant=lambda c: pytest.fail(f"not JSON a browser parses: {c}"))


def names(trace: dict) -> tuple:
    """``({pid: process name}, {(pid, tid): thread name})`` from the metadata events."""
    procs, threads = {}, {}
    for e in trace["traceEvents"]:
        if e["ph"] == "M" and e["name"] == "process_name":
            procs[e["pid"]] = e["args"]["name"]
        elif e["ph"] == "M" and e["name"] == "thread_name":
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
    return procs, threads


def of(trace: dict, ph: str) -> list:
    return [e for e in trace["traceEvents"] if e["ph"] == ph]


def track(trace: dict, e: dict) -> tuple:
    procs, threads = names(trace)
    return procs[e["pid"]], threads[(e["pid"], e["tid"])]


def assert_spans_match(records: list, trace: dict) -> None:
    """Every span record (and group decision) is one complete event with its kind, ts, dur and track, and no
    complete event is anything else (a second lane's thread, "stage s (2)", is its worker's too)."""
    procs, threads = names(trace)
    expected = Counter()
    for e in records:
        if e["kind"] in SPANS:
            lane = " background" if e.get("lane") == "background" else ""
            where = (f"pipeline {e['pipeline']}", f"stage {e['stage']}{lane}")
        elif e["kind"] == "group":
            where = ("group scheduler", f"stage {e['stage']}")
        else:
            continue
        expected[(e["kind"], us(e["start"]), us(e["end"]) - us(e["start"]), *where)] += 1
    got = Counter(
        (x["name"], x["ts"], x["dur"], procs[x["pid"]], re.sub(r" \(\d+\)$", "", threads[(x["pid"], x["tid"])]))
        for x in of(trace, "X")
    )
    assert got == expected


def assert_nested(trace: dict) -> None:
    """On every thread, two complete events either follow each other or one holds the other."""
    by_thread = defaultdict(list)
    for x in of(trace, "X"):
        by_thread[(x["pid"], x["tid"])].append((x["ts"], x["ts"] + x["dur"]))
    for key, spans in by_thread.items():
        open_ = []
        for a, b in sorted(spans, key=lambda s: (s[0], -s[1])):
            while open_ and open_[-1] <= a:
                open_.pop()
            assert not open_ or b <= open_[-1], f"thread {key}: ({a}, {b}) overlaps a span ending at {open_[-1]}"
            open_.append(b)


def flows(trace: dict) -> dict:
    """Flow id -> its events in time order."""
    out = defaultdict(list)
    for e in trace["traceEvents"]:
        if e["ph"] in ("s", "t", "f"):
            out[e["id"]].append(e)
    return {k: sorted(v, key=lambda e: e["ts"]) for k, v in out.items()}


def assert_flows_bound(trace: dict) -> None:
    """Each flow starts, steps and ends in time order, under one name, each point inside a sync span or a group
    decision on its own thread (what the viewer binds it to: ``bp: "e"``)."""
    spans = defaultdict(list)
    for x in of(trace, "X"):
        spans[(x["pid"], x["tid"])].append(x)
    for fid, points in flows(trace).items():
        assert [p["ph"] for p in points] == ["s"] + ["t"] * (len(points) - 2) + ["f"], fid
        assert len({(p["name"], p["cat"]) for p in points}) == 1 and all(p["bp"] == "e" for p in points)
        for p in points:
            around = [
                x
                for x in spans[(p["pid"], p["tid"])]
                if x["ts"] <= p["ts"] <= x["ts"] + x["dur"] and x["name"] in ("sync", "group")
            ]
            assert around, f"flow {fid}: no sync span around {p}"


# ------------------------------------------------------------------ recorded event lists


def two_by_two() -> list:
    """Two pipelines of two stages, a step each: pipeline 0 averages stage 0 in the background while stage 1's
    step goes on; pipeline 1 waits for its group and is paused a while; the scheduler decided round 3."""
    evs = []
    for p in range(2):
        t = 0.1 * p
        evs += [
            span("forward", p, 0, t, t + 0.02, 0, 0),
            span("send", p, 0, t + 0.02, t + 0.03, 0, 0),
            span("recv", p, 1, t + 0.02, t + 0.03, 0, 0),
            span("forward", p, 1, t + 0.03, t + 0.05, 0, 0),
            span("backward", p, 1, t + 0.05, t + 0.08, 0, 0),
            span("send", p, 1, t + 0.08, t + 0.09, 0, 0),
            span("recv", p, 0, t + 0.03, t + 0.09, 0, 0),
            span("backward", p, 0, t + 0.09, t + 0.12, 0, 0),
            span("optimizer", p, 0, t + 0.12, t + 0.13, 0, epoch=0),
            span("optimizer", p, 1, t + 0.09, t + 0.1, 0, epoch=0),
        ]
    evs += [
        events.group(0, 3, [0, 1], "full", 0.2, 0.23, 0.03, True, "sdpipe"),
        span("sync", 0, 0, 0.23, 0.4, group=[0, 1], round=3, reason="full", lane="background"),
        span("wait", 1, 0, 0.23, 0.25, what="group", group=[0, 1], round=3),
        span("sync", 1, 0, 0.25, 0.3, group=[0, 1], round=3, reason="full"),
        span("pause", 1, 1, 0.3, 0.5),
        events.stage_info(0, 0, 0.0, 1000, 10),
    ]
    return evs


def test_every_span_is_one_complete_event_on_its_workers_track(tmp_path):
    """A process per pipeline and one for the group scheduler, a thread per stage and one for an overlapped
    averaging; every span one complete event in microseconds, named by its kind, its category the time
    attribution's, its record's other fields in args."""
    evs = two_by_two()
    trace = load(evs, tmp_path)
    assert trace["displayTimeUnit"] == "ms"
    assert trace["otherData"]["simulated"] is None and trace["otherData"]["records"] == len(evs)
    procs, threads = names(trace)
    assert sorted(procs.values()) == ["group scheduler", "pipeline 0", "pipeline 1"]
    by_proc = defaultdict(list)
    for (pid, _), name in sorted(threads.items()):
        by_proc[procs[pid]].append(name)
    assert by_proc == {
        "pipeline 0": ["stage 0", "stage 0 background", "stage 1"],
        "pipeline 1": ["stage 0", "stage 1"],
        "group scheduler": ["stage 0"],
    }
    sort = {e["pid"]: e["args"]["sort_index"] for e in of(trace, "M") if e["name"] == "process_sort_index"}
    assert sorted(sort, key=sort.get) == sorted(procs, key=lambda p: (procs[p] != "group scheduler", procs[p]))
    assert_spans_match(evs, trace)
    assert_nested(trace)

    (fwd,) = [x for x in of(trace, "X") if x["name"] == "forward" and track(trace, x) == ("pipeline 1", "stage 1")]
    assert (fwd["ts"], fwd["dur"], fwd["cat"], fwd["args"]) == (130000, 20000, "compute", {"step": 0, "microbatch": 0})
    cats = {(x["name"], track(trace, x)[1]): x["cat"] for x in of(trace, "X")}
    assert cats[("recv", "stage 0")] == "bubble" and cats[("wait", "stage 0")] == "group"
    assert cats[("sync", "stage 0 background")] == "background" and cats[("sync", "stage 0")] == "averaging"
    assert cats[("pause", "stage 1")] == "paused" and cats[("optimizer", "stage 0")] == "compute"
    (decision,) = [x for x in of(trace, "X") if x["name"] == "group"]
    assert decision["args"] == {"round": 3, "group": [0, 1], "reason": "full", "wait": 0.03, "connected": True} | {
        "policy": "sdpipe"
    }


def test_spans_that_overlap_in_part_go_on_a_second_thread_and_nested_ones_stay():
    """A viewer draws the complete events of one thread nested: one that outlasts the span it starts in goes on
    the worker's next lane; one inside another, or starting as it ends (after rounding to microseconds too),
    stays."""
    assert _lanes([(0, 10), (2, 4), (8, 12), (10, 11)]) == [0, 0, 1, 0]
    assert _lanes([(0, 5), (1, 6), (2, 7), (6, 8)]) == [0, 1, 2, 0]
    evs = [
        span("forward", 0, 0, 0.0, 1.0),
        span("straggle", 0, 0, 0.2, 0.4, what="slowdown"),  # inside the forward
        span("wait", 0, 0, 0.5, 1.5, what="group", group=[0], round=3),  # outlasts it
        span("send", 0, 0, 1.0, 0.1 + 0.2 + 0.9),  # from the forward's end; 1.2000000000000002
        span("recv", 0, 0, 1.2, 1.3),  # from the send's end, as rounded
        span("sync", 0, 0, 0.3, 0.9, group=[0, 1], round=2, lane="background"),
    ]
    trace = sdpipe.trace_export.chrome_trace(evs)
    assert_nested(trace)
    assert_spans_match(evs, trace)
    where = {x["name"]: track(trace, x)[1] for x in of(trace, "X")}
    assert where == {
        "forward": "stage 0",
        "straggle": "stage 0",
        "wait": "stage 0 (2)",
        "send": "stage 0",
        "recv": "stage 0",
        "sync": "stage 0 background",
    }


def test_the_members_of_a_round_are_linked_by_one_flow(tmp_path):
    """Per stage and round one flow, from the scheduler's decision through every member's sync span (blocking
    or overlapped) in time order; an all-reduce's (no round) per stage and step; a lone member's round none."""
    evs = [
        events.group(1, 7, [0, 2], "full", 12.29, 12.30, 0.01, True, "sdpipe"),
        span("sync", 0, 1, 12.30, 12.34, step=41, group=[0, 2], round=7, reason="full"),
        span("sync", 2, 1, 12.31, 12.34, step=40, group=[0, 2], round=7, reason="full", lane="background"),
        events.group(0, 7, [0, 2], "full", 12.20, 12.25, 0.05, True, "sdpipe"),  # stage 0's own round 7
        span("sync", 0, 0, 12.25, 12.27, step=41, group=[0, 2], round=7, reason="full"),
        span("sync", 2, 0, 12.26, 12.27, step=40, group=[0, 2], round=7, reason="full"),
        events.group(0, 8, [1], "alone", 12.3, 12.4, 0.1, False, "sdpipe"),  # alone: nobody to link
        span("sync", 0, 0, 13.0, 13.1, step=42, group=[0, 1, 2]),  # an all-reduce
        span("sync", 1, 0, 13.05, 13.1, step=42, group=[0, 1, 2]),
        span("sync", 2, 0, 13.02, 13.1, step=42, group=[0, 1, 2]),
    ]
    trace = load(evs, tmp_path)
    assert_flows_bound(trace)
    linked = {points[0]["name"]: [track(trace, p) for p in points] for points in flows(trace).values()}
    assert linked == {
        "stage 1 round 7": [
            ("group scheduler", "stage 1"),
            ("pipeline 0", "stage 1"),
            ("pipeline 2", "stage 1 background"),
        ],
        "stage 0 round 7": [("group scheduler", "stage 0"), ("pipeline 0", "stage 0"), ("pipeline 2", "stage 0")],
        "stage 0 step 42 of 0, 1, 2": [("pipeline 0", "stage 0"), ("pipeline 2", "stage 0"), ("pipeline 1", "stage 0")],
    }
    assert len(flows(trace)) == 3  # one id each
    # the decision at its window's close, each member from its sync's start
    first = flows(trace)[next(k for k, v in flows(trace).items() if v[0]["name"] == "stage 1 round 7")]
    assert [p["ts"] for p in first] == [us(12.30) - 1, us(12.30) + 1, us(12.31) + 1]


def test_controls_epochs_checkpoints_and_lost_workers_are_instants(tmp_path):
    """A control the driver or the service applied marks the whole run, one a worker took its thread; an epoch's
    end its pipeline; a checkpoint the run; a lost worker its thread.  A diverged loss stays JSON."""
    evs = [
        span("forward", 0, 0, 0.0, 0.1),
        events.control("pause", 1.0, applied_by="driver"),
        events.control("policy", 1.5, applied_by="scheduler", policy="allreduce"),
        events.control("policy", 1.6, applied_by="worker", pipeline=1, stage=0, step=5, policy="allreduce"),
        events.control("joined", 1.7, applied_by="driver", pipeline=1, donor=0),
        events.epoch(0, 1, 10, 2.0, {"epoch": 0, "pipeline": 0, "loss": float("nan")}),
        events.checkpoint(1, "/tmp/ckpt/epoch-0001", 2.1),
        events.worker_lost(1, 1, 2.2, "tcp://127.0.0.1:1", "its process died"),
    ]
    trace = load(evs, tmp_path)
    seen = []
    for e in of(trace, "i"):
        where = track(trace, e) if e["s"] == "t" else names(trace)[0][e["pid"]] if e["s"] == "p" else "run"
        seen.append((e["name"], e["cat"], e["s"], e["ts"], where))
        assert ("pid" in e) == (e["s"] != "g") and ("tid" in e) == (e["s"] == "t")
    assert seen == [
        ("pause", "control", "g", 1000000, "run"),
        ("policy", "control", "g", 1500000, "run"),
        ("policy", "control", "t", 1600000, ("pipeline 1", "stage 0")),
        ("joined", "control", "p", 1700000, "pipeline 1"),
        ("epoch 0", "epoch", "p", 2000000, "pipeline 0"),
        ("checkpoint", "checkpoint", "g", 2100000, "run"),
        ("worker-lost", "worker-lost", "t", 2200000, ("pipeline 1", "stage 1")),
    ]
    epoch = next(e for e in of(trace, "i") if e["cat"] == "epoch")
    assert epoch["args"] == {"step": 10, "metrics": {"epoch": 0, "pipeline": 0, "loss": "nan"}}
    assert next(e for e in of(trace, "i") if e["s"] == "t")["args"]["applied_by"] == "worker"


@pytest.mark.parametrize(
    "source, path, message",
    [
        ([], 3, "path: must be a file path (a str or os.PathLike), got int"),
        ([], "{tmp}/missing/trace.json", "path: the folder {tmp}/missing does not exist"),
        ([], "{tmp}", "path: {tmp} is a folder; name a file in it, such as {tmp}/trace.json"),
        ("run", "{tmp}/trace.json", "source: must be a sdpipe.Run, a sdpipe.RunResult or a list of event records"),
    ],
)
def test_bad_input_is_a_one_line_error(tmp_path, source, path, message):
    path = path.format(tmp=tmp_path) if isinstance(path, str) else path
    with pytest.raises(ValueError) as err:
        sdpipe.export_trace(source, path)
    assert str(err.value).startswith(message.format(tmp=tmp_path)) and "\n" not in str(err.value)
    assert not (tmp_path / "trace.json").exists()


# ------------------------------------------------------------------ a simulated run, a real run


def test_a_simulated_runs_trace_matches_its_records(tmp_path):
    """``simulate(...)``'s result exports its spans one for one, its rounds linked, marked simulated."""
    costs = sdpipe.Costs(forward=[0.002, 0.003], backward=[0.004, 0.006], weight_bytes=[4e5, 8e5])
    result = sdpipe.simulate(2, 2, costs=costs, steps=6, epochs=1, policy="sdpipe")
    path = result.export_trace(tmp_path / "sim.json")
    with open(path) as f:
        trace = json.load(f)
    assert trace["otherData"]["simulated"] is True
    assert trace["otherData"]["config"]["policy"] == "sdpipe" and trace["otherData"]["config"]["stages"] == 2
    assert_spans_match(result.events, trace)
    assert_nested(trace)
    assert_flows_bound(trace)
    rounds = {(e["stage"], e["round"]) for e in result.events if e["kind"] == "sync"}
    assert len(flows(trace)) == len(rounds) > 0
    epochs = [e for e in of(trace, "i") if e["cat"] == "epoch"]
    assert len(epochs) == len([e for e in result.events if e["kind"] == "epoch"]) == 2


@pytest.fixture(scope="module")
def real_run(shared_cluster):
    """A 2 x 2 sdpipe run of the digits MLP, one epoch: its handle and its result."""
    run = sdpipe.train(
        digits_mlp(), digits()[0], stages=2, pipelines=2, policy="sdpipe", epochs=1, cluster=shared_cluster
    )
    return run, run.result(timeout=300)


@pytest.mark.cluster
def test_a_real_runs_trace_matches_its_records(real_run, tmp_path):
    """The run's handle and its result export the same trace: its spans one for one, nothing overlapping in part
    on a thread, each round of two linked, an epoch instant per pipeline, the configuration in otherData."""
    run, result = real_run
    trace = load(result, tmp_path)
    live = load(run, tmp_path, "live.json")
    assert live["traceEvents"] == trace["traceEvents"]
    assert trace["otherData"]["simulated"] is False and live["otherData"]["simulated"] is False
    assert trace["otherData"]["config"]["pipelines"] == 2 and trace["otherData"]["config"]["policy"] == "sdpipe"
    procs, threads = names(trace)
    for p in range(2):
        mine = {name for (pid, _), name in threads.items() if procs[pid] == f"pipeline {p}"}
        assert {"stage 0", "stage 1"} <= mine, mine
    assert_spans_match(result.events, trace)
    assert_nested(trace)
    assert_flows_bound(trace)
    points = Counter(  # a round's decision and members, or an all-reduce's members (no round)
        (e["stage"], e["round"]) if e.get("round") is not None else (e["stage"], e["step"], tuple(e["group"]))
        for e in result.events
        if e["kind"] in ("sync", "group")
    )
    assert len(flows(trace)) == sum(1 for n in points.values() if n > 1) > 0
    epochs = [e for e in of(trace, "i") if e["cat"] == "epoch"]
    assert sorted(procs[e["pid"]] for e in epochs) == ["pipeline 0", "pipeline 1"]


# ------------------------------------------------------------------ drawn in a browser

# What the page drew: its row labels in order, the bars per row, the bars' fills by category, whether every bar
# lies inside the plot, the flows and the instants.
DRAWN_JS = """() => {
    const svg = document.getElementById('timeline');
    const rows = Array.from(svg.querySelectorAll('.row-label')).map(t => ({name: t.textContent, row: +t.dataset.row}));
    const bars = {}, fills = {};
    let outside = 0;
    for (const r of svg.querySelectorAll('rect.span')) {
        bars[r.dataset.row] = (bars[r.dataset.row] || 0) + 1;
        (fills[r.dataset.cat] = fills[r.dataset.cat] || new Set()).add(r.getAttribute('fill'));
        const x = +r.getAttribute('x'), w = +r.getAttribute('width');
        if (x < 199 || x + w > svg.width.baseVal.value + 1 || w <= 0) outside++;
    }
    return {rows: rows.map(r => r.name), bars: rows.map(r => bars[r.row] || 0), outside: outside,
            fills: Object.fromEntries(Object.entries(fills).map(([c, s]) => [c, Array.from(s)])),
            processes: Array.from(svg.querySelectorAll('.process-label')).map(t => t.textContent),
            flows: svg.querySelectorAll('polyline.flow').length, instants: svg.querySelectorAll('.instant').length,
            legend: document.getElementById('legend').textContent};
}"""


@pytest.mark.cluster
@pytest.mark.browser
@pytest.mark.skipif(
    not os.path.exists(CHROMIUM), reason=f"needs Chromium at {CHROMIUM} (Debian: apt-get install chromium)"
)
def test_the_trace_of_a_real_run_draws_in_chromium(real_run, tmp_path):
    """tools/trace_view.py's page draws every track as a row, in the trace's order, with each of its spans a bar
    in its category's dashboard colour inside the plot, each round's flow and each instant."""
    _, result = real_run
    trace = load(result, tmp_path)
    page_path = tmp_path / "trace.html"
    page_path.write_text(trace_view.page(trace, "sdpipe trace: digits MLP, 2 stages x 2 pipelines, sdpipe"))
    procs, threads = names(trace)
    sort = {(e["pid"], e.get("tid")): e["args"]["sort_index"] for e in of(trace, "M") if "sort_index" in e["args"]}
    order = sorted(threads, key=lambda t: (sort[(t[0], None)], t[0], sort[t], t[1]))
    spans = Counter((x["pid"], x["tid"]) for x in of(trace, "X"))

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with chromium_page(width=1500, height=400) as page:
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(page_path.as_uri())
        drawn = page.evaluate(DRAWN_JS)
        page.screenshot(path=str(ARTIFACTS / "trace-view.png"), full_page=True)
        # the wheel over the plot's middle zooms in about 20x there: fewer bars, wide enough to be labelled
        box = page.locator("#timeline").bounding_box()
        page.mouse.move(box["x"] + 200 + (box["width"] - 216) / 2, box["y"] + 100)
        page.mouse.wheel(0, -1500)
        page.wait_for_function(f"() => +document.getElementById('timeline').dataset.drawn < {len(of(trace, 'X'))}")
        zoomed = page.evaluate("() => document.querySelectorAll('#timeline .span-text').length")
        page.screenshot(path=str(ARTIFACTS / "trace-view-zoomed.png"), full_page=True)
    assert errors == []
    assert drawn["processes"] == sorted(set(procs.values()), key=lambda n: (n != "group scheduler", n))
    assert drawn["rows"] == [threads[t] for t in order]
    assert drawn["bars"] == [spans[t] for t in order] and sum(drawn["bars"]) == len(of(trace, "X"))
    assert drawn["outside"] == 0
    colors = trace_view.colors()
    assert {c: f for c, f in drawn["fills"].items() if c != "paused"} == {
        c: [colors[c]] for c in drawn["fills"] if c != "paused"
    }
    assert drawn["flows"] == len(flows(trace)) and drawn["instants"] == len(of(trace, "i"))
    assert all(c in drawn["legend"] for c in {x["cat"] for x in of(trace, "X")})
    assert zoomed > 10
