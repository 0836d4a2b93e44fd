"""Load the router itself has caused (requests in flight, prefill not yet done) and step timing."""

from __future__ import annotations

from routing.types import ReplicaView

STEP_SAME_S = 0.002
"""Chunks from one replica closer than this (or SAME_STEP_FRACTION of a step) share a step."""
SAME_STEP_FRACTION = 0.3
STEP_EWMA = 0.2


class LoadTracker:
    """Counts, per replica, requests in flight and their estimated uncached prefill tokens.

    The gateway knows the moment it dispatches a request and the moment the first token comes
    back, so it can tell how much prefill work it has queued on each replica long before the
    engine's own metrics (scraped every few seconds) show it. It also times each replica's
    engine steps from the chunks it streams, so routing can tell how long a request sent there
    now would wait for the step in flight to end.
    """

    __slots__ = ("inflight", "last_step_end", "pending_prefill", "step_s")

    def __init__(self) -> None:
        self.inflight: dict[str, int] = {}
        self.pending_prefill: dict[str, float] = {}
        self.last_step_end: dict[str, float] = {}
        self.step_s: dict[str, float] = {}

    def step_ended(self, replica: str, now: float) -> None:
        """A replica streamed a chunk at `now`: one of its engine steps just ended.

        Every step of a replica with streams in flight ends in one chunk per stream, so the
        gaps between chunks time its steps. Chunks closer together than a fraction of a step
        belong to the same step (several streams, or one stream split in transit); a gap over
        3 typical steps is an outlier (a long prefill, a pause) that would skew the estimate.
        """
        last = self.last_step_end.get(replica)
        if last is None:
            self.last_step_end[replica] = now
            return
        gap = now - last
        est = self.step_s.get(replica)
        if gap < STEP_SAME_S or (est is not None and gap < SAME_STEP_FRACTION * est):
            return
        self.last_step_end[replica] = now
        if est is None:
            self.step_s[replica] = gap
        elif gap < 3.0 * est:
            self.step_s[replica] = est + STEP_EWMA * (gap - est)

    def step_remaining(self, replica: str, now: float) -> float:
        """Estimated seconds until the replica's step in flight ends (0 when idle or unknown)."""
        if not self.inflight.get(replica):
            return 0.0
        last = self.last_step_end.get(replica)
        est = self.step_s.get(replica)
        if last is None or est is None:
            return 0.0
        left = last + est - now
        return left if left > 0.0 else 0.0

    def dispatched(self, replica: str, uncached_tokens: float) -> None:
        self.inflight[replica] = self.inflight.get(replica, 0) + 1
        self.pending_prefill[replica] = self.pending_prefill.get(replica, 0.0) + uncached_tokens

    def first_token(self, replica: str, uncached_tokens: float) -> None:
        """The replica finished this request's prefill: its prefill is no longer pending."""
        left = self.pending_prefill.get(replica, 0.0) - uncached_tokens
        self.pending_prefill[replica] = left if left > 1e-6 else 0.0

    def finished(self, replica: str, uncached_tokens: float, saw_first_token: bool) -> None:
        left = self.inflight[replica] = max(0, self.inflight.get(replica, 0) - 1)
        if not left:
            # Idle from now: the next chunk starts a new run of steps, not a gap to time.
            self.last_step_end.pop(replica, None)
        if not saw_first_token:
            self.first_token(replica, uncached_tokens)

    def view(self, replica: str, now: float | None = None) -> ReplicaView:
        return ReplicaView(
            name=replica,
            inflight=self.inflight.get(replica, 0),
            pending_prefill_tokens=self.pending_prefill.get(replica, 0.0),
            step_remaining_s=0.0 if now is None else self.step_remaining(replica, now),
        )
