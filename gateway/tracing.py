"""OpenTelemetry tracing (the `otel` extra): a span per inference request.

Imported only when `tracing.enabled` is true: off, the gateway neither imports OpenTelemetry
nor checks anything per request. On, three things change at start, not per request:

- `RequestCore.handle` is wrapped (`Tracing.wrap`): the wrapper starts the request's span,
  child of the client's `traceparent` if it sent one, puts the span's own `traceparent` (and
  `tracestate`) in the headers the replica gets, and ends the span when the reply is done
  (for a stream, when the stream ends);
- the observer is a `TracingObserver`: what it is told about the request (the routing
  decision, retries, failed tries, how it finished) it also writes on the request's span,
  found in a context variable of the request's task;
- admission is a `TracingAdmission`, which times the request's wait in its class's queue.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from contextvars import ContextVar
from time import perf_counter, time_ns

from opentelemetry import trace
from opentelemetry.propagators.textmap import Getter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from backends.pool import Pool
from gateway import __version__
from gateway.admission import Admission, ClassGate, Grant
from gateway.config import GatewayConfig, TracingConfig
from gateway.exchange import ClientLink, InferenceRequest, Reply
from gateway.metrics import GatewayMetrics
from gateway.observe import Observer
from gateway.outcome import Finished
from gateway.relay import StreamBody
from gateway.stats import StatsRecorder
from routing.types import Decision

Handle = Callable[[InferenceRequest, ClientLink | None], Awaitable[Reply]]


class _Traced:
    """The span of the request its task is handling, and which try it is on."""

    __slots__ = ("attempt", "span")

    def __init__(self, span: Span) -> None:
        self.span = span
        self.attempt = 0


_current: ContextVar[_Traced | None] = ContextVar("prefix_gateway_span", default=None)


class _HeaderGetter(Getter[Mapping[bytes, bytes]]):
    """Reads W3C headers from the request's raw (lower-case bytes) headers."""

    def get(self, carrier: Mapping[bytes, bytes], key: str) -> list[str] | None:
        value = carrier.get(key.encode())
        return None if value is None else [value.decode("latin-1")]

    def keys(self, carrier: Mapping[bytes, bytes]) -> list[str]:
        return [k.decode("latin-1") for k in carrier]


_GETTER = _HeaderGetter()
_W3C = (b"traceparent", b"tracestate")


