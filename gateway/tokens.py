"""Exact prefix keys: the engine's own tokenisation, cut into its KV-block size.

With `routing.hashing: engine_tokens` the gateway asks a replica of the pool to tokenise each
prompt (vLLM's POST /tokenize renders chat messages with the model's own chat template), then
hashes whole token blocks aligned to the engine's KV block size, so the index speaks in the
engine's own blocks. It costs one extra loopback round trip per request; character blocks
(`hashing: chars`, the default) cost nothing and need no tokenizer (docs/routing.md compares).
"""

from __future__ import annotations

import itertools
from typing import Any

import aiohttp
import orjson

from backends.pool import Pool
from routing.hashing import token_block_hashes
from routing.types import RoutingRequest

_TIMEOUT = aiohttp.ClientTimeout(total=5.0)
_cursor = itertools.count()


def tokenize_body(payload: dict[str, Any], chat: bool) -> dict[str, Any]:
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


async def engine_token_request(http: aiohttp.ClientSession, pool: Pool, payload: dict[str, Any],
                               chat: bool, model: str, traffic_class: str) -> RoutingRequest | None:
    """Tokenise on a healthy replica; None when none can (the caller falls back to chars)."""
    healthy = [r for r in pool.replicas.values() if r.healthy and model in r.models]
    if not healthy:
        return None
    prompt = payload.get("prompt")
    if not chat and isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        tokens = prompt  # already token ids
    else:
        replica = healthy[next(_cursor) % len(healthy)]
        headers = {"Authorization": replica.auth} if replica.auth else None
        try:
            async with http.post(replica.base_url + "/tokenize",
                                 data=orjson.dumps(tokenize_body(payload, chat)),
                                 headers={"Content-Type": "application/json", **(headers or {})},
                                 timeout=_TIMEOUT) as resp:
                if resp.status != 200:
                    return None
                tokens = orjson.loads(await resp.read()).get("tokens")
        except (TimeoutError, aiohttp.ClientError, OSError, orjson.JSONDecodeError):
            return None
        if not isinstance(tokens, list):
            return None
    block = pool.token_block_size()
    hashes = token_block_hashes(tokens, block)
    return pool.router.request_from_hashes(hashes, float(len(tokens)), float(block),
                                           text=str(tokens[:64]), traffic_class=traffic_class)
