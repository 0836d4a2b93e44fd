"""Load the router itself has caused: requests in flight, prefill not yet done, step timing."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence

from routing.engine_speed import EngineSpeeds
from routing.steps import DECODE_AGREES, StepTimer
from routing.types import ReplicaView

RemoteLoad = tuple[int, float, float, int, float, int, int]
"""Other gateways' load on a replica: (requests in flight, pending prefill tokens, of which
presumably not yet computed, first tokens seen there so far, when the oldest request still
awaiting its first token was sent: inf if none or not said, requests passed through whole
whose prefill is presumably not done, requests streamed still awaiting a first token)."""

NO_LOAD: RemoteLoad = (0, 0.0, 0.0, 0, math.inf, 0, 0)
"""No other gateway's load on a replica."""

ENDS_DECAY = 200.0
"""Requests ended weigh (1 - 1/ENDS_DECAY) less per request ended since (`LoadTracker.speed`)."""
UNSEEN_SHARE = 0.1
"""While at least this share of requests end with no first token seen, speeds are the
engines' where they report them (`LoadTracker.speed`)."""
ENGINE_READ_SLACK_S = 0.1
"""A request sent this long before the step an engine's counts are of ended is in its count
of requests awaiting a first token (`LoadTracker.engine_prefills_waiting`): time for the
request to cross to the engine and be parsed and queued there."""
HEAD_CREDIT_MAX = 0.9
"""At most this share of the oldest pending request's prefill is presumed done before its
first token arrives."""


