"""Mirror copies: a client's request sent again to a candidate pool, in the background, its
answer timed and discarded.

A copy is started once the client's own request has its reply (so it never holds that
request up), runs as a task of its own (never awaited on the client's path), and is bounded:
while an experiment has `max_concurrency` copies in flight, or its candidate pool has no
healthy replica with room, a new copy is dropped and counted instead. Its failures reach no
client: they are counted, and count against the candidate's replicas as a client request's
would (so a broken candidate replica leaves rotation and copies stop going there).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from time import perf_counter
from typing import Any

import orjson

from backends.health import HealthMonitor
from backends.pool import Pool
from backends.upstream import ConnectFailed, ReadFailed, Timeouts, Upstream
from gateway.attempt import Attempt
from gateway.exchange import InferenceRequest
from gateway.experiments.live import CANDIDATE, LiveExperiment, Trial
from gateway.observe import Observer
from gateway.outcome import Finished, Outcome
from gateway.parse import output_tokens
from routing.prompt import render_chat, render_completion
from routing.types import ReplicaView, RoutingRequest

log = logging.getLogger("prefix_gateway.mirror")


class _CopyObserver:
    """What a copy's try reports: not the client traffic's metrics (a copy is no request of
    a client), only what the candidate pool learns (its chars per token)."""

    def __init__(self, observer: Observer) -> None:
        self.observer = observer

    def inflight(self, pool: str, replica: str, delta: int) -> None:
        pass

    def finished(self, f: Finished) -> None:
        pass

    def chars_per_token(self, pool: str, value: float) -> None:
        self.observer.chars_per_token(pool, value)


def copy_body(payload: dict[str, Any]) -> bytes:
    """The copy's body: always streamed (to time its first token), with its usage."""
    opts = payload.get("stream_options")
    return orjson.dumps({**payload, "stream": True, "stream_options": {
        **(opts if isinstance(opts, dict) else {}), "include_usage": True}})


class Mirror:
    """Starts and tracks the copies of every mirror experiment."""

    def __init__(self, upstream: Upstream, monitor: HealthMonitor, observer: Observer,
                 timeouts: Mapping[str, Timeouts], default_timeouts: Timeouts,
                 limits: Mapping[str, int | None]) -> None:
        self.upstream = upstream
        self.monitor = monitor
        self.observer: Any = _CopyObserver(observer)
        self.timeouts = timeouts
        self.default_timeouts = default_timeouts
        self.limits = limits
        """Pool -> max_inflight_per_replica (None: unlimited)."""
        self.tasks: dict[asyncio.Task[None], LiveExperiment] = {}
        """Copies in flight, and whose."""

    def _views(self, pool: Pool, model: str) -> list[ReplicaView]:
        views = pool.healthy_views(model)
        limit = self.limits.get(pool.name)
        if limit is not None:
            views = [v for v in views if v.inflight < limit]
        return views

    def offer(self, exp: LiveExperiment, request: InferenceRequest, headers: dict[str, str],
              pair: int) -> bool:
        """Start a copy of `request` for `exp`, or drop it (counted) when the experiment has
        its most copies in flight or the candidate has no room. Returns whether it started.
        Cheap and synchronous: everything else happens in the copy's task."""
        if exp.copies >= exp.config.max_concurrency or not self._views(exp.candidate,
                                                                         request.model):
            exp.count("dropped")
            return False
        exp.copies += 1
        task = asyncio.get_running_loop().create_task(self._copy(exp, request, headers, pair))
        self.tasks[task] = exp
        task.add_done_callback(self._ended)
        return True

    def _ended(self, task: asyncio.Task[None]) -> None:
        self.tasks.pop(task, None)

    def cancel(self, exp: LiveExperiment) -> int:
        """Cut `exp`'s copies in flight (the kill switch): the candidate stops generating
        them. Returns how many."""
        mine = [t for t, e in self.tasks.items() if e is exp]
        for t in mine:
            t.cancel()
        return len(mine)

    async def stop(self) -> None:
        tasks = list(self.tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _copy(self, exp: LiveExperiment, request: InferenceRequest,
                    headers: dict[str, str], pair: int) -> None:
        trial = Trial(exp, CANDIDATE, perf_counter(), pair)
        try:
            await self._send(exp, request, headers, trial)
        except asyncio.CancelledError:
            trial.failed("cancelled")
            raise
        except Exception:
            log.exception("mirror copy for experiment %s failed in the gateway", exp.name)
            trial.failed("internal")
            exp.count("failed")
        finally:
            exp.copies -= 1

    async def _send(self, exp: LiveExperiment, request: InferenceRequest,
                    headers: dict[str, str], trial: Trial) -> None:
        pool = exp.candidate
        cls = exp.config.traffic_class
        routing: RoutingRequest | None = None
        if pool.hashes_engine_tokens:
            routing = await pool.token_request(self.upstream, request.payload, request.chat,
                                               cls)
        if routing is None:
            text = (render_chat(request.payload) if request.chat
                    else render_completion(request.payload))
            routing = pool.router.request_from_text(text, cls)
        body = copy_body(request.payload)
        views = self._views(pool, request.model)
        if not views:  # the room seen when it was offered is gone
            trial.failed("no_replica")
            exp.count("dropped")
            return
        routing.output_tokens = output_tokens(request.payload)
        decision = pool.router.route(routing, views)
        replica = pool.replicas[decision.replica]
        if replica.auth:
            headers = {**headers, "Authorization": replica.auth}
        monitor = self.monitor
        attempt = Attempt(pool, replica, decision, routing, cls, trial.received_at,
                          self.observer, False, monitor, trial)
        exp.count("sent")
        timeouts = self.timeouts.get(pool.name, self.default_timeouts)
        name = replica.name
        try:
            resp = await self.upstream.request("POST", replica.base_url + request.path,
                                               body=body, headers=headers, timeouts=timeouts)
        except ConnectFailed as exc:
            monitor.mark_failed(pool, replica, f"{name}: {exc}", suspect=exc.timed_out)
            attempt.end(Outcome.TRY_ANOTHER)
            trial.failed("timeout" if exc.timed_out else "connect")
            exp.count("failed")
            return
        except BaseException:
            attempt.end(Outcome.TRY_ANOTHER)
            raise
        try:
            if resp.status >= 400:
                await resp.read()
                if resp.status >= 500:
                    monitor.request_failed(pool, replica, f"{name}: HTTP {resp.status}",
                                           hard=resp.status == 503)
                exp.count("failed")
            else:
                async for chunk in resp.chunks():
                    attempt.observe(chunk)  # timed, then dropped
                if attempt.watcher.error is not None:
                    trial.kind = "stream_error"
                    attempt.end(Outcome.FAILED)
                    exp.count("failed")
                    return
                if replica.live_failures or replica.ejections:
                    monitor.request_succeeded(pool, replica)
            attempt.end(Outcome.ANSWERED, resp.status)
        except ReadFailed as exc:
            monitor.request_failed(pool, replica, f"{name}: {str(exc).split(':', 1)[0]} "
                                   "while reading a mirror copy", hard=not exc.timed_out)
            trial.kind = "timeout" if exc.timed_out else "read"
            attempt.end(Outcome.FAILED)
            exp.count("failed")
        except BaseException:
            resp.abort()  # cancelled: the candidate stops generating
            attempt.end(Outcome.TRY_ANOTHER)
            raise
        finally:
            resp.release()
