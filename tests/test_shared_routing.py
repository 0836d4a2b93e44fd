"""Gateways sharing one Redis route as one: a prefix warmed through one gateway is routed to
the same replica by another, each sees the load the other put on the replicas, and when
Redis goes away they keep serving on their own state and converge again once it is back."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis as redis_lib
from prometheus_client.parser import text_string_to_metric_families

from routing.load import NO_LOAD
from routing.types import ReplicaView
from tests.conftest import eventually, poll, start_gateways, start_sims, tenant_prompt
from tests.inprocess import Harness, gateway, two_pools
from tests.redis_server import RedisServer

SHARED = "prefix_gateway.shared"


def shared_config(redis: dict[str, Any], **shared: Any) -> dict[str, Any]:
    config = two_pools(realtime=4)
    config["redis"] = {**redis, "shared_routing": {"flush_interval_s": 0.01,
                                                   "load_interval_s": 0.02, **shared}}
    return config


@asynccontextmanager
async def two_states(redis_server: RedisServer, routing: dict[str, Any] | None = None,
                     **shared: Any) -> AsyncIterator[tuple[Any, Any]]:
    """Two gateways' states sharing routing through `redis_server`, with no background task:
    each test drives their writers and readers by hand."""
    from backends.upstream.inprocess import InProcessUpstream
    from gateway.config import parse_config
    from gateway.state import GatewayState

    raw = shared_config(redis_server.config(), **shared)
    raw["routing"].update(routing or {})
    config = parse_config(raw)
    a, b = (GatewayState(config, upstream=InProcessUpstream()) for _ in range(2))
    try:
        assert a.shared is not None and b.shared is not None
        yield a, b
    finally:
        for state in (a, b):
            await state.shared.stop()
            await state.redis.aclose()


def chat(system: str, user: str = "hello") -> dict[str, Any]:
    return {"model": "tiny", "max_tokens": 2,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": user}]}


def hashes_of(gw: Harness, body: dict[str, Any]) -> list[int]:
    from routing.prompt import render_chat

    return gw.app.state.pool_by_name["realtime"].router.request_from_text(
        render_chat(body)).hashes


def warm_elsewhere(gw: Harness, body: dict[str, Any]) -> str:
    """Route `body`'s prefix on `gw` to a replica other than its cold home, as load would
    have made it (through the router, exactly as a request's decision records it)."""
    from routing.prompt import render_chat

    router = gw.app.state.pool_by_name["realtime"].router
    request = router.request_from_text(render_chat(body))
    home = router.policy.choose(request, [ReplicaView(name=n) for n in router.indexes],
                                router).replica
    other = next(n for n in sorted(router.indexes) if n != home)
    assert router.route(request, [ReplicaView(name=other)]).replica == other
    return other


async def metric(gw: Harness, name: str, **labels: str) -> float | None:
    for s in await gw.metrics():
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    return None


def requests_by_replica(stats: dict[str, Any]) -> dict[str, int]:
    return {r["name"]: r["requests"] for p in stats["pools"] for r in p["replicas"]}


async def served_by(gw: Harness, body: dict[str, Any]) -> str:
    """Send `body` through `gw`; the replica whose count of answered requests rose."""
    before = requests_by_replica(await gw.stats())
    r = await gw.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    after = requests_by_replica(await gw.stats())
    rose = [name for name, n in after.items() if n > before.get(name, 0)]
    assert len(rose) == 1, (before, after)
    return rose[0]


async def test_a_prefix_warmed_on_one_gateway_is_routed_there_by_the_other(
        redis_server: RedisServer) -> None:
    config = shared_config(redis_server.config())
    async with gateway(config) as a, gateway(config) as b:
        await eventually(lambda: metric(b, "gateway_shared_state_up"))
        body = chat(tenant_prompt(1))
        # Warmed through A on a replica that is not the prefix's cold home: B, which never
        # saw it, would send it home; once A's insert reaches B it follows A.
        replica = warm_elsewhere(a, body)
        hashes = hashes_of(b, body)
        router_b = b.app.state.pool_by_name["realtime"].router
        await eventually(lambda: router_b.matched_blocks(replica, hashes) == len(hashes))
        assert await served_by(b, body) == replica
        # And through HTTP: what A routes, B learns.
        body2 = chat(tenant_prompt(2))
        first = await served_by(a, body2)
        h2 = hashes_of(b, body2)
        await eventually(lambda: router_b.matched_blocks(first, h2) == len(h2))
        # A's request is over: once B knows (its load on `first` reached B too), B follows.
        await eventually(lambda: not router_b.load.remote)
        assert await served_by(b, body2) == first
        # Each applies what the other published (B's two decisions reach A in time), and
        # none of its own.
        async def inserts(gw: Harness, direction: str) -> float:
            return await metric(gw, "gateway_shared_state_inserts_total", pool="realtime",
                                direction=direction) or 0

        for gw in (a, b):
            await eventually(lambda gw=gw: _is(inserts(gw, "published"), 2))
            await eventually(lambda gw=gw: _is(inserts(gw, "applied"), 2))
        assert [await inserts(gw, "applied") for gw in (a, b)] == [2, 2]  # nothing twice
        lag = await metric(b, "gateway_shared_state_lag_seconds_count", pool="realtime")
        assert lag is not None and lag >= 2


async def test_load_on_one_gateway_is_seen_by_the_other(redis_server: RedisServer) -> None:
    config = shared_config(redis_server.config())
    async with gateway(config) as a, gateway(config) as b:
        load_a = a.app.state.pool_by_name["realtime"].router.load
        router_b = b.app.state.pool_by_name["realtime"].router
        # What an attempt books on dispatch: three requests and their prefill on rt-2.
        for sent_at in (1000.25, 1000.5, 1000.75):
            load_a.dispatched("rt-2", 1000.0, sent_at)
        await eventually(lambda: router_b.load.view("rt-2").inflight == 3)
        view = router_b.load.view("rt-2")
        assert view.pending_prefill_tokens == 3000.0
        assert router_b.load.inflight.get("rt-2", 0) == 0  # not B's own to finish
        # When A's oldest request there was sent: B credits none of its own ahead of it. And
        # A's three streamed requests awaiting a first token: the waiting count of an engine
        # that counts no first tokens holds them (`LoadTracker.engine_prefills_waiting`).
        assert router_b.load.remote["rt-2"][3:] == (0, 1000.25, 0, 3)
        # A's first token there: B learns that a step there ended a prefill of A's.
        load_a.first_token("rt-2", 1000.0, 1001.0, 1000.25)
        await eventually(lambda: router_b.load.remote["rt-2"][3:] == (1, 1000.5, 0, 2))
        load_a.first_token("rt-2", 2000.0)
        for _ in range(3):
            load_a.finished("rt-2", 0.0, True)
        await eventually(lambda: router_b.load.view("rt-2").inflight == 0)
        assert router_b.load.view("rt-2").pending_prefill_tokens == 0.0
        # A request of A's passed through whole: B counts it among those the engine's count
        # of first tokens must be shared with (`LoadTracker.engine_first_tokens`).
        load_a.dispatched("rt-2", 500.0, 1002.0, blind_at=5.0)
        await eventually(lambda: router_b.load.remote.get("rt-2", NO_LOAD)[5:] == (1, 0))


async def test_load_booked_after_a_quiet_spell_is_seen_without_any_insert(
        redis_server: RedisServer) -> None:
    """A gateway that has said "nothing in flight" still looks at its load: a request that
    records no prefix insert (a prompt shorter than one block) must not stay unseen."""
    config = shared_config(redis_server.config())
    async with gateway(config) as a, gateway(config) as b:
        state = a.app.state
        stream = state.shared.streams["realtime"]
        # Its first look at its load, published: from here it has nothing queued to write.
        await eventually(lambda: state.redis.xlen(stream))
        # ...and its writer waits for something to write.
        await eventually(lambda: not state.shared.queue and state.shared._wake._waiters)
        router_b = b.app.state.pool_by_name["realtime"].router
        state.pool_by_name["realtime"].router.load.dispatched("rt-1", 10.0)
        await eventually(lambda: router_b.load.view("rt-1").inflight == 1)


async def test_redis_killed_and_restarted_mid_run(tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=SHARED)
    server = RedisServer(tmp_path / "redis")
    server.start()
    config = shared_config(server.config())
    failures: list[str] = []
    sent = 0
    try:
        async with AsyncExitStack() as stack:
            a = await stack.enter_async_context(gateway(config))
            b = await stack.enter_async_context(gateway(config))
            for gw in (a, b):
                await eventually(lambda gw=gw: metric(gw, "gateway_shared_state_up"))
            stop = asyncio.Event()

            async def traffic(gw: Harness, tenant: int) -> None:
                nonlocal sent
                i = 0
                while not stop.is_set():
                    r = await gw.http.post("/v1/chat/completions",
                                           json=chat(tenant_prompt(tenant + i % 5), f"q{i}"))
                    sent += 1
                    if r.status_code != 200:
                        failures.append(f"{r.status_code} {r.text[:200]}")
                    i += 1

            load = [asyncio.create_task(traffic(a, 10)), asyncio.create_task(traffic(b, 20))]
            # However the test ends, the traffic stops (callbacks run last pushed first).
            stack.push_async_callback(asyncio.gather, *load, return_exceptions=True)
            stack.callback(stop.set)
            await eventually(lambda: sent >= 10)
            server.stop()
            for gw in (a, b):
                await eventually(lambda gw=gw: _is(metric(gw, "gateway_shared_state_up"), 0))
            before = sent
            await eventually(lambda: sent >= before + 20)  # served meanwhile, on local state
            # A prefix warmed on A while Redis is away: B cannot know it yet.
            body = chat(tenant_prompt(99))
            replica = warm_elsewhere(a, body)
            hashes = hashes_of(b, body)
            router_b = b.app.state.pool_by_name["realtime"].router
            assert router_b.matched_blocks(replica, hashes) == 0
            server.start()
            for gw in (a, b):
                await eventually(lambda gw=gw: _is(metric(gw, "gateway_shared_state_up"), 1))
            await eventually(lambda: router_b.matched_blocks(replica, hashes) == len(hashes))
            stop.set()
            await asyncio.gather(*load)
            # Alone now (and A's load on it over): B sends the prefix where A did.
            await eventually(lambda: not router_b.load.remote)
            assert await served_by(b, body) == replica
    finally:
        server.stop()
    assert not failures, failures[:5]
    assert sent > before + 20
    logged = [r.getMessage() for r in caplog.records if r.name == SHARED]
    # Once per gateway that it went, once that it came back: not per failed command.
    assert sum("does not answer now" in m for m in logged) == 2, logged
    assert sum("answers again" in m for m in logged) == 2, logged


async def _is(value: Any, expected: float) -> bool:
    return (await value) == expected


async def test_sharing_off_keeps_each_gateway_to_its_own_state(
        redis_server: RedisServer) -> None:
    redis = redis_server.config()
    config = shared_config(redis, enabled=False)
    async with gateway(config) as a, gateway(config) as b:
        for gw in (a, b):  # nothing that could share: no task, no hook on the routers
            assert gw.app.state.shared is None
            assert gw.app.state.pool_by_name["realtime"].router.on_record is None
        body = chat(tenant_prompt(3))
        replica = warm_elsewhere(a, body)
        await b.http.get("/health")
        # And nothing was written: no routing key under the gateways' prefix.
        client = redis_lib.Redis.from_url(redis["url"])
        try:
            assert not list(client.scan_iter(match=f"{redis['key_prefix']}routing:*"))
        finally:
            client.close()
        router_b = b.app.state.pool_by_name["realtime"].router
        assert router_b.matched_blocks(replica, hashes_of(b, body)) == 0
        assert await metric(b, "gateway_shared_state_up") is None


def test_serve_processes_share_routing_through_redis(redis_server: RedisServer,
                                                     tmp_path: Path) -> None:
    from gateway import processes
    from tests.conftest import two_pool_config

    sims = start_sims(["vllm"] * 4 + ["trtllm"], tmp_path)
    try:
        ports = processes.free_ports(2)
        redis = {**redis_server.config(), "shared_routing": {"flush_interval_s": 0.01}}
        configs = {}
        for name, port in zip(("a", "b"), ports, strict=True):
            c = two_pool_config(sims.urls[:4], sims.urls[4:], port)
            c["redis"] = redis
            configs[name] = c
        a, b = start_gateways(configs, tmp_path)
        try:
            with httpx.Client(timeout=30) as http:
                poll(lambda: "gateway_shared_state_up 1.0" in http.get(b.url + "/metrics").text)
                for i in range(8):
                    body = chat(tenant_prompt(50 + i))
                    assert http.post(a.url + "/v1/chat/completions",
                                     json=body).status_code == 200
                    # Once A's inserts reached B, B sends the same prefix where A did.
                    poll(lambda i=i: _applied(http, b.url) >= i + 1)
                    poll(lambda: not any(  # and that A's request is over
                        r["other_gateways_inflight"]
                        for p in http.get(b.url + "/admin/stats").json()["pools"]
                        for r in p["replicas"]))
                    assert http.post(b.url + "/v1/chat/completions",
                                     json=body).status_code == 200
                # Each gateway sent the same prefixes to the same replicas.
                assert requests_by_replica(http.get(a.url + "/admin/stats").json()) == \
                    requests_by_replica(http.get(b.url + "/admin/stats").json())
                # B found every prefix A had sent in its index: none was cold to it.
                pools = http.get(b.url + "/admin/stats").json()["pools"]
                assert pools[0]["decisions_by_reason"] == {"affinity": 8}, pools[0]
        finally:
            a.stop()
            b.stop()
    finally:
        sims.stop()


def _applied(http: httpx.Client, url: str) -> float:
    """Prefix inserts of other gateways the gateway at `url` applied."""
    text = http.get(url + "/metrics").text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "gateway_shared_state_inserts_total"
               and s.labels == {"pool": "realtime", "direction": "applied"})


