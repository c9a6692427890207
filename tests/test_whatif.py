"""Workers sharing the machine's cores in the simulator, and a run's live predictions from its own records."""

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sdpipe
from sdpipe.data import digits, digits_mlp
from sdpipe.simulation import Costs, calibrate, cores_of, simulate

COSTS4 = Costs(
    forward=[0.002, 0.004, 0.004, 0.001],
    backward=[0.004, 0.008, 0.008, 0.002],
    optimizer=[0.001] * 4,
    weight_bytes=[4e5] * 4,
    activation_bytes=[4e4] * 3,
    step_overhead=0.001,
)


def demand(result, costs: Costs, microbatches: int = 4) -> float:
    """The cores a simulated run's workers kept busy: each step asks ``costs.cpu`` (else its compute) of a core."""
    S = costs.stages
    cpu = costs.cpu or [microbatches * (costs.forward[s] + costs.backward[s]) + costs.optimizer[s] for s in range(S)]
    return sum(cpu) * sum(result.steps.values()) / result.wall_time


@settings(max_examples=20, deadline=None)
@given(
    policy=st.sampled_from(["sdpipe", "allreduce", "none"]),
    cores=st.integers(1, 10),
    slow=st.sampled_from([1.0, 4.0]),
    extra=st.sampled_from([0.0, 0.03]),
)
def test_shared_cores_hold_the_workers_demand_within_them(policy, cores, slow, extra):
    """On ``cores`` cores the workers' demand stays within them (1% and one step's rounding over); when it fits
    without waiting, nothing changes; a core more never makes the run slower."""
    costs = Costs(**{**COSTS4.__dict__, "cpu": [0.013 * 4 + extra] * 4}) if extra else COSTS4
    h = sdpipe.Heterogeneity(slowdown={1: slow})
    kw = dict(costs=costs, steps=30, epochs=1, policy=policy, heterogeneity=h, record=False)
    alone, shared = simulate(4, 2, **kw), simulate(4, 2, cores=cores, **kw)
    if demand(alone, costs) <= cores:
        assert shared.stretch == 1.0 and shared.wall_time == alone.wall_time
    else:
        assert shared.stretch > 1.0 and demand(shared, costs) <= cores * 1.02
    assert simulate(4, 2, cores=cores + 1, **kw).wall_time <= shared.wall_time * 1.0001


@pytest.mark.parametrize("cores", [0, -1, 1.5, "2", True])
def test_bad_cores_are_named(cores):
    with pytest.raises(ValueError, match=r"^cores: must be a whole number >= 1 \(the cores the workers share\)"):
        simulate(4, 2, costs=COSTS4, cores=cores)


def test_a_simulated_run_has_no_cpu_times_to_calibrate_shared_cores_on():
    result = simulate(4, 2, costs=COSTS4, steps=5)
    with pytest.raises(ValueError, match=r"^result: its records hold no CPU times .* shared=False$"):
        calibrate(result, shared=True)


@pytest.mark.cluster
def test_a_run_measures_its_cpu_and_predicts_every_change_from_it(shared_cluster):
    """A real 2 x 2 run under allreduce with pipeline 1 slept 3x: its compute spans carry CPU seconds (never more
    than their wall time), its stage records the cores; calibrated on them, the simulator on those cores; after
    the run, ``what_if`` has a prediction for every change, each read against the run as it ran."""
    train, held_out = digits()
    run = sdpipe.train(
        digits_mlp(),
        train,
        eval_data=held_out,
        stages=2,
        pipelines=2,
        policy="allreduce",
        epochs=4,
        heterogeneity=sdpipe.Heterogeneity(slowdown={1: 3.0}),
        cluster=shared_cluster,
    )
    result = run.result(timeout=300)
    spans = [e for e in result.events if e["kind"] in ("forward", "backward", "optimizer")]
    assert spans and all(0 <= e["cpu"] <= e["end"] - e["start"] + 1e-3 for e in spans)
    assert any("process_cpu" in e for e in spans if e["kind"] == "optimizer")
    assert cores_of(result) == len(os.sched_getaffinity(0)) == run.cores
    wall = calibrate(result).costs
    costs, _, heterogeneity = calibrate(result, shared=True)
    assert heterogeneity == result.config.heterogeneity  # the nominal one: sleeping is in the model
    M = result.config.microbatches
    for s in range(2):
        assert costs.forward[s] <= wall.forward[s] + 1e-3 and costs.backward[s] <= wall.backward[s] + 1e-3
        assert costs.cpu[s] >= M * (costs.forward[s] + costs.backward[s]) + costs.optimizer[s] - 1e-9

    w = run.what_if(last=1e6)
    changes = [p.change for p in w.predictions]
    assert changes == [
        "as it runs",
        "policy sdpipe",
        "policy none",
        "no heterogeneity",
        "schedule gpipe",
        "schedule async-1f1b",
        "schedule async-2bw",
        "pipelines 3",
        "pipelines 1 (without 1)",
    ]
    assert w.measured > 0 and w.ratio("as it runs") == 1.0
    assert all(p.samples_per_s > 0 and p.stretch >= 1.0 for p in w.predictions)
    assert w.expected("policy sdpipe") == pytest.approx(w.measured * w.ratio("policy sdpipe"))
    assert w["pipelines 1 (without 1)"].config.heterogeneity.slowdown == {}
    assert "policy sdpipe" in str(w) and str(w).startswith("measured: ")
    with pytest.raises(ValueError, match=r"^last: must be a number of seconds > 0, got 0$"):
        run.predict(last=0)
    with pytest.raises(ValueError, match=r"^last: must be a number of seconds > 0, got True$"):
        run.attribution(last=True)
    with pytest.raises(ValueError, match=r"^colour: not a change a prediction takes; it takes policy, schedule"):
        run.predict(colour="red")
    with pytest.raises(KeyError, match="change: no prediction 'policy ps'"):
        w["policy ps"]
