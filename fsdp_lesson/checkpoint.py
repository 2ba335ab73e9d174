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

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np

from .comm import Comm, together
from .data import DataError, sha256_of
from .rng import Rng
from .strategies import Strategy

FORMAT = 4
# TrainConfig fields a resumed run may change; everything else must match the checkpoint.
# With reshard=True the global batch may change too (see check_compatible).
MAY_CHANGE = {"strategy", "steps", "log_every", "eval_batches", "samples", "memory_budget_mb"}
MAY_CHANGE |= {"prefetch", "reshard_after_forward"}  # zero3's options that change no number
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


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


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
        with open(path, "wb") as f:
            np.savez(f, **owned_shards(strategy))
        return path.name, sha256_of(path)

    _agree_on_io(comm, prepare, final)
    digests = comm.allgather_objects(_agree_on_io(comm, write_shard, final))

    def write_manifest() -> None:
        if comm.rank != 0:
            return
        np.save(partial / "losses.npy", np.asarray(losses[:step], dtype=np.float64))
        files = dict(digests) | {"losses.npy": sha256_of(partial / "losses.npy")}
        manifest = {
            "format": FORMAT,
            "strategy": strategy.name,
            "world_size": comm.size,
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
        text = json.dumps(manifest, indent=1).encode()
        _write_bytes(partial / "manifest.json", text)
        _write_bytes(partial / "manifest.sha256", hashlib.sha256(text).hexdigest().encode())
        old = final.with_name(final.name + ".old")
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(partial, final)
        shutil.rmtree(old, ignore_errors=True)

    _agree_on_io(comm, write_manifest, final)


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

    return together(comm, attempt, (CheckpointError,))


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
    text = path.read_bytes()
    if not checksum.is_file() or checksum.read_text().strip() != hashlib.sha256(text).hexdigest():
        raise CheckpointError(
            f"{path} does not match manifest.sha256 (edited or damaged): this checkpoint "
            f"cannot be trusted; resume from another one or start afresh"
        )
    try:
        manifest = json.loads(text)
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path} is corrupted ({err}); save the checkpoint again") from None
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
    if strategy.scaler is None:
        return {}
    return {"scale": float(strategy.scaler.scale), "good_steps": strategy.scaler.good_steps}


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
    scaler = manifest["loss_scaler"]
    if scaler and not (
        isinstance(scaler.get("scale"), float)
        and scaler["scale"] > 0
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
    may_change = MAY_CHANGE | ({"batch"} if reshard else set())
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
    same_layout = (
        manifest["strategy"] == strategy.name and manifest["world_size"] == strategy.comm.size
    )
    if not same_layout and not reshard:
        raise CheckpointError(
            f"the checkpoint was saved by {manifest['strategy']} on {manifest['world_size']} "
            f"ranks, this run is {strategy.name} on {strategy.comm.size}: pass --reshard to "
            f"convert it"
        )
    if manifest["step"] > train_config["steps"]:  # equal is fine: evaluate and sample
        raise CheckpointError(
            f"the checkpoint is at step {manifest['step']}, past this run's last step "
            f"{train_config['steps']}: ask for more steps (--steps) to train on from it"
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
    saved_n = manifest["world_size"]
    shards = [np.load(found / rank_file(r, saved_n)) for r in range(saved_n)]
    missing = [key for key in strategy.local_state() if key not in shards[0].files]
    if missing:
        raise CheckpointError(f"{found}: the shards lack {missing}: resume with the same optimizer")
    vectors = {key: np.concatenate([s[key] for s in shards]) for key in strategy.local_state()}
    strategy.load_state(vectors, manifest["optimizer_steps"])
    if strategy.scaler is not None and manifest["loss_scaler"]:  # fp16: the scale goes on
        strategy.scaler.scale = manifest["loss_scaler"]["scale"]
        strategy.scaler.good_steps = manifest["loss_scaler"]["good_steps"]
    try:
        rng.set_state(manifest["rng"])
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{found}: its RNG state cannot be restored ({err})") from None
    manifest["losses"] = np.load(found / "losses.npy")
    manifest["path"] = str(found)
    return manifest
