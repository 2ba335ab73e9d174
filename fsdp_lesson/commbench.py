"""commbench: time ping-pong and each collective, and fit the latency-bandwidth model to it.

    python -m fsdp_lesson.commbench [--ranks 2 4] [--quick] [--out FILE.json]
    python -m fsdp_lesson commbench --mpiexec build/hosts/mpiexec --ranks 2 \
        --min-bytes 4096 --max-bytes 4194304

For each rank count N it runs `mpiexec -n N` once. Every rank times a ping-pong between ranks 0
and 1 and each collective of Comm, the library's (collectives="mpi") and the hand-made ring
(collectives="ring"), on buffers from 4 B to 64 MiB: the median over repetitions of the slowest
rank's time per call. Then, per kind and N, a least-squares fit of

    t = alpha * messages + beta * bytes

with the messages and bytes a rank sends per call, as Comm's traffic report has them (measured
for the ring, the ring model counted for the library). alpha is the cost of one message
(latency, software overhead), 1/beta the bandwidth; a message of alpha/beta bytes costs as much
in latency as in transfer, so smaller messages are latency-bound and larger ones bandwidth-bound.

--mpiexec runs the ranks with another launcher, e.g. the simulated hosts' (hosts.py): then 1/beta
is the link's. A 4 MiB call takes 0.35 s at 100 Mbit/s, so --max-bytes keeps such a run short;
--min-bytes 4096 leaves out the smallest messages, whose time on a loaded machine is the
scheduler's (0.01-0.2 ms from run to run across the hosts), which would otherwise sway the fit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from .comm import Comm

SIZES = [4**k for k in range(1, 14)]  # 4 B, 16 B, ..., 64 MiB
QUICK_SIZES = SIZES[:7]  # up to 16 KiB
KINDS = ("pingpong", "allreduce", "reduce_scatter", "allgather", "bcast")
IMPLS = ("mpi", "ring")  # the library's collectives and the hand-made ring
REP_SECONDS = {False: 0.02, True: 0.002}  # quick: a shorter repetition


def _operation(comm: Comm, kind: str, nbytes: int):
    """A no-argument call of one collective on a float32 buffer of about nbytes (at least one
    element per rank where the buffer is cut into shards), and the buffer's bytes."""
    n = comm.size
    elements = max(1, nbytes // 4)
    if kind in ("allgather", "reduce_scatter"):
        elements = -(-elements // n) * n  # a multiple of N, as FlatParam pads
    full, shard = np.ones(elements, np.float32), np.ones(elements // n, np.float32)
    calls = {
        "allreduce": lambda: comm.allreduce_mean(full),
        "reduce_scatter": lambda: comm.reduce_scatter_mean(full, shard),
        "allgather": lambda: comm.allgather(shard, full),
        "bcast": lambda: comm.bcast(full, 0),
        "pingpong": lambda: _pingpong(comm.mpi, full),
    }
    return calls[kind], full.nbytes


def _pingpong(world, buf: np.ndarray) -> None:
    """Rank 0 sends buf to rank 1, which sends it back; the other ranks do nothing."""
    rank = world.Get_rank()
    if rank == 0:
        world.Send(buf, 1)
        world.Recv(buf, 1)
    elif rank == 1:
        world.Recv(buf, 0)
        world.Send(buf, 0)


def _over_ranks(world, values, op: str) -> np.ndarray:
    """The elementwise "max" or "mean" of float values over ranks (a buffer Allreduce)."""
    from mpi4py import MPI

    out = np.array(values, dtype=np.float64)
    world.Allreduce(MPI.IN_PLACE, out, op=MPI.MAX if op == "max" else MPI.SUM)
    return out if op == "max" else out / world.Get_size()


def _seconds_per_call(world, call, rep_seconds: float) -> tuple[float, int, int]:
    """Median over repetitions of the slowest rank's seconds per call; (median, reps, calls).

    A collective is as slow as its slowest rank. Each repetition runs `calls` back-to-back
    calls, as many as fill rep_seconds, so the clock's resolution does not matter.
    """

    def slowest_run(calls: int) -> float:
        world.Barrier()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        return time.perf_counter() - start

    call()  # warm-up: first-touch pages, the ring's scratch buffers, MPI's connections
    probe = 1  # grow a probe of back-to-back calls to a millisecond, to size the repetitions
    while (elapsed := _over_ranks(world, [slowest_run(probe)], "max")[0]) < 1e-3 and probe < 512:
        probe *= 8
    once = elapsed / probe
    calls = int(min(10_000, max(1, rep_seconds / once)))
    reps = 7 if once < 0.05 else 3  # fewer repetitions of the big, slow calls
    times = [slowest_run(calls) / calls for _ in range(reps)]
    return float(np.median(_over_ranks(world, times, "max"))), reps, calls


def time_collectives(
    comm: Comm, sizes: list[int] = SIZES, quick: bool = False
) -> list[dict] | None:
    """Run on every rank of comm's MPI world; rank 0 gets the measured points, others None.

    A point: impl ("mpi", "ring", or "p2p" for the ping-pong), kind, ranks, buffer_bytes, the
    messages and sent_bytes per call (means over ranks) and seconds per call. `comm`'s own
    traffic is untouched: every point runs on a fresh Comm.
    """
    world, n = comm.mpi, comm.size
    if world is None or n < 2:
        raise ValueError("commbench needs an MPI world of 2 ranks or more (mpiexec -n 2 ...)")
    series = [("p2p", "pingpong")] + [(impl, kind) for impl in IMPLS for kind in KINDS[1:]]
    points = []
    for impl, kind in series:
        timed = set()  # buffer sizes already timed: padding to N elements can repeat one
        for nbytes in sizes:
            bench = Comm(world, collectives="mpi" if impl == "p2p" else impl)
            call, buffer_bytes = _operation(bench, kind, nbytes)
            if buffer_bytes in timed:
                continue
            timed.add(buffer_bytes)
            seconds, reps, calls = _seconds_per_call(world, call, REP_SECONDS[quick])
            if kind == "pingpong":  # one way: one message of the buffer in half a round trip
                seconds, messages, sent = seconds / 2, 1.0, float(buffer_bytes)
            else:
                t = bench.traffic[kind]
                per_call = [t.messages / t.calls, t.sent_bytes / t.calls]
                messages, sent = _over_ranks(world, per_call, "mean")
            point = dict(impl=impl, kind=kind, ranks=n, buffer_bytes=buffer_bytes)
            point |= dict(messages=float(messages), sent_bytes=float(sent), seconds=seconds)
            points.append(point | dict(reps=reps, calls_per_rep=calls))
    return points if comm.rank == 0 else None


def _nonnegative_lstsq(A: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin |A c - y| over c >= 0, for two columns: if the free solution has a negative
    coefficient, the best one-column fit (the other at 0) is the constrained optimum."""
    coef = np.linalg.lstsq(A, y, rcond=None)[0]
    if (coef >= 0).all():
        return coef
    candidates = []
    for keep in range(A.shape[1]):
        c = np.zeros(A.shape[1])
        c[keep] = max(0.0, np.linalg.lstsq(A[:, [keep]], y, rcond=None)[0][0])
        candidates.append(c)
    return min(candidates, key=lambda c: np.linalg.norm(A @ c - y))


def fit_line(messages, sent_bytes, seconds) -> dict:
    """Least squares of log t against log(alpha * messages + beta * bytes), alpha, beta >= 0.

    On log t every decade of buffer size weighs the same, as on the log-log plot (a plain fit
    of t would see only the largest buffers), and a point ten times off counts as much whether
    too slow or too fast. Solved by Gauss-Newton from the fit of relative residuals;
    r2 is the R^2 of log t.
    """
    X = np.column_stack([messages, sent_bytes]).astype(float)
    log_t = np.log(np.asarray(seconds, dtype=float))

    def misfit(coef: np.ndarray) -> float:
        return float(((np.log(np.maximum(X @ coef, 1e-300)) - log_t) ** 2).sum())

    coef = _nonnegative_lstsq(X * np.exp(-log_t)[:, None], np.ones_like(log_t))
    for _ in range(50):  # Gauss-Newton: log(X c) ~ log(p) + X (c - coef) / p, with p = X coef
        p = X @ coef
        trial = _nonnegative_lstsq(X / p[:, None], log_t - np.log(p) + 1)
        for _ in range(30):  # halve the step while it makes the misfit worse
            if misfit(trial) <= misfit(coef):
                break
            trial = (trial + coef) / 2
        if misfit(coef) - misfit(trial) <= 1e-12:
            break
        coef = trial
    r2 = 1 - misfit(coef) / ((log_t - log_t.mean()) ** 2).sum()
    alpha, beta = (float(c) for c in coef)
    return {
        "alpha_s": alpha,
        "beta_s_per_byte": beta,
        "alpha_us": alpha * 1e6,
        "gb_per_s": 1 / beta / 1e9 if beta > 0 else float("inf"),
        "crossover_bytes": alpha / beta if beta > 0 else float("inf"),
        "r2": float(r2),
        "points": len(log_t),
    }


def fit(points: list[dict]) -> dict[int, dict[str, dict[str, dict]]]:
    """fit_line per rank count, impl and kind: fits[N][impl][kind]."""
    groups: dict[tuple, list[dict]] = {}
    for p in points:
        groups.setdefault((p["ranks"], p["impl"], p["kind"]), []).append(p)
    fits: dict = {}
    for (n, impl, kind), group in sorted(groups.items()):
        columns = ([p[key] for p in group] for key in ("messages", "sent_bytes", "seconds"))
        fits.setdefault(n, {}).setdefault(impl, {})[kind] = fit_line(*columns)
    return fits


def predict_seconds(traffic_report: dict[str, dict], fit: dict[str, dict]) -> dict[str, float]:
    """Predicted seconds inside each collective kind of a run, from its messages and bytes.

    traffic_report: Comm.traffic_report() (or History.traffic) of one rank; fit: fits[N][impl]
    for that run's N and collectives. Compare with the report's measured "seconds".
    """
    return {
        kind: line_seconds(fit[kind], t["messages"], t["sent_bytes"])
        for kind, t in traffic_report.items()
        if kind in fit
    }


def line_seconds(line: dict, messages: float, sent_bytes: float) -> float:
    """One fitted line's prediction: alpha * messages + beta * bytes, in seconds."""
    return line["alpha_s"] * messages + line["beta_s_per_byte"] * sent_bytes


# A full TCP segment on a 1500-byte MTU: 1448 B of payload (20 B IP, 32 B TCP with timestamps)
# in a 1514 B frame with the 14 B Ethernet header, all of which a tbf on a veth counts.
TCP_PAYLOAD, FRAME = 1448, 1514


def tcp_payload_rate(bits_per_second: float) -> float:
    """Bytes of payload per second that a link shaped to bits_per_second carries in full TCP
    segments: what a fitted 1/beta (bytes the ranks send) can reach on it, 95.6 % of rate/8."""
    return bits_per_second / 8 * TCP_PAYLOAD / FRAME


def table(fits: dict) -> str:
    """One line per N, impl and kind: alpha, 1/beta, the crossover alpha/beta and R^2."""
    header = ("N", "impl", "kind", "alpha us", "1/beta GB/s", "alpha/beta", "R^2")
    lines = ["{:>2} {:4} {:14} {:>9} {:>11} {:>10} {:>6}".format(*header)]
    for n, impls in fits.items():
        for impl, kinds in impls.items():
            for kind, f in kinds.items():
                lines.append(
                    f"{n:>2} {impl:4} {kind:14} {f['alpha_us']:>9.2f} {f['gb_per_s']:>11.3g} "
                    f"{_human_bytes(f['crossover_bytes']):>10} {f['r2']:>6.3f}"
                )
    return "\n".join(lines)


def _human_bytes(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return ""


def sizes_between(min_bytes: int, max_bytes: int, quick: bool = False) -> list[int]:
    """The buffer sizes timed: those of SIZES (QUICK_SIZES if quick) from min to max_bytes."""
    return [s for s in (QUICK_SIZES if quick else SIZES) if min_bytes <= s <= max_bytes]


class Terminated(Exception):
    """This process got SIGINT, SIGTERM or SIGHUP while a job ran (args[0]: the signal's
    number): the job is ended, then this raised."""


def run_job(command: list[str], timeout: float, cwd: Path) -> subprocess.CompletedProcess:
    """subprocess.run(command) for a launcher, in a process group of its own that is ended
    whole (mpiexec, its proxy and the ranks) when this process gets Ctrl-C, SIGTERM or SIGHUP,
    or the timeout passes: a plain run leaves them running once its Python is gone."""
    job = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        start_new_session=True,  # its own group, which killpg reaches whole
    )

    def terminated(signum, frame):
        raise Terminated(signum)

    previous, wakeup = {}, -1
    if threading.current_thread() is threading.main_thread():  # where handlers can be set
        ending = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        previous = {sig: signal.signal(sig, terminated) for sig in ending}
        # `python -m fsdp_lesson` ends a training rank at once on a signal (launch.py), which
        # here would leave the job behind: this process ends it first, then itself
        wakeup = signal.set_wakeup_fd(-1)
    try:
        out, err = job.communicate(timeout=timeout)
    except BaseException:
        end_group(job)
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if previous:
            signal.set_wakeup_fd(wakeup)
    return subprocess.CompletedProcess(command, job.returncode, out, err)


def end_group(job: subprocess.Popen) -> None:
    """End a job's process group: SIGTERM (mpiexec passes it on to the ranks), then SIGKILL to
    whatever of the group is left after 5 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(job.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        job.wait(timeout=5)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(job.pid, signal.SIGKILL)
    job.wait()


def run(
    ranks: list[int],
    quick: bool = False,
    timeout: float = 900,
    mpiexec: Path | None = None,
    min_bytes: int = SIZES[0],
    max_bytes: int = SIZES[-1],
) -> list[dict]:
    """One `mpiexec -n N python -m fsdp_lesson.commbench --worker` per N; every point.

    mpiexec: the launcher (default: the one beside this Python), e.g. build/hosts/mpiexec.
    """
    launcher = str(mpiexec or Path(sys.executable).parent / "mpiexec")
    points = []
    for n in ranks:
        start, load_before = time.perf_counter(), os.getloadavg()[0]
        command = [launcher, "-n", str(n), sys.executable, "-m", "fsdp_lesson.commbench"]
        out = run_job(
            command
            + ["--worker", "--min-bytes", str(min_bytes), "--max-bytes", str(max_bytes)]
            + (["--quick"] if quick else []),
            timeout=timeout,
            cwd=Path(__file__).resolve().parent.parent,  # where the ranks import fsdp_lesson
        )
        if out.returncode != 0:
            raise RuntimeError(f"{launcher} -n {n} failed:\n{out.stderr[-2000:]}")
        points += json.loads(out.stdout)
        print(
            f"N={n}: timed in {time.perf_counter() - start:.0f} s; load average "
            f"{load_before:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores "
            "(other work on the machine slows the small messages most)",
            file=sys.stderr,
        )
    return points


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fsdp_lesson commbench", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="default: 2 4")
    parser.add_argument("--quick", action="store_true", help="sizes up to 16 KiB, short reps")
    parser.add_argument("--min-bytes", type=int, default=SIZES[0], help="smallest buffer (4)")
    parser.add_argument(
        "--max-bytes", type=int, default=SIZES[-1], help="largest buffer (default: 64 MiB)"
    )
    parser.add_argument(
        "--mpiexec", type=Path, help="launcher, e.g. build/hosts/mpiexec (default: the venv's)"
    )
    parser.add_argument("--out", type=Path, help="write the points and fits to this JSON file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        sizes = sizes_between(args.min_bytes, args.max_bytes, args.quick)
        points = time_collectives(Comm.world(), sizes, args.quick)
        if points is not None:
            print(json.dumps(points))
        return 0
    if min(args.ranks) < 2:
        parser.error("--ranks: every rank count must be 2 or more")
    if len(sizes_between(args.min_bytes, args.max_bytes, args.quick)) < 2:
        parser.error("--min-bytes/--max-bytes: the range must hold two sizes of 4**k B or more")
    try:
        points = run(args.ranks, args.quick, 900, args.mpiexec, args.min_bytes, args.max_bytes)
    except (Terminated, KeyboardInterrupt) as err:
        signum = err.args[0] if isinstance(err, Terminated) else signal.SIGINT
        name = signal.Signals(signum).name
        print(f"commbench: stopped by {name}; its mpiexec and ranks are ended", file=sys.stderr)
        return 128 + signum
    fits = fit(points)
    print(table(fits))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"points": points, "fits": fits}, indent=1))
        print(f"wrote {len(points)} points to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
