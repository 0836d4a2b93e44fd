"""`prefix-gateway serve --workers N`: worker processes sharing one port under a supervising
process (real processes and real simulated replicas); and how /metrics and /admin/stats
merge the workers' figures."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import psutil
import pytest

from gateway import processes
from gateway.metrics import GatewayMetrics
from gateway.stats import render_table
from gateway.workerview import dump_metrics, merge_metrics, merge_stats
from tests.conftest import ROOT, Gateway, Sims, poll, start_gateway, start_sims
from tests.test_reload_process import config, padded, write_unseen

WORKERS = 2


@pytest.fixture(scope="module")
def sims(tmp_path_factory) -> Iterator[Sims]:
    # Real-time simulated replicas: a stream of 400 tokens lasts about 8 s (21 ms a token).
    s = start_sims(["vllm", "vllm"], tmp_path_factory.mktemp("sims"), time_scale=1.0)
    yield s
    s.stop()


def workers_config(port: int, replicas: dict[str, str]) -> dict:
    cfg = config(port, replicas)
    cfg["server"]["workers"] = WORKERS
    return cfg


@pytest.fixture
def gw(sims: Sims, tmp_path) -> Iterator[Gateway]:
    port = processes.free_ports(1)[0]
    g = start_gateway(workers_config(port, {"rt-0": sims.urls[0]}), tmp_path)
    g.config_path.write_text(padded(workers_config(port, {"rt-0": sims.urls[0]})))
    # /ready answers once a worker serves; "serving on" is printed once every worker does.
    poll(lambda: "(2 workers)" in g.log(), deadline_s=30)
    poll(lambda: len(worker_pids(g)) == WORKERS, deadline_s=15)
    yield g
    g.stop()


def test_workers_without_redis_are_not_told_to_share_their_prefixes(gw: Gateway) -> None:
    # They share them through their directory now (gateway/workerprefixes.py): the warning
    # that each kept its own prefix index (3.8x one worker's mean TTFT near saturation) went.
    assert "(2 workers)" in gw.log()
    assert "no shared routing state" not in gw.log()


def stats(gw: Gateway) -> dict:
    r = httpx.get(gw.url + "/admin/stats", timeout=10)
    assert r.status_code == 200
    return r.json()


def worker_pids(gw: Gateway) -> dict[int, int]:
    """Each live worker's pid -> requests it finished."""
    return {w["pid"]: w["requests"] for w in stats(gw)["workers"]}


def complete(gw: Gateway, prompt: str) -> None:
    # httpx.post opens a new connection each time: any worker may accept it.
    r = httpx.post(gw.url + "/v1/completions", timeout=30,
                   json={"model": "tiny", "prompt": prompt, "max_tokens": 1})
    assert r.status_code == 200, r.text


