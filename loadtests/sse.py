"""Server-sent events as the benchmark clients read them: each event's data, up to [DONE]."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator

DONE = b"[DONE]"


def _data(line: bytes) -> bytes | None:
    """The payload of a `data:` line; None for any other line (comments, blank lines)."""
    return line[5:].strip() if line.startswith(b"data:") else None


async def data_events(lines: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    """The data of each event of a stream read line by line (aiohttp's `resp.content`)."""
    async for line in lines:
        data = _data(line)
        if data == DONE:
            return
        if data is not None:
            yield data


def data_events_sync(lines: Iterable[bytes]) -> Iterator[bytes]:
    """`data_events` for a blocking client (requests' `iter_lines`, as locust uses)."""
    for line in lines:
        data = _data(line)
        if data == DONE:
            return
        if data is not None:
            yield data
