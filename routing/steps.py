"""Engine step timing from streamed chunks, and the prefill rate those steps reveal."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence

SAME_STEP_S = 0.002
"""Chunks from one replica closer than this (or than SAME_STEP_FRACTION of a typical step,
if less) share a step: one step's chunks reach the gateway within a fraction of a millisecond
of each other. The bound is absolute, not only relative, because a typical step that long
prefill steps have stretched must not swallow the short decode steps that follow."""
SAME_STEP_FRACTION = 0.3
"""Chunks closer than this fraction of a decode-only step share a step too, whatever
SAME_STEP_S says: on a machine whose cores are busy, the engine's server and the gateway may
take milliseconds to pass on one step's chunks (the first token of a request that a long step
prefilled often trails the other streams' chunks by 3-8 ms), and a decode-only step, unlike
the typical step, is not stretched by prefills."""
OUTLIER_STEPS = 3.0
"""A gap over this many typical steps (a long prefill, a pause) does not move the estimates."""
STEP_EWMA = 0.2
DECAY_SAMPLES = 200
"""The rate and decode-step fits weigh their samples by (1 - 1/DECAY_SAMPLES)^age."""
DECODE_ONLY_FACTOR = 1.5
"""A step up to this many times a decode-only step's expected length carried no prefill."""
RATE_MIN_SAMPLES = 20
"""Prefill-rate samples needed before the learned rate is used."""
SPEED_MIN_SAMPLES = 10
"""A replica's own prefill-rate samples needed before its speed departs from 1, or:"""
SPEED_ALONE_SAMPLES = 5
"""samples from steps after which nothing of this gateway's was left queued on the replica: no
chunk of another prompt can have hidden in them, so they need fewer. At light load most steps
are such, and a mixed fleet's speeds are known within its first few dozen requests (multi-turn
sessions placed on a slow replica before then stay there for their cache); under a standing
queue few are, and the noisier samples must be more (with one sample of any kind, false
speeds as low as a third of the truth cost the mixed fleet near saturation 30%)."""
IDLE_PREFILL_MIN_TOKENS = 512
"""A cold prompt of at least this many tokens, sent to a replica with nothing in flight and
alone there until its first token, times the replica's prefill whole from dispatch to first
token: a sample of its own rate worth SPEED_ALONE_SAMPLES, since no other work can hide in
it. Step samples need a step before to time against, so before this a replica's first
requests taught nothing, and at light load a mixed fleet's sessions were placed blind for
seconds, on the slow half as often as not, and stayed there for their cache. The sample also
holds one step's fixed cost and the round trip (5 ms or so): at this length that is a
fifth of the time at most on a fast replica, and a slow one pays it too."""
IDLE_PREFILL_MIN_S = 0.02
"""Nor one that took less than this: the round trip and the gateway's event loop jitter by
milliseconds on a busy host, and a single sample of a few milliseconds could make one of two
equal replicas look twice as fast as the other (replicas that answer at once, in a test on a
loaded machine, gave the shadow gateway false speeds)."""
BUSY_MIN_SAMPLES = 10
"""First tokens needed before a replica's throughput while busy (`busy_speed`) is used: each
sample also holds the decode work of the steps between, which makes it noisier."""
SPEED_TOLERANCE = 1.5
"""A replica's speed departs from 1 only when its learned rate is more than this factor off
the median replica's. Equal replicas' own rates scatter by about 15% each way (on long
prompts prefilled in chunks the gateway cannot see); priced as speeds, that scatter raised the
prefill imbalance of an equal fleet from 1.02 to 1.15 on Mooncake at 8 replicas."""


DECODE_AGREES = 1.2
"""A replica's speed departs from 1 only while its decode-only steps, too, are more than this
factor slower (or faster) than the median replica's at the same batch: a replica on a slower
accelerator, or throttled, or sharing one, is slower at both, but equal replicas' learned
prefill rates stray past SPEED_TOLERANCE at times (long prompts prefilled in chunks), and
their decode steps do not."""


Known = tuple[float, dict[str, float]]
"""The replicas' rates as last worked out: (the median replica's, every known one's)."""

