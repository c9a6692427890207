"""Schedules as data: pure tests, no torch.distributed, no Dask."""

import subprocess
import sys

import pytest

from sdpipe.core.schedule import (
    Action,
    ScheduleError,
    add_communication,
    async_drain,
    async_plan,
    async_step,
    build_plan,
    dry_run,
    format_plan,
    gpipe,
    one_f_one_b,
    validate,
    weight_versions,
)


def test_pure_modules_import_without_torch_or_dask():
    code = (
        "import sys; import sdpipe.core.schedule, sdpipe.core.partition, sdpipe.config;"
        "bad=[m for m in ('torch','distributed','dask') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_action_round_trips_through_text():
    for a in [Action(2, "F", 0), Action(0, "RB", 11), Action(13, "SF", 3)]:
        assert Action.from_str(str(a)) == a
    with pytest.raises(ValueError, match="action"):
        Action.from_str("2X0")
    with pytest.raises(ValueError, match="op"):
        Action(0, "Q", 0)


@pytest.mark.parametrize("build", [gpipe, one_f_one_b])
@pytest.mark.parametrize("S,M", [(1, 1), (2, 4), (3, 2), (4, 8), (5, 3)])
def test_builtin_plans_are_complete_and_valid(build, S, M):
    plan = build(S, M)
    validate(plan, M)
    for s, acts in plan.items():
        assert sorted(acts) == sorted([Action(s, o, m) for o in "FB" for m in range(M)])
        for m in range(M):
            assert acts.index(Action(s, "F", m)) < acts.index(Action(s, "B", m))
    validate(add_communication(plan), M)


def test_one_f_one_b_order_and_memory():
    plan = one_f_one_b(4, 8)
    assert [str(a) for a in plan[3][:4]] == ["3F0", "3B0", "3F1", "3B1"]
    assert [str(a) for a in plan[0][:5]] == ["0F0", "0F1", "0F2", "0F3", "0B0"]
    for s, acts in plan.items():  # at most S - s activations alive on stage s
        alive = peak = 0
        for a in acts:
            alive += 1 if a.op == "F" else -1
            peak = max(peak, alive)
        assert peak == min(4 - s, 8)


def test_gpipe_keeps_all_activations():
    plan = gpipe(3, 5)
    assert [a.op for a in plan[1]] == ["F"] * 5 + ["B"] * 5


def test_communication_pairs_neighbours():
    plan = add_communication(one_f_one_b(3, 2))
    assert [str(a) for a in plan[0]][:2] == ["0F0", "0SF0"]
    assert str(plan[2][0]) == "2RF0"
    assert all(a.op not in ("RF", "SB") for a in plan[0])
    assert all(a.op not in ("SF", "RB") for a in plan[2])
    with pytest.raises(ScheduleError, match="already holds communication"):
        add_communication(plan)


def test_deadlock_is_reported_with_marked_grid():
    plan = one_f_one_b(2, 2)
    plan[1] = [Action(1, "F", 1), Action(1, "B", 1), Action(1, "F", 0), Action(1, "B", 0)]
    plan[0] = [Action(0, "F", 0), Action(0, "B", 0), Action(0, "F", 1), Action(0, "B", 1)]
    with pytest.raises(ScheduleError) as err:
        validate(plan, 2)
    msg = str(err.value)
    assert "deadlocks" in msg and ">0B0<" in msg and ">1F1<" in msg
    assert "stage 0" in msg.splitlines()[2] and "stage 1" in msg.splitlines()[3]


def test_missing_and_misplaced_actions_are_rejected():
    plan = gpipe(2, 2)
    plan[0] = plan[0][:-1]
    with pytest.raises(ScheduleError, match="misses 0B1"):
        validate(plan, 2)
    plan = gpipe(2, 2)
    plan[0] = plan[0] + [Action(1, "F", 0)]
    with pytest.raises(ScheduleError, match="listed under stage 0"):
        validate(plan, 2)
    with pytest.raises(ScheduleError, match="numbered"):
        validate({1: []}, 1)


def test_dry_run_makespan_and_bubble():
    # GPipe S=2 M=2, F=B=1: 0F0 0F1 | 1F0 1F1 1B0 1B1 | 0B0 0B1 -> 6 units, bubble 1/3
    r = dry_run(gpipe(2, 2), {"F": 1, "B": 1})
    assert r.makespan == 6.0
    assert r.bubble_fraction == pytest.approx(1 / 3)
    # the classic bubble (S-1)/(M+S-1) for equal F and B costs
    for S, M in [(4, 8), (3, 12)]:
        for build in (gpipe, one_f_one_b):
            r = dry_run(build(S, M), {"F": 1, "B": 1})
            assert r.bubble_fraction == pytest.approx((S - 1) / (M + S - 1))
    # communication costs lengthen the makespan
    plan = build_plan("1f1b", 3, 4)
    assert dry_run(plan, {"F": 1, "B": 2, "RF": 0.5, "RB": 0.5}).makespan > dry_run(plan, {"F": 1, "B": 2}).makespan
    assert dry_run(plan, lambda a: 1.0).busy(0) == 8.0


def test_build_plan_rejects_unknown_names():
    with pytest.raises(ValueError, match="schedule: 'zigzag' is not one of gpipe, 1f1b"):
        build_plan("zigzag", 2, 2)
    with pytest.raises(ValueError, match="microbatches"):
        gpipe(2, 0)


def test_format_plan_is_a_grid():
    text = format_plan(one_f_one_b(2, 3))
    lines = text.splitlines()
    assert lines[0].startswith("t") and len(lines) == 3
    assert lines[1].split()[2:] == ["0F0", "0F1", ".", "0B0", "0F2", "0B1", ".", "0B2"]


# ------------------------------------------------------------------ asynchronous schedules (no flush)
@pytest.mark.parametrize("S,M", [(1, 1), (2, 4), (3, 2), (4, 1), (4, 8)])
@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("every", [1, 2, 4])
def test_async_plan_is_one_f_one_b_over_all_steps_with_updates(S, M, steps, every):
    """Without flush, the steps and the drain together are 1F1B over all their micro-batches; the updates
    come after every ``every``-th backward and once more for a window the drain leaves incomplete."""
    plan = async_plan(S, M, steps, every)
    assert {s: [a for a in acts if a.op != "U"] for s, acts in plan.items()} == one_f_one_b(S, steps * M)
    total = steps * M
    for acts in plan.values():
        updates = [i for i, a in enumerate(acts) if a.op == "U"]
        assert [acts[i].microbatch for i in updates] == list(range(-(-total // every)))
        backwards_before = [sum(a.op == "B" for a in acts[:i]) for i in updates]
        assert backwards_before == [min(total, (k + 1) * every) for k in range(len(updates))]
    validate(add_communication(plan), total)  # no deadlock, every action once, updates in order


def test_async_step_cuts_the_stream_at_each_steps_first_forward():
    """Step k of a stage starts with the forward of its own first micro-batch; stage 0 warms up S - 1
    micro-batches ahead, so its backwards of a step's last micro-batches fall into the next step."""
    assert [str(a) for a in async_step(0, 2, 2, 0, 1)] == ["0F0", "0F1", "0B0", "0U0"]
    assert [str(a) for a in async_step(0, 2, 2, 1, 1)] == ["0F2", "0B1", "0U1", "0F3", "0B2", "0U2"]
    assert [str(a) for a in async_drain(0, 2, 2, 2, 1)] == ["0B3", "0U3"]
    assert [str(a) for a in async_step(1, 2, 2, 1, 1)] == ["1F2", "1B2", "1U2", "1F3", "1B3", "1U3"]
    assert async_drain(1, 2, 2, 2, 1) == []  # the last stage owes nothing
    assert [str(a) for a in async_step(1, 3, 4, 0, 4)] == ["1F0", "1F1", "1B0", "1F2", "1B1", "1F3", "1B2"]
    assert [str(a) for a in async_drain(1, 3, 4, 1, 4)] == ["1B3", "1U0"]


def test_async_dry_run_bubble_is_warm_up_and_drain_only():
    for S, M in [(2, 4), (4, 2)]:
        flush = dry_run(build_plan("1f1b", S, M), {"F": 1, "B": 1})
        assert flush.bubble_fraction == pytest.approx((S - 1) / (M + S - 1))
        for steps in (4, 16):
            run = dry_run(build_plan("async-1f1b", S, M, steps=steps), {"F": 1, "B": 1})
            assert run.bubble_fraction == pytest.approx((S - 1) / (steps * M + S - 1))
            # per step, the steady state beats a flush by (M + S - 1) / M as the steps grow
            assert run.makespan < steps * flush.makespan
    with pytest.raises(ValueError, match="update_every"):
        async_step(0, 2, 2, 0, 0)


def test_weight_versions_of_stashing_and_double_buffering():
    """Versions a stage stashes: one per micro-batch in flight with an update after each backward (PipeDream),
    two once an update takes in at least the pipeline's depth of backwards (PipeDream-2BW)."""
    assert [weight_versions(4, 1, s) for s in range(4)] == [4, 3, 2, 1]
    assert [weight_versions(4, 4, s) for s in range(4)] == [2, 2, 2, 1]
    assert weight_versions(3, 8) == 2


def test_updates_out_of_order_or_left_behind_are_rejected():
    plan = async_plan(2, 2, 1, 1)
    bad = {**plan, 0: [a for a in plan[0] if str(a) != "0U0"]}
    with pytest.raises(ScheduleError, match="0U1 comes where update 0 is due"):
        validate(bad, 2)
    bad = {**plan, 1: plan[1][:-1]}  # the last backward's update missing
    with pytest.raises(ScheduleError, match="ends with 1 backward"):
        validate(bad, 2)
