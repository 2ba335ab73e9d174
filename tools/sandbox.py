"""Run one submission's notebooks in a sandbox of its own (tools/grade.py's; as root).

The sandbox: `unshare` pid, mount and network namespaces; a root folder holding the system's
programs and libraries, this Python, the package, its data and tools/ (read-only), a fresh
/proc, /tmp, /run and /dev/shm, HOME (the scratch folder with the notebooks) and RESULTS
(root's, for the executed copies); only a loopback of its own; an account with no name and no
rights (STUDENT_UID: no groups, no new privileges, rlimits) for the kernels and, when a
notebook connects to one, a 4-engine MPI cluster; v1 memory and pids cgroups where the kernel
has them. Between notebooks every process of that account but the cluster is ended; at the
end the namespace's first process exits, which ends everything in it.

    python tools/sandbox.py --sandbox FD             the namespace's first process (the job on
                                                     stdin as JSON, a line per notebook to FD)
    python tools/sandbox.py --as-student UID CPU -- COMMAND...    exec COMMAND as that account
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
N_ENGINES = 4
START_TIMEOUT = 120  # seconds for a sandbox's cluster to come up
HEALTH_TIMEOUT = 30  # seconds for the engines to clear their namespaces and answer
BUSY_GRACE = 5  # seconds a notebook's last task may still run on the engines after it ended
STUDENT_UID = 64_911  # the sandbox's account: no name, no home, no group, owns nothing outside
MEMORY_BYTES = 6 * 2**30  # one sandbox (kernel, cluster, everything): a cgroup's limit
MAX_PROCESSES = 256  # the sandbox account's processes
CGROUPS = Path("/sys/fs/cgroup")
HOME = "/home/student"  # inside the sandbox: the submission's scratch folder, the account's
NOTEBOOKS = f"{HOME}/notebooks"  # the kernels' folder: a notebook's "../build" is the account's
KEY_FILE = f"{HOME}/.verdict-key"  # a notebook's key, for its setup code to read and delete
RESULTS = "/grade-out"  # inside the sandbox: executed notebooks, root's only
KERNELS = "/grade-kernels"  # inside the sandbox: the kernel spec that starts as the student
NEEDS_CLUSTER = re.compile(r"connect\(|%px|%%px|\branks\.")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass
class Notebook:
    """One notebook to run: its file name in the sandbox, the notebook, the key written to
    KEY_FILE for it, and the setup code run before its first cell (outside the history)."""

    file: str
    nb: nbformat.NotebookNode
    key: bytes
    setup: str


# ---------------------------------------------------------------------------------------------
# Inside the sandbox (the first process of its pid namespace, root, in a root of its own)


def first_line(cell: nbformat.NotebookNode) -> str:
    line = next((x.strip() for x in cell.source.splitlines() if x.strip()), "")
    return line if len(line) <= 40 else line[:37] + "..."


def where(number: int, cell: nbformat.NotebookNode) -> str:
    return f"cell {number} ({first_line(cell)!r})" if first_line(cell) else f"cell {number}"


def error_line(out: nbformat.NotebookNode) -> str:
    """'RuntimeError: boom': the error's name and the first line of its value."""
    value = ANSI.sub("", str(out.get("evalue", ""))).strip().splitlines()
    name = str(out.get("ename", "Error"))[:80]
    return f"{name}: {value[0][:200]}" if value else name


