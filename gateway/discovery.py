"""Discovery: pools whose replicas come from DNS or from Kubernetes EndpointSlices.

Each pool with a `discovery` section has one source. A round of a source either finds a set
of endpoints (address, port, ready) or fails. What it finds goes through `Fleet.sync`, the
path the admin API and reloads take: a replica that appears joins once a health check passes,
one that disappears (or terminates) drains, its requests in flight finishing, and is dropped.
A round that fails changes nothing: the replicas found before stay, the failure is counted in
`gateway_discovery_errors_total` and logged once, when discovery starts failing (and once
when it works again).

- DNS: the name is resolved every `interval_s` through `Resolver` (the system's resolver, run
  by the event loop's executor: `loop.getaddrinfo`), each address a replica.
- Kubernetes: a thread lists the EndpointSlices the label selector picks and watches them from
  the list's resourceVersion, with the official `kubernetes` client (synchronous, hence the
  thread); the watch ends every `resync_s` (the server closes it) and the slices are listed
  again, and a watch that expired (410 Gone) is followed by a list at once. Each change is
  handed to the event loop with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from backends.pool import Pool, ReplicaSpec
from gateway.config import (
    DiscoveryConfig,
    GatewayConfig,
    discovered_name,
    discovered_url,
)
from gateway.fleet import Fleet, Found

log = logging.getLogger("prefix_gateway.discovery")

Endpoints = dict[tuple[str, int], bool]
"""(address, port) -> ready."""

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
BACKOFF_MAX_S = 30.0
"""The longest wait before a failed Kubernetes list or watch is tried again."""
FIRST_ROUND_S = 15.0
"""At start, the longest wait for a Kubernetes source's first list (DNS: its timeout_s)."""


class Resolver(Protocol):
    async def resolve(self, name: str, port: int, family: str) -> set[str]:
        """The addresses `name` resolves to (`family`: any, ipv4 or ipv6); raises OSError
        (socket.gaierror) when it cannot be resolved."""
        ...


_FAMILIES = {"any": socket.AF_UNSPEC, "ipv4": socket.AF_INET, "ipv6": socket.AF_INET6}


class SystemResolver:
    """The system's resolver (/etc/hosts, /etc/resolv.conf), off the event loop."""

    async def resolve(self, name: str, port: int, family: str) -> set[str]:
        infos = await asyncio.get_running_loop().getaddrinfo(
            name, port, family=_FAMILIES[family], type=socket.SOCK_STREAM)
        return {str(info[4][0]) for info in infos}


class Source:
    """One pool's discovery."""

    def __init__(self, discovery: Discovery, pool: Pool, config: DiscoveryConfig) -> None:
        self.discovery = discovery
        self.pool = pool
        self.config = config
        self.kind = config.kind
        self.first = asyncio.Event()
        """Set after the first round, found or failed."""
        self.failing = False
        self.stopped = False
        metrics = discovery.fleet.state.metrics
        metrics.discovery_success.values.setdefault((pool.name, self.kind), 0.0)
        metrics.discovery_errors.values.setdefault((pool.name, self.kind), 0.0)

    @property
    def scheme(self) -> str:
        sub = self.config.dns or self.config.kubernetes
        assert sub is not None
        return sub.scheme

    def found(self, endpoints: Endpoints) -> None:
        if self.stopped:
            return
        metrics = self.discovery.fleet.state.metrics
        key = (self.pool.name, self.kind)
        metrics.discovery_success.set(key, time.time())
        metrics.discovered.set(key, len(endpoints))
        if self.failing:
            log.info("discovery (%s) of pool %s works again: %d replicas found", self.kind,
                     self.pool.name, len(endpoints))
        self.failing = False
        found: dict[str, Found] = {}
        for (address, port), ready in endpoints.items():
            name = discovered_name(self.pool.name, address, port)
            found[name] = (ReplicaSpec(name, discovered_url(self.scheme, address, port)), ready)
        self.discovery.fleet.sync(self.pool, self.kind, found)
        self.first.set()

    def failed(self, why: str) -> None:
        if self.stopped:
            return
        self.discovery.fleet.state.metrics.discovery_errors.inc((self.pool.name, self.kind))
        if not self.failing:
            kept = sum(1 for (p, _), s in self.discovery.fleet.owner.items()
                       if p == self.pool.name and s == self.kind)
            log.warning("discovery (%s) of pool %s failed; the %d replicas it found before "
                        "are kept: %s", self.kind, self.pool.name, kept, why)
        self.failing = True
        self.first.set()

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        """Stop finding: nothing it finds from now on is applied."""
        self.stopped = True

    async def join(self) -> None:
        """Wait until it has stopped (after `stop`)."""

    def first_round_s(self) -> float:
        raise NotImplementedError


