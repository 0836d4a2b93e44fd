"""The experiment record, its paired bootstrap comparison, its text report and the split side."""

from __future__ import annotations

import random
import sys

import pytest

from gateway.experiments import ExperimentRecord, Sample, paired_difference, render_report
from gateway.experiments.report import arm_rows, percentile
from routing.experiment_split import candidate_side


def ok(ttft: float, tpot: float | None = 0.02, arrived: float = 1000.0, prompt: int = 100,
       output: int = 10, inflight: int = 0) -> Sample:
    return Sample(arrived=arrived, ttft_s=ttft, tpot_s=tpot, duration_s=ttft + 0.2,
                  prompt_tokens=prompt, output_tokens=output, inflight=inflight)


def failed(kind: str, arrived: float = 1000.0) -> Sample:
    return Sample(arrived=arrived, ttft_s=None, tpot_s=None, duration_s=1.0, prompt_tokens=100,
                  output_tokens=None, error=kind)


def record(mode: str = "mirror", max_samples: int = 20_000) -> ExperimentRecord:
    return ExperimentRecord("trial", mode, "chat", "pool-a", "pool-b", 1.0, max_samples)


def test_percentiles_interpolate_between_order_statistics() -> None:
    values = [float(v) for v in range(1, 101)]
    random.Random(3).shuffle(values)
    assert percentile(values, 0.5) == pytest.approx(50.5)
    assert percentile(values, 0.95) == pytest.approx(95.05)
    assert percentile(values, 0.99) == pytest.approx(99.01)
    assert percentile(values, 0.0) == 1.0 and percentile(values, 1.0) == 100.0
    assert percentile([7.0], 0.99) == 7.0
    assert percentile([], 0.5) is None


def test_an_arm_reports_its_percentiles_and_errors_by_kind() -> None:
    r = record()
    for i in range(1, 101):
        r.add("candidate", ok(i / 1000, tpot=i / 10_000, arrived=1000.0 + i))
    for kind in ("timeout", "timeout", "http_5xx", "connect"):
        r.add("candidate", failed(kind))
    arm = r.report()["arms"]["candidate"]
    assert arm["requests"] == 104 and arm["ok"] == 100
    assert arm["errors"] == {"connect": 1, "http_5xx": 1, "timeout": 2}
    assert arm["timeouts"] == 2
    assert arm["ttft_p50_s"] == pytest.approx(0.0505)
    assert arm["ttft_p95_s"] == pytest.approx(0.09505)
    assert arm["ttft_p99_s"] == pytest.approx(0.09901)
    assert arm["tpot_p50_s"] == pytest.approx(0.00505)
    assert arm["pool"] == "pool-b"
    assert r.report()["arms"]["baseline"]["ttft_p50_s"] is None


def test_memory_is_bounded_to_the_newest_samples() -> None:
    r = record(max_samples=50)
    for i in range(500):
        r.add("baseline", ok(1.0 if i < 450 else 0.001, arrived=1000.0 + i), pair=i)
        r.add("candidate", ok(1.0 if i < 450 else 0.002, arrived=1000.0 + i), pair=i)
    rep = r.report()
    assert rep["arms"]["baseline"]["requests"] == 50
    assert rep["arms"]["baseline"]["ttft_p99_s"] == pytest.approx(0.001)  # old ones gone
    assert rep["paired"] == 50
    assert rep["conditions"]["since"] == 1450.0


def test_pairs_count_only_when_both_arms_succeeded() -> None:
    r = record()
    r.add("baseline", ok(0.1), pair=1)
    r.add("candidate", ok(0.2), pair=1)
    r.add("baseline", ok(0.1), pair=2)
    r.add("candidate", failed("timeout"), pair=2)
    r.add("baseline", failed("http_5xx"), pair=3)
    r.add("candidate", ok(0.2), pair=3)
    r.add("baseline", ok(0.1), pair=4)  # its copy was dropped
    r.add("candidate", ok(0.2))  # no pair id (split mode)
    r.add("baseline", ok(0.1, tpot=None), pair=5)
    r.add("candidate", ok(0.3, tpot=0.05), pair=5)
    rep = r.report()
    assert rep["paired"] == 2
    assert rep["ttft_diff_s"]["n"] == 2
    assert rep["ttft_diff_s"]["mean"] == pytest.approx(0.15)
    assert rep["tpot_diff_s"]["n"] == 1  # pair 5 has no baseline TPOT


