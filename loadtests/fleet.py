"""Benchmark fleets as child processes: simulated or stub replicas and gateways, and stopping
them."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway import processes
from gateway.defaults import one_pool_config

REPO = Path(__file__).resolve().parents[1]
# Children import this checkout's packages whatever the caller's working directory.
CHILD_ENV = {"PYTHONPATH": str(REPO)}
MODEL = "tiny"


@functools.cache
def _has_taskset() -> bool:
    return shutil.which("taskset") is not None


def pinned(cmd: list[str], core: int | None) -> list[str]:
    """The command run on one CPU core (taskset), when a core is given and taskset exists."""
    return ["taskset", "-c", str(core), *cmd] if core is not None and _has_taskset() else cmd


@dataclass
class Fleet:
    """The processes one benchmark run started, with their logs in `log_dir`.

    `stop()` (or leaving the `with` block) ends every one of them; it is idempotent.
    """

    log_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="loadtests-")))
    procs: list[subprocess.Popen] = field(default_factory=list)

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def spawn(self, cmd: list[str], name: str) -> subprocess.Popen:
        """Start a child process logging to `log_dir/NAME.log`; the fleet will stop it."""
        proc = processes.spawn(cmd, str(self.log_dir / f"{name}.log"), env=CHILD_ENV)
        self.procs.append(proc)
        return proc

    def start_sims(self, n: int, kv_capacity_tokens: int, profile: str,
                   time_scale: float = 1.0, model: str = MODEL,
                   deadline_s: float = 60.0, name: str = "sim", fleet: str | None = None,
                   slow: str | None = None, engine: str = "vllm",
                   vllm_engines: bool = False) -> list[str]:
        """`n` simulated replicas in one process; their base URLs once all are healthy.
        `engine`: "vllm", or "trtllm" (trtllm-serve with its Prometheus page mounted).
        `vllm_engines`: KV taken on demand with preemption, and outputs kept cached, as vLLM does.

        `name` prefixes the replicas' names and names the log (`NAMEs.log`), so a benchmark
        can run several such processes (one per pool). `fleet` and `slow` give the replicas
        mixed speeds (backends/sim/fleet_spec.py; `fleet` must describe `n` replicas).
        """
        base = processes.consecutive_free_ports(n)
        mixed = [*(["--fleet", fleet] if fleet else []), *(["--slow", slow] if slow else [])]
        proc = self.spawn([sys.executable, "-m", "backends.sim", "--port", str(base),
                           "--count", str(n), "--kind", engine, "--model", model,
                           *(["--trtllm-perf-metrics"] if engine == "trtllm" else []),
                           *(["--lazy-kv", "--cache-outputs"] if vllm_engines else []),
                           "--profile", profile, "--time-scale", str(time_scale),
                           "--kv-capacity-tokens", str(kv_capacity_tokens), "--name", name,
                           *mixed], f"{name}s")
        urls = [f"http://127.0.0.1:{base + i}" for i in range(n)]
        processes.wait_healthy(urls, [proc], deadline_s=deadline_s)
        return urls

    def start_stubs(self, n: int, core: int | None = None,
                    deadline_s: float = 20.0) -> tuple[subprocess.Popen, list[str]]:
        """`n` instant stub replicas (stub_replica.py) in one process, optionally on one core."""
        base = processes.consecutive_free_ports(n)
        proc = self.spawn(pinned([sys.executable, "-m", "loadtests.stub_replica",
                                  "--port", str(base), "--count", str(n)], core), "stub")
        urls = [f"http://127.0.0.1:{base + i}" for i in range(n)]
        processes.wait_healthy(urls, [proc], deadline_s=deadline_s)
        return proc, urls

    def start_gateway(self, replica_urls: Sequence[str], name: str = "gateway", *,
                      deadline_s: float = 60.0, core: int | None = None, root: Path = REPO,
                      **config: Any) -> tuple[str, subprocess.Popen]:
        """A gateway process with one pool of these replicas, once it answers /ready:
        (its URL, its process).

        `config` are `gateway.defaults.one_pool_config`'s keywords (pool, routing, health,
        ...); `root` is the checkout it runs from (another one for an A/B of two versions).
        """
        cfg = one_pool_config(list(replica_urls), processes.free_ports(1)[0], **config)
        # -P: import the gateway from `root` (PYTHONPATH), not from the working directory.
        url, proc, _ = processes.start_gateway(
            cfg, self.log_dir, name, deadline_s=deadline_s, env={"PYTHONPATH": str(root)},
            python_flags=("-P",), wrap=lambda cmd: pinned(cmd, core))
        self.procs.append(proc)
        return url, proc

    def start_gateway_config(self, config: dict[str, Any], name: str = "gateway", *,
                             deadline_s: float = 60.0,
                             env: dict[str, str] | None = None) -> tuple[str, subprocess.Popen]:
        """A gateway process on a whole configuration (a dict, as the YAML file holds it),
        once it answers /ready: (its URL, its process)."""
        url, proc, _ = processes.start_gateway(
            config, self.log_dir, name, deadline_s=deadline_s,
            env={**CHILD_ENV, **(env or {})}, python_flags=("-P",))
        self.procs.append(proc)
        return url, proc

    def start_redis(self, name: str = "redis", deadline_s: float = 20.0) -> str:
        """A throwaway `redis-server` on a free loopback port, its files in `log_dir/NAME`;
        its URL once it answers PING."""
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (Debian: apt-get install "
                               "redis-server)")
        port = processes.free_ports(1)[0]
        workdir = self.log_dir / name
        workdir.mkdir(exist_ok=True)
        proc = self.spawn([exe, "--port", str(port), "--bind", "127.0.0.1", "--dir",
                           str(workdir), "--save", "", "--appendonly", "no"], name)
        end = time.monotonic() + deadline_s
        while not _redis_pong(port):
            if proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with code {proc.returncode}; see "
                                   f"{self.log_dir / name}.log")
            if time.monotonic() > end:
                raise RuntimeError(f"redis-server did not answer PING within {deadline_s}s")
            time.sleep(0.05)
        return f"redis://127.0.0.1:{port}/0"

    def stop_process(self, proc: subprocess.Popen) -> None:
        """Stop one process of the fleet (e.g. a gateway between two policies)."""
        processes.stop_all([proc])
        self.procs.remove(proc)

    def stop(self) -> None:
        processes.stop_all(self.procs)
        self.procs.clear()


def _redis_pong(port: int) -> bool:
    """Whether a Redis server on loopback `port` answers PING (inline command, no client
    library needed)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C, so the finally blocks stop the child processes."""
    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def run_async(coro: Any) -> Any:
    """Run a load generator's coroutine, on uvloop when it is installed (on a small machine
    the client must not be the bottleneck). SIGTERM cancels it and raises KeyboardInterrupt,
    as Ctrl-C does, so the caller's `finally` blocks stop what it started."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(_interruptible(coro))
    return uvloop.run(_interruptible(coro))


async def _interruptible(coro: Any) -> Any:
    """`coro`, cancelled by SIGTERM through the loop. A Python signal handler that raises
    (`sigterm_as_interrupt`) lands wherever the loop is: inside one of uvloop's transport
    callbacks, KeyboardInterrupt is reported as a fatal transport error and the run goes on."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None  # run_async's main task
    terminated = False

    def terminate() -> None:
        nonlocal terminated
        terminated = True
        task.cancel()

    previous = signal.getsignal(signal.SIGTERM)
    try:
        loop.add_signal_handler(signal.SIGTERM, terminate)
    except (NotImplementedError, RuntimeError, ValueError):  # no signals here (not main thread)
        return await coro
    try:
        return await coro
    except asyncio.CancelledError:
        if terminated:
            raise KeyboardInterrupt from None
        raise
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        # remove_signal_handler leaves the default behind, not what was there before.
        signal.signal(signal.SIGTERM, previous)


def use_uvloop() -> None:
    """Make uvloop the default event loop of later `asyncio.run` calls, when installed."""
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
