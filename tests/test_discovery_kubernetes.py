"""Discovery from Kubernetes EndpointSlices: the official `kubernetes` client, in the gateway's
discovery thread, talks to a fake API server on loopback (tests/fake_kube.py) that lists and
watches EndpointSlices as the real one does; the endpoints are simulated replicas, processes
on loopback addresses."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import pytest

from tests.conftest import eventually, require
from tests.discovering import complete_stream, one_pool, port_of, running, three_addresses
from tests.fake_kube import FakeKubeApi, endpoint, endpoint_slice

require("kubernetes", "kubernetes")

SELECTOR = "kubernetes.io/service-name=vllm"


@pytest.fixture(scope="module")
def sims(tmp_path_factory):
    yield from three_addresses(tmp_path_factory)


@pytest.fixture
def api():
    fake = FakeKubeApi()
    yield fake
    fake.close()


def discovery(api: FakeKubeApi, tmp_path, **more) -> dict:
    return {"kubernetes": {"selector": SELECTOR, "namespace": "llm", "port_name": "http",
                           "kubeconfig": str(api.kubeconfig(tmp_path / "kubeconfig")),
                           **more}}


async def test_endpointslices_add_drain_and_remove_replicas(sims, api, tmp_path,
                                                            caplog) -> None:
    caplog.set_level(logging.INFO, logger="prefix_gateway")
    port = port_of(sims.urls[0])
    a, b, c = (f"rt-127.0.0.{i}-{port}" for i in (2, 3, 4))

    def vllm_abc(*endpoints: dict, announce: bool = True) -> None:
        api.put(endpoint_slice("vllm-abc", "vllm", list(endpoints), port), announce)

    vllm_abc(endpoint("127.0.0.2"))
    # Another Service's slice, and one of the same Service in another namespace: not picked.
    api.put(endpoint_slice("other-xyz", "other", [endpoint("127.0.0.4")], port))
    api.put(endpoint_slice("vllm-def", "vllm", [endpoint("127.0.0.4")], port,
                           namespace="elsewhere"))
    async with running(one_pool(discovery(api, tmp_path, resync_s=30))) as gw:
        # Listed and probed before the gateway serves.
        listed = await gw.listed()
        assert set(listed) == {a} and listed[a]["healthy"]
        assert listed[a]["discovered_by"] == "kubernetes"
        assert listed[a]["url"] == f"http://127.0.0.2:{port}"
        assert await gw.complete("first " * 30) == a
        assert api.count(watch=False) == 1
        await eventually(lambda: api.count(watch=True) == 1)  # then watched from its version

        # An endpoint added to the slice: it joins through a health check.
        vllm_abc(endpoint("127.0.0.2"), endpoint("127.0.0.3"))
        await eventually(lambda: gw.healthy(b))
        await eventually(lambda: gw.serves(b))

        # Ready -> not ready: drained, still listed; ready again: back after a health check.
        vllm_abc(endpoint("127.0.0.2"), endpoint("127.0.0.3", ready=False))

        async def drained(name: str, removing: bool) -> bool:
            rep = (await gw.listed()).get(name)
            return bool(rep and rep["draining"] and rep["removing"] == removing)

        await eventually(lambda: drained(b, removing=False))
        for i in range(6):
            assert await gw.complete(f"b not ready {i} " * 30) == a
        vllm_abc(endpoint("127.0.0.2"), endpoint("127.0.0.3"))
        await eventually(lambda: gw.healthy(b))
        await eventually(lambda: gw.serves(b))

        # Terminating (still serving) while streams are in flight there: they finish,
        # nothing new goes there, then it is dropped.
        held = await gw.hold_streams_on(b, sims.procs[1])
        try:
            on_b = gw.inflight(b)
            vllm_abc(endpoint("127.0.0.2"),
                     endpoint("127.0.0.3", ready=False, serving=True, terminating=True))
            await eventually(lambda: drained(b, removing=True))
            assert (await gw.listed())[b]["inflight"] == on_b
            for i in range(6):
                assert await gw.complete(f"b terminating {i} " * 30) == a
        finally:
            os.kill(sims.procs[1].pid, signal.SIGCONT)
        results = await asyncio.gather(*held)
        assert all(complete_stream(r) for r in results), results
        assert sum(r[1] == b for r in results) >= on_b >= 1
        await eventually(lambda: _gone(gw, b))

        # A second slice of the Service comes, then is deleted.
        api.put(endpoint_slice("vllm-ghi", "vllm", [endpoint("127.0.0.4")], port))
        await eventually(lambda: gw.healthy(c))
        api.delete("llm", "vllm-ghi")
        await eventually(lambda: _gone(gw, c))
        assert set(await gw.listed()) == {a}

        # The history is compacted: the open watch gets 410 Gone. A change made meanwhile,
        # which no watch announced, is seen by the list that follows.
        lists = api.count(watch=False)
        vllm_abc(endpoint("127.0.0.2"), endpoint("127.0.0.3"), announce=False)
        api.expire()
        await eventually(lambda: gw.healthy(b))
        assert api.count(watch=False) == lists + 1
        assert any("the watch expired (410 Gone); listing again" in r.getMessage()
                   for r in caplog.records)
        assert await gw.sample("gateway_discovery_errors_total", pool="rt",
                               source="kubernetes") == 0
        assert await gw.sample("gateway_discovered_replicas", pool="rt",
                               source="kubernetes") == 2


async def _gone(gw, name: str) -> bool:
    return name not in await gw.listed()


async def test_the_watch_is_restarted_with_a_full_list_every_resync(sims, api,
                                                                    tmp_path) -> None:
    port = port_of(sims.urls[0])
    a, b = (f"rt-127.0.0.{i}-{port}" for i in (2, 3))
    api.put(endpoint_slice("vllm-abc", "vllm", [endpoint("127.0.0.2")], port))
    async with running(one_pool(discovery(api, tmp_path, resync_s=1))) as gw:
        assert set(await gw.listed()) == {a}
        # A change no watch announces (as if an event were lost): the next list shows it.
        api.put(endpoint_slice("vllm-abc", "vllm", [endpoint("127.0.0.3")], port),
                announce=False)
        await eventually(lambda: gw.healthy(b))
        await eventually(lambda: _gone(gw, a))
        assert api.count(watch=False) >= 2
        # Every watch asked the server to end it after resync_s, from the list's version.
        watches = [q for path, q in api.requests if q.get("watch")]
        assert watches and all(q["timeoutSeconds"] == ["1"] and q["resourceVersion"]
                               for q in watches)


async def test_an_api_server_that_fails_keeps_the_replicas(sims, api, tmp_path,
                                                           caplog) -> None:
    caplog.set_level(logging.INFO, logger="prefix_gateway")
    port = port_of(sims.urls[0])
    a, b = (f"rt-127.0.0.{i}-{port}" for i in (2, 3))
    api.put(endpoint_slice("vllm-abc", "vllm", [endpoint("127.0.0.2"), endpoint("127.0.0.3")],
                           port))
    async with running(one_pool(discovery(api, tmp_path, resync_s=30))) as gw:
        assert set(await gw.listed()) == {a, b}
        api.unavailable = True
        api.close_watches()  # the connection drops; the list that follows gets 503

        async def errors() -> float:
            return await gw.sample("gateway_discovery_errors_total", pool="rt",
                                   source="kubernetes") or 0

        await eventually(lambda: _at_least(errors, 2))
        failures = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
                    and "discovery (kubernetes) of pool rt failed" in r.getMessage()]
        assert len(failures) == 1, failures
        assert "HTTP 503" in failures[0] and "the 2 replicas it found before are kept" in \
            failures[0]
        listed = await gw.listed()
        assert set(listed) == {a, b} and not any(r["draining"] for r in listed.values())
        assert await gw.complete("served meanwhile " * 30) in {a, b}

        # Back, with one endpoint fewer.
        api.put(endpoint_slice("vllm-abc", "vllm", [endpoint("127.0.0.3")], port))
        api.unavailable = False
        await eventually(lambda: _gone(gw, a), deadline_s=60)
        assert any("discovery (kubernetes) of pool rt works again: 1 replicas found"
                   in r.getMessage() for r in caplog.records)


async def _at_least(value, n: float) -> bool:
    return await value() >= n


async def test_a_wrong_token_is_an_error_not_an_empty_pool(sims, api, tmp_path,
                                                           caplog) -> None:
    port = port_of(sims.urls[0])
    path = api.kubeconfig(tmp_path / "kubeconfig")
    path.write_text(path.read_text().replace("fake-kube-token", "wrong-token"))
    config = one_pool({"kubernetes": {"selector": SELECTOR, "namespace": "llm",
                                      "kubeconfig": str(path)}},
                      [{"name": "static-0", "url": sims.urls[0]}])
    api.put(endpoint_slice("vllm-abc", "vllm", [endpoint("127.0.0.3")], port))
    async with running(config) as gw:
        assert set(await gw.listed()) == {"static-0"}
        assert await gw.sample("gateway_discovery_errors_total", pool="rt",
                               source="kubernetes") >= 1
        assert await gw.sample("gateway_discovery_last_success_timestamp_seconds",
                               pool="rt", source="kubernetes") == 0
        assert any("HTTP 401" in r.getMessage() for r in caplog.records
                   if r.levelno == logging.WARNING)
        assert await gw.complete("static " * 30) == "static-0"
