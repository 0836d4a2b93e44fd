"""The prefixes and rates the workers of `serve --workers N` share through files when no Redis
shares routing state (gateway/workerprefixes.py), on real files, in process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gateway.config import GatewayConfig
from gateway.defaults import one_pool_config
from gateway.state import GatewayState
from gateway.workerload import WorkerLoad
from gateway.workerprefixes import WorkerPrefixes, prefixes_path, retired_path
from routing.steps import POOL_RATE_KEY


def state(pin_running: bool = False, output_cached: bool = False) -> GatewayState:
    config = one_pool_config(["http://127.0.0.1:9", "http://127.0.0.1:10"], 8080)
    config.setdefault("routing", {}).update(pin_running=pin_running,
                                            output_cached=output_cached)
    return GatewayState(GatewayConfig.model_validate(config))


def worker(tmp_path: Path, pid: int, pin_running: bool = False, output_cached: bool = False,
           **kw) -> tuple[GatewayState, WorkerPrefixes]:
    s = state(pin_running, output_cached)
    return s, WorkerPrefixes(tmp_path, s.pools, s.observer, pid=pid, **kw)


def held(s: GatewayState, replica: str, hashes: list[int]) -> int:
    return s.pools[0].router.indexes[replica].match(hashes)


def counted(s: GatewayState, direction: str) -> float:
    return s.metrics.shared_inserts.values.get(("default", direction), 0)


def peers(directory: Path, own: WorkerPrefixes) -> list[str]:
    return [str(p) for p in directory.glob("*.prefixes") if p != own.path]


def test_a_prefix_one_worker_routes_is_held_by_the_others(tmp_path: Path) -> None:
    """Each worker kept its own prefix index: a conversation's next turn reaching another
    worker was routed as a cold prefix (3.8x one worker's mean TTFT near saturation)."""
    a, wa = worker(tmp_path, 1)
    b, wb = worker(tmp_path, 2)
    c, wc = worker(tmp_path, 3)
    a.pools[0].router.record("replica-1", [11, 12, 13], 300.0)
    b.pools[0].router.record("replica-0", [21, 22], 200.0)
    assert held(b, "replica-1", [11, 12, 13]) == 0
    for w in (wa, wb, wc):
        w.write()
    for w in (wa, wb, wc):
        w.read(peers(tmp_path, w))
    assert held(b, "replica-1", [11, 12, 13]) == 3
    assert held(c, "replica-1", [11, 12, 13]) == 3 and held(c, "replica-0", [21, 22]) == 2
    assert held(a, "replica-0", [21, 22]) == 2
    assert held(a, "replica-1", [21, 22]) == 0  # where it went, not elsewhere
    # Counted as the shared routing state counts them, on each side.
    assert counted(a, "published") == 1 and counted(c, "applied") == 2
    # Read once: nothing is applied twice.
    wc.read(peers(tmp_path, wc))
    assert counted(c, "applied") == 2


def test_a_worker_started_later_reads_what_the_others_decided(tmp_path: Path) -> None:
    a, wa = worker(tmp_path, 1)
    for i in range(5):
        a.pools[0].router.record("replica-0", [100 + i, 200 + i], 10.0)
        wa.write()
    late, wl = worker(tmp_path, 2)
    wl.read(peers(tmp_path, wl))
    assert all(held(late, "replica-0", [100 + i, 200 + i]) == 2 for i in range(5))
    # Decided before it began: not observed as the sharing's lag.
    assert late.metrics.shared_lag.rows == {}


def test_a_dead_workers_prefixes_reach_its_replacement_and_not_the_others_twice(
        tmp_path: Path) -> None:
    """The supervisor deleted a dead worker's file: its replacement read only the living
    workers', and routed cold every prefix the dead one had placed."""
    dead, wd = worker(tmp_path, 1)
    survivor, ws = worker(tmp_path, 2)
    dead.pools[0].router.record("replica-1", [31, 32, 33], 300.0)
    wd.write()
    ws.read(peers(tmp_path, ws))
    assert counted(survivor, "applied") == 1
    # One more decision written after the survivor's last read, then dead: the supervisor
    # renames its file (Supervisor._retire).
    dead.pools[0].router.record("replica-0", [41, 42], 200.0)
    wd.write()
    os.replace(prefixes_path(tmp_path, 1), retired_path(tmp_path, 1))
    replacement, wr = worker(tmp_path, 3)
    wr.read(peers(tmp_path, wr))
    assert held(replacement, "replica-1", [31, 32, 33]) == 3
    assert held(replacement, "replica-0", [41, 42]) == 2
    assert counted(replacement, "applied") == 2
    # The survivor reads the file it held open to its end as it drops it: the last decision
    # too, and the first not again. Nor does the replacement apply any twice.
    ws.read(peers(tmp_path, ws))
    assert held(survivor, "replica-0", [41, 42]) == 2
    ws.read(peers(tmp_path, ws))
    wr.read(peers(tmp_path, wr))
    assert counted(survivor, "applied") == 2 and counted(replacement, "applied") == 2


def test_a_file_started_again_loses_nothing(tmp_path: Path) -> None:
    """Past `max_bytes` a worker starts a new file; a reader finishes the old one first."""
    a, wa = worker(tmp_path, 1, max_bytes=200)
    b, wb = worker(tmp_path, 2)
    started, size = 0, 0
    for i in range(40):
        a.pools[0].router.record("replica-1", [1000 + i, 2000 + i, 3000 + i], 5.0)
        wa.write()
        started += os.path.getsize(wa.path) < size
        size = os.path.getsize(wa.path)
        if i % 2:  # the reader reads every other write, across the new files
            wb.read(peers(tmp_path, wb))
    wb.read(peers(tmp_path, wb))
    assert started > 10  # the file was started again, many times
    assert os.path.getsize(wa.path) <= 200
    assert all(held(b, "replica-1", [1000 + i, 2000 + i, 3000 + i]) == 3 for i in range(40))
    assert counted(b, "applied") == 40
    assert len(os.listdir(tmp_path)) == 1  # no temporary file left behind


def test_a_line_half_written_waits_for_its_end(tmp_path: Path) -> None:
    b, wb = worker(tmp_path, 2)
    path = prefixes_path(tmp_path, 1)
    line = b'{"d":{"default":[["replica-0",1.0,[7,8,9],0.0]]}}\n'
    path.write_bytes(line[:20])
    wb.read([str(path)])
    assert held(b, "replica-0", [7, 8, 9]) == 0
    with path.open("ab") as f:
        f.write(line[20:])
    wb.read([str(path)])
    assert held(b, "replica-0", [7, 8, 9]) == 3
    # A line it cannot read (a worker of another version, a torn file) is skipped.
    with path.open("ab") as f:
        f.write(b"not json\n" + line.replace(b"[7,8,9]", b"[4,5]"))
    wb.read([str(path)])
    assert held(b, "replica-0", [4, 5]) == 2


def test_rates_are_shared_and_go_with_the_worker_that_learned_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each worker saw only its share of a replica's steps: alone, each took N times as long
    to learn a slow replica's speed."""
    a, wa = worker(tmp_path, 1)
    b, wb = worker(tmp_path, 2)
    learned = {"replica-1": [1000.0, 2.0, 40, 40, 0.0, 0.0, 0],
               POOL_RATE_KEY: [9000.0, 3.0, 50, 0, 0.0, 0.0, 0]}
    monkeypatch.setattr(a.pools[0].router, "own_rates", lambda: learned)
    wa.write()
    wb.read(peers(tmp_path, wb))
    steps = b.pools[0].router.load.steps
    assert steps._remote_rates == {"replica-1": (1000.0, 2.0, 40, 40, 0.0, 0.0, 0)}
    assert steps._remote_pool == (9000.0, 3.0, 50)
    # Unchanged, not written again; a new file starts with them (a reader opening it late
    # still learns them).
    size = os.path.getsize(wa.path)
    wa._rates_at = -1.0
    wa.write()
    assert os.path.getsize(wa.path) == size
    wa.max_bytes = size
    a.pools[0].router.record("replica-0", [5], 1.0)
    wa.write()
    late, wl = worker(tmp_path, 3)
    wl.read(peers(tmp_path, wl))
    assert late.pools[0].router.load.steps._remote_rates == steps._remote_rates
    assert held(late, "replica-0", [5]) == 1
    # A worker that stops takes its file with it: what it learned no longer counts.
    wa.close()
    assert not wa.path.exists()
    wb.read(peers(tmp_path, wb))
    assert steps._remote_rates == {} and steps._remote_pool is None


def test_decisions_queued_while_nothing_writes_them_are_bounded(tmp_path: Path) -> None:
    a, wa = worker(tmp_path, 1, max_queue=3)
    for i in range(5):
        a.pools[0].router.record("replica-0", [i], 1.0)
    assert len(wa.queue) == 3 and counted(a, "dropped") == 2
    wa.write()
    assert not wa.pending


def test_the_workers_load_ticks_write_and_read_the_prefixes(tmp_path: Path) -> None:
    a, b = state(), state()
    la = WorkerLoad(tmp_path, a, pid=1, prefixes=WorkerPrefixes(tmp_path, a.pools, a.observer,
                                                                 pid=1))
    lb = WorkerLoad(tmp_path, b, pid=2, prefixes=WorkerPrefixes(tmp_path, b.pools, b.observer,
                                                                 pid=2))
    a.pools[0].router.record("replica-1", [31, 32], 50.0)
    assert la.pause_s() == la.interval_s  # a decision to write: busy
    la.tick(1000.0)
    lb.tick(1000.0)
    assert held(b, "replica-1", [31, 32]) == 2
    la.remove()
    assert not prefixes_path(tmp_path, 1).exists()


def test_decisions_that_cannot_be_written_are_counted_dropped(tmp_path: Path) -> None:
    directory = tmp_path / "workers"
    directory.mkdir()
    a, wa = worker(directory, 1)
    a.pools[0].router.record("replica-0", [1, 2], 1.0)
    directory.rmdir()  # the gateway is stopping: the directory went first
    with pytest.raises(OSError):
        wa.write()
    assert counted(a, "dropped") == 1 and counted(a, "published") == 0


def test_a_workers_running_requests_stay_pinned_in_the_others_until_they_end_or_it_dies(
        tmp_path: Path) -> None:
    """With `pin_running`, the workers pin what each other's running requests hold on the
    engines, as the gateways sharing a Redis do, and release it when the request ends or
    the worker dies (its file retired)."""
    from routing.types import Decision, ReplicaView

    a, wa = worker(tmp_path, 1, pin_running=True)
    b, wb = worker(tmp_path, 2, pin_running=True)
    router_a, router_b = a.pools[0].router, b.pools[0].router

    def start(text: str, max_tokens_in_blocks: int) -> Decision:
        request = router_a.request_from_text(text)
        request.output_tokens = max_tokens_in_blocks * request.block_tokens
        return router_a.route(request, [ReplicaView(name="replica-1")])

    assert router_a.output_reserve == 0.5  # a vLLM pool: half of each max_tokens
    first, second = start("first " * 200, 8), start("second " * 200, 4)
    wa.write()
    wb.read(peers(tmp_path, wb))
    index_b = router_b.indexes["replica-1"]
    assert router_b.remote_pins() == 2
    assert index_b.pinned_blocks == len(first.hashes) + len(second.hashes)
    assert index_b.reserved == 6  # room for both outputs
    router_a.finished(first, True)
    wa.write()
    wb.read(peers(tmp_path, wb))
    assert router_b.remote_pins() == 1
    assert index_b.pinned_blocks == len(second.hashes) and index_b.reserved == 2
    # The worker died with its request running: the supervisor retires its file.
    os.replace(prefixes_path(tmp_path, 1), retired_path(tmp_path, 1))
    wb.read(peers(tmp_path, wb))
    assert router_b.remote_pins() == 0 and index_b.pinned_blocks == 0
    assert index_b.reserved == 0
    # Its replacement applies the dead worker's prefixes, and pins none of them.
    replacement, wr = worker(tmp_path, 3, pin_running=True)
    wr.read(peers(tmp_path, wr))
    router_r = replacement.pools[0].router
    assert router_r.matched_blocks("replica-1", second.hashes) == len(second.hashes)
    assert router_r.remote_pins() == 0 and router_r.indexes["replica-1"].reserved == 0


def test_a_request_ended_on_one_worker_leaves_its_output_in_the_others_index(
        tmp_path: Path) -> None:
    """With `output_cached`, a worker's line carries the blocks each ended request's output
    left cached on its engine, and the other workers' indexes keep them as its own does."""
    from routing.types import ReplicaView

    for cached in (True, False):
        directory = tmp_path / str(cached)
        directory.mkdir()
        a, wa = worker(directory, 1, pin_running=True, output_cached=cached)
        b, wb = worker(directory, 2, pin_running=True, output_cached=cached)
        router_a, router_b = a.pools[0].router, b.pools[0].router
        request = router_a.request_from_text("context " * 300)
        decision = router_a.route(request, [ReplicaView(name="replica-1")])
        router_a.dispatched(decision, 0.0)
        router_a.first_token(decision, 1.0, 0.0)
        router_a.finished(decision, True, output_tokens=int(12 * request.block_tokens))
        wa.write()
        wb.read(peers(directory, wb))
        grown = 12 if cached else 0
        assert router_b.remote_pins() == 0
        assert len(router_b.indexes["replica-1"]) == len(request.hashes) + grown
        assert len(router_a.indexes["replica-1"]) == len(request.hashes) + grown
