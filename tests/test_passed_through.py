"""Requests passed through whole: when their prefill is presumed done, and what they hide."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from backends.sim.fleet_spec import fleet_profiles
from gateway import processes
from gateway.defaults import one_pool_config
from loadtests.simulate import load_workload, simulate
from routing.load import LoadTracker, sum_loads
from routing.steps import StepTimer
from tests.conftest import poll, start_gateway, start_sims


def test_the_engines_first_token_count_ends_the_oldest_passed_through_prefills() -> None:
    load = LoadTracker()
    load.engine_first_tokens("r0", 10)  # the first reading only sets the baseline
    load.dispatched("r0", 1000.0, blind_at=0.0)
    load.dispatched("r0", 300.0, blind_at=0.1)
    load.dispatched("r0", 500.0)  # streamed
    assert load.view("r0", 5.0).pending_prefill_tokens == 1800.0  # no estimate: counts rule
    load.first_token("r0", 500.0, now=1.0, dispatched_at=0.2)
    # Two first tokens since: one the gateway saw, the other the oldest passed-through one.
    load.engine_first_tokens("r0", 12)
    assert load.pending_prefill["r0"] == 300.0
    assert load.inflight["r0"] == 3  # still decoding
    load.finished("r0", 1000.0, saw_first_token=False)  # already off the queue
    assert load.pending_prefill["r0"] == 300.0
    load.finished("r0", 300.0, saw_first_token=False)  # answered before the next reading
    assert load.pending_prefill["r0"] == 0.0
    load.engine_first_tokens("r0", 13)  # its first token: nothing left to take off
    assert load.pending_prefill["r0"] == 0.0


def test_gateways_sharing_a_replica_each_take_their_share_of_the_engines_count() -> None:
    a, b = LoadTracker(), LoadTracker()
    for gateway in (a, b):
        gateway.engine_first_tokens("r0", 0)
        gateway.dispatched("r0", 1000.0, blind_at=0.0)
        gateway.dispatched("r0", 1000.0, blind_at=0.0)
    a.set_remote(sum_loads([b.own_load()]))
    b.set_remote(sum_loads([a.own_load()]))
    # Two prefills passed through ended: each gateway reads the same count of two, and
    # takes one of its own off the queue (taking two each, the queues would err short).
    for gateway in (a, b):
        gateway.engine_first_tokens("r0", 2)
        assert gateway.pending_prefill["r0"] == 1000.0


def test_a_share_of_the_engines_count_carries_its_fraction_to_the_next_reading() -> None:
    # Three gateways with two requests passed through each: one ended between readings is a
    # third of one for each. Rounded, each took none (and two thirds of two, one each).
    gateways = [LoadTracker() for _ in range(3)]
    for gateway in gateways:
        gateway.engine_first_tokens("r0", 0)
        gateway.dispatched("r0", 1000.0, blind_at=0.0)
        gateway.dispatched("r0", 1000.0, blind_at=0.0)
    for gateway in gateways:
        gateway.set_remote(sum_loads([g.own_load() for g in gateways if g is not gateway]))
    for count in (1, 2):
        for gateway in gateways:
            gateway.engine_first_tokens("r0", count)
            assert gateway.pending_prefill["r0"] == 2000.0
    for gateway in gateways:  # the third: a whole one each
        gateway.engine_first_tokens("r0", 3)
        assert gateway.pending_prefill["r0"] == 1000.0


def test_counts_are_read_between_scrapes_where_other_gateways_send_too() -> None:
    counted, waiting, other = LoadTracker(), LoadTracker(), LoadTracker()
    counted.engine_first_tokens("r0", 0)  # an engine that counts first tokens (vLLM)
    for gateway in (counted, waiting, other):
        gateway.dispatched("r0", 1000.0, blind_at=0.0)
    # The shares of first tokens carry their fractions, and a waiting count (TensorRT-LLM)
    # leaves out the other gateways' streamed requests: both are read every second.
    for gateway in (counted, waiting):
        gateway.set_remote(sum_loads([other.own_load()]))
        assert gateway.awaits_unseen("r0")


def test_a_waiting_count_leaves_out_the_other_gateways_streamed_requests() -> None:
    streaming, passing = LoadTracker(), LoadTracker()
    for _ in range(2):
        streaming.dispatched("r0", 1000.0, sent_at=0.0)
        passing.dispatched("r0", 1000.0, sent_at=0.0, blind_at=0.0)
    passing.set_remote(sum_loads([streaming.own_load()]))
    # Two requests await a first token there: the streaming gateway's two. The two passed
    # through are prefilled. Read as room for its own, the count left both queued.
    passing.engine_prefills_waiting("r0", 2, read_at=10.0)
    assert passing.pending_prefill["r0"] == 0.0
    assert passing.inflight["r0"] == 2  # still decoding


def test_another_gateways_passed_through_request_hides_its_prefill_in_the_steps_timed() -> None:
    streaming, passing = LoadTracker(), LoadTracker()
    for k in range(12):  # decode steps of 20 ms, four streams
        streaming.chunk("r0", 0.02 * k)
    for _ in range(4):
        streaming.dispatched("r0", 10.0)
        streaming.first_token("r0", 10.0, now=0.0)
    seen = streaming.steps.decode_s(4)
    assert seen is not None and abs(seen - 0.02) < 1e-6
    passing.dispatched("r0", 8000.0, blind_at=0.3)  # passed through by the other gateway
    streaming.set_remote(sum_loads([passing.own_load()]))
    t = 0.02 * 11
    for _ in range(24):
        t += 0.05  # longer steps: chunks of the other gateway's prompt, unseen here
        streaming.chunk("r0", t)
    assert abs(streaming.steps.decode_s(4) - 0.02) < 1e-6


def test_nothing_is_kept_of_passed_through_requests_once_none_is_in_flight() -> None:
    load = LoadTracker()
    load.engine_first_tokens("r0", 0)
    load.dispatched("r0", 700.0, blind_at=0.0)
    load.dispatched("r0", 700.0)  # streamed, fails before its first token
    load.engine_first_tokens("r0", 1)  # the passed-through one is prefilled
    load.finished("r0", 700.0, saw_first_token=False)  # the streamed failure, same size
    load.finished("r0", 700.0, saw_first_token=False)
    assert load.pending_prefill["r0"] == 0.0
    assert not load.own_load()
    assert load._blind.get("r0") is None and load._presumed.get("r0") is None


def test_an_engine_restart_counts_no_first_tokens() -> None:
    load = LoadTracker()
    load.engine_first_tokens("r0", 500)
    load.dispatched("r0", 1000.0, blind_at=0.0)
    load.engine_first_tokens("r0", 3)  # the counter went back: a new baseline
    assert load.pending_prefill["r0"] == 1000.0
    load.engine_first_tokens("r0", 4)
    assert load.pending_prefill["r0"] == 0.0


def test_without_the_engines_count_a_passed_through_prefill_ends_at_an_estimate() -> None:
    load = LoadTracker(prefill_tokens_per_s=1000.0)  # a configured rate: no timing needed
    load.dispatched("r0", 1000.0)  # streamed, queued ahead
    load.dispatched("r0", 2000.0, blind_at=10.0)
    # Behind 1,000 queued tokens, its 2,000 take until 13 s at 1,000 tokens per second.
    assert load.view("r0", 12.9).pending_prefill_tokens == 3000.0
    assert load.view("r0", 13.0).pending_prefill_tokens == 1000.0
    load.finished("r0", 2000.0, saw_first_token=False)
    assert load.pending_prefill["r0"] == 1000.0  # presumed done already: not taken twice


def test_an_engine_waiting_count_ends_the_oldest_prefills_it_cannot_hold() -> None:
    # No count of first tokens (TensorRT-LLM) and no rate: only the engine's count of
    # requests awaiting their first token says when passed-through prefills ended.
    load = LoadTracker()
    for k in range(3):
        load.dispatched("r0", 1000.0 * (k + 1), sent_at=float(k), blind_at=float(k))
    load.dispatched("r0", 50.0, sent_at=3.0)  # streamed, awaiting its first token
    load.dispatched("r0", 70.0, sent_at=9.98, blind_at=9.98)  # sent as the engine counted
    # Two wait there: the streamed one and at most one of the three passed through before it
    # (the newest, as an engine prefills in arrival order). The one sent within the slack
    # before the count is not weighed.
    load.engine_prefills_waiting("r0", 2, read_at=10.0)
    assert load.pending_prefill["r0"] == 3000.0 + 50.0 + 70.0
    assert load.inflight["r0"] == 5  # still decoding: off the queue, not finished
    # One waits. As of the newest engine step's end, 3 s before the read, the streamed
    # request sent at 3 s may not have been there: the one may be the passed-through one.
    load.engine_prefills_waiting("r0", 1, read_at=6.0, lag_s=3.0)
    assert load.pending_prefill["r0"] == 3000.0 + 50.0 + 70.0
    # As of the read itself, the one waiting is the streamed one.
    load.engine_prefills_waiting("r0", 1, read_at=6.0)
    assert load.pending_prefill["r0"] == 50.0 + 70.0
    load.first_token("r0", 50.0, now=11.0, dispatched_at=3.0)
    load.engine_prefills_waiting("r0", 0, read_at=12.0)
    assert load.pending_prefill["r0"] == 0.0
    for tokens in (1000.0, 2000.0, 3000.0, 70.0):  # all presumed already: nothing taken twice
        load.finished("r0", tokens, saw_first_token=False)
    assert load.pending_prefill["r0"] == 0.0


def test_gateways_sharing_a_replica_each_take_their_share_of_what_its_waiting_count_leaves(
        ) -> None:
    a, b = LoadTracker(), LoadTracker()
    for gateway in (a, b):
        gateway.dispatched("r0", 1000.0, sent_at=0.0, blind_at=0.0)
        gateway.dispatched("r0", 1000.0, sent_at=0.0, blind_at=0.0)
    a.set_remote(sum_loads([b.own_load()]))
    b.set_remote(sum_loads([a.own_load()]))
    # Two of the four passed through still wait: each gateway reads the same count, and
    # takes one of its own off the queue (counting only its own, it would take none).
    for gateway in (a, b):
        gateway.engine_prefills_waiting("r0", 2, read_at=10.0)
        assert gateway.pending_prefill["r0"] == 1000.0


def test_an_engine_waiting_count_is_not_read_where_the_first_tokens_are_counted() -> None:
    load = LoadTracker()
    load.engine_first_tokens("r0", 0)
    load.dispatched("r0", 1000.0, sent_at=0.0, blind_at=0.0)
    load.engine_prefills_waiting("r0", 0, read_at=10.0)  # counts rule where there are some
    assert load.pending_prefill["r0"] == 1000.0
    load.engine_prefills_waiting("r0", None, read_at=10.0)
    assert load.pending_prefill["r0"] == 1000.0


def test_without_any_rate_a_passed_through_prefill_is_queued_until_its_answer() -> None:
    load = LoadTracker()
    load.dispatched("r0", 2000.0, blind_at=0.0)
    assert load.view("r0", 1000.0).pending_prefill_tokens == 2000.0
    load.finished("r0", 2000.0, saw_first_token=False)
    assert load.pending_prefill["r0"] == 0.0


def test_steps_that_may_hold_an_unseen_prefill_teach_no_decode_step() -> None:
    timer = StepTimer()
    for k in range(12):  # decode steps of 20 ms, then the same length with a hidden prefill
        timer.chunk("r0", 0.02 * k, inflight=4)
    seen = timer.decode_s(4)
    assert seen is not None and abs(seen - 0.02) < 1e-6
    t = 0.02 * 11
    for _ in range(12):
        t += 0.5  # long steps: a passed-through prompt computed in them
        timer.chunk("r0", t, inflight=4, awaiting_prefill=True, hidden=True)
    assert abs(timer.decode_s(4) - 0.02) < 1e-6


def test_with_nothing_decoding_that_streams_a_gap_is_not_timed_as_a_step() -> None:
    load = LoadTracker()
    load.dispatched("r0", 100.0)
    load.chunk("r0", 1.0)
    load.first_token("r0", 100.0, now=1.0, dispatched_at=0.9)
    load.chunk("r0", 1.02)
    assert load.steps.remaining("r0", 1.03) > 0.0  # a step of 20 ms in flight
    load.dispatched("r0", 100.0, blind_at=1.03)
    load.finished("r0", 100.0, saw_first_token=True)  # the streamed one ends
    # Only the passed-through request is left: its steps stream nothing, and the next chunk
    # seen there (seconds later) must not be taken for the end of one step.
    assert load.steps.remaining("r0", 1.03) == 0.0


def test_half_passed_through_near_saturation_routes_as_well_as_all_streamed() -> None:
    # The slow fleet near saturation. Counted as queued until each answer, passed-through
    # requests made every replica look busy: requests spilled off their cache, and the
    # recomputation spiralled (mean TTFT 35.8 s and hit ratio 0.35 against 6.1 s and 0.67
    # with every request streamed).
    workload = load_workload(None, "tenants", params={
        "n_tenants": 300, "n_requests": 1500, "rate_per_s": 18})
    fleet = fleet_profiles(8, "qwen-32b-h200", slow="1:3")
    streamed = simulate(workload, "prefix_affinity", fleet=fleet, stream_share=1.0)
    half = simulate(workload, "prefix_affinity", fleet=fleet, stream_share=0.5)
    assert half["hit_ratio"] > streamed["hit_ratio"] - 0.05
    assert half["ttft_mean_s"] < 1.5 * streamed["ttft_mean_s"]
    # Engines that count no first tokens but say how many requests await theirs
    # (TensorRT-LLM). With the estimate alone, which errs late under a standing queue: 12.8 s
    # and hit ratio 0.59.
    waiting = simulate(workload, "prefix_affinity", fleet=fleet, stream_share=0.5,
                       first_tokens="waiting")
    assert waiting["hit_ratio"] > streamed["hit_ratio"] - 0.05
    assert waiting["ttft_mean_s"] < 1.5 * streamed["ttft_mean_s"]


def test_a_gateway_streaming_next_to_one_passing_through_routes_as_well_as_all_streamed(
) -> None:
    # Two gateways sharing state, request k through gateway k % 2, every other request
    # streamed: one gateway streams everything, the other passes everything through (a
    # client that streams on one gateway or worker, one that does not on the other). The
    # streaming one timed the steps that computed the other's prompts as its own: mean TTFT
    # 25.8 s and hit ratio 0.44, against 6.4 s and 0.66 with every request streamed.
    workload = load_workload(None, "tenants", params={
        "n_tenants": 300, "n_requests": 1500, "rate_per_s": 18})
    fleet = fleet_profiles(8, "qwen-32b-h200", slow="1:3")
    streamed = simulate(workload, "prefix_affinity", fleet=fleet, stream_share=1.0, gateways=2)
    split = simulate(workload, "prefix_affinity", fleet=fleet, stream_share=0.5, gateways=2)
    assert split["hit_ratio"] > streamed["hit_ratio"] - 0.05
    assert split["ttft_mean_s"] < 1.5 * streamed["ttft_mean_s"]


@pytest.mark.parametrize("kind", ["vllm", "trtllm"])
def test_over_http_a_passed_through_prefill_leaves_the_queue_before_its_answer(
        kind: str, tmp_path) -> None:
    # One simulated replica in real time, a non-streaming request passed through whole with
    # a long answer: its prefill ends within a step or two, its answer seconds later. vLLM
    # counts its first tokens; TensorRT-LLM's iteration stats say how many requests wait.
    # The engine's metrics are scraped once a minute: the counts are read between scrapes,
    # while such a request may wait (health.passed_through_interval_s).
    sims = start_sims([kind], tmp_path, time_scale=1.0, profile="llama-8b-h200")
    try:
        gw = start_gateway(one_pool_config(sims.urls, processes.free_ports(1)[0],
                                           engine=kind, models=("tiny",),
                                           health={"metrics_interval_s": 60,
                                                   "passed_through_interval_s": 0.2}),
                           tmp_path)
        try:
            client = openai.OpenAI(base_url=gw.url + "/v1", api_key="sk-test", max_retries=0)

            def replica() -> dict:
                return httpx.get(gw.url + "/admin/stats").json()["pools"][0]["replicas"][0]

            # The engine's count of first tokens is read once before the request is sent.
            assert poll(lambda: replica()["engine_waiting"] is not None)
            with ThreadPoolExecutor(1) as pool:
                answer = pool.submit(client.completions.create, model="tiny",
                                     prompt="words nobody cached before " * 200,
                                     max_tokens=400)
                assert poll(lambda: replica()["inflight"] == 1)
                seen = []
                # Off the queue at the next reading of the engine's count, still in flight.
                assert poll(lambda: seen.append(replica()) or (
                    seen[-1]["pending_prefill_tokens"] == 0 or answer.done()))
                assert not answer.done(), seen[-1]
                assert seen[-1]["inflight"] == 1
                assert answer.result().usage.completion_tokens == 400
            assert replica()["pending_prefill_tokens"] == 0
        finally:
            gw.stop()
    finally:
        sims.stop()
