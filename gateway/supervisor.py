"""`serve --workers N`: a supervising process and N worker processes sharing one port.

The supervisor binds the listening socket once, then forks the workers, each serving on the
inherited socket (one accept queue: a connection waiting there is taken by whichever worker
is free, and none is lost when a worker dies). It serves nothing itself:

- SIGTERM or SIGINT: every worker is sent SIGTERM and stops gracefully (requests in flight
  finish, as with one process); the supervisor exits once they all have;
- SIGHUP: passed on to every worker, each of which reloads the configuration file;
- a worker that dies is started again, and the death logged; workers that die before they
  serve, several times in a row (an engine of the configuration refusing, a bad
  environment), end the gateway with one error and exit status 1;
- "serving on ..." is printed once every worker serves.

The workers share what /metrics and /admin/stats show through files in a private directory
on a memory filesystem when there is one (`shared_dir`; gateway/workerview.py); the
supervisor renames a dead worker's file `retired-PID` so that its counts stay in the sums.
Without Redis they share their load per replica there too (gateway/workerload.py), and
the prefixes they route (gateway/workerprefixes.py). The supervisor deletes a dead worker's
load, and renames its prefixes `PID.prefixes-retired` for its replacement to read before it
serves; those go once every worker serves.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gateway.processes import die_with_parent
from gateway.workerload import load_path
from gateway.workerprefixes import RETIRED_SUFFIX, prefixes_path, retired_path
from gateway.workerview import RETIRED

log = logging.getLogger("prefix_gateway.supervisor")

STARTUP_FAILURES = 3
"""Workers dying before they serve, in a row (none serving meanwhile): the gateway gives up."""
RESTART_DELAY_S = (0.1, 0.5, 1.0, 2.0, 5.0)
"""Wait before starting a worker again, by the number of deaths in a row of that slot."""
MEMORY_DIRS = ("/dev/shm",)
"""Where the workers' directory goes when it exists and is writable: a memory filesystem."""
STOP_DEADLINE_S = 3600.0
"""Longest wait for the workers to finish their requests after SIGTERM (then SIGKILL)."""

_HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD)

WorkerMain = Callable[[str, Callable[[], None]], None]
"""What a worker runs: (the shared directory, the callback to call once serving)."""


@dataclass
class Slot:
    index: int
    pid: int = 0
    ready_fd: int = -1
    """The read end of the pipe the worker writes to once it serves (EOF: it is gone)."""
    serving: bool = False
    deaths: int = 0
    """Deaths in a row of this slot's workers (reset once one serves)."""
    restart_at: float | None = None
    started: float = field(default_factory=time.monotonic)


