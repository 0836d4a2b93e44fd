"""The helpers every benchmark shares: metrics parsing, statistics, tables, cache reset."""

from __future__ import annotations

import json
import math
import shutil
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from loadtests.caches import reset_prefix_caches
from loadtests.fleet import MODEL, Fleet
from loadtests.metrics import (
    ENGINE_TTFT,
    HITS,
    QUERIES,
    RUNNING,
    SUCCESS,
    WAITING,
    labelled_values,
    parse_sums,
    scrape_sync,
    wait_idle,
)
from loadtests.report import cell, markdown_table, median_range, text_table
from loadtests.sse import data_events_sync
from loadtests.stats import bucket_bound, max_over_mean, median, nearest_rank, percentile
from tests.conftest import ROOT, poll


def test_parse_sums_adds_series_and_ignores_comments() -> None:
    text = (
        "# HELP vllm:prefix_cache_hits_total x\n"
        'vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 128.0\n'
        'vllm:prefix_cache_hits_total{engine="1",model_name="tiny"} 256.0\n'
        "vllm:prefix_cache_queries_total 1000.0\n"
        "vllm:prefix_cache_queries_total_created 1.7e9\n"
        "vllm:num_requests_waiting not-a-number\n"
    )
    got = parse_sums(text, (HITS, QUERIES, WAITING))
    assert got == {HITS: 384.0, QUERIES: 1000.0, WAITING: 0.0}


def test_percentile_interpolates_between_ranks() -> None:
    values = [4.0, 1.0, 3.0, 2.0]  # unsorted on purpose
    assert percentile(values, 0.0) == 1.0
    assert percentile(values, 0.5) == 2.5
    assert percentile(values, 0.9) == pytest.approx(3.7)
    assert percentile(values, 1.0) == 4.0
    assert percentile([], 0.5) is None
    assert percentile([], 0.5, 0.0) == 0.0


def test_nearest_rank_takes_a_sample_without_interpolating() -> None:
    values = [float(x) for x in range(1, 11)]
    assert nearest_rank(values, 0.5) == 6.0
    assert nearest_rank(values, 0.99) == 10.0
    assert math.isnan(nearest_rank([], 0.5))


def test_bucket_bound_is_the_bound_of_the_bucket_holding_the_quantile() -> None:
    bounds = (0.01, 0.05, 0.1, float("inf"))
    cumulative = [1, 5, 9, 10]  # as Prometheus exposes a histogram's buckets
    assert bucket_bound(bounds, cumulative, 0.5) == 0.05  # the 5th of 10 is in (0.01, 0.05]
    assert bucket_bound(bounds, cumulative, 0.9) == 0.1
    assert bucket_bound(bounds, cumulative, 0.99) == float("inf")
    assert bucket_bound(bounds, [0, 0, 0, 0], 0.5) is None


def test_median_and_imbalance() -> None:
    assert median([3.0, None, 1.0, 2.0]) == 2.0
    assert median([None]) is None
    assert max_over_mean([2, 1, 0]) == 2.0
    assert max_over_mean([0, 0], 0.0) == 0.0
    assert max_over_mean([]) is None


def test_tables() -> None:
    assert markdown_table(["a", "b"], [["1", "-"]], align="lr") == (
        "| a | b |\n|---|---:|\n| 1 | - |\n")
    assert text_table(["name", "x"], [["ab", "10.5"]]) == "name  x   \nab    10.5"
    assert cell(None) == "-"
    assert cell(0.12345) == "0.123"
    assert median_range([0.3, None, 0.1, 0.2], "{:.1f}".format) == "0.2 (0.1-0.3)"
    assert median_range([None], "{:.1f}".format) == "-"


class _Replica(BaseHTTPRequestHandler):
    """POST /reset_prefix_cache answers from the server's script, then its last answer."""

    server: _ScriptedReplica

    def do_POST(self) -> None:
        self.server.posts += 1
        script = self.server.script
        body = script[min(self.server.posts, len(script)) - 1]
        self.send_response(200 if self.path == "/reset_prefix_cache" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


class _ScriptedReplica(ThreadingHTTPServer):
    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Replica)
        self.script: list[bytes] = [b""]
        self.posts = 0
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def replica() -> Iterator[_ScriptedReplica]:
    server = _ScriptedReplica()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


