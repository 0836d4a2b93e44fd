"""Files of the Batch API (inputs, outputs, errors), kept in Redis so that every gateway
sharing the Redis serves them; OpenAI's FileObject shape."""

from __future__ import annotations

import secrets
import time
from typing import Any

import orjson

from gateway.redis_link import RedisLink

PURPOSES = ("batch", "batch_output")


_OWNER = "_owner"
"""The FileObject's stored field naming its owner (never shown to a client)."""


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


class FileStore:
    """`file:{id}` holds the FileObject as JSON, `file:{id}:data` the bytes; a sorted set per
    owner (`files`, or `files:owner:{name}` for a client key's files) orders them by creation
    (a counter shared by every gateway, not a clock).

    The owner is the name of the client key that uploaded the file ("" on a gateway without
    client keys); a file is visible only to its owner. Methods taking `owner=None` skip the
    check: that is for the gateway's own use (the runner), never for a client's request.
    """

    def __init__(self, link: RedisLink) -> None:
        self.r = link.client
        self.link = link
        self.seq = link.key("seq")

    def _index(self, owner: str) -> str:
        return self.link.key("files", "owner", owner) if owner else self.link.key("files")

    def _meta(self, file_id: str) -> str:
        return self.link.key("file", file_id)

    def _data(self, file_id: str) -> str:
        return self.link.key("file", file_id, "data")

    async def create(self, data: bytes, filename: str, purpose: str,
                     file_id: str | None = None, owner: str = "") -> dict[str, Any]:
        """Store `data` as `owner`'s file. With `file_id` given, an existing file of that id is
        kept as it is: a batch's results are written once, whoever finalises it."""
        keep = file_id is not None
        file_id = file_id or new_file_id()
        obj = {"id": file_id, "object": "file", "bytes": len(data),
               "created_at": int(time.time()), "filename": filename, "purpose": purpose,
               "status": "processed", "expires_at": None, "status_details": None}
        seq = await self.r.incr(self.seq)
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.set(self._data(file_id), data, nx=keep)
            pipe.set(self._meta(file_id), orjson.dumps({**obj, _OWNER: owner}), nx=keep)
            pipe.zadd(self._index(owner), {file_id: seq}, nx=True)
            await pipe.execute()
        return obj

    async def get(self, file_id: str, owner: str | None = None) -> dict[str, Any] | None:
        """The FileObject, or None when there is none or it is not `owner`'s."""
        raw = await self.r.get(self._meta(file_id))
        if raw is None:
            return None
        obj = orjson.loads(raw)
        if owner is not None and obj.get(_OWNER, "") != owner:
            return None
        obj.pop(_OWNER, None)
        return obj

    async def content(self, file_id: str, owner: str | None = None) -> bytes | None:
        if owner is not None and await self.get(file_id, owner) is None:
            return None
        return await self.r.get(self._data(file_id))

    async def delete(self, file_id: str, owner: str) -> bool:
        if await self.get(file_id, owner) is None:
            return False
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.delete(self._meta(file_id), self._data(file_id))
            pipe.zrem(self._index(owner), file_id)
            removed, _ = await pipe.execute()
        return bool(removed)

    async def page(self, *, after: str | None, limit: int, order: str,
                   purpose: str | None, owner: str) -> tuple[list[dict[str, Any]], bool] | None:
        """Up to `limit` of `owner`'s files after the file `after`, newest first with order
        "desc", and whether there are more; None when `after` is not one of them."""
        index = self._index(owner)
        start = 0
        if after is not None:
            rank = await (self.r.zrevrank(index, after) if order == "desc"
                          else self.r.zrank(index, after))
            if rank is None:
                return None
            start = rank + 1
        out: list[dict[str, Any]] = []
        chunk = max(limit + 1, 100)
        while len(out) <= limit:
            ids = await self.r.zrange(index, start, start + chunk - 1, desc=order == "desc")
            if not ids:
                break
            start += len(ids)
            metas = await self.r.mget([self._meta(i.decode()) for i in ids])
            for raw in metas:
                if raw is None:
                    continue  # deleted meanwhile
                obj = orjson.loads(raw)
                obj.pop(_OWNER, None)
                if purpose is None or obj["purpose"] == purpose:
                    out.append(obj)
        return out[:limit], len(out) > limit
