"""The HTTP server's limits, over raw sockets to a real gateway process: silent, slow and
oversize requests, malformed ones, connection floods at the descriptor limit, bind failures
and SIGHUP (a reload)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from gateway import processes
from tests.conftest import Gateway, Sims, poll, start_gateway, start_sims

# Long enough for a loaded CI machine to connect and send a request, short enough for a test.
SHORT_S = 0.5


def config(url: str, port: int, **server) -> dict:
    return {
        "server": {"host": "127.0.0.1", "port": port, **server},
        "pools": [{"name": "rt", "engine": "vllm", "models": ["tiny"],
                   "replicas": [{"name": "rt-0", "url": url}],
                   "health": {"interval_s": 0.2, "timeout_s": 1, "failure_threshold": 1}}],
        "traffic_classes": [{"name": "realtime", "pool": "rt"}],
        "classification": {"default_class": "realtime"},
    }


@pytest.fixture(scope="module")
def sim(tmp_path_factory) -> Iterator[Sims]:
    sims = start_sims(["vllm"], tmp_path_factory.mktemp("sim"))
    yield sims
    sims.stop()


@pytest.fixture(scope="module")
def gw(sim: Sims, tmp_path_factory) -> Iterator[Gateway]:
    """A gateway with short read and idle timeouts."""
    tmp = tmp_path_factory.mktemp("gw")
    port = processes.free_ports(1)[0]
    gateway = start_gateway(config(sim.urls[0], port, header_timeout_s=SHORT_S,
                                   body_timeout_s=SHORT_S, keepalive_timeout_s=SHORT_S), tmp)
    yield gateway
    gateway.stop()


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    # A deadline on every read: a server that never answers fails the test, never hangs it.
    sock.settimeout(30)
    return sock


def read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def parse(raw: bytes) -> tuple[int, dict[str, str], dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, json.loads(body)


def assert_openai_error(raw: bytes, status: int, code: str) -> dict:
    got, headers, body = parse(raw)
    assert got == status, raw[:300]
    assert headers["content-type"] == "application/json"
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == code
    return body["error"]


def test_a_connection_that_sends_nothing_is_closed(gw: Gateway) -> None:
    with connect(gw.url) as sock:
        assert read_all(sock) == b""


def test_headers_that_never_end_get_408(gw: Gateway) -> None:
    with connect(gw.url) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nX-Slow: ")
        assert_openai_error(read_all(sock), 408, "request_timeout")


def test_a_body_shorter_than_its_content_length_gets_408(gw: Gateway) -> None:
    with connect(gw.url) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: "
                     b"application/json\r\nContent-Length: 100\r\n\r\n{\"model\": ")
        assert_openai_error(read_all(sock), 408, "request_timeout")


def test_an_idle_kept_alive_connection_is_closed(gw: Gateway) -> None:
    with connect(gw.url) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n")
        raw = read_all(sock)  # the answer, then the close once the connection idled
        assert raw.startswith(b"HTTP/1.1 200 ") and raw.endswith(b'{"status":"ok"}')


@pytest.mark.parametrize("extra", [
    b"X-Big: " + b"a" * 20000 + b"\r\n",
    b"".join(b"X-%d: 1\r\n" % i for i in range(150)),
    b"X-Big: " + b"a" * 40000,  # never ends
], ids=["20kB-header", "150-headers", "40kB-unfinished"])
def test_oversize_request_heads_get_431(gw: Gateway, extra: bytes) -> None:
    with connect(gw.url) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: gw\r\n" + extra + b"\r\n")
        assert_openai_error(read_all(sock), 431, "request_header_fields_too_large")


@pytest.mark.parametrize("request_head", [
    b"GARBAGE\r\n\r\n",
    b"GET /health HTTP/1.1\r\nBad Header: x\r\n\r\n",
    b"GET /he\x01alth HTTP/1.1\r\nHost: gw\r\n\r\n",
    b"GET /health HTTP/9.9\r\nHost: gw\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: abc\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: 1\r\nContent-Length: 2"
    b"\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
], ids=["request-line", "header-token", "url-char", "version", "content-length",
        "two-content-lengths", "chunk-size"])
def test_malformed_requests_get_an_openai_400(gw: Gateway, request_head: bytes) -> None:
    with connect(gw.url) as sock:
        sock.sendall(request_head)
        error = assert_openai_error(read_all(sock), 400, "malformed_request")
        assert error["message"].startswith("Malformed HTTP request")


def limited_to(fds: int):
    """Prefixes a command so that it runs with at most `fds` file descriptors."""
    shim = ("import os, resource, sys; "
            f"resource.setrlimit(resource.RLIMIT_NOFILE, ({fds}, {fds})); "
            "os.execv(sys.argv[1], sys.argv[1:])")
    return lambda cmd: [sys.executable, "-c", shim, *cmd]


@pytest.fixture(scope="module")
def limited_gw(sim: Sims, tmp_path_factory) -> Iterator[tuple[str, subprocess.Popen]]:
    """A gateway with 256 file descriptors, shared by the floods (each closes its own)."""
    port = processes.free_ports(1)[0]
    # Timeouts far longer than the test: only shedding can make room for the new client.
    cfg = config(sim.urls[0], port, header_timeout_s=600, keepalive_timeout_s=600)
    url, proc, _ = processes.start_gateway(cfg, tmp_path_factory.mktemp("limited"),
                                           wrap=limited_to(256), deadline_s=30)
    yield url, proc
    processes.stop_all([proc])


@pytest.mark.parametrize("flood", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\n"],
                         ids=["idle", "slowloris"])
def test_new_clients_are_served_during_a_flood_at_the_descriptor_limit(
        limited_gw: tuple[str, subprocess.Popen], flood: bytes) -> None:
    url, proc = limited_gw
    flooders: list[socket.socket] = []
    try:
        # More connections than the process has descriptors for.
        for _ in range(300):
            sock = connect(url)
            if flood:
                sock.sendall(flood)
            flooders.append(sock)
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=30)
        done = client.completions.create(model="tiny", prompt="hello", max_tokens=2)
        assert done.choices[0].text
        for sock in flooders:
            sock.setblocking(False)

        def closed(sock: socket.socket) -> bool:
            try:
                sock.recv(1, socket.MSG_PEEK)  # the 503 of a shed connection, or its end
            except BlockingIOError:
                return False
            return True

        # The oldest connections made room (the gateway allows (256 - 64) / 2 = 96).
        poll(lambda: sum(closed(s) for s in flooders) >= 300 - 96)
        assert proc.poll() is None
    finally:
        for sock in flooders:
            sock.close()


def test_a_port_in_use_fails_with_a_clear_error_and_no_serving_line(sim: Sims,
                                                                     tmp_path: Path) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    path = tmp_path / "gw.yaml"
    path.write_text(json.dumps(config(sim.urls[0], port)))
    try:
        r = subprocess.run([sys.executable, "-m", "gateway.cli", "serve", "--config", str(path)],
                           capture_output=True, text=True, timeout=60)
    finally:
        taken.close()
    assert r.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in r.stderr
    assert "serving on" not in r.stdout + r.stderr


def test_serving_on_is_printed_once_listening(gw: Gateway) -> None:
    assert f"serving on {gw.url}" in gw.log()


def test_sighup_reloads_the_configuration_with_a_log_line(gw: Gateway) -> None:
    """SIGHUP never kills the gateway: it reloads the file (unchanged here), and says so."""
    gw.proc.send_signal(signal.SIGHUP)
    poll(lambda: "(SIGHUP): no replica changed" in gw.log(), deadline_s=15)
    assert "configuration reloaded from" in gw.log() and "NOT applied" not in gw.log()
    assert gw.proc.poll() is None
    assert httpx.get(gw.url + "/health", timeout=10).json() == {"status": "ok"}
