"""Routing policies, one per module, each registering itself by name; built from configuration.

Adding a policy: a new module here that defines a `Policy` subclass decorated with
`@register` (with its own `Settings` model, if it takes settings), and its import below:
importing a policy's module is what registers it.
"""

from __future__ import annotations

from routing.policies.base import Policy, PolicySettings, PrefixLookup, load_bound
from routing.policies.consistent_hash import ConsistentHash
from routing.policies.least_load import LeastLoad
from routing.policies.prefix_affinity import PrefixAffinity
from routing.policies.registry import (
    PolicySettingsError,
    build_policy,
    describe_settings,
    policy_class,
    policy_names,
    register,
    settings_names,
    validate_settings,
)
from routing.policies.round_robin import RoundRobin

__all__ = [
    "ConsistentHash",
    "LeastLoad",
    "Policy",
    "PolicySettings",
    "PolicySettingsError",
    "PrefixAffinity",
    "PrefixLookup",
    "RoundRobin",
    "build_policy",
    "describe_settings",
    "load_bound",
    "policy_class",
    "policy_names",
    "register",
    "settings_names",
    "validate_settings",
]
