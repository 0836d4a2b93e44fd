"""Admission control: per traffic class a concurrency limit and a bounded priority queue, per
pool a capacity; which pool a request may use (its own, or a lender's idle share), and when.

A request holds one slot from admission until its reply is done (every retry, and a stream
until its body is closed). Routing happens after admission, on the granted pool, so it sees
the load of the moment the request leaves the queue.

The rule that keeps this simple: whenever something frees up (a slot is released, a pool's
capacity grows, a waiter leaves), everything that can be granted is granted at once, in order.
So between events no waiter could be granted, and a new request with an empty queue ahead of it
may take a free slot without passing anyone.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Iterable
from time import perf_counter

from backends.pool import Pool
from gateway.config import AdmissionConfig, GatewayConfig
from gateway.errors import GatewayError, no_replica
from gateway.exchange import ClientLink
from gateway.observe import Observer

QUEUE_FULL = "queue_full"
QUEUE_TIMEOUT = "queue_timeout"
CLIENT_GONE = "client_gone"
_CANCELLED = "cancelled"
_NO_REPLICA = "no_replica"


class Refused(GatewayError):
    """429: the class's queue is full, or the request waited its longest; retry later."""

    def __init__(self, message: str, code: str, retry_after: bytes) -> None:
        super().__init__(429, message, type="rate_limit_error", code=code,
                         headers=[(b"retry-after", retry_after)])


class PoolGate:
    """A pool with a capacity: `max_inflight_per_replica` x its usable replicas."""

    __slots__ = ("borrowed", "capacity", "inflight", "name", "per_replica", "pool", "reserved",
                 "users")

    def __init__(self, pool: Pool, per_replica: int, reserved: float) -> None:
        self.pool = pool
        self.name = pool.name
        self.per_replica = per_replica
        self.reserved = reserved
        self.capacity = 0  # no replica is known healthy before the first probes
        self.inflight = 0
        """Requests granted here, of every class."""
        self.borrowed = 0
        """Of which requests of classes that borrow the pool."""
        self.users: list[ClassGate] = []
        """The classes that may use the pool, in the order a freed slot is offered to them."""

    def refresh(self) -> None:
        """Capacity from the replicas routing can use: the healthy ones, or if none, those
        whose health checks only timed out (as `Pool.healthy_views` chooses)."""
        replicas = self.pool.replicas.values()
        usable = sum(r.healthy for r in replicas) or sum(r.suspect for r in replicas)
        self.capacity = self.per_replica * usable

    @property
    def lendable(self) -> int:
        """The most borrowed work the pool takes: all but its reserved share."""
        return int((1.0 - self.reserved) * self.capacity + 1e-9)

    def lends(self, while_below: float) -> bool:
        """One more borrowed request may start here: the pool's own load is below the
        borrower's threshold, and the borrowed work stays out of the reserved share."""
        return self.inflight < self.capacity * while_below and self.borrowed < self.lendable

    def load_fraction(self) -> float:
        return self.inflight / self.capacity if self.capacity else 1.0


class _Waiter:
    __slots__ = ("fut", "left", "model", "since", "timer")

    def __init__(self, fut: asyncio.Future, model: str) -> None:
        self.fut = fut
        self.model = model
        self.since = perf_counter()
        self.left = False
        """Out of the queue (granted, timed out, gone); its heap entry is dropped lazily."""
        self.timer: asyncio.TimerHandle | None = None


class ClassGate:
    """A traffic class under admission control: its limits, its queue, its slots in use."""

    __slots__ = ("by_pool", "depth", "index", "inflight", "lenders", "max_inflight",
                 "max_queue", "max_wait", "name", "own", "pool", "priority", "queue",
                 "retry_after")

    def __init__(self, name: str, index: int, priority: int, cfg: AdmissionConfig, pool: Pool,
                 own: PoolGate | None, lenders: list[tuple[PoolGate, float]]) -> None:
        self.name = name
        self.index = index
        self.priority = priority
        self.pool = pool
        self.own = own
        """Its own pool's gate; None when that pool is unlimited."""
        self.lenders = lenders
        """(pool, while_below) it may borrow, in the configured order."""
        self.max_inflight = cfg.max_inflight
        self.max_queue = cfg.max_queue
        self.max_wait = cfg.max_queue_wait_s
        self.retry_after = str(cfg.retry_after_s).encode()
        self.inflight = 0
        self.by_pool: dict[str, int] = {}
        self.queue: list[tuple[int, int, _Waiter]] = []
        """Heap of (-priority, arrival, waiter): higher priority first, then first come."""
        self.depth = 0
        """Waiters still in the queue (the heap may also hold some that left)."""

    def pools(self) -> list[Pool]:
        return [self.pool, *(lender.pool for lender, _ in self.lenders)]


