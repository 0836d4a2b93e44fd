"""The /v1 OpenAPI document: it describes exactly the routes the app serves, `prefix-gateway
openapi` prints it; and the defects the fuzzer found (405s without `Allow`, a replica's plain
text error page passed to the client) stay fixed."""

from __future__ import annotations

import json

import pytest
from fastapi.routing import APIRoute

from backends.upstream.inprocess import Handler, HandlerResponse
from gateway.app import GatewayApp
from gateway.cli import main
from gateway.config import parse_config
from gateway.defaults import one_pool_config
from gateway.openapi import v1_openapi
from tests.inprocess import FAST_HEALTH, gateway, replica_answering, two_pools


def served_v1_routes(app: GatewayApp) -> set[tuple[str, str]]:
    """(METHOD, path) of every /v1 route: the two fast inference paths and FastAPI's."""
    routes = {("POST", path) for path in app.fast}
    for route in app.admin.routes:
        if isinstance(route, APIRoute) and route.path.startswith("/v1/"):
            routes.update((m, route.path) for m in route.methods if m != "HEAD")
    return routes


def documented(doc: dict) -> set[tuple[str, str]]:
    return {(method.upper(), path) for path, ops in doc["paths"].items() for method in ops}


def test_the_document_lists_exactly_the_v1_routes_the_gateway_serves() -> None:
    app = GatewayApp(parse_config({**two_pools(), "redis": {"url": "redis://127.0.0.1:1/0"}}))
    assert documented(v1_openapi()) == served_v1_routes(app)


def test_the_document_loads_and_every_operation_documents_its_errors() -> None:
    schemathesis = pytest.importorskip("schemathesis")
    doc = v1_openapi("http://127.0.0.1:8080/", models=["tiny", "big"])
    assert doc["servers"] == [{"url": "http://127.0.0.1:8080"}]
    loaded = schemathesis.openapi.from_dict(doc)
    ops = [op.ok() for op in loaded.get_all_operations()]
    assert len(ops) == len(documented(doc)) == 13
    for op in ops:
        responses = op.definition.raw["responses"]
        assert "500" not in responses, op.label  # a 500 is always a bug: never documented
        for code in ("400", "401", "429"):
            schema = responses[code]["content"]["application/json"]["schema"]
            assert schema == {"$ref": "#/components/schemas/ErrorResponse"}, (op.label, code)
    chat = doc["components"]["schemas"]["CreateChatCompletionRequest"]
    assert chat["properties"]["model"]["enum"] == ["tiny", "big"]
    assert chat["required"] == ["model", "messages"] and chat["additionalProperties"] is True
    assert doc["components"]["securitySchemes"]["bearerAuth"] == {
        **doc["components"]["securitySchemes"]["bearerAuth"], "type": "http",
        "scheme": "bearer"}
    stream = doc["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert set(stream) == {"application/json", "text/event-stream"}
    # Without models, any model name is documented (the gateway answers 404 for unknown ones).
    assert "enum" not in v1_openapi()["components"]["schemas"]["CreateCompletionRequest"][
        "properties"]["model"]


async def test_an_exposed_schema_is_the_v1_document_with_the_served_models() -> None:
    """With `server.expose_docs`, /openapi.json (and so /docs) is the /v1 document, not
    FastAPI's, which knew neither the inference paths nor OpenAI's shapes."""
    config = two_pools(realtime=1, batch=1)
    config["server"] = {"expose_docs": True}
    async with gateway(config) as gw:
        served = (await gw.http.get("/openapi.json")).json()
        assert documented(served) == served_v1_routes(gw.app)
        assert served == v1_openapi(models=sorted(gw.app.state.models))
        assert served["components"]["schemas"]["CreateChatCompletionRequest"]["properties"][
            "model"]["enum"] == ["tiny"]
        assert (await gw.http.get("/docs")).status_code == 200


def test_the_cli_prints_the_document(capsys) -> None:
    assert main(["openapi", "--server", "http://gw.example:9000"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == v1_openapi("http://gw.example:9000")


async def test_a_405_names_the_methods_of_its_path() -> None:
    """RFC 9110: a 405 carries `Allow`. The fast inference paths sent none; FastAPI's routes
    dropped Starlette's, which in any case listed only the first route of a path (POST of
    /v1/files, not GET)."""
    async with gateway(two_pools()) as gw:
        r = await gw.http.get("/v1/chat/completions")
        assert r.status_code == 405 and r.headers["allow"] == "POST"
        assert r.json()["error"]["code"] == "method_not_allowed"
        r = await gw.http.put("/v1/files")
        assert r.status_code == 405 and r.headers["allow"] == "GET, POST"
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        r = await gw.http.post("/v1/files/file-1")
        assert r.status_code == 405 and r.headers["allow"] == "DELETE, GET"
        r = await gw.http.delete("/v1/models")
        assert r.status_code == 405 and r.headers["allow"] == "GET"


def plain_error_replica(status: int, body: bytes, content_type: str) -> Handler:
    """A healthy replica that answers every inference request with `status` and `body`."""
    return replica_answering(lambda: HandlerResponse(status, body,
                                                     {"content-type": content_type}))


@pytest.mark.parametrize(("status", "body", "ctype"), [
    (500, b"500 Internal Server Error\n\nServer got itself in trouble", "text/plain"),
    (400, b"", "text/plain"),
    (422, b'{"detail": [{"msg": "field required"}]}', "application/json"),
])
async def test_a_replica_error_without_an_openai_body_is_wrapped_in_one(
        status: int, body: bytes, ctype: str) -> None:
    """Found by the fuzzer: a replica's own crash page (aiohttp's text/plain 500) reached the
    client as it was, which OpenAI clients cannot read; so did JSON that is not OpenAI's error
    object (a framework's `{"detail": ...}`). Its status is kept, its body becomes OpenAI's
    error object, naming neither the replica nor its address."""
    cfg = one_pool_config(["http://r0.test:8000"], 0, health=FAST_HEALTH)
    async with gateway(cfg, handlers={"replica-0": plain_error_replica(status, body, ctype)}
                       ) as gw:
        r = await gw.http.post("/v1/completions", json={"model": "tiny", "prompt": "hi"})
        assert r.status_code == status
        assert r.headers["content-type"] == "application/json"
        err = r.json()["error"]
        assert err["code"] == "upstream_error" and f"HTTP {status}" in err["message"]
        assert err["type"] == ("upstream_error" if status >= 500 else "invalid_request_error")
        assert "r0.test" not in r.text and "replica-0" not in r.text


async def test_a_replica_openai_error_passes_through_unchanged() -> None:
    body = (b'{"error": {"message": "prompt too long", "type": "BadRequestError", '
            b'"param": null, "code": 400}}')
    cfg = one_pool_config(["http://r0.test:8000"], 0, health=FAST_HEALTH)
    async with gateway(cfg, handlers={"replica-0": plain_error_replica(
            400, body, "application/json")}) as gw:
        r = await gw.http.post("/v1/completions", json={"model": "tiny", "prompt": "hi"})
        assert r.status_code == 400 and r.content == body
