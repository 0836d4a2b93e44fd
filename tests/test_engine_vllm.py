"""Real vLLM CPU replicas behind the gateway: prefix affinity raises the engines' own hits.

Slow (two real engines start on two cores): run alone with `pytest -m engine`.
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from backends.adapters.vllm import parse_vllm_first_tokens
from gateway import processes
from gateway.defaults import one_pool_config
from routing.steps import RATE_MIN_SAMPLES
from tests.conftest import poll, start_gateway, streaming_meanwhile

pytestmark = pytest.mark.engine

# An odd tenant count: with an even one, round robin over two replicas would pin each tenant
# to one replica by accident of the interleaving, and the comparison would show nothing.
TENANTS = 3
REQUESTS_PER_TENANT = 6
# Deadlines, not expectations: on a machine whose two cores other work also wants, two engines
# take minutes to start and a single prefill seconds. A healthy run finishes far sooner.
STARTUP_S = 900
REQUEST_TIMEOUT_S = 300
# A /health answer slowed by a starved API server must not take a replica out of the pool (and
# move a tenant off its home, or leave no replica to serve): these tests are not about health.
HEALTH = {"interval_s": 0.5, "timeout_s": 10, "failure_threshold": 5, "metrics_interval_s": 0.25}
# Nor are they about the server's limits on slow clients: on such a machine the test process
# itself can be starved between connecting and sending its request for longer than the default
# 10 s header timeout, and the gateway then rightly closes the silent connection (a stats call
# failed so, "Server disconnected without sending a response").
SERVER = {"header_timeout_s": REQUEST_TIMEOUT_S, "body_timeout_s": REQUEST_TIMEOUT_S}


@pytest.fixture(scope="module")
def vllm_replicas(tmp_path_factory):
    launch = pytest.importorskip("backends.vllm_cpu.launch")
    try:
        python = launch.vllm_python()
    except FileNotFoundError as exc:
        pytest.fail(f"vLLM CPU is not installed: {exc} (make test installs it)")
    model_dir = launch.ensure_model(python=python)
    base = processes.free_ports(1)[0]
    while base > 64000:  # start_replicas takes consecutive ports from base
        base = processes.free_ports(1)[0]
    reps = launch.start_replicas(2, model_dir, base_port=base, startup_timeout=STARTUP_S,
                                 log_dir=str(tmp_path_factory.mktemp("vllm-logs")))
    yield reps
    launch.stop_replicas(reps)


def engine_sums(url: str, *names: str) -> tuple[float, ...]:
    """The named samples of the engine's own /metrics, summed over their label sets."""
    sums = dict.fromkeys(names, 0.0)
    text = httpx.get(url + "/metrics", timeout=REQUEST_TIMEOUT_S).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in sums:
                sums[s.name] += s.value
    return tuple(sums[name] for name in names)


def engine_counters(url: str) -> tuple[float, float]:
    """(prefix-cache hit tokens, query tokens) from the engine's own /metrics."""
    return engine_sums(url, "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")


def gateway_engine_ratios(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=REQUEST_TIMEOUT_S).text
    return {s.labels["replica"]: s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == "gateway_engine_prefix_cache_hit_ratio"}


def tenant_system_prompt(i: int) -> str:
    topics = ["billing", "shipping", "returns", "warranty", "accounts", "security"]
    words = [f"{topics[(i + j) % len(topics)]} rule {i}.{j} applies to every order." for j in
             range(120)]
    return f"You are the assistant of tenant {i}. " + " ".join(words)


def run_workload(gateway_url: str) -> dict[str, set[int]]:
    """The same shared-prefix chat workload for every policy: tenants x users, interleaved."""
    c = openai.OpenAI(base_url=gateway_url + "/v1", api_key="x", max_retries=0,
                      timeout=REQUEST_TIMEOUT_S)
    served: dict[str, set[int]] = {}
    for u in range(REQUESTS_PER_TENANT):
        for t in range(TENANTS):
            raw = c.chat.completions.with_raw_response.create(
                model="tiny", max_tokens=4, stream=bool(u % 2),
                messages=[{"role": "system", "content": tenant_system_prompt(t)},
                          {"role": "user", "content": f"User {u} asks about order {u * 31}."}])
            if u % 2:
                assert list(raw.parse())
            else:
                assert raw.parse().choices
            served.setdefault(raw.headers["x-gateway-replica"], set()).add(t)
    return served


