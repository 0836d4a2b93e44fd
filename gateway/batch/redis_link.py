"""The Batch API's Redis connection, and whether Redis is reachable (logged once per change)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError, TryAgainError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.config import RedisConfig

log = logging.getLogger("prefix_gateway.batch")

# What "Redis is not there right now" looks like: refused or dropped connections, timeouts,
# a restarted Redis still loading its AOF (BusyLoadingError is a ConnectionError), a replica
# that became read-only in a failover. Anything else is a bug, not an outage.
UNAVAILABLE: tuple[type[BaseException], ...] = (
    RedisConnectionError, RedisTimeoutError, ReadOnlyError, TryAgainError, OSError)


def shown_url(url: str) -> str:
    """The URL without its password, for logs and messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + netloc))


class RedisLink:
    """One redis-py asyncio client (its own connection pool) and the reachability state."""

    def __init__(self, cfg: RedisConfig,
                 on_change: Callable[[bool], None] | None = None) -> None:
        self.url = shown_url(cfg.url)
        self.prefix = cfg.key_prefix
        # One quick retry on a fresh connection covers the pooled connections a restarted
        # Redis left dead; longer outages are the runner's to wait out, with its own backoff.
        self.client = aioredis.Redis.from_url(
            cfg.url, socket_timeout=cfg.timeout_s, socket_connect_timeout=cfg.timeout_s,
            retry=Retry(ExponentialBackoff(cap=0.2, base=0.02), 1), health_check_interval=0)
        self.up: bool | None = None
        """None until the first command; then whether the last one reached Redis."""
        self._on_change = on_change

    def key(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    def mark_up(self) -> None:
        if self.up is not True:
            if self.up is False:
                log.warning("Redis at %s is reachable again: batches resume", self.url)
            else:
                log.info("Redis at %s reachable: the Batch API is on", self.url)
            self.up = True
            if self._on_change:
                self._on_change(True)

    def mark_down(self, exc: BaseException) -> None:
        if self.up is not False:
            when = "at start" if self.up is None else "now"
            log.warning("Redis at %s is not reachable %s (%s): batches pause and the Batch API "
                        "answers 503 until it is back (retrying in the background); chat and "
                        "completions are served as usual", self.url, when,
                        str(exc) or type(exc).__name__)
            self.up = False
            if self._on_change:
                self._on_change(False)

    async def aclose(self) -> None:
        await self.client.aclose()
