"""Pipeline schedules as plain data.

A *plan* maps each stage of one pipeline to the ordered list of actions its
worker performs in one training step.  Every pipeline of a run walks the same
plan.  An action is a tiny value written like ``1F3`` (stage 1, forward of
micro-batch 3)::

    F   forward of a micro-batch        B   backward of a micro-batch
    SF  send the activation onward     RF  receive the activation
    SB  send the input gradient back   RB  receive the output gradient
    U   update the stage's weights (asynchronous schedules only; its number counts the updates)

Worked case, 1F1B with 2 stages and 3 micro-batches (compute only)::

    stage 0:  0F0 0F1 0B0 0F2 0B1 0B2
    stage 1:  1F0 1B0 1F1 1B1 1F2 1B2

:func:`gpipe` and :func:`one_f_one_b` build compute-only plans of one step that
ends in a flush (the step's update follows it);

The asynchronous schedules (PipeDream's 1F1B with weight stashing, ``async-1f1b``,
and its double-buffered variant PipeDream-2BW, ``async-2bw``) never flush between
steps: a stage keeps running one forward and one backward, ``S - 1 - s``
micro-batches of later steps ahead of its backwards, and updates its weights
(``U``) after every ``update_every`` backwards.  Step ``k`` of stage ``s`` is
the stretch from the forward of step ``k``'s first micro-batch to the forward of
the next step's; the backwards still owed when the run needs consistent weights
(an epoch's end, a stop, a policy switch) run in a *drain*.  Worked case, 2
stages, 2 micro-batches a step, an update after every backward (micro-batches
numbered across steps)::

    step        0                 1                 drain
    stage 0:  0F0 0F1 0B0 0U0 | 0F2 0B1 0U1 0F3 0B2 0U2 | 0B3 0U3
    stage 1:  1F0 1B0 1U0 1F1 1B1 1U1 | 1F2 1B2 1U2 1F3 1B3 1U3 |

:func:`async_step` and :func:`async_drain` give one stage's actions of a step
and of the drain (what a worker walks); :func:`async_plan` the whole plan of a
few steps, which is 1F1B over all their micro-batches plus the updates, for
the validator and the dry run (its bubble is the warm-up and the drain only).

:func:`add_communication` inserts the point-to-point actions;
:func:`validate` rejects a broken plan with a stage x time grid that marks the
step where it goes wrong; :func:`dry_run` replays a plan with per-action costs.

Sends are non-blocking (the runtime waits for them at the end of the step);
receives block until the matching send was issued.  This module imports
neither torch nor Dask.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Mapping, Union

__all__ = [
    "ASYNC_SCHEDULES",
    "COMPUTE",
    "OPS",
    "SCHEDULES",
    "Action",
    "DryRun",
    "ScheduleError",
    "add_communication",
    "async_drain",
    "async_plan",
    "async_step",
    "build_plan",
    "dry_run",
    "format_plan",
    "gpipe",
    "one_f_one_b",
    "stage_communication",
    "validate",
    "weight_versions",
]

OPS = ("F", "B", "SF", "RF", "SB", "RB", "U")
COMPUTE = ("F", "B")
_ACTION_RE = re.compile(r"^(\d+)(SF|RF|SB|RB|F|B|U)(\d+)$")

Plan = dict  # dict[int, list[Action]]


class ScheduleError(ValueError):
    """A plan that cannot run; the message holds a readable grid."""


@dataclass(frozen=True, order=True)
class Action:
    """One step of a worker: ``op`` on ``microbatch`` at ``stage``."""

    stage: int
    op: str
    microbatch: int

    def __post_init__(self):
        if self.op not in OPS:
            raise ValueError(f"op: {self.op!r} is not one of {', '.join(OPS)}")

    def __str__(self) -> str:
        return f"{self.stage}{self.op}{self.microbatch}"

    __repr__ = __str__

    @classmethod
    def from_str(cls, text: str) -> "Action":
        """Parse ``"2F0"`` back into ``Action(2, "F", 0)``."""
        m = _ACTION_RE.match(text.strip())
        if not m:
            raise ValueError(f"action: {text!r} is not of the form <stage><op><microbatch>, op one of {', '.join(OPS)}")
        return cls(int(m.group(1)), m.group(2), int(m.group(3)))


def _check_sizes(stages: int, microbatches: int) -> None:
    if not isinstance(stages, int) or stages < 1:
        raise ValueError(f"stages: must be an integer >= 1, got {stages!r}")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches: must be an integer >= 1, got {microbatches!r}")


def gpipe(stages: int, microbatches: int) -> Plan:
    """Fill-drain (GPipe): all forwards, then all backwards."""
    _check_sizes(stages, microbatches)
    return {
        s: [Action(s, "F", m) for m in range(microbatches)] + [Action(s, "B", m) for m in range(microbatches)]
        for s in range(stages)
    }


def one_f_one_b(stages: int, microbatches: int) -> Plan:
    """One-forward-one-backward with a flush at the end of the step.

    Stage ``s`` runs ``S - 1 - s`` warm-up forwards, then alternates one
    forward and one backward, then drains the remaining backwards; at most
    ``S - s`` activations are alive on a stage at once.
    """
    _check_sizes(stages, microbatches)
    plan = {}
    for s in range(stages):
        warm = min(stages - 1 - s, microbatches)
        ops = [Action(s, "F", m) for m in range(warm)]
        f, b = warm, 0
        while f < microbatches:
            ops += [Action(s, "F", f), Action(s, "B", b)]
            f += 1
            b += 1
        ops += [Action(s, "B", m) for m in range(b, microbatches)]
        plan[s] = ops
    return plan


SCHEDULES: dict[str, Callable[[int, int], Plan]] = {"gpipe": gpipe, "1f1b": one_f_one_b}

# ------------------------------------------------------------------ asynchronous (no flush)
ASYNC_SCHEDULES = ("async-1f1b", "async-2bw")


def _check_update_every(update_every: int) -> None:
    if not isinstance(update_every, int) or update_every < 1:
        raise ValueError(f"update_every: must be an integer >= 1, got {update_every!r}")


def _async_actions(stage: int, stages: int, first_f: int, end_f: int, b_range: range, update_every: int) -> list:
    """Forwards ``first_f .. end_f - 1`` and the backwards of ``b_range`` in 1F1B order, each update after
    its ``update_every``-th backward (micro-batches numbered across steps)."""
    warm = stages - 1 - stage
    # position of each action in the stage's endless 1F1B stream: F(g) at g while warming up, then 2g - warm;
    # B(i) at warm + 2i + 1
    items = [((g if g < warm else 2 * g - warm), Action(stage, "F", g)) for g in range(first_f, end_f)]
    items += [(warm + 2 * i + 1, Action(stage, "B", i)) for i in b_range]
    ops = []
    for _, a in sorted(items, key=lambda x: x[0]):
        ops.append(a)
        if a.op == "B" and (a.microbatch + 1) % update_every == 0:
            ops.append(Action(stage, "U", (a.microbatch + 1) // update_every - 1))
    return ops


def async_step(stage: int, stages: int, microbatches: int, step: int, update_every: int = 1) -> list:
    """Stage ``stage``'s compute actions of step ``step`` (0 = the first after a drain) of an asynchronous
    schedule: the forwards of the step's micro-batches and the backwards and updates that fall between
    them, ``stages - 1 - stage`` micro-batches behind (so the first steps of stage 0 warm up)."""
    _check_sizes(stages, microbatches)
    _check_update_every(update_every)
    if not 0 <= stage < stages:
        raise ValueError(f"stage: must be in 0..{stages - 1}, got {stage!r}")
    warm = stages - 1 - stage
    lo, hi = step * microbatches, (step + 1) * microbatches
    return _async_actions(stage, stages, lo, hi, range(max(0, lo - warm), max(0, hi - warm)), update_every)


def async_drain(stage: int, stages: int, microbatches: int, steps: int, update_every: int = 1) -> list:
    """The backwards stage ``stage`` still owes after ``steps`` steps, and the updates that take them in
    (a last one for a window left incomplete, so no gradient is lost)."""
    _check_sizes(stages, microbatches)
    _check_update_every(update_every)
    warm = stages - 1 - stage
    total = steps * microbatches
    ops = _async_actions(stage, stages, total, total, range(max(0, total - warm), total), update_every)
    if total % update_every:
        ops.append(Action(stage, "U", total // update_every))
    return ops


def async_plan(stages: int, microbatches: int, steps: int = 4, update_every: int = 1) -> Plan:
    """The whole plan of ``steps`` steps and the drain, compute only: what :func:`async_step` and
    :func:`async_drain` hand a worker, in one piece (1F1B over ``steps x microbatches`` micro-batches and
    the updates)."""
    _check_sizes(stages, microbatches)
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps: must be an integer >= 1, got {steps!r}")
    return {
        s: [a for k in range(steps) for a in async_step(s, stages, microbatches, k, update_every)]
        + async_drain(s, stages, microbatches, steps, update_every)
        for s in range(stages)
    }


def weight_versions(stages: int, update_every: int, stage: int = 0) -> int:
    """How many copies of its weights stage ``stage`` of an asynchronous schedule holds at most: the live
    weights (which the newest forwards use) and one per older version a micro-batch in flight still needs.

    >>> weight_versions(4, 1), weight_versions(4, 4)
    (4, 2)
    """
    in_flight = stages - stage  # forwarded, backward still to come (the warm-up plus the one in hand)
    return min(in_flight, (in_flight - 1) // update_every + 2) if update_every > 1 else in_flight


def build_plan(
    name: str, stages: int, microbatches: int, *, communication: bool = True, steps: int = 4, update_every=None
) -> Plan:
    """The validated plan of schedule ``name`` ("gpipe", "1f1b", or an asynchronous one: its ``steps`` steps
    and the drain, an update after every ``update_every`` backwards)."""
    if name in ASYNC_SCHEDULES:
        plan = async_plan(stages, microbatches, steps, update_every or default_update_every(name, stages, microbatches))
        if communication:
            plan = add_communication(plan)
        validate(plan, steps * microbatches)
        return plan
    if name not in SCHEDULES:
        raise ValueError(f"schedule: {name!r} is not one of {', '.join([*SCHEDULES, *ASYNC_SCHEDULES])}")
    plan = SCHEDULES[name](stages, microbatches)
    if communication:
        plan = add_communication(plan)
    validate(plan, microbatches)
    return plan


def default_update_every(name: str, stages: int, microbatches: int) -> int:
    """Backwards per update: PipeDream's one (``async-1f1b``); for PipeDream-2BW a step's micro-batches, at least
    the pipeline's depth, so that two weight versions suffice (``async-2bw``)."""
    return 1 if name == "async-1f1b" else max(microbatches, stages)


