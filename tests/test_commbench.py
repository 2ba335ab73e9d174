"""commbench: the alpha-beta fit on known lines, the prediction, the plot, and a quick real run.

Timings are never asserted on (the machine is shared); the real run checks the shape of what
commbench measured: every kind, impl and size, with the ring model's messages and bytes; and
that a signal to commbench leaves none of its job running.
"""

import contextlib
import json
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

from fsdp_lesson import commbench, plots
from fsdp_lesson.comm import Comm


def test_fit_recovers_alpha_and_beta_of_an_exact_line():
    sizes = np.array([4.0**k for k in range(1, 14)])
    messages = np.full_like(sizes, 6.0)  # an allreduce at N = 4
    sent = 1.5 * sizes
    line = commbench.fit_line(messages, sent, 5e-6 * messages + 1e-9 * sent)
    assert line["alpha_us"] == pytest.approx(5.0)
    assert line["gb_per_s"] == pytest.approx(1.0)
    assert line["crossover_bytes"] == pytest.approx(5000.0)
    assert line["r2"] == pytest.approx(1.0)


def test_fit_never_returns_a_negative_latency():
    sizes = np.array([16.0, 256.0, 4096.0, 65536.0])
    seconds = 1e-9 * sizes * np.array([0.5, 1.0, 1.0, 1.0])  # an unconstrained alpha < 0
    line = commbench.fit_line(np.ones(4), sizes, seconds)
    assert line["alpha_s"] == 0.0 and line["beta_s_per_byte"] > 0
    assert line["r2"] <= 1.0


def test_fit_groups_by_ranks_impl_and_kind():
    points = [
        dict(ranks=n, impl=impl, kind="allgather", messages=n - 1.0, sent_bytes=b, seconds=t)
        for n in (2, 4)
        for impl in ("mpi", "ring")
        for b, t in ((16.0, 2e-5), (1e6, 1e-3), (1e7, 1e-2))
    ]
    fits = commbench.fit(points)
    assert set(fits) == {2, 4} and set(fits[2]) == {"mpi", "ring"}
    assert fits[4]["ring"]["allgather"]["points"] == 3


def test_predict_seconds_from_a_traffic_report():
    comm = Comm()  # one rank: the counted model is all zeros
    report = comm.traffic_report()
    report["allreduce"] |= {"messages": 10, "sent_bytes": 1e6}
    fit = {"allreduce": {"alpha_s": 2e-6, "beta_s_per_byte": 1e-9}}
    assert commbench.predict_seconds(report, fit) == {"allreduce": pytest.approx(2e-5 + 1e-3)}


def test_plot_has_a_panel_per_kind():
    series = [("p2p", "pingpong")] + [("mpi", k) for k in commbench.KINDS[1:]]
    points = [
        dict(ranks=2, impl=impl, kind=kind, messages=1.0, sent_bytes=b, buffer_bytes=b)
        | {"seconds": 1e-5 + 1e-9 * b}
        for impl, kind in series
        for b in (4.0, 4096.0, 4e6)
    ]
    fig = plots.commbench_fits(points, commbench.fit(points))
    assert [ax.get_title() for ax in fig.axes] == list(commbench.KINDS)
    assert all(ax.get_xscale() == ax.get_yscale() == "log" for ax in fig.axes)


def test_latency_or_bandwidth_marks_the_crossover_and_each_message_size():
    line = {"alpha_s": 1e-5, "beta_s_per_byte": 1e-9}  # crossover at 10,000 bytes
    fig = plots.latency_or_bandwidth(line, {"small": 100.0, "large": 1e6})
    (ax,) = fig.axes
    drawn = {line.get_label(): (line.get_xdata()[0], line.get_ydata()[0]) for line in ax.lines}
    crossover = [x for label, (x, _) in drawn.items() if label.startswith("α/β")]
    assert crossover == [pytest.approx(1e4)]
    assert drawn["small"] == pytest.approx((100.0, 1e-5 + 1e-7))
    assert drawn["large"] == pytest.approx((1e6, 1e-5 + 1e-3))


def test_one_rank_is_refused():
    with pytest.raises(ValueError, match="2 ranks or more"):
        commbench.time_collectives(Comm())
    result = subprocess.run(
        [sys.executable, "-m", "fsdp_lesson.commbench", "--ranks", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "every rank count must be 2 or more" in result.stderr


@pytest.mark.mpi
def test_quick_run_times_every_kind_with_the_ring_model(tmp_path):
    out = tmp_path / "commbench.json"
    result = subprocess.run(
        [sys.executable, "-m", "fsdp_lesson.commbench", "--quick", "--ranks", "2", "3"]
        + ["--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "alpha us" in result.stdout and "1/beta GB/s" in result.stdout
    saved = json.loads(out.read_text())
    points = saved["points"]
    for n in (2, 3):
        mine = [p for p in points if p["ranks"] == n]
        series = {(p["impl"], p["kind"]) for p in mine}
        assert series == {("p2p", "pingpong")} | {
            (impl, kind) for impl in commbench.IMPLS for kind in commbench.KINDS[1:]
        }
        # per call, mean over ranks: messages, and bytes sent per byte of the buffer
        ring_model = {
            "pingpong": (1, 1),
            "allreduce": (2 * (n - 1), 2 * (n - 1) / n),
            "reduce_scatter": (n - 1, (n - 1) / n),
            "allgather": (n - 1, (n - 1) / n),
            "bcast": ((n - 1) / n, (n - 1) / n),
        }
        for p in mine:
            messages, share = ring_model[p["kind"]]
            assert p["seconds"] > 0
            assert p["messages"] == pytest.approx(messages), p
            assert p["sent_bytes"] == pytest.approx(share * p["buffer_bytes"]), p
        for impl in saved["fits"][str(n)].values():
            for line in impl.values():
                assert line["alpha_s"] >= 0 and line["beta_s_per_byte"] >= 0
                assert line["r2"] <= 1.0


@pytest.mark.mpi
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_commbench_ends_its_mpiexec_and_ranks(sig):
    """Ended while its ranks run, commbench ends its job's whole process group first (it used
    to leave mpiexec, its proxy and both ranks running ~30 s), then says so in one line."""
    command = [sys.executable, "-m", "fsdp_lesson", "commbench", "--ranks", "2", "--quick"]
    job = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    seen: dict[int, psutil.Process] = {}
    names: set[str] = set()
    try:
        me = psutil.Process(job.pid)
        while job.poll() is None and len(workers(seen)) < 2:
            with contextlib.suppress(psutil.Error):
                for process in me.children(recursive=True):
                    seen.setdefault(process.pid, process)
                    names.add(process.name())
            time.sleep(0.1)
        assert job.poll() is None, "commbench ended before its ranks ran"
        job.send_signal(sig)
        _, stderr = job.communicate(timeout=60)
    finally:
        job.kill()
        _, alive = psutil.wait_procs(list(seen.values()), timeout=10)
        for process in alive:
            process.kill()
    assert job.returncode == 128 + sig, stderr
    assert stderr.strip().splitlines()[-1] == (
        f"commbench: stopped by {signal.Signals(sig).name}; its mpiexec and ranks are ended"
    )
    assert names >= {"mpiexec", "hydra_pmi_proxy"}, names
    assert alive == [], f"left running: {[p.pid for p in alive]}"


def workers(processes: dict[int, psutil.Process]) -> list[int]:
    """The pids of the commbench ranks (--worker) among processes that still run."""
    found = []
    for pid, process in processes.items():
        with contextlib.suppress(psutil.Error):
            if "--worker" in process.cmdline():
                found.append(pid)
    return found
