"""Realtime TTFT under a batch flood: pools isolated, borrowing on, and one pool without
admission control, each against realtime traffic alone.

Starts simulated replicas (a realtime pool and a batch pool, one process each) and a Redis
server once; then, for each scenario, a gateway on its own configuration. A steady, open-loop
stream of realtime chat requests (streaming, a few shared system prompts) runs through the
gateway while a batch of chat lines that share a few long system prompts goes through the
OpenAI Batch API (`files.create`, `batches.create`, polled with `batches.retrieve`). Realtime
TTFT is measured at the client and counted only for requests sent while the batch ran; row
(0) is the same realtime stream before any batch was submitted.

    python -m loadtests.batch_flood            # the documented run (about 6 minutes)
    python -m loadtests.batch_flood --smoke    # a check that it all runs (about 1.5 minutes)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import random
import sys
import time
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import openai
import orjson

from gateway.processes import free_ports
from loadtests.caches import reset_prefix_caches
from loadtests.fleet import MODEL, Fleet, run_async, sigterm_as_interrupt
from loadtests.metrics import labelled_values, wait_idle
from loadtests.report import cell, emit_json, markdown_table, text_table
from loadtests.stats import percentile
from loadtests.traces import WORDS

ALONE, ISOLATED, BORROW, ONE_POOL = "alone", "isolated", "borrow", "one_pool"
ROWS = (ALONE, ISOLATED, BORROW, ONE_POOL)
ROW_LABELS = {
    ALONE: "(0) realtime alone, no batch",
    ISOLATED: "(a) pools isolated + batch",
    BORROW: "(b) borrowing on + batch",
    ONE_POOL: "(c) one pool, no admission + batch",
}
# Each gateway runs these rows, in this order. Row (0) is measured on the isolated and on the
# borrowing gateway before their batch (the same realtime pool, no batch traffic yet), and
# its windows are pooled: its samples then come from two moments of the run, as the batch
# rows' do, so a machine busier at one moment than another biases the ratio less.
GATEWAYS = ((ISOLATED, (ALONE, ISOLATED)), (BORROW, (ALONE, BORROW)), (ONE_POOL, (ONE_POOL,)))
TARGET_P99_RATIO = 1.2
BATCH_CLASS_HEADER = "x-traffic-class"
# The gateway's extra field of a batch object: the engines' prefix-cache figures over its
# lines, {"prompt_tokens", "cached_tokens", "hit_ratio"}.
BATCH_CACHE_FIELD = "prefix_cache"


def log(msg: str) -> None:
    print(f"batch_flood: {msg}", file=sys.stderr, flush=True)


# -- the workload (pure) ---------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """What the clients send. Token counts are the simulated engine's (UTF-8 bytes / 4)."""

    realtime_rate: float = 20.0         # realtime requests per second, Poisson arrivals
    realtime_prompts: int = 8           # shared realtime system prompts
    realtime_system_tokens: int = 1500
    realtime_user_tokens: int = 60
    realtime_max_tokens: int = 32
    batch_lines: int = 2000
    batch_prompts: int = 4              # long system prompts the batch lines share
    batch_system_tokens: int = 2000
    batch_user_tokens: int = 150
    batch_max_tokens: int = 64
    seed: int = 0


def filler(seed: int, tokens: int, head: str = "") -> str:
    """Deterministic text of about `tokens` engine tokens (4 bytes each), starting with
    `head`; distinct seeds give distinct text from the first word on."""
    rng = random.Random(seed)
    target = max(len(head), 4 * tokens)
    parts = [head] if head else []
    size = len(head)
    while size < target:
        w = rng.choice(WORDS)
        parts.append(w)
        size += len(w) + 1
    return " ".join(parts)[:target]


def system_prompts(kind: str, n: int, tokens: int, seed: int) -> list[str]:
    """`n` distinct system prompts of about `tokens` tokens each; the first words name the
    prompt, so two prompts differ from their first hashed block on."""
    return [filler(zlib.crc32(f"{kind}/{seed}/{i}".encode()), tokens,
                   f"You are assistant {i} of the {kind} service.")
            for i in range(n)]


def realtime_messages(wl: Workload, prompts: Sequence[str], i: int) -> list[dict[str, str]]:
    """The messages of realtime request `i`: one of the shared system prompts (chosen by a
    seeded draw) and a question of its own."""
    rng = random.Random(wl.seed * 1_000_003 + i)
    system = prompts[rng.randrange(len(prompts))]
    user = filler(rng.getrandbits(32), wl.realtime_user_tokens, f"Question {i}:")
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def arrivals(rate: float, seed: int) -> Iterator[float]:
    """Poisson arrival times in seconds from 0 at `rate` per second, without end."""
    rng = random.Random(seed)
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        yield t


