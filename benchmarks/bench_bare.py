"""How fast can zero3 be in Python? dp and zero3 with nothing around their collectives.

    mpiexec -n 2 python benchmarks/bench_bare.py [--steps 1500] [--reps 3]

The same model, compute (model.py's layers), batch and MPI calls as the package's dp and zero3,
written bare: no ledger, trace, watchdog, hooks or requests, only numpy and mpi4py. Every rank
runs, interleaved, reps times each:

    bare dp              grads kept across steps; each layer's Iallreduce starts after its
                         backward, all waited for before the update (as the package's dp)
    bare zero3           each unit's full parameters gathered into a new buffer forward and
                         again backward (the next one prefetched), its full gradient in a new
                         buffer, reduce-scattered while the one before it computes
    bare zero3, reused   the same, each unit's buffers allocated once and reused (what a
                         caching allocator such as PyTorch's gives FSDP)
    dp, zero3            the package's (train.run)

and rank 0 prints the median ms/step of each and zero3's ratio to dp, bare and packaged. The
bare versions' losses are checked against each other first (they train the same model). A
figure to read, not a test; ratios measured in the same run are what carries across machines.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

from fsdp_lesson.comm import Comm
from fsdp_lesson.config import ModelConfig, TrainConfig
from fsdp_lesson.data import Dataset, rank_slice
from fsdp_lesson.flat import FlatParam
from fsdp_lesson.model import MLP
from fsdp_lesson.train import run

LR = 0.1
WORLD = MPI.COMM_WORLD


class Bare:
    """The model, this rank's batches and the shared parts of both bare strategies."""

    def __init__(self, batches: list[tuple[np.ndarray, np.ndarray]]) -> None:
        self.model = MLP(ModelConfig())
        self.layers = self.model.layers
        self.n = WORLD.size
        self.flats = {layer.name: FlatParam(layer.shapes, self.n) for layer in self.layers}
        rng = np.random.default_rng(0)  # the same initial parameters on every rank
        self.initial = {
            name: flat.padded(rng.normal(0, 0.1, flat.numel).astype(np.float32))
            for name, flat in self.flats.items()
        }
        self.batches, self.loss = batches, np.zeros(1)

    def mean_loss(self, loss: float) -> float:
        """The logged loss, averaged over ranks as every strategy's is."""
        self.loss[0] = loss
        WORLD.Allreduce(MPI.IN_PLACE, self.loss)
        return self.loss[0] / self.n

    def loss_and_gradient(self, logits: np.ndarray, y: np.ndarray):
        """This rank's loss, and the logits' gradient as a share of the global batch's mean."""
        loss, cache = self.model.loss.forward(logits, y)
        return loss, self.model.loss.backward(cache, rows=len(y) * self.n)


class BareDP(Bare):
    """Whole parameters and gradients on every rank; one allreduce per layer."""

    def __init__(self, batches) -> None:
        super().__init__(batches)
        self.params = {name: v.copy() for name, v in self.initial.items()}
        self.grads = {name: np.zeros_like(v) for name, v in self.params.items()}
        self.views = {name: self.flats[name].views(v) for name, v in self.params.items()}
        self.grad_views = {name: self.flats[name].views(v) for name, v in self.grads.items()}

    def step(self, x: np.ndarray, y: np.ndarray) -> float:
        caches = []
        for layer in self.layers:
            x, cache = layer.forward(self.views[layer.name], x)
            caches.append(cache)
        loss, dx = self.loss_and_gradient(x, y)
        started = []
        for layer, cache in zip(reversed(self.layers), reversed(caches), strict=True):
            dx = layer.backward(self.views[layer.name], cache, dx, self.grad_views[layer.name])
            if layer.shapes:  # the gradient sums over ranks (backward wrote sum / (B * N))
                started.append(WORLD.Iallreduce(MPI.IN_PLACE, self.grads[layer.name]))
        MPI.Request.Waitall(started)
        for name, params in self.params.items():
            params -= LR * self.grads[name]
        return self.mean_loss(loss)


