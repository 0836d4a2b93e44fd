"""Prefix affinity: the replica holding the longest prefix, within a bound on load and cost."""

from __future__ import annotations

import math
from collections.abc import Sequence

from pydantic import Field

from routing import rendezvous
from routing.policies.base import Policy, PolicySettings, PrefixLookup, load_bound
from routing.policies.registry import register
from routing.speed import SpeedBook
from routing.types import (
    REASON_AFFINITY,
    REASON_COLD,
    REASON_OVERFLOW,
    Decision,
    ReplicaView,
    RoutingRequest,
)

Row = tuple[float, int, int, float, bool, str, float, float, float]
"""A replica as one decision sees it: (cost, matched, rendezvous weight, uncached, eligible,
name, step wait, tie cost between holders (without the step wait, requests in flight at the
tie price), cost without the step wait). A plain tuple read by index, not a NamedTuple:
building one costs 0.75 µs against 0.09 µs for the tuple (attribute and index reads cost
the same), one per replica per decision, 5-20% of a decision's routing cost at 8-32
replicas."""


class PrefixAffinitySettings(PolicySettings):
    load_factor: float = Field(1.25, ge=1.0, description="bounded-load factor c: a replica is "
                               "eligible while its in-flight count stays within ceil(c x mean)")
    load_allowance: int = Field(4, ge=0, description="in-flight requests allowed above "
                                "ceil(c x mean)")
    load_weight: float = Field(0.5, ge=0.0, description="weight of a replica's queue in the "
                               "cost when every replica has prefill queued")
    idle_load_weight: float | None = Field(
        1.5, ge=0.0, description="queue weight when no replica has prefill queued; it moves "
        "linearly to load_weight as more replicas do (None: always load_weight)")
    kv_pressure_usage: float | None = Field(
        0.8, gt=0.0, le=1.0, description="mean KV usage of the pool's engines (ReplicaView."
        "kv_usage, of those that report it) from which the queue weighs at most "
        "kv_pressure_load_weight: a miss then also takes KV room that evicts other prompts' "
        "cache and holds back admission, which the queue does not show (None: off)")
    kv_pressure_load_weight: float = Field(0.25, ge=0.0, description="the most the queue "
                                           "weighs while the engines' mean KV usage is at "
                                           "kv_pressure_usage or above")
    inflight_tokens: float = Field(256.0, ge=0.0, description="queue tokens counted per "
                                   "request in flight on a replica")
    drain_pending: bool = Field(True, description="count a replica's pending prefill less "
                                "what its engine has presumably computed of it since it was "
                                "sent (at the learned prefill rate), not whole until the "
                                "first token")
    slack_fraction: float = Field(0.25, ge=0.0, description="replicas within this fraction of "
                                  "the prompt (plus slack_tokens) of the cheapest stay "
                                  "candidates for the longest match")
    slack_tokens: float = Field(256.0, ge=0.0, description="fixed part of that slack, in tokens")
    tie_tokens: float = Field(512.0, ge=0.0, description="cost difference within which equal "
                              "matches count as a tie")
    balance_horizon: int = Field(1000, ge=0, description="decisions over which a replica's "
                                 "recent prefill, which ties weigh against the step wait, "
                                 "decays (0: none is kept and, without wait_first, ties go to "
                                 "the rendezvous owner)")
    wait_first: bool = Field(False, description="among ties, the replica whose engine step "
                             "in flight ends soonest first (its step wait), then the one with "
                             "the least recent prefill; false: the step wait plus "
                             "balance_weight times the recent prefill")
    balance_weight: float = Field(0.03, ge=0.0, description="without wait_first, the weight "
                                  "of a replica's recent prefill against its step wait in the "
                                  "tie-break (both in tokens): at 1 a window's summed prefill "
                                  "outweighs any step wait; at 0.03 the step that ends "
                                  "soonest decides most ties, and a replica sent far more "
                                  "prefill than the others still loses them")
    replica_speed: bool = Field(True, description="price each replica's queued and recent "
                                "prefill at its own learned rate (ReplicaView.speed), so a "
                                "slower replica gets proportionally less")
    speed_bound: float | None = Field(
        0.75, ge=0.0, le=1.0, description="share of replicas with prefill queued from which, "
        "while every replica slower than the replicas' mean speed has prefill queued too, a "
        "faster replica's bounded-load limit is raised by its speed over that mean: it holds "
        "more requests in flight at the same load, and the common limit sends the requests for "
        "its cached prefixes to queued slow replicas as misses (None: never; with "
        "replica_speed only)")
    busy_speed: bool = Field(True, description="until a replica's own prefill rate is "
                             "learned from its steps (which a standing queue can hold off for "
                             "minutes), speed_bound takes its speed from its throughput while "
                             "busy (ReplicaView.busy_speed)")
    waiting_stops_drain: bool = Field(True, description="while a replica's engine reports "
                                      "requests waiting, count its pending prefill whole: "
                                      "what it has queued is not being computed")
    waiting_kv_usage: float = Field(0.9, ge=0.0, le=1.0, description="KV usage "
                                    "(ReplicaView.kv_usage) from which requests waiting mean "
                                    "the engine cannot admit them; below it, or unknown, they "
                                    "are an ordinary queue that drains at its prefill rate")
    blocked_speed_cap: bool = Field(True, description="price the queue of a replica whose "
                                    "engine reports requests waiting at KV usage from "
                                    "waiting_kv_usage at a speed of at most 1.0: a fast "
                                    "replica that cannot admit work drains its queue no "
                                    "faster than a slow one")
    own_speed: bool = Field(True, description="on a fleet of mixed speeds (see "
                            "own_speed_spread), price the request's own uncached tokens, plus "
                            "own_speed_step_tokens, at the replica's speed ** (1 - share of "
                            "replicas with prefill queued): in full on an idle fleet, where "
                            "its own prefill is the request's TTFT, not at all on a busy one; "
                            "count requests in flight (inflight_tokens) times that share; "
                            "and raise a fast replica's bounded-load limit by its speed at "
                            "any load, as speed_bound does on a busy fleet (with "
                            "replica_speed only)")
    own_speed_spread: float = Field(2.0, ge=1.0, description="own_speed acts on a decision "
                                    "only while the replicas' upper-quartile speed is at "
                                    "least this many times their lower-quartile speed: a "
                                    "fleet of two speeds, not equal replicas one or two of "
                                    "whose learned speeds stray")
    own_speed_outliers: bool = Field(True, description="on a fleet that is not of mixed "
                                     "speeds, own_speed still prices the request's own "
                                     "prefill on a replica more than own_speed_spread times "
                                     "slower or faster than the pool's rate (a throttled "
                                     "replica), the others at the pool's rate")
    own_speed_step_tokens: float = Field(1024.0, ge=0.0, description="with own_speed, tokens "
                                         "added to the request's own uncached tokens before "
                                         "they are priced at the speed: the fixed cost of "
                                         "the engine step that prefills it, which a slower "
                                         "replica's steps pay more of")
    match_allowance_tokens: float | None = Field(
        8192.0, gt=0.0, description="matched tokens that earn a request one more request "
        "of load_allowance on the replica holding them: a long context is recomputed "
        "elsewhere only when its holder is far past the bound, a short match moves as soon "
        "as it is past (None: one allowance for every request)")
    time_cap: float | None = Field(
        1.15, ge=1.0, description="cap on the prefill imbalance by time: a replica whose "
        "recent prefill at its own speed (the balance_horizon window), with this request's, "
        "would pass time_cap times the replicas' mean is left out while a replica under the "
        "cap has no prefill queued (balance moves work onto idle capacity only); from the "
        "balance_horizon-th decision on, when the window holds more than a few prompts; on "
        "a fleet of mixed speeds only with time_cap_mixed_speeds. None: no cap; needs "
        "balance_horizon > 0")
    idle_cap_recompute_tokens: float | None = Field(
        16384.0, gt=0.0, description="a replica past the time cap stays eligible for a request "
        "it holds this many tokens more of than every replica the cap allows: on an idle fleet "
        "(no replica has prefill queued) always, at any other load while held_time_cap allows "
        "it; moving the request there would compute them again, work made rather than moved "
        "(at a quiet hour, turns of long conversations were computed again elsewhere). None: "
        "the cap moves it")
    held_time_cap: float | None = Field(
        1.2, ge=1.0, description="while some replica has prefill queued, the spare of "
        "idle_cap_recompute_tokens holds for a replica whose recent prefill at its own speed, "
        "with this request's, stays within held_time_cap times the replicas' mean: past it "
        "the cap moves the request even so (None: the spare holds on an idle fleet only)")
    slow_cap_spare: bool = Field(True, description="at any load, with own_speed_outliers, "
                                 "on a fleet that is not of mixed speeds: while every "
                                 "replica the time cap allows is one far slower than the "
                                 "pool, a replica it left out stays eligible for a request "
                                 "whose prefill there takes idle_cap_recompute_tokens less "
                                 "time (at each replica's speed) than on them: the cap would "
                                 "make the work it moves, a long prompt or a held context "
                                 "computed at the slow replica's speed (False: only on an "
                                 "idle fleet, as for equal replicas)")
    tie_inflight_tokens: float | None = Field(
        32.0, ge=0.0, description="queue tokens counted per request in flight when ties "
        "among replicas holding as much of the prompt (more than none of it) are judged on an "
        "idle fleet, in place of inflight_tokens, which it approaches as the share of replicas "
        "with prefill queued grows: there a decoding sequence costs the request only its share "
        "of each step that prefills it, while inflight_tokens prices the pile-up a held prefix "
        "draws and, for a cold request, the sessions a replica already serves (None: "
        "inflight_tokens)")
    time_cap_mixed_speeds: bool = Field(False, description="hold a fleet of mixed speeds "
                                        "(own_speed_spread) to time_cap too: its slow "
                                        "replicas then take their share of the prompt work "
                                        "by time even while a fast replica would serve the "
                                        "request sooner")


