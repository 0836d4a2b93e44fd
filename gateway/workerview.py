"""What /metrics and /admin/stats show when `serve` runs several worker processes: the whole
gateway, whichever worker the request reached.

Each worker writes what it counted (its metric families and the raw figures behind its
stats) to a file of its own in a directory the supervising process made, once a second and
again at every scrape, replacing the file atomically. A worker answering /metrics or
/admin/stats writes its own file first, then reads every worker's and merges them:

- counters and histograms are summed; the files of workers that died (renamed `retired-PID`
  by the supervisor) keep counting, so a sum never goes backwards when a worker is replaced
  (it loses at most the last second the dead worker counted);
- gauges that count something the gateway holds (requests in flight, queued, admission
  slots) are summed over the live workers; gauges that describe a replica or an engine (up,
  KV usage, step time, learned rates) are the answering worker's own view; a dead worker's
  gauges are dropped;
- stats: requests, errors, loads and decisions summed over the live workers; hit ratios and
  TTFT quantiles computed from every live worker's raw figures.

Each merged scrape is built only from files, which only move forward, so two scrapes reaching
different workers never see a counter go down. Nothing here runs on the request path.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import os
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
from prometheus_client import generate_latest

from gateway.metric_families import CounterFamily, GaugeFamily, HistogramFamily
from gateway.metrics import GatewayMetrics
from gateway.state import GatewayState
from gateway.stats import _quantile

log = logging.getLogger("prefix_gateway.workers")

WRITE_INTERVAL_S = 1.0
RETIRED = "retired-"

SUMMED_GAUGES = frozenset({
    "gateway_inflight_requests", "gateway_queue_depth", "gateway_admission_inflight",
    "gateway_admission_capacity", "gateway_batch_lines_in_flight",
    "gateway_batch_results_unwritten",
})
"""Gauges that count what each worker holds: the gateway's is the sum of its workers'."""


def dump_metrics(metrics: GatewayMetrics) -> dict[str, list]:
    out: dict[str, list] = {}
    for f in metrics.families():
        if isinstance(f, HistogramFamily):
            out[f.name] = [[list(k), row] for k, row in f.rows.items()]
        else:
            out[f.name] = [[list(k), v] for k, v in f.values.items()]  # type: ignore[attr-defined]
    return out


def merge_metrics(own: dict[str, list], live: list[dict[str, list]],
                  retired: list[dict[str, list]]) -> GatewayMetrics:
    """A GatewayMetrics holding the whole gateway's series (see the module's docstring)."""
    out = GatewayMetrics()
    families = {f.name: f for f in out.families()}
    for source, kind in ([(own, "own")] + [(d, "live") for d in live]
                         + [(d, "retired") for d in retired]):
        for name, series in source.items():
            fam = families.get(name)
            if fam is None:
                continue
            if isinstance(fam, HistogramFamily):
                for key, row in series:
                    k = tuple(key)
                    cur = fam.rows.get(k)
                    if cur is None or len(cur) != len(row):
                        fam.rows[k] = list(row)
                    else:
                        for i, v in enumerate(row):
                            cur[i] += v
            elif isinstance(fam, CounterFamily):
                for key, v in series:
                    fam.inc(tuple(key), v)
            elif isinstance(fam, GaugeFamily):
                if kind == "own":
                    for key, v in series:
                        fam.set(tuple(key), v)
                elif kind == "live" and name in SUMMED_GAUGES:
                    for key, v in series:
                        fam.inc(tuple(key), v)
    return out


def raw_stats(state: GatewayState) -> dict[str, Any]:
    """This worker's /admin/stats, with the raw figures a merge needs."""
    stats = state.stats
    return {
        "snapshot": stats.snapshot(state.pools, state.admission),
        "replicas": {name: [s.hit_blocks, s.miss_blocks, list(s.ttfts)]
                     for name, s in stats.replicas.items()},
        "queue_waits": {name: list(w) for name, w in stats.queue_waits.items()},
    }


_SUMMED_REPLICA = ("inflight", "pending_prefill_tokens", "requests", "errors")