class Grant:
    """A slot: the pool to route on, held until `release()`; releasing twice is harmless."""

    __slots__ = ("_admission", "borrowed", "cls", "gate", "per_replica", "pool", "released")

    def __init__(self, admission: Admission, cls: ClassGate, gate: PoolGate | None, pool: Pool,
                 borrowed: bool) -> None:
        self._admission = admission
        self.cls = cls
        self.gate = gate
        self.pool = pool
        self.per_replica = gate.per_replica if gate is not None else None
        """Routing sees only replicas with fewer requests in flight than this (None: all)."""
        self.borrowed = borrowed
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._admission.release(self)


class Admission:
    """Every class and pool under admission control (none when nothing is configured)."""

    def __init__(self, config: GatewayConfig, pools: dict[str, Pool],
                 observer: Observer) -> None:
        self.observer = observer
        self.pools: dict[str, PoolGate] = {
            p.name: PoolGate(pools[p.name], p.max_inflight_per_replica, p.reserved_fraction)
            for p in config.pools if p.max_inflight_per_replica is not None}
        self.classes: dict[str, ClassGate] = {}
        for i, c in enumerate(config.traffic_classes):
            cfg = config.admission_for(c)
            if cfg is not None:
                lenders = [(self.pools[b.pool], b.while_below) for b in cfg.borrow]
                self.classes[c.name] = ClassGate(c.name, i, c.priority, cfg, pools[c.pool],
                                                 self.pools.get(c.pool), lenders)
        for gate in self.pools.values():
            users = [g for g in self.classes.values()
                     if g.own is gate or any(lender is gate for lender, _ in g.lenders)]
            # Class rank first; at equal rank the pool's own classes before borrowers.
            users.sort(key=lambda g, gate=gate: (-g.priority, g.own is not gate, g.index))
            gate.users = users
        self.waiting = 0
        """Waiters in every queue: with none, a release has nobody to wake."""
        self._arrivals = itertools.count()

    def started(self) -> None:
        """Capacities from the first health checks, every series at zero."""
        for gate in self.pools.values():
            gate.refresh()
        self.observer.admission_started(
            {g.name: [p.name for p in g.pools()] for g in self.classes.values()},
            {name: gate.capacity for name, gate in self.pools.items()})

    # Health ---------------------------------------------------------------------------------

    def health_changed(self, pool: str) -> None:
        """A replica of `pool` was probed or failed: its capacity may have changed."""
        gate = self.pools.get(pool)
        if gate is None:
            return
        before = gate.capacity
        gate.refresh()
        if gate.capacity == before:
            return
        self.observer.admission_capacity(pool, gate.capacity)
        if not self.waiting:
            return
        if gate.capacity > before:
            self._offer(gate.users)
        elif gate.capacity == 0:
            # A dead pool answers 503 at once, as without admission control; only a class
            # that may borrow elsewhere keeps waiting.
            for g in gate.users:
                if g.own is gate and not g.lenders:
                    while g.depth:
                        self._leave(g, self._head(g), _NO_REPLICA)

    # Requests -------------------------------------------------------------------------------

    def try_now(self, g: ClassGate, model: str) -> Grant | None:
        """A slot at once if nobody of the class waits and one is free, else None."""
        if g.depth:
            return None
        return self._try(g, model, 0.0)

    async def wait(self, g: ClassGate, model: str, priority: int, link: ClientLink) -> Grant | None:
        """Queue until a slot is granted. None if the client left meanwhile; raises `Refused`
        (429) when the queue is full or the wait too long, and the 503 of a pool with no
        healthy replica when the class has nowhere else to go."""
        own = g.own
        if own is not None and own.capacity == 0 and not g.lenders:
            raise no_replica(g.pool.name)
        if g.depth >= g.max_queue:
            self.observer.admission_rejected(g.name, QUEUE_FULL)
            raise Refused(f"Too many requests of traffic class {g.name!r} are waiting "
                          f"({g.max_queue} queued); retry later.", QUEUE_FULL, g.retry_after)
        loop = asyncio.get_running_loop()
        w = _Waiter(loop.create_future(), model)
        heapq.heappush(g.queue, (-priority, next(self._arrivals), w))
        g.depth += 1
        self.waiting += 1
        self.observer.queue_depth(g.name, g.depth)
        w.timer = loop.call_later(g.max_wait, self._leave, g, w, QUEUE_TIMEOUT)
        link.queued(lambda: self._leave(g, w, CLIENT_GONE))
        try:
            outcome = await w.fut
        except asyncio.CancelledError:
            if not w.left:
                self._leave(g, w, _CANCELLED)
            elif not w.fut.cancelled() and isinstance(w.fut.result(), Grant):
                w.fut.result().release()  # granted, but cancelled before it could run
            raise
        finally:
            link.queued(None)
        if isinstance(outcome, Grant):
            return outcome
        if outcome == CLIENT_GONE:
            return None
        if outcome == QUEUE_TIMEOUT:
            raise Refused(f"Waited {g.max_wait:g} s for a slot in traffic class {g.name!r} "
                          "without getting one; retry later.", QUEUE_TIMEOUT, g.retry_after)
        raise no_replica(g.pool.name)

    def release(self, grant: Grant) -> None:
        """A request is done with its slot (use `Grant.release`): wake whom it can serve."""
        g, gate = grant.cls, grant.gate
        g.inflight -= 1
        g.by_pool[grant.pool.name] -= 1
        if gate is not None:
            gate.inflight -= 1
            if grant.borrowed:
                gate.borrowed -= 1
        self.observer.admission_released(g.name, grant.pool.name)
        if self.waiting:
            if gate is not None:
                self._offer(gate.users)
            self._offer((g,))  # its class limit may have been what held its queue

    # Inside ---------------------------------------------------------------------------------

    def _try(self, g: ClassGate, model: str, waited_s: float) -> Grant | None:
        """A slot for a request of `g` if one is free: its own pool first, then the lenders
        that serve `model` and lend at the moment."""
        if g.max_inflight is not None and g.inflight >= g.max_inflight:
            return None
        own = g.own
        if own is None or own.inflight < own.capacity:
            return self._grant(g, own, g.pool, False, waited_s)
        for lender, below in g.lenders:
            if lender.lends(below) and model in lender.pool.models:
                return self._grant(g, lender, lender.pool, True, waited_s)
        return None

    def _grant(self, g: ClassGate, gate: PoolGate | None, pool: Pool, borrowed: bool,
               waited_s: float) -> Grant:
        g.inflight += 1
        g.by_pool[pool.name] = g.by_pool.get(pool.name, 0) + 1
        if gate is not None:
            gate.inflight += 1
            if borrowed:
                gate.borrowed += 1
        self.observer.admitted(g.name, pool.name, waited_s, borrowed)
        return Grant(self, g, gate, pool, borrowed)

    def _offer(self, classes: Iterable[ClassGate]) -> None:
        """Grant the heads of these classes' queues, in this order, while slots allow."""
        for g in classes:
            while g.depth:
                w = self._head(g)
                grant = self._try(g, w.model, perf_counter() - w.since)
                if grant is None:
                    break
                self._dequeue(g, w)
                w.fut.set_result(grant)

    def _head(self, g: ClassGate) -> _Waiter:
        queue = g.queue
        while queue[0][2].left:
            heapq.heappop(queue)
        return queue[0][2]

    def _dequeue(self, g: ClassGate, w: _Waiter) -> None:
        w.left = True
        if w.timer is not None:
            w.timer.cancel()
        g.depth -= 1
        self.waiting -= 1
        self.observer.queue_depth(g.name, g.depth)
        if len(g.queue) > 2 * g.depth + 64:
            # Entries of waiters that left are dropped lazily; under a flood that keeps timing
            # out, rebuild the heap before they pile up.
            g.queue = [e for e in g.queue if not e[2].left]
            heapq.heapify(g.queue)

    def _leave(self, g: ClassGate, w: _Waiter, reason: str) -> None:
        """`w` leaves the queue without a slot: timed out, its client left, cancelled, or its
        pool died."""
        if w.left:
            return
        self._dequeue(g, w)
        self.observer.left_queue(g.name, perf_counter() - w.since)
        if reason == QUEUE_TIMEOUT:
            self.observer.admission_rejected(g.name, QUEUE_TIMEOUT)
        if not w.fut.done():
            w.fut.set_result(reason)
        if self.waiting:
            self._offer((g,))  # the next in line may borrow where this one could not
