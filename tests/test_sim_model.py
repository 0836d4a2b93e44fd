"""The simulated engine's pure model: prefix cache, scheduling, latency and counters."""

from __future__ import annotations

import random

import pytest

from backends.sim.engine import EngineModel, Event
from backends.sim.kv_cache import PrefixCache
from backends.sim.profiles import PROFILES
from routing.hashing import chain_hashes

BT = 16


def _hashes(prefix: str, blocks: int) -> list[int]:
    return chain_hashes([f"{prefix}:{i}".encode() for i in range(blocks)])


def _run(engine: EngineModel, until: float | None = None) -> list[Event]:
    """Advance step by step until idle (or `until`), collecting every event."""
    events: list[Event] = []
    while (t := engine.next_event_time()) is not None and (until is None or t <= until):
        events.extend(engine.advance(t))
    return events


def _drive(engine: EngineModel, rng: random.Random, *, requests: int, rate: float,
           prefixes: int, prefix_blocks: tuple[int, int],
           max_tokens: int) -> tuple[list[Event], int]:
    """Poisson arrivals of requests r0, r1, ...: one of `prefixes` shared prefixes plus up to
    ten blocks of their own, each asking for 1 to `max_tokens` tokens; run until idle. The
    events, and the tokens the engine granted in all."""
    shared = [_hashes(f"sys{i}", rng.randint(*prefix_blocks)) for i in range(prefixes)]
    now, granted = 0.0, 0
    events: list[Event] = []
    for i in range(requests):
        now += rng.expovariate(rate)
        events += _run(engine, until=now)
        events += engine.advance(now)
        hashes = rng.choice(shared) + _hashes(f"u{i}", rng.randint(0, 10))
        granted += engine.submit(f"r{i}", hashes, len(hashes) * BT + 3,
                                 rng.randint(1, max_tokens), now)
    return events + _run(engine), granted


def _first(events: list[Event], req_id: str) -> Event:
    return next(e for e in events if e.kind == "first_token" and e.req_id == req_id)


def _ttft(events: list[Event], req_id: str, arrival: float) -> float:
    return _first(events, req_id).time - arrival


def test_cached_prefix_gives_lower_ttft_than_uncached() -> None:
    engine = EngineModel(PROFILES["qwen-32b-h200"], 100_000, BT)
    shared = _hashes("system", 256)  # 4,096 tokens
    engine.submit("cold", shared + _hashes("a", 8), 264 * BT + 5, 4, now=0.0)
    events = _run(engine)
    t1 = events[-1].time + 1.0
    engine.submit("warm", shared + _hashes("b", 8), 264 * BT + 5, 4, now=t1)
    events += _run(engine)
    cold, warm = _first(events, "cold"), _first(events, "warm")
    assert cold.cached_tokens == 0
    assert warm.cached_tokens == 256 * BT
    assert _ttft(events, "warm", t1) < _ttft(events, "cold", 0.0) / 4


def test_profiles_match_their_calibration_points() -> None:
    qwen, llama = PROFILES["qwen-32b-h200"], PROFILES["llama-8b-h200"]
    # The qwen-32b-h200 profile was fitted to: a cached 16k prefix + 512 new tokens takes 0.16 s ...
    assert qwen.ttft_s(16_384 + 512, 16_384) == pytest.approx(0.162, rel=0.05)
    # ... against 2.1 s cold, and 8k tokens prefill at about 8.3k (32B) / 32k (8B) tokens/s.
    assert qwen.ttft_s(16_384) == pytest.approx(2.114, rel=0.05)
    assert 8192 / qwen.ttft_s(8192) == pytest.approx(8_300, rel=0.05)
    assert 8192 / llama.ttft_s(8192) == pytest.approx(32_000, rel=0.05)
    for batch, ms in ((8, 54), (32, 94), (64, 156)):
        assert (qwen.step_overhead_s + qwen.decode_s(batch)) * 1000 == pytest.approx(ms, rel=0.1)
    tiny = PROFILES["vllm-cpu-tiny"]
    assert tiny.ttft_s(2400) == pytest.approx(0.209, rel=0.05)
    assert tiny.ttft_s(2400 + 8, 2400) == pytest.approx(0.050, rel=0.1)


