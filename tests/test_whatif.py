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
    # stage 0's compute in CPU seconds (a later stage's also holds a share of its thread's time around it)
    assert costs.forward[0] <= wall.forward[0] + 1e-3 and costs.backward[0] <= wall.backward[0] + 1e-3
    for s in range(2):
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
    # the cores: the machine's less what the other processes took, measured; fitted where asked
    assert w.cores_from == "measured" and w.cores == pytest.approx(max(0.1 * run.cores, run.cores - w.others))
    assert all(p.cores == w.cores for p in w.predictions)
    fitted = run.what_if(last=1e6, cores="fitted")
    assert fitted.cores_from == "fitted" and 0 < fitted.cores <= run.cores and str(fitted).count("(fitted)") == 1
    assert run.predict(last=1e6, cores=1.25).cores == 1.25
    with pytest.raises(ValueError, match=r"^cores: must be one of measured, fitted, machine or a number of cores"):
        run.predict(cores="all")
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


def test_shared_costs_put_a_later_stages_thread_time_beyond_its_compute_into_its_forward_and_backward():
    """``calibrate(shared=True)`` on recorded spans: stage 0's training thread beyond its compute is the step's
    overhead; a later stage's is shared equally among its forwards and backwards (it is on the pipeline's path);
    the process's CPU beyond the thread stays ``costs.cpu``'s load."""
    M, fwd, bwd, opt = 2, [0.002, 0.003], [0.004, 0.006], [0.001, 0.002]
    thread, process = [0.020, 0.030], [0.050, 0.040]
    recs = []
    for epoch, step in itertools.product(range(2), range(5)):
        t = 1.0 * (epoch * 5 + step)
        for s in range(2):
            for m in range(M):
                recs.append(
                    {
                        "kind": "forward",
                        "pipeline": 0,
                        "stage": s,
                        "step": step,
                        "microbatch": m,
                        "start": t,
                        "end": t + 2 * fwd[s],
                        "cpu": fwd[s],
                    }
                )
                recs.append(
                    {
                        "kind": "backward",
                        "pipeline": 0,
                        "stage": s,
                        "step": step,
                        "microbatch": m,
                        "start": t,
                        "end": t + 2 * bwd[s],
                        "cpu": bwd[s],
                    }
                )
            recs.append({"kind": "optimizer", "pipeline": 0, "stage": s, "step": step, "epoch": epoch,
                         "start": t + 0.5, "end": t + 0.5 + opt[s], "cpu": opt[s], "step_cpu": thread[s],
                         "process_cpu": process[s]})  # fmt: skip
        recs.append(events.epoch(0, 1, step, t + 0.9, {"epoch": epoch, "pipeline": 0}))
    config = TrainConfig(stages=2, pipelines=1, microbatches=M, epochs=2)
    costs = calibrate(RunResult(models=[], history=[], events=recs, config=config, wall_time=10.0), shared=True).costs
    own = [M * (fwd[s] + bwd[s]) + opt[s] for s in range(2)]
    around = (thread[1] - own[1]) / (2 * M)
    assert costs.forward == pytest.approx([fwd[0], fwd[1] + around])
    assert costs.backward == pytest.approx([bwd[0], bwd[1] + around])
    assert costs.step_overhead == pytest.approx(thread[0] - own[0])
    assert costs.cpu == pytest.approx(process)  # the whole process per step: the thread and the rest


@pytest.mark.parametrize("cores", [0.5, 1.0, 1.5])
def test_the_load_of_a_workers_threads_falls_in_its_own_steps_not_in_its_sleep(cores):
    """A pipeline slept 1x, 2x or 8x computes the same steps with more idle time between them: the stretch its
    timeline asks for is the same (its threads' load comes with its steps; spread over the whole run, a longer
    sleep would thin it out)."""
    costs = Costs(forward=[0.002, 0.003], backward=[0.004, 0.006], optimizer=[0.001, 0.001], cpu=[0.05, 0.06])
    plan = _step_plan(TrainConfig(stages=2, pipelines=1, policy="none"))
    own = [4 * (costs.forward[s] + costs.backward[s]) + costs.optimizer[s] for s in range(2)]
    extra = [costs.cpu[s] - own[s] for s in range(2)]
    asked = []
    for f in (1.0, 2.0, 8.0):
        h = sdpipe.Heterogeneity(slowdown={0: f})
        run = simulate(2, 1, costs=costs, steps=20, epochs=1, policy="none", heterogeneity=h, record=True)
        asked.append(_wanted_stretch(run, costs, sdpipe.Network(), plan, h, extra, cores))
    assert asked[0] > 1.0
    assert asked[1] == pytest.approx(asked[0], rel=1e-9) and asked[2] == pytest.approx(asked[0], rel=1e-9)


@pytest.mark.parametrize("cores", ["all", 0, -1.0, float("nan"), True, None])
def test_a_prediction_refuses_cores_it_cannot_take(cores):
    source = Source(simulate(2, 2, costs=Costs(forward=[0.001] * 2, backward=[0.002] * 2),
                             steps=3).events, TrainConfig(stages=2, pipelines=2), 2, 4)  # fmt: skip
    with pytest.raises(ValueError, match=r"^cores: must be one of measured, fitted, machine or a number of cores > 0"):
        what_if(source, cores=cores)


def test_the_table_says_how_its_cores_were_found():
    from sdpipe.simulation.whatif import WhatIf

    def head(how, others=0.3):
        return str(WhatIf(1000.0, [], 0.0, 10.0, 1.5, 2, others, how)).splitlines()[0]

    assert head("measured").endswith("the workers got 1.5 of the 2 cores (other processes took 0.3, measured)")
    assert head("fitted", None).endswith("(fitted)")
    assert head("machine").endswith("(all of them, as asked)") and head("given").endswith("(as given)")
