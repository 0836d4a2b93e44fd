"""Trace loading: Mooncake rows made whole, malformed rows named, Azure CSVs without prefixes."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path

import pytest

from backends.sim.prompt import estimate_tokens
from loadtests.experiments.stress_trace import main as write_stress_trace
from loadtests.experiments.stress_trace import stress_trace
from loadtests.experiments.workload_trace import main as write_workload_trace
from loadtests.traces import (
    BLOCK_TOKENS,
    TraceRequest,
    agreement,
    conversation_workload,
    home_agreement,
    ideal_hit_ratio,
    load_trace,
    prompt_text,
    rag_workload,
    stress_workload,
    swing_rate,
    swing_workload,
    warm_misses,
)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_mooncake_rows_with_too_few_ids_get_unshared_blocks(tmp_path: Path) -> None:
    trace = write_jsonl(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 1200, "output_length": 5, "hash_ids": [7]},
        {"timestamp": 5, "input_length": 1200, "output_length": 5, "hash_ids": [7]},
        {"timestamp": 9, "input_length": 300, "output_length": 5, "hash_ids": []},
        {"timestamp": 12, "input_length": 100, "output_length": 5, "hash_ids": [7, 8, 9]},
    ])
    reqs = load_trace(trace)
    # Every prompt has its stated length in tokens, whatever its ids covered.
    assert [estimate_tokens(prompt_text(r)) for r in reqs] == [1200, 1200, 300, 100]
    assert [len(r.hash_ids) for r in reqs] == [3, 3, 1, 1]
    # The shared first block is still shared; the padding of two rows is not.
    assert reqs[0].hash_ids[0] == reqs[1].hash_ids[0] == 7
    assert not set(reqs[0].hash_ids[1:]) & set(reqs[1].hash_ids[1:])
    # Hits: the second row's first block, and the last row's only (100-token) block.
    assert ideal_hit_ratio(reqs) == pytest.approx((BLOCK_TOKENS + 100) / (1200 + 1200 + 300 + 100))


def test_malformed_mooncake_row_is_named_by_line(tmp_path: Path) -> None:
    trace = write_jsonl(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [1]},
        {"timestamp": 1, "output_length": 5, "hash_ids": [1]},
    ])
    with pytest.raises(ValueError, match=r"t\.jsonl:2: missing field 'input_length'"):
        load_trace(trace)


def test_azure_csv_has_relative_times_and_nothing_shared(tmp_path: Path) -> None:
    trace = tmp_path / "azure.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     "2023-11-16 18:17:03.9799600,4808,10\n"
                     "2023-11-16 18:17:04.0319600,3180,8\n"
                     "2023-11-16 18:17:05.0000000,4808,1\n")
    reqs = load_trace(trace)
    assert [r.timestamp_s for r in reqs] == pytest.approx([0.0, 0.052, 1.02004])
    assert [r.input_tokens for r in reqs] == [4808, 3180, 4808]
    assert [estimate_tokens(prompt_text(r)) for r in reqs] == [4808, 3180, 4808]
    assert ideal_hit_ratio(reqs) == 0.0  # equal lengths, yet no prefix in common


def test_azure_csv_with_a_missing_column_is_a_clear_error(tmp_path: Path) -> None:
    trace = tmp_path / "azure.csv"
    trace.write_text("TIMESTAMP,ContextTokens\n2023-11-16 18:17:03.9799600,4808\n")
    with pytest.raises(ValueError, match=r"azure\.csv:2: missing column 'GeneratedTokens'"):
        load_trace(trace)


def test_stress_trace_has_the_asked_shape_and_valid_prefix_chains(tmp_path: Path) -> None:
    out = tmp_path / "stress.jsonl"
    assert write_stress_trace(["--requests", "2000", "--rate", "5", "--input-mean", "4000",
                               "--output-mean", "100", "--reuse", "0.5", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2000
    # Mooncake's format: ms timestamps in order, one id per started 512-token block.
    assert all(a["timestamp"] <= b["timestamp"] for a, b in itertools.pairwise(rows))
    assert all(len(r["hash_ids"]) == -(-r["input_length"] // BLOCK_TOKENS) for r in rows)
    # Chained: an id always follows the same predecessor, so equal ids mean equal prefixes.
    parent: dict[int, int | None] = {}
    for r in rows:
        for prev, h in zip([None, *r["hash_ids"]], r["hash_ids"], strict=False):
            assert parent.setdefault(h, prev) == prev
    # The asked shape, within sampling error: 2,000 arrivals at 5/s, the means, half reused.
    assert rows[-1]["timestamp"] / 1000 == pytest.approx(2000 / 5, rel=0.1)
    assert sum(r["input_length"] for r in rows) / 2000 == pytest.approx(4000, rel=0.15)
    assert sum(r["output_length"] for r in rows) / 2000 == pytest.approx(100, rel=0.1)
    # --reuse 0.5: about half the requests after the first start with an earlier prompt's head.
    heads_seen: set[int] = set()
    extending = 0
    for r in rows:
        extending += r["hash_ids"][0] in heads_seen
        heads_seen.update(r["hash_ids"])
    assert extending / 1999 == pytest.approx(0.5, abs=0.05)
    reqs = load_trace(out)
    assert 0.1 < ideal_hit_ratio(reqs) < 0.6


def blocks_trace(*chains: tuple[int, ...]) -> list[TraceRequest]:
    """Requests 0.1 s apart with these block ids (full blocks)."""
    return [TraceRequest(i / 10, len(c) * BLOCK_TOKENS, 4, c) for i, c in enumerate(chains)]


# A hand-made trace, its replicas, and each request's home by the definition: the replica of
# the most recent earlier request sharing its longest prefix.
HAND_TRACE = blocks_trace((1, 2, 3), (1, 2, 4), (1, 2, 4, 5), (1, 2, 3, 6), (1, 2), (7, 8),
                          (7, 9))
HAND_REPLICAS = ["r0", "r0", "r1", "r0", "r1", "r1", "r1"]
# 0 cold; 1 home r0 (shares 1,2 with 0): agrees; 2 home r0 (1,2,4 with 1): not; 3 home r0
# (1,2,3 with 0, longer than 1,2 with the more recent 2): agrees; 4 home r0 (1,2 with all;
# the most recent is 3): not; 5 cold; 6 home r1 (7 with 5): agrees. 3 of 5 warm agree.
HAND_AGREEMENT = (3 / 5, 5)


def test_home_agreement_counts_a_spill_as_a_second_home_and_no_other_copy() -> None:
    # Without reasons nothing spills: on the hand trace the homes are each prefix's first
    # replica and those that agreed, and the same 3 of 5 agree.
    assert home_agreement(HAND_TRACE, HAND_REPLICAS) == HAND_AGREEMENT
    tenant = blocks_trace((1, 2, 3), (1, 2, 4), (1, 2, 5), (1, 2, 6), (1, 2, 7), (1, 2, 8))
    # A tenant's context on a, spilled once to b for load; its later requests go to a or b,
    # as one gateway balancing between the two holders would: all but the spill agree. By
    # the most recent server, going back to a counts as a miss.
    served = ["a", "a", "b", "a", "b", "a"]
    reasons = ["cold", "affinity", "overflow", "affinity", "affinity", "affinity"]
    assert home_agreement(tenant, served, reasons) == (4 / 5, 5)
    assert agreement(tenant, served) == (1 / 5, 5)
    # The same second copy made otherwise (a gateway that did not know the prefix, sending
    # it cold elsewhere, then keeping it there) is no home: each request sent there misses.
    own = ["cold", "affinity", "cold", "affinity", "affinity", "affinity"]
    assert home_agreement(tenant, served, own) == (3 / 5, 5)
    # Failed requests are nobody's home and not counted.
    assert home_agreement(tenant, ["a", None, "b", "a", None, "b"], reasons) == (2 / 3, 3)


def test_warm_misses_say_why_a_warm_request_left_its_home() -> None:
    tenant = blocks_trace((1, 2, 3), (1, 2, 4), (1, 2, 5), (1, 2, 6))
    served = ["a", "b", "a", "c"]
    assert warm_misses(tenant, served, [None, "overflow", "affinity", "cold"]) == {
        "affinity+held": 1, "cold+new": 1, "overflow+new": 1}


def test_agreement_follows_the_longest_then_the_most_recent_shared_prefix() -> None:
    assert agreement(HAND_TRACE, HAND_REPLICAS) == HAND_AGREEMENT
    # Every request on one replica agrees always; alternating two never does after a cold one.
    assert agreement(HAND_TRACE, ["r0"] * 7) == (1.0, 5)
    assert agreement(blocks_trace((1, 2), (1, 3), (1, 4), (1, 5)),
                     ["a", "b", "a", "b"]) == (0.0, 3)


def test_agreement_skips_failed_requests_and_compares_whole_prefixes() -> None:
    # Request 1 failed (no replica): not counted, and not the home of request 2, whose
    # longest answered prefix is (7, 9) with request 0.
    reqs = blocks_trace((7, 9), (7, 9, 10), (7, 9, 10, 11))
    assert agreement(reqs, ["r1", None, "r0"]) == (0.0, 1)
    # Answered, request 1 is request 2's home (it moved away from request 0's replica).
    assert agreement(reqs, ["r1", "r0", "r0"]) == (0.5, 2)
    # The same id after a different first block is another prefix: request 1 is cold.
    assert agreement(blocks_trace((5, 1), (6, 1)), ["r0", "r0"]) == (None, 0)
    # Nothing warm (every Azure request is like this): no figure rather than 0 or 1.
    assert agreement(blocks_trace((1,), (2,)), ["r0", "r1"]) == (None, 0)
    with pytest.raises(ValueError, match="2 requests but 1 replicas"):
        agreement(blocks_trace((1,), (2,)), ["r0"])


@pytest.mark.parametrize(("t", "rate"), [(0.0, 4.0), (119.9, 4.0), (120.0, 16.0), (239.9, 16.0),
                                         (240.0, 4.0), (400.0, 16.0)])
def test_swing_rate_switches_every_half_period(t: float, rate: float) -> None:
    assert swing_rate(t, 4.0, 16.0, 240.0) == rate


def test_swing_workload_follows_its_rate_schedule() -> None:
    reqs = swing_workload(low_rate_per_s=2.0, high_rate_per_s=20.0, period_s=100.0,
                          duration_s=400.0, n_tenants=10)
    assert all(0.0 <= r.timestamp_s < 400.0 for r in reqs)
    assert all(a.timestamp_s <= b.timestamp_s for a, b in itertools.pairwise(reqs))
    per_half = Counter(int(r.timestamp_s // 50) for r in reqs)
    # Poisson counts in each 50 s half: about 100 light, 1,000 heavy (seeded, so exact here).
    for half in range(8):
        expected = 50 * (2.0 if half % 2 == 0 else 20.0)
        assert per_half[half] == pytest.approx(expected, rel=0.3)


def test_conversation_turns_extend_the_previous_turn() -> None:
    reqs = conversation_workload(n_sessions=30, turns_mean=3.0)
    by_session: dict[str, list] = {}
    for r in reqs:
        by_session.setdefault(r.session, []).append(r)
    assert len(by_session) == 30
    assert any(len(turns) > 1 for turns in by_session.values())
    for turns in by_session.values():
        turns.sort(key=lambda r: r.timestamp_s)
        for a, b in itertools.pairwise(turns):
            assert b.hash_ids[: len(a.hash_ids)] == a.hash_ids
            assert len(b.hash_ids) > len(a.hash_ids)
    assert all(r.input_tokens == len(r.hash_ids) * BLOCK_TOKENS for r in reqs)


def test_conversations_may_start_from_shared_prefixes_and_are_otherwise_the_same() -> None:
    plain = conversation_workload(n_sessions=60, turns_mean=3.0, seed=8)
    shared = conversation_workload(n_sessions=60, turns_mean=3.0, seed=8, shared_prefixes=3,
                                   shared_tokens=2048.0)
    assert len(shared) == len(plain)
    # Every session opens with one of three 4-block prefixes.
    assert len({r.hash_ids[:4] for r in shared}) == 3
    # Behind the prefix, the same sessions: times, outputs and lengths.
    for a, b in zip(plain, shared, strict=True):
        assert (b.timestamp_s, b.output_tokens, len(b.hash_ids)) == (
            a.timestamp_s, a.output_tokens, len(a.hash_ids) + 4)
    assert len({r.hash_ids[4] for r in shared}) == len({r.hash_ids[0] for r in plain}) == 60


def test_shared_prefixes_are_chosen_with_weight_one_over_k() -> None:
    # With weights 1, 1/2, 1/3 the shares are 6/11, 3/11 and 2/11 (0.55, 0.27, 0.18); chosen
    # alike they would be a third each. 600 sessions tell them apart by far more than chance.
    reqs = conversation_workload(n_sessions=600, turns_mean=1.5, seed=8, shared_prefixes=3,
                                 shared_tokens=512.0)
    first_of = {r.session: r.hash_ids[0] for r in reqs}
    shares = sorted((Counter(first_of.values())[p] / 600 for p in set(first_of.values())),
                    reverse=True)
    assert [round(x, 1) for x in shares] == [0.5, 0.3, 0.2], shares


def test_rag_prompts_share_only_their_leading_documents() -> None:
    reqs = rag_workload(n_requests=400, n_docs=20, doc_tokens_mean=2048.0, docs_max=3, seed=5)
    assert len(reqs) == 400
    assert all(r.input_tokens == len(r.hash_ids) * BLOCK_TOKENS for r in reqs)
    assert all(b.timestamp_s > a.timestamp_s for a, b in itertools.pairwise(reqs))
    # Chained ids: a block id stands for its whole prefix, so equal ids mean equal prefixes.
    # Two prompts that share a block share every block before it.
    first_seen: dict[int, tuple[int, ...]] = {}
    for r in reqs:
        for n, h in enumerate(r.hash_ids):
            prefix = r.hash_ids[: n + 1]
            assert first_seen.setdefault(h, prefix) == prefix
    # Popular documents lead many prompts; the question behind them is always fresh.
    leading = Counter(r.hash_ids[0] for r in reqs)
    assert leading.most_common(1)[0][1] >= 40
    assert len({r.hash_ids[-1] for r in reqs}) == 400


def test_rag_documents_behind_another_are_not_a_prefix_of_their_own() -> None:
    # One document of one block each, always two per prompt: a document second in a prompt
    # has other ids than the same document first, as its KV depends on what precedes it.
    reqs = rag_workload(n_requests=300, n_docs=3, doc_tokens_mean=100.0, docs_max=2,
                        question_tokens_mean=100.0, seed=2)
    two = [r for r in reqs if len(r.hash_ids) == 3]
    assert two
    firsts = {r.hash_ids[0] for r in reqs}
    assert not firsts & {r.hash_ids[1] for r in two}


def test_stress_workload_is_the_stress_trace() -> None:
    reqs = stress_workload(n_requests=50, rate_per_s=2.0, input_mean=3000.0, seed=4)
    rows = stress_trace(50, 2.0, 3000.0, 343.0, 0.5, seed=4)
    assert [(r.timestamp_s, r.input_tokens, r.hash_ids) for r in reqs] == [
        (row["timestamp"] / 1000, row["input_length"], tuple(row["hash_ids"])) for row in rows]


def test_a_workload_written_as_a_trace_reads_back_without_its_sessions(tmp_path: Path) -> None:
    out = tmp_path / "agent.jsonl"
    params = ["n_sessions=20", "turns_mean=5", "think_time_s=15", "seed=3"]
    argv = ["--workload", "conversation", "--out", str(out)]
    for p in params:
        argv += ["--workload-param", p]
    assert write_workload_trace(argv) == 0
    built = conversation_workload(n_sessions=20, turns_mean=5.0, think_time_s=15.0, seed=3)
    read = load_trace(out)
    # The same requests in the same order, to the millisecond, and nothing that names a
    # session: a router replaying the file sees what an unseen trace would give it.
    assert [(round(r.timestamp_s * 1000), r.input_tokens, r.output_tokens, r.hash_ids)
            for r in built] == [(round(r.timestamp_s * 1000), r.input_tokens, r.output_tokens,
                                 r.hash_ids) for r in read]
    assert {r.session for r in built} != {""}
    assert {r.session for r in read} == {""}
    assert "session" not in out.read_text()