RateSums = tuple[float, float, int, int, float, float, int]
"""What is known of a replica's speed, as decayed sums: of its own prefill rate (uncached
tokens, seconds, samples, of which from steps that left nothing queued), then of its
throughput while busy (`busy_speed`: uncached tokens, seconds, first tokens)."""

NO_RATE: RateSums = (0.0, 0.0, 0, 0, 0.0, 0.0, 0)

POOL_RATE_KEY = "*"
"""Where `own_rates` puts the pool's rate (its decayed uncached tokens, seconds and samples,
as the first three `RateSums`): under a name no replica can have, so that a gateway that does
not know it leaves it out as a replica it does not have."""


def sum_rates(rates: Iterable[Mapping[str, Sequence[float]]]) -> dict[str, RateSums]:
    """Several gateways' `own_rates` summed per replica (and the pool's rate under
    POOL_RATE_KEY), for `set_remote_rates` (an entry of four, an older gateway's, has no
    throughput while busy)."""
    total: dict[str, RateSums] = {}
    for replicas in rates:
        for name, entry in replicas.items():
            t, s, n, a, bt, bs, bn = (*entry, 0.0, 0.0, 0) if len(entry) == 4 else entry
            t0, s0, n0, a0, bt0, bs0, bn0 = total.get(name, NO_RATE)
            total[name] = (t0 + t, s0 + s, n0 + int(n), a0 + int(a), bt0 + bt, bs0 + bs,
                           bn0 + int(bn))
    return total


