"""sdpipe on a multi-host Dask cluster: emulated hosts (network namespaces on a bridge, real TCP between
distinct addresses), a host that disappears, and links and CPUs limited by the kernel."""

import subprocess
import sys
import time

import pytest

import sdpipe
from sdpipe.data import digits, digits_mlp
from sdpipe.hosts import EmulatedHosts, cpu_shaping_unavailable, leftovers, unavailable

from helpers import wait_for_epoch

WHY = unavailable()
pytestmark = [pytest.mark.cluster, pytest.mark.hosts, pytest.mark.skipif(WHY is not None, reason=str(WHY))]


@pytest.fixture(scope="module")
def data():
    return digits()


@pytest.fixture(scope="module")
def hosts():
    """A scheduler host and two worker hosts with two workers each."""
    h = EmulatedHosts([2, 2])
    yield h
    h.close()
    assert_removed(h)


def assert_removed(h):
    """No namespace, link or cgroup of ``h`` is left, and none of its processes runs."""
    left = [name for names in leftovers().values() for name in names if h.id in name]
    assert not left, left
    assert all(p.poll() is not None for _, p in h._procs)


@pytest.mark.parametrize("policy", ["sdpipe", "allreduce"])
def test_training_on_emulated_hosts_uses_each_hosts_own_address(data, hosts, policy):
    from distributed import Client

    train_data, eval_data = data
    run = sdpipe.train(
        digits_mlp(), train_data, eval_data=eval_data, stages=2, pipelines=2, policy=policy, epochs=10, cluster=hosts
    )
    # the store listens on the driver's address toward the scheduler: the bridge's, not loopback
    wait_for_epoch(run, 0)
    assert run.store_host == hosts.driver_address

    def tcp_sockets():  # runs in each worker process (nested, so it travels by value)
        import psutil

        return [
            (c.status, tuple(c.laddr), tuple(c.raddr) if c.raddr else None)
            for c in psutil.Process().net_connections("tcp")
        ]

    with Client(hosts.scheduler_address, set_as_default=False) as c:
        seen = c.run(tcp_sockets, workers=run._workers)
    result = run.result(timeout=300)

    final = [h for h in result.history if h["epoch"] == 9]
    assert len(final) == 2 and all(h["accuracy"] >= 0.95 for h in final), final
    if policy == "allreduce":
        assert result.max_param_diff() < 1e-6
    # each worker says it bound its sockets to its own host's address (the host part of its Dask address)
    bound = {(e["pipeline"], e["stage"]): e["address"] for e in result.events if e["kind"] == "stage"}
    for rank, addr in enumerate(run._workers):
        assert bound[divmod(rank, 2)] == hosts.addresses[hosts.host_of(addr)]
    # and its sockets, read in the worker process itself, agree: every TCP socket is on its own address, it is
    # connected to the store on the driver's, and its tensors' peers (gloo) are the other workers' hosts
    worker_hosts = {hosts.addresses[1], hosts.addresses[2]}
    dask_ports = {int(a.rsplit(":", 1)[1]) for a in run._workers}
    ip = lambda a: (a[0].removeprefix("::ffff:"), a[1]) if a else a  # IPv4 as a dual-stack socket shows it
    for addr, socks in seen.items():
        socks = [(status, ip(local), ip(remote)) for status, local, remote in socks]
        own = hosts.addresses[hosts.host_of(addr)]
        established = [(local, remote) for status, local, remote in socks if status == "ESTABLISHED"]
        assert established and all(local[0] == own for local, _ in established), (addr, socks)
        assert any(remote == (hosts.driver_address, run.store_port) for _, remote in established), (addr, socks)
        ours = [
            (local, remote)
            for local, remote in established
            if remote[0] in worker_hosts and local[1] not in dask_ports and remote[1] not in dask_ports
        ]
        assert ours, f"{addr}: no connection to another worker outside Dask's ports: {socks}"
        listening = [local for status, local, _ in socks if status == "LISTEN" and local[1] not in dask_ports]
        assert all(ip in (own, "0.0.0.0") for ip, _ in listening), (addr, listening)  # 0.0.0.0: Dask's HTTP routes


def test_a_worker_that_cannot_reach_the_store_fails_in_one_line(data, hosts):
    """host= forced to loopback: the store listens on the driver's loopback, which no other host reaches."""
    train_data, _ = data
    start = time.monotonic()
    run = sdpipe.train(
        digits_mlp(), train_data, stages=2, pipelines=2, policy="sdpipe", epochs=2, cluster=hosts, host="127.0.0.1"
    )
    with pytest.raises(sdpipe.RunError) as err:
        run.result(timeout=120)
    took = time.monotonic() - start
    message = str(err.value).splitlines()[0]
    assert "cannot reach the run's rendezvous store at 127.0.0.1:" in message and "set host=" in message, message
    assert "worker pipeline" in message  # names the worker (and its address)
    assert took < 60, f"took {took:.0f}s: the connect timeout (20 s) applies, not the run timeout (120 s)"


def _latest(run) -> float:
    """The run's clock now, as far as its events tell (seconds since its start)."""
    return max(e.get("end") or 0.0 for e in run.events)


def _step_rate(events, pipeline, t0, t1):
    ends = [
        e["end"]
        for e in events
        if e["kind"] == "optimizer" and e["pipeline"] == pipeline and e["stage"] == 0 and t0 <= e["end"] < t1
    ]
    return len(ends) / (t1 - t0)


