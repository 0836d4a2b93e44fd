"""The request core: classify, route, forward with retries, relay; independent of ASGI.

The HTTP edge (gateway/edge.py) calls it for every inference request; so can anything else
that holds a parsed request, such as a batch runner.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from time import perf_counter

import orjson

from backends.pool import Pool, ReplicaState
from backends.upstream import ConnectFailed, ConnectionDropped, Timeouts, UpstreamResponse
from gateway.attempt import Attempt
from gateway.errors import (
    GatewayError,
    bad_request,
    model_not_found,
    no_replica,
    upstream_failed,
)
from gateway.exchange import JSON_HEADERS, ClientLink, InferenceRequest, Reply
from gateway.experiments.live import BASELINE, CANDIDATE, LiveExperiment, Trial, error_kind
from gateway.experiments.mirror import Mirror
from gateway.outcome import Finished, Outcome
from gateway.parse import cap_tokens, output_tokens
from gateway.ratelimit import RateLimited
from gateway.relay import (
    ReadFailure,
    StreamBody,
    relay_assembled,
    relay_error_status,
    relay_passthrough,
    relay_stream,
)
from gateway.state import GatewayState
from routing.prompt import render_chat, render_completion
from routing.types import Decision, RoutingRequest

log = logging.getLogger("prefix_gateway.core")

_RETRYABLE = frozenset((502, 503, 504))
# W3C trace context goes on as a pair: tracestate means nothing without its traceparent.
_FORWARD_HEADERS = (b"x-request-id", b"traceparent", b"tracestate", b"openai-organization",
                    b"openai-project")


@dataclass(slots=True)
class _Call:
    """One client request on its way through the attempts."""

    request: InferenceRequest
    pool: Pool
    traffic_class: str
    routing: RoutingRequest | None
    """None until hashed (engine tokens are fetched after the call is prepared)."""
    body: bytes
    """What the replica gets (the client's body, or its internally streamed form)."""
    headers: dict[str, str]
    client_auth: str | None
    assemble: bool
    """Stream from the replica and rebuild the JSON response here (to time it)."""
    priority: int
    """Its place in its class's admission queue (higher first)."""
    trial: Trial | None = None
    """Its experiment's record of it, when its class is in an enabled experiment."""


@dataclass(slots=True)
class _Failure:
    """Why one try failed before the client got a byte."""

    detail: str
    reason: str
    """connect, status, read, first_byte_timeout or stalled (the failover metric's label)."""
    never_sent: bool = False


def _hash_chars(request: InferenceRequest, pool: Pool, cls: str) -> RoutingRequest:
    """The prompt rendered canonically and hashed in character blocks: no tokenizer needed."""
    payload = request.payload
    text = render_chat(payload) if request.chat else render_completion(payload)
    return pool.router.request_from_text(text, cls)


def _serialise(payload: dict) -> bytes:
    """The payload as the replica gets it, once the gateway changed it."""
    try:
        return orjson.dumps(payload)
    except orjson.JSONEncodeError:
        # orjson parses 1,024 levels but writes only 254.
        raise bad_request("The request body is nested too deeply (at most 254 levels "
                          "of arrays and objects).", code="nested_too_deep") from None


def error_reply(err: GatewayError) -> Reply:
    body = err.body()
    return Reply(err.status, [*JSON_HEADERS, (b"content-length", str(len(body)).encode()),
                              *err.headers], body)


class RequestCore:
    """Turns an inference request into a reply from the best replica that answers."""

    def __init__(self, state: GatewayState) -> None:
        self.state = state
        cfg = state.config.server
        # By default no total timeout: a long generation that keeps streaming must not be cut.
        # A replica that goes silent for request_timeout_s is given up on. Pools may set their
        # own (PoolConfig.timeouts).
        self.default_timeouts = Timeouts(connect=cfg.connect_timeout_s,
                                         read=cfg.request_timeout_s)
        self.timeouts = {p.name: p.timeouts_for(cfg) for p in state.config.pools}
        self.max_attempts = cfg.max_attempts
        self.max_response = cfg.max_response_bytes
        self.route_headers = cfg.response_headers
        self.explain_headers = cfg.explain_headers
        self.internal_stream = cfg.non_streaming_ttft
        self.token_caps = {c.name: c.max_tokens for c in state.config.traffic_classes
                           if c.max_tokens is not None}
        """Traffic class -> the most tokens one of its requests may ask for."""
        self.admission = state.admission
        self.limiter = state.limiter
        self.pass_client_key = frozenset(p.name for p in state.config.pools
                                         if p.pass_client_key)
        self.gates = state.admission.classes
        """Traffic classes under admission control (empty when none is configured)."""
        self.experiments = state.experiments.by_class
        """Traffic class -> its enabled experiment (empty when none is configured)."""
        self.mirror = state.experiments.mirror = Mirror(
            state.upstream, state.monitor, state.observer, self.timeouts,
            self.default_timeouts, {p.name: p.max_inflight_per_replica
                                    for p in state.config.pools})
        if state.tracing is not None:
            # A span around each request: decided here, once, so that without tracing no
            # request checks for it.
            self.handle = state.tracing.wrap(self.handle)  # type: ignore[method-assign]

    async def handle(self, request: InferenceRequest, link: ClientLink | None = None) -> Reply:
        """The reply to `request`; errors come back as OpenAI-shaped error replies.

        Prepare, wait for admission (when its class is under admission control), route on the
        granted pool, then try the chosen replica and its fallbacks until one answers or
        something has reached the client. (One coroutine for all of it: every level of
        awaiting is paid again each time the request waits on the network.)
        """
        link = link or ClientLink()
        # Requests whose class their caller fixed (the batch runner's lines) are paced by their
        # runner, not by rate limits.
        limited = self.limiter.active and request.traffic_class is None
        try:
            call = self._prepare(request)
        except GatewayError as err:
            if err.code == "traffic_class_not_allowed":
                self.state.observer.auth_rejected("inference", "none", "forbidden")
            return error_reply(err)
        if limited:
            try:
                await self.limiter.charge(request.client, call.traffic_class, request.payload,
                                          len(request.body))
            except RateLimited as err:
                self.state.observer.auth_rejected("inference", call.traffic_class,
                                                  "rate_limited")
                self._unrouted(call, "429")
                return error_reply(err)
        try:
            if call.routing is None:
                await self._hash_engine_tokens(call)
        except GatewayError as err:
            return error_reply(err)
        obs = self.state.observer
        pool = call.pool
        grant = None
        gate = self.gates.get(call.traffic_class)
        if gate is not None:
            # The routing decision is made below, once the request holds a slot: it sees the
            # load of the moment it leaves the queue, not of the moment it arrived.
            grant = self.admission.try_now(gate, request.model)
            if grant is None:
                try:
                    grant = await self.admission.wait(gate, request.model, call.priority, link)
                except GatewayError as err:
                    self._unrouted(call, str(err.status))
                    return error_reply(err)
                if grant is None:  # the client left while queued
                    self._unrouted(call, "499")
                    return Reply(499, [], b"")
        handed_over = False  # the slot is released by the stream, when it ends
        try:
            limit = None
            if grant is not None:
                limit = grant.per_replica
                if grant.borrowed:
                    pool = await self._borrow(call, grant.pool)
                elif grant.pool is not pool:
                    limit = None  # split to its candidate: the slot is the class's own pool's
            views = pool.healthy_views(request.model)
            if limit is not None and views:
                # Replicas at their limit are hidden from routing. Admission keeps some replica
                # free (capacity = limit x usable replicas), unless the free ones do not serve
                # this model: then the replicas that do take it, over their limit.
                views = [v for v in views if v.inflight < limit] or views
            if not views:
                self._unrouted(call, "503")
                return error_reply(no_replica(pool.name))
            if obs.before_route is not None:
                obs.before_route()
            # Its output's KV, held beside its prompt while it runs (`pin_running`).
            call.routing.output_tokens = output_tokens(request.payload)
            first = decision = pool.router.route(call.routing, views)
            obs.decided(pool.name, pool.policy_name, call.traffic_class, decision)
            candidates = [decision.replica, *decision.fallbacks]
            last_error = ""
            tried = 0
            again: set[str] = set()
            for i, name in enumerate(candidates):
                if tried == self.max_attempts:
                    break
                replica = pool.replicas.get(name)
                if replica is None:
                    continue  # left the pool since the decision
                if tried:
                    # Skip fallbacks that failed or filled up meanwhile; they do not use up an
                    # attempt.
                    if not (replica.healthy or replica.suspect) or (
                            limit is not None and pool.load.inflight.get(name, 0) >= limit):
                        continue
                    if name != decision.replica:
                        decision = pool.router.reroute(call.routing, first, name)
                    obs.retried(pool.name, name)
                tried += 1
                final = tried == self.max_attempts or i == len(candidates) - 1
                result = await self._attempt(call, replica, decision, final, link)
                if isinstance(result, Reply):
                    if grant is not None and isinstance(result.body, StreamBody):
                        result.body.on_end = grant.release
                        handed_over = True
                    trial = call.trial
                    if trial is not None and trial.pair is not None and result.status < 300:
                        self._mirror(call, trial)
                    return result
                last_error = result.detail
                obs.try_failed(pool.name, name, result.reason)
                if result.never_sent and i == len(candidates) - 1 and name not in again:
                    # Nothing else to try, and the request never left: a connect that timed
                    # out is as often a CPU-starved host as a replica gone, so try it again.
                    again.add(name)
                    candidates.append(name)
            obs.finished(Finished(pool.name, first.replica, call.traffic_class, "502",
                                  perf_counter() - request.received_at))
            if call.trial is not None:
                call.trial.failed("http_5xx")
            # The detail names replicas and their addresses: for the log, not the client.
            log.warning("502 to the client: every replica tried in pool %s failed: %s",
                        pool.name, last_error or "no healthy replica left to try")
            return error_reply(upstream_failed(pool.name))
        finally:
            if grant is not None and not handed_over:
                grant.release()

    def _prepare(self, request: InferenceRequest) -> _Call:
        """Classify, check the model, hash the prompt (as characters: engine tokens are
        fetched after, by `_hash_engine_tokens`) and build what the replica gets."""
        state = self.state
        payload, headers = request.payload, request.headers
        client = request.client
        cls = request.traffic_class or state.classifier.classify(
            headers, payload.get("service_tier"), client)
        pool = state.pool_for_class[cls]
        routing, arm, pair = None, BASELINE, None
        exp = self.experiments.get(cls)
        if exp is not None:
            pool, routing, arm, pair = self._arm(request, exp, cls)
        model = request.model
        if model not in pool.models:
            others = [p.name for p in state.pools if model in p.models]
            hint = (f" It is served by pool(s) {others}, not by pool {pool.name!r} of "
                    f"traffic class {cls!r}." if others else
                    f" Available models: {state.models}.")
            raise model_not_found(model, hint)
        capped = False
        cap = self.token_caps.get(cls)
        if cap is not None:
            capped = cap_tokens(payload, cap, cls)
        if routing is None and not pool.hashes_engine_tokens:
            routing = _hash_chars(request, pool, cls)
        assemble = False
        # An experiment compares TTFT: its class's whole answers are timed whatever the
        # server's default (the cost falls on the classes under trial only).
        if not request.stream and (self.internal_stream or exp is not None):
            payload["stream"] = True
            opts = payload.get("stream_options")
            payload["stream_options"] = {**(opts if isinstance(opts, dict) else {}),
                                         "include_usage": True}
            assemble = True
        # Written again only if changed, and once whatever changed it.
        body = _serialise(payload) if capped or assemble else request.body
        fwd = {"Content-Type": "application/json"}
        for h in _FORWARD_HEADERS:
            if h in headers:
                fwd[h.decode()] = headers[h].decode("latin-1")
        auth = headers.get(b"authorization")
        priority = request.priority
        if priority is None:
            classifier = state.classifier
            priority = classifier.priority(headers, client) if classifier.sets_priority or (
                client is not None and client.priority is not None) else 0
        return _Call(request, pool, cls, routing, body, fwd,
                     auth.decode("latin-1") if auth else None, assemble, priority,
                     None if exp is None else Trial(exp, arm, request.received_at, pair))

    @staticmethod
    def _arm(request: InferenceRequest, exp: LiveExperiment, cls: str
             ) -> tuple[Pool, RoutingRequest | None, str, int | None]:
        """The pool (split), its routing request if hashed here, the arm, and the pair id of
        a request to mirror (None: not mirrored). A prefix's side or sampling is decided by
        the first block hash of its prompt as the baseline pool hashes characters."""
        base = exp.baseline
        if exp.mode == "mirror" and exp.fraction >= 1.0:
            return base, None, BASELINE, exp.new_pair()
        payload = request.payload
        text = render_chat(payload) if request.chat else render_completion(payload)
        keyed = base.router.request_from_text(text, cls)
        key = keyed.hashes[0] if keyed.hashes else keyed.key
        routing = None if base.hashes_engine_tokens else keyed
        if exp.mode == "mirror":
            return base, routing, BASELINE, exp.new_pair() if exp.on_candidate(key) else None
        cand = exp.candidate
        if (exp.on_candidate(key) and request.model in cand.models
                and any(r.healthy for r in cand.replicas.values())):
            return (cand, None if cand.hashes_engine_tokens else
                    cand.router.request_from_text(text, cls), CANDIDATE, None)
        return base, routing, BASELINE, None

    def _mirror(self, call: _Call, trial: Trial) -> None:
        """A copy of the request to the candidate, unless the switch was turned off since."""
        exp = trial.experiment
        if not exp.enabled:
            return
        headers = call.headers
        if call.client_auth and exp.candidate.name in self.pass_client_key:
            headers = {**headers, "Authorization": call.client_auth}
        assert trial.pair is not None
        self.mirror.offer(exp, call.request, headers, trial.pair)

    def _unrouted(self, call: _Call, status: str) -> None:
        """The request ends with `status` before any replica was chosen."""
        if call.trial is not None:
            call.trial.failed("no_replica" if status == "503" else error_kind(status) or "internal")
        self.state.observer.finished(Finished(call.pool.name, "none", call.traffic_class, status,
                                              perf_counter() - call.request.received_at))

    async def _borrow(self, call: _Call, pool: Pool) -> Pool:
        """The call moves to a pool its class borrows: hashed again, as that pool hashes."""
        call.pool = pool
        if pool.hashes_engine_tokens:
            await self._hash_engine_tokens(call)
        else:
            call.routing = _hash_chars(call.request, pool, call.traffic_class)
        return pool

    async def _hash_engine_tokens(self, call: _Call) -> None:
        """The engine's own tokens, from a replica; characters when none can tokenise."""
        request = call.request
        call.routing = await call.pool.token_request(
            self.state.upstream, request.payload, request.chat, call.traffic_class)
        if call.routing is None:
            call.routing = _hash_chars(request, call.pool, call.traffic_class)

    async def _attempt(self, call: _Call, replica: ReplicaState, decision: Decision,
                       final: bool, link: ClientLink) -> Reply | _Failure:
        """One try on one replica: a reply for the client, or why nothing reached it (so the
        caller may try elsewhere).

        Until something reaches the client the try can be interrupted: by the client leaving
        (the replica's request is dropped, so its engine stops), by the pool's first_byte_s,
        or by the stall watch finding the replica frozen (the request is tried elsewhere).
        """
        pool, name = call.pool, replica.name
        monitor = self.state.monitor
        attempt = Attempt(pool, replica, decision, call.routing, call.traffic_class,
                          call.request.received_at, self.state.observer, call.assemble,
                          monitor, call.trial,
                          blind=not call.request.stream and not call.assemble)
        headers = call.headers
        # The pool's (or replica's) own credentials, and only to it; the client's key only to a
        # pool configured to receive it.
        auth = replica.auth or (call.client_auth if pool.name in self.pass_client_key
                                else None)
        if auth:
            headers = {**headers, "Authorization": auth}
        url = replica.base_url + call.request.path
        timeouts = self.timeouts.get(pool.name, self.default_timeouts)
        task = asyncio.current_task()
        resp: UpstreamResponse | None = None
        streamed = False
        try:
            attempt.hold(task, timeouts.first_byte)
            link.interrupt(attempt.client_left)
            try:
                resp = await self.state.upstream.request(
                    "POST", url, body=call.body, headers=headers, timeouts=timeouts)
            except ConnectionDropped as exc:
                resp = await self._resend(call, replica, url, headers, exc, timeouts)
            finally:
                link.interrupt(None)
            if resp.status in _RETRYABLE and not final:
                detail = f"{name}: HTTP {resp.status}"
                monitor.request_failed(pool, replica, detail, hard=resp.status == 503)
                attempt.end(Outcome.TRY_ANOTHER)
                return _Failure(detail, "status")
            link.attach(resp)
            extra = self._route_headers(pool, replica, decision)
            if resp.status >= 400:
                if resp.status >= 500:
                    monitor.request_failed(pool, replica, f"{name}: HTTP {resp.status}")
                attempt.sent()
                return await relay_error_status(resp, attempt, link, extra,
                                                self.max_response)
            if call.request.stream:
                reply = await relay_stream(resp, attempt, link, extra)
                streamed = isinstance(reply.body, StreamBody)
            elif call.assemble:
                reply = await relay_assembled(resp, attempt, link, extra,
                                              call.request.chat, self.max_response)
            else:
                # Still held while the body is read: nothing reaches the client until it is
                # whole, so first_byte_s, the client leaving and the stall watch can still
                # interrupt it, and a broken or garbage answer is tried elsewhere.
                reply = await relay_passthrough(resp, attempt, link, extra,
                                                self.max_response)
            attempt.sent()
            if reply.status < 500 and (replica.live_failures or replica.ejections):
                monitor.request_succeeded(pool, replica)  # (nothing to reset, most often)
            return reply
        except ConnectFailed as exc:
            detail = f"{name}: {exc}"
            monitor.mark_failed(pool, replica, detail, suspect=exc.timed_out)
            attempt.end(Outcome.TRY_ANOTHER)
            return _Failure(detail, "connect", exc.never_sent)
        except ReadFailure as exc:
            # Nothing reached the client yet: another replica may still answer.
            detail = f"{name}: {exc.detail.split(':', 1)[0]} while reading the response"
            monitor.request_failed(pool, replica, detail, hard=exc.broken)
            return self._failed_before_content(call, attempt, detail, "read", final)
        except asyncio.CancelledError:
            why = attempt.interrupted
            attempt.ended_early = True
            if why is None or task is None or task.uncancel():
                raise  # cancelled from outside (shutdown), not by this try
            if why == "client_gone":
                attempt.end(Outcome.CLIENT_GONE)
                return Reply(499, [], b"")
            detail = (f"{name}: no content within first_byte_s ({timeouts.first_byte} s)"
                      if why == "first_byte_timeout" else f"{name}: {why}")
            if why == "first_byte_timeout":
                monitor.request_failed(pool, replica, detail)
            return self._failed_before_content(call, attempt, detail, why, final)
        finally:
            if not streamed:  # a stream releases its response and ends its try at its end
                if resp is not None:
                    link.upstream = None
                    if attempt.ended_early:
                        resp.abort()  # drop the connection: the replica stops generating
                    resp.release()
                attempt.end(Outcome.TRY_ANOTHER)  # no-op unless cancelled or a bug

    def _failed_before_content(self, call: _Call, attempt: Attempt, detail: str, reason: str,
                               final: bool) -> Reply | _Failure:
        attempt.ended_early = True
        if not final:
            attempt.end(Outcome.TRY_ANOTHER)
            return _Failure(detail, reason)
        attempt.end(Outcome.FAILED)
        self.state.observer.try_failed(call.pool.name, attempt.replica.name, reason)
        # The detail names the replica and its failure: for the log, not the client.
        log.warning("502 to the client: %s/%s", call.pool.name, detail)
        return error_reply(upstream_failed(call.pool.name))

    async def _resend(self, call: _Call, replica: ReplicaState, url: str,
                      headers: dict[str, str], exc: ConnectionDropped,
                      timeouts: Timeouts) -> UpstreamResponse:
        """Once more on a new connection: a kept-alive one was closed under the request (the
        engine's idle timeout firing as it was reused), so nothing was answered and the
        replica is fine."""
        log.info("resending to %s/%s on a new connection: %s", call.pool.name, replica.name, exc)
        self.state.observer.resent(call.pool.name, replica.name)
        return await self.state.upstream.request("POST", url, body=call.body, headers=headers,
                                                 timeouts=timeouts, fresh_connection=True)

    def _route_headers(self, pool: Pool, replica: ReplicaState,
                       decision: Decision) -> list[tuple[bytes, bytes]]:
        out = []
        if self.route_headers:
            out.append((b"x-gateway-replica", replica.name.encode()))
            out.append((b"x-gateway-pool", pool.name.encode()))
        if self.explain_headers:
            out.append((b"x-gateway-route-reason", decision.reason.encode()))
            out.append((b"x-gateway-prefix-match", f"{decision.matched_fraction:.3f}".encode()))
        return out
