"""Fault injection against real processes: a gateway process in front of simulated replica
processes on loopback, replicas killed (SIGKILL) or frozen (SIGSTOP) under requests.

Health checks are slowed to 30 s in these gateways, so whatever takes a replica out of rotation
here is the request path itself (failover, ejection, the stall watch), not the prober.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from gateway import processes
from tests.conftest import Gateway, Sims, poll, start_gateway, start_sims

SLOW_PROBES = {"interval_s": 30, "timeout_s": 1, "failure_threshold": 1,
               "metrics_interval_s": 30}


def config(urls: list[str], port: int, **pool) -> dict:
    return {
        "server": {"host": "127.0.0.1", "port": port, "max_attempts": 2},
        "pools": [{"name": "rt", "engine": "vllm", "models": ["tiny"],
                   "replicas": [{"name": f"r{i}", "url": u} for i, u in enumerate(urls)],
                   "health": SLOW_PROBES, **pool}],
        "traffic_classes": [{"name": "rt", "pool": "rt"}],
        "classification": {"default_class": "rt"},
    }


@pytest.fixture(scope="module")
def replicas(tmp_path_factory) -> Iterator[Sims]:
    """Two replicas at real speed with a slow CPU engine's profile (a long prompt takes
    seconds of prefill), each its own process, shared by the tests of this module: a test that
    kills one leaves it to the next test's `fleet` to start again."""
    sims = start_sims(["vllm", "vllm"], tmp_path_factory.mktemp("replicas"), time_scale=1.0,
                      profile="vllm-cpu-tiny", separate=True)
    yield sims
    thaw(sims)
    sims.stop()


def thaw(sims: Sims) -> None:
    for p in sims.procs:  # a frozen replica must be thawed to be stopped
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)


@pytest.fixture
def fleet(replicas: Sims, tmp_path: Path) -> Iterator[tuple[Gateway, Sims]]:
    """The two replicas, both running, idle and plain (no fault set, nothing cached), and a
    gateway of this test's own."""
    thaw(replicas)
    for i, url in enumerate(replicas.urls):
        replicas.revive(i)
        for control, body in (("/sim/recover", None), ("/sim/garbage", {"mode": "off"}),
                              ("/sim/drop_reused", {"count": 0}), ("/reset_prefix_cache", None)):
            assert httpx.post(url + control, json=body, timeout=5).status_code == 200
    # What an earlier test left running there (streams of clients gone) ends first.
    poll(lambda: all(idle(sim_state(u)) for u in replicas.urls), deadline_s=30)
    gw = start_gateway(config(replicas.urls, processes.free_ports(1)[0]), tmp_path)
    yield gw, replicas
    gw.stop()


def sim_state(url: str) -> dict:
    return httpx.get(url + "/sim/state", timeout=5).json()


def idle(state: dict) -> bool:
    return state["running"] == 0 and state["waiting"] == 0


def replica_stats(gw: Gateway) -> dict[str, dict]:
    stats = httpx.get(gw.url + "/admin/stats", timeout=5).json()
    return {r["name"]: r for p in stats["pools"] for r in p["replicas"]}


def client(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", max_retries=0, timeout=120)


def long_prompt(tag: str) -> str:
    """About 8,000 tokens: seconds of prefill on the simulated CPU engine."""
    return f"{tag}: " + " ".join(f"clause {i} of a long unique document" for i in range(900))


@pytest.mark.parametrize("stream", [True, False])
def test_a_replica_killed_during_prefill_costs_no_request(fleet, stream: bool) -> None:
    gw, sims = fleet
    result: dict = {}

    def ask() -> None:
        raw = client(gw).chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": long_prompt(str(stream))}],
            max_tokens=8, stream=stream)
        if stream:
            text = "".join(ch.choices[0].delta.content or "" for ch in raw.parse()
                           if ch.choices)
        else:
            text = raw.parse().choices[0].message.content
        result.update(replica=raw.headers["x-gateway-replica"], text=text)

    asker = threading.Thread(target=ask)
    asker.start()
    # The replica now prefilling it is killed: nothing has reached the client yet.

    def prefilling() -> tuple[int] | None:
        for i, url in enumerate(sims.urls):
            if sim_state(url)["pending_prefill_tokens"] > 0:
                return (i,)
        return None

    (victim,) = poll(prefilling, deadline_s=30)
    sims.procs[victim].kill()
    asker.join(timeout=120)
    assert result["text"] and result["replica"] == f"r{1 - victim}"


