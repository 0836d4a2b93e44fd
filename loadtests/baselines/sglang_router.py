"""Launch the SGLang router (``sglang-router==0.3.2``) as a benchmark baseline.

The router runs from its own virtualenv, made by ``deploy/sglang-router/install.sh``
(``$PG_SGLANG_VENV``, default ``~/.cache/prefix-gateway/sglang-router-venv``), so its
dependencies never mix with the gateway's.

Usage::

    from loadtests.baselines.sglang_router import start_sglang_router

    with start_sglang_router(["http://127.0.0.1:8001", "http://127.0.0.1:8002"], 30000) as r:
        ...  # send OpenAI requests to r.url
    # or: r = start_sglang_router(...); ...; r.stop()

``start_sglang_router`` returns only once every given worker is registered *and* healthy in
the router (``GET /workers``). The router's own ``/health`` and ``/readiness`` are not enough:
the router answers them before it has registered its workers, and ``/readiness`` counts only
workers that are already registered. See ``docs/benchmarks.md`` (the SGLang router baseline)
for what the workers must serve.

Command line (for manual runs)::

    python -m loadtests.baselines.sglang_router --port 30000 \
        --worker-urls http://127.0.0.1:8001 http://127.0.0.1:8002
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

SGLANG_ROUTER_VERSION = "0.3.2"
DEFAULT_VENV = Path.home() / ".cache" / "prefix-gateway" / "sglang-router-venv"
# The router downloads a tokenizer from the Hugging Face hub for any worker whose
# /model_info (or /server_info) reports a model_path. There is no network here, and no
# traffic may leave loopback, so point the hub at a closed loopback port unless the caller
# sets HF_ENDPOINT. Registration does not wait on the tokenizer; it only logs a warning.
_DEAD_HF_ENDPOINT = "http://127.0.0.1:9"
# The router's log always carries ANSI colour codes (NO_COLOR is not honoured).
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def venv_dir() -> Path:
    """The router's virtualenv (``$PG_SGLANG_VENV`` or the default)."""
    return Path(os.environ.get("PG_SGLANG_VENV") or DEFAULT_VENV).expanduser()


def venv_python() -> Path:
    """The interpreter of the router's virtualenv; raises if it is not installed."""
    py = venv_dir() / "bin" / "python"
    if not py.exists():
        raise FileNotFoundError(
            f"sglang-router venv not found at {venv_dir()}; "
            "run deploy/sglang-router/install.sh first"
        )
    return py


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _port_in_use(host: str, port: int) -> bool:
    # SO_REUSEADDR so that TIME_WAIT leftovers of an earlier run do not count; a live
    # listener still does. (The router itself binds with SO_REUSEPORT: a second router on
    # the same port would start fine and share it with the first.)
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _norm(url: str) -> str:
    return url.rstrip("/")


