"""The Batch object as the OpenAI API returns it, from its record in Redis."""

from __future__ import annotations

from typing import Any

import orjson

TIMESTAMPS = ("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at",
              "failed_at", "expired_at", "cancelling_at", "cancelled_at")


def batch_object(h: dict[str, str]) -> dict[str, Any]:
    """OpenAI's Batch, plus `prefix_cache`: the engines' prefix-cache figures over the
    batch's responses (their `usage.prompt_tokens_details.cached_tokens`)."""

    def n(key: str) -> int:
        return int(h.get(key) or 0)

    prompt, cached, completion = n("prompt_tokens"), n("cached_tokens"), n("completion_tokens")
    obj: dict[str, Any] = {
        "id": h["id"],
        "object": "batch",
        "endpoint": h["endpoint"],
        "model": h.get("model") or None,
        "errors": orjson.loads(h["errors"]) if h.get("errors") else None,
        "input_file_id": h["input_file_id"],
        "completion_window": h["completion_window"],
        "status": h["status"],
        "output_file_id": h.get("output_file_id") or None,
        "error_file_id": h.get("error_file_id") or None,
    }
    for key in TIMESTAMPS:
        obj[key] = int(h[key]) if h.get(key) else None
    obj["request_counts"] = {"total": n("total"), "completed": n("completed"),
                             "failed": n("failed")}
    obj["metadata"] = orjson.loads(h["metadata"]) if h.get("metadata") else None
    obj["usage"] = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
                    "output_tokens": completion,
                    "output_tokens_details": {"reasoning_tokens": 0},
                    "total_tokens": prompt + completion}
    obj["prefix_cache"] = {"prompt_tokens": prompt, "cached_tokens": cached,
                           "hit_ratio": round(cached / prompt, 4) if prompt else None}
    return obj