def batch_lines(wl: Workload, prompts: Sequence[str]) -> list[dict[str, Any]]:
    """The batch input, one dict per line in OpenAI's format: each line takes one of the few
    long system prompts and a document of its own; prompts are interleaved at random, as a
    batch built from several jobs would be."""
    rng = random.Random(wl.seed + 7919)
    out = []
    for j in range(wl.batch_lines):
        system = prompts[rng.randrange(len(prompts))]
        doc = filler(rng.getrandbits(32), wl.batch_user_tokens, f"Document {j}:")
        out.append({
            "custom_id": f"line-{j}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": MODEL, "max_tokens": wl.batch_max_tokens,
                     "messages": [{"role": "system", "content": system},
                                  {"role": "user", "content": doc}]},
        })
    return out


def to_jsonl(lines: Sequence[dict[str, Any]]) -> bytes:
    return b"".join(orjson.dumps(line) + b"\n" for line in lines)


# -- the gateway's configuration per scenario (pure) -----------------------------------------


@dataclass(frozen=True)
class Admission:
    """Admission settings of the isolated and borrowing gateways (the one-pool gateway has
    none, as a deployment without this gateway would)."""

    realtime_per_replica: int = 16      # max_inflight_per_replica of the realtime pool
    batch_per_replica: int = 32         # max_inflight_per_replica of the batch pool
    reserved_fraction: float = 0.25     # share of each pool never lent to another class
    borrow_below: float = 0.3           # the batch class borrows while realtime's load < this
    batch_concurrency: int = 128        # lines of the batch in flight at once


def scenario_config(scenario: str, realtime_urls: Sequence[str], batch_urls: Sequence[str],
                    port: int, redis_url: str | None, adm: Admission) -> dict[str, Any]:
    """The gateway configuration (as the YAML file holds it) of ISOLATED, BORROW or
    ONE_POOL, on the same replicas: realtime-* and batch-* replicas in their own pools, or
    all in one pool `shared`."""
    def replicas(prefix: str, urls: Sequence[str]) -> list[dict[str, str]]:
        return [{"name": f"{prefix}-{i}", "url": u} for i, u in enumerate(urls)]

    # Lenient health checks: on a small machine a busy event loop must not take replicas
    # out of rotation; this measures admission, not failure detection.
    health = {"timeout_s": 10.0, "failure_threshold": 3}
    cfg: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "port": port},
        "classification": {"header": BATCH_CLASS_HEADER, "default_class": "realtime"},
    }
    if redis_url:
        cfg["redis"] = {"url": redis_url}
        cfg["batch"] = {"concurrency": adm.batch_concurrency}
    if scenario == ONE_POOL:
        cfg["pools"] = [{"name": "shared", "engine": "vllm", "models": [MODEL], "health": health,
                         "replicas": [*replicas("realtime", realtime_urls),
                                      *replicas("batch", batch_urls)]}]
        cfg["traffic_classes"] = [{"name": "realtime", "pool": "shared"},
                                  {"name": "batch", "pool": "shared"}]
        return cfg
    if scenario not in (ISOLATED, BORROW):
        raise ValueError(f"no gateway configuration for scenario {scenario!r}")
    cfg["pools"] = [
        {"name": "realtime", "engine": "vllm", "models": [MODEL], "health": health,
         "max_inflight_per_replica": adm.realtime_per_replica,
         "reserved_fraction": adm.reserved_fraction,
         "replicas": replicas("realtime", realtime_urls)},
        {"name": "batch", "engine": "vllm", "models": [MODEL], "health": health,
         "max_inflight_per_replica": adm.batch_per_replica,
         "reserved_fraction": adm.reserved_fraction,
         "replicas": replicas("batch", batch_urls)},
    ]
    # Batch lines queue as long as they must (the runner holds at most batch_concurrency).
    batch_admission: dict[str, Any] = {"max_queue": 4096, "max_queue_wait_s": 3600}
    if scenario == BORROW:
        batch_admission["borrow"] = [{"pool": "realtime", "while_below": adm.borrow_below}]
    cfg["traffic_classes"] = [
        {"name": "realtime", "pool": "realtime", "priority": 10,
         "admission": {"max_queue": 256, "max_queue_wait_s": 30}},
        {"name": "batch", "pool": "batch", "priority": 0, "admission": batch_admission},
    ]
    return cfg


# -- results (pure) --------------------------------------------------------------------------


