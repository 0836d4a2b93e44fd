"""The simulated engine replica: a pure cache and latency model, and its HTTP servers."""

from backends.sim.engine import EngineModel, Event
from backends.sim.kv_cache import PrefixCache
from backends.sim.profiles import PROFILES, LatencyProfile
from backends.sim.replica import SimReplica, SimReplicaSpec

__all__ = [
    "PROFILES",
    "EngineModel",
    "Event",
    "LatencyProfile",
    "PrefixCache",
    "SimReplica",
    "SimReplicaSpec",
]
