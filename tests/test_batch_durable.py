"""The Batch API survives what real deployments go through, with real processes on loopback:
a gateway killed with SIGKILL mid-batch, two gateways sharing one Redis, Redis restarted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
from prometheus_client.parser import text_string_to_metric_families

from gateway import processes
from tests.conftest import (
    Gateway,
    poll,
    start_gateway,
    start_gateways,
    start_sims,
    two_pool_config,
)
from tests.redis_server import RedisServer

GROUPS = [f"You are assistant number {g} of the ACME help desk; be brief. " * 30
          for g in range(5)]


def batch_file(n: int = 50, max_tokens: int = 24) -> bytes:
    """`n` chat lines in five groups sharing a system prompt."""
    return b"".join(orjson.dumps({
        "custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "tiny", "max_tokens": max_tokens,
                 "messages": [{"role": "system", "content": GROUPS[i % 5]},
                              {"role": "user", "content": f"Question {i}?"}]}}) + b"\n"
        for i in range(n))


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=10)


def counts(c: openai.OpenAI, batch_id: str) -> Any:
    """The batch, or None while its gateway or Redis cannot answer."""
    try:
        return c.batches.retrieve(batch_id)
    except (openai.APIConnectionError, openai.InternalServerError):
        return None


def finished(c: openai.OpenAI, batch_id: str, deadline_s: float = 120.0) -> Any:
    return poll(lambda: (b := counts(c, batch_id)) is not None and b.status in (
        "completed", "failed", "expired", "cancelled") and b, deadline_s=deadline_s,
        interval_s=0.1)


def assert_one_result_per_line(c: openai.OpenAI, batch: Any, n: int = 50) -> None:
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed,
            batch.request_counts.failed) == (n, n, 0)
    assert batch.error_file_id is None
    lines = [orjson.loads(x) for x in c.files.content(batch.output_file_id).content.splitlines()]
    ids = [x["custom_id"] for x in lines]
    assert len(ids) == n and set(ids) == {f"line-{i}" for i in range(n)}
    assert all(x["response"]["status_code"] == 200 for x in lines)


def metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def batch_replicas(url: str) -> list[str]:
    stats = httpx.get(url + "/admin/stats", timeout=10).json()
    pool = next(p for p in stats["pools"] if p["name"] == "batch")
    return [r["url"] for r in pool["replicas"]]


def set_failing(replica_urls: list[str], failing: bool) -> None:
    """Simulated replicas that answer 503 (or heal): lines wait, the batch stands still."""
    for u in replica_urls:
        httpx.post(u + ("/sim/fail" if failing else "/sim/recover"), timeout=10)


def group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    # What is left may be zombies only: exited, waiting for their new parent (init, which
    # may reap orphans only now and then) to reap them.
    return all(state == "Z" for state in group_states(pgid))


def group_states(pgid: int) -> list[str]:
    """The state letter (R, S, Z...) of each process in group `pgid`; ["?"] where /proc
    cannot tell."""
    proc = Path("/proc")
    if not proc.is_dir():
        return ["?"]
    states = []
    for stat in proc.glob("[0-9]*/stat"):
        try:
            # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid:
            states.append(fields[0])
    return states


def test_a_batch_survives_sigkill_of_the_whole_gateway_and_completes_once(tmp_path) -> None:
    """The check of the issue: `prefix-gateway up --redis-url`, a 50-line batch from the
    openai client, the gateway's whole process group killed with SIGKILL mid-batch, `up`
    again with the same arguments: exactly 50 results, one per custom_id."""
    redis = RedisServer(tmp_path / "redis")
    redis.start()
    port = processes.consecutive_free_ports(1)  # bound late: below the ephemeral range
    url = f"http://127.0.0.1:{port}"
    args = [sys.executable, "-m", "gateway.cli", "up", "--port", str(port), "--redis-url",
            redis.url, "--realtime-replicas", "1", "--batch-replicas", "2",
            "--batch-concurrency", "4", "--batch-lease-s", "3", "--time-scale", "1",
            "--log-dir", str(tmp_path)]

    def up(n: int) -> subprocess.Popen:
        with open(tmp_path / f"up-{n}.log", "ab") as log:
            # Its own process group: the kill below reaches the gateway and its replicas.
            proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        processes.wait_healthy([url], [proc], deadline_s=90, path="/ready")
        return proc

    first = up(1)
    second = None
    try:
        c = client(url)
        f = c.files.create(file=("fifty.jsonl", batch_file(max_tokens=8)), purpose="batch")
        batch = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                 completion_window="24h")
        poll(lambda: c.batches.retrieve(batch.id).request_counts.completed >= 1,
             deadline_s=60, interval_s=0.02)
        # Hold the batch where it is (its replicas refuse from now on), so the kill surely
        # lands mid-batch, with lines in flight or waiting under this gateway's leases.
        set_failing(batch_replicas(url), True)
        done = c.batches.retrieve(batch.id).request_counts.completed
        assert 1 <= done < 50
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
        poll(lambda: group_gone(first.pid), deadline_s=30)

        second = up(2)
        final = finished(client(url), batch.id)
        assert_one_result_per_line(client(url), final)
        assert final.completed_at >= final.in_progress_at
    finally:
        for proc in (first, second):
            if proc is not None and not group_gone(proc.pid):
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=30)
        redis.stop()
    logs = (tmp_path / "up-1.log").read_text() + (tmp_path / "up-2.log").read_text()
    assert logs.count(f"Redis {redis.url} in use") == 2


def test_two_gateways_sharing_redis_run_every_line_exactly_once(tmp_path, redis_server) -> None:
    sims = start_sims(["vllm", "trtllm", "trtllm"], tmp_path, time_scale=0.2)
    batch_urls = sims.urls[1:]
    redis_cfg = redis_server.config()
    configs = {}
    for name, port in zip(("gw-a", "gw-b"), processes.free_ports(2), strict=True):
        cfg = configs[name] = two_pool_config(sims.urls[:1], batch_urls, port)
        cfg["redis"] = redis_cfg
        cfg["batch"] = {"concurrency": 4, "poll_interval_s": 0.2}
    gateways: list[Gateway] = []
    try:
        gateways = start_gateways(configs, tmp_path)
        a, b = (g.url for g in gateways)
        # Until both gateways hold lines, nothing can finish: each claims its share first.
        set_failing(batch_urls, True)
        c = client(a)
        f = c.files.create(file=("fifty.jsonl", batch_file(max_tokens=8)), purpose="batch")
        batch = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                 completion_window="24h")
        poll(lambda: all(metric(u, "gateway_batch_lines_in_flight") == 4 for u in (a, b)),
             deadline_s=30)
        set_failing(batch_urls, False)

        final = finished(client(b), batch.id)
        assert_one_result_per_line(client(b), final)
        ran = [metric(u, "gateway_batch_lines_total", result="completed") for u in (a, b)]
        assert sum(ran) == 50 and min(ran) >= 4
        assert [metric(u, "gateway_batch_lines_total", result="superseded") for u in (a, b)] \
            == [0, 0]
        # What the replicas themselves saw: 50 requests answered, one per line.
        answered = sum(httpx.get(u + "/sim/state", timeout=10).json()["request_success"]
                       for u in batch_urls)
        assert answered == 50
    finally:
        for g in gateways:
            g.stop()
        sims.stop()


def test_a_batch_pauses_while_redis_restarts_and_completes_with_nothing_lost(
        tmp_path) -> None:
    redis = RedisServer(tmp_path / "redis")
    redis.start()
    sims = start_sims(["vllm", "trtllm", "trtllm"], tmp_path, time_scale=1.0)
    gw = None
    try:
        cfg = two_pool_config(sims.urls[:1], sims.urls[1:], processes.free_ports(1)[0])
        cfg["redis"] = {"url": redis.url, "timeout_s": 1}
        cfg["batch"] = {"concurrency": 4, "poll_interval_s": 0.2}
        gw = start_gateway(cfg, tmp_path)
        c = client(gw.url)
        f = c.files.create(file=("fifty.jsonl", batch_file(max_tokens=8)), purpose="batch")
        batch = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                 completion_window="24h")
        poll(lambda: c.batches.retrieve(batch.id).request_counts.completed >= 1,
             deadline_s=60, interval_s=0.02)

        redis.stop()
        # The Batch API says "later"; plain serving goes on; the lines that were running
        # finish and their results wait in the gateway until Redis is back.
        try:
            c.batches.retrieve(batch.id)
            raise AssertionError("the Batch API answered without its Redis")
        except openai.InternalServerError as exc:
            assert exc.status_code == 503 and exc.code == "redis_unavailable"
        reply = c.chat.completions.create(model="tiny", max_tokens=2,
                                          messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.content
        poll(lambda: metric(gw.url, "gateway_redis_up") == 0
             and metric(gw.url, "gateway_batch_lines_in_flight") == 0, deadline_s=30)
        assert metric(gw.url, "gateway_batch_results_unwritten") >= 1

        redis.start()
        final = finished(c, batch.id)
        assert_one_result_per_line(c, final)
        assert metric(gw.url, "gateway_redis_up") == 1
        assert metric(gw.url, "gateway_batch_results_unwritten") == 0
    finally:
        if gw is not None:
            gw.stop()
        sims.stop()
        redis.stop()
    log = gw.log()
    assert log.count("is not reachable now") == 1, log[-3000:]
    assert log.count("is reachable again") == 1, log[-3000:]