@dataclass(slots=True)
class Sent:
    """One realtime request as the client saw it."""

    sent_at: float                      # perf_counter when it was sent
    ttft_s: float | None = None
    status: int = 0
    error: str = ""


@dataclass
class BatchOutcome:
    status: str = ""
    duration_s: float | None = None
    lines: int = 0                      # lines in the output file
    distinct_ids: int = 0
    failed: int = 0                     # lines in the error file, or non-200 outputs
    hit_ratio: float | None = None      # the batch object's engine-reported figure
    usage_hit_ratio: float | None = None  # cached / prompt tokens over the output's usage
    error: str = ""


def in_window(sent: Sequence[Sent], start: float, end: float) -> list[Sent]:
    """The realtime requests sent in [start, end)."""
    return [s for s in sent if start <= s.sent_at < end]


def realtime_summary(window: Sequence[Sent], window_s: float) -> dict[str, Any]:
    """TTFT figures of the realtime requests of a window (or of several pooled) lasting
    `window_s` seconds in all."""
    ok = [s.ttft_s for s in window if s.ttft_s is not None and s.status == 200]
    return {
        "realtime_sent": len(window),
        "realtime_ok": len(ok),
        "realtime_rejected": sum(1 for s in window if s.status == 429),
        "realtime_errors": sum(1 for s in window if s.status not in (200, 429)),
        "ttft_p50_s": percentile(ok, 0.5),
        "ttft_p99_s": percentile(ok, 0.99),
        "ttft_mean_s": sum(ok) / len(ok) if ok else None,
        "window_s": window_s,
    }


