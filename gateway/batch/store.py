"""Batches in Redis: the batch record, its lines, their leases and results, each change atomic
(the Lua scripts of gateway/batch/scripts.py, so gateways sharing the Redis never race).

Keys, under the configured prefix:

- `batches` (sorted set): every batch id, by creation; `active`: the batches still to work on;
- `batch:{id}` (hash): the batch object's fields, its counters and token sums;
- `batch:{id}:req` (hash): line index -> the request to run, its prefix group;
- `batch:{id}:todo` (list): indices not yet claimed, in run order;
- `batch:{id}:leased` (sorted set): index -> lease expiry (ms, Redis's clock);
- `batch:{id}:owner` (hash): index -> the gateway holding its lease;
- `batch:{id}:res` (hash): index -> its output ("o") or error ("e") line, written once;
- `batch:{id}:lock`: held while one gateway validates or finalises the batch.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from redis.exceptions import WatchError

from gateway.batch import scripts
from gateway.redis_link import RedisLink

TERMINAL = ("failed", "completed", "expired", "cancelled")


def new_batch_id() -> str:
    return "batch_" + secrets.token_hex(12)


@dataclass(slots=True)
class Claimed:
    index: str
    custom_id: str
    body: dict[str, Any]
    group: int
    leader: bool


def _text(h: Mapping[bytes, bytes]) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in h.items()}


class BatchStore:
    """Every read and write of batch state; methods raise redis-py's errors when Redis is
    unreachable (the callers decide whether to wait or to answer 503)."""

    def __init__(self, link: RedisLink) -> None:
        self.link = link
        self.r = link.client
        self.index = link.key("batches")
        self.active = link.key("active")
        self.seq = link.key("seq")
        reg = self.r.register_script
        self._claim = reg(scripts.CLAIM)
        self._renew = reg(scripts.RENEW)
        self._complete = reg(scripts.COMPLETE)
        self._release = reg(scripts.RELEASE)
        self._live = reg(scripts.LIVE)
        self._transition = reg(scripts.TRANSITION)
        self._fill = reg(scripts.FILL)
        self._unlock = reg(scripts.UNLOCK)

    def key(self, batch_id: str, part: str = "") -> str:
        return self.link.key("batch", batch_id, part) if part else self.link.key("batch",
                                                                                  batch_id)

    # The batch record ---------------------------------------------------------------------

    def owner_index(self, owner: str) -> str:
        """The sorted set of `owner`'s batches (the name of the client key that created them,
        "" on a gateway without client keys): a client lists and sees only its own."""
        return self.link.key("batches", "owner", owner) if owner else self.index

    async def create(self, fields: dict[str, str]) -> None:
        seq = await self.r.incr(self.seq)
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.hset(self.key(fields["id"]), mapping={**fields, "seq": str(seq)})
            pipe.zadd(self.owner_index(fields.get("owner", "")), {fields["id"]: seq})
            pipe.sadd(self.active, fields["id"])
            await pipe.execute()

    async def get(self, batch_id: str, owner: str | None = None) -> dict[str, str] | None:
        """The batch's record; None when there is none or it is not `owner`'s (None: the
        gateway's own look, with no owner to check)."""
        h = await self.r.hgetall(self.key(batch_id))
        if not h:
            return None
        batch = _text(h)
        if owner is not None and batch.get("owner", "") != owner:
            return None
        return batch

    async def page(self, after: str | None, limit: int,
                   owner: str) -> tuple[list[dict[str, str]], bool] | None:
        """`owner`'s batches, newest first, up to `limit` after the batch `after`; None if
        `after` is not one of them."""
        index = self.owner_index(owner)
        start = 0
        if after is not None:
            rank = await self.r.zrevrank(index, after)
            if rank is None:
                return None
            start = rank + 1
        ids = await self.r.zrange(index, start, start + limit, desc=True)
        async with self.r.pipeline(transaction=False) as pipe:
            for i in ids[:limit]:
                pipe.hgetall(self.key(i.decode()))
            rows = await pipe.execute()
        return [_text(h) for h in rows if h], len(ids) > limit

    async def active_ids(self) -> list[str]:
        return sorted(i.decode() for i in await self.r.smembers(self.active))

    async def retire(self, batch_id: str) -> None:
        await self.r.srem(self.active, batch_id)

    async def transition(self, batch_id: str, allowed: Iterable[str], **fields: Any) -> bool:
        """Set `fields` if the batch's status is one of `allowed` (atomically)."""
        args = [",".join(allowed)]
        for k, v in fields.items():
            args += [k, str(v)]
        return bool(await self._transition(keys=[self.key(batch_id)], args=args))

    # Validation ---------------------------------------------------------------------------

    async def start_lines(self, batch_id: str, requests: list[tuple[int, bytes]],
                          order: list[int], errors: dict[int, bytes],
                          fields: dict[str, str]) -> bool:
        """Store the lines to run and the error lines of malformed ones, and move the batch
        to in_progress, all at once; False if its status left `validating` meanwhile."""
        key = self.key(batch_id)
        async with self.r.pipeline(transaction=True) as pipe:
            await pipe.watch(key)
            if (await pipe.hget(key, "status")) != b"validating":
                return False
            pipe.multi()
            for part in _chunks(requests, 1000):
                pipe.hset(self.key(batch_id, "req"), mapping=dict(part))
            for part in _chunks(order, 5000):
                pipe.rpush(self.key(batch_id, "todo"), *part)
            for part in _chunks(list(errors.items()), 1000):
                pipe.hset(self.key(batch_id, "res"), mapping={i: b"e" + line
                                                              for i, line in part})
            pipe.hset(key, mapping=fields)
            try:
                await pipe.execute()
            except WatchError:
                return False
        return True

    # Lines --------------------------------------------------------------------------------

    def _line_keys(self, batch_id: str) -> list[str]:
        return [self.key(batch_id, p) for p in ("todo", "leased", "owner", "res", "req")]

    async def claim(self, batch_id: str, gateway: str, lease_ms: int, n: int) -> list[Claimed]:
        todo, leased, owner, res, req = self._line_keys(batch_id)
        flat = await self._claim(keys=[self.key(batch_id), todo, leased, owner, res, req],
                                 args=[gateway, lease_ms, n])
        out = []
        for idx, raw in zip(flat[::2], flat[1::2], strict=True):
            line = orjson.loads(raw)
            out.append(Claimed(idx.decode(), line["c"], line["b"], line["g"], bool(line["l"])))
        return out

    async def renew(self, batch_id: str, gateway: str, lease_ms: int,
                    indices: Iterable[str]) -> set[str]:
        """Extend this gateway's leases; returns the indices it no longer holds."""
        indices = list(indices)
        if not indices:
            return set()
        lost = await self._renew(keys=[self.key(batch_id, "leased"), self.key(batch_id, "owner")],
                                 args=[gateway, lease_ms, *indices])
        return {i.decode() for i in lost}

    async def complete(self, batch_id: str, gateway: str, index: str, line: bytes, ok: bool,
                       usage: tuple[int, int, int]) -> bool:
        """Write a line's result unless it has one; True if this one was written."""
        return bool(await self._complete(
            keys=[self.key(batch_id), self.key(batch_id, "res"), self.key(batch_id, "leased"),
                  self.key(batch_id, "owner")],
            args=[gateway, index, (b"o" if ok else b"e") + line, int(ok), *usage]))

    async def release(self, batch_id: str, gateway: str, indices: Iterable[str]) -> None:
        indices = list(indices)
        if indices:
            await self._release(keys=[self.key(batch_id, p) for p in ("todo", "leased", "owner")],
                                args=[gateway, *indices])

    async def live_leases(self, batch_id: str) -> int:
        return int(await self._live(keys=[self.key(batch_id, "leased")]))

    # Finalisation -------------------------------------------------------------------------

    async def lock(self, batch_id: str, gateway: str, ms: int) -> bool:
        return bool(await self.r.set(self.key(batch_id, "lock"), gateway, nx=True, px=ms))

    async def unlock(self, batch_id: str, gateway: str) -> None:
        await self._unlock(keys=[self.key(batch_id, "lock")], args=[gateway])

    async def missing(self, batch_id: str, total: int) -> list[int]:
        have = {int(i) for i in await self.r.hkeys(self.key(batch_id, "res"))}
        return [i for i in range(total) if i not in have]

    async def requests(self, batch_id: str, indices: list[int]) -> list[dict[str, Any] | None]:
        if not indices:
            return []
        raws = await self.r.hmget(self.key(batch_id, "req"), indices)
        return [orjson.loads(r) if r is not None else None for r in raws]

    async def fill(self, batch_id: str, lines: dict[int, bytes]) -> None:
        for part in _chunks(list(lines.items()), 500):
            args: list[Any] = []
            for i, line in part:
                args += [i, b"e" + line]
            await self._fill(keys=[self.key(batch_id), self.key(batch_id, "res")], args=args)

    async def results(self, batch_id: str, total: int) -> tuple[list[bytes], list[bytes]]:
        """(output lines, error lines), in input order."""
        out: list[bytes] = []
        err: list[bytes] = []
        for start in range(0, total, 1000):
            idx = list(range(start, min(total, start + 1000)))
            for raw in await self.r.hmget(self.key(batch_id, "res"), idx):
                if raw is None:
                    continue
                (out if raw[:1] == b"o" else err).append(raw[1:])
        return out, err

    async def finish(self, batch_id: str, fields: dict[str, str]) -> bool:
        """The batch's final fields, unless another gateway finished it first; either way its
        working keys are dropped (its files hold the results) and it leaves the active set."""
        done = await self.transition(batch_id, ["finalizing", "cancelling"], **fields)
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.hdel(self.key(batch_id), "ending")
            pipe.delete(*[self.key(batch_id, p) for p in ("req", "todo", "leased", "owner",
                                                          "res", "lock")])
            pipe.srem(self.active, batch_id)
            await pipe.execute()
        return done


def _chunks(items: list[Any], n: int) -> Iterable[list[Any]]:
    for i in range(0, len(items), n):
        yield items[i:i + n]


def now_s() -> int:
    return int(time.time())
