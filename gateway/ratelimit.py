"""Rate limits per client key and per traffic class: sliding one-minute windows of requests
and tokens, counted in Redis when one is configured (shared by every gateway), else here."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway.auth import ClientKey
from gateway.config import GatewayConfig, RateLimitConfig
from gateway.errors import GatewayError
from gateway.redis_link import UNAVAILABLE, Messages, RedisLink

if TYPE_CHECKING:
    from redis.asyncio import Redis

log = logging.getLogger("prefix_gateway.ratelimit")

WINDOW_S = 60.0


@dataclass(frozen=True, slots=True)
class Budget:
    """One limit to charge: a counter name, its limit per minute, and this request's cost."""

    name: str
    """e.g. `key:alice:requests`, `class:batch:tokens`."""
    limit: int
    cost: int


def wait_s(limit: int, cost: int, cur: float, prev: float, fraction: float) -> float:
    """Seconds until `cost` fits under `limit`, given this window's count `cur`, the previous
    window's `prev`, and how far into this window we are (0..1); 0: it fits now.

    The sliding window is estimated as prev x (share of the previous window still inside the
    last minute) + cur: smooth at window edges, two counters per budget.
    """
    if prev * (1.0 - fraction) + cur + cost <= limit:
        return 0.0
    room = limit - cur - cost
    if room >= 0 and prev > 0:  # the previous window's share decays enough within this one
        return max(WINDOW_S * (1.0 - fraction - room / prev), 0.001)
    # Only the next window can hold it: then this window becomes the previous one.
    after = WINDOW_S * (1.0 - fraction)
    if cost > limit:
        return math.inf
    return after + (WINDOW_S * (1.0 - (limit - cost) / cur) if cur > 0 else 0.0)


