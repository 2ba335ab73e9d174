"""plan: predicted memory, pipeline bubble and traffic of a Llama on a (dp, tp, pp, cp) mesh.

    python -m fsdp_lesson plan --model 405B --gpus 1024 --tp 8 --pp 16 --recompute
    python -m fsdp_lesson plan --model 70B --gpus 64 --recompute    # the meshes that fit 80 GiB
    python -m fsdp_lesson plan --model llama3-405b --seq-len 131072 --gpus 16384 \
        --attention flash --sequence-parallel --recompute --micro-batches 16   # 128k tokens

With --tp, --pp or --cp it prints one mesh (dp = gpus / (tp·pp·cp)): a GPU's bytes by
category, the bubble and the bytes a GPU sends per step along each dimension. Without them,
for each (tp, pp) the mesh with the fewest context-parallel GPUs (cp up to --max-cp) that fits
an 80 GiB GPU. Formulas of fsdp_lesson/plan.py (docs/zero_formulas.md, docs/long_context.md):
predicted, not measured.
"""

from __future__ import annotations

import argparse
import sys

from .plan import (
    ATTENTION,
    GPU_CAPACITY,
    MODELS,
    PLANNED,
    RECOMPUTE,
    SCHEDULES,
    bubble_fraction,
    fitting_meshes,
    mesh_gpu_bytes,
    mesh_problem,
    mesh_traffic_bytes,
    meshes,
    splits_heads,
    stage_layers,
)

GIB = 2**30


EXACT = 2**53  # the largest count float64 holds exactly: any flag above it is refused
ALIASES = {"llama2-7b": "7B"} | {f"llama3-{name.lower()}": name for name in ("8B", "70B", "405B")}


def model_name(text: str) -> str:
    """--model's value as a key of plan.MODELS: 405B, 405b or llama3-405b are the same model."""
    name = ALIASES.get(text.lower(), text.upper())
    if name not in MODELS:
        raise argparse.ArgumentTypeError(
            f"no model {text!r}: choose one of {', '.join(MODELS)} (or {', '.join(ALIASES)})"
        )
    return name


def build_parser() -> argparse.ArgumentParser:
    """The flags: the model, the GPUs and mesh, and the levers of plan.mesh_gpu_bytes."""
    parser = argparse.ArgumentParser(
        prog="python -m fsdp_lesson plan",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--model", type=model_name, default="405B", help=f"a Llama's shape: {', '.join(MODELS)}"
    )
    parser.add_argument("--gpus", type=int, default=1024, help="GPUs in all: dp·tp·pp·cp")
    parser.add_argument("--strategy", choices=PLANNED, default="zero1", help="ZeRO over dp")
    parser.add_argument(
        "--tp", type=int, help="tensor-parallel GPUs (default: list the meshes, tp <= 8)"
    )
    parser.add_argument("--pp", type=int, help="pipeline stages (default: list the meshes)")
    parser.add_argument(
        "--cp", type=int, help="context-parallel GPUs, s/cp tokens each (default: list the meshes)"
    )
    parser.add_argument("--max-cp", type=int, default=32, help="the most cp a listed mesh has")
    parser.add_argument(
        "--micro-batches", type=int, default=32, help="m per step: dp·m·b sequences a step"
    )
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="pipeline order")
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence, s")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch, b")
    parser.add_argument(
        "--sequence-parallel", action="store_true", help="split norms/dropouts over tp too"
    )
    parser.add_argument(
        "--recompute",
        nargs="?",
        const="full",
        default="none",
        choices=RECOMPUTE,
        help="full (alone: --recompute) keeps each layer's input; selective drops the s×s scores",
    )
    parser.add_argument(
        "--attention",
        choices=ATTENTION,
        default="materialized",
        help="materialized keeps the s×s probabilities (Korthikanti's count); flash keeps none",
    )
    return parser


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, with what to type instead, what the formulas cannot plan (exit code 2)."""
    for flag in ("gpus", "tp", "pp", "cp", "max_cp", "micro_batches", "seq_len", "micro_batch"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} {value}: it must be 1 or more")
        if value is not None and value > EXACT:  # the formulas compute in floats
            parser.error(
                f"--{flag.replace('_', '-')} has {len(str(value))} digits: the formulas count in"
                f" float64, exact up to 2**53 (about 9e15): use a smaller value"
            )
    model = MODELS[args.model]
    tp, pp, cp = args.tp or 1, args.pp or 1, args.cp or 1
    problem = mesh_problem(model, args.seq_len, tp, pp, cp, args.sequence_parallel)
    if problem and not splits_heads(model, tp):
        fitting = ", ".join(str(t) for t in range(1, 9) if splits_heads(model, t))
        parser.error(f"--tp {tp}: {problem}: use one of {fitting} (within one 8-GPU server)")
    if problem and pp > model.layers:
        parser.error(f"--pp {pp}: {problem}: use --pp {model.layers} or fewer")
    if problem:
        parser.error(
            f"--seq-len {args.seq_len} with --cp {cp}: {problem}: change --seq-len, --cp or --tp"
        )
    if args.gpus % (tp * pp * cp):
        mesh = tp * pp * cp
        below, above = args.gpus // mesh * mesh, (args.gpus // mesh + 1) * mesh
        nearest = f"--gpus {above}" + (f" or --gpus {below}" if below else "")
        parser.error(
            f"--gpus {args.gpus} is not a multiple of tp·pp·cp = {tp}·{pp}·{cp} = {mesh}, so no"
            f" dp fits: type {nearest}, or another --tp/--pp/--cp"
        )


def levers(args: argparse.Namespace) -> dict:
    """The keywords mesh_gpu_bytes takes, from the flags."""
    return {
        "seq_len": args.seq_len,
        "micro_batch": args.micro_batch,
        "micro_batches": args.micro_batches,
        "schedule": args.schedule,
        "sequence_parallel": args.sequence_parallel,
        "recompute": args.recompute,
        "attention": args.attention,
    }


def traffic(args: argparse.Namespace, *mesh: int) -> dict[str, float]:
    """Bytes one GPU sends per step along dp, tp, pp and cp (mesh_traffic_bytes)."""
    model, lever = MODELS[args.model], levers(args)
    keep = ("seq_len", "micro_batch", "micro_batches", "recompute")
    return mesh_traffic_bytes(model, args.strategy, *mesh, **{k: lever[k] for k in keep})


def say_mesh(args: argparse.Namespace, tp: int, pp: int, cp: int) -> None:
    """One mesh: a first-stage GPU's bytes by category, the bubble, the traffic by dimension."""
    model, dp = MODELS[args.model], args.gpus // (tp * pp * cp)
    memory = mesh_gpu_bytes(model, args.strategy, dp, tp, pp, cp, **levers(args))
    total = sum(memory.values())
    print(
        f"{model.name} on dp {dp} × tp {tp} × pp {pp} × cp {cp} = {args.gpus} GPUs, {args.strategy}"
    )
    print(f"bytes per GPU of the first stage ({stage_layers(model, pp)} of {model.layers} layers):")
    for category, size in memory.items():
        print(f"  {category:<12} {size / GIB:9.1f} GiB")
    verdict = "fits" if total <= GPU_CAPACITY else "does NOT fit"
    print(f"  {'total':<12} {total / GIB:9.1f} GiB: {verdict} an 80 GiB GPU")
    m = args.micro_batches
    print(f"pipeline bubble: {bubble_fraction(pp, m):.1%} of the step, (p-1)/(m+p-1) at m = {m}")
    print("bytes one GPU sends per step:")
    for dim, size in traffic(args, dp, tp, pp, cp).items():
        print(f"  {dim:<3} {size / GIB:9.1f} GiB")


