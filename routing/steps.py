"""Engine step timing from streamed chunks, and the prefill rate those steps reveal."""

from __future__ import annotations

SAME_STEP_S = 0.002
"""Chunks from one replica closer than this (or than SAME_STEP_FRACTION of a typical step,
if less) share a step: one step's chunks reach the gateway within a fraction of a millisecond
of each other. The bound is absolute, not only relative, because a typical step that long
prefill steps have stretched must not swallow the short decode steps that follow."""
SAME_STEP_FRACTION = 0.3
OUTLIER_STEPS = 3.0
"""A gap over this many typical steps (a long prefill, a pause) does not move the estimates."""
STEP_EWMA = 0.2
DECAY_SAMPLES = 200
"""The rate and decode-step fits weigh their samples by (1 - 1/DECAY_SAMPLES)^age."""
DECODE_ONLY_FACTOR = 1.5
"""A step up to this many times a decode-only step's expected length carried no prefill."""
RATE_MIN_SAMPLES = 20
"""Prefill-rate samples needed before the learned rate is used."""


class StepTimer:
    """Per replica, when its engine steps end and how long they last; per pool, the prefill rate.

    An engine streams one chunk per running request at the end of every step, so the gaps
    between a replica's chunks time its steps, and the last chunk says when the step in flight
    began. A request sent there now waits for that step to end before the engine even looks at
    it; `LoadTracker.view` prices that wait in prompt tokens at the engines' prefill rate.
    Step times are per replica; the rate and the decode-step fit are pool-wide, since a pool's
    replicas run one model.

    The rate is configured, or learned: a step that ends with the first token of requests
    dispatched no earlier than during the step before, or that follows a decode-only step,
    carried their whole prefill, so its length minus a decode-only step's is what those
    uncached tokens cost. Other work hidden in
    the same step (a chunk of a long prompt) only makes the learned rate lower, which is the
    safe side: a rate too high lets the phase of a step outweigh cache hits and queues.
    """

    __slots__ = ("_decode", "_fixed_rate", "_rate_samples", "_rate_seconds", "_rate_tokens",
                 "last_end", "prev_decode_only", "prev_end", "step_awaiting", "step_batch",
                 "step_firsts", "step_prefill", "step_s")

    def __init__(self, prefill_tokens_per_s: float | None = None) -> None:
        self._fixed_rate = prefill_tokens_per_s
        self.last_end: dict[str, float] = {}
        self.prev_end: dict[str, float] = {}
        self.step_s: dict[str, float] = {}
        self.step_batch: dict[str, int] = {}  # requests in flight when the last step ended
        self.step_awaiting: dict[str, bool] = {}  # a prefill was waiting when it began
        self.step_firsts: dict[str, int] = {}  # first tokens in the last step
        self.prev_decode_only: dict[str, bool] = {}  # the step before the last: decode alone?
        # Uncached tokens whose prefill ended in the replica's last step; None when the step
        # also finished a prefill that cannot be attributed to it alone.
        self.step_prefill: dict[str, float | None] = {}
        self._rate_tokens = 0.0
        self._rate_seconds = 0.0
        self._rate_samples = 0
        self._decode = DecodeFit()

    @property
    def rate(self) -> float:
        """Prefill tokens per second used to price waits (0 until known)."""
        if self._fixed_rate is not None:
            return self._fixed_rate
        if self._rate_samples < RATE_MIN_SAMPLES or self._rate_seconds <= 0.0:
            return 0.0
        return self._rate_tokens / self._rate_seconds

    @property
    def learning(self) -> bool:
        return self._fixed_rate is None

    def decode_s(self, batch: int) -> float | None:
        """Expected length of a decode-only step over `batch` sequences (None until seen)."""
        return self._decode.predict(batch)

    def chunk(self, replica: str, now: float, inflight: int = 1,
              awaiting_prefill: bool = False) -> None:
        """The replica, with `inflight` requests there (some `awaiting_prefill`: sent, no
        first token yet), streamed a chunk at `now`."""
        last = self.last_end.get(replica)
        if last is None:
            self.last_end[replica] = now
            self._open_step(replica, inflight, awaiting_prefill)
            return
        gap = now - last
        est = self.step_s.get(replica)
        if gap < (SAME_STEP_S if est is None else min(SAME_STEP_S, SAME_STEP_FRACTION * est)):
            return  # another chunk of the step that ended at `last`
        self._close_step(replica, last)
        self.prev_end[replica] = last
        self.last_end[replica] = now
        self._open_step(replica, inflight, awaiting_prefill)
        if est is None:
            self.step_s[replica] = gap
        elif gap < OUTLIER_STEPS * est:
            self.step_s[replica] = est + STEP_EWMA * (gap - est)

    def _open_step(self, replica: str, inflight: int, awaiting_prefill: bool) -> None:
        self.step_prefill[replica] = 0.0
        self.step_firsts[replica] = 0
        self.step_batch[replica] = inflight
        self.step_awaiting[replica] = awaiting_prefill

    def _close_step(self, replica: str, end: float) -> None:
        """The step that ended at `end` is complete: learn from its length."""
        start = self.prev_end.get(replica)
        if start is None:
            return
        length = end - start
        prefill = self.step_prefill.get(replica, 0.0)
        firsts = self.step_firsts.get(replica, 0)
        # Requests whose prefill ended in this step were not decoding during it.
        batch = max(0, self.step_batch.get(replica, 0) - firsts)
        decode = self._decode.predict(batch)
        # A step no longer than decode alone takes carried no prefill chunk: a prefill that
        # ends in the next step must have run in that step alone.
        self.prev_decode_only[replica] = (not firsts and decode is not None
                                          and length <= DECODE_ONLY_FACTOR * decode)
        if not firsts:
            # A step that ends no prefill is decode alone if no prefill was waiting when it
            # began, or if it is as short as decode alone: a chunk of a long prompt makes a
            # step look like a slow decode step. Until decode steps are known, any step that
            # is not an outlier teaches them (under steady load a prefill is always waiting).
            typical = self.step_s.get(replica)
            if typical is not None and length >= OUTLIER_STEPS * typical:
                return
            if (not self.step_awaiting.get(replica) or decode is None
                    or length <= DECODE_ONLY_FACTOR * decode):
                self._decode.observe(batch, length)
            return
        if prefill is not None and decode is not None and length > decode:
            keep = 1.0 - 1.0 / DECAY_SAMPLES
            self._rate_tokens = self._rate_tokens * keep + prefill
            self._rate_seconds = self._rate_seconds * keep + (length - decode)
            self._rate_samples += 1

    def prefill_done(self, replica: str, uncached_tokens: float, now: float,
                     dispatched_at: float) -> None:
        """A request sent at `dispatched_at` got its first token at `now` (after its chunk)."""
        last = self.last_end.get(replica)
        if last is None or now - last > SAME_STEP_S:
            return
        start = self.prev_end.get(replica)
        step = self.step_s.get(replica)
        prefill = self.step_prefill.get(replica, 0.0)
        self.step_firsts[replica] = self.step_firsts.get(replica, 0) + 1
        if prefill is not None and start is not None and step is not None and (
                dispatched_at >= start - step or self.prev_decode_only.get(replica, False)):
            # This step carried the whole prefill: the request was sent while the step before
            # ran (or after this one seemed to begin: a chunk reaches the gateway a little
            # before the engine starts its next step), or the step before was decode alone (a
            # real engine may take a few steps to admit a request it was sent).
            self.step_prefill[replica] = prefill + uncached_tokens
        else:
            self.step_prefill[replica] = None

    def idle(self, replica: str) -> None:
        """Nothing in flight there: the next chunk starts a new run of steps, not a gap."""
        self.last_end.pop(replica, None)
        self.prev_end.pop(replica, None)
        self.prev_decode_only.pop(replica, None)

    def remaining(self, replica: str, now: float) -> float:
        """Estimated seconds until the step in flight ends (0 when unknown or overdue)."""
        last = self.last_end.get(replica)
        est = self.step_s.get(replica)
        if last is None or est is None:
            return 0.0
        left = last + est - now
        return left if left > 0.0 else 0.0


