"""Schedules as data: pure tests, no torch.distributed, no Dask."""

import subprocess
import sys

import pytest

from sdpipe.schedule import (
    Action,
    ScheduleError,
    add_communication,
    build_plan,
    dry_run,
    format_plan,
    gpipe,
    one_f_one_b,
    validate,
)


def test_pure_modules_import_without_torch_or_dask():
    code = (
        "import sys; import sdpipe.schedule, sdpipe.partition, sdpipe.config;"
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
