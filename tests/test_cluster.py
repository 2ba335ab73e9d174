"""fsdp_lesson.cluster against real ipyparallel clusters of MPI engines (no mocks).

Every cluster here lives in a temporary IPYTHONDIR, so a user's own clusters are never touched,
and every fixture stops what it started, even when a test fails.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import ipyparallel as ipp
import psutil
import pytest
from mpi_helpers import kill_engine_of

from fsdp_lesson.cluster import ClusterError, RankError, connect, report_progress
from fsdp_lesson.hosts import running
from fsdp_lesson.launch import RANK_ENV

# --- functions that run on the engines --------------------------------------------------------
# @ipp.interactive sends them by value: the engines cannot import this test module.


@ipp.interactive
def rank_and_size() -> tuple[int, int]:
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


@ipp.interactive
def blas_threads() -> tuple[str, list[int]]:
    """The engine's OPENBLAS_NUM_THREADS, and the threads each BLAS library it loaded uses."""
    import os

    from threadpoolctl import threadpool_info

    setting = os.environ.get("OPENBLAS_NUM_THREADS", "unset")
    return setting, [pool["num_threads"] for pool in threadpool_info()]


@ipp.interactive
def allreduce_rank_plus_one() -> list[float]:
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    total = np.zeros(3)
    comm.Allreduce(np.full(3, comm.Get_rank() + 1.0), total)
    return total.tolist()


@ipp.interactive
def rank_2_fails_before_allreduce() -> float:
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if comm.Get_rank() == 2:
        raise ValueError("rank 2 refuses")
    total = np.zeros(1)
    comm.Allreduce(np.ones(1), total)  # the other ranks wait here for rank 2, forever
    return float(total[0])


@ipp.interactive
def train_with_progress(steps: int) -> int:
    import time

    from fsdp_lesson.cluster import report_progress

    for step in range(1, steps + 1):
        report_progress(step, 1.0 / step)
        time.sleep(0.2)
    return steps


# --- helpers and fixtures ---------------------------------------------------------------------


def wait_until_gone(pids: list[int], timeout: float = 15) -> list[int]:
    """Wait for the processes to end; return those still running after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while any(running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [p for p in pids if running(p)]


@pytest.fixture(scope="module", autouse=True)
def ipython_dir(tmp_path_factory):
    """A private IPYTHONDIR for this module, and this venv's mpiexec first on PATH."""
    path = tmp_path_factory.mktemp("ipython")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("IPYTHONDIR", str(path))
        mp.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
        mp.delenv("IPP_NONINTERACTIVE", raising=False)
        yield path


@contextlib.contextmanager
def ipcluster(n: int, engines: str, profile: str):
    """A running cluster as `ipcluster start` leaves it (cluster_id ""), stopped on exit."""
    cluster = ipp.Cluster(n=n, engines=engines, profile=profile, cluster_id="")
    try:
        cluster.start_and_connect_sync().close()
        yield cluster
    finally:
        cluster.stop_cluster_sync()


@pytest.fixture(scope="module")
def mpi_ipcluster():
    """A 4-engine MPI cluster that someone else started: in a shell without the launch settings
    (fsdp_lesson/launch.py) that make and connect() give their clusters."""
    with pytest.MonkeyPatch.context() as mp:
        for name in RANK_ENV:
            mp.delenv(name, raising=False)
        with ipcluster(4, "mpi", "external") as cluster:
            mp.undo()  # the engines keep the environment they started with
            yield cluster


@pytest.fixture(scope="module")
def external(mpi_ipcluster):
    """Ranks connected to the running 4-engine MPI cluster."""
    with connect(n=4, profile="external", timeout=60) as ranks:
        yield ranks


@pytest.fixture(scope="module")
def own():
    """Ranks on a cluster that connect() started itself (so it may restart the engines)."""
    with connect(n=4, profile="own", timeout=60) as ranks:
        yield ranks


# --- connecting -------------------------------------------------------------------------------


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_connect_uses_running_mpi_cluster(external):
    assert external.cluster is None  # not ours: close() must leave it running
    assert external.run(rank_and_size) == [(0, 4), (1, 4), (2, 4), (3, 4)]
    assert external.run(allreduce_rank_plus_one) == [[10.0, 10.0, 10.0]] * 4


@pytest.mark.cluster
@pytest.mark.timeout(60)
def test_connect_gives_a_cluster_started_by_hand_one_blas_thread_per_engine(external):
    # numpy on 4 engines of 2 cores: the library's default is a BLAS thread per core
    assert external.run(blas_threads) == [("unset", [1])] * 4


