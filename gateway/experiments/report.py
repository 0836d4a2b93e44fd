"""What one experiment saw per arm, the paired bootstrap comparison, and the text report."""

from __future__ import annotations

import math
import random
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

ARMS = ("baseline", "candidate")
MIN_PAIRS = 30
"""Fewer paired requests than this and no difference is called conclusive."""
MAX_DRAWS = 2_000_000
"""Bootstrap draws allowed per comparison: past it, fewer resamples (at least 200), so a
report over 20,000 pairs stays well under a second in pure Python."""


@dataclass(slots=True)
class Sample:
    """One request's outcome on one arm."""

    arrived: float
    """time.time() when the gateway received the request."""
    ttft_s: float | None
    """None when no token came."""
    tpot_s: float | None
    """None when fewer than 2 output tokens."""
    duration_s: float
    """Arrival to the last byte (or to the failure)."""
    prompt_tokens: int | None
    output_tokens: int | None
    error: str | None = None
    """None on success; else its kind: "timeout", "connect", "http_4xx", "http_5xx", ..."""
    inflight: int = 0
    """The arm's requests in flight when this one arrived."""


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-quantile (0..1) by linear interpolation between order statistics; None if empty."""
    return _interpolate(sorted(values), q) if values else None


def _interpolate(ordered: Sequence[float], q: float) -> float:
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def paired_difference(baseline: Sequence[float], candidate: Sequence[float],
                      resamples: int = 2000, seed: int = 0) -> dict[str, Any]:
    """Candidate minus baseline over paired values: the mean difference and its 95% percentile
    bootstrap interval, conclusive only with at least 30 pairs and an interval excluding 0."""
    if len(baseline) != len(candidate):
        raise ValueError("paired samples must have equal lengths")
    diffs = [c - b for b, c in zip(baseline, candidate, strict=True)]
    n = len(diffs)
    out: dict[str, Any] = {"n": n, "mean": None, "ci95": None, "conclusive": False,
                           "resamples": 0, "note": "no paired requests yet"}
    if n == 0:
        return out
    out["mean"] = math.fsum(diffs) / n
    if n < 2:
        out["note"] = f"too small to conclude: {n} pair, at least {MIN_PAIRS} needed"
        return out
    rounds = min(resamples, max(200, MAX_DRAWS // n))
    rng = random.Random(seed)
    means = sorted(math.fsum(rng.choices(diffs, k=n)) / n for _ in range(rounds))
    low, high = _interpolate(means, 0.025), _interpolate(means, 0.975)
    out["ci95"] = [low, high]
    out["resamples"] = rounds
    if n < MIN_PAIRS:
        out["note"] = f"too small to conclude: {n} pairs, at least {MIN_PAIRS} needed"
    elif low <= 0.0 <= high:
        out["note"] = "too small to conclude: the 95% interval contains 0"
    else:
        out["conclusive"] = True
        side = "above" if low > 0 else "below"
        out["note"] = f"candidate {side} baseline: the 95% interval excludes 0"
    return out


class ExperimentRecord:
    """What one experiment saw, bounded: the newest `max_samples` samples per arm."""

    def __init__(self, name: str, mode: str, traffic_class: str, baseline: str,
                 candidate: str, fraction: float, max_samples: int = 20_000) -> None:
        if max_samples < 1:
            raise ValueError("max_samples must be at least 1")
        self.name, self.mode, self.traffic_class = name, mode, traffic_class
        self.pools = {"baseline": baseline, "candidate": candidate}
        self.fraction = fraction
        self.max_samples = max_samples
        self.enabled = True
        """Set by the caller: False while the experiment's kill switch is on."""
        self._samples: dict[str, deque[tuple[Sample, int | None]]] = {
            arm: deque(maxlen=max_samples) for arm in ARMS}
        self._counts: Counter[str] = Counter()
        self.version = 0
        """Bumped by every sample and count: an unchanged version, an unchanged report."""

    def add(self, arm: str, sample: Sample, pair: int | None = None) -> None:
        """Record one outcome; `pair` is shared by the two samples of one mirrored request."""
        if arm not in self._samples:
            raise ValueError(f"arm must be one of {ARMS}, not {arm!r}")
        self._samples[arm].append((sample, pair))
        self.version += 1

    def count(self, what: str, n: int = 1) -> None:
        """Mirror counters: "sent", "dropped" (candidate saturated), "failed"."""
        self._counts[what] += n
        self.version += 1

    def report(self, engines: dict[str, dict] | None = None, now: float | None = None,
               resamples: int = 2000, seed: int = 0) -> dict[str, Any]:
        """The experiment as GET /admin/experiments shows it (candidate minus baseline).

        It works on a copy of the samples taken at once, so it may run in a thread (the
        bootstrap takes a while on many pairs) while `add` goes on in the event loop."""
        held = {arm: list(self._samples[arm]) for arm in ARMS}
        ok = {arm: {p: s for s, p in held[arm] if p is not None and s.error is None}
              for arm in ARMS}
        base, cand = ok["baseline"], ok["candidate"]
        pairs = [(base[p], cand[p]) for p in base if p in cand]

        def diff(field: str) -> dict[str, Any]:
            xs = [(getattr(b, field), getattr(c, field)) for b, c in pairs
                  if getattr(b, field) is not None and getattr(c, field) is not None]
            return paired_difference([b for b, _ in xs], [c for _, c in xs], resamples, seed)

        return {
            "name": self.name, "mode": self.mode, "traffic_class": self.traffic_class,
            "fraction": self.fraction, "enabled": self.enabled,
            "arms": {arm: self._arm(arm, held[arm], (engines or {}).get(arm)) for arm in ARMS},
            "paired": len(pairs),
            "ttft_diff_s": diff("ttft_s"),
            "tpot_diff_s": diff("tpot_s"),
            "mirror": {k: self._counts[k] for k in ("sent", "dropped", "failed")},
            "conditions": self._conditions(held, now),
        }

    def _arm(self, arm: str, held: list[tuple[Sample, int | None]],
             engine: dict | None) -> dict[str, Any]:
        samples = [s for s, _ in held]
        good = [s for s in samples if s.error is None]
        errors = Counter(s.error for s in samples if s.error is not None)
        ttft = [s.ttft_s for s in good if s.ttft_s is not None]
        tpot = [s.tpot_s for s in good if s.tpot_s is not None]
        per_request = [s.output_tokens / s.duration_s for s in good
                       if s.output_tokens and s.duration_s > 0]
        span = _span(samples)
        tokens = sum(s.output_tokens or 0 for s in good)
        engine = engine or {}
        return {
            "pool": self.pools[arm], "requests": len(samples), "ok": len(good),
            "errors": dict(sorted(errors.items())), "timeouts": errors.get("timeout", 0),
            "ttft_p50_s": percentile(ttft, 0.5), "ttft_p95_s": percentile(ttft, 0.95),
            "ttft_p99_s": percentile(ttft, 0.99),
            "tpot_p50_s": percentile(tpot, 0.5), "tpot_p95_s": percentile(tpot, 0.95),
            "output_tokens_per_s_p50": percentile(per_request, 0.5),
            "output_tokens_per_s": tokens / span if span > 0 else None,
            "concurrency": _spread([s.inflight for s in samples]),
            "prefix_cache_hit_ratio": engine.get("prefix_cache_hit_ratio"),
            "kv_usage": engine.get("kv_usage"),
            "queue_length": engine.get("queue_length"),
        }

    def _conditions(self, held: dict[str, list[tuple[Sample, int | None]]],
                    now: float | None) -> dict[str, Any]:
        # The requests the clients sent: in mirror mode the candidate's are copies of some
        # of the baseline's, so only the baseline's count; in split mode the arms share them.
        arms = ("baseline",) if self.mode == "mirror" else ARMS
        samples = [s for arm in arms for s, _ in held[arm]]
        arrivals = sorted(s.arrived for s in samples)
        since = arrivals[0] if arrivals else None
        end = now if now is not None else max((s.arrived + s.duration_s for s in samples),
                                              default=None)
        spread = arrivals[-1] - arrivals[0] if arrivals else 0.0
        return {
            "window_s": end - since if since is not None and end is not None else None,
            "since": since,
            "max_samples": self.max_samples,
            "prompt_tokens": _tokens([s.prompt_tokens for s in samples]),
            "output_tokens": _tokens([s.output_tokens for s in samples if s.error is None]),
            "arrival_rate_per_s": (len(arrivals) - 1) / spread if spread > 0 else None,
            "concurrency": _spread([s.inflight for s in samples]),
        }


