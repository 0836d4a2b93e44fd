"""Shared fixtures: real simulated replicas and a real gateway, each a process on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import yaml

from gateway import processes
from tests.redis_server import RedisServer

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Sims:
    urls: list[str]
    kinds: list[str]
    procs: list[subprocess.Popen] = field(default_factory=list)
    argvs: list[list[str]] = field(default_factory=list)
    """Each replica's `python -m backends.sim` arguments."""
    log_dir: Path | None = None

    def stop(self) -> None:
        processes.stop_all(self.procs)

    def revive(self, i: int) -> None:
        """Start replica `i` again on its port, if its process (started `separate`) is gone."""
        assert len(self.procs) == len(self.urls), "only replicas started separate=True"
        if self.procs[i].poll() is None:
            return
        log = str(self.log_dir / f"sim-{i}.log") if self.log_dir else None
        self.procs[i] = processes.spawn([sys.executable, "-m", "backends.sim", *self.argvs[i]],
                                        log)
        processes.wait_healthy([self.urls[i]], [self.procs[i]], deadline_s=30)


# Several replicas in one process: each takes its own options, as `python -m backends.sim`
# would (sys.argv[1] is a JSON list of their argument lists). One interpreter start and one
# import of the simulator serve them all.
_SIM_GROUP = """
import argparse, json, sys
from backends.sim.cli import add_sim_arguments, specs_from_args
from backends.sim.server import serve_sims
parser = argparse.ArgumentParser()
add_sim_arguments(parser)
argvs = json.loads(sys.argv[1])
serve_sims([s for argv in argvs for s in specs_from_args(parser.parse_args(argv))])
"""


def start_sims(kinds: list[str], tmp: Path, *, time_scale: float | list[float] = 0.02,
               profile: str = "llama-8b-h200", model: str = "tiny",
               extra: tuple[str, ...] = (), separate: bool = False,
               hosts: list[str] | None = None) -> Sims:
    """Start one simulated replica per entry of `kinds` ("vllm" or "trtllm"), all in one
    process unless `separate` (one process each: what a test that kills or freezes one
    replica needs, through `Sims.procs[i]`). `time_scale`: one for all, or one per replica.
    `hosts`: a loopback address per replica (127.0.0.2, ...), all on one port, as engines
    behind one DNS name are (one process each)."""
    if hosts is not None:
        separate = True
        ports = processes.free_ports(1, hosts[0]) * len(kinds)
    else:
        hosts = ["127.0.0.1"] * len(kinds)
        ports = processes.free_ports(len(kinds))
    urls = [f"http://{h}:{p}" for h, p in zip(hosts, ports, strict=True)]
    scales = time_scale if isinstance(time_scale, list) else [time_scale] * len(kinds)
    argvs = [["--host", host, "--port", str(port), "--kind", kind, "--model", model,
              "--profile", profile, "--time-scale", str(scale), "--name", f"sim{i}", *extra]
             for i, (host, port, kind, scale)
             in enumerate(zip(hosts, ports, kinds, scales, strict=True))]
    if separate or len(argvs) == 1:
        procs = [processes.spawn([sys.executable, "-m", "backends.sim", *argv],
                                 str(tmp / f"sim-{i}.log")) for i, argv in enumerate(argvs)]
    else:
        procs = [processes.spawn([sys.executable, "-c", _SIM_GROUP, json.dumps(argvs)],
                                 str(tmp / "sims.log"))]
    sims = Sims(urls, kinds, procs, argvs, tmp)
    try:
        processes.wait_healthy(urls, procs, deadline_s=30)
    except RuntimeError:
        sims.stop()
        raise
    return sims


@dataclass
class Gateway:
    url: str
    proc: subprocess.Popen
    config_path: Path
    log_path: Path

    def stop(self) -> None:
        processes.stop_all([self.proc])

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def two_pool_config(realtime: list[str], batch: list[str], port: int, **routing) -> dict:
    return {
        "server": {"host": "127.0.0.1", "port": port},
        "routing": {"policy": "prefix_affinity", **routing},
        "pools": [
            {"name": "realtime", "engine": "vllm", "models": ["tiny"],
             "replicas": [{"name": f"rt-{i}", "url": u} for i, u in enumerate(realtime)],
             "health": {"interval_s": 0.2, "timeout_s": 1, "failure_threshold": 1,
                        "metrics_interval_s": 0.2}},
            {"name": "batch", "engine": "trtllm", "models": ["tiny"],
             "replicas": [{"name": f"bt-{i}", "url": u} for i, u in enumerate(batch)],
             "health": {"interval_s": 0.2, "timeout_s": 1, "failure_threshold": 1,
                        "metrics_interval_s": 0.2}},
        ],
        "traffic_classes": [{"name": "realtime", "pool": "realtime"},
                            {"name": "batch", "pool": "batch"}],
        "classification": {"header": "x-traffic-class", "service_tier": {"flex": "batch"},
                           "api_keys": {"sk-batch-key": "batch"},
                           "default_class": "realtime"},
    }


def start_gateway(config: dict, tmp: Path, name: str = "gateway",
                  ready_path: str = "/ready") -> Gateway:
    url, proc, log_path = processes.start_gateway(config, tmp, name, deadline_s=30,
                                                  ready_path=ready_path)
    return Gateway(url, proc, tmp / f"{name}.yaml", log_path)


