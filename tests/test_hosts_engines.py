"""ipyparallel engines on the simulated hosts (fsdp_lesson/hosts.py): connect(profile="hosts")
places rank r on host r // slots, the controller listens on the switch, the client reaches it
from the machine's own namespace through Unix sockets, MPI between engines crosses the cables,
`hosts shape` re-shapes them under running engines, and `hosts down` ends and removes it all.

Real namespaces, a real ipcluster and real MPI; user namespaces needed (elsewhere those tests
skip and say why). The hosts are the tests' own (a temporary directory, found by connect()
through $FSDP_LESSON_HOSTS_DIR) and so is IPYTHONDIR: a user's hosts and profiles are untouched.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import ipyparallel as ipp
import pytest
from mpi_helpers import error_when_rank_2_is_killed, simulated_hosts

from fsdp_lesson import hosts
from fsdp_lesson.cluster import HOSTS_DIR_ENV, ClusterError, connect

REASON = hosts.unavailable()
needs_hosts = pytest.mark.skipif(REASON is not None, reason=str(REASON))
PREFIX = "fsdpl-e-"
MIB = 2**20


@ipp.interactive
def placement() -> tuple[int, int, str, str]:
    """This engine's rank, world size, hostname and MPI processor name."""
    import socket

    from mpi4py import MPI

    world = MPI.COMM_WORLD
    return world.Get_rank(), world.Get_size(), socket.gethostname(), MPI.Get_processor_name()


