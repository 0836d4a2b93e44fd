"""Soak benchmark: a gateway process under mixed load for minutes while its replicas are
killed and restarted, clients disconnect and bad input arrives; prints outcomes, failures and
the gateway's RSS and open descriptors over time.

    python -m loadtests.soak                   # 10 minutes
    python -m loadtests.soak --minutes 2 --json

Every `--report-every-s` (30 s) and at the end it prints the requests by outcome, the failures
by kind (a request whose outcome was not the one its kind expects), and the gateway's RSS and
open file descriptors (read from /proc/PID). At the end it compares RSS with RSS after the
second minute (after a fifth of the run, for runs shorter than 10 minutes): with flat memory
they are within 5%.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from gateway import processes
from loadtests.fleet import Fleet, run_async, sigterm_as_interrupt
from loadtests.traces import WORDS

MODEL = "tiny"
MAX_BODY = 1024 * 1024
"""The gateway's server.max_body_bytes here: the huge bodies exceed it."""

# kind -> weight. What each kind expects: "ok" for the inference kinds, a 4xx for bad input,
# "client_disconnected" for the requests the client abandons on purpose.
MIX: dict[str, int] = {
    "chat": 20, "chat_stream": 20, "completion": 10, "completion_stream": 10,
    "disconnect_mid_stream": 10, "disconnect_mid_request": 10,
    "bad_json": 4, "wrong_type": 4, "huge_body": 2, "unknown_model": 4,
}
EXPECTED_4XX = {"bad_json": 400, "wrong_type": 400, "huge_body": 413, "unknown_model": 404}
DISCONNECTS = ("disconnect_mid_stream", "disconnect_mid_request")
_INFERENCE = ("chat", "chat_stream", "completion", "completion_stream")


@dataclass
class Tally:
    """Requests by outcome and unexpected outcomes by kind; counts only ever grow."""

    sent: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    by_kind: dict[str, Counter[str]] = field(default_factory=dict)
    failures: Counter[str] = field(default_factory=Counter)
    """`kind: outcome` for every request whose outcome its kind does not expect."""

    def record(self, kind: str, outcome: str) -> None:
        self.outcomes[outcome] += 1
        self.by_kind.setdefault(kind, Counter())[outcome] += 1
        if outcome != expected(kind):
            self.failures[f"{kind}: {outcome}"] += 1

    @property
    def done(self) -> int:
        return sum(self.outcomes.values())


def expected(kind: str) -> str:
    if kind in EXPECTED_4XX:
        return f"4xx:{EXPECTED_4XX[kind]}"
    if kind in DISCONNECTS:
        return "client_disconnected"
    return "ok"


def proc_usage(pid: int) -> tuple[int, int]:
    """(RSS in bytes, open file descriptors) of a process, from /proc."""
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
                break
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


class Prompts:
    """Shared prefixes: each request is one of `tenants` long system prompts plus a question
    of its own, so routing has prefixes to keep warm."""

    def __init__(self, rng: random.Random, tenants: int = 8, chars: int = 1500) -> None:
        self.rng = rng
        self.systems = [self._text(chars, t) for t in range(tenants)]

    def _text(self, chars: int, seed: int) -> str:
        r = random.Random(seed)
        words: list[str] = []
        while sum(len(w) + 1 for w in words) < chars:
            words.append(r.choice(WORDS))
        return " ".join(words)

    def chat(self) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.rng.choice(self.systems)},
                {"role": "user", "content": self._question()}]

    def completion(self) -> str:
        return self.rng.choice(self.systems) + "\n" + self._question()

    def _question(self) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(3, 30)))


class Replicas:
    """Simulated replica processes, one each, that can be killed and started again on the
    same port."""

    def __init__(self, fleet: Fleet, kinds: list[str], time_scale: float) -> None:
        self.fleet = fleet
        self.kinds = kinds
        self.time_scale = time_scale
        self.ports = processes.free_ports(len(kinds))
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        self.procs: list[subprocess.Popen | None] = [None] * len(kinds)
        self.restarts = [0] * len(kinds)

    def start(self, i: int) -> None:
        cmd = [sys.executable, "-m", "backends.sim", "--port", str(self.ports[i]),
               "--kind", self.kinds[i], "--model", MODEL, "--profile", "llama-8b-h200",
               "--time-scale", str(self.time_scale), "--name", f"sim{i}"]
        self.procs[i] = self.fleet.spawn(cmd, f"sim-{i}.{self.restarts[i]}")
        self.restarts[i] += 1

    def start_all(self) -> None:
        for i in range(len(self.kinds)):
            self.start(i)
        processes.wait_healthy(self.urls, [p for p in self.procs if p], deadline_s=60)

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            self.fleet.procs.remove(proc)
        self.procs[i] = None


