"""Emulated heterogeneity inside a worker's step (sdpipe.worker.pace): what is stretched, what is not, and by whom.

Only lower bounds on sleeps are asserted (``time.sleep`` never returns early) and upper bounds far above what the
measured work could give, so no assertion depends on the machine's speed."""

import time

from sdpipe import Heterogeneity
from sdpipe.worker.pace import Pace


def test_a_step_is_stretched_by_its_own_time_and_not_by_its_waits():
    pace = Pace()
    pace.begin(3.0)
    time.sleep(0.02)  # the step's own work
    slept = pace.end()
    assert slept >= 2 * 0.02 and pace.slept == slept

    pace.begin(4.0)
    with pace.waiting():  # waiting for another pipeline: not the step's own time
        time.sleep(0.2)
    assert pace.end() < 0.2


def test_an_unslowed_step_never_sleeps():
    pace = Pace()
    pace.begin(1.0)
    time.sleep(0.01)
    with pace.waiting():
        pass
    assert pace.end() == 0.0 and pace.slept == 0.0


def test_a_straggle_is_slept_after_the_next_compute_and_recorded():
    pace, spans = Pace(), []
    pace.begin(1.0)
    pace.straggle(0.03, record=lambda start, end: spans.append(end - start))
    assert spans == []  # nothing is slept before the step's next forward or backward
    pace.computed()
    assert len(spans) == 1 and spans[0] >= 0.03
    pace.computed()  # slept once
    assert len(spans) == 1
    fresh = Pace()  # (a sleep's overrun is taken off the next one: a fresh pace owes nothing)
    fresh.begin(1.0)
    fresh.straggle(0.01)
    t = time.perf_counter()
    fresh.end()  # a step without compute sleeps its straggle at its end
    assert time.perf_counter() - t >= 0.01


def test_a_pipelines_slowdown_stretches_its_stage_0_alone_and_a_workers_key_its_own():
    h = Heterogeneity(slowdown={1: 4.0, (2, 1): 2.0, (1, 1): 3.0})
    assert [h.stretch_of(1, s) for s in range(3)] == [4.0, 3.0, 1.0]
    assert [h.stretch_of(2, s) for s in range(3)] == [1.0, 2.0, 1.0]
    assert [h.stretch_of(0, s) for s in range(3)] == [1.0, 1.0, 1.0]
    assert h.slowdown_of(1, 2) == 4.0  # the pipeline is slowed as a whole: its later stages wait for stage 0