def targets(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The targets, from the rows measured: (b)'s p99 within 1.2x of (0)'s, (b)'s batch
    faster than (a)'s, (c)'s p99 visibly worse than (0)'s (above 1.2x). A target whose rows
    are missing is None."""
    def get(row: str, key: str) -> float | None:
        return rows.get(row, {}).get(key)  # a failed row has none of the figures

    base = get(ALONE, "ttft_p99_s")
    b99, c99 = get(BORROW, "ttft_p99_s"), get(ONE_POOL, "ttft_p99_s")
    ta, tb = get(ISOLATED, "batch_duration_s"), get(BORROW, "batch_duration_s")
    a99 = get(ISOLATED, "ttft_p99_s")
    ratio_b = b99 / base if b99 is not None and base else None
    ratio_c = c99 / base if c99 is not None and base else None
    return {
        "borrow_p99_over_alone": ratio_b,
        "one_pool_p99_over_alone": ratio_c,
        # Not a target: with pools isolated the realtime replicas never see batch work, so
        # what (a) adds to (0) is the machine (the gateway and the simulated fleet sharing
        # its cores with the flood); (b) over (a) is what borrowing itself costs.
        "isolated_p99_over_alone": a99 / base if a99 is not None and base else None,
        "borrow_p99_over_isolated": b99 / a99 if b99 is not None and a99 else None,
        "borrow_p99_met": None if ratio_b is None else ratio_b <= TARGET_P99_RATIO,
        "borrow_faster_met": None if ta is None or tb is None else tb < ta,
        "one_pool_hurts_met": None if ratio_c is None else ratio_c > TARGET_P99_RATIO,
    }


def _ms(v: float | None) -> str:
    return cell(None if v is None else v * 1000, "{:.0f}")


def table_rows(rows: dict[str, dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Header and cells of the results table, one row per scenario measured, in ROWS order."""
    header = ["scenario", "realtime sent", "429", "errors", "TTFT p50 ms", "TTFT p99 ms",
              "batch s", "batch lines ok", "batch hit ratio", "batch on realtime replicas",
              "load avg"]
    out = []
    for key in ROWS:
        r = rows.get(key)
        if r is None:
            continue
        if "failed" in r:
            out.append([ROW_LABELS[key], "failed", *["-"] * (len(header) - 2)])
            continue
        batch = key != ALONE
        lines = f"{r.get('batch_ok', 0)}/{r.get('batch_lines_sent', 0)}" if batch else "-"
        out.append([
            ROW_LABELS[key], str(r["realtime_sent"]), str(r["realtime_rejected"]),
            str(r["realtime_errors"]), _ms(r["ttft_p50_s"]), _ms(r["ttft_p99_s"]),
            cell(r.get("batch_duration_s"), "{:.1f}") if batch else "-", lines,
            cell(r.get("batch_hit_ratio")) if batch else "-",
            cell(r.get("batch_on_realtime_replicas"), "{:.1%}") if batch else "-",
            cell(r.get("load_avg_1m"), "{:.1f}"),
        ])
    return header, out


def summary_lines(rows: dict[str, dict[str, Any]]) -> list[str]:
    """The ratio of (b)'s p99 to (0)'s and whether each target was met."""
    t = targets(rows)

    def verdict(met: bool | None) -> str:
        return "not measured" if met is None else ("met" if met else "NOT met")

    def x(key: str) -> str:
        return cell(t[key], "{:.2f}x")

    return [
        f"(b) realtime p99 / (0) realtime p99 = {x('borrow_p99_over_alone')} (target <= "
        f"{TARGET_P99_RATIO}x: {verdict(t['borrow_p99_met'])})",
        f"(b) batch faster than (a): {verdict(t['borrow_faster_met'])}",
        f"(c) realtime p99 / (0) realtime p99 = {x('one_pool_p99_over_alone')} (must visibly "
        f"hurt, > {TARGET_P99_RATIO}x: {verdict(t['one_pool_hurts_met'])})",
        f"for reading the above: (a) / (0) = {x('isolated_p99_over_alone')} (no batch work on "
        f"realtime replicas: the machine's share), (b) / (a) = "
        f"{x('borrow_p99_over_isolated')} (what borrowing adds)",
    ]


# -- the clients -----------------------------------------------------------------------------


async def send_realtime(client: httpx.AsyncClient, url: str, body: bytes, out: Sent) -> None:
    """Stream one realtime chat request; TTFT is the first chunk whose delta has content."""
    try:
        async with client.stream("POST", url + "/v1/chat/completions", content=body,
                                 headers={"content-type": "application/json"}) as r:
            out.status = r.status_code
            if r.status_code != 200:
                out.error = (await r.aread())[:200].decode(errors="replace")
                return
            async for line in r.aiter_lines():
                if out.ttft_s is not None or not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                with contextlib.suppress(orjson.JSONDecodeError, AttributeError, IndexError):
                    choice = (orjson.loads(data).get("choices") or [{}])[0]
                    if (choice.get("delta") or {}).get("content"):
                        out.ttft_s = time.perf_counter() - out.sent_at
        if out.ttft_s is None:
            out.status, out.error = 0, "no content in stream"
    except httpx.HTTPError as exc:
        out.status, out.error = 0, f"{type(exc).__name__}: {exc}"[:200]


async def realtime_load(url: str, wl: Workload, prompts: Sequence[str], stop: asyncio.Event,
                        sent: list[Sent]) -> None:
    """Open loop: send realtime requests at Poisson times until `stop` is set, whatever the
    answers (so queueing shows as latency, not as a lower rate); then wait for those in
    flight."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as client:
        tasks: set[asyncio.Task[None]] = set()
        t0 = time.perf_counter()
        for i, t in enumerate(arrivals(wl.realtime_rate, wl.seed)):
            delay = t0 + t - time.perf_counter()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), delay)
            if stop.is_set():
                break
            body = orjson.dumps({"model": MODEL, "stream": True,
                                 "max_tokens": wl.realtime_max_tokens,
                                 "messages": realtime_messages(wl, prompts, i)})
            s = Sent(time.perf_counter())
            sent.append(s)
            task = asyncio.create_task(send_realtime(client, url, body, s))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(tasks)


def _hit_ratio_of_outputs(outputs: Sequence[dict[str, Any]]) -> float | None:
    cached = prompt = 0
    for o in outputs:
        usage = ((o.get("response") or {}).get("body") or {}).get("usage") or {}
        prompt += int(usage.get("prompt_tokens") or 0)
        cached += int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return cached / prompt if prompt else None


async def run_batch_api(url: str, data: bytes, poll_s: float, timeout_s: float,
                        started: asyncio.Event) -> BatchOutcome:
    """Upload `data` and run it through the Batch API with the official client; the time
    from `batches.create` to a final status, and what the output file holds."""
    out = BatchOutcome()
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=2) as client:
        f = await client.files.create(file=("flood.jsonl", data), purpose="batch")
        t0 = time.perf_counter()
        started.set()
        b = await client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                        completion_window="24h")
        end = t0 + timeout_s
        while b.status not in ("completed", "failed", "expired", "cancelled"):
            if time.perf_counter() > end:
                out.error = f"still {b.status} after {timeout_s:.0f} s"
                return out
            await asyncio.sleep(poll_s)
            b = await client.batches.retrieve(b.id)
        out.duration_s = time.perf_counter() - t0
        out.status = b.status
        cache = (b.model_extra or {}).get(BATCH_CACHE_FIELD) or {}
        out.hit_ratio = cache.get("hit_ratio")
        outputs = []
        if b.output_file_id:
            text = (await client.files.content(b.output_file_id)).content
            outputs = [orjson.loads(line) for line in text.splitlines() if line.strip()]
        if b.error_file_id:
            text = (await client.files.content(b.error_file_id)).content
            out.failed += sum(1 for line in text.splitlines() if line.strip())
    out.lines = len(outputs)
    out.distinct_ids = len({o.get("custom_id") for o in outputs})
    out.failed += sum(1 for o in outputs
                      if (o.get("response") or {}).get("status_code") != 200 or o.get("error"))
    out.usage_hit_ratio = _hit_ratio_of_outputs(outputs)
    return out


async def run_batch_requests(url: str, lines: Sequence[dict[str, Any]], concurrency: int,
                             started: asyncio.Event) -> BatchOutcome:
    """The batch's lines as plain requests of the batch class, `concurrency` at a time: for
    a gateway without the Batch API (no Redis)."""
    out = BatchOutcome()
    outputs: list[dict[str, Any]] = []
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    headers = {"content-type": "application/json", BATCH_CLASS_HEADER: "batch"}
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        async def one(line: dict[str, Any]) -> None:
            async with sem:
                try:
                    r = await client.post(url + line["url"], content=orjson.dumps(line["body"]),
                                          headers=headers)
                    body = r.json() if r.status_code == 200 else None
                    outputs.append({"custom_id": line["custom_id"],
                                    "response": {"status_code": r.status_code, "body": body}})
                except (httpx.HTTPError, ValueError):
                    outputs.append({"custom_id": line["custom_id"], "error": "request failed"})

        t0 = time.perf_counter()
        started.set()
        await asyncio.gather(*(one(line) for line in lines))
        out.duration_s = time.perf_counter() - t0
    out.status = "completed"
    out.lines = len(outputs)
    out.distinct_ids = len({o["custom_id"] for o in outputs})
    out.failed = sum(1 for o in outputs
                     if o.get("error") or o["response"]["status_code"] != 200)
    out.hit_ratio = out.usage_hit_ratio = _hit_ratio_of_outputs(outputs)
    return out


# -- one gateway's run -----------------------------------------------------------------------


@dataclass
class Options:
    wl: Workload = field(default_factory=Workload)
    adm: Admission = field(default_factory=Admission)
    warmup_s: float = 10.0
    alone_s: float = 30.0
    batch_via: str = "api"              # "api" (the Batch API) or "requests"
    poll_s: float = 0.25
    batch_timeout_s: float = 900.0


def requests_by_replica_and_class(gateway_url: str) -> dict[tuple[str, str], float]:
    """Finished requests per (replica, traffic class), from the gateway's /metrics."""
    r = httpx.get(gateway_url + "/metrics", timeout=10)
    r.raise_for_status()
    out: dict[tuple[str, str], float] = {}
    for labels, value in labelled_values(r.text, "gateway_requests_total"):
        key = (labels.get("replica", ""), labels.get("traffic_class", ""))
        out[key] = out.get(key, 0.0) + value
    return out


def share_on_realtime_replicas(counts: dict[tuple[str, str], float]) -> float | None:
    """The batch class's share of requests that realtime-* replicas served."""
    batch = {rep: n for (rep, cls), n in counts.items() if cls == "batch"}
    total = sum(batch.values())
    if not total:
        return None
    return sum(n for rep, n in batch.items() if rep.startswith("realtime-")) / total


def _realtime_child(url: str, wl: Workload, prompts: Sequence[str], stop: Any,
                    conn: Any) -> None:
    """The realtime load generator's process: `realtime_load` until `stop` (a
    multiprocessing Event) is set, then every request's figures sent back over `conn`."""
    sent: list[Sent] = []

    async def main() -> None:
        done = asyncio.Event()
        loop = asyncio.get_running_loop()
        # The multiprocessing Event blocks: wait for it in a thread, wake the loop after.
        waiter = loop.run_in_executor(None, stop.wait)
        waiter.add_done_callback(lambda _: done.set())
        await realtime_load(url, wl, prompts, done, sent)

    try:
        run_async(main())
    finally:
        conn.send([(s.sent_at, s.ttft_s, s.status, s.error) for s in sent])
        conn.close()


class RealtimeProcess:
    """The realtime load in a process of its own, so that nothing else the benchmark does
    (submitting, polling, a batch sent as requests) delays its sends or its reads.
    Timestamps are `time.perf_counter()`, the system-wide monotonic clock on Linux, so the
    parent can cut windows from them."""

    def __init__(self, url: str, wl: Workload, prompts: Sequence[str]) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._stop = ctx.Event()
        self._recv, send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_realtime_child, args=(url, wl, list(prompts),
                                                                self._stop, send),
                                 name="realtime-load", daemon=True)
        self._proc.start()
        send.close()

    def finish(self, timeout_s: float = 180.0) -> list[Sent]:
        """Stop sending, wait for the requests in flight; every request's figures."""
        self._stop.set()
        try:
            if not self._recv.poll(timeout_s):
                raise RuntimeError(f"the realtime load did not finish within {timeout_s:.0f} s")
            rows = self._recv.recv()
        except EOFError:
            raise RuntimeError(f"the realtime load process died (exit code "
                               f"{self._proc.exitcode})") from None
        finally:
            self._proc.join(timeout=10)
            if self._proc.is_alive():
                self._proc.kill()
        return [Sent(at, ttft, status, error) for at, ttft, status, error in rows]


