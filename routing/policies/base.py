"""The one interface every routing policy implements, and the helpers policies share."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar, Protocol

from pydantic import BaseModel, ConfigDict

from routing.types import Decision, ReplicaView, RoutingRequest


class PrefixLookup(Protocol):
    """Read access to the per-replica prefix indexes."""

    def matched_blocks(self, replica: str, hashes: Sequence[int]) -> int: ...


class PolicySettings(BaseModel):
    """A policy's own settings: each policy subclasses this with its fields and defaults."""

    # A misspelt setting must be an error: silently routing with a default while the operator
    # believes otherwise is the failure this guards against.
    model_config = ConfigDict(extra="forbid", frozen=True)


class Policy(ABC):
    """Chooses one replica for a request from a snapshot of healthy replicas.

    `choose` is a function of the request, the snapshot, the index and the state the policy
    keeps. That state changes only through the hooks, which the router calls for every request
    however it was routed (first choice or retry); they do nothing unless a policy needs them.
    """

    name: ClassVar[str]
    Settings: ClassVar[type[PolicySettings]] = PolicySettings

    def __init__(self, settings: PolicySettings | None = None) -> None:
        self.settings = settings if settings is not None else self.Settings()

    @abstractmethod
    def choose(
        self, request: RoutingRequest, replicas: Sequence[ReplicaView], lookup: PrefixLookup
    ) -> Decision:
        """Pick a replica; `replicas` is non-empty and holds only healthy members."""

    # The hooks are optional, so not abstract: a policy overrides those it needs.
    def on_routed(self, request: RoutingRequest, decision: Decision) -> None:  # noqa: B027
        """The request is about to be sent as `decision` says (a first choice or a retry)."""

    def on_remote_routed(self, replica: str, uncached_tokens: float) -> None:  # noqa: B027
        """Another gateway sharing this one's routing state sent a request to `replica`,
        costing it `uncached_tokens` of prefill (Router.apply_remote_inserts)."""

    def on_finished(self, decision: Decision, saw_first_token: bool) -> None:  # noqa: B027
        """The attempt `decision` ended: answered, failed or abandoned."""

    def on_load_update(  # noqa: B027
        self, replica: str, inflight: int, pending_prefill_tokens: float
    ) -> None:
        """The router's load count of `replica` changed (dispatch, first token or finish)."""

    def on_removed(self, replica: str) -> None:  # noqa: B027
        """`replica` left the pool (it drains, or was replaced): forget what is kept of it."""


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
