"""Routing statistics for people: what /admin/stats returns and `prefix-gateway stats` prints."""

from __future__ import annotations

from collections import Counter, deque
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from backends.pool import Pool
from routing.load import NO_LOAD
from routing.types import Decision

if TYPE_CHECKING:
    from gateway.admission import Admission


def shown_url(url: str) -> str:
    """A replica's URL as the admin API shows it: credentials in it (user:password@, a
    query) replaced by ***."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=netloc, query="***" if parts.query else ""))

class ReplicaStats:
    __slots__ = ("errors", "hit_blocks", "miss_blocks", "requests", "routed", "ttfts")

    def __init__(self) -> None:
        self.routed = 0
        """Requests routed to it (first decisions)."""
        self.requests = 0
        self.errors = 0
        self.hit_blocks = 0
        self.miss_blocks = 0
        self.ttfts: deque[float] = deque(maxlen=2048)


class StatsRecorder:
    """Counts kept beside the Prometheus metrics, in a shape a person can read at once."""

    def __init__(self, recent_decisions: int = 50) -> None:
        self.replicas: dict[str, ReplicaStats] = {}
        self.recent: deque[tuple[float, str, str, Decision]] = deque(maxlen=recent_decisions)
        """The latest routing decisions: (time.time(), pool, traffic class, decision)."""
        self.decisions: dict[str, Counter[str]] = {}
        self.classes: dict[str, Counter[str]] = {}
        # Admission control, per traffic class.
        self.rejected: dict[str, Counter[str]] = {}
        self.borrowed: dict[str, Counter[str]] = {}
        self.queue_waits: dict[str, deque[float]] = {}

    def replica(self, name: str) -> ReplicaStats:
        s = self.replicas.get(name)
        if s is None:
            s = self.replicas[name] = ReplicaStats()
        return s

    def snapshot(self, pools: list[Pool], admission: Admission | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"pools": [], "admission": self._admission(admission)}
        for pool in pools:
            reps = []
            for r in pool.replicas.values():
                s = self.replica(r.name)
                looked = s.hit_blocks + s.miss_blocks
                snap = r.snapshot
                index = pool.router.indexes.get(r.name)
                reps.append({
                    "name": r.name,
                    "url": shown_url(r.base_url),
                    "healthy": r.healthy,
                    "last_error": r.last_error or None,
                    "inflight": pool.load.inflight.get(r.name, 0),
                    "pending_prefill_tokens": round(pool.load.pending_prefill.get(r.name, 0.0)),
                    "other_gateways_inflight": pool.load.remote.get(r.name, NO_LOAD)[0],
                    "engine_step_s": _round(pool.load.steps.step_s(r.name)),
                    "prefill_tokens_per_s": _rate(pool.load.steps.replica_rate(r.name)),
                    "engine_prefill_tokens_per_s": _rate(pool.load.engines.rate(r.name)),
                    "speed": round(pool.load.speed(r.name), 3),
                    "requests": s.requests,
                    "errors": s.errors,
                    "estimated_hit_ratio": round(s.hit_blocks / looked, 4) if looked else None,
                    "engine_hit_ratio": (round(r.engine_hit_ratio, 4)
                                         if r.engine_hit_ratio is not None else None),
                    "engine_waiting": snap.waiting if snap else None,
                    "engine_kv_usage": snap.kv_usage if snap else None,
                    "draining": r.draining,
                    "index_blocks": len(index) if index is not None else 0,
                    "index_capacity_blocks": index.capacity_blocks if index is not None else 0,
                    "index_pinned_blocks": index.pinned_blocks if index is not None else 0,
                    "index_reserved_blocks": index.reserved if index is not None else 0,
                    "ttft_p50_s": _quantile(s.ttfts, 0.5),
                    "ttft_p95_s": _quantile(s.ttfts, 0.95),
                })
            out["pools"].append({
                "name": pool.name,
                "engine": pool.engine,
                "policy": pool.policy_name,
                "models": sorted(pool.models),
                "traffic_classes": dict(self.classes.get(pool.name, Counter())),
                "decisions_by_reason": dict(self.decisions.get(pool.name, Counter())),
                "prefill_tokens_per_s": round(pool.load.steps.rate) or None,
                "prefill_rate_learned": pool.load.steps.learning,
                "chars_per_token": round(pool.router.chars_per_token, 4),
                "replicas": reps,
            })
        return out


    def _admission(self, admission: Admission | None) -> dict[str, Any]:
        """Per class under admission control: its queue, slots, limits, refusals, borrowing;
        per pool with a capacity: the capacity and its load. Empty lists when none is."""
        if admission is None:
            return {"classes": [], "pools": []}
        classes = []
        for g in admission.classes.values():
            waits = self.queue_waits.get(g.name, deque())
            classes.append({
                "name": g.name,
                "pool": g.pool.name,
                "priority": g.priority,
                "queued": g.depth,
                "inflight": g.inflight,
                "inflight_by_pool": {p: n for p, n in g.by_pool.items() if n},
                "max_inflight": g.max_inflight,
                "max_queue": g.max_queue,
                "max_queue_wait_s": g.max_wait,
                "borrow": [{"pool": lender.name, "while_below": below}
                           for lender, below in g.lenders],
                "rejected": dict(self.rejected.get(g.name, Counter())),
                "borrowed": dict(self.borrowed.get(g.name, Counter())),
                "queue_wait_p50_s": _quantile(waits, 0.5),
                "queue_wait_p95_s": _quantile(waits, 0.95),
            })
        pools = [{
            "name": gate.name,
            "max_inflight_per_replica": gate.per_replica,
            "capacity": gate.capacity,
            "inflight": gate.inflight,
            "borrowed_inflight": gate.borrowed,
            "load_fraction": round(gate.load_fraction(), 4),
            "reserved_fraction": gate.reserved,
            "lendable": gate.lendable,
        } for gate in admission.pools.values()]
        return {"classes": classes, "pools": pools}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _rate(value: float | None) -> int | None:
    return None if value is None else round(value)


def _quantile(values: deque[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4)


def render_table(stats: dict[str, Any]) -> str:
    """A fixed-width table of /admin/stats for a terminal."""
    cols = ("replica", "healthy", "inflight", "requests", "errors", "est_hit", "engine_hit",
            "ttft_p50", "ttft_p95", "step", "speed")
    lines: list[str] = []
    workers = stats.get("workers")
    if workers:  # serve --workers N: the figures are every worker's
        lines.append(f"workers: {len(workers)} (" + ", ".join(
            f"pid {w['pid']}: {w['requests']} requests, {w['inflight']} in flight"
            for w in workers) + ")")
        lines.append("")
    for pool in stats.get("pools", []):
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(pool["decisions_by_reason"].items()))
        classes = ", ".join(f"{k}={v}" for k, v in sorted(pool["traffic_classes"].items()))
        lines.append(f"pool {pool['name']} ({pool['engine']}, policy {pool['policy']}, "
                     f"models {', '.join(pool['models'])})")
        lines.append(f"  decisions: {reasons or '-'}")
        lines.append(f"  classes:   {classes or '-'}")
        rate = pool.get("prefill_tokens_per_s")
        how = "learned" if pool.get("prefill_rate_learned") else "configured"
        lines.append(f"  prefill:   {f'{rate:,} tokens/s ({how})' if rate else f'- ({how})'}")
        rows = [cols]
        for r in pool["replicas"]:
            rows.append((
                r["name"], "yes" if r["healthy"] else "NO", str(r["inflight"]),
                str(r["requests"]), str(r["errors"]), _pct(r["estimated_hit_ratio"]),
                _pct(r["engine_hit_ratio"]), _ms(r["ttft_p50_s"]), _ms(r["ttft_p95_s"]),
                _ms(r.get("engine_step_s")), f"{r['speed']:.2f}" if "speed" in r else "-",
            ))
        widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
        for row in rows:
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
        lines.append("")
    lines += _admission_table(stats.get("admission") or {})
    return "\n".join(lines).rstrip() + "\n"


def _admission_table(admission: dict[str, Any]) -> list[str]:
    classes, pools = admission.get("classes", []), admission.get("pools", [])
    if not classes and not pools:
        return []
    lines = ["admission"]
    rows = [("class", "pool", "priority", "queued", "inflight", "max_inflight", "max_queue",
             "wait_p50", "wait_p95", "rejected", "borrowed")]
    for c in classes:
        rows.append((
            c["name"], c["pool"], str(c["priority"]), str(c["queued"]),
            _pairs(c["inflight_by_pool"]) if c["inflight"] else "0",
            str(c["max_inflight"] or "-"), str(c["max_queue"]), _ms(c["queue_wait_p50_s"]),
            _ms(c["queue_wait_p95_s"]), _pairs(c["rejected"]), _pairs(c["borrowed"]),
        ))
    lines += _columns(rows)
    rows = [("pool", "per_replica", "capacity", "inflight", "borrowed", "load", "reserved")]
    for p in pools:
        rows.append((p["name"], str(p["max_inflight_per_replica"]), str(p["capacity"]),
                     str(p["inflight"]), str(p["borrowed_inflight"]), _pct(p["load_fraction"]),
                     _pct(p["reserved_fraction"])))
    if len(rows) > 1:
        lines.append("")
        lines += _columns(rows)
    return lines


def _columns(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
            for row in rows]


def _pairs(counts: dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(counts.items())) or "-"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{1000 * v:.1f}ms"
