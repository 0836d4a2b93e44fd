"""The one interface every routing policy implements."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar, Protocol

from routing.types import Decision, ReplicaView, RoutingRequest


class PrefixLookup(Protocol):
    """Read access to the per-replica prefix indexes."""

    def matched_blocks(self, replica: str, hashes: Sequence[int]) -> int: ...


class Policy(ABC):
    """Chooses one replica for a request from a snapshot of healthy replicas.

    Policies are pure: the same request, snapshot and index give the same decision. State a
    policy keeps between calls (a round-robin cursor) lives on the instance.
    """

    name: ClassVar[str]

    @abstractmethod
    def choose(
        self, request: RoutingRequest, replicas: Sequence[ReplicaView], lookup: PrefixLookup
    ) -> Decision:
        """Pick a replica; `replicas` is non-empty and holds only healthy members."""


def load_bound(replicas: Sequence[ReplicaView], factor: float) -> int:
    """Consistent hashing with bounded loads (Mirrokni et al. 2018).

    A replica may take the request while its in-flight count stays within
    ceil(factor * (total + 1) / n); with factor >= 1 the least-loaded replica always fits.
    """
    total = sum(r.inflight for r in replicas)
    return max(1, math.ceil(factor * (total + 1) / len(replicas)))


def decide(request: RoutingRequest, lookup: PrefixLookup, replica: str, reason: str,
           fallbacks: list[str]) -> Decision:
    """A decision for `replica`, with what its index says it holds of the request's prefix."""
    matched = lookup.matched_blocks(replica, request.hashes)
    return Decision(
        replica=replica,
        reason=reason,
        matched_blocks=matched,
        total_blocks=len(request.hashes),
        uncached_tokens=max(0.0, request.prompt_tokens - matched * request.block_tokens),
        fallbacks=fallbacks,
    )
