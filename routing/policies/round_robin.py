"""Round robin: each replica in turn, blind to prefixes and load (the baseline)."""

from __future__ import annotations

from collections.abc import Sequence

from routing.policies.base import Policy, PrefixLookup, decide
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
        rest = ordered[i + 1 :] + ordered[:i]
        return decide(request, lookup, ordered[i].name, REASON_ROUND_ROBIN,
                      [r.name for r in rest])