def run_notebook(nb: nbformat.NotebookNode, setup_code: str, timeout: float) -> str:
    """Execute nb in place in a fresh kernel (the student's account, HOME), setup_code first,
    on past errors, within `timeout` seconds in all; return a note: where it stopped, or the
    first cell that raised, or ''."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    deadline = time.monotonic() + timeout

    def left(_cell=None) -> int:  # a cell's timeout: what is left of the notebook's (0 = none)
        return max(1, math.ceil(deadline - time.monotonic()))

    client = NotebookClient(
        nb,
        timeout=left(),
        timeout_func=left,
        startup_timeout=left(),
        allow_errors=True,
        kernel_name="student",
        record_timing=False,
        shutdown_kernel="immediate",
        resources={"metadata": {"path": NOTEBOOKS}},
        extra_arguments=["--IPKernelApp.log_level=ERROR"],
    )
    stopped = ""
    try:
        with client.setup_kernel():
            setup = nbformat.v4.new_code_cell(setup_code)
            nb.cells.insert(0, setup)  # nbclient writes a cell's outputs to nb.cells[index]
            try:
                client.execute_cell(setup, 0, store_history=False)
            finally:
                nb.cells.pop(0)
            if any(out.get("output_type") == "error" for out in setup.outputs):
                stopped = "not run: the grader's setup code failed in the kernel"
            for index, cell in enumerate(nb.cells):
                if stopped or cell.cell_type != "code" or not cell.source.strip():
                    continue
                at = f"stopped at {where(index + 1, cell)}"
                if time.monotonic() >= deadline:
                    stopped = f"{at}: time limit of {timeout:g} s"
                    break
                try:
                    client.execute_cell(cell, index, execution_count=client.code_cells_executed)
                except CellTimeoutError:
                    stopped = f"{at}: time limit of {timeout:g} s"
                except DeadKernelError:
                    stopped = f"{at}: the kernel died"
    except Exception as err:  # the kernel did not start, or stopped answering
        stopped = f"not run to the end: {type(err).__name__}: {str(err).strip()[:200]}"
    raised = [
        (number, cell, out)
        for number, cell in enumerate(nb.cells, start=1)
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
        if out.get("output_type") == "error"
    ]
    notes = []
    if raised:
        number, cell, out = raised[0]
        more = len({n for n, _, _ in raised}) - 1
        notes.append(
            f"{where(number, cell)} raised {error_line(out)}"
            + (f" (and {more} more cell{'s' if more > 1 else ''})" if more else "")
        )
    if stopped:
        notes.append(stopped)
    return "; ".join(notes)


def student_pids(uid: int) -> list[int]:
    """The processes of the student's account (in this pid namespace: all of its own)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/status") as f:
                    uids = next(line for line in f if line.startswith("Uid:")).split()
            except (OSError, StopIteration):
                continue
            if str(uid) in uids[1:3]:
                found.append(int(entry))
    return found


def end_processes(uid: int, keep: set[int] = frozenset()) -> None:
    """SIGKILL every process of the student's account but `keep`, until none is left (a fork
    between two rounds is caught by the next; RLIMIT_NPROC bounds them)."""
    for _ in range(50):
        left = [pid for pid in student_pids(uid) if pid not in keep]
        if not left:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


class Cluster:
    """The sandbox's 4-engine MPI cluster, run by the student's account: the notebooks'
    connect(n=4) finds it (IPYTHONDIR). Restarted when it stops answering."""

    def __init__(self, uid: int, cpu_seconds: int) -> None:
        self.uid, self.cpu_seconds, self.pids = uid, cpu_seconds, set()

    def start(self) -> None:
        import ipyparallel as ipp

        ipcluster = [str(Path(sys.executable).parent / "ipcluster"), "start", "--engines=MPI",
                     f"-n={N_ENGINES}", "--daemonize", "--log-level=ERROR"]  # fmt: skip
        subprocess.run(as_student(self.uid, self.cpu_seconds, ipcluster), timeout=START_TIMEOUT)
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                with ipp.Client(timeout=5) as client:
                    client.wait_for_engines(N_ENGINES, timeout=deadline - time.monotonic())
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)
        self.pids = set(student_pids(self.uid))

    def healthy(self) -> bool:
        """All engines there and idle (a stopped notebook's tasks do not run on into the
        next one), their namespaces cleared, and each answering within seconds."""
        import ipyparallel as ipp

        try:
            client = ipp.Client(timeout=HEALTH_TIMEOUT)
        except Exception:
            return False
        try:
            client.wait_for_engines(N_ENGINES, timeout=HEALTH_TIMEOUT)
            deadline = time.monotonic() + BUSY_GRACE
            while any(
                status["queue"] or status["tasks"]
                for engine, status in client.queue_status().items()
                if engine != "unassigned"
            ):
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.2)
            client.clear(block=False).result(timeout=HEALTH_TIMEOUT)
            pids = client[:].apply_async(os.getpid).get(timeout=HEALTH_TIMEOUT)
            return len(client.ids) == N_ENGINES == len(set(pids))
        except Exception:
            return False
        finally:
            client.close()

    def restart(self) -> None:
        end_processes(self.uid)
        shutil.rmtree(Path(HOME) / ".ipython" / "profile_default" / "security", True)
        self.start()


