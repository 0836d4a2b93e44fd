"""The gateway's lock-free metric families export exactly what prometheus-client's own would."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from gateway.metric_families import CounterFamily, FamilyCollector, GaugeFamily, HistogramFamily

BUCKETS = (0.1, 0.5, 1.0, 2.5)
OBSERVED = [0.05, 0.1, 0.1000001, 0.5, 0.7, 1.0, 3.0, 100.0]  # on, just over and past bounds


def exposition(registry: CollectorRegistry) -> list[str]:
    lines = generate_latest(registry).decode().splitlines()
    return sorted(line for line in lines if not line.startswith("#")
                  and "_created" not in line)


def test_histogram_counter_and_gauge_match_prometheus_client() -> None:
    ours = CollectorRegistry()
    h = HistogramFamily("t_seconds", "help", ("pool",), buckets=BUCKETS)
    c = CounterFamily("t_requests", "help", ("pool", "status"))
    g = GaugeFamily("t_inflight", "help", ("pool",))
    ours.register(FamilyCollector([h, c, g]))
    theirs = CollectorRegistry()
    ph = Histogram("t_seconds", "help", ("pool",), buckets=BUCKETS, registry=theirs)
    pc = Counter("t_requests", "help", ("pool", "status"), registry=theirs)
    pg = Gauge("t_inflight", "help", ("pool",), registry=theirs)
    for i, value in enumerate(OBSERVED):
        pool = "a" if i % 3 else "b"
        h.observe((pool,), value)
        ph.labels(pool).observe(value)
        c.inc((pool, "200"), 2)
        pc.labels(pool, "200").inc(2)
        g.inc((pool,), 1)
        pg.labels(pool).inc(1)
    g.inc(("b",), -1)
    pg.labels("b").inc(-1)
    assert exposition(ours) == exposition(theirs)
    assert ours.get_sample_value("t_seconds_bucket", {"pool": "a", "le": "0.1"}) == 1.0
    assert ours.get_sample_value("t_seconds_bucket", {"pool": "a", "le": "+Inf"}) == 5.0
    assert ours.get_sample_value("t_requests_total", {"pool": "b", "status": "200"}) == 6.0
