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
addressed. It needs iproute2 (`ip`, `tc`) and util-linux (`unshare`, `nsenter`), and no root.

**Private to one checkout, root or not.** The namespaces live inside a user namespace of their
own, held open by one process, the keeper (`unshare --user --map-root-user --net --mount`):
inside it the user is root over what it made and nothing else, its /run is a private tmpfs
(so `ip netns` names its namespaces there, seen by no one outside), and its /etc/hosts and
/etc/resolv.conf are bind-mounted from the hosts' directory. Two checkouts, two users, or root
and a user each have hosts of their own with the same names and addresses, and cannot see or
touch each other's. Every command on the hosts enters the keeper first (`nsenter -t KEEPER -U
-m -n`). While `up` builds, the keeper waits on a pipe from `up`: if `up` dies, however, the
keeper ends, and with it every namespace (the kernel frees them), so nothing is left behind.

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
controller through Unix sockets in the profile (ipc), which the file system, not the network,
joins: nothing is added to the machine's network.
`hosts shape --bandwidth 100mbit` re-shapes every cable of running hosts, engines and all.

**What it records, and what `down` trusts.** build/hosts/state.json names the layout, the
keeper (its process id and start time) and the files `up` wrote, each written before it is
made. `down` acts on it only when the record and its directory belong to the user running it
and no one else can write them, and only on what `up` itself makes: the files of a fixed list
in that directory, and the processes inside the keeper's user namespace. A record that fails a
check is refused in one line, and nothing is touched.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .launch import rank_settings
from .watchdog import process_state

ROOT = Path(__file__).resolve().parent.parent
HOSTS_DIR_ENV = "FSDP_LESSON_HOSTS_DIR"  # where the hosts are, if not in this checkout's build/
DEFAULT_DIR = Path(os.environ.get(HOSTS_DIR_ENV) or ROOT / "build" / "hosts")
PREFIX = "fsdpl-"  # the names of the hosts' namespaces (private to their keeper)
SUBNET = "198.18.0"  # a /24 of the benchmarking range 198.18.0.0/15
SWITCH_ADDRESS = f"{SUBNET}.1"
BRIDGE = "fsdpl-br"  # interface names live inside our own namespaces, never the machine's
TIMEOUT = 30  # seconds for any one ip/tc command, and for processes to end at `down`
MAX_HOSTS = 200
# What `up` writes into the hosts' directory, and so all that `down` may remove there
FILES = ("etc-hosts", "resolv.conf", "hostfile", "launch", "mpiexec", "ipcluster")
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


class Interrupted(Exception):
    """SIGTERM during `up` (SIGINT is KeyboardInterrupt): what was made is removed, then this."""


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


RATE = re.compile(r"(\d{1,40}(?:\.\d{1,40})?)(bit|kbit|mbit|gbit|tbit)")
MIN_RATE, MAX_RATE = 1e3, 100e9  # 1kbit .. 100gbit: tc's tbf takes these with our burst


def bits_per_second(bandwidth: str) -> float:
    """tc's rate spelling (100mbit, 1gbit, 2.5gbit) as bits per second; k, m, g are 1000s.
    Only rates between 1kbit and 100gbit: tc refuses below 8 bit/s and above 2^64 bytes/s."""
    match = RATE.fullmatch(bandwidth.strip().lower())
    shown = bandwidth if len(bandwidth) <= 40 else bandwidth[:37] + "..."
    if match is None:
        raise HostsError(
            f"--bandwidth {shown!r}: give a rate as tc spells it, e.g. 100mbit, 1gbit, 10gbit"
        )
    scale = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}[match[2]]
    rate = float(match[1]) * scale
    if not MIN_RATE <= rate <= MAX_RATE:
        raise HostsError(f"--bandwidth {shown}: give a rate from 1kbit to 100gbit")
    return rate


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


def check_bandwidth(bandwidth: str) -> None:
    """Ask tc itself, on the loopback of a throwaway namespace, whether it takes the cables'
    bucket at this rate: before `up` builds or `shape` changes anything."""
    shape = shlex.join(["tc", "qdisc", "add", "dev", "lo", "root", *tbf(bandwidth)])
    out = run(["unshare", "--user", "--map-root-user", "--net", "sh", "-c", shape], check=False)
    if out.returncode != 0:
        why = (out.stderr.strip().splitlines() or ["no reason given"])[0]
        raise HostsError(f"--bandwidth {bandwidth}: tc refuses it ({why[:120]})")


def unavailable() -> str | None:
    """Why simulated hosts cannot be built here, in one line that says what to enable; None if
    they can. Probes for real, as the user at hand, in a throwaway user and network namespace
    (a private /run, a named namespace, a veth, a bridge, a tbf): nothing is left behind."""
    if not sys.platform.startswith("linux"):
        return "simulated hosts need Linux network namespaces"
    missing = [tool for tool in ("ip", "tc", "unshare", "nsenter") if shutil.which(tool) is None]
    if missing:
        return (
            f"simulated hosts need {' and '.join(missing)} (Debian: apt-get install iproute2 "
            "util-linux)"
        )
    probe = (
        "mount -t tmpfs fsdpl-run /run && ip netns add fsdpl-probe"
        " && ip -n fsdpl-probe link add fsdpl-a type veth peer name fsdpl-b"
        " && ip -n fsdpl-probe link add fsdpl-br type bridge"
        " && tc -n fsdpl-probe qdisc add dev fsdpl-a root tbf rate 1mbit burst 16384 latency 25ms"
    )
    try:
        out = subprocess.run(
            ["unshare", *KEEPER_NAMESPACES, "sh", "-c", probe],
            capture_output=True, text=True, timeout=TIMEOUT,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return "simulated hosts: probing for user and network namespaces timed out"
    if out.returncode == 0:
        return None
    why = (out.stderr.strip().splitlines() or ["no reason given"])[-1][:120]
    return f"simulated hosts: {why}; {what_to_enable()}"


USERNS_SWITCHES = [  # (file, the value that forbids unprivileged user namespaces, the fix)
    ("/proc/sys/kernel/unprivileged_userns_clone", "0",
     "sysctl -w kernel.unprivileged_userns_clone=1"),
    ("/proc/sys/user/max_user_namespaces", "0", "sysctl -w user.max_user_namespaces=15000"),
    ("/proc/sys/kernel/apparmor_restrict_unprivileged_userns", "1",
     "sysctl -w kernel.apparmor_restrict_unprivileged_userns=0"),
]  # fmt: skip


def what_to_enable() -> str:
    """The switch that keeps unprivileged user namespaces off on this kernel, and its fix."""
    for path, forbids, fix in USERNS_SWITCHES:
        try:
            if Path(path).read_text().strip() == forbids:
                return f"enable unprivileged user namespaces: {fix} (as root, once)"
        except OSError:
            continue
    return (
        "the kernel must allow user namespaces (CONFIG_USER_NS) and, in a container, the runtime "
        "must let it create them (e.g. docker run --security-opt seccomp=unconfined)"
    )


# --- the keeper -------------------------------------------------------------------------------

KEEPER_NAMESPACES = ["--user", "--map-root-user", "--net", "--mount", "--propagation", "private"]

# Run by the keeper (sh -c, $0 the hosts' directory): a private /run for `ip netns`, the hosts'
# names over /etc/hosts, no nameserver but 127.0.0.1 (where none listens) in /etc/resolv.conf,
# an empty /etc/netns (none of the machine's entries shows through); then "ready", and it waits
# for `up` to say "keep". If `up` dies first, the pipe's end is read, and the keeper exits.
KEEPER = """set -e
mount -t tmpfs -o mode=755 fsdpl-run /run
[ ! -d /etc/netns ] || mount -t tmpfs -o mode=755 fsdpl-etc /etc/netns
mount --bind "$0/etc-hosts" /etc/hosts
[ ! -f /etc/resolv.conf ] || mount --bind "$0/resolv.conf" /etc/resolv.conf
echo ready
read -r word
[ "$word" = keep ]
exec sleep infinity </dev/null >/dev/null 2>&1
"""
KEEPER_CMDLINE = b"sleep\0infinity\0"  # what the keeper is once kept, as /proc shows it


def start_time(pid: int) -> int | None:
    """A process's start time (clock ticks after boot, /proc/PID/stat field 22): with its pid,
    what names it uniquely; None if there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def keeper_alive(record: Record) -> bool:
    """Whether the record's keeper still runs: that pid, started at that time, of this user,
    sleeping as root of a user namespace that maps one user, as `unshare --map-root-user`
    makes (so never a process of the machine's own user namespace, whose fellows `down` would
    otherwise end)."""
    keeper = record.keeper
    if keeper is None or start_time(keeper["pid"]) != keeper["start"]:
        return False
    proc = Path(f"/proc/{keeper['pid']}")
    try:
        return (
            proc.stat().st_uid == os.geteuid()
            and (proc / "cmdline").read_bytes() == KEEPER_CMDLINE
            and (proc / "uid_map").read_text().split()[::2] == ["0", "1"]
        )
    except OSError:
        return False


# Enter the keeper ($1: its pid) in directory $2 and run the rest; a process already inside
# its user namespace (ipcluster started by build/hosts/ipcluster, starting its controller)
# runs it as it is: a process cannot enter the user namespace it is in.
ENTER = """k=$1 wd=$2; shift 2
if [ "$(readlink /proc/self/ns/user)" = "$(readlink /proc/$k/ns/user)" ]; then
    cd "$wd" && exec "$@"
fi
exec nsenter --preserve-credentials -t "$k" -U -m -n --wd="$wd" -- "$@"
"""


def inside(record: Record, cwd: str = "/") -> list[str]:
    """The prefix of a command run inside the hosts' keeper: its user, mount and network
    namespaces, as the user at hand (root there, over the keeper's namespaces only), in cwd
    (entering a mount namespace starts at its root)."""
    return ["sh", "-c", ENTER, "fsdpl-enter", str(record.keeper["pid"]), cwd]


def start_keeper(record: Record, directory: Path) -> subprocess.Popen:
    """Start the keeper, record it, and wait for it to be ready."""
    keeper = subprocess.Popen(
        ["unshare", *KEEPER_NAMESPACES, "sh", "-c", KEEPER, str(directory)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,  # a Ctrl-C in the terminal is up's to handle, not the keeper's
    )  # fmt: skip
    started = start_time(keeper.pid)  # None: it ended already (and so did its namespaces)
    if started is not None:
        record.keeper = {"pid": keeper.pid, "start": started}
        record.save()
    answered, _, _ = select.select([keeper.stdout], [], [], TIMEOUT)
    if not answered or keeper.stdout.readline().strip() != "ready":
        keeper.kill()
        keeper.wait(timeout=TIMEOUT)
        why = (keeper.stderr.read().strip().splitlines() or ["no reason given"])[-1][:120]
        raise HostsError(f"the hosts' keeper did not start ({why}); {what_to_enable()}")
    return keeper


def wait_until_kept(keeper: subprocess.Popen) -> None:
    """Wait for the keeper, told "keep", to become `sleep infinity`: keeper_alive knows it by
    that command line, so until then every command on the hosts would find them gone (a
    loaded machine made `up`'s first caller see that)."""
    cmdline, deadline = Path(f"/proc/{keeper.pid}/cmdline"), time.monotonic() + TIMEOUT
    while time.monotonic() < deadline and keeper.poll() is None:
        try:
            if cmdline.read_bytes() == KEEPER_CMDLINE:
                return
        except OSError:
            break  # it ended
        time.sleep(0.01)
    raise HostsError(f"the hosts' keeper did not stay up (exit code {keeper.poll()}); try again")


# --- the record -------------------------------------------------------------------------------


class Record:
    """DIR/state.json: the layout, the keeper and the files `up` wrote, each recorded before
    it is made. Loaded only if it passes trusted() and its contents are what `up` writes."""

    def __init__(self, directory: Path, layout: Layout | None = None):
        self.directory = directory
        self.path = directory / "state.json"
        self.layout = layout
        self.keeper: dict | None = None
        self.files: list[str] = []
        self.complete = False

    @classmethod
    def load(cls, directory: Path) -> Record | None:
        """The record in directory, None if there is none; HostsError if it cannot be trusted."""
        path = directory / "state.json"
        if not os.path.lexists(path):
            return None
        trusted(directory)
        try:
            data = json.loads(path.read_text())
            record = cls(directory, Layout(**data["layout"]))
            record.keeper, record.files = data["keeper"], data["files"]
            record.complete = data["complete"]
            check_recorded(record)
        except (ValueError, KeyError, TypeError, HostsError) as err:
            why = str(err)[:160]
            raise HostsError(
                f"{path} is not a record `hosts up` wrote ({why}): nothing was touched; "
                f"look at it, remove it, then: python -m fsdp_lesson hosts up --dir {directory}"
            ) from None
        return record

    def save(self) -> None:
        """Write the record whole (a new file, then rename), readable by all, writable by us."""
        data = {"layout": asdict(self.layout), "keeper": self.keeper, "files": self.files,
                "complete": self.complete}  # fmt: skip
        tmp = self.path.with_name(f"state.json.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w") as file:
            file.write(json.dumps(data, indent=1))
        os.replace(tmp, self.path)  # atomic: the record is always whole


def trusted(directory: Path) -> None:
    """The record and its directory are the user's own, plain, and writable by no one else:
    else HostsError saying whose they are. (Root acting on a record another user could write
    would let that user choose what root removes and kills.)"""
    owned(directory, stat.S_ISDIR, "directory")
    owned(directory / "state.json", stat.S_ISREG, "file")


def owned(path: Path, plain, kind: str) -> None:
    """path is a plain kind (plain(mode) holds, no link), the user's own, others cannot write."""
    hosts_dir = path if kind == "directory" else path.parent
    down_hint = f"python -m fsdp_lesson hosts down --dir {hosts_dir}"
    try:
        st = os.lstat(path)
    except PermissionError:
        raise HostsError(
            f"{path} is not readable by you: its owner takes these hosts down ({down_hint})"
        ) from None
    if not plain(st.st_mode):
        raise HostsError(f"{path} is not a plain {kind} (a link?): nothing was touched")
    if st.st_uid != os.geteuid():
        raise HostsError(
            f"{path} belongs to {owner_name(st.st_uid)}, not you: nothing was touched; its "
            f"owner takes these hosts down ({down_hint})"
        )
    if st.st_mode & 0o022:
        raise HostsError(
            f"{path} is writable by others: nothing was touched; if it is yours and as `hosts "
            f"up` left it: chmod go-w {path}"
        )