class StepTimer:
    """Per replica, when its engine steps end and how long they last; per pool, the prefill rate.

    An engine streams one chunk per running request at the end of every step, so the gaps
    between a replica's chunks time its steps, and the last chunk says when the step in flight
    began. A request sent there now waits for that step to end before the engine even looks at
    it; `LoadTracker.view` prices that wait in prompt tokens at the engines' prefill rate.
    Step times are per replica; the rate and the decode-step fit are pool-wide, since a pool's
    replicas run one model. Each replica also learns its own rate, from its own steps less its
    own decode-only steps and from a lone cold prompt sent to it while idle, timed whole
    (IDLE_PREFILL_MIN_TOKENS), so that `speed` can tell a replica on a slower accelerator (or
    a throttled or shared one) from the rest of its pool.

    The rate is configured, or learned: a step that ends with the first token of requests
    dispatched no earlier than during the step before, or that follows a decode-only step,
    carried their whole prefill, so its length minus a decode-only step's is what those
    uncached tokens cost. Other work hidden in the same step (a chunk of a long prompt) only
    makes the learned rate lower, which is the safe side: a rate too high lets the phase of a
    step outweigh cache hits and queues.
    """

    __slots__ = ("_agree_factor", "_busy", "_busy_reference", "_decode", "_decode_reference",
                 "_decode_sides", "_fixed_rate", "_rate_samples", "_rate_seconds", "_rate_tokens",
                 "_reference", "_remote_pool", "_remote_rates", "_replicas", "_unknown_speed")

    def __init__(self, prefill_tokens_per_s: float | None = None,
                 decode_agrees: float = DECODE_AGREES) -> None:
        self._fixed_rate = prefill_tokens_per_s
        self._agree_factor = decode_agrees
        self._replicas: dict[str, _Steps] = {}
        self._remote_rates: dict[str, RateSums] = {}
        self._rate_tokens = 0.0
        self._rate_seconds = 0.0
        self._rate_samples = 0
        # What other gateways learned of the pool's rate: (tokens, seconds, samples), summed.
        self._remote_pool: tuple[float, float, int] | None = None
        self._decode = DecodeFit()
        self._reference: Known | None = None  # of the replicas' own rates, when fresh
        self._unknown_speed: float | None = None  # what an unknown replica's speed is, when fresh
        self._busy: dict[str, _Busy] = {}
        self._busy_reference: Known | None = None  # of the busy rates, when fresh
        # Each replica's decode-only step at the pool's mean batch, when fresh
        self._decode_reference: dict[str, float] | None = None
        # (those lines, the rates they were sided by, {slower: the other side's median})
        self._decode_sides: tuple[dict[str, float], Known, dict[bool, float]] | None = None

    @property
    def rate(self) -> float:
        """Prefill tokens per second used to price waits (0 until known)."""
        if self._fixed_rate is not None:
            return self._fixed_rate
        tokens, seconds, samples = self._rate_tokens, self._rate_seconds, self._rate_samples
        remote = self._remote_pool
        if remote is not None:
            tokens, seconds, samples = tokens + remote[0], seconds + remote[1], samples + remote[2]
        if samples < RATE_MIN_SAMPLES or seconds <= 0.0:
            return 0.0
        return tokens / seconds

    def replica_rate(self, replica: str) -> float | None:
        """The replica's own learned prefill rate, from this gateway's samples and those other
        gateways shared (`set_remote_rates`): None until they are SPEED_MIN_SAMPLES, or
        SPEED_ALONE_SAMPLES from steps that left it nothing queued."""
        r = self._replicas.get(replica)
        remote = self._remote_rates.get(replica) if self._remote_rates else None
        if remote is None:  # one gateway: every view of every decision comes here, twice
            if r is None:
                return None
            tokens, seconds = r.rate_tokens, r.rate_seconds
            samples, alone = r.rate_samples, r.alone_samples
        elif r is None:
            tokens, seconds, samples, alone = remote[:4]
        else:
            tokens, seconds = r.rate_tokens + remote[0], r.rate_seconds + remote[1]
            samples, alone = r.rate_samples + remote[2], r.alone_samples + remote[3]
        if seconds <= 0.0 or (samples < SPEED_MIN_SAMPLES and alone < SPEED_ALONE_SAMPLES):
            return None
        return tokens / seconds

    def replica_rates(self) -> dict[str, float]:
        """Every replica's own learned prefill rate, where known."""
        names = self._replicas.keys() | self._remote_rates.keys() if self._remote_rates else (
            self._replicas)
        return {name: rate for name in names if (rate := self.replica_rate(name)) is not None}

    def own_rates(self) -> dict[str, list[float]]:
        """What this gateway learned of each replica's speed, as it shares it: {replica: its
        decayed sums (`RateSums`)}, for the replicas with samples of either kind."""
        out: dict[str, list[float]] = {}
        for name in self._replicas.keys() | self._busy.keys():
            r, b = self._replicas.get(name), self._busy.get(name)
            if (r is None or not r.rate_samples) and (b is None or not b.samples):
                continue
            rate = ([round(r.rate_tokens, 1), round(r.rate_seconds, 6), r.rate_samples,
                     r.alone_samples] if r is not None else [0.0, 0.0, 0, 0])
            busy = ([round(b.tokens, 1), round(b.seconds, 6), b.samples] if b is not None
                    else [0.0, 0.0, 0])
            out[name] = rate + busy
        if self._rate_samples and self._fixed_rate is None:
            out[POOL_RATE_KEY] = [round(self._rate_tokens, 1), round(self._rate_seconds, 6),
                                  self._rate_samples, 0, 0.0, 0.0, 0]
        return out

    def set_remote_rates(self, rates: Mapping[str, RateSums]) -> None:
        """Replace what other gateways learned of each replica's speed, and of the pool's
        rate (their `own_rates`, summed): it counts with this gateway's samples. Gateways
        sharing a fleet each see a share of its steps, and each alone would take that much
        longer to tell a slow replica from a fast one, or to learn the rate at all."""
        pool = rates.get(POOL_RATE_KEY)
        # The pool's rate counts the same way: a gateway learns it only from steps that end
        # a prefill of its own and none of another gateway's, a share of them.
        self._remote_pool = (pool[0], pool[1], int(pool[2])) if pool and pool[1] > 0.0 else None
        self._remote_rates = {name: sums for name, sums in rates.items()
                              if name != POOL_RATE_KEY and (sums[1] > 0.0 or sums[5] > 0.0)}
        self._reference = self._unknown_speed = self._busy_reference = None

    def speed(self, replica: str) -> float:
        """The replica's own learned prefill rate over the median replica's, or 1.0: within
        SPEED_TOLERANCE of the median, and always with a configured rate. A policy divides
        the prefill queued there by it.

        Until its own rate is known, a replica of a pool whose known speeds already differ (a
        mixed fleet) gets the fastest of them, if above 1: priced at 1, a fast replica that
        has not served yet may lose every request to replicas that hold the prefixes, and never
        show its speed, while a slow one priced as fast serves a few requests and is known."""
        if self._fixed_rate is not None:
            return 1.0
        own = self.replica_rate(replica)
        if own is None:
            if self._unknown_speed is None:
                self._unknown_speed = max([1.0, *map(self.speed, self.replica_rates())])
            return self._unknown_speed
        known = self._reference
        if known is None:
            rates = self.replica_rates()
            known = self._reference = (statistics.median(rates.values()), rates)
        speed = own / known[0]
        if 1 / SPEED_TOLERANCE < speed < SPEED_TOLERANCE or not self._decode_agrees(
                replica, speed, known):
            return 1.0
        return speed

    def _decode_agrees(self, replica: str, speed: float, known: Known) -> bool:
        """Whether the replica's decode-only steps are `decode_agrees` (DECODE_AGREES) times
        slower (`speed` below 1) than the median of those of the replicas whose rates are at
        or above the median rate (`known`: the median, then every replica's rate), or faster
        (above 1) than those at or below it, at the pool's mean batch. True while they
        cannot tell: the replica's own decode steps not yet known (under a standing queue
        from the start a replica may show none for minutes), or none of the other side's;
        and always with `decode_agrees` at 1 or below.

        Against the other side, not every replica: a gateway that has seen the decode steps
        of two fast replicas and one slow one of two (three gateways on a mixed fleet each
        see a share of the steps) took a fast one for the median, and its fast replicas for
        no faster than it. A replica whose own decode steps all ran at about one batch has no
        slope of its own; its line takes the pool's. Drawn flat instead, a slow replica that
        the pool had rightly kept nearly idle (steps of one or two sequences) looked as fast
        at the busy replicas' batch of 70 as they were: its speed went back to 1 as the load
        rose, and the mixed fleet under swinging load queued on its slow half (its first
        heavy spell 1.2 s to 4.0 s of mean TTFT)."""
        agrees = self._agree_factor
        if agrees <= 1.0:
            return True
        lines = self._decode_reference
        if lines is None:
            batch = round(self._decode.mean_batch() or 1.0)
            slope = self._decode.slope()
            lines = self._decode_reference = {
                name: d for name, s in self._replicas.items()
                if (d := s.decode.predict(batch, slope)) is not None and d > 0.0}
        own = lines.get(replica)
        if own is None:
            return True
        slower = speed < 1.0
        sides = self._decode_sides
        if sides is None or sides[0] is not lines or sides[1] is not known:
            sides = self._decode_sides = (lines, known, {})
        side = sides[2].get(slower)
        if side is None:
            reference, rates = known
            other = [d for name, d in lines.items() if (rate := rates.get(name)) is not None
                     and (rate >= reference if slower else rate <= reference)]
            side = sides[2][slower] = statistics.median(other) if other else 0.0
        if side <= 0.0:
            return True
        ratio = own / side
        return ratio >= agrees if slower else ratio <= 1 / agrees

    def busy_speed(self, replica: str) -> float | None:
        """The replica's prefill throughput while busy over the median replica's, or None
        while its own rate is learned (`speed` holds) or it has fewer than BUSY_MIN_SAMPLES
        first tokens; 1.0 within SPEED_TOLERANCE of the median, and always with a configured
        rate.

        A replica's own rate is learned only from steps that carried a whole prefill sent
        just before them, which a standing queue never produces: under load a replica can go
        minutes without one. Its throughput needs no such step: each first token there
        completed its uncached tokens in the time since it was sent or since the replica's
        previous first token, whichever is later. That time also holds the decode work of
        the steps between, so it understates the rate, on every replica alike."""
        if self._fixed_rate is not None:
            return 1.0
        if self.replica_rate(replica) is not None:
            return None
        own = self._busy_rate(replica)
        if own is None:
            return None
        known = self._busy_reference
        if known is None:
            names = (self._busy.keys() | self._remote_rates.keys() if self._remote_rates
                     else self._busy.keys())
            rates = {name: rate for name in names if (rate := self._busy_rate(name)) is not None}
            known = self._busy_reference = (statistics.median(rates.values()), rates)
        speed = own / known[0]
        if 1 / SPEED_TOLERANCE < speed < SPEED_TOLERANCE or not self._decode_agrees(
                replica, speed, known):
            return 1.0
        return speed

    def _busy_rate(self, replica: str) -> float | None:
        """The replica's throughput while busy, from this gateway's first tokens and the
        other gateways' (None under BUSY_MIN_SAMPLES). Each gateway times its own first
        tokens, from the one before it there: the others' prefills in between understate
        every replica's throughput alike, by about the number of gateways."""
        b = self._busy.get(replica)
        tokens, seconds, samples = (b.tokens, b.seconds, b.samples) if b is not None else (
            0.0, 0.0, 0)
        remote = self._remote_rates.get(replica)
        if remote is not None:
            tokens += remote[4]
            seconds += remote[5]
            samples += remote[6]
        if samples < BUSY_MIN_SAMPLES or seconds <= 0.0:
            return None
        return tokens / seconds

    @property
    def learning(self) -> bool:
        """Whether the rate is learned (none was configured)."""
        return self._fixed_rate is None

    def step_s(self, replica: str) -> float | None:
        """The replica's typical step length, a moving average (None until timed)."""
        r = self._replicas.get(replica)
        return r.step_s if r is not None else None

    def last_end(self, replica: str) -> float | None:
        """When the replica's last timed step ended (None if none is in progress)."""
        r = self._replicas.get(replica)
        return r.last_end if r is not None else None

    def step_times(self) -> dict[str, float]:
        """Every timed replica's typical step length."""
        return {name: r.step_s for name, r in self._replicas.items() if r.step_s is not None}

    def decode_s(self, batch: int) -> float | None:
        """Expected length of a decode-only step over `batch` sequences (None until seen)."""
        return self._decode.predict(batch)

    def chunk(self, replica: str, now: float, inflight: int = 1,
              awaiting_prefill: bool = False, others_first_tokens: int = 0,
              hidden: bool = False) -> None:
        """The replica, with `inflight` requests there (some of this gateway's
        `awaiting_prefill`: sent, no first token yet), streamed a chunk at `now`.
        `others_first_tokens`: how many first tokens other gateways sharing this one's state
        have seen there so far, as they last said (`LoadTracker.own_load`). `hidden`: a
        request there whose first token this gateway will not see (passed through whole) is
        presumably still to be prefilled: the step beginning now may compute some of it."""
        r = self._replicas.get(replica)
        if r is None:
            r = self._replicas[replica] = _Steps()
        last, est = r.last_end, r.step_s
        if last is not None:
            gap = now - last
            # Another chunk of the step that ended at `last`? (`_same_step_s`, cheap bound
            # first: this runs for every chunk the gateway relays.)
            if gap < _typical_same_step_s(r) or gap < self._decode_same_step_s(r):
                return
            # Other gateways' first tokens at the end of that step reach this one a few
            # milliseconds later (as they share their load), well before the end of this
            # step: a count that moved since that step ended says one of their prefills ended
            # in it.
            r.others_ended = others_first_tokens != r.others_seen
            self._close_step(r, last)
            if est is None:
                r.step_s = gap
            elif gap < OUTLIER_STEPS * est:
                r.step_s = est + STEP_EWMA * (gap - est)
        r.prev_start = r.prev_end
        r.prev_end = last
        r.last_end = now
        r.prefill = 0.0
        r.firsts = 0
        r.others_seen = others_first_tokens
        r.batch = inflight
        r.awaiting = awaiting_prefill
        r.hidden = hidden

    def _same_step_s(self, r: _Steps) -> float:
        """How far apart two of the replica's chunks may arrive and still end one step."""
        return max(_typical_same_step_s(r), self._decode_same_step_s(r))

    def _decode_same_step_s(self, r: _Steps) -> float:
        """A fraction of a decode-only step at the replica's batch (0 until one is known)."""
        decode = self._decode.predict(r.batch)
        return 0.0 if decode is None else SAME_STEP_FRACTION * decode

    def _close_step(self, r: _Steps, end: float) -> None:
        """The step that ended at `end` is complete: learn from its length."""
        start = r.prev_end
        if start is None:
            return
        length = end - start
        firsts = r.firsts
        # Requests whose prefill ended in this step were not decoding during it.
        batch = max(0, r.batch - firsts)
        decode = self._decode.predict(batch)
        # A step no longer than decode alone takes carried no prefill chunk: a prefill that
        # ends in the next step must have run in that step alone.
        r.prev_decode_only = (not firsts and not r.others_ended and not r.hidden
                              and decode is not None and length <= DECODE_ONLY_FACTOR * decode)
        if r.hidden:
            # It may have computed a prefill this gateway cannot see. Taken for decode steps
            # when no first token showed, such steps raised the decode line to 1.1 s at a
            # batch of 55 where the engines take 0.13 s (the slow fleet near saturation, half
            # the requests passed through), and the prefill rate measured against it to 17x
            # the truth: the wait for a step in flight was priced past 100k tokens.
            return
        if r.others_ended:
            # It ended another gateway's prefill, whose tokens and dispatch this one does not
            # know: not a decode step, and no measure of a prefill. Taken for decode steps,
            # such steps raised three gateways' decode line to 1.3 s at a batch of 100 where
            # the engines take 0.215 s (tenants at 8 replicas near saturation), and every
            # prefill measured against it came out several times too fast.
            return
        if not firsts:
            # A step that ends no prefill is decode alone if no prefill was waiting when it
            # began, or if it is as short as decode alone: a chunk of a long prompt makes a
            # step look like a slow decode step. Until decode steps are known, any step that
            # is not an outlier teaches them (under steady load a prefill is always waiting).
            if r.step_s is not None and length >= OUTLIER_STEPS * r.step_s:
                return
            if not r.awaiting or decode is None or length <= DECODE_ONLY_FACTOR * decode:
                self._decode.observe(batch, length)
            # The replica's own fit, judged by itself: on a pool of mixed speeds a slow
            # replica's decode steps are all longer than the pool's line.
            own = r.decode.predict(batch)
            if not r.awaiting or own is None or length <= DECODE_ONLY_FACTOR * own:
                r.decode.observe(batch, length)
                self._decode_reference = self._unknown_speed = None
            return
        if r.prefill is None:
            return
        if decode is not None and length > decode:
            keep = 1.0 - 1.0 / DECAY_SAMPLES
            self._rate_tokens = self._rate_tokens * keep + r.prefill
            self._rate_seconds = self._rate_seconds * keep + (length - decode)
            self._rate_samples += 1
        own = r.decode.predict(batch)
        if own is not None and length > own:
            self._own_sample(r, r.prefill, length - own, 1 if r.left_alone else 0)

    def dispatched(self, replica: str, idle: bool) -> None:
        """A request was sent to the replica; `idle`: nothing was in flight there, this
        gateway's or another's (see IDLE_PREFILL_MIN_TOKENS)."""
        r = self._replicas.get(replica)
        if r is None:
            r = self._replicas[replica] = _Steps()
        r.idle_sent = idle

    def prefill_done(self, replica: str, uncached_tokens: float, now: float,
                     dispatched_at: float, alone: bool = False, cold: bool = False) -> None:
        """A request sent at `dispatched_at` got its first token at `now` (after its chunk).
        `alone`: after it, nothing this gateway sent there awaits its first token. A step
        that also ended another gateway's prefill teaches nothing (see `chunk`). `cold`: the
        router believed the replica held none of its prompt (IDLE_PREFILL_MIN_TOKENS)."""
        self._busy_done(replica, uncached_tokens, now, dispatched_at)
        r = self._replicas.get(replica)
        if r is None or r.last_end is None or now - r.last_end > max(SAME_STEP_S,
                                                                      self._same_step_s(r)):
            return
        if r.idle_sent:
            r.idle_sent = False
            # The last request sent there found it idle, and it is the only one there now
            # (`batch`, as the chunks of this first token's step found it): this request. Its
            # step began the run (no step ended there since it was sent).
            if (cold and r.batch == 1 and r.prev_end is None
                    and r.last_end - dispatched_at >= IDLE_PREFILL_MIN_S
                    and uncached_tokens >= IDLE_PREFILL_MIN_TOKENS):
                self._own_sample(r, uncached_tokens, r.last_end - dispatched_at,
                                 SPEED_ALONE_SAMPLES)
        r.firsts += 1
        r.left_alone = alone
        if r.prefill is not None and (dispatched_at >= _step_before_began(r)
                                      or r.prev_decode_only):
            # This step carried the whole prefill: the request was sent while the step before
            # ran (or after this one seemed to begin: a chunk reaches the gateway a little
            # before the engine starts its next step), or the step before was decode alone (a
            # real engine may take a few steps to admit a request it was sent).
            r.prefill += uncached_tokens
        else:
            r.prefill = None

    def _own_sample(self, r: _Steps, uncached_tokens: float, seconds: float,
                    alone: int) -> None:
        """The replica computed `uncached_tokens` in `seconds`: a sample of its own rate,
        worth `alone` samples from steps that left nothing queued (SPEED_ALONE_SAMPLES)."""
        keep = 1.0 - 1.0 / DECAY_SAMPLES
        r.rate_tokens = r.rate_tokens * keep + uncached_tokens
        r.rate_seconds = r.rate_seconds * keep + seconds
        r.rate_samples += 1
        r.alone_samples += alone
        self._reference = self._unknown_speed = None

    def _busy_done(self, replica: str, uncached_tokens: float, now: float,
                   dispatched_at: float) -> None:
        """Throughput while busy (`busy_speed`): the request's prefill took the time since it
        was sent or since the replica's previous first token, whichever is later."""
        b = self._busy.get(replica)
        if b is None:
            b = self._busy[replica] = _Busy()
        start = dispatched_at if b.last is None or b.last < dispatched_at else b.last
        b.last = now
        if now > start:
            keep = 1.0 - 1.0 / DECAY_SAMPLES
            b.tokens = b.tokens * keep + uncached_tokens
            b.seconds = b.seconds * keep + (now - start)
            b.samples += 1
            self._busy_reference = None

    def idle(self, replica: str) -> None:
        """Nothing in flight there: the next chunk starts a new run of steps, not a gap."""
        r = self._replicas.get(replica)
        if r is not None:
            r.last_end = r.prev_end = r.prev_start = None
            r.prev_decode_only = False

    def forget(self, replica: str) -> None:
        """The replica left the pool: its step timing goes."""
        self._replicas.pop(replica, None)
        self._remote_rates.pop(replica, None)
        self._busy.pop(replica, None)
        self._reference = self._busy_reference = self._decode_reference = None
        self._unknown_speed = None

    def remaining(self, replica: str, now: float, decode_only: bool = False) -> float:
        """Estimated seconds until the step in flight ends (0 when unknown or overdue).

        With `decode_only` (no prefill sent there awaits its first token), the step in
        flight decodes only: its length is the replica's decode-only line at the batch it
        runs, not its typical step, which averages in the longer steps that carried prefill
        (on control at 8 replicas the typical step overstated a decode step's rest by 35 ms
        on average, the line by 1 ms)."""
        r = self._replicas.get(replica)
        if r is None or r.last_end is None or r.step_s is None:
            return 0.0
        length = r.step_s
        if decode_only:
            decode = r.decode.predict(r.batch)
            if decode is None:
                decode = self._decode.predict(r.batch)
            if decode is not None:
                length = decode
        left = r.last_end + length - now
        return left if left > 0.0 else 0.0


