"""loadtests.overhead's A/B bookkeeping on constructed runs: order, summary, table."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from loadtests.overhead import (
    Run,
    format_ab_table,
    format_table,
    record,
    rotation,
    summarise,
    summarise_ab,
)


def test_rotation_puts_each_variant_first_once_per_cycle() -> None:
    order = list(rotation(3, ["direct", "baseline", "current"]))
    assert order == [(0, "direct"), (0, "baseline"), (0, "current"),
                     (1, "baseline"), (1, "current"), (1, "direct"),
                     (2, "current"), (2, "direct"), (2, "baseline")]
    # Two variants alternate, as the plain gateway-vs-direct run always did.
    assert [v for _, v in rotation(2, ["direct", "gateway"])] == [
        "direct", "gateway", "gateway", "direct"]


def _run(ms: list[float], wall: float, ttft_ms: list[float] | None = None) -> Run:
    return Run(ok=len(ms), wall=wall, latencies=[x / 1000 for x in ms],
               ttfts=[x / 1000 for x in ttft_ms or []])


def test_summary_and_table_from_constructed_runs() -> None:
    # Closed loop, non-stream, two reps: 10 requests each; latencies in ms.
    direct = [record(_run([1.0] * 10, 0.01), None, False),
              record(_run([2.0] * 10, 0.01), None, False)]
    baseline = [record(_run([3.0] * 10, 0.02), 0.010, False),   # +2 ms, 1.0 CPU-ms/req
                record(_run([4.0] * 10, 0.02), 0.012, False)]   # +2 ms, 1.2
    current = [record(_run([4.0] * 10, 0.025), 0.011, False),   # +3 ms, 1.1
               record(_run([6.0] * 10, 0.025), 0.013, False)]   # +4 ms, 1.3
    # Open loop, stream: TTFT is what the added figures use.
    sd = [record(_run([5.0] * 4, 1.0, [1.0] * 4), None, True)]
    sb = [record(_run([9.0] * 4, 1.0, [2.0] * 4), 0.004, True)]
    sc = [record(_run([9.0] * 4, 1.0, [1.5] * 4), 0.002, True)]
    res = {"closed": {"non-stream": {"direct": direct, "baseline": baseline,
                                     "current": current}},
           "open": {"stream@200": {"direct": sd, "baseline": sb, "current": sc}}}

    rows = {(r["measurement"], r["metric"]): r for r in summarise_ab(res)}
    rps = rows[("closed non-stream", "req/s")]
    assert rps["baseline"]["median"] == pytest.approx(500)
    assert rps["current"]["median"] == pytest.approx(400)
    assert rps["ratio"] == pytest.approx(0.8)
    added = rows[("closed non-stream", "added latency p50 ms")]
    assert added["baseline"]["median"] == pytest.approx(2.0)
    assert added["current"]["median"] == pytest.approx(3.5)   # median of +3 and +4
    assert added["ratio"] == pytest.approx(1.75)
    cpu = rows[("closed non-stream", "gw CPU-ms/req")]
    assert cpu["baseline"]["median"] == pytest.approx(1.1)
    assert cpu["current"]["median"] == pytest.approx(1.2)
    ttft = rows[("open stream@200/s", "added TTFT p50 ms")]
    assert (ttft["baseline"]["median"], ttft["current"]["median"]) == pytest.approx((1.0, 0.5))
    assert rows[("open stream@200/s", "gw CPU-ms/req")]["ratio"] == pytest.approx(0.5)

    args = argparse.Namespace(baseline_root=Path("/old"), concurrency=16, duration=3.0, reps=2)
    table = format_ab_table(list(rows.values()), args)
    lines = table.splitlines()
    assert "baseline (/old) vs current" in table
    rps_line = next(line for line in lines if line.startswith("closed non-stream"))
    assert rps_line.split()[-1] == "0.80"
    cpu_line = next(line for line in lines if "gw CPU-ms/req" in line)
    assert "1.100" in cpu_line and "1.200" in cpu_line and cpu_line.split()[-1] == "1.09"
    assert lines[-1] == "errors: baseline 0, current 0"


def test_router_comparison_puts_cpu_of_routers_and_stubs_side_by_side() -> None:
    # Closed loop, non-stream, two reps of 10 requests: (router CPU-s, stub CPU-s) per run.
    def closed(router_s: float | None, stub_s: float, ms: float) -> dict:
        return record(_run([ms] * 10, 0.01), router_s, False, stub_s)

    res = {"closed": {"non-stream": {
        "direct": [closed(None, 0.0002, 1.0), closed(None, 0.0004, 1.0)],
        "gateway": [closed(0.006, 0.0004, 2.0), closed(0.008, 0.0006, 2.0)],
        "sglang": [closed(0.004, 0.0005, 1.5), closed(0.004, 0.0005, 1.5)]}},
        "open": {"non-stream@200": {
            "direct": [record(_run([1.0] * 4, 1.0), None, False, 0.0001)],
            "gateway": [record(_run([3.0] * 4, 1.0), 0.004, False, 0.0001)],
            "sglang": [record(_run([2.0] * 4, 1.0), 0.002, False, 0.0001)]}}}
    s = summarise(res)
    row = s["closed"]["non-stream"]
    assert row["stub_cpu_ms_per_req_direct"] == pytest.approx(0.03)
    gw, sgl = row["routers"]["gateway"], row["routers"]["sglang"]
    assert (gw["cpu_ms_per_req"], sgl["cpu_ms_per_req"]) == pytest.approx((0.7, 0.4))
    assert (gw["stub_cpu_ms_per_req"], sgl["stub_cpu_ms_per_req"]) == pytest.approx((0.05, 0.05))
    added = s["open"]["non-stream@200"]["routers"]
    assert added["gateway"]["p50_ms"]["added"] == pytest.approx(2.0)
    assert added["sglang"]["p50_ms"]["added"] == pytest.approx(1.0)
    assert added["gateway"]["cpu_ms_per_req"] == pytest.approx(1.0)

    args = argparse.Namespace(concurrency=16, duration=3.0, reps=2, prompt_chars=2000)
    lines = format_table(s, args).splitlines()
    gw_line = next(line for line in lines if line.split()[:1] == ["gateway"])
    assert "0.700" in gw_line and gw_line.split()[-1] == "1.75x"  # 0.7 / 0.4
    assert lines[-1] == "errors: 0 closed loop, 0 open loop"

    # The A/B table grows a column for the SGLang router and one for current/sglang.
    ab = {"closed": {"non-stream": {"direct": res["closed"]["non-stream"]["direct"],
                                    "baseline": res["closed"]["non-stream"]["gateway"],
                                    "current": res["closed"]["non-stream"]["gateway"],
                                    "sglang": res["closed"]["non-stream"]["sglang"]}},
          "open": {}}
    rows = {(r["measurement"], r["metric"]): r for r in summarise_ab(ab)}
    cpu = rows[("closed non-stream", "gw CPU-ms/req")]
    assert cpu["ratio"] == pytest.approx(1.0) and cpu["ratio_sglang"] == pytest.approx(1.75)
    stubs = rows[("closed non-stream", "stubs CPU-ms/req")]
    assert stubs["current"]["median"] == pytest.approx(0.05)
    table = format_ab_table(list(rows.values()), argparse.Namespace(
        baseline_root=Path("/old"), concurrency=16, duration=3.0, reps=2))
    cpu_line = next(line for line in table.splitlines() if "gw CPU-ms/req" in line)
    assert cpu_line.split()[-1] == "1.75" and cpu_line.split()[-2] == "1.00"
    assert table.splitlines()[-1] == "errors: baseline 0, current 0, sglang 0"


def test_workers_bench_counts_the_gateways_cpu_over_the_measured_requests_only() -> None:
    """It used to read the gateway's CPU before the warm-up and after the run: the warm-up's
    requests (and the idle time around them) counted as CPU but not as requests."""
    from loadtests.workers_bench import HALF, SEPARATE, record, table

    run = Run(ok=1000, wall=2.0, cpu_by_pid={1: 0.0, 2: 0.05, 3: 0.07, 99: 0.5})
    rec = record(run, [1, 2, 3], switches=250)  # 99: the stub replicas, not the gateway
    assert rec["gateway_cpu_ms_per_req"] == pytest.approx(0.12)
    assert rec["gateway_cores"] == pytest.approx(0.06)
    assert rec["rps"] == 500.0
    assert rec["switches_per_req"] == 0.25
    half = record(Run(ok=500, wall=2.0, cpu_by_pid={1: 0.08}), [1])
    text = table({"open 500/s": {"workers=1": [rec], "workers=2": [rec], HALF: [half]},
                  "closed c=32": {"workers=1": [rec], SEPARATE: [rec]}})
    assert "| open 500/s | workers=1 at half | 250 " in text
    assert "| 0.160 " in text
    assert "| closed c=32 | 2 separate gateways | 500 " in text and "| 0.25 |" in text