def add_communication(plan: Plan) -> Plan:
    """Insert the sends and receives that connect neighbouring stages."""
    return {s: stage_communication(actions, s, len(plan)) for s, actions in plan.items()}


def stage_communication(actions: list, stage: int, stages: int) -> list:
    """One stage's compute actions with the sends and receives that connect it to its neighbours."""
    s, ops = stage, []
    for a in actions:
        if a.op == "F":
            if s > 0:
                ops.append(Action(s, "RF", a.microbatch))
            ops.append(a)
            if s < stages - 1:
                ops.append(Action(s, "SF", a.microbatch))
        elif a.op == "B":
            if s < stages - 1:
                ops.append(Action(s, "RB", a.microbatch))
            ops.append(a)
            if s > 0:
                ops.append(Action(s, "SB", a.microbatch))
        elif a.op == "U":
            ops.append(a)
        else:
            raise ScheduleError(f"add_communication: plan already holds communication action {a}")
    return ops


def _has_comm(plan: Plan) -> bool:
    return any(a.op not in COMPUTE and a.op != "U" for actions in plan.values() for a in actions)


def _dependencies(a: Action, stages: int, comm: bool) -> list[Action]:
    """Actions on other stages (or earlier on this one) that ``a`` waits for."""
    s, m = a.stage, a.microbatch
    if comm:
        return {
            "RF": [Action(s - 1, "SF", m)],
            "RB": [Action(s + 1, "SB", m)],
            "SF": [Action(s, "F", m)],
            "SB": [Action(s, "B", m)],
            "B": [Action(s, "F", m)],
            "F": [],
            "U": [],
        }[a.op]
    deps = []
    if a.op == "F" and s > 0:
        deps.append(Action(s - 1, "F", m))
    if a.op == "B":
        deps.append(Action(s, "F", m))
        if s < stages - 1:
            deps.append(Action(s + 1, "B", m))
    return deps


