"""Routing state shared by the gateways using one Redis: prefix inserts and load.

Each gateway routes on its own router as before: the index is updated at decision time, in
the request's own step, and nothing on a request's path waits for Redis (it appends the
decision to a queue). What is shared travels beside it, on one stream per gateway and pool
(`{prefix}routing:{pool}:inserts:{gateway id}`, trimmed to about `stream_max_entries`), so
that a gateway never reads its own entries back, through two background tasks, each with a
connection of its own:

- the writer, woken by the first insert queued and looking at this gateway's load every
  `load_interval_s` (locally, and only while it has requests in flight), sends one
  pipelined round trip when there is something to write: the inserts decided since the
  last write and this gateway's load per replica when it changed (in flight and pending
  prefill, stamped with the writer's time; again every third of `load_ttl_s` while not
  empty), as one entry per pool; at most once per `flush_interval_s`, so that a busy
  gateway batches, and never when idle;
- the reader blocks on the other gateways' streams (XREAD BLOCK) from the last entry read
  until one of them writes, applies their inserts to this gateway's routers
  (`Router.apply_remote_inserts`) and the sum of their latest loads
  (`Router.apply_remote_load`), then reads again after `flush_interval_s`. A load older than
  `load_ttl_s` no longer counts; a gateway that stops says it has none.

Each write also carries, when it changed and at most every `RATES_INTERVAL_S`, what the
gateway learned of each replica's own prefill rate and of its throughput while busy, and of
the pool's prefill rate (`Router.own_rates`); the others count it with their own samples
(`Router.apply_remote_rates`) until it leaves the registry. A gateway
sees only its share of a replica's steps, and none it can learn from while another gateway's
prefill is queued there: alone, three gateways learned almost none of a mixed fleet's speeds,
and under load almost none of the pool's rate.

The gateways find each other in a registry (`{prefix}routing:gateways`, a sorted set of ids
scored by their last heartbeat): every `_PEERS_EVERY_S` the reader refreshes its own entry
(and the expiry of its streams) and reads which others are there, so that a gateway that
starts is read within about two seconds, and one silent for `_PEER_TTL_S` is dropped.

With `pin_running`, each insert a gateway's request holds while it runs is marked so (a
fifth item, 1, and a sixth, the blocks its output holds, when it holds any), and the end of
that request is written as a release (`e`: its replica and the last hash of its prefix; with
`output_cached`, `o`: the blocks of its output the engine keeps). The
others pin the prefix, and reserve its output's room, in their index from the insert to the
release, and keep its output after it, as the engine holds them and as the gateway that sent
it does: without that,
each gateway's index let go of what the others' running requests held, and three gateways
sent fewer warm requests where one would. A gateway releases every pin of another that
leaves the registry, and all of them when Redis goes away or entries were lost (their
releases with them); one that dropped a release from its full queue says so on its next
write (`x`), and the others release all of its pins (`Router.release_remote_pins`).

Inserts and releases wait in a bounded queue, the oldest dropped (and counted) when Redis is
slow or away.
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
from routing.steps import sum_rates

if TYPE_CHECKING:
    from redis.asyncio import Redis
    from redis.asyncio.connection import Connection

    from routing import Router

log = logging.getLogger("prefix_gateway.shared")

Insert = tuple[str, str, float, Sequence[int], float, bool, int]
"""A prefix routed here: (pool, replica, decided at (time.time()), block hashes, uncached
prompt tokens it cost the replica, held: a request holds it there until its `Release`, the
blocks its output holds there meanwhile)."""
Release = tuple[str, str, int, int]
"""A request whose prefix was routed `held` ended: (pool, replica, its last block hash, the
blocks of its output the engine keeps cached)."""
Shared = Insert | Release
"""What a gateway queues to share, in the order it happened."""

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
_PEERS_EVERY_S = 1.0
"""How often a gateway says it is alive in the registry and reads who else is."""
_PEER_TTL_S = 10.0
"""A gateway whose last heartbeat is older than this is dropped from the registry."""
_STREAM_TTL_S = 120.0
"""A gateway's streams expire this long after its last heartbeat (it stopped or crashed):
long enough for the others to read its last entries."""
RATES_INTERVAL_S = 0.25
"""At most this often a gateway looks at what it learned of each replica's prefill rate, and
publishes it if it changed: every sample changes it, and a speed needs a few dozen samples."""
_FORGOTTEN_IDS = 4096
"""Last ids kept for streams no longer read (a peer that returns resumes where it was)."""


def encode_load(router: Router) -> bytes:
    """A router's own load as a gateway publishes it (keys sorted: an unchanged load is the
    same bytes, and is not written again)."""
    return orjson.dumps(router.load.own_load(), option=orjson.OPT_SORT_KEYS)


def encode_rates(router: Router) -> bytes:
    """What a router learned of each replica's own prefill rate, as a gateway publishes it
    (keys sorted: unchanged, it is not written again)."""
    return orjson.dumps(router.own_rates(), option=orjson.OPT_SORT_KEYS)


def _pairs(reply: Any) -> dict[bytes, Any]:
    """A map reply: a dict in RESP3, a flat list of keys and values in RESP2."""
    if isinstance(reply, dict):
        return reply
    it = iter(reply or ())
    return dict(zip(it, it, strict=False))


def _id(entry_id: bytes | str) -> tuple[int, int]:
    ms, _, seq = (entry_id.decode() if isinstance(entry_id, bytes) else entry_id).partition("-")
    return int(ms), int(seq or 0)


def recorder(queue: deque[Shared], cap: int, pool: str, dropped: Callable[[Shared], None],
             wake: asyncio.Event | None = None
             ) -> Callable[[str, Sequence[int], float, bool, int], None]:
    """`Router.on_record` for a gateway's (or worker's) queue of `pool`, on the request's
    path: one append, the oldest item dropped past `cap`. The first item queued sets `wake`
    (a gateway's writer writes it without waiting)."""
    now = time.time

    def recorded(replica: str, hashes: Sequence[int], uncached: float, held: bool,
                 output_blocks: int) -> None:
        if not queue:
            if wake is not None:
                wake.set()
        elif len(queue) >= cap:
            dropped(queue.popleft())
        queue.append((pool, replica, now(), hashes, uncached, held, output_blocks))

    return recorded


def releaser(queue: deque[Shared], cap: int, pool: str,
             dropped: Callable[[Shared], None]) -> Callable[[str, int, int], None]:
    """`Router.on_release` for a gateway's (or worker's) queue of `pool`: the release is
    queued after what was decided before it, the oldest item dropped past `cap`. Not woken
    for: the next write takes it (the load changed as the request ended, and is looked at
    within `load_interval_s`)."""

    def released(replica: str, last: int, cached_blocks: int) -> None:
        if len(queue) >= cap:
            dropped(queue.popleft())
        queue.append((pool, replica, last, cached_blocks))

    return released


def note_dropped(item: Shared, lost_releases: set[str], observer: Observer) -> None:
    """An item pushed out of a full queue: an insert is counted dropped; a release marks its
    pool, whose next write tells the others to release every pin of the writer's (`x`)."""
    if len(item) == 4:
        lost_releases.add(item[0])
    else:
        observer.shared_inserts(item[0], "dropped", 1)


def insert_row(replica: str, at: float, hashes: Sequence[int], uncached: float, held: bool,
               output_blocks: int) -> tuple[Any, ...]:
    """One insert as written: (replica, decided at, hashes, uncached tokens), a fifth item,
    1, when a request holds the prefix until its release (`releases_by_pool`), and a sixth,
    the blocks its output holds there meanwhile, when there are any. orjson writes the tuple
    and the hashes as arrays; the simulated gateways (loadtests/sim_sharing.py) write the same
    rows."""
    if not held:
        return (replica, at, hashes, uncached)
    if output_blocks:
        return (replica, at, hashes, uncached, 1, output_blocks)
    return (replica, at, hashes, uncached, 1)


def remote_insert(row: Sequence[Any]) -> tuple[str, Sequence[int], float, bool, int]:
    """A row `insert_row` wrote, as `Router.apply_remote_inserts` takes it: (replica, hashes,
    uncached tokens, held, output blocks). No uncached tokens: an older gateway's row; no
    output blocks: one that reserved none."""
    n = len(row)
    return (row[0], row[2], row[3] if n > 3 else 0.0, n > 4 and row[4] == 1,
            int(row[5]) if n > 5 else 0)


def by_pool(batch: Sequence[Shared]) -> dict[str, list[tuple[Any, ...]]]:
    """Each pool's inserts as written (`insert_row`). Gateways write them to Redis, workers
    without it to their files (gateway/workerprefixes.py)."""
    out: dict[str, list[tuple[Any, ...]]] = {}
    for item in batch:
        if len(item) == 7:
            pool, *row = item
            out.setdefault(pool, []).append(insert_row(*row))
    return out


def releases_by_pool(batch: Sequence[Shared]) -> dict[str, tuple[list[tuple[str, int]],
                                                                  list[int] | None]]:
    """Each pool's releases as written, in order: (replica, last block hash) of each request
    ended that held its prefix (`e`), and the blocks of each one's output its engine keeps
    cached (`o`, the same length; None when there are none, as without `output_cached`).
    Two lists rather than a third item in each release: a gateway of an earlier version
    reads `e` as pairs, and ignores `o`."""
    ended: dict[str, list[tuple[str, int]]] = {}
    cached: dict[str, list[int]] = {}
    for item in batch:
        if len(item) == 4:
            pool, replica, last, blocks = item  # type: ignore[misc]
            ended.setdefault(pool, []).append((replica, last))
            cached.setdefault(pool, []).append(blocks)
    return {pool: (rows, cached[pool] if any(cached[pool]) else None)
            for pool, rows in ended.items()}


def apply_inserts(router: Router, observer: Observer, pool: str, items: Sequence[Any],
                  lag_since: float | None, source: str | None = None) -> None:
    """Record in `router` the inserts another gateway (or worker) wrote, as `by_pool` gives
    them, and count them; with `lag_since`, observe the lag of those decided since then.
    With `source`, the one that wrote them, a prefix held by its request is pinned (with
    `pin_running`) until the release comes; without, nothing is pinned (inserts published
    again: their requests may have ended, and their releases gone by)."""
    applied = router.apply_remote_inserts(map(remote_insert, items), source)
    observer.shared_inserts(pool, "applied", applied)
    if lag_since is None:
        return
    now = time.time()
    for item in items:
        if item[1] >= lag_since:  # not what was decided before this one began
            observer.shared_lag(pool, max(0.0, now - item[1]))


class SharedRouting:
    """This gateway's side of the shared routing state (built with a `redis` section whose
    `shared_routing.enabled` is on)."""

    def __init__(self, cfg: RedisConfig, pools: Sequence[Pool], observer: Observer,
                 client: Redis | None = None) -> None:
        self.settings = cfg.shared_routing
        self.id = uuid.uuid4().hex[:16]
        """This gateway's id in Redis: it names its streams and its field in the registry."""
        self.observer = observer
        self.link = RedisLink(cfg, self._changed, client=client, messages=MESSAGES)
        self.pools = {p.name: p for p in pools}
        self.registry = self.link.key("routing", "gateways")
        self.streams = {name: self._stream(name, self.id) for name in self.pools}
        """This gateway's own stream per pool, which it writes and never reads."""
        self.peers: frozenset[str] = frozenset()
        """The other gateways in the registry at its last reading: their streams are read."""
        self._pool_of_stream: dict[bytes, str] = {}
        """Each peer's stream read (its key) -> its pool."""
        self._reading: list[str] = []
        """The keys of the peers' streams read, in the order XREAD names them."""
        self._peers_at = -_PEERS_EVERY_S
        """When the reader last read the registry (monotonic)."""
        self._heartbeat_at = -_PEERS_EVERY_S
        """When this gateway last said it is alive (monotonic)."""
        self.queue: deque[Shared] = deque()
        """Inserts and releases to write, oldest first."""
        self._lost_releases: set[str] = set()
        """Pools a release was dropped from (the queue full): the next write of each tells
        the others to release every pin of this gateway's (`x`), not to hold one for good."""
        self.recent: deque[tuple[str, int, bytes]] = deque()
        """The last inserts this gateway published, to publish again when a peer asks: (pool,
        inserts, their JSON array) per write, oldest first, about `resync_inserts` in all.
        Kept as written, in bytes: thousands of live tuples and lists would be walked by
        every pass of the garbage collector, which cost a busy gateway more CPU than all
        its writes to Redis."""
        self._recent_count = 0
        self.last_ids: dict[str, str] = {}
        """The last entry read of each peer's stream read (and of some no longer read)."""
        self.started_at = time.time()
        self._republish_at: float | None = None
        """When a peer asked for this gateway's recent inserts (None: nobody has)."""
        self._republished = 0.0
        self._own_load: dict[str, bytes] = {}
        self._load_sent = 0.0
        self._own_rates: dict[str, bytes] = {}
        """Pool -> what this gateway last published of the replicas' rates (`encode_rates`)."""
        self._rates_at = -RATES_INTERVAL_S
        """When the writer last looked at them (monotonic)."""
        self._rates: dict[str, dict[str, dict[str, list[float]]]] = {
            name: {} for name in self.pools}
        """Pool -> other gateway's id -> what it learned of each replica's rate (its last
        `own_rates`), kept while it is in the registry: what it learned stays true after it
        stops sending requests."""
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
            pool.router.on_record = recorder(self.queue, self.settings.max_queue, pool.name,
                                             self._dropped, self._wake)
            pool.router.on_release = releaser(self.queue, self.settings.max_queue, pool.name,
                                              self._dropped)

    # On the request's path: one append (`recorder`, `releaser`) -----------------------------

    def _stream(self, pool: str, gateway: str) -> str:
        return self.link.key("routing", pool, "inserts", gateway)

    def _dropped(self, item: Shared) -> None:
        note_dropped(item, self._lost_releases, self.observer)

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
        # A copy: a cancelled reader or writer drops its connection from the map as its
        # cancellation runs, which on a loaded machine can be while these wait.
        for conn in list(self._conns.values()):
            await conn.disconnect()
        self._conns.clear()
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
                # Their requests' ends are not read meanwhile: pins held for them would stay.
                pool.router.release_remote_pins()
            self._own_load = {}  # publish it again as soon as Redis is back
            self._own_rates = {}
            self._check_gap = True
            # Say this gateway is alive, and look for the others, as soon as it is back (a
            # Redis restarted without its data has an empty registry).
            self._peers_at = self._heartbeat_at = -_PEERS_EVERY_S

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
        """One write and one read that does not wait (what the two loops do, by hand, the
        registry read every time): True when a stream had more entries than one read
        takes."""
        await self.write(with_load)
        return await self.read(None, peers=True)

    def _heartbeat(self, now: float) -> list[tuple[Any, ...]]:
        """The commands that say this gateway is alive: its registry entry and its streams'
        expiry (set again on each heartbeat: a stopped gateway's expire)."""
        ttl_ms = int(1000 * _STREAM_TTL_S)
        return [("ZADD", self.registry, repr(now), self.id),
                *(("PEXPIRE", key, ttl_ms) for key in self.streams.values())]

    async def write(self, with_load: bool) -> None:
        """Write the queued inserts and, with them or with `with_load`, this gateway's load
        if it changed (or its heartbeat is due): one pipelined round trip, none when there
        is nothing to write. On an outage the inserts go back to the queue."""
        s = self.settings
        batch = list(self.queue)
        self.queue.clear()
        republish = self._due_republish()
        trim = ("MAXLEN", "~", s.stream_max_entries)
        pools = by_pool(batch)
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
        rates: dict[str, bytes] = {}
        if (with_load or batch) and time.monotonic() - self._rates_at >= RATES_INTERVAL_S:
            self._rates_at = time.monotonic()
            for pool in self.pools.values():
                learned = encode_rates(pool.router)
                if learned != self._own_rates.get(pool.name, b"{}"):
                    rates[pool.name] = learned
        commands: list[tuple[Any, ...]] = []
        heartbeat_due = time.monotonic() - self._heartbeat_at >= _PEERS_EVERY_S
        encoded = {name: orjson.dumps(items, default=list) for name, items in pools.items()}
        releases = releases_by_pool(batch)
        lost = set(self._lost_releases)
        for name in self.pools:
            fields: list[Any] = []
            if name in lost:  # before the inserts and releases that follow it
                fields += ["x", "1"]
            if name in encoded:
                fields += ["d", encoded[name]]
            if name in releases:
                ended, cached = releases[name]
                fields += ["e", orjson.dumps(ended)]
                if cached is not None:
                    fields += ["o", orjson.dumps(cached)]
            if name in loads:
                fields += ["l", b'{"t":%r,"r":%s}' % (now, loads[name])]
            if name in rates:
                fields += ["s", rates[name]]
            if fields:
                commands.append(("XADD", self.streams[name], *trim, "*", "g", self.id, *fields))
        if republish:
            again: dict[str, list[bytes]] = {}
            for pool, _, payload in self.recent:
                again.setdefault(pool, []).append(payload[1:-1])  # the array's items
            for pool, items in again.items():
                commands.append(("XADD", self.streams[pool], *trim, "*", "g", self.id,
                                 "d", b"[%s]" % b",".join(items), "r", "1"))
        if not commands:
            return
        if heartbeat_due:  # after the XADDs, which may have made the streams
            commands += self._heartbeat(time.time())
        try:
            await self._round_trip("write", commands)
        except BaseException:
            self._requeue(batch)
            if republish:
                self._republish_at = self._republish_at or time.monotonic()
            raise
        self.link.mark_up()
        self._lost_releases -= lost
        if heartbeat_due:
            self._heartbeat_at = time.monotonic()
        self._own_load.update(loads)
        self._own_rates.update(rates)
        for pool, items in pools.items():
            self._remember(pool, len(items), encoded[pool])
            self.observer.shared_inserts(pool, "published", len(items))

    def _remember(self, pool: str, count: int, payload: bytes) -> None:
        """Keep what was written to publish it again, dropping the oldest writes beyond
        `resync_inserts` (the newest is kept whole)."""
        recent = self.recent
        recent.append((pool, count, payload))
        self._recent_count += count
        cap = self.settings.resync_inserts
        while recent and (self._recent_count > cap and (len(recent) > 1 or not cap)):
            self._recent_count -= recent.popleft()[1]

    async def read(self, block_ms: int | None, peers: bool | None = None) -> bool:
        """Read the other gateways' new entries (waiting up to `block_ms` for one; None: not
        at all) and apply them, then drop loads older than `load_ttl_s`. The registry is
        read first when `peers`, or (None) every `_PEERS_EVERY_S`. True: a stream had more
        entries than one read takes (read on at once)."""
        if peers or (peers is None
                     and time.monotonic() - self._peers_at >= _PEERS_EVERY_S):
            await self._read_peers()
        behind = False
        changed: set[str] = set()
        keys = self._reading
        if keys:
            block = ("BLOCK", block_ms) if block_ms is not None else ()
            last = self.last_ids
            (got,) = await self._round_trip("read", [
                ("XREAD", "COUNT", _READ_COUNT, *block, "STREAMS", *keys,
                 *(last[k] for k in keys))])
            self.link.mark_up()
            for stream, entries in (got.items() if isinstance(got, dict) else got or ()):
                pool = self._apply(stream, entries)
                if pool is not None:
                    changed.add(pool)
                behind = behind or len(entries) >= _READ_COUNT
        elif block_ms:  # alone: nothing to wait on until the registry is read again
            await asyncio.sleep(block_ms / 1000)
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

    async def _read_peers(self) -> None:
        """Say this gateway is alive, drop the gateways silent for `_PEER_TTL_S` and read
        which others are there: one round trip on the reader's connection."""
        now = time.time()
        replies = await self._round_trip("read", [
            *self._heartbeat(now),
            ("ZREMRANGEBYSCORE", self.registry, "-inf", repr(now - _PEER_TTL_S)),
            ("ZRANGE", self.registry, 0, -1)])
        self.link.mark_up()
        self._peers_at = self._heartbeat_at = time.monotonic()
        found = frozenset(m.decode() if isinstance(m, bytes) else m for m in replies[-1])
        self._set_peers(found - {self.id})

    def _set_peers(self, peers: frozenset[str]) -> None:
        """Read `peers`' streams from here on: a new one's from its start (or where this
        gateway had left it), a dropped one's no longer (where it was is kept)."""
        if peers == self.peers:
            return
        if peers - self.peers:
            self._own_rates = {}  # a newcomer learns what this gateway knows at its next write
        for gateway in self.peers - peers:  # its requests' ends will not be read
            for pool in self.pools.values():
                pool.router.release_remote_pins(gateway)
        for name, theirs in self._rates.items():
            gone = theirs.keys() - peers
            for gateway in gone:
                del theirs[gateway]
            if gone:
                self.pools[name].router.apply_remote_rates(sum_rates(theirs.values()))
        self.peers = peers
        self._pool_of_stream = {self._stream(pool, g).encode(): pool
                                for g in sorted(peers) for pool in self.pools}
        self._reading = [k.decode() for k in self._pool_of_stream]
        last = self.last_ids
        for key in self._reading:
            last.setdefault(key, "0-0")
        if len(last) > len(self._reading) + _FORGOTTEN_IDS:
            reading = set(self._reading)
            for key in [k for k in last if k not in reading]:
                del last[key]

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

    def _requeue(self, batch: list[Shared]) -> None:
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
                 "most recent prefix inserts again", self._recent_count)
        return True

    @staticmethod
    def _load_of(pool: Pool) -> bytes:
        return encode_load(pool.router)

    # Reading ------------------------------------------------------------------------------

    def _apply(self, stream: bytes, entries: list[list[Any]]) -> str | None:
        """Apply a stream's entries; the pool's name if another gateway's load changed."""
        pool_name = self._pool_of_stream.get(stream)
        if pool_name is None or not entries:
            return None
        loads = self._loads[pool_name]
        load_changed = rates_changed = False
        self.last_ids[stream.decode()] = entries[-1][0].decode()
        router = self.pools[pool_name].router
        for _, raw in entries:
            fields = _pairs(raw)
            if b"q" in fields:  # a peer missed entries: publish ours again
                self._republish_at = self._republish_at or time.monotonic()
                continue
            raw_rates = fields.get(b"s")
            if raw_rates is not None:
                self._rates[pool_name][fields[b"g"].decode()] = orjson.loads(raw_rates)
                rates_changed = True
            raw_load = fields.get(b"l")
            if raw_load is not None:
                value = orjson.loads(raw_load)
                loads[fields[b"g"]] = (float(value["t"]), value["r"])
                load_changed = True
            source = fields[b"g"].decode()
            if b"x" in fields:  # it dropped a release: what it holds here is not known
                router.release_remote_pins(source)
            if b"d" in fields:
                # Published again (b"r"): its lag is the outage's, not the sharing's, and its
                # requests may have ended since (their releases read, or lost): none pinned.
                again = b"r" in fields
                apply_inserts(router, self.observer, pool_name, orjson.loads(fields[b"d"]),
                              None if again else self.started_at, None if again else source)
            if b"e" in fields:
                cached = fields.get(b"o")
                router.apply_remote_releases(source, orjson.loads(fields[b"e"]),
                                             orjson.loads(cached) if cached else ())
        if rates_changed:
            router.apply_remote_rates(sum_rates(self._rates[pool_name].values()))
        return pool_name if load_changed else None

    def _apply_loads(self, name: str) -> None:
        self.pools[name].router.apply_remote_load(
            sum_loads(replicas for _, replicas in self._loads[name].values()))

    async def _ask_if_missed(self) -> None:
        """After an outage: if a peer's stream lost entries this gateway had not read
        (trimmed past its last id, or gone with a Redis that lost its data), ask the others,
        on this gateway's own stream of that pool, to publish their recent inserts again."""
        missed: list[str] = []
        for key, pool in zip(self._reading, self._pool_of_stream.values(), strict=True):
            last = self.last_ids[key]
            if last == "0-0" or pool in missed:
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
        for pool in missed:  # the lost entries may have released pins held here
            self.pools[pool].router.release_remote_pins()
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
