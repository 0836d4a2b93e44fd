"""Transports that carry one request to one replica: aiohttp in production, in-process in tests."""

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
