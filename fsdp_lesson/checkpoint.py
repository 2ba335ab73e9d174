"""Sharded checkpoints: every rank writes its own shards; rank 0 a manifest; any N can load.

    ckpt/manifest.json            config, strategy, N, layer layouts, step, RNG, sha256 of files
    ckpt/manifest.sha256          the manifest's own sha256: an edited manifest is refused
    ckpt/rank00000-of-00004.npz   rank 0's shard of every layer: params, Adam's m and v
    ckpt/losses.npy               the global loss of every step so far (a resumed run's history)

Whatever the strategy, a rank saves the slice [r*S, (r+1)*S) of every state array's padded
flat vector (FlatParam with N shards), so a checkpoint looks the same whether dp or zero3
wrote it. Loading at another N or into another strategy ("resharding") rebuilds each whole
vector from the saved slices and hands it to the strategy's load_state, which keeps what the
sharding table says it keeps.

A save never removes a good checkpoint before the next one is complete: it writes
`ckpt.partial`, moves `ckpt` to `ckpt.old`, moves `ckpt.partial` to `ckpt`, then deletes
`ckpt.old`. A crash between any two of these leaves one complete checkpoint among the three,
and `find_checkpoint` picks the newest complete one.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import numpy as np

from .comm import Comm, raise_on_every_rank
from .data import DataError, sha256_of
from .flat import FlatParam
from .rng import Rng
from .sharding import STRATEGIES
from .strategies import STRATEGY_CLASSES, Strategy
from .strategies.zero3 import make_units

FORMAT = 4
# TrainConfig fields a resumed run may change; everything else must match the checkpoint.
# With reshard=True the global batch may change too (see check_compatible).
MAY_CHANGE = {"strategy", "steps", "log_every", "eval_batches", "samples", "memory_budget_mb"}
MAY_CHANGE |= set().union(*(s.options_a_resume_may_change for s in STRATEGY_CLASSES.values()))
MAY_CHANGE |= {"recompute"}  # recomputes the same bits
MAY_CHANGE |= {"timeout"}  # how long a collective may wait (--timeout): changes no number
# The manifest's keys and their types: anything else is a damaged or foreign manifest.
MANIFEST_TYPES = {
    "format": int,
    "strategy": str,
    "world_size": int,
    "step": int,
    "model_config": dict,
    "train_config": dict,
    "optimizer_steps": int,
    "loss_scaler": dict,  # fp16's LossScaler: {"scale", "good_steps"}; {} without one
    "layers": dict,
    "rng": dict,
    "files": dict,
}
SUFFIXES = ("", ".partial", ".old")  # where a checkpoint may be found after a crash
MANIFEST_MAX_BYTES = 2**24  # a manifest takes kilobytes (its rank files' names and digests)
MAX_WORLD_SIZE = 2**20  # ranks a checkpoint may name: far beyond any run of this lesson


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved or loaded here; the message says why and what to do."""


def rank_file(rank: int, world_size: int) -> str:
    return f"rank{rank:05d}-of-{world_size:05d}.npz"


def owned_shards(strategy: Strategy) -> dict[str, np.ndarray]:
    """This rank's slice [r*S, (r+1)*S) of every state array's padded flat vector.

    A sharded array is that slice already; of a whole one, this rank saves its slice.
    """
    rank, arrays = strategy.comm.rank, {}
    for key, entry in strategy.local_state().items():
        flat = strategy.layout[entry.layer]
        whole = not entry.sharded
        arrays[key] = flat.owned_shard(flat.padded(entry.array), rank) if whole else entry.array
    return arrays


def write_durably(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Create the file at path with write(f), and return only once it is on the disk (fsync):
    a crash after a rename that follows cannot leave it empty or short."""
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _write_bytes(path: Path, data: bytes) -> None:
    write_durably(path, lambda f: f.write(data))


def _fsync_directory(directory: Path) -> None:
    """Make a directory's renames durable; a filesystem that cannot fsync a directory (some
    network ones) is left to do its best."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_atomically(files: dict[Path, Callable[[BinaryIO], object]]) -> None:
    """Replace every file of `files` (path -> write(f)) as checkpoints are written: each to a
    temporary name beside it, fsync'ed; only once all are complete are they renamed into
    place. A failure (a full disk) removes the temporaries and leaves the files that were
    there, never a torn one; the OSError raised names the file (err.filename)."""
    temporaries: dict[Path, Path] = {}
    try:
        for path, write in files.items():
            temporaries[path] = path.with_name(f".{path.name}.{os.getpid()}.partial")
            try:
                write_durably(temporaries[path], write)
            except OSError as err:
                err.filename = str(path)
                raise
    except BaseException:
        for temporary in temporaries.values():
            with contextlib.suppress(OSError):
                temporary.unlink()
        raise
    for path, temporary in temporaries.items():
        os.replace(temporary, path)
    for directory in {path.parent for path in files}:
        _fsync_directory(directory)


