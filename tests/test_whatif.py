"""Workers sharing the machine's cores in the simulator, and a run's live predictions from its own records."""

import itertools
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sdpipe
from sdpipe.config import TrainConfig
from sdpipe.data import digits, digits_mlp
from sdpipe.driver.result import RunResult
from sdpipe.simulation import Costs, calibrate, cores_of, others_cores, simulate
from sdpipe.simulation.costs import _step_plan, _wanted_stretch, stretch_compute
from sdpipe.simulation.whatif import Source, renumbered, what_if
from sdpipe.wire import events

COSTS4 = Costs(
    forward=[0.002, 0.004, 0.004, 0.001],
    backward=[0.004, 0.008, 0.008, 0.002],
    optimizer=[0.001] * 4,
    weight_bytes=[4e5] * 4,
    activation_bytes=[4e4] * 3,
    step_overhead=0.001,
)


@settings(max_examples=20, deadline=None)
@given(
    policy=st.sampled_from(["sdpipe", "allreduce", "none"]),
    cores=st.floats(0.5, 10),
    slow=st.sampled_from([1.0, 4.0]),
    extra=st.sampled_from([0.0, 0.03]),
)
def test_shared_cores_stretch_compute_as_the_timeline_asks(policy, cores, slow, extra):
    """On ``cores`` cores the compute is stretched by the factor its own timeline asks for (the mean over its
    computing instants of ``(workers computing + the other threads' cores) / cores``, at least 1); with a core
    for every worker and their threads nothing changes; without groups to form differently, more cores never
    make the run slower."""
    costs = Costs(**{**COSTS4.__dict__, "cpu": [0.013 * 4 + extra] * 4}) if extra else COSTS4
    h = sdpipe.Heterogeneity(slowdown={1: slow})
    kw = dict(costs=costs, steps=30, epochs=1, policy=policy, heterogeneity=h, record=False)
    alone, shared = simulate(4, 2, **kw), simulate(4, 2, cores=cores, **kw)
    assert shared.stretch >= 1.0
    # in lock step only: under sdpipe a stretch can also form other groups, which may be faster; under none the
    # pipelines share the batches by their speed, and another split can end sooner
    if policy == "allreduce":
        assert shared.wall_time >= alone.wall_time * 0.9999
        assert simulate(4, 2, cores=cores + 1, **kw).wall_time <= shared.wall_time * 1.02
    roomy = simulate(4, 2, cores=8 + 8 * 0.03 / 0.01, **kw)  # every worker and its threads, at their busiest
    assert roomy.stretch == 1.0 and roomy.wall_time == alone.wall_time
    plan, net = _step_plan(TrainConfig(stages=4, pipelines=2, policy=policy)), sdpipe.Network()
    recorded = simulate(4, 2, cores=cores, **{**kw, "record": True})
    own = [4 * (costs.forward[s] + costs.backward[s]) + costs.optimizer[s] for s in range(4)]
    own[0] += costs.step_overhead
    rest = [max(0.0, (costs.cpu or own)[s] - own[s]) for s in range(4)]
    asked = _wanted_stretch(recorded, stretch_compute(costs, recorded.stretch), net, plan, h, rest, cores)
    assert asked == pytest.approx(recorded.stretch, rel=0.03) or (recorded.stretch == 1.0 and asked <= 1.0 + 1e-9)


@pytest.mark.parametrize("cores", [0, -1, float("inf"), "2", True])
def test_bad_cores_are_named(cores):
    with pytest.raises(ValueError, match=r"^cores: must be a number > 0 \(the cores the workers share\) or None"):
        simulate(4, 2, costs=COSTS4, cores=cores)


def test_a_simulated_run_has_no_cpu_times_to_calibrate_shared_cores_on():
    result = simulate(4, 2, costs=COSTS4, steps=5)
    with pytest.raises(ValueError, match=r"^result: its records hold no CPU times .* shared=False$"):
        calibrate(result, shared=True)


