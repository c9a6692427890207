"""Emulated hosts: a multi-host Dask cluster on one Linux machine, with links and CPUs the kernel shapes.

Each host is a network namespace with its own address on a private bridge;
host 0 runs a ``dask scheduler``, the others ``dask worker`` processes.
They are real processes talking real TCP between distinct addresses, so a
run on them takes the same paths as one on separate machines: the driver
(this process, on the bridge's own address) reaches the scheduler over the
bridge, and each worker binds its tensors' sockets to its own host's address.

    from sdpipe.hosts import EmulatedHosts

    if __name__ == "__main__":
        with EmulatedHosts(workers=[2, 2]) as hosts:     # host 0: scheduler; hosts 1, 2: two workers each
            run = sdpipe.train(model, data, cluster=hosts, stages=2, pipelines=2)
            run.shape(2, bandwidth=1e6)                  # host 2's link: 1 MB/s each way
            run.result()

A host's link is limited by a token bucket (``tc`` ``tbf`` on both ends of
its virtual cable) and its CPU by a quota of its cgroup (the ``cpu``
controller, cgroup v1 or v2): :meth:`EmulatedHosts.shape`, or
:meth:`sdpipe.Run.shape` while a run goes on.  Traffic stays between the
addresses assigned here (a /24 private subnet that no interface of the
machine uses).

Everything needs root.  Namespaces, links, cgroups and processes are removed
when the ``with`` block ends, also after an error or Ctrl-C; those of a
process that was killed before it could clean up are removed by the next
``EmulatedHosts`` (or by ``python -m sdpipe.hosts clean``).
"""

from __future__ import annotations

import atexit
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from typing import Optional, Sequence

from sdpipe.core.checks import is_integer, is_number

STATE_DIR = "/run/sdpipe-hosts"
SCHEDULER_PORT = 8786
#: seconds the scheduler and the workers may take to start
START_TIMEOUT = 60.0
CGROUP_V1 = "/sys/fs/cgroup/cpu"
CGROUP_V2 = "/sys/fs/cgroup"
PERIOD_US = 100_000


class HostsUnavailable(RuntimeError):
    """This machine (or this user) cannot create emulated hosts; the message says why."""


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and out.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {(out.stderr or out.stdout).strip().splitlines()[-1:] or out.returncode}")
    return out


def unavailable() -> Optional[str]:
    """Why emulated hosts cannot be made here (one line), or None when they can."""
    if sys.platform != "linux":
        return f"emulated hosts need Linux network namespaces; this is {sys.platform}"
    if os.geteuid() != 0:
        return "emulated hosts need root (network namespaces, links and cgroups)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"emulated hosts need the '{tool}' command (iproute2)"
    name = f"sdpipe-probe-{os.getpid()}"
    try:
        made = _run("ip", "netns", "add", name, check=False)
        if made.returncode:
            return f"cannot create a network namespace: {made.stderr.strip()}"
    finally:
        _run("ip", "netns", "del", name, check=False)
    return None


def cpu_shaping_unavailable() -> Optional[str]:
    """Why CPU quotas cannot be set here (one line), or None."""
    if os.path.exists(os.path.join(CGROUP_V1, "cpu.cfs_quota_us")):
        return None
    if os.path.exists(os.path.join(CGROUP_V2, "cgroup.controllers")):
        with open(os.path.join(CGROUP_V2, "cgroup.controllers")) as f:
            if "cpu" in f.read().split():
                return None
        return "the cgroup v2 'cpu' controller is not enabled on this machine"
    return f"no cgroup 'cpu' controller found (looked for {CGROUP_V1} and {CGROUP_V2})"


