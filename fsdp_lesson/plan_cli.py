"""plan: predicted memory, pipeline bubble and traffic of a real model on a (dp, tp, pp) mesh.

    python -m fsdp_lesson plan --model 405B --gpus 1024 --tp 8 --pp 16 --recompute
    python -m fsdp_lesson plan --model 70B --gpus 64 --recompute    # the meshes that fit 80 GiB

With --tp or --pp it prints one mesh (dp = gpus / (tp·pp)): a GPU's bytes by category, the
bubble and the bytes a GPU sends per step along each dimension. Without them, every mesh of
--gpus GPUs that fits an 80 GiB GPU. Formulas of fsdp_lesson/plan.py (docs/zero_formulas.md):
predicted, not measured.
"""

from __future__ import annotations

import argparse
import sys

from .plan import (
    GPU_CAPACITY,
    MODELS,
    PLANNED,
    SCHEDULES,
    bubble_fraction,
    fitting_meshes,
    mesh_gpu_bytes,
    mesh_traffic_bytes,
    meshes,
    stage_layers,
)

GIB = 2**30


EXACT = 2**53  # the largest count float64 holds exactly: any flag above it is refused


def build_parser() -> argparse.ArgumentParser:
    """The flags: the model, the GPUs and mesh, and the levers of plan.mesh_gpu_bytes."""
    parser = argparse.ArgumentParser(
        prog="python -m fsdp_lesson plan",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--model", choices=list(MODELS), default="405B", help="Llama-like shape")
    parser.add_argument("--gpus", type=int, default=1024, help="GPUs in all: dp·tp·pp")
    parser.add_argument("--strategy", choices=PLANNED, default="zero1", help="ZeRO over dp")
    parser.add_argument(
        "--tp", type=int, help="tensor-parallel GPUs (default: list the meshes, tp <= 8)"
    )
    parser.add_argument("--pp", type=int, help="pipeline stages (default: list the meshes)")
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
        "--recompute", action="store_true", help="keep each layer's input, recompute the rest"
    )
    return parser


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, with what to type instead, what the formulas cannot plan (exit code 2)."""
    for flag in ("gpus", "tp", "pp", "micro_batches", "seq_len", "micro_batch"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} {value}: it must be 1 or more")
        if value is not None and value > EXACT:  # the formulas compute in floats
            parser.error(
                f"--{flag.replace('_', '-')} has {len(str(value))} digits: the formulas count in"
                f" float64, exact up to 2**53 (about 9e15): use a smaller value"
            )
    model = MODELS[args.model]
    tp, pp = args.tp or 1, args.pp or 1
    if model.heads % tp:
        fitting = ", ".join(str(t) for t in range(1, 9) if model.heads % t == 0)
        parser.error(
            f"--tp {tp}: {model.name}'s {model.heads} heads do not split evenly over {tp} GPUs: "
            f"use a divisor of {model.heads} ({fitting} within one 8-GPU server)"
        )
    if pp > model.layers:
        parser.error(
            f"--pp {pp}: {model.name} has {model.layers} layers, at least one per stage: use "
            f"--pp {model.layers} or fewer"
        )
    if args.gpus % (tp * pp):
        below, above = args.gpus // (tp * pp) * tp * pp, (args.gpus // (tp * pp) + 1) * tp * pp
        nearest = f"--gpus {above}" + (f" or --gpus {below}" if below else "")
        parser.error(
            f"--gpus {args.gpus} is not a multiple of tp·pp = {tp}·{pp} = {tp * pp}, so no dp "
            f"fits: type {nearest}, or another --tp/--pp"
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
    }


def traffic(args: argparse.Namespace, dp: int, tp: int, pp: int) -> dict[str, float]:
    """Bytes one GPU sends per step along dp, tp and pp (mesh_traffic_bytes)."""
    model, lever = MODELS[args.model], levers(args)
    keep = ("seq_len", "micro_batch", "micro_batches", "recompute")
    return mesh_traffic_bytes(model, args.strategy, dp, tp, pp, **{k: lever[k] for k in keep})


def say_mesh(args: argparse.Namespace, tp: int, pp: int) -> None:
    """One mesh: a first-stage GPU's bytes by category, the bubble, the traffic by dimension."""
    model, dp = MODELS[args.model], args.gpus // (tp * pp)
    memory = mesh_gpu_bytes(model, args.strategy, dp, tp, pp, **levers(args))
    total = sum(memory.values())
    print(f"{model.name} on dp {dp} × tp {tp} × pp {pp} = {args.gpus} GPUs, {args.strategy}")
    print(f"bytes per GPU of the first stage ({stage_layers(model, pp)} of {model.layers} layers):")
    for category, size in memory.items():
        print(f"  {category:<12} {size / GIB:9.1f} GiB")
    verdict = "fits" if total <= GPU_CAPACITY else "does NOT fit"
    print(f"  {'total':<12} {total / GIB:9.1f} GiB: {verdict} an 80 GiB GPU")
    m = args.micro_batches
    print(f"pipeline bubble: {bubble_fraction(pp, m):.1%} of the step, (p-1)/(m+p-1) at m = {m}")
    print("bytes one GPU sends per step:")
    for dim, size in traffic(args, dp, tp, pp).items():
        print(f"  {dim:<3} {size / GIB:9.1f} GiB")


def say_fitting(args: argparse.Namespace) -> None:
    """Every mesh of --gpus GPUs that fits 80 GiB, with its bubble and traffic; or the nearest."""
    model = MODELS[args.model]
    fitting = fitting_meshes(model, args.gpus, args.strategy, **levers(args))
    print(f"meshes of {args.gpus} GPUs where {model.name} fits an 80 GiB GPU ({args.strategy}):")
    if not fitting:
        needs = {
            mesh: mesh_gpu_bytes(model, args.strategy, *mesh, **levers(args))
            for mesh in meshes(model, args.gpus)
        }
        dp, tp, pp = least = min(needs, key=lambda mesh: sum(needs[mesh].values()))
        total, activations = sum(needs[least].values()), needs[least]["activations"]
        print(
            f"  none: the least, dp {dp} × tp {tp} × pp {pp}, needs {total / GIB:.1f} GiB, "
            f"{activations / GIB:.1f} of them activations: try --recompute or "
            f"--sequence-parallel (activations), --stage zero3 (state) or more --gpus"
        )
        return
    print(f"  {'dp':>5} {'tp':>3} {'pp':>4}  {'GiB/GPU':>8}  {'bubble':>6}  GiB sent: dp, tp, pp")
    for dp, tp, pp in fitting:
        total = sum(mesh_gpu_bytes(model, args.strategy, dp, tp, pp, **levers(args)).values())
        sent = "  ".join(f"{b / GIB:7.1f}" for b in traffic(args, dp, tp, pp).values())
        bubble = bubble_fraction(pp, args.micro_batches)
        print(f"  {dp:>5} {tp:>3} {pp:>4}  {total / GIB:8.1f}  {bubble:6.1%}  {sent}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check(parser, args)
    print(
        f"predicted (formulas, not measured): seq {args.seq_len}, micro-batch {args.micro_batch}, "
        f"{args.micro_batches} micro-batches, {args.schedule}, bf16 + Adam"
        + ", sequence parallel" * args.sequence_parallel
        + ", recompute" * args.recompute
    )
    if args.tp is None and args.pp is None:
        say_fitting(args)
    else:
        say_mesh(args, args.tp or 1, args.pp or 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
