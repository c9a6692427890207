"""What the dashboard shows, computed from a run's event records (no widgets, no plotting).

:class:`RunView` takes event records as they arrive (``run.events_since``) or
all at once (a finished run's ``result.events``) and keeps, in bounded memory:

* the recent spans of every worker for the timeline, and for the time
  attribution (:mod:`sdpipe.attribution`) of a live run its last
  ``attribution_window`` seconds as slices of ``SLICE`` seconds, each
  attributed once, ``LAG`` seconds after it ended, and summed
  (:meth:`~sdpipe.attribution.Attribution.merge`): only the records the next
  slices need are kept, so long runs stay fast (a replay keeps every span
  record and attributes the whole run);
* the recent group formations per stage, the distribution of group sizes and
  when graph syncs happened;
* per-worker step and compute times for straggler detection, and the run's
  samples/s against the ideal: over each pipeline's last steps, the same
  steps without the time any of its stages was held by synchronization
  (averaging, group waits), so the ratio cannot exceed 1 and says what
  synchronizing cost; its spread over blocks of those steps is shown with it;
* loss per step and metrics per epoch per pipeline;
* the control changes (policy, heterogeneity, pause) with their times, the
  live switches of policy and heterogeneity, the pauses, and the epoch records
  (what the dashboard's what-if panel sets its predictions against).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections import Counter, defaultdict, deque
from typing import Optional

from sdpipe.attribution import Attribution, attribute
from sdpipe.wire.events import membership

__all__ = ["CATEGORIES", "LAG", "SLICE", "RunView", "category"]

#: seconds of the run's clock one slice of a live run's time attribution covers (each is attributed once)
SLICE = 2.0
#: seconds (on the run's clock, as its records tell it) a slice waits after its end before it is attributed: a
#: record travels when its span ends (a worker sends its records every 0.1 s, with its next one), so the records of
#: a slice's spans have arrived by then.  A span longer than this, or a record its worker held behind one, arrives
#: after: the part of it in slices attributed before is cut (there its worker's time shows as ``other``, or not at
#: all).  A pause is waited out: a slice the run was paused at its end is attributed this long after the resume.
LAG = 3.0
#: seconds of records before a slice attributed with it: the other members of a collective that crosses its start
CONTEXT = 1.0
#: what a finished run's status is (its last slices are attributed at once: every record has arrived)
_ENDED = ("finished", "stopped", "error")

#: timeline categories, in drawing order
CATEGORIES = ("compute", "communication", "synchronization", "waiting", "eval")  # "eval" also holds checkpoint saves

_KIND_CATEGORY = {
    "forward": "compute",
    "backward": "compute",
    "optimizer": "compute",
    "send": "communication",
    "recv": "communication",
    "sync": "synchronization",
    "wait": "waiting",
    "straggle": "compute",  # an emulated slowdown's or straggle's extra time: the worker's own (slower) work
    "pause": "waiting",
    "eval": "eval",
    "save": "eval",
}


def shaping_text(limits: dict) -> str:
    """A host's kernel-enforced limits in a few words: "link 1.0 MB/s, cpu 0.25 cores" (or "no limit")."""
    parts = []
    if limits.get("bandwidth"):
        parts.append(f"link {limits['bandwidth'] / 1e6:.3g} MB/s")
    if limits.get("cpu"):
        parts.append(f"cpu {limits['cpu']:g} cores")
    return ", ".join(parts) or "no limit"


def emulated_text(h) -> str:
    """The slept heterogeneity (a Heterogeneity's dict) in a few words, or "" when there is none."""
    if not h:
        return ""

    def name(k) -> str:  # keys as Heterogeneity.to_dict writes them: "3" (a pipeline) or "3,1" (pipeline, stage)
        p, _, st = str(k).partition(",")
        return f"p{p} s{st}" if st else f"pipeline {p}"

    parts = [f"{name(k)} steps x{x:g}" for k, x in (h.get("slowdown") or {}).items() if x > 1.0]
    parts += [f"{name(k)} compute x{x:g}" for k, x in (h.get("compute_slowdown") or {}).items() if x > 1.0]
    parts += [f"{name(k)} link +{d:g} s" for k, d in (h.get("link_delay") or {}).items() if d > 0]
    if h.get("straggle_prob") and h.get("straggle_delay"):
        parts.append(f"straggles p {h['straggle_prob']:g} of {h['straggle_delay']:g} s")
    return ", ".join(parts)