def test_time_scale_multiplies_durations() -> None:
    ttfts = []
    for scale in (1.0, 0.01):
        engine = EngineModel(PROFILES["llama-8b-h200"], 100_000, BT, time_scale=scale)
        engine.submit("r", _hashes("p", 100), 1_600, 2, now=10.0)
        ttfts.append(_ttft(_run(engine), "r", 10.0))
    assert ttfts[1] == pytest.approx(ttfts[0] * 0.01)


def test_lru_evicts_least_recent_blocks_beyond_capacity() -> None:
    cache = PrefixCache(capacity_blocks=6, block_tokens=BT)
    a, b, c = _hashes("a", 3), _hashes("b", 3), _hashes("c", 3)
    cache.insert(a)
    cache.insert(b)
    assert cache.match(a) == 3  # touching a makes b the least recently used
    cache.insert(c)
    assert cache.resident_blocks == 6
    assert cache.match(a, touch=False) == 3
    assert cache.match(c, touch=False) == 3
    assert cache.match(b, touch=False) == 0
    assert cache.evicted_blocks == 3


def test_match_stops_at_first_missing_block() -> None:
    cache = PrefixCache(capacity_blocks=2, block_tokens=BT)
    chain = _hashes("x", 3)
    cache.insert(chain)  # only two fit: the head is kept, the tail goes first
    assert cache.match(chain) == 2
    cache.clear()
    cache.insert(chain[1:])
    assert cache.match(chain) == 0


def test_pinned_blocks_survive_eviction() -> None:
    cache = PrefixCache(capacity_blocks=4, block_tokens=BT)
    a = _hashes("a", 2)
    cache.insert(a)
    cache.acquire(a)
    cache.insert(_hashes("b", 4))
    assert cache.match(a, touch=False) == 2
    assert cache.resident_blocks == 4
    cache.release(a)
    cache.insert(_hashes("c", 4))
    assert cache.match(a, touch=False) == 0


def test_queueing_raises_ttft_under_concurrency() -> None:
    engine = EngineModel(PROFILES["llama-8b-h200"], 1_000_000, BT, max_running=2)
    for i in range(6):
        engine.submit(f"r{i}", _hashes(f"p{i}", 64), 64 * BT, 32, now=0.0)
    # The first submit started a step alone; the rest join at the next step boundary.
    assert (engine.num_running, engine.num_waiting) == (1, 5)
    events = _run(engine, until=engine.next_event_time())
    assert (engine.num_running, engine.num_waiting) == (2, 4)
    events += _run(engine)
    ttfts = [_ttft(events, f"r{i}", 0.0) for i in range(6)]
    assert ttfts[0] < ttfts[2] < ttfts[4]
    assert engine.stats().request_success == 6


def test_prefill_time_runs_from_scheduling_to_first_token() -> None:
    engine = EngineModel(PROFILES["llama-8b-h200"], 1_000_000, BT, max_running=2)
    for i in range(6):
        engine.submit(f"r{i}", _hashes(f"p{i}", 64), 64 * BT, 8, now=0.0)
    events = _run(engine)
    hs = engine.histograms
    s = engine.stats()
    # Arrival to first token splits into waiting then prefill; queueing must not leak in.
    ttft_sum = sum(_ttft(events, f"r{i}", 0.0) for i in range(6))
    assert hs["queue_time"].sum > 0
    assert s.prefill_time_sum == pytest.approx(ttft_sum - hs["queue_time"].sum)
    assert s.prefill_time_count == hs["prefill_time"].count == 6
    assert s.prefill_time_sum == hs["prefill_time"].sum < ttft_sum