@dataclass
class GatewayRun:
    """What one gateway's run measured: each row's realtime requests and window length, and
    the batch's outcome."""

    windows: dict[str, tuple[list[Sent], float]] = field(default_factory=dict)
    batch: BatchOutcome | None = None
    alone_load: float = 0.0             # the 1-minute load average after row (0)'s window


async def run_gateway(url: str, rows: Sequence[str], opts: Options,
                      realtime_prompts: Sequence[str],
                      lines: Sequence[dict[str, Any]]) -> GatewayRun:
    """Realtime load through one gateway: a warm-up, row (0)'s window if asked, then the
    batch, with the realtime requests sent while it ran as the batch row's window."""
    load = RealtimeProcess(url, opts.wl, realtime_prompts)
    windows: dict[str, tuple[float, float]] = {}
    outcome: BatchOutcome | None = None
    alone_load = 0.0
    batch_row = next((r for r in rows if r != ALONE), None)
    try:
        await asyncio.sleep(opts.warmup_s)
        if ALONE in rows:
            t0 = time.perf_counter()
            log(f"(0): realtime alone for {opts.alone_s:.0f} s")
            await asyncio.sleep(opts.alone_s)
            windows[ALONE] = (t0, time.perf_counter())
            alone_load = os.getloadavg()[0]
        if batch_row is not None:
            started = asyncio.Event()
            log(f"{ROW_LABELS[batch_row]}: {len(lines)} batch lines via {opts.batch_via}")
            if opts.batch_via == "api":
                job = run_batch_api(url, to_jsonl(lines), opts.poll_s, opts.batch_timeout_s,
                                    started)
            else:
                job = run_batch_requests(url, lines, opts.adm.batch_concurrency, started)
            task = asyncio.create_task(job)
            # Until the batch starts (or the job fails before, e.g. on its upload).
            waiter = asyncio.create_task(started.wait())
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            t0 = time.perf_counter()
            outcome = await task
            windows[batch_row] = (t0, time.perf_counter())
    finally:
        sent = load.finish()
    return GatewayRun({row: (in_window(sent, a, b), b - a) for row, (a, b) in windows.items()},
                      outcome, alone_load)


