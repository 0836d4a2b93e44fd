"""The shadow single gateway: where one gateway would have sent what several gateways routed."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gateway.config import GatewayConfig, parse_config
from gateway.wiring import build_router
from loadtests.traces import TraceRequest, prompt_text, shadow_agreement
from routing import Router, RoutingRequest
from routing.policies.base import decide
from routing.types import Decision, ReplicaView


class Shadow:
    """The shadow single gateway: one more router that sees every request and every event of
    a run at once, with no sharing delay, to say where one gateway would have sent each
    request that several gateways routed.

    Before a request is routed the shadow is asked where it would send it (its policy's
    choice on the views it builds from its own, exact, load); then it is told where the
    request really went and records that instead (its index, its load and its policy's
    balancing of recent prefill count the real replica), so that its state follows the real
    fleet rather than a fleet of its own."""

    __slots__ = ("_told", "held", "matched", "picks", "router")

    def __init__(self, router: Router, requests: int) -> None:
        self.router = router
        self.picks: list[str | None] = [None] * requests
        """Per request, the replica the shadow would have chosen (None: not routed)."""
        self.matched: list[tuple[int, int] | None] = [None] * requests
        """Per request, the blocks of it that the shadow's index held on its own pick and on
        the replica that really served it (None: not routed)."""
        self.held: list[int | None] = [None] * requests
        """Per request, the most blocks of it that the shadow's index held on any one replica
        when it was asked (0: cold for one gateway, wherever the trace says it came before;
        None: not routed)."""
        self._told: list[Decision | None] = [None] * requests

    def ask(self, request: RoutingRequest, views: list[ReplicaView]) -> Decision:
        """Where the shadow would send `request`, on `views` (nothing recorded)."""
        return self.router.policy.choose(request, views, self.router)

    def tell(self, rid: int, request: RoutingRequest, pick: Decision, real: Decision) -> None:
        """Request `rid`, for which the shadow answered `pick`, really went as `real`: the
        shadow records that, and its pick."""
        router = self.router
        # Before the request is recorded: what the shadow held when it was asked.
        self.held[rid] = max((router.matched_blocks(name, request.hashes)
                              for name in router.indexes), default=0) if request.hashes else 0
        told = pick if pick.replica == real.replica else decide(
            request, router, real.replica, real.reason, [])
        router.commit(request, told)
        self.picks[rid] = pick.replica
        self.matched[rid] = (pick.matched_blocks, told.matched_blocks)
        self._told[rid] = told

    def _decision(self, rid: int) -> Decision:
        told = self._told[rid]
        assert told is not None  # only routed requests have later events
        return told

    def dispatched(self, rid: int, blind_at: float | None = None) -> None:
        self.router.dispatched(self._decision(rid), blind_at=blind_at)

    def first_token(self, rid: int, now: float, sent_at: float) -> None:
        self.router.first_token(self._decision(rid), now, sent_at)

    def finished(self, rid: int, saw_first_token: bool = True, output_tokens: int = 0) -> None:
        self.router.finished(self._decision(rid), saw_first_token, output_tokens)


class ReplayShadow:
    """A `Shadow` fed by a replay's client, over HTTP: the literal single-gateway
    counterfactual for gateways the replay drives.

    The client asks it where one gateway would send request i just before sending it, tells
    it where the request went (the `x-gateway-replica` response header) when the answer's
    headers arrive, and passes on every streamed chunk, first token and end as a gateway sees
    them. Its router is built from the gateways' own configuration; `sync` copies from a
    gateway's `/admin/stats` what the gateways learn from the engines (each replica's index
    capacity, their last scrape's waiting requests and KV usage). It learns step times, rates
    and speeds from the chunks it sees, which reach the client a little after they reach the
    gateway, and its index and load count a request from its response headers, a little after
    the gateway counted it: both are small against a step."""

    def __init__(self, router: Router, requests: Sequence[TraceRequest]) -> None:
        self.router = router
        self.shadow = Shadow(router, len(requests))
        self._texts = [prompt_text(r) for r in requests]
        self._requests: dict[int, RoutingRequest] = {}
        """Request i as the shadow hashed it when asked (at the chars per token of then)."""
        self._asked: dict[int, Decision] = {}
        self._sent_at: dict[int, float] = {}
        self._scraped: dict[str, tuple[int, float]] = {}

    def ask(self, i: int, now: float) -> None:
        """Request i is about to be sent at `now`: where would one gateway send it?"""
        load = self.router.load
        views = [load.view(name, now, *self._scraped.get(name, (0, None)))
                 for name in self.router.indexes]
        if views:
            request = self._requests[i] = self.router.request_from_text(self._texts[i])
            self._asked[i] = self.shadow.ask(request, views)
            self._sent_at[i] = now

    def served(self, i: int, replica: str | None, reason: str | None) -> bool:
        """Request i's answer says `replica` serves it (None, or a replica the shadow does not
        know: not counted). True when the shadow follows the request from here on."""
        pick = self._asked.pop(i, None)
        if pick is None or replica is None or replica not in self.router.indexes:
            self.dropped(i)
            return False
        request = self._requests.pop(i)
        real = decide(request, self.router, replica, reason or pick.reason, [])
        self.shadow.tell(i, request, pick, real)
        self.shadow.dispatched(i)
        return True

    def dropped(self, i: int) -> None:
        """Request i failed before it was served: forget the question."""
        self._asked.pop(i, None)
        self._sent_at.pop(i, None)
        self._requests.pop(i, None)

    def chunk(self, replica: str, now: float) -> None:
        if replica in self.router.indexes:
            self.router.chunk(replica, now)

    def first_token(self, i: int, now: float) -> None:
        self.shadow.first_token(i, now, self._sent_at[i])

    def finished(self, i: int, saw_first_token: bool) -> None:
        self._sent_at.pop(i, None)
        self.shadow.finished(i, saw_first_token)

    def sync(self, stats: Mapping[str, Any], pool: str | None = None) -> None:
        """Copy from a gateway's `/admin/stats` (its pool `pool`, else the first) what it
        learned from the engines: the characters per token it estimates prompts by, each
        replica's prefix-index capacity, and the waiting requests and KV usage of its last
        scrape."""
        pools = stats.get("pools") or []
        chosen = next((p for p in pools if pool is None or p.get("name") == pool), None)
        if chosen is None:
            return
        if chosen.get("chars_per_token"):
            self.router.chars_per_token = float(chosen["chars_per_token"])
        for rep in chosen.get("replicas") or []:
            name = rep.get("name")
            if name not in self.router.indexes:
                continue
            capacity = rep.get("index_capacity_blocks")
            if capacity and capacity != self.router.indexes[name].capacity_blocks:
                self.router.resize_index(name, int(capacity))
            waiting, usage = rep.get("engine_waiting"), rep.get("engine_kv_usage")
            if waiting is not None and usage is not None:
                self._scraped[name] = (int(waiting), float(usage))

    def figures(self, requests: Sequence[TraceRequest],
                replicas: Sequence[str | None]) -> dict[str, Any]:
        """`shadow_agreement`, `shadow_match_agreement`, `shadow_warm_requests`,
        `shadow_held_agreement` and `shadow_held_requests` of a run whose request i was served
        by `replicas[i]`."""
        return shadow_agreement(requests, replicas, self.shadow.picks, self.shadow.matched,
                                self.shadow.held)


def replay_shadow(config: GatewayConfig | Mapping[str, Any], requests: Sequence[TraceRequest],
                  pool: str | None = None) -> ReplayShadow:
    """A `ReplayShadow` for gateways running `config` (a parsed config, or one as a dict):
    its pool `pool` (default: the first), its routing settings and its replicas' names."""
    cfg = config if isinstance(config, GatewayConfig) else parse_config(dict(config))
    chosen = next((p for p in cfg.pools if pool is None or p.name == pool), None)
    if chosen is None:
        raise ValueError(f"no pool {pool!r} in the configuration")
    router = build_router(cfg.routing_for(chosen), chosen.engine)
    for replica in chosen.replicas:
        router.add_replica(replica.name)
    return ReplayShadow(router, requests)