def as_student(uid: int, cpu_seconds: int, command: list[str]) -> list[str]:
    """command, run by this file's --as-student: the student's account and limits."""
    here = str(Path(__file__).resolve())
    return [sys.executable, here, "--as-student", str(uid), str(cpu_seconds), "--", *command]


def become_student(uid: int, cpu_seconds: int, command: list[str]) -> None:
    """Exec command as the student's account: no groups, no new privileges (no setuid
    program), CPU seconds, file size, process count and no core files limited; a kernel's
    connection file (-f) handed over to it; output to /dev/null (the kernel talks over zmq)."""
    import ctypes
    import resource

    if "-f" in command:
        os.chown(command[command.index("-f") + 1], uid, uid)
    limits = {
        resource.RLIMIT_CPU: cpu_seconds,
        resource.RLIMIT_NPROC: MAX_PROCESSES,
        resource.RLIMIT_FSIZE: 2**30,
        resource.RLIMIT_CORE: 0,
        resource.RLIMIT_NOFILE: 4096,
    }
    for which, value in limits.items():
        resource.setrlimit(which, (value, value))
    ctypes.CDLL(None, use_errno=True).prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    os.umask(0o077)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.execvp(command[0], command)


def mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True)


def build_root(scratch: Path) -> Path:
    """A root holding only what a notebook needs, read-only: the system's programs and
    libraries, this Python, the package, its data and tools; a fresh /proc, /tmp, /run and
    /dev/shm; HOME (the submission's scratch folder) and RESULTS (root's)."""
    new = scratch / "root"
    new.mkdir(exist_ok=True)
    mount("--make-rprivate", "/")
    mount("-t", "tmpfs", "-o", "mode=755", "tmpfs", str(new))
    # the fresh places first: a checkout (or its venv) under /tmp is then bound on top of them
    (new / "dev").mkdir()
    mount("--rbind", "/dev", str(new / "dev"))
    mount("-t", "tmpfs", "-o", "mode=1777", "tmpfs", str(new / "dev" / "shm"))
    (new / "proc").mkdir()
    mount("-t", "proc", "proc", str(new / "proc"))
    for place, mode in (("tmp", "1777"), ("var/tmp", "1777"), ("run", "755")):
        (new / place).mkdir(parents=True)
        mount("-t", "tmpfs", "-o", f"mode={mode}", "tmpfs", str(new / place))
    shown = ["/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32", "/etc", "/sys",
             sys.base_prefix, sys.prefix, str(ROOT / "fsdp_lesson"), str(ROOT / "data"),
             str(ROOT / "tools"), str(ROOT / "tests" / "fixtures")]  # fmt: skip
    for source in shown:
        target = new / source.lstrip("/")
        if os.path.islink(source):
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(os.readlink(source))
        elif os.path.isdir(source):
            target.mkdir(parents=True, exist_ok=True)
            mount("--rbind", source, str(target))
            mount("-o", "remount,bind,ro", str(target))
    for place, source in ((HOME, scratch / "work"), (RESULTS, scratch / "out")):
        (new / place.lstrip("/")).mkdir(parents=True)
        mount("--bind", str(source), str(new / place.lstrip("/")))
    return new


