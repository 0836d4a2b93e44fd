"""The ASGI application: a lean router for inference paths, FastAPI for everything else."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from backends.pool import ReplicaState
from gateway import __version__
from gateway.auth import CLIENT_SCOPE
from gateway.batch import api as batch_api
from gateway.batch.service import BatchService
from gateway.config import GatewayConfig
from gateway.core import RequestCore, error_reply
from gateway.discovery import Discovery, Resolver
from gateway.edge import InferenceEndpoint, send_reply
from gateway.errors import GatewayError, bad_request
from gateway.fleet import Fleet
from gateway.reload import Reloader
from gateway.state import GatewayState
from gateway.workerload import WorkerLoad
from gateway.workerprefixes import WorkerPrefixes
from gateway.workerview import WorkerView

_NOT_JSON = object()
"""An admin request body that is not JSON."""

_STATIC = Path(__file__).parent / "static"


def _error(status: int, message: str, type: str = "invalid_request_error",
           code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type, "param": None,
                                   "code": code}}, status_code=status, headers=headers)


def build_admin(state: GatewayState, batch: BatchService | None = None,
                fleet: Fleet | None = None, reloader: Reloader | None = None,
                view: WorkerView | None = None,
                discovery: Discovery | None = None) -> FastAPI:
    """Health, readiness, models, metrics and stats, the replicas, and the Batch API: where
    FastAPI's conveniences pay. `view`: this process is one of several workers (serve
    --workers), and /metrics and /admin/stats answer for them all."""
    fleet = fleet or Fleet(state)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await state.start()
        if discovery is not None:
            await discovery.start()
        if batch is not None:
            await batch.start()
        watch = None
        if reloader is not None:
            watch = asyncio.create_task(reloader.run())
            with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
                asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reloader.request)
        shared = loads = None
        if view is not None:
            view.write()
            shared = asyncio.create_task(view.run())
            if state.shared is None:  # no Redis shares the load: the workers share theirs
                loads = WorkerLoad(view.directory, state, prefixes=WorkerPrefixes(
                    view.directory, state.pools, state.observer))
                # Before serving: the others' prefixes, a dead worker's that this one
                # replaces among them, are in its index for its first decision.
                with contextlib.suppress(OSError):
                    loads.tick()
                loads_task = asyncio.create_task(loads.run())
        # Everything allocated so far (FastAPI, pydantic, prometheus, routing tables) lives for
        # the whole process: keep it out of the collector's full passes, which otherwise walk
        # it on the hot path (about 6% of the gateway's CPU under load, docs/benchmarks.md).
        gc.freeze()
        try:
            yield
        finally:
            if watch is not None:
                with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
                    asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
                watch.cancel()
                await asyncio.gather(watch, return_exceptions=True)
            if loads is not None:
                loads_task.cancel()
                await asyncio.gather(loads_task, return_exceptions=True)
                loads.remove()
            if shared is not None:
                shared.cancel()
                await asyncio.gather(shared, return_exceptions=True)
                with contextlib.suppress(OSError):
                    view.write()  # type: ignore[union-attr]  # the last counts, for the sums
            if discovery is not None:
                await discovery.stop()
            await fleet.stop()
            if batch is not None:
                await batch.stop()
            await state.stop()

    # The interactive docs and the schema describe the whole surface, admin included: off
    # unless asked for (server.expose_docs).
    docs = state.config.server.expose_docs
    app = FastAPI(title="prefix-gateway", version=__version__, lifespan=lifespan,
                  docs_url="/docs" if docs else None, redoc_url="/redoc" if docs else None,
                  openapi_url="/openapi.json" if docs else None)
    if docs:
        # The document of what clients may call, in OpenAI's shapes (gateway/openapi.py), not
        # FastAPI's: the inference paths are not FastAPI routes and the admin ones are not for
        # clients. Built per request: the models served may change while it runs.
        from gateway.openapi import v1_openapi

        app.openapi = lambda: v1_openapi(models=sorted(state.models) or None)  # type: ignore[method-assign]
    not_found = ("Not found: see /docs for the gateway's routes." if docs else
                 "Not found: the gateway serves /v1/chat/completions, /v1/completions, "
                 "/v1/models, the Batch API and /health.")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        msg = not_found if exc.status_code == 404 else str(exc.detail)
        headers = exc.headers
        if exc.status_code == 405:
            # RFC 9110: a 405 lists every method of the path; Starlette's lists only those of
            # the first route matching it (GET /v1/files and POST /v1/files are two routes).
            headers = {**(headers or {}), "Allow": ", ".join(_methods_of_path(app, request.scope))}
        return _error(exc.status_code, msg, code="not_found" if exc.status_code == 404 else None,
                      headers=headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(400, str(exc.errors()[:3]))

    @app.get("/health")
    async def health() -> dict[str, str]:
        """Liveness: the gateway process answers."""
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        """Readiness: every pool has at least one healthy replica."""
        ok, healthy = state.ready()
        return JSONResponse({"ready": ok, "healthy_replicas": healthy},
                            status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        """The union of the models every pool serves."""
        return {"object": "list", "data": [
            {"id": m, "object": "model", "created": 0, "owned_by": "prefix-gateway",
             "pools": [p.name for p in state.pools if m in p.models]}
            for m in state.models]}

    @app.get("/v1/models/{model}")
    async def model(model: str) -> JSONResponse:
        if model not in state.models:
            return _error(404, f"The model `{model}` does not exist or is not served here.",
                          code="model_not_found")
        return JSONResponse({"id": model, "object": "model", "created": 0,
                             "owned_by": "prefix-gateway"})

    @app.get("/metrics")
    async def metrics() -> Response:
        if view is not None:
            return Response(view.metrics_text(), media_type=CONTENT_TYPE_LATEST)
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/admin/stats")
    async def stats() -> dict[str, Any]:
        """Per pool and replica: health, load, hit ratios, TTFT, decisions by reason; per
        traffic class and pool under admission control: queues, slots, refusals, borrowing."""
        if view is not None:
            return view.stats()
        return state.stats.snapshot(state.pools, state.admission)

    @app.get("/admin/history")
    async def history(since: float | None = None) -> dict[str, Any]:
        """The /admin page's charts: one sample per `history.interval_s` over the last
        `history.window_s` (only those after `since`, a sample's `t`, if given), and the
        latest routing decisions with their reasons."""
        return state.history.snapshot(since)

    # Replicas joining and leaving (gateway/fleet.py); a reload from the file overrides these.
    def _failed(err: GatewayError) -> JSONResponse:
        return _error(err.status, err.message, code=err.code)

    def _change(pool: str, change: Callable[[], ReplicaState], status: int) -> JSONResponse:
        """A change to `pool`'s replicas, answered with the replica as it is after it. With
        several workers a change would reach only the one answering: refused."""
        if view is not None:
            return _error(409, "This gateway runs several worker processes (server.workers), "
                          "and the admin API would change the replicas of one of them only: "
                          "change the configuration file instead; every worker reloads it "
                          "(SIGHUP or the file watch).", code="several_workers")
        try:
            p = fleet.pool(pool)
            r = change()
        except GatewayError as err:
            return _failed(err)
        return JSONResponse(fleet.describe(p, r), status_code=status)

    @app.get("/admin/replicas")
    async def replicas() -> dict[str, Any]:
        """Every pool's replicas: health, draining, requests in flight."""
        return fleet.listing()

    @app.post("/admin/pools/{pool}/replicas")
    async def add_replica(pool: str, request: Request) -> JSONResponse:
        """Add a replica ({name, url, models?, api_key?}); in rotation once healthy."""
        try:
            body = await request.json()
        except ValueError:
            body = _NOT_JSON

        def add() -> ReplicaState:
            if body is _NOT_JSON:
                raise bad_request("The body must be a JSON object {name, url, models?, "
                                  "api_key?}.", code="invalid_replica")
            return fleet.add(pool, body)

        return _change(pool, add, 201)

    @app.post("/admin/pools/{pool}/replicas/{name}/drain")
    async def drain_replica(pool: str, name: str) -> JSONResponse:
        """No new requests for the replica; those in flight finish. It stays listed."""
        return _change(pool, lambda: fleet.drain(pool, name), 200)

    @app.delete("/admin/pools/{pool}/replicas/{name}")
    async def remove_replica(pool: str, name: str) -> JSONResponse:
        """Drain the replica, then drop it once its requests in flight have ended."""
        return _change(pool, lambda: fleet.drain(pool, name, remove=True), 202)

    # Engine A/B experiments (gateway/experiments/).
    @app.get("/admin/experiments")
    async def experiments() -> dict[str, Any]:
        """Each experiment's arms, paired comparison and conditions. With several workers:
        this worker's requests only (worker_pid says which)."""
        body: dict[str, Any] = {"experiments": await state.experiments.reports_aside()}
        if view is not None:
            body["worker_pid"] = view.pid
        return body

    def _switch(name: str, enabled: bool) -> JSONResponse:
        if view is not None:
            return _error(409, "This gateway runs several worker processes (server.workers), "
                          "and the admin API would switch the experiment in one of them only: "
                          "set its `enabled` in the configuration file instead; every worker "
                          "reloads it (SIGHUP or the file watch).", code="several_workers")
        exp = state.experiments.switch(name, enabled)
        if exp is None:
            return _error(404, f"No experiment named {name!r}.", code="experiment_not_found")
        return JSONResponse({"name": exp.name, "mode": exp.mode, "enabled": exp.enabled})

    @app.post("/admin/experiments/{name}/disable")
    async def disable_experiment(name: str) -> JSONResponse:
        """The kill switch: no more copies (mirror) or candidate requests (split), at once."""
        return _switch(name, False)

    @app.post("/admin/experiments/{name}/enable")
    async def enable_experiment(name: str) -> JSONResponse:
        return _switch(name, True)

    @app.get("/admin", response_class=HTMLResponse)
    async def page() -> HTMLResponse:
        return HTMLResponse((_STATIC / "stats.html").read_text())

    batch_api.install(app, batch, state.config.batch.max_file_bytes)
    return app


def _methods_of_path(app: FastAPI, scope: dict[str, Any]) -> list[str]:
    """The methods of every route whose path matches the request's."""
    methods: set[str] = set()
    for route in app.router.routes:
        match, _ = route.matches(scope)
        if match is not Match.NONE:
            methods.update(getattr(route, "methods", None) or ())
    return sorted(methods)


class GatewayApp:
    """Dispatches inference POSTs straight to their handlers, the rest to FastAPI.

    FastAPI's per-request machinery (routing, dependency injection, response models) costs
    more than everything the gateway itself does per request, so the two hot paths bypass it.
    """

    def __init__(self, config: GatewayConfig, state: GatewayState | None = None,
                 reloader: Callable[[Fleet], Reloader] | None = None,
                 workers_dir: str | None = None, resolver: Resolver | None = None) -> None:
        self.state = state or GatewayState(config)
        self.core = RequestCore(self.state)
        # The Batch API runs only with Redis; without it its routes say how to turn it on.
        self.batch = BatchService(self.core) if config.redis is not None else None
        self.fleet = Fleet(self.state)
        """Replicas joining and leaving while it runs (the admin API, reloads)."""
        self.discovery = Discovery(self.fleet, resolver)
        """Replicas found by DNS or Kubernetes EndpointSlices (`resolver`: DNS's)."""
        self.reloader = reloader(self.fleet) if reloader is not None else None
        self.view = WorkerView(workers_dir, self.state) if workers_dir is not None else None
        """One of several workers (serve --workers): /metrics and /admin/stats cover all."""
        self.admin = build_admin(self.state, self.batch, self.fleet, self.reloader, self.view,
                                 self.discovery)
        auth = self.state.auth
        self.guarded = auth.client_required or auth.admin_required or auth.metrics_required
        """Some route needs a key: an open gateway classifies no path per request."""
        limit = config.server.max_body_bytes
        self.fast = {
            "/v1/chat/completions": InferenceEndpoint(self.core, "/v1/chat/completions", True,
                                                      limit),
            "/v1/completions": InferenceEndpoint(self.core, "/v1/completions", False, limit),
        }

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            if self.guarded:
                surface = _surface(path)
                if surface is not None and not await self._allowed(surface, scope, send):
                    return
            handler = self.fast.get(path.rstrip("/") or "/")
            if handler is not None:
                await handler(scope, receive, send)
                return
        await self.admin(scope, receive, send)

    async def _allowed(self, surface: str, scope, send) -> bool:
        """Check the caller's key for `surface`; False: refused (the answer is sent)."""
        auth = self.state.auth
        if not (auth.admin_required if surface == "admin" else auth.metrics_required
                if surface == "metrics" else auth.client_required):
            return True
        headers = dict(scope["headers"])
        try:
            if surface == "admin":
                auth.admin(headers)
            elif surface == "metrics":
                auth.metrics_reader(headers)
            else:
                scope[CLIENT_SCOPE] = auth.client(headers)
            return True
        except GatewayError as err:
            reason = "unauthenticated" if err.status == 401 else "forbidden"
            self.state.observer.auth_rejected(surface, "none", reason)
            await send_reply(send, error_reply(err))
            return False


def _surface(path: str) -> str | None:
    """Which keys a path needs: inference and api (client keys), admin, metrics; None: open
    (/health, /ready, and what FastAPI answers 404). Case-folded, so that no spelling of a
    guarded path slips through to a router that might match it."""
    p = path.lower()
    if p == "/v1" or p.startswith("/v1/"):
        return "inference" if p.rstrip("/") in _INFERENCE else "api"
    if p.rstrip("/") == "/admin":
        return None  # the stats page: static, no data; it asks for the key /admin/stats needs
    if p.startswith("/admin/"):
        return "admin"
    if p == "/metrics" or p.startswith("/metrics/"):
        return "metrics"
    return None


_INFERENCE = frozenset(("/v1/chat/completions", "/v1/completions"))


def create_app(config: GatewayConfig,
               reloader: Callable[[Fleet], Reloader] | None = None,
               workers_dir: str | None = None) -> GatewayApp:
    """`reloader`: builds the reloader of the configuration file (serve), given the fleet;
    `workers_dir`: this is one worker of several, sharing their figures there."""
    return GatewayApp(config, reloader=reloader, workers_dir=workers_dir)