def test_prefix_affinity_raises_engine_prefix_cache_hits(vllm_replicas, tmp_path) -> None:
    urls = [r.url for r in vllm_replicas]
    hit_tokens: dict[str, float] = {}
    for policy in ("round_robin", "prefix_affinity"):
        for url in urls:
            # Empty caches for each policy (needs VLLM_SERVER_DEV_MODE=1, set by the launcher).
            reset = httpx.post(url + "/reset_prefix_cache", timeout=REQUEST_TIMEOUT_S)
            assert reset.status_code == 200
        before = {u: engine_counters(u) for u in urls}
        port = processes.free_ports(1)[0]
        config = one_pool_config(urls, port, replica_prefix="vllm", routing={"policy": policy},
                                 health={**HEALTH, "hit_ratio_window_s": 3600}, server=SERVER)
        gw = start_gateway(config, tmp_path, name=policy)
        try:
            served = run_workload(gw.url)
            after = {u: engine_counters(u) for u in urls}
            deltas = {u: (after[u][0] - before[u][0], after[u][1] - before[u][1]) for u in urls}
            hit_tokens[policy] = sum(d[0] for d in deltas.values())
            if policy == "prefix_affinity":
                # Each tenant's prefix lives on one replica only.
                homes = [t for tenants in served.values() for t in tenants]
                assert sorted(homes) == list(range(TENANTS))
            # The gateway's gauge is the engines' own counters over the same window.
            expected = {f"vllm-{i}": d[0] / d[1] for i, (u, d) in enumerate(deltas.items())
                        if d[1] > 0}
            poll(lambda exp=expected, g=gw: all(
                abs(gateway_engine_ratios(g.url).get(name, -1) - ratio) < 1e-9
                for name, ratio in exp.items()), deadline_s=120)
        finally:
            gw.stop()
    assert hit_tokens["prefix_affinity"] > hit_tokens["round_robin"], hit_tokens



def engine_prefill_rate_counters(url: str) -> tuple[float, float]:
    """(prefilled tokens, seconds requests spent in prefill) from the engine's own /metrics."""
    return engine_sums(url, "vllm:request_prefill_kv_computed_tokens_sum",
                       "vllm:request_prefill_time_seconds_sum")


# The gateway needs routing.steps.RATE_MIN_SAMPLES steps it can attribute to prefills, and how
# many requests yield one depends on how busy the machine is: send requests until the rate is
# learned, and give up only at this deadline.
LEARN_DEADLINE_S = 900
STATS_EVERY = 4


