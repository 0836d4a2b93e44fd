"""The offline simulator: report shape, determinism, and the orderings routing must produce."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from gateway.config import RoutingSettings
from loadtests.reference_policies import SGLangCacheAware
from loadtests.simulate import (
    REPORT_KEYS,
    Workload,
    load_workload,
    main,
    settings_for,
    simulate,
)
from loadtests.traces import tenants_workload
from routing import Router
from routing.types import ReplicaView

if TYPE_CHECKING:
    from loadtests.sim_sharing import Gateways


@pytest.fixture(scope="module")
def tenants() -> Workload:
    # 150 tenants x 6,144-token contexts: 0.9M tokens of KV demand, more than one replica's
    # 512k-token cache, so where a request goes decides whether it hits.
    return load_workload(workload="tenants", limit=200)


def run(workload: Workload, policy: str) -> dict:
    return simulate(workload, policy, replicas=4)


def test_report_has_every_key_and_serves_every_request(tenants: Workload) -> None:
    report = run(tenants, "prefix_affinity")
    assert set(REPORT_KEYS) <= set(report)
    assert report["requests"] == 200
    assert report["errors"] == 0
    assert report["replicas"] == 4
    assert 0.0 < report["hit_ratio"] <= 1.0


def test_ttft_percentiles_interpolate_between_requests() -> None:
    from backends.sim.profiles import PROFILES
    from loadtests.traces import TraceRequest

    prof = PROFILES["qwen-32b-h200"]
    # Two unrelated prompts, 1,024 and 2,048 tokens, far enough apart that each runs alone on
    # its idle engine: their TTFTs are the profile's, and the percentiles lie between them.
    reqs = [TraceRequest(0.0, 1024, 10, (1, 2), ""), TraceRequest(30.0, 2048, 10, (3, 4, 5, 6), "")]
    workload = Workload("two", reqs)
    _, tokens = workload.engine_prompts(16)
    short, long = prof.ttft_s(tokens[0], 0), prof.ttft_s(tokens[1], 0)
    assert long > short
    report = simulate(workload, "round_robin", replicas=1)
    assert report["ttft_mean_s"] == pytest.approx((short + long) / 2, abs=1e-4)
    assert report["ttft_p50_s"] == pytest.approx((short + long) / 2, abs=1e-4)
    assert report["ttft_p90_s"] == pytest.approx(short + 0.9 * (long - short), abs=1e-4)
    assert report["ttft_p99_s"] == pytest.approx(short + 0.99 * (long - short), abs=1e-4)


@pytest.mark.parametrize(("n_requests", "imbalance"), [(4, 1.0), (3, 1.333)])
def test_request_imbalance_is_busiest_over_mean(n_requests: int, imbalance: float) -> None:
    from loadtests.traces import TraceRequest

    # Round robin over two replicas: 2 + 2 requests are balanced, 2 + 1 are 2 / 1.5.
    reqs = [TraceRequest(10.0 * i, 512, 2, (i,), "") for i in range(n_requests)]
    report = simulate(Workload("rr", reqs), "round_robin", replicas=2)
    assert report["requests"] == n_requests
    assert report["imbalance"] == imbalance


def test_runs_are_deterministic(tenants: Workload) -> None:
    assert run(tenants, "prefix_affinity") == run(tenants, "prefix_affinity")
    assert run(tenants, "oracle") == run(tenants, "oracle")


def test_prefix_affinity_hits_more_than_round_robin(tenants: Workload) -> None:
    affinity = run(tenants, "prefix_affinity")
    blind = run(tenants, "round_robin")
    assert affinity["hit_ratio"] > blind["hit_ratio"] + 0.1
    assert affinity["ttft_mean_s"] < blind["ttft_mean_s"]


@pytest.mark.parametrize("policy", ["oracle", "prefix_affinity", "sglang_cache_aware"])
def test_no_policy_beats_the_ideal_hit_ratio(tenants: Workload, policy: str) -> None:
    report = run(tenants, policy)
    assert report["hit_ratio"] <= report["ideal_hit_ratio"] + 1e-9


@pytest.mark.parametrize("policy", ["oracle", "prefix_affinity", "round_robin"])
def test_no_policy_beats_the_ttft_floor(tenants: Workload, policy: str) -> None:
    report = run(tenants, policy)
    assert 0.0 < report["ttft_floor_mean_s"] <= report["ttft_mean_s"]


def test_ttft_floor_prices_the_ideal_hit_on_an_idle_engine() -> None:
    from backends.sim.profiles import PROFILES
    from loadtests.traces import TraceRequest

    prof = PROFILES["qwen-32b-h200"]
    # Two requests with one 512-token block in common; the second adds one of its own.
    reqs = [TraceRequest(0.0, 512, 10, (1,), ""), TraceRequest(1.0, 1024, 10, (1, 2), "")]
    workload = Workload("two", reqs)
    _, tokens = workload.engine_prompts(16)
    alone_cold = prof.ttft_s(tokens[0], 0)
    alone_with_hit = prof.ttft_s(tokens[1], 512)
    assert workload.ttft_bounds(prof).floor == pytest.approx((alone_cold + alone_with_hit) / 2)


@pytest.mark.parametrize("policy", ["oracle", "prefix_affinity", "sglang_cache_aware"])
def test_no_policy_beats_the_cobatch_bound(tenants: Workload, policy: str) -> None:
    report = run(tenants, policy)
    # Most requests here start while another sequence decodes, so the bound clears the floor.
    assert report["ttft_floor_mean_s"] < report["ttft_bound_mean_s"] <= report["ttft_mean_s"]


@pytest.mark.parametrize("gap_s", [0.1, 5.0])
def test_cobatch_bound_charges_a_start_that_must_share_a_step_with_decoding(gap_s: float) -> None:
    from backends.sim.profiles import PROFILES
    from loadtests.traces import TraceRequest

    prof = PROFILES["qwen-32b-h200"]
    # One replica, two unrelated 1,024-token prompts with 10-token outputs. The first decodes
    # for 9 steps after its first token (0.4 s); a second arriving 0.1 s after the first must
    # share a step with it, one arriving 5 s after starts alone.
    reqs = [TraceRequest(0.0, 1024, 10, (1, 2), ""), TraceRequest(gap_s, 1024, 10, (3, 4), "")]
    workload = Workload("two", reqs)
    report = simulate(workload, "round_robin", replicas=1)
    floor = workload.ttft_bounds(prof).floor
    forced = prof.decode_s(1) / 2 if gap_s < 1 else 0.0
    assert report["ttft_bound_mean_s"] == pytest.approx(floor + forced, abs=1e-4)
    assert report["ttft_bound_mean_s"] <= report["ttft_mean_s"]
    if not forced:
        assert report["ttft_mean_s"] == pytest.approx(floor, abs=1e-4)  # the bound is exact here


def test_no_policy_beats_the_cobatch_bound_on_random_workloads() -> None:
    import random

    from loadtests.simulate import ALL_POLICIES
    from loadtests.traces import TraceRequest

    # Small random fleets and traces: shared heads of random length, outputs from 1 token up,
    # arrivals from sparse to bursty. The bound is a proof, so no schedule may beat it.
    rng = random.Random(7)
    charged = 0
    for trial in range(12):
        heads = [tuple(rng.randrange(10**9) for _ in range(rng.randint(1, 16)))
                 for _ in range(rng.randint(1, 4))]
        t, reqs = 0.0, []
        for _ in range(rng.randint(5, 40)):
            t += rng.expovariate(rng.choice([0.5, 5.0, 50.0]))
            ids = (*rng.choice(heads)[: rng.randint(0, 16)], rng.randrange(10**9))
            reqs.append(TraceRequest(t, len(ids) * 512 - rng.randint(0, 400),
                                     rng.choice([1, 2, 10, 100]), ids, ""))
        workload = Workload(f"random{trial}", reqs)
        replicas = rng.randint(1, 4)
        for policy in ALL_POLICIES:
            report = simulate(workload, policy, replicas=replicas)
            assert report["ttft_bound_mean_s"] <= report["ttft_mean_s"], (trial, policy)
        charged += report["ttft_bound_mean_s"] > report["ttft_floor_mean_s"]
    assert charged >= 6  # most traces force co-batched starts, so the check has teeth


def test_engine_hit_ratio_counts_only_real_reuse() -> None:
    # Every request has its own context: nothing to reuse, whatever the policy.
    unique = Workload("unique", tenants_workload(n_tenants=20_000, system_blocks=2,
                                                  n_requests=100, seed=9))
    report = simulate(unique, "prefix_affinity", replicas=2)
    assert report["ideal_hit_ratio"] < 0.05
    assert report["hit_ratio"] <= report["ideal_hit_ratio"] + 1e-9


def test_cli_prints_json_on_the_last_line(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    assert main(["--workload", "hot_prompt", "--limit", "50", "--replicas", "2", "--json"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    report = json.loads(last)
    assert report["policy"] == "prefix_affinity"
    assert report["requests"] == 50


def test_sglang_emulation_pins_a_prefix_then_balances_when_imbalanced() -> None:
    policy = SGLangCacheAware()
    router = Router(["w0", "w1", "w2"], policy, block_chars=64)
    text = "s" * 2000
    req = router.request_from_text(text + "q1")
    first = router.route(req, [ReplicaView(n) for n in ("w0", "w1", "w2")]).replica
    # Cold prefixes go to the least-loaded worker, ties to the first: SGLang's min_by_key.
    assert first == "w0"
    again = router.route(router.request_from_text(text + "q2"),
                         [ReplicaView("w0", inflight=5), ReplicaView("w1"), ReplicaView("w2")])
    assert again.replica == "w0"  # match rate above 0.3 wins while the pool is balanced
    skewed = [ReplicaView("w0", inflight=100), ReplicaView("w1", inflight=10), ReplicaView("w2")]
    assert router.route(router.request_from_text(text + "q3"), skewed).replica == "w2"


def test_settings_are_key_values_with_json_values() -> None:
    from loadtests.settings import key_value

    assert key_value("load_weight=1") == ("load_weight", 1)
    assert key_value("prefill_tokens_per_s=null") == ("prefill_tokens_per_s", None)
    assert key_value("policy=round_robin") == ("policy", "round_robin")  # not JSON: text
    with pytest.raises(SystemExit) as exc:
        main(["--workload", "hot_prompt", "--limit", "5", "--set", "load_weight"])
    assert exc.value.code == 2  # argparse: "expected KEY=VALUE, got 'load_weight'"


def test_settings_are_printed_as_they_are_typed() -> None:
    from loadtests.settings import key_value, settings_text

    settings = [("decode_step_wait", False), ("time_cap", None), ("policy", "round_robin"),
                ("balance_weight", 0.03)]
    text = settings_text(settings)
    # JSON, not Python: a printed command runs as shown and reads back the same settings.
    assert text == "decode_step_wait=false,time_cap=null,policy=round_robin,balance_weight=0.03"
    assert [key_value(part) for part in text.split(",")] == settings
    assert settings_text([], ", ") == "defaults"


def test_held_out_scenarios_share_no_workload_seed_with_the_tuning_set() -> None:
    from loadtests.scoreboard import SCENARIOS

    def seeded(sc) -> tuple:
        return (sc.trace or sc.workload, dict(sc.params).get("seed"))

    held = [sc for sc in SCENARIOS if sc.held_out]
    assert {sc.replicas for sc in held} == {8, 32}
    assert {sc.workload for sc in held} == {"conversation", "stress", "swing"}
    tuning = {seeded(sc) for sc in SCENARIOS if not sc.held_out}
    assert not {seeded(sc) for sc in held} & tuning


def test_shadow_oracle_logs_both_choices_for_every_request() -> None:
    from loadtests.experiments.shadow_oracle import run, summary

    workload = load_workload(workload="tenants", params={
        "n_tenants": 6, "n_requests": 80, "rate_per_s": 20, "system_blocks": 4})
    report, rows = run(workload, "prefix_affinity", 3, RoutingSettings())
    assert len(rows) == report["requests"] == 80
    assert {r["kind"] for r in rows} <= {"agree", "equal", "hit lost", "phantom hit", "queue"}
    assert all(r["routed"] in {"r0", "r1", "r2"} and r["oracle"] in {"r0", "r1", "r2"}
               for r in rows)
    assert all(r["routed_est_s"] >= r["oracle_est_s"] for r in rows)  # the oracle's own best
    assert "agree" in summary(rows)


def test_shadow_oracle_tells_losses_between_equal_holders_with_nothing_queued() -> None:
    from loadtests.experiments.shadow_oracle import summary

    def row(kind: str, cached: tuple[int, int], pending: tuple[int, int],
            inflight: tuple[int, int], est: tuple[float, float]) -> dict[str, object]:
        return {"kind": kind, "routed_cached": cached[0], "oracle_cached": cached[1],
                "routed_pending": pending[0], "oracle_pending": pending[1],
                "routed_inflight": inflight[0], "oracle_inflight": inflight[1],
                "routed_est_s": est[0], "oracle_est_s": est[1], "routed_believed": cached[0]}

    rows = [row("queue", (512, 512), (0, 0), (1, 3), (0.30, 0.26)),  # to fewer in flight
            row("queue", (512, 512), (0, 0), (4, 2), (0.30, 0.28)),  # to more
            row("queue", (0, 0), (900, 0), (1, 3), (0.50, 0.30)),  # a queue on one side
            row("queue", (0, 512), (0, 0), (1, 3), (0.50, 0.30)),  # held unequally
            row("agree", (0, 0), (0, 0), (0, 0), (0.20, 0.20))]
    text = summary(rows)
    # Per request of all five: (0.04 + 0.02) / 5 and 0.04 / 5.
    assert "nothing pending on either: 2, 0.0120 s" in text
    assert "to fewer in flight than the oracle's: 1, 0.0080 s" in text


def test_shadow_oracle_runs_on_a_fleet_of_mixed_speeds() -> None:
    from backends.sim.fleet_spec import fleet_profiles
    from loadtests.experiments.shadow_oracle import main, run

    # Mostly cold prompts, far apart, on one replica at full speed and one three times slower:
    # the oracle reads each engine's own profile, so it sends the slow one only a prompt it
    # holds (on two equal replicas it splits the cold ones about evenly).
    workload = load_workload(workload="tenants", params={
        "n_tenants": 40, "n_requests": 40, "rate_per_s": 0.5, "system_blocks": 8})
    fleet = fleet_profiles(2, "qwen-32b-h200", slow="1:3")
    report, rows = run(workload, "prefix_affinity", 2, RoutingSettings(), fleet=fleet)
    assert report["fleet"] == "1 x qwen-32b-h200 + 1 x qwen-32b-h200/3"
    assert len(rows) == 40
    slow = [r for r in rows if r["oracle"] == "r1"]
    assert len(slow) < 10 and all(r["oracle_cached"] > 0 for r in slow)
    with pytest.raises(SystemExit) as exc:
        main(["--workload", "tenants", "--replicas", "3", "--fleet", "qwen-32b-h200:2"])
    assert exc.value.code == 2  # the fleet spec's count disagrees with --replicas


def test_the_oracle_held_to_an_imbalance_cap_keeps_it_and_says_what_it_costs() -> None:
    from backends.sim.fleet_spec import fleet_profiles
    from loadtests.experiments.balanced_oracle import compare

    # Cold 4k-token prompts on one replica at the 8B's speed and one at the 32B's (4x slower):
    # the plain oracle sends the slow one next to nothing, so its prefill time is all on the
    # fast one; held to 1.15 it must give the slow one its share of the time.
    workload = load_workload(workload="tenants", params={
        "n_tenants": 60, "n_requests": 60, "rate_per_s": 4, "system_blocks": 8})
    fleet = fleet_profiles(2, "qwen-32b-h200", fleet="llama-8b-h200:1,qwen-32b-h200:1")
    rows = {r["router"]: r for r in compare(workload, fleet, [1.15])}
    assert list(rows) == ["prefix_affinity", "oracle", "oracle, cap 1.15"]
    assert rows["oracle"]["prefill_time_imbalance"] > 1.5
    capped = rows["oracle, cap 1.15"]
    assert capped["prefill_time_imbalance"] <= 1.2
    assert capped["requests"] == 60
    assert capped["ttft_mean_s"] > rows["oracle"]["ttft_mean_s"]  # balance is not free here


def test_the_capped_oracle_runs_on_a_trace_file_over_a_fleet_given_on_the_command_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from loadtests.experiments.balanced_oracle import main as balanced_main

    # A held-out cell is a trace file, not a scoreboard scenario: the same comparison runs on
    # it over the fleet `simulate` would build (two replicas, the second three times slower).
    trace = tmp_path / "cell.jsonl"
    trace.write_text("".join(json.dumps({
        "timestamp": 400 * i, "input_length": 2048, "output_length": 8,
        "hash_ids": [1, 2, 100 + i]}) + "\n" for i in range(30)))
    assert balanced_main(["--trace", str(trace), "--replicas", "2", "--slow", "1:3",
                          "--caps", "1.15,1.3"]) == 0
    out = capsys.readouterr().out
    assert f"{trace}, 2 replicas, speedup 1" in out
    rows = [line.split("|")[1].strip() for line in out.splitlines()
            if line.startswith("| ") and not line.startswith("| router")]
    assert rows == ["prefix_affinity", "oracle", "oracle, cap 1.15", "oracle, cap 1.3"]
    cells = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
             for line in out.splitlines() if line.startswith("| ")}
    assert cells["oracle"][1] == "1.000"  # each run is against the plain oracle
    # The slow replica is there: the plain oracle leaves it idle (all prefill time on the
    # fast one), and held to 1.15 it pays for the balance. On two equal replicas the same
    # cap would make it faster (0.71x: the shared prefix piles every request on one).
    assert float(cells["oracle"][3]) > 1.5
    assert float(cells["oracle, cap 1.15"][3]) <= 1.15
    assert float(cells["oracle, cap 1.15"][1]) > 1.0
    # The profile is the simulator's too: the 8B's replicas answer sooner than the 32B's.
    balanced_main(["--trace", str(trace), "--replicas", "2", "--profile", "llama-8b-h200"])
    fast = capsys.readouterr().out
    oracle_s = [float(line.split("|")[2]) for text in (out, fast) for line in text.splitlines()
                if line.startswith("| oracle |")]
    assert oracle_s[1] < oracle_s[0]
    with pytest.raises(SystemExit) as exc:  # a trace has no seed to change
        balanced_main(["--trace", str(trace), "--seed", "3"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:  # one cell or the other, not both
        balanced_main(["--trace", str(trace), "--scenario", "mixed:multi_turn/8/light"])
    assert exc.value.code == 2


def test_a_slow_replica_gets_proportionally_less_prefill() -> None:
    from backends.sim.fleet_spec import fleet_profiles
    from gateway.config import RoutingSettings
    from loadtests.traces import TraceRequest

    # 600 distinct 2k-token prompts, 5 a second, over 4 replicas of which the last is three
    # times slower. Its queue priced at its own speed keeps it to less than a third of a fast
    # replica's prefill tokens, and the busy prefill time stays even (`own_speed_outliers:
    # false`). With each request's own prefill priced at its speed too (the default: it is
    # more than own_speed_spread off the pool's rate), an idle fast replica serves a cold
    # prompt sooner, so the slow one gets next to none, as the oracle gives it none, and the
    # mean TTFT is lower; the prefill time is no longer even at this light load.
    reqs = [TraceRequest(0.2 * i, 2048, 32, tuple(range(10 * i + 1, 10 * i + 5)), "")
            for i in range(600)]
    fleet = fleet_profiles(4, "qwen-32b-h200", slow="1:3")
    variants = {"defaults": {}, "queue only": {"own_speed_outliers": False},
                "pool rate": {"replica_speed": False}}
    runs = {name: simulate(Workload("cold", reqs), "prefix_affinity", fleet=fleet,
                           settings=RoutingSettings(**kw)) for name, kw in variants.items()}
    shares = {}
    for name, report in runs.items():
        *fast, slow = report["prefill_tokens_per_replica"]
        assert report["requests"] == 600
        assert report["fleet"] == "3 x qwen-32b-h200 + 1 x qwen-32b-h200/3"
        assert report["learned_prefill_tokens_per_s"][3] < 0.4 * min(
            report["learned_prefill_tokens_per_s"][:3])
        shares[name] = slow / (sum(fast) / 3)
    assert shares["queue only"] < 0.3
    assert runs["queue only"]["prefill_time_imbalance"] <= 1.1
    assert shares["pool rate"] > 0.35  # the pool's rate alone lets it take more
    assert shares["defaults"] < 0.05, shares
    assert runs["defaults"]["ttft_mean_s"] < runs["queue only"]["ttft_mean_s"]


def test_prefill_time_imbalance_is_tokens_over_each_replica_rate() -> None:
    from loadtests.stats import prefill_seconds

    assert prefill_seconds([9000.0, 3000.0], [9000.0, 3000.0]) == [1.0, 1.0]


def test_cli_takes_a_fleet(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--workload", "tenants", "--workload-param", "n_requests=40",
                 "--fleet", "llama-8b-h200:1,qwen-32b-h200:1", "--json"]) == 0
    out = capsys.readouterr().out
    assert "2 replicas (1 x llama-8b-h200 + 1 x qwen-32b-h200)" in out
    assert '"prefill_time_imbalance"' in out
    with pytest.raises(SystemExit):
        main(["--workload", "tenants", "--replicas", "3", "--fleet", "llama-8b-h200:2"])


def test_views_carry_the_engines_last_scraped_queue_and_kv_usage() -> None:
    """As the gateway scrapes /metrics every few seconds, a policy sees the engine's queue
    and KV usage as of the last scrape: nothing before the first one, then values that only
    change at scrape times; with no scraping, never anything."""
    from backends.sim.profiles import PROFILES
    from loadtests.simulate import make_policy, run_pool

    workload = load_workload(workload="tenants", params={
        "n_tenants": 60, "n_requests": 300, "rate_per_s": 40})
    start = workload.requests[0].timestamp_s

    def seen(interval: float | None) -> list[tuple[float, list[tuple[int, float | None]]]]:
        got: list[tuple[float, list[tuple[int, float | None]]]] = []

        def factory(name, settings, engines, overrides):  # type: ignore[no-untyped-def]
            policy = make_policy(name, settings, engines, overrides)
            choose = policy.choose

            def recording(request, views, lookup):  # type: ignore[no-untyped-def]
                got.append((views[0].engine_waiting, [(v.engine_waiting, v.kv_usage)
                                                      for v in views]))
                return choose(request, views, lookup)

            policy.choose = recording  # type: ignore[method-assign]
            return policy

        run_pool(workload, "least_load", profiles=[PROFILES["qwen-32b-h200"]] * 2,
                 kv_capacity_tokens=64_000, policy_factory=factory,
                 metrics_interval_s=interval)
        return [(workload.requests[i].timestamp_s - start, views)
                for i, (_, views) in enumerate(got)]

    scraped = seen(2.0)
    assert all(v == (0, None) for t, views in scraped if t <= 2.0 for v in views)
    after = [(t, views) for t, views in scraped if t > 2.0]
    assert after and all(kv is not None and 0.0 < kv <= 1.0 for _, views in after
                         for _, kv in views)
    assert any(w > 0 for _, views in after for w, _ in views)  # the small caches fill
    # Constant between scrapes: all views within one 2 s period agree.
    by_period: dict[int, set[str]] = {}
    for t, views in after:
        by_period.setdefault(int(t // 2.0), set()).add(repr(views))
    assert all(len(v) == 1 for v in by_period.values())
    assert len({repr(views) for _, views in after}) > 1
    assert all(v == (0, None) for _, views in seen(None) for v in views)


# -- several gateways (loadtests/sim_sharing.py) ---------------------------------------------


def test_agreement_figures_count_spills_among_the_warm_misses() -> None:
    from loadtests.traces import BLOCK_TOKENS, TraceRequest, agreement_figures

    # A tenant's context on a, spilled once to b for load, then balanced between the two (as
    # one gateway does), then sent cold to c by a gateway that did not know it.
    chains = [(1, 2, 3), (1, 2, 4), (1, 2, 5), (1, 2, 6), (1, 2, 7), (1, 2, 8)]
    reqs = [TraceRequest(i / 10, len(c) * BLOCK_TOKENS, 4, c) for i, c in enumerate(chains)]
    served = ["a", "a", "b", "a", "b", "c"]
    reasons = ["cold", "affinity", "overflow", "affinity", "affinity", "cold"]
    got = agreement_figures(reqs, served, reasons)
    # Warm: requests 1-5. Homes of (1, 2): a, then b after the spill; c is no home.
    assert got["agreement"] == pytest.approx(3 / 5)
    assert got["warm_requests"] == 5
    # By the last server: only request 1 (a after a) agrees.
    assert got["agreement_last"] == pytest.approx(1 / 5)
    assert got["warm_miss_reasons"] == {"affinity+held": 2, "cold+new": 1, "overflow+new": 1}
    assert got["spills"] == 1


def test_one_gateway_reports_its_agreement_and_ignores_sharing(tenants: Workload) -> None:
    from loadtests.sim_sharing import Sharing

    one = simulate(tenants, "prefix_affinity", replicas=4)
    assert one["gateways"] == 1
    assert 0.5 < one["agreement"] <= 1.0
    assert one["warm_requests"] > 50
    assert "sharing" not in one
    # One gateway has nobody to share with: its report is the same whatever the settings.
    assert simulate(tenants, "prefix_affinity", replicas=4, gateways=1,
                    sharing=Sharing(True, 0.5, 2.0, 1.0)) == one


def test_gateways_sharing_at_once_agree_as_one_and_without_sharing_far_less(
        tenants: Workload) -> None:
    from loadtests.sim_sharing import Sharing

    one = simulate(tenants, "prefix_affinity", replicas=4)
    at_once = simulate(tenants, "prefix_affinity", replicas=4, gateways=3,
                       sharing=Sharing(True, 0.0, 0.0, 0.0))
    apart = simulate(tenants, "prefix_affinity", replicas=4, gateways=3,
                     sharing=Sharing(enabled=False))
    assert at_once["gateways"] == apart["gateways"] == 3
    assert apart["sharing"] == "off"
    assert at_once["agreement"] > apart["agreement"] + 0.2
    assert at_once["agreement"] == pytest.approx(one["agreement"], abs=0.03)
    assert at_once["hit_ratio"] > apart["hit_ratio"]


def test_shadow_agreement_counts_warm_requests_served_where_the_shadow_would_send_them(
) -> None:
    from loadtests.traces import BLOCK_TOKENS, TraceRequest, shadow_agreement

    chains = [(1, 2), (1, 3), (4, 5), (1, 6), (4, 7), (4, 8)]
    reqs = [TraceRequest(i / 10, len(c) * BLOCK_TOKENS, 4, c) for i, c in enumerate(chains)]
    served = ["a", "a", "b", None, "c", "b"]
    picks = ["a", "a", "b", "a", "b", "b"]
    # Warm: 1 (agrees), 4 (c, not b) and 5 (agrees); 3 failed, 0 and 2 are cold.
    assert shadow_agreement(reqs, served, picks) == {
        "shadow_agreement": pytest.approx(2 / 3), "shadow_warm_requests": 3}


def test_shadow_match_agreement_also_counts_a_replica_holding_as_much_of_the_prompt() -> None:
    from loadtests.traces import BLOCK_TOKENS, TraceRequest, shadow_agreement

    chains = [(1, 2), (1, 3), (1, 4), (1, 5), (1, 6)]
    reqs = [TraceRequest(i / 10, len(c) * BLOCK_TOKENS, 4, c) for i, c in enumerate(chains)]
    served = ["a", "b", "c", "a", "d"]
    picks = ["a", "a", "a", "a", "a"]
    # (blocks held on the pick, on the replica that served it), in the shadow's index.
    matched = [(0, 0), (3, 3), (3, 1), (2, 2), (2, 4)]
    # Warm: 1 (b holds as much as a), 2 (c holds less), 3 (agrees), 4 (d holds more).
    assert shadow_agreement(reqs, served, picks, matched) == {
        "shadow_agreement": pytest.approx(1 / 4), "shadow_warm_requests": 4,
        "shadow_match_agreement": pytest.approx(3 / 4)}
    with pytest.raises(ValueError, match="matched"):
        shadow_agreement(reqs, served, picks, matched[:-1])


def test_shadow_held_agreement_counts_only_warm_requests_some_replica_still_holds() -> None:
    from loadtests.traces import BLOCK_TOKENS, TraceRequest, shadow_agreement

    chains = [(1, 2), (1, 3), (1, 4), (1, 5), (1, 6)]
    reqs = [TraceRequest(i / 10, len(c) * BLOCK_TOKENS, 4, c) for i, c in enumerate(chains)]
    served = ["a", "b", "c", "a", "d"]
    picks = ["a", "b", "a", "a", "a"]
    # The most blocks of each that any replica held in the shadow's index when it was asked:
    # 2 and 4 came before by the trace but were cached nowhere by then.
    held = [0, 3, 0, 2, 0]
    got = shadow_agreement(reqs, served, picks, held=held)
    assert got["shadow_agreement"] == pytest.approx(2 / 4)
    assert (got["shadow_held_agreement"], got["shadow_held_requests"]) == (1.0, 2)
    # Nothing held anywhere: no figure rather than a made-up one.
    none = shadow_agreement(reqs, served, picks, held=[0] * 5)
    assert (none["shadow_held_agreement"], none["shadow_held_requests"]) == (None, 0)
    with pytest.raises(ValueError, match="held"):
        shadow_agreement(reqs, served, picks, held=held[:-1])


def test_the_simulators_table_shows_the_shadows_figures_when_a_run_has_them() -> None:
    from loadtests.simulate import format_table

    workload = load_workload(workload="multi_turn", params={"n_sessions": 20,
                                                            "rate_per_s": 8})
    one = simulate(workload, "prefix_affinity", replicas=2)
    three = simulate(workload, "prefix_affinity", replicas=2, gateways=3)
    assert "shadow held" not in format_table([one])
    header, row = format_table([three]).splitlines()[:2]
    assert header.split()[-6:] == ["shadow", "agr.", "shadow", "match", "shadow", "held"]
    assert row.split()[-1] == f"{three['shadow_held_agreement']:.3f}"
    # Runs with and without a shadow in one table: "-" where a run has none.
    assert format_table([one, three]).splitlines()[1].split()[-3:] == ["-", "-", "-"]


def test_the_shadow_of_one_gateway_picks_what_it_picked() -> None:
    from backends.sim.profiles import PROFILES
    from loadtests.simulate import run_pool
    from loadtests.traces import agreement_figures, shadow_agreement

    # Small caches: the gateway's index evicts, so the agreement figure counts misses. (With
    # pin_running the index lends room to the deep queue this rate builds and evicts little.)
    workload = load_workload(workload="tenants", params={
        "n_tenants": 60, "n_requests": 300, "rate_per_s": 40})
    run = run_pool(workload, "prefix_affinity", profiles=[PROFILES["qwen-32b-h200"]] * 4,
                   kv_capacity_tokens=64_000, shadow=True,
                   settings=settings_for("prefix_affinity", {"pin_running": False}))
    served = [run.names[i] if i >= 0 else None for i in run.replica_of]
    assert run.shadow is not None
    assert all(s is not None for s in served)
    # The same computation on the same state: every request, not only the warm ones.
    assert run.shadow.picks == served
    got = shadow_agreement(workload.requests, served, run.shadow.picks, run.shadow.matched,
                           run.shadow.held)
    assert got["shadow_agreement"] == got["shadow_match_agreement"] == 1.0
    assert got["shadow_held_agreement"] == 1.0
    assert all(m is not None and m[0] == m[1] for m in run.shadow.matched)
    # What the shadow held is at least what its pick held, and with these small caches some
    # warm requests were held nowhere when they came.
    assert all(h is not None and m is not None and h >= m[0]
               for h, m in zip(run.shadow.held, run.shadow.matched, strict=True))
    assert 0 < got["shadow_held_requests"] < got["shadow_warm_requests"]
    figures = agreement_figures(workload.requests, served, run.reasons)
    assert got["shadow_warm_requests"] == figures["warm_requests"] > 100
    assert figures["agreement"] < 0.9
    # One gateway's report leaves the shadow out (it would say 1.0).
    assert "shadow_agreement" not in simulate(workload, "prefix_affinity", replicas=4,
                                              kv_capacity_tokens=64_000)


def test_gateways_not_sharing_pick_what_one_gateway_would_far_less_often(
        tenants: Workload) -> None:
    from loadtests.sim_sharing import Sharing

    shared = simulate(tenants, "prefix_affinity", replicas=4, gateways=3)
    apart = simulate(tenants, "prefix_affinity", replicas=4, gateways=3,
                     sharing=Sharing(enabled=False))
    assert shared["shadow_warm_requests"] > 50
    assert apart["shadow_warm_requests"] > 50
    assert shared["shadow_agreement"] > 0.9
    assert apart["shadow_agreement"] < shared["shadow_agreement"] - 0.2
    # A replica holding as much of the prompt counts too: never less than the exact figure.
    assert shared["shadow_match_agreement"] >= shared["shadow_agreement"]
    assert apart["shadow_match_agreement"] < shared["shadow_match_agreement"] - 0.2


def _two_gateways(flush_s: float, load_s: float):
    from loadtests.sim_sharing import Gateways, Sharing
    from routing import build_policy

    routers = [Router(["r0", "r1"], build_policy("prefix_affinity", {}), block_chars=4)
               for _ in range(2)]
    return routers, Gateways(routers, Sharing(True, flush_s, load_s, 0.0))


def test_inserts_reach_the_other_gateway_at_most_once_per_flush_interval() -> None:
    routers, gws = _two_gateways(0.025, 0.05)
    a, b = routers
    first, second = [11, 12], [21, 22]
    gws.now = 0.0
    a.record("r0", first, 2.0)
    # An idle writer writes at once, and a blocked reader reads at once.
    gws.run_until(0.0)
    assert b.matched_blocks("r0", first) == 2
    gws.now = 0.01
    a.record("r1", second, 2.0)
    # The writer sleeps flush_interval_s after a write, and so does the reader after a read.
    gws.run_until(0.024)
    assert b.matched_blocks("r1", second) == 0
    gws.run_until(0.025)
    assert b.matched_blocks("r1", second) == 2
    assert a.matched_blocks("r1", [31]) == 0  # nothing comes back to the writer


def test_the_simulated_gateways_pin_each_others_running_requests_as_the_real_ones_do() -> None:
    """What `--gateways N --set pin_running=true` measures: each gateway's held inserts
    reach the others pinned, with room for their output, and the request's end releases
    them with the next write."""
    from loadtests.sim_sharing import Gateways, Sharing
    from routing import build_policy
    from routing.types import ReplicaView

    routers = [Router(["r0", "r1"], build_policy("prefix_affinity", {}), block_chars=4,
                      pin_running=True) for _ in range(2)]
    gws = Gateways(routers, Sharing(True, 0.025, 0.05, 0.0))
    a, b = routers
    request = a.request_from_text("a long enough prompt")
    request.output_tokens = 5 * request.block_tokens
    gws.now = 0.0
    decision = a.route(request, [ReplicaView(name="r1")])
    gws.run_until(0.0)
    assert b.remote_pins("0") == 1
    assert b.indexes["r1"].pinned_blocks == len(request.hashes)
    assert b.indexes["r1"].reserved == 5
    gws.now = 0.03
    a.finished(decision, False)
    gws.run_until(0.049)  # not woken by a release: it waits for the next look at the load
    assert b.remote_pins() == 1
    gws.run_until(0.05)
    assert b.remote_pins() == 0 and b.indexes["r1"].pinned_blocks == 0
    assert b.indexes["r1"].reserved == 0


def test_load_is_published_as_the_gateway_encodes_it_when_looked_at() -> None:
    from gateway.shared_routing import encode_load
    from routing.types import Decision

    routers, gws = _two_gateways(0.025, 0.05)
    a, b = routers
    gws.run_until(0.0)  # the first look at the load: nothing in flight
    a.dispatched(Decision("r0", "cold", 0, 1, 300.0), 0.001)
    gws.run_until(0.049)
    assert b.load.remote == {}
    gws.run_until(0.05)  # the next look sees it changed and writes it
    # In flight, pending, left to compute, first tokens seen, when the oldest was sent,
    # passed through and not yet prefilled, streamed awaiting a first token.
    assert encode_load(a) == b'{"r0":[1,300.0,300.0,0,0.001,0,1]}'
    assert b.load.remote == {"r0": (1, 300.0, 300.0, 0, 0.001, 0, 1)}
    assert b.load.view("r0").inflight == 1


def test_a_busy_gateways_decision_reaches_the_others_within_10_ms_by_default() -> None:
    from loadtests.sim_sharing import Gateways, Sharing
    from routing import build_policy

    # Decisions another gateway has not read yet are ones it may pile onto the same replica:
    # at the default flush interval, a decision made just after a write (the writer sleeping)
    # is read by the others within 10 ms of it (25 ms before).
    routers = [Router(["r0", "r1"], build_policy("prefix_affinity", {}), block_chars=4)
               for _ in range(2)]
    gws = Gateways(routers, Sharing())
    a, b = routers
    gws.now = 0.0
    a.record("r0", [11, 12], 2.0)
    gws.run_until(0.0)
    gws.now = 0.001
    a.record("r1", [21, 22], 2.0)
    gws.run_until(0.011)
    assert b.matched_blocks("r1", [21, 22]) == 2


def test_three_gateways_near_saturation_route_about_as_well_as_one() -> None:
    # Tenants at 18 requests/s on 8 replicas: near saturation. Each gateway learned the
    # engines' prefill rate from steps that also carried the other gateways' prefills, and
    # three gateways' mean TTFT was 6.6x one gateway's (24.8 s against 3.8 s). Now a step
    # with another gateway's requests on the replica teaches no rate.
    workload = load_workload(workload="tenants", params={
        "n_tenants": 300, "n_requests": 1500, "rate_per_s": 18})
    one = simulate(workload, "prefix_affinity", replicas=8)
    three = simulate(workload, "prefix_affinity", replicas=8, gateways=3)
    assert one["ttft_mean_s"] > 1.0  # near saturation: queues matter
    assert three["ttft_mean_s"] < 1.25 * one["ttft_mean_s"]
    assert three["shadow_agreement"] > 0.9


def _two_sharing_gateways(names: list[str]) -> tuple[Gateways, list[Router]]:
    """Two gateways' routers over `names`, sharing as through Redis (the simulator's)."""
    from loadtests.sim_sharing import Gateways, Sharing
    from routing import build_policy

    routers = [Router(names, build_policy("prefix_affinity", {}), block_chars=4)
               for _ in range(2)]
    return Gateways(routers, Sharing(True, 0.01, 0.05, 0.0)), routers


def test_gateways_share_what_they_learned_of_each_replicas_rate() -> None:
    from tests.test_routing import feed_replica

    # Gateway a has timed r2's steps three times as long as r0's and r1's; b has seen none
    # of them. Once a's writer looks at what it learned, b prices r2 as a does.
    gws, (a, b) = _two_sharing_gateways(["r0", "r1", "r2"])
    feed_replica(a.load, "r0", 20, 0.05, 0.05)
    feed_replica(a.load, "r1", 20, 0.05, 0.05)
    feed_replica(a.load, "r2", 20, 0.15, 0.15)
    assert a.load.view("r2").speed == pytest.approx(1 / 3, rel=0.02)
    assert b.load.view("r2").speed == 1.0
    gws.now = 0.0
    gws.run_until(0.06)
    assert b.load.steps.replica_rate("r2") == pytest.approx(a.load.steps.replica_rate("r2"),
                                                            rel=1e-4)
    assert b.load.view("r2").speed == pytest.approx(1 / 3, rel=0.02)
    assert b.load.view("r0").speed == 1.0
    # What b learns itself counts with a's: equal samples of a rate twice as high, and b's
    # figure is the mean of the two.
    feed_replica(b.load, "r2", 20, 0.15, 0.075)
    assert b.load.steps.replica_rate("r2") == pytest.approx(
        2 * 20 * 1000 / (20 * 0.15 + 20 * 0.075), rel=0.02)


def test_gateways_share_what_they_learned_of_the_pools_prefill_rate() -> None:
    from routing.steps import POOL_RATE_KEY, RATE_MIN_SAMPLES
    from tests.test_routing import feed_replica

    # Under load every step of every replica holds other gateways' requests, and a gateway
    # learns the pool's rate only from the few that hold none: three gateways on Mooncake at
    # 8 replicas learned 0-2 samples each in 23 minutes, so none drained a queue or priced a
    # step's wait, where one gateway does both. Here each of two has too few samples to use
    # the rate; shared, they have enough.
    gws, routers = _two_sharing_gateways(["r0", "r1"])
    a, b = routers
    feed_replica(a.load, "r0", 12, 0.05, 0.05)
    feed_replica(b.load, "r1", 12, 0.05, 0.05)
    assert a.load.steps.rate == b.load.steps.rate == 0.0
    assert a.own_rates()[POOL_RATE_KEY][2] < RATE_MIN_SAMPLES
    gws.now = 0.0
    gws.run_until(0.06)
    for router in routers:
        assert router.load.steps.rate == pytest.approx(20_000.0, rel=0.02)
        # The pool's entry is not taken for a replica's.
        assert set(router.load.steps.replica_rates()) == {"r0", "r1"}


def test_three_gateways_on_a_mixed_fleet_each_learn_the_slow_replicas() -> None:
    # Half the replicas at the 32B model's speed: three gateways each see a third of the
    # steps, and every step there holds the others' decoding requests. Learning nothing from
    # those steps, or alone, they learned almost no speeds, and their mean TTFT was 1.55x one
    # gateway's on multi-turn sessions at light load.
    from backends.sim.fleet_spec import parse_fleet
    from loadtests.simulate import run_pool

    workload = load_workload(workload="multi_turn", params={"n_sessions": 60,
                                                            "rate_per_s": 8})
    profiles = [p.build() for p in parse_fleet("llama-8b-h200:2,qwen-32b-h200:2")]
    run = run_pool(workload, "prefix_affinity", profiles=profiles, gateways=3)
    for router in run.routers:
        speeds = [router.load.view(name).speed for name in run.names]
        assert min(speeds[:2]) > 3 * max(speeds[2:]), speeds


def test_the_scoreboard_compares_two_settings_when_asked_for_an_after(capsys) -> None:
    from loadtests.scoreboard import SCENARIOS
    from loadtests.scoreboard import main as scoreboard

    with pytest.raises(SystemExit) as exc:
        scoreboard(["--after", "pin_running=true"])
    assert exc.value.code == 2
    assert "--after goes with --compare" in capsys.readouterr().err
    # One small cell, the same setting before and after: the two runs agree only if the after
    # run takes it (at the defaults, tie_tokens=512, this cell's mean differs), and the
    # heading says which settings and how to run it again.
    assert scoreboard(["--only", "slow:multi_turn", "--set", "tuning",
                       "--compare", "tie_tokens=0", "--after", "tie_tokens=0",
                       "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert "before (tie_tokens=0) and after (tie_tokens=0)" in out
    assert "--compare tie_tokens=0 --after tie_tokens=0`" in out
    rows = [line.split("|") for line in out.splitlines()
            if line.startswith("| tuning | multi_turn on the slow fleet |")]
    assert len(rows) == 1
    before_s, after_s = rows[0][5].strip(), rows[0][6].strip()
    assert before_s == after_s
    sc = next(sc for sc in SCENARIOS if sc.key == "slow:multi_turn" and not sc.held_out)
    defaults = simulate(load_workload(None, sc.workload, speedup=sc.speedup,
                                      params=dict(sc.params)),
                        "prefix_affinity", replicas=sc.replicas,
                        fleet=sc.profiles())["ttft_mean_s"]
    assert f"{defaults:.3f}" != after_s


def test_the_scoreboard_sweeps_variants_against_the_oracle(capsys) -> None:
    from loadtests.scoreboard import SCENARIOS
    from loadtests.scoreboard import main as scoreboard

    with pytest.raises(SystemExit) as exc:
        scoreboard(["--sweep"])
    assert exc.value.code == 2
    assert "--sweep needs at least one --variant" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        scoreboard(["--sweep", "--variant", "load_factor=4", "--variant", "load_factor=4"])
    assert exc.value.code == 2
    assert "each --variant once" in capsys.readouterr().err
    assert scoreboard(["--only", "slow:multi_turn", "--set", "tuning", "--sweep",
                       "--variant", "defaults", "--variant", "load_factor=4",
                       "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert ("`python -m loadtests.scoreboard --sweep --only slow:multi_turn --set tuning "
            "--variant defaults --variant load_factor=4`") in out
    row = next(line.split("|") for line in out.splitlines()
               if line.startswith("| tuning | multi_turn on the slow fleet |"))
    oracle_s = float(row[5])
    sc = next(sc for sc in SCENARIOS if sc.key == "slow:multi_turn" and not sc.held_out)
    workload = load_workload(None, sc.workload, speedup=sc.speedup, params=dict(sc.params))
    defaults = simulate(workload, "prefix_affinity", replicas=sc.replicas, fleet=sc.profiles())
    oracle = simulate(workload, "oracle", replicas=sc.replicas, fleet=sc.profiles())
    assert f"{oracle['ttft_mean_s']:.3f}" == f"{oracle_s:.3f}"
    # Each variant's cell is its own run: the defaults' ratio is the defaults', and the
    # other variant's differs from it.
    expected = f"{defaults['ttft_mean_s'] / oracle['ttft_mean_s']:.3f}"
    assert row[6].split()[0] == expected
    assert row[7].split()[0] != expected
    summary = [line.split("|") for line in out.splitlines()
               if line.startswith(("| defaults | tuning |", "| load_factor=4 | tuning |"))]
    assert [cells[3].strip() for cells in summary] == ["1", "1"]


def test_the_scoreboard_runs_on_engines_that_allocate_as_vllm_does(
        capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--vllm-engines` reaches every run, in the worker processes too: a run given the
    vLLM-like engines reports here ten times its mean (on this light cell the two engines
    agree, so the real figures alone could not tell)."""
    import loadtests.scoreboard as scoreboard_module
    from loadtests.scoreboard import SCENARIOS
    from loadtests.scoreboard import main as scoreboard

    real = scoreboard_module.simulate

    def marked(*args: Any, **kwargs: Any) -> dict[str, Any]:
        report = real(*args, **kwargs)
        if kwargs.get("engine_lazy_kv") and kwargs.get("engine_caches_outputs"):
            report["ttft_mean_s"] *= 10
        return report

    monkeypatch.setattr(scoreboard_module, "simulate", marked)
    assert scoreboard(["--only", "slow:multi_turn", "--set", "tuning", "--sweep",
                       "--vllm-engines", "--variant", "defaults", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert "`python -m loadtests.scoreboard --sweep --only slow:multi_turn --set tuning " \
        "--vllm-engines --variant defaults`" in out
    row = next(line.split("|") for line in out.splitlines()
               if line.startswith("| tuning | multi_turn on the slow fleet |"))
    sc = next(sc for sc in SCENARIOS if sc.key == "slow:multi_turn" and not sc.held_out)
    workload = load_workload(None, sc.workload, speedup=sc.speedup, params=dict(sc.params))
    oracle = real(workload, "oracle", replicas=sc.replicas, fleet=sc.profiles(),
                  engine_lazy_kv=True, engine_caches_outputs=True)
    assert f"{oracle['ttft_mean_s'] * 10:.3f}" == row[5].strip()
    # Without the flag the runs that follow are on the default engines again.
    assert scoreboard(["--only", "slow:multi_turn", "--set", "tuning", "--sweep",
                       "--variant", "defaults", "--jobs", "1"]) == 0
    row = next(line.split("|") for line in capsys.readouterr().out.splitlines()
               if line.startswith("| tuning | multi_turn on the slow fleet |"))
    plain = real(workload, "oracle", replicas=sc.replicas, fleet=sc.profiles())
    assert f"{plain['ttft_mean_s']:.3f}" == row[5].strip()


def test_with_nothing_streamed_a_slow_replica_is_known_from_its_engines_metrics() -> None:
    from backends.sim.fleet_spec import fleet_profiles
    from gateway.config import RoutingSettings
    from loadtests.traces import TraceRequest

    # The same cold prompts and fleet, but every request passed through whole: the gateway
    # times no engine step. From its engines' prefill counters it still prices the slow
    # replica's queue at its speed; without them (engine_speed off) the replicas are equal.
    reqs = [TraceRequest(0.2 * i, 2048, 32, tuple(range(10 * i + 1, 10 * i + 5)), "")
            for i in range(600)]
    fleet = fleet_profiles(4, "qwen-32b-h200", slow="1:3")

    def shares_and_runs(reads_s: float) -> tuple[dict[bool, float], dict[bool, dict]]:
        runs = {on: simulate(Workload("cold", reqs), "prefix_affinity", fleet=fleet,
                             settings=RoutingSettings(engine_speed=on), stream_share=0.0,
                             passed_through_interval_s=reads_s)
                for on in (True, False)}
        shares = {}
        for on, report in runs.items():
            *fast, slow = report["prefill_tokens_per_replica"]
            assert report["requests"] == 600
            assert report["learned_prefill_tokens_per_s"] == [0, 0, 0, 0]  # nothing timed
            shares[on] = slow / (sum(fast) / 3)
        return shares, runs

    # With the engines' counts read at the scrapes alone: priced at its speed, it gets no
    # more than its due (a third of a fast one's tokens); priced as equal, more (0.42).
    shares, runs = shares_and_runs(0.0)
    assert shares[True] < 1 / 3 < shares[False]
    assert runs[True]["ttft_mean_s"] < runs[False]["ttft_mean_s"]
    # Read every second (the default), its passed-through requests leave its queue sooner
    # and it looks free more often: it gets past its due (0.41, near the engine's speed for
    # it, 0.44, which compresses the true 0.33), but far less than priced as equal (0.59).
    shares, runs = shares_and_runs(1.0)
    assert shares[True] < 0.5 < shares[False]
    assert runs[True]["ttft_mean_s"] < runs[False]["ttft_mean_s"]


def test_engines_that_cache_outputs_keep_them_and_the_index_can_count_them(
        tenants: Workload) -> None:
    from backends.sim.profiles import PROFILES
    from loadtests.simulate import run_pool

    def kept_outputs(engine_keeps: bool, index_counts: bool) -> tuple[int, int]:
        """Output blocks resident in the engines, and in the routers' indexes, at the end."""
        run = run_pool(tenants, "prefix_affinity", profiles=[PROFILES["qwen-32b-h200"]] * 2,
                       settings=settings_for("prefix_affinity",
                                             {"output_cached": index_counts}),
                       engine_caches_outputs=engine_keeps)
        in_engines = sum(h < 0 for e in run.engines for h in e.cache.hashes())
        in_indexes = sum(h < 0 for index in run.router.indexes.values()
                         for h in index._blocks)
        return in_engines, in_indexes

    assert kept_outputs(False, False) == (0, 0)
    engines, indexes = kept_outputs(True, True)
    assert engines > 0 and indexes > 0
    engines, indexes = kept_outputs(True, False)
    assert engines > 0 and indexes == 0


def test_simulated_gateways_sharing_routing_state_keep_each_others_outputs(
        tenants: Workload) -> None:
    """Two simulated gateways: with shared state each one's index keeps the outputs of the
    other's requests as well as its own (the releases carry them), so each holds about what
    both generated; without sharing, each only its own half."""
    from backends.sim.profiles import PROFILES
    from loadtests.sim_sharing import Sharing
    from loadtests.simulate import run_pool

    def kept_outputs(shared: bool) -> list[int]:
        run = run_pool(tenants, "prefix_affinity", profiles=[PROFILES["qwen-32b-h200"]] * 2,
                       settings=settings_for("prefix_affinity", {"output_cached": True}),
                       engine_caches_outputs=True, gateways=2,
                       sharing=Sharing(enabled=shared))
        return [sum(h < 0 for index in router.indexes.values() for h in index._blocks)
                for router in run.routers]

    own_only = kept_outputs(False)
    assert min(own_only) > 0
    assert min(kept_outputs(True)) > 1.5 * max(own_only)


def test_engines_with_lazy_kv_preempt_under_pressure_and_serve_every_request() -> None:
    """`--engine-lazy-kv`: engines that take KV as tokens need it (vLLM) admit more at once
    and preempt when decoding fills their cache; every request is still served, and the
    gateway counts half of each max_tokens as it does for vLLM."""
    from backends.sim.profiles import PROFILES
    from loadtests.simulate import run_pool, simulate

    tenants = load_workload(workload="tenants", limit=200,
                            params={"output_tokens": 2_000, "rate_per_s": 40})

    def run(lazy: bool) -> tuple[int, float]:
        pool = run_pool(tenants, "prefix_affinity", profiles=[PROFILES["qwen-32b-h200"]] * 2,
                        kv_capacity_tokens=64_000, max_output=2_000, engine_lazy_kv=lazy)
        assert all(r >= 0 for r in pool.replica_of)
        return sum(e.preemptions for e in pool.engines), pool.router.output_reserve

    assert run(False) == (0, 1.0)
    preempted, reserve = run(True)
    assert preempted > 0 and reserve == 0.5
    report = simulate(tenants, "prefix_affinity", replicas=2, kv_capacity_tokens=64_000,
                      max_output=2_000, engine_lazy_kv=True)
    assert report["errors"] == 0 and report["engine_preemptions"] > 0
