"""A pool's router: prefix indexes per replica, a policy, the load it caused, and its events."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from routing.hashing import char_block_hashes, key_hash
from routing.load import NO_LOAD, LoadTracker, RemoteLoad
from routing.policies import Policy
from routing.policies.base import decide
from routing.prefix_index import PrefixIndex
from routing.steps import DECODE_AGREES, POOL_RATE_KEY, RateSums
from routing.types import REASON_RETRY, Decision, ReplicaView, RoutingRequest

REMOTE_PINS_PER_SOURCE = 65536
"""Prefixes another gateway's running requests may hold pinned in a router at once: past
it (its releases lost, it never said so) the oldest are released."""


class Router:
    """Routes requests of one pool: owns the replicas' prefix indexes, the policy and the load.

    The caller reports each request's life to it (`dispatched`, `chunk`, `first_token`,
    `finished`), and the router keeps `load` and tells the policy; it never reaches past the
    policy's hooks, so a new policy needs no change here or in the caller.

    The index is updated synchronously at decision time, before the request is even sent, so a
    burst of requests with the same new prefix follows the first one instead of scattering
    (an asynchronous insert leaves a window in which every request of the burst looks cold).
    """

    def __init__(
        self,
        replicas: Iterable[str],
        policy: Policy,
        *,
        block_chars: int = 256,
        chars_per_token: float = 4.0,
        index_capacity_blocks: int = 16384,
        key_blocks: int = 1,
        prefill_tokens_per_s: float | None = None,
        speed_decode_agrees: float = DECODE_AGREES,
        pin_running: bool = False,
        output_reserve: float = 1.0,
        output_cached: bool = False,
        decode_step_wait: bool = True,
        engine_speed: bool = True,
    ) -> None:
        self.policy = policy
        # Most policies ignore these hooks: skip the calls (several a request) when they do.
        self._tell_load = type(policy).on_load_update is not Policy.on_load_update
        self._tell_finished = type(policy).on_finished is not Policy.on_finished
        self._tell_remote = type(policy).on_remote_routed is not Policy.on_remote_routed
        self.block_chars = block_chars
        self.chars_per_token = chars_per_token
        self.key_blocks = max(1, key_blocks)
        self.default_capacity = index_capacity_blocks
        self.pin_running = pin_running
        self.output_reserve = output_reserve
        """With `pin_running`, the share of a running request's `output_tokens` its engine
        holds KV for (1.0: reserved whole at admission; vLLM allocates as it decodes)."""
        self.output_cached = output_cached
        """With `pin_running`, a finished request's output stays in its replica's index as
        blocks no prompt matches, the tokens it generated (`finished`): its engine keeps
        them cached, and they push out older prefixes."""
        self.load = LoadTracker(prefill_tokens_per_s, speed_decode_agrees, decode_step_wait,
                                engine_speed)
        self.indexes: dict[str, PrefixIndex] = {}
        self._block_tokens = 0.0
        """Tokens per block of the last prefix recorded (a pool hashes all its requests
        alike): the unit of the room an index lends to queued prefill, and of the outputs it
        keeps (`pin_running`, `output_cached`)."""
        self.on_record: Callable[[str, Sequence[int], float, bool, int], None] | None = None
        """Told of every prefix this router records as sent (first choices and retries), with
        the uncached prompt tokens it costs there, whether a request holds it there until
        `on_release` says it ended (its decision's, with `pin_running`) and the blocks its
        output holds there meanwhile, after its own index has it: how the gateway shares its
        decisions with other gateways."""
        self.on_release: Callable[[str, int, int], None] | None = None
        """Told, with `pin_running`, when a request whose prefix `on_record` reported held
        ends: its replica, the last of its block hashes (a chained hash names the whole
        prefix) and the blocks of its output the engine keeps cached (`output_cached`; else
        0). Gateways sharing routing state pin what the others' requests hold while they
        run, and keep what they leave cached, as each does for its own."""
        self._remote_pins: dict[str, dict[tuple[str, int], list[Any]]] = {}
        """Other gateway (or worker) -> (replica, last hash) -> [its hashes, requests holding
        them, blocks their outputs hold]: the pins of their running requests, released when
        they end or leave."""
        for name in replicas:
            self.add_replica(name)

    # Membership -----------------------------------------------------------------------------

    def add_replica(self, name: str, capacity_blocks: int | None = None) -> None:
        if name not in self.indexes:
            self.indexes[name] = PrefixIndex(capacity_blocks or self.default_capacity)

    def remove_replica(self, name: str) -> None:
        """Forget what `name` holds: no prefix of the index leads there any more, and the
        policy drops its state of it. The load it still carries (requests in flight) stays
        counted until `forget_load`."""
        self.indexes.pop(name, None)
        self.policy.on_removed(name)

    def forget_load(self, name: str) -> None:
        """Drop the load counters of a replica that left for good (nothing in flight)."""
        self.load.forget(name)

    def resize_index(self, name: str, capacity_blocks: int) -> None:
        if name in self.indexes:
            self.indexes[name].resize(capacity_blocks)

    # Requests -------------------------------------------------------------------------------

    def request_from_text(self, text: str, traffic_class: str = "") -> RoutingRequest:
        """Hash a canonical prompt once; every later step reuses the hashes."""
        hashes = char_block_hashes(text, self.block_chars)
        request = self.request_from_hashes(hashes, len(text) / self.chars_per_token,
                                           self.block_chars / self.chars_per_token,
                                           text=text, traffic_class=traffic_class)
        request.prompt_chars = len(text)
        return request

    def request_from_hashes(
        self,
        hashes: list[int],
        prompt_tokens: float,
        block_tokens: float,
        *,
        text: str = "",
        traffic_class: str = "",
    ) -> RoutingRequest:
        if hashes:
            key = hashes[min(self.key_blocks, len(hashes)) - 1]
        else:
            # Shorter than one block: nothing to reuse, but a stable key still spreads them.
            key = key_hash(text)
        return RoutingRequest(
            hashes=hashes,
            prompt_tokens=prompt_tokens,
            block_tokens=block_tokens,
            key=key,
            traffic_class=traffic_class,
        )

    # Decisions ------------------------------------------------------------------------------

    def matched_blocks(self, replica: str, hashes: Sequence[int]) -> int:
        index = self.indexes.get(replica)
        return index.match(hashes) if index is not None else 0

    def route(self, request: RoutingRequest, replicas: Sequence[ReplicaView]) -> Decision:
        """Choose among `replicas` (healthy, non-empty) and record the prefix as sent there."""
        if not replicas:
            raise ValueError("no replica to route to")
        decision = self.policy.choose(request, replicas, self)
        self.commit(request, decision)
        return decision

    def reroute(self, request: RoutingRequest, previous: Decision, replica: str) -> Decision:
        """The decision for retrying `request` on `replica` (one of `previous.fallbacks`) after
        `previous` failed before any byte; the prefix is recorded there as sent."""
        # Matched before recording, as for a first choice: what the replica holds already.
        decision = decide(request, self, replica, REASON_RETRY,
                          [n for n in previous.fallbacks if n != replica])
        self.commit(request, decision)
        return decision

    def commit(self, request: RoutingRequest, decision: Decision) -> None:
        """`request` goes as `decision` says: the decision carries its blocks (pinned while
        it runs, with `pin_running`), the replica's index records them, the policy is told."""
        decision.hashes = request.hashes
        if self.pin_running and request.output_tokens > 0.0 and request.block_tokens > 0.0:
            decision.output_blocks = int(request.output_tokens * self.output_reserve
                                         / request.block_tokens)
        self.record(decision.replica, request.hashes, decision.uncached_tokens,
                    request.block_tokens, held=self.pin_running,
                    output_blocks=decision.output_blocks)
        self.policy.on_routed(request, decision)

    def record(self, replica: str, hashes: Sequence[int], uncached_tokens: float = 0.0,
               block_tokens: float = 0.0, held: bool = False, output_blocks: int = 0) -> None:
        """Note that `replica` now holds the prefix `hashes`, which cost it `uncached_tokens`
        of prefill (`commit` does this); `block_tokens`, the tokens in one of those blocks,
        sizes the room `pin_running` lends to prefill not computed yet (0: none); `held`: a
        request holds it there until `finished` (`on_release`), and `output_blocks` of the
        index's capacity for its output meanwhile."""
        index = self.indexes.get(replica)
        if index is not None and hashes:
            if self.pin_running and block_tokens > 0.0:
                # This request's uncached blocks, not dispatched yet, are queued there too. In
                # the request's own blocks: characters or the engine's tokens, as it was hashed.
                self._block_tokens = block_tokens
                index.room = self._room(replica, uncached_tokens)
            # From the decision, not the first token: it also gives the room back if it is
            # abandoned while queued, and the other gateways reserve it from the same moment.
            index.reserve(output_blocks)
            index.insert(hashes)
            if self.on_record is not None:
                self.on_record(replica, hashes, uncached_tokens, held, output_blocks)

    def _room(self, replica: str, unsent_tokens: float = 0.0) -> int:
        """The blocks `replica`'s index lends to prefill queued there: sent, by this gateway
        and by the others whose decisions it holds too, but not computed by the engine yet,
        so that they do not push out blocks the engine still holds (`pin_running`)."""
        block_tokens = self._block_tokens
        if not block_tokens:
            return 0
        load = self.load
        queued = load.pending_prefill.get(replica, 0.0) + unsent_tokens
        if load.remote:
            others = load.remote.get(replica)
            if others is not None:
                queued += others[1]
        return int(queued / block_tokens)

    # What other gateways decided (shared routing state) --------------------------------------

    def apply_remote_inserts(self, inserts: Iterable[tuple[Any, ...]],
                             source: str | None = None) -> int:
        """Record prefixes other gateways sent to replicas of this pool, (replica, hashes,
        uncached prompt tokens it cost there[, held[, output blocks]]), as if routed here: no
        `on_record` (they are not this router's decisions), and the policy is told through
        `on_remote_routed` only, so that what it balances on counts the whole fleet's
        decisions, as one gateway's would. Replicas this router does not know (removed, or not
        in its configuration) are skipped. With `pin_running`, a prefix `held` by a request of
        `source` (the gateway or worker that sent it) is pinned there until that request ends
        (`apply_remote_releases`) or `source` leaves (`release_remote_pins`), and its output
        blocks are reserved there as long. Returns the inserts applied."""
        applied = 0
        indexes = self.indexes
        tell = self.policy.on_remote_routed if self._tell_remote else None
        pin_running = self.pin_running
        pins = self._remote_pins.setdefault(source, {}) if (
            pin_running and source is not None) else None
        for replica, hashes, uncached, *held in inserts:
            index = indexes.get(replica)
            if index is not None and hashes:
                if pin_running:  # queued there too, as in `record`
                    index.room = self._room(replica, uncached)
                index.insert(hashes)
                if pins is not None and held and held[0]:
                    self._pin_remote(pins, index, replica, hashes,
                                     held[1] if len(held) > 1 else 0)
                applied += 1
                if tell is not None:
                    tell(replica, uncached)
        return applied

    def _pin_remote(self, pins: dict[tuple[str, int], list[Any]], index: PrefixIndex,
                    replica: str, hashes: Sequence[int], output_blocks: int) -> None:
        """Pin, from the other gateway's decision on, what its request holds: its own pin
        comes at the first token, but its blocks queued until then are lent room here as
        there, and a request abandoned before it is released all the same."""
        key = (replica, hashes[-1])
        held = pins.get(key)
        if held is None:
            if len(pins) >= REMOTE_PINS_PER_SOURCE:  # its releases were lost: the oldest go
                old_key, (old_hashes, count, old_output) = next(iter(pins.items()))
                del pins[old_key]
                self._unpin_remote(old_key[0], old_hashes, count, old_output)
            pins[key] = [hashes, 1, output_blocks]
        else:
            held[1] += 1
            held[2] += output_blocks
        index.reserve(output_blocks)
        index.pin(hashes)

    def _unpin_remote(self, replica: str, hashes: Sequence[int], count: int,
                      output_blocks: int, cached_blocks: int = 0) -> None:
        index = self.indexes.get(replica)
        if index is not None:  # else removed since: its index went with it
            index.unreserve(output_blocks)
            for _ in range(count):
                index.unpin(hashes, cached_blocks)
                cached_blocks = 0

    def apply_remote_releases(self, source: str, releases: Iterable[Sequence[Any]],
                              cached: Sequence[int] = ()) -> int:
        """Requests of `source` ended: (replica, last block hash) of each prefix it had sent
        `held`, and, in the same order, the blocks of each one's output its engine keeps
        cached (`cached`, as `on_release` tells them; missing: none). Their pins are
        released here (with `pin_running`), and with `output_cached` their outputs stay in
        the index as this router's own would; a release of nothing pinned (the pin was
        never applied) is ignored. Returns the pins released."""
        pins = self._remote_pins.get(source)
        if not pins:
            return 0
        released = 0
        keep = len(cached) if self.output_cached else 0
        for i, (replica, last) in enumerate(releases):
            held = pins.get((replica, last))
            if held is None:
                continue
            # Releases name the prefix, not the request: requests sharing it release an even
            # share of their outputs' blocks, the last one what is left.
            output_blocks = held[2] // held[1]
            held[1] -= 1
            held[2] -= output_blocks
            if not held[1]:
                del pins[(replica, last)]
            self._unpin_remote(replica, held[0], 1, output_blocks,
                               int(cached[i]) if i < keep else 0)
            released += 1
        return released

    def release_remote_pins(self, source: str | None = None) -> int:
        """Release every pin `source`'s requests hold here (None: every other gateway's): it
        left, or its releases may have been lost (an outage, a gap in what was read).
        Returns the requests' pins released."""
        sources = list(self._remote_pins) if source is None else [source]
        released = 0
        for name in sources:
            for (replica, _), (hashes, count, output_blocks) in self._remote_pins.pop(
                    name, {}).items():
                self._unpin_remote(replica, hashes, count, output_blocks)
                released += count
        return released

    def remote_pins(self, source: str | None = None) -> int:
        """Requests of other gateways (of `source`, or of all) whose prefixes are pinned here."""
        groups = self._remote_pins.values() if source is None else [
            self._remote_pins.get(source, {})]
        return sum(count for pins in groups for _, count, _ in pins.values())

    def apply_remote_load(self, loads: Mapping[str, RemoteLoad]) -> None:
        """The load other gateways have put on each replica now: replica -> (requests in
        flight, pending prefill tokens, of which left to compute), replacing what they
        reported before. Routing sees the sum of theirs and this router's own; `load.inflight`
        stays this router's own."""
        before = self.load.remote
        self.load.set_remote(loads)
        if not (self.pin_running or self._tell_load):
            return
        for replica in set(before) | set(self.load.remote):
            index = self.indexes.get(replica)
            if index is None:
                continue
            if self.pin_running:  # the others' queue there changed: so does the room
                index.lend(self._room(replica))
            if self._tell_load:
                self._load_update(replica)

    def apply_remote_rates(self, rates: Mapping[str, RateSums]) -> None:
        """What other gateways learned of each replica's speed, its own prefill rate and its
        throughput while busy (their `own_rates`, summed: `routing.steps.sum_rates`),
        and the pool's rate (under `POOL_RATE_KEY`), replacing what they shared before;
        replicas this router does not have are left out."""
        self.load.steps.set_remote_rates({name: sums for name, sums in rates.items()
                                          if name in self.indexes or name == POOL_RATE_KEY})

    def own_rates(self) -> dict[str, list[float]]:
        """What this router learned of each replica's speed and of the pool's rate, to share
        (`RateSums`)."""
        return self.load.steps.own_rates()

    # A request's life after the decision ---------------------------------------------------

    def dispatched(self, decision: Decision, sent_at: float | None = None,
                   blind_at: float | None = None) -> None:
        """The request was sent to `decision.replica` at `sent_at` (on the clock gateways
        sharing routing state read alike: `LoadTracker.dispatched`); `blind_at`: it will
        show no first token, and was sent then on the clock of the views."""
        self.load.dispatched(decision.replica, decision.uncached_tokens, sent_at, blind_at)
        if self._tell_load:
            self._load_update(decision.replica)

    def chunk(self, replica: str, now: float) -> None:
        """`replica` streamed a chunk at `now` (times its engine steps)."""
        self.load.chunk(replica, now)

    def first_token(self, decision: Decision, now: float, sent_at: float) -> None:
        """The request's first content token arrived at `now`; it was sent at `sent_at`. From
        now until it finishes its engine holds its prompt's blocks (`pin_running`)."""
        self.load.first_token(decision.replica, decision.uncached_tokens, now, sent_at,
                              cold=decision.matched_blocks == 0)
        if self.pin_running and decision.hashes:
            index = self.indexes.get(decision.replica)
            if index is not None:
                # Its prefill is computed: no longer lent room, held by the pin instead.
                index.room = self._room(decision.replica)
                index.pin(decision.hashes)
        if self._tell_load:
            self._load_update(decision.replica)

    def finished(self, decision: Decision, saw_first_token: bool,
                 output_tokens: int = 0) -> None:
        """The attempt `decision` ended (answered, failed or abandoned), having generated
        `output_tokens` (cached there with `output_cached`)."""
        self.load.finished(decision.replica, decision.uncached_tokens, saw_first_token)
        if self.pin_running and decision.hashes:
            index = self.indexes.get(decision.replica)
            cached = self._output_blocks(output_tokens) if saw_first_token else 0
            if index is not None:
                # Its prefill, computed or abandoned, is no longer queued there.
                index.unreserve(decision.output_blocks)
                index.lend(self._room(decision.replica))
                if saw_first_token:
                    index.unpin(decision.hashes, cached)
            if self.on_release is not None:
                self.on_release(decision.replica, decision.hashes[-1], cached)
        if self._tell_finished:
            self.policy.on_finished(decision, saw_first_token)
        if self._tell_load:
            self._load_update(decision.replica)

    def _output_blocks(self, output_tokens: int) -> int:
        """The index blocks `output_tokens` generated fill (`output_cached`): round, not floor,
        since on the engine the output's first block is shared with the prompt's partial last
        one, on average half of it."""
        if not self.output_cached or output_tokens <= 0 or not self._block_tokens:
            return 0
        return round(output_tokens / self._block_tokens)

    def _load_update(self, replica: str) -> None:
        load = self.load
        n, p, *_ = load.remote.get(replica, NO_LOAD)
        self.policy.on_load_update(replica, load.inflight.get(replica, 0) + n,
                                   load.pending_prefill.get(replica, 0.0) + p)