def exporter_for(config: TracingConfig) -> SpanExporter:
    """OTLP over HTTP (protobuf) to `config.endpoint`, or where the OTEL_EXPORTER_OTLP_*
    environment variables say."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=config.endpoint) if config.endpoint else OTLPSpanExporter()


class Tracing:
    """The gateway's tracer provider (its own, not the process-global one) and the pieces
    that write spans. `exporter`: where spans go, each as it ends (tests pass the SDK's
    in-memory exporter); None: OTLP, in batches from a background thread."""

    def __init__(self, config: TracingConfig, exporter: SpanExporter | None = None) -> None:
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": config.service_name,
                                      "service.version": __version__}),
            sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)))
        if exporter is None:
            self.provider.add_span_processor(BatchSpanProcessor(exporter_for(config)))
        else:
            self.provider.add_span_processor(SimpleSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("prefix_gateway", __version__)
        self.propagator = TraceContextTextMapPropagator()

    def observer(self, metrics: GatewayMetrics, stats: StatsRecorder) -> Observer:
        return TracingObserver(metrics, stats)

    def admission(self, config: GatewayConfig, pools: dict[str, Pool],
                  observer: Observer) -> Admission:
        return TracingAdmission(config, pools, observer)

    async def shutdown(self) -> None:
        """Export what is left (blocking: in a thread)."""
        await asyncio.to_thread(self.provider.shutdown)

    def wrap(self, handle: Handle) -> Handle:
        """`handle` (RequestCore.handle) with a span around each request."""
        tracer, propagator = self.tracer, self.propagator

        async def traced(request: InferenceRequest, link: ClientLink | None = None) -> Reply:
            headers = request.headers
            parent = propagator.extract(headers, getter=_GETTER) \
                if b"traceparent" in headers else None
            # From the request's arrival, as the gateway's TTFT and duration are measured.
            started = time_ns() - int((perf_counter() - request.received_at) * 1e9)
            span = tracer.start_span(
                f"POST {request.path}", context=parent, kind=SpanKind.SERVER,
                start_time=started, attributes={
                    "http.request.method": "POST", "url.path": request.path,
                    "gen_ai.request.model": request.model, "gateway.stream": request.stream})
            # The replica gets this span's context, in place of the client's.
            carrier: dict[str, str] = {}
            propagator.inject(carrier, context=trace.set_span_in_context(span))
            fwd = {k: v for k, v in headers.items() if k not in _W3C}
            for k, v in carrier.items():
                fwd[k.encode()] = v.encode("latin-1")
            request.headers = fwd
            _current.set(_Traced(span))
            try:
                reply = await handle(request, link)
            except BaseException as exc:
                if not isinstance(exc, asyncio.CancelledError):
                    span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
                span.end()
                _current.set(None)
                raise
            span.set_attribute("http.response.status_code", reply.status)
            if reply.status >= 500:
                span.set_status(Status(StatusCode.ERROR))
            body = reply.body
            if isinstance(body, StreamBody):
                _end_with(body, span)
            else:
                span.end()
                _current.set(None)
            return reply

        return traced


def _end_with(body: StreamBody, span: Span) -> None:
    """End `span` when the stream ends (after what already runs then: a slot's release)."""
    before = body.on_end

    def on_end() -> None:
        try:
            if before is not None:
                before()
        finally:
            span.end()
            _current.set(None)

    body.on_end = on_end


class TracingObserver(Observer):
    """The observer, which also writes what it is told about a request on its span."""

    def decided(self, pool: str, policy: str, cls: str, d: Decision) -> None:
        super().decided(pool, policy, cls, d)
        t = _current.get()
        if t is not None:
            t.attempt = 1
            t.span.set_attributes({
                "gateway.pool": pool, "gateway.policy": policy, "gateway.traffic_class": cls,
                "gateway.route.replica": d.replica, "gateway.route.reason": d.reason,
                "gateway.route.matched_fraction": round(d.matched_fraction, 4),
                "gateway.route.matched_blocks": d.matched_blocks,
                "gateway.route.total_blocks": d.total_blocks,
                "gateway.replica": d.replica, "gateway.attempt": 1})
            # A retry changes gateway.replica and gateway.attempt (below).

    def retried(self, pool: str, replica: str) -> None:
        super().retried(pool, replica)
        t = _current.get()
        if t is not None:
            t.attempt += 1
            t.span.add_event("retry", {"gateway.replica": replica,
                                       "gateway.attempt": t.attempt})
            t.span.set_attributes({"gateway.replica": replica, "gateway.attempt": t.attempt})

    def try_failed(self, pool: str, replica: str, reason: str) -> None:
        super().try_failed(pool, replica, reason)
        t = _current.get()
        if t is not None:
            t.span.add_event("try_failed", {"gateway.replica": replica, "gateway.reason": reason,
                                            "gateway.attempt": t.attempt})

    def finished(self, f: Finished) -> None:
        super().finished(f)
        t = _current.get()
        if t is None:
            return
        span = t.span
        attrs: dict[str, str | float | int] = {"gateway.status": f.status,
                                               "gateway.duration_s": round(f.duration_s, 6)}
        if not t.attempt:  # ended before any decision (429, 503, a client gone while queued)
            attrs["gateway.pool"] = f.pool
            attrs["gateway.traffic_class"] = f.traffic_class
        if f.ttft_s is not None:
            attrs["gateway.ttft_s"] = round(f.ttft_s, 6)
        if f.completion_tokens:
            attrs["gen_ai.usage.output_tokens"] = f.completion_tokens
        span.set_attributes(attrs)
        if f.status.startswith("5"):
            span.set_status(Status(StatusCode.ERROR, f"status {f.status}"))


class TracingAdmission(Admission):
    """Admission control, which also writes the request's wait for a slot on its span."""

    def try_now(self, g: ClassGate, model: str) -> Grant | None:
        grant = super().try_now(g, model)
        if grant is not None:
            _queued(0.0, grant)
        return grant

    async def wait(self, g: ClassGate, model: str, priority: int,
                   link: ClientLink) -> Grant | None:
        since = perf_counter()
        grant = None
        try:
            grant = await super().wait(g, model, priority, link)
            return grant
        finally:
            _queued(perf_counter() - since, grant)


def _queued(waited_s: float, grant: Grant | None) -> None:
    t = _current.get()
    if t is None:
        return
    attrs: dict[str, float | str | bool] = {"gateway.queue_wait_s": round(waited_s, 6)}
    if grant is not None:
        attrs["gateway.admission.pool"] = grant.pool.name
        attrs["gateway.admission.borrowed"] = grant.borrowed
    t.span.set_attributes(attrs)

