"""One try of one request on one replica: what it costs the replica, and what it observed."""

from __future__ import annotations

from time import perf_counter

from backends.pool import Pool, ReplicaState
from gateway.observe import Observer
from gateway.outcome import Finished, Outcome
from gateway.sse import StreamWatcher
from routing.types import Decision, RoutingRequest


class Attempt:
    """Books a try from dispatch to end: load, in-flight count, step timing, TTFT, tokens.

    `end()` runs once, whatever way the try ended; only tries that answered the client (or
    failed it) count as finished requests.
    """

    __slots__ = ("_ended", "decision", "observer", "pool", "received_at", "replica", "request",
                 "saw_first", "sent_at", "traffic_class", "watcher")

    def __init__(self, pool: Pool, replica: ReplicaState, decision: Decision,
                 request: RoutingRequest, traffic_class: str, received_at: float,
                 observer: Observer, keep_events: bool) -> None:
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
        pool.router.dispatched(decision)
        observer.inflight(pool.name, replica.name, 1)
        self.sent_at = perf_counter()

    def observe(self, chunk: bytes) -> None:
        """Every chunk ends an engine step there (step timing); the first with content ends
        this request's prefill."""
        now = perf_counter()
        self.watcher.feed(chunk, now)
        router = self.pool.router
        router.chunk(self.replica.name, now)
        if not self.saw_first and self.watcher.first_token_at is not None:
            self.saw_first = True
            router.first_token(self.decision, now, self.sent_at)

    def end(self, outcome: Outcome, status: int = 0) -> None:
        if self._ended:
            return
        self._ended = True
        pool, name, watcher = self.pool, self.replica.name, self.watcher
        pool.router.finished(self.decision, self.saw_first)
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
        self.observer.finished(Finished(pool.name, name, self.traffic_class, label,
                                        perf_counter() - self.received_at, ttft,
                                        watcher.completion_tokens(), decode))