def test_chunked_prefill_budget_queues_prefill_within_a_step() -> None:
    engine = EngineModel(PROFILES["qwen-32b-h200"], 1_000_000, BT, max_batched_tokens=2048)
    engine.submit("long", _hashes("l", 512), 512 * BT, 2, now=0.0)
    engine.submit("short", _hashes("s", 4), 4 * BT, 2, now=0.0)
    events = _run(engine)
    # 8,192 tokens at 2,048 per step: four steps before "long" has its first token.
    assert _first(events, "long").time < _first(events, "short").time
    assert engine.stats().iterations >= 5


def test_counters_are_in_tokens() -> None:
    engine = EngineModel(PROFILES["llama-8b-h200"], 100_000, BT)
    shared = _hashes("sys", 10)
    engine.submit("a", shared + _hashes("a", 2), 12 * BT + 3, 5, now=0.0)
    _run(engine)
    engine.submit("b", shared + _hashes("b", 2), 12 * BT + 7, 7, now=100.0)
    _run(engine)
    s = engine.stats()
    assert s.prefix_cache_query_tokens == (12 * BT + 3) + (12 * BT + 7)
    assert s.prefix_cache_hit_tokens == 10 * BT
    assert s.prompt_tokens == s.prefix_cache_query_tokens
    assert s.generation_tokens == 12
    assert s.request_success == 2
    assert s.ttft_count == 2
    assert sum(s.ttft_bucket_counts) == 2
    assert s.running == s.waiting == 0
    assert s.kv_usage == 0.0


def test_full_prompt_hit_still_computes_the_last_token() -> None:
    engine = EngineModel(PROFILES["llama-8b-h200"], 100_000, BT)
    h = _hashes("same", 8)
    engine.submit("a", h, 8 * BT, 1, now=0.0)
    _run(engine)
    engine.submit("b", h, 8 * BT, 1, now=10.0)
    events = _run(engine)
    assert _first(events, "b").cached_tokens == 7 * BT


def test_an_engine_that_caches_outputs_keeps_them_before_older_prompts_and_after_its_own(
) -> None:
    # 40 blocks: an old prompt of 10, a request of 20 prompt blocks and 8 of output, then
    # one that needs 9 (8 of prompt and its one output token's).
    def after_one_request(cache_outputs: bool) -> EngineModel:
        engine = EngineModel(PROFILES["llama-8b-h200"], 40 * BT, BT, cache_outputs=cache_outputs)
        engine.submit("old", _hashes("old", 10), 10 * BT, 1, now=0.0)
        _run(engine)
        engine.submit("a", _hashes("a", 20), 20 * BT, 8 * BT, now=10.0)
        _run(engine)
        engine.submit("b", _hashes("b", 8), 8 * BT, 1, now=20.0)
        _run(engine)
        return engine

    freed = after_one_request(False)
    assert freed.cache.match(_hashes("old", 10), touch=False) == 10
    kept = after_one_request(True)
    # The output's 8 blocks stayed, 2 blocks were left free, so the newer prompt pushed out 7
    # blocks of the oldest one, tail first; the request's own prompt is whole.
    assert kept.cache.match(_hashes("old", 10), touch=False) == 3
    assert kept.cache.match(_hashes("a", 20), touch=False) == 20
    assert kept.cache.resident_blocks == 39  # its output's 8 among them


def test_kv_capacity_holds_requests_back_until_blocks_free() -> None:
    engine = EngineModel(PROFILES["llama-8b-h200"], 40 * BT, BT)
    engine.submit("a", _hashes("a", 20), 20 * BT, 10 * BT, now=0.0)
    engine.submit("b", _hashes("b", 20), 20 * BT, 10 * BT, now=0.0)
    assert (engine.num_running, engine.num_waiting) == (1, 1)
    assert engine.stats().kv_usage == pytest.approx(30 / 40)
    events = _run(engine)
    finished_a = next(e for e in events if e.kind == "finished" and e.req_id == "a")
    assert _first(events, "b").time > finished_a.time


