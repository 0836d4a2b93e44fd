"""The gateway's configuration schema (pydantic) and the YAML loader that explains mistakes."""

from __future__ import annotations

import hashlib
import importlib.util
import ipaddress
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    AnyHttpUrl,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from backends.upstream import Timeouts
from routing.policies import (
    PolicySettingsError,
    policy_class,
    policy_names,
    settings_names,
    validate_settings,
)

EngineKind = Literal["vllm", "trtllm"]

OUTPUT_RESERVE: dict[EngineKind, float] = {"trtllm": 1.0, "vllm": 0.5}
"""`output_reserve` by engine, when not set: TensorRT-LLM's default scheduler reserves a
request's whole output when it admits it; vLLM allocates as it decodes."""

# RFC 9110 field-name: a token.
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


class _Strict(BaseModel):
    # A misspelt key is an error, not silently ignored: "polcy: round_robin" must not route
    # with the default policy while the operator believes otherwise.
    model_config = ConfigDict(extra="forbid")


class RoutingSettings(BaseModel):
    """How a pool chooses a replica: the router's own settings, and beside them, flat, the
    settings of the chosen policy (each policy's `Settings` model in routing/policies/)."""

    # Keys other than the router's are the policy's: validated against its settings model
    # below, so a misspelt or misplaced one is still an error.
    model_config = ConfigDict(extra="allow")

    policy: str = Field("prefix_affinity", description="the routing policy: one of "
                        f"{', '.join(policy_names())}")
    block_chars: int = Field(256, ge=16, le=65536, description="characters per hashed block")
    chars_per_token: float = Field(
        4.0, gt=0, description="to estimate tokens from characters (a first guess when learned)"
    )
    learn_chars_per_token: bool = Field(
        True, description="learn chars_per_token from the replicas' usage.prompt_tokens"
    )
    prefill_tokens_per_s: float | None = Field(
        None, ge=0.0, description="the engines' prefill rate, to price the wait for a "
        "replica's engine step in flight (timed from its streamed chunks) in prompt tokens; "
        "None: learn it from the steps that carry a prefill; 0: ignore step timing"
    )
    speed_decode_agrees: float = Field(
        1.2, ge=0.0, description="a replica's learned speed departs from 1 only while its "
        "decode-only steps, too, are more than this factor slower (or faster) than the median "
        "replica's: equal replicas' learned prefill rates stray, their decode steps do not "
        "(1 or less: the prefill rate alone decides)"
    )
    decode_step_wait: bool = Field(
        True, description="time the wait for a replica's engine step in flight, while no "
        "prefill is pending there, by its decode-only steps at the batch it runs (timed from "
        "its streamed chunks); false: by its typical step, which averages in the longer steps "
        "that carry prefill"
    )
    engine_speed: bool = Field(
        True, description="while a tenth or more of the requests ending show no first token "
        "(non-streaming ones passed through: their prefill hides in the engine steps the "
        "gateway times), price each replica's queue at the prefill rate its engine's metrics "
        "report (prompt tokens computed over seconds in prefill, between scrapes) over the "
        "median engine's; false: always at the rates the gateway timed"
    )
    index_capacity_blocks: int = Field(
        16384, ge=1, description="prefix index size per replica, until the engine reports its own"
    )
    pin_running: bool = Field(
        True, description="account in each replica's prefix index as its engine does: a "
        "running request's prefix is pinned from its first token until it finishes (the "
        "engine keeps those KV blocks), its output takes room from the decision until it ends "
        "(output_reserve), and the prefill still queued there gets room (the engine holds "
        "none of it yet); false: a plain LRU over what was sent. Gateways sharing routing "
        "state (and the workers of one gateway) pin each other's running requests' prefixes "
        "and reserve their outputs too"
    )
    output_reserve: float | None = Field(
        None, ge=0.0, le=1.0, description="with pin_running, the share of a running request's "
        "max_tokens its engine holds KV for beside its prompt, taken from the prefix index's "
        "capacity while it runs. None: by the pool's engine, 1.0 for trtllm (its default "
        "capacity scheduler, GUARANTEED_NO_EVICT, reserves the whole output when it admits a "
        "request), 0.5 for vllm (it allocates as it decodes: half, on average, of an output "
        "that runs to its max_tokens)"
    )
    output_cached: bool = Field(
        False, description="with pin_running, a finished request's output stays in its "
        "replica's prefix index, as blocks no prompt matches, evicted just before its prompt's: "
        "vLLM keeps the full blocks a request generated cached and frees a request's blocks tail "
        "first, so they push out older prefixes; false: an output's room is free again when "
        "its request ends (the default: a truer estimate, measured to route no better)")
    key_blocks: int = Field(1, ge=1, description="leading blocks that form the rendezvous key")
    hashing: Literal["chars", "engine_tokens"] = Field(
        "chars", description="hash character blocks, or the engine's own tokens (vLLM tokenises)"
    )
    token_block_size: int | None = Field(
        None, ge=1, description="tokens per block with engine_tokens (default: the engine's)"
    )

    @field_validator("policy")
    @classmethod
    def _registered(cls, v: str) -> str:
        policy_class(v)  # raises ValueError naming the registered policies
        return v

    @model_validator(mode="after")
    def _policy_settings(self) -> RoutingSettings:
        given = self.__pydantic_extra__ or {}
        if not given:
            return self
        try:
            validated = validate_settings(self.policy, given)
        except PolicySettingsError as exc:
            # Raised as a ValidationError, each problem at its own key, so the loader can name
            # the key's path and line as for any other mistake.
            raise ValidationError.from_exception_data(type(self).__name__, [
                InitErrorDetails(type=PydanticCustomError("policy_setting", "{why}",
                                                          {"why": self._explain(key, why)}),
                                 loc=(key,), input=given.get(key))
                for key, why in exc.problems
            ]) from None
        # Keep the values as the policy reads them (coerced), only those given.
        self.__pydantic_extra__ = {k: getattr(validated, k) for k in given}
        return self

    @classmethod
    def _explain(cls, key: str, why: str) -> str:
        if any(key in settings_names(name) for name in policy_names()):
            return why  # a setting of another policy
        return (f"unknown key (check its spelling and indentation): not a routing setting "
                f"({', '.join(sorted(cls.model_fields))}) nor {why.removeprefix('not ')}")

    def policy_settings(self) -> dict[str, Any]:
        """The chosen policy's settings, validated, its defaults filled in: what to pass to
        `routing.build_policy(self.policy, ...)`."""
        return validate_settings(self.policy, self.__pydantic_extra__ or {}).model_dump()

    def output_reserve_for(self, engine: EngineKind) -> float:
        """`output_reserve` as set, else as `engine` holds a running request's output."""
        return self.output_reserve if self.output_reserve is not None else OUTPUT_RESERVE[engine]

    def for_policy(self, policy: str) -> RoutingSettings:
        """These settings for another policy: the router's as they are, and of the policy
        settings, those `policy` also takes (a load_factor stays a load_factor)."""
        takes = set(settings_names(policy))
        kept = {k: v for k, v in (self.__pydantic_extra__ or {}).items() if k in takes}
        router = {k: getattr(self, k) for k in type(self).model_fields if k != "policy"}
        return RoutingSettings.model_validate({**router, "policy": policy, **kept})


