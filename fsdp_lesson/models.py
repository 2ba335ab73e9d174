"""Which network a run trains (--model): the C program's MLP, or the transformer."""

from __future__ import annotations

from .comm import Comm
from .config import ModelConfig
from .gpt import GPT
from .model import MLP, Model
from .tensor import megatron


def build_model(
    config: ModelConfig,
    tp: Comm | None = None,
    c_compat: bool = False,
    sequence_parallel: bool = False,
    cp: Comm | None = None,
    cp_layout: str = "zigzag",
) -> Model:
    """The model of `config`, split over the tensor-parallel ranks `tp` (None: whole) and, a
    transformer, its sequences over the context-parallel ranks `cp` (None: whole)."""
    if config.model == "gpt":
        return GPT(config, tp, sequence_parallel, cp, cp_layout)
    return MLP(config, megatron(tp, c_compat))
