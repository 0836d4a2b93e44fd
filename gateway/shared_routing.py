"""Routing state shared by the gateways using one Redis: prefix inserts and load.

Each gateway routes on its own router as before: the index is updated at decision time, in
the request's own step, and nothing on a request's path waits for Redis. What is shared
travels beside it, in one background task that, every `flush_interval_s`, sends one
pipelined round trip:

- the prefix inserts decided since the last tick, as one entry per pool on that pool's
  stream (`{prefix}routing:{pool}:inserts`, trimmed to about `stream_max_entries`);
- an XREAD of the streams from the last entry read: the other gateways' inserts, applied to
  this gateway's routers (`Router.apply_remote_inserts`);
- every `load_interval_s`, this gateway's own load per replica into the pool's hash
  (`{prefix}routing:{pool}:load`, one field per gateway, stamped with the writer's time) and
  a read of the other gateways' fields (`Router.apply_remote_load`).

Inserts wait in a bounded queue, the oldest dropped (and counted) when Redis is slow or away.
Each carries the time its gateway decided it; the reader observes the time from there to its
being applied (`gateway_shared_state_lag_seconds`). When Redis goes away, the task logs it
once (and once when it returns), the gateway routes on its own state (the other gateways'
load is dropped) and it retries with a growing backoff. On return, a gateway that may have
missed entries (its stream was trimmed past the last one it read, or Redis lost it) asks the
others to publish their recent inserts again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import orjson
from redis.exceptions import ResponseError

from backends.pool import Pool
from gateway.config import RedisConfig
from gateway.observe import Observer
from gateway.redis_link import UNAVAILABLE, Messages, RedisLink

if TYPE_CHECKING:
    from redis.asyncio import Redis
    from redis.asyncio.connection import Connection

log = logging.getLogger("prefix_gateway.shared")

Insert = tuple[str, str, float, Sequence[int], float]
"""A prefix routed here: (pool, replica, decided at (time.time()), block hashes, uncached
prompt tokens it cost the replica)."""

MESSAGES = Messages(
    log,
    down="shared routing state: Redis at {url} does not answer {when} ({error}): this gateway "
    "routes on its own state until it does (retrying in the background)",
    back="shared routing state: Redis at {url} answers again: routing state shared again",
    first="shared routing state: Redis at {url} reachable: routing state is shared with the "
    "gateways using it")

_READ_COUNT = 256
_BACKOFF_S = (0.05, 2.0)
_RESYNC_EVERY_S = 1.0
"""A gateway publishes its recent inserts again at most this often, however many ask."""

_FORGET_STALE = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then
  return redis.call('HDEL', KEYS[1], ARGV[1])
end
return 0
"""


def _pairs(reply: Any) -> dict[bytes, Any]:
    """A map reply: a dict in RESP3, a flat list of keys and values in RESP2."""
    if isinstance(reply, dict):
        return reply
    it = iter(reply or ())
    return dict(zip(it, it, strict=False))


def _id(entry_id: bytes | str) -> tuple[int, int]:
    ms, _, seq = (entry_id.decode() if isinstance(entry_id, bytes) else entry_id).partition("-")
    return int(ms), int(seq or 0)


