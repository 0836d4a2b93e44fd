"""A real redis-server for the tests: started on a free port in its own directory, with the
AOF on (so a restart keeps what it had), stopped and started again at will."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import redis

from gateway import processes


class RedisServer:
    def __init__(self, directory: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not on PATH: the Batch API tests need it "
                               "(Debian/Ubuntu: apt-get install redis-server; .ci/run does)")
        self.binary = binary
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = processes.free_ports(1)[0]
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def config(self, **extra: object) -> dict[str, object]:
        """A `redis` configuration section with a key prefix of its own, so tests sharing
        one server never see each other's batches."""
        return {"url": self.url, "key_prefix": f"test-{uuid.uuid4().hex[:10]}:", **extra}

    def start(self, deadline_s: float = 20.0) -> None:
        # The AOF on, so a restart keeps everything: `stop` is a SIGTERM, on which Redis
        # writes out and fsyncs its AOF before exiting. appendfsync everysec rather than the
        # always the docs advise for a server that may crash: no test crashes Redis, and an
        # fsync per write costs milliseconds each (far more on a busy disk).
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir",
                str(self.dir), "--save", "", "--appendonly", "yes", "--appendfsync", "everysec",
                "--daemonize", "no", "--protected-mode", "no", "--logfile", "redis.log"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1)
        end = time.monotonic() + deadline_s
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self.proc.returncode}: "
                                       + self.log()[-1500:])
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                    pass
                if time.monotonic() > end:
                    raise RuntimeError("redis-server did not answer PING: " + self.log()[-1500:])
                time.sleep(0.05)
        finally:
            client.close()

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> None:
        """SIGTERM: Redis shuts down cleanly, its AOF written out and fsynced."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def log(self) -> str:
        path = self.dir / "redis.log"
        return path.read_text(errors="replace") if path.exists() else ""