def start_gateways(configs: dict[str, dict], tmp: Path) -> list[Gateway]:
    """Start a gateway per name -> config at once (each start is mostly imports, which a
    second core runs meanwhile) and wait until all are ready."""
    started: list[Gateway] = []
    for name, config in configs.items():
        path = tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        proc = processes.spawn([sys.executable, "-m", "gateway.cli", "serve", "--config",
                                str(path), "--log-level", "warning"], str(tmp / f"{name}.log"))
        url = f"http://{config['server'].get('host', '127.0.0.1')}:{config['server']['port']}"
        started.append(Gateway(url, proc, path, tmp / f"{name}.log"))
    try:
        processes.wait_healthy([g.url for g in started], [g.proc for g in started],
                               deadline_s=30, path="/ready")
    except RuntimeError as exc:
        processes.stop_all([g.proc for g in started])
        raise RuntimeError(f"gateways did not become ready: {exc}\n"
                           + "\n".join(g.log()[-1500:] for g in started)) from None
    return started


def tenant_prompt(i: int, chars: int = 2000) -> str:
    """A long system prompt of tenant `i`: tenants share nothing, a tenant's requests all."""
    text = " ".join(f"Tenant {i} policy clause {j}: answer precisely and cite sources."
                    for j in range(chars // 40))
    return text[:chars]


def require(module: str, extra: str) -> None:
    """Import `module`, or fail (never skip) saying how to install it: every test runs in CI,
    whose `make install-test` installs the extras."""
    try:
        importlib.import_module(module)
    except ImportError:
        pytest.fail(f"{module} is not installed: pip install -e '.[{extra}]' (make install-test "
                    "installs it)", pytrace=False)


# The deadlines only bound a failing wait, so they are generous: on a loaded two-core machine
# a condition met within milliseconds when quiet has been seen to take over 15 s.
def poll(predicate, deadline_s: float = 30.0, interval_s: float = 0.05):
    """Wait for `predicate()` to return a truthy value, or fail at the deadline."""
    end = time.monotonic() + deadline_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"condition not met within {deadline_s}s")
        time.sleep(interval_s)


async def eventually(predicate, deadline_s: float = 30.0, interval_s: float = 0.02):
    """`poll` for async tests: wait for `predicate()` (a plain or a coroutine function) to
    return a truthy value, or fail at the deadline."""
    end = time.monotonic() + deadline_s
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"condition not met within {deadline_s}s")
        await asyncio.sleep(interval_s)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Iterator[tuple[Gateway, Sims]]:
    """Three realtime (vLLM-like) and two batch (trtllm-like) simulated replicas + a gateway."""
    tmp = tmp_path_factory.mktemp("fleet")
    sims = start_sims(["vllm", "vllm", "vllm", "trtllm", "trtllm"], tmp)
    port = processes.free_ports(1)[0]
    try:
        gw = start_gateway(two_pool_config(sims.urls[:3], sims.urls[3:], port), tmp)
    except Exception:
        sims.stop()
        raise
    yield gw, sims
    gw.stop()
    sims.stop()


@contextlib.contextmanager
def streaming_meanwhile(client, **extra_body) -> Iterator[None]:
    """Keep a replica streaming, one long completion after another, while the block runs, so
    requests sent in the block arrive while its engine steps (and its whole prefill lands in
    one step, which is how the gateway learns the prefill rate)."""
    done = threading.Event()

    def stream() -> None:
        while not done.is_set():
            # Closed on leaving: a stream left open would keep its gateway from shutting down.
            with client.completions.create(model="tiny", prompt="background " * 40,
                                           max_tokens=2000, stream=True,
                                           extra_body=extra_body or None) as chunks:
                for _ in chunks:
                    if done.is_set():
                        break

    background = threading.Thread(target=stream)
    background.start()
    try:
        yield
    finally:
        done.set()
        background.join(timeout=120)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory) -> Iterator[RedisServer]:
    """One real redis-server for the session; each test takes its own key prefix
    (`redis_server.config()`)."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30) as c:
        yield c


os.environ.setdefault("OPENAI_API_KEY", "unused-by-the-gateway")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """On failure, show the tail of every process log the test wrote (gateway, replicas):
    the cause of a 502 is in the gateway's log, and CI keeps nothing else."""
    report = yield
    if report.failed and call.when == "call" and "tmp_path" in item.funcargs:
        for log in sorted(Path(item.funcargs["tmp_path"]).glob("*.log")):
            lines = log.read_text(errors="replace").splitlines()[-40:]
            report.sections.append((f"tail of {log.name}", "\n".join(lines)))
    return report


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto` (the default, pyproject.toml): the fast suite (`-m "not engine"`) runs on one
    worker per core and one more (many tests spend part of their time waiting on the
    processes they started); any run that may include the real-engine tests runs in one
    process, as those engines take every core and their deadlines assume it."""
    expr = config.option.markexpr or ""
    if "not engine" not in expr.replace("  ", " "):
        return 0
    return len(os.sched_getaffinity(0)) + 1