class LoadTracker:
    """Counts, per replica, requests in flight and their estimated uncached prefill tokens.

    The gateway knows the moment it dispatches a request and the moment the first token comes
    back, so it can tell how much prefill work it has queued on each replica long before the
    engine's own metrics (scraped every few seconds) show it. Its `steps` time each replica's
    engine steps from the chunks it streams (routing/steps.py).
    """

    __slots__ = ("_blind", "_blind_inflight", "_decoding", "_drain", "_ends", "_engine_firsts",
                 "_first_tokens", "_order", "_presumed", "_share_left", "_unseen",
                 "decode_step_wait", "engines", "inflight", "pending_prefill", "remote", "steps")

    def __init__(self, prefill_tokens_per_s: float | None = None,
                 speed_decode_agrees: float = DECODE_AGREES,
                 decode_step_wait: bool = True, engine_speed: bool = True) -> None:
        self.inflight: dict[str, int] = {}
        self.pending_prefill: dict[str, float] = {}
        self.steps = StepTimer(prefill_tokens_per_s, speed_decode_agrees)
        self.engines = EngineSpeeds(engine_speed and prefill_tokens_per_s is None)
        """What the engines' own metrics say of their prefill rates: the replicas' speeds
        where the gateway's own timing is blind to much of the work (`speed`)."""
        self._ends = 0.0
        self._unseen = 0.0
        """Requests ended, and of those, ended without a first token seen (passed through
        whole, or failed before it); both decayed by (1 - 1/ENDS_DECAY) per request."""
        self.decode_step_wait = decode_step_wait
        """Whether a step in flight where no prefill is pending is timed as decode alone
        (`StepTimer.remaining`)."""
        self._drain: dict[str, float] = {}
        """Replica -> tokens of its oldest pending prefill that its engine has presumably
        computed: see `prefill_left`."""
        self._order: dict[str, deque[tuple[float, float]]] = {}
        """Replica -> (uncached tokens, when sent: `dispatched`) of its requests awaiting a
        first token, oldest first."""
        self._blind: dict[str, deque[tuple[float, float, float]]] = {}
        """Replica -> (when its prefill presumably ends, inf: not before the engine's count
        or its answer says so; uncached tokens; when sent, on the clock of `dispatched`'s
        `sent_at`) of its requests whose first token this gateway will not see (`dispatched`
        with `blind_at`), oldest first, while presumably queued: see `_expect_blind`."""
        self._blind_inflight: dict[str, int] = {}
        """Replica -> its requests in flight that show this gateway nothing until they end."""
        self._decoding: dict[str, int] = {}
        """Replica -> its requests past a first token this gateway saw, not yet ended: while
        there are some, every engine step there streams a chunk."""
        self._engine_firsts: dict[str, tuple[float, int]] = {}
        """Replica -> (first tokens its engine had reported, first tokens gateways had seen
        there) at its last scrape: see `engine_first_tokens`."""
        self._presumed: dict[str, dict[float, int]] = {}
        """Replica -> uncached tokens -> how many of its unseen requests of that size were
        presumed prefilled and have not finished yet."""
        self._share_left: dict[str, float] = {}
        """Replica -> the fraction of a request left over from this gateway's last share of
        its engine's count of first tokens: see `engine_first_tokens`."""
        self._first_tokens: dict[str, int] = {}
        """Replica -> first tokens seen there so far, told to other gateways (`own_load`)."""
        self.remote: dict[str, RemoteLoad] = {}
        """Replica -> the load other gateways sharing this one's routing state report having
        put there (`RemoteLoad`); added to this gateway's own counts in `view`, never to
        `inflight` or `pending_prefill` (what this gateway must finish)."""

    def own_load(self) -> dict[str, list[float | None]]:
        """What this gateway has in flight, as it tells others: {replica: [requests, pending
        prefill tokens, of those presumably not yet computed (`prefill_left`), first tokens
        seen there so far, when the oldest request awaiting its first token was sent (None:
        none, or not said), requests passed through whole whose prefill is presumably not
        done (`engine_first_tokens`), requests streamed still awaiting a first token
        (`engine_prefills_waiting`)]} for the replicas with requests; the last two left out
        while both are none, the last while it is.

        Others must see the same drained figure this gateway routes on: counted whole, its
        long prompts would make a replica look busier to every other gateway than to it, and
        they would spill away from it more than one gateway would. The first tokens tell them
        which engine steps ended one of this gateway's prefills (`StepTimer.chunk`); the
        oldest request, whose prefill the engine computes first (`_credit`)."""
        pending = self.pending_prefill
        out: dict[str, list[float | None]] = {}
        for r, n in self.inflight.items():
            if n > 0:
                p = pending.get(r, 0.0)
                # What is presumed computed, in steps of 16 tokens: it grows every engine step,
                # and each change of the figure is a write to the other gateways.
                done = (p - self.prefill_left(r)) // 16.0 * 16.0 if p > 0.0 else 0.0
                order = self._order.get(r)
                oldest = order[0][1] if order and p > 0.0 else -math.inf
                entry: list[float | None] = [
                    n, round(p, 1), round(p - done, 1), self._first_tokens.get(r, 0),
                    round(oldest, 3) if oldest > -math.inf else None]
                unseen = len(self._blind.get(r, ()))
                streamed = len(order) - unseen if order else 0
                if streamed:
                    entry += (unseen, streamed)
                elif unseen:  # most often none: the figure is left out, as older gateways do
                    entry.append(unseen)
                out[r] = entry
        return out

    def set_remote(self, loads: Mapping[str, RemoteLoad]) -> None:
        """Replace the other gateways' load with `loads` (`sum_loads`; replicas absent:
        none)."""
        self.remote = {r: (max(0, int(n)), max(0.0, float(p)), max(0.0, float(left)),
                           int(firsts), float(oldest), max(0, int(rest[0])) if rest else 0,
                           max(0, int(rest[1])) if len(rest) > 1 else 0)
                       for r, (n, p, left, firsts, oldest, *rest) in loads.items()
                       if n > 0 or p > 0}

    def dispatched(self, replica: str, uncached_tokens: float,
                   sent_at: float | None = None, blind_at: float | None = None) -> None:
        """A request with `uncached_tokens` to prefill was sent to `replica` at `sent_at`,
        on a clock every gateway sharing this one's state reads alike (wall-clock seconds in
        the gateway); None: unknown, as if before any other gateway's. `blind_at`: the
        request will show this gateway no first token (passed through whole), and was sent
        at this time on the clock of `view`: see `_expect_blind`."""
        if blind_at is not None:
            self._expect_blind(replica, uncached_tokens, blind_at,
                               -math.inf if sent_at is None else sent_at)
            self._blind_inflight[replica] = self._blind_inflight.get(replica, 0) + 1
            self._unseen_steps(replica)
        self._order.setdefault(replica, deque()).append(
            (uncached_tokens, -math.inf if sent_at is None else sent_at))
        self.steps.dispatched(replica, idle=not self.inflight.get(replica, 0)
                              and replica not in self.remote)
        self.inflight[replica] = self.inflight.get(replica, 0) + 1
        self.pending_prefill[replica] = self.pending_prefill.get(replica, 0.0) + uncached_tokens

    def chunk(self, replica: str, now: float) -> None:
        """The replica streamed a chunk at `now`: one of its engine steps just ended."""
        # The others' load looked up once for all three: this runs for every chunk relayed.
        others = self.remote.get(replica) if self.remote else None
        batch = self._batch(replica, others)
        awaiting = self.pending_prefill.get(replica, 0.0) > 0.0
        if awaiting:
            self._credit(replica, now, batch, others)
        ends = self._blind.get(replica)
        if ends:
            self._presume_prefilled(replica, now)
        # Another gateway's requests passed through there hide their prefills in these steps
        # as this gateway's own would: a gateway streaming everything next to one passing
        # everything through timed them as its own steps, learned a prefill rate and decode
        # line from work it could not see, and the two spiralled (mean TTFT 40 s, against
        # 4.0 s with every request streamed).
        self.steps.chunk(replica, now, batch, awaiting, others[3] if others is not None else 0,
                         hidden=bool(ends) or (others is not None and others[5] > 0))

    def batch(self, replica: str) -> int:
        """Requests in flight on the replica, this gateway's and the others' (as they last
        said): the engine's batch, which sets how long its decode steps take."""
        return self._batch(replica, self.remote.get(replica) if self.remote else None)

    def _batch(self, replica: str, others: RemoteLoad | None) -> int:
        own = self.inflight.get(replica, 0)
        return own + others[0] if others is not None else own

    def first_token(self, replica: str, uncached_tokens: float, now: float | None = None,
                    dispatched_at: float | None = None, cold: bool = False) -> None:
        """The replica finished this request's prefill: its prefill is no longer pending.
        `cold`: the router believed the replica held none of its prompt."""
        left = self.pending_prefill.get(replica, 0.0) - uncached_tokens
        self.pending_prefill[replica] = left if left > 1e-6 else 0.0
        order = self._order.get(replica)
        if order:
            if order[0][0] == uncached_tokens:
                order.popleft()
                self._drain[replica] = 0.0  # the next oldest one is now being prefilled
            else:  # the oldest of that size; none: not sent through dispatched()
                i = next((i for i, (tokens, _) in enumerate(order) if tokens == uncached_tokens),
                         None)
                if i is not None:
                    del order[i]
        if now is not None:
            self._decoding[replica] = self._decoding.get(replica, 0) + 1
            self._first_tokens[replica] = self._first_tokens.get(replica, 0) + 1
            if dispatched_at is not None:
                self.steps.prefill_done(replica, uncached_tokens, now, dispatched_at,
                                        alone=self.pending_prefill.get(replica, 0.0) <= 0.0,
                                        cold=cold)

    def finished(self, replica: str, uncached_tokens: float, saw_first_token: bool) -> None:
        keep = 1.0 - 1.0 / ENDS_DECAY
        self._ends = self._ends * keep + 1.0
        self._unseen = self._unseen * keep + (0.0 if saw_first_token else 1.0)
        left = self.inflight[replica] = max(0, self.inflight.get(replica, 0) - 1)
        if saw_first_token:
            self._decoding[replica] = max(0, self._decoding.get(replica, 0) - 1)
        elif self._blind_inflight.get(replica):
            # Or a streamed request that failed before its first token: rare, and the count
            # is right again once the replica has nothing in flight.
            self._blind_inflight[replica] -= 1
        if not left:
            self._decoding[replica] = self._blind_inflight[replica] = 0
            self._order.pop(replica, None)  # nothing in flight awaits a first token
            # Nothing in flight, nothing passed through waits: what a miscount (a request
            # that failed before its first token, taken for one passed through) left goes.
            self._blind.pop(replica, None)
            self._presumed.pop(replica, None)
            self.steps.idle(replica)
        else:
            self._unseen_steps(replica)
        if not saw_first_token and not self._unexpect_blind(replica, uncached_tokens):
            self.first_token(replica, uncached_tokens)

    def _unseen_steps(self, replica: str) -> None:
        """With requests there that show nothing and none that streams a chunk each step,
        the engine's steps go unseen: the gap to the next chunk is not one step (its ends
        are forgotten, as when the replica goes idle).

        Timed as one step, such gaps of several seconds made a replica's typical step and
        the wait for it (`StepTimer.remaining`) as long: on the slow fleet near saturation
        with half the requests passed through, a tenth of the views priced the step in
        flight past 100k tokens, and requests spilled off their cache."""
        if self._blind_inflight.get(replica) and not self._decoding.get(replica):
            self.steps.idle(replica)

    def _expect_blind(self, replica: str, uncached_tokens: float, now: float,
                      sent_at: float) -> None:
        """Queue a request sent at `now` whose first token this gateway will not see: its
        prefill is presumed done when the engine's count of first tokens says so
        (`engine_first_tokens`), or, where the engine reports none, at an estimate: after what
        is queued there, at the replica's rate. Without either, at its answer.

        Counted as queued until its answer, a passed-through request held its replica's
        queue up for its whole decode: on the slow fleet near saturation with half the
        requests passed through, every replica looked queued, requests spilled off their
        cache, and the recomputation drove the fleet into a spiral (mean TTFT 60 s, against
        3.7 s with every request streamed). The estimate errs late under a standing queue
        (by 10 s at the median there), so the engine's count, late by a scrape at most, is
        preferred where there is one."""
        ends = self._blind.setdefault(replica, deque())
        rate = None if replica in self._engine_firsts else self._blind_rate(replica)
        if rate is None:
            end = math.inf
        else:
            ahead = self.prefill_left(replica)
            if self.remote:
                ahead += self.remote.get(replica, NO_LOAD)[2]
            end = now + (ahead + uncached_tokens) / rate
            if ends and end < ends[-1][0]:
                end = ends[-1][0]  # an engine prefills in arrival order
        ends.append((end, uncached_tokens, sent_at))

    def _blind_rate(self, replica: str) -> float | None:
        """Prefill tokens per second the replica computes, for `_expect_blind`: its own
        learned rate, or the pool's at its speed, or its engine's (`EngineSpeeds`)."""
        own = self.steps.replica_rate(replica)
        if own is None:
            pool = self.steps.rate
            own = pool * self.speed(replica) if pool > 0.0 else self.engines.rate(replica)
        return own

    def _presume_prefilled(self, replica: str, now: float) -> None:
        """The unseen requests whose estimated prefill end is past: no longer queued."""
        ends = self._blind[replica]
        while ends and ends[0][0] <= now:
            self._presume_oldest(replica, ends)

    def _presume_oldest(self, replica: str, ends: deque[tuple[float, float, float]]) -> None:
        """The oldest unseen request there is presumed prefilled: no longer queued."""
        _, tokens, _ = ends.popleft()
        presumed = self._presumed.setdefault(replica, {})
        presumed[tokens] = presumed.get(tokens, 0) + 1
        self.first_token(replica, tokens)

    def awaits_unseen(self, replica: str) -> bool:
        """Whether requests passed through whole may still wait for their prefill there, and
        the engine's counts read now could end them (`engine_first_tokens`,
        `engine_prefills_waiting`) between its regular scrapes.

        Also where other gateways send: each takes its share of the first tokens and carries
        the fraction, and takes the others' streamed requests off a count of requests
        awaiting a first token. Read at the scrapes alone there, with rounded shares, three
        gateways on the slow fleet near saturation with half the requests passed through
        were at 4.19 s (vLLM, geometric mean over 11 seeds)."""
        return bool(self._blind.get(replica))

    def engine_first_tokens(self, replica: str, count: float | None) -> None:
        """The replica's engine has produced `count` first tokens so far (from its metrics,
        None: it reports none). Those no gateway saw since the last reading ended the
        prefills of requests passed through whole: as many of this gateway's oldest unseen
        requests there are presumed prefilled (an engine prefills in arrival order)."""
        if count is None:
            return
        seen = self._first_tokens.get(replica, 0)
        others = self.remote.get(replica, NO_LOAD) if self.remote else NO_LOAD
        seen += others[3]
        last = self._engine_firsts.get(replica)
        self._engine_firsts[replica] = (count, seen)
        ends = self._blind.get(replica)
        if last is None or count < last[0] or not ends:
            return  # the first reading, the engine restarted, or nothing unseen there
        unseen = int(count - last[0]) - (seen - last[1])
        if others[5]:
            # Other gateways' requests passed through end there too, and each gateway reads
            # the same count: each takes its share, as its requests are of those waiting,
            # and carries the fraction to its next reading. Rounded instead, a share read
            # every second was a fraction of one request most of the time: with three
            # gateways a third of one rounded to none, two thirds of two to one each.
            exact = max(0.0, unseen * len(ends) / (len(ends) + others[5])
                        + self._share_left.get(replica, 0.0))
            unseen = math.floor(exact)
            self._share_left[replica] = exact - unseen
        for _ in range(min(unseen, len(ends))):
            self._presume_oldest(replica, ends)

    def engine_prefills_waiting(self, replica: str, waiting: float | None, read_at: float,
                                lag_s: float = 0.0) -> None:
        """The replica's engine had `waiting` requests not yet past their first token as of
        `lag_s` before it was read at `read_at` (on the clock of `dispatched`'s `sent_at`;
        None: it does not say). For an engine that reports no count of first tokens
        (TensorRT-LLM), this gateway's requests passed through there cannot be waiting in
        greater number than that less its own streamed requests still awaiting a first
        token: the oldest past that are presumed prefilled.

        Their estimated ends (`_expect_blind`) chain on the queue ahead at the replica's rate
        and err late under a standing queue; this bound catches what the estimate is late
        for. Only requests sent ENGINE_READ_SLACK_S before the moment counted are weighed, on
        both sides: one sent later may not have reached the engine's queue by then. With
        several gateways, the others' streamed requests still awaiting a first token, as
        they last said, are taken off the count too, and each gateway takes its share of what
        the count leaves out, as its requests passed through are of all those there (their
        count is in the shared load). Without the share, three gateways on the slow fleet
        near saturation with half the requests passed through were at 16.8 s, with it 6.2 s
        (estimates alone: 9.1 s)."""
        if waiting is None or replica in self._engine_firsts:
            return
        ends = self._blind.get(replica)
        if not ends:
            return
        mark = read_at - lag_s - ENGINE_READ_SLACK_S
        weighed = 0
        for _, _, sent in ends:
            if sent > mark:
                break
            weighed += 1
        order = self._order.get(replica, ())
        streamed = 0
        for _, sent in order:
            if sent > mark:
                break
            streamed += 1
        # `order` holds every request awaiting a first token, those passed through included.
        streamed = max(0, streamed - weighed)
        others = self.remote.get(replica, NO_LOAD) if self.remote else NO_LOAD
        # The others' streamed requests wait in the count as this gateway's do. Left in, a
        # gateway passing everything through next to one streaming everything read the
        # count as room for its own: its estimates, late, held requests queued.
        excess = weighed - max(0, int(waiting) - streamed - others[6])
        if others[5]:
            # Other gateways' requests passed through wait there too: the engine's count
            # holds them all, so each gateway takes its share of what it cannot hold, as its
            # requests are of those passed through there (as with the count of first tokens).
            excess = _share(excess + others[5], weighed, others[5])
        for _ in range(min(excess, weighed)):
            self._presume_oldest(replica, ends)

    def _unexpect_blind(self, replica: str, uncached_tokens: float) -> bool:
        """An unseen request of `uncached_tokens` ended: True if it was already presumed
        prefilled (nothing left to take off the queue); its estimate goes if not."""
        presumed = self._presumed.get(replica)
        if presumed and _take(presumed, uncached_tokens):
            return True
        ends = self._blind.get(replica)
        if ends:
            for i, (_, tokens, _) in enumerate(ends):
                if tokens == uncached_tokens:
                    del ends[i]
                    break
        return False

    def forget(self, replica: str) -> None:
        """The replica left: its counters and step timing go."""
        self.inflight.pop(replica, None)
        self.pending_prefill.pop(replica, None)
        self._drain.pop(replica, None)
        self._order.pop(replica, None)
        self._first_tokens.pop(replica, None)
        self._blind.pop(replica, None)
        self._blind_inflight.pop(replica, None)
        self._decoding.pop(replica, None)
        self._presumed.pop(replica, None)
        self._engine_firsts.pop(replica, None)
        self._share_left.pop(replica, None)
        self.steps.forget(replica)
        self.engines.forget(replica)

    def prefill_left(self, replica: str) -> float:
        """Pending prefill tokens less what the engine has presumably computed of them.

        Pending prefill only falls when a request's first token arrives, but a long prompt is
        prefilled in chunks over many steps: counted whole until its end, it makes a replica
        that is nearly through it look as busy as one that has not begun. Each step the
        gateway times there while prefill is pending computed about (its length less a
        decode-only step's) times the learned prefill rate, which errs low. The credit goes
        to the oldest request awaiting its first token only (an engine prefills in arrival
        order), and never all of it: if the router believed it cached more than the engine
        still held, its prefill is longer than believed, and that must not be taken off the
        requests queued behind it. Nor while another gateway's oldest request there was sent
        before this one's: the engine is computing that one, and its gateway credits it.
        """
        pending = self.pending_prefill.get(replica, 0.0)
        done = self._drain.get(replica, 0.0)
        return pending - done if done < pending else 0.0

    def _credit(self, replica: str, now: float, batch: int,
                others: RemoteLoad | None = None) -> None:
        """A step of `replica` (running `batch` sequences) ended at `now` with prefill
        pending: credit what it computed (`others`: the other gateways' load there)."""
        order = self._order.get(replica)
        if not order:
            return
        if others is not None and others[4] < order[0][1]:
            # Credited to this gateway's oldest request as well, three gateways' queues
            # looked about a tenth drained when they were not (tenants on the mixed fleet
            # near saturation: 8% slower than one gateway).
            return
        steps = self.steps
        last = steps.last_end(replica)
        # The replica's own learned rate when it has one (replicas may differ in speed).
        rate = steps.replica_rate(replica) or steps.rate
        if last is None or rate <= 0.0:
            return
        decode = steps.decode_s(batch) or 0.0
        extra = now - last - decode
        if extra > 0.0:
            head = HEAD_CREDIT_MAX * order[0][0]
            self._drain[replica] = min(head, self._drain.get(replica, 0.0) + rate * extra)

    def speed(self, replica: str) -> float:
        """The replica's speed as a policy prices it (`ReplicaView.speed`): its prefill rate
        as this gateway timed it (`StepTimer.speed`), or, while at least UNSEEN_SHARE of the
        requests ending showed no first token (passed through whole), as the engine's metrics
        report it, where they do (`EngineSpeeds`)."""
        return self._speed(replica)[0]

    def _speed(self, replica: str) -> tuple[float, bool]:
        """`speed`, and whether it is the one this gateway timed."""
        engine_speeds = self.engines.speeds
        # Read for every replica of every decision: a dict test first, the common case.
        if engine_speeds and self._unseen >= UNSEEN_SHARE * self._ends > 0.0:
            # Requests that stream nothing prefill in the steps the gateway times for its
            # streamed ones: its own rates are blind to that work (on a mixed fleet with half
            # the requests passed through they strayed 2-5x from the truth) or, with nothing
            # streamed, never learned. The engines count every prefill.
            speed = engine_speeds.get(replica)
            if speed is not None:
                return speed, False
        return self.steps.speed(replica), True

    def view(self, replica: str, now: float | None = None, engine_waiting: int = 0,
             kv_usage: float | None = None) -> ReplicaView:
        """What a policy sees of `replica` at `now`: this router's load there and the other
        gateways', its step and speeds, and what the engine's last scraped metrics said
        (`engine_waiting`, `kv_usage`; as the defaults, never scraped)."""
        if now is not None and self._blind.get(replica):
            self._presume_prefilled(replica, now)
        steps = self.steps
        rate = steps.rate  # a property that adds what other gateways learned: read it once
        speed, speed_timed = self._speed(replica)
        inflight = self.inflight.get(replica, 0)
        own_inflight = inflight
        pending = self.pending_prefill.get(replica, 0.0)
        left = self.prefill_left(replica) if rate > 0.0 else None
        if self.remote:
            n, p, remote_left, *_ = self.remote.get(replica, NO_LOAD)
            inflight += n
            pending += p
            if left is not None:
                left += remote_left
        # The engine step in flight carries prefill only if some was pending when it began:
        # one sent since waits for the next step. Pending now is the cheap superset of that.
        decode_only = self.decode_step_wait and pending <= 0.0
        wait = (rate * steps.remaining(replica, now, decode_only)
                if now is not None and own_inflight else 0.0)
        return ReplicaView(
            name=replica,
            inflight=inflight,
            pending_prefill_tokens=pending,
            step_wait_tokens=wait,
            prefill_left_tokens=left,
            speed=speed,
            # Known from the engines, the speed is learned: no throughput-while-busy stand-in.
            busy_speed=steps.busy_speed(replica) if speed_timed else None,
            engine_waiting=engine_waiting,
            kv_usage=kv_usage,
        )