def test_a_replica_killed_during_a_long_prefill_under_load_costs_no_client_its_request(
        fleet) -> None:
    """Twelve clients at once, long and short prompts, streaming and not; the replica busy
    prefilling a long one is killed. No request that had received no content is lost: every
    non-streaming one is answered, and a stream fails only if content had reached its client
    before (it then ends with an error event)."""
    gw, sims = fleet
    outcomes: dict[int, tuple[str, bool, str]] = {}
    """request -> (replica, content received before any error, error or '')."""

    def ask(i: int) -> None:
        stream, long = i % 2 == 0, i % 3 == 0
        content = long_prompt(f"load {i}") if long else f"request {i}: say something"
        got, replica = False, ""
        try:
            raw = client(gw).chat.completions.with_raw_response.create(
                model="tiny", messages=[{"role": "user", "content": content}],
                max_tokens=40, stream=stream)
            replica = raw.headers["x-gateway-replica"]
            if stream:
                for ch in raw.parse():
                    got = got or bool(ch.choices and ch.choices[0].delta.content)
            else:
                got = bool(raw.parse().choices[0].message.content)
            outcomes[i] = (replica, got, "")
        except openai.APIError as exc:
            outcomes[i] = (replica, got, f"{type(exc).__name__}: {exc}")

    askers = [threading.Thread(target=ask, args=(i,)) for i in range(12)]
    for t in askers:
        t.start()

    def prefilling_under_load() -> tuple[int] | None:
        states = [sim_state(u) for u in sims.urls]
        for i, st in enumerate(states):
            if st["pending_prefill_tokens"] > 1000 and st["running"] + st["waiting"] >= 2:
                return (i,)
        return None

    (victim,) = poll(prefilling_under_load, deadline_s=30)
    sims.procs[victim].kill()
    for t in askers:
        t.join(timeout=120)
    assert len(outcomes) == 12
    lost = {i: o for i, o in outcomes.items() if o[2] and not o[1]}
    assert not lost, f"requests failed with no content received: {lost}"
    for i, (replica, got, error) in outcomes.items():
        if i % 2:  # non-streaming: never anything sent before the answer, so always answered
            assert got and not error, (i, outcomes[i])
        if error:  # only a stream that was already under way on the victim may fail
            assert i % 2 == 0 and replica == f"r{victim}", (i, outcomes[i])
    assert any(r == f"r{1 - victim}" for r, _, _ in outcomes.values())


def test_a_replica_killed_mid_stream_ends_the_stream_and_leaves_rotation(fleet) -> None:
    gw, sims = fleet
    raw = client(gw).completions.with_raw_response.create(
        model="tiny", prompt="write a long story", max_tokens=3000, stream=True)
    victim = int(raw.headers["x-gateway-replica"][1:])
    chunks = iter(raw.parse())
    assert [next(chunks) for _ in range(5)]
    sims.procs[victim].kill()
    with pytest.raises(openai.APIError, match="failed mid-stream"):
        for _ in chunks:
            pass
    assert replica_stats(gw)[f"r{victim}"]["healthy"] is False
    metrics = httpx.get(gw.url + "/metrics").text
    assert (f'gateway_replica_ejections_total{{pool="rt",reason="broken",replica="r{victim}"}} '
            "1.0") in metrics
    # New requests go to the replica left, at once.
    for i in range(3):
        again = client(gw).completions.with_raw_response.create(
            model="tiny", prompt=f"another {i}", max_tokens=2)
        assert again.headers["x-gateway-replica"] == f"r{1 - victim}"


