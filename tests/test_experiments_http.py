"""Engine A/B experiments through a real gateway process and the official `openai` client:
simulated pools of two latency profiles (8B and 32B shapes on an H200), a mirror, a reload
that turns it off, the arms swapped, and several workers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
import yaml

from gateway import processes
from tests.conftest import Gateway, poll, start_gateway, start_sims, tenant_prompt

# Checked often, but a replica is ejected only after three failed checks of 5 s: on a loaded
# machine one slow answer to a health check had taken a candidate replica out, and the copies
# sent meanwhile were dropped for want of a healthy replica.
HEALTH = {"interval_s": 0.2, "timeout_s": 5, "failure_threshold": 3, "metrics_interval_s": 0.2}


@pytest.fixture(scope="module")
def pools(tmp_path_factory) -> Iterator[dict[str, list[str]]]:
    tmp = tmp_path_factory.mktemp("ab-sims")
    fast = start_sims(["vllm", "vllm"], tmp, time_scale=0.5)
    try:
        slow_dir = tmp_path_factory.mktemp("ab-slow")
        slow = start_sims(["vllm", "vllm"], slow_dir, time_scale=0.5, profile="qwen-32b-h200")
    except Exception:
        fast.stop()
        raise
    yield {"fast": fast.urls, "slow": slow.urls}
    fast.stop()
    slow.stop()


def ab_config(port: int, pools: dict[str, list[str]], baseline: str = "fast",
              candidate: str = "slow", workers: int = 1, **experiment: Any) -> dict[str, Any]:
    return {
        "server": {"host": "127.0.0.1", "port": port, "workers": workers},
        "pools": [{"name": name, "engine": "vllm", "models": ["tiny"], "health": HEALTH,
                   "replicas": [{"name": f"{name}-{i}", "url": u} for i, u in enumerate(urls)]}
                  for name, urls in pools.items()],
        "traffic_classes": [{"name": "chat", "pool": baseline},
                            {"name": "other", "pool": candidate}],
        "classification": {"default_class": "chat"},
        "experiments": [{"name": "ab", "traffic_class": "chat", "baseline": baseline,
                         "candidate": candidate, "mode": "mirror", **experiment}],
    }


def send(gw: Gateway, n: int, threads: int = 8) -> list[str]:
    """`n` chat requests (every other one streamed) from 12 tenants; the pool of each answer."""
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="sk-none", max_retries=0)

    def one(i: int) -> str:
        messages = [{"role": "system", "content": tenant_prompt(i % 12, 1200)},
                    {"role": "user", "content": f"question {i}"}]
        if i % 2:
            with client.chat.completions.with_streaming_response.create(
                    model="tiny", messages=messages, max_tokens=4, stream=True) as resp:
                text = "".join(c.choices[0].delta.content or "" for c in resp.parse()
                               if c.choices)
                assert text
                return resp.headers["x-gateway-pool"]
        raw = client.chat.completions.with_raw_response.create(
            model="tiny", messages=messages, max_tokens=4)
        assert raw.parse().choices[0].message.content
        return raw.headers["x-gateway-pool"]

    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(one, range(n)))


def report(gw: Gateway) -> dict[str, Any]:
    r = httpx.get(gw.url + "/admin/experiments", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def experiment(gw: Gateway) -> dict[str, Any]:
    return report(gw)["experiments"][0]


def settled(gw: Gateway, copies: int, deadline_s: float = 300) -> dict[str, Any]:
    """The experiment once each of `copies` mirror copies has ended or was dropped.

    A copy starts only after its client's answer, so on a loaded machine the last ones end
    long after the last answer; waiting for every copy to be accounted for (rather than for
    a count of pairs) ends as soon as they are, and a shortfall of pairs then fails with the
    counters that explain it, not with a deadline."""
    def done() -> dict[str, Any] | None:
        exp = experiment(gw)
        cand = exp["arms"]["candidate"]
        # A copy dropped after it started (its replica's room gone) is both a candidate
        # sample ("no_replica") and a drop: counted once.
        ended = (cand["requests"] + exp["mirror"]["dropped"]
                 - cand["errors"].get("no_replica", 0))
        return exp if ended >= copies else None
    return poll(done, deadline_s=deadline_s, interval_s=0.5)


def test_a_mirror_reports_the_slower_candidate_and_a_reload_turns_it_off(pools, tmp_path):
    port = processes.free_ports(1)[0]
    # Room for every copy: on a loaded machine the slow pool falls behind, more than the
    # default 32 copies wait at once, and the ones beyond it are dropped, never paired.
    gw = start_gateway(ab_config(port, pools, max_concurrency=300), tmp_path)
    try:
        assert set(send(gw, 300)) == {"fast"}
        exp = settled(gw, 300)
        assert exp["paired"] >= 290, (exp["mirror"], exp["arms"]["candidate"]["errors"])
        assert exp["arms"]["baseline"]["requests"] == 300
        assert exp["arms"]["candidate"]["ok"] >= 290
        diff = exp["ttft_diff_s"]
        assert diff["conclusive"] and diff["ci95"][0] > 0, diff
        assert exp["arms"]["candidate"]["ttft_p50_s"] > exp["arms"]["baseline"]["ttft_p50_s"]
        cond = exp["conditions"]
        assert cond["prompt_tokens"]["p50"] > 200 and cond["output_tokens"]["max"] == 4
        assert cond["arrival_rate_per_s"] > 0
        # The engines' own figures, scraped by the gateway, are in the report.
        assert exp["arms"]["baseline"]["prefix_cache_hit_ratio"] is not None
        assert exp["arms"]["candidate"]["kv_usage"] is not None
        # The command line prints the same report from the running gateway.
        cli = subprocess.run([sys.executable, "-m", "gateway.cli", "experiments", "--url",
                              gw.url], capture_output=True, text=True, timeout=60)
        assert cli.returncode == 0, cli.stderr
        assert "experiment ab: mirror 100.0% of traffic class chat" in cli.stdout
        assert "TTFT difference (candidate - baseline)" in cli.stdout
        assert "conclusive (candidate above baseline" in cli.stdout
        metrics = httpx.get(gw.url + "/metrics", timeout=10).text
        assert ('gateway_experiment_mirror_copies_total{experiment="ab",result="sent"} '
                f'{float(exp["mirror"]["sent"])}') in metrics

        # The kill switch in the file, applied by SIGHUP: no copy from the next request on.
        sent = exp["mirror"]["sent"]
        gw.config_path.write_text(yaml.safe_dump(ab_config(port, pools, enabled=False,
                                                             max_concurrency=300)))
        os.kill(gw.proc.pid, signal.SIGHUP)
        poll(lambda: experiment(gw)["enabled"] is False, deadline_s=15)
        send(gw, 20)
        exp = experiment(gw)
        assert exp["mirror"]["sent"] == sent
        assert exp["paired"] >= 290  # its measurements are kept
    finally:
        gw.stop()


def test_the_arms_swapped_give_the_opposite_sign(pools, tmp_path):
    port = processes.free_ports(1)[0]
    gw = start_gateway(ab_config(port, pools, baseline="slow", candidate="fast",
                                 max_concurrency=240), tmp_path)
    try:
        assert set(send(gw, 240)) == {"slow"}
        exp = settled(gw, 240)
        assert exp["paired"] >= 230, (exp["mirror"], exp["arms"]["candidate"]["errors"])
        diff = exp["ttft_diff_s"]
        assert diff["conclusive"] and diff["ci95"][1] < 0, diff
    finally:
        gw.stop()


def test_with_several_workers_each_answers_for_itself_and_the_switch_is_the_file(
        pools, tmp_path):
    port = processes.free_ports(1)[0]
    gw = start_gateway(ab_config(port, pools, workers=2), tmp_path)
    try:
        poll(lambda: "(2 workers)" in gw.log(), deadline_s=30)
        body = report(gw)
        assert isinstance(body["worker_pid"], int)
        assert body["experiments"][0]["name"] == "ab"
        r = httpx.post(gw.url + "/admin/experiments/ab/disable", timeout=10)
        assert r.status_code == 409 and r.json()["error"]["code"] == "several_workers"
    finally:
        gw.stop()
