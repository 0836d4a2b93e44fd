"""Authentication, authorisation and what never leaves the gateway, in-process: the auth
matrix with the official `openai` client, admin and metrics keys, docs off, upstream
credentials, and error bodies without internal addresses."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import openai
import pytest

from backends.sim.app import SimApp
from backends.sim.replica import SimReplicaSpec
from backends.upstream.inprocess import Handler, HandlerResponse
from gateway.config import key_digest
from tests.inprocess import gateway, sim_handler, two_pools

RT, BT, ALL, ADMIN, PROM = "sk-rt-only", "sk-batch-only", "sk-both", "sk-admin", "sk-prom"


def with_auth(config: dict[str, Any] | None = None, **auth: Any) -> dict[str, Any]:
    """two_pools() with client keys (realtime only, batch only, both), an admin key and a
    metrics key; `auth` overrides keys of the section."""
    config = config or two_pools(realtime=1, batch=1)
    config["classification"].pop("api_keys", None)  # plain keys: not with auth
    config["auth"] = {
        "api_keys": [
            {"name": "rt", "key": key_digest(RT), "classes": ["realtime"]},
            {"name": "bt", "key": key_digest(BT), "classes": ["batch"]},
            {"name": "all", "key": key_digest(ALL)},
        ],
        "admin_keys": [{"name": "ops", "key": key_digest(ADMIN)}],
        "metrics_keys": [{"name": "prom", "key": key_digest(PROM)}],
        **auth,
    }
    return config


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def sample(text: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


async def test_no_key_or_a_wrong_key_is_401_in_openai_shape() -> None:
    async with gateway(with_auth()) as gw:
        for key in (None, "sk-wrong"):
            headers = bearer(key) if key else {}
            r = await gw.http.post("/v1/chat/completions", headers=headers, json={
                "model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 401
            assert r.headers["www-authenticate"].startswith("Bearer")
            err = r.json()["error"]
            assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
            assert set(err) == {"message", "type", "param", "code"}
            if key:
                assert key not in r.text  # never echoed
        # The official client sees an AuthenticationError, on every /v1 route.
        c = gw.openai(api_key="sk-wrong")
        with pytest.raises(openai.AuthenticationError) as info:
            await c.completions.create(model="tiny", prompt="x", max_tokens=2)
        assert info.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            await c.models.list()
        for path in ("/v1/models", "/v1/files", "/v1/batches", "/V1/Models", "/v1/nothing"):
            assert (await gw.http.get(path)).status_code == 401, path
        text = (await gw.http.get("/metrics", headers=bearer(PROM))).text
        assert sample(text, "gateway_auth_rejected_total", surface="inference",
                      reason="unauthenticated") == 3
        assert sample(text, "gateway_auth_rejected_total", surface="api",
                      reason="unauthenticated") == 6


async def test_a_key_chooses_only_among_its_classes() -> None:
    config = two_pools(realtime=1, batch=1)
    config["classification"]["service_tier"].update(auto="realtime", default="realtime")
    async with gateway(with_auth(config)) as gw:
        msgs = [{"role": "user", "content": "hi"}]
        # Its own default: the batch-only key lands on the batch pool without asking.
        r = await gw.openai(api_key=BT).chat.completions.with_raw_response.create(
            model="tiny", messages=msgs, max_tokens=2)
        assert r.headers["x-gateway-pool"] == "batch"
        # The header may not lift it to realtime (it outranked the key before).
        with pytest.raises(openai.PermissionDeniedError) as info:
            await gw.openai(api_key=BT, default_headers={"x-traffic-class": "realtime"}) \
                .chat.completions.create(model="tiny", messages=msgs, max_tokens=2)
        assert info.value.code == "traffic_class_not_allowed"
        assert "'realtime'" in info.value.message
        # Nor may service_tier move the realtime key to batch.
        with pytest.raises(openai.PermissionDeniedError):
            await gw.openai(api_key=RT).completions.create(
                model="tiny", prompt="x", max_tokens=2, extra_body={"service_tier": "flex"})
        # "auto" and "default" name no class: the key's own default serves them.
        for tier in ("auto", "default"):
            r = await gw.openai(api_key=BT).completions.with_raw_response.create(
                model="tiny", prompt="x", max_tokens=2, extra_body={"service_tier": tier})
            assert r.headers["x-gateway-pool"] == "batch"
        # A key with both classes chooses with the header or service_tier.
        both = gw.openai(api_key=ALL)
        r = await both.completions.with_raw_response.create(
            model="tiny", prompt="x", max_tokens=2, extra_headers={"x-traffic-class": "batch"})
        assert r.headers["x-gateway-pool"] == "batch"
        r = await both.completions.with_raw_response.create(
            model="tiny", prompt="x", max_tokens=2, extra_body={"service_tier": "flex"})
        assert r.headers["x-gateway-pool"] == "batch"
        r = await both.completions.with_raw_response.create(model="tiny", prompt="x",
                                                             max_tokens=2)
        assert r.headers["x-gateway-pool"] == "realtime"
        text = (await gw.http.get("/metrics", headers=bearer(ADMIN))).text
        assert sample(text, "gateway_auth_rejected_total", reason="forbidden") == 2


async def test_admin_needs_the_admin_key_and_metrics_their_token() -> None:
    async with gateway(with_auth()) as gw:
        for path in ("/admin/stats", "/admin/history"):
            for headers in ({}, bearer(ALL), bearer(PROM), bearer("sk-wrong")):
                r = await gw.http.get(path, headers=headers)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = await gw.http.get("/admin/stats", headers=bearer(ADMIN))
        assert r.status_code == 200 and r.json()["pools"]
        r = await gw.http.get("/admin/history", headers=bearer(ADMIN))
        assert r.status_code == 200 and r.json()["interval_s"] == 5.0
        # The page itself holds no data: it loads, and asks the browser for the key.
        page = await gw.http.get("/admin")
        assert page.status_code == 200 and "sessionStorage" in page.text
        assert "Bearer" in page.text
        # An admin key is not a client key.
        with pytest.raises(openai.AuthenticationError):
            await gw.openai(api_key=ADMIN).models.list()
        for headers in ({}, bearer(ALL)):
            assert (await gw.http.get("/metrics", headers=headers)).status_code == 401
        for key in (PROM, ADMIN):
            r = await gw.http.get("/metrics", headers=bearer(key))
            assert r.status_code == 200 and "gateway_requests" in r.text
        assert sample(r.text, "gateway_auth_rejected_total", surface="admin") == 8
        assert sample(r.text, "gateway_auth_rejected_total", surface="metrics") == 2
        # /health and /ready stay open: load balancers probe them without keys.
        assert (await gw.http.get("/health")).status_code == 200
        assert (await gw.http.get("/ready")).status_code in (200, 503)


async def test_client_keys_without_an_admin_key_close_the_admin_api() -> None:
    async with gateway(with_auth(admin_keys=[], metrics_keys=[])) as gw:
        for path in ("/admin/stats", "/admin/history"):
            r = await gw.http.get(path, headers=bearer(ALL))
            assert r.status_code == 403 and r.json()["error"]["code"] == "admin_disabled"
        # Without metrics keys, /metrics stays open (for a scraper on a private network).
        assert (await gw.http.get("/metrics")).status_code == 200


async def test_docs_and_the_schema_are_off_unless_exposed() -> None:
    async with gateway(two_pools(realtime=1, batch=1)) as gw:
        for path in ("/docs", "/redoc", "/openapi.json"):
            r = await gw.http.get(path)
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", path
    config = two_pools(realtime=1, batch=1)
    config["server"] = {"expose_docs": True}
    async with gateway(config) as gw:
        assert (await gw.http.get("/openapi.json")).json()["info"]["title"] == "prefix-gateway /v1"
        assert (await gw.http.get("/docs")).status_code == 200


def recording(seen: list[dict[str, str]], name: str) -> Handler:
    """A simulated replica that records the headers of every inference request it gets."""
    sim = SimApp.from_spec(SimReplicaSpec(name=name, kind="vllm", models=("tiny",),
                                          time_scale=0.01))
    inner = sim_handler(sim)

    async def handle(method: str, target: str, headers: Mapping[str, str],
                     body: bytes) -> HandlerResponse:
        if target.startswith("/v1/"):
            seen.append({k.lower(): v for k, v in headers.items()})
        return await inner(method, target, headers, body)

    return handle


@pytest.mark.parametrize("authenticated", [False, True])
async def test_the_clients_key_is_never_forwarded_unless_the_pool_asks(authenticated) -> None:
    seen: list[dict[str, str]] = []
    config = with_auth() if authenticated else two_pools(realtime=1, batch=1)
    key = ALL if authenticated else "sk-the-clients-own"
    async with gateway(config, handlers={"rt-0": recording(seen, "rt-0")}) as gw:
        c = gw.openai(api_key=key, default_headers={"x-request-id": "r-1"})
        await c.completions.create(model="tiny", prompt="x", max_tokens=2)
        await c.completions.create(model="tiny", prompt="x", max_tokens=2, stream=True)
    assert len(seen) == 2
    for headers in seen:
        assert "authorization" not in headers
        assert headers["x-request-id"] == "r-1"  # what is meant to pass still passes
        assert key not in str(headers)


async def test_a_pools_own_key_goes_to_it_and_a_passing_pool_gets_the_clients() -> None:
    seen_rt: list[dict[str, str]] = []
    seen_bt: list[dict[str, str]] = []
    config = with_auth()
    config["pools"][0]["api_key"] = "upstream-secret"
    config["pools"][1]["pass_client_key"] = True
    handlers = {"rt-0": recording(seen_rt, "rt-0"), "bt-0": recording(seen_bt, "bt-0")}
    async with gateway(config, handlers=handlers) as gw:
        c = gw.openai(api_key=ALL)
        await c.completions.create(model="tiny", prompt="x", max_tokens=2)
        await c.completions.create(model="tiny", prompt="x", max_tokens=2,
                                   extra_headers={"x-traffic-class": "batch"})
    assert [h["authorization"] for h in seen_rt] == ["Bearer upstream-secret"]
    assert [h["authorization"] for h in seen_bt] == [f"Bearer {ALL}"]


async def test_a_502_names_no_replica_address() -> None:
    # (Credentials in a replica URL are refused by the configuration: test_config_hardening.)
    config = two_pools(realtime=1, batch=1)
    config["pools"][0]["replicas"][0]["url"] = "http://rt-0.internal.test:8000"
    async with gateway(config) as gw:
        gw.upstream.unmount(gw.urls["rt-0"])  # refused connections from now on
        r = await gw.http.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_unavailable"
        for secret in ("rt-0", "internal.test", "8000", "refused"):
            assert secret not in r.text


# Configuration ------------------------------------------------------------------------------


def parse(config: dict[str, Any]):
    from gateway.config import parse_config

    return parse_config(config)


def test_keys_are_digests_and_a_plain_key_is_refused_without_being_echoed() -> None:
    from gateway.config import ConfigError

    config = with_auth()
    config["auth"]["api_keys"][0]["key"] = "sk-live-plain-secret"
    with pytest.raises(ConfigError) as info:
        parse(config)
    assert "sha256:<64 hex digits>" in str(info.value) and "hash-key" in str(info.value)
    assert "sk-live-plain-secret" not in str(info.value)


def test_a_key_may_come_from_the_environment_or_a_file(tmp_path, monkeypatch) -> None:
    from gateway.auth import Authenticator
    from gateway.config import ConfigError

    monkeypatch.setenv("GW_TEST_KEY", "sk-from-env\n")
    (tmp_path / "key").write_text(key_digest("sk-from-file") + "\n")  # a digest works too
    config = with_auth()
    config["auth"]["api_keys"] = [{"name": "env", "key_env": "GW_TEST_KEY"},
                                  {"name": "file", "key_file": str(tmp_path / "key")}]
    auth = Authenticator(parse(config))
    assert auth.client({b"authorization": b"Bearer sk-from-env"}).name == "env"
    assert auth.client({b"authorization": b"bearer sk-from-file"}).name == "file"
    monkeypatch.delenv("GW_TEST_KEY")
    with pytest.raises(ConfigError, match="GW_TEST_KEY is not set"):
        parse(config)


@pytest.mark.parametrize(("change", "message"), [
    (lambda a: a["api_keys"][0].update(classes=["nope"]), "unknown traffic class 'nope'"),
    (lambda a: a["api_keys"][0].update(default_class="batch"), "not among its classes"),
    (lambda a: a["api_keys"][1].update(key=a["api_keys"][0]["key"]), "the same key"),
    (lambda a: a["admin_keys"].append({"name": "x", "key": key_digest(ALL)}), "the same key"),
    (lambda a: a["api_keys"][1].update(name="rt"), "names must be unique"),
    (lambda a: a["api_keys"][0].update(key_env="X"), "exactly one of"),
])
def test_auth_mistakes_are_config_errors(change, message) -> None:
    from gateway.config import ConfigError

    config = with_auth()
    change(config["auth"])
    with pytest.raises(ConfigError, match=message):
        parse(config)


def test_plain_classification_keys_are_refused_with_auth() -> None:
    from gateway.config import ConfigError

    config = with_auth()
    config["classification"]["api_keys"] = {"sk-plain": "batch"}
    with pytest.raises(ConfigError, match=r"cannot be used with auth\.api_keys"):
        parse(config)


def test_a_public_address_needs_client_keys_or_an_explicit_opt_out() -> None:
    config = two_pools(realtime=1, batch=1)
    config["server"] = {"host": "0.0.0.0"}
    problem = parse(config).exposure_problem()
    assert problem and "allow_unauthenticated" in problem
    config["auth"] = {"allow_unauthenticated": True}
    assert parse(config).exposure_problem() is None
    assert parse(with_auth({**two_pools(1, 1), "server": {"host": "0.0.0.0"}})) \
        .exposure_problem() is None
    for host in ("127.0.0.1", "::1", "localhost"):
        assert parse({**two_pools(1, 1), "server": {"host": host}}).exposure_problem() is None
