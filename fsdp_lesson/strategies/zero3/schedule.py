"""zero3's schedule: the order the units run in, and so which one prefetch gathers next.

The loop tells the strategy which pass it is in (begin_phase: FSDP2's training state), so the
schedule needs no guess from the order of hook calls: forward runs the units with parameters
first to last, backward last to first. While unit i computes, prefetch gathers the unit that
runs next (forward: i+1, backward: i-1), as FSDP2's implicit prefetching does (it records the
forward order at run time; here the model's layer order is that order).
"""

from __future__ import annotations

from .unit import Unit


class Schedule:
    """The units with parameters in forward order, and the unit that runs after a given one."""

    def __init__(self, units: list[Unit]) -> None:
        self.order = [unit for unit in units if unit.flat.numel]  # a ReLU alone gathers nothing
        # each unit's successor in each pass, worked out once: materialize asks at every gather
        ahead, behind = [*self.order[1:], None], [None, *self.order[:-1]]
        self.after = {
            False: {unit.name: next_ for unit, next_ in zip(self.order, ahead, strict=True)},
            True: {unit.name: next_ for unit, next_ in zip(self.order, behind, strict=True)},
        }

    def following(self, unit: Unit, backward: bool) -> Unit | None:
        """The unit that runs after `unit` (forward: the next one; backward: the one before)."""
        return self.after[backward][unit.name]
