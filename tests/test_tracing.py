"""OpenTelemetry tracing (tracing.enabled, the otel extra): a span per request with the
routing decision, the queue wait and TTFT, W3C trace context to the replica and from the
client; off, nothing of it is imported or run."""

from __future__ import annotations

import asyncio
import http.server
import json
import subprocess
import sys
import threading
from collections.abc import Mapping
from typing import Any

import aiohttp
import httpx
import pytest
from aiohttp import web
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # the otel extra
    InMemorySpanExporter,
)

from backends.upstream.inprocess import HandlerResponse
from gateway import processes
from gateway.config import ConfigError, parse_config
from gateway.tracing import Tracing
from tests.conftest import (
    ROOT,
    poll,
    start_gateway,
    start_sims,
    tenant_prompt,
    two_pool_config,
)
from tests.inprocess import gateway, replica_answering, two_pools
from tests.test_auth import recording

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"


def traced(config: dict[str, Any]) -> tuple[dict[str, Any], Tracing, InMemorySpanExporter]:
    config = {**config, "tracing": {"enabled": True, "service_name": "gw-test"}}
    exporter = InMemorySpanExporter()
    return config, Tracing(parse_config(config).tracing, exporter), exporter


def parent_of(traceparent: str) -> tuple[str, str]:
    """(trace id, parent span id) of a traceparent header."""
    version, trace_id, span_id, _flags = traceparent.split("-")
    assert version == "00"
    return trace_id, span_id


async def test_a_span_per_request_with_the_decision_and_trace_context_both_ways() -> None:
    seen: list[dict[str, str]] = []
    config, tracing, exporter = traced(two_pools(realtime=1, batch=1))
    async with gateway(config, handlers={"rt-0": recording(seen, "rt-0")},
                       tracing=tracing) as gw:
        c = gw.openai()
        # A client's trace: the gateway's span is its child, and the replica's parent.
        r = await c.chat.completions.with_raw_response.create(
            model="tiny", max_tokens=4,
            messages=[{"role": "system", "content": tenant_prompt(1)},
                      {"role": "user", "content": "hi"}],
            extra_headers={"traceparent": TRACEPARENT, "tracestate": "vendor=abc"})
        assert r.status_code == 200
        (span,) = exporter.get_finished_spans()
        ctx = span.get_span_context()
        assert f"{ctx.trace_id:032x}" == CLIENT_TRACE
        assert span.parent is not None and f"{span.parent.span_id:016x}" == CLIENT_SPAN
        assert span.name == "POST /v1/chat/completions" and span.kind.name == "SERVER"
        assert parent_of(seen[0]["traceparent"]) == (CLIENT_TRACE, f"{ctx.span_id:016x}")
        assert seen[0]["tracestate"] == "vendor=abc"
        a = span.attributes
        assert a["gateway.pool"] == "realtime" and a["gateway.traffic_class"] == "realtime"
        assert a["gateway.replica"] == a["gateway.route.replica"] == "rt-0"
        assert a["gateway.route.reason"] == r.headers["x-gateway-route-reason"]
        assert a["gateway.route.matched_fraction"] == pytest.approx(
            float(r.headers["x-gateway-prefix-match"]), abs=1e-3)
        assert a["gateway.route.total_blocks"] > 0
        assert a["gateway.attempt"] == 1
        # Passed through whole (the default for a non-streaming request): no first token to
        # time; a stream's TTFT is below.
        assert "gateway.ttft_s" not in a and a["gateway.status"] == "200"
        assert a["http.response.status_code"] == 200 and a["gen_ai.request.model"] == "tiny"
        assert "gateway.queue_wait_s" not in a  # its class is not under admission control
        assert span.resource.attributes["service.name"] == "gw-test"

        # No client trace: a new one, whose context the replica gets; a stream's span ends
        # with the stream, TTFT and all.
        exporter.clear()
        stream = await c.completions.create(model="tiny", prompt=tenant_prompt(1),
                                            max_tokens=6, stream=True)
        async for _ in stream:
            pass
        (span,) = exporter.get_finished_spans()
        ctx = span.get_span_context()
        assert span.parent is None
        assert parent_of(seen[1]["traceparent"]) == (f"{ctx.trace_id:032x}",
                                                     f"{ctx.span_id:016x}")
        assert "tracestate" not in seen[1]
        assert span.attributes["gateway.stream"] is True
        assert span.attributes["gateway.ttft_s"] > 0
        assert span.attributes["gen_ai.usage.output_tokens"] == 6
        assert span.end_time > span.start_time