NO, YES = json.dumps({"success": False}).encode(), json.dumps({"success": True}).encode()


def test_reset_retries_until_the_engine_reports_success(replica: _ScriptedReplica) -> None:
    replica.script = [NO, NO, YES]  # vLLM: false while requests still hold blocks
    reset_prefix_caches([replica.url], poll_s=0.01)
    assert replica.posts == 3


def test_reset_accepts_an_empty_200(replica: _ScriptedReplica) -> None:
    replica.script = [b""]  # the simulated replica's answer
    reset_prefix_caches([replica.url, replica.url])
    assert replica.posts == 2


def test_reset_names_the_replica_that_never_succeeds(replica: _ScriptedReplica) -> None:
    replica.script = [NO]
    with pytest.raises(RuntimeError, match=f"{replica.url}: /reset_prefix_cache"):
        reset_prefix_caches([replica.url], deadline_s=0.2, poll_s=0.01)


def test_sse_yields_each_events_data_until_done() -> None:
    lines = [b": keep-alive\n", b"data: {\"a\": 1}\n", b"\n", b"event: x\n", b"data:{}\n",
             b"data: [DONE]\n", b"data: after\n"]
    assert list(data_events_sync(lines)) == [b'{"a": 1}', b"{}"]


def test_labelled_values_reads_each_series_with_its_labels() -> None:
    text = (
        "# TYPE gateway_requests_total counter\n"
        'gateway_requests_total{pool="rt",replica="r-0",traffic_class="batch",status="200"} 3.0\n'
        'gateway_requests_total{pool="rt",replica="r-1",traffic_class="realtime",status="429"} 1\n'
        "gateway_requests_total_created 1.7e9\n"
        "gateway_requests 5\n"
        "other_total 9\n"
    )
    got = labelled_values(text, "gateway_requests_total")
    assert got == [
        ({"pool": "rt", "replica": "r-0", "traffic_class": "batch", "status": "200"}, 3.0),
        ({"pool": "rt", "replica": "r-1", "traffic_class": "realtime", "status": "429"}, 1.0),
    ]
    assert labelled_values("plain_total 2\n", "plain_total") == [({}, 2.0)]


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")
def test_fleet_redis_answers_and_stops_with_the_fleet() -> None:
    fleet = Fleet()
    try:
        url = fleet.start_redis()
        host_port = url.removeprefix("redis://").split("/")[0]
        port = int(host_port.split(":")[1])
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"SET k v\r\nGET k\r\n")
            got = b""
            while got.count(b"\r\n") < 3:
                got += s.recv(64)
        assert got == b"+OK\r\n$1\r\nv\r\n"
        (proc,) = fleet.procs
    finally:
        fleet.stop()
    assert proc.poll() is not None


