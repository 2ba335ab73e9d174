"""Simulated hosts: a cluster of machines inside this one, joined by a link of known bandwidth.

    python -m fsdp_lesson hosts up --hosts 2 --slots 2 --bandwidth 1gbit
    build/hosts/mpiexec -n 4 python -m fsdp_lesson train --strategy zero3 --out runs/z3
    python -m fsdp_lesson hosts down

On one machine the "network" between ranks is shared memory, so a collective costs
microseconds and the network never decides anything. Real FSDP runs where it does. This module
builds the smallest honest stand-in for a cluster: every host is a Linux network namespace (its
own interfaces, addresses and routes; and, for each job, its own hostname and /dev/shm), all
hosts are plugged into one switch, and each host's cable to the switch is throttled to the
bandwidth you ask for:

      fsdpl-h0 198.18.0.10           fsdpl-h1 198.18.0.11         one namespace per host
      ranks 0, 1                     ranks 2, 3                   (slots 2: filled in order)
        eth0  tbf: host -> switch      eth0                       the host's end of its cable
         |                              |
      fsdpl-p0  tbf: switch -> host   fsdpl-p1                    the switch's end
          \\___________ fsdpl-br ________/                         a bridge: the switch
                fsdpl-sw 198.18.0.1                               its namespace; mpiexec runs here

A cable is a veth pair and a token-bucket filter (`tc qdisc ... tbf`) on each of its ends, so
both directions run at the bandwidth. Everything lives in namespaces this module creates (named
`fsdpl-...`), with addresses from 198.18.0.0/15, the range set aside for benchmarking
(RFC 2544): nothing is added to the machine's own network, and nothing outside it is ever
addressed. It needs root (creating namespaces) and iproute2 (`ip`, `tc`).

**How ranks get onto the hosts.** `build/hosts/mpiexec` is hydra's mpiexec with a hostfile, as on
a cluster; what ssh does there (start hydra's proxy on a host, which then starts that host's
ranks) `build/hosts/launch` does here: `ip netns exec <host> ...`. mpiexec itself runs in the
switch's namespace, where the proxies reach it at 198.18.0.1.

**Why bytes really cross the cable.** MPICH's UCX transport, left alone, sees that all "hosts" are
one kernel and moves their bytes through shared memory (cross-memory attach, or memory mapped
through /proc, SysV): six allreduces of 4 MiB across two hosts put 50 KB on the cables, against
50 MB over TCP. So the ranks get UCX_TLS=tcp,self: between hosts only TCP, which goes over eth0
and the tbf. Between ranks of one host MPICH uses its own shared memory (it knows which ranks
share a host from the hostfile), as on a real node; each host's private /dev/shm and SysV IPC
keep one host's segments from another's. `link_bytes()` reads the cables' byte counters, to
check where the bytes went.

**Notebooks on the hosts.** `hosts up` also writes an ipyparallel profile,
build/hosts/profile_hosts (never ~/.ipython/profile_hosts, which README's real clusters use),
that `connect(n=4, profile="hosts")` uses while the hosts are up, and `build/hosts/ipcluster
start -n 4` starts from a terminal: the controller runs in the switch's namespace and listens for
engines on 198.18.0.1, and hydra's mpiexec places the engines on the hosts, as on a cluster. The
notebook's client, in the machine's own namespace where 198.18.0.1 is out of reach, talks to the
controller through Unix sockets in the profile (ipc): nothing is added to the machine's network.
`hosts shape --bandwidth 100mbit` re-shapes every cable of running hosts, engines and all.

**What it records.** `hosts up` writes every step to build/hosts/state.json *before* taking it, so
a crash at any point leaves a record of everything that may exist; `hosts down` undoes exactly
the recorded steps, tolerates the ones that never happened, and touches nothing else.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .launch import rank_settings
from .watchdog import process_state

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DIR = ROOT / "build" / "hosts"
PREFIX = "fsdpl-"  # every namespace this module makes is named so; down removes only those
SUBNET = "198.18.0"  # a /24 of the benchmarking range 198.18.0.0/15
SWITCH_ADDRESS = f"{SUBNET}.1"
BRIDGE = "fsdpl-br"  # interface names live inside our own namespaces, never the machine's
TIMEOUT = 30  # seconds for any one ip/tc command, and for processes to end at `down`
PROFILE = "profile_hosts"  # the ipyparallel profile `up` writes into the hosts' directory

# The ranks' transport across the hosts (see the module's docstring). A value the user set wins,
# as with fsdp_lesson/launch.py's settings, so `UCX_TLS=tcp,self,sm build/hosts/mpiexec ...`
# shows what shared memory across "hosts" would do to the cables' counters.
LINK_ENV: dict[str, str] = {
    "MPIR_CVAR_CH4_NETMOD": "ucx",  # the wheel's default netmod, said here
    "UCX_TLS": "tcp,self",  # no UCX shared memory: between hosts only TCP over the cable
    "UCX_NET_DEVICES": "eth0",  # a host's cable (not its loopback)
    "FSDP_LESSON_ALL_INTERFACES": "1",  # launch.py: do not bind ranks to loopback
}
LOOPBACK = re.compile(r"(^|[,:= ])(lo|localhost|127\.0\.0\.1|::1)($|[,: ])")


class HostsError(Exception):
    """Something the user can fix: one line on stderr, exit code 2."""


@dataclass
class Layout:
    """The cluster asked for, and every name and address that follows from it."""

    hosts: int
    slots: int
    bandwidth: str  # as tc spells it: 1gbit, 100mbit
    prefix: str = PREFIX

    @property
    def switch(self) -> str:
        return f"{self.prefix}sw"

    @property
    def names(self) -> list[str]:
        return [f"{self.prefix}h{i}" for i in range(self.hosts)]

    def address(self, i: int) -> str:
        return f"{SUBNET}.{10 + i}"

    def namespaces(self) -> list[str]:
        return [self.switch, *self.names]


def bits_per_second(bandwidth: str) -> float:
    """tc's rate spelling (100mbit, 1gbit, 2.5gbit) as bits per second; k, m, g are 1000s."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit)", bandwidth.strip().lower())
    if match is None or float(match[1]) <= 0:
        raise HostsError(
            f"--bandwidth {bandwidth!r}: give a rate as tc spells it, e.g. 100mbit, 1gbit, 10gbit"
        )
    scale = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}[match[2]]
    return float(match[1]) * scale