def owner_name(uid: int) -> str:
    """A user's name (uid N when the machine does not know it)."""
    import pwd

    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def check_recorded(record: Record) -> None:
    """The record names only what `up` makes: a valid layout of our prefix, files of FILES
    (and the profile) in its own directory, a keeper given by an integer pid and start time."""
    layout = record.layout
    check_layout(layout)
    extra = set(record.files) - {*FILES, PROFILE}
    if extra:
        raise HostsError(f"files up never writes: {sorted(extra)}")
    keeper = record.keeper
    if keeper is not None and not (
        set(keeper) == {"pid", "start"} and all(type(v) is int and v > 0 for v in keeper.values())
    ):
        raise HostsError("a keeper that is not a process id and a start time")
    if type(record.complete) is not bool:
        raise HostsError("'complete' is not true or false")


def run(
    command: list[str], check: bool = True, timeout: float = TIMEOUT
) -> subprocess.CompletedProcess:
    """One command with a timeout; a failure raises HostsError with its stderr's last line."""
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise HostsError(f"`{shlex.join(command)[:200]}` did not finish in {timeout:g} s") from None
    if check and out.returncode != 0:
        why = (out.stderr.strip().splitlines() or ["no message"])[-1]
        raise HostsError(f"`{shlex.join(command)[:200]}` failed: {why[:200]}")
    return out