def _share(n: int, own: int, others: int) -> int:
    """This gateway's share of `n`, as its `own` requests are of `own + others`, rounded."""
    return int(n * own / (own + others) + 0.5)


def _take(counts: dict[float, int], key: float) -> bool:
    """One less of `key` in the multiset `counts`: False if there was none."""
    n = counts.get(key, 0)
    if not n:
        return False
    if n > 1:
        counts[key] = n - 1
    else:
        del counts[key]
    return True


def sum_loads(loads: Iterable[Mapping[str, Sequence[float | None]]]) -> dict[str, RemoteLoad]:
    """Other gateways' (or workers') `own_load`s summed per replica (the oldest request: the
    oldest of theirs), for `set_remote`. An entry of an older gateway lacks the last figures:
    without the drained one it counts its pending prefill whole; without the first tokens,
    none (steps ending its prefills teach this gateway as its own would); without the oldest
    request, none ahead of this gateway's; without the requests passed through, or the
    requests streamed awaiting a first token, none."""
    total: dict[str, RemoteLoad] = {}
    for replicas in loads:
        for replica, entry in replicas.items():
            n, pending = int(entry[0]), float(entry[1])
            left = float(entry[2]) if len(entry) > 2 else pending
            firsts = int(entry[3]) if len(entry) > 3 else 0
            oldest = entry[4] if len(entry) > 4 and entry[4] is not None else math.inf
            unseen = int(entry[5]) if len(entry) > 5 and entry[5] is not None else 0
            streamed = int(entry[6]) if len(entry) > 6 and entry[6] is not None else 0
            n0, p0, l0, f0, o0, u0, s0 = total.get(replica, NO_LOAD)
            total[replica] = (n0 + n, p0 + pending, l0 + left, f0 + firsts, min(o0, oldest),
                              u0 + unseen, s0 + streamed)
    return total
