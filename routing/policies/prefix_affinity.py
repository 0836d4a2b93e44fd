"""Prefix affinity: the replica holding the longest prefix, within a bound on load and cost."""

from __future__ import annotations

from collections.abc import Sequence

from routing import rendezvous
from routing.policies.base import Policy, PrefixLookup, load_bound
from routing.types import (
    REASON_AFFINITY,
    REASON_COLD,
    REASON_OVERFLOW,
    Decision,
    ReplicaView,
    RoutingRequest,
)


class PrefixAffinity(Policy):
    """Longest cached prefix first, but never onto a replica that is too busy to benefit.

    Three steps, each guarding against a failure seen in real routers:
    1. Bounded load: only replicas whose in-flight count stays within ceil(c * mean) are
       eligible, so a hot system prompt spreads over a few replicas instead of melting one.
    2. Cost: each eligible replica's estimated prefill work if chosen, its own uncached tokens
       plus `load_weight` times the uncached prefill already queued there. Replicas within
       `slack` of the cheapest stay candidates: cache hits are worth a little queueing, not a lot.
    3. Among those, the longest matched prefix wins; ties (notably a prefix nobody holds yet)
       go to the rendezvous owner of the prefix key, so independent gateways agree on a cold
       prefix's home and distinct cold prefixes spread evenly from their first request.
    """

    name = "prefix_affinity"

    def __init__(
        self,
        load_factor: float = 1.25,
        load_weight: float = 1.0,
        slack_fraction: float = 0.25,
        slack_tokens: float = 256.0,
    ) -> None:
        if load_factor < 1.0:
            raise ValueError("load_factor must be >= 1 (below 1 no replica may take a request)")
        self.load_factor = load_factor
        self.load_weight = load_weight
        self.slack_fraction = slack_fraction
        self.slack_tokens = slack_tokens

    def choose(
        self, request: RoutingRequest, replicas: Sequence[ReplicaView], lookup: PrefixLookup
    ) -> Decision:
        hashes = request.hashes
        prompt_tokens = request.prompt_tokens
        block_tokens = request.block_tokens
        bound = load_bound(replicas, self.load_factor)
        key = request.key
        w = self.load_weight

        # (cost, matched, weight, uncached, eligible, name)
        rows: list[tuple[float, int, int, float, bool, str]] = []
        best_match = 0
        for r in replicas:
            matched = lookup.matched_blocks(r.name, hashes) if hashes else 0
            if matched > best_match:
                best_match = matched
            uncached = max(0.0, prompt_tokens - matched * block_tokens)
            cost = uncached + w * r.pending_prefill_tokens
            eligible = r.inflight + 1 <= bound
            rows.append((cost, matched, rendezvous.weight(key, r.name), uncached, eligible, r.name))

        eligible_rows = [row for row in rows if row[4]]
        if not eligible_rows:
            least = min(r.inflight for r in replicas)
            eligible_rows = [row for row, r in zip(rows, replicas, strict=True)
                             if r.inflight == least]
        min_cost = min(row[0] for row in eligible_rows)
        slack = self.slack_fraction * prompt_tokens + self.slack_tokens
        near = [row for row in eligible_rows if row[0] <= min_cost + slack]
        chosen = max(near, key=lambda row: (row[1], row[2]))

        if best_match == 0:
            owner = max(rows, key=lambda row: row[2])
            reason = REASON_COLD if chosen is owner else REASON_OVERFLOW
        else:
            reason = REASON_AFFINITY if chosen[1] >= best_match else REASON_OVERFLOW

        others = sorted(
            (row for row in rows if row is not chosen),
            key=lambda row: (not row[4], row[0], -row[1], -row[2]),
        )
        return Decision(
            replica=chosen[5],
            reason=reason,
            matched_blocks=chosen[1],
            total_blocks=len(hashes),
            uncached_tokens=chosen[3],
            fallbacks=[row[5] for row in others],
        )
