"""Per-replica prefill speed from the engine's own metrics, for traffic the gateway cannot time."""

from __future__ import annotations

import statistics

ENGINE_MIN_PREFILLS = 20.0
"""Prefills (decayed) an engine must report before its rate is used: one request's prefill
time holds a step's fixed cost and the decode of the requests batched with it, and a few
dozen average that out."""
ENGINE_DECAY_PREFILLS = 400.0
"""Older scrapes' sums weigh (1 - 1/ENGINE_DECAY_PREFILLS) less per prefill reported since:
a replica throttled for a while shows it after a few hundred of its own requests."""
ENGINE_SPEED_GAP = 1.5
"""Engines whose rates, in order, lie within this factor of the next form one group, and each
takes its group's median rate: equal engines' reported rates scatter with the prompts they
happened to get, and priced as speeds that scatter would unbalance an equal pool (as with the
speeds the gateway times itself: routing/steps.py, SPEED_TOLERANCE)."""


class EngineSpeeds:
    """What each engine's metrics say of its prefill rate, relative to the median engine's.

    The gateway times engine steps from the chunks it streams (routing/steps.py), but a
    non-streaming request passed through (`server.non_streaming_ttft: false`, the default)
    streams none: with only such requests no replica is timed, and on a pool of mixed speeds
    every replica is priced as equal; with some, their prefills hide in the steps the gateway
    times, and the rates it learns are wrong. The engines count every prefill: vLLM reports,
    per request, the time from being scheduled to the first token (a histogram's sum and
    count) and the prompt tokens it computed rather than took from its prefix cache;
    TensorRT-LLM each iteration's latency and context tokens (the adapters turn either into
    the three counters `report` takes). Between two scrapes, tokens over time is the
    engine's prefill rate.

    A request's prefill time includes the other requests prefilled or decoded in the same
    steps, so the rate errs low on a busy engine. Where several prefills overlap, the time
    counted is capped at the wall time they can have covered that earlier scrapes did not
    (`_busy`), which bounds the error; below the cap equal engines at equal load err alike.
    It is the coarser signal, used only where the gateway's own timing is blind to much of
    the work (`LoadTracker.speed`).
    """

    __slots__ = ("_covered", "_last", "_sums", "enabled", "speeds")

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._last: dict[str, tuple[float, float, float, float]] = {}
        """Replica -> its last scrape: (when, computed tokens, prefill seconds, prefills)."""
        self._covered: dict[str, float] = {}
        """Replica -> when the last scrape that counted prefills (or the first scrape) was
        taken: wall time before it is counted already, or not known to be busy."""
        self._sums: dict[str, tuple[float, float, float]] = {}
        """Replica -> decayed sums since it was first scraped: (tokens, seconds, prefills)."""
        self.speeds: dict[str, float] = {}
        """Replica -> its speed, worked out again at each report (`_work_out_speeds`): the
        rate of its group (ENGINE_SPEED_GAP) over the median engine's; 1.0 where every known
        engine is in one group; absent while its rate is unknown or fewer than two are."""

    def report(self, replica: str, now: float, computed_tokens: float | None,
               prefill_seconds: float | None, prefills: float | None) -> None:
        """An engine's cumulative counters, scraped at `now` (seconds, any monotonic clock)."""
        if not self.enabled or computed_tokens is None or prefill_seconds is None or (
                prefills is None):
            return
        last = self._last.get(replica)
        self._last[replica] = (now, computed_tokens, prefill_seconds, prefills)
        if last is None:
            self._covered[replica] = now  # what came before the first scrape is not known
            return
        t0, tokens0, seconds0, count0 = last
        d_tokens, d_seconds, d_count = (computed_tokens - tokens0, prefill_seconds - seconds0,
                                        prefills - count0)
        if d_seconds < 0.0 or d_count < 0.0:
            # The histogram went backwards: the engine restarted. Its rate is learned again.
            self._sums.pop(replica, None)
            self._covered[replica] = now
            self.speeds = self._work_out_speeds()
            return
        if d_count <= 0.0 or d_seconds <= 0.0 or d_tokens < 0.0:
            # Nothing to learn; or tokens derived from two counters an engine moves at
            # different moments (prompt tokens less cache hits) that dipped between scrapes.
            return
        busy = self._busy(replica, t0, now, d_seconds, d_count)
        tokens, seconds, count = self._sums.get(replica, (0.0, 0.0, 0.0))
        keep = (1.0 - 1.0 / ENGINE_DECAY_PREFILLS) ** d_count
        self._sums[replica] = (tokens * keep + d_tokens, seconds * keep + busy,
                               count * keep + d_count)
        self.speeds = self._work_out_speeds()

    def _busy(self, replica: str, t0: float, now: float, seconds: float, count: float) -> float:
        """The seconds of prefill to count for `count` prefills that ended between the scrapes
        at `t0` and `now` and took `seconds` in all: at most the wall time they can have
        covered that an earlier scrape did not count.

        Each began at most its own length before it ended; taking the mean length for it,
        none began before `t0` less that mean, nor is time before the last scrape that counted
        prefills new. Capped at the time between scrapes alone, one prefill longer than that
        (a long prompt, or a slow engine: 7 s for 700 tokens on a CPU without bfloat16) was
        counted as that short, and its rate read tens of times too high."""
        start = max(t0 - seconds / count, self._covered.get(replica, t0))
        self._covered[replica] = now
        return min(seconds, now - start) if now > start else seconds

    def rate(self, replica: str) -> float | None:
        """The replica's computed prompt tokens per second of prefill, once known."""
        sums = self._sums.get(replica)
        if sums is None or sums[2] < ENGINE_MIN_PREFILLS or sums[1] <= 0.0:
            return None
        return sums[0] / sums[1]

    def rates(self) -> dict[str, float]:
        """Every known engine's rate."""
        return {name: r for name in self._sums if (r := self.rate(name)) is not None}

    def forget(self, replica: str) -> None:
        self._last.pop(replica, None)
        self._sums.pop(replica, None)
        self._covered.pop(replica, None)
        self.speeds = self._work_out_speeds()

    def _work_out_speeds(self) -> dict[str, float]:
        rates = sorted((r, name) for name, r in self.rates().items())
        if len(rates) < 2:
            return {}
        median = statistics.median(r for r, _ in rates)
        groups: list[list[tuple[float, str]]] = [[rates[0]]]
        for rate, name in rates[1:]:
            if rate > groups[-1][-1][0] * ENGINE_SPEED_GAP:
                groups.append([])
            groups[-1].append((rate, name))
        if len(groups) == 1:
            return dict.fromkeys((name for _, name in rates), 1.0)
        speeds: dict[str, float] = {}
        for group in groups:
            speed = statistics.median(r for r, _ in group) / median
            speeds.update((name, speed) for _, name in group)
        return speeds