# Below this, probing and scraping every replica would keep a core busy for nothing.
MIN_INTERVAL_S = 0.05


class HealthSettings(_Strict):
    interval_s: float = Field(2.0, ge=MIN_INTERVAL_S, le=3600)
    timeout_s: float = Field(2.0, gt=0, le=3600)
    failure_threshold: int = Field(2, ge=1)
    metrics_interval_s: float = Field(5.0, ge=MIN_INTERVAL_S, le=3600)
    passed_through_interval_s: float = Field(
        1.0, ge=0, le=3600, description="while requests passed through whole may still wait "
        "for their prefill on a replica, its engine's metrics are also read this often, for "
        "the counts that end those prefills in the gateway's queue (0: only every "
        "metrics_interval_s)")
    hit_ratio_window_s: float = Field(60.0, gt=0)

    @field_validator("passed_through_interval_s")
    @classmethod
    def _not_too_often(cls, v: float) -> float:
        if 0 < v < MIN_INTERVAL_S:
            raise ValueError(f"must be 0 (off) or at least {MIN_INTERVAL_S}")
        return v



def _repeated(names: list[str]) -> list[str]:
    """The names that occur more than once, sorted."""
    return sorted({n for n in names if names.count(n) > 1})

class ReplicaConfig(_Strict):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.:-]+$")
    url: AnyHttpUrl
    models: list[str] | None = None
    api_key: str | None = None

    @field_validator("url")
    @classmethod
    def _plain_url(cls, v: AnyHttpUrl) -> AnyHttpUrl:
        # Credentials in a URL end up in logs, stats and error messages; a query or fragment
        # would be glued in front of every request path.
        if v.username or v.password:
            raise ValueError("must not carry credentials (user:password@); put the replica's "
                             "key in api_key (of the replica or its pool) instead")
        if v.query or v.fragment:
            raise ValueError("must not have a query (?...) or fragment (#...): requests go to "
                             "this URL followed by the API path")
        return v

    @property
    def base_url(self) -> str:
        return str(self.url).rstrip("/")


class UpstreamTimeoutsConfig(_Strict):
    """How long the pool's replicas are waited for, in seconds; null: no limit. A key left out
    takes the server's default (connect_s: server.connect_timeout_s, between_chunks_s:
    server.request_timeout_s; first_byte_s and total_s: no limit)."""

    connect_s: float | None = Field(None, gt=0, description="to open a connection")
    first_byte_s: float | None = Field(
        None, gt=0, description="from sending the request to its first content (the first "
        "generated token of a stream; the response's headers for a non-streaming request "
        "relayed whole); a try that reaches it has sent nothing to the client and is tried "
        "on another replica")
    between_chunks_s: float | None = Field(
        None, gt=0, description="longest silence between two bytes of the response (its "
        "headers included)")
    total_s: float | None = Field(
        None, gt=0, description="for the whole response: a stream cut by it ends with an "
        "SSE error event")


class EjectionConfig(_Strict):
    """Passive outlier ejection: live traffic takes a failing or frozen replica out of
    rotation (docs/operating.md, "Failover and ejection")."""

    consecutive_failures: int = Field(
        3, ge=1, description="failed requests in a row (5xx, timeouts, bad streams) that "
        "eject a replica; a broken connection or a 503 ejects it at once")
    base_s: float = Field(1.0, ge=0.05, le=3600, description="the first ejection's length; "
                          "each one soon after another lasts twice as long")
    max_s: float = Field(30.0, ge=0.05, le=86400, description="the longest ejection")
    stall_s: float = Field(
        1.0, ge=0, description="a replica that sends no byte for this long (or 20 of its "
        "recent engine steps, if longer) while the gateway waits to read streams that had "
        "content from it, and leaves a health check sent meanwhile unanswered, is ejected "
        "(never the pool's last healthy replica), and its requests that sent nothing to "
        "their client yet are tried on another replica; 0: off")

    @model_validator(mode="after")
    def _ordered(self) -> EjectionConfig:
        if self.base_s > self.max_s:
            raise ValueError(f"base_s ({self.base_s}) is above max_s ({self.max_s})")
        return self


_HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9_]([A-Za-z0-9_-]{0,62})(\.[A-Za-z0-9_]"
                       r"([A-Za-z0-9_-]{0,62}))*\.?$")


