"""The batch runner: claims lines under leases, runs them through the request core on the
batch traffic class, writes each result once, and moves batches through their statuses.

Every gateway sharing a Redis runs one. A line is run by whoever holds its lease; a lease is
renewed while its line runs, and one that lapses (its gateway died) is taken over. Results
are written with "first one wins", so a line taken over from a gateway that was only slow
still gives one line in the output. While Redis is unreachable, lines in flight finish and
their results wait in memory; nothing new starts until Redis answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import secrets
import socket
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from gateway.batch.execute import LineExecutor
from gateway.batch.files import FileStore
from gateway.batch.lifecycle import finalize, validate
from gateway.batch.lines import ENDPOINTS, response_line
from gateway.batch.store import TERMINAL, BatchStore, Claimed, now_s
from gateway.config import BatchConfig
from gateway.core import RequestCore
from gateway.observe import Observer
from gateway.redis_link import UNAVAILABLE, RedisLink

log = logging.getLogger("prefix_gateway.batch")


def gateway_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


@dataclass(slots=True)
class Result:
    batch_id: str
    index: str
    line: bytes
    ok: bool
    usage: tuple[int, int, int]
    """prompt, cached prompt and completion tokens."""


@dataclass(slots=True)
class Line:
    claimed: Claimed
    task: asyncio.Task | None = None
    sent: bool = False
    """A request is at a replica (cancelling lets such a line finish); set by the executor."""


@dataclass(slots=True)
class LocalBatch:
    """What this gateway holds of one batch."""

    chat: bool
    path: str
    lines: dict[str, Line] = field(default_factory=dict)
    gates: dict[int, asyncio.Event] = field(default_factory=dict)
    """Prefix group -> set once its leader's first token arrived (its prefix is cached)."""


