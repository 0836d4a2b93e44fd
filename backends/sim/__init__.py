"""The simulated engine replica: a pure cache and latency model, its HTTP surface and servers."""

from backends.sim.app import SimApp
from backends.sim.engine import EngineModel, Event
from backends.sim.kv_cache import PrefixCache
from backends.sim.messages import SimResponse
from backends.sim.profiles import PROFILES, LatencyProfile
from backends.sim.replica import SimReplica, SimReplicaSpec

__all__ = [
    "PROFILES",
    "EngineModel",
    "Event",
    "LatencyProfile",
    "PrefixCache",
    "SimApp",
    "SimReplica",
    "SimReplicaSpec",
    "SimResponse",
]
