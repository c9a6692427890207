"""Where each worker's time goes, from a run's own records, and whom it waited on.

:func:`attribute` splits every worker's wall time (from its first span to its last, within an optional window
of the run's clock) into

``compute``
    forward, backward and optimizer spans, and an emulated slowdown's or a straggle's sleep (the worker's own,
    slower work; its part is also given apart as ``slowdown``);
``bubble``
    waiting for a neighbour stage of its pipeline: receiving activations or gradients (the transfer included:
    on gloo the two are one call), sending them, and waiting for the step's control message;
``group``
    waiting for its group or collective: the service's answer, an overlapped averaging still running, and the
    part of a blocking averaging (an all-reduce, a group's average) spent waiting for the last member to come;
``averaging``
    the rest of a blocking averaging: the duration of the collective for the member that came last (who waited
    for nobody);
``eval``
    evaluation and checkpoint saves;
``paused``
    the run held by the user;
``other``
    what no span covers (Python between spans, the event loop, bookkeeping).

Spans are laid on the worker's time line with the first of those categories winning where two overlap, so
the shares add up to the wall time exactly.  An overlapped averaging (``lane="background"``) runs beside the
compute in its own thread: it is no share of the wall time, and is given apart (``background``).

Whom it waited on: a receive waits for the neighbour the next span's direction names (a forward's activations
come from the stage before, a backward's gradients from the stage after); the control message from the stage
before; a group's wait for the member that came last (the latest to start its part of the same round or
collective).  :attr:`Attribution.bottleneck` puts it in one sentence: the pipeline the others waited for
longest in groups (a straggler), or the stage its neighbours waited for longest (a heavy stage).

A real run's records (:meth:`sdpipe.Run.attribution`, :meth:`sdpipe.RunResult.attribution`).  A simulated
run's result takes the call too, but its records hold no waits, receives or slowdown sleeps yet: its idle time
shows as ``other``.
"""

from __future__ import annotations

import bisect
import itertools
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

__all__ = ["CATEGORIES", "CATEGORY_OF", "Attribution", "attribute"]

#: the categories of a worker's time, in the order shares are drawn and overlaps resolved (the first one wins)
CATEGORIES = ("paused", "eval", "group", "averaging", "bubble", "compute", "other")

#: a share of the others' time below which nobody is named the bottleneck
NAMED_ABOVE = 0.05
#: a stage is named the bottleneck of every pipeline when its least score is at least this share of its greatest
STAGE_EVERYWHERE = 0.5

#: a span's kind -> its category (a ``wait`` or ``sync`` is ``group``, ``bubble`` or ``averaging`` by its fields)
CATEGORY_OF = {
    "forward": "compute",
    "backward": "compute",
    "optimizer": "compute",
    "straggle": "compute",
    "recv": "bubble",
    "send": "bubble",
    "pause": "paused",
    "eval": "eval",
    "save": "eval",
}
_RANK = {c: i for i, c in enumerate(CATEGORIES)}