# --- up ---------------------------------------------------------------------------------------


def up(layout: Layout, directory: Path = DEFAULT_DIR) -> Record:
    """Build the hosts of layout and write hostfile, launch and mpiexec into directory.

    Hosts recorded there already are taken down first. On a failure or an interruption,
    whatever was made is taken down again before the error is raised.
    """
    check_layout(layout)
    directory = directory.resolve()  # the scripts and the profile name it: from any cwd
    reason = unavailable()
    if reason is not None:
        raise HostsError(reason)
    check_bandwidth(layout.bandwidth)
    if Record.load(directory) is not None:  # checked first: a record not ours stops us here
        down(directory)
    directory.mkdir(parents=True, exist_ok=True)
    try:
        owned(directory, stat.S_ISDIR, "directory")
    except HostsError as err:
        raise HostsError(f"{err}; or choose a directory of your own with --dir") from None
    record = Record(directory, layout)
    record.save()
    keeper = None
    try:
        write_file(record, "etc-hosts", hosts_file(layout))
        write_file(record, "resolv.conf", "nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
        keeper = start_keeper(record, directory)
        build(record, layout, directory)
        keeper.stdin.write("keep\n")
        keeper.stdin.close()  # from now on the keeper outlives us: `down` ends it
        wait_until_kept(keeper)
    except BaseException:
        with signals_held():
            if keeper is not None:
                keeper.kill()  # and with it every namespace: nothing else runs inside yet
                keeper.wait(timeout=TIMEOUT)
            down(directory)
        raise
    record.complete = True
    record.save()
    return record


class signals_held:
    """SIGINT and SIGTERM ignored for a while (while `up` removes what it made)."""

    def __enter__(self):
        self.saved = [signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)]

    def __exit__(self, *exc):
        for s, handler in zip((signal.SIGINT, signal.SIGTERM), self.saved, strict=True):
            signal.signal(s, handler)


