"""Child processes: replicas the CLI starts and stops with itself, and gateway processes."""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # Linux: the child gets SIGTERM if the gateway dies, even by SIGKILL, so no replica is
    # left running behind a gateway that is gone.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


die_with_parent = _die_with_parent


def free_ports(n: int, host: str = "127.0.0.1", avoid: Iterable[int] = ()) -> list[int]:
    """`n` distinct ports free now, none of them in `avoid` (ports chosen for other processes
    that have not bound them yet: the kernel may hand out a port again until it is bound)."""
    socks = []
    avoid = set(avoid)
    ports: list[int] = []
    try:
        while len(ports) < n:
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)  # held until the end, so that no port comes back twice
            if (port := s.getsockname()[1]) not in avoid:
                ports.append(port)
        return ports
    finally:
        for s in socks:
            s.close()


def _ephemeral_low() -> int:
    """The lowest port the kernel hands to outgoing connections (Linux; else its default)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def consecutive_free_ports(n: int, host: str = "127.0.0.1", low: int = 20000) -> int:
    """A base port such that base .. base+n-1 are free now, below the kernel's ephemeral
    range: a process may bind its ports many seconds after they were chosen (a real engine
    imports and loads first), and meanwhile any outgoing connection on the machine may be
    given a free port from that range (a vLLM replica failed to bind one that way)."""
    high = _ephemeral_low() - n
    if high <= low:
        low, high = 1024, 65535 - n
    rng = random.Random()
    for _ in range(500):
        base = rng.randrange(low, high)
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")


def spawn(args: Sequence[str], log_path: str | None = None,
          env: dict[str, str] | None = None) -> subprocess.Popen:
    if log_path is None:
        return subprocess.Popen(list(args), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})}, preexec_fn=_die_with_parent)
    # The child keeps its own copy of the descriptor; the parent's is closed at once.
    with open(log_path, "ab") as out:
        return subprocess.Popen(list(args), stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})}, preexec_fn=_die_with_parent)


def wait_healthy(urls: Sequence[str], procs: Sequence[subprocess.Popen], deadline_s: float,
                 path: str = "/health") -> None:
    """Poll each URL until it answers 200, or fail with the reason once the deadline passes."""
    end = time.monotonic() + deadline_s
    pending = list(urls)
    while pending:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"a replica process exited early with code {p.returncode}: "
                                   f"{' '.join(p.args[:6])} ...")
        url = pending[0]
        try:
            with urllib.request.urlopen(url + path, timeout=1) as r:
                if r.status == 200:
                    pending.pop(0)
                    continue
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > end:
            raise RuntimeError(f"replica {url} did not become healthy within {deadline_s:.0f}s")
        time.sleep(0.1)


def stop_all(procs: Sequence[subprocess.Popen], grace_s: float = 10.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    end = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def start_gateway(config: dict[str, Any], work_dir: Path, name: str = "gateway", *,
                  deadline_s: float = 60.0, env: dict[str, str] | None = None,
                  python_flags: Sequence[str] = (),
                  wrap: Callable[[list[str]], list[str]] | None = None,
                  ready_path: str = "/ready",
                  ) -> tuple[str, subprocess.Popen, Path]:
    """Run `gateway.cli serve` on `config` (written to work_dir/NAME.yaml) until it answers
    `ready_path` (/ready: a healthy replica in every pool; /health: the process is up).

    Returns the gateway's URL, its process and its log. If it does not become ready, the
    process is stopped and the error carries the tail of its log. `wrap` can prefix the
    command (e.g. with taskset); `python_flags` go to the interpreter.
    """
    server = config["server"]
    url = f"http://{server.get('host', '127.0.0.1')}:{server['port']}"
    config_path = work_dir / f"{name}.yaml"
    config_path.write_text(yaml.safe_dump(config))
    log_path = work_dir / f"{name}.log"
    cmd = [sys.executable, *python_flags, "-m", "gateway.cli", "serve", "--config",
           str(config_path), "--log-level", "warning"]
    proc = spawn(wrap(cmd) if wrap else cmd, str(log_path), env=env)
    try:
        wait_healthy([url], [proc], deadline_s=deadline_s, path=ready_path)
    except RuntimeError as exc:
        stop_all([proc])
        raise RuntimeError(f"gateway {name} did not become ready: {exc}\n"
                           + log_path.read_text(errors="replace")[-2000:]) from None
    return url, proc, log_path
