"""Least load: the replica with the fewest requests in flight, then the least queued prefill."""

from __future__ import annotations

from collections.abc import Sequence

from routing import rendezvous
from routing.policies.base import Policy, PrefixLookup, decide
from routing.policies.registry import register
from routing.types import REASON_LEAST_LOAD, Decision, ReplicaView, RoutingRequest


@register
class LeastLoad(Policy):
    name = "least_load"

    def choose(
        self, request: RoutingRequest, replicas: Sequence[ReplicaView], lookup: PrefixLookup
    ) -> Decision:
        # Ties go by rendezvous weight, not list order, so an idle fleet is not always
        # filled from its first replica.
        ordered = sorted(
            replicas,
            key=lambda r: (
                r.inflight + r.engine_waiting,
                r.pending_prefill_tokens,
                -rendezvous.weight(request.key, r.name),
            ),
        )
        return decide(request, lookup, ordered[0].name, REASON_LEAST_LOAD,
                      [r.name for r in ordered[1:]])
