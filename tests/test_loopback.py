"""A local run listens on loopback only: its ranks expose nothing to the network.

The launch settings (fsdp_lesson/launch.py) restrict MPICH's netmods to the loopback device on
a job that stays on one host, and leave them alone for a job across hosts or with
FSDP_LESSON_ALL_INTERFACES=1. Checked on the real path: a 4-rank run under the tests' mpiexec,
its listening sockets read from /proc (which socket belongs to which process: /proc/PID/fd).
hydra's control port, mpiexec's own, is the one exception hydra allows no setting for; under
mpiexec.gforker (same wheel) nothing at all listens beyond loopback.
"""

import ipaddress
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from mpi_helpers import MPIEXEC, ROOT

from fsdp_lesson.launch import (
    ALL_INTERFACES,
    LOOPBACK_ENV,
    LOOPBACK_SET,
    drop_inherited_loopback,
    one_host,
    rank_env,
    rank_settings,
)

# --- the settings ------------------------------------------------------------------------------

HYDRA_ONE_HOST = {"PMI_RANK": "0", "PMI_SIZE": "4", "MPI_LOCALNRANKS": "4"}
HYDRA_TWO_HOSTS = {"PMI_RANK": "0", "PMI_SIZE": "4", "MPI_LOCALNRANKS": "2"}


def test_which_jobs_stay_on_this_host():
    assert one_host({}) is True  # not started by a launcher: it is one, or runs alone
    assert one_host(HYDRA_ONE_HOST) is True
    assert one_host(HYDRA_TWO_HOSTS) is False
    assert one_host({"OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_SIZE": "4"}) is False
    assert one_host({"SLURM_PROCID": "0", "SLURM_STEP_NUM_NODES": "1"}) is True
    assert one_host({"SLURM_PROCID": "0", "SLURM_STEP_NUM_NODES": "3"}) is False
    assert one_host({"PMI_RANK": "0", "PMI_SIZE": "4"}) is None  # a launcher that does not say


def test_a_local_launch_gets_the_loopback_settings_and_the_users_win():
    local = rank_settings({})
    assert LOOPBACK_ENV.items() <= local.items()
    assert local[LOOPBACK_SET] == ",".join(LOOPBACK_ENV)
    assert LOOPBACK_ENV.items() <= rank_settings(HYDRA_ONE_HOST).items()
    mine = rank_settings({"UCX_NET_DEVICES": "eth1"})
    assert mine["UCX_NET_DEVICES"] == "eth1" and "UCX_NET_DEVICES" not in mine[LOOPBACK_SET]


@pytest.mark.parametrize(
    "env", [{ALL_INTERFACES: "1"}, HYDRA_TWO_HOSTS, {"PMI_RANK": "0", "PMI_SIZE": "4"}]
)
def test_several_hosts_or_the_switch_or_an_unknown_launcher_get_no_loopback_settings(env):
    settings = rank_settings(env)
    assert not set(LOOPBACK_ENV) & set(settings) and LOOPBACK_SET not in settings
    assert settings["MPI4PY_RC_THREAD_LEVEL"] == "multiple"  # the rest stays


def test_a_rank_across_hosts_drops_what_a_local_launcher_passed_on_but_not_the_users():
    inherited = rank_settings({"FI_PROVIDER": "verbs"})  # a launcher here; the user's provider
    env = {**HYDRA_TWO_HOSTS, "FI_PROVIDER": "verbs", **inherited}
    drop_inherited_loopback(env)
    assert "UCX_NET_DEVICES" not in env and "FI_TCP_IFACE" not in env
    assert env["FI_PROVIDER"] == "verbs" and LOOPBACK_SET not in env
    local = {**HYDRA_ONE_HOST, **rank_settings({})}
    drop_inherited_loopback(local)
    assert LOOPBACK_ENV.items() <= local.items()  # one host: kept
    switched = {**HYDRA_ONE_HOST, **rank_settings({}), ALL_INTERFACES: "1"}
    drop_inherited_loopback(switched)
    assert not set(LOOPBACK_ENV) & set(switched)


