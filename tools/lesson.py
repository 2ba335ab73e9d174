"""What `make run`, `make test` and `make lab` do: each with a local 4-engine MPI cluster.

    python tools/lesson.py run    execute every notebook in order, HTML site in build/html/
    python tools/lesson.py test   the whole test suite: unit, MPI (mpiexec) and nbval
    python tools/lesson.py lab    JupyterLab beside a running cluster

`run` and `test` use their own IPython directory (build/ipython), so a cluster a learner
started by hand is never touched; the cluster they start is stopped again, even on failure.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from fsdp_lesson.launch import rank_settings

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
N_ENGINES = 4
START_TIMEOUT = 120  # seconds for the engines to register


@contextmanager
def mpi_cluster(n: int = N_ENGINES):
    """Start `ipcluster --engines=MPI -n n` (profile default), yield, and always stop it."""
    import ipyparallel as ipp
    from traitlets.config import Config

    from fsdp_lesson.cluster import stop_cluster, stop_when_gone

    # cluster_id "" is what `ipcluster start` uses: the notebooks' connect() finds this one;
    # its engines get the ranks' launch settings (fsdp_lesson/launch.py)
    environment = {"MPILauncher": {"environment": rank_settings()}}
    cluster = ipp.Cluster(
        n=n,
        engines="mpi",
        profile="default",
        cluster_id="",
        log_level=40,
        config=Config(environment),
    )
    print(f"starting a local cluster of {n} MPI engines ...", flush=True)
    watchdog = None
    try:
        cluster.start_cluster_sync()
        # killed outright (SIGKILL, a crashed CI runner), this process runs no `finally`: a
        # watchdog of its own stops the cluster once this process is gone
        watchdog = stop_when_gone(os.getpid(), cluster.cluster_file)
        with cluster.connect_client_sync() as client:
            client.wait_for_engines(n, timeout=START_TIMEOUT)
        yield cluster
    finally:
        stop_cluster(cluster)
        if watchdog is not None:  # nothing left for it to stop
            watchdog.terminate()
            watchdog.wait(timeout=10)
        print("cluster stopped", flush=True)


def needs(path: Path) -> str | None:
    """What a notebook needs beyond the course's install, as its metadata says: "hosts" (the
    simulated hosts: notebook 13), "torch" (the torch extra: notebook 16), or None."""
    metadata = json.loads(path.read_text()).get("metadata", {})
    return metadata.get("fsdp_lesson", {}).get("needs")


def needs_hosts(path: Path) -> bool:
    """Whether a notebook runs on the simulated hosts (notebook 13)."""
    return needs(path) == "hosts"


def needs_torch(path: Path) -> bool:
    """Whether a notebook runs PyTorch, the optional torch extra (notebook 16)."""
    return needs(path) == "torch"


def torch_missing() -> str | None:
    """Why the notebooks that run PyTorch cannot run here (the extra is not installed), or None."""
    if importlib.util.find_spec("torch") is None:
        return "needs the torch extra (PyTorch's CPU build), not installed: make torch"
    return None


@contextmanager
def simulated_hosts(notebooks: list[Path]):
    """Yield the reason the hosts' notebooks cannot run here, or None once hosts are up: those
    `make hosts` brought up, else 2 hosts x 2 slots at 1 Gbit/s, taken down again after. (No
    root needed: the hosts are this user's and this checkout's own, fsdp_lesson/hosts.py.)"""
    from fsdp_lesson import hosts

    if not any(map(needs_hosts, notebooks)) or hosts_are_up(hosts):
        yield None
        return
    reason = hosts.unavailable()
    if reason is not None:
        yield f"needs the simulated hosts: {reason}"
        return
    print("bringing up simulated hosts for notebook 13 (2 x 2 slots, 1 Gbit/s) ...", flush=True)
    try:
        hosts.up(hosts.Layout(hosts=2, slots=2, bandwidth="1gbit"))
    except hosts.HostsError as err:  # a record in build/hosts that is not this user's, say
        yield f"needs the simulated hosts: {err}"
        return
    try:
        yield None
    finally:
        hosts.down()
        print("simulated hosts down", flush=True)


def hosts_are_up(hosts) -> bool:
    """Whether `make hosts` has this checkout's hosts up (and their keeper running)."""
    try:
        hosts.up_record(hosts.DEFAULT_DIR)
    except hosts.HostsError:
        return False
    return True