@dataclass
class Attribution:
    """Every worker's time by category (:data:`CATEGORIES`), per stage the spread, and the bottleneck.

    ``workers``: one dict per worker, ``pipeline``, ``stage``, ``wall`` (seconds), each category's seconds,
    ``slowdown`` (seconds of emulated slowdown and straggles, inside ``compute``), ``background`` (overlapped
    averaging beside it), ``waited_on``: ``{(pipeline, stage): seconds}`` it waited for each other worker, and
    ``start`` and ``end``: the first and last instant of its spans in the window (``wall`` is the time between)."""

    workers: list
    bottleneck: str
    named: Optional[dict] = None  # {"pipeline" or "stage": id, "share": of the others' time, "how": "group"|"bubble"}
    window: tuple = field(default=(None, None))
    path: list = field(default_factory=list)
    """The critical path: the chain of work the window's last step waited on, back to the window's start,
    ``(pipeline, stage, category, start, end)`` in time order (see :meth:`on_path`)."""

    @classmethod
    def merge(cls, parts: list) -> "Attribution":
        """The attribution of the windows of ``parts`` together: each an :class:`Attribution` of the same run's
        records over its own window, the windows one after the other without overlapping (slices of the run's
        clock).  Per worker its seconds by category, ``wall``, ``slowdown``, ``background`` and ``waited_on`` are
        summed, the time between its last span in one part and its first in the next (no span covered it) is
        added to its ``other`` and ``wall``, and the bottleneck is found on the sums::

            attribute(events, 0, 2)   compute 1.2 s   wall 1.9 s (its spans from 0.1 to 2.0)
            attribute(events, 2, 4)   compute 1.1 s   wall 1.8 s (from 2.1 to 3.9)
            merge of the two          compute 2.3 s   wall 3.8 s, the 0.1 s from 2.0 to 2.1 in other

        That is what :func:`attribute` finds over the whole window (``since`` of the first part, ``until`` of the
        last) when each part was attributed with every record of a span that crosses its window, and those of
        the collectives around it (a sync is split where the last member came, then clipped); a span missing
        from a part's records is missing from the merge.  A merge has no critical path (it walks back from the
        window's end: attribute the whole window for it)."""
        by_worker = defaultdict(list)
        for part in parts:
            for w in part.workers:
                by_worker[(w["pipeline"], w["stage"])].append(w)
        workers = []
        for (p, s), ws in sorted(by_worker.items()):
            timed = sorted((w for w in ws if w["start"] is not None), key=lambda w: w["start"])
            if not timed:  # overlapped averaging only: no share of any wall time
                continue
            out = {"pipeline": p, "stage": s, **{c: sum(w[c] for w in timed) for c in CATEGORIES}}
            between = sum(max(0.0, b["start"] - a["end"]) for a, b in itertools.pairwise(timed))
            out["other"] += between
            waited = defaultdict(float)
            for w in timed:
                for k, v in w["waited_on"].items():
                    waited[k] += v
            workers.append(
                out
                | {
                    "wall": sum(w["wall"] for w in timed) + between,
                    "slowdown": sum(w["slowdown"] for w in timed),
                    "background": sum(w["background"] for w in ws),
                    "waited_on": dict(waited),
                    "start": timed[0]["start"],
                    "end": timed[-1]["end"],
                }
            )
        named, sentence = _bottleneck(workers)
        windows = [part.window for part in parts]
        since = min((a for a, _ in windows if a is not None), default=None)
        until = max((b for _, b in windows if b is not None), default=None)
        return cls(workers, sentence, named, (since, until))

    def on_path(self) -> list:
        """The critical path's seconds per worker and category, the most first:
        ``[((pipeline, stage, category), seconds, share of the path)]``."""
        total = defaultdict(float)
        for p, s, cat, a, b in self.path:
            total[(p, s, cat)] += b - a
        length = sum(total.values())
        return [(k, v, v / length) for k, v in sorted(total.items(), key=lambda kv: -kv[1])] if length else []

    def share(self, pipeline: int, stage: int, category: str) -> float:
        """One worker's share of its wall time in ``category``."""
        for w in self.workers:
            if (w["pipeline"], w["stage"]) == (pipeline, stage):
                return w[category] / w["wall"] if w["wall"] > 0 else 0.0
        raise KeyError(f"worker: no records of pipeline {pipeline} stage {stage}")

    def per_stage(self) -> list:
        """Per stage and category: the minimum, median and maximum share over its workers."""
        out = []
        for s in sorted({w["stage"] for w in self.workers}):
            ws = [w for w in self.workers if w["stage"] == s and w["wall"] > 0]
            row = {"stage": s}
            for c in CATEGORIES:
                xs = [w[c] / w["wall"] for w in ws]
                row[c] = (min(xs), statistics.median(xs), max(xs)) if xs else (0.0, 0.0, 0.0)
            out.append(row)
        return out

    def table(self) -> str:
        """Every worker's shares as a text table (what a notebook prints), the bottleneck under it."""
        cols = [c for c in CATEGORIES if any(w[c] > 0 for w in self.workers)]
        head = f"{'pipeline':>8} {'stage':>5} {'wall s':>7} " + " ".join(f"{c:>9}" for c in cols)
        lines = [head]
        for w in sorted(self.workers, key=lambda w: (w["pipeline"], w["stage"])):
            shares = " ".join(f"{w[c] / w['wall'] if w['wall'] else 0:>9.1%}" for c in cols)
            lines.append(f"{w['pipeline']:>8} {w['stage']:>5} {w['wall']:>7.2f} {shares}")
        top = self.on_path()[:3]
        path = (
            "critical path: " + ", ".join(f"pipeline {p} stage {s} {cat} {share:.0%}" for (p, s, cat), _, share in top)
            if top
            else ""
        )
        return "\n".join([*lines, "", self.bottleneck, *([path] if path else [])])

    def __str__(self) -> str:
        return self.table()

    def _repr_pretty_(self, p, cycle) -> None:  # IPython
        p.text(self.table())


