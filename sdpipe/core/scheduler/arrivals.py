"""A stage's open round, and rule "arrival": when each worker's next ready signal is due."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from sdpipe.core.scheduler.dsu import DisjointSet

__all__ = []


@dataclass
class _Round:
    members: list
    opened: float
    deadline: float
    graph: bool = False
    expected: Optional[frozenset] = None  # rule "arrival": the workers this round waits for
    missing: set = field(default_factory=set)  # of those, the live ones not in it and not waiting for the global group
    trial: Optional["DisjointSet"] = None  # a graph-sync round: the union with its members so far (built lazily)
    trial_members: int = 0  # how many of ``members`` ``trial`` holds
    witness: Optional[int] = None  # a graph-sync round: the last available worker found outside its component


def _median(xs) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


class _Arrivals:
    """What rule "arrival" knows of a stage's workers: when each was last released from a group and its
    recent compute intervals (release to next ready signal), with median and median absolute deviation.

    A worker's next ready signal is predicted at ``released + median`` (under overlapped averaging, where a
    worker does not wait for its group, at its last ready signal + the median ready-to-ready interval), give
    or take ``spread``
    (3 x the median absolute deviation, at least 2% of the median); a worker without a release to predict
    from (it has not been in a group since the start or since a global group, after which workers evaluate)
    is expected within the horizon, without a time.  The stage's typical interval is the
    median of its last ``4 x history`` intervals of any worker, so fast workers, who step more often,
    weigh more, and one straggler does not stretch every round's horizon.

    Kept by worker id in arrays: release times, each worker's last ``history`` intervals as a row (in no
    order: a median needs none) with their count and the slot the next one goes to, medians and spreads.
    Under overlapped averaging a ready signal is only logged; the log is taken in, in numpy and in its
    order, when anything reads the state (a round's plan, mostly), so a ready signal costs two appends.
    """

    #: ready signals logged before they are taken in regardless (a stage whose rule never plans a round)
    LOG_MAX = 1 << 16

    def __init__(self, history: int, overlap: bool = False):
        self.history = history
        #: under overlapped averaging a worker goes on at its ready signal: its next one follows its last one,
        #: not its release, so the intervals run ready to ready
        self.overlap = overlap
        self.recent: deque = deque(maxlen=4 * history)
        self._typical: Optional[float] = None
        self._rel = np.full(16, np.nan)  # by worker id: time of its last release (overlap: ready), NaN: none
        self._med = np.full(16, np.nan)  # median and spread of its intervals, NaN: none or out of date
        self._spr = np.full(16, np.nan)
        self._ring = np.zeros((16, history))  # its last ``history`` intervals
        self._count = np.zeros(16, dtype=np.int64)  # how many of the row hold one (at most ``history``)
        self._slot = np.zeros(16, dtype=np.int64)  # the slot of its next interval
        self._dirty: set = set()  # workers with intervals newer than their median and spread
        self._log_w: list = []  # overlap: ready signals (worker, time) not yet taken in
        self._log_t: list = []

    def _grow(self, worker: int) -> None:
        n = len(self._rel)
        if worker >= n:
            m = max(worker + 1, 2 * n)
            for name, fill in (("_rel", np.nan), ("_med", np.nan), ("_spr", np.nan), ("_count", 0), ("_slot", 0)):
                old = getattr(self, name)
                a = np.full(m, fill, dtype=old.dtype)
                a[:n] = old
                setattr(self, name, a)
            ring = np.zeros((m, self.history))
            ring[:n] = self._ring
            self._ring = ring

    @property
    def released(self) -> dict:
        """worker -> time of its last release (overlap: of its last ready signal)."""
        self._take_in()
        at = np.flatnonzero(~np.isnan(self._rel))
        return dict(zip(at.tolist(), self._rel[at].tolist(), strict=True))

    def ready(self, worker: int, now: float) -> None:
        if self.overlap:  # the simulator's hot path: logged, taken in by _take_in
            self._log_w.append(worker)
            self._log_t.append(now)
            if len(self._log_w) >= self.LOG_MAX:
                self._take_in()
            return
        if worker >= len(self._rel):
            self._grow(worker)
        last = float(self._rel[worker])
        if last != last:  # NaN: not released since the start or a global group
            return
        self._rel[worker] = np.nan
        dt = max(0.0, now - last)
        self.recent.append(dt)
        self._typical = None
        slot = int(self._slot[worker])
        self._ring[worker, slot] = dt
        self._slot[worker] = (slot + 1) % self.history
        self._count[worker] = min(int(self._count[worker]) + 1, self.history)
        self._dirty.add(worker)

    def _take_in(self) -> None:
        """The logged ready signals, in their order: each worker's interval since its previous one."""
        if not self._log_w:
            return
        W = np.array(self._log_w, dtype=np.int64)
        T = np.array(self._log_t, dtype=np.float64)
        self._log_w, self._log_t = [], []
        self._grow(int(W.max()))
        n, h = len(W), self.history
        order = np.argsort(W, kind="stable")  # by worker, each worker's signals in time order
        Ws, Ts = W[order], T[order]
        first = np.ones(n, dtype=bool)
        first[1:] = Ws[1:] != Ws[:-1]
        prev = np.empty(n)
        prev[1:] = Ts[:-1]
        prev[first] = self._rel[Ws[first]]
        last = np.ones(n, dtype=bool)
        last[:-1] = first[1:]
        self._rel[Ws[last]] = Ts[last]
        valid = ~np.isnan(prev)
        if not valid.any():
            return
        dt = np.maximum(Ts - prev, 0.0)
        in_order = np.zeros(n, dtype=bool)  # the intervals in the log's order, for the stage's recent ones
        in_order[order] = valid
        recent = np.empty(n)
        recent[order] = dt
        self.recent.extend(recent[in_order][-self.recent.maxlen :].tolist())
        self._typical = None
        # each worker's new intervals into its row, after the ones it holds (only its last ``history``)
        Wv, Dv = Ws[valid], dt[valid]
        m = len(Wv)
        start = np.ones(m, dtype=bool)
        start[1:] = Wv[1:] != Wv[:-1]
        starts = np.flatnonzero(start)
        sizes = np.diff(np.append(starts, m))
        rank = np.arange(m) - np.repeat(starts, sizes)
        total = np.repeat(sizes, sizes)
        keep = rank >= total - h
        workers = Wv[starts]
        slot0 = self._slot[Wv]
        self._ring[Wv[keep], (slot0[keep] + rank[keep]) % h] = Dv[keep]
        self._slot[workers] = (self._slot[workers] + sizes) % h
        self._count[workers] = np.minimum(self._count[workers] + sizes, h)
        self._dirty.update(workers.tolist())

    def release(self, workers, now: float) -> None:
        if self.overlap:
            return
        for w in workers:
            if w >= len(self._rel):
                self._grow(w)
            self._rel[w] = now

    def release_global(self, workers) -> None:
        """After a global group the workers evaluate or checkpoint: their next interval says nothing of a step."""
        self._take_in()
        for w in workers:
            if w < len(self._rel):
                self._rel[w] = np.nan

    def forget(self, worker: int) -> None:
        self._take_in()
        if worker < len(self._rel):
            self._rel[worker] = self._med[worker] = self._spr[worker] = np.nan
            self._count[worker] = self._slot[worker] = 0
        self._dirty.discard(worker)

    def _update_stats(self) -> None:
        """Median and spread of every worker with new intervals, the workers with as many intervals together (a
        sort per row in numpy; the median of an even count is the mean of the middle two, as is the median
        absolute deviation's)."""
        self._take_in()
        if not self._dirty:
            return
        dirty = np.fromiter(self._dirty, dtype=np.int64, count=len(self._dirty))
        self._dirty.clear()
        counts = self._count[dirty]
        for n in np.unique(counts[counts > 0]).tolist():
            rows = dirty[counts == n]
            xs = np.sort(self._ring[rows, :n], axis=1)
            k = n >> 1
            med = xs[:, k] if n & 1 else 0.5 * (xs[:, k - 1] + xs[:, k])
            ds = np.sort(np.abs(xs - med[:, None]), axis=1)
            mad = ds[:, k] if n & 1 else 0.5 * (ds[:, k - 1] + ds[:, k])
            self._med[rows] = med
            self._spr[rows] = np.maximum(3.0 * mad, 0.02 * med)

    def typical(self) -> Optional[float]:
        self._take_in()
        if self._typical is None and self.recent:
            self._typical = _median(self.recent)
        return self._typical

    def stats(self, worker: int):
        """(median, spread) of the worker's recent intervals; None before its first."""
        self._update_stats()
        if worker >= len(self._count) or not self._count[worker]:
            return None
        return float(self._med[worker]), float(self._spr[worker])

    def plan(self, now: float, candidates, horizon: float):
        """The workers among ``candidates`` (a boolean array by worker id) predicted ready within the horizon,
        ``now +- horizon`` (give or take their spread: due up to a horizon ago counts, a worker overdue by more is
        stalled), and the time the round stops waiting for them: ``now + horizon``, or ``now`` when nobody is
        expected.  A worker not released since the start or a global group is expected, without a time; one
        released without an interval yet is predicted from the stage's typical interval (give or take a quarter
        of it).  One pass in numpy over every worker id (a round at 16,384 pipelines looks at them all)."""
        typical = self.typical()
        end = now + horizon
        self._update_stats()
        n = len(candidates)
        self._grow(n - 1)
        rel, med, spr = self._rel[:n], self._med[:n], self._spr[:n]
        unknown = np.isnan(med)
        if unknown.any():
            med = np.where(unknown, typical, med)
            spr = np.where(unknown, 0.25 * typical, spr)
        pred = rel + med
        ok = np.isnan(rel) | ((now - horizon - spr <= pred) & (pred <= end + spr))
        expected = np.flatnonzero(candidates & ok).tolist()
        return frozenset(expected), (end if expected else now)

    def renewed(self, policy) -> "_Arrivals":
        """These arrivals under ``policy``: the same, or (another history length or overlap) relearnt from the
        recent intervals that still mean the same thing."""
        if (policy.history, policy.overlap) == (self.history, self.overlap):
            return self
        fresh = _Arrivals(policy.history, policy.overlap)
        if policy.overlap == self.overlap:
            fresh.restore(self.snapshot())
        return fresh

    def _row(self, worker: int) -> list:
        """A worker's intervals, oldest first."""
        c, s = int(self._count[worker]), int(self._slot[worker])
        row = self._ring[worker].tolist()
        return row[:c] if c < self.history else row[s:] + row[:s]

    def snapshot(self) -> dict:
        self._take_in()
        return {
            "released": {str(k): v for k, v in self.released.items()},
            "intervals": {str(w): self._row(w) for w in np.flatnonzero(self._count).tolist()},
            "recent": list(self.recent),
        }

    def restore(self, snap: dict) -> None:
        for k, v in snap.get("released", {}).items():
            w = int(k)
            self._grow(w)
            self._rel[w] = v
        h = self.history
        for k, v in snap.get("intervals", {}).items():
            w, v = int(k), list(v)[-h:]
            self._grow(w)
            if v:
                self._ring[w, : len(v)] = v
                self._count[w] = len(v)
                self._slot[w] = len(v) % h
                self._dirty.add(w)
        self.recent.extend(snap.get("recent", ()))
