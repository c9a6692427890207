"""The simulator's stand-ins for training: a proxy model whose loss shows how well the replicas mix, the
parameter server's stale-synchronous release rule, and its server."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from sdpipe.core.checks import is_number
from sdpipe.core.sync_rules import GLOBAL

__all__ = ["Proxy"]


@dataclass(frozen=True)
class Proxy:
    """The convergence proxy's parameters: every worker steps ``x -= lr * (x + noise * N(0, 1))`` on the bowl
    ``mean(x ** 2)`` and its groups average its point (a stand-in for training, apart from the run's optimizer)."""

    lr: float = 0.1
    """Step size of each worker's step on its bowl."""
    noise: float = 1.0
    """Standard deviation of each step's gradient noise (in units of the gradient)."""

    def __post_init__(self):
        for name in ("lr", "noise"):
            v = getattr(self, name)
            if not is_number(v) or not (0 <= v < math.inf):
                raise ValueError(f"proxy.{name}: must be a finite number >= 0, got {v!r}")


class _Proxy:
    """The convergence proxy: each worker (p, s) holds a point x (4 numbers) of the bowl ``mean(x ** 2)`` and
    steps ``x -= lr * (x + noise * N(0, 1))`` per step; groups average their members' points.

    ``mass`` is a worker's progress (1 + steps since the last global sync), the weight of ``weighting="progress"``.
    Replicas of a stage start equal.  A pipeline's loss is the mean of its stages' quadratics.  Workers are
    numbered ``p * stages + s`` (the rows of ``x``); the noise has its own random stream (drawn in blocks), apart
    from the timing's.

    A step is only logged (:meth:`learn`); every other method first takes the logged steps in, together and in
    their order (:meth:`settle`), so the points and the noise they drew are those of stepping at once.  The
    pairs of a round average together (:meth:`mix_pairs`).
    """

    __slots__ = ("a", "b", "buf", "gen", "i", "log", "mass", "pending", "stages", "x")

    def __init__(self, stages: int, pipelines: int, seed: int, proxy: Proxy):
        self.stages, self.a, self.b = stages, 1.0 - proxy.lr, proxy.lr * proxy.noise
        self.gen = np.random.default_rng([seed, 1])
        init = self.gen.normal(0.0, 3.0, size=(stages, 4))
        self.x = init[np.arange(pipelines * stages) % stages]  # by worker: its point
        self.mass = np.ones(pipelines * stages)
        self.buf, self.i = np.empty(0), 0
        self.pending: dict = {}  # worker -> correction served to it (adpsgd's passive side) not yet applied
        self.log: list = []  # workers that stepped, in order, not yet taken in

    def learn(self, w: int) -> None:
        """Worker w stepped (taken in by the next :meth:`settle`)."""
        self.log.append(w)

    def _normals(self, k: int):
        """The noise stream's next k numbers."""
        parts = []
        while k:
            if self.i >= len(self.buf):
                self.buf, self.i = self.gen.standard_normal(1 << 16), 0
            take = min(k, len(self.buf) - self.i)
            parts.append(self.buf[self.i : self.i + take])
            self.i += take
            k -= take
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def settle(self) -> None:
        """Take the logged steps in, in their order: ``x = a x - b z`` with the stream's next 4 numbers z and one
        more step of progress each."""
        log = self.log
        if not log:
            return
        self.log = []
        n, a, b, x, mass = len(log), self.a, self.b, self.x, self.mass
        Z = self._normals(4 * n).reshape(n, 4)
        W = np.array(log)
        if len(set(log)) == n:  # each stepped once
            x[W] = a * x[W] - b * Z
            mass[W] += 1.0
            return
        # a worker's steps one after another: every worker's k-th one together
        order = np.argsort(W, kind="stable")
        ws = W[order]
        first = np.ones(n, dtype=bool)
        first[1:] = ws[1:] != ws[:-1]
        starts = np.flatnonzero(first)
        rank = np.empty(n, dtype=np.int64)
        rank[order] = np.arange(n) - np.repeat(starts, np.diff(np.append(starts, n)))
        for k in range(int(rank.max()) + 1):
            sel = rank == k
            rows = W[sel]
            x[rows] = a * x[rows] - b * Z[sel]
            mass[rows] += 1.0

    def mix_pairs(self, us: list, vs: list, by_progress: bool) -> None:
        """Each pair ``(us[i], vs[i])`` (distinct workers of one stage, each in one pair) averages, as :meth:`mix`
        does two."""
        self.settle()
        x, mass = self.x, self.mass
        U, V = np.array(us), np.array(vs)
        MU, MV = mass[U], mass[V]
        if by_progress:
            mean = (MU[:, None] * x[U] + MV[:, None] * x[V]) / (MU + MV)[:, None]
        else:
            mean = (x[U] + x[V]) / 2.0  # (1 x_u + 1 x_v) / 2
        x[U] = mean
        x[V] = mean
        mass[U] = mass[V] = (MU + MV) / 2

    def mix(self, workers: list, by_progress: bool, restart: bool) -> None:
        """``workers`` (of one stage) average (by progress or uniformly), in the order listed; a global sync
        (``restart``) resets their progress."""
        n = len(workers)
        if n == 2:
            self.mix_pairs(workers[:1], workers[1:], by_progress)
        elif n > 2:
            self.settle()
            x, mass = self.x, self.mass
            w = mass[workers].tolist() if by_progress else [1.0] * n
            total = sum(w)
            points = x[workers].tolist()
            mean = [sum(wi * pt[k] for wi, pt in zip(w, points, strict=True)) / total for k in range(4)]
            x[workers] = mean
            mass[workers] = sum(mass[workers].tolist()) / n
        if restart:
            self.mass[workers] = 1.0

    def pair(self, active: int, passive: int) -> None:
        """adpsgd: the active worker takes the pair's mean; the passive one is owed ``(x_a - x_p) / 2`` (folded in
        at its next step boundary, :meth:`fold`), so the sum over the replicas is conserved."""
        self.settle()
        xa, xp = self.x[active].tolist(), self.x[passive].tolist()
        half = [(xa[k] - xp[k]) / 2 for k in range(4)]
        self.x[active] = [xa[k] - half[k] for k in range(4)]
        owed = self.pending.get(passive)
        self.pending[passive] = half if owed is None else [owed[k] + half[k] for k in range(4)]

    def fold(self, w: int) -> None:
        owed = self.pending.pop(w, None)
        if owed is not None:
            self.settle()
            v = self.x[w].tolist()
            self.x[w] = [v[k] + owed[k] for k in range(4)]

    def copy(self, donor: int, p: int) -> None:
        """Pipeline p takes the donor's points and progress (a joiner's state)."""
        self.settle()
        S = self.stages
        self.x[p * S : p * S + S] = self.x[donor * S : donor * S + S]
        self.mass[p * S : p * S + S] = self.mass[donor * S : donor * S + S]

    def loss(self, p: int) -> float:
        self.settle()
        S = self.stages
        total = 0.0
        for v in self.x[p * S : p * S + S].tolist():
            total += v[0] * v[0] + v[1] * v[1] + v[2] * v[2] + v[3] * v[3]
        return total / (4 * S)


class _Ssp:
    """A stage's parameter server's stale synchronous parallel bookkeeping, kept incrementally: the decisions of
    :func:`sdpipe.core.sync_rules.ps_release` (which the runtime's server calls after every request) in O(1) per
    request where that function looks at every client (``tests/test_simulate.py`` holds the two to the same
    answers)."""

    __slots__ = ("at_global", "clock", "count", "held", "live", "seq", "slowest", "staleness")

    def __init__(self, clients, staleness: int):
        self.staleness = staleness
        self.live = set(clients)
        self.clock = {c: 0 for c in self.live}
        self.at_global: set = set()
        self.count = {0: len(self.live)}  # clock -> running clients (live, not at the global sync) at it
        self.slowest = 0  # the slowest running client's clock
        self.held: dict = {}  # clock -> [(arrival, client)] of the step-pulls held by the bound
        self.seq = 0

    def _advance(self) -> None:
        count, top = self.count, max(self.count, default=0)
        while self.slowest < top and not count.get(self.slowest):
            self.slowest += 1

    def push(self, client: int, kind: str) -> tuple:
        """Client ``client`` pushed (``kind`` "step" or "global") and waits for its pull: ``(the clients answered
        now in order, whether the global sync completed)``."""
        self.seq += 1
        k = self.clock[client]
        self.count[k] -= 1
        if kind == GLOBAL:
            self.at_global.add(client)
            if self.at_global >= self.live:
                replies = tuple(sorted(self.at_global))
                self.clock = dict.fromkeys(self.clock, 0)
                self.count, self.slowest, self.at_global, self.held = {0: len(self.live)}, 0, set(), {}
                return replies, True
            self._advance()
            return self._release(()), False
        self.clock[client] = k + 1
        self.count[k + 1] = self.count.get(k + 1, 0) + 1
        self._advance()
        return self._release(((self.seq, client),)), False

    def _release(self, new: tuple) -> tuple:
        """The held step-pulls within the bound now (in arrival order), then the new one if it is; the rest held."""
        bound, held = self.slowest + self.staleness, self.held
        out = []
        for k in [k for k in held if k <= bound]:
            out += held.pop(k)
        for arrival, c in new:
            k = self.clock[c]
            if k <= bound:
                out.append((arrival, c))
            else:
                held.setdefault(k, []).append((arrival, c))
        out.sort()
        return tuple(c for _, c in out)


class _Server:
    """A parameter server of one stage: its weights (the proxy's point), its link's two directions (each one
    transfer at a time), its clients' last pull and the time each is waiting since."""

    __slots__ = ("asked", "in_free", "out_free", "ssp", "w")

    def __init__(self, point: list, clients, staleness: int):
        self.w = list(point)
        self.in_free = self.out_free = 0.0
        self.ssp = _Ssp(clients, staleness)
        self.asked: dict = {}  # client -> (ready time, step, kind) of its pending pull
