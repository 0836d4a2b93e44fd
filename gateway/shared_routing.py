"""Routing state shared by the gateways using one Redis: prefix inserts and load.

Each gateway routes on its own router as before: the index is updated at decision time, in
the request's own step, and nothing on a request's path waits for Redis (it appends the
decision to a queue). What is shared travels beside it, on one stream per pool
(`{prefix}routing:{pool}:inserts`, trimmed to about `stream_max_entries`), through two
background tasks, each with a connection of its own:

- the writer, woken by the first insert queued and looking at this gateway's load every
  `load_interval_s` (locally, and only while it has requests in flight), sends one
  pipelined round trip when there is something to write: the inserts decided since the
  last write and this gateway's load per replica when it changed (in flight and pending
  prefill, stamped with the writer's time; again every third of `load_ttl_s` while not
  empty), as one entry per pool; at most once per `flush_interval_s`, so that a busy
  gateway batches, and never when idle;
- the reader blocks on the streams (XREAD BLOCK) from the last entry read until another
  gateway writes, applies their inserts to this gateway's routers
  (`Router.apply_remote_inserts`) and the sum of their latest loads
  (`Router.apply_remote_load`), then reads again after `flush_interval_s`. A load older than
  `load_ttl_s` no longer counts; a gateway that stops says it has none.

Inserts wait in a bounded queue, the oldest dropped (and counted) when Redis is slow or away.
Each carries the time its gateway decided it; the reader observes the time from there to its
being applied (`gateway_shared_state_lag_seconds`). When Redis goes away, the tasks log it
once (and once when it returns), the gateway routes on its own state (the other gateways'
load is dropped) and they retry with a growing backoff. On return, a gateway that may have
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
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import orjson
from redis.exceptions import ResponseError

from backends.pool import Pool
from gateway.config import RedisConfig
from gateway.observe import Observer
from gateway.redis_link import UNAVAILABLE, Messages, RedisLink
from routing.load import sum_loads

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
_BLOCK_S = 1.0
"""Longest wait of a read for another gateway's entry (at most half the Redis timeout)."""
_RESYNC_EVERY_S = 1.0
"""A gateway publishes its recent inserts again at most this often, however many ask."""



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
        self._loads: dict[str, dict[bytes, tuple[float, dict[str, list[float]]]]] = {
            name: {} for name in self.pools}
        """Pool -> other gateway's id -> (written at, {replica: [in flight, pending]})."""
        self._wake = asyncio.Event()
        """Set by the first insert queued: the writer writes it without waiting."""
        self._tasks: list[asyncio.Task[None]] = []
        self._conns: dict[str, Connection] = {}
        self._failures: set[str] = set()
        for pool in pools:
            pool.router.on_record = self._recorder(pool.name)

    # On the request's path: one append ----------------------------------------------------

    def _recorder(self, pool: str) -> Callable[[str, Sequence[int], float], None]:
        queue, cap, now, dropped = self.queue, self.settings.max_queue, time.time, self._dropped

        wake = self._wake

        def recorded(replica: str, hashes: Sequence[int], uncached: float) -> None:
            if not queue:
                wake.set()
            elif len(queue) >= cap:
                dropped(queue.popleft())
            queue.append((pool, replica, now(), hashes, uncached))

        return recorded

    def _dropped(self, item: Insert) -> None:
        self.observer.shared_inserts(item[0], "dropped", 1)

    # Running ------------------------------------------------------------------------------

    def start(self) -> None:
        self.observer.shared_up(False)  # the series exists from the start
        self._tasks = [asyncio.create_task(self._write_loop(), name="shared-routing-write"),
                       asyncio.create_task(self._read_loop(), name="shared-routing-read")]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5)
        self._tasks = []
        if self.link.up:  # peers stop counting this gateway's load at once (best effort)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._forget_own_load(), 1.0)
        for conn in self._conns.values():
            await conn.disconnect()
        await self.link.aclose()

    async def _forget_own_load(self) -> None:
        now = time.time()
        await self._round_trip("write", [
            ("XADD", key, "MAXLEN", "~", self.settings.stream_max_entries, "*", "g", self.id,
             "l", b'{"t":%r,"r":{}}' % now) for key in self.streams.values()])

    def _changed(self, up: bool) -> None:
        self.observer.shared_up(up)
        if not up:
            # Others' load is no longer known: route on this gateway's own.
            self._loads = {name: {} for name in self.pools}
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

    async def _guarded(self, step: Callable[[], Awaitable[Any]]) -> bool:
        """Run one step of a loop; an outage or a bug is reported (False: back off)."""
        try:
            await step()
        except UNAVAILABLE as exc:
            self.link.mark_down(exc)
            return False
        except Exception as exc:  # a bug must not end the sharing
            self._failed(exc)
            return False
        return True

    async def _write_loop(self) -> None:
        """Writes when there is something to write: inserts (woken by the first one queued),
        this gateway's load when it changed (looked at every `load_interval_s`, locally) or
        its heartbeat is due, a republish; at most once per `flush_interval_s`, so that a
        busy gateway batches. An idle one sends nothing."""
        s = self.settings
        delay = _BACKOFF_S[0]
        next_load = 0.0
        wake = self._wake
        while True:
            if not self.queue and self._republish_at is None:
                # Nothing to write until an insert (which wakes it) or the next look at the
                # load: a request that records no insert (a prompt under one block) changes
                # the load too. The look is local; only a change is written.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), max(0.0, next_load - time.monotonic()))
            wake.clear()
            now = time.monotonic()
            load_due = now >= next_load
            if load_due:
                next_load = now + s.load_interval_s
            if await self._guarded(lambda load_due=load_due: self.write(load_due)):
                delay = _BACKOFF_S[0]
                await asyncio.sleep(s.flush_interval_s)
            else:  # an outage, or a bug: retried with a growing backoff
                await asyncio.sleep(delay)
                delay = min(delay * 2, _BACKOFF_S[1])

    async def _read_loop(self) -> None:
        """Blocks on the streams until another gateway writes (or `_BLOCK_S` passes, to let
        the others' load age out), applies what came, and reads again after
        `flush_interval_s` (at once when a read did not take all): an idle gateway costs one
        round trip per `_BLOCK_S`."""
        s = self.settings
        delay = _BACKOFF_S[0]
        timeout = self.link.client.connection_pool.connection_kwargs.get("socket_timeout")
        block_ms = max(1, int(1000 * min(_BLOCK_S, (timeout or 5.0) / 2)))
        while True:
            behind = False

            async def step() -> None:
                nonlocal behind
                if self._check_gap:  # before reading on: the gap is measured from the last id
                    await self._ask_if_missed()
                behind = await self.read(block_ms)

            if await self._guarded(step):
                delay = _BACKOFF_S[0]
                if not behind:
                    await asyncio.sleep(s.flush_interval_s)
            else:
                await asyncio.sleep(delay)
                delay = min(delay * 2, _BACKOFF_S[1])

    # Writing ------------------------------------------------------------------------------

    async def tick(self, with_load: bool) -> bool:
        """One write and one read that does not wait (what the two loops do, by hand): True
        when a stream had more entries than one read takes."""
        await self.write(with_load)
        return await self.read(None)

    async def write(self, with_load: bool) -> None:
        """Write the queued inserts and, with them or with `with_load`, this gateway's load
        if it changed (or its heartbeat is due): one pipelined round trip, none when there
        is nothing to write. On an outage the inserts go back to the queue."""
        s = self.settings
        batch = list(self.queue)
        self.queue.clear()
        republish = self._due_republish()
        trim = ("MAXLEN", "~", s.stream_max_entries)
        pools = self._by_pool(batch)
        loads: dict[str, bytes] = {}
        # With inserts, the load too: the requests just decided are in flight, and the other
        # gateways see them as soon as they see the decisions.
        if with_load or batch:
            now = time.time()
            heartbeat = now - self._load_sent >= s.load_ttl_s / 3
            for pool in self.pools.values():
                own = self._load_of(pool)
                # Nothing in flight, said once: no heartbeat needed for an empty load.
                if own != self._own_load.get(pool.name) or (heartbeat and own != b"{}"):
                    loads[pool.name] = own
            if loads:
                self._load_sent = now
        commands: list[tuple[Any, ...]] = []
        for name in self.pools:
            fields: list[Any] = []
            if name in pools:
                fields += ["d", orjson.dumps(pools[name])]
            if name in loads:
                fields += ["l", b'{"t":%r,"r":%s}' % (now, loads[name])]
            if fields:
                commands.append(("XADD", self.streams[name], *trim, "*", "g", self.id, *fields))
        if republish:
            for pool, items in self._by_pool(list(self.recent)).items():
                commands.append(("XADD", self.streams[pool], *trim, "*", "g", self.id,
                                 "d", orjson.dumps(items), "r", "1"))
        if not commands:
            return
        try:
            await self._round_trip("write", commands)
        except BaseException:
            self._requeue(batch)
            if republish:
                self._republish_at = self._republish_at or time.monotonic()
            raise
        self.link.mark_up()
        self._own_load.update(loads)
        self.recent.extend(batch)
        for pool, items in pools.items():
            self.observer.shared_inserts(pool, "published", len(items))

    async def read(self, block_ms: int | None) -> bool:
        """Read the other gateways' new entries (waiting up to `block_ms` for one; None: not
        at all) and apply them, then drop loads older than `load_ttl_s`. True: a stream had
        more entries than one read takes (read on at once)."""
        block = ("BLOCK", block_ms) if block_ms is not None else ()
        (got,) = await self._round_trip("read", [
            ("XREAD", "COUNT", _READ_COUNT, *block, "STREAMS", *self.last_ids,
             *self.last_ids.values())])
        self.link.mark_up()
        behind = False
        changed: set[str] = set()
        for stream, entries in (got.items() if isinstance(got, dict) else got or ()):
            pool = self._apply(stream, entries)
            if pool is not None:
                changed.add(pool)
            behind = behind or len(entries) >= _READ_COUNT
        now = time.time()
        ttl = self.settings.load_ttl_s
        for name, theirs in self._loads.items():
            # Gone (stopped without saying so, or cut off from Redis): ignored once stale.
            for gateway in [g for g, (t, _) in theirs.items() if now - t > ttl]:
                del theirs[gateway]
                changed.add(name)
        for name in changed:
            self._apply_loads(name)
        return behind

    async def _round_trip(self, role: str, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Send `commands` at once on this gateway's own connection for `role` (the writer's,
        or the reader's, which blocks) and read their raw replies: a write costs one send and
        one read, without a client pipeline's layers. A connection that fails is dropped;
        if it had worked before (a Redis restarted since), one retry on a new one tells an
        outage from a stale socket."""
        for attempt in (0, 1):
            conn = self._conns.get(role)
            fresh = conn is None
            if conn is None:
                conn = self._conns[role] = self.link.client.connection_pool.make_connection()
            try:
                await conn.send_packed_command(conn.pack_commands(commands),
                                               check_health=False)
                replies = [await conn.read_response() for _ in commands]
            except UNAVAILABLE:
                await conn.disconnect()  # never read what is left of these replies as the next
                del self._conns[role]
                if fresh or attempt:
                    raise
                continue
            except BaseException:
                await conn.disconnect()
                self._conns.pop(role, None)
                raise
            break
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
        return orjson.dumps(pool.router.load.own_load(), option=orjson.OPT_SORT_KEYS)

    # Reading ------------------------------------------------------------------------------

    def _apply(self, stream: bytes, entries: list[list[Any]]) -> str | None:
        """Apply a stream's entries; the pool's name if another gateway's load changed."""
        pool_name = self._pool_of_stream.get(stream)
        if pool_name is None or not entries:
            return None
        loads = self._loads[pool_name]
        load_changed = False
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
            raw_load = fields.get(b"l")
            if raw_load is not None:
                value = orjson.loads(raw_load)
                loads[fields[b"g"]] = (float(value["t"]), value["r"])
                load_changed = True
            if b"d" not in fields:
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
        return pool_name if load_changed else None

    def _apply_loads(self, name: str) -> None:
        self.pools[name].router.apply_remote_load(
            sum_loads(replicas for _, replicas in self._loads[name].values()))

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