def check_layout(layout: Layout) -> None:
    if type(layout.hosts) is not int or not 1 <= layout.hosts <= MAX_HOSTS:
        raise HostsError(f"--hosts {layout.hosts}: between 1 and {MAX_HOSTS} hosts")
    if type(layout.slots) is not int or not 1 <= layout.slots <= 1024:
        raise HostsError(f"--slots {layout.slots}: between 1 and 1024 ranks per host")
    prefix = layout.prefix
    if not isinstance(prefix, str) or not re.fullmatch(r"fsdpl-[a-z0-9-]{0,20}", prefix):
        raise HostsError(f"prefix {str(layout.prefix)[:40]!r}: fsdpl- and up to 20 of [a-z0-9-]")
    if not isinstance(layout.bandwidth, str):
        raise HostsError("--bandwidth: a rate as tc spells it, e.g. 1gbit")
    bits_per_second(layout.bandwidth)


def build(record: Record, layout: Layout, directory: Path) -> None:
    """Every namespace, cable and script, inside the keeper: one shell per namespace."""
    profile = make_profile(record, layout, directory)
    run_inside(record, switch_commands(layout))
    for i, host in enumerate(layout.names):
        run_inside(record, host_commands(layout, i, host))
    write_scripts(record, layout, directory, profile)


