"""Canonical prompt text of an OpenAI request: what the engine will see before it generates."""

from __future__ import annotations

from typing import Any

import orjson

# Separators that cannot appear in ordinary text keep "ab"+"c" and "a"+"bc" apart.
_ROLE_SEP = "\x1e"
_MSG_SEP = "\x1f"


def _content_text(content: Any) -> str:
    """Flatten OpenAI message content (string or list of parts) to text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if isinstance(part, dict):
                if part.get("type") == "text" or "text" in part:
                    parts.append(str(part.get("text", "")))
                else:
                    # Images, audio, files: hash their JSON so equal media still match.
                    parts.append(orjson.dumps(part, option=orjson.OPT_SORT_KEYS).decode())
            else:
                parts.append(str(part))
        return "".join(parts)
    return orjson.dumps(content, option=orjson.OPT_SORT_KEYS).decode()


def render_chat(body: dict[str, Any]) -> str:
    """Render chat messages in the order an engine's template puts them.

    Tools go first because chat templates place tool definitions in the system preamble, before
    the first user turn: two requests with the same messages but different tools do not share
    a KV prefix and must not look as if they did.
    """
    out: list[str] = []
    tools = body.get("tools")
    if tools:
        out.append("tools" + _ROLE_SEP + orjson.dumps(tools, option=orjson.OPT_SORT_KEYS).decode())
    for msg in body.get("messages") or ():
        if not isinstance(msg, dict):
            continue
        role = str(msg.get("role", ""))
        text = _content_text(msg.get("content"))
        if msg.get("tool_calls"):
            text += orjson.dumps(msg["tool_calls"], option=orjson.OPT_SORT_KEYS).decode()
        out.append(role + _ROLE_SEP + text)
    return _MSG_SEP.join(out)


def render_completion(body: dict[str, Any]) -> str:
    """Render a completions prompt (string, list of strings, or token ids)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            # A batch of prompts: route on the first; they are usually siblings.
            return first
        if isinstance(first, int):
            return " ".join(map(str, prompt))
        if isinstance(first, list):
            return " ".join(map(str, first))
    return ""