class DnsSource(Source):
    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    def first_round_s(self) -> float:
        assert self.config.dns is not None
        return self.config.dns.timeout_s + 1.0

    async def _run(self) -> None:
        dns = self.config.dns
        assert dns is not None
        resolver = self.discovery.resolver
        # Also checked, not only cancelled: asyncio.wait_for (Python 3.11) can swallow a
        # cancellation that arrives just as the resolution completes.
        while not self.stopped:
            try:
                addresses = await asyncio.wait_for(
                    resolver.resolve(dns.name, dns.port, dns.family), dns.timeout_s)
            except TimeoutError:
                self.failed(f"{dns.name}: no answer within {dns.timeout_s:g} s")
            except OSError as exc:
                self.failed(f"{dns.name}: {exc.strerror or exc}")
            except Exception as exc:  # a resolver's own bug: a failed round, not a dead task
                self.failed(f"{dns.name}: {type(exc).__name__}: {exc}")
            else:
                if addresses:
                    self.found({(a, dns.port): True for a in addresses})
                else:
                    self.failed(f"{dns.name} resolved to no address")
            await asyncio.sleep(dns.interval_s)

    def stop(self) -> None:
        super().stop()
        self._task.cancel()

    async def join(self) -> None:
        await asyncio.gather(self._task, return_exceptions=True)