def write_failure(err: OSError, flag: str = "--out") -> str:
    """One line for a failed write: 'no space left on device writing DIR/params.npz: free
    space or choose another --out'."""
    reason = err.strerror or type(err).__name__
    reason = reason[:1].lower() + reason[1:]
    full = err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
    fix = f"free space or choose another {flag}" if full else f"choose another {flag}"
    return f"{reason} writing {err.filename}: {fix}"


def save_checkpoint(
    directory: str | os.PathLike,
    strategy: Strategy,
    step: int,
    rng: Rng,
    model_config: dict,
    train_config: dict,
    losses: np.ndarray,
) -> None:
    """Every rank writes its shards; rank 0 the manifest; then the directory is moved into place.

    A collective: every rank must call it. `step` is the number of steps done, `losses` the
    global loss of each of them. If any rank cannot write (a full disk, a file where the
    directory should be), every rank raises the same CheckpointError.
    """
    comm, final = strategy.comm, Path(directory)
    partial = final.with_name(final.name + ".partial")

    def prepare() -> None:
        if comm.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)

    def write_shard() -> tuple[str, str]:
        path = partial / rank_file(comm.rank, comm.size)
        write_durably(path, lambda f: np.savez(f, **owned_shards(strategy)))
        return path.name, sha256_of(path)

    _agree_on_io(comm, prepare, final)
    digests = comm.allgather_objects(_agree_on_io(comm, write_shard, final))

    def write_manifest() -> None:
        if comm.rank != 0:
            return
        losses_so_far = np.asarray(losses[:step], dtype=np.float64)
        write_durably(partial / "losses.npy", lambda f: np.save(f, losses_so_far))
        files = dict(digests) | {"losses.npy": sha256_of(partial / "losses.npy")}
        manifest = manifest_of(strategy, step, rng, model_config, train_config, files)
        text = json.dumps(manifest, indent=1).encode()
        _write_bytes(partial / "manifest.json", text)
        _write_bytes(partial / "manifest.sha256", hashlib.sha256(text).hexdigest().encode())
        _fsync_directory(partial)  # its files' names, before it becomes the checkpoint
        _move_into_place(partial, final)

    _agree_on_io(comm, write_manifest, final)


def manifest_of(
    strategy: Strategy, step: int, rng: Rng, model_config: dict, train_config: dict, files: dict
) -> dict:
    """What a checkpoint's manifest.json says (MANIFEST_TYPES lists its keys)."""
    return {
        "format": FORMAT,
        "strategy": strategy.name,
        "world_size": strategy.comm.size,
        "step": step,
        "model_config": model_config,
        "train_config": train_config,
        "optimizer_steps": strategy.optimizer.t,
        "loss_scaler": scaler_state(strategy),
        "layers": {
            layer.name: {k: list(v) for k, v in layer.shapes.items()}
            for layer in strategy.model.layers
        },
        "rng": rng.get_state(),
        "files": files,
    }