@pytest.mark.skipif(cpu_shaping_unavailable() is not None, reason=str(cpu_shaping_unavailable()))
def test_run_shape_caps_a_hosts_cpu_live_recorded_and_shown_as_shaped(data, hosts):
    pytest.importorskip("ipywidgets")
    from sdpipe.widgets import Dashboard

    train_data, _ = data
    run = sdpipe.train(digits_mlp(), train_data, stages=2, pipelines=2, policy="sdpipe", epochs=200, cluster=hosts)
    try:
        wait_for_epoch(run, 0)
        t_free = _latest(run)
        time.sleep(6)
        with pytest.raises(ValueError, match="pass one of host"):
            run.shape(bandwidth=1e6)
        assert run.shape(pipeline=1, cpu=0.2) == {"bandwidth": None, "cpu": 0.2}
        t_capped = _latest(run)
        time.sleep(6)
        run.shape(pipeline=1, cpu=None)
        t_lifted = _latest(run)
        time.sleep(1)
    finally:
        run.stop()
    result = run.result(timeout=120)
    shaped = [e for e in result.events if e["kind"] == "control" and e["what"] == "shaped"]
    host = hosts.host_of(run._workers[2])
    assert [(e["host"], e["pipelines"], e["cpu"]) for e in shaped] == [(host, [1], 0.2), (host, [1], None)]
    # the kernel held pipeline 1 back while capped; pipeline 0 (other host) kept its pace
    before = _step_rate(result.events, 1, t_free, t_capped)
    during = _step_rate(result.events, 1, t_capped + 1, t_lifted)
    assert during < 0.6 * before, (before, during)
    # the dashboard says "shaped", with what and where
    dash = Dashboard(result)
    labels = [label for _, label in dash.view.controls]
    assert any(label.startswith(f"shaped {hosts.addresses[host]}: cpu 0.2 cores") for label in labels), labels
    assert dash.view.heterogeneity() == "none" and "none" in dash.hetero.value  # lifted again at the end


def test_shaping_limits_a_hosts_link_and_cpu(no_leaks):
    """Measured from processes on the host: a transfer to it under a 1 MB/s token bucket, a busy loop under 0.25
    cores."""
    with EmulatedHosts([0]) as h:
        receiver = h.popen(1, [sys.executable, "-c", _RECEIVER, h.addresses[1]], stdout=subprocess.PIPE, text=True)
        try:
            assert receiver.stdout.readline().strip() == "ready"
            free = _send(h.addresses[1], 2_000_000)
            h.shape(1, bandwidth=1e6)
            limited = _send(h.addresses[1], 2_000_000)
            h.shape(1, bandwidth=None)
            lifted = _send(h.addresses[1], 2_000_000)
        finally:
            receiver.kill()
            receiver.wait(10)
        assert limited > 1.4 and free < 0.5 * limited and lifted < 0.5 * limited, (free, limited, lifted)
        if cpu_shaping_unavailable() is None:
            h.shape(1, cpu=0.25)
            share = _busy_share(h)
            h.shape(1, cpu=None)
            assert share < 0.35, share
            assert _busy_share(h) > 0.4
    assert_removed(h)


_RECEIVER = """
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 9000)); s.listen(4); print("ready", flush=True)
while True:
    c, _ = s.accept()
    while c.recv(1 << 20):
        pass
    c.sendall(b"k"); c.close()
"""


def _send(address, n):
    import socket

    t = time.monotonic()
    with socket.create_connection((address, 9000), timeout=30) as s:
        s.sendall(b"x" * n)
        s.shutdown(socket.SHUT_WR)
        assert s.recv(1) == b"k"
    return time.monotonic() - t


def _busy_share(h) -> float:
    """CPU seconds per wall second of a busy loop on host 1."""
    p = h.popen(
        1,
        [
            sys.executable,
            "-c",
            "import time\nt=time.monotonic()\nwhile time.monotonic()-t<2: pass\n"
            "print(time.process_time()/(time.monotonic()-t))",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    out, _ = p.communicate(timeout=30)
    return float(out)


@pytest.mark.parametrize("policy", ["sdpipe", "allreduce"])
def test_a_host_that_disappears(data, policy, no_leaks):
    """Every process of host 2 (pipeline 1's workers) killed at once, mid-run."""
    train_data, eval_data = data
    with EmulatedHosts([2, 2]) as h:
        run = sdpipe.train(
            digits_mlp(), train_data, eval_data=eval_data, stages=2, pipelines=2, policy=policy, epochs=8, cluster=h
        )
        wait_for_epoch(run, 1)
        assert {h.host_of(a) for a in run._workers[2:]} == {2}
        h.kill(2)
        killed = time.monotonic()
        if policy == "sdpipe":
            result = run.result(timeout=300)
            assert set(result.lost) == {1} and result.finished_pipelines == [0]
            assert max(x["epoch"] for x in result.history if x["pipeline"] == 0) == 7
        else:
            with pytest.raises(sdpipe.RunError) as err:
                run.result(timeout=120)
            assert time.monotonic() - killed < 30
            message = str(err.value)
            assert "pipeline 1" in message and h.addresses[2] in message, message
    assert_removed(h)