class KubernetesSource(Source):
    """Lists and watches EndpointSlices in a thread of its own."""

    def start(self) -> None:
        self._stop = threading.Event()
        self._watch: Any = None
        self._problems: set[str] = set()
        self._events = 0
        """Events the current watch delivered."""
        self._thread = threading.Thread(target=self._run, args=(asyncio.get_running_loop(),),
                                        name=f"discovery-{self.pool.name}", daemon=True)
        self._thread.start()

    def first_round_s(self) -> float:
        return FIRST_ROUND_S

    def stop(self) -> None:
        super().stop()
        self._stop.set()
        watch = self._watch
        if watch is not None:
            watch.stop()  # shuts its socket down: the thread's read returns

    async def join(self) -> None:
        await asyncio.to_thread(self._thread.join, 10.0)

    # In the thread --------------------------------------------------------------------------

    def _post(self, loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> None:
        if not self._stop.is_set():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(fn, *args)

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        from kubernetes.client.exceptions import ApiException

        k8s = self.config.kubernetes
        assert k8s is not None
        namespace = k8s.namespace or own_namespace()
        api = None
        backoff = 1.0
        expired = 0
        """Watches in a row that expired before any event: past the first, wait as after
        a failure (a server that keeps saying 410 is not listed in a tight loop)."""
        while not self._stop.is_set():
            try:
                if api is None:
                    api = self._api()
                slices: dict[str, dict[str, Any]] = {}
                version = self._list(api, namespace, slices)
                self._deliver(loop, slices)
                backoff = 1.0
                self._events = 0
                self._follow(api, namespace, version, slices, loop)
                expired = 0
                continue  # the watch ended (resync_s): list again
            except ApiException as exc:
                if exc.status == 410:
                    log.info("discovery (kubernetes) of pool %s: the watch expired (410 "
                             "Gone); listing again", self.pool.name)
                    expired = 1 if self._events else expired + 1
                    if expired > 1:
                        self._stop.wait(backoff)
                        backoff = min(backoff * 2, BACKOFF_MAX_S)
                    continue
                why = f"HTTP {exc.status} {exc.reason}".strip()
            except Exception as exc:  # unreachable server, bad kubeconfig, ...
                why = f"{type(exc).__name__}: {exc}"
            if self._stop.is_set():
                return
            self._post(loop, self.failed, f"namespace {namespace}, selector {k8s.selector}: "
                       f"{why}")
            self._stop.wait(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX_S)

    def _api(self) -> Any:
        from kubernetes import client
        from kubernetes import config as kube_config

        k8s = self.config.kubernetes
        assert k8s is not None
        configuration = client.Configuration()
        if k8s.kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
            kube_config.load_incluster_config(client_configuration=configuration)
        else:
            kube_config.load_kube_config(config_file=k8s.kubeconfig, context=k8s.context,
                                         client_configuration=configuration)
        return client.DiscoveryV1Api(client.ApiClient(configuration))

    def _list(self, api: Any, namespace: str, slices: dict[str, dict[str, Any]]) -> str:
        k8s = self.config.kubernetes
        assert k8s is not None
        resp = api.list_namespaced_endpoint_slice(namespace, label_selector=k8s.selector,
                                                  _preload_content=False,
                                                  _request_timeout=(10, 60))
        try:
            body = json.loads(resp.data)
        finally:
            resp.release_conn()
        for item in body.get("items") or []:
            slices[item["metadata"]["name"]] = item
        return str(body["metadata"]["resourceVersion"])

    def _follow(self, api: Any, namespace: str, version: str,
                slices: dict[str, dict[str, Any]], loop: asyncio.AbstractEventLoop) -> None:
        """Follow the watch until it ends (raises ApiException 410 if it expires)."""
        from kubernetes import watch

        k8s = self.config.kubernetes
        assert k8s is not None
        self._watch = w = watch.Watch()
        if self._stop.is_set():
            return
        try:
            # With timeout_seconds the client does not resume by itself: a 410 is raised.
            for event in w.stream(api.list_namespaced_endpoint_slice, namespace,
                                  label_selector=k8s.selector, resource_version=version,
                                  timeout_seconds=int(k8s.resync_s),
                                  _request_timeout=(10, k8s.resync_s + 60)):
                kind, obj = event["type"], event["raw_object"]
                name = (obj.get("metadata") or {}).get("name")
                if kind in ("ADDED", "MODIFIED") and name:
                    slices[name] = obj
                elif kind == "DELETED" and name:
                    slices.pop(name, None)
                else:
                    continue  # BOOKMARK
                self._events += 1
                self._deliver(loop, slices)
        finally:
            self._watch = None

    def _deliver(self, loop: asyncio.AbstractEventLoop,
                 slices: dict[str, dict[str, Any]]) -> None:
        k8s = self.config.kubernetes
        assert k8s is not None
        endpoints, problems = slice_endpoints(slices.values(), k8s.port_name)
        for problem in problems:
            if problem not in self._problems:
                self._problems.add(problem)
                log.warning("discovery (kubernetes) of pool %s: %s", self.pool.name, problem)
        self._post(loop, self.found, endpoints)


def own_namespace() -> str:
    """The namespace of the pod the gateway runs in (its service account's), else default."""
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or "default"
    except OSError:
        return "default"


def slice_endpoints(slices: Iterable[dict[str, Any]],
                    port_name: str | None) -> tuple[Endpoints, list[str]]:
    """The endpoints of EndpointSlices (discovery.k8s.io/v1, as the API serves them), with the
    port named `port_name` (None: a slice's only port): (address, port) -> ready. A
    terminating endpoint is left out (it drains, even while it still serves); one whose
    `ready` is false is there, not ready; a `ready` left out (nil) means ready. An endpoint's
    addresses are fungible: the first is used. Also returns what made slices unusable."""
    found: Endpoints = {}
    problems: list[str] = []
    for s in slices:
        name = (s.get("metadata") or {}).get("name", "?")
        ports = s.get("ports") or []
        if port_name is None:
            if len(ports) != 1:
                problems.append(f"EndpointSlice {name} has {len(ports)} ports: set port_name")
                continue
            port = ports[0]
        else:
            port = next((p for p in ports if (p.get("name") or "") == port_name), None)
            if port is None:
                problems.append(f"EndpointSlice {name} has no port named {port_name!r}")
                continue
        number = port.get("port")
        if number is None:
            problems.append(f"EndpointSlice {name}: its port has no number (all ports)")
            continue
        for endpoint in s.get("endpoints") or []:
            conditions = endpoint.get("conditions") or {}
            addresses = endpoint.get("addresses") or []
            if conditions.get("terminating") is True or not addresses:
                continue
            key = (str(addresses[0]), int(number))
            found[key] = found.get(key, False) or conditions.get("ready") is not False
    return found, problems


_SOURCES: dict[str, type[Source]] = {"dns": DnsSource, "kubernetes": KubernetesSource}


class Discovery:
    """Every pool's discovery source: started with the gateway, changed by reloads."""

    def __init__(self, fleet: Fleet, resolver: Resolver | None = None) -> None:
        self.fleet = fleet
        self.resolver: Resolver = resolver or SystemResolver()
        self.sources: dict[str, Source] = {}
        fleet.discovery = self

    async def start(self) -> None:
        """Start every pool's source and wait for its first round (and for the health checks
        of the replicas it found), so that the gateway starts serving with them."""
        for pc in self.fleet.state.config.pools:
            if pc.discovery is not None:
                self._start(self.fleet.state.pool_by_name[pc.name], pc.discovery)
        await self._first_rounds(list(self.sources.values()))

    async def _first_rounds(self, sources: list[Source]) -> None:
        for s in sources:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(s.first.wait(), s.first_round_s())
        await self.fleet.settled()

    async def stop(self) -> None:
        sources = list(self.sources.values())
        self.sources.clear()
        for s in sources:
            s.stop()
        await asyncio.gather(*(s.join() for s in sources), return_exceptions=True)

    def apply(self, new: GatewayConfig) -> list[str]:
        """A reloaded configuration: start, restart or stop the sources whose settings
        changed. A source restarted with other settings keeps the replicas it found until its
        first round finds others; a source stopped takes its replicas away (drained)."""
        changes: list[str] = []
        wanted = {p.name: p.discovery for p in new.pools}
        for pool in self.fleet.state.pools:
            want = wanted.get(pool.name)
            cur = self.sources.get(pool.name)
            if cur is not None and cur.config == want:
                continue
            if cur is not None:
                cur.stop()
                del self.sources[pool.name]
                if want is None or want.kind != cur.kind:
                    changes += self.fleet.forget_source(pool, cur.kind)
                    self.fleet.state.metrics.forget_discovery(pool.name, cur.kind)
                    changes.append(f"{pool.name}: {cur.kind} discovery stopped")
            if want is not None:
                self._start(pool, want)
                changes.append(f"{pool.name}: {want.kind} discovery "
                               f"{'restarted' if cur is not None else 'started'}")
        return changes

    def _start(self, pool: Pool, config: DiscoveryConfig) -> None:
        source = _SOURCES[config.kind](self, pool, config)
        self.sources[pool.name] = source
        source.start()
