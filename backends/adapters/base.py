"""The one interface the gateway uses to ask any engine kind about its health and state."""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from backends.upstream import Timeouts, Upstream, UpstreamError


@dataclass(slots=True)
class EngineSnapshot:
    """What an engine says about itself, normalised across engine kinds and versions."""

    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    """KV cache usage, 0-1."""
    prefix_hit_tokens: float | None = None
    """Cumulative prefix-cache hits, in tokens."""
    prefix_query_tokens: float | None = None
    """Cumulative prefix-cache lookups, in tokens."""
    block_size: int | None = None
    """Tokens per KV block."""
    num_blocks: int | None = None
    """KV blocks the engine has (its cache capacity)."""
    computed_prompt_tokens: float | None = None
    """Cumulative prompt tokens the engine computed (not served from its prefix cache)."""
    prefill_seconds: float | None = None
    """Cumulative seconds requests spent in prefill (the prefill-time histogram's sum)."""
    prefills: float | None = None
    """How many requests `prefill_seconds` counts (the prefill-time histogram's count)."""
    first_tokens: float | None = None
    """Cumulative first tokens the engine has produced (counted as each prefill ends, not
    when the request finishes): ends the prefills of requests the gateway passed through."""
    prefills_waiting: float | None = None
    """Requests the engine holds that have not yet produced their first token, queued or
    prefilling (at most: those finishing their prefill in the step read count too). Read
    where an engine reports no `first_tokens`, to bound the gateway's estimate of when the
    prefills of requests it passed through end."""
    prefills_waiting_lag_s: float | None = None
    """How long before the read `prefills_waiting` may be as of: an engine that counts as a
    step ends reports the newest step that ended, and the one in flight since may have run
    about as long."""
    source: str = ""
    """Which surface or metric-name generation the values came from."""

    @property
    def capacity_tokens(self) -> int | None:
        if self.block_size and self.num_blocks:
            return self.block_size * self.num_blocks
        return None


class Probe(enum.Enum):
    """A liveness check's outcome; a timeout is weaker evidence than a refusal or a 503."""

    OK = "ok"
    DEAD = "dead"
    TIMEOUT = "timeout"


class EngineAdapter(ABC):
    """Engine-specific knowledge (paths, metric names) lives only behind this interface."""

    kind: str
    health_path: str = "/health"
    default_block_size: int = 16

    async def probe(self, upstream: Upstream, base_url: str, timeout: float) -> Probe:
        """OK when the engine answers its liveness check with 200."""
        return (await self.check(upstream, base_url, timeout))[0]

    async def check(self, upstream: Upstream, base_url: str,
                    timeout: float) -> tuple[Probe, str]:
        """The liveness check's outcome and, unless OK, why (for the logs)."""
        try:
            resp = await upstream.request("GET", base_url + self.health_path,
                                          timeouts=Timeouts(total=timeout))
        except UpstreamError as exc:
            return (Probe.TIMEOUT if exc.timed_out else Probe.DEAD), str(exc)
        try:
            await resp.read()
        except UpstreamError as exc:
            return (Probe.TIMEOUT if exc.timed_out else Probe.DEAD), str(exc)
        finally:
            resp.release()
        if resp.status == 200:
            return Probe.OK, ""
        return Probe.DEAD, f"{self.health_path} answered HTTP {resp.status}"

    @abstractmethod
    async def scrape(
        self, upstream: Upstream, base_url: str, timeout: float
    ) -> EngineSnapshot | None:
        """Read the engine's load and cache state; None when it exposes nothing usable."""

    async def read_counts(
        self, upstream: Upstream, base_url: str, timeout: float
    ) -> EngineSnapshot | None:
        """Read at least the counts that end passed-through prefills
        (`EngineSnapshot.first_tokens`, `prefills_waiting`), between scrapes: by default the
        whole scrape; an engine whose counts are on a page of their own reads that alone."""
        return await self.scrape(upstream, base_url, timeout)

    async def tokenize(self, upstream: Upstream, base_url: str, payload: dict[str, Any],
                       chat: bool, headers: Mapping[str, str]) -> list[int] | None:
        """The engine's own token ids for a request's prompt; None when it cannot tell."""
        return None

    def forget(self, base_url: str) -> None:
        """The replica at `base_url` left the pool: drop what was kept of it (none here)."""
        return None
