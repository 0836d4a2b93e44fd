"""The gateway's Redis connection, and whether Redis is reachable (logged once per change).

One redis-py client (one connection pool) serves everything a gateway keeps in Redis: the
Batch API, shared rate limits and shared routing state. Each of them holds its own
`RedisLink` on that client, since each says in its own words what an outage means for it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError, TryAgainError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.config import RedisConfig

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


def connect(cfg: RedisConfig) -> aioredis.Redis:
    """A client with the gateway's timeouts. One quick retry on a fresh connection covers the
    pooled connections a restarted Redis left dead; longer outages are each user's to wait
    out, with its own backoff."""
    return aioredis.Redis.from_url(
        cfg.url, socket_timeout=cfg.timeout_s, socket_connect_timeout=cfg.timeout_s,
        retry=Retry(ExponentialBackoff(cap=0.2, base=0.02), 1), health_check_interval=0)


@dataclass(frozen=True, slots=True)
class Messages:
    """What a user of the link logs: `{url}`, `{when}` ("at start", "now") and `{error}` are
    filled in. `first`: Redis answered for the first time (None: nothing logged)."""

    log: logging.Logger
    down: str
    back: str
    first: str | None = None


BATCH = Messages(
    logging.getLogger("prefix_gateway.batch"),
    down="Redis at {url} is not reachable {when} ({error}): batches pause and the Batch API "
    "answers 503 until it is back (retrying in the background); chat and completions are "
    "served as usual",
    back="Redis at {url} is reachable again: batches resume",
    first="Redis at {url} reachable: the Batch API is on")


class RedisLink:
    """A client (shared, or its own) and whether Redis answered the last command sent through
    this link: each change is logged once, in the user's words, and told to `on_change`."""

    def __init__(self, cfg: RedisConfig, on_change: Callable[[bool], None] | None = None, *,
                 client: aioredis.Redis | None = None, messages: Messages = BATCH) -> None:
        self.url = shown_url(cfg.url)
        self.prefix = cfg.key_prefix
        self._owns = client is None
        self.client = client if client is not None else connect(cfg)
        self.up: bool | None = None
        """None until the first command; then whether the last one reached Redis."""
        self._on_change = on_change
        self.messages = messages

    def key(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    def mark_up(self) -> None:
        if self.up is not True:
            m = self.messages
            if self.up is False:
                m.log.warning(m.back.format(url=self.url))
            elif m.first is not None:
                m.log.info(m.first.format(url=self.url))
            self.up = True
            if self._on_change:
                self._on_change(True)

    def mark_down(self, exc: BaseException) -> None:
        if self.up is not False:
            m = self.messages
            when = "at start" if self.up is None else "now"
            m.log.warning(m.down.format(url=self.url, when=when,
                                        error=str(exc) or type(exc).__name__))
            self.up = False
            if self._on_change:
                self._on_change(False)

    async def aclose(self) -> None:
        """Closes the client if it is the link's own (a shared one is closed by its owner)."""
        if self._owns:
            await self.client.aclose()