def run_inside(record: Record, commands: list[list[str]]) -> None:
    """Run commands one after another inside the keeper (sh -e: the first failure stops it)."""
    script = "set -e\n" + "\n".join(shlex.join(c) for c in commands)
    run([*inside(record), "sh", "-c", script])


def make_profile(record: Record, layout: Layout, directory: Path) -> Path:
    """The ipyparallel profile directory, with its ipcluster_config.py; returns its path."""
    profile = directory / PROFILE
    if len(str(profile / "security" / "client-65535")) > 107:  # a Unix socket's path limit
        raise HostsError(f"{directory} is too long a path for Unix sockets: use a shorter --dir")
    record.files.append(PROFILE)
    record.save()
    profile.mkdir(exist_ok=True)
    (profile / "ipcluster_config.py").write_text(ipcluster_config(record, layout, profile))
    return profile


def hosts_file(layout: Layout) -> str:
    """The /etc/hosts every namespace sees: the switch's and each host's name and address."""
    return f"127.0.0.1 localhost\n{SWITCH_ADDRESS} {layout.switch}\n" + "".join(
        f"{layout.address(i)} {name}\n" for i, name in enumerate(layout.names)
    )


# IPv6 off (where the kernel has it): no router solicitations on the counters
NO_IPV6 = (
    "(for f in all default; do echo 1 >/proc/sys/net/ipv6/conf/$f/disable_ipv6; done)"
    " 2>/dev/null; :"
)


