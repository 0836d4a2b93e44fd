"""The gateway over HTTP with the official openai client, in front of simulated replicas."""

from __future__ import annotations

import subprocess
import sys
from collections import defaultdict

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import poll


def tenant_prompt(i: int, chars: int = 2000) -> str:
    text = " ".join(f"Tenant {i} policy clause {j}: answer precisely and cite sources."
                    for j in range(chars // 40))
    return text[:chars]


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


def test_batch_class_is_served_only_by_batch_replicas(fleet) -> None:
    gw, _ = fleet
    by_header = client(gw.url, default_headers={"x-traffic-class": "batch"})
    by_key = openai.OpenAI(base_url=gw.url + "/v1", api_key="sk-batch-key", max_retries=0)
    seen = set()
    for i in range(6):
        for c in (by_header, by_key):
            raw = c.completions.with_raw_response.create(
                model="tiny", prompt=tenant_prompt(50 + i % 2) + f" job {i}", max_tokens=3,
                stream=bool(i % 2))
            if i % 2:
                assert list(raw.parse())
            assert raw.headers["x-gateway-pool"] == "batch"
            seen.add(raw.headers["x-gateway-replica"])
    # service_tier=flex maps to batch in this config.
    raw = client(gw.url).chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], service_tier="flex",
        max_tokens=2)
    seen.add(raw.headers["x-gateway-replica"])
    assert seen and seen <= {"bt-0", "bt-1"}


def test_metrics_have_ttft_for_both_pools_and_estimated_hits(fleet) -> None:
    gw, _ = fleet
    c = client(gw.url)
    system = tenant_prompt(99)
    for u in range(3):
        c.chat.completions.create(model="tiny", max_tokens=3, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": str(u)}])
    client(gw.url, default_headers={"x-traffic-class": "batch"}).completions.create(
        model="tiny", prompt=system, max_tokens=3)
    samples = metric_samples(gw.url)
    ttft_pools = {s.labels["pool"] for s in samples
                  if s.name == "gateway_time_to_first_token_seconds_count" and s.value > 0}
    assert ttft_pools == {"realtime", "batch"}
    hits = sum(s.value for s in samples
               if s.name == "gateway_prefix_blocks_total" and s.labels["result"] == "hit")
    assert hits > 0
    tpot = [s for s in samples if s.name == "gateway_time_per_output_token_seconds_count"]
    assert sum(s.value for s in tpot) > 0
    reasons = {s.labels["reason"] for s in samples
               if s.name == "gateway_routing_decisions_total" and s.value > 0}
    assert "affinity" in reasons
    # The simulated engines count one token per 4 bytes; the pools learn that.
    cpt = {s.labels["pool"]: s.value for s in samples if s.name == "gateway_chars_per_token"}
    assert set(cpt) == {"realtime", "batch"} and 3.5 < cpt["realtime"] < 4.5
    up = {s.labels["replica"]: s.value for s in samples if s.name == "gateway_replica_up"}
    assert up == {"rt-0": 1, "rt-1": 1, "rt-2": 1, "bt-0": 1, "bt-1": 1}
    # The engines' own hit ratio, read from their metrics (vLLM names and trtllm JSON stats).
    engine = poll(lambda: {s.labels["replica"] for s in metric_samples(gw.url)
                           if s.name == "gateway_engine_prefix_cache_hit_ratio"
                           and s.value > 0} or None)
    assert engine & {"rt-0", "rt-1", "rt-2"}
    # Engine step times, from the gaps between the chunks the replicas streamed.
    stepped = poll(lambda: {s.labels["replica"] for s in metric_samples(gw.url)
                            if s.name == "gateway_engine_step_seconds" and s.value > 0} or None)
    assert stepped & {"rt-0", "rt-1", "rt-2"}


def test_admin_stats_and_cli_show_counts(fleet) -> None:
    gw, _ = fleet
    c = client(gw.url)
    served = set()
    for u in range(4):
        raw = c.completions.with_raw_response.create(model="tiny", prompt=tenant_prompt(7) + str(u),
                                                     max_tokens=6)
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
    # The table's request column agrees with the JSON (at least as many, as time moved on).
    table_total = sum(int(line.split()[3]) for line in out.splitlines()
                      if line.strip().startswith("rt-"))
    assert table_total >= total


@pytest.mark.parametrize(("path", "body", "status", "code"), [
    ("/v1/chat/completions", b"{not json", 400, "invalid_json"),
    ("/v1/chat/completions", b'{"model": "nope", "messages": [{"role": "user", "content": "x"}]}',
     404, "model_not_found"),
    ("/v1/chat/completions", b'{"model": "tiny"}', 400, "missing_required_parameter"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": []}', 400, "invalid_value"),
    ("/v1/completions", b'{"model": "tiny"}', 400, "missing_required_parameter"),
    ("/v1/completions", b'[1, 2]', 400, None),
    ("/v1/completions", b'{"prompt": "x"}', 400, "missing_required_parameter"),
])
def test_bad_requests_get_openai_errors(fleet, http, path, body, status, code) -> None:
    gw, _ = fleet
    r = http.post(gw.url + path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    assert err["code"] == code


def test_openai_client_sees_typed_errors(fleet) -> None:
    gw, _ = fleet
    c = client(gw.url)
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="tiny", messages=[])
    with pytest.raises(openai.BadRequestError, match="Unknown traffic class"):
        client(gw.url, default_headers={"x-traffic-class": "bulk"}).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}])


def test_replica_errors_pass_through(fleet, http) -> None:
    gw, sims = fleet
    # A request the engine itself rejects (its 4xx) reaches the client as the engine sent it.
    r = http.post(gw.url + "/v1/completions", json={"model": "tiny", "prompt": "x",
                                                   "max_tokens": -5})
    direct = http.post(sims.urls[0] + "/v1/completions", json={"model": "tiny", "prompt": "x",
                                                              "max_tokens": -5})
    assert direct.status_code == 400
    assert r.status_code == direct.status_code
    assert r.json()["error"]["message"] == direct.json()["error"]["message"]


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


WEIRD_BODIES = [
    b"", b"null", b'""', b"[]", b"\xff\xfe\x00", b"{" * 2000, b'{"model": 5, "messages": []}',
    b'{"model": "tiny", "messages": "hi"}', b'{"model": "tiny", "messages": [1]}',
    b'{"model": "tiny", "messages": [{"content": "no role"}]}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}',
    b'{"model": "", "messages": [{"role": "user", "content": "x"}]}',
]


@pytest.mark.parametrize("body", WEIRD_BODIES)
def test_malformed_bodies_never_get_a_5xx(fleet, http, body) -> None:
    gw, _ = fleet
    for path in ("/v1/chat/completions", "/v1/completions"):
        r = http.post(gw.url + path, content=body, headers={"content-type": "application/json"})
        assert 400 <= r.status_code < 500, (path, body[:40], r.status_code, r.text[:200])
        assert r.json()["error"]["message"]


def test_wrong_method_and_oversized_body(fleet, http) -> None:
    gw, _ = fleet
    r = http.get(gw.url + "/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    big = b'{"model": "tiny", "prompt": "' + b"x" * (33 * 1024 * 1024) + b'"}'
    r = http.post(gw.url + "/v1/completions", content=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
