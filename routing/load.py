"""Load the router itself has caused: requests in flight and prefill work not yet done."""

from __future__ import annotations

from routing.types import ReplicaView


class LoadTracker:
    """Counts, per replica, requests in flight and their estimated uncached prefill tokens.

    The gateway knows the moment it dispatches a request and the moment the first token comes
    back, so it can tell how much prefill work it has queued on each replica long before the
    engine's own metrics (scraped every few seconds) show it.
    """

    __slots__ = ("inflight", "pending_prefill")

    def __init__(self) -> None:
        self.inflight: dict[str, int] = {}
        self.pending_prefill: dict[str, float] = {}

    def dispatched(self, replica: str, uncached_tokens: float) -> None:
        self.inflight[replica] = self.inflight.get(replica, 0) + 1
        self.pending_prefill[replica] = self.pending_prefill.get(replica, 0.0) + uncached_tokens

    def first_token(self, replica: str, uncached_tokens: float) -> None:
        """The replica finished this request's prefill: its prefill is no longer pending."""
        left = self.pending_prefill.get(replica, 0.0) - uncached_tokens
        self.pending_prefill[replica] = left if left > 1e-6 else 0.0

    def finished(self, replica: str, uncached_tokens: float, saw_first_token: bool) -> None:
        self.inflight[replica] = max(0, self.inflight.get(replica, 0) - 1)
        if not saw_first_token:
            self.first_token(replica, uncached_tokens)

    def view(self, replica: str) -> ReplicaView:
        return ReplicaView(
            name=replica,
            inflight=self.inflight.get(replica, 0),
            pending_prefill_tokens=self.pending_prefill.get(replica, 0.0),
        )