def namespace_commands(ns: str) -> list[list[str]]:
    """One namespace (a host's or the switch's), IPv6 off, loopback up."""
    return [
        ["ip", "netns", "add", ns],
        ["ip", "netns", "exec", ns, "sh", "-c", NO_IPV6],
        ["ip", "-n", ns, "link", "set", "lo", "up"],
    ]


def switch_commands(layout: Layout) -> list[list[str]]:
    """The switch's namespace and its bridge at SWITCH_ADDRESS."""
    sw = layout.switch
    return [
        *namespace_commands(sw),
        ["ip", "-n", sw, "link", "add", BRIDGE, "type", "bridge"],
        ["ip", "-n", sw, "addr", "add", f"{SWITCH_ADDRESS}/24", "dev", BRIDGE],
        ["ip", "-n", sw, "link", "set", BRIDGE, "up"],
    ]


def host_commands(layout: Layout, i: int, host: str) -> list[list[str]]:
    """Host i's namespace and its cable: a veth pair from its eth0 to a port of the bridge,
    both ends shaped."""
    sw, port, shape = layout.switch, f"fsdpl-p{i}", tbf(layout.bandwidth)
    return [
        *namespace_commands(host),
        ["ip", "-n", sw, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns",
         host],
        ["ip", "-n", sw, "link", "set", port, "master", BRIDGE, "up"],
        ["ip", "-n", host, "addr", "add", f"{layout.address(i)}/24", "dev", "eth0"],
        ["ip", "-n", host, "link", "set", "eth0", "up"],
        ["tc", "-n", host, "qdisc", "add", "dev", "eth0", "root", *shape],
        ["tc", "-n", sw, "qdisc", "add", "dev", port, "root", *shape],
    ]  # fmt: skip


def write_scripts(record: Record, layout: Layout, directory: Path, profile: Path) -> None:
    """hostfile, launch, mpiexec and ipcluster in directory."""
    hostfile = "".join(f"{name}:{layout.slots}\n" for name in layout.names)
    write_file(record, "hostfile", hostfile)
    write_file(record, "launch", launch_script(layout), executable=True)
    write_file(record, "mpiexec", mpiexec_script(directory), executable=True)
    write_file(record, "ipcluster", ipcluster_script(record, layout, profile), executable=True)


def write_file(record: Record, name: str, text: str, executable: bool = False) -> None:
    """Record the file, then write it (a file of FILES in the hosts' directory)."""
    record.files.append(name)
    record.save()
    path = record.directory / name
    path.unlink(missing_ok=True)  # ours (recorded) or a left-over of ours: never followed
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o755 if executable else 0o644)
    with os.fdopen(fd, "w") as file:
        file.write(text)


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


def ipcluster_config(record: Record, layout: Layout, profile: Path) -> str:
    """The profile's ipcluster_config.py: the controller in the switch's namespace, engines for
    hosts on 198.18.0.1 (tcp), clients through Unix sockets in the profile (ipc: the machine's
    own namespace cannot reach 198.18.0.1); the engines by MPI across the hosts."""
    python = [sys.executable, "-m", "ipyparallel.controller"]
    controller = [*inside(record), "ip", "netns", "exec", layout.switch, *python]
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


