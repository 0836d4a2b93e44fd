"""Files of the Batch API (inputs, outputs, errors), kept in Redis so that every gateway
sharing the Redis serves them; OpenAI's FileObject shape."""

from __future__ import annotations

import secrets
import time
from typing import Any

import orjson

from gateway.batch.redis_link import RedisLink

PURPOSES = ("batch", "batch_output")


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


class FileStore:
    """`file:{id}` holds the FileObject as JSON, `file:{id}:data` the bytes; the sorted set
    `files` orders them by creation (a counter shared by every gateway, not a clock)."""

    def __init__(self, link: RedisLink) -> None:
        self.r = link.client
        self.link = link
        self.index = link.key("files")
        self.seq = link.key("seq")

    def _meta(self, file_id: str) -> str:
        return self.link.key("file", file_id)

    def _data(self, file_id: str) -> str:
        return self.link.key("file", file_id, "data")

    async def create(self, data: bytes, filename: str, purpose: str,
                     file_id: str | None = None) -> dict[str, Any]:
        """Store `data` as a file. With `file_id` given, an existing file of that id is kept
        as it is: a batch's results are written once, whoever finalises it."""
        keep = file_id is not None
        file_id = file_id or new_file_id()
        obj = {"id": file_id, "object": "file", "bytes": len(data),
               "created_at": int(time.time()), "filename": filename, "purpose": purpose,
               "status": "processed", "expires_at": None, "status_details": None}
        seq = await self.r.incr(self.seq)
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.set(self._data(file_id), data, nx=keep)
            pipe.set(self._meta(file_id), orjson.dumps(obj), nx=keep)
            pipe.zadd(self.index, {file_id: seq}, nx=True)
            await pipe.execute()
        return obj

    async def get(self, file_id: str) -> dict[str, Any] | None:
        raw = await self.r.get(self._meta(file_id))
        return orjson.loads(raw) if raw is not None else None

    async def content(self, file_id: str) -> bytes | None:
        return await self.r.get(self._data(file_id))

    async def delete(self, file_id: str) -> bool:
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.delete(self._meta(file_id), self._data(file_id))
            pipe.zrem(self.index, file_id)
            removed, _ = await pipe.execute()
        return bool(removed)

    async def page(self, *, after: str | None, limit: int, order: str,
                   purpose: str | None) -> tuple[list[dict[str, Any]], bool] | None:
        """Up to `limit` files after the file `after`, newest first with order "desc", and
        whether there are more; None when `after` is not a file."""
        start = 0
        if after is not None:
            rank = await (self.r.zrevrank(self.index, after) if order == "desc"
                          else self.r.zrank(self.index, after))
            if rank is None:
                return None
            start = rank + 1
        out: list[dict[str, Any]] = []
        chunk = max(limit + 1, 100)
        while len(out) <= limit:
            ids = await self.r.zrange(self.index, start, start + chunk - 1,
                                      desc=order == "desc")
            if not ids:
                break
            start += len(ids)
            metas = await self.r.mget([self._meta(i.decode()) for i in ids])
            for raw in metas:
                if raw is None:
                    continue  # deleted meanwhile
                obj = orjson.loads(raw)
                if purpose is None or obj["purpose"] == purpose:
                    out.append(obj)
        return out[:limit], len(out) > limit
