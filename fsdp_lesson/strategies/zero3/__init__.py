"""zero3 in three small modules: the unit (its shard, gather, free and reduce-scatter), the
schedule (which unit runs next, so what prefetch gathers), and the strategy's hooks."""

from .schedule import Schedule
from .strategy import ZeRO3
from .unit import Unit, make_units

__all__ = ["Schedule", "Unit", "ZeRO3", "make_units"]