def test_a_simulated_trtllm_fleet_is_read_and_emptied_as_a_vllm_one() -> None:
    # Benchmarks read trtllm-serve's Prometheus page under vLLM's names (its /metrics is the
    # gateway's to drain), and empty the simulated engine's cache through its control path.
    fleet = Fleet()
    try:
        (url,) = fleet.start_sims(1, 512_000, "llama-8b-h200", time_scale=1.0,
                                  engine="trtllm")

        def ask(max_tokens: int = 2) -> None:
            body = json.dumps({"model": MODEL, "prompt": "the same words again " * 100,
                               "max_tokens": max_tokens}).encode()
            req = urllib.request.Request(url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                assert r.status == 200

        names = (HITS, QUERIES, SUCCESS, ENGINE_TTFT + "_count")
        ask()
        ask()
        warm = scrape_sync(url, names, engine="trtllm")
        assert warm[SUCCESS] == 2 and warm[ENGINE_TTFT + "_count"] == 2
        assert 0 < warm[HITS] < warm[QUERIES]  # the second prompt found the first's blocks
        reset_prefix_caches([url], engine="trtllm")
        ask()
        cold = scrape_sync(url, names, engine="trtllm")
        assert cold[QUERIES] > warm[QUERIES] and cold[HITS] == warm[HITS]
        # A long answer in flight: read as running, and waited for until it is done.
        long = threading.Thread(target=ask, args=(300,))
        long.start()
        try:
            assert poll(lambda: scrape_sync(url, (RUNNING,), engine="trtllm")[RUNNING] == 1)
            wait_idle([url], engine="trtllm", deadline_s=60, poll_s=0.05)
            assert scrape_sync(url, (SUCCESS,), engine="trtllm")[SUCCESS] == 4
        finally:
            long.join(timeout=60)
    finally:
        fleet.stop()


def test_count_read_cost_reads_a_replica_and_its_server_cpu(tmp_path, capsys) -> None:
    from loadtests.count_read_cost import main as count_read_cost
    from tests.conftest import start_sims

    sims = start_sims(["vllm"], tmp_path)
    try:
        assert count_read_cost(["--url", sims.urls[0], "--pid", str(sims.procs[0].pid),
                                "--reads", "20"]) == 0
    finally:
        sims.stop()
    rows = dict(line.strip("|").split("|")[:2] for line in capsys.readouterr().out.splitlines()
                if line.startswith("| ") and not line.startswith("| measure"))
    rows = {k.strip(): v.strip() for k, v in rows.items()}
    assert rows["page"].endswith("lines") and float(rows["page"].split()[0]) > 0
    # Given the server's pid, its CPU per read is read (without, the row says "-").
    assert float(rows["API server CPU ms per read"]) >= 0.0
    p50, p99 = (float(x) for x in rows["read latency p50 / p99 ms"].split(" / "))
    assert 0.0 < p50 <= p99
    for row in ("prometheus_client: the whole page parsed ms", "gateway: a scrape's scan ms",
                "gateway: first-token scan (between scrapes) ms"):
        assert float(rows[row]) > 0.0


def test_worker_share_cost_times_both_sides_and_every_decision_crosses(capsys) -> None:
    from loadtests import worker_share_cost

    small = worker_share_cost.measure(100.0, 4, 40, 4)
    big = worker_share_cost.measure(100.0, 64, 40, 4)
    assert small["decisions"] == 100  # 40 ticks of 25 ms at 100 a second
    assert small["applied"] == small["decisions"] == big["applied"]
    assert big["bytes_per_decision"] > 4 * small["bytes_per_decision"]
    assert small["writer_us_per_tick"] > 0 and small["reader_us_per_tick"] > 0
    worker_share_cost.main(["--blocks", "8", "--ticks", "20", "--replicas", "2"])
    out = capsys.readouterr().out
    assert "100 decisions/s, 2 replicas, 20 ticks of 25 ms" in out
    assert out.splitlines()[-1].startswith("| 8 | ")


SIGTERM_IN_A_CALLBACK = """
import asyncio, os, signal, sys
from loadtests.fleet import run_async, sigterm_as_interrupt

class Client(asyncio.Protocol):
    def data_received(self, data):
        # The signal's Python handler runs here, inside the event loop's transport callback,
        # where a benchmark's client spends most of its time.
        os.kill(os.getpid(), signal.SIGTERM)

async def main():
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Server(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    await loop.create_connection(Client, "127.0.0.1", port)
    await asyncio.sleep(20)  # the deadline: interrupted long before, or not at all
    return "ran on"

class Server(asyncio.Protocol):
    def connection_made(self, transport):
        transport.write(b"x")

with sigterm_as_interrupt():
    try:
        print(run_async(main()))
    except KeyboardInterrupt:
        print("interrupted")
"""


def test_sigterm_interrupts_a_benchmarks_event_loop_wherever_it_lands() -> None:
    # A benchmark stops its engines in `finally` blocks: SIGTERM must unwind run_async. Raised
    # from a signal handler inside uvloop's transport callback, KeyboardInterrupt was reported
    # as a fatal transport error and the run went on (vllm_bench kept its engines running).
    out = subprocess.run([sys.executable, "-c", SIGTERM_IN_A_CALLBACK], capture_output=True,
                         text=True, timeout=60, cwd=str(ROOT))
    assert out.stdout.strip() == "interrupted", out.stderr[-2000:]
