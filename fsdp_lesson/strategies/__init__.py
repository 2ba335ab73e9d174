"""One small module per strategy; `make_strategy` picks one by name (sharding.STRATEGIES)."""

from __future__ import annotations

from ..sharding import STRATEGIES
from .base import StateArray, Strategy
from .dp import DataParallel
from .single import Single
from .zero1 import ZeRO1
from .zero2 import ZeRO2
from .zero3 import ZeRO3

STRATEGY_CLASSES = {cls.name: cls for cls in (Single, DataParallel, ZeRO1, ZeRO2, ZeRO3)}
assert tuple(STRATEGY_CLASSES) == STRATEGIES, "every strategy has a row in the sharding table"


def make_strategy(name: str, model, optimizer, comm, ledger, **options) -> Strategy:
    """The strategy `name`; options: the memory options and its own (zero3: layers_per_unit...)."""
    return STRATEGY_CLASSES[name](model, optimizer, comm, ledger, **options)


def strategy_options(name: str, config) -> dict:
    """Strategy `name`'s own options as `config` (a TrainConfig) sets them."""
    return {option: getattr(config, option) for option in STRATEGY_CLASSES[name].options}


__all__ = [
    "STRATEGY_CLASSES",
    "DataParallel",
    "Single",
    "StateArray",
    "Strategy",
    "ZeRO1",
    "ZeRO2",
    "ZeRO3",
    "make_strategy",
    "strategy_options",
]
