"""Transports that carry one request to one replica: our httptools client (or aiohttp),
and an in-process one for tests."""

from backends.upstream.base import (
    NO_TIMEOUTS,
    ConnectFailed,
    ConnectionDropped,
    ReadFailed,
    Timeouts,
    Upstream,
    UpstreamError,
    UpstreamResponse,
    fetch_text,
)

__all__ = [
    "NO_TIMEOUTS",
    "ConnectFailed",
    "ConnectionDropped",
    "ReadFailed",
    "Timeouts",
    "Upstream",
    "UpstreamError",
    "UpstreamResponse",
    "fetch_text",
]
