"""`prefix-gateway up`: the embedded default starts, serves both pools, and stops on SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import sys
from pathlib import Path

import httpx
import openai
import pytest

from gateway import cli, processes
from tests.conftest import poll


def children_of(pid: int) -> set[int]:
    kids = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name may contain spaces; the parent pid follows its closing parenthesis.
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            kids.add(int(entry.name))
    return kids


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


# SIGTERM with the embedded default's counts (3 realtime and 2 batch replicas); SIGINT with
# one replica per pool, enough to show that it too stops the replicas it started.
@pytest.mark.parametrize(("sig", "flags", "n_rt", "n_bt"), [
    (signal.SIGTERM, (), 3, 2),
    (signal.SIGINT, ("--realtime-replicas", "1", "--batch-replicas", "1"), 1, 1),
], ids=["SIGTERM-default", "SIGINT-1+1"])
def test_up_serves_both_pools_and_stops_everything(tmp_path, capsys, sig, flags, n_rt,
                                                   n_bt) -> None:
    # `up` binds its port only once its replicas serve, seconds after the test chose it:
    # below the ephemeral range, or an outgoing connection (a health check) may take it first.
    port = processes.consecutive_free_ports(1)
    url = f"http://127.0.0.1:{port}"
    proc = processes.spawn([sys.executable, "-m", "gateway.cli", "up", "--port", str(port),
                            "--time-scale", "0.02", "--log-dir", str(tmp_path), *flags],
                           str(tmp_path / "up.log"))
    try:
        processes.wait_healthy([url], [proc], deadline_s=60, path="/ready")
        replicas = children_of(proc.pid)
        assert len(replicas) == n_rt + n_bt
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        rt = c.chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=2)
        assert rt.headers["x-gateway-pool"] == "realtime"
        assert rt.headers["x-gateway-replica"].startswith("realtime-")
        bt = c.chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=2,
            extra_headers={"x-traffic-class": "batch"})
        assert bt.headers["x-gateway-replica"].startswith("batch-")
        # Admission control is on: 64 slots per replica, realtime may borrow the batch pool.
        # `prefix-gateway stats`, in the test process.
        assert cli.cmd_stats(cli.build_parser().parse_args(["stats", "--url", url])) == 0
        table = capsys.readouterr().out
        rows = [line.split() for line in table.split("admission\n", 1)[1].splitlines()]
        assert ["realtime", "64", str(64 * n_rt), "0", "0", "0.0%", "25.0%"] in rows
        assert ["batch", "64", str(64 * n_bt), "0", "0", "0.0%", "25.0%"] in rows
        stats = httpx.get(url + "/admin/stats").json()["admission"]
        assert stats["classes"][0]["borrow"] == [{"pool": "batch", "while_below": 0.5}]
        os.kill(proc.pid, sig)
        assert proc.wait(timeout=30) in (0, -sig, 128 + sig)
        poll(lambda: not any(alive(p) for p in replicas), deadline_s=15)
    finally:
        processes.stop_all([proc])
    log = (tmp_path / "up.log").read_text()
    assert "serving on" in log
    assert "UNAUTHENTICATED" in log and "--api-key" in log  # said at start, without keys


def test_ports_chosen_for_a_late_bind_are_free_and_below_the_ephemeral_range() -> None:
    # A real engine binds its ports only after it has imported and loaded (seconds to a
    # minute); a port from the ephemeral range could meanwhile be given to any outgoing
    # connection, and a vLLM replica once failed to start on "Address already in use".
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(20):
        base = processes.consecutive_free_ports(3)
        assert base + 3 <= low
        for port in range(base, base + 3):
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))


def test_ports_for_the_replicas_are_never_the_gateways(monkeypatch) -> None:
    # `up` picks its simulated replicas' ports while its own port (the test's pick, or the
    # user's) is not bound yet, and the kernel may hand that port out again: a replica once
    # took the gateway's port, which then failed to start ("Address already in use").
    handed_out = iter([7001, 7002, 7003, 7004])

    class Scripted:
        def __init__(self) -> None:
            self.port = next(handed_out)

        def bind(self, address: tuple[str, int]) -> None:
            pass

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", self.port)

        def close(self) -> None:
            pass

    monkeypatch.setattr(processes.socket, "socket", Scripted)
    assert processes.free_ports(2, avoid=[7001, 7003]) == [7002, 7004]
