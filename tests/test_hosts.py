"""Simulated hosts (fsdp_lesson/hosts.py): every strategy at N = 4 across 2 hosts joined by a
1 Gbit/s link trains the model single-rank training trains, its bytes cross the cables as the
collectives' algorithms put them there, a checkpoint saved across hosts resumes on one machine,
and `hosts down` leaves nothing behind, also after a crash between any two steps of `up`; a
record that is not the user's own, or names what `up` never makes, is refused with nothing
touched; a rate tc would refuse is refused before anything changes.

The hosts need iproute2 and user namespaces (no root); elsewhere those tests skip and say why.
Every set of hosts is private to its keeper (fsdp_lesson/hosts.py), so the tests' hosts (a
temporary directory) and a user's never meet. tests/test_hosts_private.py runs them as an
unprivileged user and two at once.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from mpi_helpers import simulated_hosts

from fsdp_lesson import hosts
from fsdp_lesson.config import ModelConfig, RunConfig, TrainConfig
from fsdp_lesson.hosts import PROFILE
from fsdp_lesson.train import run

ROOT = Path(__file__).resolve().parent.parent
REASON = hosts.unavailable()
needs_hosts = pytest.mark.skipif(REASON is not None, reason=str(REASON))
PREFIX = "fsdpl-t-"
STEPS = 100
TRAIN = ["-m", "fsdp_lesson", "train"]
FLAGS = ["--eval-batches", "0", "--samples", "0", "--log-every", str(STEPS)]


def namespaces(directory: Path) -> list[str]:
    """The namespaces of the hosts in directory, as their keeper sees them."""
    listed = hosts.run([*hosts.inside(hosts.up_record(directory)), "ip", "netns", "list"])
    return sorted(line.split()[0] for line in listed.stdout.splitlines())


def on_the_machine() -> list[str]:
    """What of the hosts the machine itself shows: namespaces, /etc/netns entries and links
    named fsdpl- in its own namespace. There should never be one: all of it is the keeper's."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=30)
    return [
        *(line for line in listed.stdout.splitlines() if line.startswith("fsdpl-")),
        *(str(p) for p in Path("/etc/netns").glob("fsdpl-*")),
        *(line for line in links.stdout.splitlines() if "fsdpl" in line),
    ]


def qdisc(directory: Path, ns: str, dev: str) -> str:
    show = [*hosts.inside(hosts.up_record(directory)), "tc", "-n", ns, "qdisc", "show", "dev", dev]
    return hosts.run(show).stdout


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """2 hosts x 2 slots at 1 Gbit/s, up once for the module and always down at its end."""
    with simulated_hosts(tmp_path_factory.mktemp("hosts"), PREFIX) as directory:
        keeper = hosts.Record.load(directory).keeper["pid"]
        yield directory
    assert not hosts.running(keeper) and sorted(directory.iterdir()) == []


@pytest.fixture(scope="module")
def single():
    """Single-rank training in this process: the history and the full parameters."""
    history, strategy = run(ModelConfig(), TrainConfig(steps=STEPS, eval_batches=0, samples=0))
    return history, strategy.full_params()