def test_a_known_shift_gives_an_interval_excluding_zero_with_the_right_sign() -> None:
    rng = random.Random(1)
    base = [rng.uniform(0.05, 0.5) for _ in range(200)]
    cand = [b * 1.5 + rng.gauss(0, 0.01) for b in base]
    up = paired_difference(base, cand)
    assert up["n"] == 200 and up["conclusive"] is True
    low, high = up["ci95"]
    assert 0 < low <= up["mean"] <= high
    assert "above" in up["note"]
    down = paired_difference(cand, base)
    assert down["conclusive"] is True and down["ci95"][1] < 0
    assert down["mean"] == pytest.approx(-up["mean"])


def test_identical_arms_are_not_conclusive() -> None:
    rng = random.Random(2)
    base = [rng.uniform(0.05, 0.5) for _ in range(300)]
    same = paired_difference(base, list(base))
    low, high = same["ci95"]
    assert low <= 0 <= high and same["conclusive"] is False
    assert "contains 0" in same["note"]
    noisy = paired_difference(base, [b + rng.gauss(0, 0.05) for b in base])
    assert noisy["ci95"][0] <= 0 <= noisy["ci95"][1] and noisy["conclusive"] is False


def test_fewer_than_30_pairs_are_never_conclusive() -> None:
    base = [0.1 * (1 + i % 3) for i in range(29)]
    small = paired_difference(base, [b + 1.0 for b in base])
    assert small["ci95"][0] > 0  # a clear shift, yet too few pairs
    assert small["conclusive"] is False and "29 pairs" in small["note"]
    assert paired_difference([], [])["ci95"] is None
    assert paired_difference([0.1], [0.2])["conclusive"] is False
    with pytest.raises(ValueError):
        paired_difference([0.1], [])


def test_the_interval_narrows_as_pairs_accumulate() -> None:
    rng = random.Random(4)
    base = [rng.uniform(0.05, 0.5) for _ in range(1600)]
    cand = [b + 0.02 + rng.gauss(0, 0.05) for b in base]
    widths = []
    for n in (50, 200, 800, 1600):
        ci = paired_difference(base[:n], cand[:n])["ci95"]
        widths.append(ci[1] - ci[0])
    assert widths == sorted(widths, reverse=True)
    assert widths[-1] < widths[0] / 3  # about 1/sqrt(n): 1/sqrt(32) of the first


def test_the_bootstrap_is_deterministic_for_a_seed() -> None:
    rng = random.Random(5)
    base = [rng.random() for _ in range(100)]
    cand = [b + rng.gauss(0, 0.1) for b in base]
    assert paired_difference(base, cand, seed=7) == paired_difference(base, cand, seed=7)
    assert paired_difference(base, cand, seed=7)["ci95"] != \
        paired_difference(base, cand, seed=8)["ci95"]


def test_candidate_side_is_stable_and_takes_about_its_fraction() -> None:
    rng = random.Random(6)
    keys = [rng.getrandbits(64) for _ in range(10_000)] + list(range(10_000))
    for fraction in (0.1, 0.5, 0.9):
        share = sum(candidate_side(k, "trial", fraction) for k in keys) / len(keys)
        assert abs(share - fraction) < 0.02
    assert all(candidate_side(k, "trial", 0.3) == candidate_side(k, "trial", 0.3)
               for k in keys[:500])
    assert not any(candidate_side(k, "trial", 0.0) for k in keys[:2000])
    assert all(candidate_side(k, "trial", 1.0) for k in keys[:2000])
    # a bigger fraction only moves prefixes to the candidate, never back
    assert all(candidate_side(k, "trial", 0.6) for k in keys[:2000]
               if candidate_side(k, "trial", 0.3))
    other = [candidate_side(k, "other", 0.5) for k in keys[:2000]]
    assert other != [candidate_side(k, "trial", 0.5) for k in keys[:2000]]
    assert candidate_side(-1, "trial", 0.5) in (True, False)  # any int hashes