def soak_config(realtime: list[str], batch: list[str], port: int) -> dict[str, Any]:
    """Two pools as `prefix-gateway up` has them, with health checks quick enough to follow
    replicas that die and come back within seconds."""
    health = {"interval_s": 0.5, "timeout_s": 1, "failure_threshold": 1,
              "metrics_interval_s": 1}
    return {
        "server": {"host": "127.0.0.1", "port": port, "max_body_bytes": MAX_BODY},
        "pools": [
            {"name": "realtime", "engine": "vllm", "models": [MODEL], "health": health,
             "replicas": [{"name": f"rt-{i}", "url": u} for i, u in enumerate(realtime)]},
            {"name": "batch", "engine": "trtllm", "models": [MODEL], "health": health,
             "replicas": [{"name": f"bt-{i}", "url": u} for i, u in enumerate(batch)]},
        ],
        "traffic_classes": [{"name": "realtime", "pool": "realtime"},
                            {"name": "batch", "pool": "batch"}],
        "classification": {"header": "x-traffic-class", "default_class": "realtime"},
    }


class Load:
    """Open-loop arrivals of the MIX at `rate` per second against the gateway."""

    def __init__(self, url: str, rate: float, seed: int, tally: Tally) -> None:
        self.url = url
        self.rate = rate
        self.rng = random.Random(seed)
        self.prompts = Prompts(self.rng)
        self.tally = tally
        self.kinds = list(MIX)
        self.weights = [MIX[k] for k in self.kinds]
        self.tasks: set[asyncio.Task] = set()

    async def run(self, session: aiohttp.ClientSession, until: float) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while loop.time() < until:
            kind = self.rng.choices(self.kinds, self.weights)[0]
            task = asyncio.create_task(self.one(session, kind))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
            self.tally.sent += 1
            next_at += self.rng.expovariate(self.rate)
            await asyncio.sleep(max(0.0, next_at - loop.time()))

    async def one(self, session: aiohttp.ClientSession, kind: str) -> None:
        try:
            outcome = await self._send(session, kind)
        except (aiohttp.ClientError, OSError) as exc:
            outcome = f"transport_error:{type(exc).__name__}"
        except TimeoutError:
            outcome = "timeout"
        self.tally.record(kind, outcome)

    def _body(self, kind: str) -> tuple[str, bytes, bool]:
        """(path, body, stream) of one request of `kind`."""
        rng = self.rng
        chat = kind.startswith("chat") if kind in _INFERENCE else rng.random() < 0.5
        stream = kind.endswith("stream")
        max_tokens = rng.randint(4, 64)
        if kind == "disconnect_mid_request":
            max_tokens = 400  # long enough to still be generating when the client leaves
        path = "/v1/chat/completions" if chat else "/v1/completions"
        payload: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "stream": stream}
        if chat:
            payload["messages"] = self.prompts.chat()
        else:
            payload["prompt"] = self.prompts.completion()
        if kind == "unknown_model":
            payload["model"] = "no-such-model"
        elif kind == "wrong_type":
            payload[rng.choice(["model", "stream", "messages" if chat else "prompt"])] = 42
        elif kind == "huge_body":
            key = "messages" if chat else "prompt"
            filler = "x" * (MAX_BODY + 1024)
            payload[key] = [{"role": "user", "content": filler}] if chat else filler
        body = json.dumps(payload).encode()
        if kind == "bad_json":
            body = body[: rng.randint(1, len(body) - 1)]
        return path, body, stream

    async def _send(self, session: aiohttp.ClientSession, kind: str) -> str:
        path, body, stream = self._body(kind)
        headers = {"content-type": "application/json"}
        if self.rng.random() < 0.2:
            headers["x-traffic-class"] = "batch"
        request = session.post(self.url + path, data=body, headers=headers)
        if kind == "disconnect_mid_request":
            # Leave while the replica is still generating: the gateway must drop its upstream
            # request and everything it held for it.
            try:
                async with asyncio.timeout(self.rng.uniform(0.05, 0.3)):
                    async with request as resp:
                        await resp.read()
                        return _status_outcome(resp.status)
            except TimeoutError:
                return "client_disconnected"
        async with request as resp:
            if resp.status != 200:
                await resp.read()
                return _status_outcome(resp.status)
            if not stream:
                data = await resp.json(content_type=None)
                return "ok" if data.get("choices") else "bad_body"
            events = 0
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return "ok"
                if data.startswith(b'{"error"'):
                    # Before any content: a request another replica could still have served.
                    return "error_mid_stream" if events else "error_before_content"
                events += 1
                if kind == "disconnect_mid_stream" and events >= 2:
                    resp.close()  # drop the connection mid-stream
                    return "client_disconnected"
            return "stream_cut"  # ended without [DONE] or an error event