# --- a real run: who listens where ---------------------------------------------------------


def address(text: str) -> str:
    """/proc/net's little-endian hex address (IPv4 or IPv6) as a string."""
    raw = bytes.fromhex(text)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    return str(ipaddress.IPv6Address(words))


def listening() -> dict[int, str]:
    """Every listening TCP socket and every unconnected UDP socket: inode -> "addr port"."""
    found = {}
    for table, state in [("tcp", "0A"), ("tcp6", "0A"), ("udp", "07"), ("udp6", "07")]:
        path = Path("/proc/net", table)
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == state:
                host, port = fields[1].split(":")
                found[int(fields[9])] = f"{table} {address(host)} {int(port, 16)}"
    return found


def socket_inodes(pid: int) -> set[int]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def is_loopback(entry: str) -> bool:
    ip = ipaddress.ip_address(entry.split()[1])
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or bool(mapped and mapped.is_loopback)


def sockets_of_a_running_job(launcher: list[str], n: int) -> tuple[dict, dict]:
    """Start `launcher -n n python -m fsdp_lesson train` (zero3, training until stopped); once
    every rank trains, return the listening sockets of the launcher's own processes (mpiexec
    and hydra's proxy) and of the ranks that are not the launcher's; then end the job."""
    command = [*launcher, "-n", str(n), sys.executable, "-m", "fsdp_lesson", "train"]
    command += ["--strategy", "zero3", "--steps", "1000000", "--log-every", "1000000"]
    job = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=rank_env()
    )
    processes = []
    try:
        first = job.stdout.readline()  # "step: 0, ...": MPI is up on every rank
        assert first.startswith("step: 0"), job.communicate(timeout=60)[1]
        top = psutil.Process(job.pid)
        processes = [top, *top.children(recursive=True)]
        ranks = [p for p in processes if p.name().startswith("python")]
        assert len(ranks) == n
        sockets = listening()
        launchers = set().union(*(socket_inodes(p.pid) for p in processes if p not in ranks))
        of_ranks = set().union(*(socket_inodes(p.pid) for p in ranks)) - launchers
        return (
            {i: sockets[i] for i in launchers if i in sockets},
            {i: sockets[i] for i in of_ranks if i in sockets},
        )
    finally:
        job.send_signal(signal.SIGINT)  # Ctrl-C: every rank stops
        try:
            job.communicate(timeout=20)
        finally:
            job.kill()
            psutil.wait_procs(processes, timeout=10)


linux_only = pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads /proc/net")


@pytest.mark.mpi
@linux_only
def test_a_local_run_of_4_ranks_listens_on_loopback_only():
    launchers, ranks = sockets_of_a_running_job([MPIEXEC], 4)
    assert ranks, "the ranks listen on nothing: nothing was checked"
    beyond = {i: s for i, s in ranks.items() if not is_loopback(s)}
    assert beyond == {}, f"the ranks listen beyond loopback: {sorted(beyond.values())}"
    # hydra's control port binds every interface whatever -iface or HYDRA_IFACE say (they
    # choose the address it announces); it is the one exception (docs/architecture.md)
    assert len([s for s in launchers.values() if not is_loopback(s)]) <= 1, launchers


@pytest.mark.mpi
@linux_only
def test_under_mpiexec_gforker_nothing_listens_beyond_loopback():
    gforker = Path(MPIEXEC).with_name("mpiexec.gforker")
    if not gforker.exists():
        pytest.skip("no mpiexec.gforker beside mpiexec")
    launchers, ranks = sockets_of_a_running_job([str(gforker)], 4)
    beyond = {i: s for i, s in {**launchers, **ranks}.items() if not is_loopback(s)}
    assert beyond == {}, f"listening beyond loopback: {sorted(beyond.values())}"