def tbf(bandwidth: str) -> list[str]:
    """The token bucket of one cable end: the rate, a burst, and at most 25 ms of queue.

    The burst is what the bucket lets through at once after an idle moment; a real link has
    none (every byte takes 1/rate), so it is kept small: 100 us of the rate, at least two full
    frames (2 x 1514 B). With a 16 KiB burst, small messages crossed free of charge and
    commbench's fit at 100 Mbit/s had R^2 0.78-0.99; with 3 KB, 0.94-1. But the veth hands tbf
    packets of up to 64 KiB (GSO), and one larger than the burst is cut into frames, which at
    1 Gbit/s costs more CPU than a 2-core machine has (5 allreduces of 4 MiB across 2 hosts:
    1.1 s with a 12 KB burst, 0.35 s with 70 KB). So from 500 Mbit/s on, a burst holds one.
    """
    rate = bits_per_second(bandwidth)
    burst = max(2 * 1514, int(rate / 8 * 100e-6))
    if rate >= 500e6:
        burst = max(burst, 70_000)  # a 64 KiB GSO packet and its headers
    return ["tbf", "rate", f"{rate:.0f}bit", "burst", str(burst), "latency", "25ms"]


def unavailable() -> str | None:
    """Why simulated hosts cannot be built here, in one line; None if they can.

    Probes for real in a throwaway namespace (a veth, a bridge, a tbf), which vanishes with the
    probe's process: nothing is left behind.
    """
    if not sys.platform.startswith("linux"):
        return "simulated hosts need Linux network namespaces"
    missing = [tool for tool in ("ip", "tc", "unshare") if shutil.which(tool) is None]
    if missing:
        return (
            f"simulated hosts need {' and '.join(missing)} (Debian: apt-get install iproute2 "
            "util-linux)"
        )
    if os.geteuid() != 0:
        return "simulated hosts need root (network namespaces, tc): run this as root"
    probe = (
        "ip link add fsdpl-a type veth peer name fsdpl-b && ip link add fsdpl-br type bridge"
        " && tc qdisc add dev fsdpl-a root tbf rate 1mbit burst 16384 latency 25ms"
    )
    try:
        out = subprocess.run(
            ["unshare", "--net", "sh", "-c", probe], capture_output=True, text=True, timeout=30
        )
    except subprocess.TimeoutExpired:
        return "simulated hosts: probing for network namespaces timed out"
    if out.returncode != 0:
        why = (out.stderr.strip().splitlines() or ["no reason given"])[-1]
        return f"simulated hosts: this machine refuses network namespaces, veth or tbf ({why})"
    return None