def test_conditions_describe_the_clients_requests() -> None:
    r = record()
    for i in range(11):
        s = ok(0.1, arrived=1000.0 + i * 0.5, prompt=100 * (i + 1), output=i + 1, inflight=i)
        r.add("baseline", s, pair=i)
        r.add("candidate", ok(0.2, arrived=s.arrived, prompt=99_999), pair=i)
    r.count("sent", 11)
    r.count("dropped")
    c = r.report(now=1010.0)["conditions"]
    assert c["prompt_tokens"] == {"p50": 600.0, "p95": pytest.approx(1050.0), "max": 1100}
    assert c["output_tokens"]["max"] == 11
    assert c["arrival_rate_per_s"] == pytest.approx(2.0)
    assert c["concurrency"] == {"mean": 5.0, "max": 10}
    assert c["window_s"] == pytest.approx(10.0) and c["since"] == 1000.0
    assert r.report()["mirror"] == {"sent": 11, "dropped": 1, "failed": 0}
    split = record("split")
    split.add("baseline", ok(0.1, prompt=10))
    split.add("candidate", ok(0.1, prompt=30))
    assert split.report()["conditions"]["prompt_tokens"]["max"] == 30


def test_the_report_text_holds_the_figures_and_conditions() -> None:
    r = record()
    rng = random.Random(9)
    for i in range(100):
        b = rng.uniform(0.1, 0.3)
        r.add("baseline", ok(b, arrived=1_764_583_200.0 + i), pair=i)
        r.add("candidate", ok(b * 1.5, arrived=1_764_583_200.0 + i), pair=i)
    r.add("candidate", failed("timeout"), pair=100)
    r.count("sent", 101)
    rep = r.report(engines={"baseline": {"prefix_cache_hit_ratio": 0.4125, "kv_usage": 0.5,
                                         "queue_length": 2.0}})
    text = render_report({"experiments": [rep]})
    assert "experiment trial: mirror 100.0% of traffic class chat, enabled" in text
    assert f"{1000 * rep['arms']['baseline']['ttft_p50_s']:.1f} ms" in text
    assert f"{1000 * rep['arms']['candidate']['ttft_p99_s']:.1f} ms" in text
    assert "timeout=1" in text and "41.2%" in text  # 41.25 is a tie: to even
    low, high = rep["ttft_diff_s"]["ci95"]
    assert f"95% CI [{1000 * low:+.1f} ms, {1000 * high:+.1f} ms] over 100 pairs: conclusive" \
        in text
    assert "paired requests: 100" in text and "mirror copies: sent 101" in text
    assert "since 2025-12-01 10:00:00 UTC" in text
    assert "prompt tokens p50 100" in text and "arrival rate 1.00/s" in text
    rows = dict((label, (b, c)) for label, b, c in arm_rows(rep))
    assert rows["requests"] == ("100", "101") and rows["engine KV usage"] == ("50.0%", "-")
    assert render_report({"experiments": []}) == "no experiments configured\n"
    r.enabled = False
    assert "DISABLED" in render_report({"experiments": [r.report()]})


def test_add_refuses_an_unknown_arm() -> None:
    with pytest.raises(ValueError):
        record().add("treatment", ok(0.1))


def test_a_report_may_run_in_a_thread_while_samples_arrive() -> None:
    import threading

    r = record(max_samples=5000)
    for i in range(5000):
        r.add("baseline", ok(0.1), pair=i)
        r.add("candidate", ok(0.2), pair=i)
    stop = threading.Event()

    def feed() -> None:
        i = 5000
        while not stop.is_set():
            r.add("baseline", ok(0.1), pair=i)
            r.add("candidate", ok(0.2), pair=i)
            i += 1

    feeder = threading.Thread(target=feed)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads take turns often, as a busy gateway's would
    feeder.start()
    try:
        reports = [r.report(resamples=10) for _ in range(10)]
    finally:
        stop.set()
        feeder.join(timeout=30)
        sys.setswitchinterval(switch)
    # Each report is of one copy per arm while the windows slide: full arms, the pairs found
    # in both copies (the feeder may move on between the two, so fewer than all), and the
    # difference taken over exactly those pairs.
    for rep in reports:
        assert rep["arms"]["baseline"]["requests"] == rep["arms"]["candidate"]["requests"] == 5000
        assert 0 < rep["paired"] <= 5000
        assert rep["ttft_diff_s"]["n"] == rep["paired"]
        assert rep["ttft_diff_s"]["mean"] == pytest.approx(0.1)
