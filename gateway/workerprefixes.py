"""The prefixes each worker of `serve --workers N` routes, and what it learns of the replicas'
speeds, shared with the other workers through append-only files when no Redis shares routing
state.

Each worker routes on its own router. Without this, each kept its own prefix index: the
kernel hands each connection to any worker, so the turns of one conversation reached workers
that had not placed the earlier ones, and routed them as cold prefixes. Near saturation two
workers had 3.8x one worker's mean TTFT (docs/benchmarks.md). Each also learned the
replicas' speeds from only its share of their steps.

At each tick of the workers' shared load (gateway/workerload.py: every 25 ms while any worker
has requests in flight), each worker:

- appends what it decided since the last tick to `PID.prefixes` in the workers' directory,
  one JSON line per tick: per pool, `[replica, decided at, hashes, uncached tokens]` for
  each prefix recorded (the items of the shared routing state's streams), and, at most every
  `RATES_INTERVAL_S` and when they changed, what it learned of each replica's rates;
- reads what the other workers appended since it last read (a new worker reads their files
  from the start: their recent decisions, and the rates they learned), and applies it to its
  routers as the shared routing state applies other gateways' (`Router.apply_remote_inserts`,
  `Router.apply_remote_rates`).

With `pin_running`, the lines carry the ends of the requests that held their prefixes too
(`e`, and `o` with `output_cached`, as the shared routing state's releases) and a worker
pins the others' running requests' prefixes, and reserves their outputs' room, until they
end (keeping their outputs after them, with `output_cached`), or until their
worker's file leaves the listing (it stopped or died: its requests ended with it). A dead
worker's prefixes that its replacement applies are not pinned.

A file that grows past `max_bytes` starts again: the worker writes the next line, headed by
its current rates, to a new file and renames it over the old one. A reader keeps the old file
open, reads it to its end, then opens the new one: nothing written is missed, unless a
worker fills a whole file between two reads of another (4 MiB in a tick). A line is read
only once its newline is there (a reader may see a write half done). The supervisor renames
a dead worker's file `PID.prefixes-retired`: the workers that remain read it to its end,
then drop it and what it learned of the rates, keeping the prefixes they applied; a worker
that starts, such as the dead one's replacement, applies its prefixes before it serves, and
the supervisor deletes it once every worker serves. On the request's path: one append to a
queue, bounded (the oldest dropped and counted) in case the ticks stop.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from backends.pool import Pool
from gateway.observe import Observer
from gateway.shared_routing import (
    RATES_INTERVAL_S,
    Shared,
    apply_inserts,
    by_pool,
    encode_rates,
    note_dropped,
    recorder,
    releaser,
    releases_by_pool,
)
from routing.steps import sum_rates

log = logging.getLogger("prefix_gateway.workers")

SUFFIX = ".prefixes"
RETIRED_SUFFIX = ".prefixes-retired"
"""A dead worker's file, renamed by the supervisor: read only by workers that start."""
MAX_BYTES = 4 << 20
"""A worker's file starts again past this size. At 100 decisions a second that is about 8 s
of them for prompts of 256 blocks (5 kB a decision), 2 minutes for 16 blocks: what a new
worker reads at its start (docs/benchmarks.md, worker_share_cost)."""
MAX_QUEUE = 100_000
"""Decisions kept while no tick writes them (the directory gone): the oldest are dropped."""
_READ_BYTES = 1 << 20

def prefixes_path(directory: str | Path, pid: int) -> Path:
    return Path(directory) / f"{pid}{SUFFIX}"


def retired_path(directory: str | Path, pid: int) -> Path:
    return Path(directory) / f"{pid}{RETIRED_SUFFIX}"


@dataclass
class _Peer:
    """Another worker's file as this one reads it."""

    fd: int
    inode: int
    offset: int = 0
    partial: bytes = b""
    """The start of a line whose newline was not written yet."""
    rates: dict[str, Any] = field(default_factory=dict)
    """Pool -> what that worker last said it learned of the replicas' rates."""
    source: str | None = None
    """Whose pins its prefixes hold here (its file's path); None: a dead worker's, read
    once, whose requests ended with it (nothing pinned)."""