@register
class PrefixAffinity(Policy):
    """Longest cached prefix first, but never onto a replica that is too busy to benefit.

    Four steps, each guarding against a failure seen in real routers or in the simulator
    (docs/routing.md has the figures behind every default):
    1. Bounded load: only replicas whose in-flight count stays within
       ceil(c * mean) + `load_allowance` are eligible, so a hot system prompt spreads over a
       few replicas instead of melting one. The allowance keeps the bound from bouncing
       requests off their cache at small counts (2 in flight per replica gives a bound of 3).
       On a busy fleet whose slower replicas all have prefill queued, a replica faster than
       the replicas' mean speed may hold proportionally more (`speed_bound`): at the same
       load it has more in flight. A request gets one more request of allowance on a replica
       per `match_allowance_tokens` it matches there: a long conversation is recomputed
       elsewhere only when its holder is far past the bound.
    2. Cost, in prompt tokens: the request's uncached tokens on the replica (from the prefix
       index), plus `load_weight` times the weighted queue there, where the queue is the
       uncached prefill already sent and not yet past first token plus `inflight_tokens` per
       request in flight (decoding sequences lengthen every engine step). The weight moves
       from `idle_load_weight` when no replica has prefill queued to `load_weight` when all
       do: on a busy fleet a miss is work that every later request pays for, which the
       request's own TTFT does not see, so a hit is worth more than an equal amount of queue;
       on an idle fleet the queue is what the request waits for. While the engines' mean KV
       usage is at `kv_pressure_usage` or above, the weight is at most
       `kv_pressure_load_weight`:
       there a miss also takes KV room, evicting other prompts' cache and holding back
       admission, so a fleet near its KV capacity that balances queues over hits runs out
       of KV sooner and tips past saturation. Last, the wait for the
       engine step in flight there (`ReplicaView.step_wait_tokens`): an engine admits new
       work only between steps.
    3. Replicas within `slack` of the cheapest stay candidates and the longest matched prefix
       among them wins: a hit is worth a little queueing, not a lot.
    4. Among equally long matches within `tie_tokens` of the cheapest of them (not counting the
       step wait, and, when they hold some of the prompt, pricing requests in flight at
       `tie_inflight_tokens` on an idle fleet: between replicas holding as much, a decoding
       sequence costs the request only its share of a step), the replica with the least step
       wait plus `balance_weight` times the uncached prefill it recently received wins (with
       `balance_horizon` > 0, a decaying per-replica sum), else the rendezvous owner of the
       prefix key. The wait is what the request itself waits; the recent prefill, weighed
       lightly, keeps prefill work even when cold prompts vary in length; rendezvous makes
       independent gateways agree on a cold prefix's home.
       With `wait_first`, the step wait first and the recent prefill second.
    With `time_cap` (1.15 by default), before step 3, replicas whose recent prefill time is
    past the cap are left out while one under it is idle: on equal replicas balance by time
    costs about 1% of the mean TTFT; on a fleet of mixed speeds, where it costs far more, only
    with `time_cap_mixed_speeds`. A replica the cap left out stays a candidate for a prompt
    it holds `idle_cap_recompute_tokens` more of than the others: on an idle fleet always, at
    another load while its recent prefill stays within `held_time_cap` of the mean; at
    any load, where the cap allows only replicas far slower than the pool, one where the
    request's prefill takes that much less time (`slow_cap_spare`).
    """

    name = "prefix_affinity"
    Settings = PrefixAffinitySettings
    settings: PrefixAffinitySettings

    def __init__(self, settings: PrefixAffinitySettings | None = None) -> None:
        super().__init__(settings)
        s = self.settings
        self.load_factor = s.load_factor
        self.load_weight = s.load_weight
        self.slack_fraction = s.slack_fraction
        self.slack_tokens = s.slack_tokens
        self.inflight_tokens = s.inflight_tokens
        self.tie_tokens = s.tie_tokens
        self.load_allowance = s.load_allowance
        self.balance_horizon = s.balance_horizon
        self.wait_first = s.wait_first
        self.balance_weight = s.balance_weight
        self._decay = 1.0 - 1.0 / s.balance_horizon if s.balance_horizon > 0 else 0.0
        """What the recent prefill keeps of itself per decision (`balance_horizon`)."""
        self.idle_load_weight = s.load_weight if s.idle_load_weight is None else s.idle_load_weight
        # name -> (recent uncached prefill sent there, decision count when last updated)
        self._recent: dict[str, tuple[float, int]] = {}
        self._decisions = 0
        self.drain_pending = s.drain_pending
        self._speeds = SpeedBook(s.replica_speed)
        self.speed_bound = s.speed_bound if s.replica_speed else None
        self.busy_speed = s.busy_speed
        self.waiting_stops_drain = s.waiting_stops_drain
        self.waiting_kv_usage = s.waiting_kv_usage
        self.kv_pressure_usage = s.kv_pressure_usage
        self.kv_pressure_load_weight = s.kv_pressure_load_weight
        self.blocked_speed_cap = s.blocked_speed_cap
        self.own_speed = s.own_speed and s.replica_speed
        self.own_speed_step_tokens = s.own_speed_step_tokens
        self.own_speed_spread = s.own_speed_spread
        self.own_speed_outliers = s.own_speed_outliers and self.own_speed
        self.match_allowance_tokens = s.match_allowance_tokens
        self.time_cap = s.time_cap if s.balance_horizon > 0 else None
        self.time_cap_mixed_speeds = s.time_cap_mixed_speeds
        self.idle_cap_recompute_tokens = s.idle_cap_recompute_tokens
        self.held_time_cap = s.held_time_cap
        self.slow_cap_spare = s.slow_cap_spare
        self.tie_inflight_tokens = s.tie_inflight_tokens
        self._seen_at: dict[str, int] = {}
        """Replica -> the decision at which the time cap last saw it among the views (up to
        the last change of views: those since are `_cap_names`, last seen at `_cap_at`)."""
        self._cap_names: tuple[str, ...] = ()
        self._cap_at = 0

    def _recent_work(self, name: str) -> float:
        value, at = self._recent.get(name, (0.0, self._decisions))
        return value * self._decay ** (self._decisions - at) if at != self._decisions else value

    def choose(
        self, request: RoutingRequest, replicas: Sequence[ReplicaView], lookup: PrefixLookup
    ) -> Decision:
        hashes = request.hashes
        prompt_tokens = request.prompt_tokens
        block_tokens = request.block_tokens
        speeds = [self._speeds.see(r) for r in replicas]
        key = request.key
        busy = sum(1 for r in replicas if r.pending_prefill_tokens > 0) / len(replicas)
        slowest, fastest = min(speeds), max(speeds)
        mixed = self._spread(speeds, slowest, fastest)
        # own_speed acts on this decision: on a fleet of mixed speeds that is not all busy.
        own = self.own_speed and busy < 1.0 and mixed
        bounds = self._bounds(replicas, busy, own)
        w = self.idle_load_weight + (self.load_weight - self.idle_load_weight) * busy
        pressure = self.kv_pressure_usage
        if pressure is not None and self._mean_kv_usage_at_least(replicas, pressure):
            w = min(w, self.kv_pressure_load_weight)
        # With own_speed, decoding requests count as queue only as far as the fleet is busy:
        # on an idle one each lengthens the request's prefill step by a millisecond or so, and
        # counted whole they outweighed a fast replica's speed and sent requests to a slow
        # replica for having fewer in flight.
        per_request = self.inflight_tokens * busy if own else self.inflight_tokens
        own_exponent = 1.0 - busy
        # The speed each replica's own prefill is priced at (None: priced whole everywhere).
        priced = speeds if own else self._outlier_speeds(speeds, slowest, fastest, busy)
        # Ties price them lower still, but only as far as the fleet is idle: behind a queue the
        # request's own step is no longer what it waits for, and the requests in flight stand
        # for work whose drain is only estimated (a replica three times slower, its speed not
        # yet learned, took 1.23 of the mean prefill time on tenants near saturation at the
        # tie price throughout).
        tie_per_request = self.tie_inflight_tokens
        if tie_per_request is not None:
            tie_per_request = (tie_per_request * busy if own else
                               tie_per_request + (self.inflight_tokens - tie_per_request) * busy)
        self._decisions += 1

        allowance = self.match_allowance_tokens
        rows: list[Row] = []
        best_match = 0
        for r, speed, bound, own_rate in zip(replicas, speeds, bounds, priced or speeds,
                                             strict=True):
            matched = lookup.matched_blocks(r.name, hashes) if hashes else 0
            if matched > best_match:
                best_match = matched
            matched_tokens = matched * block_tokens
            uncached = max(0.0, prompt_tokens - matched_tokens)
            wait = r.step_wait_tokens
            # The queue is priced at the replica's own rate: it is the wait there. An engine
            # out of KV admits nothing until requests finish, however fast it computes, so
            # its speed must not make its queue look shorter than a slow replica's.
            if self.blocked_speed_cap and speed > 1.0 and self._blocked(r):
                speed = 1.0
            pending = self._pending(r)
            queue = (pending + per_request * r.inflight) / speed
            # With own_speed, at the speed to the power of the share of replicas with nothing
            # queued: on an idle fleet the request's own prefill there is its TTFT; on a busy
            # one a miss is work every later request pays for wherever it runs.
            uncached_cost = (uncached if priced is None else
                             (uncached + self.own_speed_step_tokens) / own_rate ** own_exponent)
            # Kept apart for the ties, which are judged without the step wait: taken off the
            # cost again, it rounded, and costs exactly tie_tokens apart (whole tokens, as
            # cold prompts on idle replicas are) fell on either side of the boundary.
            plain = uncached_cost + w * queue
            cost = plain + wait
            # Without the step wait, and the requests in flight at the tie price (read only
            # when the replicas tie on a match longer than zero).
            tie_cost = 0.0 if tie_per_request is None else (
                uncached_cost + w * (pending + tie_per_request * r.inflight) / speed)
            eligible = r.inflight < bound
            if not eligible and allowance is not None:
                # Leaving a holder recomputes what it holds; one more request there costs a
                # little of every step's time. A long match buys room in proportion.
                eligible = r.inflight < bound + int(matched_tokens / allowance)
            rows.append((cost, matched, rendezvous.weight(key, r.name), uncached, eligible,
                         r.name, wait, tie_cost, plain))

        if (self.time_cap is not None and self._decisions >= self.balance_horizon
                and (self.time_cap_mixed_speeds or not mixed)
                and not any(r.busy_speed is not None and r.busy_speed != 1.0
                            for r in replicas)):
            # Not before the window has filled: over a pool's first requests the sums are a
            # prompt or two each, and the cap would send a shared prefix's second request
            # away from its holder. Not on a fleet of mixed speeds unless asked: the lowest
            # TTFT leaves its slow replicas nearly idle at light load (the oracle's imbalance
            # by time is 2.0 there), and the cap costs multi-turn chats 28% of their mean
            # TTFT; on equal replicas about 1%. Not while a replica's throughput says it is
            # slower or faster than the rest before its own rate is known: its window counts
            # its prefill at speed 1, and the cap would give it more time than its share (a
            # replica three times slower, under a standing queue for minutes, took 1.20 of
            # the mean).
            self._start_returning(rows)
            if busy < 1.0:  # with no replica idle the cap never acts
                # Outliers' speeds only: a fleet of mixed speeds held to the cap
                # (time_cap_mixed_speeds) asked its slow replicas to take their share.
                rows = self._cap_by_time(rows, replicas, speeds, None if mixed else priced,
                                         cold=best_match == 0, idle_fleet=busy == 0.0)
        eligible_rows = [row for row in rows if row[4]]
        if not eligible_rows:
            least = min(r.inflight for r in replicas)
            eligible_rows = [row for row, r in zip(rows, replicas, strict=True)
                             if r.inflight == least]
        min_cost = min(row[0] for row in eligible_rows)
        slack = self.slack_fraction * prompt_tokens + self.slack_tokens
        near = [row for row in eligible_rows if row[0] <= min_cost + slack]
        top = max(row[1] for row in near)
        longest = [row for row in near if row[1] == top]
        # Ties are judged without the step wait, which changes from one millisecond to the
        # next: it must not keep balancing from seeing the replicas that are really even.
        # Nor, among replicas holding as much of a prompt some of them hold, at the full
        # in-flight price: one more decoding sequence costs the request a millisecond or two a
        # step, and the full price sent it past a step ending sooner, or past a shorter queue,
        # to a replica with fewer in flight (RAGPulse at 32 replicas: 5% behind the oracle).
        # A cold request keeps the full price: it may start a session whose later turns follow
        # it, and the requests in flight stand for those a replica already serves.
        if top > 0 and tie_per_request is not None:
            tie_costs = [row[7] for row in longest]
        else:
            tie_costs = [row[8] for row in longest]
        cheapest = min(tie_costs)
        ties = [row for row, tie_cost in zip(longest, tie_costs, strict=True)
                if tie_cost <= cheapest + self.tie_tokens]
        if len(ties) > 1 and self.wait_first:
            # The step wait is what this request itself waits; the recent prefill, a guess at
            # what later ones will (in tokens summed over the window, it outweighed any wait).
            # With balance_horizon 0 nothing is recorded and the recent prefill is 0 for all.
            chosen = min(ties, key=lambda row: (row[6], self._recent_work(row[5]), -row[2]))
        elif self.balance_horizon > 0 and len(ties) > 1:
            bw = self.balance_weight
            chosen = min(ties, key=lambda row: (bw * self._recent_work(row[5]) + row[6],
                                                -row[2]))
        else:
            chosen = max(ties, key=lambda row: row[2])

        if best_match == 0:
            # Nobody holds any of it: cold, wherever it goes (its rendezvous owner, or the
            # replica with the least recent prefill when balancing).
            reason = REASON_COLD
        else:
            reason = REASON_AFFINITY if chosen[1] >= best_match else REASON_OVERFLOW

        others = sorted(
            (row for row in rows if row is not chosen),
            key=lambda row: (not row[4], row[0], -row[1], -row[2]),
        )
        return Decision(
            replica=chosen[5],
            reason=reason,
            matched_blocks=chosen[1],
            total_blocks=len(hashes),
            uncached_tokens=chosen[3],
            fallbacks=[row[5] for row in others],
        )

    def _cap_by_time(self, rows: list[Row], replicas: Sequence[ReplicaView],
                     speeds: Sequence[float], priced: Sequence[float] | None, cold: bool,
                     idle_fleet: bool) -> list[Row]:
        """`rows` with those over the time cap made ineligible (see `time_cap`), while a
        replica under it has no prefill queued, but those holding a long context
        (`idle_cap_recompute_tokens`): on an `idle_fleet` (none has) always, else while
        within `held_time_cap`; and where it allows only replicas `priced` slower than the
        pool, those where the request's prefill takes that much less time
        (`slow_cap_spare`); a `cold` prompt (no replica holds any of it) that would pass the
        cap on every replica, eligible only where an idle replica is left with the least
        recent prefill; else `rows` as they are."""
        recent = [self._recent_work(row[5]) for row in rows]
        total = sum(recent)
        cap = self.time_cap / len(rows)
        # The request's own prefill on each replica, in time at its speed.
        owns = [row[3] / speed for row, speed in zip(rows, speeds, strict=True)]
        allowed: list[bool] = []
        idle_under = eligible_under = False
        for row, rec, own, r in zip(rows, recent, owns, replicas, strict=True):
            ok = rec + own <= cap * (total + own)
            allowed.append(ok)
            if ok:
                idle_under = idle_under or r.pending_prefill_tokens <= 0.0
                eligible_under = eligible_under or row[4]
        if not idle_under and cold:
            # A cold prompt longer than a replica's share of the window passes the cap
            # everywhere. Left to the cost, it went to the idle replica with the fewest
            # requests in flight, often the one the cap had kept idle for being the most
            # past it (agent loops on 32 replicas: one replica at 1.21 of the mean). With no
            # holder to lose, it goes to the idle replica it leaves with the least.
            after = [rec + own for rec, own in zip(recent, owns, strict=True)]
            floor = min((a for a, r in zip(after, replicas, strict=True)
                         if r.pending_prefill_tokens <= 0.0), default=None)
            if floor is not None:
                allowed = [a <= floor for a in after]
                idle_under = True
                eligible_under = any(a and row[4] for a, row in zip(allowed, rows, strict=True))
        if idle_under and not all(allowed) and self.idle_cap_recompute_tokens is not None:
            if self.slow_cap_spare and priced is not None and all(
                    p < 1.0 for p, a in zip(priced, allowed, strict=True) if a):
                # At any load: on the slow replica the request's prefill takes several times
                # as long, work the cap makes rather than moves, and a held context copied
                # there is no second home (the costs send later requests for it elsewhere).
                # On the slow fleet's Mooncake the cap sent cold 51k- and 76k-token prompts
                # there, 26 s and 46 s of TTFT, with fast replicas idle of prefill.
                allowed = self._spare_held(allowed, owns)
            elif idle_fleet:
                allowed = self._spare_held(allowed, [row[3] for row in rows])
            elif self.held_time_cap is not None:
                # Moved, a held context is computed again where it goes: the balance that
                # buys is the mean rising, not the holder's share falling. On document Q&A a
                # question whose 17k-22k-token document was held by a replica just past the
                # cap went to compute it again (2.4-3.3 s of TTFT where the holder took
                # 0.2-0.4 s). Only up to held_time_cap, or a hot document's holder takes more
                # and more of the prefill (imbalance by time 1.20-1.23 without the limit).
                limit = self.held_time_cap / len(rows)
                spared = self._spare_held(allowed, [row[3] for row in rows])
                allowed = [a or (spare and rec + own <= limit * (total + own)) for a, spare,
                           rec, own in zip(allowed, spared, recent, owns, strict=True)]
        # Only idle capacity is worth balancing onto: with every replica under the cap
        # queued, moving work there queues it behind prefill (on the mixed fleet near
        # saturation, the slow half queued and the fast half not, mean TTFT 3x).
        if not idle_under or all(allowed):
            return rows
        if not eligible_under:
            # Over the in-flight bound too: the time cap decides, the bound is the softer one.
            return [(*row[:4], a, *row[5:]) for a, row in zip(allowed, rows, strict=True)]
        return [(*row[:4], a and row[4], *row[5:]) for a, row in zip(allowed, rows, strict=True)]

    def _spare_held(self, allowed: list[bool], prefill: Sequence[float]) -> list[bool]:
        """`allowed`, with every replica the cap left out where the request's `prefill`
        (its uncached tokens, or their time at the replica's speed) is at least
        `idle_cap_recompute_tokens` less than on each replica it allows allowed again."""
        # On an idle fleet the request's TTFT is its own prefill, and the prefill the cap
        # moves is not moved but made: computed again where it goes, while the holder's
        # idle time balances nothing. At the end of document Q&A a few long conversations
        # were left, their holders past the cap on a window of their own turns, and turns
        # were sent to compute 38k-74k-token contexts again (6-13 s, against 0.5-0.7 s).
        # Only long contexts: shorter ones (from 8,192 tokens) cost agent loops 1.2%.
        least = min(p for p, a in zip(prefill, allowed, strict=True) if a)
        spare = least - self.idle_cap_recompute_tokens
        return [a or p <= spare for a, p in zip(allowed, prefill, strict=True)]

    def _start_returning(self, rows: list[Row]) -> None:
        """A replica that joins, or comes back from longer than the window out of the views
        (unhealthy), starts at no less than the others' mean (raised in the window): with its
        recent prefill at nothing or decayed, it alone would be under the cap and take every
        request until it caught up."""
        now = self._decisions
        names = tuple([row[5] for row in rows])
        if names == self._cap_names:
            # The same views as the cap's last decision: every one seen then, none back.
            self._cap_at = now
            return
        seen_at = self._seen_at
        for name in self._cap_names:  # seen up to the last decision with the old views
            seen_at[name] = self._cap_at
        self._cap_names, self._cap_at = names, now
        gone = now - self.balance_horizon
        back = [name for name in names if seen_at.get(name, gone) <= gone] if seen_at else []
        for name in names:
            seen_at[name] = now
        if not back or len(back) == len(names):
            return
        others = [self._recent_work(name) for name in names if name not in back]
        start = sum(others) / len(others)
        for name in back:
            if self._recent_work(name) < start:
                self._recent[name] = (start, now)

    def _spread(self, speeds: Sequence[float], slowest: float, fastest: float) -> bool:
        """Whether the speeds (`slowest` to `fastest`) are those of a fleet of mixed speeds
        (`own_speed_spread`)."""
        spread = self.own_speed_spread
        if spread <= 1.0:
            return True
        if fastest < spread * slowest:  # equal replicas: no sort on every request
            return False
        ranked = sorted(speeds)
        n = len(ranked)
        return ranked[(3 * n - 1) // 4] >= spread * ranked[n // 4]

    def _outlier_speeds(self, speeds: list[float], slowest: float, fastest: float,
                        busy: float) -> list[float] | None:
        """On a fleet that is not one of mixed speeds, the speeds to price each request's own
        prefill at (`own_speed_outliers`): a replica more than `own_speed_spread` off the
        pool's rate at its own, the others at the pool's; None while no replica is that far
        off, or every replica has prefill queued.

        With one slow replica in eight the quartiles are equal, and its cold prompts and
        partial hits looked as cheap as a fast replica's: the sessions they started stayed
        there at three times the cost of every turn. Strays within the spread (equal
        replicas' learned speeds on long chunked prompts) are left alone, as by `_spread`."""
        if not self.own_speed_outliers or busy >= 1.0:
            return None
        lo, hi = 1.0 / self.own_speed_spread, self.own_speed_spread
        if slowest >= lo and fastest <= hi:
            return None
        return [v if v < lo or v > hi else 1.0 for v in speeds]

    def _bounds(self, replicas: Sequence[ReplicaView], busy: float, own: bool) -> list[int]:
        """Each replica's in-flight limit: ceil(c x mean) + `load_allowance`. While at least
        `speed_bound` of the replicas have prefill queued (`busy`) and every replica slower
        than the replicas' mean speed is among them, or at any load when `own_speed` acts on
        the decision (`own`: the request's own prefill is priced at the speed, and the common
        limit would turn cheap requests away from the fast replicas), one faster than that
        mean gets the mean scaled by its speed over it instead.

        Never lower: a slow replica's share is its price's business (its queue at its speed);
        scaled both ways, the limits put more prefill time on the slow replica of the slow
        fleet (tenants at heavy load: imbalance by time 1.15 to 1.20). Only on a busy fleet
        whose slow replicas are all queued: what the common limit turns away from a fast
        replica is then a miss that waits behind a slow queue and takes KV cache from a
        second replica. With a slow replica idle, or most replicas idle, it is prefill taken
        at once, and the common limit keeps the fast replicas from taking all the prefill
        (prefill imbalance by time past 1.15 on the mixed fleet's tenants otherwise)."""
        common = load_bound(replicas, self.load_factor)
        if own or (self.speed_bound is not None and busy >= self.speed_bound):
            speeds = [r.busy_speed if self.busy_speed and r.busy_speed is not None
                      else r.speed if r.speed > 0.0 else 1.0 for r in replicas]
            mean_speed = sum(speeds) / len(speeds)
            if any(sp > mean_speed for sp in speeds) and (own or all(
                    r.pending_prefill_tokens > 0.0
                    for r, sp in zip(replicas, speeds, strict=True) if sp < mean_speed)):
                mean = self.load_factor * (sum(r.inflight for r in replicas) + 1) / len(replicas)
                return [max(common, math.ceil(mean * sp / mean_speed)) + self.load_allowance
                        for sp in speeds]
        return [common + self.load_allowance] * len(replicas)

    def on_removed(self, replica: str) -> None:
        self._recent.pop(replica, None)
        self._seen_at.pop(replica, None)
        self._cap_names = tuple(name for name in self._cap_names if name != replica)
        self._speeds.forget(replica)

    def on_remote_routed(self, replica: str, uncached_tokens: float) -> None:
        # Balancing on this gateway's decisions alone, gateways sharing an index break the
        # same tie (a prefix held by two replicas) each its own way; counting every gateway's
        # prefill, and moving the decision clock for each, they balance as one gateway would.
        if self.balance_horizon > 0:
            self._decisions += 1
            self._recent[replica] = (self._recent_work(replica) + self._speeds.time_of(
                replica, uncached_tokens), self._decisions)

    def _pending(self, r: ReplicaView) -> float:
        """The replica's queued prefill: drained at the learned rate when that is on and
        known (a long prompt mostly computed no longer counts whole)."""
        if (self.drain_pending and r.prefill_left_tokens is not None
                and not (self.waiting_stops_drain and self._blocked(r))):
            return r.prefill_left_tokens
        return r.pending_prefill_tokens

    @staticmethod
    def _mean_kv_usage_at_least(replicas: Sequence[ReplicaView], usage: float) -> bool:
        """Whether the engines that report KV usage use `usage` of it on average."""
        total, known = 0.0, 0
        for r in replicas:
            if r.kv_usage is not None:
                total += r.kv_usage
                known += 1
        return known > 0 and total >= usage * known

    def _blocked(self, r: ReplicaView) -> bool:
        """Whether r's engine, as last scraped, has requests it cannot admit for want of KV."""
        return r.engine_waiting > 0 and (self.waiting_kv_usage <= 0.0 or (
            r.kv_usage is not None and r.kv_usage >= self.waiting_kv_usage))

    def on_routed(self, request: RoutingRequest, decision: Decision) -> None:
        # Here rather than in choose(), so that a retry's prefill counts on the replica that
        # really got it; the decision clock only moves in choose(), once per request.
        if self.balance_horizon > 0:
            name = decision.replica
            self._recent[name] = (self._recent_work(name) + self._speeds.time_of(
                name, decision.uncached_tokens), self._decisions)
