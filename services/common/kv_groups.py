"""KV layer groups: how a model whose layers mix sliding windows and full attention shares one
block pool, so a windowed layer's KV memory is bounded by its window.

A block (a page of the pool) holds K and V of ``layers_per_page`` layers for ``block_size``
tokens. Layers are grouped by kind (full attention, or one window size) into groups of that
many layers, the greatest common divisor of the kinds' layer counts: Gemma 3 270M's 3 global
and 15 local layers make one full group of 3 and five window groups of 3, every group's pages
the same size. Layer ``i`` of every group lives in the pool's ``i``-th K/V tensor pair; each
group has its own block ids, so the scheduler can give a window group's blocks back once they
fall behind the window while the full group keeps its own (vLLM v1's hybrid KV cache).

A model whose layers are all of one kind has one group of every layer: its pages are what
they always were. The block table of a request interleaves the groups: entry
``i * num_groups + k`` is group ``k``'s block for tokens ``[i * block_size, (i + 1) * block_size)``.

Torch-free: the scheduler's block manager reads ``windows`` alone (one per group, 0 for full
attention), the runtime also the layer lists.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import gcd


@dataclass(frozen=True, slots=True)
class KVGroups:
    layers: tuple[tuple[int, ...], ...]
    """Per group, its layers in order (every group the same length)."""
    windows: tuple[int, ...]
    """Per group, its layers' sliding window in tokens, 0 for full attention."""

    @property
    def num_groups(self) -> int:
        return len(self.layers)

    @property
    def layers_per_page(self) -> int:
        return len(self.layers[0])

    def place(self, layer: int) -> tuple[int, int]:
        """(group, slot) of a layer: its block ids are its group's, its tensors the slot's."""
        for group, members in enumerate(self.layers):
            if layer in members:
                return group, members.index(layer)
        raise ValueError(f"layer {layer} is in no KV group")


def kv_groups(layer_windows: Sequence[int | None], num_layers: int) -> KVGroups:
    """Group ``num_layers`` layers by their windows (``layer_windows``: one per layer, None for
    full attention; empty when no layer has a window). Layers of one kind stay in their order."""
    windows = [w or 0 for w in layer_windows] if layer_windows else [0] * num_layers
    if len(windows) != num_layers:
        raise ValueError(f"{len(windows)} layer windows for {num_layers} layers")
    kinds: dict[int, list[int]] = {}
    for layer, window in enumerate(windows):
        kinds.setdefault(window, []).append(layer)
    if len(kinds) == 1:
        return KVGroups((tuple(range(num_layers)),), (windows[0] if windows else 0,))
    size = 0
    for members in kinds.values():
        size = gcd(size, len(members))
    layers: list[tuple[int, ...]] = []
    group_windows: list[int] = []
    for window in sorted(kinds, key=lambda w: (w != 0, w)):  # full attention first
        members = kinds[window]
        for start in range(0, len(members), size):
            layers.append(tuple(members[start:start + size]))
            group_windows.append(window)
    return KVGroups(tuple(layers), tuple(group_windows))


def first_needed_block(num_computed_tokens: int, window: int, block_size: int) -> int:
    """The first block a window layer still reads once ``num_computed_tokens`` are computed:
    the next query, at that position, sees keys from ``position - window + 1`` on, and later
    queries less. Blocks before it may be given back. 0 for full attention."""
    if window <= 0:
        return 0
    return max(0, num_computed_tokens - window + 1) // block_size