def ipcluster_script(record: Record, layout: Layout, profile: Path) -> str:
    """build/hosts/ipcluster: ipcluster with the hosts' profile (start -n 4, stop), run in the
    switch's namespace so that `down` ends it with its controller."""
    ipcluster = str(Path(sys.executable).parent / "ipcluster")
    enter = shlex.join(inside(record)[:-1])  # the caller's directory instead of /
    ipcluster = shlex.join(["ip", "netns", "exec", layout.switch, ipcluster])
    return f"""#!/bin/sh
# Written by `python -m fsdp_lesson hosts up`: `ipcluster start -n 4` (or stop) with the hosts'
# profile: the controller in the switch's namespace, the engines on the hosts.
exec {enter} "$PWD" {ipcluster} "$@" --profile-dir={shlex.quote(str(profile))}
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
        raise HostsError(
            f"no simulated hosts are up in {directory}: python -m fsdp_lesson hosts up --dir "
            f"{directory}"
        )
    if not keeper_alive(record):
        raise HostsError(
            f"the simulated hosts of {directory} are gone (their keeper, process "
            f"{record.keeper['pid']}, ended): python -m fsdp_lesson hosts up --dir {directory}"
        )
    return record


def set_bandwidth(bandwidth: str, directory: Path = DEFAULT_DIR) -> None:
    """Re-shape both ends of every cable of the hosts that are up (tc qdisc replace): the same
    job at 10gbit, 1gbit and 100mbit, without rebuilding the hosts or restarting engines."""
    check_bandwidth(bandwidth)
    record = up_record(directory)
    shape, sw = tbf(bandwidth), record.layout.switch
    ends = [(host, "eth0") for host in record.layout.names]
    ends += [(sw, f"fsdpl-p{i}") for i in range(record.layout.hosts)]
    run_inside(record, [["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", *shape]
                        for ns, dev in ends])  # fmt: skip
    record.layout.bandwidth = bandwidth
    record.save()


def mpiexec_command(argv: list[str], directory: Path = DEFAULT_DIR) -> list[str]:
    """The command that runs hydra's mpiexec inside the switch's namespace, hostname and all,
    with the hosts' hostfile and launch script: argv is mpiexec's (-n N COMMAND...)."""
    record = up_record(directory)
    sw = record.layout.switch
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    return [
        *inside(record, os.getcwd()), "ip", "netns", "exec", sw, "unshare", "--uts", "sh", "-c",
        'hostname "$0" && exec "$@"', sw, mpiexec, "-launcher", "ssh", "-launcher-exec",
        str(directory / "launch"), "-f", str(directory / "hostfile"), *argv,
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
    record = up_record(directory)
    where = [(host, "eth0") for host in record.layout.names] + [(record.layout.switch, BRIDGE)]
    read = [["ip", "netns", "exec", ns, "cat", f"/sys/class/net/{dev}/statistics/tx_bytes",
             f"/sys/class/net/{dev}/statistics/rx_bytes"] for ns, dev in where]  # fmt: skip
    script = "set -e\n" + "\n".join(shlex.join(c) for c in read)
    numbers = run([*inside(record), "sh", "-c", script]).stdout.split()
    return {
        ns: {"tx": int(numbers[2 * i]), "rx": int(numbers[2 * i + 1])}
        for i, (ns, _) in enumerate(where)
    }


def between_hosts(before: dict, after: dict, directory: Path = DEFAULT_DIR) -> int:
    """Bytes that went from host to host between two link_bytes() readings: every host's
    cable's tx, less what the switch itself took in (control traffic for mpiexec)."""
    layout = Record.load(directory).layout
    sent = sum(after[h]["tx"] - before[h]["tx"] for h in layout.names)
    return sent - (after[layout.switch]["rx"] - before[layout.switch]["rx"])


# --- down -------------------------------------------------------------------------------------


def down(directory: Path = DEFAULT_DIR) -> list[str]:
    """End every process inside the keeper's namespaces, then the keeper (the kernel frees the
    namespaces), then remove the recorded files. Returns what was removed. The record goes
    last, so a down that fails can be run again."""
    directory = directory.resolve()
    record = Record.load(directory)
    if record is None:
        return []
    removed = []
    if keeper_alive(record):
        pid = record.keeper["pid"]
        end_processes(inside_user_namespace(pid))
        end_processes([pid])
        removed.append(f"{record.layout.hosts + 1} namespaces (keeper {pid})")
    for name in reversed(record.files):  # validated: names of FILES and PROFILE only
        path = directory / name
        if name == PROFILE:
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    if record.files:
        removed.append(f"{len(record.files)} files of {directory}")
    record.path.unlink()
    return removed


def inside_user_namespace(keeper: int) -> list[int]:
    """Every process in the keeper's user namespace but the keeper: everything that ran on the
    hosts (their namespaces are entered only through it). Processes not ours are not readable,
    so never listed."""
    try:
        ours = os.readlink(f"/proc/{keeper}/ns/user")
    except OSError:
        return []
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != keeper:
            try:
                if os.readlink(f"/proc/{entry}/ns/user") == ours:
                    pids.append(int(entry))
            except OSError:  # gone, or not ours
                continue
    return pids