class DnsDiscoveryConfig(_Strict):
    """A pool's replicas are the addresses (A and AAAA records) a DNS name resolves to, such
    as a Kubernetes headless Service's, resolved again every `interval_s`."""

    name: str = Field(description="the DNS name, e.g. vllm.llm.svc.cluster.local")
    port: int = Field(ge=1, le=65535, description="the engines' port, the same at every address")
    scheme: Literal["http", "https"] = Field("http", description="http or https")
    family: Literal["any", "ipv4", "ipv6"] = Field(
        "any", description="which records: any (A and AAAA), ipv4 (A), ipv6 (AAAA)")
    interval_s: float = Field(10.0, ge=MIN_INTERVAL_S, le=3600,
                              description="seconds between two resolutions")
    timeout_s: float = Field(5.0, gt=0, le=300, description="longest wait for one resolution; "
                             "longer is a failure (the replicas found before stay)")

    @field_validator("name")
    @classmethod
    def _hostname(cls, v: str) -> str:
        if not _HOSTNAME.fullmatch(v):
            raise ValueError(f"{v!r} is not a DNS name (letters, digits, '-', '_' and dots; "
                             "no scheme, port or path: give the port in `port`)")
        return v


KUBERNETES_EXTRA = "pip install 'prefix-gateway[kubernetes]'"


def kubernetes_client_installed() -> bool:
    return importlib.util.find_spec("kubernetes") is not None


class KubernetesDiscoveryConfig(_Strict):
    """A pool's replicas are the endpoints of the Kubernetes EndpointSlices a label selector
    picks, watched through the Kubernetes API (the `kubernetes` extra)."""

    selector: str = Field(min_length=1, description="label selector of the EndpointSlices, "
                          "e.g. kubernetes.io/service-name=vllm")
    namespace: str | None = Field(
        None, min_length=1, description="their namespace (None: the gateway's own, read from "
        "its service account in a pod, else `default`)")
    port_name: str | None = Field(
        None, description="the name of the EndpointSlice port to send requests to (None: "
        "slices must have exactly one port)")
    scheme: Literal["http", "https"] = Field("http", description="http or https")
    resync_s: float = Field(300.0, ge=1, le=86400, description="the watch is restarted with a "
                            "full list this often (and at once when it expires)")
    kubeconfig: str | None = Field(
        None, min_length=1, description="a kubeconfig file (None: the pod's service account "
        "inside a cluster, else $KUBECONFIG or ~/.kube/config)")
    context: str | None = Field(None, min_length=1, description="the kubeconfig context "
                                "(None: its current context)")

    @model_validator(mode="after")
    def _client(self) -> KubernetesDiscoveryConfig:
        if not kubernetes_client_installed():
            raise ValueError("Kubernetes discovery needs the `kubernetes` Python client, an "
                             f"optional extra that is not installed: {KUBERNETES_EXTRA}")
        if self.kubeconfig is not None and not os.access(self.kubeconfig, os.R_OK):
            raise ValueError(f"kubeconfig {self.kubeconfig} cannot be read")
        return self


class DiscoveryConfig(_Strict):
    """Where a pool finds replicas besides its `replicas` list: exactly one of `dns` or
    `kubernetes`."""

    dns: DnsDiscoveryConfig | None = None
    kubernetes: KubernetesDiscoveryConfig | None = None

    @model_validator(mode="after")
    def _one(self) -> DiscoveryConfig:
        if (self.dns is None) == (self.kubernetes is None):
            raise ValueError("give exactly one of dns or kubernetes")
        return self

    @property
    def kind(self) -> str:
        return "dns" if self.dns is not None else "kubernetes"


def discovered_name(pool: str, address: str, port: int) -> str:
    """A discovered replica's name: stable for its address and port, unique across pools."""
    return f"{pool}-{address}-{port}"


def discovered_url(scheme: str, address: str, port: int) -> str:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return f"{scheme}://{address}:{port}"
    return f"{scheme}://[{ip}]:{port}" if ip.version == 6 else f"{scheme}://{ip}:{port}"


class PoolConfig(_Strict):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    engine: EngineKind
    models: list[str] = Field(min_length=1)
    replicas: list[ReplicaConfig] = Field(default_factory=list)
    discovery: DiscoveryConfig | None = Field(
        None, description="find more replicas by DNS or Kubernetes EndpointSlices")
    api_key: str | None = None
    pass_client_key: bool = Field(
        False, description="forward the client's own Authorization header to the pool's "
        "replicas when neither the pool nor the replica has an api_key (off: client keys "
        "never leave the gateway)")
    routing: RoutingSettings | None = None
    health: HealthSettings = Field(default_factory=HealthSettings)
    max_inflight_per_replica: int | None = Field(
        None, ge=1, description="requests in flight per replica; the pool's capacity is this "
        "times its healthy replicas. None: unlimited (no admission control for the pool)"
    )
    reserved_fraction: float = Field(
        0.25, ge=0.0, le=1.0, description="share of the pool's capacity never lent to other "
        "traffic classes (its own classes always keep it)"
    )
    timeouts: UpstreamTimeoutsConfig = Field(default_factory=UpstreamTimeoutsConfig)
    ejection: EjectionConfig = Field(default_factory=EjectionConfig)

    def timeouts_for(self, server: ServerConfig) -> Timeouts:
        """The pool's upstream timeouts, the server's defaults where it sets none."""
        t = self.timeouts
        given = t.model_fields_set
        return Timeouts(
            connect=t.connect_s if "connect_s" in given else server.connect_timeout_s,
            read=t.between_chunks_s if "between_chunks_s" in given else server.request_timeout_s,
            total=t.total_s, first_byte=t.first_byte_s)

    @model_validator(mode="after")
    def _unique_replicas(self) -> PoolConfig:
        if not self.replicas and self.discovery is None:
            raise ValueError("a pool needs replicas, or discovery to find them")
        names = [r.name for r in self.replicas]
        dupes = _repeated(names)
        if dupes:
            raise ValueError(f"replica names must be unique within a pool: {dupes}")
        return self


class BorrowConfig(_Strict):
    """Another pool a class may use while that pool is lightly loaded."""

    pool: str
    while_below: float = Field(
        0.5, gt=0.0, le=1.0, description="borrow only while the pool's load fraction (requests "
        "in flight there / its capacity) is below this"
    )


