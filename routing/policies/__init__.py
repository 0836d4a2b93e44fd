"""Routing policies, one per module, built by name from configuration."""

from __future__ import annotations

import inspect
from typing import Any

from routing.policies.base import Policy, PrefixLookup, load_bound
from routing.policies.consistent_hash import ConsistentHash
from routing.policies.least_load import LeastLoad
from routing.policies.prefix_affinity import PrefixAffinity
from routing.policies.round_robin import RoundRobin

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (RoundRobin, LeastLoad, ConsistentHash, PrefixAffinity)
}


def build_policy(name: str, **params: Any) -> Policy:
    """Build a policy from its configured name and the routing settings."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}") from None
    # Settings are shared across policies (load_factor matters to two of them); each policy
    # takes the ones its constructor names and ignores the rest.
    accepted = inspect.signature(cls).parameters
    return cls(**{k: v for k, v in params.items() if k in accepted})


__all__ = [
    "POLICIES",
    "ConsistentHash",
    "LeastLoad",
    "Policy",
    "PrefixAffinity",
    "PrefixLookup",
    "RoundRobin",
    "build_policy",
    "load_bound",
]
