"""vLLM: /health (503 when the engine core is dead) and `vllm:` Prometheus metrics."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from backends.adapters.base import EngineAdapter, EngineSnapshot
from backends.adapters.promtext import (
    check_page,
    counter_sum,
    parse_labels,
    sample_sum,
    scan_samples,
    with_totals,
)
from backends.upstream import Timeouts, Upstream, UpstreamError, fetch_text

# Current names first; the deprecated ones are read when the current ones are absent (older
# releases, or newer ones started with --show-hidden-metrics-for-version).
_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_HITS = ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits")
_QUERIES = ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries")
_BY_SOURCE = "vllm:prompt_tokens_by_source_total"
_FIRST_TOKENS = "vllm:time_to_first_token_seconds_count"
_RUNNING = "vllm:num_requests_running"
_WAITING = "vllm:num_requests_waiting"
_CACHE_CONFIG = "vllm:cache_config_info"
_COMPUTED = "vllm:request_prefill_kv_computed_tokens_sum"


def parse_vllm_first_tokens(text: str) -> EngineSnapshot:
    """Only the count of first tokens of a vLLM /metrics page (summed over engines, as
    `parse_vllm_metrics` does): read every second while requests passed through may wait."""
    first_tokens = sample_sum(scan_samples(text, (_FIRST_TOKENS,)), _FIRST_TOKENS)
    return EngineSnapshot(first_tokens=first_tokens, source="vllm:first-tokens")


_READ = (*with_totals((*_KV_USAGE, *_HITS, *_QUERIES, "vllm:prompt_tokens")), _BY_SOURCE,
         _FIRST_TOKENS, _RUNNING, _WAITING, _CACHE_CONFIG, _COMPUTED,
         "vllm:request_prefill_time_seconds_sum", "vllm:request_prefill_time_seconds_count")


def parse_vllm_metrics(text: str) -> EngineSnapshot:
    """Normalise a vLLM /metrics page; sums over engines (data-parallel ranks). Reads only the
    samples it uses (`scan_samples`); ValueError if it is not a Prometheus page."""
    check_page(text)
    found = scan_samples(text, _READ)

    def first(names: tuple[str, ...]) -> tuple[float | None, str]:
        for n in names:
            if (value := counter_sum(found, n)) is not None:
                return value, n
        return None, ""

    block_size: int | None = None
    num_blocks: int | None = None
    for label_text, _ in found.get(_CACHE_CONFIG, ()):
        labels = parse_labels(label_text)
        if labels.get("block_size", "").isdigit():
            block_size = int(labels["block_size"])
        blocks = labels.get("num_gpu_blocks") or labels.get("num_cpu_blocks")
        if blocks and blocks.isdigit():
            num_blocks = (num_blocks or 0) + int(blocks)
    # One counter split by a source label; summing it whole would count the cache hits as
    # computed tokens.
    local = [value for label_text, value in found.get(_BY_SOURCE, ())
             if parse_labels(label_text).get("source") == "local_compute"]
    local_compute = sum(local) if local else None
    kv, kv_name = first(_KV_USAGE)
    hits, hits_name = first(_HITS)
    queries, _ = first(_QUERIES)
    engines = max(1, len(found.get(_RUNNING, ())))
    # Best: the tokens each request computed in its prefill, observed with its prefill time
    # (both when it finishes), so that the two cover the same requests between two scrapes.
    computed = sample_sum(found, _COMPUTED)
    if computed is None:
        computed = local_compute
    prompt = counter_sum(found, "vllm:prompt_tokens")
    if computed is None and prompt is not None and hits is not None:
        # Releases before prompt_tokens_by_source. Hits are counted when a request is
        # scheduled, prompt tokens when its prefill ends, so hits can run ahead.
        computed = max(0.0, prompt - hits)
    return EngineSnapshot(
        running=sample_sum(found, _RUNNING),
        waiting=sample_sum(found, _WAITING),
        # A gauge per engine: the mean is the fleet-of-ranks usage.
        kv_usage=(kv / engines) if kv is not None else None,
        prefix_hit_tokens=hits,
        prefix_query_tokens=queries,
        block_size=block_size,
        num_blocks=num_blocks,
        computed_prompt_tokens=computed,
        prefill_seconds=sample_sum(found, "vllm:request_prefill_time_seconds_sum"),
        prefills=sample_sum(found, "vllm:request_prefill_time_seconds_count"),
        # Observed in the engine step that produces each request's first token.
        first_tokens=sample_sum(found, _FIRST_TOKENS),
        source="vllm:" + ("deprecated-names" if hits_name.startswith("vllm:gpu_") or
                          kv_name.startswith("vllm:gpu_") else "current-names"),
    )


class VllmAdapter(EngineAdapter):
    kind = "vllm"
    health_path = "/health"
    default_block_size = 16

    async def scrape(
        self, upstream: Upstream, base_url: str, timeout: float
    ) -> EngineSnapshot | None:
        text = await _metrics_page(upstream, base_url, timeout)
        if text is None:
            return None
        try:
            return parse_vllm_metrics(text)
        except ValueError:
            return None

    async def read_counts(
        self, upstream: Upstream, base_url: str, timeout: float
    ) -> EngineSnapshot | None:
        text = await _metrics_page(upstream, base_url, timeout)
        return None if text is None else parse_vllm_first_tokens(text)

    async def tokenize(self, upstream: Upstream, base_url: str, payload: dict[str, Any],
                       chat: bool, headers: Mapping[str, str]) -> list[int] | None:
        """vLLM's POST /tokenize renders chat messages with the model's own chat template."""
        try:
            resp = await upstream.request(
                "POST", base_url + "/tokenize", body=orjson.dumps(tokenize_body(payload, chat)),
                headers={"Content-Type": "application/json", **headers},
                timeouts=_TOKENIZE_TIMEOUTS)
        except UpstreamError:
            return None
        try:
            if resp.status != 200:
                return None
            tokens = orjson.loads(await resp.read()).get("tokens")
        except (UpstreamError, orjson.JSONDecodeError, AttributeError):
            return None
        finally:
            resp.release()
        return tokens if isinstance(tokens, list) else None


_TOKENIZE_TIMEOUTS = Timeouts(total=5.0)


def tokenize_body(payload: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The /tokenize request for an OpenAI chat or completions body."""
    body: dict[str, Any] = {"model": payload["model"]}
    if chat:
        body["messages"] = payload["messages"]
        body["add_generation_prompt"] = True
        for key in ("tools", "chat_template", "chat_template_kwargs"):
            if payload.get(key) is not None:
                body[key] = payload[key]
    else:
        prompt = payload["prompt"]
        body["prompt"] = prompt[0] if isinstance(prompt, list) and prompt and \
            isinstance(prompt[0], str) else prompt
    return body


async def _metrics_page(upstream: Upstream, base_url: str, timeout: float) -> str | None:
    """The engine's /metrics page; None when it cannot be read."""
    status, text = await fetch_text(upstream, base_url + "/metrics", timeout)
    return text if status == 200 and text else None