def test_prompt_longer_than_the_cache_is_refused() -> None:
    engine = EngineModel(PROFILES["llama-8b-h200"], 10 * BT, BT)
    with pytest.raises(ValueError, match="does not fit"):
        engine.submit("big", [], 10 * BT, 1, now=0.0)


def test_idle_engine_has_no_events() -> None:
    engine = EngineModel(PROFILES["vllm-cpu-tiny"], 10_000, BT)
    assert engine.next_event_time() is None
    assert engine.advance(1e9) == []


def test_token_events_stream_every_token_once() -> None:
    engine = EngineModel(PROFILES["vllm-cpu-tiny"], 100_000, BT, token_events=True)
    for i, n in enumerate((1, 5, 9)):
        engine.submit(f"r{i}", _hashes(f"r{i}", 4), 4 * BT, n, now=0.0)
    events = _run(engine)
    for i, n in enumerate((1, 5, 9)):
        got = sum(e.tokens for e in events if e.req_id == f"r{i}" and e.kind != "finished")
        fin = [e for e in events if e.req_id == f"r{i}" and e.kind == "finished"]
        assert got == n
        assert fin[0].tokens == n and fin[0].finish_reason == "length"


def test_abort_releases_kv_and_slot() -> None:
    engine = EngineModel(PROFILES["llama-8b-h200"], 100_000, BT, max_running=1)
    engine.submit("a", _hashes("a", 10), 10 * BT, 1000, now=0.0)
    engine.submit("b", _hashes("b", 10), 10 * BT, 2, now=0.0)
    t = engine.next_event_time()
    assert t is not None
    engine.advance(t)
    assert engine.abort("a")
    assert not engine.abort("a")
    events = _run(engine)
    assert [e.req_id for e in events if e.kind == "finished"] == ["b"]
    s = engine.stats()
    assert s.request_aborted == 1 and s.used_blocks == 0


def test_iteration_log_records_steps() -> None:
    engine = EngineModel(PROFILES["vllm-cpu-tiny"], 100_000, 32, iteration_log=10)
    engine.submit("a", _hashes("a", 4), 4 * 32, 3, now=0.0)
    _run(engine)
    recs = list(engine.iterations)
    assert [r.iter for r in recs] == [1, 2, 3]
    assert recs[0].num_context_requests == 1 and recs[0].num_ctx_tokens == 128
    assert recs[-1].num_completed == 1
    assert recs[0].missed_blocks == 4


def test_many_requests_conserve_tokens_and_blocks() -> None:
    """A busy engine under KV pressure: everything finishes and every block comes back."""
    engine = EngineModel(PROFILES["qwen-32b-h200"], 3_000 * BT, BT, max_running=32)
    events, expected_gen = _drive(engine, random.Random(7), requests=600, rate=30.0,
                                  prefixes=12, prefix_blocks=(20, 200), max_tokens=64)
    finished = {e.req_id for e in events if e.kind == "finished"}
    assert finished == {f"r{i}" for i in range(600)}
    s = engine.stats()
    assert s.generation_tokens == expected_gen
    assert s.request_success == 600
    assert s.used_blocks == 0 and s.running == s.waiting == 0
    assert s.pending_prefill_tokens == 0
    assert 0 < s.prefix_cache_hit_tokens < s.prefix_cache_query_tokens
    assert engine.cache.evicted_blocks > 0
    assert s.resident_blocks <= s.capacity_blocks


