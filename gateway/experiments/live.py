"""Experiments at run time: which traffic class is in one, its arms' samples and counters."""

from __future__ import annotations

import asyncio
import logging
from time import perf_counter, time
from typing import TYPE_CHECKING, Any

from backends.pool import Pool
from gateway.config import ExperimentConfig, GatewayConfig
from gateway.experiments.report import ExperimentRecord, Sample
from gateway.metrics import GatewayMetrics
from gateway.outcome import Finished
from routing.experiment_split import candidate_side

if TYPE_CHECKING:
    from gateway.experiments.mirror import Mirror

log = logging.getLogger("prefix_gateway.experiments")

BASELINE, CANDIDATE = "baseline", "candidate"


def error_kind(status: str) -> str | None:
    """A finished request's status as a Sample's error kind (None: it succeeded)."""
    if status.startswith("2"):
        return None
    if status == "499":
        return "cancelled"
    if status == "429":
        return "rejected"
    return "http_5xx" if status.startswith("5") else "http_4xx"


class LiveExperiment:
    """One configured experiment while the gateway runs: its pools, switch and record."""

    __slots__ = (
        "_pairs",
        "baseline",
        "candidate",
        "config",
        "copies",
        "fraction",
        "inflight",
        "metrics",
        "mode",
        "name",
        "record",
    )

    def __init__(self, config: ExperimentConfig, pools: dict[str, Pool],
                 metrics: GatewayMetrics) -> None:
        self.config = config
        self.name = config.name
        self.mode = config.mode
        self.fraction = config.share
        self.baseline = pools[config.baseline]
        self.candidate = pools[config.candidate]
        self.metrics = metrics
        self.record = ExperimentRecord(config.name, config.mode, config.traffic_class,
                                       config.baseline, config.candidate, self.fraction,
                                       config.max_samples)
        self.record.enabled = config.enabled
        self.inflight = {BASELINE: 0, CANDIDATE: 0}
        """Each arm's requests in flight (a sample notes it at its arrival)."""
        self.copies = 0
        """Mirror copies in flight (at most config.max_concurrency)."""
        self._pairs = 0

    @property
    def enabled(self) -> bool:
        return self.record.enabled

    def new_pair(self) -> int:
        self._pairs += 1
        return self._pairs

    def on_candidate(self, prefix_key: int) -> bool:
        """Whether the prefix goes to the candidate (split) or is mirrored (mirror)."""
        return candidate_side(prefix_key, self.name, self.fraction)

    def add(self, arm: str, sample: Sample, pair: int | None) -> None:
        self.record.add(arm, sample, pair)
        m, key = self.metrics, (self.name, arm)
        m.experiment_requests.inc((self.name, arm, sample.error or "ok"))
        if sample.ttft_s is not None:
            m.experiment_ttft.observe(key, sample.ttft_s)
        if sample.tpot_s is not None:
            m.experiment_tpot.observe(key, sample.tpot_s)
        if sample.output_tokens:
            m.experiment_output_tokens.inc(key, sample.output_tokens)

    def count(self, what: str) -> None:
        """A mirror copy `sent`, `dropped` (the candidate had no room) or `failed`."""
        self.record.count(what)
        self.metrics.experiment_copies.inc((self.name, what))

    def engines(self) -> dict[str, dict[str, float | None]]:
        """What each arm's engines report: means over the pool's healthy replicas."""
        return {arm: _engine_means(pool) for arm, pool in
                ((BASELINE, self.baseline), (CANDIDATE, self.candidate))}


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 4) if values else None


def _engine_means(pool: Pool) -> dict[str, float | None]:
    healthy = [r for r in pool.replicas.values() if r.healthy]
    snaps = [r.snapshot for r in healthy if r.snapshot is not None]
    return {
        "prefix_cache_hit_ratio": _mean([r.engine_hit_ratio for r in healthy
                                         if r.engine_hit_ratio is not None]),
        "kv_usage": _mean([s.kv_usage for s in snaps if s.kv_usage is not None]),
        "queue_length": _mean([s.waiting for s in snaps if s.waiting is not None]),
    }


class Trial:
    """One request of an experiment on one arm, from its arrival to its sample (once)."""

    __slots__ = ("arm", "arrived", "done", "experiment", "inflight", "kind", "pair",
                 "received_at")

    def __init__(self, experiment: LiveExperiment, arm: str, received_at: float,
                 pair: int | None = None) -> None:
        self.experiment = experiment
        self.arm = arm
        self.received_at = received_at
        self.arrived = time() - (perf_counter() - received_at)
        self.inflight = experiment.inflight[arm]
        experiment.inflight[arm] += 1
        self.pair = pair
        self.done = False
        self.kind: str | None = None
        """An error kind that says more than the status (timeout, connect, read)."""

    def finished(self, f: Finished, usage: dict[str, Any] | None,
                 estimated_prompt_tokens: float | None = None) -> None:
        """The try that answered (or failed) the request ended: `f` as metrics record it.

        Its prompt length is the engine's count when the answer carried usage (a client's
        stream carries none unless it asked), else the router's estimate."""
        tokens = f.completion_tokens
        tpot = f.decode_s / (tokens - 1) if f.ttft_s is not None and tokens > 1 else None
        prompt = usage.get("prompt_tokens") if usage else None
        if not isinstance(prompt, int) and estimated_prompt_tokens:
            prompt = round(estimated_prompt_tokens)
        kind = error_kind(f.status)
        if kind is not None and self.kind is not None:
            kind = self.kind
        self._add(Sample(self.arrived, f.ttft_s, tpot, f.duration_s,
                         prompt if isinstance(prompt, int) else None,
                         tokens if f.ttft_s is not None or usage else None, kind,
                         self.inflight))

    def failed(self, kind: str) -> None:
        """The request ended before any replica answered it."""
        self._add(Sample(self.arrived, None, None, perf_counter() - self.received_at, None,
                         None, kind, self.inflight))

    def _add(self, sample: Sample) -> None:
        if self.done:
            return
        self.done = True
        exp = self.experiment
        exp.inflight[self.arm] -= 1
        exp.add(self.arm, sample, self.pair)