class AdmissionConfig(_Strict):
    """A traffic class's limits and queue."""

    max_inflight: int | None = Field(
        None, ge=1, description="requests of the class in flight at once, all pools together "
        "(None: only the pools' capacities limit it)"
    )
    max_queue: int = Field(256, ge=0, description="requests waiting for a slot; beyond, 429")
    max_queue_wait_s: float = Field(
        30.0, gt=0, description="longest wait for a slot; then 429"
    )
    retry_after_s: int = Field(1, ge=1, description="the Retry-After header of its 429s")
    borrow: list[BorrowConfig] = Field(
        default_factory=list, description="other pools the class may use, in this order"
    )


class ExperimentConfig(_Strict):
    """An engine A/B experiment on one traffic class: its requests are mirrored to, or split
    with, a candidate pool, and both arms are measured (docs/experiments.md)."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$",
                      description="names it in /admin/experiments and the metrics")
    traffic_class: str = Field(description="the traffic class whose requests it takes")
    baseline: str = Field(description="the pool the class's requests go to now (the class's "
                          "own pool)")
    candidate: str = Field(description="the pool tried against it")
    mode: Literal["mirror", "split"] = Field(
        description="mirror: a copy of each (sampled) request also goes to the candidate, "
        "its answer read and discarded, the client always answered by the baseline; split: "
        "a fraction of the prefixes is served by the candidate for real")
    fraction: float | None = Field(
        None, ge=0.0, le=1.0, description="mirror: the share of the class's prefixes "
        "mirrored (None: 1, all); split: the share of prefixes the candidate serves (None: "
        "0.5)")
    enabled: bool = Field(True, description="false: no copy is sent and no request is split "
                          "(the kill switch; the measurements so far are kept)")
    max_concurrency: int = Field(
        32, ge=1, le=100_000, description="mirror: copies in flight at once; a copy beyond "
        "it (or when the candidate has no healthy replica with room) is dropped and counted")
    max_samples: int = Field(20_000, ge=100, le=1_000_000, description="the newest samples "
                             "kept per arm for the report")

    @property
    def share(self) -> float:
        """The fraction in force (its default filled in)."""
        if self.fraction is not None:
            return self.fraction
        return 1.0 if self.mode == "mirror" else 0.5


class TrafficClassConfig(_Strict):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    pool: str
    priority: int = Field(
        0, description="rank among the classes that wait for the same pool (higher first)"
    )
    admission: AdmissionConfig | None = None
    max_tokens: int | None = Field(
        None, ge=1, le=2**31 - 1, description="the most tokens a request of the class may ask "
        "for (max_tokens or max_completion_tokens); above, 400 max_tokens_too_large; a request "
        "that asks for none gets this as its max_tokens. None: no cap"
    )


class ClassificationConfig(_Strict):
    """Where a request's traffic class comes from, first match wins, in this order."""

    header: str | None = Field("x-traffic-class", description="request header naming the class")
    api_keys: dict[str, str] = Field(default_factory=dict, description="bearer key -> class")
    service_tier: dict[str, str] = Field(
        default_factory=dict, description="OpenAI service_tier value -> class"
    )
    default_class: str
    priority_header: str | None = Field(
        None, description="request header giving the request's priority within its class "
        "(an integer, clamped to priority_min..priority_max)"
    )
    priority_api_keys: dict[str, int] = Field(
        default_factory=dict, description="bearer key -> priority within its class"
    )
    priority_min: int = Field(-10, description="lowest priority a request can have")
    priority_max: int = Field(10, description="highest priority a request can have")

    @field_validator("header", "priority_header")
    @classmethod
    def _header_name(cls, v: str | None) -> str | None:
        if v and not _HEADER_NAME.fullmatch(v):
            raise ValueError(f"{v!r} is not a valid HTTP header name (letters, digits and "
                             "!#$%&'*+-.^_`|~ only; no spaces or colons), so no request "
                             "could ever carry it")
        # Header names are case-insensitive; the server hands them over in lowercase.
        return v.lower() if v else v

    @model_validator(mode="after")
    def _priority_range(self) -> ClassificationConfig:
        if self.header and self.header == self.priority_header:
            raise ValueError(f"header and priority_header are the same header "
                             f"({self.header!r}): one names a class, the other a number")
        if self.priority_min > self.priority_max:
            raise ValueError(f"priority_min ({self.priority_min}) is above priority_max "
                             f"({self.priority_max})")
        for key, value in self.priority_api_keys.items():
            if not self.priority_min <= value <= self.priority_max:
                raise ValueError(f"priority_api_keys[{key[:4] + '...'!r}] = {value} is outside "
                                 f"priority_min..priority_max ({self.priority_min}.."
                                 f"{self.priority_max})")
        return self


class ServerConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    workers: int = Field(
        1, ge=1, le=256, description="worker processes sharing the port (serve only); above 1, "
        "a supervising process starts, restarts and stops them, and /metrics and /admin/stats "
        "cover them all"
    )
    response_headers: bool = Field(True, description="send x-gateway-replica / x-gateway-pool")
    explain_headers: bool = Field(True, description="send x-gateway-route-reason / -match")
    request_timeout_s: float = Field(
        600.0, gt=0, description="longest silence from a replica (no byte) before giving up; a "
        "long generation that keeps streaming is never cut"
    )
    connect_timeout_s: float = Field(3.0, gt=0)
    upstream_keepalive_s: float = Field(
        4.0, gt=0, description="how long an idle connection to a replica is kept for reuse; "
        "below the engines' own idle timeout (5 s in vLLM and trtllm-serve), so the gateway "
        "rarely reuses a connection the engine is closing"
    )
    upstream_client: Literal["httptools", "aiohttp"] = Field(
        "httptools", description="the HTTP client to the replicas: `httptools`, the gateway's "
        "own (asyncio protocols and httptools' parser: about a third less CPU per request), or "
        "`aiohttp`"
    )
    max_attempts: int = Field(2, ge=1, le=10, description="tries before the first byte is sent")
    max_body_bytes: int = Field(32 * 1024 * 1024, ge=1024)
    non_streaming_ttft: bool = Field(
        False,
        description="stream from the replica internally for non-streaming requests, to "
        "measure their TTFT; the client still gets one JSON response. Off (the default): the "
        "body passes through, which costs the engine and the gateway less CPU "
        "(docs/benchmarks.md)",
    )
    expose_docs: bool = Field(
        False, description="serve /docs, /redoc and /openapi.json (off: they answer 404)")
    # Limits on what clients send and hold (gateway/httpserver.py enforces them).
    max_header_bytes: int = Field(
        16384, ge=1024, le=1024 * 1024, description="request line and headers together; "
        "larger ones get 431"
    )
    max_headers: int = Field(100, ge=8, le=10000, description="request headers; more get 431")
    header_timeout_s: float = Field(
        10.0, gt=0, le=3600, description="longest time from a new connection, or a request's "
        "first byte, to the end of its headers; then 408 and the connection is closed"
    )
    body_timeout_s: float = Field(
        30.0, gt=0, le=3600, description="longest silence while a request body arrives (a "
        "body shorter than its Content-Length ends here); then 408"
    )
    keepalive_timeout_s: float = Field(
        75.0, gt=0, le=3600, description="an idle kept-alive client connection is closed after "
        "this long"
    )
    max_connections: int = Field(
        4096, ge=16, description="client connections open at once (lowered to what the "
        "process's file descriptor limit allows); a new one beyond it closes the connection "
        "that has waited longest without being answered, or gets 503 if all are being answered"
    )
    max_response_bytes: int = Field(
        64 * 1024 * 1024, ge=1024, description="largest non-streaming response body the "
        "gateway buffers from a replica; a larger one ends the request with 502"
    )