def sandbox_main(fd: int) -> int:
    """The sandbox's first process: read the job (stdin), build its root and loopback, run
    each notebook, write a line per notebook to fd. Its exit ends every process in here."""
    job = json.load(sys.stdin)
    results = os.fdopen(fd, "w", buffering=1)
    os.set_inheritable(fd, False)
    uid, timeout = job["uid"], job["timeout"]
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    new = build_root(Path(job["scratch"]))
    kernel = {"argv": as_student(uid, int(timeout) + 30, [sys.executable, "-m",
              "ipykernel_launcher", "-f", "{connection_file}"]),
              "display_name": "student", "language": "python"}  # fmt: skip
    (new / KERNELS.lstrip("/") / "kernels" / "student").mkdir(parents=True)
    (new / KERNELS.lstrip("/") / "kernels" / "student" / "kernel.json").write_text(
        json.dumps(kernel)
    )
    os.chroot(new)
    os.chdir("/")
    from fsdp_lesson.launch import rank_settings

    runtime = Path(HOME) / ".local" / "runtime"
    os.environ.clear()
    os.environ.update(
        PATH=os.pathsep.join([str(Path(sys.executable).parent), "/usr/local/bin", "/usr/bin",
                              "/bin"]),
        HOME=HOME, USER="student", LANG="C.UTF-8", TMPDIR="/tmp", MPLBACKEND="Agg",
        IPYTHONDIR=f"{HOME}/.ipython", MPLCONFIGDIR=f"{HOME}/.matplotlib",
        JUPYTER_RUNTIME_DIR=str(runtime), JUPYTER_PATH=KERNELS, JUPYTER_CONFIG_DIR=KERNELS,
        IPP_NONINTERACTIVE="1", PYTHONDONTWRITEBYTECODE="1", **rank_settings(),
    )  # fmt: skip
    for folder in (runtime, Path(HOME) / ".ipython", Path(HOME) / ".matplotlib"):
        folder.mkdir(parents=True, exist_ok=True)
        os.chown(folder, uid, uid)
        os.chown(folder.parent, uid, uid)
    cluster = None
    for notebook in job["notebooks"]:
        start = time.perf_counter()
        nb = nbformat.read(Path(NOTEBOOKS) / notebook["file"], as_version=4)
        note = ""
        if cluster is None and notebook["cluster"]:
            cluster = Cluster(uid, int(timeout * len(job["notebooks"])) + 120)
            try:
                cluster.start()
            except Exception as err:
                note = f"its cluster did not start: {type(err).__name__}: {str(err)[:200]}"
        key_file = Path(KEY_FILE)
        key_file.write_bytes(bytes.fromhex(notebook["key"]))
        os.chown(key_file, uid, uid)
        note = "; ".join(filter(None, [note, run_notebook(nb, notebook["setup"], timeout)]))
        key_file.unlink(missing_ok=True)
        end_processes(uid, cluster.pids if cluster else set())
        if cluster is not None and not cluster.healthy():
            cluster.restart()
            note += ("; " if note else "") + "the engines were restarted after it"
        nbformat.write(nb, Path(RESULTS) / notebook["file"])
        line = {"file": notebook["file"], "note": note, "seconds": time.perf_counter() - start}
        results.write(json.dumps(line) + "\n")
    return 0


def cgroup(name: str) -> list[Path]:
    """Cgroups (v1 memory and pids, where they can be made) capping one sandbox's memory and
    process count; [] where the kernel does not offer them (the rlimits still hold)."""
    made = []
    for controller, limits in (("memory", {"memory.limit_in_bytes": MEMORY_BYTES}),
                               ("pids", {"pids.max": MAX_PROCESSES})):  # fmt: skip
        folder = CGROUPS / controller / name
        try:
            folder.mkdir()
            for limit, value in limits.items():
                (folder / limit).write_text(str(value))
        except OSError:
            continue
        made.append(folder)
    return made