def test_gateway_learns_the_prefill_rate_of_a_real_engine(vllm_replicas, tmp_path) -> None:
    url = vllm_replicas[0].url
    config = one_pool_config([url], processes.free_ports(1)[0], replica_prefix="vllm",
                             health=HEALTH, server=SERVER)
    gw = start_gateway(config, tmp_path, name="steps")
    before = engine_prefill_rate_counters(url)
    try:
        c = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0,
                          timeout=REQUEST_TIMEOUT_S)

        spent = {"stats": 0.0, "requests": 0.0}  # where the wait went, if it runs out

        def pool_stats() -> dict:
            # As long as a completion may take: on a saturated machine the engine's busy loop
            # and the background stream leave the gateway little CPU, and a stats call has
            # been seen to wait over 30 s for it.
            start = time.monotonic()
            stats = httpx.get(gw.url + "/admin/stats",
                              timeout=REQUEST_TIMEOUT_S).json()["pools"][0]
            spent["stats"] += time.monotonic() - start
            return stats

        # This tiny model decodes a token in milliseconds on CPU: without ignore_eos a
        # background stream would end long before the requests do.
        with streaming_meanwhile(c, ignore_eos=True):
            deadline = time.monotonic() + LEARN_DEADLINE_S
            sent = 0
            # Until both rates are known: the gateway's own, from the steps it times, and the
            # engine's, from its metrics (20 prefills counted between scrapes). The gateway
            # needs RATE_MIN_SAMPLES steps, at most one per request: asked after every
            # STATS_EVERY requests, from then on.
            while sent < RATE_MIN_SAMPLES or sent % STATS_EVERY or not (
                    (pool := pool_stats())["prefill_tokens_per_s"]
                    and pool["replicas"][0]["engine_prefill_tokens_per_s"]):
                assert time.monotonic() < deadline, (
                    f"not learned after {sent} requests (s spent {spent}): {pool_stats()}")
                prompt = f"Request {sent}. " + " ".join(
                    f"fresh clause {sent}.{j} never seen before." for j in range(60))
                # Streamed: a request's first token is what ends its prefill step (a
                # non-streaming one is passed through whole by default).
                start = time.monotonic()
                list(c.completions.create(model="tiny", prompt=prompt, max_tokens=2,
                                          stream=True))
                spent["requests"] += time.monotonic() - start
                sent += 1
    finally:
        gw.stop()
    after = engine_prefill_rate_counters(url)
    assert pool["prefill_rate_learned"] is True
    assert pool["replicas"][0]["engine_step_s"] > 0
    # Learned from the steps that carried these prompts' prefills, through vLLM's own stream:
    # it agrees with the rate the engine itself reports over the same requests, within an
    # order of magnitude. (The learned rate leans low by design, routing/steps.py, and more so
    # when the gateway relays chunks late: with both cores busy it was once 3.7x below the
    # engine's. A step misattributed to a prefill that it did not carry would be off by
    # orders of magnitude.)
    engine_rate = (after[0] - before[0]) / (after[1] - before[1])
    assert engine_rate / 10 < pool["prefill_tokens_per_s"] < engine_rate * 10, (pool, engine_rate)
    # The engine's rate as the gateway reads it from the same metrics, scrape by scrape
    # (routing/engine_speed.py): the same figure, but for older scrapes weighing a little less
    # and the seconds of a scrape capped at the wall time its prefills can have covered (which
    # can only raise it; capped at the time between scrapes, a prefill longer than that, as on
    # a CPU without bfloat16, read 20 times the engine's rate).
    read = pool["replicas"][0]["engine_prefill_tokens_per_s"]
    assert engine_rate / 2 < read < engine_rate * 2, (read, engine_rate)


def test_a_real_engine_counts_a_first_token_before_the_request_ends(vllm_replicas) -> None:
    # The gateway takes requests it passed through whole off a replica's queue when the
    # engine's count of first tokens (its TTFT histogram) moves past those it saw stream
    # (routing/load.py, engine_first_tokens): that count must move at the first token, not
    # when the request ends. A stream read to its first token and then dropped never ends
    # successfully, and its first token is counted all the same.
    url = vllm_replicas[1].url
    names = ("vllm:time_to_first_token_seconds_count", "vllm:request_success_total",
             "vllm:num_requests_running", "vllm:num_requests_waiting")
    before = engine_sums(url, *names)
    with httpx.stream("POST", url + "/v1/completions", timeout=REQUEST_TIMEOUT_S, json={
            "model": "tiny", "prompt": "Count the first token. " * 40, "max_tokens": 3000,
            "ignore_eos": True, "stream": True}) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                break  # the first token: the request is dropped here, mid-generation
    # Aborted: nothing left running, and no success counted.
    after = poll(lambda: (s := engine_sums(url, *names))[2] + s[3] == 0 and s,
                 deadline_s=REQUEST_TIMEOUT_S)
    assert after[1] == before[1], (before, after)
    assert after[0] == before[0] + 1, (before, after)
    # What the gateway reads between scrapes, a scan of the page for that count alone.
    assert parse_vllm_first_tokens(httpx.get(url + "/metrics").text).first_tokens == after[0]
