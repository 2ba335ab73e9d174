"""One small module per strategy; `make_strategy` picks one by name."""

from __future__ import annotations

from .base import Strategy
from .dp import DataParallel
from .single import Single
from .zero1 import ZeRO1
from .zero2 import ZeRO2
from .zero3 import ZeRO3

STRATEGY_CLASSES = {cls.name: cls for cls in (Single, DataParallel, ZeRO1, ZeRO2, ZeRO3)}


def make_strategy(name: str, model, params, optimizer, comm, ledger) -> Strategy:
    return STRATEGY_CLASSES[name](model, params, optimizer, comm, ledger)


__all__ = ["Strategy", "STRATEGY_CLASSES", "make_strategy"]
