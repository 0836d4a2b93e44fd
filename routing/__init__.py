"""Pure routing logic: prefix hashing, per-replica prefix indexes, load bounds and policies.

Nothing here does I/O, so the gateway, the benchmarks and the offline simulator all run the
same decisions, and a policy can be unit-tested in microseconds.
"""

from routing.hashing import chain_hashes, char_block_hashes, key_hash, token_block_hashes
from routing.load import LoadTracker
from routing.policies import Policy, PolicySettings, build_policy, policy_names, register
from routing.prefix_index import PrefixIndex
from routing.prompt import render_chat, render_completion
from routing.router import Router
from routing.types import Decision, ReplicaView, RoutingRequest

__all__ = [
    "Decision",
    "LoadTracker",
    "Policy",
    "PolicySettings",
    "PrefixIndex",
    "ReplicaView",
    "Router",
    "RoutingRequest",
    "build_policy",
    "chain_hashes",
    "char_block_hashes",
    "key_hash",
    "policy_names",
    "register",
    "render_chat",
    "render_completion",
    "token_block_hashes",
]