class BatchRunner:
    def __init__(self, link: RedisLink, store: BatchStore, files: FileStore, core: RequestCore,
                 cfg: BatchConfig, traffic_class: str, models: Collection[str],
                 group_chars: int, observer: Observer) -> None:
        self.link = link
        self.store = store
        self.files = files
        self.core = core
        self.cfg = cfg
        self.traffic_class = traffic_class
        self.models = models
        self.group_chars = group_chars
        self.observer = observer
        self.executor = LineExecutor(core, traffic_class, observer)
        self.me = gateway_id()
        self.lease_ms = int(cfg.lease_s * 1000)
        self.local: dict[str, LocalBatch] = {}
        self.unwritten: list[Result] = []
        self.unreleased: list[tuple[str, str]] = []
        """Lines stopped before a result, whose leases go back to the batch."""
        self.wake = asyncio.Event()
        self._stopping = False

    # The loop -----------------------------------------------------------------------------

    async def run(self) -> None:
        """Until cancelled: write results, tend every active batch; leases are renewed
        beside, so that a long step (finalising a large batch) never lets them lapse."""
        renewer = asyncio.create_task(self._renew_loop(), name="batch-lease-renewal")
        try:
            await self._loop()
        finally:
            renewer.cancel()

    async def _loop(self) -> None:
        delay = 0.05
        while not self._stopping:
            self.wake.clear()  # before the work: a line ending during it wakes the next round
            try:
                await self._write_results()
                for batch_id in await self.store.active_ids():
                    await self._tend_safely(batch_id)
                self.link.mark_up()
                delay = 0.05
                wait = self.cfg.poll_interval_s
            except UNAVAILABLE as exc:
                self.link.mark_down(exc)
                delay = min(delay * 2, 2.0)
                wait = delay * random.uniform(0.5, 1.0)
            except Exception:  # a bug must not stop batches for good: log it, go on
                log.exception("batch runner step failed")
                wait = self.cfg.poll_interval_s
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), wait)

    async def _tend_safely(self, batch_id: str) -> None:
        """One batch's step; a bug in it is logged and does not hold up the others."""
        try:
            await self._tend(batch_id)
        except UNAVAILABLE:
            raise
        except Exception:
            log.exception("batch %s: step failed", batch_id)

    def halt(self) -> None:
        """The loop ends at its next turn."""
        self._stopping = True
        self.wake.set()

    async def stop(self) -> None:
        """Stop running lines and give back their leases, so another gateway (or this one,
        restarted) takes them at once; write what finished."""
        self.halt()
        tasks = [ln.task for lb in self.local.values() for ln in lb.lines.values() if ln.task]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        with contextlib.suppress(*UNAVAILABLE):
            await self._write_results()

    # Batches ------------------------------------------------------------------------------

    async def _tend(self, batch_id: str) -> None:
        batch = await self.store.get(batch_id)
        status = batch["status"] if batch else "gone"
        if batch is None or status in TERMINAL:
            self._drop(batch_id, abort=True)
            await self.store.retire(batch_id)
            return
        expired = now_s() >= int(batch["expires_at"])
        if status == "validating":
            # Validated even when its window has passed: it then expires with one error line
            # per request, so its owner learns which requests never ran (the window is in
            # whole seconds, so a short one can pass before the runner first looks).
            if await self.store.lock(batch_id, self.me, self.lease_ms):
                try:
                    await validate(self.store, self.files, batch, self.models,
                                   self.cfg.max_lines, self.group_chars)
                finally:
                    await self.store.unlock(batch_id, self.me)
                self.wake.set()
        elif status == "in_progress":
            done = int(batch.get("completed", 0)) + int(batch.get("failed", 0))
            if done >= int(batch["total"]):  # all done counts, even past the window
                await self._end(batch, "completed", ["in_progress"])
            elif expired:
                await self._end(batch, "expired", ["in_progress"])
            else:
                await self._claim(batch)
        elif status == "cancelling":
            self._drop(batch_id, abort=False)
            if batch.get("ending") or await self.store.live_leases(batch_id) == 0:
                await self._end(batch, "cancelled", ["cancelling"])
        elif status == "finalizing":
            await self._end(batch, batch.get("ending") or "completed", ["finalizing"])

    async def _end(self, batch: dict[str, str], kind: str, allowed: list[str]) -> None:
        """Finalise the batch as `kind`: the first gateway to get here takes its lock."""
        batch_id = batch["id"]
        if kind == "expired":
            self._drop(batch_id, abort=True)  # what still runs is too late
        status = "cancelling" if kind == "cancelled" else "finalizing"
        fields: dict[str, Any] = {"status": status, "ending": kind}
        if status == "finalizing" and "finalizing_at" not in batch:
            fields["finalizing_at"] = now_s()
        await self.store.transition(batch_id, allowed, **fields)
        if not await self.store.lock(batch_id, self.me, self.lease_ms):
            return
        try:
            fresh = await self.store.get(batch_id)
            if fresh and fresh["status"] == status:
                await finalize(self.store, self.files, fresh, kind)
        finally:
            await self.store.unlock(batch_id, self.me)
        self._drop(batch_id, abort=True)

    def _drop(self, batch_id: str, abort: bool) -> None:
        """Stop this gateway's lines of a batch: all of them, or (cancelling) those not yet
        at a replica, whose leases are given back."""
        lb = self.local.get(batch_id)
        if lb is None:
            return
        for ln in list(lb.lines.values()):
            if (abort or not ln.sent) and ln.task is not None:
                ln.task.cancel()
        if abort:
            self.local.pop(batch_id, None)

    async def _claim(self, batch: dict[str, str]) -> None:
        batch_id = batch["id"]
        lb = self.local.get(batch_id)
        if lb is None:
            path = batch["endpoint"]
            lb = self.local[batch_id] = LocalBatch(ENDPOINTS[path], path)
        room = self.cfg.concurrency - len(lb.lines)
        if room <= 0:
            return
        for c in await self.store.claim(batch_id, self.me, self.lease_ms, room):
            if c.index in lb.lines:
                continue  # ours already, its lease had lapsed while Redis was away
            if c.leader and c.group not in lb.gates:
                lb.gates[c.group] = asyncio.Event()
            line = lb.lines[c.index] = Line(c)
            line.task = asyncio.create_task(self._run_line(batch_id, lb, line))
            self.observer.batch_inflight(1)

    # Leases and results -------------------------------------------------------------------

    async def _renew_loop(self) -> None:
        while True:
            await asyncio.sleep(min(self.cfg.lease_s / 3, self.cfg.poll_interval_s))
            try:
                await self._renew()
            except UNAVAILABLE:
                pass  # the main loop notices and logs; a lease renewed late may lapse
            except Exception:
                log.exception("renewing batch leases failed")

    async def _renew(self) -> None:
        for batch_id, lb in list(self.local.items()):
            lost = await self.store.renew(batch_id, self.me, self.lease_ms, list(lb.lines))
            for index in lost:
                # Taken over while this gateway could not renew (Redis away longer than a
                # lease): the other gateway runs it now.
                ln = lb.lines.get(index)
                if ln is not None and ln.task is not None:
                    log.warning("batch %s line %s: lease lost, stopping it here", batch_id,
                                index)
                    ln.task.cancel()

    async def _write_results(self) -> None:
        """Results first (they are kept in memory until Redis has them), then the leases of
        lines stopped unfinished."""
        while self.unwritten:
            r = self.unwritten[0]
            written = await self.store.complete(r.batch_id, self.me, r.index, r.line, r.ok,
                                                r.usage)
            self.unwritten.pop(0)
            self.observer.batch_unwritten(len(self.unwritten))
            self.observer.batch_line(("completed" if r.ok else "failed") if written
                                     else "superseded")
        while self.unreleased:
            batch_id, index = self.unreleased[0]
            await self.store.release(batch_id, self.me, [index])
            self.unreleased.pop(0)

    # One line -----------------------------------------------------------------------------

    async def _run_line(self, batch_id: str, lb: LocalBatch, line: Line) -> None:
        c = line.claimed
        gate = lb.gates.get(c.group)
        try:
            if gate is not None and not c.leader:
                await gate.wait()
            a = await self.executor.answer(lb.path, lb.chat, c.body, gate if c.leader else None,
                                           line)
            self.unwritten.append(Result(batch_id, c.index, response_line(
                c.custom_id, a.status, a.request_id, a.body), a.ok, a.usage))
            self.observer.batch_unwritten(len(self.unwritten))
        except asyncio.CancelledError:
            # Stopped before a result: its lease goes back (unless it is no longer ours).
            self.unreleased.append((batch_id, c.index))
            raise
        finally:
            if c.leader and gate is not None:
                gate.set()  # whatever happened, the rest of its group must not wait on
            if lb.lines.get(c.index) is line:
                del lb.lines[c.index]
            self.observer.batch_inflight(-1)
            self.wake.set()