@pytest.mark.cluster
@pytest.mark.timeout(60)
def test_reset_clears_every_engine_and_the_view_keeps_working(external):
    external.view.execute("leftover = 1")
    assert external.view.pull("leftover") == [1, 1, 1, 1]
    external.reset()
    external.view.execute("present = 'leftover' in dir()")
    assert external.view.pull("present") == [False] * 4
    assert external.run(os.getpid, timeout=30) == external.pids  # the same engines, in rank order


@pytest.mark.cluster
@pytest.mark.timeout(60)
def test_more_engines_than_asked_is_refused(external):
    with pytest.raises(ClusterError) as info:
        connect(n=2, profile="external", timeout=10)
    message = str(info.value)
    assert "started with 4 engines, but n=2 were asked for" in message
    assert "ipcluster start --engines=MPI -n 2 --profile=external" in message


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_connect_starts_its_own_cluster_and_close_stops_it(ipython_dir):
    # Files of a dead cluster on record must not make connect() hang or use them.
    stale = ipp.Cluster(profile="fresh", cluster_id="")
    stale.start_controller_sync()
    with open(stale.cluster_file) as f:
        record = f.read()
    stale.stop_cluster_sync()
    with open(stale.cluster_file, "w") as f:
        f.write(record)

    ranks = connect(n=4, profile="fresh", timeout=60)
    try:
        assert ranks.cluster is not None
        assert ranks.run(rank_and_size) == [(r, 4) for r in range(4)]
        pids = ranks.run(os.getpid) + [ranks.cluster.controller.pid]
        pids.append(ranks.cluster.engine_set.pid)  # mpiexec
        assert all(running(p) for p in pids)
    finally:
        ranks.close()
    assert wait_until_gone(pids) == []


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_connect_after_its_controller_was_killed_stops_what_that_controller_left():
    with ipcluster(2, "mpi", "orphans") as cluster:
        controller = cluster.controller.pid
        launcher = next(iter(cluster.engines.values())).pid  # mpiexec of the engines
        left = [launcher] + [
            p.pid
            for pid in (controller, launcher)
            for p in psutil.Process(pid).children(recursive=True)
        ]
        assert len(left) > 3  # the schedulers, mpiexec and its engines
        os.kill(controller, signal.SIGKILL)  # the controller alone dies
        assert wait_until_gone([controller]) == []
        try:
            ranks = connect(n=2, profile="orphans", timeout=60)
            try:
                assert wait_until_gone(left) == []
                assert ranks.run(rank_and_size) == [(0, 2), (1, 2)]
            finally:
                ranks.close()
        finally:  # whatever the test found, it leaves nothing behind
            for pid in filter(running, left):
                with contextlib.suppress(ProcessLookupError):  # ended since running() said so
                    os.kill(pid, signal.SIGKILL)


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_its_own_cluster_whose_controller_was_killed_leaves_no_child_of_it():
    """connect()'s own cluster: the controller killed -9 leaves its schedulers running with
    parent 1 (8 of them, two minutes later), which stopping the cluster cannot reach through
    the controller; close() ends them by the pids connect() recorded."""
    ranks = connect(n=2, profile="own-orphans", timeout=60)
    children = []
    try:
        controller = ranks.cluster.controller.pid
        children = [p.pid for p in psutil.Process(controller).children(recursive=True)]
        assert children, "the controller has no children to leave behind"
        os.kill(controller, signal.SIGKILL)  # the controller alone dies
        assert wait_until_gone([controller]) == []
        assert all(running(p) for p in children)  # orphaned, not gone with it
    finally:
        ranks.close()
        left = wait_until_gone(children)
        for pid in left:  # whatever the test found, it leaves nothing behind
            with contextlib.suppress(ProcessLookupError):  # ended since wait_until_gone
                os.kill(pid, signal.SIGKILL)
    assert left == [], f"the dead controller's children still run: {left}"


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_cluster_without_mpi_engines_is_refused():
    with ipcluster(4, "local", "local"):
        with pytest.raises(ClusterError) as info:
            connect(n=4, profile="local", timeout=30)
    message = str(info.value)
    assert "not one MPI world" in message and "size 1" in message
    assert "ipcluster start --engines=MPI -n 4 --profile=local" in message


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_too_few_engines_is_refused():
    with ipcluster(2, "mpi", "two"):
        with pytest.raises(ClusterError) as info:
            connect(n=4, profile="two", timeout=60)
    message = str(info.value)  # refused at once: after the timeout it would say "Only 2 of"
    assert "started with 2 engines, but n=4 were asked for" in message
    assert "ipcluster start --engines=MPI -n 4 --profile=two" in message


