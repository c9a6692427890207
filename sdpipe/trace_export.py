"""A run's records as a Chrome trace: one timeline in Perfetto (ui.perfetto.dev) or chrome://tracing.

:func:`export_trace` writes a live :class:`~sdpipe.Run`'s records so far, a finished or simulated run's
:class:`~sdpipe.RunResult`, or a list of records, in the Trace Event Format's JSON object form::

    {"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {"config": {...}, "simulated": false, ...}}

Where each record goes (:func:`chrome_trace` builds it, no I/O)::

    pipeline p          a process, with a thread per stage ("stage s"): every span of work (forward, backward,
                        send, recv, optimizer, sync, wait, straggle, eval, pause, save) is one complete event
                        (ph "X") named by its kind, ``cat`` its time category (sdpipe.attribution: compute, bubble,
                        group, averaging, eval, paused), ``args`` the record's other fields (step, microbatch,
                        group, round, reason, ...)
    stage s background  a thread of the pipeline's for its worker's overlapped averaging (``lane="background"``,
                        ``cat`` "background"), which runs beside the worker's next steps
    group scheduler     a process, with a thread per stage: each group decision (a ``group`` record) as a span
                        from its window's opening to its closing

A viewer nests the complete events of one thread and cannot draw two that overlap in part, so a span that
overlaps another in part goes on a second thread of its worker ("stage s (2)"); spans that nest stay together.
Times are the records' seconds on the run's clock (simulated seconds in a simulated run) in whole microseconds,
so every span's start and end round the same way and the order of any two ends is kept.

The members of one round are linked: a flow (ph "s", "t", "f", ``bp: "e"``) from the scheduler's decision (at
its window's close) through each member's sync span (from its start), in time order, one flow id per stage and
round (an all-reduce's, which has no round: per stage, step and members).  For example, stage 1's round 7 of
pipelines 0 and 2, decided at 12.30 s::

    group scheduler / stage 1      [group 12.29-12.30]s
    pipeline 0 / stage 1                              t[sync 12.30-12.34]
    pipeline 2 / stage 1 background                      f[sync 12.31-12.34]

Moments are instant events (ph "i"): a control (pause, resume, stop, policy, heterogeneity, ...) over the whole
run (scope "g") when the driver or the service applied it, on the worker's thread ("t") when a worker took it;
an epoch's end over its pipeline's process ("p"); a checkpoint over the run; a lost worker and a worker's
``stage`` description on its thread.
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from pathlib import Path

from sdpipe.attribution import CATEGORY_OF
from sdpipe.driver.result import RunResult, plain_config
from sdpipe.driver.run import Run

__all__ = ["SPANS", "chrome_trace", "export_trace"]

#: the kinds of record that are spans of one worker's work (every other kind but ``group`` is a moment)
SPANS = ("forward", "backward", "send", "recv", "optimizer", "sync", "wait", "straggle", "eval", "pause", "save")

_FIELDS = ("kind", "pipeline", "stage", "start", "end")  # what a track, a name and ts/dur already say


def export_trace(source, path) -> str:
    """Write ``source``'s records as Chrome trace JSON to ``path`` (see the module docstring); the path written.

    ``source``: a :class:`~sdpipe.Run` (its records so far), a :class:`~sdpipe.RunResult` (a real or simulated
    run's) or a list of event records.  ``otherData`` holds the run's configuration and whether it was simulated
    (None for a bare list).  Open the file in ui.perfetto.dev or chrome://tracing::

        result = sdpipe.simulate(2, 2, costs=sdpipe.Costs(forward=[0.002] * 2, backward=[0.004] * 2))
        sdpipe.export_trace(result, "sim.json")  # or result.export_trace("sim.json")
    """
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path: must be a file path (a str or os.PathLike), got {type(path).__name__}")
    target = Path(os.fspath(path)).expanduser()
    if target.is_dir():
        raise ValueError(f"path: {target} is a folder; name a file in it, such as {target / 'trace.json'}")
    if not target.parent.is_dir():
        raise ValueError(f"path: the folder {target.parent} does not exist")
    if isinstance(source, RunResult):
        trace = chrome_trace(source.events, config=plain_config(source.config), simulated=source.simulated)
    elif isinstance(source, (list, tuple)):
        trace = chrome_trace(source)
    elif isinstance(source, Run):
        trace = chrome_trace(source.events, config=plain_config(source.config), simulated=False)
    else:
        raise ValueError(
            f"source: must be a sdpipe.Run, a sdpipe.RunResult or a list of event records, got {type(source).__name__}"
        )
    with open(target, "w") as f:
        json.dump(trace, f, separators=(",", ":"))
    return str(target)


def chrome_trace(events: list, *, config=None, simulated=None) -> dict:
    """The trace of ``events`` (a run's records) as a dict in the Trace Event Format, ``config`` (a plain dict) and
    ``simulated`` in its ``otherData``.  Pure: :func:`export_trace` writes it."""
    us = lambda t: round(t * 1e6)  # monotone: rounding keeps every order of starts and ends
    pipelines = sorted({e["pipeline"] for e in events if e.get("pipeline") is not None})
    scheduler = pipelines[-1] + 2 if pipelines else 1  # pid 0 is Perfetto's idle process: pipeline p is pid p + 1

    # tracks (pid, stage, background, lane): every worker that left a record has its stage's thread, and its
    # spans (the scheduler's decisions, per stage) are laid out in lanes
    tracks = {(e["pipeline"] + 1, e["stage"], False, 0) for e in events if _worker(e)}
    laid_out = defaultdict(list)  # (pid, stage, background) -> its spans
    for e in events:
        if e["kind"] in SPANS:
            laid_out[(e["pipeline"] + 1, e["stage"], e.get("lane") == "background")].append(e)
        elif e["kind"] == "group":
            laid_out[(scheduler, e["stage"], False)].append(e)
    track_of = {}  # id(record) -> its track
    for key, spans in laid_out.items():
        for e, lane in zip(spans, _lanes([(us(e["start"]), us(e["end"])) for e in spans]), strict=True):
            track_of[id(e)] = (*key, lane)
            tracks.add((*key, lane))
    tid = {t: scheduler + 1 + i for i, t in enumerate(sorted(tracks))}  # tids apart from every pid

    out = []
    for pid in sorted({p + 1 for p in pipelines} | {t[0] for t in tracks}):
        name, order = ("group scheduler", -1) if pid == scheduler else (f"pipeline {pid - 1}", pid)
        out += [_meta("process_name", pid, name=name), _meta("process_sort_index", pid, sort_index=order)]
    for (pid, stage, background, lane), i in tid.items():
        name = f"stage {stage}" + (" background" if background else "") + (f" ({lane + 1})" if lane else "")
        out += [_meta("thread_name", pid, i, name=name), _meta("thread_sort_index", pid, i, sort_index=i)]

    spans, rounds = [], defaultdict(list)  # rounds: a flow's name -> its points (ts, pid, tid)
    for e in events:
        if id(e) not in track_of:
            continue
        pid, i = track_of[id(e)][0], tid[track_of[id(e)]]
        a, b = us(e["start"]), us(e["end"])
        spans.append({"name": e["kind"], "cat": _category(e), "ph": "X", "ts": a, "dur": b - a, "pid": pid, "tid": i})
        spans[-1]["args"] = _args(e)
        if e["kind"] in ("sync", "group"):  # a decision at its window's close, a member's sync from its start
            inside = 1 if b - a >= 2 else 0  # inside the span: a viewer binds the point to the span around it
            rounds[_round(e)].append((b - inside if e["kind"] == "group" else a + inside, pid, i))
    out += sorted(spans, key=lambda x: (x["pid"], x["tid"], x["ts"], -x["dur"]))
    out += _flows(rounds)

    for e in events:
        if id(e) in track_of:
            continue
        scope = _scope(e)
        instant = {"name": _name(e), "cat": e["kind"], "ph": "i", "s": scope, "ts": us(e["start"])}
        if scope != "g":
            instant["pid"] = e["pipeline"] + 1
        if scope == "t":
            instant["tid"] = tid[(e["pipeline"] + 1, e["stage"], False, 0)]
        out.append(instant | {"args": _args(e)})

    clock = "simulated seconds" if simulated else "seconds since the run's launch"
    return {
        "traceEvents": out,
        "displayTimeUnit": "ms",
        "otherData": {
            "producer": "sdpipe",
            "clock": f"ts and dur: microseconds on the records' clock ({clock})",
            "simulated": simulated,
            "records": len(events),
            "config": _plain(config),
        },
    }


def _worker(e: dict) -> bool:
    """A record of one worker (both its pipeline and stage named)."""
    return e.get("pipeline") is not None and e.get("stage") is not None


def _lanes(spans: list) -> list:
    """Per span ``(start, end)``, its lane: the first whose spans it either follows or nests in, so that no two
    spans of one lane overlap in part.  For example ``[(0, 10), (2, 4), (8, 12), (10, 11)]`` -> ``[0, 0, 1, 0]``:
    (2, 4) nests in (0, 10), (8, 12) outlasts it, (10, 11) starts as it ends."""
    order = sorted(range(len(spans)), key=lambda i: (spans[i][0], -spans[i][1]))
    stacks, lanes = [], [0] * len(spans)  # per lane, the ends of its spans still open at the current start
    for i in order:
        a, b = spans[i]
        for stack in stacks:
            while stack and stack[-1] <= a:
                stack.pop()
        k = next((k for k, stack in enumerate(stacks) if not stack or b <= stack[-1]), len(stacks))
        if k == len(stacks):
            stacks.append([])
        stacks[k].append(b)
        lanes[i] = k
    return lanes


def _category(e: dict) -> str:
    """A span's time category (:data:`sdpipe.attribution.CATEGORIES`; "background" for an overlapped averaging)."""
    kind = e["kind"]
    if kind == "sync":
        return "background" if e.get("lane") == "background" else "averaging"
    if kind == "wait":
        return "group" if e.get("what") in ("group", "drain") else "bubble"
    return "group" if kind == "group" else CATEGORY_OF[kind]


def _round(e: dict) -> str:
    """The flow a sync span or a group decision belongs to, by name: its stage's round, or (an all-reduce has no
    round) its stage, step and members."""
    if e.get("round") is not None:
        return f"stage {e['stage']} round {e['round']}"
    return f"stage {e['stage']} step {e['step']} of {', '.join(map(str, e['group']))}"


def _flows(rounds: dict) -> list:
    """One flow per round of two points or more: it starts at the first in time, steps through the next and ends
    at the last (each bound to the span around it: ``bp: "e"``)."""
    out, flow_id = [], 0
    for name, points in rounds.items():
        if len(points) < 2:
            continue
        flow_id += 1
        points.sort()
        for i, (ts, pid, tid) in enumerate(points):
            ph = "s" if i == 0 else "f" if i == len(points) - 1 else "t"
            out.append(
                {"name": name, "cat": "round", "ph": ph, "id": flow_id, "bp": "e", "ts": ts, "pid": pid, "tid": tid}
            )
    return out


def _name(e: dict) -> str:
    """A moment's name: a control's change (pause, policy, ...), the epoch that ended, else its kind."""
    if e["kind"] == "control":
        return e["what"]
    return f"epoch {e['metrics']['epoch']}" if e["kind"] == "epoch" else e["kind"]


def _scope(e: dict) -> str:
    """An instant's scope: its pipeline's process for an epoch; its worker's thread when it names one; its pipeline
    when it names that only; else the whole run."""
    if e["kind"] == "epoch" or (e.get("pipeline") is not None and e.get("stage") is None):
        return "p"
    return "t" if _worker(e) else "g"


def _args(e: dict) -> dict:
    return {k: _plain(v) for k, v in e.items() if k not in _FIELDS and v is not None}


def _plain(v):
    """``v`` as JSON data a browser parses: a NaN or infinite number (a diverged loss) as a string."""
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def _meta(what: str, pid: int, tid=None, **args) -> dict:
    """A metadata event: a process's or thread's name or sort index."""
    event = {"name": what, "ph": "M", "pid": pid, "args": args}
    return event if tid is None else event | {"tid": tid}