# --- the record -------------------------------------------------------------------------------


class Record:
    """build/hosts/state.json: the layout and every step of `up`, each written before it is
    taken. A step is {"what": ..., "name"/"path": ..., "command": [...]} and `down` knows how
    to undo each kind: a namespace (with everything inside it), a directory of files under
    /etc/netns, a file of ours, the ipyparallel profile (a directory beside the record)."""

    def __init__(self, directory: Path, layout: Layout | None = None):
        self.path = directory / "state.json"
        self.layout = layout
        self.steps: list[dict] = []
        self.complete = False

    @classmethod
    def load(cls, directory: Path) -> Record | None:
        path = directory / "state.json"
        if not path.exists():
            return None
        try:
            data = json.loads(path.read_text())
            record = cls(directory, Layout(**data["layout"]))
            record.steps, record.complete = data["steps"], data["complete"]
        except (ValueError, KeyError, TypeError) as err:
            raise HostsError(f"{path} is damaged ({err}): nothing was removed") from None
        return record

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = {"layout": asdict(self.layout), "steps": self.steps, "complete": self.complete}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, self.path)  # atomic: the record is always whole

    def step(self, what: str, **details) -> None:
        """Record the step, then (the caller) take it."""
        self.steps.append({"what": what, **details})
        self.save()


def run(command: list[str], check: bool = True) -> subprocess.CompletedProcess:
    """One ip/tc command with a timeout; a failure raises HostsError with its stderr's last line."""
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        raise HostsError(f"`{shlex.join(command)}` did not finish in {TIMEOUT} s") from None
    if check and out.returncode != 0:
        why = (out.stderr.strip().splitlines() or ["no message"])[-1]
        raise HostsError(f"`{shlex.join(command)}` failed: {why}")
    return out


def act(record: Record, what: str, command: list[str], **details) -> None:
    """Record a step, then run its command."""
    record.step(what, command=command, **details)
    run(command)


# --- up ---------------------------------------------------------------------------------------


def up(layout: Layout, directory: Path = DEFAULT_DIR) -> Record:
    """Build the hosts of layout and write hostfile, launch and mpiexec into directory.

    Hosts recorded there already are taken down first. On a failure, whatever was made is
    taken down again before the error is raised.
    """
    reason = unavailable()
    if reason is not None:
        raise HostsError(reason)
    check_layout(layout)
    directory = directory.resolve()  # the scripts and the profile name it: from any cwd
    if Record.load(directory) is not None:
        down(directory)
    for name in layout.namespaces():
        if Path("/run/netns", name).exists():
            raise HostsError(
                f"namespace {name} exists but {directory / 'state.json'} does not record it "
                f"(another checkout's hosts, or build/ was removed): ip netns delete {name}"
            )
    record = Record(directory, layout)
    try:
        build(record, layout, directory)
    except BaseException:
        down(directory)
        raise
    record.complete = True
    record.save()
    return record


