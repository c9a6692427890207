"""A model cut by measured time (``cuts="time"``) on a real LocalCluster."""

import pytest

import sdpipe
from sdpipe.core.partition import time_cuts
from sdpipe.data import digits, digits_cnn
from sdpipe.driver.layers import boundary_seconds, memory_of

pytestmark = pytest.mark.cluster


def test_a_run_cut_by_time_holds_the_cut_its_measured_layers_ask_for(shared_cluster):
    """The driver times each layer on a micro-batch, cuts where the slowest stage is fastest, and the run's config
    holds that cut (a checkpoint keeps it); the run trains on it.  A memory limit no cut fits is a one-line error
    before any worker starts."""
    train, _ = digits()
    run = sdpipe.train(digits_cnn(8), train, stages=3, pipelines=1, epochs=2, cuts="time", cluster=shared_cluster)
    result = run.result(timeout=300)
    costs = run.layer_costs
    assert len(costs) == len(digits_cnn(8)) and all(c.forward >= 0 and c.backward >= 0 for c in costs)
    assert isinstance(run.config.cuts, tuple) and list(run.config.cuts) == time_cuts(
        [c.seconds for c in costs], 3, boundary=boundary_seconds(costs)
    )
    assert result.config.to_dict()["cuts"] == list(run.config.cuts)
    assert len(result.history) == 2 and all(h["loss"] == h["loss"] for h in result.history)  # trained, no NaN
    largest = max(memory_of(c, run.config.microbatches) for c in costs)
    with pytest.raises(ValueError, match=r"^memory_limit: no cut into 3 stages fits 100 bytes per worker") as err:
        sdpipe.train(digits_cnn(8), train, stages=3, cuts="time", memory_limit=100, cluster=shared_cluster)
    assert f"{largest:,.0f}" in str(err.value) and "\n" not in str(err.value)