def _collective(e: dict) -> tuple:
    """The round or collective a sync or group wait belongs to: (stage, round) when the service named one, else
    the stage, step and members (an all-reduce of one step)."""
    if e.get("round") is not None:
        return (e["stage"], "round", e["round"])
    return (e["stage"], "step", e["step"], tuple(e.get("group") or ()))


def attribute(
    events: list, since: Optional[float] = None, until: Optional[float] = None, *, part: bool = False
) -> Attribution:
    """Attribute every worker's time in ``events`` (a run's records) between ``since`` and ``until`` (seconds on
    the run's clock; None: from each worker's first span, to its last).  See the module docstring.  ``part``: the
    window is a part of a longer one, for :meth:`Attribution.merge`: no critical path is walked, and a worker
    whose only spans in it are overlapped averaging keeps its row (``wall`` 0; its ``background`` counts in the
    merge)."""
    spans = defaultdict(list)
    for e in events:
        p, s = e.get("pipeline"), e.get("stage")
        if p is None or s is None or e.get("start") is None or e["end"] <= e["start"]:
            continue
        if e["kind"] in CATEGORY_OF or e["kind"] in ("wait", "sync"):
            spans[(p, s)].append(e)
    # a blocking averaging: the last member to come waited for nobody; the others waited for it.  A round's or
    # collective's waits and syncs, to find who came last
    members, group_waits = defaultdict(list), defaultdict(list)
    for key, es in spans.items():
        for e in es:
            kind = e["kind"]
            if kind == "sync" or (kind == "wait" and e.get("what") in ("group", "drain")):
                c = _collective(e)
                group_waits[c].append((e["start"], key))
                if kind == "sync" and e.get("lane") != "background":
                    members[c].append((e, key))
    last_in = {}
    for c, ms in members.items():
        last = max(ms, key=lambda m: m[0]["start"])
        last_in[c] = (last[1], last[0]["end"] - last[0]["start"])
    workers = []
    ordered = {key: sorted(es, key=lambda e: e["start"]) for key, es in sorted(spans.items())}
    for key, es in ordered.items():
        workers.append(_one(key, es, since, until, last_in, group_waits))
    workers = [w for w in workers if w["wall"] > 0 or (part and w["background"] > 0)]
    named, sentence = _bottleneck([w for w in workers if w["wall"] > 0])
    path = [] if part else _critical_path(ordered, since, until, last_in, group_waits)
    return Attribution(workers, sentence, named, (since, until), path)


def _ahead(es: list) -> list:
    """Per span of one worker (in start order): the kind of the next forward or backward after it (which way a
    receive's data came: a forward's activations from the stage before, a backward's gradients from the one
    after)."""
    ahead, nxt = [], "forward"
    for e in reversed(es):
        ahead.append(nxt)
        if e["kind"] in ("forward", "backward"):
            nxt = e["kind"]
    ahead.reverse()
    return ahead


def _behind(es: list) -> list:
    """Per span of one worker (in start order): the kind of the last forward or backward before it (which way its
    sends went)."""
    behind, last = [], "forward"
    for e in es:
        behind.append(last)
        if e["kind"] in ("forward", "backward"):
            last = e["kind"]
    return behind


def _sent_to(e: dict, p: int, s: int, before: str) -> tuple:
    """Whom a ``wait`` without a group waited on: for its sends (``what="sends"``) the stage its last compute
    sent to (after a forward the next stage, after a backward the one before); else the stage before, for the
    step's control message."""
    if e.get("what") == "sends":
        return (p, s + 1 if before == "forward" else s - 1)
    return (p, s - 1)


