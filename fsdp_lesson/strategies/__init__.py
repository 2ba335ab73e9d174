"""One small module per strategy; `make_strategy` picks one by name."""

from __future__ import annotations

from .base import Strategy
from .dp import DataParallel
from .single import Single

STRATEGY_CLASSES = {cls.name: cls for cls in (Single, DataParallel)}


def make_strategy(name: str, model, params, optimizer, comm, ledger) -> Strategy:
    if name not in STRATEGY_CLASSES:
        raise NotImplementedError(f"strategy {name!r} is not available yet")
    return STRATEGY_CLASSES[name](model, params, optimizer, comm, ledger)


__all__ = ["Strategy", "Single", "DataParallel", "STRATEGY_CLASSES", "make_strategy"]
