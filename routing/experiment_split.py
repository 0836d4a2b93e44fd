"""Which side of a split experiment a prefix falls on: a pure, stable function of the prefix."""

from __future__ import annotations

import xxhash

_MASK = 0xFFFFFFFFFFFFFFFF


def candidate_side(prefix_key: int, experiment: str, fraction: float) -> bool:
    """True when requests whose prefix hashes to `prefix_key` go to the candidate arm.

    The side depends only on the prefix and the experiment's name, so one prefix keeps one
    side (both arms keep warm caches) and every gateway agrees without sharing state; a new
    name reshuffles the sides.
    """
    if fraction <= 0.0:
        return False
    if fraction >= 1.0:
        return True
    h = xxhash.xxh64_intdigest(experiment.encode(), seed=prefix_key & _MASK)
    # The top 53 bits as a float in [0, 1): exact, so the cut at `fraction` is exact too.
    return (h >> 11) * 2.0 ** -53 < fraction
