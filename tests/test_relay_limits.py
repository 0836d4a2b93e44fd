"""What the gateway holds requests and replica answers to: each class's max_tokens cap, the
size of a non-streaming answer it buffers, and the shape of replica errors it relays."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

import openai
import orjson
import pytest

from backends.sim.app import SimApp
from backends.sim.replica import SimReplicaSpec
from backends.upstream.inprocess import HandlerResponse
from tests.inprocess import gateway, sim_handler, two_pools

MESSAGES = [{"role": "user", "content": "hi"}]


def capped(max_tokens: int = 16, **server) -> dict:
    config = two_pools(realtime=1, batch=1)
    config["traffic_classes"][0]["max_tokens"] = max_tokens
    config["server"] = server
    return config


async def test_a_request_above_its_class_cap_gets_a_400() -> None:
    async with gateway(capped()) as gw:
        client = gw.openai()
        with pytest.raises(openai.BadRequestError) as exc:
            await client.completions.create(model="tiny", prompt="x", max_tokens=17)
        assert exc.value.code == "max_tokens_too_large"
        assert exc.value.param == "max_tokens"
        assert "at most 16 tokens" in exc.value.message
        with pytest.raises(openai.BadRequestError) as exc:
            await client.chat.completions.create(model="tiny", messages=MESSAGES,
                                                 max_completion_tokens=100, stream=True)
        assert exc.value.param == "max_completion_tokens"
        done = await client.completions.create(model="tiny", prompt="x", max_tokens=16)
        assert done.usage.completion_tokens == 16
        # The batch class has no cap.
        done = await client.completions.create(model="tiny", prompt="x", max_tokens=40,
                                               extra_headers={"x-traffic-class": "batch"})
        assert done.usage.completion_tokens == 40


async def test_a_request_that_asks_for_no_limit_gets_its_class_cap() -> None:
    seen: list[dict] = []
    config = capped()
    sim = SimApp.from_spec(SimReplicaSpec(name="rt-0", kind="vllm", models=("tiny",),
                                          time_scale=0.02))

    async def recording(method: str, target: str, headers: Mapping[str, str],
                        body: bytes) -> HandlerResponse:
        if method == "POST":
            seen.append(orjson.loads(body))
        return await sim_handler(sim)(method, target, headers, body)

    async with gateway(config, handlers={"rt-0": recording}) as gw:
        stream = await gw.openai().chat.completions.create(model="tiny", messages=MESSAGES,
                                                           stream=True)
        chunks = [c async for c in stream]
        assert chunks
    sim.close()
    assert seen[-1]["max_tokens"] == 16


@pytest.mark.parametrize(("field", "value", "code"), [
    ("max_tokens", 1e12, "invalid_type"),
    ("max_tokens", 2**40, "invalid_value"),
    ("max_tokens", 16.5, "invalid_type"),
    ("max_tokens", "16", "invalid_type"),
    ("max_tokens", True, "invalid_type"),
    ("max_completion_tokens", -1, "invalid_value"),
])
async def test_absurd_token_limits_get_a_400_whatever_the_class(field: str, value: object,
                                                                code: str) -> None:
    async with gateway(two_pools(realtime=1, batch=1)) as gw:
        with pytest.raises(openai.BadRequestError) as exc:
            await gw.openai().chat.completions.create(
                model="tiny", messages=MESSAGES, extra_body={field: value})
        assert exc.value.code == code
        assert exc.value.param == field


async def _health_or(answer: HandlerResponse, method: str) -> HandlerResponse:
    return HandlerResponse(200, b"ok") if method == "GET" else answer


def huge_replica(size: int):
    """A replica whose answers are `size` bytes: one JSON body, or SSE events of that total."""

    async def events() -> AsyncIterator[bytes]:
        piece = b"x" * 60000
        for _ in range(size // len(piece) + 1):
            yield b'data: {"id": "c", "object": "text_completion", "choices": [{"index": 0, ' \
                  b'"text": "' + piece + b'", "finish_reason": null}]}\n\n'
        yield b"data: [DONE]\n\n"

    async def handle(method: str, target: str, headers: Mapping[str, str],
                     body: bytes) -> HandlerResponse:
        if method == "GET":
            return HandlerResponse(200, b"ok")
        if orjson.loads(body).get("stream"):
            return HandlerResponse(200, events(), {"content-type": "text/event-stream"})
        text = "x" * size
        return HandlerResponse(200, orjson.dumps({
            "id": "c", "object": "text_completion", "model": "tiny",
            "choices": [{"index": 0, "text": text, "finish_reason": "length"}]}))

    return handle


@pytest.mark.parametrize("non_streaming_ttft", [True, False], ids=["assembled", "passthrough"])
async def test_a_non_streaming_answer_above_max_response_bytes_is_a_502(
        non_streaming_ttft: bool) -> None:
    config = two_pools(realtime=1, batch=1)
    config["server"] = {"max_response_bytes": 1024 * 1024,
                        "non_streaming_ttft": non_streaming_ttft}
    async with gateway(config, handlers={"rt-0": huge_replica(3 * 1024 * 1024)}) as gw:
        r = await gw.http.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert r.status_code == 502
        error = r.json()["error"]
        assert error["code"] == "response_too_large"
        assert set(error) == {"message", "type", "param", "code"}
        # A stream is relayed as it comes, never held: its size is not limited.
        stream = await gw.openai().completions.create(model="tiny", prompt="x", stream=True)
        text = "".join([c.choices[0].text async for c in stream if c.choices])
        assert len(text) > 3 * 1024 * 1024


def answering(status: int, body: bytes, content_type: str):
    async def handle(method: str, target: str, headers: Mapping[str, str],
                     _body: bytes) -> HandlerResponse:
        return await _health_or(HandlerResponse(status, body, {"content-type": content_type}),
                                method)
    return handle


TRACEBACK = (b"Traceback (most recent call last):\n  File \"/srv/engine.py\"\nConnectionError: "
             b"http://admin:hunter2@10.1.2.3:8000/internal unreachable")


@pytest.mark.parametrize(("status", "body", "content_type"), [
    (500, TRACEBACK, "text/plain"),
    (500, b'{"detail": "CUDA error at 10.1.2.3"}', "application/json"),
    (507, b"<html>hunter2 10.1.2.3</html>", "text/html"),
    (404, b"<html>nginx at 10.1.2.3</html>", "text/html"),
    (502, TRACEBACK, "text/plain"),  # the last replica left to try
], ids=["500-text", "500-json", "507-html", "404-html", "502-last-try"])
async def test_replica_errors_are_answered_in_openai_shape_without_internals(
        status: int, body: bytes, content_type: str) -> None:
    config = two_pools(realtime=1, batch=1)
    async with gateway(config, handlers={"rt-0": answering(status, body, content_type)}) as gw:
        r = await gw.http.post("/v1/chat/completions",
                               json={"model": "tiny", "messages": MESSAGES})
        assert r.status_code == status
        assert r.headers["content-type"] == "application/json"
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert f"HTTP {status}" in error["message"]
        assert "10.1.2.3" not in r.text and "hunter2" not in r.text
        with pytest.raises(openai.APIStatusError) as exc:
            await gw.openai().chat.completions.create(model="tiny", messages=MESSAGES)
        assert exc.value.status_code == status


async def test_a_replica_4xx_in_json_passes_through_unchanged() -> None:
    body = b'{"error": {"message": "context too long", "type": "BadRequestError", ' \
           b'"param": null, "code": 400}}'
    config = two_pools(realtime=1, batch=1)
    async with gateway(config, handlers={
            "rt-0": answering(400, body, "application/json")}) as gw:
        r = await gw.http.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert r.status_code == 400
        assert r.content == body


def test_the_output_a_request_may_generate_is_the_smaller_of_its_limits() -> None:
    from gateway.parse import output_tokens

    assert output_tokens({"max_tokens": 300}) == 300
    assert output_tokens({"max_completion_tokens": 50, "max_tokens": 300}) == 50
    assert output_tokens({"max_tokens": None, "max_completion_tokens": 70}) == 70
    assert output_tokens({"max_tokens": 20, "max_completion_tokens": 70}) == 20
    assert output_tokens({"prompt": "x"}) == 0  # unknown: nothing is reserved for it