# --- running ----------------------------------------------------------------------------------


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_exception_on_one_rank_raises_promptly_and_engines_recover(own):
    with pytest.raises(RankError) as info:  # promptly: after the timeout, a TimeoutError
        own.run(rank_2_fails_before_allreduce, timeout=60)
    assert info.value.rank == 2 and info.value.ename == "ValueError"
    message = str(info.value)
    assert message.startswith(
        f"rank 2 (engine {info.value.engine}) raised ValueError: rank 2 refuses"
    )
    assert "restarted" in message
    assert own.run(rank_and_size) == [(r, 4) for r in range(4)]


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_timeout_raises_promptly_and_engines_recover(own):
    # promptly: waiting for the ranks' 600 s would pass the test's own timeout (120 s)
    with pytest.raises(TimeoutError) as info:
        own.run(time.sleep, 600, timeout=2)
    assert "ranks [0, 1, 2, 3] had not finished" in str(info.value)
    assert own.run(rank_and_size) == [(r, 4) for r in range(4)]


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_engine_that_dies_is_an_error_not_a_hang(own):
    killer = threading.Timer(1.0, kill_engine_of, (own, 1))
    killer.start()
    with pytest.raises(RankError) as info:  # not a hang: after the timeout, a TimeoutError
        own.run(time.sleep, 600, timeout=60)
    killer.join()
    assert info.value.rank == 1  # the lost rank is named, not whichever engine reported first
    assert "the engine of rank 1" in str(info.value) and "restarted" in str(info.value)
    engine = info.value.engine
    assert str(info.value).startswith(f"rank 1 (engine {engine}) raised EngineError")
    assert f"Engine {engine} died" not in str(info.value)  # one name: rank, engine in brackets
    assert own.run(rank_and_size) == [(r, 4) for r in range(4)]


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_connect_to_a_cluster_whose_engines_died_starts_fresh_ones(tmp_path, capsys):
    # a crash, or a checker's timeout (the watchdog's MPI_Abort), ends the whole engine set of
    # a cluster connect() did not start: connect() starts new engines on its controller
    with ipcluster(4, "mpi", "dies") as cluster:
        launcher = next(iter(cluster.engines.values())).pid  # mpiexec of the engines
        os.kill(launcher, signal.SIGKILL)
        assert wait_until_gone([launcher]) == []
        with connect(n=4, profile="dies", timeout=60) as ranks:
            assert "engines had stopped: started 4 fresh ones" in capsys.readouterr().out
            assert ranks.run(rank_and_size) == [(r, 4) for r in range(4)]
            fresh = ranks.pids
        stop = [pid for pid in fresh if psutil.pid_exists(pid)]
        for pid in stop:  # the fresh engines are the test's cluster's to stop: it only
            with contextlib.suppress(ProcessLookupError):  # knew the set that died; one may
                os.kill(pid, signal.SIGKILL)  # have ended since pid_exists (their mpiexec)
        assert wait_until_gone(stop) == []


@ipp.interactive
def train_until_rank_2_dies(model_config, train_config, checkpoint_dir, die_at):
    """Train zero3 with checkpoints; rank 2 kills its own engine at step `die_at` (a crash)."""
    import os
    import signal

    from fsdp_lesson.comm import Comm
    from fsdp_lesson.config import RunConfig
    from fsdp_lesson.train import run

    comm = Comm.world()

    def crash(step, loss):
        if comm.rank == 2 and step == die_at:
            os.kill(os.getpid(), signal.SIGKILL)

    saving = RunConfig(save_every=10, checkpoint_dir=checkpoint_dir)
    run(model_config, train_config, saving, comm, on_log=crash)


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_training_resumes_from_the_checkpoint_after_an_engine_dies(own, tmp_path):
    from fsdp_lesson.cluster import run_on_engine
    from fsdp_lesson.config import ModelConfig, RunConfig, TrainConfig
    from fsdp_lesson.train import run

    config = TrainConfig(
        strategy="zero3", optimizer="adam", steps=60, log_every=1, eval_batches=2, samples=2
    )
    old_pids = list(own.pids)
    with pytest.raises(RankError) as info:  # prompt: after the timeout, a TimeoutError
        own.run(
            train_until_rank_2_dies, ModelConfig(), config, str(tmp_path / "ckpt"), 35, timeout=120
        )
    assert info.value.rank == 2 and "restarted" in str(info.value)
    assert wait_until_gone(old_pids) == []  # no orphan engine of the crashed job
    # the engines are back: resume from the last checkpoint (step 30) and finish
    results = own.run(
        run_on_engine, ModelConfig(), config, RunConfig(resume=tmp_path / "ckpt"), timeout=120
    )
    straight, strategy = run(
        ModelConfig(), config.__class__(**(config.to_dict() | {"strategy": "single"}))
    )
    for layer, p in strategy.full_params().items():
        for k, v in p.items():
            assert abs(results[0]["params"][layer][k] - v).max() <= 1e-5, f"{layer}.{k}"
    assert abs(results[0]["losses"][30:] - straight.losses[30:]).max() <= 1e-5
    assert results[0]["samples"] == straight.samples