def requests_total(gw: Gateway) -> float:
    text = httpx.get(gw.url + "/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("gateway_requests_total{"))


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def serve_both(gw: Gateway) -> int:
    """Send requests until each worker finished one; how many were sent."""
    sent = 0

    def both_served() -> bool:
        nonlocal sent
        complete(gw, f"hello {sent} " * 20)
        sent += 1
        counts = worker_pids(gw)
        return len(counts) == WORKERS and all(counts.values())

    poll(both_served, deadline_s=60, interval_s=0)
    return sent


def test_workers_share_the_port_and_metrics_cover_them_all(gw: Gateway) -> None:
    pids = worker_pids(gw)
    assert len(pids) == WORKERS
    for pid in pids:
        assert parent_of(pid) == gw.proc.pid  # forked by the supervisor, not the gateway itself
    sent = serve_both(gw)
    assert set(worker_pids(gw)) == set(pids)
    # Every worker's requests are counted, whichever worker answers the scrape.
    poll(lambda: requests_total(gw) == sent, deadline_s=15)
    assert sum(worker_pids(gw).values()) == sent
    rt0 = next(r for p in stats(gw)["pools"] for r in p["replicas"] if r["name"] == "rt-0")
    assert rt0["requests"] == sent
    # The admin API would change one worker only: refused, the file is the way.
    r = httpx.post(gw.url + "/admin/pools/rt/replicas", timeout=10,
                   json={"name": "rt-9", "url": "http://127.0.0.1:9"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "several_workers"

    # A worker killed: another takes its place, and the counts it had stay in the sums.
    poll(lambda: requests_total(gw) == sent, deadline_s=15)
    victim = min(pids)
    os.kill(victim, signal.SIGKILL)
    poll(lambda: f"worker {victim} (slot" in gw.log() and "was killed by SIGKILL" in gw.log(),
         deadline_s=15)
    poll(lambda: len(now := worker_pids(gw)) == WORKERS and victim not in now, deadline_s=30)
    replacement = (set(worker_pids(gw)) - set(pids)).pop()
    poll(lambda: re.search(rf"worker {replacement} \(slot \d\) serving", gw.log()),
         deadline_s=15)
    assert requests_total(gw) == sent
    before = sent
    sent += serve_both(gw)
    assert sent > before
    poll(lambda: requests_total(gw) == sent, deadline_s=15)
    assert gw.proc.poll() is None


def test_sighup_reloads_every_worker(gw: Gateway, sims: Sims) -> None:
    pids = worker_pids(gw)
    port = int(gw.url.rsplit(":", 1)[1])
    # A change the file watch cannot see: only SIGHUP, passed on to each worker, applies it.
    write_unseen(gw.config_path, padded(workers_config(port, {"rt-0": sims.urls[0],
                                                              "rt-1": sims.urls[1]})))
    gw.proc.send_signal(signal.SIGHUP)
    for pid in pids:
        poll(lambda pid=pid: f"[worker {pid}] configuration reloaded from "
             f"{gw.config_path} (SIGHUP): rt/rt-1 added" in gw.log(), deadline_s=15)
    poll(lambda: {r["name"] for p in stats(gw)["pools"] for r in p["replicas"]
                  if r["healthy"]} == {"rt-0", "rt-1"}, deadline_s=15)
    assert worker_pids(gw).keys() == pids.keys()  # reloaded, not restarted
    assert gw.proc.poll() is None


def stream(url: str, results: list, i: int) -> None:
    try:
        with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": f"stream {i} " * 40, "max_tokens": 400,
                "stream": True}) as r:
            body = b"".join(r.iter_bytes())
        results.append((r.status_code, body))
    except httpx.HTTPError as exc:
        results.append((0, repr(exc).encode()))


def busy_every_worker(gw: Gateway, results: list, threads: list[threading.Thread]) -> None:
    """Start streams, one at a time, until each worker holds one and every stream started is
    in flight (none still connecting): a new stream only once the last one has arrived."""
    def both_busy() -> bool:
        workers = stats(gw)["workers"]
        inflight = sum(w["inflight"] for w in workers)
        if inflight == len(threads) - len(results) and len(workers) == WORKERS and all(
                w["inflight"] for w in workers):
            return True
        if len(threads) - len(results) <= inflight:
            t = threading.Thread(target=stream, args=(gw.url, results, len(threads)))
            t.start()
            threads.append(t)
        return False

    poll(both_busy, deadline_s=30, interval_s=0.2)


def test_sigterm_stops_every_worker_after_their_requests(gw: Gateway) -> None:
    pids = worker_pids(gw)
    results: list = []
    threads: list[threading.Thread] = []
    busy_every_worker(gw, results, threads)
    assert not results, "the streams should still be running when SIGTERM is sent"
    gw.proc.send_signal(signal.SIGTERM)
    assert gw.proc.wait(timeout=60) == 0
    for t in threads:
        t.join(timeout=60)
    assert len(results) == len(threads)
    for status, body in results:
        assert status == 200, body
        assert body.rstrip().endswith(b"data: [DONE]"), body[-200:]
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or _zombie_or_gone(pid)
    for pid in pids:
        assert f"prefix_gateway.supervisor worker {pid} stopped" in gw.log()
    assert gw.log().rstrip().endswith("every worker stopped")


def _zombie_or_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_port_in_use_exits_1_with_one_error(sims: Sims, tmp_path: Path) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    path = tmp_path / "gw.yaml"
    path.write_text(padded(workers_config(port, {"rt-0": sims.urls[0]})))
    try:
        proc = subprocess.run([sys.executable, "-m", "gateway.cli", "serve", "--config",
                               str(path), "--workers", "2"], capture_output=True, text=True,
                              timeout=60, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    finally:
        taken.close()
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert errors == [f"prefix-gateway: cannot listen on 127.0.0.1:{port}: Address already "
                      "in use"], proc.stderr
    assert "serving on" not in proc.stdout
    assert "Started server process" not in proc.stdout + proc.stderr  # no worker started


FAILING = """
import sys
from gateway.supervisor import Supervisor
def worker(directory, serving):
    raise RuntimeError("this worker cannot start")
sys.exit(Supervisor(2, worker, "prefix-gateway: serving on nowhere").run())
"""


def test_workers_failing_to_start_end_the_gateway_with_status_1() -> None:
    proc = subprocess.run([sys.executable, "-c", FAILING], capture_output=True, text=True,
                          timeout=60, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 1
    assert proc.stderr.count("prefix-gateway: workers keep failing to start (3 in a row") == 1
    assert "RuntimeError: this worker cannot start" in proc.stderr
    assert "serving on" not in proc.stdout


# Merging the workers' figures ------------------------------------------------------------------

def _metrics(requests: float, inflight: float, up: float, ttft: float) -> dict:
    m = GatewayMetrics()
    m.requests.inc(("p", "r", "c", "200"), requests)
    m.inflight.set(("p", "r"), inflight)
    m.replica_up.set(("p", "r"), up)
    m.ttft.observe(("p", "r", "c"), ttft)
    return orjson.loads(orjson.dumps(dump_metrics(m)))


def test_merged_metrics_sum_counters_histograms_and_held_gauges() -> None:
    own = _metrics(3, 1, 1, 0.01)
    live = _metrics(5, 2, 0, 0.3)
    dead = _metrics(7, 4, 0, 30.0)
    m = merge_metrics(own, [live], [dead])
    assert m.requests.values[("p", "r", "c", "200")] == 15  # a dead worker's count stays
    assert m.inflight.values[("p", "r")] == 3  # live workers' in flight; a dead one's dropped
    assert m.replica_up.values[("p", "r")] == 1  # a replica's state: the answering worker's
    row = m.ttft.rows[("p", "r", "c")]
    assert sum(row[:-1]) == 3 and row[-1] == pytest.approx(30.31)
    text = m.registry.collect()
    names = {f.name for f in text}
    assert "gateway_requests" in names and "gateway_time_to_first_token_seconds" in names


def _stats(requests: int, inflight: int, hits: int, misses: int, ttfts: list[float],
           decisions: dict[str, int]) -> dict:
    replica = {"name": "r", "healthy": True, "engine_hit_ratio": None, "inflight": inflight,
               "pending_prefill_tokens": 10 * inflight,
               "requests": requests, "errors": 0, "estimated_hit_ratio": None,
               "ttft_p50_s": None, "ttft_p95_s": None}
    return {"snapshot": {"pools": [{"name": "p", "engine": "vllm", "policy": "prefix_affinity",
                                    "models": ["tiny"], "prefill_tokens_per_s": None,
                                    "prefill_rate_learned": False,
                                    "traffic_classes": {"c": requests},
                                    "decisions_by_reason": decisions, "replicas": [replica]}],
                         "admission": {"classes": [], "pools": []}},
            "replicas": {"r": [hits, misses, ttfts]}, "queue_waits": {}}


def test_merged_stats_cover_every_live_worker() -> None:
    merged = merge_stats(1, {1: _stats(2, 1, 3, 1, [0.1, 0.2], {"affinity": 2}),
                             2: _stats(4, 2, 1, 3, [0.3, 0.4, 0.5, 0.6], {"cold": 4})})
    pool = merged["pools"][0]
    r = pool["replicas"][0]
    assert (r["requests"], r["inflight"], r["pending_prefill_tokens"]) == (6, 3, 30)
    assert r["estimated_hit_ratio"] == 0.5
    assert r["ttft_p50_s"] == 0.4 and r["ttft_p95_s"] == 0.6
    assert pool["decisions_by_reason"] == {"affinity": 2, "cold": 4}
    assert pool["traffic_classes"] == {"c": 6}
    assert merged["worker_pid"] == 1
    assert merged["workers"] == [{"pid": 1, "requests": 2, "inflight": 1},
                                 {"pid": 2, "requests": 4, "inflight": 2}]
    assert render_table(merged).startswith(
        "workers: 2 (pid 1: 2 requests, 1 in flight, pid 2: 4 requests, 2 in flight)\n")


def test_one_worker_is_one_process_as_before(sims: Sims, tmp_path: Path) -> None:
    port = processes.free_ports(1)[0]
    g = start_gateway(config(port, {"rt-0": sims.urls[0]}), tmp_path)
    try:
        complete(g, "one process " * 20)
        assert psutil.Process(g.proc.pid).children() == []  # no supervisor, no worker
        body = stats(g)
        assert "workers" not in body and "worker_pid" not in body
        assert "workers)" not in g.log()
        r = httpx.post(g.url + "/admin/pools/rt/replicas", timeout=10,
                       json={"name": "rt-1", "url": sims.urls[1]})
        assert r.status_code == 201  # the admin API changes the one process's replicas
    finally:
        g.stop()


def test_a_worker_rewrites_its_file_when_any_figure_moved(tmp_path: Path) -> None:
    from gateway.config import GatewayConfig
    from gateway.defaults import one_pool_config
    from gateway.state import GatewayState
    from gateway.workerview import WorkerView

    state = GatewayState(GatewayConfig.model_validate(one_pool_config(
        ["http://127.0.0.1:9", "http://127.0.0.1:10"], 8080)))
    view = WorkerView(tmp_path, state)
    inflight = state.metrics.inflight
    inflight.set(("default", "replica-0"), 1)
    inflight.set(("default", "replica-1"), 0)
    view.write()
    assert view.signature() == view.written  # nothing moved: the periodic write skips
    # A request moved from one replica to another: the total is the same, the file is not.
    inflight.set(("default", "replica-0"), 0)
    inflight.set(("default", "replica-1"), 1)
    assert view.signature() != view.written
    state.metrics.requests.inc(("default", "replica-0", "default", "200"))
    view.write()
    on_disk = orjson.loads((tmp_path / f"{os.getpid()}.json").read_bytes())
    assert [["default", "replica-0", "default", "200"], 1.0] in \
        on_disk["metrics"]["gateway_requests"]
    assert view.signature() == view.written
    state.metrics.requests.inc(("default", "replica-0", "default", "200"))
    assert view.signature() != view.written


def test_each_worker_routes_on_the_others_requests_in_flight_too(gw: Gateway) -> None:
    """Without Redis, each worker's router counted only its own requests in flight: N
    workers could each fill a replica up to the load bound. Now each sees the others'."""
    results: list = []
    threads: list[threading.Thread] = []
    busy_every_worker(gw, results, threads)

    def others_seen() -> bool:
        # Whichever worker answers, the other holds streams in flight on the one replica.
        (replica,) = stats(gw)["pools"][0]["replicas"]
        return replica["other_gateways_inflight"] >= 1

    poll(others_seen, deadline_s=20, interval_s=0.05)
    for t in threads:
        t.join(timeout=60)
    assert all(status == 200 for status, _ in results)


def test_a_prefix_either_worker_routed_is_in_every_workers_index(gw: Gateway) -> None:
    """Each worker kept its own prefix index: a conversation's next turn reaching the other
    worker was routed as a cold prefix (near saturation, 3.8x one worker's mean TTFT). Now
    each worker's index holds the prefixes every worker routed."""
    blocks_each = 4  # 1,024 characters: four whole blocks of 256
    sent = 0

    def both_served() -> bool:
        nonlocal sent
        complete(gw, f"{sent:04d} shared-prefix test ".ljust(256 * blocks_each, "x"))
        sent += 1
        counts = worker_pids(gw)
        return len(counts) == WORKERS and all(counts.values())

    poll(both_served, deadline_s=60, interval_s=0)
    held: dict[int, int] = {}

    def every_worker_holds_all() -> bool:
        answer = stats(gw)  # a new connection: either worker answers
        (replica,) = answer["pools"][0]["replicas"]
        held[answer["worker_pid"]] = replica["index_blocks"]
        return len(held) == WORKERS and set(held.values()) == {blocks_each * sent}

    poll(every_worker_holds_all, deadline_s=20, interval_s=0.05)

    def shared(direction: str) -> float:
        text = httpx.get(gw.url + "/metrics", timeout=10).text
        prefix = f'gateway_shared_state_inserts_total{{direction="{direction}",pool="rt"}}'
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith(prefix))

    # Every decision published by one worker and applied by the other (the sums of both).
    poll(lambda: shared("published") == shared("applied") == sent, deadline_s=20)

    # A worker killed: its replacement holds what it had placed (it read them only from the
    # living workers' files, and routed them cold), and the dead one's file goes once the
    # replacement serves. The survivor keeps what it applied.
    import tempfile
    roots = {Path("/dev/shm"), Path(tempfile.gettempdir())}
    files = {p.name: p for root in roots if root.is_dir() for pid in held
             for p in root.glob(f"prefix-gateway-workers-*/{pid}.prefixes")}
    assert set(files) == {f"{pid}.prefixes" for pid in held}
    victim = min(held)
    os.kill(victim, signal.SIGKILL)
    poll(lambda: not files[f"{victim}.prefixes"].exists(), deadline_s=15)
    assert files[f"{max(held)}.prefixes"].exists()
    replaced: dict[int, int] = {}

    def replacement_holds_all() -> bool:
        answer = stats(gw)
        if answer["worker_pid"] not in held:
            (replica,) = answer["pools"][0]["replicas"]
            replaced[answer["worker_pid"]] = replica["index_blocks"]
        return set(replaced.values()) == {blocks_each * sent}

    poll(replacement_holds_all, deadline_s=30, interval_s=0.05)
    retired = files[f"{victim}.prefixes"].with_name(f"{victim}.prefixes-retired")
    poll(lambda: not retired.exists(), deadline_s=15)


def test_worker_loads_sum_the_other_workers_and_forget_a_gone_one(tmp_path: Path) -> None:
    from gateway.config import GatewayConfig
    from gateway.defaults import one_pool_config
    from gateway.state import GatewayState
    from gateway.workerload import WorkerLoad
    from routing.types import Decision

    def state() -> GatewayState:
        return GatewayState(GatewayConfig.model_validate(one_pool_config(
            ["http://127.0.0.1:9", "http://127.0.0.1:10"], 8080)))

    a, b, c = state(), state(), state()
    la, lb, lc = (WorkerLoad(tmp_path, s, pid=pid) for s, pid in ((a, 1), (b, 2), (c, 3)))
    for s, sent in ((a, (10.0, 11.0)), (b, (5.0,))):
        for at in sent:
            s.pools[0].router.dispatched(Decision("replica-0", "cold", 0, 1, 100.0), at)
    now = 1000.0
    for w in (la, lb, lc):
        w.tick(now)
    for w in (la, lb, lc):
        w._listed_at = -10.0  # list the directory again: every worker's file is there now
        w.tick(now)
    # Summed, and the oldest request of theirs (B's, sent at 5.0) is what C and A see.
    assert c.pools[0].router.load.remote == {"replica-0": (3, 300.0, 300.0, 0, 5.0, 0, 3)}
    assert a.pools[0].router.load.remote == {"replica-0": (1, 100.0, 100.0, 0, 5.0, 0, 1)}
    assert a.pools[0].router.load.inflight == {"replica-0": 2}  # its own stay its own
    view = c.pools[0].router.load.view("replica-0")
    assert (view.inflight, view.pending_prefill_tokens) == (3, 300.0)
    lb.remove()  # B stopped: C forgets its load at once
    lc.tick(now + 0.1)
    assert c.pools[0].router.load.remote == {"replica-0": (2, 200.0, 200.0, 0, 10.0, 0, 2)}
    # A dies without a word: its file stops being rewritten, and ages out.
    lc.tick(now + lc.ttl_s + 1)
    assert c.pools[0].router.load.remote == {}


# Where the workers' files live ---------------------------------------------------------------

@pytest.mark.skipif(not os.access("/dev/shm", os.W_OK), reason="no writable /dev/shm")
def test_the_workers_files_live_on_a_memory_filesystem_and_go_with_the_gateway(
        gw: Gateway) -> None:
    """On a disk filesystem each replacement of a worker's load file (up to 40 a second
    under load) cost 90-130 us of CPU and blocked the worker's loop for 1-2 ms."""
    pids = worker_pids(gw)
    found = poll(lambda: [p for pid in pids
                          for p in Path("/dev/shm").glob(f"prefix-gateway-workers-*/{pid}.json")],
                 deadline_s=15)
    directory = found[0].parent
    assert {p.parent for p in found} == {directory} and len(found) == WORKERS
    gw.proc.send_signal(signal.SIGTERM)
    assert gw.proc.wait(timeout=60) == 0
    assert not directory.exists()


def test_the_workers_directory_falls_back_to_the_temporary_directory() -> None:
    import tempfile

    from gateway.supervisor import shared_dir

    made = Path(shared_dir(("/nonexistent-memory-dir",)))
    try:
        assert made.parent == Path(tempfile.gettempdir())
        assert made.name.startswith("prefix-gateway-workers-")
        assert made.stat().st_mode & 0o777 == 0o700  # private to the gateway's user
    finally:
        made.rmdir()


# How often the workers look at each other's load ----------------------------------------------

def _load_state():
    from gateway.config import GatewayConfig
    from gateway.defaults import one_pool_config
    from gateway.state import GatewayState

    return GatewayState(GatewayConfig.model_validate(one_pool_config(
        ["http://127.0.0.1:9", "http://127.0.0.1:10"], 8080)))


def _dispatch(state, n: int = 1, sent_at: float = 1000.0) -> None:
    """What a request starting in a worker does to its load (gateway/attempt.py)."""
    from routing.types import Decision

    for _ in range(n):
        state.pools[0].router.dispatched(Decision("replica-0", "cold", 0, 1, 100.0), sent_at)
        state.observer.inflight("default", "replica-0", 1)


def test_idle_workers_look_at_each_others_load_once_a_second_busy_ones_every_25_ms(
        tmp_path: Path) -> None:
    """An idle worker woke 40 times a second to find nothing changed: about as much CPU as
    its health checks, scrapes and server together."""
    from gateway.workerload import IDLE_INTERVAL_S, INTERVAL_S, WorkerLoad

    a, b = _load_state(), _load_state()
    la, lb = WorkerLoad(tmp_path, a, pid=1), WorkerLoad(tmp_path, b, pid=2)
    for w in (la, lb):
        w.tick(1000.0)
    assert IDLE_INTERVAL_S >= 1.0
    assert la.pause_s() == lb.pause_s() == IDLE_INTERVAL_S
    _dispatch(b)  # B has a request in flight: both look as often as before
    assert lb.pause_s() == INTERVAL_S
    lb.tick(1000.0)
    la._listed_at = -10.0
    la.tick(1000.0)
    assert la.pause_s() == INTERVAL_S
    assert a.pools[0].router.load.remote == {"replica-0": (1, 100.0, 100.0, 0, 1000.0, 0, 1)}


async def test_an_idle_workers_first_request_wakes_its_load_sharing_at_once(
        tmp_path: Path) -> None:
    import asyncio

    from gateway.workerload import WorkerLoad
    from tests.conftest import eventually

    a = _load_state()
    la = WorkerLoad(tmp_path, a, pid=1, idle_interval_s=3600.0)
    task = asyncio.create_task(la.run())
    try:
        # Idle: waiting an hour, listening for its first request.
        await eventually(lambda: a.observer.load_moved is not None)
        assert not la.path.exists()
        _dispatch(a, 2)
        assert a.observer.load_moved is None  # woken once; the rest costs nothing
        await eventually(la.path.exists)
        written = orjson.loads(la.path.read_bytes())["p"]
        # Two requests awaiting a first token, none passed through (`LoadTracker.own_load`).
        assert written == {"default": {"replica-0": [2, 200.0, 200.0, 0, 1000.0, 0, 2]}}
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert a.observer.load_moved is None


async def test_an_idle_workers_first_decision_sees_the_others_latest_prefixes(
        tmp_path: Path) -> None:
    """An idle worker looked at the others once a second: its first request after a pause
    (the next turn of a conversation another worker placed) was routed without what they
    decided since."""
    import asyncio

    from gateway.workerload import WorkerLoad
    from gateway.workerprefixes import WorkerPrefixes
    from tests.conftest import eventually

    a, b = _load_state(), _load_state()
    la = WorkerLoad(tmp_path, a, pid=1, prefixes=WorkerPrefixes(tmp_path, a.pools, a.observer,
                                                                 pid=1))
    lb = WorkerLoad(tmp_path, b, pid=2, idle_interval_s=3600.0,
                    prefixes=WorkerPrefixes(tmp_path, b.pools, b.observer, pid=2))
    task = asyncio.create_task(lb.run())
    try:
        await eventually(lambda: b.observer.before_route is not None)
        a.pools[0].router.record("replica-0", [41, 42, 43], 30.0)
        la.tick()
        index = b.pools[0].router.indexes["replica-0"]
        assert index.match([41, 42, 43]) == 0  # B idles for an hour
        b.observer.before_route()  # as the gateway does before routing a request
        assert index.match([41, 42, 43]) == 3
        assert b.observer.before_route is None and b.observer.load_moved is None
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_woken_worker_still_ticks_no_sooner_than_an_interval_after_the_last(
        tmp_path: Path) -> None:
    """Each request of a worker at a low rate found it idle again: without a floor it ticked
    once per request (100 times a second at 100 requests a second), more than when busy."""
    import asyncio

    from gateway.workerload import WorkerLoad
    from tests.conftest import eventually

    a = _load_state()
    la = WorkerLoad(tmp_path, a, pid=1, interval_s=3600.0, idle_interval_s=7200.0)
    ticks: list[int] = []
    la.tick = lambda now=None: ticks.append(1)  # type: ignore[method-assign]
    task = asyncio.create_task(la.run())
    try:
        await eventually(lambda: a.observer.load_moved is not None)
        _dispatch(a)
        assert a.observer.load_moved is None
        for _ in range(50):  # many turns of the loop: the tick waits for its interval
            await asyncio.sleep(0)
        assert ticks == []
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


SLEEPING = """
import os, signal, sys, time
from gateway.supervisor import Supervisor

def worker(directory, serving):
    serving()
    signal.pause()

sup = Supervisor(2, worker, "serving")
timeouts = []
select = sup.sel.select
def recorded(timeout=None):
    if sup.stopping is None:  # stopping, it polls for the workers' exits on a deadline
        timeouts.append(timeout)
    return select(timeout)
sup.sel.select = recorded
code = sup.run()
print("timeouts", sorted({repr(t) for t in timeouts}), flush=True)
sys.exit(code)
"""


def test_the_supervisor_sleeps_until_something_happens() -> None:
    """It woke twice a second to find nothing to do; signals and its workers' pipes wake
    it."""
    proc = subprocess.Popen([sys.executable, "-c", SLEEPING], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "serving (2 workers)"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "timeouts ['None']" in out, out
