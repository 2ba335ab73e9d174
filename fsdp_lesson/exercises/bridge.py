"""Notebook 16's checker: the learner's `shard_model(model)`, PyTorch's FSDP2 (`fully_shard`)
wrapping the package's MLP one unit per layer, on the four engines.

On every rank, inside the bridge's process group, it wraps two fresh copies of the model, the
learner's way and torch_bridge.shard_per_layer's (the key), runs one step of each and reports
what PyTorch itself says: which modules are FSDP units, each rank's parameter bytes from its
DTensors' local shards (against torch_bridge.shard_bytes, from the package's sharding), what a
rank still holds after the forward and how many allgathers a step makes. The client names the
usual mistake (no root, only the root, a layer left out, reshard_after_forward=False) without
printing the expected value. Needs the torch extra, as torch_bridge does.
"""

from __future__ import annotations

from ..checks import NOT_SOLVED, fail, how_wrong, not_solved
from ..config import ModelConfig

CONFIG = ModelConfig()  # the notebook's MLP: emb, fc1, fc2
SEED = 42  # the initial parameters, the same on every rank
GROUP_TIMEOUT = 30.0  # seconds: a rank whose wrapping differs cannot hang the engines for long


def step_report(module, batch) -> dict:
    """One forward and backward of a wrapped module on this rank: its FSDP units (the root is
    ""), its parameter bytes (local shards) before the step, after the forward and after the
    backward, its gradients' bytes, and the allgathers the step made."""
    import torch.nn.functional as F
    from torch.distributed.fsdp import FSDPModule

    from ..torch_bridge import CollectiveCounter, local_bytes

    X, Y = batch
    report = {
        "units": [name for name, m in module.named_modules() if isinstance(m, FSDPModule)],
        "sharded": any(hasattr(p, "to_local") for p in module.parameters()),
        "params": local_bytes(module)["params"],
    }
    counter = CollectiveCounter()
    with counter:
        logits = module(X)
        report["after_forward"] = local_bytes(module)["params"]
        F.cross_entropy(logits, Y).backward()
    after = local_bytes(module)
    report["after_backward"], report["grads"] = after["params"], after["grads"]
    report["allgathers"] = counter.traffic.get("allgather", {}).get("calls", 0)
    return report


def shard_model_reports() -> dict:
    """On every rank, with the notebook's %%px `shard_model`: the step reports of the learner's
    wrapping ("answer") and of the key's ("key"); "answer" is NOT_SOLVED for a stub (None, the
    model untouched), or the text of what it raised, or of what it returned instead of a module."""
    import torch
    from torch import nn

    import __main__

    from ..data import Dataset
    from ..model import MLP
    from ..rng import make_rng
    from ..torch_bridge import TorchMLP, batches, process_group, shard_per_layer

    torch.set_num_threads(1)
    data = Dataset.load(seq_len=CONFIG.seq_len)
    initial = MLP(CONFIG).init_params(make_rng(SEED))
    with process_group(timeout=GROUP_TIMEOUT) as (rank, size):
        batch = next(batches(data, 32, make_rng(SEED + 1), rank, size))
        out = {"rank": rank, "size": size}
        out["key"] = step_report(shard_per_layer(TorchMLP(CONFIG, initial)), batch)
        model = TorchMLP(CONFIG, initial)
        try:
            answer = __main__.shard_model(model)
            wrapped = any(hasattr(p, "to_local") for p in model.parameters())
            if not_solved(answer) and not wrapped:  # a stub
                out["answer"] = NOT_SOLVED
            elif not isinstance(answer, nn.Module):
                what = "None" if answer is None else type(answer).__name__
                out["answer"] = f"it returned {what}, not the model: return it"
            else:
                out["answer"] = step_report(answer, batch)
        except Exception as err:  # the learner's code: its line says what it raised
            out["answer"] = raised(model, rank, err)
    return out


def raised(model, rank: int, err: Exception) -> str:
    """What the learner's wrapping raised, and why when the root was wrapped before a layer
    (fully_shard refuses a layer whose parameters the root's unit already sharded)."""
    from torch.distributed.fsdp import FSDPModule

    layers = [getattr(model, name) for name in model.order]
    if isinstance(model, FSDPModule) and not all(isinstance(m, FSDPModule) for m in layers):
        return (
            "fully_shard(model) came before its layers: the root's unit took every parameter,"
            " and a layer's are then already sharded — wrap the layers first, then the root"
        )
    return f"rank {rank} raised {type(err).__name__}: {err}".splitlines()[0]


def shard_model_mistake(reports: list[dict]) -> str | None:
    """The first thing wrong with the learner's wrapping on the ranks, in words; None if right."""
    from ..torch_bridge import shard_bytes

    answers = [r["answer"] for r in reports]
    for answer in answers:
        if isinstance(answer, str):
            return answer
    first = answers[0]
    layers = [unit for unit in reports[0]["key"]["units"] if unit]
    if not first["sharded"]:
        return (
            "no parameter is sharded: every rank holds the whole model, as dp — call fully_shard"
            " on each layer, then on the model"
        )
    if first["units"] == [""]:
        return (
            "only the root is wrapped: the whole model is one unit, gathered whole by one"
            " allgather in the forward — wrap each layer first, then the root"
        )
    missing = [layer for layer in layers if layer not in first["units"]]
    if missing:
        return (
            f"layer {', '.join(missing)} is not wrapped: its parameters join the root's unit,"
            " gathered with it — wrap every layer in model.order, then the root"
        )
    if "" not in first["units"]:
        return (
            "the root is not wrapped: each layer is then a root of its own, and a root keeps"
            " its parameters gathered from the forward to the backward — call fully_shard(model)"
            " after the layers"
        )
    for report in reports:
        rank, answer = report["rank"], report["answer"]
        expected = shard_bytes(CONFIG, report["size"], rank)["fsdp2"]
        if answer["params"] != expected:
            return (
                f"rank {rank} holds {answer['params']:,} bytes of parameters:"
                f" {how_wrong(answer['params'], expected)} (FSDP2 cuts every parameter's dim 0"
                " over all the ranks)"
            )
        if answer["after_forward"] > answer["params"]:
            return (
                f"after the forward rank {rank} still holds its layers whole:"
                " reshard_after_forward=False keeps them gathered until the backward (the"
                " package's --no-reshard-after-forward); zero3 as notebook 05 built it frees"
                " them — leave the default, True"
            )
        if answer["grads"] != answer["params"]:
            return f"rank {rank}'s gradients are not sharded as its parameters are"
        if answer["allgathers"] != report["key"]["allgathers"]:
            return (
                f"a step made {answer['allgathers']} allgathers on rank {rank}, not one per"
                " layer in the forward and again in the backward"
            )
    return None


def check_shard_model(ranks) -> bool:
    """The exercise on the four engines: the learner's fully_shard wrapping against one unit
    per layer, then the root; names the mistake, or confirms each rank's shard bytes."""
    reports = ranks.run(shard_model_reports, timeout=300)
    if any(r["answer"] == NOT_SOLVED for r in reports):
        return fail(f"✗ shard_model: {NOT_SOLVED}")
    mistake = shard_model_mistake(reports)
    if mistake is not None:
        return fail(f"✗ shard_model: {mistake}")
    print(
        f"✓ shard_model: correct — one unit per layer and the root; each of the {len(reports)}"
        " ranks holds FSDP2's dim-0 shard of every parameter, the last rank the shortest,"
        " freed after the forward"
    )
    return True
