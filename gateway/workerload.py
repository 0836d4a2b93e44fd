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
  does with other gateways' load.

A file older than `ttl_s` (a worker that died without a word) no longer counts, and the
supervisor deletes a dead worker's file at once. While no worker has a request in flight, a
worker looks only every `idle_interval_s` (1 s) and writes nothing: 40 wake-ups a second
cost an idle worker about as much CPU as its health checks, scrapes and server together. Its
first request wakes it at once (`Observer.load_moved`, one comparison on the request path),
so from the next request on it routes on the others' load as fresh as before; only that
first decision sees their load as it was at the last look. Nothing else here runs on the
request path.
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
                 pid: int | None = None, idle_interval_s: float = IDLE_INTERVAL_S) -> None:
        self.directory = Path(directory)
        self.state = state
        self.interval_s = interval_s
        self.idle_interval_s = idle_interval_s
        self.ttl_s = ttl_s
        self.pid = os.getpid() if pid is None else pid
        self.path = load_path(self.directory, self.pid)
        self._own: bytes = b"{}"
        self._written_at = 0.0
        self._listed_at = -_LIST_EVERY_S
        self._files: list[Path] = []
        self._seen: dict[Path, int] = {}
        """File -> the modification time (ns) of what was last read from it."""
        self._theirs: dict[Path, dict[str, Any]] = {}
        """File -> what it held: {"t": written at, "p": {pool: {replica: [n, pending]}}}."""
        self._woken: asyncio.Event | None = None

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
            tmp = self.directory / f".{self.pid}{SUFFIX}.tmp"
            tmp.write_bytes(b'{"t":%r,"p":%s}' % (now, own))
            os.replace(tmp, self.path)
            self._own, self._written_at = own, now
        if now - self._listed_at >= _LIST_EVERY_S:
            self._listed_at = now
            self._files = [p for p in self.directory.glob(f"*{SUFFIX}") if p != self.path]
            for gone in set(self._theirs) - set(self._files):
                self._theirs.pop(gone, None)
                self._seen.pop(gone, None)
        changed = False
        for path in self._files:
            try:
                mtime = path.stat().st_mtime_ns
                if self._seen.get(path) == mtime:
                    continue
                self._theirs[path] = orjson.loads(path.read_bytes())
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
        if self._own != b"{}" or self.own_load() != b"{}" or any(
                value.get("p") for value in self._theirs.values()):
            return self.interval_s
        return self.idle_interval_s

    def _wake(self) -> None:
        observer = self.state.observer
        observer.load_moved = None  # once is enough: the rest waits for the next tick
        if self._woken is not None:
            self._woken.set()

    async def _pause(self) -> None:
        pause = self.pause_s()
        if pause <= self.interval_s:
            await asyncio.sleep(pause)
            return
        # Idle: a request in this worker ends the wait at once.
        self._woken = woken = asyncio.Event()
        self.state.observer.load_moved = self._wake
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(woken.wait(), pause)
        finally:
            self.state.observer.load_moved = None
            self._woken = None

    async def run(self) -> None:
        while True:
            await self._pause()
            try:
                self.tick()
            except OSError as exc:  # the directory went away: the gateway is stopping
                log.debug("cannot share load in %s: %s", self.directory, exc)

    def remove(self) -> None:
        """This worker stops: the others stop counting its load at once."""
        with contextlib.suppress(OSError):
            self.path.unlink()