def _step_before_began(r: _Steps) -> float:
    """When the step before the last one began: its real start when both its ends were seen
    (a long prefill step before stretches the window, as it should: a request sent during it
    waited for it to end), else one typical step before the last one began (inf if unknown)."""
    if r.prev_start is not None:
        return r.prev_start
    if r.prev_end is None or r.step_s is None:
        return float("inf")
    return r.prev_end - r.step_s


def _typical_same_step_s(r: _Steps) -> float:
    """A fraction of the replica's typical step, at most SAME_STEP_S."""
    est = r.step_s
    return SAME_STEP_S if est is None else min(SAME_STEP_S, SAME_STEP_FRACTION * est)


class _Steps:
    """One replica's step timing: the last two step ends and what the last step carried."""

    __slots__ = ("alone_samples", "awaiting", "batch", "decode", "firsts", "hidden", "idle_sent",
                 "last_end", "left_alone", "others_ended", "others_seen", "prefill",
                 "prev_decode_only", "prev_end", "prev_start", "rate_samples", "rate_seconds",
                 "rate_tokens", "step_s")

    def __init__(self) -> None:
        self.last_end: float | None = None  # when the last step ended (its first chunk)
        self.prev_end: float | None = None  # when the one before it ended
        self.prev_start: float | None = None  # when the one before that ended
        self.step_s: float | None = None  # typical step length, a moving average
        self.batch = 0  # requests in flight when the last step ended
        self.awaiting = False  # a prefill was waiting when the step in flight began
        self.hidden = False  # one this gateway cannot see was, presumably (`chunk`)
        self.firsts = 0  # first tokens at the end of the last step
        self.left_alone = False  # the last of them left nothing of this gateway's queued
        # Other gateways' first tokens there as they said when the step in flight began, and
        # whether that count moved during the last step (one of their prefills ended in it).
        self.others_seen = 0
        self.others_ended = False
        # Uncached tokens whose prefill ended in the last step; None when the step also
        # finished a prefill that cannot be attributed to it alone.
        self.prefill: float | None = 0.0
        self.prev_decode_only = False  # the step before the last: decode alone?
        # Its own prefill rate and decode-only fit, decayed as the pool's are.
        self.rate_tokens = 0.0
        self.rate_seconds = 0.0
        self.rate_samples = 0
        self.alone_samples = 0  # of which from steps that left nothing queued (`left_alone`)
        self.idle_sent = False  # the last request sent there found nothing in flight
        self.decode = DecodeFit()


