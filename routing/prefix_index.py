"""Per-replica record of which prefix blocks were recently sent there (bounded LRU)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixIndex:
    """An approximate picture of one replica's prefix cache.

    It holds the chained block hashes routed to the replica, evicting the least recently used
    block once `capacity_blocks` is reached, so it forgets roughly when the engine would. Because
    hashes are chained, a prefix of length k is present iff its k-th hash is present; matching
    walks forward and stops at the first absent block.
    """

    __slots__ = ("_blocks", "capacity_blocks")

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks <= 0:
            raise ValueError("capacity_blocks must be positive")
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hashes: Sequence[int]) -> int:
        """Number of leading blocks of `hashes` present (no side effects)."""
        blocks = self._blocks
        # Binary search is valid because presence is prefix-closed for chained hashes, except
        # after partial eviction of a chain's middle; a linear walk is exact and cheap enough.
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def insert(self, hashes: Sequence[int]) -> None:
        """Record that `hashes` were sent to this replica, refreshing their recency."""
        blocks = self._blocks
        move = blocks.move_to_end
        # Touch the chain tail first so its head ends up most recent: eviction from the front
        # then removes a chain's tail before its head, as an engine's LRU does (a head without
        # its tail still matches; a tail without its head never can).
        for h in reversed(hashes):
            if h in blocks:
                move(h)
            else:
                blocks[h] = None
        overflow = len(blocks) - self.capacity_blocks
        if overflow > 0:
            pop = blocks.popitem
            for _ in range(overflow):
                pop(last=False)

    def resize(self, capacity_blocks: int) -> None:
        """Change capacity (e.g. once the engine reports its real KV cache size)."""
        self.capacity_blocks = max(1, capacity_blocks)
        self.insert(())

    def clear(self) -> None:
        self._blocks.clear()
