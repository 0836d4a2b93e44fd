"""Discovery by DNS (gateway/discovery.py): the resolver behind a seam that the tests drive
(FakeResolver), the real one resolving `localhost`, simulated replicas as processes on
loopback addresses behind the name; its configuration, and reloads that change it. Kubernetes
EndpointSlices: tests/test_discovery_kubernetes.py."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
from pathlib import Path

import pytest
import yaml

from gateway.config import ConfigError, parse_config
from gateway.discovery import SystemResolver, slice_endpoints
from gateway.reload import Reloader
from tests.conftest import eventually, start_sims
from tests.discovering import (
    FakeResolver,
    complete_stream,
    one_pool,
    port_of,
    running,
    three_addresses,
)

NAME = "vllm.llm.svc.cluster.local"


def dns(port: int, name: str = NAME, **more) -> dict:
    return {"dns": {"name": name, "port": port, "interval_s": 0.05, **more}}


@pytest.fixture(scope="module")
def sims(tmp_path_factory):
    yield from three_addresses(tmp_path_factory)


def names(port: int, *hosts: str) -> list[str]:
    return [f"rt-{h}-{port}" for h in hosts]


async def test_the_system_resolver_resolves_localhost() -> None:
    assert "127.0.0.1" in await SystemResolver().resolve("localhost", 8000, "ipv4")
    assert all(":" not in a for a in await SystemResolver().resolve("localhost", 80, "ipv4"))


async def test_a_pool_found_through_the_real_resolver_serves(tmp_path) -> None:
    sim = start_sims(["vllm"], tmp_path)
    try:
        port = port_of(sim.urls[0])
        async with running(one_pool(dns(port, "localhost", family="ipv4"))) as gw:
            name = f"rt-127.0.0.1-{port}"
            rep = (await gw.listed())[name]
            # Found and probed before the gateway serves: healthy from the start.
            assert rep["healthy"] and rep["discovered_by"] == "dns"
            assert rep["url"] == f"http://127.0.0.1:{port}"
            assert await gw.complete("hello " * 20) == name
            assert await gw.sample("gateway_discovered_replicas", pool="rt", source="dns") == 1
            assert await gw.sample("gateway_discovery_last_success_timestamp_seconds",
                                   pool="rt", source="dns") > 0
    finally:
        sim.stop()


async def test_a_record_that_appears_joins_and_one_that_goes_drains(sims, caplog) -> None:
    caplog.set_level(logging.INFO, logger="prefix_gateway")
    port = port_of(sims.urls[0])
    a, b = names(port, "127.0.0.2", "127.0.0.3")
    resolver = FakeResolver({NAME: {"127.0.0.2"}})
    async with running(one_pool(dns(port)), resolver) as gw:
        assert set(await gw.listed()) == {a}
        assert await gw.healthy(a)
        for i in range(4):
            assert await gw.complete(f"only a {i} " * 30) == a

        resolver.answers[NAME] = {"127.0.0.2", "127.0.0.3"}
        await eventually(lambda: gw.healthy(b))  # joined through a health check
        assert (await gw.listed())[b]["discovered_by"] == "dns"
        assert any(f"rt/{b} found (http://127.0.0.3:{port})" in r.getMessage()
                   for r in caplog.records)
        await eventually(lambda: gw.serves(b))

        # b's record goes while streams are in flight there: they finish, nothing new goes.
        held = await gw.hold_streams_on(b, sims.procs[1])
        try:
            on_b = gw.inflight(b)
            resolver.answers[NAME] = {"127.0.0.2"}

            async def draining() -> bool:
                rep = (await gw.listed()).get(b)
                return bool(rep and rep["draining"] and rep["removing"])

            await eventually(draining)
            assert (await gw.listed())[b]["inflight"] == on_b
            for i in range(10):
                assert await gw.complete(f"while b drains {i} " * 30) == a
        finally:
            os.kill(sims.procs[1].pid, signal.SIGCONT)
        results = await asyncio.gather(*held)
        assert all(complete_stream(r) for r in results), results  # zero failed requests
        assert sum(r[1] == b for r in results) >= on_b >= 1
        await eventually(lambda: _gone(gw, b))
        assert any(f"replica rt/{b} drained and removed" in r.getMessage()
                   for r in caplog.records)
        assert await gw.sample("gateway_discovered_replicas", pool="rt", source="dns") == 1


async def _gone(gw, name: str) -> bool:
    return name not in await gw.listed()


async def test_resolution_failures_keep_the_replicas_found_before(sims, caplog) -> None:
    caplog.set_level(logging.INFO, logger="prefix_gateway")
    port = port_of(sims.urls[0])
    a, b = names(port, "127.0.0.2", "127.0.0.3")
    resolver = FakeResolver({NAME: {"127.0.0.2", "127.0.0.3"}})
    async with running(one_pool(dns(port, timeout_s=0.2)), resolver) as gw:
        assert set(await gw.listed()) == {a, b}

        def failures() -> list[str]:
            return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
                    and "discovery (dns) of pool rt failed" in r.getMessage()]

        # A name that stops resolving, an answer with no address, a resolver that does not
        # answer: each round fails, the replicas stay, logged once while it lasts.
        resolver.error = socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name "
                                         "resolution")
        await resolver.rounds(3)
        resolver.error = None
        resolver.answers[NAME] = set()
        await resolver.rounds(3)
        resolver.hang = True
        await resolver.rounds(2)
        resolver.hang = False
        del resolver.answers[NAME]
        await resolver.rounds(3)
        assert len(failures()) == 1, failures()
        assert "the 2 replicas it found before are kept" in failures()[0]
        assert "Temporary failure in name resolution" in failures()[0]
        assert await gw.sample("gateway_discovery_errors_total", pool="rt", source="dns") >= 9
        listed = await gw.listed()
        assert set(listed) == {a, b} and not any(r["draining"] for r in listed.values())
        for i in range(6):
            assert await gw.complete(f"still served {i} " * 30) in {a, b}

        resolver.answers[NAME] = {"127.0.0.3", "127.0.0.4"}
        await resolver.rounds(2)
        assert any("discovery (dns) of pool rt works again: 2 replicas found" in r.getMessage()
                   for r in caplog.records)
        assert len(failures()) == 1
        await eventually(lambda: _gone(gw, a))  # idle: dropped at once
        await eventually(lambda: gw.healthy(names(port, "127.0.0.4")[0]))


async def test_a_reload_changes_the_discovery_settings(sims, tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="prefix_gateway")
    port = port_of(sims.urls[0])
    a, b, c = names(port, "127.0.0.2", "127.0.0.3", "127.0.0.4")
    resolver = FakeResolver({NAME: {"127.0.0.2"}, "other.llm.svc": {"127.0.0.3"}})
    path = tmp_path / "gw.yaml"
    async with running(one_pool(dns(port)), resolver) as gw:
        reloader = Reloader(path, gw.app.fleet, gw.app.state.metrics)

        def reload(config: dict) -> None:
            path.write_text(yaml.safe_dump(config))
            assert reloader.reload("test")

        # Another name: its replicas come, the old name's go.
        reload(one_pool(dns(port, "other.llm.svc")))
        assert not any("NOT applied" in r.getMessage() for r in caplog.records)
        await eventually(lambda: gw.healthy(b))
        await eventually(lambda: _gone(gw, a))

        # A static replica beside discovery: the file's list changes, discovered ones stay.
        static = [{"name": "static-0", "url": sims.urls[2]}]
        reload(one_pool(dns(port, "other.llm.svc"), static))
        await eventually(lambda: gw.healthy("static-0"))
        assert (await gw.listed())["static-0"]["discovered_by"] is None
        assert await gw.healthy(b)

        # Discovery turned off: what it found drains; the file's replica stays.
        config = one_pool(dns(port), static)
        config["pools"][0].pop("discovery")
        reload(config)
        await eventually(lambda: _gone(gw, b))
        assert set(await gw.listed()) == {"static-0"}
        assert await gw.sample("gateway_discovered_replicas", pool="rt", source="dns") is None
        assert await gw.complete("after " * 30) == "static-0"

        # On again: a record whose URL a static replica has is left out, logged once.
        resolver.answers[NAME] = {"127.0.0.4", "127.0.0.3"}
        reload(one_pool(dns(port), static))
        await eventually(lambda: gw.healthy(b))
        await resolver.rounds(3)
        assert c not in await gw.listed()
        left_out = [r.getMessage() for r in caplog.records if "left it out" in r.getMessage()]
        assert len(left_out) == 1 and "static-0 has this url already" in left_out[0]


async def test_a_discovered_replica_drained_through_the_admin_api_stays_drained(sims) -> None:
    port = port_of(sims.urls[0])
    a, b = names(port, "127.0.0.2", "127.0.0.3")
    resolver = FakeResolver({NAME: {"127.0.0.2", "127.0.0.3"}})
    async with running(one_pool(dns(port)), resolver) as gw:
        r = await gw.http.post(f"/admin/pools/rt/replicas/{b}/drain")
        assert r.status_code == 200 and r.json()["draining"]
        await resolver.rounds(3)  # found again, unchanged: left as the operator set it
        assert (await gw.listed())[b]["draining"]
        for i in range(6):
            assert await gw.complete(f"drained b {i} " * 30) == a
        # Its record goes and comes back: it joins again.
        resolver.answers[NAME] = {"127.0.0.2"}
        await resolver.rounds(2)
        resolver.answers[NAME] = {"127.0.0.2", "127.0.0.3"}
        await eventually(lambda: gw.healthy(b))


# Configuration ---------------------------------------------------------------------------


def invalid(config: dict) -> str:
    with pytest.raises(ConfigError) as err:
        parse_config(config)
    return str(err.value)


def test_discovery_settings_are_checked() -> None:
    ok = parse_config(one_pool(dns(8000)))
    d = ok.pools[0].discovery
    assert d is not None and d.kind == "dns" and d.dns is not None
    assert (d.dns.scheme, d.dns.family, d.dns.timeout_s) == ("http", "any", 5.0)
    assert "a pool needs replicas, or discovery" in invalid(one_pool(None))  # type: ignore[arg-type]
    assert "give exactly one of dns or kubernetes" in invalid(one_pool({}))
    both = {**dns(8000), "kubernetes": {"selector": "app=vllm"}}
    assert "give exactly one of dns or kubernetes" in invalid(one_pool(both))
    for bad in ("http://vllm.llm", "vllm.llm:8000", "vllm llm", "", "a/b"):
        assert "is not a DNS name" in invalid(one_pool(dns(8000, bad)))
    assert "pools[0].discovery.dns.port" in invalid(one_pool(dns(0)))
    assert "pools[0].discovery.dns.interval_s" in invalid(one_pool(dns(8000, interval_s=0)))
    assert "pools[0].discovery.dns.family" in invalid(one_pool(dns(8000, family="ipv5")))
    assert "unknown key" in invalid(one_pool(dns(8000, ttl=3)))
    assert "unknown key" in invalid(one_pool({"dns": {"name": "x", "port": 1},
                                              "consul": {}}))


def test_kubernetes_discovery_without_the_extra_is_a_clear_error(monkeypatch, tmp_path) -> None:
    config = one_pool({"kubernetes": {"selector": "kubernetes.io/service-name=vllm"}})
    parsed = parse_config(config).pools[0].discovery
    assert parsed is not None and parsed.kubernetes is not None
    assert parsed.kubernetes.resync_s == 300 and parsed.kubernetes.namespace is None
    missing = {"kubernetes": {"selector": "x=y", "kubeconfig": str(tmp_path / "none")}}
    assert "kubeconfig" in invalid(one_pool(missing)) and "cannot be read" in invalid(
        one_pool(missing))
    monkeypatch.setitem(sys.modules, "kubernetes", None)  # as if not installed
    message = invalid(config)
    assert "pools[0].discovery.kubernetes" in message
    assert "pip install 'prefix-gateway[kubernetes]'" in message


def test_a_file_with_discovery_loads_with_line_numbers(tmp_path: Path) -> None:
    from gateway.config import load_config

    path = tmp_path / "gw.yaml"
    path.write_text(yaml.safe_dump(one_pool(dns(8000, interval_s=-1)), sort_keys=False))
    with pytest.raises(ConfigError, match=r"gw\.yaml:\d+: pools\[0\]\.discovery\.dns\."
                                          r"interval_s"):
        load_config(path)


# EndpointSlices, as the API serves them --------------------------------------------------


def _slice(endpoints: list[dict], ports: list[dict] | None = None, name: str = "s") -> dict:
    return {"metadata": {"name": name}, "addressType": "IPv4", "endpoints": endpoints,
            "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}]
            if ports is None else ports}


def test_endpoint_conditions_decide_what_is_in_the_pool() -> None:
    endpoints = [
        {"addresses": ["10.0.0.1"], "conditions": {"ready": True, "serving": True,
                                                   "terminating": False}},
        {"addresses": ["10.0.0.2"], "conditions": {}},  # nil: ready, not terminating
        {"addresses": ["10.0.0.3"], "conditions": {"ready": False, "serving": False,
                                                   "terminating": False}},
        {"addresses": ["10.0.0.4"], "conditions": {"ready": False, "serving": True,
                                                   "terminating": True}},
        {"addresses": ["10.0.0.5", "10.0.0.6"]},  # fungible addresses: the first
    ]
    found, problems = slice_endpoints([_slice(endpoints)], "http")
    assert problems == []
    assert found == {("10.0.0.1", 8000): True, ("10.0.0.2", 8000): True,
                     ("10.0.0.3", 8000): False, ("10.0.0.5", 8000): True}
    # The same endpoint in two slices (while the controller moves it): ready if one says so.
    other = _slice([{"addresses": ["10.0.0.3"], "conditions": {"ready": True}}], name="t")
    found, _ = slice_endpoints([_slice(endpoints), other], "http")
    assert found[("10.0.0.3", 8000)] is True


def test_the_port_is_chosen_by_name() -> None:
    ports = [{"name": "metrics", "port": 9090}, {"name": "http", "port": 8000}]
    ep = [{"addresses": ["10.0.0.1"], "conditions": {"ready": True}}]
    assert slice_endpoints([_slice(ep, ports)], "http")[0] == {("10.0.0.1", 8000): True}
    found, problems = slice_endpoints([_slice(ep, ports)], None)
    assert found == {} and "has 2 ports: set port_name" in problems[0]
    found, problems = slice_endpoints([_slice(ep, ports)], "grpc")
    assert found == {} and "no port named 'grpc'" in problems[0]
    unnamed = [{"name": "", "port": 8001}]
    assert slice_endpoints([_slice(ep, unnamed)], None)[0] == {("10.0.0.1", 8001): True}
    assert slice_endpoints([_slice(ep, unnamed)], "")[0] == {("10.0.0.1", 8001): True}
    found, problems = slice_endpoints([_slice(ep, [{"name": "http"}])], "http")
    assert found == {} and "no number" in problems[0]


# `prefix-gateway serve` ------------------------------------------------------------------


def test_serve_discovers_through_dns_and_a_sighup_changes_the_settings(tmp_path) -> None:
    import httpx

    from gateway import processes
    from tests.conftest import poll, start_gateway

    two = start_sims(["vllm", "vllm"], tmp_path)
    p1, p2 = (port_of(u) for u in two.urls)
    config = one_pool(dns(p1, "localhost", family="ipv4", interval_s=0.2))
    config["server"] = {"host": "127.0.0.1", "port": processes.free_ports(1)[0]}
    try:
        gw = start_gateway(config, tmp_path)  # ready: found and healthy before serving
        try:
            def listed() -> dict:
                r = httpx.get(gw.url + "/admin/replicas", timeout=10)
                return {rep["name"]: rep for p in r.json()["pools"] for rep in p["replicas"]}

            assert listed()[f"rt-127.0.0.1-{p1}"]["healthy"]
            r = httpx.post(gw.url + "/v1/completions", timeout=30, json={
                "model": "tiny", "prompt": "hi " * 20, "max_tokens": 2})
            assert r.status_code == 200 and r.headers["x-gateway-replica"] == f"rt-127.0.0.1-{p1}"

            config["pools"][0]["discovery"] = dns(p2, "localhost", family="ipv4")
            gw.config_path.write_text(yaml.safe_dump(config))
            gw.proc.send_signal(signal.SIGHUP)
            poll(lambda: "rt: dns discovery restarted" in gw.log(), deadline_s=15)
            poll(lambda: listed().get(f"rt-127.0.0.1-{p2}", {}).get("healthy"), deadline_s=15)
            poll(lambda: f"rt-127.0.0.1-{p1}" not in listed(), deadline_s=15)
            assert "NOT applied" not in gw.log()
            assert gw.proc.poll() is None
        finally:
            gw.stop()
    finally:
        two.stop()


def test_serve_check_names_the_discovery(tmp_path, capsys) -> None:
    from gateway import cli

    path = tmp_path / "gw.yaml"
    path.write_text(yaml.safe_dump(one_pool(dns(8000), [{"name": "static-0",
                                                         "url": "http://10.0.0.9:8000"}])))
    parsed = cli.build_parser().parse_args(["serve", "--config", str(path), "--check"])
    assert parsed.func(parsed) == 0
    assert "rt (vllm, 1 replicas, dns discovery)" in capsys.readouterr().out
