"""Replica faults only real sockets show: a stopped process, a kept-alive connection closed
under a request, a connect that times out. The rest of failover is tested in-process
(tests/test_gateway.py)."""

from __future__ import annotations

import contextlib
import socket
import threading

import httpx
import openai
import pytest

from gateway import processes
from gateway.defaults import one_pool_config
from tests.conftest import Sims, poll, start_gateway, start_sims, two_pool_config


def start_small_fleet(tmp_path, probe_interval_s: float = 0.2):
    """Two realtime replicas and one batch replica behind a gateway; the first replica in a
    process of its own (`sims.procs[0]`), to stop it alone."""
    alone = start_sims(["vllm"], tmp_path)
    try:
        rest = start_sims(["vllm", "trtllm"], tmp_path)
    except Exception:
        alone.stop()
        raise
    sims = Sims(alone.urls + rest.urls, alone.kinds + rest.kinds, alone.procs + rest.procs)
    port = processes.free_ports(1)[0]
    config = two_pool_config(sims.urls[:2], sims.urls[2:], port)
    for pool in config["pools"]:
        pool["health"]["interval_s"] = probe_interval_s
    try:
        return start_gateway(config, tmp_path), sims
    except Exception:
        sims.stop()
        raise


@pytest.fixture
def small_fleet(tmp_path):
    # Slow probes: a failure must be noticed by the request path itself, not by the prober.
    gw, sims = start_small_fleet(tmp_path, probe_interval_s=30)
    yield gw, sims
    gw.stop()
    sims.stop()


def replica_up(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    out = {}
    for line in text.splitlines():
        if line.startswith("gateway_replica_up{"):
            name = line.split('replica="')[1].split('"')[0]
            out[name] = float(line.rsplit(" ", 1)[1])
    return out


def test_stopped_replica_process_is_survived(small_fleet) -> None:
    gw, sims = small_fleet
    processes.stop_all([sims.procs[0]])
    c = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    # Every request succeeds: connection refused on rt-0 is retried on rt-1 at once.
    for i in range(8):
        raw = c.chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": f"q{i} " * 100}], max_tokens=1)
        assert raw.headers["x-gateway-replica"] == "rt-1"


@pytest.mark.parametrize("client", ["httptools", "aiohttp"])
def test_keepalive_connection_closed_by_the_replica_is_retried_on_a_fresh_one(
        tmp_path, client: str) -> None:
    # Engines close idle keep-alive connections (vLLM and trtllm-serve after 5 s); a request
    # that reuses one at that moment must not fail, nor take a working replica out.
    sims = start_sims(["vllm"], tmp_path)
    port = processes.free_ports(1)[0]
    config = one_pool_config(sims.urls, port, health={"interval_s": 30, "metrics_interval_s": 30},
                             server={"upstream_client": client})
    gw = start_gateway(config, tmp_path)
    try:
        c = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        c.completions.create(model="tiny", prompt="warm the connection pool", max_tokens=1)
        for stream in (False, True):
            assert httpx.post(sims.urls[0] + "/sim/drop_reused", json={"count": 1}).json() \
                == {"drop_reused": 1}
            raw = c.completions.with_raw_response.create(model="tiny", prompt="reuse it",
                                                         max_tokens=2, stream=stream)
            assert raw.status_code == 200
            if stream:
                assert list(raw.parse())
            # The replica did drop a reused connection, and the gateway kept it in rotation.
            assert httpx.get(sims.urls[0] + "/sim/state").json()["drop_reused"] == 0
            assert replica_up(gw.url)["replica-0"] == 1
        metrics = httpx.get(gw.url + "/metrics").text
        assert 'gateway_connection_resends_total{pool="default",replica="replica-0"} 2.0' \
            in metrics
    finally:
        gw.stop()
        sims.stop()


class StalledListener:
    """A replica address whose connects hang (its accept queue is full) until `open()`, after
    which it forwards every connection to a real replica: what a client of a machine too busy
    to accept sees."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.server = socket.socket()
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(0)
        self.port = self.server.getsockname()[1]
        # One connection nobody accepts fills a backlog of 0: later SYNs are dropped.
        self.filler = socket.create_connection(("127.0.0.1", self.port))
        self.thread: threading.Thread | None = None

    def open(self) -> None:
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.server.accept()
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
                for src, dst in ((conn, upstream), (upstream, conn)):
                    threading.Thread(target=_pipe, args=(src, dst), daemon=True).start()

    def close(self) -> None:
        self.filler.close()
        self.server.close()


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := src.recv(65536):
            dst.sendall(data)
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)


def test_connect_timeout_to_the_only_replica_is_tried_once_more(tmp_path) -> None:
    # On a CPU-starved machine a connect can time out to a replica that is fine. With no other
    # replica to try, the gateway tries the same one again rather than answering 502.
    sims = start_sims(["vllm"], tmp_path)
    stalled = StalledListener(int(sims.urls[0].rsplit(":", 1)[1]))
    port = processes.free_ports(1)[0]
    # The kernel resends an unanswered SYN 1 s and 3 s after the first: a connect timeout of
    # 4 s lets the second try connect on either resend, whenever the listener opens in time.
    config = one_pool_config([f"http://127.0.0.1:{stalled.port}"], port,
                             server={"connect_timeout_s": 4.0, "max_attempts": 3},
                             health={"interval_s": 30, "timeout_s": 0.2,
                                     "metrics_interval_s": 30})
    # Not /ready: the stalled replica's probe timed out, so no replica is healthy; it is only a
    # suspect, which the gateway still routes to when nothing better is left.
    gw = start_gateway(config, tmp_path, ready_path="/health")
    result: dict[str, object] = {}

    def ask() -> None:
        c = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=60)
        raw = c.completions.with_raw_response.create(model="tiny", prompt="hello", max_tokens=2)
        result["status"] = raw.status_code

    client = threading.Thread(target=ask)
    try:
        client.start()

        def first_connect_timed_out() -> bool:
            pool = httpx.get(gw.url + "/admin/stats").json()["pools"][0]
            return "ConnectionTimeoutError" in (pool["replicas"][0]["last_error"] or "")

        poll(first_connect_timed_out, deadline_s=30)
        stalled.open()  # the second try's SYN is resent by the kernel and now accepted
        client.join(60)
        assert result == {"status": 200}
        metrics = httpx.get(gw.url + "/metrics").text
        assert 'gateway_retries_total{pool="default",replica="replica-0"} 1.0' in metrics
    finally:
        stalled.close()
        gw.stop()
        sims.stop()
