"""Load the router itself has caused: requests in flight, prefill not yet done, step timing."""

from __future__ import annotations

from collections.abc import Mapping

from routing.steps import StepTimer
from routing.types import ReplicaView


class LoadTracker:
    """Counts, per replica, requests in flight and their estimated uncached prefill tokens.

    The gateway knows the moment it dispatches a request and the moment the first token comes
    back, so it can tell how much prefill work it has queued on each replica long before the
    engine's own metrics (scraped every few seconds) show it. Its `steps` time each replica's
    engine steps from the chunks it streams (routing/steps.py).
    """

    __slots__ = ("inflight", "pending_prefill", "remote", "steps")

    def __init__(self, prefill_tokens_per_s: float | None = None) -> None:
        self.inflight: dict[str, int] = {}
        self.pending_prefill: dict[str, float] = {}
        self.steps = StepTimer(prefill_tokens_per_s)
        self.remote: dict[str, tuple[int, float]] = {}
        """Replica -> (in flight, pending prefill tokens) that other gateways sharing this
        one's routing state report having put there; added to this gateway's own counts in
        `view`, never to `inflight` or `pending_prefill` (what this gateway must finish)."""

    def set_remote(self, loads: Mapping[str, tuple[int, float]]) -> None:
        """Replace the other gateways' load with `loads` (replicas absent: none)."""
        self.remote = {r: (max(0, int(n)), max(0.0, float(p)))
                       for r, (n, p) in loads.items() if n > 0 or p > 0}

    def dispatched(self, replica: str, uncached_tokens: float) -> None:
        self.inflight[replica] = self.inflight.get(replica, 0) + 1
        self.pending_prefill[replica] = self.pending_prefill.get(replica, 0.0) + uncached_tokens

    def chunk(self, replica: str, now: float) -> None:
        """The replica streamed a chunk at `now`: one of its engine steps just ended."""
        self.steps.chunk(replica, now, self.inflight.get(replica, 0),
                         self.pending_prefill.get(replica, 0.0) > 0.0)

    def first_token(self, replica: str, uncached_tokens: float, now: float | None = None,
                    dispatched_at: float | None = None) -> None:
        """The replica finished this request's prefill: its prefill is no longer pending."""
        left = self.pending_prefill.get(replica, 0.0) - uncached_tokens
        self.pending_prefill[replica] = left if left > 1e-6 else 0.0
        if now is not None and dispatched_at is not None:
            self.steps.prefill_done(replica, uncached_tokens, now, dispatched_at)

    def finished(self, replica: str, uncached_tokens: float, saw_first_token: bool) -> None:
        left = self.inflight[replica] = max(0, self.inflight.get(replica, 0) - 1)
        if not left:
            self.steps.idle(replica)
        if not saw_first_token:
            self.first_token(replica, uncached_tokens)

    def forget(self, replica: str) -> None:
        """The replica left: its counters and step timing go."""
        self.inflight.pop(replica, None)
        self.pending_prefill.pop(replica, None)
        self.steps.forget(replica)

    def view(self, replica: str, now: float | None = None) -> ReplicaView:
        wait = 0.0
        if now is not None and self.inflight.get(replica):
            wait = self.steps.rate * self.steps.remaining(replica, now)
        inflight = self.inflight.get(replica, 0)
        pending = self.pending_prefill.get(replica, 0.0)
        if self.remote:
            n, p = self.remote.get(replica, (0, 0.0))
            inflight += n
            pending += p
        return ReplicaView(
            name=replica,
            inflight=inflight,
            pending_prefill_tokens=pending,
            step_wait_tokens=wait,
            speed=self.steps.speed(replica),
        )
