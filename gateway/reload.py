"""Reloading the configuration file while serving: on SIGHUP, and when the file changes.

The file is watched by polling its inode, modification time and size (no dependency, and it
sees a Kubernetes ConfigMap's symlink swap as well as an edit in place). A file that cannot be
read or is invalid is rejected whole: its error is logged and the configuration in force stays.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

from gateway.config import ConfigError, GatewayConfig, load_config
from gateway.fleet import Fleet
from gateway.metrics import GatewayMetrics

log = logging.getLogger("prefix_gateway.reload")

WATCH_INTERVAL_S = 1.0


def _identity(config: GatewayConfig) -> GatewayConfig:
    return config


class Reloader:
    """Reloads `path` into `fleet` when asked (`request`, from SIGHUP) or when the file
    changes; `prepare` applies the command line's overrides to each configuration read."""

    def __init__(self, path: str | Path, fleet: Fleet, metrics: GatewayMetrics,
                 prepare: Callable[[GatewayConfig], GatewayConfig] | None = None,
                 interval_s: float = WATCH_INTERVAL_S) -> None:
        self.path = Path(path)
        self.fleet = fleet
        self.metrics = metrics
        self.prepare = prepare or _identity
        self.interval_s = interval_s
        self._wake = asyncio.Event()
        self._seen = self.signature()

    def signature(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def request(self) -> None:
        """Reload as soon as possible (SIGHUP)."""
        self._wake.set()

    async def run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval_s)
            asked = self._wake.is_set()
            self._wake.clear()
            seen = self.signature()
            changed = seen is not None and seen != self._seen
            self._seen = seen
            if asked or changed:
                self.reload("SIGHUP" if asked else "the file changed")

    def reload(self, why: str) -> bool:
        """Read, validate and apply the file; False: rejected (the old configuration stays)."""
        try:
            config = self.prepare(load_config(self.path))
        except ConfigError as exc:
            self.metrics.config_reloads.inc(("rejected",))
            log.error("configuration reload (%s) rejected; the configuration in force is kept: "
                      "%s", why, exc)
            return False
        try:
            changes, not_applied = self.fleet.apply(config)
        except Exception:
            self.metrics.config_reloads.inc(("rejected",))
            log.exception("configuration reload (%s) failed while applying it", why)
            return False
        self.metrics.config_reloads.inc(("ok",))
        if not_applied:
            log.warning("configuration reload (%s): changed settings that need a restart were "
                        "NOT applied: %s", why, ", ".join(not_applied))
        log.info("configuration reloaded from %s (%s): %s", self.path, why,
                 "; ".join(changes) if changes else "no replica changed")
        return True