def _expected(stages: int, microbatches: int, comm: bool) -> dict[int, set]:
    exp = {}
    for s in range(stages):
        ops = {Action(s, o, m) for o in COMPUTE for m in range(microbatches)}
        if comm:
            for m in range(microbatches):
                if s > 0:
                    ops |= {Action(s, "RF", m), Action(s, "SB", m)}
                if s < stages - 1:
                    ops |= {Action(s, "SF", m), Action(s, "RB", m)}
        exp[s] = ops
    return exp


@dataclass(frozen=True)
class DryRun:
    """What :func:`dry_run` found: timings of every action and their summary."""

    makespan: float
    bubble_fraction: float
    spans: tuple  # ((Action, start, end), ...) in start order

    def busy(self, stage: int) -> float:
        """Seconds of compute (forward and backward) on ``stage``."""
        return sum(e - b for a, b, e in self.spans if a.stage == stage and a.op in COMPUTE)


Cost = Union[float, Mapping[str, float], Callable[[Action], float]]


def _cost_fn(costs: Cost) -> Callable[[Action], float]:
    if callable(costs):
        return costs
    if isinstance(costs, Mapping):
        unknown = set(costs) - set(OPS)
        if unknown:
            raise ValueError(f"costs: unknown ops {sorted(unknown)}; allowed {', '.join(OPS)}")
        table = {"F": 1.0, "B": 2.0, "SF": 0.0, "RF": 0.0, "SB": 0.0, "RB": 0.0, "U": 0.0, **costs}
        return lambda a: float(table[a.op])
    return lambda a: float(costs)