def _span(samples: list[Sample]) -> float:
    if not samples:
        return 0.0
    return (max(s.arrived + s.duration_s for s in samples)
            - min(s.arrived for s in samples))


def _tokens(values: list[int | None]) -> dict[str, float | None]:
    known = [v for v in values if v is not None]
    return {"p50": percentile(known, 0.5), "p95": percentile(known, 0.95),
            "max": max(known) if known else None}


def _spread(values: list[int]) -> dict[str, float | None]:
    return {"mean": math.fsum(values) / len(values) if values else None,
            "max": max(values) if values else None}


# The text report. gateway/static/stats.html writes the same figures the same way (rounding
# exact ties to even, as Python's format does): change both together.

def _ms(v: float | None) -> str:
    return "-" if v is None else f"{1000 * v:.1f} ms"


def _signed_ms(v: float | None) -> str:
    return "-" if v is None else f"{1000 * v:+.1f} ms"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _num(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _pairs(counts: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(counts.items())) or "-"


def arm_rows(exp: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The side-by-side rows of one experiment: (label, baseline, candidate)."""
    rows: list[tuple[str, Any]] = [
        ("pool", lambda a: str(a["pool"])),
        ("requests", lambda a: str(a["requests"])),
        ("ok", lambda a: str(a["ok"])),
        ("errors", lambda a: _pairs(a["errors"])),
        ("TTFT p50", lambda a: _ms(a["ttft_p50_s"])),
        ("TTFT p95", lambda a: _ms(a["ttft_p95_s"])),
        ("TTFT p99", lambda a: _ms(a["ttft_p99_s"])),
        ("TPOT p50", lambda a: _ms(a["tpot_p50_s"])),
        ("TPOT p95", lambda a: _ms(a["tpot_p95_s"])),
        ("tokens/s per request p50", lambda a: _num(a["output_tokens_per_s_p50"])),
        ("tokens/s aggregate", lambda a: _num(a["output_tokens_per_s"])),
        ("engine prefix-cache hit", lambda a: _pct(a.get("prefix_cache_hit_ratio"))),
        ("engine KV usage", lambda a: _pct(a.get("kv_usage"))),
        ("engine queue", lambda a: _num(a.get("queue_length"))),
        ("in flight at arrival mean / max", lambda a: _mean_max(a.get("concurrency"))),
    ]
    arms = exp["arms"]
    return [(label, f(arms["baseline"]), f(arms["candidate"])) for label, f in rows]


SPLIT_NOTE = "compare the arms' percentiles, and the conditions each arm saw"


def diff_line(d: dict[str, Any]) -> str:
    """One paired difference as the report writes it."""
    if not d.get("n"):
        return d.get("note") or "no paired requests yet"
    ci = d.get("ci95")
    interval = f"[{_signed_ms(ci[0])}, {_signed_ms(ci[1])}]" if ci else "-"
    verdict = "conclusive" if d.get("conclusive") else "not conclusive"
    return (f"mean {_signed_ms(d['mean'])}, 95% CI {interval} over {d['n']} pairs: "
            f"{verdict} ({d['note']})")


def condition_lines(c: dict[str, Any]) -> list[str]:
    """The conditions the figures were measured under, one per line."""
    since = c.get("since")
    # Whole seconds, cut rather than rounded, as the page's Date writes them.
    started = ("" if since is None else datetime.fromtimestamp(math.floor(since), UTC)
               .strftime(" since %Y-%m-%d %H:%M:%S UTC"))
    window = "-" if c.get("window_s") is None else f"{c['window_s']:.1f} s"
    p, o = c.get("prompt_tokens") or {}, c.get("output_tokens") or {}
    rate = c.get("arrival_rate_per_s")
    return [
        f"window {window}{started} (newest {c.get('max_samples', '-')} samples per arm)",
        f"prompt tokens p50 {_num(p.get('p50'), 0)}, p95 {_num(p.get('p95'), 0)}, "
        f"max {_num(p.get('max'), 0)}",
        f"output tokens p50 {_num(o.get('p50'), 0)}, p95 {_num(o.get('p95'), 0)}, "
        f"max {_num(o.get('max'), 0)}",
        f"arrival rate {'-' if rate is None else f'{rate:.2f}/s'}, "
        f"in flight at arrival {_concurrency(c.get('concurrency'))}",
    ]


def _mean_max(c: dict[str, Any] | None) -> str:
    c = c or {}
    return f"{_num(c.get('mean'))} / {_num(c.get('max'), 0)}"


def _concurrency(c: dict[str, Any] | None) -> str:
    c = c or {}
    return f"mean {_num(c.get('mean'))}, max {_num(c.get('max'), 0)}"


def render_report(body: dict[str, Any]) -> str:
    """The text of GET /admin/experiments for a terminal or a decision document."""
    experiments = body.get("experiments", [])
    if not experiments:
        return "no experiments configured\n"
    lines: list[str] = []
    for exp in experiments:
        state = "enabled" if exp.get("enabled", True) else "DISABLED (kill switch on)"
        lines.append(f"experiment {exp['name']}: {exp['mode']} {_pct(exp['fraction'])} of "
                     f"traffic class {exp['traffic_class']}, {state}")
        rows = [("", "baseline", "candidate"), *arm_rows(exp)]
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                  for r in rows]
        if exp["mode"] == "split":
            lines.append(f"  not paired: a split sends each prefix to one arm only ({SPLIT_NOTE})")
        else:
            lines.append(f"  paired requests: {exp['paired']}")
            for what, key in (("TTFT", "ttft_diff_s"), ("TPOT", "tpot_diff_s")):
                lines.append(f"  {what} difference (candidate - baseline): {diff_line(exp[key])}")
        if exp["mode"] == "mirror":
            m = exp["mirror"]
            lines.append(f"  mirror copies: sent {m['sent']}, dropped {m['dropped']} "
                         f"(candidate saturated), failed {m['failed']}")
        lines.append("  conditions:")
        lines += ["    " + line for line in condition_lines(exp["conditions"])]
        lines.append("")
    return "\n".join(lines)
