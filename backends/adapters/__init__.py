"""Engine adapters by kind: the only place that knows an engine's paths and metric names."""

from __future__ import annotations

from backends.adapters.base import EngineAdapter, EngineSnapshot, Probe
from backends.adapters.trtllm import TrtllmAdapter
from backends.adapters.vllm import VllmAdapter


def adapter_for(kind: str) -> EngineAdapter:
    """The adapter for an engine kind (simulated replicas speak one of the two surfaces)."""
    if kind == "vllm":
        return VllmAdapter()
    if kind == "trtllm":
        return TrtllmAdapter()
    raise ValueError(f"unknown engine kind {kind!r}; expected vllm or trtllm")


__all__ = [
    "EngineAdapter",
    "EngineSnapshot",
    "Probe",
    "TrtllmAdapter",
    "VllmAdapter",
    "adapter_for",
]
