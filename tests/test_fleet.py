"""Replicas joining and leaving a running gateway: configuration reloads and the admin API
(gateway/fleet.py, gateway/reload.py), in process. The real process's SIGHUP and file watch
are tested in tests/test_reload_process.py."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import yaml

from backends.sim.app import SimApp
from backends.sim.replica import SimReplicaSpec
from backends.upstream.inprocess import Handler, HandlerResponse
from gateway.config import key_digest
from gateway.reload import Reloader
from tests.conftest import eventually
from tests.inprocess import Harness, gateway, sim_handler, two_pools

RT1 = "http://rt-1.test:8000"


def new_sim(name: str) -> SimApp:
    return SimApp.from_spec(SimReplicaSpec(name=name, kind="vllm", models=("tiny",),
                                           profile="llama-8b-h200", time_scale=0.02))


def reloader(gw: Harness, path: Path) -> Reloader:
    return Reloader(path, gw.app.fleet, gw.app.state.metrics)


def write(path: Path, config: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(config))
    return path


def posts_to(gw: Harness, url: str, since: int = 0) -> int:
    return sum(1 for method, u in gw.upstream.requests[since:]
               if method == "POST" and u.startswith(url + "/"))


async def listed(gw: Harness) -> dict[str, dict[str, Any]]:
    r = await gw.http.get("/admin/replicas")
    assert r.status_code == 200
    return {rep["name"]: rep for p in r.json()["pools"] for rep in p["replicas"]}


async def sample(gw: Harness, name: str, **labels: str) -> float | None:
    for s in await gw.metrics():
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    return None


async def complete(gw: Harness, prompt: str) -> httpx.Response:
    return await gw.http.post("/v1/completions", json={
        "model": "tiny", "prompt": prompt, "max_tokens": 2})


async def test_a_reload_adds_a_replica_that_takes_traffic_once_healthy(tmp_path, caplog) -> None:
    sim = new_sim("rt-1")
    healthy = asyncio.Event()
    inner = sim_handler(sim)

    async def rt1(method: str, path: str, headers: Mapping[str, str],
                  body: bytes) -> HandlerResponse:
        if path == "/health" and not healthy.is_set():
            return HandlerResponse(503, b"starting")
        return await inner(method, path, headers, body)

    caplog.set_level(logging.INFO, logger="prefix_gateway")
    try:
        async with gateway(two_pools(realtime=1), handlers={}) as gw:
            gw.upstream.mount(RT1, rt1)
            path = write(tmp_path / "gw.yaml", two_pools(realtime=2))
            assert reloader(gw, path).reload("test")
            assert any(r.levelno == logging.INFO and "realtime/rt-1 added" in r.getMessage()
                       for r in caplog.records)
            assert await sample(gw, "gateway_config_reloads_total", result="ok") == 1
            rep = (await listed(gw))["rt-1"]
            assert rep["healthy"] is False and rep["draining"] is False
            # Probed (and failing) at once: until a check passes it takes no request.
            await eventually(lambda: any(u == RT1 + "/health" for _, u in gw.upstream.requests))
            for i in range(12):
                r = await complete(gw, f"cold prompt {i} " * 40)
                assert r.status_code == 200 and r.headers["x-gateway-replica"] == "rt-0"
            assert posts_to(gw, RT1) == 0
            healthy.set()

            async def rt1_healthy() -> bool:
                return (await listed(gw))["rt-1"]["healthy"]

            await eventually(rt1_healthy)
            served = set()
            for i in range(24):
                r = await complete(gw, f"another prompt {i} " * 40)
                assert r.status_code == 200
                served.add(r.headers["x-gateway-replica"])
            assert served == {"rt-0", "rt-1"}
            assert await sample(gw, "gateway_replica_up", replica="rt-1") == 1
    finally:
        sim.close()


def gated(sim: SimApp, gate: asyncio.Event) -> Handler:
    """The sim's handler, whose streams stop after their first two SSE events until `gate`
    opens. Counted in events, not in the sim's chunks: on a busy machine the sim catches up
    by sending several tokens in one chunk, and a whole stream can come in two."""
    inner = sim_handler(sim)

    async def handle(method: str, path: str, headers: Mapping[str, str],
                     body: bytes) -> HandlerResponse:
        answer = await inner(method, path, headers, body)
        if method != "POST" or isinstance(answer.body, bytes):
            return answer

        async def chunks() -> AsyncIterator[bytes]:
            sent = 0
            pending = b""
            async for chunk in answer.body:  # type: ignore[union-attr]
                pending += chunk
                while sent < 2 and b"\n\n" in pending:
                    event, pending = pending.split(b"\n\n", 1)
                    sent += 1
                    yield event + b"\n\n"
                if sent < 2:
                    continue
                await gate.wait()
                if pending:
                    yield pending
                    pending = b""
            if pending:
                yield pending

        return HandlerResponse(answer.status, chunks(), answer.headers)

    return handle


async def stream(gw: Harness, prompt: str) -> tuple[int, str, str]:
    """A streamed completion read to its end: status, replica, body."""
    async with gw.http.stream("POST", "/v1/completions", json={
            "model": "tiny", "prompt": prompt, "max_tokens": 8, "stream": True}) as r:
        body = (await r.aread()).decode()
        return r.status_code, r.headers.get("x-gateway-replica", ""), body


def complete_stream(result: tuple[int, str, str]) -> bool:
    status, _, body = result
    return status == 200 and body.rstrip().endswith("data: [DONE]") and '"error"' not in body


async def test_a_removed_replica_drains_under_load(tmp_path) -> None:
    gate = asyncio.Event()
    sim = new_sim("rt-1")
    try:
        # The held streams are silent on purpose: no stall watch, which would move them away
        # if a health check timed out on a loaded machine.
        config = two_pools(realtime=2)
        config["pools"][0]["ejection"] = {"stall_s": 0}
        async with gateway(config, handlers={"rt-1": gated(sim, gate)}) as gw:
            pool = gw.app.state.pool_by_name["realtime"]
            held: list[asyncio.Task] = []
            i = 0

            def two_held_on_rt1() -> bool:
                return pool.load.inflight.get("rt-1", 0) >= 2

            while not two_held_on_rt1():  # cold prompts spread over both replicas
                held.append(asyncio.create_task(stream(gw, f"tenant {i} prompt " * 40)))
                i += 1
                if i % 4 == 0:  # every stream answered, or held on rt-1
                    await eventually(lambda: two_held_on_rt1() or sum(
                        not t.done() for t in held) <= pool.load.inflight.get("rt-1", 0))
                assert i < 200, "no stream went to rt-1"
            on_rt1 = pool.load.inflight["rt-1"]
            # The prompts of those streams are cached on rt-1 (as far as routing knows).
            assert len(pool.router.indexes["rt-1"])

            assert reloader(gw, write(tmp_path / "gw.yaml", two_pools(realtime=1))).reload("t")
            assert "rt-1" not in pool.router.indexes  # no prefix leads there any more
            rep = (await listed(gw))["rt-1"]
            assert rep["draining"] and rep["removing"] and rep["inflight"] == on_rt1
            since = len(gw.upstream.requests)
            # Under load while it drains, the same tenants' prompts included.
            more = await asyncio.gather(*(stream(gw, f"tenant {j} prompt " * 40)
                                          for j in range(i)),
                                        *(complete(gw, f"tenant {j} prompt " * 40)
                                          for j in range(i)))
            for result in more[:i]:
                assert complete_stream(result) and result[1] == "rt-0"
            for r in more[i:]:
                assert r.status_code == 200 and r.headers["x-gateway-replica"] == "rt-0"
            assert posts_to(gw, RT1, since) == 0
            assert (await listed(gw))["rt-1"]["inflight"] == on_rt1  # still held, still there
            gate.set()
            results = await asyncio.gather(*held)
            assert all(complete_stream(r) for r in results), results  # zero failed requests
            # Every request rt-1 got was one of these, and answered in full.
            assert sum(r[1] == "rt-1" for r in results) == posts_to(gw, RT1) >= on_rt1

            async def gone() -> bool:
                return "rt-1" not in await listed(gw)

            await eventually(gone)
            stats = await gw.stats()
            assert all(r["name"] != "rt-1" for p in stats["pools"] for r in p["replicas"])
            assert not any(s.labels.get("replica") == "rt-1" for s in await gw.metrics())
            assert "rt-1" not in pool.load.inflight
    finally:
        sim.close()


async def test_a_bad_file_is_rejected_and_the_old_configuration_stays(tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="prefix_gateway")
    async with gateway(two_pools(realtime=2)) as gw:
        bad = two_pools(realtime=3)
        bad["pools"][0]["replicas"][1]["url"] = "http://user:secret@rt-1.test:8000"
        path = write(tmp_path / "gw.yaml", bad)
        reload = reloader(gw, path)
        assert not reload.reload("test")
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert any("rejected" in m and "must not carry credentials" in m for m in errors)
        path.write_text("pools: [unclosed\n")
        assert not reload.reload("test")
        assert any("not valid YAML" in r.getMessage() for r in caplog.records
                   if r.levelno == logging.ERROR)
        assert await sample(gw, "gateway_config_reloads_total", result="rejected") == 2
        assert set(await listed(gw)) == {"rt-0", "rt-1", "bt-0", "bt-1"}
        assert not any(r["draining"] for r in (await listed(gw)).values())
        for i in range(6):
            assert (await complete(gw, f"still served {i} " * 30)).status_code == 200

        # A valid file that also changes a setting read only at start: the replicas change,
        # the setting is named in a warning.
        good = two_pools(realtime=1)
        good["server"] = {"max_attempts": 5}
        caplog.clear()
        assert reloader(gw, write(path, good)).reload("test")
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("NOT applied" in m and "server" in m for m in warnings)
        assert (await listed(gw))["rt-1"]["draining"]
        assert gw.app.core.max_attempts != 5


ADMIN, CLIENT = "sk-admin-1", "sk-client-1"


async def test_admin_replica_routes_need_the_admin_key() -> None:
    config = two_pools(realtime=1, batch=1)
    config["classification"].pop("api_keys")
    config["auth"] = {"api_keys": [{"name": "c", "key": key_digest(CLIENT)}],
                      "admin_keys": [{"name": "ops", "key": key_digest(ADMIN)}]}
    body = {"name": "rt-9", "url": "http://rt-9.test:8000"}
    async with gateway(config) as gw:
        for key in (None, CLIENT, "sk-wrong"):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            for method, url, kw in (
                    ("GET", "/admin/replicas", {}),
                    ("POST", "/admin/pools/realtime/replicas", {"json": body}),
                    ("POST", "/admin/pools/realtime/replicas/rt-0/drain", {}),
                    ("DELETE", "/admin/pools/realtime/replicas/rt-0", {})):
                r = await gw.http.request(method, url, headers=headers, **kw)
                assert r.status_code == 401, (method, url, key)
                assert r.json()["error"]["code"] == "invalid_api_key"
        admin = {"Authorization": f"Bearer {ADMIN}"}
        r = await gw.http.get("/admin/replicas", headers=admin)
        assert r.status_code == 200
        names = {rep["name"]: rep for p in r.json()["pools"] for rep in p["replicas"]}
        assert set(names) == {"rt-0", "bt-0"} and not names["rt-0"]["draining"]
        r = await gw.http.post("/admin/pools/realtime/replicas", json=body, headers=admin)
        assert r.status_code == 201 and r.json()["name"] == "rt-9"


async def test_admin_api_adds_drains_and_removes_replicas(tmp_path) -> None:
    sim9, sim8 = new_sim("rt-9"), new_sim("rt-8")
    try:
        async with gateway(two_pools(realtime=1)) as gw:
            gw.upstream.mount("http://rt-9.test:8000", sim_handler(sim9))
            gw.upstream.mount("http://rt-8.test:8000", sim_handler(sim8))

            async def call(method: str, url: str, status: int, code: str | None = None,
                           **kw: Any) -> dict[str, Any]:
                r = await gw.http.request(method, url, **kw)
                assert r.status_code == status, r.text
                if code is not None:
                    err = r.json()["error"]
                    assert err["code"] == code and err["message"]
                    assert set(err) == {"message", "type", "param", "code"}
                return r.json()

            add = "/admin/pools/realtime/replicas"
            rt0 = gw.urls["rt-0"]
            await call("POST", "/admin/pools/nope/replicas", 404, "pool_not_found",
                       json={"name": "x", "url": "http://x.test:1"})
            await call("POST", add, 409, "duplicate_replica",
                       json={"name": "rt-0", "url": "http://x.test:1"})
            await call("POST", add, 409, "duplicate_replica",  # names are unique in all pools
                       json={"name": "bt-0", "url": "http://x.test:1"})
            await call("POST", add, 409, "duplicate_url", json={"name": "x", "url": rt0})
            await call("POST", add, 409, "duplicate_url",
                       json={"name": "x", "url": gw.urls["bt-1"]})
            for url in ("http://u:p@x.test:1", "http://x.test:1/?a=b", "http://x.test:1/#f",
                        "ftp://x.test:1", "not a url"):
                await call("POST", add, 400, "invalid_replica", json={"name": "x", "url": url})
            await call("POST", add, 400, "invalid_replica", json={"name": "x"})
            await call("POST", add, 400, "invalid_replica", json={"name": "a b", "url": "http://x.test:1"})
            await call("POST", add, 400, "invalid_replica", content=b"{not json",
                       headers={"content-type": "application/json"})
            assert set(await listed(gw)) == {"rt-0", "bt-0", "bt-1"}

            rep = await call("POST", add, 201, json={"name": "rt-9",
                                                     "url": "http://rt-9.test:8000/"})
            assert rep["healthy"] is False and rep["url"] == "http://rt-9.test:8000"

            async def serves(name: str) -> bool:
                for i in range(8):
                    r = await complete(gw, f"spread {name} {i} " * 40)
                    assert r.status_code == 200
                    if r.headers["x-gateway-replica"] == name:
                        return True
                return False

            await eventually(lambda: serves("rt-9"))
            await call("POST", "/admin/pools/realtime/replicas/nope/drain", 404,
                       "replica_not_found")
            await call("POST", "/admin/pools/batch/replicas/rt-9/drain", 404,
                       "replica_not_found")
            await call("DELETE", "/admin/pools/realtime/replicas/nope", 404, "replica_not_found")
            await call("DELETE", "/admin/pools/nope/replicas/rt-9", 404, "pool_not_found")
            rep = await call("POST", "/admin/pools/realtime/replicas/rt-9/drain", 200)
            assert rep["draining"] and not rep["removing"]
            since = len(gw.upstream.requests)
            for i in range(10):
                r = await complete(gw, f"after drain {i} " * 40)
                assert r.status_code == 200 and r.headers["x-gateway-replica"] == "rt-0"
            assert posts_to(gw, "http://rt-9.test:8000", since) == 0
            # Drained, it stays listed, and out of rotation: health rounds go on without it.
            since = len(gw.upstream.requests)
            await eventually(lambda: any(u == rt0 + "/health"
                                         for _, u in gw.upstream.requests[since:]))
            rep = (await listed(gw))["rt-9"]
            assert rep["draining"] and rep["healthy"] is False
            assert not any(u.startswith("http://rt-9.test:8000")
                           for _, u in gw.upstream.requests[since:])
            rep = await call("DELETE", "/admin/pools/realtime/replicas/rt-9", 202)
            assert rep["removing"]

            async def gone() -> bool:
                return "rt-9" not in await listed(gw)

            await eventually(gone)
            # Its URL is free again once it left.
            await call("POST", add, 201, json={"name": "rt-9b", "url": "http://rt-9.test:8000"})

            # At a reload the file is the truth: replicas added through the API go, replicas
            # drained through it come back.
            await call("POST", add, 201, json={"name": "rt-8", "url": "http://rt-8.test:8000"})
            await call("POST", "/admin/pools/realtime/replicas/rt-0/drain", 200)
            assert reloader(gw, write(tmp_path / "gw.yaml", two_pools(realtime=1))).reload("t")
            now = await listed(gw)
            assert now["rt-8"]["removing"] and now["rt-9b"]["removing"]
            assert not now["rt-0"]["draining"]

            async def rt0_healthy() -> bool:  # back through a health check
                return (await listed(gw))["rt-0"]["healthy"]

            await eventually(rt0_healthy)
            await eventually(lambda: serves("rt-0"))
            await eventually(gone)
            await eventually(lambda: _absent(gw, "rt-8"))
    finally:
        sim9.close()
        sim8.close()


async def _absent(gw: Harness, name: str) -> bool:
    return name not in await listed(gw)


async def test_a_reload_moves_a_replica_to_a_new_url_and_changes_its_models(tmp_path) -> None:
    new = new_sim("rt-1-new")
    try:
        async with gateway(two_pools(realtime=2)) as gw:
            pool = gw.app.state.pool_by_name["realtime"]
            moved = "http://rt-1-new.test:8000"
            gw.upstream.mount(moved, sim_handler(new))
            for i in range(8):  # some prompts cached on rt-1, as routing knows
                assert (await complete(gw, f"before {i} " * 40)).status_code == 200
            assert len(pool.router.indexes["rt-1"])
            cfg = two_pools(realtime=2)
            cfg["pools"][0]["replicas"][1]["url"] = moved
            cfg["pools"][0]["replicas"][0]["models"] = ["tiny", "tiny-extra"]
            assert reloader(gw, write(tmp_path / "gw.yaml", cfg)).reload("t")
            assert len(pool.router.indexes["rt-1"]) == 0  # the new engine holds nothing yet
            rep = (await listed(gw))["rt-1"]
            assert rep["url"] == moved and not rep["draining"]
            models = (await gw.http.get("/v1/models")).json()["data"]
            assert "tiny-extra" in {m["id"] for m in models}
            assert (await listed(gw))["rt-0"]["models"] == ["tiny", "tiny-extra"]
            since = len(gw.upstream.requests)

            async def new_url_serves() -> bool:
                r = await complete(gw, f"after {len(gw.upstream.requests)} " * 40)
                assert r.status_code == 200
                return posts_to(gw, moved, since) > 0

            await eventually(new_url_serves)
            assert posts_to(gw, gw.urls["rt-1"], since) == 0
    finally:
        new.close()
