"""Sharded checkpoints: every rank writes its own shards; rank 0 a manifest; any mesh can load.

    ckpt/manifest.json            config, strategy, N, each layer's shapes and writers, step,
                                  RNG, sha256 of files
    ckpt/manifest.sha256          the manifest's own sha256: an edited manifest is refused
    ckpt/rank00000-of-00004.npz   rank 0's slice of each of its layers: params, Adam's m and v
    ckpt/losses.npy               the global loss of every step so far (a resumed run's history)

What is saved is each WHOLE layer, as single-rank training holds it: its state's flat vector
(FlatParam) cut into W slices, written by the W ranks that hold the layer. Without a mesh
these are all N ranks, and a rank's slice [r*S, (r+1)*S) is what zero3 keeps, or what dp cuts
from its whole vector, so a checkpoint looks the same whether dp or zero3 wrote it. On a mesh
(--tp T, --pp P) a layer's W = T x D ranks are those of its pipeline stage: its tensor-parallel
pieces are joined first (layer.whole), one layer at a time. Loading into another strategy, N
or mesh ("resharding") rebuilds each whole vector from the slices of the ranks that wrote it,
cuts this rank's piece (layer.piece) of this rank's stage's layers, and hands them to the
strategy's load_state, which keeps what the sharding table says it keeps.

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
from .model import MLP
from .rng import Rng
from .sharding import STRATEGIES
from .strategies import STRATEGY_CLASSES, Strategy
from .strategies.base import owner, where_held
from .watchdog import in_phase

FORMAT = 5  # 5: whole layers, each with the ranks that wrote it (4: a plain run's, still read)
# TrainConfig fields a resumed run may change; everything else must match the checkpoint.
# With reshard=True the global batch may change too (see check_compatible).
MAY_CHANGE = {"strategy", "steps", "log_every", "eval_batches", "samples", "memory_budget_mb"}
MAY_CHANGE |= set().union(*(s.options_a_resume_may_change for s in STRATEGY_CLASSES.values()))
MAY_CHANGE |= {"recompute"}  # recomputes the same bits
MAY_CHANGE |= {"timeout"}  # how long a collective may wait (--timeout): changes no number
MAY_CHANGE |= {"micro_batches", "schedule"}  # a pipeline's: the same rows, summed in turn
MAY_CHANGE |= {"sequence_parallel", "cp_layout"}  # where a sequence's activations lie, no state
# How a run lays out its state, as the strategy and N do: another needs --reshard.
LAYOUT = {"layers_per_unit": "--layers-per-unit", "tp": "--tp", "pp": "--pp", "cp": "--cp"}
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
    "layers": dict,  # name -> {"shapes": the whole layer's, "ranks": who wrote its slices}
    "rng": dict,
    "files": dict,
}
SUFFIXES = ("", ".partial", ".old")  # where a checkpoint may be found after a crash
MANIFEST_MAX_BYTES = 2**24  # a manifest takes kilobytes (its rank files' names and digests)
MAX_WORLD_SIZE = 2**20  # ranks a checkpoint may name: far beyond any run of this lesson
READ_ERRORS = (ValueError, OSError, EOFError, zipfile.BadZipFile)  # an unreadable file


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved or loaded here; the message says why and what to do."""


def rank_file(rank: int, world_size: int) -> str:
    return f"rank{rank:05d}-of-{world_size:05d}.npz"


def whole_model(strategy: Strategy) -> MLP:
    """The whole model whose layers the strategy trains (all of them, or a pipeline Stage's)."""
    return getattr(strategy.model, "model", strategy.model)


