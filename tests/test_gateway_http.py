"""End to end over real sockets: the gateway process, simulated replica processes, the
official openai client and the stats CLI. Behaviour in detail is tested in-process
(tests/test_gateway.py)."""

from __future__ import annotations

import subprocess
import sys
from collections import defaultdict

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import tenant_prompt


def client(url: str, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="sk-test", max_retries=0, **kw)


def metric_samples(url: str) -> list:
    text = httpx.get(url + "/metrics").text
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


def test_shared_prefixes_stay_home_and_spread_over_replicas(fleet) -> None:
    gw, _ = fleet
    c = client(gw.url)
    served: dict[int, set[str]] = defaultdict(set)
    for i in range(8):
        system = tenant_prompt(i)
        for u in range(10):
            messages = [{"role": "system", "content": system},
                        {"role": "user", "content": f"User {u} asks question number {u * 7}."}]
            if u % 2:
                raw = c.chat.completions.with_raw_response.create(
                    model="tiny", messages=messages, max_tokens=4)
                completion = raw.parse()
                assert completion.choices[0].message.content
                assert completion.usage is not None and completion.usage.completion_tokens == 4
            else:
                raw = c.chat.completions.with_raw_response.create(
                    model="tiny", messages=messages, max_tokens=4, stream=True)
                chunks = list(raw.parse())
                assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            assert raw.headers["x-gateway-pool"] == "realtime"
            served[i].add(raw.headers["x-gateway-replica"])
    assert all(len(replicas) <= 2 for replicas in served.values()), served
    used = set().union(*served.values())
    assert used <= {"rt-0", "rt-1", "rt-2"}
    assert len(used) >= 2


def test_admin_stats_and_cli_show_counts(fleet) -> None:
    gw, _ = fleet
    c = client(gw.url)
    served = set()
    for u in range(4):
        # Streamed: TTFT and engine steps are timed from streams (a non-streaming request is
        # passed through whole by default).
        # 24 tokens: on a loaded machine a few of a stream's chunks may arrive together and
        # count as one step; 6 once left no two apart on any replica.
        raw = c.completions.with_raw_response.create(model="tiny", prompt=tenant_prompt(7) + str(u),
                                                     max_tokens=24, stream=True)
        assert list(raw.parse())
        served.add(raw.headers["x-gateway-replica"])
    stats = httpx.get(gw.url + "/admin/stats").json()
    pools = {p["name"]: p for p in stats["pools"]}
    assert set(pools) == {"realtime", "batch"}
    rt = pools["realtime"]
    assert sum(r["requests"] for r in rt["replicas"]) >= 4
    assert sum(rt["decisions_by_reason"].values()) >= 4
    assert all(r["healthy"] for r in rt["replicas"])
    assert any(r["ttft_p50_s"] for r in rt["replicas"])
    # Engine steps are timed from the chunks each replica streamed (one per step per stream).
    steps = {r["name"]: r["engine_step_s"] for r in rt["replicas"]}
    assert all(steps[name] is not None and steps[name] > 0 for name in served), steps
    out = subprocess.run([sys.executable, "-m", "gateway.cli", "stats", "--url", gw.url],
                         capture_output=True, text=True, check=True).stdout
    assert "pool realtime" in out and "pool batch" in out
    # With no rate configured, each pool learns its engines' prefill rate and says so.
    assert rt["prefill_rate_learned"] is True
    assert out.count("(learned)") == 2
    total = sum(r["requests"] for r in rt["replicas"])
    # The table's request column agrees with the JSON (nothing else runs meanwhile).
    table_total = sum(int(line.split()[3]) for line in out.splitlines()
                      if line.strip().startswith("rt-"))
    assert table_total == total


def test_models_health_and_ready(fleet, http) -> None:
    gw, _ = fleet
    assert http.get(gw.url + "/health").json() == {"status": "ok"}
    ready = http.get(gw.url + "/ready")
    assert ready.status_code == 200 and ready.json()["ready"] is True
    models = client(gw.url).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    page = http.get(gw.url + "/admin")
    assert page.status_code == 200 and "/admin/stats" in page.text
    missing = http.get(gw.url + "/nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


def test_wrong_method_and_oversized_body(fleet, http) -> None:
    gw, _ = fleet
    r = http.get(gw.url + "/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    big = b'{"model": "tiny", "prompt": "' + b"x" * (33 * 1024 * 1024) + b'"}'
    r = http.post(gw.url + "/v1/completions", content=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
