"""The bridge to PyTorch: the package's MLP, batches and MPI ranks in torch.distributed.

What this course built by hand, run by the library learners use at work, on the same ranks:

    the package                        PyTorch (this module)
    --strategy dp                      DistributedDataParallel
    --strategy zero3, one layer/unit   fully_shard (FSDP2) on every layer, then on the root
    --no-reshard-after-forward         fully_shard(..., reshard_after_forward=False)
    --precision bf16                   MixedPrecisionPolicy(param_dtype=bfloat16,
                                                            reduce_dtype=float32)
    --tp T (Megatron's pairs)          ColwiseParallel / RowwiseParallel over a 2-D DeviceMesh
    --resume a package checkpoint      torch.distributed.checkpoint (DCP) of FSDP2, converted
                                       by dcp_to_package

The module starts from the package's own initial parameters (model.MLP.init_params, the same
Rng) and draws the package's own batches (data.GlobalBatchSampler, rank_slice's rule), so a run
here and the package's run of the same strategy train the same model (docs/pytorch.md).

Only this module imports torch: the optional extra, `make torch` (`pip install -e '.[torch]'`).
The process group runs gloo over the ranks MPI already started (mpiexec, or the cluster's
engines, on one host): rank and world size from MPI, rendezvous on a file rank 0 names over MPI,
gloo's sockets on the loopback interface, a timeout on every wait.
"""

from __future__ import annotations

INSTALL_HINT = (
    "the PyTorch bridge needs the torch extra (PyTorch 2.13.0, CPU build): make torch "
    "(docs/pytorch.md)"
)

try:
    import torch
except ModuleNotFoundError as missing:  # the course without the extra: one line, how to fix it
    if missing.name != "torch":
        raise
    raise ModuleNotFoundError(INSTALL_HINT, name="torch") from None

import gc
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, replace
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from .checkpoint import (
    find_checkpoint,
    read_losses,
    read_manifest,
    read_pieces,
    save_checkpoint,
    to_layout,
)
from .collectives import counted_per_call
from .comm import Comm
from .config import DEFAULT_LR, ModelConfig, TrainConfig
from .data import Dataset, GlobalBatchSampler
from .flat import FlatParam
from .gpt import EPS
from .model import MLP, Embedding, Linear, Params
from .models import build_model
from .rng import make_rng
from .train import run

LOOPBACK_DEVICE = "lo"  # gloo's sockets: the loopback interface, as launch.py's MPI settings
STRATEGIES = ("dp", "zero3")  # what `train` runs: DDP and FSDP2 (with tp: DTensor and FSDP2)


# --- the model -----------------------------------------------------------------------------


class TorchMLP(nn.Module):
    """model.MLP as torch modules named as the package names its layers (emb, fc1, fc2, ...),
    holding the given parameters: {layer: {"W": ..., "b": ...}}, the package's layout.

    The package stores a Linear's W as (in, out) and computes x @ W + b, as the C program does;
    torch's nn.Linear stores weight as (out, in) and computes x @ weight.T + bias: the same
    numbers, transposed. An embedding's table is (vocab, emb) in both.
    """

    def __init__(self, config: ModelConfig, params: dict[str, Params]) -> None:
        super().__init__()
        self.order: list[str] = []  # the layers with parameters, in forward's order
        for layer in MLP(config).layers:
            if isinstance(layer, Embedding):
                module = nn.Embedding(*layer.shapes["W"])
            elif isinstance(layer, Linear):
                module = nn.Linear(*layer.shapes["W"])
            else:  # a ReLU: the forward applies it between the Linears
                continue
            with torch.no_grad():
                for name, value in to_torch(layer.name, params[layer.name]).items():
                    getattr(module, name).copy_(value)
            self.add_module(layer.name, module)
            self.order.append(layer.name)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, S) token ids -> (B, V) logits: embedding, flattened, Linears with ReLUs between."""
        return run_layers(self, self.order, tokens, last=self.order[-1])


class PackageLayer(nn.Module):
    """A layer's parameters under the package's names and layout (a weight (in, out), x @ W),
    so to_package reads them back unchanged; a subclass's forward is gpt.py's layer's."""

    def __init__(self, arrays: Params, heads: int = 1) -> None:
        super().__init__()
        self.heads = heads
        for key, value in arrays.items():
            self.register_parameter(key, nn.Parameter(torch.from_numpy(value.copy())))


