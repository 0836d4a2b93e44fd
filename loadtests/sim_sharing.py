"""Simulated gateways sharing routing state in simulated time, as shared_routing does."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.config import SharedRoutingConfig
from gateway.shared_routing import (
    _BLOCK_S,
    RATES_INTERVAL_S,
    encode_load,
    encode_rates,
    insert_row,
    remote_insert,
)
from routing import Router
from routing.load import sum_loads
from routing.steps import sum_rates

_DEFAULTS = SharedRoutingConfig.model_fields
DEFAULT_FLUSH_INTERVAL_S: float = _DEFAULTS["flush_interval_s"].default
DEFAULT_LOAD_INTERVAL_S: float = _DEFAULTS["load_interval_s"].default


@dataclass(frozen=True, slots=True)
class Sharing:
    """How the simulated gateways share their routing state.

    `enabled` False: not at all (each routes on its own state; cold prefixes agree through
    rendezvous alone). Else as `SharedRouting` does, with its intervals and `delay_s` more
    from a write to its being readable (Redis's round trip). An interval of 0 means at once:
    the writer looks at its load after every change of it, and writes without waiting."""

    enabled: bool = True
    flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S
    load_interval_s: float = DEFAULT_LOAD_INTERVAL_S
    delay_s: float = 0.0
    read_interval_s: float | None = None
    """The reader's pause after a read (None: flush_interval_s)."""

    @property
    def read_pause_s(self) -> float:
        return self.flush_interval_s if self.read_interval_s is None else self.read_interval_s


@dataclass(slots=True)
class _Message:
    """One write of a gateway's stream: readable from `at`."""

    at: float
    gateway: int
    inserts: bytes | None
    load: bytes | None
    rates: bytes | None = None
    releases: bytes | None = None
    cached: bytes | None = None


class _Writer:
    """One gateway's writer loop (`SharedRouting._write_loop`) as a state machine."""

    __slots__ = ("due", "last_load", "last_rates", "next_load", "queue", "rates_at",
                 "sleep_end")

    def __init__(self, start: float) -> None:
        self.queue: list[tuple[Any, ...]] = []
        """(replica, hashes, uncached, held, output blocks) inserts and (replica, last hash,
        cached output blocks) releases."""
        self.sleep_end = -math.inf  # when the sleep after its last write ends
        self.next_load = start  # when it next looks at its load
        self.due = start  # when it next runs one iteration (looks, and writes if it must)
        self.last_load: bytes | None = None
        self.last_rates: bytes | None = None
        self.rates_at = -math.inf  # when it last looked at its learned rates


class _Reader:
    """One gateway's reader loop (`SharedRouting._read_loop`): where it is in the messages."""

    __slots__ = ("cursor", "loads", "rates", "ready_at")

    def __init__(self, start: float) -> None:
        self.cursor = 0  # messages before it are applied (or its own)
        self.ready_at = start  # when its next blocking read begins
        self.loads: dict[int, dict[str, list[float]]] = {}
        self.rates: dict[int, dict[str, list[float]]] = {}


class Gateways:
    """`len(routers)` gateways over one pool: request k goes to gateway k % G. With `sharing`
    enabled, each gateway's writer and reader run as `SharedRouting`'s loops do, in simulated
    time: inserts (with the policy's `on_remote_routed`) and each gateway's `own_load`, encoded
    as it encodes them, reach the others when their reader next reads."""

    def __init__(self, routers: Sequence[Router], sharing: Sharing, start: float = 0.0) -> None:
        self.routers = list(routers)
        self.sharing = sharing
        self.now = start
        count = len(self.routers)
        self._on = sharing.enabled and count > 1
        self._writers = [_Writer(start) for _ in range(count)]
        self._readers = [_Reader(start) for _ in range(count)]
        self._messages: list[_Message] = []
        if self._on:
            for g, router in enumerate(self.routers):
                router.on_record = self._recorder(g)
                router.on_release = self._releaser(g)

    def gateway_of(self, k: int) -> int:
        return k % len(self.routers)

    def _recorder(self, g: int) -> Any:
        writer = self._writers[g]

        def recorded(replica: str, hashes: Sequence[int], uncached: float, held: bool,
                     output_blocks: int) -> None:
            writer.queue.append((replica, list(hashes), uncached, held, output_blocks))
            # The first insert queued wakes the writer (when its sleep is over).
            writer.due = min(writer.due, max(self.now, writer.sleep_end))

        return recorded

    def _releaser(self, g: int) -> Any:
        writer = self._writers[g]

        def released(replica: str, last: int, cached_blocks: int) -> None:
            # Written with the next write, as there.
            writer.queue.append((replica, last, cached_blocks))

        return released

    def changed(self, g: int, t: float) -> None:
        """Gateway g's load changed at t: with a load interval of 0 its writer looks now."""
        if self._on and self.sharing.load_interval_s <= 0.0:
            w = self._writers[g]
            w.due = min(w.due, max(t, w.sleep_end))

    # The event loop's side ------------------------------------------------------------------

    def next_time(self) -> float:
        """When the next write or read happens (inf: none pending)."""
        if not self._on:
            return math.inf
        t = min(w.due for w in self._writers)
        for h in range(len(self._readers)):
            t = min(t, self._next_read(h))
        return t

    def run_until(self, t: float) -> None:
        """Every write and read due at or before t, in time order (writes first on a tie)."""
        if not self._on:
            return
        while True:
            wt, g = min((w.due, i) for i, w in enumerate(self._writers))
            rt, h = min((self._next_read(i), i) for i in range(len(self._readers)))
            if min(wt, rt) > t:
                return
            if wt <= rt:
                self._write(g, wt)
            else:
                self._read(h, rt)

    def _write(self, g: int, t: float) -> None:
        """One iteration of the writer's loop at t (`SharedRouting.write`)."""
        s, w = self.sharing, self._writers[g]
        load_due = t >= w.next_load
        if load_due:
            w.next_load = t + s.load_interval_s if s.load_interval_s > 0.0 else math.inf
        batch, w.queue = w.queue, []
        load = rates = None
        if load_due or batch or s.load_interval_s <= 0.0:
            own = encode_load(self.routers[g])
            if own != w.last_load:
                load = w.last_load = own
            if t - w.rates_at >= RATES_INTERVAL_S:
                w.rates_at = t
                learned = encode_rates(self.routers[g])
                if learned != w.last_rates:
                    rates = w.last_rates = learned
        if batch or load is not None or rates is not None:
            # As shared_routing writes them: inserts by `insert_row`, releases as
            # releases_by_pool does, [replica, last hash], and their outputs' cached blocks.
            items = [insert_row(rep, t, h, u, held, o)
                     for rep, h, u, held, o in (i for i in batch if len(i) == 5)]
            ended = [i[:2] for i in batch if len(i) == 3]
            cached = [i[2] for i in batch if len(i) == 3]
            self._messages.append(_Message(
                t + s.delay_s, g, orjson.dumps(items) if items else None, load, rates,
                orjson.dumps(ended) if ended else None,
                orjson.dumps(cached) if any(cached) else None))
        w.sleep_end = t + s.flush_interval_s
        timer = max(w.sleep_end, w.next_load) if s.load_interval_s > 0.0 else math.inf
        w.due = timer if not w.queue else w.sleep_end

    def _next_read(self, h: int) -> float:
        """When gateway h's reader next applies something (inf: nothing to read).

        On the way it moves the reader past its own gateway's messages, which it never
        applies, and past the empty reads it would have made before the next message became
        readable: what the reader would have done by then in any case, so asking twice
        answers the same."""
        r = self._readers[h]
        msgs = self._messages
        i = r.cursor
        while i < len(msgs) and msgs[i].gateway == h:
            i += 1
        r.cursor = i
        if i == len(msgs):
            return math.inf
        at = msgs[i].at
        # A read blocks for _BLOCK_S, then returns empty and sleeps flush_interval_s before
        # blocking again: an entry written in that sleep waits for the next read.
        block, flush = _BLOCK_S, self.sharing.read_pause_s
        if r.ready_at + block <= at and flush > 0.0:
            periods = math.floor((at - r.ready_at) / (block + flush))
            r.ready_at += periods * (block + flush)
            if r.ready_at + block <= at:
                r.ready_at += block + flush
        return max(at, r.ready_at)

    def _read(self, h: int, t: float) -> None:
        """Gateway h reads every entry readable at t and applies it (`SharedRouting._apply`)."""
        r, router = self._readers[h], self.routers[h]
        msgs = self._messages
        load_changed = rates_changed = False
        i = r.cursor
        while i < len(msgs) and msgs[i].at <= t:
            m = msgs[i]
            i += 1
            if m.gateway == h:
                continue
            if m.load is not None:
                r.loads[m.gateway] = orjson.loads(m.load)
                load_changed = True
            if m.rates is not None:
                r.rates[m.gateway] = orjson.loads(m.rates)
                rates_changed = True
            if m.inserts is not None:
                router.apply_remote_inserts(map(remote_insert, orjson.loads(m.inserts)),
                                            str(m.gateway))
            if m.releases is not None:
                router.apply_remote_releases(str(m.gateway), orjson.loads(m.releases),
                                             orjson.loads(m.cached) if m.cached else ())
        r.cursor = i
        if load_changed:
            router.apply_remote_load(sum_loads(r.loads.values()))
        if rates_changed:
            router.apply_remote_rates(sum_rates(r.rates.values()))
        r.ready_at = t + self.sharing.read_pause_s