def _critical_path(ordered: dict, since, until, last_in, group_waits) -> list:
    """The chain of work the window's last step waited on, walked back from the latest span's end: on a worker,
    its span before the time reached (a gap: ``other``); a receive jumps to the neighbour it waited for, the
    control message's wait to the stage before, a group's wait or a blocking averaging's wait to the member
    that came last; until the window's start.  ``[(pipeline, stage, category, start, end)]`` in time order."""
    lanes = {k: [e for e in es if e.get("lane") != "background"] for k, es in ordered.items()}
    lanes = {k: v for k, v in lanes.items() if v}
    if not lanes:
        return []
    starts = {k: [e["start"] for e in es] for k, es in lanes.items()}
    ahead = {k: _ahead(es) for k, es in lanes.items()}
    ends = [(es[-1]["end"], k) for k, es in lanes.items()]
    t, key = max(ends) if until is None else max((min(e, until), k) for e, k in ends)
    lo = since if since is not None else min(es[0]["start"] for es in lanes.values())
    path, seen = [], set()
    while t > lo and len(path) < 1_000_000:
        i = bisect.bisect_left(starts[key], t) - 1
        if i < 0:
            break
        e = lanes[key][i]
        if e["end"] < t:  # nothing recorded between its end and t
            path.append((*key, "other", max(e["end"], lo), t))
            t = e["end"]
            continue
        kind, (p, s) = e["kind"], key
        jump = None
        if kind == "recv":
            jump = (p, s - 1 if ahead[key][i] == "forward" else s + 1)
            cat = "bubble"
        elif kind == "wait" and e.get("what") in ("group", "drain"):
            others = [m for m in group_waits.get(_collective(e), []) if m[1] != key]
            jump, cat = (max(others)[1] if others else None), "group"
        elif kind == "wait" and e.get("what") == "sends":  # ends as the receiver posts its receive: no lead
            jump, cat = None, "bubble"
        elif kind == "wait":  # the control message from the stage before
            jump, cat = (p, s - 1), "bubble"
        elif kind == "sync":
            last, pure = last_in.get(_collective(e), (key, t - e["start"]))
            if last != key and t - e["start"] > pure:  # it waited for the last member, then averaged
                path.append((*key, "averaging", max(t - pure, lo), t))
                t, jump, cat = t - pure, last, "group"
            else:
                jump, cat = None, "averaging"
        else:
            cat = CATEGORY_OF[kind]
        if jump is not None and jump in lanes and (jump, t) not in seen:
            seen.add((jump, t))
            key = jump
            continue
        path.append((*key, cat, max(e["start"], lo), t))
        t = e["start"]
    path.reverse()
    return [x for x in path if x[4] > x[3]]


def _one(key, es, since, until, last_in, group_waits) -> dict:
    """One worker: its categories by a sweep over its spans (clipped to the window), and whom it waited on."""
    p, s = key
    pieces = []  # (start, end, category)
    waited = defaultdict(float)
    slowdown = background = 0.0
    ahead, behind = _ahead(es), _behind(es)
    for i, e in enumerate(es):
        a, b = e["start"], e["end"]
        if since is not None:
            a = max(a, since)
        if until is not None:
            b = min(b, until)
        if b <= a:
            continue
        kind = e["kind"]
        if kind == "sync":
            if e.get("lane") == "background":
                background += b - a
                continue
            # the whole span splits (the wait for the last member, then the averaging), then each part is clipped:
            # a window's edge through a sync cuts the parts where they lie, not the averaging off its clipped end
            last, pure = last_in.get(_collective(e), (key, e["end"] - e["start"]))
            split = e["end"] - min(pure, e["end"] - e["start"]) if last != key else e["start"]
            if min(split, b) > a:
                pieces.append((a, min(split, b), "group"))
                waited[last] += min(split, b) - a
            if b > max(a, split):
                pieces.append((max(a, split), b, "averaging"))
            continue
        if kind == "wait":
            if e.get("what") in ("group", "drain"):
                pieces.append((a, b, "group"))
                others = [m for m in group_waits.get(_collective(e), []) if m[1] != key]
                if others:
                    waited[max(others)[1]] += b - a
            else:  # its sends to be received, or the control message from the stage before
                pieces.append((a, b, "bubble"))
                waited[_sent_to(e, p, s, behind[i])] += b - a
            continue
        cat = CATEGORY_OF[kind]
        pieces.append((a, b, cat))
        if kind == "straggle":
            slowdown += b - a
        elif kind == "recv":
            waited[(p, s - 1 if ahead[i] == "forward" else s + 1)] += b - a
    out = {"pipeline": p, "stage": s, **dict.fromkeys(CATEGORIES, 0.0)}
    if not pieces:
        return out | {
            "wall": 0.0,
            "slowdown": 0.0,
            "background": background,
            "waited_on": {},
            "start": None,
            "end": None,
        }
    start, end = min(x[0] for x in pieces), max(x[1] for x in pieces)
    # the sweep: at every instant the first category (CATEGORIES' order) of the spans covering it
    cuts = sorted({x[0] for x in pieces} | {x[1] for x in pieces})
    by_start = sorted(pieces)
    active, j = [], 0
    for t0, t1 in itertools.pairwise(cuts):
        while j < len(by_start) and by_start[j][0] <= t0:
            active.append(by_start[j])
            j += 1
        active = [x for x in active if x[1] > t0]
        if active:
            out[min(active, key=lambda x: _RANK[x[2]])[2]] += t1 - t0
        else:
            out["other"] += t1 - t0
    return out | {
        "wall": end - start,
        "slowdown": slowdown,
        "background": background,
        "waited_on": {k: v for k, v in waited.items() if k != key},
        "start": start,
        "end": end,
    }


