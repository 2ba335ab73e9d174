"""Sharded checkpoints: every rank writes its own shards; rank 0 a manifest; any N can load.

    ckpt/manifest.json            config, strategy, N, layer layouts, step, RNG, sha256 of files
    ckpt/rank00000-of-00004.npz   rank 0's shard of every layer: params, Adam's m and v

Whatever the strategy, a rank saves the slice [r*S, (r+1)*S) of every layer's padded flat
vector (FlatParam with N shards), so a checkpoint looks the same whether dp or zero3 wrote
it. Loading at another N or into another strategy ("resharding") rebuilds each layer's full
vector from the old shards and hands every strategy what it keeps. Writes go to a
temporary directory renamed into place at the end: an interrupted save never leaves a
checkpoint that loads.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np

from .flat import FlatParam
from .rng import Rng
from .strategies import Strategy

FORMAT = 1
# TrainConfig fields a resumed run may change; everything else must match the checkpoint.
MAY_CHANGE = {"strategy", "steps", "log_every", "eval_batches", "n_samples", "memory_budget_mb"}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this run; the message says why and what to do."""


def rank_file(rank: int, world_size: int) -> str:
    return f"rank{rank:05d}-of-{world_size:05d}.npz"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _padded(flat: np.ndarray, layout: FlatParam) -> np.ndarray:
    """A layer's vector (unpadded or padded) as the padded vector of `layout`."""
    out = np.zeros(layout.padded_numel, dtype=np.float32)
    out[: layout.numel] = flat[: layout.numel]
    return out


def owned_shards(strategy: Strategy) -> dict[str, np.ndarray]:
    """This rank's slice of every layer's params and optimizer state, in the N-way layout."""
    comm, arrays = strategy.comm, {}
    for layer in strategy.model.layers:
        name, layout = layer.name, FlatParam(layer.shapes, comm.size)
        params = strategy.params[name]
        arrays[f"{name}.params"] = (
            params
            if strategy.shards_params
            else layout.owned_shard(_padded(params, layout), comm.rank)
        )
        for key, value in strategy.opt_state[name].items():
            if isinstance(value, np.ndarray):
                arrays[f"{name}.{key}"] = (
                    value
                    if strategy.shards_optimizer
                    else layout.owned_shard(_padded(value, layout), comm.rank)
                )
    return arrays


def save_checkpoint(
    directory: str | os.PathLike,
    strategy: Strategy,
    step: int,
    rng: Rng,
    model_config: dict,
    train_config: dict,
) -> None:
    """Every rank writes its shards; rank 0 the manifest; then the directory is renamed into place.

    A collective: every rank must call it. `step` is the number of steps done.
    """
    comm, final = strategy.comm, Path(directory)
    partial = final.with_name(final.name + ".partial")
    if comm.rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    comm.barrier()
    path = partial / rank_file(comm.rank, comm.size)
    with open(path.with_suffix(".tmp"), "wb") as f:
        np.savez(f, **owned_shards(strategy))
    os.replace(path.with_suffix(".tmp"), path)
    digests = comm.gather_objects((path.name, _sha256(path)))
    if comm.rank == 0:
        manifest = {
            "format": FORMAT,
            "strategy": strategy.name,
            "world_size": comm.size,
            "step": step,
            "model_config": model_config,
            "train_config": train_config,
            "optimizer_steps": {n: s.get("t", 0) for n, s in strategy.opt_state.items()},
            "layers": {
                layer.name: {k: list(v) for k, v in layer.shapes.items()}
                for layer in strategy.model.layers
            },
            "rng": rng.get_state(),
            "files": dict(digests),
        }
        (partial / "manifest.json").write_text(json.dumps(manifest, indent=1))
        old = final.with_name(final.name + ".old")
        if final.exists():
            os.replace(final, old)
        os.replace(partial, final)
        shutil.rmtree(old, ignore_errors=True)
    comm.barrier()


def read_manifest(directory: str | os.PathLike) -> dict:
    """The manifest, after checking that every file it lists is there with its sha256."""
    directory = Path(directory)
    path = directory / "manifest.json"
    if not path.is_file():
        raise CheckpointError(f"{directory}: no manifest.json, so not a (complete) checkpoint")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path} is corrupted ({err}); save the checkpoint again") from None
    for name, digest in manifest["files"].items():
        if not (directory / name).is_file() or _sha256(directory / name) != digest:
            raise CheckpointError(
                f"{directory / name} is missing or corrupted (sha256 differs from the manifest); "
                f"this checkpoint cannot be loaded: resume from another one or start afresh"
            )
    return manifest


def check_compatible(
    manifest: dict, strategy: Strategy, model_config: dict, train_config: dict, reshard: bool
) -> None:
    """Refuse a checkpoint of another model or run, or of another layout without reshard=True."""
    if manifest["model_config"] != model_config:
        raise CheckpointError(
            f"the checkpoint is of another model ({manifest['model_config']}), not "
            f"{model_config}: resume with the flags it was saved with"
        )
    differ = {
        k
        for k, v in train_config.items()
        if k not in MAY_CHANGE and manifest["train_config"].get(k) != v
    }
    if differ:
        saved = {k: manifest["train_config"].get(k) for k in sorted(differ)}
        raise CheckpointError(
            f"the checkpoint was saved with {saved}: resume with the same settings"
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


def load_checkpoint(
    directory: str | os.PathLike,
    strategy: Strategy,
    rng: Rng,
    model_config: dict,
    train_config: dict,
    reshard: bool = False,
) -> int:
    """Load params, optimizer state and RNG into this run; return the step to continue from.

    Every rank reads every shard file and rebuilds each layer's full vector (so any N can
    load any N), then keeps what its strategy keeps.
    """
    directory = Path(directory)
    manifest = read_manifest(directory)
    check_compatible(manifest, strategy, model_config, train_config, reshard)
    saved_n = manifest["world_size"]
    shards = [np.load(directory / rank_file(r, saved_n)) for r in range(saved_n)]
    comm = strategy.comm
    for layer in strategy.model.layers:
        name = layer.name
        layout, saved = FlatParam(layer.shapes, comm.size), FlatParam(layer.shapes, saved_n)
        for key in ["params"] + [k for k in strategy.opt_state[name] if k != "t"]:
            full = np.concatenate([s[f"{name}.{key}"] for s in shards])[: saved.numel]
            target = strategy.params[name] if key == "params" else strategy.opt_state[name][key]
            sharded = strategy.shards_params if key == "params" else strategy.shards_optimizer
            if sharded:
                target[...] = layout.owned_shard(_padded(full, layout), comm.rank)
            else:
                target[: layout.numel] = full
        if "t" in strategy.opt_state[name]:
            strategy.opt_state[name]["t"] = manifest["optimizer_steps"][name]
    rng.set_state(manifest["rng"])
    return manifest["step"]