class SharedRoutingConfig(_Strict):
    """Routing state gateways sharing a Redis share: which prefixes went to which replica,
    and the load each gateway has put on each replica (docs/operating.md)."""

    enabled: bool = Field(True, description="share routing state through Redis (false: each "
                          "gateway routes on its own state alone)")
    # 10 ms, not 25: a decision another gateway has not yet read is one it may pile onto the
    # same replica; three gateways' mean TTFT came within 1-3% of one gateway's at 10 ms
    # against up to 6% at 25 ms (docs/benchmarks.md, the simulator's several gateways).
    flush_interval_s: float = Field(0.01, ge=0.005, le=1.0, description="at most how "
                                    "often the prefixes routed since the last write are "
                                    "written to Redis, in one pipelined round trip, and the "
                                    "other gateways' read (nothing is sent when idle)")
    load_interval_s: float = Field(0.05, ge=0.01, le=5.0, description="how often a gateway "
                                   "with requests in flight looks at its load per replica, "
                                   "publishing it when it changed (each write of decisions "
                                   "carries it too)")
    load_ttl_s: float = Field(3.0, ge=0.1, le=600, description="a gateway's published load "
                              "older than this is ignored (a gateway that stopped or lost "
                              "Redis); it republishes unchanged load every third of it")
    max_queue: int = Field(10_000, ge=100, le=1_000_000, description="prefix inserts (and, "
                           "with pin_running, the ends of the requests holding them) waiting "
                           "to be written; beyond it (Redis slow or away) the oldest are "
                           "dropped and counted")
    stream_max_entries: int = Field(10_000, ge=100, le=10_000_000, description="entries "
                                    "(flushes) each gateway's stream of a pool keeps in "
                                    "Redis (trimmed approximately)")
    resync_inserts: int = Field(4096, ge=0, le=1_000_000, description="a gateway's most "
                                "recent prefix inserts it keeps to publish again when a peer "
                                "missed entries (the stream was trimmed past it, or its Redis "
                                "lost them)")


class RedisConfig(_Strict):
    """Where the Batch API keeps its files, batches, line progress and results, and through
    which gateways share rate limits and routing state."""

    url: str = Field(description="redis://[:password@]host:port/db, rediss://... or "
                     "unix:///path/to/socket")
    key_prefix: str = Field("prefix-gateway:", min_length=1, description="prefix of every "
                            "key the gateway writes, so one Redis can hold several deployments")
    timeout_s: float = Field(5.0, gt=0, description="connect and command timeout")
    shared_routing: SharedRoutingConfig = Field(default_factory=SharedRoutingConfig)

    @field_validator("url")
    @classmethod
    def _scheme(cls, v: str) -> str:
        if not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must start with redis://, rediss:// or unix://")
        return v


class BatchConfig(_Strict):
    """The OpenAI Batch API's runner and limits (active only with a `redis` section)."""

    traffic_class: str | None = Field(
        None, description="the traffic class batch lines run as (None: the class named "
        "`batch` if there is one, else classification.default_class)")
    concurrency: int = Field(16, ge=1, le=4096, description="lines of one batch a gateway "
                             "runs at once")
    lease_s: float = Field(10.0, ge=1, le=3600, description="a line's lease: renewed while it "
                           "runs; another gateway takes the line over once it lapses")
    max_file_bytes: int = Field(100 * 1024 * 1024, ge=1024, le=512 * 1024 * 1024,
                                description="largest file upload")
    max_lines: int = Field(50_000, ge=1, description="most requests in one batch input file")
    poll_interval_s: float = Field(1.0, ge=MIN_INTERVAL_S, le=60, description="how often a "
                                   "gateway looks for batches to work on and renews its "
                                   "leases")



class HistoryConfig(_Strict):
    """What the gateway keeps in memory for the /admin page: per-interval samples and the
    latest routing decisions (both fixed-size rings)."""

    interval_s: float = Field(5.0, ge=0.1, le=3600, description="one sample per interval")
    window_s: float = Field(900.0, gt=0, le=86400, description="samples kept cover this long "
                            "(window_s / interval_s samples, at most 17,280)")
    decisions: int = Field(50, ge=0, le=10000, description="latest routing decisions kept")

    @model_validator(mode="after")
    def _samples(self) -> HistoryConfig:
        n = self.window_s / self.interval_s
        if n < 2 or n > 17280:
            raise ValueError(f"history.window_s / history.interval_s is {n:g}: keep 2 to "
                             "17,280 samples")
        return self

    @property
    def samples(self) -> int:
        return round(self.window_s / self.interval_s)