def least_cp(found: list[tuple[int, int, int, int]]) -> list[tuple[int, int, int, int]]:
    """Of the meshes found, for each (tp, pp) the one with the fewest cp GPUs: more cp only
    adds ring traffic once a mesh fits."""
    first: dict[tuple[int, int], tuple[int, int, int, int]] = {}
    for mesh in found:
        first.setdefault(mesh[1:3], mesh)
    return list(first.values())


def say_fitting(args: argparse.Namespace) -> None:
    """For each (tp, pp), the least cp whose mesh fits 80 GiB, its bubble and traffic; or the
    mesh that comes nearest, and what to change."""
    model, lever = MODELS[args.model], levers(args)
    found = fitting_meshes(model, args.gpus, args.strategy, max_cp=args.max_cp, **lever)
    print(
        f"meshes of {args.gpus} GPUs where {model.name} fits an 80 GiB GPU ({args.strategy},"
        f" the fewest cp for each tp × pp, cp up to {args.max_cp}):"
    )
    if not found:
        needs = {
            mesh: mesh_gpu_bytes(model, args.strategy, *mesh, **lever)
            for mesh in meshes(model, args.gpus, max_cp=args.max_cp)
            if mesh_problem(model, args.seq_len, *mesh[1:], args.sequence_parallel) is None
        }
        dp, tp, pp, cp = least = min(needs, key=lambda mesh: sum(needs[mesh].values()))
        total, activations = sum(needs[least].values()), needs[least]["activations"]
        print(
            f"  none: the least, dp {dp} × tp {tp} × pp {pp} × cp {cp}, needs {total / GIB:.1f}"
            f" GiB, {activations / GIB:.1f} of them activations: try --recompute,"
            f" --sequence-parallel or --attention flash (activations), --strategy zero3 (state),"
            f" a larger --max-cp or more --gpus"
        )
        return
    print(
        f"  {'dp':>5} {'tp':>3} {'pp':>4} {'cp':>3}  {'GiB/GPU':>8}  {'bubble':>6}"
        "  GiB sent: dp, tp, pp, cp"
    )
    for dp, tp, pp, cp in least_cp(found):
        total = sum(mesh_gpu_bytes(model, args.strategy, dp, tp, pp, cp, **lever).values())
        sent = "  ".join(f"{b / GIB:7.1f}" for b in traffic(args, dp, tp, pp, cp).values())
        bubble = bubble_fraction(pp, args.micro_batches)
        print(f"  {dp:>5} {tp:>3} {pp:>4} {cp:>3}  {total / GIB:8.1f}  {bubble:6.1%}  {sent}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check(parser, args)
    print(
        f"predicted (formulas, not measured): seq {args.seq_len}, micro-batch {args.micro_batch}, "
        f"{args.micro_batches} micro-batches, {args.schedule}, bf16 + Adam"
        + ", sequence parallel" * args.sequence_parallel
        + f", {args.recompute} recompute" * (args.recompute != "none")
        + ", flash attention" * (args.attention == "flash")
    )
    if args.tp is None and args.pp is None and args.cp is None:
        say_fitting(args)
    else:
        say_mesh(args, args.tp or 1, args.pp or 1, args.cp or 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
