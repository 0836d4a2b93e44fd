"""The JSON bodies a simulated replica sends, in OpenAI/vLLM shape: replies, chunks, errors."""

from __future__ import annotations

from typing import Any

import orjson


def error_body(message: str, type_: str, code: int, param: str | None = None) -> bytes:
    """OpenAI's error object, as current vLLM returns it."""
    return orjson.dumps(
        {"error": {"message": message, "type": type_, "param": param, "code": code}}
    )


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def chat_chunk(
    rid: str,
    created: int,
    model: str,
    delta: dict[str, Any],
    finish_reason: str | None = None,
) -> bytes:
    return sse(
        {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [
                {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            ],
        }
    )


def completion_chunk(
    rid: str, created: int, model: str, text: str, finish_reason: str | None = None
) -> bytes:
    return sse(
        {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": finish_reason,
                    "stop_reason": None,
                }
            ],
        }
    )


def usage_chunk(rid: str, created: int, model: str, chat: bool, use: dict[str, Any]) -> bytes:
    obj = "chat.completion.chunk" if chat else "text_completion"
    return sse(
        {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": use}
    )


def chat_response(
    rid: str, created: int, model: str, text: str, finish_reason: str, use: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text, "tool_calls": []},
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
            }
        ],
        "usage": use,
        "prompt_logprobs": None,
    }


def completion_response(
    rid: str, created: int, model: str, text: str, finish_reason: str, use: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
                "prompt_logprobs": None,
            }
        ],
        "usage": use,
    }


def model_list(models: list[str], owned_by: str, created: int, max_model_len: int) -> bytes:
    return orjson.dumps(
        {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": created,
                    "owned_by": owned_by,
                    "root": name,
                    "parent": None,
                    "max_model_len": max_model_len,
                }
                for name in models
            ],
        }
    )