def check_layout(layout: Layout) -> None:
    if not 1 <= layout.hosts <= 200:
        raise HostsError(f"--hosts {layout.hosts}: between 1 and 200 hosts")
    if layout.slots < 1:
        raise HostsError(f"--slots {layout.slots}: at least 1 rank per host")
    if not re.fullmatch(r"fsdpl-[a-z0-9-]{0,20}", layout.prefix):
        raise HostsError(f"prefix {layout.prefix!r}: fsdpl- and up to 20 of [a-z0-9-]")
    bits_per_second(layout.bandwidth)


def build(record: Record, layout: Layout, directory: Path) -> None:
    """Every step of `up`, each recorded before it is taken."""
    # first, so that `down` removes it last, once nothing of ours runs that could write into it
    profile = make_profile(record, layout, directory)
    names_file = hosts_file(layout)
    for ns in layout.namespaces():
        make_namespace(record, ns, names_file)
    make_switch(record, layout.switch)
    for i, host in enumerate(layout.names):
        make_cable(record, layout, i, host)
    write_scripts(record, layout, directory, profile)


def make_profile(record: Record, layout: Layout, directory: Path) -> Path:
    """The ipyparallel profile directory, with its ipcluster_config.py; returns its path."""
    profile = directory / PROFILE
    if len(str(profile / "security" / "client-65535")) > 107:  # a Unix socket's path limit
        raise HostsError(f"{directory} is too long a path for Unix sockets: use a shorter --dir")
    record.step("profile", path=str(profile))
    profile.mkdir(parents=True, exist_ok=True)
    (profile / "ipcluster_config.py").write_text(ipcluster_config(layout, profile))
    return profile


def hosts_file(layout: Layout) -> str:
    """The /etc/hosts every namespace sees: the switch's and each host's name and address."""
    return f"127.0.0.1 localhost\n{SWITCH_ADDRESS} {layout.switch}\n" + "".join(
        f"{layout.address(i)} {name}\n" for i, name in enumerate(layout.names)
    )