def layer_vector(strategy: Strategy, layer, what: str) -> np.ndarray:
    """A layer's whole vector of one state ("params", "m") as single-rank training lays it out:
    gathered over dp if sharded, cut from its zero3 unit, tp pieces joined (layer.whole)."""
    name, keys = where_held(strategy.layout, layer.name)  # zero3's unit: "fc1.W"
    if name is None:  # no parameters: an empty vector, as every rank finds
        return np.zeros(0, np.float32)
    entry, flat = strategy.local_state()[f"{name}.{what}"], strategy.layout[name]
    vector = entry.array
    if entry.sharded:  # an allgather over the ranks that shard it (HSDP: this rank's group)
        vector = strategy.shard_comm.allgather(vector, np.empty(flat.padded_numel, vector.dtype))
    views = flat.views(vector)
    piece = {param: views[key] for param, key in keys.items()}
    return FlatParam(layer.whole_shapes).flatten(layer.whole(piece))


def owned_shards(strategy: Strategy) -> dict[str, np.ndarray]:
    """This rank's slice [i*S, (i+1)*S) of each of its layers' whole state vectors, i its place
    among the W ranks that hold the layer (FlatParam with W shards; W = N without a mesh).

    Without --tp, zero3's units or --replicate a sharded array is that slice already; of a whole
    one, this rank saves its slice. Otherwise the layer is gathered first (a collective: every
    rank calls).
    """
    (stage_size, slot), local, arrays = strategy.mesh.stage_ranks(), strategy.local_state(), {}
    states = dict.fromkeys(key.rsplit(".", 1)[1] for key in local)  # params, m, v
    for layer in strategy.model.layers:
        flat = FlatParam(layer.whole_shapes, stage_size)
        for what in states:
            key = f"{layer.name}.{what}"
            entry = local.get(key)  # None: the layer is part of a zero3 unit
            if entry is not None and entry.sharded and stage_size == strategy.shard_comm.size:
                arrays[key] = entry.array
            else:
                vector = layer_vector(strategy, layer, what)
                arrays[key] = flat.owned_shard(flat.padded(vector), slot)
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