async def test_a_retry_is_the_second_attempt_on_the_span() -> None:
    config = two_pools(realtime=2, batch=1, policy="round_robin")
    config, tracing, exporter = traced(config)
    failing = replica_answering(lambda: HandlerResponse(
        502, iter([b'{"error": "down"}']), {"content-type": "application/json"}))
    async with gateway(config, handlers={"rt-0": failing}, tracing=tracing) as gw:
        c = gw.openai()
        for i in range(2):  # round robin: one of the two goes to rt-0 first
            await c.completions.create(model="tiny", prompt=f"p{i}", max_tokens=2)
    spans = exporter.get_finished_spans()
    assert len(spans) == 2
    retried = [s for s in spans if s.attributes["gateway.attempt"] == 2]
    assert len(retried) == 1
    span = retried[0]
    assert span.attributes["gateway.route.replica"] == "rt-0"
    assert span.attributes["gateway.replica"] == "rt-1"
    events = [(e.name, dict(e.attributes)) for e in span.events]
    assert ("try_failed", {"gateway.replica": "rt-0", "gateway.reason": "status",
                           "gateway.attempt": 1}) in events
    assert ("retry", {"gateway.replica": "rt-1", "gateway.attempt": 2}) in events


async def test_the_wait_for_an_admission_slot_is_on_the_span() -> None:
    config = two_pools(realtime=1, batch=1)
    config["pools"][0]["max_inflight_per_replica"] = 1
    config["traffic_classes"][0]["admission"] = {"max_queue": 4}
    config, tracing, exporter = traced(config)
    async with gateway(config, tracing=tracing) as gw:
        c = gw.openai()
        await asyncio.gather(*(c.completions.create(model="tiny", prompt="x", max_tokens=30)
                               for _ in range(2)))
    waits = sorted(s.attributes["gateway.queue_wait_s"] for s in exporter.get_finished_spans())
    assert waits[0] == 0.0 and waits[1] > 0  # one had the slot at once, one queued for it
    for span in exporter.get_finished_spans():
        assert span.attributes["gateway.admission.pool"] == "realtime"
        assert span.attributes["gateway.admission.borrowed"] is False


def test_tracing_needs_the_otel_extra(monkeypatch) -> None:
    import gateway.config

    monkeypatch.setattr(gateway.config, "_importable", lambda name: False)
    with pytest.raises(ConfigError, match=r"prefix-gateway\[otel\]"):
        parse_config({**two_pools(realtime=1, batch=1), "tracing": {"enabled": True}})
    parse_config(two_pools(realtime=1, batch=1))  # off: not needed