class _Busy:
    """One replica's prefill throughput while busy, decayed as the rate fits are."""

    __slots__ = ("last", "samples", "seconds", "tokens")

    def __init__(self) -> None:
        self.tokens = 0.0  # uncached tokens of its first tokens
        self.seconds = 0.0  # the time each of them took (see `StepTimer._busy_done`)
        self.samples = 0
        self.last: float | None = None  # when its last first token came


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

    def mean_batch(self) -> float | None:
        """The mean batch of the steps fitted, decayed as they are (None before any)."""
        return self._sx / self._n if self._n >= 1.0 else None

    def _line(self) -> tuple[float, float, float | None] | None:
        """(mean batch, mean step, seconds per sequence or None where the batches fitted
        barely varied: no slope to trust), None before any step."""
        n = self._n
        if n < 1.0:
            return None
        mean_x, mean_y = self._sx / n, self._sy / n
        var = self._sxx / n - mean_x * mean_x
        if var < 1.0:
            return mean_x, mean_y, None
        return mean_x, mean_y, max(0.0, (self._sxy / n - mean_x * mean_y) / var)

    def slope(self) -> float | None:
        """Seconds per sequence of the fitted line (None before its batches have varied)."""
        line = self._line()
        return None if line is None else line[2]

    def predict(self, batch: int, flat_slope: float | None = None) -> float | None:
        """The step's length at `batch`; where the batches fitted barely varied, the line
        has `flat_slope` (none: flat)."""
        line = self._line()
        if line is None:
            return None
        mean_x, mean_y, slope = line
        if slope is None:
            slope = flat_slope or 0.0
        return mean_y + slope * (batch - mean_x)
