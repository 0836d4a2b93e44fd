"""Every Prometheus metric the gateway exports, defined in this one place."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from gateway.metric_families import (
    CounterFamily,
    Family,
    FamilyCollector,
    GaugeFamily,
    HistogramFamily,
)

# Buckets span a cached prefix on a GPU (tens of ms) to a long cold prefill under queueing.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5,
                5.0, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0)
# From no wait at all (most requests, in the first bucket) to a long queue of batch work.
QUEUE_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                      20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
DURATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
                    160.0, 320.0, 640.0)
# A flush interval and a round trip (milliseconds) to an outage's backlog (seconds).
SHARED_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
                      0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class GatewayMetrics:
    """The metric families, exported on their own registry so tests can run several gateways."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        rl = ("pool", "replica", "traffic_class")
        self.requests = CounterFamily(
            "gateway_requests", "Requests finished, by replica and the HTTP status the client got "
            "(499: the client left first; replica 'none' with 503: no healthy replica, with 429: "
            "refused by admission control, with 499: the client left while queued).",
            (*rl, "status"))
        self.ttft = HistogramFamily(
            "gateway_time_to_first_token_seconds", "Time from request arrival at the gateway to "
            "the first content token leaving the replica, measured at the gateway.", rl,
            buckets=TTFT_BUCKETS)
        self.tpot = HistogramFamily(
            "gateway_time_per_output_token_seconds", "Mean time between output tokens after the "
            "first, per request.", rl, buckets=TPOT_BUCKETS)
        self.duration = HistogramFamily(
            "gateway_request_duration_seconds", "Time from request arrival to the last byte.",
            rl, buckets=DURATION_BUCKETS)
        self.prefix_blocks = CounterFamily(
            "gateway_prefix_blocks", "Prompt blocks the router expected to hit (or miss) in the "
            "chosen replica's cache at routing time (its own estimate).",
            ("pool", "replica", "result"))
        self.engine_hit_ratio = GaugeFamily(
            "gateway_engine_prefix_cache_hit_ratio", "Prefix-cache hit ratio reported by the "
            "replica's own metrics, in tokens, over the recent window.", ("pool", "replica"),
            )
        self.decisions = CounterFamily(
            "gateway_routing_decisions", "Routing decisions by policy and reason.",
            ("pool", "policy", "reason"))
        self.inflight = GaugeFamily(
            "gateway_inflight_requests", "Requests in flight through the gateway.",
            ("pool", "replica"))
        self.replica_up = GaugeFamily(
            "gateway_replica_up", "1 while the replica passes health checks.",
            ("pool", "replica"))
        self.retries = CounterFamily(
            "gateway_retries", "Requests retried on another replica before the first byte.",
            ("pool", "replica"))
        self.resends = CounterFamily(
            "gateway_connection_resends", "Requests sent again to the same replica on a new "
            "connection, after it closed a kept-alive one under them (its idle timeout).",
            ("pool", "replica"))
        self.engine_waiting = GaugeFamily(
            "gateway_engine_requests_waiting", "Requests queued inside the engine (its metrics).",
            ("pool", "replica"))
        self.engine_kv_usage = GaugeFamily(
            "gateway_engine_kv_cache_usage_ratio", "KV cache usage reported by the engine (0-1).",
            ("pool", "replica"))
        self.engine_step = GaugeFamily(
            "gateway_engine_step_seconds", "Engine step (iteration) time, timed by the gateway "
            "from the gaps between the replica's streamed chunks (a moving average).",
            ("pool", "replica"))
        self.prefill_rate = GaugeFamily(
            "gateway_prefill_tokens_per_second", "Prefill rate the pool prices a wait for an "
            "engine step with (configured, or learned from steps that carry a prefill; 0 until "
            "known).", ("pool",))
        self.chars_per_token = GaugeFamily(
            "gateway_chars_per_token", "Characters per engine token the pool uses to size its "
            "prefix indexes (learned from the replicas' usage.prompt_tokens).", ("pool",))
        self.match_fraction = HistogramFamily(
            "gateway_prefix_match_fraction", "Fraction of the prompt's blocks the router expected "
            "to be cached on the chosen replica.", ("pool",),
            buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0))
        # Admission control (only for the classes and pools it is configured for).
        self.queue_wait = HistogramFamily(
            "gateway_queue_wait_seconds", "Time requests waited for an admission slot, however "
            "the wait ended (0 for those admitted at once).", ("traffic_class",),
            buckets=QUEUE_WAIT_BUCKETS)
        self.queue_depth = GaugeFamily(
            "gateway_queue_depth", "Requests waiting for an admission slot.", ("traffic_class",))
        self.admission_inflight = GaugeFamily(
            "gateway_admission_inflight", "Admitted requests holding a slot, by the pool they "
            "were granted (their own or a lender).", ("traffic_class", "pool"))
        self.admission_capacity = GaugeFamily(
            "gateway_admission_capacity", "Slots of the pool: max_inflight_per_replica times "
            "its healthy replicas.", ("pool",))
        self.admission_rejected = CounterFamily(
            "gateway_admission_rejected", "Requests refused with 429: the class's queue was "
            "full (queue_full) or they waited max_queue_wait_s (queue_timeout).",
            ("traffic_class", "reason"))
        self.borrowed = CounterFamily(
            "gateway_borrowed", "Requests admitted on another class's pool (borrowed).",
            ("traffic_class", "pool"))
        self.batch_lines = CounterFamily(
            "gateway_batch_lines", "Batch lines this gateway ran, by result: completed (a 2xx "
            "response written), failed (another status written to the error file), retried "
            "(a try answered 429, 502, 503 or 504, or broken off, to be tried again) and "
            "superseded (finished after another gateway wrote the line's result).", ("result",))
        self.batch_inflight = GaugeFamily(
            "gateway_batch_lines_in_flight", "Batch lines this gateway holds the lease of and "
            "runs (or waits to run) now.", ())
        self.batch_unwritten = GaugeFamily(
            "gateway_batch_results_unwritten", "Finished batch lines whose result this gateway "
            "holds in memory until Redis takes it (above 0 only while Redis is unreachable).",
            ())
        self.redis_up = GaugeFamily(
            "gateway_redis_up", "1 while the Batch API's Redis answers, 0 while it does not "
            "(absent without a redis section).", ())
        # Routing state shared with other gateways through Redis (redis.shared_routing).
        self.shared_up = GaugeFamily(
            "gateway_shared_state_up", "1 while the Redis that shares routing state between "
            "gateways answers, 0 while it does not (the gateway then routes on its own state; "
            "absent when routing state is not shared).", ())
        self.shared_lag = HistogramFamily(
            "gateway_shared_state_lag_seconds", "Time from another gateway's (or another "
            "worker's) routing decision to its prefix insert being applied to this one's index "
            "(the writer's clock against this one's).", ("pool",), buckets=SHARED_LAG_BUCKETS)
        self.shared_inserts = CounterFamily(
            "gateway_shared_state_inserts", "Prefix inserts shared through Redis, or between "
            "the workers of one gateway without it, by direction: published (this gateway's "
            "or worker's decisions written), applied (the others' decisions recorded here), "
            "dropped (not written: the queue was full while Redis was slow or away, or the "
            "workers' files could not be written).", ("pool", "direction"))
        # Authentication, authorisation and rate limits.
        self.auth_rejected = CounterFamily(
            "gateway_auth_rejected", "Requests refused before routing: unauthenticated (401: "
            "no key or a wrong one), forbidden (403: a traffic class or API the key may not "
            "use), rate_limited (429: a key's or class's budget per minute). Surface: "
            "inference, api (other /v1 routes), admin, metrics; traffic_class 'none' when "
            "not known yet.", ("surface", "traffic_class", "reason"))
        # Faults: tries that failed before the client got anything, and passive ejection.
        self.tries_failed = CounterFamily(
            "gateway_tries_failed", "Tries that failed before anything reached the client, by "
            "reason (connect, status: 502/503/504, read: the response broke or was garbage, "
            "first_byte_timeout, stalled); each is tried on another replica while attempts "
            "remain (see gateway_retries).", ("pool", "replica", "reason"))
        self.ejections = CounterFamily(
            "gateway_replica_ejections", "Replicas taken out of rotation by live traffic, by "
            "reason: broken (a connection broke, or 503), consecutive_failures (5xx, "
            "timeouts in a row), stalled (no byte for stall_s while streams that had content "
            "wait).",
            ("pool", "replica", "reason"))
        # Engine A/B experiments (gateway/experiments/): each arm's requests, mirror copies.
        ea = ("experiment", "arm")
        self.experiment_requests = CounterFamily(
            "gateway_experiment_requests", "Requests of an experiment's traffic class by arm "
            "(baseline: the client's requests on the baseline pool; candidate: split requests "
            "served by the candidate pool, or mirror copies) and outcome: ok, or the error's "
            "kind (http_4xx, http_5xx, timeout, connect, read, stream_error, cancelled, "
            "rejected, no_replica).", (*ea, "outcome"))
        self.experiment_ttft = HistogramFamily(
            "gateway_experiment_time_to_first_token_seconds", "An experiment arm's time to "
            "first token, measured at the gateway (a mirror copy's from when it was sent).",
            ea, buckets=TTFT_BUCKETS)
        self.experiment_tpot = HistogramFamily(
            "gateway_experiment_time_per_output_token_seconds", "An experiment arm's mean "
            "time between output tokens after the first, per request.", ea,
            buckets=TPOT_BUCKETS)
        self.experiment_output_tokens = CounterFamily(
            "gateway_experiment_output_tokens", "Output tokens an experiment arm generated.",
            ea)
        self.experiment_copies = CounterFamily(
            "gateway_experiment_mirror_copies", "Mirror copies by result: sent (to a "
            "candidate replica), dropped (not sent: max_concurrency copies in flight, or no "
            "healthy candidate replica with room), failed (sent, and not answered well).",
            ("experiment", "result"))
        # Configuration reloads (SIGHUP, the file changing).
        self.config_reloads = CounterFamily(
            "gateway_config_reloads", "Reloads of the configuration file, by result: ok "
            "(applied) or rejected (invalid: the configuration in force is kept).", ("result",))
        # Discovery (DNS, Kubernetes EndpointSlices).
        self.discovery_errors = CounterFamily(
            "gateway_discovery_errors", "Failed discovery rounds: a DNS resolution that failed "
            "or found nothing, a Kubernetes list or watch that failed (the replicas found "
            "before are kept).", ("pool", "source"))
        self.discovery_success = GaugeFamily(
            "gateway_discovery_last_success_timestamp_seconds", "When discovery last found "
            "the pool's replicas (Unix time; 0 until it has).", ("pool", "source"))
        self.discovered = GaugeFamily(
            "gateway_discovered_replicas", "Replicas discovery found for the pool at its last "
            "success, ready or not (terminating ones are not counted).", ("pool", "source"))
        self.registry.register(FamilyCollector(self.families()))

    def forget_discovery(self, pool: str, source: str) -> None:
        for family in (self.discovery_errors, self.discovery_success, self.discovered):
            family.values.pop((pool, source), None)

    def forget_replica(self, pool: str, replica: str) -> None:
        """Drop every series of a replica that left its pool."""
        for family in self.families():
            if family.labels[:2] != ("pool", "replica"):
                continue
            series = family.rows if isinstance(family, HistogramFamily) else family.values  # type: ignore[attr-defined]
            for key in [k for k in series if k[0] == pool and k[1] == replica]:
                del series[key]

    def families(self) -> list[Family]:
        return [m for m in vars(self).values() if isinstance(m, Family)]
