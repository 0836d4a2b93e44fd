"""Rendezvous (highest-random-weight) hashing: every router picks the same owner for a key."""

from __future__ import annotations

from collections.abc import Iterable

import xxhash


def weight(key: int, replica: str) -> int:
    """The replica's pseudo-random weight for `key`; the highest weight owns the key."""
    return xxhash.xxh3_64_intdigest(replica.encode(), seed=key & 0xFFFFFFFFFFFFFFFF)


def rank(key: int, replicas: Iterable[str]) -> list[str]:
    """Replicas ordered by preference for `key` (owner first).

    Removing a replica only moves the keys it owned, and independent routers with the same
    replica names agree on the order without sharing any state.
    """
    return sorted(replicas, key=lambda name: weight(key, name), reverse=True)