@ipp.interactive
def timed_allreduce(nbytes: int, repeats: int) -> tuple[float, float]:
    """Seconds for `repeats` allreduces of nbytes (after a barrier), and the sum's first value."""
    import time

    import numpy as np
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    mine, total = np.full(nbytes // 8, world.Get_rank() + 1.0), np.empty(nbytes // 8)
    world.Barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        world.Allreduce(mine, total)
    return time.perf_counter() - start, float(total[0])


def processes_in(directory: Path) -> list[int]:
    """Every process on the hosts of directory: controller, schedulers, mpiexec, proxies,
    engines... (all of them in the keeper's user namespace)."""
    return hosts.inside_user_namespace(hosts.up_record(directory).keeper["pid"])


def across(directory: Path, ranks, nbytes: int, repeats: int) -> tuple[float, int]:
    """The slowest rank's time for the allreduces, and the bytes that went host to host."""
    before = hosts.link_bytes(directory)
    results = ranks.run(timed_allreduce, nbytes, repeats, timeout=120)
    crossed = hosts.between_hosts(before, hosts.link_bytes(directory), directory)
    assert [total for _, total in results] == [10.0] * 4  # 1 + 2 + 3 + 4
    return max(seconds for seconds, _ in results), crossed


def qdisc(directory: Path, ns: str, dev: str) -> str:
    show = [*hosts.inside(hosts.up_record(directory)), "tc", "-n", ns, "qdisc", "show", "dev", dev]
    return hosts.run(show).stdout


@pytest.fixture(scope="module")
def private_ipython(tmp_path_factory):
    """A private IPYTHONDIR holding a profile_hosts of the user's own, which must stay as it is."""
    ipython = tmp_path_factory.mktemp("ipython")
    (ipython / "profile_hosts").mkdir()
    (ipython / "profile_hosts" / "ipcluster_config.py").write_text("# the user's own\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("IPYTHONDIR", str(ipython))
        yield ipython
    assert (ipython / "profile_hosts" / "ipcluster_config.py").read_text() == "# the user's own\n"


@pytest.fixture(scope="module")
def simulated(tmp_path_factory, private_ipython):
    """2 hosts x 2 slots at 1 Gbit/s that connect(profile="hosts") finds; always down at the end."""
    directory = tmp_path_factory.mktemp("engines")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(HOSTS_DIR_ENV, str(directory))
        with simulated_hosts(directory, PREFIX):
            yield directory


@pytest.fixture(scope="module")
def ranks(simulated):
    """4 engines on the hosts, in a cluster connect() started itself."""
    ranks = connect(n=4, profile="hosts", timeout=120)
    yield ranks
    ranks.close()


@needs_hosts
@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_connect_places_the_engines_on_the_hosts_and_mpi_crosses_the_cables(simulated, ranks):
    assert ranks.cluster is not None  # started by connect(), stopped by close() or at exit
    hostnames = [f"{PREFIX}h0"] * 2 + [f"{PREFIX}h1"] * 2
    assert ranks.run(placement) == [(r, 4, h, h) for r, h in enumerate(hostnames)]
    # an allreduce of 4 MiB: each host's half of the sum must reach the other host, at least
    # 4 MiB in all on the cables (measured: 8.4 MB, MPICH reduces within a host first)
    _, crossed = across(simulated, ranks, 4 * MIB, 1)
    assert 4 * MIB <= crossed <= 4 * 4 * MIB, f"{crossed:,} B between hosts"


@needs_hosts
@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_shape_changes_every_cable_under_running_engines(simulated, ranks):
    """100 Mbit/s through `hosts shape`, then back to 1 Gbit/s through set_bandwidth: tc shows
    the rate on both ends of each cable, the record follows, the same engines keep running,
    and the allreduces take at least the time their bytes need at 100 Mbit/s (a bound a busy
    machine cannot cross: it only slows them)."""
    pids = ranks.run(os.getpid)
    assert hosts.main(["shape", "--bandwidth", "100mbit", "--dir", str(simulated)]) == 0
    for ns, dev in [(f"{PREFIX}h0", "eth0"), (f"{PREFIX}h1", "eth0"), (f"{PREFIX}sw", "fsdpl-p1")]:
        assert "rate 100Mbit" in qdisc(simulated, ns, dev), qdisc(simulated, ns, dev)
    assert hosts.Record.load(simulated).layout.bandwidth == "100mbit"
    slow, crossed = across(simulated, ranks, 4 * MIB, 3)
    # each host sends half of what crosses, through its own 100 Mbit/s cable
    assert slow >= 0.8 * (crossed / 2) * 8 / 100e6, (slow, crossed)

    hosts.set_bandwidth("1gbit", simulated)
    assert "rate 1Gbit" in qdisc(simulated, f"{PREFIX}sw", "fsdpl-p0")
    assert hosts.Record.load(simulated).layout.bandwidth == "1gbit"
    assert ranks.run(os.getpid) == pids


@needs_hosts
@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_an_engine_that_dies_on_a_host_is_named_and_the_engines_restart_there(ranks):
    """Rank 2, on the second host: its process is the first seen to end (the hosts share this
    machine's process ids), so the rank is named; the new engines are on the hosts again."""
    error = error_when_rank_2_is_killed(ranks)
    assert error.rank == 2 and "restarted" in str(error), str(error)
    assert [host for *_, host in ranks.run(placement)] == [
        f"{PREFIX}h0", f"{PREFIX}h0", f"{PREFIX}h1", f"{PREFIX}h1"
    ]  # fmt: skip


@needs_hosts
@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_a_cluster_started_in_a_terminal_is_used(simulated, ranks):
    """`build/hosts/ipcluster start -n 4` (left running: the next test's `down` must end it)."""
    terminal = subprocess.Popen(
        [str(simulated / "ipcluster"), "start", "-n", "4"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        cluster_file = simulated / hosts.PROFILE / "security" / "cluster-.json"
        while not cluster_file.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        with connect(n=4, profile="hosts", timeout=120) as theirs:
            assert theirs.cluster is None  # not ours: close() leaves it running
            assert [host for *_, host in theirs.run(placement)] == [
                f"{PREFIX}h0", f"{PREFIX}h0", f"{PREFIX}h1", f"{PREFIX}h1"
            ]  # fmt: skip
            assert set(theirs.pids).isdisjoint(ranks.pids)
        assert terminal.poll() is None
    except BaseException:
        terminal.kill()
        raise


@needs_hosts
@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_down_ends_the_clusters_and_leaves_nothing(simulated, ranks):
    """With both clusters running: no namespace, no process of theirs, no profile, nothing in
    the machine's own network, and the Ranks closes without remaking the profile."""
    pids = processes_in(simulated)
    keeper = hosts.up_record(simulated).keeper["pid"]
    controller, mpiexec = ranks.cluster.controller.process.pid, ranks.cluster.engine_set.process.pid
    assert {controller, mpiexec, *ranks.pids} <= set(pids)
    started = time.monotonic()
    hosts.down(simulated)
    took = time.monotonic() - started
    assert [p for p in [*pids, keeper] if hosts.running(p)] == []
    assert took < 15, f"down took {took:.1f} s: something waited out SIGTERM"
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=30)
    assert "fsdpl" not in listed.stdout + links.stdout
    ranks.close()
    assert sorted(simulated.iterdir()) == []  # no profile, scripts or record


def test_connect_to_hosts_that_are_not_up_says_what_to_type(tmp_path, monkeypatch):
    monkeypatch.setenv(HOSTS_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    with pytest.raises(ClusterError) as info:
        connect(n=4, profile="hosts", timeout=10)
    message = str(info.value)
    assert "\n" not in message
    assert f"python -m fsdp_lesson hosts up --hosts 2 --slots 2 --dir {tmp_path}" in message
    assert "as root" not in message