def prepare_environment() -> None:
    """This venv's mpiexec first on PATH; this job's cluster files apart from a learner's own.

    The directory is made here: IPython, finding no parent to create it in (a fresh clone has
    no build/), would give each process a temporary directory of its own, and the notebooks'
    connect() would then start clusters of their own instead of using this job's.
    """
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]
    ipython_dir = Path(os.environ.get("LESSON_IPYTHONDIR", ROOT / "build" / "ipython"))
    ipython_dir.mkdir(parents=True, exist_ok=True)
    os.environ["IPYTHONDIR"] = str(ipython_dir)
    os.environ.setdefault("IPP_NONINTERACTIVE", "1")  # no streaming, no progress widgets


def run_lesson(notebooks: list[Path]) -> int:
    """Execute the notebooks top to bottom against the cluster; write HTML; print a summary.

    The executed copies go to build/html/ only: the committed notebooks stay as they are.
    """
    import nbformat
    from course_site import link_pages, write_page  # tools/, beside this file
    from execute_notebooks import execute

    prepare_environment()
    os.environ["FSDP_LESSON_DOCS"] = "1"  # notebook 07 saves the README's plots to docs/
    html_dir = ROOT / "build" / "html"
    html_dir.mkdir(parents=True, exist_ok=True)
    summary = []
    no_torch = torch_missing()
    with mpi_cluster(), simulated_hosts(notebooks) as no_hosts:
        for path in notebooks:
            reason = (no_hosts if needs_hosts(path) else None) or (
                no_torch if needs_torch(path) else None
            )
            if reason:
                summary.append((path.name, f"skipped: {reason}", 0.0))
                print(f"{path.name:40s} skipped: {reason}", flush=True)
                continue
            nb = nbformat.read(path, as_version=4)
            start = time.perf_counter()
            try:
                execute(nb, path.parent)
                status = "executed OK"
            except Exception as err:  # report and go on with the next notebook
                status = f"FAILED: {type(err).__name__}: {str(err).strip().splitlines()[-1]}"
            seconds = time.perf_counter() - start
            write_page(nb, html_dir / f"{path.stem}.html")
            summary.append((path.name, status, seconds))
            print(f"{path.name:40s} {status} ({seconds:.1f} s)", flush=True)
    link_pages(html_dir)  # index.html, prev/next links
    print(f"\nSummary (HTML in {html_dir}/, start at index.html):")
    for name, status, seconds in summary:
        print(f"  {name:40s} {status:12s} {seconds:6.1f} s")
    ok = all(status.startswith(("executed OK", "skipped")) for _, status, _ in summary)
    return 0 if ok else 1


def run_tests(pytest_args: list[str]) -> int:
    """The notebooks under nbval (strict), then tests/, with the cluster the notebooks use.

    Every notebook runs twice on the same engines, with its outputs compared both times, so a
    notebook that leaves state behind fails: first the teacher's notebook under nbval, then its
    student copy (tests/test_student.py), which must run and print every output nbval compares
    but its exercises'; a notebook without exercises runs twice under nbval. Nothing else uses
    those engines (a test that needs a cluster starts its own), so tests/ runs beside them, in
    a second pytest whose report follows: first the tests that mostly wait (WAITING_TESTS),
    which leave the notebooks the cores, then the busy ones, which the notebooks' end leaves
    the cores to. A few busy files (AFTER_THE_NOTEBOOKS) run in the first pytest, after the
    student copies, so that the two end nearer together.
    Paths among pytest_args (files, folders, node ids) replace the default selection and run
    in one pytest; simulated hosts come up only for the default selection or a notebook that
    needs them.
    """
    import nbformat
    from student import has_solutions  # tools/student.py, beside this file

    prepare_environment()
    paths = [a for a in pytest_args if is_test_path(a)]
    options = [a for a in pytest_args if not is_test_path(a)]
    wanted = [Path(p).resolve() for p in paths if p.endswith(".ipynb")] if paths else NOTEBOOKS
    with mpi_cluster(), simulated_hosts(wanted) as no_hosts:
        notebooks = NOTEBOOKS
        if no_hosts:  # tests/test_student.py skips the same notebooks, with the same reason
            notebooks = [path for path in notebooks if not needs_hosts(path)]
            print(f"not under nbval: notebook 13, which {no_hosts}", flush=True)
        if no_torch := torch_missing():  # and these too
            notebooks = [path for path in notebooks if not needs_torch(path)]
            print(f"not under nbval: notebook 16, which {no_torch}", flush=True)
        nbval = ["--nbval", "--nbval-current-env", "--nbval-cell-timeout=600"]
        pytest = [sys.executable, "-m", "pytest", *nbval, "-p", "no:cacheprovider", *options]
        if paths:
            return subprocess.call([*pytest, *paths], cwd=ROOT)
        again = [path for path in notebooks if not has_solutions(nbformat.read(path, 4))]
        student = ROOT / "tests" / "test_student.py"  # the second run, right after the first
        rest = [path for path in sorted((ROOT / "tests").glob("test_*.py")) if path != student]
        waiting = [path for path in rest if path.name in WAITING_TESTS]
        after = [path for path in rest if path.name in AFTER_THE_NOTEBOOKS]
        busy = [path for path in rest if path not in waiting + after]
        on_the_engines = [*map(str, [*notebooks, *again, student, *after]), "--keep-duplicates"]
        return run_side_by_side([*pytest, *on_the_engines], [*pytest, *map(str, waiting + busy)])