def test_off_nothing_is_imported_nor_wrapped() -> None:
    """Off (the default), the gateway imports neither its tracing module, nor the SDK's
    tracer, nor the exporter (FastAPI and the redis client import parts of OpenTelemetry of
    their own when it is installed), and its request path is the plain one: no wrapper, the
    plain observer and admission."""
    code = """
import json, sys
from gateway.admission import Admission
from gateway.app import create_app
from gateway.config import parse_config
from gateway.observe import Observer
from tests.inprocess import two_pools
app = create_app(parse_config(two_pools()))
print(json.dumps({
    "otel": sorted(m for m in sys.modules
                   if m.startswith(("opentelemetry.sdk.trace", "opentelemetry.exporter"))),
    "tracing_module": "gateway.tracing" in sys.modules,
    "wrapped": "handle" in vars(app.core),
    "observer": type(app.state.observer) is Observer,
    "admission": type(app.state.admission) is Admission}))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {
        "otel": [], "tracing_module": False, "wrapped": False, "observer": True,
        "admission": True}


async def _recording_proxy(target: str, seen: list[Mapping[str, str]]) -> web.AppRunner:
    """A loopback HTTP server in front of `target` that records the headers of each
    inference request and passes everything through."""
    session = aiohttp.ClientSession(auto_decompress=False)

    async def forward(request: web.Request) -> web.StreamResponse:
        if request.path.startswith("/v1/"):
            seen.append(dict(request.headers))
        headers = {k: v for k, v in request.headers.items() if k.lower() != "host"}
        async with session.request(request.method, target + request.path_qs,
                                   headers=headers, data=await request.read()) as up:
            resp = web.StreamResponse(status=up.status, headers={
                k: v for k, v in up.headers.items()
                if k.lower() not in ("content-length", "transfer-encoding", "connection")})
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", forward)
    app.on_cleanup.append(lambda _: session.close())
    runner = web.AppRunner(app)
    await runner.setup()
    return runner


async def test_a_real_request_to_a_simulated_replica_carries_the_trace(tmp_path) -> None:
    """Over real HTTP: the gateway (its real upstream transport) in front of a simulated
    replica process, through a loopback server that shows what the replica receives."""
    from gateway.app import GatewayApp
    from gateway.state import GatewayState

    sims = start_sims(["vllm"], tmp_path)
    seen: list[Mapping[str, str]] = []
    runner = await _recording_proxy(sims.urls[0], seen)
    port = processes.free_ports(1)[0]
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        config = two_pools(realtime=1, batch=1)
        config["pools"][0]["replicas"][0]["url"] = f"http://127.0.0.1:{port}"
        config["pools"][1]["replicas"][0]["url"] = sims.urls[0]
        config, tracing, exporter = traced(config)
        cfg = parse_config(config)
        state = GatewayState(cfg, tracing=tracing)
        app = GatewayApp(cfg, state)
        await state.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://gateway", timeout=30) as http:
                # A stream, so that the span has a first token to time.
                r = await http.post("/v1/chat/completions", headers={"traceparent": TRACEPARENT},
                                    json={"model": "tiny", "max_tokens": 4, "stream": True,
                                          "messages": [
                                              {"role": "user", "content": tenant_prompt(3)}]})
                assert r.status_code == 200 and b"data: [DONE]" in r.content
        finally:
            await state.stop()
    finally:
        await runner.cleanup()
        sims.stop()
    (span,) = exporter.get_finished_spans()
    ctx = span.get_span_context()
    assert f"{ctx.trace_id:032x}" == CLIENT_TRACE
    (headers,) = seen
    assert parent_of(headers["traceparent"]) == (CLIENT_TRACE, f"{ctx.span_id:016x}")
    assert span.attributes["gateway.replica"] == "rt-0"
    assert span.attributes["gateway.ttft_s"] > 0
    assert span.attributes["http.response.status_code"] == 200


def test_a_gateway_exports_its_spans_over_otlp_http(tmp_path) -> None:
    """`prefix-gateway serve` with tracing on sends its spans, as OTLP/HTTP protobuf, to
    `tracing.endpoint`: here a loopback server that decodes them."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    received: list[ExportTraceServiceRequest] = []

    class Collector(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if self.path == "/v1/traces":
                received.append(ExportTraceServiceRequest.FromString(body))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    collector = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    sims = start_sims(["vllm", "trtllm"], tmp_path)
    try:
        config = two_pool_config(sims.urls[:1], sims.urls[1:], processes.free_ports(1)[0])
        config["tracing"] = {"enabled": True, "service_name": "edge-gw", "endpoint":
                             f"http://127.0.0.1:{collector.server_port}/v1/traces"}
        gw = start_gateway(config, tmp_path)
        try:
            r = httpx.post(gw.url + "/v1/completions", headers={"traceparent": TRACEPARENT},
                           json={"model": "tiny", "prompt": tenant_prompt(2), "max_tokens": 3},
                           timeout=30)
            assert r.status_code == 200

            def exported() -> list:
                return [(rs, span) for req in received for rs in req.resource_spans
                        for ss in rs.scope_spans for span in ss.spans]

            ((resource_spans, span),) = poll(exported, 30)  # batches leave every 5 s
        finally:
            gw.stop()
    finally:
        sims.stop()
        collector.shutdown()
    assert span.trace_id.hex() == CLIENT_TRACE and span.parent_span_id.hex() == CLIENT_SPAN
    assert span.name == "POST /v1/completions"
    attrs = {a.key: a.value for a in span.attributes}
    assert attrs["gateway.pool"].string_value == "realtime"
    assert attrs["gateway.replica"].string_value == "rt-0"
    assert attrs["gateway.status"].string_value == "200"
    service = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
    assert service["service.name"] == "edge-gw"