class RateLimited(GatewayError):
    """429 with Retry-After: a key's or a class's budget for this minute is spent."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(429, message, type="rate_limit_error", code="rate_limit_exceeded",
                         headers=[(b"retry-after", str(retry_after).encode())])


def rate_limited(budget: Budget, wait: float, who: str) -> RateLimited:
    kind = budget.name.rsplit(":", 1)[1]  # requests or tokens
    if math.isinf(wait):
        message = (f"Request too large for {who}: it needs {budget.cost} {kind} and the limit "
                   f"is {budget.limit} {kind} per minute.")
        retry = int(WINDOW_S)
    else:
        retry = max(1, math.ceil(wait))
        message = (f"Rate limit reached for {who}: {budget.limit} {kind} per minute. Retry "
                   f"after {retry} s.")
    return RateLimited(message, retry)


class MemoryCounter:
    """The windows in this process (no Redis, or while Redis is unreachable)."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, int], float] = {}

    def charge(self, budgets: Sequence[Budget], now: float) -> tuple[float, int]:
        """(0, -1) and every budget charged; or (seconds to wait, index of the budget that
        refused) and nothing charged."""
        idx = int(now // WINDOW_S)
        fraction = (now - idx * WINDOW_S) / WINDOW_S
        for i, b in enumerate(budgets):
            w = wait_s(b.limit, b.cost, self.counts.get((b.name, idx), 0),
                       self.counts.get((b.name, idx - 1), 0), fraction)
            if w:
                return w, i
        for b in budgets:
            self.counts[(b.name, idx)] = self.counts.get((b.name, idx), 0) + b.cost
        if len(self.counts) > 4 * len(budgets) + 1024:  # drop windows older than the previous
            self.counts = {k: v for k, v in self.counts.items() if k[1] >= idx - 1}
        return 0.0, -1


# All budgets of a request checked, then charged, in one atomic step on Redis's own clock (so
# gateways with skewed clocks share the same windows). KEYS: one prefix per budget; ARGV:
# limit and cost per budget. Returns {0} when charged, else {wait seconds (a string), index}.
_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local idx = math.floor(now / 60)
local fraction = (now - idx * 60) / 60
for i = 1, #KEYS do
  local limit = tonumber(ARGV[2 * i - 1])
  local cost = tonumber(ARGV[2 * i])
  local cur = tonumber(redis.call('GET', KEYS[i] .. ':' .. idx) or '0')
  local prev = tonumber(redis.call('GET', KEYS[i] .. ':' .. (idx - 1)) or '0')
  if prev * (1 - fraction) + cur + cost > limit then
    return {1, tostring(cur), tostring(prev), tostring(fraction), i - 1}
  end
end
for i = 1, #KEYS do
  local key = KEYS[i] .. ':' .. idx
  redis.call('INCRBY', key, ARGV[2 * i])
  redis.call('EXPIRE', key, 150)
end
return {0}
"""


_MESSAGES = Messages(
    log, down="rate limits: Redis at {url} is not reachable ({error}): counting in this "
    "gateway alone until it is back",
    back="rate limits: Redis at {url} is reachable again: budgets shared again")


class RedisCounter:
    """The windows in Redis: one budget for every gateway sharing the Redis and key prefix."""

    def __init__(self, link: RedisLink) -> None:
        self.link = link
        self.prefix = link.prefix + "ratelimit:"
        self.script = link.client.register_script(_SCRIPT)

    async def charge(self, budgets: Sequence[Budget]) -> tuple[float, int] | None:
        """As MemoryCounter.charge; None when Redis cannot be reached."""
        args: list[int] = []
        for b in budgets:
            args += [b.limit, b.cost]
        try:
            out = await self.script(keys=[self.prefix + b.name for b in budgets], args=args)
        except UNAVAILABLE as exc:
            self.link.mark_down(exc)
            return None
        self.link.mark_up()
        if int(out[0]) == 0:
            return 0.0, -1
        cur, prev, fraction, i = float(out[1]), float(out[2]), float(out[3]), int(out[4])
        b = budgets[i]
        return wait_s(b.limit, b.cost, cur, prev, fraction) or 0.001, i

    async def aclose(self) -> None:
        await self.link.aclose()


class RateLimiter:
    """Charges each request to its key's and its class's budgets, or refuses it with 429."""

    def __init__(self, config: GatewayConfig, client: Redis | None = None) -> None:
        """`client`: the gateway's Redis client, shared (else the limiter makes its own)."""
        self.classes: dict[str, RateLimitConfig] = dict(config.rate_limits.classes)
        self.default_max_tokens = config.rate_limits.default_max_tokens
        self.active = bool(self.classes) or any(k.limits for k in config.auth.api_keys)
        """Some budget is configured (else no request is charged)."""
        self.memory = MemoryCounter()
        self.redis: RedisCounter | None = None
        if config.redis is not None and self.active:
            self.redis = RedisCounter(RedisLink(config.redis, client=client,
                                                messages=_MESSAGES))

    def budgets(self, client: ClientKey | None, cls: str,
                tokens: int) -> list[tuple[Budget, str]]:
        out: list[tuple[Budget, str]] = []
        for limits, prefix, who in (
                (client.limits if client else None, f"key:{client.name if client else ''}",
                 f"API key {client.name!r}" if client else ""),
                (self.classes.get(cls), f"class:{cls}", f"traffic class {cls!r}")):
            if limits is None:
                continue
            if limits.requests_per_minute is not None:
                out.append((Budget(prefix + ":requests", limits.requests_per_minute, 1), who))
            if limits.tokens_per_minute is not None:
                out.append((Budget(prefix + ":tokens", limits.tokens_per_minute, tokens), who))
        return out

    def tokens(self, payload: dict, body_bytes: int) -> int:
        """What a request is charged in tokens: its body's bytes / 4 (a prompt estimate that
        needs no tokenizer) plus the output it may ask for."""
        out = payload.get("max_completion_tokens", payload.get("max_tokens"))
        if not isinstance(out, int) or isinstance(out, bool) or out < 0:
            out = self.default_max_tokens
        n = payload.get("n")
        if isinstance(n, int) and not isinstance(n, bool) and n > 1:
            out *= n
        return body_bytes // 4 + out

    async def charge(self, client: ClientKey | None, cls: str, payload: dict,
                     body_bytes: int) -> None:
        """Charge the request, or raise a 429 GatewayError (with Retry-After)."""
        pairs = self.budgets(client, cls, self.tokens(payload, body_bytes))
        if not pairs:
            return
        budgets = [b for b, _ in pairs]
        result = None
        if self.redis is not None:
            result = await self.redis.charge(budgets)
        if result is None:
            result = self.memory.charge(budgets, time.time())
        wait, i = result
        if wait:
            raise rate_limited(budgets[i], wait, pairs[i][1])

    async def aclose(self) -> None:
        if self.redis is not None:
            await self.redis.aclose()