async def test_a_gateway_that_missed_entries_asks_and_the_others_publish_again(
        redis_server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    """The resync after an outage, step by step (each tick by hand, no background task): B
    comes back to a stream trimmed past the last entry it read."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    caplog.set_level(logging.INFO, logger=SHARED)
    async with two_states(redis_server) as (a, b):
        sa, sb = a.shared, b.shared
        stream = sa.streams["realtime"]
        router_a = a.pool_by_name["realtime"].router
        router_b = b.pool_by_name["realtime"].router
        from routing.prompt import render_chat

        request = router_a.request_from_text(render_chat(chat(tenant_prompt(5))))
        router_a.route(request, [ReplicaView(name="rt-3")])
        await sa.tick(True)
        await sb.tick(True)  # B reads it in its turn: it follows the stream
        assert router_b.matched_blocks("rt-3", request.hashes) == len(request.hashes)
        # A decides again; before B reads it, B loses Redis and the stream is trimmed past
        # what B read (a peer far ahead, a small stream_max_entries).
        later = router_a.request_from_text(render_chat(chat(tenant_prompt(6))))
        router_a.route(later, [ReplicaView(name="rt-2")])
        await sa.tick(False)
        sb.link.mark_down(RedisConnectionError("test"))
        await a.redis.xtrim(stream, maxlen=0, approximate=False)
        count_before = sum(b.metrics.shared_lag.rows[("realtime",)][:-1])
        assert count_before == 1  # A's first decision, read by B in order
        await sb._ask_if_missed()  # what its tick does first, once Redis answers again
        assert not sb._check_gap
        await sb.tick(False)
        assert router_b.matched_blocks("rt-2", later.hashes) == 0  # lost with the stream
        await sa.tick(False)  # A reads B's request...
        await sa.tick(False)  # ...and publishes its recent inserts again
        await sb.tick(False)
        assert router_b.matched_blocks("rt-2", later.hashes) == len(later.hashes)
        logged = [r.getMessage() for r in caplog.records if r.name == SHARED]
        assert any("asking the other gateways to publish theirs again" in m for m in logged)
        assert any("publishing this one's 2 most recent prefix inserts again" in m
                   for m in logged)
        # Published again is not a decision's lag: the histogram did not count it.
        assert sum(b.metrics.shared_lag.rows[("realtime",)][:-1]) == count_before


async def test_an_idle_gateway_writes_nothing_and_a_stopping_one_drops_its_load(
        redis_server: RedisServer) -> None:
    """Before, every flush interval sent a round trip (write, read and the others' load),
    traffic or none: 12-25 ms of CPU a second per gateway. Now the writer writes only what
    changed, and the reader waits on the stream."""
    async with two_states(redis_server) as (a, b):
        sa, sb = a.shared, b.shared
        stream = sa.streams["realtime"]
        await sa.write(True)  # its first look at its load: nothing in flight, said once
        written = await a.redis.xlen(stream)
        for _ in range(3):
            await sa.write(True)
        assert await a.redis.xlen(stream) == written  # idle: nothing sent
        load_a = a.pool_by_name["realtime"].router.load
        load_a.dispatched("rt-1", 500.0)
        await sa.write(False)
        assert await a.redis.xlen(stream) == written  # load is looked at when due only
        await sa.write(True)
        assert await a.redis.xlen(stream) == written + 1
        router_b = b.pool_by_name["realtime"].router
        await sb.read(None)
        assert router_b.load.view("rt-1").inflight == 1
        await sa.stop()  # says it has nothing in flight any more
        await sb.read(None)
        assert router_b.load.remote == {}


async def test_a_connection_dropped_while_stopping_does_not_break_the_stop(
        redis_server: RedisServer) -> None:
    """A reader or writer cancelled by `stop` drops its connection from the gateway's map when
    its cancellation runs, which can be while `stop` disconnects the others (a loaded
    machine): iterating the map itself then raised "dictionary keys changed during
    iteration" out of the gateway's shutdown."""
    async with two_states(redis_server) as (a, _):
        shared = a.shared
        await shared.write(True)
        await shared.read(None)
        assert set(shared._conns) == {"write", "read"}
        writer, reader = shared._conns["write"], shared._conns["read"]
        disconnect = writer.disconnect

        async def dropping_the_reader(*args: Any, **kwargs: Any) -> None:
            await disconnect(*args, **kwargs)
            shared._conns.pop("read", None)  # as the cancelled reader's handler does

        writer.disconnect = dropping_the_reader
        await shared.stop()
        assert not writer.is_connected and not reader.is_connected


async def test_a_gateway_never_reads_its_own_entries_back(redis_server: RedisServer) -> None:
    """Each gateway writes a stream of its own and reads only the others': its reader is not
    woken by its own writes to parse and discard them (on one shared stream per pool, every
    write of a busy gateway did that)."""
    from routing.prompt import render_chat

    async with two_states(redis_server) as (a, b):
        sa, sb = a.shared, b.shared
        assert sa.streams["realtime"] != sb.streams["realtime"]
        received: dict[str, list[bytes]] = {"a": [], "b": []}
        for name, s in (("a", sa), ("b", sb)):
            def spy(stream: bytes, entries: list[Any], name: str = name,
                    apply: Any = s._apply) -> str | None:
                received[name] += [dict(_fields(raw))[b"g"] for _, raw in entries]
                return apply(stream, entries)

            s._apply = spy  # type: ignore[method-assign]
        router_a = a.pool_by_name["realtime"].router
        for i in range(3):
            request = router_a.request_from_text(render_chat(chat(tenant_prompt(30 + i))))
            router_a.route(request, [ReplicaView(name="rt-1")])
            await sa.tick(True)
        await sb.tick(True)
        await sa.tick(False)
        # A read only B's entry (its load), B all of A's: nobody its own.
        assert received["a"] and set(received["a"]) == {sb.id.encode()}
        assert len(received["b"]) >= 3 and set(received["b"]) == {sa.id.encode()}
        router_b = b.pool_by_name["realtime"].router
        assert router_b.matched_blocks("rt-1", request.hashes) == len(request.hashes)


async def test_what_one_gateway_learned_of_a_replicas_speed_the_other_prices_it_by(
        redis_server: RedisServer) -> None:
    """Gateways sharing a fleet each see a share of its steps: each alone would take that
    much longer to tell a slow replica from the others (through three gateways on a fleet
    of two speeds, almost never)."""
    from gateway.shared_routing import RATES_INTERVAL_S
    from tests.test_routing import feed_replica

    async with two_states(redis_server) as (a, b):
        sa, sb = a.shared, b.shared
        stream = sa.streams["realtime"]
        load_a = a.pool_by_name["realtime"].router.load
        router_b = b.pool_by_name["realtime"].router
        for name in ("rt-0", "rt-1", "rt-2"):
            feed_replica(load_a, name, 20, 0.05, 0.05)
        feed_replica(load_a, "rt-3", 20, 0.15, 0.15)  # three times slower
        assert load_a.view("rt-3").speed == pytest.approx(1 / 3, rel=0.02)
        assert router_b.load.view("rt-3").speed == 1.0
        assert load_a.steps.rate > 0.0 and router_b.load.steps.rate == 0.0
        await sa.tick(True)
        await sb.tick(True)
        assert router_b.load.view("rt-3").speed == pytest.approx(1 / 3, rel=0.02)
        assert router_b.load.view("rt-0").speed == 1.0
        # The pool's rate too: b has timed no step of its own.
        assert router_b.load.steps.rate == pytest.approx(load_a.steps.rate, rel=1e-4)
        # Unchanged, what it learned is not written again, however often the writer looks.
        written = await a.redis.xlen(stream)
        sa._rates_at -= RATES_INTERVAL_S
        await sa.write(True)
        assert await a.redis.xlen(stream) == written
        # A gateway that leaves the registry takes what it learned with it.
        sb._set_peers(frozenset())
        assert router_b.load.steps.replica_rate("rt-3") is None
        assert router_b.load.view("rt-3").speed == 1.0
        assert router_b.load.steps.rate == 0.0


def _fields(raw: Any) -> list[tuple[bytes, Any]]:
    if isinstance(raw, dict):
        return list(raw.items())
    return list(zip(raw[::2], raw[1::2], strict=True))


async def test_a_gateway_started_later_is_read_and_a_silent_one_dropped(
        redis_server: RedisServer) -> None:
    """The gateways find each other in the registry: one that starts after the others is
    read by them (its prefixes reach their index), and one that stopped heartbeating is
    dropped from it (its streams are no longer read, and expire)."""
    config = shared_config(redis_server.config())
    async with gateway(config) as a:
        shared_a = a.app.state.shared
        # A alone has read the registry: nobody else is there.
        await eventually(lambda: metric(a, "gateway_shared_state_up"))
        assert shared_a.peers == frozenset()
        async with gateway(config) as b:
            shared_b = b.app.state.shared
            await eventually(lambda: shared_a.peers == {shared_b.id})
            body = chat(tenant_prompt(7))
            replica = warm_elsewhere(b, body)
            hashes = hashes_of(a, body)
            router_a = a.app.state.pool_by_name["realtime"].router
            await eventually(lambda: router_a.matched_blocks(replica, hashes) == len(hashes))
            # A gateway that stopped without a word: its heartbeat ages past the limit.
            redis = a.app.state.redis
            await redis.zadd(shared_a.registry, {"gone": 1.0})
            await eventually(lambda: _is_none(redis.zscore(shared_a.registry, "gone")))
            assert "gone" not in shared_a.peers
            # A's own streams expire unless it goes on heartbeating.
            assert await redis.pttl(shared_a.streams["realtime"]) > 0


async def _is_none(value: Any) -> bool:
    return (await value) is None


async def test_what_a_gateway_keeps_to_publish_again_is_nothing_the_collector_walks(
        redis_server: RedisServer) -> None:
    """The inserts kept for a resync are kept as written (bytes), not as the queued tuples
    holding the requests' hash lists: thousands of those, live for seconds, made every
    collector pass of a busy gateway walk them (+0.015 ms of CPU per request). A resync
    still publishes them."""
    import gc
    import sys

    async with two_states(redis_server) as (a, b):
        sa, sb = a.shared, b.shared
        router_a = a.pool_by_name["realtime"].router
        hashes = [11, 22, 33]
        refs = sys.getrefcount(hashes)
        router_a.record("rt-2", hashes, 48.0)
        assert sys.getrefcount(hashes) == refs + 1  # queued
        await sa.tick(True)
        assert sys.getrefcount(hashes) == refs  # written and kept: no longer held
        gc.collect()
        assert sa.recent and not any(gc.is_tracked(item) for item in sa.recent)
        # B asks, A publishes its recent inserts again, B has them.
        router_b = b.pool_by_name["realtime"].router
        await sb.tick(True)
        router_b.indexes["rt-2"].clear()
        await sb.link.client.xadd(sb.streams["realtime"], {"g": sb.id, "q": "1"})
        await sa.tick(False)  # reads B's request
        await sa.tick(False)  # publishes again
        await sb.tick(False)
        assert router_b.matched_blocks("rt-2", hashes) == 3


async def test_a_request_running_through_one_gateway_is_pinned_in_the_others_index(
        redis_server: RedisServer) -> None:
    """With `pin_running`, each gateway pins in its index the prefixes the engines hold for
    the other gateways' running requests, as for its own, and lets them go when those end
    or when the gateway that sent them leaves: without it, the others' indexes evicted
    what the engines still held (three gateways agreed with one on fewer warm requests)."""
    from routing.prompt import render_chat

    async with two_states(redis_server, {"pin_running": True}) as (a, b):
        sa, sb = a.shared, b.shared
        router_a = a.pool_by_name["realtime"].router
        router_b = b.pool_by_name["realtime"].router
        requests, decisions = [], []
        for i in range(2):
            request = router_a.request_from_text(render_chat(chat(tenant_prompt(40 + i))))
            requests.append(request)
            decisions.append(router_a.route(request, [ReplicaView(name="rt-1")]))
        await sa.tick(True)
        await sb.tick(True)
        assert router_b.remote_pins(sa.id) == 2
        pinned = router_b.indexes["rt-1"].pinned_blocks
        assert pinned == len(set(requests[0].hashes) | set(requests[1].hashes))
        router_a.finished(decisions[0], False)  # abandoned while queued: released all the same
        await sa.tick(True)
        await sb.tick(True)
        assert router_b.remote_pins(sa.id) == 1
        assert router_b.indexes["rt-1"].pinned_blocks == len(requests[1].hashes)
        # A leaves the registry: its request's end will never be read here.
        sb._set_peers(frozenset())
        assert router_b.remote_pins() == 0 and router_b.indexes["rt-1"].pinned_blocks == 0


async def test_a_request_ended_on_one_gateway_leaves_its_output_in_the_others_index(
        redis_server: RedisServer) -> None:
    """With `output_cached`, the engine keeps the blocks a request generated whichever
    gateway sent it: its release carries them (`o`, beside the `e` pairs an earlier version
    reads), and the other gateway's index keeps them as the sender's does."""
    from routing.prompt import render_chat

    async with two_states(redis_server, {"pin_running": True, "output_cached": True}) as (
            a, b):
        sa, sb = a.shared, b.shared
        router_a = a.pool_by_name["realtime"].router
        router_b = b.pool_by_name["realtime"].router
        request = router_a.request_from_text(render_chat(chat(tenant_prompt(45))))
        decision = router_a.route(request, [ReplicaView(name="rt-1")])
        router_a.dispatched(decision, time.time())
        router_a.first_token(decision, time.time(), time.time())
        await sa.tick(True)
        await sb.tick(True)
        held = len(router_b.indexes["rt-1"])
        assert held == len(router_a.indexes["rt-1"]) == len(request.hashes)
        generated = 40 * request.block_tokens
        router_a.finished(decision, True, output_tokens=int(generated))
        await sa.tick(True)
        await sb.tick(True)
        assert router_b.remote_pins() == 0
        assert len(router_b.indexes["rt-1"]) == len(router_a.indexes["rt-1"]) == held + 40
        entries = await a.redis.xrange(sa.streams["realtime"])
        ended = [fields for _, fields in entries if b"e" in fields]
        assert len(ended) == 1
        assert orjson.loads(ended[0][b"e"]) == [["rt-1", request.hashes[-1]]]
        assert orjson.loads(ended[0][b"o"]) == [40]


async def test_a_release_dropped_from_a_full_queue_lets_the_others_release_every_pin(
        redis_server: RedisServer) -> None:
    """A gateway whose queue overflowed (Redis slow) may have dropped the release of a pin
    the others hold: its next write says so, and they release every pin of its, rather
    than hold one for good. Pins of its requests decided after are kept."""
    from routing.prompt import render_chat

    async with two_states(redis_server, {"pin_running": True}, max_queue=100) as (a, b):
        sa, sb = a.shared, b.shared
        router_a = a.pool_by_name["realtime"].router
        router_b = b.pool_by_name["realtime"].router
        request = router_a.request_from_text(render_chat(chat(tenant_prompt(50))))
        decision = router_a.route(request, [ReplicaView(name="rt-2")])
        await sa.tick(True)
        await sb.tick(True)
        assert router_b.remote_pins(sa.id) == 1
        router_a.finished(decision, True)
        for i in range(100):  # its release is pushed out of the queue
            router_a.record("rt-0", [1000 + i], 1.0)
        later = router_a.request_from_text(render_chat(chat(tenant_prompt(51))))
        router_a.route(later, [ReplicaView(name="rt-3")])
        await sa.tick(True)
        await sb.tick(True)
        assert router_b.remote_pins(sa.id) == 1
        assert router_b.indexes["rt-2"].pinned_blocks == 0
        assert router_b.indexes["rt-3"].pinned_blocks == len(later.hashes)
        # Said once: the next write does not release the later pin.
        router_a.record("rt-0", [2000], 1.0)
        await sa.tick(True)
        await sb.tick(True)
        assert router_b.remote_pins(sa.id) == 1


async def test_through_http_a_request_running_on_one_gateway_is_pinned_by_the_other(
        redis_server: RedisServer) -> None:
    """The request path itself: a streamed completion running through gateway A holds its
    prompt's prefix pinned in B's index, and room for its output (its max_tokens), until the
    replica ends it, whichever replica A chose."""
    from routing.prompt import render_completion
    from tests.test_admission import holding

    config = shared_config(redis_server.config())
    config["routing"]["pin_running"] = True
    held = holding("rt-0", "rt-1", "rt-2", "rt-3")
    async with gateway(config, handlers=held) as a, gateway(config, handlers=held) as b:
        shared_a = a.app.state.shared
        await eventually(lambda: b.app.state.shared.peers == {shared_a.id})
        prompt = tenant_prompt(60)
        client = a.openai()

        async def complete() -> list[Any]:
            stream = await client.completions.create(model="tiny", prompt=prompt,
                                                     max_tokens=300, stream=True)
            return [chunk async for chunk in stream]

        running = asyncio.create_task(complete())
        router_b = b.app.state.pool_by_name["realtime"].router
        hashes = router_b.request_from_text(render_completion({"prompt": prompt})).hashes
        await eventually(lambda: router_b.remote_pins(shared_a.id) == 1)
        replica = next(name for name, h in held.items() if h.prompts)
        assert router_b.indexes[replica].pinned_blocks == len(hashes)
        # Half its max_tokens: a vLLM pool's engine allocates as it decodes.
        assert router_b.output_reserve == 0.5
        output_blocks = int(150 / (router_b.block_chars / router_b.chars_per_token))
        assert output_blocks > 0
        assert router_b.indexes[replica].reserved == output_blocks
        shown = {r["name"]: r for r in (await b.stats())["pools"][0]["replicas"]}
        assert shown[replica]["index_pinned_blocks"] == len(hashes)
        assert shown[replica]["index_reserved_blocks"] == output_blocks
        router_a = a.app.state.pool_by_name["realtime"].router
        assert router_a.indexes[replica].reserved == output_blocks  # from its decision, as B
        held[replica].finish()
        chunks = await running
        assert "".join(c.choices[0].text for c in chunks) == "first last"
        await eventually(lambda: router_b.remote_pins() == 0)
        assert router_b.indexes[replica].pinned_blocks == 0
        assert router_b.indexes[replica].reserved == 0
        await eventually(lambda: router_a.indexes[replica].reserved == 0)
        # Still held as an ordinary entry: the engine keeps it cached after the request.
        assert router_b.matched_blocks(replica, hashes) == len(hashes)