def make_namespace(record: Record, ns: str, names_file: str) -> None:
    """One namespace (a host's or the switch's): its /etc files, IPv6 off, loopback up."""
    act(record, "netns", ["ip", "netns", "add", ns], name=ns)
    # `ip netns exec` shows these files as /etc/hosts and /etc/resolv.conf: the hosts' names
    # resolve from the file, and a lookup of any other name asks no nameserver but 127.0.0.1
    # inside the namespace, where none listens.
    etc = Path("/etc/netns", ns)
    if not etc.parent.exists():  # made by us, so removed by down when empty again
        record.step("etc", path=str(etc.parent), files=[])
        etc.parent.mkdir()
    record.step("etc", path=str(etc), files=["hosts", "resolv.conf"])
    # `ip netns add` just made ns, so an /etc/netns/ns already there is no live setup's: a
    # killed run's (our prefix), which this one takes over and `down` removes
    etc.mkdir(exist_ok=True)
    (etc / "hosts").write_text(names_file)
    (etc / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
    # IPv6 off (where the kernel has it): no router solicitations on the counters
    no_ipv6 = "for f in all default; do echo 1 >/proc/sys/net/ipv6/conf/$f/disable_ipv6; done"
    no_ipv6 = f"({no_ipv6}) 2>/dev/null; :"
    act(record, "inside", ["ip", "netns", "exec", ns, "sh", "-c", no_ipv6], name=ns)
    act(record, "inside", ["ip", "-n", ns, "link", "set", "lo", "up"], name=ns)


def make_switch(record: Record, sw: str) -> None:
    """The bridge in the switch's namespace, at SWITCH_ADDRESS."""
    act(record, "inside", ["ip", "-n", sw, "link", "add", BRIDGE, "type", "bridge"], name=sw)
    act(
        record,
        "inside",
        ["ip", "-n", sw, "addr", "add", f"{SWITCH_ADDRESS}/24", "dev", BRIDGE],
        name=sw,
    )
    act(record, "inside", ["ip", "-n", sw, "link", "set", BRIDGE, "up"], name=sw)


def make_cable(record: Record, layout: Layout, i: int, host: str) -> None:
    """Host i's cable: a veth pair from its eth0 to a port of the bridge, both ends shaped."""
    sw, port = layout.switch, f"fsdpl-p{i}"
    peer = ["peer", "name", "eth0", "netns", host]  # the host's end of the pair
    act(record, "inside", ["ip", "-n", sw, "link", "add", port, "type", "veth", *peer], name=sw)
    act(record, "inside", ["ip", "-n", sw, "link", "set", port, "master", BRIDGE, "up"], name=sw)
    act(
        record,
        "inside",
        ["ip", "-n", host, "addr", "add", f"{layout.address(i)}/24", "dev", "eth0"],
        name=host,
    )
    act(record, "inside", ["ip", "-n", host, "link", "set", "eth0", "up"], name=host)
    shape = tbf(layout.bandwidth)
    act(
        record,
        "inside",
        ["tc", "-n", host, "qdisc", "add", "dev", "eth0", "root", *shape],
        name=host,
    )
    act(record, "inside", ["tc", "-n", sw, "qdisc", "add", "dev", port, "root", *shape], name=sw)


def write_scripts(record: Record, layout: Layout, directory: Path, profile: Path) -> None:
    """hostfile, launch, mpiexec and ipcluster in directory."""
    hostfile = "".join(f"{name}:{layout.slots}\n" for name in layout.names)
    write_file(record, directory / "hostfile", hostfile)
    write_file(record, directory / "launch", launch_script(layout), executable=True)
    write_file(record, directory / "mpiexec", mpiexec_script(directory), executable=True)
    write_file(record, directory / "ipcluster", ipcluster_script(layout, profile), executable=True)


def write_file(record: Record, path: Path, text: str, executable: bool = False) -> None:
    record.step("file", path=str(path))
    path.write_text(text)
    if executable:
        path.chmod(0o755)


def launch_script(layout: Layout) -> str:
    """build/hosts/launch: ssh's part. hydra runs `launch -x HOST COMMAND...` to start its proxy
    on HOST; here that is entering HOST's namespace, with the host's own hostname, SysV IPC and
    /dev/shm (a fresh tmpfs), as a separate machine would have."""
    names = " ".join(layout.names)
    return f"""#!/bin/sh
# Written by `python -m fsdp_lesson hosts up` (fsdp_lesson/hosts.py): what ssh does on a
# cluster. hydra's mpiexec runs `launch [-x] HOST COMMAND...` to start its proxy on HOST.
while [ "${{1#-}}" != "$1" ]; do shift; done  # ssh's options (-x: no X11 forwarding)
host=$1; shift
case " {names} " in
    *" $host "*) ;;
    *) echo "launch: $host is not one of the simulated hosts ({names})" >&2; exit 255 ;;
esac
exec ip netns exec "$host" unshare --uts --ipc --mount sh -c \\
    'hostname "$0" && mount -t tmpfs -o mode=1777 fsdpl-shm /dev/shm && exec sh -c "$1"' \\
    "$host" "$*"
"""


def mpiexec_script(directory: Path) -> str:
    """build/hosts/mpiexec: this Python running mpiexec_main()."""
    return f"""#!{sys.executable}
# Written by `python -m fsdp_lesson hosts up`: mpiexec -n N COMMAND... across the simulated
# hosts, ranks filling each host's slots in turn (fsdp_lesson/hosts.py, mpiexec_main).
import sys
sys.path.insert(0, {str(ROOT)!r})
from fsdp_lesson.hosts import mpiexec_main
sys.exit(mpiexec_main(sys.argv[1:], {str(directory)!r}))
"""


def ipcluster_config(layout: Layout, profile: Path) -> str:
    """The profile's ipcluster_config.py: the controller in the switch's namespace, engines for
    hosts on 198.18.0.1 (tcp), clients through Unix sockets in the profile (ipc: the machine's
    own namespace cannot reach 198.18.0.1); the engines by MPI across the hosts."""
    python = [sys.executable, "-m", "ipyparallel.controller"]
    controller = ["ip", "netns", "exec", layout.switch, *python]
    controller_args = [
        f"--IPController.engine_ip={SWITCH_ADDRESS}",
        "--IPController.client_transport=ipc",
        f"--IPController.client_ip={profile / 'security' / 'client'}",
    ]
    return f"""# Written by `python -m fsdp_lesson hosts up` (fsdp_lesson/hosts.py); `hosts down`
# removes it. The controller in the switch's namespace, the engines on the hosts.
c = get_config()
c.Cluster.engine_launcher_class = "mpi"
c.MPILauncher.mpi_cmd = [{str(profile.parent / "mpiexec")!r}]
c.LocalControllerLauncher.controller_cmd = {controller!r}
c.LocalControllerLauncher.controller_args = {controller_args!r}
"""


def ipcluster_script(layout: Layout, profile: Path) -> str:
    """build/hosts/ipcluster: ipcluster with the hosts' profile (start -n 4, stop), run in the
    switch's namespace so that `down` ends it with its controller."""
    ipcluster = str(Path(sys.executable).parent / "ipcluster")
    ipcluster = shlex.join(["ip", "netns", "exec", layout.switch, ipcluster])
    return f"""#!/bin/sh
# Written by `python -m fsdp_lesson hosts up`: `ipcluster start -n 4` (or stop) with the hosts'
# profile: the controller in the switch's namespace, the engines on the hosts.
exec {ipcluster} "$@" --profile-dir={shlex.quote(str(profile))}
"""


def link_client_sockets(client_file: Path, timeout: float = TIMEOUT) -> None:
    """Give the client sockets of a controller of the hosts' profile the names ipyparallel's
    Client (9.2) connects to: the controller binds ipc://PATH-PORT, the client asks for
    PATH:PORT. Waits at most timeout seconds for the controller to write client_file."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            connection = json.loads(client_file.read_text())
            break
        except (OSError, ValueError):  # not yet written, or being written
            if time.monotonic() > deadline:
                raise HostsError(
                    f"the controller wrote no {client_file} in {timeout:g} s"
                ) from None
            time.sleep(0.1)
    path = Path(connection["interface"].removeprefix("ipc://"))
    for port in {value for value in connection.values() if isinstance(value, int)}:
        alias = path.with_name(f"{path.name}:{port}")
        if not alias.is_symlink():
            alias.symlink_to(f"{path.name}-{port}")


# --- running across the hosts -----------------------------------------------------------------


def hosts_env(base: dict[str, str]) -> dict[str, str]:
    """The environment of a job across the hosts: base, LINK_ENV where base says nothing, then
    the project's launch settings (launch.py) minus any that would bind a rank to loopback.

    A loopback setting that a launcher of this project put into base (launch.py lists those in
    FSDP_LESSON_LOOPBACK) is not the user's: it is dropped too.
    """
    inherited = base.get("FSDP_LESSON_LOOPBACK", "").split(",")
    env = {k: v for k, v in base.items() if not (k in inherited and LOOPBACK.search(v))}
    env.pop("FSDP_LESSON_LOOPBACK", None)
    env |= {k: v for k, v in LINK_ENV.items() if k not in env}
    for name, value in rank_settings(env).items():
        if name in env or not LOOPBACK.search(value):
            env[name] = value
    return env


def up_record(directory: Path = DEFAULT_DIR) -> Record:
    """The record of hosts that are up in directory; HostsError saying what to type if none."""
    record = Record.load(directory)
    if record is None or not record.complete:
        raise HostsError(f"no simulated hosts are up ({directory}): python -m fsdp_lesson hosts up")
    return record


def set_bandwidth(bandwidth: str, directory: Path = DEFAULT_DIR) -> None:
    """Re-shape both ends of every cable of the hosts that are up (tc qdisc replace): the same
    job at 10gbit, 1gbit and 100mbit, without rebuilding the hosts or restarting engines."""
    record = up_record(directory)
    shape, sw = tbf(bandwidth), record.layout.switch
    ends = [(host, "eth0") for host in record.layout.names]
    ends += [(sw, f"fsdpl-p{i}") for i in range(record.layout.hosts)]
    for ns, dev in ends:
        run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", *shape])
    record.layout.bandwidth = bandwidth
    record.save()


def mpiexec_command(argv: list[str], directory: Path = DEFAULT_DIR) -> list[str]:
    """The command that runs hydra's mpiexec inside the switch's namespace, hostname and all,
    with the hosts' hostfile and launch script: argv is mpiexec's (-n N COMMAND...)."""
    sw = up_record(directory).layout.switch
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    return [
        "ip", "netns", "exec", sw, "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
        sw, mpiexec, "-launcher", "ssh", "-launcher-exec", str(directory / "launch"),
        "-f", str(directory / "hostfile"), *argv,
    ]  # fmt: skip


def mpiexec_main(argv: list[str], directory: str | Path = DEFAULT_DIR) -> int:
    """build/hosts/mpiexec: becomes hydra's mpiexec (exec), so signals and exit code are its."""
    try:
        command = mpiexec_command(argv, Path(directory))
    except HostsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    os.execvpe(command[0], command, hosts_env(dict(os.environ)))


def link_bytes(directory: Path = DEFAULT_DIR) -> dict[str, dict[str, int]]:
    """The cables' byte counters, {host: {"tx": sent into its cable, "rx": received from it}},
    read from /sys/class/net/eth0/statistics inside each host; under the switch's name, what
    the switch itself sent and received (mpiexec's control traffic with the hosts' proxies).

    What crossed between hosts is then the sum of the hosts' tx less the switch's rx.
    """
    record = Record.load(directory)
    if record is None:
        raise HostsError(f"no simulated hosts are up ({directory})")
    where = [(host, "eth0") for host in record.layout.names] + [(record.layout.switch, BRIDGE)]
    counters = {}
    for ns, dev in where:
        stats = f"/sys/class/net/{dev}/statistics"
        read = ["cat", f"{stats}/tx_bytes", f"{stats}/rx_bytes"]
        tx, rx = run(["ip", "netns", "exec", ns, *read]).stdout.split()
        counters[ns] = {"tx": int(tx), "rx": int(rx)}
    return counters


def between_hosts(before: dict, after: dict, directory: Path = DEFAULT_DIR) -> int:
    """Bytes that went from host to host between two link_bytes() readings: every host's
    cable's tx, less what the switch itself took in (control traffic for mpiexec)."""
    layout = Record.load(directory).layout
    sent = sum(after[h]["tx"] - before[h]["tx"] for h in layout.names)
    return sent - (after[layout.switch]["rx"] - before[layout.switch]["rx"])


# --- down -------------------------------------------------------------------------------------


def down(directory: Path = DEFAULT_DIR) -> list[str]:
    """Undo every recorded step, newest first; what was never made is skipped. Returns what was
    removed. The record goes last, so a down that fails can be run again."""
    record = Record.load(directory)
    if record is None:
        return []
    removed = []
    namespaces = [step["name"] for step in record.steps if step["what"] == "netns"]
    ours = [ns for ns in namespaces if ns.startswith(PREFIX) and Path("/run/netns", ns).exists()]
    end_processes_in(ours)
    for step in reversed(record.steps):
        what = step["what"]
        if what == "netns" and step["name"] in ours:
            run(["ip", "netns", "delete", step["name"]])  # its links, addresses, qdiscs too
            removed.append(f"namespace {step['name']}")
        elif what == "etc" and is_ours(step["path"]):
            etc = Path(step["path"])
            for name in step["files"]:
                (etc / name).unlink(missing_ok=True)
            if etc.is_dir() and not any(etc.iterdir()):
                etc.rmdir()
        elif what == "file":
            Path(step["path"]).unlink(missing_ok=True)
        elif what == "profile" and Path(step["path"]).parent.resolve() == directory.resolve():
            shutil.rmtree(step["path"], ignore_errors=True)
    record.path.unlink()
    return removed


def is_ours(etc: str) -> bool:
    """/etc/netns itself (removed only when empty) or /etc/netns/fsdpl-...: nothing else."""
    path = Path(etc)
    return path == Path("/etc/netns") or (
        path.parent == Path("/etc/netns") and path.name.startswith(PREFIX)
    )


def end_processes_in(namespaces: list[str]) -> None:
    """Stop what still runs in our namespaces (a job's mpiexec, proxies, ranks; a controller and
    its engines), all at once: SIGTERM, then SIGKILL what is left after TIMEOUT seconds. (One
    namespace at a time, an engine would wait out the TIMEOUT in MPI_Finalize for its peers.)"""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = [
            int(pid)
            for ns in namespaces
            for pid in run(["ip", "netns", "pids", ns], check=False).stdout.split()
        ]
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + TIMEOUT
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if running(p)]
            time.sleep(0.05)
        if not pids:
            return


