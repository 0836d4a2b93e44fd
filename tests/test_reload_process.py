"""`prefix-gateway serve` reloads its configuration file while serving: on SIGHUP, and when the
file changes (a real process and real simulated replicas)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from gateway import processes
from tests.conftest import Gateway, Sims, poll, start_gateway, start_sims

PAD = 600
"""Every file written here is padded to this size with a comment, so that a change can be
made invisible to the file watch (same size, inode and modification time): only SIGHUP then
reloads it."""


def config(port: int, replicas: dict[str, str]) -> dict:
    return {
        "server": {"host": "127.0.0.1", "port": port},
        "pools": [{"name": "rt", "engine": "vllm", "models": ["tiny"],
                   "replicas": [{"name": n, "url": u} for n, u in replicas.items()],
                   "health": {"interval_s": 0.2, "timeout_s": 1, "failure_threshold": 1}}],
        "traffic_classes": [{"name": "realtime", "pool": "rt"}],
        "classification": {"default_class": "realtime"},
    }


def padded(cfg: dict) -> str:
    text = yaml.safe_dump(cfg)
    assert len(text) < PAD - 2
    return text + "#" * (PAD - len(text) - 1) + "\n"


def write_unseen(path: Path, text: str) -> None:
    """Rewrite the file in place, keeping its size and times: the watch cannot tell."""
    before = os.stat(path)
    assert len(text) == before.st_size
    with open(path, "r+") as f:
        f.write(text)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert os.stat(path).st_ino == before.st_ino


@pytest.fixture(scope="module")
def sims(tmp_path_factory) -> Iterator[Sims]:
    s = start_sims(["vllm", "vllm"], tmp_path_factory.mktemp("sims"))
    yield s
    s.stop()


@pytest.fixture
def gw(sims: Sims, tmp_path) -> Iterator[Gateway]:
    port = processes.free_ports(1)[0]
    g = start_gateway(config(port, {"rt-0": sims.urls[0]}), tmp_path)
    yield g
    g.stop()


def replicas(gw: Gateway) -> dict[str, dict]:
    r = httpx.get(gw.url + "/admin/replicas", timeout=10)
    assert r.status_code == 200
    return {rep["name"]: rep for p in r.json()["pools"] for rep in p["replicas"]}


def served_by(gw: Gateway, prompt: str) -> str:
    r = httpx.post(gw.url + "/v1/completions", timeout=30,
                   json={"model": "tiny", "prompt": prompt, "max_tokens": 2})
    assert r.status_code == 200, r.text
    return r.headers["x-gateway-replica"]


def reloads(gw: Gateway, result: str) -> float:
    text = httpx.get(gw.url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(f'gateway_config_reloads_total{{result="{result}"}}'):
            return float(line.split()[-1])
    return 0.0


def test_sighup_and_file_changes_reload_the_replicas(gw: Gateway, sims: Sims) -> None:
    port = int(gw.url.rsplit(":", 1)[1])
    # The file changes (same configuration): the watch reloads it.
    gw.config_path.write_text(padded(config(port, {"rt-0": sims.urls[0]})))
    poll(lambda: "(the file changed): no replica changed" in gw.log(), deadline_s=15)

    # A change the watch cannot see: only SIGHUP applies it.
    write_unseen(gw.config_path, padded(config(port, {"rt-0": sims.urls[0],
                                                      "rt-1": sims.urls[1]})))
    gw.proc.send_signal(signal.SIGHUP)
    poll(lambda: "(SIGHUP): rt/rt-1 added" in gw.log(), deadline_s=15)
    assert gw.proc.poll() is None
    poll(lambda: replicas(gw)["rt-1"]["healthy"], deadline_s=15)
    seen: set[str] = set()
    poll(lambda: seen.add(served_by(gw, f"prompt {len(seen)} {os.urandom(4).hex()} " * 30))
         or seen == {"rt-0", "rt-1"}, deadline_s=30)

    # An invalid file is rejected: logged, and the replicas stay.
    gw.config_path.write_text("pools: [unclosed\n")
    poll(lambda: "rejected; the configuration in force is kept" in gw.log(), deadline_s=15)
    assert "not valid YAML" in gw.log()
    assert set(replicas(gw)) == {"rt-0", "rt-1"}
    assert reloads(gw, "rejected") == 1

    # The file removes rt-0: it drains, leaves, and every request goes to rt-1.
    gw.config_path.write_text(padded(config(port, {"rt-1": sims.urls[1]})))
    poll(lambda: "rt/rt-0 removed (draining)" in gw.log(), deadline_s=15)
    poll(lambda: "rt-0" not in replicas(gw), deadline_s=15)
    assert "replica rt/rt-0 drained and removed" in gw.log()
    for i in range(6):
        assert served_by(gw, f"after {i} " * 30) == "rt-1"
    assert reloads(gw, "ok") == 3
    assert gw.proc.poll() is None