def _status_outcome(status: int) -> str:
    if 200 <= status < 300:
        return "ok"
    return f"{status // 100}xx:{status}"


@dataclass
class Sample:
    t: float
    rss: int
    fds: int


class Soak:
    def __init__(self, args: argparse.Namespace, out) -> None:
        self.args = args
        self.out = out
        self.tally = Tally()
        self.samples: list[Sample] = []
        self.kills: list[dict[str, Any]] = []
        self.reports: list[dict[str, Any]] = []

    def snapshot(self, elapsed: float, pid: int) -> dict[str, Any]:
        t = self.tally
        rss, fds = proc_usage(pid)
        return {"elapsed_s": round(elapsed, 1), "sent": t.sent, "done": t.done,
                "in_flight": t.sent - t.done, "outcomes": dict(sorted(t.outcomes.items())),
                "failures": dict(sorted(t.failures.items())),
                "rss_mb": round(rss / 2**20, 1), "fds": fds, "kills": len(self.kills)}

    def print_report(self, rep: dict[str, Any]) -> None:
        outcomes = ", ".join(f"{k} {v}" for k, v in rep["outcomes"].items())
        failures = ", ".join(f"{k} {v}" for k, v in rep["failures"].items()) or "none"
        print(f"[{rep['elapsed_s']:7.1f}s] sent {rep['sent']} done {rep['done']} "
              f"in flight {rep['in_flight']} | {outcomes} | failures: {failures} | "
              f"gateway RSS {rep['rss_mb']} MB, fds {rep['fds']} | kills {rep['kills']}",
              file=self.out, flush=True)

    async def run(self, url: str, gateway_pid: int, replicas: Replicas) -> dict[str, Any]:
        a = self.args
        loop = asyncio.get_running_loop()
        start = loop.time()
        duration = a.seconds if a.seconds is not None else a.minutes * 60
        end = start + duration
        load = Load(url, a.rate, a.seed, self.tally)
        baseline_at = min(120.0, duration / 5)
        baseline: Sample | None = None
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        async with aiohttp.ClientSession(connector=connector,
                                         timeout=aiohttp.ClientTimeout(total=60)) as session:
            runner = asyncio.create_task(load.run(session, end))
            faults = asyncio.create_task(self.faults(replicas, start, end))
            next_sample = start
            next_report = start + a.report_every_s
            while loop.time() < end:
                await asyncio.sleep(max(0.0, min(next_sample, next_report, end)
                                        - loop.time()))
                now = loop.time()
                if now >= next_sample:
                    rss, fds = proc_usage(gateway_pid)
                    self.samples.append(Sample(round(now - start, 1), rss, fds))
                    if baseline is None and now - start >= baseline_at:
                        baseline = self.samples[-1]
                    next_sample += a.sample_every_s
                if now >= next_report and now < end:
                    rep = self.snapshot(now - start, gateway_pid)
                    self.reports.append(rep)
                    self.print_report(rep)
                    next_report += a.report_every_s
            await runner
            faults.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await faults
            # Every request still in flight ends (or times out) before the final count.
            if load.tasks:
                await asyncio.wait(list(load.tasks), timeout=90)
        # Idle: whatever the gateway still holds for requests that ended is what it retains.
        await asyncio.sleep(a.settle_s)
        final = self.snapshot(loop.time() - start, gateway_pid)
        self.print_report(final)
        rss_end, fds_end = proc_usage(gateway_pid)
        baseline = baseline or (self.samples[0] if self.samples else Sample(0, rss_end, fds_end))
        growth = (rss_end - baseline.rss) / baseline.rss if baseline.rss else 0.0
        memory = {"baseline_at_s": baseline.t, "rss_baseline_mb": round(baseline.rss / 2**20, 1),
                  "rss_end_mb": round(rss_end / 2**20, 1), "rss_growth": round(growth, 4),
                  "within_5_percent": abs(growth) <= 0.05,
                  "fds_baseline": baseline.fds, "fds_end": fds_end}
        print(f"memory: RSS {memory['rss_end_mb']} MB at the end vs "
              f"{memory['rss_baseline_mb']} MB at {baseline.t:.0f}s: {growth:+.1%} "
              f"({'within' if memory['within_5_percent'] else 'OUTSIDE'} 5%); fds "
              f"{fds_end} vs {baseline.fds}", file=self.out, flush=True)
        t = self.tally
        return {
            "duration_s": duration, "rate": a.rate, "seed": a.seed,
            "mix": MIX, "sent": t.sent, "done": t.done,
            "outcomes": dict(sorted(t.outcomes.items())),
            "by_kind": {k: dict(sorted(v.items())) for k, v in sorted(t.by_kind.items())},
            "failures": dict(sorted(t.failures.items())),
            "kills": self.kills, "memory": memory, "reports": self.reports,
            "samples": [{"t": s.t, "rss_mb": round(s.rss / 2**20, 1), "fds": s.fds}
                        for s in self.samples],
        }

    async def faults(self, replicas: Replicas, start: float, end: float) -> None:
        """SIGKILL one replica every `kill_every_s` (in turn), start it again
        `restart_after_s` later on the same port."""
        a = self.args
        loop = asyncio.get_running_loop()
        i = 0
        while loop.time() + a.kill_every_s < end:
            await asyncio.sleep(a.kill_every_s)
            victim = i % len(replicas.urls)
            i += 1
            replicas.kill(victim)
            self.kills.append({"t_s": round(loop.time() - start, 1), "replica": victim})
            await asyncio.sleep(a.restart_after_s)
            replicas.start(victim)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtests.soak", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0, help="duration (default 10)")
    p.add_argument("--seconds", type=float, default=None, help="duration, overriding --minutes")
    p.add_argument("--rate", type=float, default=30.0, help="requests per second (default 30)")
    p.add_argument("--seed", type=int, default=1)
    # Two per pool: one replica killed never leaves a pool empty, so every failure is one a
    # gateway could have avoided.
    p.add_argument("--realtime-replicas", type=int, default=2)
    p.add_argument("--batch-replicas", type=int, default=2)
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="simulated replicas' latency scale (default 1: an 8B model on an H200)")
    p.add_argument("--kill-every-s", type=float, default=45.0,
                   help="SIGKILL a replica this often (in turn; default 45)")
    p.add_argument("--restart-after-s", type=float, default=5.0,
                   help="start a killed replica again after this long (default 5)")
    p.add_argument("--report-every-s", type=float, default=30.0)
    p.add_argument("--sample-every-s", type=float, default=5.0,
                   help="how often RSS and descriptors are sampled (default 5)")
    p.add_argument("--settle-s", type=float, default=2.0,
                   help="idle time before the final reading (default 2)")
    p.add_argument("--json", action="store_true",
                   help="print the final report as JSON on stdout (progress goes to stderr)")
    p.add_argument("--log-dir", default=None, help="where process logs go (default: a temp dir)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = sys.stderr if args.json else sys.stdout
    fleet = Fleet(log_dir=_dir(args.log_dir)) if args.log_dir else Fleet()
    with sigterm_as_interrupt(), fleet:
        kinds = ["vllm"] * args.realtime_replicas + ["trtllm"] * args.batch_replicas
        replicas = Replicas(fleet, kinds, args.time_scale)
        replicas.start_all()
        n_rt = args.realtime_replicas
        config = soak_config(replicas.urls[:n_rt], replicas.urls[n_rt:],
                             processes.free_ports(1)[0])
        url, gw = fleet.start_gateway_config(config)
        print(f"soak: gateway {url} (pid {gw.pid}), {len(kinds)} simulated replicas, "
              f"{args.rate:g} req/s for {args.seconds or args.minutes * 60:g}s; logs in "
              f"{fleet.log_dir}", file=out, flush=True)
        result = run_async(Soak(args, out).run(url, gw.pid, replicas))
        result["gateway_exit_code"] = gw.poll()
        result["log_dir"] = str(fleet.log_dir)
    if args.json:
        print(json.dumps(result, indent=2))
    return 0


def _dir(path: str) -> Path:
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    return d


if __name__ == "__main__":
    sys.exit(main())