def remove_cgroups(folders: list[Path]) -> None:
    for folder in folders:
        for _ in range(50):  # its last processes may still be exiting
            try:
                folder.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def run_sandboxed(
    notebooks: list[Notebook],
    scratch: Path,
    timeout: float,
    done: Callable[[str, dict], None],
    uid: int = STUDENT_UID,
) -> None:
    """Run the notebooks in one sandbox (sandbox_main); done(file, {"note", "seconds"}) as
    each ends (its executed copy in scratch/out/FILE), or for each never run. Whatever
    happens in there, this returns within the notebooks' time limits, and nothing of it
    runs on."""
    for place in ("work", "out"):
        shutil.rmtree(scratch / place, ignore_errors=True)
        (scratch / place).mkdir(mode=0o700)
    (scratch / "work" / "notebooks").mkdir()
    for folder in (scratch / "work", scratch / "work" / "notebooks"):
        os.chown(folder, uid, uid)
    for notebook in notebooks:
        nbformat.write(notebook.nb, scratch / "work" / "notebooks" / notebook.file)
    code = ["\n".join(c.source for c in n.nb.cells if c.cell_type == "code") for n in notebooks]
    spec = {
        "uid": uid, "timeout": timeout, "scratch": str(scratch),
        "notebooks": [{"file": n.file, "key": n.key.hex(), "setup": n.setup,
                       "cluster": bool(NEEDS_CLUSTER.search(source))}
                      for n, source in zip(notebooks, code, strict=True)],
    }  # fmt: skip
    groups = cgroup(f"fsdp-grade-{os.getpid()}-{secrets.token_hex(4)}")
    read, write = os.pipe()

    def join_cgroups() -> None:
        for folder in groups:
            (folder / "cgroup.procs").write_text(str(os.getpid()))

    command = ["unshare", "--pid", "--fork", "--mount", "--net", "--kill-child", "--",
               sys.executable, str(Path(__file__).resolve()), "--sandbox", str(write)]  # fmt: skip
    finished: set[str] = set()
    with open(scratch / "sandbox.log", "wb") as log:
        proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=log, stderr=log,
                                pass_fds=(write,), preexec_fn=join_cgroups, cwd="/")  # fmt: skip
    os.close(write)
    try:
        proc.stdin.write(json.dumps(spec).encode())
        proc.stdin.close()
        deadline = (
            time.monotonic() + len(notebooks) * (timeout + HEALTH_TIMEOUT + 30) + START_TIMEOUT
        )
        buffer = b""
        with os.fdopen(read, "rb", buffering=0) as results:
            while time.monotonic() < deadline:
                ready, _, _ = select.select([results], [], [], 1.0)
                if not ready:
                    continue
                chunk = results.read(65536)
                if not chunk:
                    break
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for raw in lines:
                    line = json.loads(raw)
                    finished.add(line["file"])
                    done(line["file"], line)
    finally:
        proc.kill()  # unshare; --kill-child ends the namespace's first process, and so all
        proc.wait()
        remove_cgroups(groups)
    log_text = (scratch / "sandbox.log").read_text(errors="replace").strip().splitlines()
    why = log_text[-1][:200] if log_text else "no message"
    for notebook in notebooks:
        if notebook.file not in finished:
            done(notebook.file, {"note": f"not run: the sandbox ended ({why})"})


def main(argv: list[str]) -> int:
    if argv[:1] == ["--sandbox"]:
        return sandbox_main(int(argv[1]))
    if argv[:1] == ["--as-student"]:
        become_student(int(argv[1]), int(argv[2]), argv[argv.index("--") + 1 :])
    print(
        "usage: tools/sandbox.py --sandbox FD | --as-student UID CPU -- COMMAND...", file=sys.stderr
    )
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