# Tests that mostly wait (for a cluster to start or stop, an engine or a rank to time out, a
# browser): measured on a quiet 2-core machine, their processes used 38% of one core over their
# 368 s (4% to 88% by file). Each starts whatever it needs (none uses the session's engines,
# which only the notebooks and their student copies do), so they go first beside the notebooks.
WAITING_TESTS = (
    "test_cluster.py",
    "test_timeout.py",
    "test_grade.py",
    "test_site.py",
    "test_limits.py",
    "test_harness.py",
    "test_hosts_engines.py",
    "test_lesson_signals.py",
    "test_hosts_private.py",
    "test_loopback.py",
)
# Busy files that end the first pytest: measured alone on a quiet 2-core machine, the busy files
# took 331 s, these 95, 25 and 23 s. With the notebooks' pytest ending at the student copies,
# tests/ ended 5 min after it (quiet fresh clones: 588 s, 893 s); with the bridge moved, 2.5 min
# after it (690 s, 844 s).
AFTER_THE_NOTEBOOKS = ("test_torch_bridge.py", "test_failures.py", "test_teaching.py")
BESIDE_LOG = ROOT / "build" / "tests-beside.log"


def is_test_path(arg: str) -> bool:
    """A file, folder or node id (path::test) to collect, rather than an option or its value
    (`-k 16` selects by name: 16 is not a path)."""
    return not arg.startswith("-") and (ROOT / arg.split("::")[0]).exists()


def run_side_by_side(first: list[str], second: list[str], log_path: Path = BESIDE_LOG) -> int:
    """Run two commands at once: the first's report live, the second's (kept in log_path)
    after it. Nonzero when either fails; neither outlives this."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        beside = subprocess.Popen(second, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            print("(tests/ runs beside the notebooks; its report follows theirs)", flush=True)
            code = subprocess.call(first, cwd=ROOT)
            if beside.poll() is None:
                print("\nwaiting for tests/ ...", flush=True)
            code_beside = beside.wait()
        finally:
            if beside.poll() is None:  # this process is ending (a signal, an error): so is it
                beside.terminate()
                try:
                    beside.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    beside.kill()
            print(f"\n--- tests/, beside the notebooks ({log_path}) ---", flush=True)
            print(log_path.read_text(), end="", flush=True)
    return code or code_beside


def run_lab() -> int:
    """JupyterLab in notebooks/, with a 4-engine MPI cluster (a running one is reused)."""
    import ipyparallel as ipp

    try:
        with ipp.Client(profile="default", timeout=5) as client:
            running = len(client.ids) >= N_ENGINES
    except Exception:
        running = False
    lab = [sys.executable, "-m", "jupyter", "lab", "--notebook-dir", str(ROOT / "notebooks")]
    if os.geteuid() == 0:  # containers often run as root, which Jupyter refuses by default
        lab.append("--allow-root")
    if running:
        print("using the running ipcluster (profile default)")
        return subprocess.call(lab)
    with mpi_cluster():
        try:
            return subprocess.call(lab)
        except KeyboardInterrupt:
            return 0


def main() -> int:
    # A terminated job (CI's timeout, a closed terminal) still stops its cluster: exit via finally.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGHUP, lambda *_: sys.exit(129))
    # Everything started from here (the cluster's engines, kernels, pytest and the tests'
    # mpiexec) inherits the ranks' environment (fsdp_lesson/launch.py says what and why).
    os.environ.update(rank_settings())
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("job", choices=["run", "test", "lab"])
    args, rest = parser.parse_known_args()
    if args.job == "run":  # optional notebook paths run a subset
        return run_lesson([Path(p).resolve() for p in rest] or NOTEBOOKS)
    if args.job == "test":
        return run_tests(rest)
    return run_lab()


if __name__ == "__main__":
    sys.exit(main())