class TracingConfig(_Strict):
    """OpenTelemetry tracing (the `otel` extra): a span per inference request."""

    enabled: bool = Field(False, description="off: nothing of OpenTelemetry is imported")
    service_name: str = Field("prefix-gateway", min_length=1)
    endpoint: str | None = Field(
        None, description="OTLP/HTTP traces URL, e.g. http://collector:4318/v1/traces; None: "
        "the exporter's environment variables (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, "
        "OTEL_EXPORTER_OTLP_ENDPOINT) or its default, http://localhost:4318/v1/traces")
    sample_ratio: float = Field(1.0, ge=0.0, le=1.0, description="share of new traces "
                                "recorded; a request with a traceparent follows its sampled "
                                "flag")

    @model_validator(mode="after")
    def _installed(self) -> TracingConfig:
        if self.enabled:
            missing = [name for name in _OTEL_MODULES if not _importable(name)]
            if missing:
                raise ValueError("tracing.enabled needs the otel extra (pip install "
                                 f"'prefix-gateway[otel]'): {', '.join(missing)} not installed")
        return self


_OTEL_MODULES = ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http")


def _importable(name: str) -> bool:
    """Whether module `name` is installed, without importing it (only its parents)."""
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


# Authentication, authorisation and rate limits (docs/security.md) --------------------------

_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
LOOPBACK_HOSTS = frozenset(("127.0.0.1", "::1", "localhost"))


def key_digest(key: str) -> str:
    """How the gateway stores and compares a key: `sha256:` and the hex SHA-256 of its text."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


class KeySource(_Strict):
    """Where a key comes from: its digest written in the file (`key`), or the plain key in an
    environment variable (`key_env`) or a file (`key_file`), hashed when the config is read.
    Exactly one of them."""

    key: str | None = Field(None, description="sha256:<64 hex digits>, from "
                            "`prefix-gateway hash-key`")
    key_env: str | None = Field(None, min_length=1, description="environment variable that "
                                "holds the key (plain, or its sha256: digest)")
    key_file: str | None = Field(None, min_length=1, description="file that holds the key "
                                 "(plain, or its sha256: digest; surrounding whitespace "
                                 "ignored)")
    _digest: str = PrivateAttr("")

    @field_validator("key")
    @classmethod
    def _is_digest(cls, v: str | None) -> str | None:
        if v is not None and not _DIGEST.match(v.strip().lower()):
            # Never echo the value: it may be a plain key pasted by mistake.
            raise ValueError("must be a digest, sha256:<64 hex digits> (print one with "
                             "`prefix-gateway hash-key`); a plain key belongs in key_env or "
                             "key_file, never in the configuration")
        return v.strip().lower() if v else v

    @model_validator(mode="after")
    def _resolve(self) -> KeySource:
        given = [n for n in ("key", "key_env", "key_file") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of key (a sha256: digest), key_env or key_file")
        if self.key is not None:
            self._digest = self.key
            return self
        if self.key_env is not None:
            raw = os.environ.get(self.key_env)
            if not raw or not raw.strip():
                raise ValueError(f"environment variable {self.key_env} is not set or empty")
        else:
            try:
                raw = Path(str(self.key_file)).read_text()
            except OSError as exc:
                raise ValueError(f"cannot read key_file {self.key_file}: {exc.strerror}") \
                    from None
            if not raw.strip():
                raise ValueError(f"key_file {self.key_file} is empty")
        raw = raw.strip()
        self._digest = raw.lower() if _DIGEST.match(raw.lower()) else key_digest(raw)
        return self

    @property
    def digest(self) -> str:
        return self._digest


class RateLimitConfig(_Strict):
    """Budgets per minute (a sliding window); None: no limit of that kind."""

    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(
        None, ge=1, description="prompt tokens (estimated) plus max_tokens, charged when the "
        "request is admitted")


class ClientKeyConfig(KeySource):
    """A client API key: who it is, which traffic classes it may use, its limits."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.:@-]+$",
                      description="shown in logs and metrics instead of the key")
    classes: list[str] | None = Field(
        None, min_length=1, description="traffic classes the key may use (None: all)")
    default_class: str | None = Field(
        None, description="its class when the request names none (None: "
        "classification.default_class if allowed, else the first of `classes`)")
    priority: int | None = Field(None, description="priority within its class, unless a "
                                 "priority header says otherwise")
    limits: RateLimitConfig | None = None