def _simulate(plan: Plan, cost: Callable[[Action], float]):
    """Replay ``plan``; returns (finish times, stuck actions per stage)."""
    stages = len(plan)
    comm = _has_comm(plan)
    finish: dict[Action, float] = {}
    pos = {s: 0 for s in plan}
    free = {s: 0.0 for s in plan}
    spans = []
    progress = True
    while progress:
        progress = False
        for s in sorted(plan):
            actions = plan[s]
            while pos[s] < len(actions):
                a = actions[pos[s]]
                deps = _dependencies(a, stages, comm)
                if any(d not in finish for d in deps):
                    break
                start = max([free[s]] + [finish[d] for d in deps])
                end = start + max(0.0, cost(a))
                finish[a] = end
                free[s] = end
                spans.append((a, start, end))
                pos[s] += 1
                progress = True
    stuck = {s: plan[s][pos[s]] for s in plan if pos[s] < len(plan[s])}
    return finish, spans, stuck


def format_plan(plan: Plan, mark: Mapping[int, Action] | None = None) -> str:
    """The plan as a stage x time grid, one unit of time per action.

    Actions in ``mark`` are shown as ``>1B0<``: each is the first action of its
    stage that cannot run.
    """
    _finish, spans, stuck = _simulate(plan, lambda a: 1.0)
    mark = dict(mark or {})
    width = max([len(str(a)) for acts in plan.values() for a in acts] + [3]) + 2
    cols = int(max([e for _, _, e in spans] + [0]))
    ncols = cols + (1 if stuck else 0)
    grid = {s: ["."] * ncols for s in plan}
    for a, b, _ in spans:
        grid[a.stage][int(b)] = str(a)
    for s, a in mark.items():
        col = max([int(e) for x, _, e in spans if x.stage == s] + [0])
        grid[s][min(col, ncols - 1)] = f">{a}<"
    head = "t      " + "".join(f"{t:<{width}}" for t in range(ncols))
    rows = [f"stage {s} " + "".join(f"{c:<{width}}" for c in grid[s]) for s in sorted(plan)]
    return "\n".join([head, *rows])


