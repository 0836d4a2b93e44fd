"""The simulated engine's KV cache: block-hashed prefix blocks, pins, reservations, LRU eviction."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixCache:
    """Block-hashed KV cache with a capacity in blocks and block-granular LRU eviction.

    Blocks in use by running requests are pinned (refcounted) and never evicted; unpinned
    resident blocks sit in LRU order. `reserved` counts blocks promised to running requests that
    do not hold a hashed prefix block yet (uncomputed prompt blocks, partial tail, decode
    output), so admission can guarantee a request never runs out of KV mid-flight.
    """

    def __init__(self, capacity_blocks: int, block_tokens: int) -> None:
        if capacity_blocks <= 0 or block_tokens <= 0:
            raise ValueError("capacity_blocks and block_tokens must be positive")
        self.capacity_blocks = capacity_blocks
        self.block_tokens = block_tokens
        self._lru: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._pins: dict[int, int] = {}
        self.reserved = 0
        # Tokens looked up and found at admission, as vLLM counts its prefix-cache queries.
        self.query_tokens = 0
        self.hit_tokens = 0
        self.evicted_blocks = 0
        self._next_output = -1  # keys of kept output blocks: no prompt's hash is negative

    @property
    def resident_blocks(self) -> int:
        return len(self._lru) + len(self._pins)

    @property
    def used_blocks(self) -> int:
        """Blocks held or reserved by running requests (what vLLM reports as KV usage)."""
        return len(self._pins) + self.reserved

    @property
    def free_blocks(self) -> int:
        """Blocks holding nothing at all (evictable cached blocks are not counted)."""
        return self.capacity_blocks - len(self._lru) - len(self._pins) - self.reserved

    def hashes(self) -> list[int]:
        """Every resident block hash (pinned first, then unpinned oldest first)."""
        return [*self._pins, *self._lru]

    def match(self, hashes: Sequence[int], touch: bool = True) -> int:
        """Number of leading blocks resident; the chain is useless past the first miss."""
        lru, pins = self._lru, self._pins
        n = 0
        for h in hashes:
            if h not in lru and h not in pins:
                break
            n += 1
        if touch and n:
            # Head blocks become the most recent: losing a head orphans the whole chain.
            for h in reversed(hashes[:n]):
                if h in lru:
                    lru.move_to_end(h)
        return n

    def insert(self, hashes: Sequence[int]) -> int:
        """Make a chain resident and most recent (unpinned); returns blocks newly added."""
        added = 0
        for h in reversed(hashes):
            if h in self._pins:
                continue
            if h in self._lru:
                self._lru.move_to_end(h)
                continue
            if self.free_blocks <= 0 and not self._evict(1):
                break
            self._lru[h] = None
            added += 1
        return added

    def acquire(self, hashes: Sequence[int]) -> None:
        """Pin resident blocks for a running request."""
        lru, pins = self._lru, self._pins
        for h in hashes:
            if h in pins:
                pins[h] += 1
            else:
                del lru[h]
                pins[h] = 1

    def release(self, hashes: Sequence[int]) -> None:
        """Unpin blocks; tail first so the chain's head is the last to be evicted (as vLLM)."""
        lru, pins = self._lru, self._pins
        for h in reversed(hashes):
            left = pins[h] - 1
            if left:
                pins[h] = left
            else:
                del pins[h]
                lru[h] = None

    def keep_output(self, blocks: int) -> None:
        """A finished request's `blocks` full output blocks stay cached, the most recent (so,
        kept before its prompt is released, evicted before it, as vLLM frees tail first);
        they come from its reservation, just returned. No prompt ever matches them."""
        lru, key = self._lru, self._next_output
        for k in range(key, key - blocks, -1):
            if self.free_blocks <= 0 and not self._evict(1):
                break
            lru[k] = None
        self._next_output = key - blocks

    def reserve(self, blocks: int) -> bool:
        """Promise `blocks` to a request, evicting LRU blocks if needed; False if impossible."""
        short = blocks - self.free_blocks
        if short > 0 and not self._evict(short):
            return False
        self.reserved += blocks
        return True

    def unreserve(self, blocks: int) -> None:
        self.reserved -= blocks

    def commit(self, block_hash: int) -> None:
        """Turn one reserved block into the pinned, hashed block a request just computed."""
        self.reserved -= 1
        pins = self._pins
        if block_hash in pins:
            pins[block_hash] += 1
            return
        self._lru.pop(block_hash, None)
        pins[block_hash] = 1

    def clear(self) -> int:
        """Drop every unpinned block (vLLM's reset_prefix_cache); returns blocks dropped."""
        n = len(self._lru)
        self._lru.clear()
        self.evicted_blocks += n
        return n

    def _evict(self, blocks: int) -> bool:
        if blocks > len(self._lru):
            return False
        pop = self._lru.popitem
        for _ in range(blocks):
            pop(last=False)
        self.evicted_blocks += blocks
        return True
