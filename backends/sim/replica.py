"""One simulated replica in real time: its spec, its EngineModel on the event loop's clock."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from backends.sim.engine import EngineModel, Event
from backends.sim.profiles import PROFILES

SimKind = Literal["vllm", "trtllm"]
DEFAULT_BLOCK_TOKENS: dict[str, int] = {"vllm": 16, "trtllm": 32}
# trtllm-serve keeps this many iteration stats for /metrics (iter_stats_max_iterations).
TRTLLM_ITER_STATS_KEPT = 1000


@dataclass(frozen=True)
class SimReplicaSpec:
    """How to build one simulated replica; port 0 picks a free port."""

    name: str = "sim"
    port: int = 0
    kind: SimKind = "vllm"
    models: tuple[str, ...] = ("tiny",)
    profile: str = "vllm-cpu-tiny"
    slowdown: float = 1.0  # the engine runs this many times slower than its profile
    time_scale: float = 1.0
    kv_capacity_tokens: int = 262_144
    block_tokens: int | None = None  # None: the engine kind's default (vLLM 16, trtllm 32)
    max_running: int | None = None  # None: the profile's
    trtllm_perf_metrics: bool = False  # mount /prometheus/metrics (return_perf_metrics)
    trtllm_legacy_metrics: bool = False  # 1.1.0rc5's five un-prefixed Prometheus names
    version: str | None = None  # /version; None: a version with this surface
    lazy_kv: bool = False  # KV taken as tokens need it, with preemption, as vLLM does
    cache_outputs: bool = False  # finished outputs' full blocks stay cached, as in vLLM

    def __post_init__(self) -> None:
        if self.kind not in DEFAULT_BLOCK_TOKENS:
            raise ValueError(f"kind must be 'vllm' or 'trtllm', not {self.kind!r}")
        if self.profile not in PROFILES:
            raise ValueError(f"unknown profile {self.profile!r}; known: {', '.join(PROFILES)}")
        if not self.slowdown > 0:
            raise ValueError(f"slowdown must be positive, not {self.slowdown!r}")
        if not self.models:
            raise ValueError("a replica serves at least one model name")

    @property
    def effective_block_tokens(self) -> int:
        return self.block_tokens or DEFAULT_BLOCK_TOKENS[self.kind]

    @property
    def effective_version(self) -> str:
        if self.version:
            return self.version
        if self.kind == "vllm":
            return "0.32.0"
        return "1.1.0rc5" if self.trtllm_legacy_metrics else "1.3.0rc27"


class RequestHandle:
    """What a handler waits on: tokens so far, first-token facts, completion."""

    __slots__ = (
        "_changed",
        "cached_tokens",
        "finish_reason",
        "finished",
        "first_token_time",
        "max_tokens",
        "prompt_tokens",
        "req_id",
        "tokens",
    )

    def __init__(self, req_id: str, prompt_tokens: int, max_tokens: int) -> None:
        self.req_id = req_id
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.tokens = 0
        self.cached_tokens = 0
        self.first_token_time: float | None = None
        self.finished = False
        self.finish_reason = ""
        self._changed = asyncio.Event()

    async def wait_change(self) -> None:
        """Return once tokens arrived or the request finished since the last call."""
        await self._changed.wait()
        self._changed.clear()


class SimReplica:
    """Drives an EngineModel in real time with one event-loop timer at its next step end.

    A timer rather than a sleeping task: a submit into a busy engine does not move the next
    event, so most submits cost no wake-up at all. Model time is `loop.time()`.
    """

    def __init__(self, spec: SimReplicaSpec) -> None:
        self.spec = spec
        self.block_tokens = spec.effective_block_tokens
        self.model = EngineModel(
            PROFILES[spec.profile].slowed(spec.slowdown),
            spec.kv_capacity_tokens,
            self.block_tokens,
            max_running=spec.max_running,
            time_scale=spec.time_scale,
            token_events=True,
            iteration_log=TRTLLM_ITER_STATS_KEPT if spec.kind == "trtllm" else 0,
            lazy_kv=spec.lazy_kv,
            cache_outputs=spec.cache_outputs,
        )
        self.port = spec.port
        self._handles: dict[str, RequestHandle] = {}
        self._ids = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None

    @property
    def max_model_len(self) -> int:
        return self.model.capacity_tokens

    def submit(
        self, block_hashes: Sequence[int], prompt_tokens: int, max_tokens: int
    ) -> RequestHandle:
        """Queue a request now; raises ValueError if it can never fit this engine."""
        now = asyncio.get_running_loop().time()
        self._dispatch(self.model.advance(now))
        req_id = f"{self.spec.name}-{next(self._ids)}"
        granted = self.model.submit(req_id, block_hashes, prompt_tokens, max_tokens, now)
        handle = RequestHandle(req_id, prompt_tokens, granted)
        self._handles[req_id] = handle
        self._schedule()
        return handle

    def abort(self, handle: RequestHandle) -> None:
        if handle.finished:
            return
        self._handles.pop(handle.req_id, None)
        if self.model.abort(handle.req_id):
            self._schedule()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._timer_at = None

    def _schedule(self) -> None:
        at = self.model.next_event_time()
        if at == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at
        self._timer = None if at is None else asyncio.get_running_loop().call_at(at, self._fire)

    def _fire(self) -> None:
        # The loop may fire a timer a clock-resolution early; the step is due regardless.
        now = max(asyncio.get_running_loop().time(), self._timer_at or 0.0)
        self._timer = self._timer_at = None
        self._dispatch(self.model.advance(now))
        self._schedule()

    def _dispatch(self, events: list[Event]) -> None:
        handles = self._handles
        for ev in events:
            handle = handles.get(ev.req_id)
            if handle is None:
                continue
            if ev.kind == "finished":
                handle.finished = True
                handle.finish_reason = ev.finish_reason
                del handles[ev.req_id]
            else:
                handle.tokens += ev.tokens
                if ev.kind == "first_token":
                    handle.cached_tokens = ev.cached_tokens
                    handle.first_token_time = ev.time
            handle._changed.set()