def test_a_frozen_replica_leaves_rotation_and_new_requests_are_served(fleet) -> None:
    gw, sims = fleet
    stop = threading.Event()
    failures: list[BaseException] = []

    def load(i: int) -> None:
        c = client(gw)
        n = 0
        while not stop.is_set():
            n += 1
            try:
                # Closed when left early: an open stream would hold its gateway's shutdown.
                with c.completions.create(model="tiny", prompt=f"user {i} turn {n} " * 20,
                                          max_tokens=200, stream=True) as chunks:
                    for _ in chunks:
                        if stop.is_set():
                            break
            except openai.APIError as exc:  # a stream cut on the frozen replica: expected
                if "mid-stream" not in str(exc):
                    failures.append(exc)

    threads = [threading.Thread(target=load, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    try:
        poll(lambda: all(sim_state(u)["running"] > 0 for u in sims.urls), deadline_s=30)
        victim = 0
        os.kill(sims.procs[victim].pid, signal.SIGSTOP)
        # Out of rotation before this deadline, although its health checks run every 30 s.
        poll(lambda: replica_stats(gw)["r0"]["healthy"] is False, deadline_s=5)
        # New requests are all served by the other replica while it is frozen.
        for i in range(5):
            raw = client(gw).completions.with_raw_response.create(
                model="tiny", prompt=f"while frozen {i}", max_tokens=2)
            assert raw.headers["x-gateway-replica"] == "r1"
        assert "stalled" in replica_stats(gw)["r0"]["last_error"]
    finally:
        os.kill(sims.procs[0].pid, signal.SIGCONT)
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert failures == []


@pytest.mark.parametrize("mode", ["html", "malformed_sse"])
def test_a_replica_answering_garbage_costs_no_request_and_is_ejected(fleet, mode: str) -> None:
    gw, sims = fleet
    assert httpx.post(sims.urls[0] + "/sim/garbage", json={"mode": mode}).status_code == 200
    c = client(gw)
    served = set()
    for i in range(12):
        stream = i % 2 == 0
        raw = c.chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": f"question {i} " * 30}],
            max_tokens=3, stream=stream)
        if stream:
            text = "".join(ch.choices[0].delta.content or "" for ch in raw.parse() if ch.choices)
        else:
            text = raw.parse().choices[0].message.content
        assert text  # a whole answer, whichever replica was tried first
        served.add(raw.headers["x-gateway-replica"])
    assert served == {"r1"}
    metrics = httpx.get(gw.url + "/metrics").text
    assert 'gateway_tries_failed_total{pool="rt",reason="read",replica="r0"}' in metrics
    # Garbage in a row is an outlier, although the replica's health checks pass.
    assert ('gateway_replica_ejections_total{pool="rt",reason="consecutive_failures",'
            'replica="r0"} 1.0') in metrics


def test_a_replica_too_slow_for_first_byte_s_is_left_for_one_that_answers(tmp_path) -> None:
    # r0 is 10,000 times slower than r1: its first token takes far longer than first_byte_s,
    # r1's (milliseconds) far shorter. Each try left for that timeout costs its length.
    sims = start_sims(["vllm", "vllm"], tmp_path, time_scale=[200.0, 0.02],
                      profile="vllm-cpu-tiny")
    try:
        cfg = config(sims.urls, processes.free_ports(1)[0], timeouts={"first_byte_s": 0.5})
        gw = start_gateway(cfg, tmp_path)
        try:
            c = client(gw)
            for i in range(8):
                raw = c.completions.with_raw_response.create(
                    model="tiny", prompt=f"prompt {i} " * 40, max_tokens=2, stream=i % 2 == 0)
                assert raw.headers["x-gateway-replica"] == "r1"
            metrics = httpx.get(gw.url + "/metrics").text
            assert ('gateway_tries_failed_total{pool="rt",reason="first_byte_timeout",'
                    'replica="r0"}') in metrics
        finally:
            gw.stop()
    finally:
        sims.stop()