class SharedRouting:
    """This gateway's side of the shared routing state (built with a `redis` section whose
    `shared_routing.enabled` is on)."""

    def __init__(self, cfg: RedisConfig, pools: Sequence[Pool], observer: Observer,
                 client: Redis | None = None) -> None:
        self.settings = s = cfg.shared_routing
        self.id = uuid.uuid4().hex[:16]
        """This gateway's id in Redis: its own entries are skipped, its load is its field."""
        self.observer = observer
        self.link = RedisLink(cfg, self._changed, client=client, messages=MESSAGES)
        self.pools = {p.name: p for p in pools}
        self.streams = {name: self.link.key("routing", name, "inserts") for name in self.pools}
        self.load_keys = {name: self.link.key("routing", name, "load") for name in self.pools}
        self._pool_of_stream = {k.encode(): name for name, k in self.streams.items()}
        self.queue: deque[Insert] = deque()
        """(pool, replica, decided at (time.time()), block hashes, uncached tokens), oldest
        first."""
        self.recent: deque[Insert] = deque(
            maxlen=s.resync_inserts)
        """The last inserts this gateway published, to publish again when a peer asks."""
        self.last_ids: dict[str, str] = {k: "0-0" for k in self.streams.values()}
        self.started_at = time.time()
        self._republish_at: float | None = None
        """When a peer asked for this gateway's recent inserts (None: nobody has)."""
        self._republished = 0.0
        self._own_load: dict[str, bytes] = {}
        self._load_sent = 0.0
        self._check_gap = False
        self._tasks: list[asyncio.Task[None]] = []
        self._conn: Connection | None = None
        self._failures: set[str] = set()
        self._forget_stale = self.link.client.register_script(_FORGET_STALE)
        for pool in pools:
            pool.router.on_record = self._recorder(pool.name)

    # On the request's path: one append ----------------------------------------------------

    def _recorder(self, pool: str) -> Callable[[str, Sequence[int], float], None]:
        queue, cap, now, dropped = self.queue, self.settings.max_queue, time.time, self._dropped

        def recorded(replica: str, hashes: Sequence[int], uncached: float) -> None:
            if len(queue) >= cap:
                dropped(queue.popleft())
            queue.append((pool, replica, now(), hashes, uncached))

        return recorded

    def _dropped(self, item: Insert) -> None:
        self.observer.shared_inserts(item[0], "dropped", 1)

    # Running ------------------------------------------------------------------------------

    def start(self) -> None:
        self.observer.shared_up(False)  # the series exists from the start
        self._tasks = [asyncio.create_task(self._loop(), name="shared-routing")]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5)
        self._tasks = []
        if self.link.up:  # peers stop counting this gateway's load at once (best effort)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._forget_own_load(), 1.0)
        if self._conn is not None:
            await self._conn.disconnect()
        await self.link.aclose()

    async def _forget_own_load(self) -> None:
        pipe = self.link.client.pipeline(transaction=False)
        for key in self.load_keys.values():
            pipe.hdel(key, self.id)
        await pipe.execute()

    def _changed(self, up: bool) -> None:
        self.observer.shared_up(up)
        if not up:
            # Others' load is no longer known: route on this gateway's own.
            for pool in self.pools.values():
                pool.router.apply_remote_load({})
            self._own_load = {}  # publish it again as soon as Redis is back
            self._check_gap = True

    def _failed(self, exc: BaseException) -> None:
        """Something other than an outage went wrong: logged once per kind, then retried."""
        what = f"{type(exc).__name__}: {exc}"
        if what not in self._failures and len(self._failures) < 64:
            self._failures.add(what)
            log.error("shared routing state: %s (retrying)", what, exc_info=exc)

    async def _loop(self) -> None:
        s = self.settings
        delay = _BACKOFF_S[0]
        next_load = 0.0
        behind = failed = False
        while True:
            if failed:  # an outage, or a bug: retried with a growing backoff
                await asyncio.sleep(delay)
                delay = min(delay * 2, _BACKOFF_S[1])
            elif not behind:
                await asyncio.sleep(s.flush_interval_s)
            now = time.monotonic()
            load_due = now >= next_load
            behind, failed = False, True
            try:
                if self._check_gap:  # before reading on: the gap is measured from the last id
                    await self._ask_if_missed()
                behind = await self.tick(load_due)
            except UNAVAILABLE as exc:
                self.link.mark_down(exc)
                continue
            except Exception as exc:  # a bug must not end the sharing
                self._failed(exc)
                continue
            failed = False
            delay = _BACKOFF_S[0]
            if load_due:
                next_load = now + s.load_interval_s

    # Writing ------------------------------------------------------------------------------

    async def tick(self, with_load: bool) -> bool:
        """Write the queued inserts and read the other gateways' new ones (and, with
        `with_load`, write this gateway's load and read the others'): one pipelined round
        trip. On an outage the inserts go back to the queue. True: a stream had more entries
        than one read takes (read on at once)."""
        s = self.settings
        batch = list(self.queue)
        self.queue.clear()
        republish = self._due_republish()
        trim = ("MAXLEN", "~", s.stream_max_entries)
        commands: list[tuple[Any, ...]] = []
        pools = self._by_pool(batch)
        for pool, items in pools.items():
            commands.append(("XADD", self.streams[pool], *trim, "*", "g", self.id,
                             "d", orjson.dumps(items)))
        if republish:
            for pool, items in self._by_pool(list(self.recent)).items():
                commands.append(("XADD", self.streams[pool], *trim, "*", "g", self.id,
                                 "d", orjson.dumps(items), "r", "1"))
        loads: list[tuple[str, int]] = []
        """(pool, index of its HGETALL in the replies)"""
        if with_load:
            now = time.time()
            heartbeat = now - self._load_sent >= s.load_ttl_s / 3
            for pool in self.pools.values():
                own = self._load_of(pool)
                key = self.load_keys[pool.name]
                if heartbeat or own != self._own_load.get(pool.name):
                    commands.append(("HSET", key, self.id, b'{"t":%r,"r":%s}' % (now, own)))
                    # Gone with the last gateway: nobody's load outlives it for long.
                    commands.append(("PEXPIRE", key, int(s.load_ttl_s * 10_000)))
                    self._own_load[pool.name] = own
                    self._load_sent = now
                loads.append((pool.name, len(commands)))
                commands.append(("HGETALL", key))
        commands.append(("XREAD", "COUNT", _READ_COUNT, "STREAMS", *self.last_ids,
                         *self.last_ids.values()))
        try:
            replies = await self._round_trip(commands)
        except BaseException:
            self._requeue(batch)
            if republish:
                self._republish_at = self._republish_at or time.monotonic()
            raise
        self.link.mark_up()
        self.recent.extend(batch)
        for pool, items in pools.items():
            self.observer.shared_inserts(pool, "published", len(items))
        for pool_name, at in loads:
            self._read_loads(pool_name, _pairs(replies[at]))
        got = replies[-1] or ()
        behind = False
        for stream, entries in (got.items() if isinstance(got, dict) else got):
            self._apply(stream, entries)
            behind = behind or len(entries) >= _READ_COUNT
        return behind

    async def _round_trip(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Send `commands` at once on this gateway's own connection and read their raw
        replies: a tick costs one write and one read, without a client pipeline's layers
        (what runs every flush interval, for as long as the gateway runs)."""
        conn = self._conn
        if conn is None:
            conn = self._conn = self.link.client.connection_pool.make_connection()
        try:
            await conn.send_packed_command(conn.pack_commands(commands), check_health=False)
            replies = [await conn.read_response() for _ in commands]
        except BaseException:
            await conn.disconnect()  # never read what is left of these replies as the next
            raise
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies

    @staticmethod
    def _by_pool(batch: list[Insert]) -> dict[str, list[list[Any]]]:
        out: dict[str, list[list[Any]]] = {}
        for pool, replica, at, hashes, uncached in batch:
            out.setdefault(pool, []).append([replica, round(at, 6), list(hashes),
                                             round(uncached, 1)])
        return out

    def _requeue(self, batch: list[Insert]) -> None:
        """Put unwritten inserts back before those queued since, keeping the newest."""
        queue = self.queue
        queue.extendleft(reversed(batch))
        while len(queue) > self.settings.max_queue:
            self._dropped(queue.popleft())

    def _due_republish(self) -> bool:
        asked = self._republish_at
        if asked is None or not self.recent:
            self._republish_at = None
            return False
        if time.monotonic() - self._republished < _RESYNC_EVERY_S:
            return False
        self._republish_at = None
        self._republished = time.monotonic()
        log.info("shared routing state: a gateway missed entries; publishing this one's %d "
                 "most recent prefix inserts again", len(self.recent))
        return True

    @staticmethod
    def _load_of(pool: Pool) -> bytes:
        load = pool.router.load
        own = {r: [n, round(load.pending_prefill.get(r, 0.0), 1)]
               for r, n in load.inflight.items() if n > 0}
        return orjson.dumps(own, option=orjson.OPT_SORT_KEYS)

    def _read_loads(self, name: str, fields: dict[bytes, bytes]) -> None:
        now = time.time()
        ttl = self.settings.load_ttl_s
        me = self.id.encode()
        total: dict[str, tuple[int, float]] = {}
        stale: list[bytes] = []
        for gateway, raw in (fields or {}).items():
            if gateway == me:
                continue
            value = orjson.loads(raw)
            if now - float(value["t"]) > ttl:
                stale.append(gateway)
                continue
            for replica, (n, pending) in value["r"].items():
                n0, p0 = total.get(replica, (0, 0.0))
                total[replica] = (n0 + int(n), p0 + float(pending))
        self.pools[name].router.apply_remote_load(total)
        for gateway in stale:
            # Gone (stopped without saying so, or cut off from Redis): cleared by whoever
            # sees it first, unless it wrote again meanwhile; one that comes back publishes
            # its load again.
            task = asyncio.get_running_loop().create_task(
                self._forget_stale(keys=[self.load_keys[name]], args=[gateway, fields[gateway]]))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())

    # Reading ------------------------------------------------------------------------------

    def _apply(self, stream: bytes, entries: list[list[Any]]) -> None:
        pool_name = self._pool_of_stream.get(stream)
        if pool_name is None or not entries:
            return
        key = self.streams[pool_name]
        self.last_ids[key] = entries[-1][0].decode()
        router = self.pools[pool_name].router
        me = self.id.encode()
        now = time.time()
        observe = self.observer.shared_lag
        for _, raw in entries:
            fields = _pairs(raw)
            if fields.get(b"g") == me:
                continue
            if b"q" in fields:  # a peer missed entries: publish ours again
                self._republish_at = self._republish_at or time.monotonic()
                continue
            items = orjson.loads(fields[b"d"])
            # [replica, decided at, hashes, uncached tokens] (no uncached: an older gateway's)
            applied = router.apply_remote_inserts(
                (item[0], item[2], item[3] if len(item) > 3 else 0.0) for item in items)
            self.observer.shared_inserts(pool_name, "applied", applied)
            if b"r" in fields:
                continue  # published again: its lag is the outage's, not the sharing's
            for item in items:
                at = item[1]
                if at >= self.started_at:  # not what was decided before this gateway began
                    observe(pool_name, max(0.0, now - at))

    async def _ask_if_missed(self) -> None:
        """After an outage: if a stream lost entries this gateway had not read (trimmed past
        its last id, or gone with a Redis that lost its data), ask the others to publish
        their recent inserts again."""
        missed = []
        for pool, key in self.streams.items():
            last = self.last_ids[key]
            if last == "0-0":
                continue  # never read anything: it reads whatever the stream holds
            try:
                info = await self.link.client.xinfo_stream(key)
            except ResponseError:  # no such key: Redis lost the stream
                missed.append(pool)
                continue
            # Trimming takes the oldest entries: those after `last` are all still there
            # unless the stream's head has passed it (then some may be gone: ask, at the
            # price of one republish too many).
            first = info.get("first-entry")
            added = info.get("last-generated-id") or b"0-0"
            if _id(added) > _id(last) and (not first or _id(first[0]) > _id(last)):
                missed.append(pool)
        if missed:
            log.info("shared routing state: entries of pools %s were lost while this gateway "
                     "was away from Redis; asking the other gateways to publish theirs again",
                     ", ".join(missed))
            pipe = self.link.client.pipeline(transaction=False)
            for pool in missed:
                pipe.xadd(self.streams[pool], {"g": self.id, "q": "1"},
                          maxlen=self.settings.stream_max_entries, approximate=True)
            await pipe.execute()
        self._check_gap = False
