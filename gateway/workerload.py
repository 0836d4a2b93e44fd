"""The load the other workers of one `serve --workers N` put on each replica, when no Redis
shares routing state: what each worker's router balances on besides its own.

Each worker routes on its own router; without this, a worker's load bound and queue costs
counted only its own requests in flight, so N workers could each put a replica at the bound.
Every `interval_s` (25 ms) while any worker has requests in flight, each worker:

- writes its own load (per pool and replica: requests in flight, pending prefill tokens) to
  `PID.load` in the workers' directory, replacing it atomically, when it changed, and
  again every third of `ttl_s` while it is not empty (a heartbeat);
- reads the other workers' files whose modification time changed since it last read them,
  and hands each pool's router the sum (`Router.apply_remote_load`), as shared routing state
  does with other gateways' load;
- with `prefixes`, appends the prefixes it routed since and reads the others'
  (gateway/workerprefixes.py).

A file older than `ttl_s` (a worker that died without a word) no longer counts, and the
supervisor deletes a dead worker's file at once. While no worker has a request in flight, a
worker looks only every `idle_interval_s` (1 s) and writes nothing: 40 wake-ups a second
cost an idle worker about as much CPU as its health checks, scrapes and server together. Its
first request catches up before it is routed (`Observer.before_route`: one tick, on the
request's path, once per idle spell) and wakes it, so every decision routes on the others'
latest load and prefixes (`Observer.load_moved` wakes it too). Nothing else here runs on the
request path: two comparisons, and for the prefixes one append to a queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Any

import orjson

from backends.pool import Pool
from gateway.state import GatewayState
from gateway.workerprefixes import SUFFIX as PREFIXES_SUFFIX
from gateway.workerprefixes import WorkerPrefixes
from routing.load import sum_loads

log = logging.getLogger("prefix_gateway.workers")

SUFFIX = ".load"
"""Not `.json`: the workers' figures (gateway/workerview.py) are those."""
INTERVAL_S = 0.025
IDLE_INTERVAL_S = 1.0
"""How often a worker looks while no worker has a request in flight."""
TTL_S = 3.0
_LIST_EVERY_S = 1.0
"""How often the directory is listed again for workers that started or left."""


def load_path(directory: str | Path, pid: int) -> Path:
    return Path(directory) / f"{pid}{SUFFIX}"