class Supervisor:
    def __init__(self, n: int, worker: WorkerMain, banner: str | None = None) -> None:
        self.n = n
        self.worker = worker
        self.banner = banner
        self.slots = [Slot(i) for i in range(n)]
        self.dir = ""
        self.sel = selectors.DefaultSelector()
        self.stopping: int | None = None
        """The signal that stops the gateway, once one came."""
        self.hup = False
        self.startup_failures = 0
        self.announced = False
        self._wake_r, self._wake_w = os.pipe()

    # The supervisor's loop --------------------------------------------------------------------

    def run(self) -> int:
        self.dir = shared_dir()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        old_wakeup = signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        old = {s: signal.signal(s, self._on_signal) for s in _HANDLED}
        self.sel.register(self._wake_r, selectors.EVENT_READ, None)
        try:
            for slot in self.slots:
                self._start(slot)
            return self._loop()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            signal.set_wakeup_fd(old_wakeup)
            self.sel.close()
            os.close(self._wake_r)
            os.close(self._wake_w)
            shutil.rmtree(self.dir, ignore_errors=True)

    def _on_signal(self, signum: int, _frame: object) -> None:
        if signum in (signal.SIGTERM, signal.SIGINT):
            if self.stopping is None:
                self.stopping = signum
        elif signum == signal.SIGHUP:
            self.hup = True

    def _loop(self) -> int:
        while True:
            # Signals (SIGCHLD included) wake the select through the wakeup pipe, and a worker
            # serving writes to its own pipe: with no restart due, nothing needs a timeout.
            timeout: float | None = None
            pending = [s.restart_at for s in self.slots if s.restart_at is not None]
            if pending:
                timeout = max(0.0, min(pending) - time.monotonic())
            for key, _ in self.sel.select(timeout):
                if key.data is None:
                    with contextlib.suppress(BlockingIOError):
                        while os.read(self._wake_r, 512):
                            pass
                else:
                    self._ready(key.data)
            if self.stopping is not None:
                return self._stop_all(self.stopping)
            if self.hup:
                self.hup = False
                log.info("SIGHUP: asking every worker to reload the configuration file")
                self._signal_all(signal.SIGHUP)
            failed = self._reap()
            if failed is not None:
                return failed
            now = time.monotonic()
            for slot in self.slots:
                if slot.restart_at is not None and slot.restart_at <= now:
                    self._start(slot)

    def _ready(self, slot: Slot) -> None:
        try:
            data = os.read(slot.ready_fd, 64)
        except OSError:
            data = b""
        if not data:  # the worker is gone: _reap says how
            self._close_pipe(slot)
            return
        if not slot.serving:
            slot.serving = True
            slot.deaths = 0
            self.startup_failures = 0
            if self.announced:
                log.info("worker %d (slot %d) serving", slot.pid, slot.index)
            if all(s.serving for s in self.slots):
                self._drop_retired_prefixes()
            if not self.announced and all(s.serving for s in self.slots):
                self.announced = True
                pids = ", ".join(str(s.pid) for s in self.slots)
                log.info("%d workers serving (pids %s)", self.n, pids)
                if self.banner:
                    print(f"{self.banner} ({self.n} workers)", flush=True)

    def _reap(self) -> int | None:
        """Collect dead workers and schedule their replacements; an exit status once the
        gateway must stop because workers keep failing to start."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return None
            if pid == 0:
                return None
            slot = next((s for s in self.slots if s.pid == pid), None)
            if slot is None:
                continue
            how = _described(status)
            self._close_pipe(slot)
            self._retire(pid)
            slot.pid = 0
            slot.deaths += 1
            if not slot.serving:
                self.startup_failures += 1
                if self.startup_failures >= STARTUP_FAILURES:
                    print(f"prefix-gateway: workers keep failing to start ({self.startup_failures}"
                          f" in a row, the last {how}); see the errors above. Stopping.",
                          file=sys.stderr, flush=True)
                    self._stop_all(signal.SIGTERM)
                    return 1
                log.error("worker %d (slot %d) %s before serving; starting another",
                          pid, slot.index, how)
            else:
                log.error("worker %d (slot %d) %s; starting another", pid, slot.index, how)
            slot.serving = False
            delay = RESTART_DELAY_S[min(slot.deaths, len(RESTART_DELAY_S)) - 1]
            slot.restart_at = time.monotonic() + delay

    def _stop_all(self, signum: int) -> int:
        name = signal.Signals(signum).name
        live = [s for s in self.slots if s.pid]
        if live:
            log.info("%s: stopping %d workers (requests in flight finish)", name, len(live))
        self._signal_all(signal.SIGTERM)
        end = time.monotonic() + STOP_DEADLINE_S
        while any(s.pid for s in self.slots):
            try:
                pid, _status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                if time.monotonic() > end:
                    self._signal_all(signal.SIGKILL)
                    end = float("inf")
                self.sel.select(0.2)
                with contextlib.suppress(BlockingIOError):
                    while os.read(self._wake_r, 512):
                        pass
                continue
            for s in self.slots:
                if s.pid == pid:
                    log.info("worker %d stopped (%s)", pid, _described(_status))
                    self._close_pipe(s)
                    s.pid = 0
        log.info("every worker stopped")
        return 0

    def _signal_all(self, signum: int) -> None:
        for s in self.slots:
            if s.pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(s.pid, signum)

    # Workers ----------------------------------------------------------------------------------

    def _start(self, slot: Slot) -> None:
        slot.restart_at = None
        slot.serving = False
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the worker
            os.close(r)
            self._become_worker(w)  # never returns
        os.close(w)
        slot.pid, slot.ready_fd, slot.started = pid, r, time.monotonic()
        self.sel.register(r, selectors.EVENT_READ, slot)

    def _become_worker(self, ready_w: int) -> None:
        code = 1
        try:
            signal.set_wakeup_fd(-1)
            for s in _HANDLED:
                signal.signal(s, signal.SIG_DFL)
            # Until the worker listens for it (to reload), SIGHUP must not kill it.
            signal.signal(signal.SIGHUP, signal.SIG_IGN)
            # uvicorn stops gracefully on SIGTERM/SIGINT, then raises the signal again with
            # the handler it found: a worker stopped so exits with status 0.
            signal.signal(signal.SIGTERM, _exit_quietly)
            signal.signal(signal.SIGINT, _exit_quietly)
            self.sel.close()
            for fd in (self._wake_r, self._wake_w,
                       *(s.ready_fd for s in self.slots if s.ready_fd >= 0)):
                with contextlib.suppress(OSError):
                    os.close(fd)
            die_with_parent()
            # Which worker says what: its pid in every line it logs.
            for handler in logging.getLogger().handlers:
                handler.setFormatter(logging.Formatter(
                    "%(asctime)s %(name)s [worker %(process)d] %(message)s"))

            def serving() -> None:
                with contextlib.suppress(OSError):
                    os.write(ready_w, b"r")

            self.worker(self.dir, serving)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)

    def _close_pipe(self, slot: Slot) -> None:
        if slot.ready_fd >= 0:
            with contextlib.suppress(KeyError, ValueError):
                self.sel.unregister(slot.ready_fd)
            with contextlib.suppress(OSError):
                os.close(slot.ready_fd)
            slot.ready_fd = -1

    def _retire(self, pid: int) -> None:
        """A dead worker's figures: its counters stay in the gateway's sums."""
        path = Path(self.dir) / f"{pid}.json"
        with contextlib.suppress(OSError):
            os.replace(path, path.with_name(f"{RETIRED}{pid}.json"))
        with contextlib.suppress(OSError):  # its requests in flight are gone with it
            load_path(self.dir, pid).unlink()
        with contextlib.suppress(OSError):  # the others applied them; its replacement will
            os.replace(prefixes_path(self.dir, pid), retired_path(self.dir, pid))

    def _drop_retired_prefixes(self) -> None:
        """Every worker serves: each read the dead workers' prefixes, while they lived or
        before it served."""
        for path in Path(self.dir).glob(f"*{RETIRED_SUFFIX}"):
            with contextlib.suppress(OSError):
                path.unlink()


def shared_dir(candidates: tuple[str, ...] = MEMORY_DIRS) -> str:
    """A new private directory for the workers' files, on a memory filesystem if one of
    `candidates` is usable, else in the system's temporary directory.

    Each worker replaces its load file up to 40 times a second under load: on a disk
    filesystem (ext4 flushes a file renamed over another at once) each replacement cost
    90-130 us of CPU and blocked the worker's event loop for 1-2 ms; on tmpfs, 7 us."""
    for base in candidates:
        if os.path.isdir(base) and os.access(base, os.W_OK | os.X_OK):
            with contextlib.suppress(OSError):
                return tempfile.mkdtemp(prefix="prefix-gateway-workers-", dir=base)
    return tempfile.mkdtemp(prefix="prefix-gateway-workers-")


def _exit_quietly(_signum: int, _frame: object) -> None:
    raise SystemExit(0)


def _described(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(sig).name}"
        return f"was killed by signal {sig}"
    return f"exited with status {os.waitstatus_to_exitcode(status)}"