class Experiments:
    """Every configured experiment; `by_class` holds the enabled ones, by traffic class (the
    request core's one lookup per request)."""

    def __init__(self, config: GatewayConfig, pools: dict[str, Pool],
                 metrics: GatewayMetrics) -> None:
        self.pools = pools
        self.metrics = metrics
        self.classes = {c.name: c.pool for c in config.traffic_classes}
        """Traffic class -> its pool, as the gateway started (a reload does not change it)."""
        self.by_name: dict[str, LiveExperiment] = {}
        self.by_class: dict[str, LiveExperiment] = {}
        self.mirror: Mirror | None = None
        """Sends the copies (set by the request core, which owns the transport)."""
        self._reporting = asyncio.Lock()
        self._reported: dict[tuple[int, int, bool, str], dict[str, Any]] = {}
        """The last report of each record, by what it was computed from."""
        self.apply(config)

    def _index(self) -> None:
        # In place: the request core holds this dict.
        self.by_class.clear()
        self.by_class.update((e.config.traffic_class, e) for e in self.by_name.values()
                             if e.enabled)

    def apply(self, config: GatewayConfig) -> tuple[list[str], list[str]]:
        """Make the running experiments those of `config`: an unchanged one keeps its record
        (and its switch, if the admin API turned it), one whose `enabled` alone changed is
        switched, any other change starts it again. Returns what changed, and what could not
        be applied (a pool or class the running gateway does not have)."""
        changes: list[str] = []
        not_applied: list[str] = []
        wanted: dict[str, LiveExperiment] = {}
        for ec in config.experiments:
            missing = [p for p in (ec.baseline, ec.candidate) if p not in self.pools]
            if missing or self.classes.get(ec.traffic_class) != ec.baseline:
                not_applied.append(f"experiments[{ec.name}] (its pools or traffic class "
                                   "change with a restart only)")
                continue
            cur = self.by_name.get(ec.name)
            if cur is not None and cur.config == ec:
                wanted[ec.name] = cur
                continue
            if cur is not None and cur.config.model_copy(update={"enabled": ec.enabled}) == ec:
                cur.config = ec
                cur.record.enabled = ec.enabled
                wanted[ec.name] = cur
                changes.append(f"experiment {ec.name} {'enabled' if ec.enabled else 'disabled'}")
                continue
            wanted[ec.name] = LiveExperiment(ec, self.pools, self.metrics)
            changes.append(f"experiment {ec.name} " + ("changed (its measurements start "
                                                         "again)" if cur else "added"))
        for name in self.by_name.keys() - wanted.keys():
            changes.append(f"experiment {name} removed")
        for name, exp in self.by_name.items():
            if wanted.get(name) is not exp or not exp.enabled:
                self._cut(exp)  # removed, started again or switched off
        self.by_name = wanted
        self._index()
        return changes, not_applied

    def _cut(self, exp: LiveExperiment) -> None:
        if self.mirror is not None and (n := self.mirror.cancel(exp)):
            log.info("experiment %s: %d mirror copies in flight cut", exp.name, n)

    def switch(self, name: str, enabled: bool) -> LiveExperiment | None:
        """The kill switch (and back): from the next request on; switched off, its copies
        in flight are cut too. None: no such name."""
        exp = self.by_name.get(name)
        if exp is None:
            return None
        if exp.enabled != enabled:
            exp.record.enabled = enabled
            log.warning("experiment %s %s through the admin API", name,
                        "enabled" if enabled else "disabled")
            self._index()
            if not enabled:
                self._cut(exp)
        return exp

    async def reports_aside(self) -> list[dict[str, Any]]:
        """Every experiment's report, computed in a thread: a bootstrap over many pairs takes
        up to half a second of pure Python, which the event loop must not wait for. A record
        that has not changed since its last report (same samples, switch and engine figures)
        gives that report again, and callers at once share one computation."""
        async with self._reporting:
            held = [(e.record, e.engines()) for e in self.by_name.values()]
            keys = [(id(rec), rec.version, rec.enabled, repr(engines)) for rec, engines in held]
            todo = [(i, rec, engines) for i, ((rec, engines), key) in
                    enumerate(zip(held, keys, strict=True)) if key not in self._reported]
            # ExperimentRecord.report copies its samples at once (one C call under the GIL),
            # so requests may keep adding to the records meanwhile.
            fresh = await asyncio.to_thread(
                lambda: {i: rec.report(engines=engines) for i, rec, engines in todo})
            self._reported = {key: fresh[i] if i in fresh else self._reported[key]
                              for i, key in enumerate(keys)}
            return [self._reported[key] for key in keys]
