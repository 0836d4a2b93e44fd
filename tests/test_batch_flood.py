"""Pure parts of loadtests.batch_flood: the workload, the gateways' configurations, the
windows, the targets and the table (no process, no timing)."""

from __future__ import annotations

import itertools

import orjson
import pytest

from gateway.config import parse_config
from loadtests import batch_flood as bf
from loadtests.batch_flood import ALONE, BORROW, ISOLATED, ONE_POOL, Sent
from routing.hashing import char_block_hashes

WL = bf.Workload(batch_lines=300, batch_prompts=3, batch_system_tokens=500,
                 batch_user_tokens=40, realtime_prompts=4, realtime_system_tokens=300)


def test_filler_is_deterministic_sized_in_tokens_and_starts_with_its_head() -> None:
    text = bf.filler(5, 250, "Head:")
    assert text == bf.filler(5, 250, "Head:")
    assert text.startswith("Head: ")
    assert len(text.encode()) == 1000  # 4 bytes a token, as the simulated engine counts
    assert bf.filler(6, 250, "Head:") != text


def test_system_prompts_differ_from_their_first_hashed_block() -> None:
    prompts = bf.system_prompts("batch", 5, 600, seed=0)
    assert prompts == bf.system_prompts("batch", 5, 600, seed=0)
    firsts = {char_block_hashes(p, 256)[0] for p in prompts}
    assert len(firsts) == 5
    assert prompts != bf.system_prompts("realtime", 5, 600, seed=0)


def test_batch_lines_are_openai_lines_sharing_few_prompts_in_mixed_order() -> None:
    prompts = bf.system_prompts("batch", WL.batch_prompts, WL.batch_system_tokens, WL.seed)
    lines = bf.batch_lines(WL, prompts)
    assert lines == bf.batch_lines(WL, prompts)
    assert len(lines) == 300
    assert len({line["custom_id"] for line in lines}) == 300
    systems = [line["body"]["messages"][0]["content"] for line in lines]
    assert set(systems) == set(prompts)
    # Interleaved, not grouped: many changes of prompt from one line to the next.
    changes = sum(1 for a, b in itertools.pairwise(systems) if a != b)
    assert changes > 100
    docs = [line["body"]["messages"][1]["content"] for line in lines]
    assert len(set(docs)) == 300
    for line in lines[:5]:
        assert line["method"] == "POST" and line["url"] == "/v1/chat/completions"
        assert line["body"]["max_tokens"] == WL.batch_max_tokens
    data = bf.to_jsonl(lines)
    assert data.endswith(b"\n") and data.count(b"\n") == 300
    assert [orjson.loads(x) for x in data.splitlines()] == lines


def test_realtime_requests_share_system_prompts_and_ask_their_own_question() -> None:
    prompts = bf.system_prompts("realtime", 4, 300, 0)
    msgs = [bf.realtime_messages(WL, prompts, i) for i in range(200)]
    assert msgs[7] == bf.realtime_messages(WL, prompts, 7)
    assert {m[0]["content"] for m in msgs} == set(prompts)
    assert len({m[1]["content"] for m in msgs}) == 200


def test_arrivals_increase_at_the_asked_mean_rate() -> None:
    times = list(itertools.islice(bf.arrivals(5.0, seed=3), 5000))
    assert all(b > a for a, b in itertools.pairwise(times))
    assert times[-1] / len(times) == pytest.approx(1 / 5.0, rel=0.05)
    assert times[:10] == list(itertools.islice(bf.arrivals(5.0, seed=3), 10))


RT = ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
BT = ["http://127.0.0.1:9101"]


@pytest.mark.parametrize("scenario", [ISOLATED, BORROW, ONE_POOL])
def test_every_scenario_configuration_is_valid_for_the_gateway(scenario: str) -> None:
    cfg = bf.scenario_config(scenario, RT, BT, 8080, "redis://127.0.0.1:6390/0",
                             bf.Admission())
    parse_config(cfg, f"<{scenario}>")


def test_scenario_configurations_differ_where_the_rows_do() -> None:
    adm = bf.Admission(realtime_per_replica=8, batch_per_replica=24, borrow_below=0.3)
    iso = bf.scenario_config(ISOLATED, RT, BT, 8080, None, adm)
    bor = bf.scenario_config(BORROW, RT, BT, 8080, None, adm)
    one = bf.scenario_config(ONE_POOL, RT, BT, 8080, None, adm)
    assert "redis" not in iso
    assert [p["name"] for p in iso["pools"]] == ["realtime", "batch"]
    assert [r["url"] for r in iso["pools"][0]["replicas"]] == RT
    assert iso["pools"][1]["max_inflight_per_replica"] == 24
    classes = {c["name"]: c for c in iso["traffic_classes"]}
    assert "borrow" not in classes["batch"]["admission"]
    bclasses = {c["name"]: c for c in bor["traffic_classes"]}
    assert bclasses["batch"]["admission"]["borrow"] == [{"pool": "realtime",
                                                         "while_below": 0.3}]
    # Apart from borrowing, the two admission gateways are the same.
    bclasses["batch"]["admission"].pop("borrow")
    assert bor == iso
    assert [p["name"] for p in one["pools"]] == ["shared"]
    assert [r["url"] for r in one["pools"][0]["replicas"]] == RT + BT
    assert "max_inflight_per_replica" not in one["pools"][0]
    assert all("admission" not in c and c["pool"] == "shared"
               for c in one["traffic_classes"])
    with pytest.raises(ValueError):
        bf.scenario_config(ALONE, RT, BT, 8080, None, adm)