def _waits_on(ws: list, key) -> float:
    """The share of ``ws``'s wall time spent waiting on the workers ``key(w, (pipeline, stage))`` picks."""
    wall = sum(w["wall"] for w in ws)
    return sum(v for w in ws for k, v in w["waited_on"].items() if key(w, k)) / wall if wall else 0.0


def _own(ws: list, category: str) -> float:
    wall = sum(w["wall"] for w in ws)
    return sum(w[category] for w in ws) / wall if wall else 0.0


def _bottleneck(workers: list) -> tuple:
    """Who holds the others back, scored by the others' share of time waiting on it less its own share of such
    waits (where a pipeline's stages all wait for each other's hand-offs, none is the slow one): a pipeline the
    other pipelines wait for in groups (a straggler); in each pipeline, the stage its other stages wait for; a
    stage that is that one in every pipeline (a heavy stage).  The best score above :data:`NAMED_ABOVE` is
    named, with the others' waits in groups when it is one pipeline's stage."""
    if not workers:
        return None, "no worker's spans recorded yet"
    pipelines = sorted({w["pipeline"] for w in workers})
    candidates = []
    group_share = {}
    for p in pipelines:
        others = [w for w in workers if w["pipeline"] != p]
        on = _waits_on(others, lambda w, k, p=p: k == (p, w["stage"]))
        group_share[p] = on
        if len(pipelines) > 1:
            mine = [w for w in workers if w["pipeline"] == p]
            candidates.append({"pipeline": p, "share": on, "score": on - _own(mine, "group"), "how": "group"})
    slowest = {}  # per pipeline, the stage its other stages wait for most (net of its own waits)
    for p in pipelines:
        best = None
        for s in sorted({w["stage"] for w in workers if w["pipeline"] == p}):
            others = [w for w in workers if w["pipeline"] == p and w["stage"] != s]
            if not others:
                continue
            on = _waits_on(others, lambda w, k, s=s: k == (w["pipeline"], s))
            me = [w for w in workers if (w["pipeline"], w["stage"]) == (p, s)]
            c = {"pipeline": p, "stage": s, "share": on, "score": on - _own(me, "bubble"), "how": "bubble"}
            if best is None or c["score"] > best["score"]:
                best = c
        if best is not None:
            slowest[p] = best
            candidates.append(best | {"groups": group_share[p]})
    stages = {c["stage"] for c in slowest.values()}
    if len(pipelines) > 1 and len(slowest) == len(pipelines) and len(stages) == 1:
        scores = [c["score"] for c in slowest.values()]
        # the same stage in every pipeline, about as slow in each (not one pipeline's straggler whose stage the
        # others' match by a little): it takes the place of its pipelines' candidates, at the best one's score
        if min(scores) >= NAMED_ABOVE and min(scores) >= STAGE_EVERYWHERE * max(scores):
            (s,) = stages
            share = statistics.mean(c["share"] for c in slowest.values())
            candidates = [c for c in candidates if c["how"] != "bubble"]
            candidates.append({"stage": s, "share": share, "score": max(scores) + 1e-9, "how": "stage"})
    total = {c: sum(w[c] for w in workers) for c in CATEGORIES}
    wall = sum(w["wall"] for w in workers)
    if not candidates or max(c["score"] for c in candidates) < NAMED_ABOVE:
        main = max(CATEGORIES, key=lambda c: total[c])
        waiting = (total["group"] + total["bubble"]) / wall
        return None, (
            f"no worker holds the others back; the workers wait {_pct(waiting)} of their time for each other "
            f"(pipeline hand-offs {_pct(total['bubble'] / wall)}, groups {_pct(total['group'] / wall)}), "
            f"and the largest share is {main} ({_pct(total[main] / wall)})"
        )
    named = max(candidates, key=lambda c: c["score"])
    if named["how"] == "group":
        return named, (
            f"pipeline {named['pipeline']} is the straggler: the other pipelines wait {_pct(named['share'])} of their "
            "time in groups that include it"
        )
    if named["how"] == "stage":
        return named, (
            f"stage {named['stage']} is the bottleneck: in every pipeline the other stages wait {_pct(named['share'])} "
            "of their time for its activations or gradients"
        )
    groups = (
        f"; the other pipelines wait {_pct(named['groups'])} of their time in groups that include it"
        if len(pipelines) > 1
        else ""
    )
    return named, (
        f"pipeline {named['pipeline']} is slow at stage {named['stage']}: its other stages wait "
        f"{_pct(named['share'])} of their time for it{groups}"
    )


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"