@in_phase("a checkpoint save")
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

    A collective: every rank of the mesh must call it. `step` is the number of steps done,
    `losses` the global loss of each of them. If any rank cannot write (a full disk, a file
    where the directory should be), every rank raises the same CheckpointError.
    """
    ranks, final = strategy.mesh.world, Path(directory)
    partial = final.with_name(final.name + ".partial")
    shards = owned_shards(strategy)  # collectives first: a rank that fails to write skips none

    def prepare() -> None:
        if ranks.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)

    def write_shard() -> tuple[str, str]:
        path = partial / rank_file(ranks.rank, ranks.size)
        write_durably(path, lambda f: np.savez(f, **shards))
        return path.name, sha256_of(path)

    _agree_on_io(ranks, prepare, final)
    mine = [layer.name for layer in strategy.model.layers]
    written = ranks.allgather_objects((*_agree_on_io(ranks, write_shard, final), mine))

    def write_manifest() -> None:
        if ranks.rank != 0:
            return
        losses_so_far = np.asarray(losses[:step], dtype=np.float64)
        write_durably(partial / "losses.npy", lambda f: np.save(f, losses_so_far))
        files = {name: digest for name, digest, _ in written}
        files["losses.npy"] = sha256_of(partial / "losses.npy")
        manifest = manifest_of(strategy, step, rng, model_config, train_config, files, written)
        text = json.dumps(manifest, indent=1).encode()
        _write_bytes(partial / "manifest.json", text)
        _write_bytes(partial / "manifest.sha256", hashlib.sha256(text).hexdigest().encode())
        _fsync_directory(partial)  # its files' names, before it becomes the checkpoint
        _move_into_place(partial, final)

    _agree_on_io(ranks, write_manifest, final)


def manifest_of(
    strategy: Strategy,
    step: int,
    rng: Rng,
    model_config: dict,
    train_config: dict,
    files: dict,
    written: list[tuple[str, str, list[str]]],
) -> dict:
    """What a checkpoint's manifest.json says (MANIFEST_TYPES lists its keys); `written`: each
    world rank's (file, sha256, the layers it wrote a slice of), in rank order."""
    layers = {
        layer.name: {"shapes": {k: list(v) for k, v in layer.whole_shapes.items()}, "ranks": []}
        for layer in whole_model(strategy).layers
    }
    for rank, (_, _, names) in enumerate(written):
        for name in names:
            layers[name]["ranks"].append(rank)
    return {
        "format": FORMAT,
        "strategy": strategy.name,
        "world_size": len(written),
        "step": step,
        "model_config": model_config,
        "train_config": train_config,
        "optimizer_steps": strategy.optimizer.t,
        "loss_scaler": scaler_state(strategy),
        "layers": layers,
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
    if manifest["format"] not in (4, FORMAT):
        raise bad(f"format {manifest['format']}, this version reads formats 4 and {FORMAT}")
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
    _check_layout(manifest, bad)
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
    _check_layers(manifest, bad)


def _check_layout(manifest: dict, bad: Callable[[str], CheckpointError]) -> None:
    """The layout options the manifest says it was saved with (LAYOUT: units, --tp, --pp) are
    positive integers, and --tp x --pp ranks divide its world_size, as any run's must."""
    sizes = {key: manifest["train_config"].get(key, 1) for key in LAYOUT}
    for key, size in sizes.items():
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise bad(f"{key!r} is {repr(size)[:40]}, not a positive integer")
    if manifest["world_size"] % (sizes["tp"] * sizes["pp"]):
        raise bad(
            f"'tp' {sizes['tp']} x 'pp' {sizes['pp']} does not divide its world_size "
            f"{manifest['world_size']}"
        )


def _check_layers(manifest: dict, bad: Callable[[str], CheckpointError]) -> None:
    """Each layer's entry is its whole shapes and the distinct ranks that wrote its slices. A
    format-4 manifest (before meshes) lists each layer's shapes: all N ranks wrote every layer,
    unless zero3 saved units of several layers (--layers-per-unit), which this version refuses."""
    n, units = manifest["world_size"], manifest["train_config"].get("layers_per_unit", 1)
    if manifest["format"] == 4:
        if "layers_per_unit" in STRATEGY_CLASSES[manifest["strategy"]].options and units > 1:
            raise bad(
                f"format 4 with --layers-per-unit {units} saves units, not layers: resume it "
                f"with the version that saved it, or start afresh"
            )
        manifest["layers"] = {
            name: {"shapes": shapes, "ranks": list(range(n))}
            for name, shapes in manifest["layers"].items()
        }
    for name, entry in manifest["layers"].items():
        ranks = entry.get("ranks") if isinstance(entry, dict) else None
        if not (
            isinstance(ranks, list)
            and isinstance(entry.get("shapes"), dict)
            and ranks
            and all(type(r) is int and 0 <= r < n for r in ranks)
            and len(set(ranks)) == len(ranks)
        ):
            what = repr(entry)[:200]
            raise bad(f"layer {name!r} is {what}, not its shapes and the ranks that wrote it")


def check_compatible(
    manifest: dict, strategy: Strategy, model_config: dict, train_config: dict, reshard: bool
) -> None:
    """Refuse a checkpoint of another model or run, or of another layout without reshard=True."""
    layers = {
        layer.name: {k: list(v) for k, v in layer.whole_shapes.items()}
        for layer in whole_model(strategy).layers
    }
    saved_layers = {name: entry["shapes"] for name, entry in manifest["layers"].items()}
    if manifest["model_config"] != model_config or saved_layers != layers:
        raise CheckpointError(
            f"the checkpoint is of another model ({manifest['model_config']}), not "
            f"{model_config}: resume with the flags it was saved with"
        )
    # the layout's options are compared below, as the strategy and N are
    may_change = MAY_CHANGE | set(LAYOUT) | ({"batch"} if reshard else set())
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
    saved = layout_of(manifest["strategy"], manifest["train_config"])
    this = layout_of(strategy.name, train_config)
    n = strategy.mesh.world.size
    if (saved, manifest["world_size"]) != (this, n) and not reshard:
        raise CheckpointError(
            f"the checkpoint was saved by {saved} on {manifest['world_size']} ranks, this run "
            f"is {this} on {n}: pass --reshard to convert it"
        )
    if manifest["step"] > train_config["steps"]:  # equal is fine: evaluate and sample
        raise CheckpointError(
            f"the checkpoint is at step {manifest['step']}, past this run's last step "
            f"{train_config['steps']}: ask for more steps (--steps) to train on from it"
        )


def layout_of(strategy: str, train_config: dict) -> str:
    """'zero3 with --layers-per-unit 2 --tp 2': the strategy and the options of LAYOUT set."""
    sizes = {flag: train_config.get(key, 1) for key, flag in LAYOUT.items()}
    flags = " ".join(f"{flag} {size}" for flag, size in sizes.items() if size != 1)
    return f"{strategy} with {flags}" if flags else strategy


def _damaged(path: Path, what: str) -> CheckpointError:
    return CheckpointError(
        f"{path} is a damaged checkpoint ({what}): resume from another one or start afresh"
    )


def _reason(err: Exception) -> str:
    """An exception's first line, short, or its type's name."""
    return str(err).splitlines()[0][:200] if str(err) else type(err).__name__


NPY_HEADER_MAX = 2**16  # bytes of an .npy header at most (numpy's own limit is 10,000)


def read_slice(path: Path, f: np.lib.npyio.NpzFile, key: str, size: int) -> np.ndarray:
    """One saved slice of rank file `f` (at path), checked to be float32 of shape (size,)
    from the zip's own record and the array's header before a byte of it is read: a header
    of shape (2**40,), or a small member that inflates to a gigabyte, allocates nothing."""
    if key not in f:
        layer = key.rsplit(".", 1)[0]
        if not any(k.startswith(f"{layer}.") for k in f.files):  # the manifest says it wrote it
            raise _damaged(path, f"it holds no slice of {layer}, which the manifest says it does")
        raise CheckpointError(
            f"{path.parent}: the shards lack {key}: resume with the same optimizer"
        )
    try:
        stored, shape, dtype = npy_header(f, key)
    except READ_ERRORS as err:
        raise _damaged(path, f"it cannot be read: {_reason(err)}") from None
    if stored > size * 4 + NPY_HEADER_MAX or dtype != np.float32 or shape != (size,):
        raise _damaged(
            path,
            f"{key} is {dtype} of shape {repr(shape)[:60]} in {stored:,} bytes, not float32 of"
            f" shape ({size},)",
        )
    try:
        return f[key]
    except READ_ERRORS as err:
        raise _damaged(path, f"it cannot be read: {_reason(err)}") from None


def npy_header(f: np.lib.npyio.NpzFile, key: str) -> tuple[int, tuple, np.dtype]:
    """(bytes once inflated, shape, dtype) of one array of an .npz, from the zip's directory
    and the .npy header alone (the header's own reader caps its size)."""
    info = f.zip.getinfo(f"{key}.npy")
    with f.zip.open(info) as member:
        version = np.lib.format.read_magic(member)
        if version == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(member)
        else:
            shape, _, dtype = np.lib.format.read_array_header_2_0(member)
    return info.file_size, shape, dtype


def open_rank_file(path: Path) -> np.lib.npyio.NpzFile:
    """A rank's .npz file, opened to read its arrays one at a time."""
    try:
        f = np.load(path)  # allow_pickle=False: an object array is refused, not run
    except READ_ERRORS as err:
        raise _damaged(path, f"it cannot be read: {_reason(err)}") from None
    if not isinstance(f, np.lib.npyio.NpzFile):
        raise _damaged(path, "not an .npz file of arrays")
    return f


def read_pieces(directory: Path, manifest: dict, model, needed: set[str]) -> dict[str, np.ndarray]:
    """Every needed state ("fc1.m") of each of model's layers (a Stage's: its own) as this
    rank's flat piece: the whole layer joined from the slices of the ranks that wrote it, then
    cut (layer.piece), one whole layer at a time."""
    n, vectors, opened = manifest["world_size"], {}, {}
    with contextlib.ExitStack() as files:
        for layer in model.layers:
            ranks = manifest["layers"][layer.name]["ranks"]
            for r in ranks:
                if r not in opened:
                    opened[r] = files.enter_context(open_rank_file(directory / rank_file(r, n)))
            flat = FlatParam(layer.whole_shapes, len(ranks))
            for what in needed:
                key = f"{layer.name}.{what}"
                slices = [
                    read_slice(directory / rank_file(r, n), opened[r], key, flat.shard_size)
                    for r in ranks
                ]
                vector = np.concatenate(slices)[: flat.numel]
                if layer.split:  # this rank's piece, flat as its own FlatParam lays it out
                    vector = FlatParam(layer.shapes).flatten(layer.piece(flat.views(vector)))
                vectors[key] = vector
    return vectors


def entry_layers(flat: FlatParam, name: str) -> list[str]:
    """The layers a layout entry holds, in order: the layer `name` itself, or a zero3 unit's
    (--layers-per-unit K), whose keys are "layer.param"."""
    return list(dict.fromkeys(owner(key, name)[0] for key, *_ in flat.spans)) or [name]


def to_layout(vectors: dict[str, np.ndarray], strategy: Strategy) -> dict[str, np.ndarray]:
    """The whole vectors of strategy.local_state()'s keys: each layout entry's layers' vectors
    one after another (a layer alone: its own)."""
    out = {}
    for key in strategy.local_state():
        name, what = key.rsplit(".", 1)
        layers = entry_layers(strategy.layout[name], name)
        parts = [vectors[f"{layer}.{what}"] for layer in layers]
        out[key] = parts[0] if len(parts) == 1 else np.concatenate(parts)
    return out


def read_losses(directory: Path, step: int) -> np.ndarray:
    """losses.npy: the float64 global loss of each of the checkpoint's `step` steps."""
    path = directory / "losses.npy"
    try:  # mapped, so a header that claims more than the file holds allocates nothing
        losses = np.load(path, mmap_mode="r")  # allow_pickle=False
    except (ValueError, OSError, EOFError) as err:
        losses = err
    if not isinstance(losses, np.ndarray) or losses.dtype != np.float64 or losses.shape != (step,):
        what = losses if isinstance(losses, Exception) else f"{losses.dtype} {losses.shape}"
        raise CheckpointError(
            f"{path} is a damaged checkpoint ({what}, not the float64 loss of each of its "
            f"{step} steps): resume from another one or start afresh"
        )
    return np.array(losses)  # read now, and the file closed


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


@in_phase("a checkpoint load")
def load_checkpoint(
    directory: str | os.PathLike,
    strategy: Strategy,
    rng: Rng,
    model_config: dict,
    train_config: dict,
    reshard: bool = False,
) -> dict:
    """Load params, optimizer state and RNG into this run; return the manifest (and losses).

    Every rank rebuilds its layers' whole vectors from the files of the ranks that wrote them
    (so any mesh can load any mesh), and cuts its pieces; the strategy keeps what it keeps.
    """
    found = find_checkpoint(directory)
    if found is None:
        read_manifest(directory)  # raises the reason the directory itself is no checkpoint
    manifest = read_manifest(found)
    check_compatible(manifest, strategy, model_config, train_config, reshard)
    needed = {key.rsplit(".", 1)[1] for key in strategy.local_state()}  # params, m, v
    vectors = to_layout(read_pieces(found, manifest, strategy.model, needed), strategy)
    manifest["losses"] = read_losses(found, manifest["step"])
    _check_rng_state(manifest["rng"], found)
    strategy.load_state(vectors, manifest["optimizer_steps"])
    scaler = strategy.precision.scaler
    if scaler is not None and manifest["loss_scaler"]:  # fp16: the scale goes on
        scaler.scale = manifest["loss_scaler"]["scale"]
        scaler.good_steps = manifest["loss_scaler"]["good_steps"]
    try:
        rng.set_state(manifest["rng"])
    except (KeyError, TypeError, ValueError, OverflowError) as err:  # 2**300: OverflowError
        raise CheckpointError(
            f"{found}: its RNG state cannot be restored ({_reason(err)[:100]})"
        ) from None
    manifest["path"] = str(found)
    return manifest