def heterogeneity_text(emulated, shaped: dict) -> str:
    """One line: the slept heterogeneity ``emulated`` (a Heterogeneity's dict) and the kernel-shaped hosts (host
    address -> its last "shaped" control record), or "none"."""
    parts = []
    slept = emulated_text(emulated)
    if slept:
        parts.append(f"emulated (slept): {slept}")
    hosts = [
        f"{a} (pipelines {', '.join(map(str, e.get('pipelines') or [])) or '-'}) {shaping_text(e)}"
        for a, e in shaped.items()
        if e.get("bandwidth") or e.get("cpu")
    ]
    if hosts:
        parts.append("shaped by the kernel: " + "; ".join(hosts))
    return " · ".join(parts) or "none"


def category(kind: str):
    """The timeline category of an event kind (None for records that are not spans of work)."""
    return _KIND_CATEGORY.get(kind)


class RunView:
    """Aggregates event records of one run for display."""

    def __init__(
        self,
        stages: int,
        pipelines: int,
        batch_size: int,
        *,
        window: float = 4.0,
        rounds: int = 60,
        steps: int = 12,
        flag_factor: float = 2.0,
        attribution_window: Optional[float] = 30.0,
    ):
        self.stages, self.pipelines, self.batch_size = stages, pipelines, batch_size
        self.window, self.rounds, self.steps, self.flag_factor = window, rounds, steps, flag_factor
        #: seconds of the run's clock the time attribution covers, up to the latest record (None: the whole run)
        self.attribution_window = attribution_window
        #: the pipelines taking part now: a pipeline that joins adds its rows, one that leaves or is lost drops them
        self.active = set(range(pipelines))
        self.workers = [(p, s) for p in range(pipelines) for s in range(stages)]
        self.now = 0.0
        self.count = 0
        self._recent = {w: deque() for w in self.workers}  # (category, start, end), merged
        self._background = {w: deque() for w in self.workers}  # (start, end) of overlapped averaging
        # span records in arrival order: a replay's all; a live run's from the next slice to attribute on (and its
        # context); the slices attributed, (start, end, Attribution), those of the window; the next slice's start
        self._spans: deque = deque()
        self._slices: deque = deque()
        self._next: Optional[float] = None
        self._first = math.inf  # the earliest start of a span record
        #: [pause, resume or None] on the run's clock, of each pause (the driver's controls)
        self.pauses: list = []
        #: the driver's control records that switched the run's policy or heterogeneity live, in order
        self.switches: list = []
        #: the epoch records (each pipeline's, at its epoch's end), in arrival order
        self.epoch_records: list = []
        self._rounds = {s: {} for s in range(stages)}  # stage -> key -> {"members": set, "reason": str, "end": t}
        self._order = {s: deque() for s in range(stages)}  # keys in arrival order, bounded
        self.sizes = {s: Counter() for s in range(stages)}  # groups of the ordinary rounds by members
        self.reasons = {s: Counter() for s in range(stages)}
        self.graph_syncs: list = []  # (time, stage)
        self._opt_end = {w: deque(maxlen=steps + 1) for w in self.workers}
        self._busy = defaultdict(float)  # (worker, step) -> compute seconds
        self._held = defaultdict(float)  # (worker, step) -> sync and group-wait seconds
        self._compute = {w: deque(maxlen=steps) for w in self.workers}
        self._own = {w: deque(maxlen=steps) for w in self.workers}
        self._steps = {w: {} for w in self.workers}  # step -> (duration, held): the recent steps of each worker
        self._stage0_steps: deque = deque()  # end times of stage-0 optimizer spans (one per pipeline step)
        self.losses = {p: [] for p in range(pipelines)}  # (step, loss)
        self.epochs = {p: [] for p in range(pipelines)}  # metric dicts
        self.controls: list = []  # (time, label)
        self.emulated = None  # the slept heterogeneity last set live (a Heterogeneity's dict), None: the configured one
        self.shaped: dict = {}  # host address -> its last "shaped" control record (kernel-enforced limits)
        self.status = None

    def heterogeneity(self, configured=None) -> str:
        """One line: the slept (emulated) heterogeneity and the kernel-shaped hosts, or "none".

        ``configured``: the run's starting heterogeneity (a dict), used until a live change arrives.
        """
        return heterogeneity_text(self.emulated if self.emulated is not None else configured, self.shaped)

    # ------------------------------------------------------------ input
    def add(self, events) -> None:
        for e in events:
            self._add(e)
        self._forget()

    def _forget(self) -> None:
        """Drop the span records no slice to attribute needs: those that ended before the next slice's context
        (before the window's, until the first slice).  Records come in batches per worker, not in order of their
        ends: one that ended earlier than the first kept goes when the ones before it have (a slice's start clips
        it meanwhile)."""
        if self.attribution_window is None:
            return
        lo, q = self._start() - CONTEXT, self._spans
        while q and q[0]["end"] < lo:
            q.popleft()

    def _start(self) -> float:
        """The start of the next slice to attribute: after the last one (the first: of the first span record), but
        none that ends before the window of the last slice due (a view that attaches to a long run, the end of a
        long pause: those would never be drawn)."""
        first = self._next if self._next is not None else math.floor(min(self._first, self.now) / SLICE) * SLICE
        skip = math.floor((self.now - self.attribution_window - LAG - SLICE) / SLICE) * SLICE
        return max(first, skip)

    def _add(self, e: dict) -> None:
        self.count += 1
        kind = e.get("kind")
        end = e.get("end") or 0.0
        if end > self.now:
            self.now = end
        if kind == "group":
            self._formation(e["stage"], ("round", e["round"]), e["group"], e["reason"], end)
            return
        change = membership(e)
        if change is not None:
            self._member(*change)
        if kind == "worker-lost":
            self.controls.append((e["start"], f"lost: pipeline {e['pipeline']}"))
            return
        if kind == "control":
            what = e["what"]
            if e.get("applied_by") == "driver" and what == "pause":
                self.pauses.append([e["start"], None])
            elif e.get("applied_by") == "driver" and what == "resume" and self.pauses and self.pauses[-1][1] is None:
                self.pauses[-1][1] = e["start"]
            if e.get("applied_by") == "driver" and what in ("policy", "heterogeneity"):
                self.switches.append(e)
            if e.get("applied_by") == "driver":
                label = what + (f": {e['policy']}" if e.get("policy") else "")
                if what in ("joined", "leave", "join-failed") and e.get("pipeline") is not None:
                    label = f"{what}: pipeline {e['pipeline']}"
                elif what == "add":
                    label = f"add: pipeline {', '.join(map(str, e.get('pipelines') or []))}"
                elif what == "recut":
                    label = f"recut: stages start at layers 0, {', '.join(map(str, e.get('cuts') or []))}"
                if e["what"] == "heterogeneity":
                    self.emulated = e.get("heterogeneity")
                elif e["what"] == "shaped":
                    self.shaped[e["address"]] = e
                    label = f"shaped {e['address']}: {shaping_text(e)}"
                self.controls.append((e["start"], label))
            return
        if kind == "epoch":
            m = e["metrics"]
            self.epochs.setdefault(m["pipeline"], []).append(m)
            self.epoch_records.append(e)
            return
        cat = category(kind)
        p, s = e.get("pipeline"), e.get("stage")
        if cat is None or (p, s) not in self._recent:
            return
        w = (p, s)
        start = e["start"]
        self._spans.append(e)
        self._first = min(self._first, start)
        if e.get("lane") == "background":  # overlapped averaging: beside the step's own spans, on its own lane
            self._background[w].append((start, end))
            return
        q = self._recent[w]
        if q and q[-1][0] == cat and start - q[-1][2] < 0.002:
            q[-1] = (cat, q[-1][1], max(end, q[-1][2]))
        else:
            q.append((cat, start, end))
        step = e.get("step")
        if kind in ("forward", "backward", "straggle"):
            self._busy[(w, step)] += end - start
        elif kind == "sync" or (kind == "wait" and e.get("what") in ("group", "drain")):
            self._held[(w, step)] += end - start
        if kind == "sync" and "round" not in e and not e.get("served") and e.get("group") and len(e["group"]) > 1:
            # groups of policies without the group service (allreduce, adpsgd pairs): one formation per step and group
            self._formation(s, ("step", step, tuple(e["group"])), e["group"], e.get("reason") or "step", end)
        elif kind == "optimizer":
            self._step_done(w, step, end, e.get("loss"))

    def _member(self, pipeline: int, present: bool) -> None:
        """A pipeline joined (its rows appear; a new id gets its own) or left the run (its rows go)."""
        if present:
            for p in range(self.pipelines, pipeline + 1):
                for s in range(self.stages):
                    w = (p, s)
                    self._recent[w], self._background[w] = deque(), deque()
                    self._opt_end[w] = deque(maxlen=self.steps + 1)
                    self._compute[w], self._own[w] = deque(maxlen=self.steps), deque(maxlen=self.steps)
                    self._steps[w] = {}
                self.losses.setdefault(p, [])
                self.epochs.setdefault(p, [])
            self.pipelines = max(self.pipelines, pipeline + 1)
            self.active.add(pipeline)
        else:
            self.active.discard(pipeline)
        self.workers = [(p, s) for p in sorted(self.active) for s in range(self.stages)]

    def _formation(self, stage: int, key, members, reason: str, end: float) -> None:
        rounds = self._rounds.setdefault(stage, {})
        r = rounds.get(key)
        if r is None:
            r = rounds[key] = {"members": set(), "reason": reason, "end": end, "groups": []}
            self._order.setdefault(stage, deque()).append(key)
            if len(self._order[stage]) > self.rounds:
                rounds.pop(self._order[stage].popleft(), None)
            if reason == "graph":
                self.graph_syncs.append((end, stage))
        elif key[0] == "step":
            return  # the same group, reported by another member
        r["members"].update(members)
        r["groups"].append(tuple(members))
        if reason in ("graph", "global"):
            r["reason"] = reason
        if reason not in ("global", "graph", "preempted"):
            self.sizes.setdefault(stage, Counter())[len(members)] += 1
        self.reasons.setdefault(stage, Counter())[reason] += 1

    def _step_done(self, w, step, end: float, loss) -> None:
        ends = self._opt_end[w]
        if ends:
            duration = end - ends[-1]
            held = min(self._held.pop((w, step), 0.0), duration)
            self._compute[w].append(self._busy.pop((w, step), 0.0))
            self._own[w].append(max(duration - held, 1e-9))
            recent = self._steps[w]
            recent[step] = (duration, held)
            if len(recent) > 4 * self.steps:
                for old in sorted(recent)[: len(recent) - 2 * self.steps]:
                    del recent[old]
        else:
            self._busy.pop((w, step), None)
            self._held.pop((w, step), None)
        ends.append(end)
        if w[1] == 0:
            self._stage0_steps.append(end)
        if loss is not None:
            self.losses.setdefault(w[0], []).append((step, float(loss)))

    # ------------------------------------------------------------ output
    def timeline(self, bins: int = 200) -> dict:
        """Bars of the last ``window`` seconds: category -> {"y": worker labels, "base": starts, "x": durations};
        ``"background"``: the overlapped averaging spans, drawn on their own lane beside the step's bars.

        The window is cut into ``bins`` slots; each slot of a worker shows the
        category it spent most of its time in, and equal neighbouring slots
        join into one bar.  So a redraw costs at most ``bins`` bars per worker
        however many spans there are (micro-batch spans last milliseconds).
        """
        lo = self.now - self.window
        width = self.window / bins
        out = {c: {"y": [], "base": [], "x": []} for c in CATEGORIES}
        for w in self.workers:  # the rows of the pipelines taking part
            q = self._recent[w]
            while q and q[0][2] < lo:
                q.popleft()
            slots = _slots(q, lo, lo + self.window, width, bins)
            label = self.label(w)
            run = None  # (category, first slot, last slot)
            for i, c in enumerate([*slots, None]):
                cat = c.most_common(1)[0][0] if c else None
                if run is not None and cat == run[0]:
                    run = (cat, run[1], i)
                    continue
                if run is not None:
                    d = out[run[0]]
                    d["y"].append(label)
                    d["base"].append(lo + run[1] * width)
                    d["x"].append((run[2] - run[1] + 1) * width)
                run = (cat, i, i) if cat is not None else None
        out["background"] = bg = {"y": [], "base": [], "x": []}
        for w in self.workers:
            q = self._background[w]
            while q and q[0][1] < lo:
                q.popleft()
            label = self.label(w)
            for start, end in q:
                a = max(start, lo)
                bg["y"].append(label)
                bg["base"].append(a)
                bg["x"].append(max(end - a, 0.0))
        return out

    def label(self, w) -> str:
        return f"pipeline {w[0]} stage {w[1]}"

    def attribution(self) -> Attribution:
        """Where the time of each worker taking part went (:func:`sdpipe.attribution.attribute`): in a replay over
        the whole run; live, over the last ``attribution_window`` seconds of the slices attributed so far
        (:meth:`attribute_slices`), summed (:meth:`~sdpipe.attribution.Attribution.merge`; its ``window``: from
        the first slice's start to the last one's end, ``LAG`` to ``LAG + SLICE`` seconds before the latest record
        while the run goes on; while it is paused, up to its latest record: the time after the last slice is
        attributed at each call, and not kept).  A live call costs the new slices' records (a few microseconds
        each), if any.

        A pipeline that left or was lost has no row, and is not named the bottleneck (on the few records it may
        still have in the window, its shares can be extreme)."""
        if self.attribution_window is None:
            return attribute([e for e in self._spans if e["pipeline"] in self.active])
        self.attribute_slices()
        parts = [(a, b, part) for a, b, part in self._slices]
        if self.pauses and self.pauses[-1][1] is None and self._first < math.inf:
            # paused: the time up to its latest record, which no slice covers before the resume, attributed for now
            a, b = self._start(), self.now
            if b > a:
                records = [e for e in self._spans if e["end"] >= a - CONTEXT and e["pipeline"] in self.active]
                parts.append((a, b, attribute(records, since=a, until=b, part=True)))
        keep = parts[-1][1] - self.attribution_window - 1e-9 if parts else 0.0
        return Attribution.merge(
            [
                dataclasses.replace(part, workers=[w for w in part.workers if w["pipeline"] in self.active])
                for a, _, part in parts
                if a >= keep
            ]
        )

    def attribute_slices(self) -> int:
        """Attribute each slice of ``SLICE`` seconds (from a multiple of it on the run's clock) that ended ``LAG``
        seconds before the latest record (after a resume, when it ended in the pause; all of them once the run
        ended), once, from the span records of the pipelines taking part that reach into it or its ``CONTEXT``
        before; keep those of the last ``attribution_window`` seconds.  Returns how many it attributed."""
        self._forget()
        if self._first == math.inf:
            return 0
        ended = self.status in _ENDED
        a, added = self._start(), 0
        while a < self.now and (ended or self.now >= self._due(a + SLICE)):
            b = a + SLICE if not ended else min(a + SLICE, self.now)
            records = [e for e in self._spans if e["end"] >= a - CONTEXT and e["pipeline"] in self.active]
            self._slices.append((a, b, attribute(records, since=a, until=b, part=True)))
            a, added = a + SLICE, added + 1
            self._next = a
            self._forget()
        while self._slices and self._slices[0][0] < self._slices[-1][1] - self.attribution_window - 1e-9:
            self._slices.popleft()
        return added

    def _due(self, end: float) -> float:
        """The latest record's end from which a slice that ends at ``end`` is attributed: ``LAG`` after it, or
        after the resume of a pause it ends in (never while that pause lasts: the pause's records come with the
        resume)."""
        for pause, resume in self.pauses:
            if pause <= end and (resume is None or end < resume):
                return math.inf if resume is None else resume + LAG
        return end + LAG

    def formations(self, stage: int) -> dict:
        """The recent formations of ``stage``: keys, a pipelines x formations membership matrix and reasons.

        Matrix values: 0 not in a group, 1 alone, 2 in a group, 3 graph sync, 4 global sync.
        """
        keys = list(self._order.get(stage, ()))
        rounds = self._rounds.get(stage, {})
        z = [[0] * len(keys) for _ in range(self.pipelines)]
        reasons = []
        for j, k in enumerate(keys):
            r = rounds[k]
            reasons.append(r["reason"])
            code = {"graph": 3, "global": 4}.get(r["reason"], 2)
            for g in r["groups"]:
                for m in g:
                    if 0 <= m < self.pipelines:
                        z[m][j] = code if len(g) > 1 or code > 2 else 1
        return {"keys": keys, "z": z, "reasons": reasons}

    def step_times(self) -> dict:
        """Per worker: median step time, compute per step, and whether it is flagged as a straggler."""
        step = {w: _median([b - a for a, b in itertools.pairwise(q)]) for w, q in self._opt_end.items()}
        compute = {w: _median(list(q)) for w, q in self._compute.items()}
        known = [v for v in compute.values() if v]
        # the lower middle value: with half the workers slowed (2 of 4), the median would sit between the groups
        med = statistics.median_low(known) if known else None
        flagged = {w: bool(med and compute[w] and compute[w] > self.flag_factor * med) for w in self.workers}
        return {"step": step, "compute": compute, "median_compute": med, "flagged": flagged}

    def throughput(self, blocks: int = 3) -> dict:
        """Samples/s of the pipelines' recent steps against the ideal, with the ratio's spread.

        For each pipeline, its last ``steps`` steps that every stage of it
        finished: ``samples_per_s`` sums batch / mean step time (stage 0's
        durations), ``ideal`` sums the same with each step shortened by the
        time the most-held stage spent in synchronization (averaging, group
        waits).  ``ratio`` = samples_per_s / ideal is at most 1: what
        synchronizing left of the pipelines' own speed.  ``spread`` is the
        (lowest, highest) ratio over ``blocks`` consecutive blocks of those
        steps, and ``window_samples_per_s`` counts the pipelines' steps ended
        in the last ``window`` seconds.
        """
        q = self._stage0_steps
        lo = self.now - self.window
        while q and q[0] < lo:
            q.popleft()
        span = min(self.window, self.now) or None
        window_rate = len(q) * self.batch_size / span if span else None
        per = []  # per pipeline: list of (duration, held) over its recent common steps
        for p in sorted(self.active):
            recents = [self._steps[(p, s)] for s in range(self.stages)]
            common = sorted(set(recents[0]).intersection(*recents[1:]))[-self.steps :]
            per.append([(recents[0][k][0], min(recents[0][k][0], max(r[k][1] for r in recents))) for k in common])
        if not all(per):
            return {
                "samples_per_s": None,
                "ideal": None,
                "ratio": None,
                "spread": None,
                "window_samples_per_s": window_rate,
            }
        run, ideal = _rates(per, self.batch_size)
        ratios = _block_ratios(per, self.batch_size, blocks)
        return {
            "samples_per_s": run,
            "ideal": ideal,
            "ratio": run / ideal,
            "spread": (min(ratios), max(ratios)) if len(ratios) > 1 else None,
            "window_samples_per_s": window_rate,
        }


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _slots(spans, lo: float, hi: float, width: float, bins: int) -> list:
    """The seconds by category (a Counter, None where none) in each of ``bins`` slots of ``width`` seconds from
    ``lo`` (to ``hi``), of ``(category, start, end)`` spans."""
    slots = [None] * bins
    for cat, start, end in spans:
        a, b = max(start, lo), min(end, hi)
        i = int((a - lo) / width)
        while i < bins and lo + i * width < b:
            cover = min(b, lo + (i + 1) * width) - max(a, lo + i * width)
            if cover > 0:
                if slots[i] is None:
                    slots[i] = Counter()
                slots[i][cat] += cover
            i += 1
    return slots


def _rates(per: list, batch_size: int) -> tuple:
    """(samples/s, ideal samples/s) of pipelines' steps, each pipeline's a list of (duration, held by sync)."""
    run = ideal = 0.0
    for steps in per:
        d = sum(x for x, _ in steps)
        h = sum(y for _, y in steps)
        run += batch_size * len(steps) / d
        ideal += batch_size * len(steps) / max(d - h, 1e-9)
    return run, ideal


def _block_ratios(per: list, batch_size: int, blocks: int) -> list:
    """The ratio samples/s / ideal over each of ``blocks`` consecutive blocks of every pipeline's steps."""
    ratios = []
    for b in range(blocks):
        rows = [steps[b * len(steps) // blocks : (b + 1) * len(steps) // blocks] for steps in per]
        if all(rows):
            r, i = _rates(rows, batch_size)
            ratios.append(r / i)
    return ratios
