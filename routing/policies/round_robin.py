"""Round robin: each replica in turn, blind to prefixes and load (the baseline)."""

from __future__ import annotations

from collections.abc import Sequence

from routing.policies.base import Policy, PrefixLookup
from routing.types import REASON_ROUND_ROBIN, Decision, ReplicaView, RoutingRequest


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._cursor = 0

    def choose(
        self, request: RoutingRequest, replicas: Sequence[ReplicaView], lookup: PrefixLookup
    ) -> Decision:
        ordered = sorted(replicas, key=lambda r: r.name)
        i = self._cursor % len(ordered)
        self._cursor += 1
        chosen = ordered[i]
        matched = lookup.matched_blocks(chosen.name, request.hashes)
        rest = ordered[i + 1 :] + ordered[:i]
        return Decision(
            replica=chosen.name,
            reason=REASON_ROUND_ROBIN,
            matched_blocks=matched,
            total_blocks=len(request.hashes),
            uncached_tokens=max(0.0, request.prompt_tokens - matched * request.block_tokens),
            fallbacks=[r.name for r in rest],
        )