def test_lazy_kv_admits_on_the_prompt_and_preempts_the_newest_when_blocks_run_out() -> None:
    """As vLLM: admission takes the prompt's blocks only, so both requests run at once where
    reserving their outputs admitted one (above); when decoding fills the cache the newest
    is preempted, computes its prompt and what it had generated again, and still finishes
    with every token it was granted, its first token reported once."""
    engine = EngineModel(PROFILES["llama-8b-h200"], 40 * BT, BT, lazy_kv=True,
                         token_events=True)
    engine.submit("a", _hashes("a", 18), 18 * BT, 10 * BT, now=0.0)
    engine.submit("b", _hashes("b", 18), 18 * BT, 10 * BT, now=0.0)
    t = engine.next_event_time()
    assert t is not None
    events = engine.advance(t)  # the step in flight ends; the next admits "b" too
    assert (engine.num_running, engine.num_waiting) == (2, 0)
    # The prompts' 36 blocks, and one for the first token "a" decodes (its prompt fills 18).
    assert engine.stats().used_blocks == 37
    events += _run(engine)
    assert engine.preemptions >= 1 and engine.stats().preemptions == engine.preemptions
    for rid in ("a", "b"):
        assert [e.kind for e in events if e.req_id == rid].count("first_token") == 1
        assert sum(e.tokens for e in events if e.req_id == rid and e.kind != "finished") \
            == 10 * BT
    # The older request ran through; the newer one waited for it to end before resuming.
    finished = [e.req_id for e in events if e.kind == "finished"]
    assert finished == ["a", "b"]
    s = engine.stats()
    assert s.used_blocks == 0 and s.running == s.waiting == 0 and s.pending_prefill_tokens == 0
    assert s.generation_tokens == 20 * BT
    # Its prompt's blocks stayed cached while it was preempted: its first admission's
    # lookups are counted once, as vLLM counts a preempted request's apart.
    assert s.prefix_cache_query_tokens == 36 * BT


def test_lazy_kv_preempted_during_its_prefill_still_reports_its_first_token() -> None:
    """A request preempted before its first token (its prefill chunked over many steps while
    an older one decodes into the last free block) computes its prompt again and then
    reports its first token, once, with its TTFT; it used to be taken for a resumed one and
    report none."""
    engine = EngineModel(PROFILES["llama-8b-h200"], 40 * BT, BT, lazy_kv=True,
                         token_events=True, max_batched_tokens=BT // 2 + 1)
    engine.submit("a", _hashes("a", 18), 18 * BT, 10 * BT, now=0.0)
    events: list[Event] = []
    while not events or events[-1].kind != "first_token":
        t = engine.next_event_time()
        assert t is not None
        events += engine.advance(t)
    engine.submit("b", _hashes("b", 20), 20 * BT, 4, now=events[-1].time)
    events += _run(engine)
    assert engine.preemptions == 1
    first = [e for e in events if e.kind == "first_token"]
    assert [e.req_id for e in first] == ["a", "b"]
    b_first = first[1]
    assert b_first.time > next(e.time for e in events if e.kind == "finished" and e.req_id == "a")
    assert sum(e.tokens for e in events if e.req_id == "b" and e.kind != "finished") == 4
    s = engine.stats()
    assert s.ttft_count == 2 and s.prompt_tokens == 38 * BT
    assert s.used_blocks == 0 and s.running == s.waiting == 0 and s.pending_prefill_tokens == 0


def test_lazy_kv_conserves_tokens_and_blocks_under_pressure() -> None:
    """Many requests on a cache that their outputs overflow: preemptions happen, and
    everything still finishes with its tokens and gives back every block."""
    engine = EngineModel(PROFILES["qwen-32b-h200"], 500 * BT, BT, max_running=32,
                         lazy_kv=True, cache_outputs=True)
    events, expected_gen = _drive(engine, random.Random(11), requests=400, rate=200.0,
                                  prefixes=8, prefix_blocks=(20, 120), max_tokens=400)
    assert engine.preemptions > 0
    assert {e.req_id for e in events if e.kind == "finished"} == {f"r{i}" for i in range(400)}
    assert sum(e.kind == "first_token" for e in events) == 400
    s = engine.stats()
    assert s.generation_tokens == expected_gen and s.request_success == 400
    assert s.used_blocks == 0 and s.running == s.waiting == 0
    assert s.pending_prefill_tokens == 0
    assert s.resident_blocks <= s.capacity_blocks