class WorkerPrefixes:
    """One worker's side of the shared prefixes: appends its own, applies the others'."""

    def __init__(self, directory: str | Path, pools: Sequence[Pool], observer: Observer,
                 pid: int | None = None, max_bytes: int = MAX_BYTES,
                 max_queue: int = MAX_QUEUE) -> None:
        self.directory = Path(directory)
        self.pools = {pool.name: pool for pool in pools}
        self.observer = observer
        self.pid = os.getpid() if pid is None else pid
        self.path = prefixes_path(self.directory, self.pid)
        self._path = str(self.path)
        self._tmp = str(self.directory / f".{self.pid}{SUFFIX}.tmp")
        self.max_bytes = max_bytes
        self.max_queue = max_queue
        self.queue: deque[Shared] = deque()
        self._lost_releases: set[str] = set()
        """Pools a release was dropped from: the next line tells the others to release every
        pin of this worker's there (`x`)."""
        self.started_at = time.time()
        self._fd: int | None = None
        self._size = 0
        self.written_bytes = 0
        """Appended since it started, over every file."""
        self._own_rates: dict[str, bytes] = {}
        """Pool -> what this worker last wrote of the replicas' rates (`encode_rates`)."""
        self._rates_at = -RATES_INTERVAL_S
        self._peers: dict[str, _Peer] = {}
        self._read_retired = False
        for pool in pools:
            pool.router.on_record = recorder(self.queue, self.max_queue, pool.name,
                                             self._dropped)
            pool.router.on_release = releaser(self.queue, self.max_queue, pool.name,
                                              self._dropped)

    # On the request's path: one append (`recorder`, `releaser`) -----------------------------

    def _dropped(self, item: Shared) -> None:
        note_dropped(item, self._lost_releases, self.observer)

    @property
    def pending(self) -> bool:
        """Decisions wait to be written."""
        return bool(self.queue)

    # Writing ------------------------------------------------------------------------------

    def write(self) -> None:
        """Append the decisions queued since the last write, and the rates if due and
        changed: one line, none when there is nothing new."""
        line: dict[str, Any] = {}
        written: dict[str, int] = {}
        releases: dict[str, Any] = {}
        lost = set(self._lost_releases)
        if lost:
            line["x"] = sorted(lost)
        if self.queue:
            pools = by_pool(self.queue)
            releases = releases_by_pool(self.queue)
            self.queue.clear()
            if pools:
                line["d"] = pools
            if releases:
                line["e"] = {name: ended for name, (ended, _) in releases.items()}
                cached = {name: blocks for name, (_, blocks) in releases.items()
                          if blocks is not None}
                if cached:
                    line["o"] = cached
            written = {name: len(items) for name, items in pools.items()}
        rates = self._rates_due()
        if rates:
            line["s"] = rates
        if not line:
            return
        data = orjson.dumps(line, default=list) + b"\n"
        try:
            if self._fd is None or self._size + len(data) > self.max_bytes:
                self._start_file(data)
            else:
                self._append(data)
        except OSError:
            for name, count in written.items():
                self.observer.shared_inserts(name, "dropped", count)
            self._lost_releases.update(releases)
            raise
        self._lost_releases -= lost
        for name, count in written.items():
            self.observer.shared_inserts(name, "published", count)

    def _rates_due(self) -> dict[str, Any]:
        """Each pool's rates that changed since last written, at most every
        `RATES_INTERVAL_S`."""
        now = time.monotonic()
        if now - self._rates_at < RATES_INTERVAL_S:
            return {}
        self._rates_at = now
        changed: dict[str, Any] = {}
        for name, pool in self.pools.items():
            learned = encode_rates(pool.router)
            if learned != self._own_rates.get(name, b"{}"):
                self._own_rates[name] = learned
                changed[name] = orjson.Fragment(learned)
        return changed

    def _append(self, data: bytes) -> None:
        assert self._fd is not None
        view = memoryview(data)
        while view:  # a regular file takes it whole but for a full disk, which raises
            view = view[os.write(self._fd, view):]
        self._size += len(data)
        self.written_bytes += len(data)

    def _start_file(self, data: bytes) -> None:
        """Write `data` to a new file headed by every pool's rates, and put it in place of
        the old one (readers finish the old one first: they hold it open)."""
        head = b""
        if self._own_rates:
            head = orjson.dumps({"s": {name: orjson.Fragment(rates)
                                       for name, rates in self._own_rates.items()}}) + b"\n"
        fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
        old, old_size = self._fd, self._size
        self._fd, self._size = fd, 0
        try:
            self._append(head + data)
            os.replace(self._tmp, self._path)
        except OSError:
            os.close(fd)
            self._fd, self._size = old, old_size
            raise
        if old is not None:
            os.close(old)

    # Reading ------------------------------------------------------------------------------

    def read(self, files: Sequence[str]) -> None:
        """Apply what the workers writing `files` (the other workers' files now listed)
        appended since the last read; forget those whose file is gone."""
        if not self._read_retired:
            self._read_retired = True
            self.read_retired()
        rates_changed = False
        for path in set(self._peers) - set(files):
            self._leave(path)
            rates_changed = True
        for path in files:
            try:
                st = os.stat(path)
                inode, size = st.st_ino, st.st_size
            except FileNotFoundError:  # that worker left: its file goes with it
                if path in self._peers:
                    self._leave(path)
                    rates_changed = True
                continue
            peer = self._peers.get(path)
            if peer is not None and peer.inode == inode and peer.offset >= size:
                continue
            try:
                if peer is not None and peer.inode != inode:
                    # It started a new file: the rest of the old one first.
                    rates_changed |= self._drain(peer)
                    self._forget(path)
                    peer = self._open(path, peer.rates)
                elif peer is None:
                    peer = self._open(path, {})
                rates_changed |= self._drain(peer)
            except FileNotFoundError:  # it left as its file was started again
                rates_changed = True
                continue
        if rates_changed:
            for name, pool in self.pools.items():
                pool.router.apply_remote_rates(sum_rates(
                    peer.rates[name] for peer in self._peers.values() if name in peer.rates))

    def read_retired(self) -> None:
        """Apply the prefixes of the dead workers' files (`RETIRED_SUFFIX`) whole, once, at
        this worker's first read: a replacement would otherwise route cold what the worker
        it replaces had placed. What they learned of the rates is left: the workers that
        remain stopped counting it too."""
        for path in self.directory.glob(f"*{RETIRED_SUFFIX}"):
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:  # deleted meanwhile: every worker had read it
                continue
            peer = _Peer(fd, 0)
            try:
                self._drain(peer, rates=False)
            finally:
                os.close(fd)

    def _open(self, path: str, rates: dict[str, Any]) -> _Peer:
        fd = os.open(path, os.O_RDONLY)
        peer = self._peers[path] = _Peer(fd, os.fstat(fd).st_ino, rates=rates, source=path)
        return peer

    def _leave(self, path: str) -> None:
        """A worker's file is gone from the listing (it stopped, or died and was retired):
        what it appended since the last read first, from the file still open."""
        self._drain(self._peers[path], rates=False)
        self._forget(path)
        for pool in self.pools.values():  # its requests ended with it
            pool.router.release_remote_pins(path)

    def _forget(self, path: str) -> None:
        peer = self._peers.pop(path)
        with contextlib.suppress(OSError):
            os.close(peer.fd)

    def _drain(self, peer: _Peer, rates: bool = True) -> bool:
        """Apply the whole lines added to `peer`'s file (with `rates`, what it says of the
        rates too); whether its rates changed."""
        chunks = [peer.partial]
        while chunk := os.read(peer.fd, _READ_BYTES):
            chunks.append(chunk)
            peer.offset += len(chunk)
        data = b"".join(chunks)
        end = data.rfind(b"\n") + 1
        peer.partial = data[end:]
        rates_changed = False
        for line in data[:end].splitlines():
            try:
                entry = orjson.loads(line)
            except orjson.JSONDecodeError as exc:  # not written by a worker of this version
                log.debug("unreadable line in a worker's prefixes: %s", exc)
                continue
            self._apply(entry, peer.source)
            if rates and "s" in entry:
                peer.rates.update(entry["s"])
                rates_changed = True
        return rates_changed

    def _apply(self, entry: dict[str, Any], source: str | None) -> None:
        """One line of another worker's: first `x`, the pools where it dropped a release
        (what it holds there is no longer known), then its inserts, then its releases."""
        for name in entry.get("x", ()):
            pool = self.pools.get(name)
            if pool is not None and source is not None:
                pool.router.release_remote_pins(source)
        for name, items in entry.get("d", {}).items():
            pool = self.pools.get(name)
            if pool is not None:
                apply_inserts(pool.router, self.observer, name, items, self.started_at, source)
        if source is None:
            return
        cached = entry.get("o", {})
        for name, releases in entry.get("e", {}).items():
            pool = self.pools.get(name)
            if pool is not None:
                pool.router.apply_remote_releases(source, releases, cached.get(name, ()))

    # Stopping -----------------------------------------------------------------------------

    def close(self) -> None:
        """This worker stops: its file goes (what the others applied stays with them)."""
        for path in list(self._peers):
            self._forget(path)
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
        with contextlib.suppress(OSError):
            self.path.unlink()