@pytest.mark.cluster
@pytest.mark.timeout(60)
def test_progress_line(external, capsys, monkeypatch):
    assert external.run(train_with_progress, 5, progress=5) == [5] * 4
    assert "\rstep 5/5  loss 0.2000\n" in capsys.readouterr().out

    monkeypatch.setenv("IPP_NONINTERACTIVE", "1")
    assert external.run(train_with_progress, 2, progress=2) == [2] * 4
    assert capsys.readouterr().out == ""


def test_report_progress_is_a_no_op_off_an_engine():
    report_progress(1, 0.5)


@pytest.mark.parametrize("pidfds", [True, False], ids=["pidfds", "polling"])
def test_exits_are_noted_in_the_order_the_processes_end(pidfds, monkeypatch):
    """What names the rank whose engine died first: mpiexec ends the others milliseconds later."""
    from fsdp_lesson import cluster

    if not pidfds:
        monkeypatch.setattr(cluster, "_pidfds", lambda pids: {})
    processes = [subprocess.Popen(["sleep", "60"]) for _ in range(3)]
    exits, stop = [], threading.Event()
    pids = [p.pid for p in processes]
    watch = threading.Thread(target=cluster._note_exits, args=(pids, exits, stop))
    watch.start()
    try:
        for rank in (2, 0):  # rank 1 keeps running: only `stop` ends the watch
            time.sleep(0.05)
            processes[rank].kill()
            processes[rank].wait()  # reaped, as hydra reaps its engines
        time.sleep(0.1)
        stop.set()
        watch.join(timeout=5)
    finally:
        stop.set()
        for process in processes:
            process.kill()
            process.wait()
    assert exits == [(2,), (0,)] and not watch.is_alive()


def test_engines_seen_to_end_together_are_named_together():
    """A busy machine may wake the watch only after mpiexec ended the others too: the message
    says so, rather than naming the lowest rank as the one that died."""
    from fsdp_lesson import cluster

    pids = [101, 102, 103, 104]
    assert cluster._first_to_end([(2,), (0, 1, 3)], pids) == (
        2,
        "the engine of rank 2 (pid 103) was the first to end",
    )
    rank, text = cluster._first_to_end([(0, 2), (1, 3)], pids)
    assert rank == 0 and text.startswith("the engines of ranks [0, 2] were seen to end together")
    assert "was the first" not in text and "hid which was first" in text


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_a_killed_kernel_leaves_no_cluster_behind(tmp_path):
    """nbval and kernel restarts kill the kernel, so atexit never runs: a watchdog stops it."""
    script = (
        "import json, os, sys, time\n"
        "from fsdp_lesson.cluster import connect\n"
        "r = connect(n=4, profile='killed', timeout=60)\n"
        "pids = r.pids + [r.cluster.controller.pid, r.cluster.engine_set.pid]\n"
        "print(json.dumps({'pids': pids, 'file': r.cluster.cluster_file}), flush=True)\n"
        "time.sleep(300)\n"
    )
    kernel = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        line = kernel.stdout.readline()
        while not line.startswith("{"):  # connect() says which cluster it uses first
            line = kernel.stdout.readline()
        started = json.loads(line)
    finally:
        kernel.kill()
        kernel.wait()
    assert wait_until_gone(started["pids"], timeout=60) == []
    deadline = time.monotonic() + 30
    while os.path.exists(started["file"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not os.path.exists(started["file"])
