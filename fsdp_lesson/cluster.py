"""Connect to a cluster of MPI engines, check it is one MPI world, and run functions on every rank.

A notebook calls ``ranks = connect(n=4)`` once. It uses the ``ipcluster`` that is running for
the profile, or starts one that is stopped again when Python exits. ``profile="hosts"`` means the
simulated hosts' profile while they are up (fsdp_lesson/hosts.py; the directory they were built
in is $FSDP_LESSON_HOSTS_DIR, default build/hosts), else a profile_hosts of the user's own.
``ranks.run(fn)`` runs ``fn`` on every engine and returns the results ordered by MPI rank
(engine ids are not ranks).
Every wait has a timeout: a rank that raises while the others wait in a collective gives one
clear error instead of a cell that never returns.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import json
import logging
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ipyparallel as ipp
import psutil
from ipyparallel.datapub import publish_data
from ipyparallel.error import EngineError
from IPython import get_ipython
from IPython.display import display
from IPython.paths import get_ipython_dir
from traitlets.config import Config

from . import hosts
from .launch import rank_settings

# ipyparallel's info lines ("Starting 4 engines ...") and the engines' logs it dumps when
# mpiexec is stopped stay out of notebook outputs; our errors say what matters.
_log = logging.getLogger(__name__)
_log.addHandler(logging.NullHandler())
_log.propagate = False
# After one rank fails, how long the others get to finish before we call them stuck.
_GRACE_SECONDS = 3.0
# How often run() wakes up to refresh the progress line.
_POLL_SECONDS = 0.25
# Where connect(profile="hosts") looks for simulated hosts (hosts.py): a directory of `hosts up`.
HOSTS_DIR_ENV = hosts.HOSTS_DIR_ENV


class ClusterError(RuntimeError):
    """The engines cannot be used as one MPI world; the message says why and how to fix it."""


class RankError(RuntimeError):
    """A rank raised an exception (or its engine died) inside Ranks.run."""

    def __init__(
        self, rank: int, ename: str, evalue: str, detail: str = "", engine: int | None = None
    ) -> None:
        self.rank, self.ename, self.evalue, self.engine = rank, ename, evalue, engine
        who = f"rank {rank}" + ("" if engine is None else f" (engine {engine})")
        super().__init__(f"{who} raised {ename}: {evalue}{detail}")


def _how_to_fix(n: int, profile: str, owned: bool) -> str:
    """The exact commands that give n engines forming one MPI world."""
    simulated = _simulated_hosts(profile)
    if owned:
        mpiexec = str(simulated / "mpiexec") if simulated else _mpiexec()
        return (
            f"connect() started the engines with {mpiexec}; check that it runs one MPI world "
            f"with the MPI that mpi4py uses: {mpiexec} -n {n} {sys.executable} -m mpi4py.bench "
            f"helloworld"
        )
    if simulated:
        ipcluster = simulated / "ipcluster"
        return f"{ipcluster} stop; {ipcluster} start -n {n}"
    flag = "" if profile == "default" else f" --profile={profile}"
    return f"ipcluster stop{flag}; ipcluster start --engines=MPI -n {n}{flag}"


def _simulated_hosts(profile: str) -> Path | None:
    """The directory of the simulated hosts that profile "hosts" means, if they are up."""
    if profile != "hosts":
        return None
    directory = Path(os.environ.get(HOSTS_DIR_ENV) or hosts.DEFAULT_DIR)
    try:
        hosts.up_record(directory)
    except hosts.HostsError:
        return None
    return directory if (directory / hosts.PROFILE).is_dir() else None


def _profile_location(profile: str, n: int) -> dict[str, str]:
    """ipyparallel's keyword for where the profile is: the simulated hosts' own profile
    directory for "hosts" while they are up (a user's profile_hosts is never touched), else
    the profile by name. Profile "hosts" with neither raises ClusterError saying what to type."""
    simulated = _simulated_hosts(profile)
    if simulated:
        return {"profile_dir": str(simulated / hosts.PROFILE)}
    if profile == "hosts" and not os.path.isdir(os.path.join(get_ipython_dir(), "profile_hosts")):
        where = f" --dir {os.environ[HOSTS_DIR_ENV]}" if os.environ.get(HOSTS_DIR_ENV) else ""
        raise ClusterError(
            f"No simulated hosts are up for profile 'hosts': type `python -m fsdp_lesson hosts "
            f"up --hosts 2 --slots {(n + 1) // 2}{where}`, then connect again"
        )
    return {"profile": profile}


def _mpiexec() -> str:
    """mpiexec from PATH, else the one beside this Python (the mpich wheel's, venv not on PATH)."""
    return shutil.which("mpiexec") or os.path.join(os.path.dirname(sys.executable), "mpiexec")


def _prepare_engine() -> tuple[int, int, int]:
    """Runs on an engine as connect() finds it: its BLAS threads set as every launch sets them
    (launch.py); returns its place in MPI.COMM_WORLD (rank, size) and its process id.

    A cluster started by hand (`ipcluster start`) lacks the launch settings, so each engine's
    BLAS uses a thread per core: 4 engines on 2 cores ran notebook 07 3.2x slower. The engine
    may have loaded numpy already, so the limit goes through threadpoolctl (on the library
    numpy loads); a value the user set wins.
    """
    import numpy  # noqa: F401  (loads the BLAS library whose threads are limited here)
    from mpi4py import MPI
    from threadpoolctl import threadpool_limits

    from fsdp_lesson.launch import rank_settings

    threadpool_limits(int(rank_settings()["OPENBLAS_NUM_THREADS"]))
    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size(), os.getpid()


def _engines_in_rank_order(
    client: ipp.Client, n: int, timeout: float, fix: str
) -> tuple[list[int], list[int]]:
    """Check that the engines are exactly one MPI world of size n; return their ids and their
    process ids, both by rank."""
    ids = client.ids
    if len(ids) > n:
        raise ClusterError(
            f"The cluster has {len(ids)} engines but n={n} were asked for. Use connect(n="
            f"{len(ids)}), or a cluster of exactly {n} engines. Fix: {fix}"
        )
    try:
        worlds = client.direct_view(ids).apply_async(_prepare_engine).get(timeout=timeout)
    except Exception as err:
        raise ClusterError(
            f"Could not ask the engines for their MPI rank ({type(err).__name__}: {err}). "
            f"Is mpi4py installed for the engines' Python? Fix: {fix}"
        ) from err
    world_of = dict(zip(ids, worlds, strict=True))  # engine id -> (rank, size, pid)
    sizes = sorted({size for _, size, _ in worlds})
    if n > 1 and sizes == [1]:
        raise ClusterError(
            f"The {n} engines are not one MPI world (each reports COMM_WORLD size 1): they were "
            f"not started as one MPI job, as when a cluster is started without --engines=MPI. "
            f"Fix: {fix}"
        )
    if sizes != [n] or sorted(rank for rank, *_ in worlds) != list(range(n)):
        found = ", ".join(
            f"engine {eid}: rank {rank} of {size}" for eid, (rank, size, _) in world_of.items()
        )
        raise ClusterError(
            f"The engines are not one MPI world of size {n} ({found}). "
            f"Use a cluster of exactly {n} MPI engines. Fix: {fix}"
        )
    ids = sorted(ids, key=lambda eid: world_of[eid][0])
    return ids, [world_of[eid][2] for eid in ids]


def _wait_for_engines(client: ipp.Client, n: int, timeout: float, fix: str) -> None:
    """Wait at most `timeout` seconds for n engines to register with the controller."""
    try:
        client.wait_for_engines(n, timeout=timeout, interactive=False)
    except (TimeoutError, EngineError) as err:
        raise ClusterError(
            f"Only {len(client.ids)} of the {n} engines asked for came up within {timeout:g} s "
            f"({err}). Fix: {fix}"
        ) from err


def _check_engine_count(cluster: ipp.Cluster, n: int, fix: str) -> None:
    """Refuse at once a running cluster that was started with another number of engines.

    (Waiting would only time out: engines that were never launched never register.)
    """
    launched = sum(engine_set.n or 0 for engine_set in cluster.engines.values())
    if cluster.engines and launched != n:
        raise ClusterError(
            f"The running cluster was started with {launched} engines, but n={n} were asked "
            f"for. Fix: {fix}"
        )


def _cluster_record(where: dict[str, str]) -> dict:
    """The profile's cluster file as last written (from_file rewrites it without dead parts)."""
    path = ipp.Cluster(**where, cluster_id="", log=_log).cluster_file
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _stop_what_a_dead_controller_left(record: dict, cluster: ipp.Cluster) -> None:
    """A controller that died on its own (killed, out of memory) leaves its schedulers (its
    process group) and its engines running: stop them, found by the pids the cluster file
    records, never by name."""
    pid = ((record.get("controller") or {}).get("state") or {}).get("pid")
    if isinstance(pid, int) and pid > 1 and not psutil.pid_exists(pid):
        # a group outlives its leader's pid only while a member runs, so this is its group
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGTERM)
    with contextlib.suppress(Exception):
        cluster.stop_engines_sync()  # the engine sets whose mpiexec still runs
    end_controller_children(cluster.cluster_file)  # those connect() recorded, if it started it


def _running_cluster(profile: str, n: int, where: dict[str, str]) -> ipp.Cluster | None:
    """The cluster `ipcluster start` runs for this profile (where it is: _profile_location), or
    None (stale files count as none).

    If its controller runs but its engines are gone (when one engine of an MPI job dies,
    mpiexec ends them all: a crash, or a checker's timeout), it starts n fresh engines there.
    """
    record = _cluster_record(where)
    try:
        cluster = ipp.Cluster.from_file(**where, cluster_id="", log=_log)
    except FileNotFoundError:
        return None
    # from_file checks the recorded controller pid: a dead controller leaves `controller` None;
    # and it drops every engine set whose launcher (mpiexec) is no longer running.
    if cluster.controller is None:
        _stop_what_a_dead_controller_left(record, cluster)
        return None
    if len(cluster.engines) < len((record.get("engines") or {}).get("sets", {})):
        # their MPI job has ended (an engine died, or a checker's timeout stopped them): start
        # a fresh set on the running controller, as Ranks does after a failure
        cluster.config = _engine_config(where)
        cluster.stop_engines_sync()
        cluster.start_engines_sync(n)
        print(f"the running cluster's engines had stopped: started {n} fresh ones")
    return cluster


def _engine_config(where: dict[str, str]) -> Config:
    """How connect() starts engines: the ranks' launch settings (launch.py), and the MPI that
    mpi4py uses unless the profile names one (the simulated hosts')."""
    launcher = {"environment": rank_settings()}
    if "profile_dir" not in where:
        launcher["mpi_cmd"] = [_mpiexec()]
    return Config({"MPILauncher": launcher})


def _running_cluster_of(profile: str) -> ipp.Cluster | None:
    """The ipyparallel Cluster that `ipcluster start` (or make run/test) runs for profile, to
    restart its engines from here; None if there is none or its controller is gone."""
    where = _profile_location(profile, 0)
    try:
        cluster = ipp.Cluster.from_file(
            **where, cluster_id="", log=_log, config=_engine_config(where)
        )
    except FileNotFoundError:
        return None
    return cluster if cluster.controller is not None else None


def connect(n: int = 4, profile: str = "default", timeout: float = 60) -> Ranks:
    """Connect to the running ipcluster of `profile` (or start one); check it is one MPI world.

    profile="hosts" with simulated hosts up (fsdp_lesson/hosts.py) places the engines on them.
    """
    where = _profile_location(profile, n)
    cluster = _running_cluster(profile, n, where)
    owned = cluster is None
    if owned:  # start our own; ipyparallel stops it when Python exits (shutdown_atexit)
        cluster = ipp.Cluster(
            n=n,
            engines="mpi",
            **where,
            shutdown_atexit=True,
            log=_log,
            config=_engine_config(where),
        )
    fix = _how_to_fix(n, profile, owned)
    try:
        if owned:
            cluster.start_cluster_sync()
            stop_when_gone(os.getpid(), cluster.cluster_file)
            atexit.register(stop_cluster, cluster)  # before ipyparallel's own (atexit is LIFO)
        if "profile_dir" in where:  # the simulated hosts' controller talks ipc to clients
            hosts.link_client_sockets(Path(cluster.controller.connection_files["client"]), timeout)
        client = cluster.connect_client_sync(timeout=timeout)
    except Exception as err:
        if owned:
            stop_cluster(cluster)
        raise ClusterError(
            f"No answer from the controller of profile {profile!r} "
            f"({type(err).__name__}: {err}). Fix: {fix}"
        ) from err
    try:
        if not owned:
            _check_engine_count(cluster, n, fix)
        _wait_for_engines(client, n, timeout, fix)
        ids_by_rank, pids = _engines_in_rank_order(client, n, timeout, fix)
    except ClusterError:
        client.close()
        if owned:
            stop_cluster(cluster)
        raise
    if owned:  # now that its engines have registered, its schedulers all run
        record_controller_children(cluster)
    ranks = Ranks(client, ids_by_rank, pids, profile, timeout, cluster if owned else None)
    if owned:
        print(
            f"started a cluster of {n} MPI engines (profile {profile!r}); it stops when this "
            f"Python exits"
        )
    else:
        print(f"using the running cluster of {n} MPI engines (profile {profile!r})")
    return ranks


class Ranks:
    """The engines of one MPI world, in rank order: run a function on all of them."""

    def __init__(
        self,
        client: ipp.Client,
        ids_by_rank: list[int],
        pids: list[int],
        profile: str,
        timeout: float,
        cluster: ipp.Cluster | None,
    ) -> None:
        self.client = client
        self.view = client.direct_view(ids_by_rank)  # view.targets[r] is the engine of rank r
        self.view.block = True  # so %px, after view.activate(), waits and shows the output
        self.n = len(ids_by_rank)
        self._profile = profile
        self._timeout = timeout
        self.cluster = cluster  # the ipyparallel Cluster if connect() started it, else None
        self.pids = pids  # the engines' process ids by rank (they run on this machine)
        self._exits: list[tuple[int, ...]] = []  # ranks seen ended, by wake of the watch
        self._stop_watch = threading.Event()
        self._watch_exits()

    def __repr__(self) -> str:
        return f"<Ranks n={self.n} engines by rank={self.view.targets}>"

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout: float = 300,
        progress: int | None = None,
        **kwargs: Any,
    ) -> list:
        """Run fn(*args, **kwargs) on every rank; return the results as a list ordered by rank.

        Raises RankError as soon as one rank fails, and TimeoutError after `timeout` seconds.
        Engines left stuck (e.g. in a collective the failed rank never joined) are restarted
        if connect() started the cluster. `progress` (total steps) shows a line fed by
        report_progress() on the engines.
        """
        ar = self.view.apply_async(fn, *args, **kwargs)
        per_rank = ar.split()  # one AsyncResult per engine, in view.targets order = rank order
        line = _ProgressLine(progress) if progress and not _noninteractive() else None
        deadline = time.monotonic() + timeout
        pending = set(per_rank)
        try:
            while pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    stuck = [r for r, part in enumerate(per_rank) if not part.done()]
                    note = self._recover(f"Ranks {stuck} were still running")
                    raise TimeoutError(
                        f"{_name(fn)} did not finish within {timeout:g} s: "
                        f"ranks {stuck} had not finished.{note}"
                    )
                _, pending = concurrent.futures.wait(
                    pending,
                    timeout=min(left, _POLL_SECONDS),
                    return_when=concurrent.futures.FIRST_EXCEPTION,
                )
                failed = [r for r, part in enumerate(per_rank) if part.done() and part.exception()]
                if failed:
                    self._raise_rank_error(per_rank, failed[0])
                if line:
                    line.update(ar["data"][0])  # what rank 0 last published
            if line:
                ar.wait_for_output(timeout=1)  # progress messages may trail the results
                line.update(ar["data"][0])
        finally:
            if line:
                line.close()
        return [part.result(timeout=0) for part in per_rank]

    def reset(self) -> None:
        """Clear every engine's namespace, as `%reset -f` would, so that a notebook run again
        (or the next one on the same cluster) starts from empty engines. Imported modules stay
        loaded: after changing the package, restart the cluster instead."""
        cleared = self.client.clear(targets=self.view.targets, block=False)
        try:
            cleared.result(timeout=self._timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(
                f"the engines did not clear their namespaces within {self._timeout:g} s: one is "
                "still running something; wait for it to finish, or restart the cluster"
            ) from None

    def _raise_rank_error(self, per_rank: list, rank: int) -> None:
        """Give the others a moment, restart stuck or dead engines, raise one RankError.

        When several ranks fail (often all alike), the lowest one is named, so the message
        is the same run after run.
        """
        targets = list(self.view.targets)  # engine ids by rank, before any restart renews them
        concurrent.futures.wait([p for p in per_rank if not p.done()], timeout=_GRACE_SECONDS)
        stuck = [r for r, part in enumerate(per_rank) if not part.done()]
        rank = min(r for r, part in enumerate(per_rank) if part.done() and part.exception())
        err = per_rank[rank].exception()
        ename = getattr(err, "ename", type(err).__name__)
        evalue = getattr(err, "evalue", str(err))
        note, shown = "", err  # shown: the exception whose traceback the message carries
        if ename == "EngineError":
            rank, evalue = self._lost_rank(default=rank)
            note = self._recover("An engine died, and that ends the MPI job of all the engines")
            # the traceback shown is the lost rank's own, not that of the lowest rank whose
            # engine went down with the job ("rank 0 (engine 0) died" under a rank-2 header)
            lost = per_rank[rank]
            shown = lost.exception() if lost.done() else None
        elif stuck:
            note = self._recover(
                f"Ranks {stuck} were still running, probably waiting for rank {rank} in MPI"
            )
        remote_tb = _strip_ansi(getattr(shown, "traceback", None) or "")
        # ipyparallel names engines by id, this message by rank: say both, one way
        remote_tb = re.sub(r"\bEngine (\d+)\b", lambda m: _as_rank(targets, m), remote_tb)
        detail = note + (f"\n\nTraceback on rank {rank}:\n{remote_tb}" if remote_tb else "")
        raise RankError(rank, ename, evalue, detail, engine=targets[rank]) from err

    def _recover(self, what: str) -> str:
        """Restart the engines after `what` went wrong; return a note for the error message."""
        cluster = self.cluster or _running_cluster_of(self._profile)  # not ours: restart its
        if cluster is None:  # engines all the same, through its controller, if it still runs
            fix = _how_to_fix(self.n, self._profile, owned=False)
            return (
                f"\n{what}. These engines cannot recover on their own (a rank blocked in MPI "
                f"ignores interrupts): restart the cluster with\n  {fix}\nthen run connect() again."
            )
        self._restart_engines(cluster)
        return f"\n{what}, so the engines were restarted (their variables are gone)."

    def _lost_rank(self, default: int, wait: float = 5.0) -> tuple[int, str]:
        """Which rank died first, as far as the watch of _note_exits saw (see _first_to_end);
        it waits up to `wait` seconds for the watch to see one end, else says `default`."""
        deadline = time.monotonic() + wait
        while not self._exits and time.monotonic() < deadline:
            time.sleep(0.05)
        if not self._exits:
            return default, "an engine died (no engine process was seen to end)"
        return _first_to_end(self._exits, self.pids)

    def _watch_exits(self) -> None:
        """Stop watching the previous engines' processes, if any; watch the current ones."""
        self._stop_watch.set()
        self._exits, self._stop_watch = [], threading.Event()
        watch = (self.pids, self._exits, self._stop_watch)
        threading.Thread(target=_note_exits, args=watch, daemon=True).start()

    def _restart_engines(self, cluster: ipp.Cluster) -> None:
        """Kill the engine set and start a fresh one; a rank blocked in MPI ignores SIGTERM."""
        old = set(self.view.targets)
        with contextlib.suppress(psutil.NoSuchProcess):  # mpiexec may have ended the job already
            cluster.signal_engines_sync(signal.SIGKILL)
        cluster.stop_engines_sync()
        # New engines reuse the old ids, so wait for the old ones to unregister first.
        deadline = time.monotonic() + self._timeout
        while old & set(self.client.ids) and time.monotonic() < deadline:
            time.sleep(0.1)
        cluster.start_engines_sync(self.n)
        fix = _how_to_fix(self.n, self._profile, owned=True)
        _wait_for_engines(self.client, self.n, self._timeout, fix)
        # Update the view in place, so a view activated for %px keeps working.
        self.view.targets, self.pids = _engines_in_rank_order(
            self.client, self.n, self._timeout, fix
        )
        self._watch_exits()

    def close(self) -> None:
        """Close the client; stop the cluster too if connect() started it."""
        self._stop_watch.set()
        self.client.close()
        if self.cluster is not None:
            stop_cluster(self.cluster)
            self.cluster = None

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _ProgressLine:
    """One line, 'step s/total  loss x', updated in place while run() waits."""

    def __init__(self, total: int) -> None:
        self.total = total
        shell = get_ipython()
        in_kernel = shell is not None and getattr(shell, "kernel", None) is not None
        self.handle = display(self._text({}), raw=True, display_id=True) if in_kernel else None

    def _text(self, data: dict) -> dict:
        """The line as a raw text/plain display bundle."""
        text = f"step {data.get('step', 0)}/{self.total}"
        if "loss" in data:
            text += f"  loss {data['loss']:.4f}"
        return {"text/plain": text}

    def update(self, data: dict) -> None:
        """Show the latest {"step", "loss"} published by rank 0."""
        if self.handle is not None:
            self.handle.update(self._text(data), raw=True)
        else:
            sys.stdout.write("\r" + self._text(data)["text/plain"])
            sys.stdout.flush()

    def close(self) -> None:
        """End the terminal line (a notebook display needs nothing)."""
        if self.handle is None:
            sys.stdout.write("\n")


def children_file(cluster_file: str) -> Path:
    """Where connect() records the children of the controller it started (beside the cluster
    file)."""
    return Path(cluster_file).with_suffix(".children.json")


def record_controller_children(cluster: ipp.Cluster) -> None:
    """Write the controller's children (its schedulers: pid and start time) beside the cluster
    file. A controller killed with SIGKILL leaves them running with parent 1, where only this
    record finds them (never a name; the start time tells a reused pid apart)."""
    with contextlib.suppress(psutil.Error, OSError, AttributeError, TypeError):
        children = psutil.Process(cluster.controller.pid).children(recursive=True)
        record = [[p.pid, p.create_time()] for p in children]
        children_file(cluster.cluster_file).write_text(json.dumps(record))


def end_controller_children(cluster_file: str) -> None:
    """End the controller's recorded children that still run (SIGTERM, then SIGKILL after 5 s)
    and remove the record."""
    path = children_file(cluster_file)
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    running = []
    for pid, started in record if isinstance(record, list) else []:
        with contextlib.suppress(psutil.Error, TypeError, ValueError):
            process = psutil.Process(int(pid))
            if process.create_time() == started:
                process.terminate()
                running.append(process)
    _, alive = psutil.wait_procs(running, timeout=5)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()
    with contextlib.suppress(OSError):
        path.unlink()


def stop_cluster(cluster: ipp.Cluster) -> None:
    """Stop the engines and the controller, each even if the other fails (as when the engines
    never started: ipyparallel's stop_cluster then skips the controller), and the controller's
    recorded children (left running when the controller itself was killed)."""
    recorded = cluster.cluster_file
    if not os.path.isdir(cluster.profile_dir):  # `hosts down` took the profile and the cluster
        cluster.cluster_file = ""  # so stopping writes no cluster file: it would remake the dir
    with contextlib.suppress(Exception):
        cluster.stop_engines_sync()
    with contextlib.suppress(Exception):
        cluster.stop_controller_sync()
    with contextlib.suppress(Exception):
        cluster.stop_cluster_sync()  # and the cluster file
    if recorded:
        end_controller_children(recorded)


def stop_when_gone(pid: int, cluster_file: str) -> subprocess.Popen:
    """Start a watchdog that stops the cluster once process `pid` ends, even if it is killed
    (atexit runs only on a clean exit; nbval and a kernel restart kill the kernel)."""
    return subprocess.Popen(
        [sys.executable, "-m", "fsdp_lesson.cluster", str(pid), cluster_file],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def _watchdog(pid: int, cluster_file: str) -> None:
    """The watchdog: wait for `pid` to end (or the cluster to be stopped), then stop it."""
    while psutil.pid_exists(pid) and os.path.exists(cluster_file):
        time.sleep(1)
    if os.path.exists(cluster_file):
        stop_cluster(ipp.Cluster.from_file(cluster_file, log=_log))


def run_on_engine(model_config, train_config, run_config=None) -> dict:
    """What a notebook runs on every engine (Ranks.run): train on MPI.COMM_WORLD.

    Returns this rank's History as a dict, plus "params", the full parameters gathered
    (identical on every rank), and "placements", where this rank's state lies on the mesh
    (strategies.base.placement_table). Rank 0 feeds the notebook's progress line.
    """
    from .comm import Comm
    from .strategies.base import placement_table
    from .train import run

    collectives = "mpi" if run_config is None else run_config.collectives
    history, strategy = run(
        model_config, train_config, run_config, Comm.world(collectives), on_log=report_progress
    )
    params, placements = strategy.full_params(), placement_table(strategy)
    return history.to_dict() | {
        "params": params,
        "rank": strategy.comm.rank,
        "placements": placements,
    }


def report_progress(step: int, loss: float) -> None:
    """On an engine, send (step, loss) to run()'s progress line; elsewhere, do nothing."""
    kernel = sys.modules.get("ipyparallel.engine.kernel")  # imported only inside an engine
    if kernel is not None and kernel.IPythonParallelKernel.initialized():
        publish_data({"step": int(step), "loss": float(loss)})


def _note_exits(pids: list[int], exits: list[tuple[int, ...]], stop: threading.Event) -> None:
    """Append the ranks whose processes ended to `exits`, a tuple per wake, until all have or
    `stop` is set: mpiexec ends the others ~10 ms after one engine dies, so only a watch already
    running can tell which was first, and only if it wakes in between (a tuple of one). pidfds
    wake it on Linux; elsewhere it polls."""
    fds = _pidfds(pids)
    poller = select.poll() if fds else None
    for fd in fds:
        poller.register(fd, select.POLLIN)
    seen: set[int] = set()
    try:
        while len(seen) < len(pids) and not stop.is_set():
            if poller:
                ready = [fd for fd, _ in poller.poll(500)]
                for fd in ready:
                    poller.unregister(fd)  # it stays readable
                ended = {fds[fd] for fd in ready}
            else:
                stop.wait(0.005)
                ended = {r for r, pid in enumerate(pids) if not psutil.pid_exists(pid)} - seen
            if ended:
                seen |= ended
                exits.append(tuple(sorted(ended)))
    finally:
        for fd in fds:
            os.close(fd)


def _first_to_end(exits: list[tuple[int, ...]], pids: list[int]) -> tuple[int, str]:
    """The rank the watch saw end first, and how it knows. mpiexec ends the others milliseconds
    after the first; a busy machine may wake the watch only after several ended, and then the
    message says they ended together and names the lowest (it cannot tell more)."""
    first = exits[0]
    if len(first) == 1:
        rank = first[0]
        return rank, f"the engine of rank {rank} (pid {pids[rank]}) was the first to end"
    return first[0], (
        f"the engines of ranks {list(first)} were seen to end together (mpiexec ends the others "
        "milliseconds after the first, and this busy machine hid which was first)"
    )


def _pidfds(pids: list[int]) -> dict[int, int]:
    """The processes' pidfds (fd -> rank), each readable once its process ends; {} where there
    are none (not Linux, or a process reaped already)."""
    fds: dict[int, int] = {}
    try:
        for rank, pid in enumerate(pids):
            fds[os.pidfd_open(pid)] = rank
    except (AttributeError, OSError):
        for fd in fds:
            os.close(fd)
        return {}
    return fds


def _as_rank(targets: list[int], match: re.Match) -> str:
    """'Engine 0' as 'rank 2 (engine 0)' when engine 0 is rank 2 (engine ids are not ranks)."""
    engine = int(match[1])
    return f"rank {targets.index(engine)} (engine {engine})" if engine in targets else match[0]


def _noninteractive() -> bool:
    """True under CI: IPP_NONINTERACTIVE=1 turns progress output off, as in ipyparallel."""
    return os.environ.get("IPP_NONINTERACTIVE", "") not in {"", "0"}


def _name(fn: Callable[..., Any]) -> str:
    """A function's name for messages."""
    return getattr(fn, "__name__", repr(fn))


def _strip_ansi(text: str) -> str:
    """Remote tracebacks come colored; drop the escape codes for plain error messages."""
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


if __name__ == "__main__":  # the watchdog process of stop_when_gone
    _watchdog(int(sys.argv[1]), sys.argv[2])