def _has_flag(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


class SGLangRouterHandle:
    """A running router process. ``.url`` is its base URL (no trailing slash)."""

    def __init__(
        self,
        process: subprocess.Popen,
        url: str,
        port: int,
        worker_urls: list[str],
        log_path: Path,
        command: list[str],
        prometheus_port: int | None,
    ) -> None:
        self.process = process
        self.url = url
        self.port = port
        self.worker_urls = worker_urls
        self.log_path = log_path
        self.command = command
        self.prometheus_port = prometheus_port

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def metrics_url(self) -> str | None:
        """The router's own Prometheus endpoint (a separate port), if known."""
        if self.prometheus_port is None:
            return None
        return f"http://127.0.0.1:{self.prometheus_port}/metrics"

    def alive(self) -> bool:
        return self.process.poll() is None

    def workers(self, timeout: float = 5.0) -> list[dict]:
        """The router's view of its workers (``GET /workers``)."""
        r = httpx.get(f"{self.url}/workers", timeout=timeout)
        r.raise_for_status()
        return r.json().get("workers", [])

    def log_tail(self, max_bytes: int = 4000) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return _ANSI.sub("", data[-max_bytes:].decode(errors="replace"))

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM the router, then SIGKILL after ``timeout`` s. Returns the exit code.

        On SIGTERM the router drains in-flight requests (its grace period is 180 s by
        default), hence the SIGKILL fallback. Idempotent.
        """
        if self.process.poll() is not None:
            return self.process.returncode
        self._signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            return self.process.wait(timeout=10)

    def _signal(self, sig: int) -> None:
        # The router runs in its own session: signal its whole process group, by its id.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, sig)

    def __enter__(self) -> SGLangRouterHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.alive() else f"exited {self.process.returncode}"
        return f"SGLangRouterHandle(url={self.url!r}, pid={self.pid}, {state}, log={self.log_path})"


def build_command(
    python: Path | str,
    worker_urls: Sequence[str],
    port: int,
    policy: str = "cache_aware",
    extra_args: Sequence[str] = (),
    host: str = "127.0.0.1",
    prometheus_port: int | None = None,
) -> list[str]:
    """The router's command line. Policy flags are left at their CLI defaults."""
    cmd = [
        str(python), "-m", "sglang_router.launch_router",
        "--worker-urls", *[_norm(u) for u in worker_urls],
        "--policy", policy,
        "--host", host,
        "--port", str(port),
    ]  # fmt: skip
    # The router's metrics server defaults to 0.0.0.0:29000, which clashes between runs.
    if prometheus_port is not None and not _has_flag(extra_args, "--prometheus-port"):
        cmd += ["--prometheus-port", str(prometheus_port)]
    if not _has_flag(extra_args, "--prometheus-host"):
        cmd += ["--prometheus-host", "127.0.0.1"]
    cmd += list(extra_args)
    return cmd


def _ready(client: httpx.Client, url: str, wanted: set[str]) -> tuple[bool, str]:
    try:
        r = client.get(f"{url}/workers")
    except httpx.HTTPError as e:
        return False, f"router not answering: {type(e).__name__}"
    if r.status_code != 200:
        return False, f"GET /workers -> {r.status_code}"
    healthy = {_norm(w.get("url", "")) for w in r.json().get("workers", []) if w.get("is_healthy")}
    missing = wanted - healthy
    if missing:
        return False, f"workers not yet registered+healthy: {sorted(missing)}"
    return True, "ok"


def start_sglang_router(
    worker_urls: list[str],
    port: int,
    policy: str = "cache_aware",
    extra_args: Sequence[str] = (),
    *,
    host: str = "127.0.0.1",
    log_path: str | Path | None = None,
    startup_timeout: float = 60.0,
    poll_interval: float = 0.1,
    prometheus_port: int | None = None,
    env: dict[str, str] | None = None,
) -> SGLangRouterHandle:
    """Start the SGLang router in front of ``worker_urls`` and wait until it serves.

    ``policy`` is passed as ``--policy``; every other routing flag keeps its CLI default
    (for cache_aware: cache-threshold 0.3, balance-abs 64, balance-rel 1.5, eviction 60 s,
    max-tree-size 2**26). ``extra_args`` are appended verbatim.

    Returns once ``GET /workers`` lists every worker URL as healthy. A worker whose
    ``/health`` does not answer 200 is retried by the router with a growing backoff
    (about 1, 2, 3, 4 s ...), so late workers are picked up, just not at once.
    On timeout or early exit the router is stopped and ``RuntimeError`` is raised with the
    tail of its log.
    """
    if not worker_urls:
        raise ValueError("worker_urls must not be empty")
    python = venv_python()
    # Otherwise the readiness poll could be answered by whatever already holds the port.
    if _port_in_use(host, port):
        raise RuntimeError(f"port {port} on {host} is already in use")
    if prometheus_port is None and not _has_flag(extra_args, "--prometheus-port"):
        prometheus_port = free_port()
    cmd = build_command(python, worker_urls, port, policy, extra_args, host, prometheus_port)

    if log_path is None:
        fd, name = tempfile.mkstemp(prefix=f"sglang-router-{port}-", suffix=".log")
        os.close(fd)
        log_path = name
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)

    child_env = dict(os.environ)
    child_env.setdefault("HF_ENDPOINT", _DEAD_HF_ENDPOINT)
    if env:
        child_env.update(env)

    with open(log_path, "ab") as log:
        log.write(f"# {' '.join(cmd)}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=child_env,
            start_new_session=True,
        )
    connect_host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    if ":" in connect_host:
        connect_host = f"[{connect_host}]"
    url = f"http://{connect_host}:{port}"
    handle = SGLangRouterHandle(
        proc, url, port, [_norm(u) for u in worker_urls], log_path, cmd, prometheus_port
    )

    wanted = set(handle.worker_urls)
    deadline = time.monotonic() + startup_timeout
    status = "not polled"
    with httpx.Client(timeout=2.0) as client:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"sglang-router exited with code {proc.returncode} during startup "
                    f"(log {log_path}):\n{handle.log_tail()}"
                )
            ok, status = _ready(client, url, wanted)
            if ok and proc.poll() is None:
                return handle
            if time.monotonic() >= deadline:
                handle.stop()
                raise RuntimeError(
                    f"sglang-router not ready after {startup_timeout:.0f}s ({status}); "
                    f"log {log_path}:\n{handle.log_tail()}"
                )
            time.sleep(poll_interval)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Run sglang-router in front of the given workers.")
    p.add_argument("--worker-urls", nargs="+", required=True)
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--policy", default="cache_aware")
    p.add_argument("--log-path", default=None)
    p.add_argument("--startup-timeout", type=float, default=60.0)
    args, extra = p.parse_known_args(argv)
    h = start_sglang_router(
        args.worker_urls, args.port, args.policy, extra,
        log_path=args.log_path, startup_timeout=args.startup_timeout,
    )  # fmt: skip
    print(f"sglang-router ready at {h.url} (pid {h.pid}, log {h.log_path}); Ctrl-C stops it")

    def _on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _on_term)
    try:
        while h.alive():
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        h.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