def batch_figures(outcome: BatchOutcome, lines_sent: int) -> dict[str, Any]:
    """A batch row's batch columns."""
    return {"batch_duration_s": outcome.duration_s, "batch_status": outcome.status,
            "batch_lines_sent": lines_sent, "batch_output_lines": outcome.lines,
            "batch_distinct_ids": outcome.distinct_ids,
            "batch_ok": outcome.lines - outcome.failed if outcome.lines else 0,
            "batch_failed": outcome.failed, "batch_hit_ratio": outcome.hit_ratio,
            "batch_usage_hit_ratio": outcome.usage_hit_ratio, "batch_error": outcome.error}


def run_all(opts: Options, fleet: Fleet, realtime_urls: list[str], batch_urls: list[str],
            redis_url: str | None, only: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Every gateway in turn on the same replicas, each starting with empty prefix caches;
    each row's figures (row (0) pooled over the gateways that measured it)."""
    wl = opts.wl
    rt_prompts = system_prompts("realtime", wl.realtime_prompts, wl.realtime_system_tokens,
                                wl.seed)
    lines = batch_lines(wl, system_prompts("batch", wl.batch_prompts, wl.batch_system_tokens,
                                           wl.seed))
    urls = [*realtime_urls, *batch_urls]
    results: dict[str, dict[str, Any]] = {}
    alone: list[Sent] = []
    alone_s = alone_load = 0.0
    for scenario, rows in GATEWAYS:
        rows = tuple(r for r in rows if r in only)
        if not rows:
            continue
        wait_idle(urls)
        reset_prefix_caches(urls)
        cfg = scenario_config(scenario, realtime_urls, batch_urls, free_ports(1)[0],
                              redis_url if opts.batch_via == "api" else None, opts.adm)
        try:
            url, proc = fleet.start_gateway_config(cfg, name=f"gateway-{scenario}")
            try:
                run = run_async(run_gateway(url, rows, opts, rt_prompts, lines))
                counts = requests_by_replica_and_class(url)
            finally:
                fleet.stop_process(proc)
        except (RuntimeError, OSError, httpx.HTTPError, openai.OpenAIError) as exc:
            log(f"{scenario}: FAILED: {exc}")
            for row in rows:
                results[row] = {"failed": f"{type(exc).__name__}: {exc}"[:500]}
            continue
        for row, (sent, window_s) in run.windows.items():
            if row == ALONE:
                alone += sent
                alone_s += window_s
                alone_load = max(alone_load, run.alone_load)
                continue
            res = realtime_summary(sent, window_s)
            if run.batch is not None:
                res.update(batch_figures(run.batch, len(lines)))
            res["batch_on_realtime_replicas"] = share_on_realtime_replicas(counts)
            res["load_avg_1m"] = os.getloadavg()[0]
            log(f"{ROW_LABELS[row]}: TTFT p50 {_ms(res['ttft_p50_s'])} ms, p99 "
                f"{_ms(res['ttft_p99_s'])} ms over {res['realtime_sent']} requests; batch "
                f"{cell(res.get('batch_duration_s'), '{:.1f}')} s, hit "
                f"{cell(res.get('batch_hit_ratio'))}")
            results[row] = res
    if alone_s:
        res = realtime_summary(alone, alone_s)
        res["load_avg_1m"] = alone_load
        log(f"{ROW_LABELS[ALONE]}: TTFT p50 {_ms(res['ttft_p50_s'])} ms, p99 "
            f"{_ms(res['ttft_p99_s'])} ms over {res['realtime_sent']} requests")
        results[ALONE] = res
    return results


# -- command line ----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    wl, adm = Workload(), Admission()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--smoke", action="store_true",
                   help="scale down for a quick check: 200 batch lines, 2 x 10 s of row (0), 5 s "
                        "warm-up (explicit options still win)")
    p.add_argument("--rows", default=",".join(ROWS),
                   help=f"comma-separated rows to run, of {', '.join(ROWS)}")
    g = p.add_argument_group("fleet")
    g.add_argument("--realtime-replicas", type=int, default=3)
    g.add_argument("--batch-replicas", type=int, default=2)
    g.add_argument("--profile", default="llama-8b-h200",
                   help="simulated replicas' latency profile (backends/sim/profiles.py)")
    g.add_argument("--kv-capacity-tokens", type=int, default=32_768,
                   help="KV cache of each simulated replica, in tokens")
    g.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply every simulated duration")
    g = p.add_argument_group("realtime load")
    g.add_argument("--realtime-rate", type=float, default=wl.realtime_rate,
                   help="requests per second, Poisson arrivals (open loop)")
    g.add_argument("--realtime-prompts", type=int, default=wl.realtime_prompts)
    g.add_argument("--realtime-system-tokens", type=int, default=wl.realtime_system_tokens)
    g.add_argument("--realtime-max-tokens", type=int, default=wl.realtime_max_tokens)
    g.add_argument("--warmup", type=float, default=None,
                   help="seconds of realtime load before anything is measured (default 10)")
    g.add_argument("--alone", type=float, default=None,
                   help="seconds of row (0), realtime without batch, on each of the isolated "
                        "and borrowing gateways (default 30)")
    g = p.add_argument_group("batch")
    g.add_argument("--batch-lines", type=int, default=None, help="lines (default 2000)")
    g.add_argument("--batch-prompts", type=int, default=wl.batch_prompts)
    g.add_argument("--batch-system-tokens", type=int, default=wl.batch_system_tokens)
    g.add_argument("--batch-user-tokens", type=int, default=wl.batch_user_tokens)
    g.add_argument("--batch-max-tokens", type=int, default=wl.batch_max_tokens)
    g.add_argument("--batch-via", choices=("api", "requests"), default="api",
                   help="api: the OpenAI Batch API (needs redis-server); requests: the lines "
                        "as plain requests of class batch, --batch-concurrency at a time")
    g = p.add_argument_group("admission (rows a and b)")
    g.add_argument("--realtime-per-replica", type=int, default=adm.realtime_per_replica)
    g.add_argument("--batch-per-replica", type=int, default=adm.batch_per_replica)
    g.add_argument("--reserved-fraction", type=float, default=adm.reserved_fraction)
    g.add_argument("--borrow-below", type=float, default=adm.borrow_below)
    g.add_argument("--batch-concurrency", type=int, default=adm.batch_concurrency)
    p.add_argument("--seed", type=int, default=wl.seed)
    p.add_argument("--markdown", action="store_true", help="print the table as markdown")
    p.add_argument("--json", action="store_true", help="print the result as JSON at the end")
    p.add_argument("--output", help="append the JSON result to this JSONL file")
    return p


