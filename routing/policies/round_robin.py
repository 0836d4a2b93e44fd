"""Round robin: each replica in turn, blind to prefixes and load (the baseline)."""

from __future__ import annotations

from collections.abc import Sequence

from routing.policies.base import Policy, PolicySettings, PrefixLookup, decide
from routing.policies.registry import register
from routing.types import REASON_ROUND_ROBIN, Decision, ReplicaView, RoutingRequest


@register
class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self, settings: PolicySettings | None = None) -> None:
        super().__init__(settings)
        self._cursor = 0

    def choose(
        self, request: RoutingRequest, replicas: Sequence[ReplicaView], lookup: PrefixLookup
    ) -> Decision:
        ordered = sorted(replicas, key=lambda r: r.name)
        i = self._cursor % len(ordered)
        self._cursor += 1
        rest = ordered[i + 1 :] + ordered[:i]
        return decide(request, lookup, ordered[i].name, REASON_ROUND_ROBIN,
                      [r.name for r in rest])