def busy_steps(pipeline: int, stage: int, machine: float, own: float, address: str = "10.0.0.1") -> list:
    """A worker's stage record and 11 optimizer spans a second apart, the machine busy ``machine`` CPU seconds and
    the worker's process ``own`` in each second."""
    return [events.stage_info(pipeline, stage, 0.0, 100, 10, address, 2)] + [
        {"kind": "optimizer", "pipeline": pipeline, "stage": stage, "step": k, "epoch": 0, "start": k + 0.9,
         "end": k + 1.0, "cpu": 0.01, "step_cpu": own, "process_cpu": own, "machine_cpu": machine}
        for k in range(11)
    ]  # fmt: skip


def test_the_other_processes_cores_are_the_machines_busy_cpu_less_the_workers():
    run = RunResult(models=[], history=[], events=busy_steps(0, 0, 1.5, 0.5) + busy_steps(0, 1, 1.5, 0.25),
                    config=None, wall_time=11.0)  # fmt: skip
    assert others_cores(run) == pytest.approx(0.75)  # 1.5 busy - 0.5 - 0.25 the workers'
    two_hosts = busy_steps(0, 0, 1.5, 0.5) + busy_steps(0, 1, 1.5, 0.25, address="10.0.0.2")
    assert others_cores(RunResult(models=[], history=[], events=two_hosts, config=None, wall_time=11.0)) is None
    older = [{k: v for k, v in e.items() if k != "machine_cpu"} for e in busy_steps(0, 0, 1.5, 0.5)]
    assert others_cores(RunResult(models=[], history=[], events=older, config=None, wall_time=11.0)) is None


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
    for p, s in itertools.product(range(2), range(2)):  # the machine was busy at least while the worker ran
        steps = [e for e in spans if e["kind"] == "optimizer" and (e["pipeline"], e["stage"]) == (p, s)]
        assert sum(e["machine_cpu"] for e in steps[1:]) >= 0.9 * sum(e["process_cpu"] for e in steps[1:]) > 0
    assert 0.0 <= others_cores(result) < run.cores
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
    assert 0.0 <= w.others < run.cores and "other processes took" in str(w)
    with pytest.raises(ValueError, match=r"^last: must be a number of seconds > 0, got 0$"):
        run.predict(last=0)
    with pytest.raises(ValueError, match=r"^last: must be a number of seconds > 0, got True$"):
        run.attribution(last=True)
    with pytest.raises(ValueError, match=r"^colour: not a change a prediction takes; it takes policy, schedule"):
        run.predict(colour="red")
    with pytest.raises(KeyError, match="change: no prediction 'policy ps'"):
        w["policy ps"]


def test_a_run_a_pipeline_left_is_predicted_on_the_pipelines_still_there():
    """Pipeline 1 of 3 left: the simulator takes pipelines 0 and 2 as 0 and 1, with their records and
    heterogeneity; pipeline 1's records are left out; a row that leaves one out names it by the run's id."""
    h = sdpipe.Heterogeneity(slowdown={2: 4.0, (1, 0): 2.0})
    result = simulate(4, 3, costs=COSTS4, steps=40, epochs=2, policy="sdpipe", heterogeneity=h)
    timed = [{**e, "cpu": e["end"] - e["start"]} if e["kind"] in ("forward", "backward", "optimizer") else e
             for e in result.events]  # fmt: skip
    timed = [{**e, "step_cpu": 0.02, "process_cpu": 0.03} if e["kind"] == "optimizer" else e for e in timed]
    source = Source(timed, result.config, 2, 40)
    assert renumbered(source, [0, 1, 2]) is source
    two = renumbered(source, [0, 2])
    assert two.config.pipelines == 2 and two.ids == [0, 2]
    assert two.config.heterogeneity.slowdown == {1: 4.0}
    was = {(e["kind"], e["start"], e.get("stage")) for e in timed if e.get("pipeline") == 2}
    assert {(e["kind"], e["start"], e.get("stage")) for e in two.events if e.get("pipeline") == 1} == was
    assert all(e.get("pipeline") in (None, 0, 1) for e in two.events)
    assert all(set(e["group"]) <= {0, 1} for e in two.events if isinstance(e.get("group"), list))
    w = what_if(two, since=0.0)
    assert [p.change for p in w.predictions][-2:] == ["pipelines 3", "pipelines 1 (without 2)"]
    assert w.measured > 0 and all(p.samples_per_s > 0 for p in w.predictions)
