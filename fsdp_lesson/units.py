"""Units: the groups of consecutive layers that zero3 shards, gathers and frees together.

PyTorch FSDP shards what `fully_shard` wraps (usually one transformer block); DeepSpeed's
stage 3 fetches sub-modules. Here a unit is K parameterised layers, with the ReLUs between
them, laid out as one flat vector (FlatParam over "layer.param" keys):

    K = 1   emb | fc1 | relu1 | fc2          every layer its own unit (a ReLU's unit is empty)
    K = 2   emb fc1 relu1 | fc2              one allgather and one reduce-scatter per unit
    K >= the number of parameterised layers: the whole model is one unit (root-only wrapping)

Bigger units mean fewer, larger collectives and more memory gathered at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from .flat import FlatParam
from .model import Params


@dataclass(frozen=True)
class Unit:
    """A group of consecutive layers and the flat layout of all their parameters."""

    name: str
    layers: tuple[str, ...]  # in forward order
    flat: FlatParam  # keys "layer.param", e.g. "fc1.W"

    def views(self, full: np.ndarray) -> dict[str, Params]:
        """Each layer's parameters as shaped views into the unit's full flat buffer."""
        return {
            layer: {name: full[start:stop].reshape(shape) for name, start, stop, shape in spans}
            for layer, spans in self.layer_spans.items()
        }

    @cached_property
    def layer_spans(self) -> dict[str, list[tuple[str, int, int, tuple[int, ...]]]]:
        """Each layer's (param, start, stop, shape) in the flat vector: worked out once, since
        zero3 takes views at every gather."""
        spans: dict[str, list] = {layer: [] for layer in self.layers}
        for key, start, stop, shape in self.flat.spans:
            layer, name = key.rsplit(".", 1)
            spans[layer].append((name, start, stop, shape))
        return spans


def make_units(layers: list, layers_per_unit: int, world_size: int) -> list[Unit]:
    """Group the model's layers into units of `layers_per_unit` parameterised layers."""
    if layers_per_unit == 1:  # every layer its own unit, as the strategies' per-layer layout
        groups = [[layer] for layer in layers]
    else:  # a parameterless layer joins the unit before it
        groups = []
        for layer in layers:
            if not groups or layer.shapes and _parameterised(groups[-1]) == layers_per_unit:
                groups.append([])
            groups[-1].append(layer)
    units = []
    for group in groups:
        name = group[0].name if len(group) == 1 else f"{group[0].name}..{group[-1].name}"
        shapes = {f"{g.name}.{k}": shape for g in group for k, shape in g.shapes.items()}
        units.append(Unit(name, tuple(g.name for g in group), FlatParam(shapes, world_size)))
    return units


def _parameterised(group: list) -> int:
    return sum(1 for layer in group if layer.shapes)