def end_processes(pids: list[int]) -> None:
    """Stop these processes (a job's mpiexec, proxies, ranks; a controller and its engines),
    all at once: SIGTERM, then SIGKILL what is left after TIMEOUT seconds. (One namespace at
    a time, an engine would wait out the TIMEOUT in MPI_Finalize for its peers.)"""
    for sig in (signal.SIGTERM, signal.SIGKILL):
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
    start = commands.add_parser(
        "up", help="build the hosts (no root needed: a user namespace); taken down first if up"
    )
    start.add_argument("--hosts", type=int, default=2, help="hosts (default: 2)")
    start.add_argument("--slots", type=int, default=2, help="ranks per host (default: 2)")
    start.add_argument(
        "--bandwidth", default="1gbit", help="each host's link, as tc spells it (default: 1gbit)"
    )
    shape = commands.add_parser("shape", help="re-shape every cable of the hosts that are up")
    shape.add_argument("--bandwidth", required=True, help="as tc spells it: 10gbit, 100mbit")
    for sub in (start, commands.add_parser("down", help="remove what `up` recorded"), shape):
        sub.add_argument(
            "--dir", type=Path, default=DEFAULT_DIR, help=f"default: ${HOSTS_DIR_ENV}, build/hosts"
        )
    args = parser.parse_args(argv)
    directory = args.dir.resolve()
    try:
        if args.action == "shape":
            set_bandwidth(args.bandwidth, directory)
            print(f"hosts shape: every link {args.bandwidth} both ways (tbf)")
            return 0
        if args.action == "down":
            removed = down(directory)
            print(f"hosts down: removed {', '.join(removed)}" if removed else "hosts down: none up")
            return 0
        layout = Layout(args.hosts, args.slots, args.bandwidth)
        with interrupts_raise():
            up(layout, directory)
    except HostsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Interrupted) as err:
        what = "SIGTERM" if isinstance(err, Interrupted) else "Ctrl-C"
        print(f"hosts up: stopped by {what}; what it had made in {directory} is removed again "
              "(keeper, namespaces, files)", file=sys.stderr)  # fmt: skip
        return 2
    print(summary(layout, directory))
    return 0


class interrupts_raise:
    """Ctrl-C raises KeyboardInterrupt and SIGTERM Interrupted, whatever handlers were set
    (python -m fsdp_lesson sets the ranks' for every command): `up` cleans up after both."""

    def __enter__(self):
        def interrupt(signum, frame):
            raise Interrupted()

        self.wakeup = signal.set_wakeup_fd(-1)
        self.saved = [
            signal.signal(signal.SIGINT, signal.default_int_handler),
            signal.signal(signal.SIGTERM, interrupt),
        ]

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self.saved[0])
        signal.signal(signal.SIGTERM, self.saved[1])
        signal.set_wakeup_fd(self.wakeup)


def summary(layout: Layout, directory: Path) -> str:
    where = "" if directory == (ROOT / "build" / "hosts").resolve() else f" --dir {directory}"
    lines = [
        f"hosts up: {layout.hosts} hosts x {layout.slots} slots, each link {layout.bandwidth} "
        "both ways (tbf), private to this user and directory"
    ]
    for i, name in enumerate(layout.names):
        lines.append(f"  {name}  {layout.address(i)}  slots {layout.slots}")
    lines.append(f"  {layout.switch}  {SWITCH_ADDRESS}  the switch (bridge {BRIDGE}); mpiexec")
    lines.append(
        f"run:  {directory / 'mpiexec'} -n {layout.hosts * layout.slots} python -m fsdp_lesson "
        "train --strategy zero3 --steps 200 --out runs/z3"
    )
    env = "" if not where else f" (with {HOSTS_DIR_ENV}={directory})"
    lines.append(
        f'notebook{env}: connect(n={layout.hosts * layout.slots}, profile="hosts")   or, in a '
        f"terminal: {directory / 'ipcluster'} start -n {layout.hosts * layout.slots}"
    )
    lines.append(f"shape: python -m fsdp_lesson hosts shape --bandwidth 100mbit{where}")
    make = "" if where else "   (make hosts-down)"
    lines.append(f"stop: python -m fsdp_lesson hosts down{where}{make}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