class DecodeFit:
    """Decode-only step length as a line in the batch size, fitted over recent steps.

    A decode step lengthens with every sequence in the batch, and under load decode-only steps
    grow rare while batches grow: an average of past decode steps would then undercount the
    decode share of a prefill step and credit the prefill with it.
    """

    __slots__ = ("_n", "_sx", "_sxx", "_sxy", "_sy")

    def __init__(self) -> None:
        self._n = self._sx = self._sy = self._sxx = self._sxy = 0.0

    def observe(self, batch: int, seconds: float) -> None:
        keep = 1.0 - 1.0 / DECAY_SAMPLES
        self._n = self._n * keep + 1.0
        self._sx = self._sx * keep + batch
        self._sy = self._sy * keep + seconds
        self._sxx = self._sxx * keep + batch * batch
        self._sxy = self._sxy * keep + batch * seconds

    def predict(self, batch: int) -> float | None:
        n = self._n
        if n < 1.0:
            return None
        mean_x, mean_y = self._sx / n, self._sy / n
        var = self._sxx / n - mean_x * mean_x
        if var < 1.0:  # batches barely varied: no slope to trust
            return mean_y
        slope = max(0.0, (self._sxy / n - mean_x * mean_y) / var)
        return mean_y + slope * (batch - mean_x)