def _free_subnet() -> ipaddress.IPv4Network:
    """A private /24 that no interface of this machine has an address in."""
    used = []
    for line in _run("ip", "-4", "-o", "addr").stdout.splitlines():
        parts = line.split()
        if "inet" in parts:
            used.append(ipaddress.ip_interface(parts[parts.index("inet") + 1]).network)
    for third in range(200, 256):
        net = ipaddress.ip_network(f"10.213.{third}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise HostsUnavailable("no free private subnet 10.213.200-255.0/24 for emulated hosts")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class EmulatedHosts:
    """``len(workers) + 1`` hosts: host 0 runs the Dask scheduler, host ``i`` runs ``workers[i-1]`` Dask workers.

    Also usable as the ``cluster=`` of :func:`sdpipe.train` (it has a
    ``scheduler_address``); the run's :meth:`~sdpipe.Run.shape` then shapes
    these hosts.  ``threads``: threads per worker (sdpipe needs one per rank).
    """

    def __init__(
        self,
        workers: Sequence[int] = (2, 2),
        *,
        threads: int = 1,
        env: Optional[dict] = None,
        start_timeout: float = START_TIMEOUT,
    ):
        if not workers or any(not is_integer(n) or n < 0 for n in workers):
            raise ValueError(f"workers: must be a non-empty list of worker counts (integers >= 0), got {workers!r}")
        why = unavailable()
        if why:
            raise HostsUnavailable(why)
        clean_stale()
        self.id = uuid.uuid4().hex[:6]
        self.workers = list(workers)
        self.threads = threads
        self.subnet = _free_subnet()
        hosts = list(self.subnet.hosts())
        #: The driver's address: the bridge's, in this machine's own namespace.
        self.driver_address = str(hosts[0])
        #: Address of each host (host 0 runs the scheduler).
        self.addresses = [str(hosts[10 + i]) for i in range(len(workers) + 1)]
        self.bridge = f"sdb-{self.id}"
        self.namespaces = [f"sdpipe-{self.id}-h{i}" for i in range(len(self.addresses))]
        self._outer = [f"sdv-{self.id}-{i}" for i in range(len(self.addresses))]  # host ends in this namespace
        self.cgroups: list = []
        self._procs: list = []  # (host, Popen)
        #: Current shaping of each host: {"bandwidth": bytes/s or None, "cpu": cores or None}.
        self.shaping = [{"bandwidth": None, "cpu": None} for _ in self.addresses]
        self._env = env or {}
        self._closed = False
        #: Folder of the hosts' Dask logs (removed on close).
        self.log_dir = os.path.join(STATE_DIR, self.id)
        self.scheduler_address = f"tcp://{self.addresses[0]}:{SCHEDULER_PORT}"
        self._save_state()
        atexit.register(self.close)
        try:
            self._make_network()
            self._make_cgroups()
            self._start(start_timeout)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------ set-up
    def _save_state(self) -> None:
        os.makedirs(STATE_DIR, exist_ok=True)
        with open(os.path.join(STATE_DIR, f"{self.id}.json"), "w") as f:
            json.dump(
                {
                    "pid": os.getpid(),
                    "bridge": self.bridge,
                    "namespaces": self.namespaces,
                    "links": self._outer,
                    "cgroups": [_cgroup_path(self.id, i) for i in range(len(self.addresses))],
                },
                f,
            )

    def _make_network(self) -> None:
        prefix = self.subnet.prefixlen
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.driver_address}/{prefix}", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for i, (ns, outer, addr) in enumerate(zip(self.namespaces, self._outer, self.addresses, strict=True)):
            inner = f"sdi-{self.id}-{i}"
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
            _run("ip", "link", "set", outer, "master", self.bridge)
            _run("ip", "link", "set", outer, "up")
            _run("ip", "link", "set", inner, "netns", ns)
            _run("ip", "-n", ns, "link", "set", inner, "name", "eth0")
            _run("ip", "-n", ns, "addr", "add", f"{addr}/{prefix}", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")

    def _make_cgroups(self) -> None:
        if cpu_shaping_unavailable():
            return
        for i in range(len(self.addresses)):
            path = _cgroup_path(self.id, i)
            if path.startswith(CGROUP_V2 + "/") and not os.path.exists(CGROUP_V1):
                _enable_v2_cpu()
            os.makedirs(path, exist_ok=True)
            self.cgroups.append(path)

    def popen(self, host: int, args: list, **kwargs) -> subprocess.Popen:
        """Start ``args`` (a command line) on ``host``: in its network namespace and its cgroup, in a new session.

        The process is the caller's to wait for; :meth:`close` kills it with the host if it still runs.
        """
        # the process joins its host's cgroup before it becomes the command, so all its children are in it too
        procs = os.path.join(self.cgroups[host], "cgroup.procs") if self.cgroups else "/dev/null"
        cmd = ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", "ip", "netns", "exec", self.namespaces[host], *args]
        return subprocess.Popen(cmd, start_new_session=True, **kwargs)

    def _spawn(self, host: int, args: list, log: str) -> subprocess.Popen:
        env = dict(
            os.environ,
            OMP_NUM_THREADS="1",
            MKL_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
            DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES="0",
            DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED="False",
            **self._env,
        )
        with open(log, "wb") as out:
            p = self.popen(
                host, [sys.executable, *args], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
            )
        self._procs.append((host, p))
        return p

    def _start(self, timeout: float) -> None:
        os.makedirs(self.log_dir, exist_ok=True)
        self._spawn(0, _scheduler_args(self.addresses[0]), os.path.join(self.log_dir, "scheduler.log"))
        for i, n in enumerate(self.workers, start=1):
            if n:
                args = _worker_args(self.scheduler_address, self.addresses[i], n, self.threads, f"h{i}")
                self._spawn(i, args, os.path.join(self.log_dir, f"host{i}.log"))
        self.wait_for_workers(sum(self.workers), timeout)

    def wait_for_workers(self, n: int, timeout: float = START_TIMEOUT) -> None:
        """Wait until the scheduler knows ``n`` workers (a one-line error naming the logs after ``timeout``)."""
        from distributed import Client

        deadline = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < deadline:
            for host, p in self._procs:
                if p.poll() is not None:
                    raise RuntimeError(
                        f"emulated host {host}: its Dask process exited with {p.returncode}; see {self.log_dir}"
                    )
            try:
                with Client(self.scheduler_address, timeout=5, set_as_default=False) as c:
                    if n:
                        c.wait_for_workers(n, timeout=max(1.0, deadline - time.monotonic()))
                    return
            except (OSError, TimeoutError) as e:
                seen += 1
                last = e
                time.sleep(0.5)
        raise TimeoutError(
            f"emulated hosts: {n} Dask workers did not start within {timeout:.0f}s "
            f"({type(last).__name__ if seen else 'no answer'}); see {self.log_dir}"
        )

    # ------------------------------------------------------------ shaping
    def host_of(self, address: str) -> int:
        """The host index of a Dask worker address (``tcp://10.213.x.y:port``) or a bare IP address."""
        from urllib.parse import urlparse

        ip = urlparse(address).hostname if "://" in address else address.split(":")[0]
        if ip not in self.addresses:
            raise ValueError(f"host: {address!r} is not on one of these emulated hosts ({', '.join(self.addresses)})")
        return self.addresses.index(ip)

    def shape(self, host: int, *, bandwidth: Optional[float] = ..., cpu: Optional[float] = ...) -> dict:
        """Limit ``host``'s link to ``bandwidth`` bytes/s each way and its CPU to ``cpu`` cores; None lifts a limit.

        An argument left out keeps its current setting.  Returns the host's shaping now.
        """
        if not is_integer(host) or not 0 <= host < len(self.addresses):
            raise ValueError(f"host: must be a host index 0..{len(self.addresses) - 1}, got {host!r}")
        _check_shaping(bandwidth, cpu)
        if bandwidth is not ...:
            for ns, dev in [(None, self._outer[host]), (self.namespaces[host], "eth0")]:
                _set_bandwidth(ns, dev, bandwidth)
            self.shaping[host]["bandwidth"] = None if bandwidth is None else float(bandwidth)
        if cpu is not ...:
            _set_quota(self.cgroups[host], cpu)
            self.shaping[host]["cpu"] = None if cpu is None else float(cpu)
        return dict(self.shaping[host])

    def pids(self, host: int) -> list:
        """Processes running in ``host``'s namespace."""
        got = _run("ip", "netns", "pids", self.namespaces[host], check=False).stdout.split()
        return [int(p) for p in got]

    def kill(self, host: int) -> list:
        """Kill every process of ``host`` at once (SIGKILL): the host disappears. Returns the pids killed."""
        pids = self.pids(host)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    # ------------------------------------------------------------ teardown
    def close(self) -> None:
        """Stop every process and remove the namespaces, links and cgroups (safe to call twice)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        for _, p in self._procs:
            _signal_group(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for _, p in self._procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for _, p in self._procs:
            _signal_group(p.pid, signal.SIGKILL)
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass
        _remove(
            self.bridge, self.namespaces, [_cgroup_path(self.id, i) for i in range(len(self.addresses))], self._outer
        )
        try:
            os.remove(os.path.join(STATE_DIR, f"{self.id}.json"))
        except FileNotFoundError:
            pass
        shutil.rmtree(os.path.join(STATE_DIR, self.id), ignore_errors=True)

    def __enter__(self) -> "EmulatedHosts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        hosts = ", ".join(
            f"h{i}={a}" + (" (scheduler)" if i == 0 else f" ({self.workers[i - 1]} workers)")
            for i, a in enumerate(self.addresses)
        )
        return f"EmulatedHosts({hosts}; driver {self.driver_address}{', closed' if self._closed else ''})"


def _check_shaping(bandwidth, cpu) -> None:
    """One-line errors for limits out of range (``...``: left as it is; None: no limit)."""
    if bandwidth is not ... and bandwidth is not None:
        if not is_number(bandwidth) or not 1000 <= bandwidth <= 1e11:
            raise ValueError(
                f"bandwidth: must be bytes/s between 1e3 and 1e11, or None for no limit, got {bandwidth!r}"
            )
    if cpu is not ... and cpu is not None:
        if not is_number(cpu) or not 0.01 <= cpu <= 1024:
            raise ValueError(f"cpu: must be cores between 0.01 and 1024, or None for no limit, got {cpu!r}")
        why = cpu_shaping_unavailable()
        if why:
            raise HostsUnavailable(f"cpu: cannot cap a host's CPU here: {why}")


def _set_bandwidth(namespace: Optional[str], dev: str, bandwidth: Optional[float]) -> None:
    """A token bucket of ``bandwidth`` bytes/s on ``dev`` (in ``namespace``, None: this one); None removes it."""
    where = ("-n", namespace) if namespace else ()
    if bandwidth is None:
        _run("tc", *where, "qdisc", "del", "dev", dev, "root", check=False)
        return
    rate, burst = int(bandwidth * 8), max(int(bandwidth / 50), 16384)
    _run(
        "tc",
        *where,
        "qdisc",
        "replace",
        "dev",
        dev,
        "root",
        "tbf",
        "rate",
        f"{rate}bit",
        "burst",
        str(burst),
        "latency",
        "100ms",
    )


def _scheduler_args(address: str) -> list:
    return ["-m", "distributed.cli.dask_scheduler", "--host", address, "--port", str(SCHEDULER_PORT), "--no-dashboard"]


def _worker_args(scheduler: str, address: str, n: int, threads: int, name: str) -> list:
    return [
        "-m",
        "distributed.cli.dask_worker",
        scheduler,
        "--host",
        address,
        "--nworkers",
        str(n),
        "--nthreads",
        str(threads),
        "--no-dashboard",
        "--name",
        name,
    ]


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _cgroup_path(id_: str, host: int) -> str:
    base = CGROUP_V1 if os.path.exists(CGROUP_V1) else CGROUP_V2
    return os.path.join(base, f"sdpipe-{id_}-h{host}")


def _enable_v2_cpu() -> None:
    path = os.path.join(CGROUP_V2, "cgroup.subtree_control")
    with open(path) as f:
        if "cpu" in f.read().split():
            return
    with open(path, "w") as f:
        f.write("+cpu")


def _set_quota(path: str, cores: Optional[float]) -> None:
    if os.path.exists(os.path.join(path, "cpu.cfs_quota_us")):
        with open(os.path.join(path, "cpu.cfs_period_us"), "w") as f:
            f.write(str(PERIOD_US))
        with open(os.path.join(path, "cpu.cfs_quota_us"), "w") as f:
            f.write("-1" if cores is None else str(max(1000, int(cores * PERIOD_US))))
    else:
        with open(os.path.join(path, "cpu.max"), "w") as f:
            f.write(f"{'max' if cores is None else max(1000, int(cores * PERIOD_US))} {PERIOD_US}")


def _remove(bridge: str, namespaces: list, cgroups: list, links: list = ()) -> None:
    for ns in namespaces:
        for pid in _run("ip", "netns", "pids", ns, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    for path in cgroups:
        deadline = time.monotonic() + 5
        while os.path.isdir(path):
            try:
                os.rmdir(path)  # fails while a (dying) process is still in it
            except OSError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
    for link in links:  # one end of a virtual cable takes the other with it
        _run("ip", "link", "del", link, check=False)
    for ns in namespaces:
        _run("ip", "netns", "del", ns, check=False)
    _run("ip", "link", "del", bridge, check=False)


def clean_stale() -> list:
    """Remove the hosts of processes that died without cleaning up; returns their ids."""
    removed = []
    if not os.path.isdir(STATE_DIR):
        return removed
    for name in os.listdir(STATE_DIR):
        if not name.endswith(".json"):
            continue
        path = os.path.join(STATE_DIR, name)
        try:
            with open(path) as f:
                state = json.load(f)
        except (OSError, ValueError):
            continue
        if _alive(state.get("pid", -1)):
            continue
        _remove(state["bridge"], state["namespaces"], state.get("cgroups", []), state.get("links", []))
        os.remove(path)
        shutil.rmtree(path[: -len(".json")], ignore_errors=True)
        removed.append(name[: -len(".json")])
    return removed


def leftovers() -> dict:
    """Namespaces, links and cgroups named like emulated hosts' that exist now (for tests and for ``clean``)."""
    ns = [
        line.split()[0]
        for line in _run("ip", "netns", "list", check=False).stdout.splitlines()
        if line.startswith("sdpipe-")
    ]
    links = [
        line.split(":")[1].strip().split("@")[0]
        for line in _run("ip", "-o", "link", check=False).stdout.splitlines()
        if line.split(":")[1].strip().startswith(("sdb-", "sdv-", "sdi-"))
    ]
    groups = [
        d for base in (CGROUP_V1, CGROUP_V2) if os.path.isdir(base) for d in os.listdir(base) if d.startswith("sdpipe-")
    ]
    return {"namespaces": ns, "links": links, "cgroups": groups}


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m sdpipe.hosts", description="Emulated hosts on this machine (root).")
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start hosts and keep them until Ctrl-C")
    up.add_argument("workers", nargs="+", type=int, help="Dask workers on each worker host, e.g. 2 2")
    sub.add_parser("clean", help="remove hosts left by processes that were killed")
    args = ap.parse_args(argv)
    if args.cmd == "clean":
        print(f"removed: {', '.join(clean_stale()) or 'nothing'}; left: {leftovers()}")
        return 0
    try:
        with EmulatedHosts(args.workers) as hosts:
            print(hosts)
            print(f"scheduler: {hosts.scheduler_address}  (Ctrl-C to stop and remove everything)", flush=True)
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    except (HostsUnavailable, ValueError, TimeoutError, RuntimeError) as e:
        print(f"sdpipe.hosts: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
