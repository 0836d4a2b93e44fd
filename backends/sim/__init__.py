"""The simulated engine replica: a pure cache and latency model, and its HTTP servers."""

from backends.sim.model import PROFILES, EngineModel, Event, LatencyProfile, PrefixCache
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
