"""Closing a cluster that trained: every worker process exits in time, so the nanny kills none (and warns of none)."""

import logging

import pytest
from distributed import Client, LocalCluster

import sdpipe
from sdpipe.data import digits, digits_mlp

pytestmark = pytest.mark.cluster


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_closing_a_notebook_style_cluster_after_training_warns_of_nothing(no_leaks):
    # as the notebooks do: the user's own LocalCluster of 8 workers, a 4 x 2 run, then close
    handler = _Collect()
    loggers = [logging.getLogger(n) for n in ("distributed.nanny", "distributed.worker", "distributed.core")]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        cluster = LocalCluster(n_workers=8, threads_per_worker=1, host="127.0.0.1", dashboard_address=None)
        client = Client(cluster, set_as_default=False)
        train_data, eval_data = digits()
        result = sdpipe.train(
            digits_mlp(),
            train_data,
            eval_data=eval_data,
            stages=2,
            pipelines=4,
            epochs=2,
            policy="adpsgd",
            cluster=client,
        ).result(timeout=300)
        assert result.finished_pipelines == [0, 1, 2, 3]
        sdpipe.close_cluster(client, cluster)  # as the notebooks close theirs
        assert client.status == "closed" and cluster.status.name == "closed"
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
    assert not [m for m in handler.messages if "still alive" in m or "killing" in m], handler.messages


def test_a_closing_workers_heartbeat_race_is_not_reported():
    """What sdpipe.close_cluster installs in the workers before they close: Dask's report of a heartbeat that met the
    scheduler's closed connection is dropped, any other record passes."""
    from sdpipe.driver.cluster import QuietClosing

    def record(msg):
        return logging.LogRecord("distributed.worker", logging.ERROR, __file__, 1, msg, (), None)

    quiet = QuietClosing()
    assert not quiet.filter(record("Failed to communicate with scheduler during heartbeat."))
    assert quiet.filter(record("Compute Failed"))
    assert quiet.filter(record("Worker stream died during communication: %s"))