def merge_stats(own_pid: int, workers: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The whole gateway's /admin/stats from each live worker's `raw_stats` (by pid); the
    structure (pools, replicas, classes) is the answering worker's."""
    own = workers[own_pid]
    out = copy.deepcopy(own["snapshot"])
    others = [w for pid, w in workers.items() if pid != own_pid]
    hits: Counter[str] = Counter()
    misses: Counter[str] = Counter()
    ttfts: dict[str, list[float]] = {}
    waits: dict[str, list[float]] = {}
    for w in workers.values():
        for name, (hit, miss, t) in w["replicas"].items():
            hits[name] += hit
            misses[name] += miss
            ttfts.setdefault(name, []).extend(t)
        for name, q in w["queue_waits"].items():
            waits.setdefault(name, []).extend(q)
    for pool in out["pools"]:
        theirs = [p for w in others for p in w["snapshot"]["pools"] if p["name"] == pool["name"]]
        for key in ("traffic_classes", "decisions_by_reason"):
            total = Counter(pool[key])
            for p in theirs:
                total.update(p[key])
            pool[key] = dict(total)
        for r in pool["replicas"]:
            for p in theirs:
                for other in p["replicas"]:
                    if other["name"] == r["name"]:
                        for key in _SUMMED_REPLICA:
                            r[key] += other[key]
            looked = hits[r["name"]] + misses[r["name"]]
            r["estimated_hit_ratio"] = round(hits[r["name"]] / looked, 4) if looked else None
            ordered = ttfts.get(r["name"], [])
            r["ttft_p50_s"] = _quantile(ordered, 0.5)  # type: ignore[arg-type]
            r["ttft_p95_s"] = _quantile(ordered, 0.95)  # type: ignore[arg-type]
    adm = out["admission"]
    for c in adm["classes"]:
        for w in others:
            for o in w["snapshot"]["admission"]["classes"]:
                if o["name"] != c["name"]:
                    continue
                c["queued"] += o["queued"]
                c["inflight"] += o["inflight"]
                for key in ("inflight_by_pool", "rejected", "borrowed"):
                    total = Counter(c[key])
                    total.update(o[key])
                    c[key] = dict(total)
        q = waits.get(c["name"], [])
        c["queue_wait_p50_s"] = _quantile(q, 0.5)  # type: ignore[arg-type]
        c["queue_wait_p95_s"] = _quantile(q, 0.95)  # type: ignore[arg-type]
    for g in adm["pools"]:
        for w in others:
            for o in w["snapshot"]["admission"]["pools"]:
                if o["name"] == g["name"]:
                    for key in ("capacity", "inflight", "borrowed_inflight"):
                        g[key] += o[key]
        g["load_fraction"] = round(g["inflight"] / g["capacity"], 4) if g["capacity"] else 1.0
    out["worker_pid"] = own_pid
    out["workers"] = [{
        "pid": pid,
        "requests": sum(r["requests"] for p in w["snapshot"]["pools"] for r in p["replicas"]),
        "inflight": sum(r["inflight"] for p in w["snapshot"]["pools"] for r in p["replicas"]),
    } for pid, w in sorted(workers.items())]
    return out


class WorkerView:
    """One worker's side of the shared directory: writes its file, answers for all."""

    def __init__(self, directory: str | Path, state: GatewayState,
                 interval_s: float = WRITE_INTERVAL_S) -> None:
        self.directory = Path(directory)
        self.state = state
        self.interval_s = interval_s
        self.pid = os.getpid()
        self.path = self.directory / f"{self.pid}.json"
        self.written: tuple[float, ...] = ()
        """The signature of what the file holds now."""

    def _own(self) -> dict[str, Any]:
        return {"pid": self.pid, "metrics": dump_metrics(self.state.metrics),
                "stats": raw_stats(self.state)}

    def signature(self) -> tuple[float, ...]:
        """Changes whenever anything the file holds for the others may have: a cheap look
        (a sum per family), so that an idle worker writes nothing."""
        out: list[float] = []
        for f in self.state.metrics.families():
            if isinstance(f, HistogramFamily):  # counts only grow: their sum tells
                out += (sum(sum(row) for row in f.rows.values()), len(f.rows))
            elif isinstance(f, GaugeFamily):  # one series up, another down: every value
                out.append(hash(tuple(f.values.items())))
            else:
                out += (sum(f.values.values()), len(f.values))  # type: ignore[attr-defined]
        return tuple(out)

    def write(self) -> dict[str, Any]:
        self.written = self.signature()
        own = self._own()
        tmp = self.directory / f".{self.pid}.tmp"
        tmp.write_bytes(orjson.dumps(own))
        os.replace(tmp, self.path)
        return own

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            if self.signature() == self.written:
                continue
            try:
                self.write()
            except OSError as exc:  # the directory went away: the gateway is stopping
                log.debug("cannot write %s: %s", self.path, exc)

    def _read(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The other live workers' files, and the retired (dead) workers'."""
        live, retired = [], []
        for p in self.directory.glob("*.json"):
            if p == self.path:
                continue
            with contextlib.suppress(OSError, orjson.JSONDecodeError):
                data = orjson.loads(p.read_bytes())
                (retired if p.name.startswith(RETIRED) else live).append(data)
        return live, retired

    def metrics_text(self) -> bytes:
        own = self.write()
        live, retired = self._read()
        merged = merge_metrics(own["metrics"], [d["metrics"] for d in live],
                               [d["metrics"] for d in retired])
        return generate_latest(merged.registry)

    def stats(self) -> dict[str, Any]:
        own = self.write()
        live, _ = self._read()
        workers = {d["pid"]: d["stats"] for d in live}
        workers[self.pid] = own["stats"]
        return merge_stats(self.pid, workers)