def running(pid: int) -> bool:
    """Whether a process runs (a zombie, ended but not yet reaped by its parent, does not)."""
    return process_state(pid) not in ("gone", "exited")


# --- the command line -------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fsdp_lesson hosts", description=__doc__.splitlines()[0]
    )
    commands = parser.add_subparsers(dest="action", required=True)
    start = commands.add_parser("up", help="build the hosts (root); taken down first if up")
    start.add_argument("--hosts", type=int, default=2, help="hosts (default: 2)")
    start.add_argument("--slots", type=int, default=2, help="ranks per host (default: 2)")
    start.add_argument(
        "--bandwidth", default="1gbit", help="each host's link, as tc spells it (default: 1gbit)"
    )
    start.add_argument("--prefix", default=PREFIX, help=argparse.SUPPRESS)  # the tests' own
    shape = commands.add_parser("shape", help="re-shape every cable of the hosts that are up")
    shape.add_argument("--bandwidth", required=True, help="as tc spells it: 10gbit, 100mbit")
    for sub in (start, commands.add_parser("down", help="remove what `up` recorded"), shape):
        sub.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="default: build/hosts")
    args = parser.parse_args(argv)
    try:
        if args.action == "shape":
            set_bandwidth(args.bandwidth, args.dir)
            print(f"hosts shape: every link {args.bandwidth} both ways (tbf)")
            return 0
        if args.action == "down":
            removed = down(args.dir)
            print(f"hosts down: removed {', '.join(removed)}" if removed else "hosts down: none up")
            return 0
        layout = Layout(args.hosts, args.slots, args.bandwidth, args.prefix)
        up(layout, args.dir)
    except HostsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(summary(layout, args.dir))
    return 0


def summary(layout: Layout, directory: Path) -> str:
    lines = [
        f"hosts up: {layout.hosts} hosts x {layout.slots} slots, each link {layout.bandwidth} "
        "both ways (tbf)"
    ]
    for i, name in enumerate(layout.names):
        lines.append(f"  {name}  {layout.address(i)}  slots {layout.slots}")
    lines.append(f"  {layout.switch}  {SWITCH_ADDRESS}  the switch (bridge {BRIDGE}); mpiexec")
    lines.append(
        f"run:  {directory / 'mpiexec'} -n {layout.hosts * layout.slots} python -m fsdp_lesson "
        "train --strategy zero3 --out runs/z3"
    )
    lines.append(
        f'notebook: connect(n={layout.hosts * layout.slots}, profile="hosts")   or, in a terminal: '
        f"{directory / 'ipcluster'} start -n {layout.hosts * layout.slots}"
    )
    lines.append("shape: python -m fsdp_lesson hosts shape --bandwidth 100mbit")
    lines.append("stop: python -m fsdp_lesson hosts down   (make hosts-down)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
