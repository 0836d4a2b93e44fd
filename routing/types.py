"""The values routing reads and returns: a request's prefix, a replica's state, a decision."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class RoutingRequest:
    """What a policy knows about one request: its chained block hashes and size."""

    hashes: list[int]
    prompt_tokens: float
    """Estimated prompt length in tokens (characters / chars_per_token when untokenised)."""
    block_tokens: float
    """Estimated tokens per hashed block."""
    key: int
    """Stable key of the request's leading prefix, for rendezvous hashing."""
    traffic_class: str = ""
    prompt_chars: int = 0
    """Characters of the canonical prompt, when hashed as characters (else 0)."""
    output_tokens: float = 0.0
    """The most it may generate (its max_tokens), in the engine's tokens; 0 when unknown."""


@dataclass(slots=True)
class ReplicaView:
    """A snapshot of one replica as routing sees it."""

    name: str
    inflight: int = 0
    pending_prefill_tokens: float = 0.0
    """Estimated uncached prompt tokens of requests sent there and not yet past first token."""
    engine_waiting: int = 0
    """Requests the engine itself reports as queued (from its metrics), when known."""
    kv_usage: float | None = None
    step_wait_tokens: float = 0.0
    """Time until the engine step in flight there ends (a request sent now waits for it),
    estimated from its streamed chunks and priced in prompt tokens at the prefill rate."""
    prefill_left_tokens: float | None = None
    """Pending prefill less what the engine has presumably computed of it since it was sent
    (the learned prefill rate times the time it had it): None when not estimated."""
    speed: float = 1.0
    """Its learned prefill rate over its pool's (1.0 until learned): 0.33 for a replica three
    times slower than the pool's mean, so a policy can price its prefill by its own rate."""
    busy_speed: float | None = None
    """Until `speed` is learned, its prefill throughput while busy over the pool's median
    (1.0 within the same tolerance); None once `speed` is learned, or before either is."""


@dataclass(slots=True)
class Decision:
    """The replica chosen for a request, why, and what routing expected of it."""

    replica: str
    reason: str
    matched_blocks: int
    total_blocks: int
    uncached_tokens: float
    fallbacks: list[str] = field(default_factory=list)
    """Other replicas in order of preference, for a retry before the first byte."""
    hashes: Sequence[int] = ()
    """The request's prefix blocks, which the router pins in the replica's index while the
    request runs there (set by `Router.route` and `Router.reroute`)."""
    output_blocks: int = 0
    """Blocks of the replica's index reserved for its output while it runs (`pin_running`)."""

    @property
    def matched_fraction(self) -> float:
        return self.matched_blocks / self.total_blocks if self.total_blocks else 0.0


# Routing reasons, as they appear in metrics and stats.
REASON_AFFINITY = "affinity"  # went where its longest cached prefix is
REASON_COLD = "cold"  # no replica holds any of its prefix: rendezvous home
REASON_OVERFLOW = "overflow"  # its prefix's home was over the load bound
REASON_HASH = "hash"  # consistent hashing chose the key's home
REASON_ROUND_ROBIN = "round_robin"
REASON_LEAST_LOAD = "least_load"
REASON_RETRY = "retry"  # a fallback tried after its first choice failed before any byte
