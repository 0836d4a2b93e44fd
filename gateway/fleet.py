"""Replicas joining and leaving a running gateway: from a reloaded configuration file, or
from the admin API.

A replica that leaves is drained: at once it gets no new request (it is neither healthy nor
suspect, which is all routing and fallbacks look at, and its prefix index is gone), the
requests it has in flight, streams included, finish as they would have, and then it is
dropped from the pool, the stats and the metrics. A replica that joins is out of rotation
until a health check passes, as every replica is at start.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from pydantic import ValidationError

from backends.pool import Pool, ReplicaSpec, ReplicaState
from gateway.config import GatewayConfig, ReplicaConfig
from gateway.errors import GatewayError, bad_request
from gateway.state import GatewayState
from gateway.stats import shown_url

log = logging.getLogger("prefix_gateway.fleet")

Found = tuple[ReplicaSpec, bool]
"""A discovered replica: its spec, and whether it is ready."""


class Applier(Protocol):
    def apply(self, new: GatewayConfig) -> list[str]: ...

DRAIN_POLL_S = 0.05
"""How often a draining replica is looked at to see whether its last request ended."""


def replica_spec(r: ReplicaConfig) -> ReplicaSpec:
    return ReplicaSpec(r.name, r.base_url, tuple(r.models) if r.models else None, r.api_key)


def not_found(what: str, name: str) -> GatewayError:
    return GatewayError(404, f"No {what} named {name!r}.", code=f"{what}_not_found")


def conflict(message: str, code: str) -> GatewayError:
    return GatewayError(409, message, code=code)


class Fleet:
    """Adds, drains and removes replicas of the running pools, and applies a reloaded
    configuration's replicas (`apply`)."""

    def __init__(self, state: GatewayState) -> None:
        self.state = state
        self._drops: dict[tuple[str, str], asyncio.Task[None]] = {}
        """Replicas being removed: dropped once nothing is in flight there."""
        self._tasks: set[asyncio.Task[None]] = set()
        self.discovery: Applier | None = None
        """Applies a reloaded configuration's discovery settings (gateway/discovery.py)."""
        self._found: dict[tuple[str, str], dict[str, Found]] = {}
        """(pool, source) -> the replicas that source found last, as `sync` applied them."""
        self.owner: dict[tuple[str, str], str] = {}
        """(pool, replica) -> the discovery source that found it; not there: from the file
        or the admin API."""
        self._refused: set[tuple[str, str, str]] = set()
        """(pool, replica, why) of discovered replicas left out, each logged once."""

    async def stop(self) -> None:
        tasks = [*self._drops.values(), *self._tasks]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # Looking up -------------------------------------------------------------------------------

    def pool(self, name: str) -> Pool:
        pool = self.state.pool_by_name.get(name)
        if pool is None:
            raise not_found("pool", name)
        return pool

    def replica(self, pool: Pool, name: str) -> ReplicaState:
        r = pool.replicas.get(name)
        if r is None:
            raise not_found("replica", name)
        return r

    def removing(self, pool: Pool, name: str) -> bool:
        return (pool.name, name) in self._drops

    def describe(self, pool: Pool, r: ReplicaState) -> dict[str, Any]:
        return {"name": r.name, "pool": pool.name, "url": shown_url(r.base_url),
                "models": sorted(r.models), "healthy": r.healthy, "draining": r.draining,
                "removing": self.removing(pool, r.name),
                "discovered_by": self.owner.get((pool.name, r.name)),
                "inflight": pool.load.inflight.get(r.name, 0)}

    def listing(self) -> dict[str, Any]:
        return {"pools": [{"name": p.name, "replicas": [self.describe(p, r)
                                                        for r in p.replicas.values()]}
                          for p in self.state.pools]}

    # The admin API ----------------------------------------------------------------------------

    def add(self, pool_name: str, body: Any) -> ReplicaState:
        """A replica from the admin API: validated as in the file, its name new to every pool,
        its URL to every replica not being removed."""
        pool = self.pool(pool_name)
        try:
            rc = ReplicaConfig.model_validate(body)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}"
                                 for e in exc.errors()[:3])
            raise bad_request(f"Invalid replica: {problems}", code="invalid_replica") from None
        for p in self.state.pools:
            if rc.name in p.replicas:
                raise conflict(f"A replica named {rc.name!r} exists already (pool {p.name!r}).",
                               "duplicate_replica")
            for r in p.replicas.values():
                if (r.base_url.lower() == rc.base_url.lower()
                        and not self.removing(p, r.name)):
                    raise conflict(f"Replica {p.name}/{r.name} has this url already; each "
                                   "engine replica is listed once.", "duplicate_url")
        r = self._join(pool, replica_spec(rc))
        log.info("replica %s/%s (%s) added through the admin API; in rotation once a health "
                 "check passes", pool.name, r.name, shown_url(r.base_url))
        return r

    def drain(self, pool_name: str, name: str, remove: bool = False) -> ReplicaState:
        """Out of rotation now; with `remove`, dropped once its requests in flight ended."""
        pool = self.pool(pool_name)
        r = self.replica(pool, name)
        self._drain(pool, r, remove)
        return r

    # Applying a reloaded configuration ------------------------------------------------------

    def apply(self, new: GatewayConfig) -> tuple[list[str], list[str]]:
        """Make each running pool's replicas those of `new`: the file is the truth at each
        reload (replicas added or drained through the admin API meanwhile follow it). Returns
        what changed, and the settings that changed but need a restart (not applied)."""
        changes: list[str] = []
        wanted = {p.name: p for p in new.pools}
        for pool in self.state.pools:
            pc = wanted.get(pool.name)
            if pc is None:
                continue  # a pool removed: reported by restart_needed
            want = {r.name: r for r in pc.replicas}
            for name, r in list(pool.replicas.items()):
                if (pool.name, name) in self.owner:
                    if name not in want:
                        continue  # found by discovery, not the file's
                    self._disown(pool, name)  # the file lists it: the file's from now on
                if name not in want and not self.removing(pool, name):
                    self._drain(pool, r, remove=True)
                    changes.append(f"{pool.name}/{name} removed (draining)")
            for name, rc in want.items():
                spec = replica_spec(rc)
                cur = pool.replicas.get(name)
                if cur is None:
                    self._join(pool, spec)
                    changes.append(f"{pool.name}/{name} added ({shown_url(spec.base_url)})")
                    continue
                if cur.base_url != spec.base_url:
                    self._cancel_drop(pool, name)
                    self._join(pool, spec)
                    changes.append(f"{pool.name}/{name} moved to {shown_url(spec.base_url)} "
                                   "(its requests in flight finish on the old url)")
                    continue
                if cur.draining:
                    self._undrain(pool, cur)
                    changes.append(f"{pool.name}/{name} back in the pool (it is in the file)")
                models = set(spec.models) if spec.models else set(pool.spec.models)
                key = spec.api_key or pool.spec.api_key
                if models != cur.models or (f"Bearer {key}" if key else None) != cur.auth:
                    pool.update_replica(spec)
                    self._refresh_models()
                    changes.append(f"{pool.name}/{name} models or api_key changed")
        if self.discovery is not None:
            changes += self.discovery.apply(new)
        changed, not_applied = self.state.experiments.apply(new)
        return changes + changed, restart_needed(self.state.config, new) + not_applied

    # Discovery ----------------------------------------------------------------------------

    def sync(self, pool: Pool, source: str, found: dict[str, Found]) -> list[str]:
        """Make the replicas `source` found in `pool` those of `found` (name -> its spec, and
        whether it is ready): a replica that appeared joins (in rotation once a health check
        passes), one that is no longer ready drains and stays listed, one that is ready again
        comes back, one that is gone (or terminating) drains and is dropped once idle. Only
        what changed since the last sync is acted on, so a discovered replica drained through
        the admin API stays drained while discovery keeps finding it unchanged."""
        key = (pool.name, source)
        before = self._found.get(key, {})
        kept: dict[str, Found] = {}
        changes: list[str] = []
        for name in before.keys() - found.keys():
            if self.owner.get((pool.name, name)) != source:
                continue  # never joined (not ready yet), or the file's now
            del self.owner[(pool.name, name)]
            r = pool.replicas.get(name)
            if r is not None and not self.removing(pool, name):
                self._drain(pool, r, remove=True)
                changes.append(f"{pool.name}/{name} gone (draining)")
        for name, (spec, ready) in found.items():
            if before.get(name) == (spec, ready):
                kept[name] = (spec, ready)
                continue
            cur = pool.replicas.get(name)
            mine = self.owner.get((pool.name, name)) == source
            why = None if mine else self._refusal(pool, spec)
            if why is not None:
                if (pool.name, name, why) not in self._refused:
                    self._refused.add((pool.name, name, why))
                    log.warning("discovery (%s) found %s for pool %s and left it out: %s",
                                source, shown_url(spec.base_url), pool.name, why)
                continue
            kept[name] = (spec, ready)
            if not ready:
                if mine and cur is not None and not cur.draining:
                    self._drain(pool, cur, remove=False)
                    changes.append(f"{pool.name}/{name} not ready (draining)")
                continue
            self.owner[(pool.name, name)] = source
            if cur is None or cur.base_url != spec.base_url:
                self._cancel_drop(pool, name)
                self._join(pool, spec)
                changes.append(f"{pool.name}/{name} found ({shown_url(spec.base_url)})")
            elif cur.draining:
                self._undrain(pool, cur)
                changes.append(f"{pool.name}/{name} ready again")
        self._found[key] = kept
        if changes:
            log.info("discovery (%s): %s", source, "; ".join(changes))
        return changes

    def forget_source(self, pool: Pool, source: str) -> list[str]:
        """A discovery source that no longer runs: its replicas drain and are dropped."""
        changes = self.sync(pool, source, {})
        self._found.pop((pool.name, source), None)
        return changes

    def _refusal(self, pool: Pool, spec: ReplicaSpec) -> str | None:
        """Why a discovered replica cannot join: its name or URL is another replica's."""
        for p in self.state.pools:
            other = p.replicas.get(spec.name)
            if other is not None and not self.removing(p, spec.name):
                return f"a replica named {spec.name!r} exists already (pool {p.name!r})"
            for r in p.replicas.values():
                if (r.base_url.lower() == spec.base_url.lower() and r.name != spec.name
                        and not self.removing(p, r.name)):
                    return f"replica {p.name}/{r.name} has this url already"
        return None

    def _disown(self, pool: Pool, name: str) -> None:
        source = self.owner.pop((pool.name, name))
        self._found.get((pool.name, source), {}).pop(name, None)

    async def settled(self) -> None:
        """Wait for the health checks of the replicas that joined so far."""
        await asyncio.gather(*list(self._tasks), return_exceptions=True)

    # Membership changes -----------------------------------------------------------------------

    def _join(self, pool: Pool, spec: ReplicaSpec) -> ReplicaState:
        state = self.state
        r = pool.add_replica(spec)
        state.monitor.forget(pool, spec.name)
        state.observer.replica_up(pool.name, r.name, False)
        state.metrics.inflight.values.setdefault((pool.name, r.name), 0)
        state.admission.health_changed(pool.name)
        self._refresh_models()
        self._spawn(state.monitor.check_now(pool, r))
        return r

    def _drain(self, pool: Pool, r: ReplicaState, remove: bool) -> None:
        if not r.draining:
            pool.drain(r.name)
            self.state.observer.replica_up(pool.name, r.name, False)
            self.state.admission.health_changed(pool.name)
            self._refresh_models()
            log.info("replica %s/%s draining: no new requests, %d in flight finish", pool.name,
                     r.name, pool.load.inflight.get(r.name, 0))
        key = (pool.name, r.name)
        if remove and key not in self._drops:
            self._drops[key] = asyncio.create_task(self._drop_when_idle(pool, r))

    def _undrain(self, pool: Pool, r: ReplicaState) -> None:
        self._cancel_drop(pool, r.name)
        pool.undrain(r.name)
        self.state.monitor.forget(pool, r.name)
        self._refresh_models()
        self._spawn(self.state.monitor.check_now(pool, r))

    def _cancel_drop(self, pool: Pool, name: str) -> None:
        task = self._drops.pop((pool.name, name), None)
        if task is not None:
            task.cancel()

    async def _drop_when_idle(self, pool: Pool, r: ReplicaState) -> None:
        key = (pool.name, r.name)
        try:
            while not pool.idle(r.name):
                await asyncio.sleep(DRAIN_POLL_S)
        except asyncio.CancelledError:
            return
        if self._drops.get(key) is not asyncio.current_task():
            return
        del self._drops[key]
        if pool.replicas.get(r.name) is not r:
            return  # replaced meanwhile
        state = self.state
        pool.drop(r.name)
        state.monitor.forget(pool, r.name)
        state.metrics.forget_replica(pool.name, r.name)
        if not any(r.name in p.replicas for p in state.pools):
            state.stats.replicas.pop(r.name, None)
        state.admission.health_changed(pool.name)
        self._refresh_models()
        log.info("replica %s/%s drained and removed", pool.name, r.name)

    def _refresh_models(self) -> None:
        self.state.models = sorted({m for p in self.state.pools for m in p.models})

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


_RELOADED = frozenset(("pools", "experiments"))
"""Top-level sections a reload applies (the pools: their replicas and discovery)."""


def restart_needed(old: GatewayConfig, new: GatewayConfig) -> list[str]:
    """The settings, other than pools' replicas, that differ between `old` and `new`: a
    reload does not apply them (each is read once, when the gateway starts)."""
    a, b = _settings(old), _settings(new)
    out = [k for k in sorted(set(a) | set(b))
           if k not in _RELOADED and a.get(k) != b.get(k)]
    pa, pb = a["pools"], b["pools"]
    for name in sorted(set(pa) | set(pb)):
        if name not in pb:
            out.append(f"pools: {name} removed")
        elif name not in pa:
            out.append(f"pools: {name} added")
        else:
            out += [f"pools[{name}].{k}" for k in sorted(set(pa[name]) | set(pb[name]))
                    if pa[name].get(k) != pb[name].get(k)]
    return out


def _settings(cfg: GatewayConfig) -> dict[str, Any]:
    d = cfg.model_dump(mode="json")
    pools = {}
    for p in d["pools"]:
        p.pop("replicas", None)
        p.pop("discovery", None)
        pools[p["name"]] = p
    d["pools"] = pools
    return d
