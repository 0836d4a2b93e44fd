"""A lower bound on mean TTFT that no router beats in the replica model, co-batching counted.

The TTFT floor runs every request alone on an idle engine. This
bound adds what the floor leaves out: a request whose first-token step also decodes other
sequences pays at least `decode_s(1)` more, and there are too few steps without decoding
sequences for every request to land in one. The argument, for `backends.sim.engine.EngineModel`:

1. A request's TTFT is at least its floor (the ideal hit, alone) plus every other cost in its
   prefill steps: `decode_s(n)` for n >= 1 decoding sequences, other requests' prefill chunks.
   Call a request an *escaper* if its TTFT is below floor + `decode_s(1)`. An escaper's last
   prefill step decodes nothing: it is a *quiet* step.
2. Call a request *heavy* if its uncached prefill (at the ideal hit) costs at least
   `decode_s(1)` or needs more than one step's token budget. A step carries at most one request
   prefilled in an earlier step (the engine splits at most one request per step, and finishes
   carried requests first); every other request finishing in it was prefilled whole in it. So
   two heavy escapers cannot share a quiet step: one of them would pay the other's whole
   uncached prefill, at least `decode_s(1)`.
3. After an escaper's first token at time f, it decodes for o - 1 more steps (o its output
   tokens), each at least `step_overhead_s + decode_s(1)` long, so its replica has no quiet step
   during [f, f + D) with D = (o - 1) * (step_overhead_s + decode_s(1)). And f lies in
   [lo, lo + decode_s(1)) with lo = arrival + floor. So every heavy escaper owns the interval
   [lo + decode_s(1), lo + D) on its replica, and those intervals cannot overlap on a replica.
4. The most such intervals that fit on R replicas is an interval-scheduling count (earliest end
   first, each onto the replica whose last interval ends latest without overlapping; optimal).
   Every heavy request past that count, with o >= 2, pays at least `decode_s(1)`.

Light requests and one-token outputs are counted as escapers for free, so the bound stays a
bound; it ignores queueing and where prefixes are cached, so it is loose under load.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import NamedTuple

from backends.sim.profiles import LatencyProfile


class TtftBounds(NamedTuple):
    """Two lower bounds on mean TTFT, in the replica model's seconds."""

    floor: float  # every request alone on an idle engine, with the ideal hit
    cobatch: float  # the floor plus `decode_s(1)` per start that must share a decoding step


def ttft_bounds(
    profile: LatencyProfile,
    replicas: int,
    arrivals: Sequence[float],
    prompt_tokens: Sequence[int],
    ideal_cached_tokens: Sequence[int],
    output_tokens: Sequence[int],
) -> TtftBounds:
    """The floor and the co-batching bound of these requests on `replicas` engines.

    `output_tokens` are the tokens each request will generate (after any max_tokens cap).
    """
    n = len(arrivals)
    if n == 0:
        return TtftBounds(0.0, 0.0)
    d1 = profile.decode_s(1)
    decode_step = profile.step_overhead_s + d1
    floor_total = 0.0
    owned: list[tuple[float, float]] = []  # (end, start) of each heavy escaper's interval
    for arrival, prompt, cached, out in zip(
        arrivals, prompt_tokens, ideal_cached_tokens, output_tokens, strict=True
    ):
        floor = profile.ttft_s(prompt, cached)
        floor_total += floor
        uncached = prompt - cached
        heavy = (uncached > profile.max_batched_tokens
                 or profile.prefill_chunk_s(uncached, cached) >= d1)
        busy = (out - 1) * decode_step
        if heavy and busy > d1:
            lo = arrival + floor
            owned.append((lo + busy, lo + d1))
    owned.sort()
    last_ends: list[float] = []  # per replica in use, the end of its last interval, sorted
    escapers = 0
    for end, start in owned:
        k = bisect.bisect_right(last_ends, start)
        if k:
            last_ends.pop(k - 1)
        elif len(last_ends) >= replicas:
            continue
        bisect.insort(last_ends, end)
        escapers += 1
    return TtftBounds(floor_total / n, (floor_total + d1 * (len(owned) - escapers)) / n)
