"""The decisions of the synchronization policies, as pure functions: plain values in, a decision out.

Nothing here imports torch or Dask or touches the run's store or a clock (a time is an argument):
:mod:`sdpipe.worker.sync` is the shell that reads the store and moves tensors, and calls these to decide;
``tests/test_sync_rules.py`` checks them, with hypothesis, without a cluster.

* **Stale synchronous parallel** (``ps``; Ho et al., NIPS 2013, as in HetPipe): :func:`ps_release`.  A
  parameter server counts each client's pushes since the last global sync (its *clock*).  After each
  request it answers the waiting step-pulls of the clients at most ``staleness`` steps ahead of the
  slowest live client still training, and completes the global sync once every live client is at it::

      staleness 1, clocks {0: 3, 1: 1, 2: 2}, all live, all waiting on a step-pull
      slowest running clock 1: client 1 (0 ahead) and 2 (1 ahead) are answered, client 0 (2 ahead) waits

* **Gossip pairs** (``adpsgd``; Lian et al., ICML 2018): :func:`gossip_roles` splits the pipelines into
  active (even) and passive (odd) ones, so every pair has one of each and no two actives wait for each
  other; :func:`choose_peer` draws an active pipeline's passive peer, skipping the lost ones.
* **Mass weighting** (``sdpipe`` under ``weighting="progress"``): a replica's *mass* is 1 plus its steps
  since the last global sync; :func:`member_weight`, :func:`mass_after_group`, :func:`mass_after_round`.
* **The group policy's stop** (``sdpipe``): :func:`group_stop`.

The epoch-tail rule, equally pure, lives with the batch order: :func:`sdpipe.data.leaves_tail`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

__all__ = [
    "PsRelease",
    "choose_peer",
    "gossip_roles",
    "group_stop",
    "held_step_pulls",
    "mass_after_group",
    "mass_after_round",
    "mass_after_step",
    "member_weight",
    "ps_release",
]

#: kinds of a pull waiting at the parameter server
STEP, GLOBAL = "step", "global"
#: the ``reason`` of a sync span that is not a group's: a push and pull at a parameter server, a gossip pair's exchange
SERVED, PAIR = "ps", "pair"


# ------------------------------------------------------------------ parameter server (stale synchronous parallel)
@dataclass(frozen=True)
class PsRelease:
    """What the parameter server does after a request."""

    replies: tuple
    """Clients whose pull is answered now, in the order to answer them."""
    global_sync: bool
    """The global sync completed: the clients at it are answered, and the clocks restart."""
    clock: dict
    """Every client's clock afterwards (all 0 after a global sync, else unchanged)."""


def ps_release(clock: Mapping[int, int], live, at_global, waiting: Mapping[int, str], staleness: int) -> PsRelease:
    """Which waiting pulls the server answers now.

    ``clock``: each client's pushes since the last global sync; ``live``: clients that have not left;
    ``at_global``: clients whose global pull waits; ``waiting``: client -> kind (``"step"`` or ``"global"``) of
    its pending pull, in arrival order; ``staleness``: how many steps a client may be ahead of the slowest one.

    The global sync completes once every live client is at it (and one is): each of them is answered, in
    client order, and the clocks restart.  Otherwise a step-pull is answered when its client is at most
    ``staleness`` steps ahead of the slowest live client not at the global sync (clients at it no longer step).
    """
    at_global = set(at_global)
    if at_global and at_global >= set(live):
        return PsRelease(tuple(sorted(at_global)), True, {c: 0 for c in clock})
    running = [clock[c] for c in live if c not in at_global]
    slowest = min(running) if running else 0
    replies = tuple(c for c, kind in waiting.items() if kind == STEP and clock[c] - slowest <= staleness)
    return PsRelease(replies, False, dict(clock))


def held_step_pulls(waiting: Mapping[int, str]) -> tuple:
    """The step-pulls to answer while the run is paused (a paused client does not catch up), in arrival order."""
    return tuple(c for c, kind in waiting.items() if kind == STEP)


# ------------------------------------------------------------------ gossip pairs
def gossip_roles(pipelines: int) -> tuple:
    """``(actives, passives)``: the even pipelines start exchanges, the odd ones serve them.

    >>> gossip_roles(5)
    ([0, 2, 4], [1, 3])
    """
    return [p for p in range(pipelines) if p % 2 == 0], [p for p in range(pipelines) if p % 2 == 1]


def choose_peer(passives: Sequence[int], lost: Callable[[int], bool], rng) -> tuple:
    """An active pipeline's peer for this step: ``(peer or None, the passives to draw from from now on)``.

    Draws uniformly with ``rng.choice``; a drawn peer whose pipeline is ``lost`` is dropped for good and the
    draw repeats among the others.  ``lost`` is asked only about the peers drawn (each look is a store call).
    """
    passives = list(passives)
    while passives:
        peer = rng.choice(passives)
        if not lost(peer):
            return peer, passives
        passives.remove(peer)
    return None, passives


# ------------------------------------------------------------------ mass weighting
def member_weight(mass: float, weighting: str) -> float:
    """A member's weight in its group's average: its mass under ``"progress"``, 1 under ``"uniform"``."""
    return mass if weighting == "progress" else 1.0


def mass_after_step(mass: float) -> float:
    """An optimizer step adds 1 to a replica's mass."""
    return mass + 1.0


def mass_after_group(total: float, size: int) -> float:
    """The mass each member keeps after its group averaged: the group's mean (``total`` is the masses' sum)."""
    return total / size


def mass_after_round(mass: float, reason: str) -> float:
    """After a round with that ``reason``: a global sync restarts the mass at 1 (every replica holds the same model)."""
    return 1.0 if reason == "global" else mass


# ------------------------------------------------------------------ the group policy's stop
def group_stop(answered: bool, store_stop: bool, first_seen: Optional[float], now: float, grace: float) -> tuple:
    """Stage 0 at a step boundary under a group policy: ``(stop now, when the driver's stop was first seen)``.

    ``answered``: an answer of the group service said the run stops (the members of a round get the same
    answer, so they stop after the same round); ``store_stop``: the driver's flag in the run's store, the
    fallback, taken once ``grace`` seconds passed since ``first_seen`` (``None`` until first seen at ``now``).
    """
    if answered:
        return True, first_seen
    if not store_stop:
        return False, first_seen
    if first_seen is None:
        first_seen = now
    return now - first_seen > grace, first_seen
