"""Consistent hashing with bounded loads: the prefix key's rendezvous owner unless it is full."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from routing import rendezvous
from routing.policies.base import Policy, PolicySettings, PrefixLookup, decide, load_bound
from routing.policies.registry import register
from routing.types import REASON_HASH, REASON_OVERFLOW, Decision, ReplicaView, RoutingRequest


class ConsistentHashSettings(PolicySettings):
    load_factor: float = Field(1.25, ge=1.0, description="bounded-load factor c: no replica "
                               "above ceil(c x mean in-flight)")


@register
class ConsistentHash(Policy):
    name = "consistent_hash"
    Settings = ConsistentHashSettings
    settings: ConsistentHashSettings

    def __init__(self, settings: ConsistentHashSettings | None = None) -> None:
        super().__init__(settings)
        self.load_factor = self.settings.load_factor

    def choose(
        self, request: RoutingRequest, replicas: Sequence[ReplicaView], lookup: PrefixLookup
    ) -> Decision:
        by_name = {r.name: r for r in replicas}
        ranked = rendezvous.rank(request.key, by_name)
        bound = load_bound(replicas, self.load_factor)
        # Walk the key's preference list to the first replica with room (the bounded-load rule).
        chosen = next((n for n in ranked if by_name[n].inflight + 1 <= bound), None)
        if chosen is None:
            chosen = min(ranked, key=lambda n: by_name[n].inflight)
        reason = REASON_HASH if chosen == ranked[0] else REASON_OVERFLOW
        return decide(request, lookup, chosen, reason, [n for n in ranked if n != chosen])