class BareZeRO3(Bare):
    """Shards only; each layer (a unit) gathered forward and backward, its gradient
    reduce-scattered."""

    def __init__(self, batches, reuse: bool) -> None:
        super().__init__(batches)
        self.units = [layer for layer in self.layers if layer.shapes]  # one layer per unit
        self.shards = {
            name: flat.owned_shard(self.initial[name], WORLD.rank).copy()
            for name, flat in self.flats.items()
            if flat.numel
        }
        self.grad_shards = {name: np.zeros_like(s) for name, s in self.shards.items()}
        self.reuse = reuse
        self.kept: dict[tuple[str, str], np.ndarray] = {}  # reuse: (unit, "params"/"grad")

    def buffer(self, name: str, what: str) -> np.ndarray:
        """A unit's full buffer: new, or with reuse the same one every time."""
        if self.reuse and (name, what) in self.kept:
            return self.kept[name, what]
        full = np.empty(self.flats[name].padded_numel, np.float32)
        if self.reuse:
            self.kept[name, what] = full
        return full

    def start_gather(self, unit) -> tuple:
        full = self.buffer(unit.name, "params")
        return WORLD.Iallgather(self.shards[unit.name], full), full

    def gathered(self, order: list):
        """Each unit of `order` with its full parameters, gathered in turn (the next prefetched)."""
        in_flight = self.start_gather(order[0])
        for i, unit in enumerate(order):
            request, full = in_flight
            request.Wait()
            if i + 1 < len(order):
                in_flight = self.start_gather(order[i + 1])
            yield unit, self.flats[unit.name].views(full)

    def step(self, x: np.ndarray, y: np.ndarray) -> float:
        caches = {}
        for unit, params in self.gathered(self.units):
            for layer in self.layers_from(unit):
                x, caches[layer.name] = layer.forward(params if layer.shapes else {}, x)
        loss, dx = self.loss_and_gradient(x, y)
        reducing = []
        for unit, params in self.gathered(self.units[::-1]):
            flat, full = self.flats[unit.name], self.buffer(unit.name, "grad")
            full[flat.numel :] = 0  # backward writes all but the padding
            for layer in reversed(self.layers_from(unit)):
                p, g = (params, flat.views(full)) if layer.shapes else ({}, {})
                dx = layer.backward(p, caches[layer.name], dx, g)
            reducing.append(WORLD.Ireduce_scatter_block(full, self.grad_shards[unit.name]))
            if len(reducing) > 1:  # the one before it is waited for
                reducing.pop(0).Wait()
        MPI.Request.Waitall(reducing)
        for name, shard in self.shards.items():
            shard -= LR * self.grad_shards[name]
        return self.mean_loss(loss)

    def layers_from(self, unit) -> list:
        """The unit's layer and the parameterless layers after it, up to the next unit."""
        i = self.layers.index(unit)
        j = i + 1
        while j < len(self.layers) and not self.layers[j].shapes:
            j += 1
        return self.layers[i:j]


def batches_for_this_rank(count: int, batch: int) -> list[tuple[np.ndarray, np.ndarray]]:
    data, rng = Dataset.load(), np.random.default_rng(1)
    out = []
    for _ in range(count):
        rows = rng.integers(0, len(data.X_train), batch)
        X, Y = data.X_train[rows], data.Y_train[rows]
        out.append((rank_slice(X, WORLD.rank, WORLD.size), rank_slice(Y, WORLD.rank, WORLD.size)))
    return out


def bare_ms(strategy: Bare, steps: int) -> tuple[float, list[float]]:
    """Median ms/step past the warm-up, and the losses."""
    seconds, losses = [], []
    WORLD.Barrier()
    for step in range(steps):
        x, y = strategy.batches[step % len(strategy.batches)]
        start = time.perf_counter()
        losses.append(strategy.step(x, y))
        seconds.append(time.perf_counter() - start)
    return float(np.median(seconds[steps // 10 :]) * 1e3), losses


def package_ms(strategy: str, steps: int, data: Dataset) -> float:
    config = TrainConfig(strategy=strategy, steps=steps, eval_batches=0, samples=0)
    history, _ = run(ModelConfig(), config, comm=Comm.world(), data=data)
    return float(np.median(history.step_seconds[steps // 10 :]) * 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    batches = batches_for_this_rank(64, TrainConfig().batch)
    data = Dataset.load()
    # the bare versions train the same model: their losses agree before any is timed
    _, dp_losses = bare_ms(BareDP(batches), 50)
    for reuse in (False, True):
        _, zero3_losses = bare_ms(BareZeRO3(batches, reuse), 50)
        diff = np.abs(np.subtract(dp_losses, zero3_losses)).max()
        if diff > 1e-5:
            raise AssertionError(f"bare zero3 (reuse={reuse}) differs from bare dp by {diff:.1e}")
    runs = {
        "bare dp": lambda: bare_ms(BareDP(batches), args.steps)[0],
        "bare zero3": lambda: bare_ms(BareZeRO3(batches, reuse=False), args.steps)[0],
        "bare zero3, reused": lambda: bare_ms(BareZeRO3(batches, reuse=True), args.steps)[0],
        "dp": lambda: package_ms("dp", args.steps, data),
        "zero3": lambda: package_ms("zero3", args.steps, data),
    }
    ms = {name: [] for name in runs}
    for _ in range(args.reps):  # interleaved: the machine's load drifts
        for name, timed in runs.items():
            ms[name].append(timed())
    if WORLD.rank == 0:
        median = {name: float(np.median(v)) for name, v in ms.items()}
        runs_of = f"median of {args.reps} runs of {args.steps} steps"
        print(f"the seed's model, SGD, N = {WORLD.size}, {runs_of}")
        for name, value in median.items():
            print(f"{name:20s} {value:7.3f} ms/step")
        print(
            f"zero3 / dp: bare {median['bare zero3'] / median['bare dp']:.2f}x, bare with reused "
            f"buffers {median['bare zero3, reused'] / median['bare dp']:.2f}x, the package's "
            f"{median['zero3'] / median['dp']:.2f}x"
        )


if __name__ == "__main__":
    main()
