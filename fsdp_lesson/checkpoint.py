"""Sharded checkpoints: every rank writes its own shards; rank 0 a manifest; any N can load.

    ckpt/manifest.json            config, strategy, N, layer layouts, step, RNG, sha256 of files
    ckpt/rank00000-of-00004.npz   rank 0's shard of every layer: params, Adam's m and v

Whatever the strategy, a rank saves the slice [r*S, (r+1)*S) of every layer's padded flat
vector (FlatParam with N shards), so a checkpoint looks the same whether dp or zero3 wrote
it. Loading at another N or into another strategy ("resharding") rebuilds each layer's full
vector from the old shards and hands it to the strategy's load_state, which keeps what the
sharding table says it keeps. Writes go to a
temporary directory renamed into place at the end: an interrupted save never leaves a
checkpoint that loads.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from .data import sha256_of
from .rng import Rng
from .strategies import Strategy

FORMAT = 2
# TrainConfig fields a resumed run may change; everything else must match the checkpoint.
MAY_CHANGE = {"strategy", "steps", "log_every", "eval_batches", "samples", "memory_budget_mb"}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this run; the message says why and what to do."""


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
    digests = comm.gather_objects((path.name, sha256_of(path)))
    if comm.rank == 0:
        manifest = {
            "format": FORMAT,
            "strategy": strategy.name,
            "world_size": comm.size,
            "step": step,
            "model_config": model_config,
            "train_config": train_config,
            "optimizer_steps": strategy.optimizer.t,
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
        if not (directory / name).is_file() or sha256_of(directory / name) != digest:
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
) -> int:
    """Load params, optimizer state and RNG into this run; return the step to continue from.

    Every rank reads every shard file and rebuilds each array's whole vector (so any N can
    load any N); the strategy keeps what it keeps.
    """
    directory = Path(directory)
    manifest = read_manifest(directory)
    check_compatible(manifest, strategy, model_config, train_config, reshard)
    saved_n = manifest["world_size"]
    shards = [np.load(directory / rank_file(r, saved_n)) for r in range(saved_n)]
    vectors = {key: np.concatenate([s[key] for s in shards]) for key in strategy.local_state()}
    strategy.load_state(vectors, manifest["optimizer_steps"])
    rng.set_state(manifest["rng"])
    return manifest["step"]