def _move_into_place(partial: Path, final: Path) -> None:
    """partial becomes final; an earlier final is kept as final.old until then, so a crash at
    any moment leaves a whole checkpoint (final, or final.old) behind."""
    old = final.with_name(final.name + ".old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(partial, final)
    _fsync_directory(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def _agree_on_io(comm: Comm, work, where: Path):
    """Run file work on every rank; an OSError on any rank is a CheckpointError on all."""

    def attempt():
        try:
            return work()
        except (OSError, DataError) as err:  # DataError: sha256_of could not read a file back
            reason = getattr(err, "strerror", None) or err
            raise CheckpointError(
                f"rank {comm.rank} could not write the checkpoint {where} ({reason}): free some "
                f"space, or save elsewhere (--out); is another run writing there too?"
            ) from None

    return raise_on_every_rank(comm, attempt, (CheckpointError,))


def find_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint at `directory`, or left beside it by an interrupted save."""
    best = None
    for suffix in SUFFIXES:
        candidate = Path(str(directory) + suffix)
        try:
            step = read_manifest(candidate)["step"]
        except CheckpointError:
            continue
        if best is None or step > best[0]:
            best = (step, candidate)
    return None if best is None else best[1]


def read_manifest(directory: str | os.PathLike) -> dict:
    """The manifest, after checking its own checksum, its keys and types, and every file's."""
    directory = Path(directory)
    path, checksum = directory / "manifest.json", directory / "manifest.sha256"
    if not path.is_file():
        raise CheckpointError(f"{directory}: no manifest.json, so not a (complete) checkpoint")
    if path.stat().st_size > MANIFEST_MAX_BYTES:
        raise CheckpointError(
            f"{path} is {path.stat().st_size:,} bytes, not a manifest (they take kilobytes): "
            f"this checkpoint cannot be trusted; resume from another one or start afresh"
        )
    text = path.read_bytes()
    if not checksum.is_file() or checksum.read_bytes()[:100].strip() != (
        hashlib.sha256(text).hexdigest().encode()
    ):
        raise CheckpointError(
            f"{path} does not match manifest.sha256 (edited or damaged): this checkpoint "
            f"cannot be trusted; resume from another one or start afresh"
        )
    try:
        manifest = json.loads(text)
    except (ValueError, RecursionError) as err:  # not JSON, not UTF-8, nested too deep
        reason = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
        raise CheckpointError(
            f"{path} is corrupted ({reason}); save the checkpoint again"
        ) from None
    _validate(manifest, path)
    for name, digest in manifest["files"].items():
        if not (directory / name).is_file() or sha256_of(directory / name) != digest:
            raise CheckpointError(
                f"{directory / name} is missing or corrupted (sha256 differs from the manifest); "
                f"this checkpoint cannot be loaded: resume from another one or start afresh"
            )
    return manifest


def scaler_state(strategy: Strategy) -> dict:
    """fp16's loss scale and its run of good steps; {} for a run without loss scaling."""
    scaler = strategy.precision.scaler
    if scaler is None:
        return {}
    return {"scale": float(scaler.scale), "good_steps": scaler.good_steps}


def _validate(manifest, path: Path) -> None:
    """Refuse a manifest whose shape is not what save_checkpoint writes."""

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: {what}; this is not a checkpoint this version can load")

    if not isinstance(manifest, dict):
        raise bad(f"the manifest is a {type(manifest).__name__}, not an object")
    for key, kind in MANIFEST_TYPES.items():
        if key not in manifest:
            raise bad(f"the manifest has no {key!r}")
        if not isinstance(manifest[key], kind) or isinstance(manifest[key], bool) != (kind is bool):
            raise bad(f"{key!r} is {manifest[key]!r}, not a {kind.__name__}")
    if manifest["format"] != FORMAT:
        raise bad(f"format {manifest['format']}, this version reads format {FORMAT}")
    n, step = manifest["world_size"], manifest["step"]
    if n < 1 or step < 0 or manifest["optimizer_steps"] < 0:
        raise bad(f"world_size {n}, step {step}: out of range")
    if n > MAX_WORLD_SIZE or len(manifest["files"]) != n + 1:  # before anything is built from n
        present = sum(1 for p in path.parent.glob("rank*-of-*.npz"))
        raise bad(
            f"world_size {n}, but it lists {len(manifest['files']) - 1} shard files and the "
            f"directory holds {present}: its files are not the {n} ranks' shards"
        )
    if manifest["optimizer_steps"] > step:  # one optimizer step per step at most
        raise bad(f"'optimizer_steps' {manifest['optimizer_steps']} is more than its {step} steps")
    if manifest["strategy"] not in STRATEGIES:
        raise bad(f"'strategy' {manifest['strategy']!r} is none of {', '.join(STRATEGIES)}")
    units = manifest["train_config"].get("layers_per_unit", 1)
    if not isinstance(units, int) or isinstance(units, bool) or units < 1:
        raise bad(f"'layers_per_unit' is {units!r}, not a positive integer")
    scaler = manifest["loss_scaler"]
    if scaler and not (
        isinstance(scaler.get("scale"), float)
        and 0 < scaler["scale"] < float("inf")
        and isinstance(scaler.get("good_steps"), int)
        and scaler["good_steps"] >= 0
    ):
        raise bad(f"'loss_scaler' is {scaler!r}, not a positive scale and a step count")
    expected = {rank_file(r, n) for r in range(n)} | {"losses.npy"}
    if set(manifest["files"]) != expected:
        raise bad(f"its files {sorted(manifest['files'])} are not the {n} ranks' shards")


def check_compatible(
    manifest: dict, strategy: Strategy, model_config: dict, train_config: dict, reshard: bool
) -> None:
    """Refuse a checkpoint of another model or run, or of another layout without reshard=True."""
    layers = {
        layer.name: {k: list(v) for k, v in layer.shapes.items()} for layer in strategy.model.layers
    }
    if manifest["model_config"] != model_config or manifest["layers"] != layers:
        raise CheckpointError(
            f"the checkpoint is of another model ({manifest['model_config']}), not "
            f"{model_config}: resume with the flags it was saved with"
        )
    # the units are a layout, as the strategy and N are: they are compared below
    may_change = MAY_CHANGE | {"layers_per_unit"} | ({"batch"} if reshard else set())
    differ = {
        k
        for k, v in train_config.items()
        if k not in may_change and manifest["train_config"].get(k) != v
    }
    if differ:
        saved = {k: manifest["train_config"].get(k) for k in sorted(differ)}
        hint = " (with --reshard the global batch may change)" if "batch" in differ else ""
        raise CheckpointError(
            f"the checkpoint was saved with {saved}: resume with the same settings{hint}"
        )
    saved_units = manifest["train_config"].get("layers_per_unit", 1)
    units = train_config.get("layers_per_unit", 1)
    same_layout = (manifest["strategy"], manifest["world_size"], saved_units) == (
        strategy.name,
        strategy.comm.size,
        units,
    )
    if not same_layout and not reshard:

        def with_units(k: int) -> str:
            return "" if k == 1 else f" with --layers-per-unit {k}"

        raise CheckpointError(
            f"the checkpoint was saved by {manifest['strategy']}{with_units(saved_units)} on "
            f"{manifest['world_size']} ranks, this run is {strategy.name}{with_units(units)} on "
            f"{strategy.comm.size}: pass --reshard to convert it"
        )
    if manifest["step"] > train_config["steps"]:  # equal is fine: evaluate and sample
        raise CheckpointError(
            f"the checkpoint is at step {manifest['step']}, past this run's last step "
            f"{train_config['steps']}: ask for more steps (--steps) to train on from it"
        )


def saved_layout(manifest: dict, model) -> dict[str, tuple[tuple[str, ...], FlatParam]]:
    """How a checkpoint lays out its state: each saved name (a layer, or a zero3 unit of
    --layers-per-unit K layers) -> (its layers, its FlatParam over the saved N ranks)."""
    n, k = manifest["world_size"], manifest["train_config"].get("layers_per_unit", 1)
    if "layers_per_unit" in STRATEGY_CLASSES[manifest["strategy"]].options and k > 1:
        return {unit.name: (unit.layers, unit.flat) for unit in make_units(model.layers, k, n)}
    return {layer.name: ((layer.name,), FlatParam(layer.shapes, n)) for layer in model.layers}


def read_shard(path: Path, saved: dict, needed: set[str]) -> dict[str, np.ndarray]:
    """One rank's file: every saved name's `needed` states ("fc1.m"), each checked to be the
    float32 slice that layout says, before anything is built from it."""

    def damaged(what: str) -> CheckpointError:
        return CheckpointError(
            f"{path} is a damaged checkpoint ({what}): resume from another one or start afresh"
        )

    arrays = {}
    try:
        with np.load(path) as f:  # allow_pickle=False: an object array is refused, not run
            missing = sorted(
                f"{name}.{what}" for name in saved for what in needed if f"{name}.{what}" not in f
            )
            if missing:
                raise CheckpointError(
                    f"{path.parent}: the shards lack {missing}: resume with the same optimizer"
                )
            for name, (_, flat) in saved.items():
                for what in needed:
                    key = f"{name}.{what}"
                    array = f[key]
                    if array.dtype != np.float32 or array.shape != (flat.shard_size,):
                        raise damaged(
                            f"{key} is {array.dtype} of shape {array.shape}, not float32 of "
                            f"shape ({flat.shard_size},)"
                        )
                    arrays[key] = array
    except CheckpointError:
        raise
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as err:
        reason = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
        raise damaged(f"it cannot be read: {reason}") from None
    return arrays


def to_layers(shards: list[dict], saved: dict, needed: set[str]) -> dict[str, np.ndarray]:
    """Every layer's whole (unpadded) vector of every state ("fc1.m"), from the slices of any
    N ranks. A unit's vector is its layers' vectors one after another (units.py), so a
    checkpoint of zero3 units converts to layers by cutting it."""
    vectors = {}
    for name, (layers, flat) in saved.items():
        sizes = _layer_sizes(flat, layers)
        for what in needed:
            whole = np.concatenate([shard[f"{name}.{what}"] for shard in shards])[: flat.numel]
            start = 0
            for layer in layers:
                vectors[f"{layer}.{what}"] = whole[start : start + sizes[layer]]
                start += sizes[layer]
    return vectors


def _layer_sizes(flat: FlatParam, layers: tuple[str, ...]) -> dict[str, int]:
    """Each layer's number of parameters in a flat layout: a layer's own ("W", "b") or a
    unit's ("fc1.W", "fc1.b", "fc2.W", ...)."""
    if len(layers) == 1:
        return {layers[0]: flat.numel}
    return {
        layer: sum(n for key, n in flat.sizes.items() if key.rsplit(".", 1)[0] == layer)
        for layer in layers
    }


def to_layout(vectors: dict[str, np.ndarray], strategy: Strategy) -> dict[str, np.ndarray]:
    """The whole vectors of strategy.local_state()'s keys: a layer's as it is; a zero3 unit's
    (--layers-per-unit K) its layers' vectors one after another."""
    groups = {unit.name: unit.layers for unit in getattr(strategy, "units", ())}
    out = {}
    for key in strategy.local_state():
        name, what = key.rsplit(".", 1)
        parts = [vectors[f"{layer}.{what}"] for layer in groups.get(name, (name,))]
        out[key] = parts[0] if len(parts) == 1 else np.concatenate(parts)
    return out


def read_losses(directory: Path, step: int) -> np.ndarray:
    """losses.npy: the float64 global loss of each of the checkpoint's `step` steps."""
    path = directory / "losses.npy"
    try:
        losses = np.load(path)  # allow_pickle=False
    except (ValueError, OSError, EOFError) as err:
        losses = err
    if not isinstance(losses, np.ndarray) or losses.dtype != np.float64 or losses.shape != (step,):
        what = losses if isinstance(losses, Exception) else f"{losses.dtype} {losses.shape}"
        raise CheckpointError(
            f"{path} is a damaged checkpoint ({what}, not the float64 loss of each of its "
            f"{step} steps): resume from another one or start afresh"
        )
    return losses


def _check_rng_state(state: dict, directory: Path) -> None:
    """The glibc stream's state (--c-compat) is 31 words and a position: anything else would
    fail only later, mid-run. (numpy's own state is checked by numpy when it is set.)"""
    if "glibc_ring" not in state:
        return
    ring, pos = state["glibc_ring"], state.get("glibc_pos")
    words = isinstance(ring, list) and len(ring) == 31
    if not (
        words
        and all(isinstance(w, int) and 0 <= w < 2**32 for w in ring)
        and isinstance(pos, int)
        and 0 <= pos < 31
    ):
        raise CheckpointError(
            f"{directory}: its RNG state cannot be restored (not 31 words and a position)"
        )


def load_checkpoint(
    directory: str | os.PathLike,
    strategy: Strategy,
    rng: Rng,
    model_config: dict,
    train_config: dict,
    reshard: bool = False,
) -> dict:
    """Load params, optimizer state and RNG into this run; return the manifest (and losses).

    Every rank reads every shard file and rebuilds each array's whole vector (so any N can
    load any N); the strategy keeps what it keeps.
    """
    found = find_checkpoint(directory)
    if found is None:
        read_manifest(directory)  # raises the reason the directory itself is no checkpoint
    manifest = read_manifest(found)
    check_compatible(manifest, strategy, model_config, train_config, reshard)
    saved = saved_layout(manifest, strategy.model)
    needed = {key.rsplit(".", 1)[1] for key in strategy.local_state()}  # params, m, v
    n = manifest["world_size"]
    shards = [read_shard(found / rank_file(r, n), saved, needed) for r in range(n)]
    vectors = to_layout(to_layers(shards, saved, needed), strategy)
    del shards  # the whole vectors are views of them, or copies
    manifest["losses"] = read_losses(found, manifest["step"])
    _check_rng_state(manifest["rng"], found)
    strategy.load_state(vectors, manifest["optimizer_steps"])
    scaler = strategy.precision.scaler
    if scaler is not None and manifest["loss_scaler"]:  # fp16: the scale goes on
        scaler.scale = manifest["loss_scaler"]["scale"]
        scaler.good_steps = manifest["loss_scaler"]["good_steps"]
    try:
        rng.set_state(manifest["rng"])
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{found}: its RNG state cannot be restored ({err})") from None
    manifest["path"] = str(found)
    return manifest