def _check_updates(plan: Plan, s: int, actions: list) -> None:
    """A stage's updates: numbered 0, 1, ... in order, each after a backward, no backward after the last."""
    if not any(a.op == "U" for a in actions):
        return
    count, since = 0, 0
    for a in actions:
        if a.op == "B":
            since += 1
        elif a.op == "U":
            if a.microbatch != count:
                raise ScheduleError(
                    f"plan: stage {s}'s update {a} comes where update {count} is due\n{format_plan(plan)}"
                )
            if since == 0:
                raise ScheduleError(f"plan: stage {s}'s update {a} takes in no backward\n{format_plan(plan)}")
            count, since = count + 1, 0
    if since:
        raise ScheduleError(f"plan: stage {s} ends with {since} backward(s) no update takes in\n{format_plan(plan)}")


def validate(plan: Plan, microbatches: int) -> None:
    """Raise :class:`ScheduleError` unless ``plan`` runs to completion.

    Checks that stages are numbered 0..S-1, every action sits on its own
    stage, each expected action occurs exactly once, and that replaying the
    plan never deadlocks (a receive whose send never comes, a backward before
    its forward).  Updates (``U``, asynchronous plans) must be numbered in
    order, each take in at least one backward, and leave none behind.
    """
    if not isinstance(plan, Mapping) or not plan:
        raise ScheduleError("plan: must be a non-empty mapping of stage -> list of actions")
    stages = len(plan)
    if sorted(plan) != list(range(stages)):
        raise ScheduleError(f"plan: stages must be numbered 0..{stages - 1}, got {sorted(plan)}")
    comm = _has_comm(plan)
    expected = _expected(stages, microbatches, comm)
    for s, actions in plan.items():
        for a in actions:
            if not isinstance(a, Action):
                raise ScheduleError(f"plan: stage {s} holds {a!r}, not an Action")
            if a.stage != s:
                raise ScheduleError(f"plan: action {a} is listed under stage {s}")
        _check_updates(plan, s, actions)
        seen = [a for a in actions if a.op != "U"]
        dup = sorted({a for a in seen if seen.count(a) > 1})
        missing = sorted(expected[s] - set(seen))
        extra = sorted(set(seen) - expected[s])
        if dup or missing or extra:
            parts = []
            if dup:
                parts.append(f"repeats {', '.join(map(str, dup))}")
            if missing:
                parts.append(f"misses {', '.join(map(str, missing))}")
            if extra:
                parts.append(f"has unexpected {', '.join(map(str, extra))}")
            raise ScheduleError(f"plan: stage {s} {'; '.join(parts)}\n{format_plan(plan)}")
    _, _, stuck = _simulate(plan, lambda a: 1.0)
    if stuck:
        why = "; ".join(
            f"stage {s} waits at {a} for {', '.join(str(d) for d in _dependencies(a, stages, comm))}"
            for s, a in sorted(stuck.items())
        )
        raise ScheduleError(f"plan deadlocks: {why}\n{format_plan(plan, stuck)}")


def dry_run(plan: Plan, costs: Cost = None) -> DryRun:
    """Replay ``plan`` with per-action costs (seconds) and summarize it.

    ``costs`` is a number for every action, a mapping op -> seconds (defaults
    F=1, B=2, communication 0) or a function of the action.  The bubble
    fraction is the share of ``stages x makespan`` not spent in forward or
    backward compute.

    >>> dry_run(gpipe(2, 2), {"F": 1, "B": 1}).makespan
    6.0
    """
    cost = _cost_fn({} if costs is None else costs)
    microbatches = 1 + max(a.microbatch for acts in plan.values() for a in acts)
    validate(plan, microbatches)
    _, spans, _ = _simulate(plan, cost)
    spans.sort(key=lambda x: (x[1], x[0].stage))
    makespan = max(e for _, _, e in spans) if spans else 0.0
    busy = sum(e - b for a, b, e in spans if a.op in COMPUTE)
    bubble = 1.0 - busy / (len(plan) * makespan) if makespan > 0 else 0.0
    return DryRun(makespan=makespan, bubble_fraction=bubble, spans=tuple(spans))
