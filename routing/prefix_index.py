"""Per-replica record of which prefix blocks were recently sent there (bounded LRU, pins)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixIndex:
    """An approximate picture of one replica's prefix cache.

    It holds the chained block hashes routed to the replica, evicting the least recently used
    block once `capacity_blocks` is reached, so it forgets roughly when the engine would. Because
    hashes are chained, a prefix of length k is present iff its k-th hash is present; matching
    walks forward and stops at the first absent block.

    The engine's own accounting, optionally (the router's `pin_running`):
    - blocks of requests still running there can be pinned (`pin`, `unpin`), as an engine pins
      the KV blocks of the sequences it computes: never evicted, and back as the most recent
      when the last request holding them ends;
    - `room` blocks of the capacity are lent to blocks sent but not computed yet (the prefill
      queued there): the index holds them from the moment they are sent, the engine only once
      it computes them, and without the loan they would push out blocks the engine still has;
    - `reserved` blocks of the capacity hold no prefix at all: the output of the requests
      running there, which the engine keeps KV for beside their prompts;
    - a request's output stays cached once it ends (`unpin` with `output_blocks`): vLLM
      keeps every full block it computed, generated ones too, and frees a request's blocks
      tail first, so its output is evicted just before its prompt. No later prompt matches
      it (a client sends back the text, and the next turn's template differs), but it takes
      room that would otherwise hold older prefixes.
    """

    __slots__ = ("_blocks", "_next_output", "_pinned", "capacity_blocks", "reserved", "room")

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks <= 0:
            raise ValueError("capacity_blocks must be positive")
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()  # unpinned, least recent first
        self._pinned: dict[int, int] = {}  # block -> running requests holding it
        self.room = 0
        self.reserved = 0
        # Keys of cached output blocks: negative, so no prompt's hash (an unsigned digest)
        # ever matches one.
        self._next_output = -1

    def __len__(self) -> int:
        return len(self._blocks) + len(self._pinned)

    @property
    def pinned_blocks(self) -> int:
        """Blocks held by running requests (`pin`)."""
        return len(self._pinned)

    def match(self, hashes: Sequence[int]) -> int:
        """Number of leading blocks of `hashes` present (no side effects)."""
        blocks, pinned = self._blocks, self._pinned
        # Binary search is valid because presence is prefix-closed for chained hashes, except
        # after partial eviction of a chain's middle; a linear walk is exact and cheap enough.
        n = 0
        for h in hashes:
            if h not in blocks and h not in pinned:
                break
            n += 1
        return n

    def insert(self, hashes: Sequence[int]) -> None:
        """Record that `hashes` were sent to this replica, refreshing their recency."""
        blocks, pinned = self._blocks, self._pinned
        move = blocks.move_to_end
        # Touch the chain tail first so its head ends up most recent: eviction from the front
        # then removes a chain's tail before its head, as an engine's LRU does (a head without
        # its tail still matches; a tail without its head never can).
        for h in reversed(hashes):
            if h in blocks:
                move(h)
            elif h not in pinned:
                blocks[h] = None
        self._evict()

    def pin(self, hashes: Sequence[int]) -> None:
        """A request holding `hashes` is running there: keep them until `unpin`."""
        blocks, pinned = self._blocks, self._pinned
        for h in hashes:
            held = pinned.get(h)
            if held:
                pinned[h] = held + 1
            else:
                blocks.pop(h, None)
                pinned[h] = 1
        self._evict()  # a block pinned after the index let it go counts again

    def unpin(self, hashes: Sequence[int], output_blocks: int = 0) -> None:
        """That request ended: its blocks are evictable again, the most recent, tail first,
        after the `output_blocks` it generated (evicted before its prompt's blocks)."""
        blocks, pinned = self._blocks, self._pinned
        if output_blocks > 0:
            key = self._next_output
            for k in range(key, key - output_blocks, -1):
                blocks[k] = None
            self._next_output = key - output_blocks
        for h in reversed(hashes):
            held = pinned.get(h)
            if held is None:
                continue  # never pinned in this index (the replica was removed and re-added)
            if held > 1:
                pinned[h] = held - 1
            else:
                del pinned[h]
                blocks[h] = None
        self._evict()

    def lend(self, room: int) -> None:
        """Lend `room` blocks of the capacity to prefill sent but not computed yet (what is
        queued there now), evicting what no longer fits."""
        self.room = room
        self._evict()

    def reserve(self, blocks: int) -> None:
        """`blocks` more of the capacity hold a running request's output. Counted from the
        next eviction (the `insert` or `pin` that follows), so that the prefix recorded with
        it is refreshed before anything is pushed out."""
        self.reserved += blocks

    def unreserve(self, blocks: int) -> None:
        """That request ended: its output's blocks are free again (never below none: a
        replica re-added while its requests ran has a new index that held none of them)."""
        self.reserved = max(0, self.reserved - blocks)

    def _evict(self) -> None:
        blocks = self._blocks
        overflow = (len(blocks) + len(self._pinned) + self.reserved - self.capacity_blocks
                    - self.room)
        if overflow > 0:
            pop = blocks.popitem
            for _ in range(min(overflow, len(blocks))):
                pop(last=False)

    def resize(self, capacity_blocks: int) -> None:
        """Change capacity (e.g. once the engine reports its real KV cache size)."""
        self.capacity_blocks = max(1, capacity_blocks)
        self._evict()

    def clear(self) -> None:
        """Forget every block not pinned (an engine's cache reset keeps what is running)."""
        self._blocks.clear()
