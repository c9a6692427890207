"""The SDPipe group scheduler, as a pure state machine.

No torch, no Dask, no clock: time comes in with each event.  The Dask service
(:mod:`sdpipe.service`), the tests and a simulator all drive this same code.

Per stage, following the SDPipe paper (Miao et al., PVLDB 2023, Sec. 4) and
its prototype's constants::

    worker ready  ->  no round open?  open one, deadline = now + that worker's window
                      round open?     join it
    a round closes when it holds max_group workers ("full") or its window ends
    ("window"); its members average together (a group of one skips averaging).
    Each member's window then adapts: doubled (<= window_max) when the group
    had fewer than min_group members, else times 0.9 (>= window_min).

Rule "arrival" (``policy.window``, the default; ours, not the prototype's).  A
constant window does not follow step times: with steps of 200 ms, workers
seldom come within 10 ms of each other, and most rounds close alone.  So the
scheduler keeps, per worker, when it was last released from a group and its
recent compute intervals (release to next ready; median and median absolute
deviation of the last ``history``).  When a round opens at ``now`` it predicts
every computing worker's next ready time and waits only for those predicted
within ``horizon x typical`` of ``now`` (typical: the stage's typical
interval; a worker overdue by more than that is stalled) and for those not
released since a global group, at most until ``now + horizon x typical``; it
closes ("arrived") as soon as they all came, and at once ("alone") when
nobody is predicted.  A worker predicted beyond the horizon (a straggler) is
never waited for: it forms its own rounds, joins whoever is open when it
comes, or is pulled in by the connectivity bound.  Until a stage has seen one
interval, the prototype's window applies.  Rule "prototype" keeps the
prototype's window throughout.

Connectivity bound: as in the SDPipe prototype, updates are counted per
stage (a worker's steps: one per member of each group, or, for a member whose
ready signal carries a step number, the steps it took since its last one: under
overlapped averaging a worker goes on without a ready signal while its last
averaging is in flight) and the groups since
the last reset are kept in a disjoint set.  When the union connects every
live worker of the stage the count resets.  Otherwise, once the count reaches
``(staleness - 1) * D`` (D live workers: P - 1 steps of every worker), the
next round is a *graph-sync* round: it ignores window and size and closes
only once its members join the union into one component.  So every worker's
model mixes with every other's, directly or transitively, within P steps'
worth of updates, ``P * D`` (the last ordinary round may overshoot the
threshold by less than one round).  Counting updates rather than rounds keeps
the bound about steps: a fast worker's many small groups do not bring the
next graph sync forward.  Each stage starts its graph syncs on its own: several
stages may hold one at once.  Holding workers of two stages at once could
deadlock (a held worker of stage 1 may be the one its pipeline's stage-0
worker needs to finish the step that stage 0's graph sync waits for); such a
cycle is broken as below.

Rounds that wait on each other: a round without a deadline (a graph-sync round,
or any round under the ``allreduce`` preset's infinite window) holds its members
until the workers it waits for come.  The workers of one pipeline depend on each
other: a stage's next step needs its neighbours' activations or gradients of that
step, which a neighbour held at an earlier step's ready signal cannot send.  When
the stages' rounds are formed from ready signals at different steps of the same
pipelines (after a live switch from overlapped averaging, where workers went on
without ready signals, to the ``allreduce`` preset), stage 0's round can wait
for a worker blocked by its sibling in stage 1's round, which waits for a worker
blocked by its sibling in stage 0's round: nobody would ever come.  A worker
``w`` of a stage counts as blocked by another stage's round when its sibling is
held there at a step ``w`` has already reached (its last ready signal's step is
at least that one); a cycle of such waits closes its first-opened round at once
with the members it holds ("preempted").  Ready signals that keep their steps in
line never form one (the worker a round waits for is then still finishing the
step its sibling waits at), so the ``allreduce`` preset's groups stay whole.

Global sync: a worker may ask for the global group instead (at an epoch end).
Such a worker takes part in no ordinary round; when every live worker of the
stage asked, they form one group with reason "global".  A pending round is
closed at once when a worker asks for the global group, so nobody waits on a
worker that will not come; and when a worker that waits in it reaches its
epoch's end (``Hurry``: under overlapped averaging its ready signal is still
in the round while its next step found no batch), so its global sync does not
wait out the round's window.

Joining (elastic pipelines): a worker that was not live, or was lost, joins a stage with ``Join`` once it
holds a live replica's state (its ``donor``): it is in no group before that, and from then on a live worker
like any other.  Its model equals the donor's, so the union counts it in the donor's component from its join
(the connectivity bound counts it from there); without a donor it is a component of its own.  A global group
waits for it from its join on, not before.

Shards: :class:`ShardedScheduler` decides each stage's rounds in a :class:`StageShard` of its own, which learns
the other stages' rounds without a deadline only by messages (that may come late), and breaks a cycle of them
when its round opened first (:mod:`sdpipe.core.scheduler.shard`); with its messages delivered at once it decides
the groups this scheduler does (a property test, and the 16,384 x 4 runs of ``benchmarks/scheduler_scale.py``).

Pairing: above ``pair_threshold`` live workers an ordinary round splits its
sorted members into adjacent pairs (a trailing odd worker joins the last pair).

Worked case, D=3, window 1 ms, max_group 3::

    t=0.0000 Ready(0)  -> round 0 opens, deadline 0.0010
    t=0.0004 Ready(2)  -> joins
    t=0.0010 Tick      -> Group(round 0, members (0, 2), reason "window")
    t=0.0030 Ready(1)  -> round 1 opens ... worker 1 waits alone, its window doubles
"""

from __future__ import annotations

from sdpipe.core.scheduler.dsu import DisjointSet
from sdpipe.core.scheduler.group import GroupScheduler, bounds_of
from sdpipe.core.scheduler.policy import PAIRINGS, WEIGHTINGS, WINDOW_RULES, SchedulerPolicy
from sdpipe.core.scheduler.shard import ShardedScheduler, StageShard
from sdpipe.core.scheduler.signals import Event, Group, Hurry, Join, Lost, Ready, Retune, Tick
from sdpipe.core.scheduler.stage import StageScheduler

__all__ = [
    "PAIRINGS",
    "WEIGHTINGS",
    "WINDOW_RULES",
    "DisjointSet",
    "Event",
    "Group",
    "GroupScheduler",
    "Hurry",
    "Join",
    "Lost",
    "Ready",
    "Retune",
    "SchedulerPolicy",
    "ShardedScheduler",
    "StageScheduler",
    "StageShard",
    "Tick",
    "bounds_of",
]
