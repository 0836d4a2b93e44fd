"""One try of one request on one replica: what it costs the replica, and what it observed."""

from __future__ import annotations

import asyncio
from time import perf_counter, time
from typing import TYPE_CHECKING

from backends.health import HealthMonitor
from backends.pool import Pool, ReplicaState
from gateway.observe import Observer
from gateway.outcome import Finished, Outcome
from gateway.sse import StreamWatcher
from routing.types import Decision, RoutingRequest

if TYPE_CHECKING:
    from gateway.experiments.live import Trial


class Attempt:
    """Books a try from dispatch to end: load, in-flight count, step timing, TTFT, tokens.

    `end()` runs once, whatever way the try ended; only tries that answered the client (or
    failed it) count as finished requests.
    """

    __slots__ = ("_ended", "_task", "_timer", "decision", "ended_early", "interrupted",
                 "monitor", "observer", "pool", "received_at", "replica", "request", "saw_first",
                 "sent_at", "traffic_class", "trial", "watcher")

    def __init__(self, pool: Pool, replica: ReplicaState, decision: Decision,
                 request: RoutingRequest, traffic_class: str, received_at: float,
                 observer: Observer, keep_events: bool,
                 monitor: HealthMonitor | None = None, trial: Trial | None = None,
                 blind: bool = False) -> None:
        self.pool = pool
        self.replica = replica
        self.decision = decision
        self.request = request
        self.traffic_class = traffic_class
        self.received_at = received_at
        self.observer = observer
        self.watcher = StreamWatcher(keep=keep_events)
        self.saw_first = False
        self._ended = False
        self.monitor = monitor
        self._timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task | None = None
        self.interrupted: str | None = None
        """Why the try was cut short before anything reached the client (client_gone,
        stalled, first_byte_timeout), None if it was not."""
        self.ended_early = False
        """The replica's response was abandoned: drop its connection, do not reuse it."""
        self.trial = trial
        """The request's experiment trial, if its class is in one: told how it ended."""
        self.sent_at = perf_counter()
        # On the wall clock: gateways on other hosts compare it with their own requests'.
        # `blind`: passed through whole, it shows no first token (its prefill's end is
        # presumed on the clock of the replicas' views).
        pool.router.dispatched(decision, time(), self.sent_at if blind else None)
        observer.inflight(pool.name, replica.name, 1)

    def observe(self, chunk: bytes) -> None:
        """Every chunk ends an engine step there (step timing); the first with content ends
        this request's prefill."""
        now = perf_counter()
        self.watcher.feed(chunk, now)
        router = self.pool.router
        router.chunk(self.replica.name, now)
        self.replica.last_chunk_at = now
        if not self.saw_first and self.watcher.first_token_at is not None:
            self.saw_first = True
            router.first_token(self.decision, now, self.sent_at)
            if self._timer is not None:  # first_byte_s bounds the wait for content only
                self._timer.cancel()
                self._timer = None

    # Until something reaches the client, the try can be cut short and tried elsewhere.

    def hold(self, task: asyncio.Task | None, first_byte: float | None = None) -> None:
        """From now until `sent()` or `end()`, the try may be interrupted: `task` is the one
        to cancel; `first_byte` (seconds) interrupts it (first_byte_timeout) if no content
        has come by then (a timer, not an asyncio.timeout() context: that would cost two
        coroutines on every try, limit or none). `task` None: as `sent()`."""
        if task is None:
            self.sent()
            return
        self._task = task
        self.replica.holding.add(self)
        if first_byte is not None:
            self._timer = asyncio.get_running_loop().call_later(
                first_byte, self.interrupt, "first_byte_timeout")

    def sent(self) -> None:
        """The response is going to the client: it can no longer be tried elsewhere."""
        if self._task is not None:
            self.replica.holding.discard(self)
            self._task = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def interrupt(self, why: str) -> None:
        """Cut the try short (once): its task is cancelled where it waits."""
        if self.interrupted is None and self._task is not None:
            self.interrupted = why
            self._task.cancel()

    def client_left(self) -> None:
        self.interrupt("client_gone")

    def failed_mid_stream(self, detail: str, timed_out: bool) -> None:
        """The replica broke a stream the client was already reading: counts against it."""
        if self.monitor is not None:
            self.monitor.request_failed(self.pool, self.replica, detail, hard=not timed_out)

    def end(self, outcome: Outcome, status: int = 0) -> None:
        if self._ended:
            return
        self._ended = True
        pool, name, watcher = self.pool, self.replica.name, self.watcher
        self.sent()  # if still held: nothing is left to interrupt
        generated = watcher.completion_tokens()
        pool.router.finished(self.decision, self.saw_first, generated)
        self.observer.inflight(pool.name, name, -1)
        if watcher.usage and self.request.prompt_chars:
            tokens = watcher.usage.get("prompt_tokens")
            if isinstance(tokens, int):
                pool.observe_prompt_tokens(self.request.prompt_chars, tokens)
                self.observer.chars_per_token(pool.name, pool.router.chars_per_token)
        if outcome is Outcome.TRY_ANOTHER:
            return
        label = "499" if outcome is Outcome.CLIENT_GONE else \
            "502" if outcome is Outcome.FAILED else str(status)
        first = watcher.first_token_at
        ttft = first - self.received_at if first is not None else None
        decode = (watcher.last_token_at or first) - first if first is not None else 0.0
        f = Finished(pool.name, name, self.traffic_class, label,
                     perf_counter() - self.received_at, ttft, generated, decode)
        self.observer.finished(f)
        if self.trial is not None:
            self.trial.finished(f, watcher.usage, self.request.prompt_tokens)