def across_hosts(directory: Path, n: int, *args: str) -> tuple[subprocess.CompletedProcess, int]:
    """`DIR/mpiexec -n n python ARGS` and the bytes that went from host to host meanwhile."""
    before = hosts.link_bytes(directory)
    out = subprocess.run(
        [str(directory / "mpiexec"), "-n", str(n), sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out, hosts.between_hosts(before, hosts.link_bytes(directory), directory)


def assert_same_params(npz: Path, params: dict, atol: float = 1e-5) -> None:
    saved = np.load(npz)
    for layer, p in params.items():
        for k, v in p.items():
            diff = np.abs(saved[f"{layer}.{k}"] - v).max()
            assert diff <= atol, f"{layer}.{k} differs by {diff:.1e}"


@needs_hosts
def test_up_builds_what_it_records(cluster):
    record = hosts.Record.load(cluster)
    assert record.complete and record.layout.names == [f"{PREFIX}h0", f"{PREFIX}h1"]
    assert (cluster / "hostfile").read_text() == f"{PREFIX}h0:2\n{PREFIX}h1:2\n"
    assert namespaces(cluster) == sorted(record.layout.namespaces())
    assert on_the_machine() == []
    for ns, dev in [(f"{PREFIX}h0", "eth0"), (f"{PREFIX}sw", "fsdpl-p0")]:  # both ends shaped
        shown = qdisc(cluster, ns, dev)
        assert "tbf" in shown and "rate 1Gbit" in shown, shown
    out, _ = across_hosts(cluster, 4, "-c", "import socket; print(socket.gethostname())")
    placed = sorted(re.findall(rf"{PREFIX}h\d", out.stdout))  # a host's slots, then the next
    assert placed == [f"{PREFIX}h0"] * 2 + [f"{PREFIX}h1"] * 2


@needs_hosts
@pytest.mark.parametrize("strategy", ["dp", "zero1", "zero2", "zero3"])
def test_every_strategy_across_hosts_equals_single(cluster, single, tmp_path, strategy):
    """The same model as single-rank training, and bytes on the cables. The ring model counts
    half of N = 4's sends between hosts (ranks 1 -> 2 and 3 -> 0 of the ring), but MPICH picks
    other algorithms: what must cross at the least is each host's half of the data, 2/3 of the
    ring's share (dp's allreduce measured 0.67-0.70: MPICH reduces within a host first), and its
    allgather and reduce-scatter pair distant ranks, up to 4/3 of it (measured 1.19-1.35 with
    the headers of small messages). So between 0.6 and 2 times the counted share."""
    _, crossed = across_hosts(
        cluster, 4, *TRAIN, "--strategy", strategy, "--steps", str(STEPS), "--out",
        str(tmp_path), *FLAGS,
    )  # fmt: skip
    history, params = single
    assert_same_params(tmp_path / "params.npz", params)
    losses = json.loads((tmp_path / "history.json").read_text())["losses"]
    assert np.abs(np.array(losses) - history.losses).max() <= 1e-5
    traffic = json.loads((tmp_path / "history.json").read_text())["traffic"]
    counted = sum(t["sent_bytes"] for rank in traffic for t in rank.values())
    assert 0.6 <= crossed / (counted / 2) <= 2.0, f"crossed {crossed:,} B, counted {counted:,} B"


@needs_hosts
def test_the_ring_puts_its_neighbours_bytes_on_the_cables(cluster, tmp_path):
    """With the lesson's ring (--collectives ring) the bytes between hosts are exactly ranks 1's
    and 3's sends (their right neighbours are on the other host); the cables carry them plus
    TCP/IP headers (under 5 % on full segments) and a few KB of mpiexec's control traffic."""
    _, crossed = across_hosts(
        cluster, 4, *TRAIN, "--strategy", "dp", "--collectives", "ring", "--steps", "50",
        "--out", str(tmp_path), *FLAGS,
    )  # fmt: skip
    traffic = json.loads((tmp_path / "history.json").read_text())["traffic"]
    sent = [sum(t["sent_bytes"] for t in rank.values()) for rank in traffic]
    assert 1.0 <= crossed / (sent[1] + sent[3]) <= 1.1, (crossed, sent)


@needs_hosts
def test_a_checkpoint_saved_across_hosts_resumes_on_one_machine(cluster, single, tmp_path):
    across_hosts(
        cluster, 4, *TRAIN, "--strategy", "zero3", "--steps", str(STEPS // 2), "--save-every",
        str(STEPS // 2), "--out", str(tmp_path), *FLAGS,
    )  # fmt: skip
    config = TrainConfig(steps=STEPS, eval_batches=0, samples=0)
    resumed, strategy = run(
        ModelConfig(), config, RunConfig(resume=tmp_path / "checkpoint", reshard=True)
    )
    history, params = single
    for layer, p in params.items():
        for k, v in p.items():
            assert np.abs(strategy.full_params()[layer][k] - v).max() <= 1e-5, f"{layer}.{k}"
    assert np.abs(resumed.losses - history.losses).max() <= 1e-5


CRASH = """
import os, sys
from pathlib import Path
from fsdp_lesson import hosts
saves, at = 0, int(sys.argv[2])
def save(self):  # write the record, then die before the step it records
    global saves
    original(self)
    saves += 1
    if saves == at:
        os._exit(9)
original, hosts.Record.save = hosts.Record.save, save
hosts.up(hosts.Layout(2, 1, "100mbit"), Path(sys.argv[1]))
"""


def ended(pid: int, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while hosts.running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not hosts.running(pid)


@needs_hosts
@pytest.mark.parametrize("crash_at", [1, 4, 5, 9, 10])
def test_a_crash_of_up_at_any_step_leaves_nothing_that_down_does_not_remove(tmp_path, crash_at):
    """`up` killed outright after writing its record's k-th version: before the keeper was told
    to keep (k < 10) it ends by itself, taking every namespace with it; after (k = 10, the
    record not yet complete) `down` ends it. Either way `down` leaves the directory empty."""
    out = subprocess.run(
        [sys.executable, "-c", CRASH, str(tmp_path), str(crash_at)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 9, out.stderr
    keeper = hosts.Record.load(tmp_path).keeper
    if keeper is not None and crash_at < 10:
        assert ended(keeper["pid"]), "the keeper outlived `up`"
    hosts.down(tmp_path)
    assert keeper is None or not hosts.running(keeper["pid"])
    assert sorted(tmp_path.iterdir()) == [] and on_the_machine() == []


@needs_hosts
@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGTERM])
def test_up_interrupted_removes_what_it_made_and_says_so(tmp_path, how):
    """Ctrl-C or SIGTERM while `hosts up --hosts 200` builds: one line of its own, exit 2, the
    keeper (and so every namespace) gone and no file left."""
    directory = tmp_path / "hosts"
    command = [sys.executable, "-m", "fsdp_lesson", "hosts", "up", "--hosts", "200", "--dir",
               str(directory)]  # fmt: skip
    building = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)  # fmt: skip
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # until a few hosts exist
        record = hosts.Record.load(directory) if directory.exists() else None
        if record is not None and PROFILE in record.files:
            break
        time.sleep(0.05)
    time.sleep(1)
    keeper = hosts.Record.load(directory).keeper["pid"]
    building.send_signal(how)
    out, err = building.communicate(timeout=60)
    assert building.returncode == 2 and err.count("\n") == 1, err
    assert "hosts up: stopped by" in err and "removed" in err and "Traceback" not in err
    assert not hosts.running(keeper) and sorted(directory.iterdir()) == []


def forged(directory: Path, **changes) -> Path:
    """A record of 1 host in directory, as `up` writes it, with changes."""
    directory.mkdir(mode=0o755)
    record = hosts.Record(directory, hosts.Layout(1, 1, "1gbit"))
    record.files, record.complete = ["hostfile"], True
    for name, value in changes.items():
        setattr(record, name, value)
    record.save()
    (directory / "hostfile").write_text("fsdpl-h0:1\n")
    return directory


def refused(directory: Path, capsys, *words: str) -> None:
    """`hosts down` refuses the record in one line naming words, and removes nothing."""
    before = sorted(directory.iterdir())
    assert hosts.main(["down", "--dir", str(directory)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nothing was touched" in err, err
    assert all(word in err for word in words), err
    assert sorted(directory.iterdir()) == before


def test_up_returns_once_the_keeper_is_kept_and_names_one_that_ended():
    """`up` waited only until it had told the keeper "keep": a loaded machine let its caller
    look before the keeper became `sleep infinity`, and find the hosts gone."""
    slow = "read -r word; sleep 0.3; exec sleep infinity"  # a keeper the machine holds back
    keeper = subprocess.Popen(["sh", "-c", slow], stdin=subprocess.PIPE, text=True)
    try:
        keeper.stdin.write("keep\n")
        keeper.stdin.close()
        hosts.wait_until_kept(keeper)
        assert Path(f"/proc/{keeper.pid}/cmdline").read_bytes() == b"sleep\0infinity\0"
    finally:
        keeper.kill()
        keeper.wait()
    ended = subprocess.Popen(["sh", "-c", "exit 3"], stdin=subprocess.PIPE, text=True)
    ended.wait()
    with pytest.raises(hosts.HostsError, match="did not stay up .exit code 3"):
        hosts.wait_until_kept(ended)


def test_a_record_naming_files_up_never_writes_is_refused(tmp_path, capsys):
    victim = tmp_path / "victim"
    victim.write_text("keep me\n")
    refused(forged(tmp_path / "hosts", files=["hostfile", "../victim"]), capsys, "../victim")
    assert victim.read_text() == "keep me\n"


def test_a_record_naming_a_process_not_a_keeper_ends_nothing(tmp_path):
    """The pid and start time of a process of the user's own (not a keeper in a user namespace
    of its own): down removes the recorded files and leaves the process running."""
    victim = subprocess.Popen(["sleep", "60"])
    try:
        keeper = {"pid": victim.pid, "start": hosts.start_time(victim.pid)}
        directory = forged(tmp_path / "hosts", keeper=keeper)
        hosts.down(directory)
        assert victim.poll() is None and sorted(directory.iterdir()) == []
    finally:
        victim.kill()
        victim.wait()


@pytest.mark.parametrize("damage", ["others-write", "symlink", "directory-others-write",
                                    "not-json", "prefix"])  # fmt: skip
def test_a_record_others_could_have_written_is_refused(tmp_path, capsys, damage):
    directory = forged(tmp_path / "hosts")
    state = directory / "state.json"
    if damage == "others-write":
        state.chmod(0o666)
    elif damage == "symlink":
        elsewhere = tmp_path / "elsewhere.json"
        state.rename(elsewhere)
        state.symlink_to(elsewhere)
    elif damage == "directory-others-write":
        directory.chmod(0o777)
    elif damage == "not-json":
        state.write_text("{")
    else:
        state.write_text(state.read_text().replace('"fsdpl-"', '"victim-"'))
    refused(directory, capsys)


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file to another user")
def test_root_refuses_a_record_another_user_wrote(tmp_path, capsys):
    """The record and its directory of uid 65534: root refuses it and names its owner."""
    directory = forged(tmp_path / "hosts")
    for path in (directory, directory / "state.json"):
        os.chown(path, 65534, 65534)
    refused(directory, capsys, "uid 65534", "--dir")


def test_what_to_enable_names_the_switch_that_is_off(tmp_path, monkeypatch, capsys):
    switch = tmp_path / "unprivileged_userns_clone"
    switch.write_text("0\n")
    monkeypatch.setattr(hosts, "USERNS_SWITCHES", [(str(switch), "0", "sysctl -w x=1")])
    assert "enable unprivileged user namespaces: sysctl -w x=1" in hosts.what_to_enable()
    monkeypatch.setattr(
        hosts, "unavailable", lambda: f"simulated hosts: no; {hosts.what_to_enable()}"
    )
    assert hosts.main(["up", "--dir", str(tmp_path / "hosts")]) == 2


def test_bandwidth_as_tc_spells_it(capsys):
    assert hosts.bits_per_second("1gbit") == 1e9
    assert hosts.bits_per_second("100mbit") == 1e8
    assert hosts.tbf("1gbit")[:4] == ["tbf", "rate", "1000000000bit", "burst"]
    with pytest.raises(hosts.HostsError, match="as tc spells it"):
        hosts.bits_per_second("1gb/s")
    for rate in ("0.0000001bit", "1bit", "99999999999999999999tbit", "200gbit"):
        assert hosts.main(["shape", "--bandwidth", rate, "--dir", "/nonexistent"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--bandwidth" in err, err


@needs_hosts
def test_a_bad_rate_changes_nothing_on_running_hosts(cluster, capsys):
    """`shape` and `up` with a rate tc refuses: one line each, the hosts up, the cables as were."""
    keeper = hosts.Record.load(cluster).keeper
    assert hosts.main(["shape", "--bandwidth", "1bit", "--dir", str(cluster)]) == 2
    assert hosts.main(["up", "--bandwidth", "99999999999999999999tbit", "--dir", str(cluster)]) == 2
    assert capsys.readouterr().err.count("\n") == 2
    record = hosts.Record.load(cluster)
    assert record.complete and record.keeper == keeper and hosts.keeper_alive(record)
    assert "rate 1Gbit" in qdisc(cluster, f"{PREFIX}h0", "eth0")


def test_the_hosts_environment_overrides_loopback_binding(monkeypatch):
    """launch.py's settings apply across the hosts too, except one that would bind a rank to
    loopback; LINK_ENV keeps UCX on the cables; a value the user set wins."""
    local = {"OMP_NUM_THREADS": "1", "UCX_NET_DEVICES": "lo", "SOME_IFACE": "lo"}
    monkeypatch.setattr(hosts, "rank_settings", lambda env: {k: env.get(k, v) for k, v in
                                                             local.items()})  # fmt: skip
    env = hosts.hosts_env({"PATH": "/bin"})
    assert env["UCX_TLS"] == "tcp,self" and env["UCX_NET_DEVICES"] == "eth0"
    assert env["OMP_NUM_THREADS"] == "1" and "SOME_IFACE" not in env
    assert hosts.hosts_env({"UCX_TLS": "tcp,self,sm"})["UCX_TLS"] == "tcp,self,sm"
    passed_on = {"UCX_NET_DEVICES": "lo", "FI_TCP_IFACE": "lo", "OMP_NUM_THREADS": "2",
                 "FSDP_LESSON_LOOPBACK": "UCX_NET_DEVICES,FI_TCP_IFACE"}  # fmt: skip
    env = hosts.hosts_env(passed_on)  # what a launcher here set is not the user's choice
    assert env["UCX_NET_DEVICES"] == "eth0" and "FI_TCP_IFACE" not in env
    assert env["OMP_NUM_THREADS"] == "2" and "FSDP_LESSON_LOOPBACK" not in env