class NamedKeyConfig(KeySource):
    """An admin or metrics key."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.:@-]+$")


class AuthConfig(_Strict):
    """Who may call the gateway (docs/security.md)."""

    api_keys: list[ClientKeyConfig] = Field(
        default_factory=list, description="client keys for /v1/*; none: /v1 is open")
    admin_keys: list[NamedKeyConfig] = Field(
        default_factory=list, description="keys for /admin, /admin/stats; none: /admin is "
        "open only while api_keys is empty too, else refused")
    metrics_keys: list[NamedKeyConfig] = Field(
        default_factory=list, description="bearer tokens for /metrics (an admin key works "
        "too); none: /metrics is open")
    allow_unauthenticated: bool = Field(
        False, description="allow server.host to be a non-loopback address without api_keys")

    @model_validator(mode="after")
    def _unique(self) -> AuthConfig:
        for where, keys in (("api_keys", self.api_keys), ("admin_keys", self.admin_keys),
                            ("metrics_keys", self.metrics_keys)):
            names = [k.name for k in keys]
            dupes = _repeated(names)
            if dupes:
                raise ValueError(f"auth.{where}: names must be unique: {dupes}")
        digests = [k.digest for k in (*self.api_keys, *self.admin_keys, *self.metrics_keys)]
        if len(set(digests)) != len(digests):
            raise ValueError("auth: the same key is given twice (as two client keys, or as a "
                             "client key and an admin or metrics key); give each its own")
        return self


class RateLimitsConfig(_Strict):
    """Rate limits per traffic class (per key: in auth.api_keys[].limits)."""

    classes: dict[str, RateLimitConfig] = Field(
        default_factory=dict, description="traffic class -> its budget, all clients together")
    default_max_tokens: int = Field(
        256, ge=0, description="output tokens charged for a request that sets no max_tokens")


class GatewayConfig(_Strict):
    server: ServerConfig = Field(default_factory=ServerConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    rate_limits: RateLimitsConfig = Field(default_factory=RateLimitsConfig)
    routing: RoutingSettings = Field(default_factory=RoutingSettings)
    pools: list[PoolConfig] = Field(min_length=1)
    traffic_classes: list[TrafficClassConfig] = Field(min_length=1)
    classification: ClassificationConfig
    redis: RedisConfig | None = None
    batch: BatchConfig = Field(default_factory=BatchConfig)
    history: HistoryConfig = Field(default_factory=HistoryConfig)
    tracing: TracingConfig = Field(default_factory=TracingConfig)
    experiments: list[ExperimentConfig] = Field(
        default_factory=list, description="engine A/B experiments on live traffic "
        "(docs/experiments.md); applied again on reload")

    @model_validator(mode="after")
    def _references(self) -> GatewayConfig:
        pools = [p.name for p in self.pools]
        if len(set(pools)) != len(pools):
            raise ValueError(f"pool names must be unique: {pools}")
        replicas = [r.name for p in self.pools for r in p.replicas]
        dupes = sorted({n for n in replicas if replicas.count(n) > 1})
        if dupes:
            raise ValueError(f"replica names must be unique across pools (metrics label): {dupes}")
        self._check_replica_urls()
        classes = [c.name for c in self.traffic_classes]
        if len(set(classes)) != len(classes):
            raise ValueError(f"traffic class names must be unique: {classes}")
        for c in self.traffic_classes:
            if c.pool not in pools:
                raise ValueError(f"traffic class {c.name!r} names unknown pool {c.pool!r}; "
                                 f"pools are {pools}")
        self._check_borrowing()
        cl = self.classification
        known = set(classes)
        if cl.default_class not in known:
            raise ValueError(f"classification.default_class {cl.default_class!r} is not a "
                             f"traffic class; classes are {sorted(known)}")
        for where, mapping in (("api_keys", cl.api_keys), ("service_tier", cl.service_tier)):
            for k, v in mapping.items():
                if v not in known:
                    shown = k if where == "service_tier" else k[:4] + "..."
                    raise ValueError(f"classification.{where}[{shown!r}] names unknown "
                                     f"traffic class {v!r}; classes are {sorted(known)}")
        if self.batch.traffic_class is not None and self.batch.traffic_class not in known:
            raise ValueError(f"batch.traffic_class {self.batch.traffic_class!r} is not a "
                             f"traffic class; classes are {sorted(known)}")
        self._check_auth(known)
        self._check_experiments()
        return self

    def _check_experiments(self) -> None:
        pools = {p.name: p for p in self.pools}
        classes = {c.name: c for c in self.traffic_classes}
        names = [e.name for e in self.experiments]
        dupes = _repeated(names)
        if dupes:
            raise ValueError(f"experiments: names must be unique: {dupes}")
        taken: dict[str, str] = {}
        for e in self.experiments:
            where = f"experiments[{e.name!r}]"
            cls = classes.get(e.traffic_class)
            if cls is None:
                raise ValueError(f"{where} names unknown traffic class {e.traffic_class!r}; "
                                 f"classes are {sorted(classes)}")
            if e.traffic_class in taken:
                raise ValueError(f"{where}: traffic class {e.traffic_class!r} is already in "
                                 f"experiment {taken[e.traffic_class]!r}; one experiment per "
                                 "class")
            taken[e.traffic_class] = e.name
            for role in ("baseline", "candidate"):
                if getattr(e, role) not in pools:
                    raise ValueError(f"{where}: {role} names unknown pool "
                                     f"{getattr(e, role)!r}; pools are {sorted(pools)}")
            if e.baseline != cls.pool:
                raise ValueError(f"{where}: baseline {e.baseline!r} is not the pool of traffic "
                                 f"class {cls.name!r} ({cls.pool!r}); the baseline is where "
                                 "the class's requests go now")
            if e.candidate == e.baseline:
                raise ValueError(f"{where}: candidate and baseline are the same pool "
                                 f"{e.baseline!r}")
            missing = sorted(self.served_models(pools[e.baseline])
                             - self.served_models(pools[e.candidate]))
            if missing:
                raise ValueError(f"{where}: candidate pool {e.candidate!r} does not serve "
                                 f"model(s) {missing} of the baseline pool {e.baseline!r}")

    def _check_auth(self, known: set[str]) -> None:
        for key in self.auth.api_keys:
            where = f"auth.api_keys[{key.name!r}]"
            for c in [*(key.classes or ()), *([key.default_class] if key.default_class else [])]:
                if c not in known:
                    raise ValueError(f"{where} names unknown traffic class {c!r}; classes are "
                                     f"{sorted(known)}")
            if key.default_class and key.classes and key.default_class not in key.classes:
                raise ValueError(f"{where}: default_class {key.default_class!r} is not among "
                                 f"its classes {key.classes}")
        for c in self.rate_limits.classes:
            if c not in known:
                raise ValueError(f"rate_limits.classes names unknown traffic class {c!r}; "
                                 f"classes are {sorted(known)}")
        cl = self.classification
        if self.auth.api_keys and (cl.api_keys or cl.priority_api_keys):
            # Those maps hold plain keys; with auth, each key's class and priority live in its
            # auth.api_keys entry, where only its digest is written.
            raise ValueError("classification.api_keys and priority_api_keys cannot be used with "
                             "auth.api_keys: give each key its default_class and priority there")

    def exposure_problem(self) -> str | None:
        """Why the gateway must not serve as configured: a non-loopback address with no client
        keys, unless the operator said so explicitly. None: fine. (Checked where it serves,
        after command-line overrides of the host, not when the file is read.)"""
        host = self.server.host.strip("[]")
        if host in LOOPBACK_HOSTS or self.auth.api_keys or self.auth.allow_unauthenticated:
            return None
        return (f"server.host {self.server.host!r} is not a loopback address and auth.api_keys "
                "is empty: anyone who reaches it could use every pool. Add client keys "
                "(auth.api_keys), bind 127.0.0.1, or set auth.allow_unauthenticated: true "
                "(serve --allow-unauthenticated) to run open on purpose")

    @property
    def authenticated(self) -> bool:
        """Whether /v1 asks for a client key."""
        return bool(self.auth.api_keys)
    def _check_replica_urls(self) -> None:
        # One engine behind two replica entries would be routed to as two: its load and its
        # cached prefixes split in halves that each look half as busy.
        seen: dict[str, str] = {}
        for i, pool in enumerate(self.pools):
            for j, r in enumerate(pool.replicas):
                where = f"pools[{i}].replicas[{j}] ({pool.name}/{r.name})"
                first = seen.setdefault(r.base_url.lower(), where)
                if first != where:
                    raise ValueError(f"{where} has the same url as {first}: {r.base_url}; "
                                     "each engine replica must be listed once (to share it "
                                     "between traffic classes, send them to the same pool or "
                                     "let one borrow the other's)")

    def _check_borrowing(self) -> None:
        pools = {p.name: p for p in self.pools}
        for c in self.traffic_classes:
            lenders = [b.pool for b in c.admission.borrow] if c.admission else []
            if not lenders:
                continue
            own = pools[c.pool]
            where = f"traffic class {c.name!r}: admission.borrow"
            if own.max_inflight_per_replica is None:
                raise ValueError(f"{where}: its pool {own.name!r} has no "
                                 "max_inflight_per_replica, so it never runs out of room and "
                                 "would never borrow; set one")
            if len(set(lenders)) != len(lenders):
                raise ValueError(f"{where} names a pool twice: {lenders}")
            for name in lenders:
                lender = pools.get(name)
                if lender is None:
                    raise ValueError(f"{where} names unknown pool {name!r}; pools are "
                                     f"{sorted(pools)}")
                if name == own.name:
                    raise ValueError(f"{where} names the class's own pool {name!r}")
                if lender.max_inflight_per_replica is None:
                    raise ValueError(f"{where}: pool {name!r} has no max_inflight_per_replica, "
                                     "so its load cannot be measured; set one to lend it")
                if not self.served_models(lender) & self.served_models(own):
                    raise ValueError(f"{where}: pool {name!r} serves none of the models of "
                                     f"pool {own.name!r}")

    @staticmethod
    def served_models(pool: PoolConfig) -> set[str]:
        return set(pool.models).union(*(r.models or () for r in pool.replicas))

    def admission_for(self, traffic_class: TrafficClassConfig) -> AdmissionConfig | None:
        """The class's admission settings: its own, the defaults when only its pool has a
        limit, None when neither does (no admission control: requests are forwarded at once)."""
        if traffic_class.admission is not None:
            return traffic_class.admission
        pool = next(p for p in self.pools if p.name == traffic_class.pool)
        return AdmissionConfig() if pool.max_inflight_per_replica is not None else None
    @property
    def batch_class(self) -> str:
        """The traffic class batch lines run as."""
        if self.batch.traffic_class is not None:
            return self.batch.traffic_class
        names = [c.name for c in self.traffic_classes]
        return "batch" if "batch" in names else self.classification.default_class

    @model_validator(mode="before")
    @classmethod
    def _pools_inherit_the_policy(cls, data: Any) -> Any:
        # A pool's routing block that names no policy is for the global one: its policy
        # settings must be validated against that, not against the default policy.
        if not isinstance(data, dict) or not isinstance(data.get("pools"), list):
            return data
        routing = data.get("routing")
        policy = routing.get("policy") if isinstance(routing, dict) else None
        if policy is None or policy not in policy_names():
            return data
        pools = [
            {**p, "routing": {"policy": policy, **p["routing"]}}
            if isinstance(p, dict) and isinstance(p.get("routing"), dict)
            and "policy" not in p["routing"] else p
            for p in data["pools"]
        ]
        return {**data, "pools": pools}

    def routing_for(self, pool: PoolConfig) -> RoutingSettings:
        """The pool's routing settings: the global ones, overridden by what the pool sets. A
        pool that chooses another policy keeps of the global policy settings those its policy
        also takes."""
        if pool.routing is None:
            return self.routing
        own = pool.routing.model_dump(exclude_unset=True)
        base = self.routing.for_policy(own.get("policy", self.routing.policy))
        return RoutingSettings.model_validate({**base.model_dump(exclude_unset=True), **own})


class ConfigError(Exception):
    """A configuration file that cannot be used; the message says where and why."""


def _line_of(node: yaml.Node | None, loc: tuple[Any, ...]) -> int | None:
    """Follow a pydantic error location through the YAML node tree to a line number."""
    line = None
    for part in loc:
        if node is None:
            break
        line = node.start_mark.line + 1
        if isinstance(node, yaml.MappingNode):
            node = next((v for k, v in node.value if k.value == part), None)
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int):
            node = node.value[part] if part < len(node.value) else None
        else:
            node = None
    if node is not None:
        line = node.start_mark.line + 1
    return line


def _loc_text(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def parse_config(data: Any, source: str = "<config>", text: str | None = None) -> GatewayConfig:
    try:
        return GatewayConfig.model_validate(data)
    except ValidationError as exc:
        root = yaml.compose(text) if text else None
        lines = []
        for err in exc.errors():
            loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and "[" in p))
            line = _line_of(root, loc) if root is not None else None
            where = f"{source}:{line}" if line else source
            msg = err["msg"]
            if err["type"] == "extra_forbidden":
                msg = "unknown key (check its spelling and indentation)"
            lines.append(f"{where}: {_loc_text(loc)}: {msg}")
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(lines)) from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (plain PyYAML keeps the
    last silently, so an operator's first setting would be ignored)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, list | dict):
                continue  # unhashable: the schema rejects it with its own message
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first given on line {seen[key]})",
                    key_node.start_mark)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load_config(path: str | Path) -> GatewayConfig:
    """Read and validate a YAML config file; errors name the key, its path and line."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {p}: {exc.strerror}") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: constructs plain data only
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping with pools, traffic_classes "
                          "and classification")
    return parse_config(data, str(p), text)
