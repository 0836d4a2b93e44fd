"""Pure helpers of loadtests.vllm_bench (no engine needed)."""

from __future__ import annotations

import itertools

from loadtests import vllm_bench as vb


def test_system_targets_spread_evenly() -> None:
    assert vb.system_targets(6, 1500, 2500) == [1500, 1700, 1900, 2100, 2300, 2500]
    assert vb.system_targets(1, 1500, 2500) == [2000]


def test_fit_words_stays_at_or_below_target() -> None:
    n = vb.fit_words(1000, lambda words: 2 * words + 3, 100)
    assert 2 * n + 3 <= 1000 and 2 * n + 3 >= 980


def test_build_turns_histories_grow_and_are_deterministic() -> None:
    turns = vb.build_turns(["sys A", "sys B"], users=2, turns=3, user_words=5, reply_words=7,
                           seed=1)
    assert len(turns) == 2 * 2 * 3
    assert turns == vb.build_turns(["sys A", "sys B"], 2, 3, 5, 7, seed=1)
    by_user = {}
    for t in turns:
        by_user.setdefault((t.tenant, t.user), []).append(t)
    for (tenant, _), seq in by_user.items():
        assert [t.turn for t in seq] == [0, 1, 2]  # a user's turns come in order
        for prev, nxt in itertools.pairwise(seq):
            assert nxt.messages[: len(prev.messages)] == prev.messages  # history is a prefix
            assert len(nxt.messages) == len(prev.messages) + 2
        assert seq[0].messages[0] == {"role": "system", "content": ["sys A", "sys B"][tenant]}


def test_target_ratio_and_ttft() -> None:
    agg = {"prefix_affinity": {"engine_hit_ratio": 0.8, "ttft_p50_s": 0.3},
           "round_robin": {"engine_hit_ratio": 0.4, "ttft_p50_s": 0.7}}
    t = vb.target(agg)
    assert t is not None and t["hit_met"] and t["ttft_met"] and abs(t["hit_ratio_x"] - 2) < 1e-9


def test_kv_gib_covers_the_block_cap() -> None:
    gib = vb.kv_gib(77, 128, 16384)
    assert gib * vb.launch.GiB >= 77 * 128 * 16384


def test_the_gateways_expected_hits_are_read_from_its_own_metrics_page() -> None:
    from prometheus_client import generate_latest

    from gateway.metrics import GatewayMetrics

    m = GatewayMetrics()
    m.prefix_blocks.inc(("bench", "vllm-0", "hit"), 30)
    m.prefix_blocks.inc(("bench", "vllm-0", "miss"), 10)
    before = vb.expected_blocks(generate_latest(m.registry).decode())
    assert before == (30.0, 10.0)
    m.prefix_blocks.inc(("bench", "vllm-1", "hit"), 6)
    m.prefix_blocks.inc(("bench", "vllm-0", "miss"), 2)
    # Another name that starts the same, and other series, are not counted.
    text = generate_latest(m.registry).decode() + 'gateway_prefix_blocks_totals{result="hit"} 9\n'
    after = vb.expected_blocks(text)
    assert after == (36.0, 12.0)
    assert vb.expected_hit_ratio(before, after) == 0.75  # 6 of the 8 blocks routed since
    assert vb.expected_hit_ratio(after, after) is None


def test_a_run_reports_the_gateways_expected_hits_beside_the_engines_from_one_page_read() -> None:
    from prometheus_client import generate_latest

    from gateway.metrics import GatewayMetrics

    m = GatewayMetrics()

    def page() -> dict:
        return vb.gateway_page_figures(generate_latest(m.registry).decode())

    gw_before = page()
    ttft = ("bench", "vllm-0", "realtime")
    m.ttft.observe(ttft, 0.25)
    m.ttft.observe(ttft, 0.75)
    m.prefix_blocks.inc(("bench", "vllm-0", "hit"), 9)
    m.prefix_blocks.inc(("bench", "vllm-0", "miss"), 1)
    gw_after = page()
    zero = dict.fromkeys(vb.COUNTERS, 0.0)
    engine = {**zero, vb.HITS: 600.0, vb.QUERIES: 1000.0, f"{vb.ENGINE_TTFT}_sum": 0.8,
              f"{vb.ENGINE_TTFT}_count": 2.0}
    results = [vb.Result(0, 0, True, ttft_s=0.3, replica="vllm-0", prompt_tokens=500),
               vb.Result(0, 1, True, ttft_s=0.8, replica="vllm-0", prompt_tokens=500)]
    res = vb.summarize(results, 1.0, [zero], [engine], gw_before, gw_after, [], [], 1)
    assert res["engine_hit_ratio"] == 0.6
    assert res["gateway_expected_hit_ratio"] == 0.9  # the index believed more than was held
    assert res["gateway_ttft_mean_s"] == 0.5
    assert abs(res["gateway_minus_engine_ttft_s"] - 0.1) < 1e-9


def test_belief_gaps_separate_a_prefix_still_in_flight_from_one_the_engine_let_go():
    # Tenant 0: r1 sent while r0 (same tenant, same replica) had no first token yet; the
    # engine held nothing of what the index expected. r2 came later and found only part of
    # it. r3 is short by less than a block: rounding, not a gap. r4 expected nothing.
    def req(tenant: int, sent: float, first: float, match: float, cached: int) -> vb.Result:
        return vb.Result(tenant, 0, True, ttft_s=first - sent, replica="vllm-0",
                         prompt_tokens=1000, cached_tokens=cached, expected_match=match,
                         sent_s=sent, first_token_s=first)

    results = [req(0, 0.0, 2.0, 0.0, 0), req(0, 1.0, 3.0, 0.8, 0), req(0, 5.0, 6.0, 0.9, 400),
               req(1, 5.0, 6.0, 0.9, 800), req(1, 7.0, 8.0, 0.0, 0),
               vb.Result(2, 0, False, replica="vllm-0", error="HTTP 500")]
    gaps = vb.belief_gaps(results, block_tokens=128)
    assert gaps is not None
    assert gaps["requests"] == 5
    assert gaps["short"] == 2 and gaps["in_flight"] == 1 and gaps["engine_cold"] == 1
    assert abs(gaps["short_points"] - (800 + 500) / 5000) < 1e-9
    assert abs(gaps["in_flight_points"] - 800 / 5000) < 1e-9
    assert abs(gaps["expected_cached_ratio"] - 2600 / 5000) < 1e-9
    assert abs(gaps["engine_cached_ratio"] - 1200 / 5000) < 1e-9
    assert "2/5 (in flight 1, engine-cold 1" in vb.describe_belief(gaps)
    # Without the gateway's header (a policy that routes without an index) there is no figure.
    assert vb.belief_gaps([vb.Result(0, 0, True, ttft_s=0.1, prompt_tokens=10)], 128) is None