class WorkerLoad:
    """One worker's side of the shared load: writes its own, applies the others'."""

    def __init__(self, directory: str | Path, state: GatewayState,
                 interval_s: float = INTERVAL_S, ttl_s: float = TTL_S,
                 pid: int | None = None, idle_interval_s: float = IDLE_INTERVAL_S,
                 prefixes: WorkerPrefixes | None = None) -> None:
        self.directory = Path(directory)
        self.state = state
        self.prefixes = prefixes
        """The prefixes and rates shared beside the load, at the same ticks (None: not)."""
        self.interval_s = interval_s
        self.idle_interval_s = idle_interval_s
        self.ttl_s = ttl_s
        self.pid = os.getpid() if pid is None else pid
        self.path = load_path(self.directory, self.pid)
        self._path = str(self.path)
        self._tmp = str(self.directory / f".{self.pid}{SUFFIX}.tmp")
        self._own: bytes = b"{}"
        self._written_at = 0.0
        self._listed_at = -_LIST_EVERY_S
        self._files: list[str] = []
        self._prefix_files: list[str] = []
        self._seen: dict[str, int] = {}
        """File -> the modification time (ns) of what was last read from it."""
        self._theirs: dict[str, dict[str, Any]] = {}
        """File -> what it held: {"t": written at, "p": {pool: {replica: [n, pending]}}}."""

    @property
    def pools(self) -> list[Pool]:
        return self.state.pools

    def own_load(self) -> bytes:
        out = {pool.name: pool.router.load.own_load() for pool in self.pools}
        return orjson.dumps({name: mine for name, mine in out.items() if mine},
                            option=orjson.OPT_SORT_KEYS)

    def tick(self, now: float | None = None) -> None:
        """Write this worker's load if due, read what changed of the others', apply."""
        now = time.time() if now is None else now
        own = self.own_load()
        if own != self._own or (own != b"{}" and now - self._written_at >= self.ttl_s / 3):
            fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, b'{"t":%r,"p":%s}' % (now, own))
            finally:
                os.close(fd)
            os.replace(self._tmp, self._path)
            self._own, self._written_at = own, now
        prefixes = self.prefixes
        if prefixes is not None:
            prefixes.write()
        if now - self._listed_at >= _LIST_EVERY_S:
            self._listed_at = now
            # Plain strings from here on: pathlib's per-call cost, 80 times a second, showed.
            self._files = [str(p) for p in self.directory.glob(f"*{SUFFIX}") if p != self.path]
            for gone in set(self._theirs) - set(self._files):
                self._theirs.pop(gone, None)
                self._seen.pop(gone, None)
            if prefixes is not None:
                self._prefix_files = [str(p) for p in self.directory.glob(f"*{PREFIXES_SUFFIX}")
                                      if p != prefixes.path]
        if prefixes is not None:
            prefixes.read(self._prefix_files)
        changed = False
        for path in self._files:
            try:
                mtime = os.stat(path).st_mtime_ns
                if self._seen.get(path) == mtime:
                    continue
                with open(path, "rb") as f:
                    self._theirs[path] = orjson.loads(f.read())
                self._seen[path] = mtime
            except FileNotFoundError:  # the worker left: listed again within a second
                if self._theirs.pop(path, None) is not None:
                    changed = True
                self._seen.pop(path, None)
                continue
            except (OSError, orjson.JSONDecodeError) as exc:
                log.debug("cannot read %s: %s", path, exc)
                continue
            changed = True
        stale = [p for p, v in self._theirs.items() if now - float(v.get("t", 0)) > self.ttl_s]
        for path in stale:
            del self._theirs[path]
            changed = True
        if changed:
            self._apply()

    def _apply(self) -> None:
        for pool in self.pools:
            pool.router.apply_remote_load(sum_loads(
                (value.get("p") or {}).get(pool.name, {}) for value in self._theirs.values()))

    def pause_s(self) -> float:
        """How long to wait before the next tick: `interval_s` while this worker or another
        has requests in flight (or this one's file still shows some), else `idle_interval_s`."""
        # Its own requests counted directly: own_load() would serialise them once more per
        # tick, beside tick()'s own.
        busy = any(n for pool in self.pools for n in pool.router.load.inflight.values())
        busy = busy or (self.prefixes is not None and self.prefixes.pending)
        if busy or self._own != b"{}" or any(value.get("p") for value in self._theirs.values()):
            return self.interval_s
        return self.idle_interval_s

    async def _idle(self, pause: float) -> None:
        """Wait `pause` seconds, or until this worker's next request starts or ends."""
        loop = asyncio.get_running_loop()
        woken = loop.create_future()
        observer = self.state.observer

        def wake() -> None:
            observer.load_moved = None  # once is enough: the rest waits for the next tick
            if not woken.done():
                woken.set_result(None)

        def catch_up() -> None:
            # A request about to be routed: the others' latest load and prefixes first.
            observer.before_route = None
            try:
                self.tick()
            except OSError as exc:
                log.debug("cannot share load in %s: %s", self.directory, exc)
            wake()

        timer = loop.call_later(pause, wake)
        observer.load_moved = wake
        observer.before_route = catch_up
        try:
            await woken
        finally:
            timer.cancel()
            observer.load_moved = observer.before_route = None

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        last = loop.time()
        while True:
            pause = self.pause_s()
            if pause > self.interval_s:
                await self._idle(pause)
                # Woken by a request: still no sooner than `interval_s` after the last tick,
                # or a worker at 100 requests a second would tick 100 times.
                await asyncio.sleep(max(0.0, last + self.interval_s - loop.time()))
            else:
                await asyncio.sleep(pause)
            last = loop.time()
            try:
                self.tick()
            except OSError as exc:  # the directory went away: the gateway is stopping
                log.debug("cannot share load in %s: %s", self.directory, exc)

    def remove(self) -> None:
        """This worker stops: the others stop counting its load at once."""
        with contextlib.suppress(OSError):
            self.path.unlink()
        if self.prefixes is not None:
            self.prefixes.close()