class GPTEmbedding(PackageLayer):
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, S) tokens -> (B, S, E): W[token] + P[position]."""
        return self.W[tokens] + self.P[: tokens.shape[1]]


class GPTBlock(PackageLayer):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x + attn(ln1(x)), then x + mlp(ln2(x)), as gpt.Block.forward (keys without bias)."""
        B, S, E = x.shape
        h = layer_norm(x, self.ln1_g, self.ln1_b)
        q, k, v = h @ self.wq + self.bq, h @ self.wk, h @ self.wv + self.bv
        q, k, v = (t.view(B, S, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # scale 1/sqrt(D)
        x = x + att.transpose(1, 2).reshape(B, S, E) @ self.wo + self.bo
        u = layer_norm(x, self.ln2_g, self.ln2_b) @ self.w_fc + self.b_fc
        return x + F.gelu(u, approximate="tanh") @ self.w_proj + self.b_proj


class GPTHead(PackageLayer):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, S, E) -> (B, S, V): the final LayerNorm, then the LM head."""
        return layer_norm(x, self.lnf_g, self.lnf_b) @ self.W + self.b


class TorchGPT(nn.Module):
    """gpt.GPT as torch modules named as the package names its layers (emb, h0, ..., head),
    each its own module, the unit `fully_shard` wraps (as FSDP2 wraps a TransformerBlock).
    Forward: (B, S) tokens -> (B, S, V) logits."""

    def __init__(self, config: ModelConfig, params: dict[str, Params]) -> None:
        super().__init__()
        self.order = list(params)  # emb, h0, ..., head
        for layer, arrays in params.items():
            kind = {"emb": GPTEmbedding, "head": GPTHead}.get(layer, GPTBlock)
            self.add_module(layer, kind(arrays, config.heads))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = tokens
        for name in self.order:
            x = getattr(self, name)(x)
        return x


def layer_norm(x: torch.Tensor, g: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """gpt.layer_norm: over the last axis, eps 1e-5."""
    return F.layer_norm(x, (x.shape[-1],), g, b, eps=float(EPS))


def run_layers(module: nn.Module, names: list[str], x: torch.Tensor, last: str) -> torch.Tensor:
    """The named layers of `module` in order: an embedding's rows flattened, a ReLU after every
    Linear but the model's `last` (a pipeline stage runs some of them, TorchMLP all)."""
    for name in names:
        layer = getattr(module, name)
        x = layer(x).flatten(1) if isinstance(layer, nn.Embedding) else layer(x)
        if isinstance(layer, nn.Linear) and name != last:
            x = torch.relu(x)
    return x


class StageModule(nn.Module):
    """The layers of a TorchMLP that one pipeline stage holds (torch.distributed.pipelining's
    stage module, the package's pipeline.Stage): a slice of `order`, run as TorchMLP runs it."""

    def __init__(self, whole: TorchMLP, names: list[str]) -> None:
        super().__init__()
        self.order, self.last = names, whole.order[-1]
        for name in names:
            self.add_module(name, getattr(whole, name))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_layers(self, self.order, x, self.last)


def to_torch(layer: str, params: Params) -> dict[str, torch.Tensor]:
    """One layer's package parameters as its torch module's: W -> weight (a Linear's
    transposed), b -> bias."""
    out = {}
    for key, value in params.items():
        value = np.asarray(value)
        if key == "W" and layer != "emb":
            value = value.T
        out["weight" if key == "W" else "bias"] = torch.from_numpy(np.ascontiguousarray(value))
    return out


def to_package(state: dict[str, torch.Tensor]) -> dict[str, Params]:
    """A full state dict ({"fc1.weight": ...}, plain tensors) in the package's layout,
    {layer: {"W": ..., "b": ...}} as float32 numpy arrays."""
    out: dict[str, Params] = {}
    for key, value in state.items():
        layer, name = key.rsplit(".", 1)
        array = value.detach().to(torch.float32).numpy()
        if name == "weight" and layer != "emb":
            array = array.T
        name = {"weight": "W", "bias": "b"}.get(name, name)  # TorchGPT's: the package's names
        out.setdefault(layer, {})[name] = np.ascontiguousarray(array)
    return out


def full_params(module: nn.Module) -> dict[str, Params]:
    """Every parameter, whole, in the package's layout, on every rank. A DTensor (FSDP2's
    shards, tensor parallelism's pieces) is gathered with full_tensor(): a collective, so every
    rank must call this."""
    state = {}
    for key, value in module.named_parameters():
        key = key.removeprefix("module.")  # DDP's wrapper
        state[key] = value.full_tensor() if hasattr(value, "full_tensor") else value
    return to_package(state)


def batches(
    data: Dataset, batch: int, rng, rank: int, world_size: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's rows of every global batch, as the package draws them (GlobalBatchSampler:
    the same seeded Rng, rows b with b % world_size == rank), as int64 tensors."""
    sampler = GlobalBatchSampler(data.X_train, data.Y_train, batch, rng)
    while True:
        X, Y = sampler.next_slice(rank, world_size)
        yield torch.from_numpy(X.astype(np.int64)), torch.from_numpy(Y.astype(np.int64))


# --- the process group ---------------------------------------------------------------------


@contextmanager
def process_group(timeout: float = 60.0, mpi_comm=None) -> Iterator[tuple[int, int]]:
    """torch.distributed's default process group over the running MPI ranks; (rank, size).

    gloo, rank and size from MPI (mpi_comm, default COMM_WORLD), rendezvous on a FileStore in
    a fresh directory that rank 0 makes and names to the others over MPI (the ranks share one
    host's disk), gloo's own sockets on the loopback interface. Not a TCPStore: its server
    listens on every interface, whatever address it is given. `timeout` (seconds) bounds the
    rendezvous and every collective (init_process_group's timeout, the package's --timeout).
    On the way out every rank waits for the others, then the group is destroyed (gloo's threads
    end with it, and no process is left) and rank 0 removes the directory. gloo keeps a few
    sockets listening on 127.0.0.1 for the life of the process; another group reuses them.
    """
    if mpi_comm is None:
        from mpi4py import MPI

        mpi_comm = MPI.COMM_WORLD
    rank, size = mpi_comm.Get_rank(), mpi_comm.Get_size()
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed process group is already running on this rank")
    os.environ["GLOO_SOCKET_IFNAME"] = LOOPBACK_DEVICE
    directory = mpi_comm.bcast(tempfile.mkdtemp(prefix="torch-bridge-") if rank == 0 else None)
    try:
        store = dist.FileStore(os.path.join(directory, "store"), size)
        store.set_timeout(timedelta(seconds=timeout))
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=size, timeout=timedelta(seconds=timeout)
        )
        try:
            yield rank, size
        finally:
            mpi_comm.Barrier()  # no rank destroys the group while another still uses it
            dist.destroy_process_group()
            del store
            # FSDP2's and DTensor's modules hold their groups in reference cycles: collected
            # now, their gloo sockets close, and a next group does not add to them
            gc.collect()
    finally:
        mpi_comm.Barrier()  # every rank has let go of the store's file
        if rank == 0:
            shutil.rmtree(directory, ignore_errors=True)


# --- what a rank holds and sends -------------------------------------------------------------


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's local shard or piece, a plain tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def local_bytes(module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """This rank's bytes of parameters, gradients and optimizer state, from the tensors it
    holds (a DTensor's local shard), and `allocated`: the parameters' storage, which under
    FSDP2 includes the padding that makes every rank's dim-0 chunk of a parameter equal."""
    out = {"params": 0, "grads": 0, "optimizer": 0, "allocated": 0}
    for p in module.parameters():
        out["params"] += local(p).nbytes
        out["allocated"] += local(p).untyped_storage().nbytes()
        if p.grad is not None:
            out["grads"] += local(p.grad).nbytes
    states = optimizer.state.values() if optimizer is not None else ()
    for state in states:
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:  # not Adam's step count
                out["optimizer"] += local(value).nbytes
    return out


def shard_bytes(config: ModelConfig, world_size: int, rank: int) -> dict[str, int]:
    """One parameter copy's bytes (float32) on `rank` of `world_size`, counted two ways.

    `fsdp2`: FSDP2 shards every parameter on its dim 0 (torch's layout: a Linear's output
    features) into chunks of ceil(d0 / N) rows, so the last ranks hold fewer rows, or none,
    and the ranks' shards add up to the model exactly; `fsdp2_allocated`: the storage under
    them, every rank's chunk padded to ceil(d0 / N) rows so that an allgather's pieces are
    equal. `package`: zero3's shard of each layer's flat vector (flat.FlatParam), ceil(numel / N)
    elements on every rank, the padding on the last: equal on all ranks, a few elements more
    than the model in all.
    """
    out = {"fsdp2": 0, "fsdp2_allocated": 0, "package": 0}
    for layer in MLP(config).layers:
        out["package"] += FlatParam(layer.shapes, world_size).shard_size
        for shape in layer.shapes.values():
            rows, *rest = shape[::-1] if isinstance(layer, Linear) else shape  # torch's layout
            chunk, row_size = -(-rows // world_size), int(np.prod(rest))
            out["fsdp2"] += min(chunk, max(rows - rank * chunk, 0)) * row_size
            out["fsdp2_allocated"] += chunk * row_size
    return {what: 4 * numel for what, numel in out.items()}


# The collectives, as a dispatch mode sees them: {op: (the package's kind, the argument holding
# the full buffer F, the argument naming the group)}. FSDP2 and DDP call c10d's ops on a
# ProcessGroup; DTensor's tensor parallelism calls the functional ones on a group's name. The
# package counts F the same way (collectives.Traffic.buffer_bytes).
COLLECTIVE_OPS = {
    "c10d._allgather_base_": ("allgather", 0, 2),  # (output: N shards, input: this rank's)
    "c10d._reduce_scatter_base_": ("reduce_scatter", 1, 2),  # (output: this rank's, input)
    "c10d.allreduce_": ("allreduce", 0, 1),  # ([tensors], group, ...)
    "c10d.broadcast_": ("bcast", 0, 1),
    "_c10d_functional.all_reduce": ("allreduce", 0, 2),  # (tensor, op, group name)
    "_c10d_functional.all_gather_into_tensor": ("allgather", None, 2),  # (input, N, group name)
    "_c10d_functional.reduce_scatter_tensor": ("reduce_scatter", 0, 3),  # (input, op, N, name)
}


def group_size(group) -> int:
    """The ranks of a collective's group: a c10d op's ProcessGroup (boxed, as the dispatcher
    passes it), or a functional collective's group name."""
    if isinstance(group, str):
        return dist.distributed_c10d._resolve_process_group(group).size()
    return dist.ProcessGroup.unbox(group).size()


class CollectiveCounter(TorchDispatchMode):
    """Within `with CollectiveCounter() as c:`, every collective this rank calls, by the package's
    kinds (and group size, "allreduce (2 ranks)" when not the world's): calls, buffer_bytes (the
    full buffer F) and sent_bytes, the ring model's count of what it sends
    (collectives.counted_per_call), as the package's Comm counts its own calls."""

    def __init__(self) -> None:
        super().__init__()
        self.traffic: dict[str, dict] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        op = f"{func.namespace}.{func.__name__.split('.')[0]}"
        if op in COLLECTIVE_OPS:
            kind, where, group = COLLECTIVE_OPS[op]
            n = group_size(args[group])
            if where is None:  # a functional allgather's output is N times its input
                nbytes = n * args[0].nbytes
            else:
                buffers = args[where] if isinstance(args[where], list | tuple) else [args[where]]
                nbytes = sum(t.nbytes for t in buffers)
            label = kind if n == dist.get_world_size() else f"{kind} ({n} ranks)"
            entry = self.traffic.setdefault(
                label, {"calls": 0, "buffer_bytes": 0, "sent_bytes": 0.0}
            )
            entry["calls"] += 1
            entry["buffer_bytes"] += nbytes
            entry["sent_bytes"] += counted_per_call(n)[kind][0] * nbytes / n
        return func(*args, **(kwargs or {}))


# --- wrapping and training -----------------------------------------------------------------


def shard_per_layer(
    module: nn.Module, mesh=None, reshard_after_forward: bool = True, precision: str = "fp32"
) -> nn.Module:
    """FSDP2 as the package's zero3 with one layer per unit: fully_shard on every layer, then
    on the root (which gathers nothing of its own: every parameter is in a layer).

    Each parameter becomes a DTensor sharded on dim 0 over the mesh (default: every rank); a
    layer's shards are gathered together (one allgather per layer) before its forward and
    backward and its gradient reduce-scattered, as the package's FlatParam per layer is.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy()  # fp32: compute and reduce in the parameters' float32
    if precision == "bf16":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    elif precision != "fp32":
        raise ValueError(f"the bridge runs --precision fp32 or bf16, not {precision}")
    options = dict(mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    for name in module.order:
        fully_shard(getattr(module, name), **options)
    fully_shard(module, **options)
    return module


def tensor_parallel(module: TorchMLP, tp_mesh) -> TorchMLP:
    """Megatron's pairs as the package's --tp splits them (tensor.py): fc1 column-parallel
    (weight's rows, torch's dim 0: output features), fc2 row-parallel (weight's dim 1: input
    features), its output summed over the tp ranks; the embedding replicated."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    linears = module.order[1:]
    if len(linears) != 2:
        raise ValueError("the bridge's tensor parallelism pairs fc1 and fc2: use layers=1")
    plan = {linears[0]: ColwiseParallel(), linears[1]: RowwiseParallel()}
    return parallelize_module(module, tp_mesh, plan)


def pipeline(module: TorchMLP, tc: TrainConfig) -> tuple[StageModule, object]:
    """torch.distributed.pipelining as the package's --pp P (dp = 1): this rank's stage holds
    its run of the layers (the first ceil(L/P) on stage 0, ...), and a GPipe or 1F1B schedule
    over --micro-batches runs it; the loss is each micro-batch's mean, and the gradients are
    scaled by 1/M (the schedule's scale_grads), so the step is the whole batch's mean's."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank, size = dist.get_rank(), dist.get_world_size()
    if size != tc.pp:
        raise ValueError(f"the bridge pipelines over every rank: --pp {size}, not {tc.pp}")
    per_stage = -(-len(module.order) // size)
    stage_module = StageModule(module, module.order[rank * per_stage : (rank + 1) * per_stage])
    stage = PipelineStage(stage_module, rank, size, torch.device("cpu"))
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[tc.schedule]
    return stage_module, kind(stage, n_microbatches=tc.micro_batches, loss_fn=F.cross_entropy)


def make_optimizer(tc: TrainConfig, params) -> torch.optim.Optimizer:
    """torch's SGD or Adam at the package's learning rate (its default per optimizer)."""
    lr = tc.lr if tc.lr is not None else DEFAULT_LR[tc.optimizer]
    if tc.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr)
    return torch.optim.Adam(params, lr=lr, betas=(0.9, 0.999), eps=1e-8)


def wrap(module: nn.Module, tc: TrainConfig, size: int) -> tuple[nn.Module, int, int]:
    """The module (TorchMLP, TorchGPT) wrapped as tc's strategy and tp say; (module,
    data-parallel rank, size)."""
    rank = dist.get_rank()
    if tc.strategy not in STRATEGIES:
        raise ValueError(f"the bridge runs --strategy {' or '.join(STRATEGIES)}, not {tc.strategy}")
    if size % tc.tp:
        raise ValueError(f"--tp {tc.tp} needs a multiple of {tc.tp} ranks, not {size}")
    if tc.tp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        dp = size // tc.tp  # the package's mesh: tp the fastest-changing rank (mesh.py)
        mesh = init_device_mesh("cpu", (dp, tc.tp), mesh_dim_names=("dp", "tp"))
        module = tensor_parallel(module, mesh["tp"])
        if tc.strategy == "zero3":
            module = shard_per_layer(module, mesh["dp"], tc.reshard_after_forward, tc.precision)
        elif dp > 1:
            raise ValueError("with --tp the bridge runs --strategy zero3 (FSDP2 over dp)")
        return module, rank // tc.tp, dp
    if tc.strategy == "zero3":
        return shard_per_layer(module, None, tc.reshard_after_forward, tc.precision), rank, size
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(module), rank, size


def train(
    model_config: ModelConfig,
    tc: TrainConfig,
    data: Dataset | None = None,
    count_step: int = 2,
    save: tuple[int, str | os.PathLike] | None = None,
    resume: str | os.PathLike | None = None,
) -> dict:
    """Train as the package's `train.run` would with tc (its strategy, steps, batch, seed,
    optimizer, lr, tp, precision, reshard_after_forward; or pp, micro_batches and schedule
    with dp = 1), in PyTorch, inside process_group.

    Returns this rank's: `losses` (the global loss of every step, the mean over data-parallel
    ranks, as the package reports it), `params` (every layer whole, the package's layout),
    `bytes` (local_bytes after the last step, before its gradients are cleared) and `traffic`
    (CollectiveCounter over step `count_step`: not the first two, when DDP still broadcasts
    its buckets' order). With save=(k, directory): save_dcp after k steps, and `saved_params`,
    the parameters it saved, whole. With resume=directory (save_dcp's or package_to_dcp's):
    its parameters, data RNG and losses, then the steps after its step.
    """
    size = dist.get_world_size()
    data = data or Dataset.load(seq_len=model_config.seq_len)
    rng = make_rng(tc.seed)
    initial = build_model(model_config).init_params(rng)  # then the batches, from that stream
    module, schedule, dp_rank, dp_size = torch_model(model_config, tc, initial, size)
    gpt = model_config.model == "gpt"  # predicts every position: the targets are X shifted
    holding_the_loss = size if schedule is None else size // tc.pp  # pp: the last stage
    optimizer = make_optimizer(tc, module.parameters())
    losses, counter, start = np.zeros(tc.steps), CollectiveCounter(), 0
    if resume is not None:
        saved = load_dcp(module, resume)
        rng.set_state(saved["rng"])  # the batches go on where the checkpoint's run stopped
        start = saved["step"]
        losses[:start] = saved["losses"]
    rows = batches(data, tc.batch, rng, dp_rank, dp_size)
    with warnings.catch_warnings():
        # RowwiseParallel hands FSDP2 its output as a view: harmless, as nothing here changes
        # it in place (the ReLU and the loss make new tensors)
        warnings.filterwarnings("ignore", "FSDP2-wrapped module .* returned a view tensor")
        for step in range(start, tc.steps):
            X, Y = next(rows)
            with counter if step == count_step else nullcontext():
                optimizer.zero_grad(set_to_none=True)
                mine = local_loss(module, schedule, X, Y, gpt)
                optimizer.step()
                # the global loss, as the package's mean_scalar: the tp ranks of a group
                # hold the same loss, so the mean over all ranks is the mean over dp
                total = torch.tensor([mine], dtype=torch.float64)
                dist.all_reduce(total)
            losses[step] = total.item() / holding_the_loss
            if save is not None and step + 1 == save[0]:
                save_dcp(module, save[1], step + 1, rng, losses)
                saved = full_params(module)
    out = {
        "losses": losses,
        "params": every_layer(module, pipelined=schedule is not None),
        "bytes": local_bytes(module, optimizer),
        "traffic": counter.traffic,
    }
    return out if save is None else out | {"saved_params": saved}


def every_layer(module: nn.Module, pipelined: bool) -> dict:
    """Every layer's parameters, whole, on every rank (pipelined: each stage holds its own
    layers, so the stages exchange them)."""
    params = full_params(module)
    if not pipelined:
        return params
    stages: list = [None] * dist.get_world_size()
    dist.all_gather_object(stages, params)
    return {layer: p for stage in stages for layer, p in stage.items()}


def torch_model(
    model_config: ModelConfig, tc: TrainConfig, initial: dict, size: int
) -> tuple[nn.Module, object | None, int, int]:
    """The model as torch modules, from the package's initial parameters, parallelised as tc
    asks: (module, pipeline schedule or None, this rank's data-parallel rank, dp size)."""
    gpt = model_config.model == "gpt"
    if gpt and max(tc.tp, tc.pp, tc.cp) > 1:
        raise ValueError("the bridge trains --model gpt with dp or zero3 alone, not --tp/--pp/--cp")
    module = (TorchGPT if gpt else TorchMLP)(model_config, initial)
    if tc.pp > 1:  # a stage of the layers on each rank; every stage reads the whole batch
        module, schedule = pipeline(module, tc)
        return module, schedule, 0, 1
    module, dp_rank, dp_size = wrap(module, tc, size)
    return module, None, dp_rank, dp_size


def local_loss(module: nn.Module, schedule, X: torch.Tensor, Y: torch.Tensor, gpt: bool) -> float:
    """One step's forward and backward on this rank; its loss (pp: the last stage's, else 0)."""
    if schedule is not None:
        return pipeline_step(schedule, X, Y)
    if gpt:  # every position predicts its next token
        logits, targets = module(X).flatten(0, 1), next_tokens(X, Y).flatten()
    else:
        logits, targets = module(X), Y
    loss = F.cross_entropy(logits.float(), targets)
    loss.backward()
    return loss.item()


def next_tokens(X: torch.Tensor, Y: torch.Tensor) -> torch.Tensor:
    """Every position's target, as gpt.GPT.targets: the context shifted by one, then Y."""
    return torch.cat([X[:, 1:], Y.reshape(-1, 1)], dim=1)


def pipeline_step(schedule, X: torch.Tensor, Y: torch.Tensor) -> float:
    """One step of the pipeline schedule: the first stage feeds X, the last compares with Y;
    the batch's mean loss on the last stage (its micro-batches' mean), 0.0 on the others."""
    rank, size = dist.get_rank(), dist.get_world_size()
    inputs, losses = (X,) if rank == 0 else (), []
    if rank == size - 1:
        schedule.step(*inputs, target=Y, losses=losses)
        return torch.stack(losses).detach().mean().item()
    schedule.step(*inputs)
    return 0.0


def train_on_engine(model_config: ModelConfig, tc: TrainConfig, timeout: float = 60.0) -> dict:
    """What notebook 16 runs on every engine (Ranks.run): `train` inside its own process_group
    over the engines' MPI world, torn down before it returns; this rank's results."""
    with process_group(timeout=timeout):
        return train(model_config, tc)


# --- checkpoints across the bridge ---------------------------------------------------------

BRIDGE_STATE = "bridge.json"  # beside a DCP checkpoint: what the package's checkpoint also keeps


def save_dcp(module: nn.Module, directory: str | os.PathLike, step: int, rng, losses) -> None:
    """A torch.distributed.checkpoint (DCP) of the module's parameters, each rank writing its
    own shards, and beside it (rank 0) the step, the data's RNG state and the losses so far,
    which a package checkpoint also keeps. A collective: every rank calls it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    dcp.save({"model": get_model_state_dict(module)}, checkpoint_id=directory)
    if dist.get_rank() == 0:
        state = {"step": step, "rng": rng.get_state(), "losses": list(losses[:step])}
        Path(directory, BRIDGE_STATE).write_text(json.dumps(state))
    dist.barrier()


def load_dcp(module: nn.Module, directory: str | os.PathLike) -> dict:
    """Load a DCP checkpoint's parameters into the module (FSDP2 or DDP: DCP reshards them into
    whatever this rank holds) and return what it keeps beside them (step, rng, losses)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        set_model_state_dict,
    )

    state = {"model": get_model_state_dict(module)}
    dcp.load(state, checkpoint_id=directory)
    set_model_state_dict(module, state["model"])
    return json.loads(Path(directory, BRIDGE_STATE).read_text())


def package_to_dcp(
    directory: str | os.PathLike, out: str | os.PathLike, model_config: ModelConfig
) -> None:
    """The converter the other way: a package checkpoint (of the MLP, any strategy and mesh)
    as a DCP checkpoint of TorchMLP's full parameters at `out`, with its step, data RNG and
    losses beside it, which FSDP2 or DDP load on any number of ranks (train's resume). On one
    process, no process group: DCP saves plain tensors whole. Parameters only (SGD)."""
    import torch.distributed.checkpoint as dcp

    found = find_checkpoint(directory)
    manifest = read_manifest(found if found is not None else directory)
    if manifest["train_config"]["optimizer"] != "sgd":
        raise ValueError("package_to_dcp carries parameters only: convert an SGD run")
    model = MLP(model_config)
    vectors = read_pieces(Path(found), manifest, model, {"params"})
    params = {
        layer.name: FlatParam(layer.whole_shapes).views(vectors[f"{layer.name}.params"])
        for layer in model.layers
    }
    state = TorchMLP(model_config, params).state_dict()
    with warnings.catch_warnings():  # "assuming ... to save in a single process": as meant
        warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable")
        dcp.save({"model": state}, checkpoint_id=out, no_dist=True)
    step = manifest["step"]
    saved = {"step": step, "rng": manifest["rng"], "losses": list(read_losses(found, step))}
    Path(out, BRIDGE_STATE).write_text(json.dumps(saved))


def dcp_to_package(
    directory: str | os.PathLike,
    out: str | os.PathLike,
    model_config: ModelConfig,
    tc: TrainConfig,
    comm: Comm,
) -> None:
    """The converter: save_dcp's checkpoint at `directory` as a package checkpoint at `out`,
    which `--resume` continues with tc on comm's ranks. A collective on comm.

    Every rank reads the whole parameters (DCP reshards its shards into full tensors, without
    a process group), the package builds its strategy for tc as `run` does (steps=0: not
    trained), loads them, and writes its own checkpoint, with the DCP's step, RNG and losses.
    Parameters only: an Adam state would need its moments carried too.
    """
    import torch.distributed.checkpoint as dcp

    if tc.optimizer != "sgd":
        raise ValueError("dcp_to_package carries parameters only: convert an SGD run")
    shapes = TorchMLP(model_config, MLP(model_config).init_params(make_rng(0))).state_dict()
    state = {"model": {key: torch.empty_like(value) for key, value in shapes.items()}}
    with warnings.catch_warnings():  # "assuming ... to load in a single process": as meant
        warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable")
        dcp.load(state, checkpoint_id=directory, no_dist=True)
    params = to_package(state["model"])
    saved = json.loads(Path(directory, BRIDGE_STATE).read_text())
    _, strategy = run(model_config, replace(tc, steps=0), comm=comm)
    vectors = {  # every layer's, a ReLU's empty
        f"{layer.name}.params": FlatParam(layer.shapes).flatten(params.get(layer.name, {}))
        for layer in strategy.model.layers
    }
    strategy.load_state(to_layout(vectors, strategy))
    rng = make_rng(tc.seed)
    rng.set_state(saved["rng"])
    losses = np.asarray(saved["losses"], dtype=np.float64)
    save_checkpoint(out, strategy, saved["step"], rng, asdict(model_config), tc.to_dict(), losses)