def options_from_args(args: argparse.Namespace) -> Options:
    smoke = args.smoke

    def pick(value: Any, default: Any, smoke_value: Any) -> Any:
        return value if value is not None else (smoke_value if smoke else default)

    wl = Workload(
        realtime_rate=args.realtime_rate, realtime_prompts=args.realtime_prompts,
        realtime_system_tokens=args.realtime_system_tokens,
        realtime_max_tokens=args.realtime_max_tokens,
        batch_lines=pick(args.batch_lines, Workload.batch_lines, 200),
        batch_prompts=args.batch_prompts, batch_system_tokens=args.batch_system_tokens,
        batch_user_tokens=args.batch_user_tokens, batch_max_tokens=args.batch_max_tokens,
        seed=args.seed)
    adm = Admission(realtime_per_replica=args.realtime_per_replica,
                    batch_per_replica=args.batch_per_replica,
                    reserved_fraction=args.reserved_fraction, borrow_below=args.borrow_below,
                    batch_concurrency=args.batch_concurrency)
    return Options(wl=wl, adm=adm, warmup_s=pick(args.warmup, 10.0, 5.0),
                   alone_s=pick(args.alone, 30.0, 10.0), batch_via=args.batch_via)


def conditions(args: argparse.Namespace, opts: Options) -> str:
    wl = opts.wl
    return (f"{args.realtime_replicas} realtime + {args.batch_replicas} batch simulated vLLM "
            f"replicas ({args.profile}, time scale {args.time_scale}, "
            f"{args.kv_capacity_tokens} KV tokens each); realtime {wl.realtime_rate}/s "
            f"streaming chats ({wl.realtime_prompts} system prompts of "
            f"~{wl.realtime_system_tokens} tokens, {wl.realtime_max_tokens} output tokens); "
            f"batch of {wl.batch_lines} lines ({wl.batch_prompts} system prompts of "
            f"~{wl.batch_system_tokens} tokens + ~{wl.batch_user_tokens} of their own, "
            f"{wl.batch_max_tokens} output tokens) via {opts.batch_via}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    only = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = sorted(set(only) - set(ROWS))
    if unknown:
        raise SystemExit(f"--rows: unknown {', '.join(unknown)} (rows: {', '.join(ROWS)})")
    opts = options_from_args(args)
    fleet = Fleet()
    try:
        with sigterm_as_interrupt():
            log(conditions(args, opts) + f"; logs in {fleet.log_dir}")
            rt = fleet.start_sims(args.realtime_replicas, args.kv_capacity_tokens,
                                  args.profile, args.time_scale, name="realtime")
            bt = fleet.start_sims(args.batch_replicas, args.kv_capacity_tokens, args.profile,
                                  args.time_scale, name="batch")
            redis_url = fleet.start_redis() if opts.batch_via == "api" else None
            t = time.monotonic()
            rows = run_all(opts, fleet, rt, bt, redis_url, only)
            log(f"done in {time.monotonic() - t:.0f} s")
    except KeyboardInterrupt:
        log("interrupted; stopping")
        return 130
    finally:
        fleet.stop()
    header, cells = table_rows(rows)
    print(f"\n{conditions(args, opts)}. Realtime rows with a batch count only the requests "
          "sent while the batch ran.\n")
    print(markdown_table(header, cells, "l" + "r" * (len(header) - 1)) if args.markdown
          else text_table(header, cells))
    print()
    print("\n".join(summary_lines(rows)))
    for key, r in rows.items():
        if "failed" in r:
            print(f"{ROW_LABELS[key]}: failed: {r['failed']}")
    # The values used, not the options' None that stands for "the default (or --smoke's)".
    effective = {"warmup": opts.warmup_s, "alone": opts.alone_s,
                 "batch_lines": opts.wl.batch_lines}
    result = {"conditions": {**vars(args), **effective, "workload": asdict(opts.wl),
                             "admission": asdict(opts.adm)},
              "rows": rows, "targets": targets(rows)}
    emit_json(result, args.json, args.output)
    return 1 if any("failed" in r for r in rows.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