def test_realtime_summary_counts_only_its_window() -> None:
    sent = [Sent(0.5, 0.010, 200), Sent(1.0, 0.020, 200), Sent(1.5, 0.040, 200),
            Sent(2.0, None, 429), Sent(2.5, None, 0, "ReadError"), Sent(3.0, 0.9, 200)]
    s = bf.realtime_summary(bf.in_window(sent, 1.0, 3.0), 2.0)
    assert s["realtime_sent"] == 4 and s["realtime_ok"] == 2
    assert s["realtime_rejected"] == 1 and s["realtime_errors"] == 1
    assert s["ttft_p50_s"] == pytest.approx(0.030)
    assert s["ttft_p99_s"] == pytest.approx(0.0398)
    assert s["window_s"] == 2.0
    empty = bf.realtime_summary(bf.in_window(sent, 10.0, 11.0), 1.0)
    assert empty["ttft_p99_s"] is None and empty["realtime_sent"] == 0


def _rows(alone: float, borrow: float, one: float, t_iso: float,
          t_bor: float) -> dict[str, dict]:
    def rt(p99: float) -> dict:
        return {"realtime_sent": 100, "realtime_rejected": 0, "realtime_errors": 0,
                "ttft_p50_s": p99 / 2, "ttft_p99_s": p99}

    def batch(t: float) -> dict:
        return {"batch_duration_s": t, "batch_ok": 2000, "batch_lines_sent": 2000,
                "batch_hit_ratio": 0.9, "batch_on_realtime_replicas": 0.25}

    return {ALONE: rt(alone), ISOLATED: {**rt(alone), **batch(t_iso)},
            BORROW: {**rt(borrow), **batch(t_bor)}, ONE_POOL: {**rt(one), **batch(50.0)}}


def test_targets_met_and_not_met() -> None:
    t = bf.targets(_rows(0.100, 0.115, 0.400, 120.0, 90.0))
    assert t["borrow_p99_over_alone"] == pytest.approx(1.15)
    assert t["one_pool_p99_over_alone"] == pytest.approx(4.0)
    assert t["borrow_p99_met"] and t["borrow_faster_met"] and t["one_pool_hurts_met"]
    assert t["isolated_p99_over_alone"] == pytest.approx(1.0)
    assert t["borrow_p99_over_isolated"] == pytest.approx(1.15)
    t = bf.targets(_rows(0.100, 0.130, 0.110, 120.0, 130.0))
    assert t["borrow_p99_met"] is False and t["borrow_faster_met"] is False
    assert t["one_pool_hurts_met"] is False
    partial = bf.targets({ALONE: _rows(0.1, 0.1, 0.1, 1, 1)[ALONE]})
    assert partial["borrow_p99_met"] is None and partial["borrow_faster_met"] is None


def test_table_has_a_row_per_measured_scenario_in_order() -> None:
    rows = _rows(0.100, 0.115, 0.400, 120.0, 90.0)
    header, cells = bf.table_rows({k: rows[k] for k in (ONE_POOL, ALONE, BORROW)})
    assert [c[0] for c in cells] == [bf.ROW_LABELS[k] for k in (ALONE, BORROW, ONE_POOL)]
    col = {name: i for i, name in enumerate(header)}
    alone, borrow = cells[0], cells[1]
    assert alone[col["TTFT p99 ms"]] == "100" and alone[col["batch s"]] == "-"
    assert borrow[col["TTFT p99 ms"]] == "115" and borrow[col["batch s"]] == "90.0"
    assert borrow[col["batch lines ok"]] == "2000/2000"
    assert borrow[col["batch on realtime replicas"]] == "25.0%"
    lines = bf.summary_lines(rows)
    assert lines[0].startswith("(b) realtime p99 / (0) realtime p99 = 1.15x")
    assert "met" in lines[0] and "NOT" not in lines[0]
    assert "4.00x" in lines[2]
    assert "(a) / (0) = 1.00x" in lines[3] and "(b) / (a) = 1.15x" in lines[3]


def test_share_of_batch_requests_on_realtime_replicas() -> None:
    counts = {("realtime-0", "batch"): 30.0, ("batch-0", "batch"): 90.0,
              ("realtime-0", "realtime"): 500.0}
    assert bf.share_on_realtime_replicas(counts) == pytest.approx(0.25)
    assert bf.share_on_realtime_replicas({("realtime-0", "realtime"): 5.0}) is None


def test_smoke_scales_down_and_explicit_options_win() -> None:
    opts = bf.options_from_args(bf.build_parser().parse_args(["--smoke"]))
    assert opts.wl.batch_lines == 200 and opts.alone_s < 60
    opts = bf.options_from_args(bf.build_parser().parse_args(["--smoke", "--batch-lines",
                                                              "500"]))
    assert opts.wl.batch_lines == 500
    full = bf.options_from_args(bf.build_parser().parse_args([]))
    assert full.wl.batch_lines == 2000


def test_a_failed_row_shows_as_failed_and_its_targets_as_not_measured() -> None:
    rows = _rows(0.100, 0.115, 0.400, 120.0, 90.0)
    rows[BORROW] = {"failed": "RuntimeError: gateway borrow did not become ready"}
    header, cells = bf.table_rows(rows)
    borrow = next(c for c in cells if c[0] == bf.ROW_LABELS[BORROW])
    assert borrow[1] == "failed" and len(borrow) == len(header)
    t = bf.targets(rows)
    assert t["borrow_p99_met"] is None and t["borrow_faster_met"] is None
    assert t["one_pool_hurts_met"] is True
