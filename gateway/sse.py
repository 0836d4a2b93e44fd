"""Reading an engine's SSE stream on the side: first token, token count, and reassembly."""

from __future__ import annotations

from typing import Any

import orjson


class StreamWatcher:
    """Parses SSE events as chunks pass through, without holding up the chunks.

    It notes when the first content token arrived and counts content events (one per token in
    vLLM and trtllm-serve streams). With `keep=True` it also keeps the parsed events so that a
    non-streaming response can be rebuilt from an internal stream.

    Events up to the first token are parsed as they arrive (the first token's time is TTFT);
    later ones are kept as bytes with their arrival time and parsed together, in one call, when
    a result is first read: per event, that costs a fraction of parsing each on its own.
    """

    __slots__ = ("_buf", "_error", "_events", "_last_token_at", "_pending", "_tokens", "_usage",
                 "first_token_at", "keep")

    def __init__(self, keep: bool = False) -> None:
        self._buf = b""
        self.keep = keep
        self._events: list[dict[str, Any]] = []
        self.first_token_at: float | None = None
        self._last_token_at: float | None = None
        self._tokens = 0
        self._usage: dict[str, Any] | None = None
        self._error: dict[str, Any] | None = None
        self._pending: list[tuple[bytes, float]] = []

    def feed(self, chunk: bytes, now: float) -> None:
        buf = self._buf + chunk if self._buf else chunk
        # SSE events end with a blank line; engines send \n\n (tolerate \r\n\r\n too).
        if b"\r\n" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        events = buf.split(b"\n\n")
        self._buf = events.pop()
        for raw in events:
            if raw.startswith(b"data: ") and b"\n" not in raw:
                datas: tuple[bytes, ...] = (raw[6:],)  # the usual shape: one data line
            else:
                datas = tuple(line[5:].strip() for line in raw.split(b"\n")
                              if line.startswith(b"data:"))
            for data in datas:
                if not data or data == b"[DONE]":
                    continue
                if self.first_token_at is None:
                    self._event(data, now)
                else:
                    self._pending.append((data, now))

    def _event(self, data: bytes, now: float) -> None:
        try:
            ev = orjson.loads(data)
        except orjson.JSONDecodeError:
            return
        self._parsed(ev, now)

    def _parsed(self, ev: Any, now: float) -> None:
        if not isinstance(ev, dict):
            return
        if "error" in ev and "choices" not in ev:
            self._error = ev
            return
        if self.keep:
            self._events.append(ev)
        if ev.get("usage"):
            self._usage = ev["usage"]
        for ch in ev.get("choices") or ():
            if _has_content(ch):
                self._tokens += 1
                if self.first_token_at is None:
                    self.first_token_at = now
                self._last_token_at = now
                break

    def _settle(self) -> None:
        """Parse the events kept as bytes: all at once, or one by one if one is malformed."""
        pending = self._pending
        if not pending:
            return
        self._pending = []
        try:
            parsed = orjson.loads(b"[" + b",".join([data for data, _ in pending]) + b"]")
        except orjson.JSONDecodeError:
            parsed = None
        if parsed is None or len(parsed) != len(pending):  # e.g. "1,2" smuggled in one event
            for data, now in pending:
                self._event(data, now)
            return
        for ev, (_, now) in zip(parsed, pending, strict=True):
            self._parsed(ev, now)

    @property
    def events(self) -> list[dict[str, Any]]:
        self._settle()
        return self._events

    @property
    def usage(self) -> dict[str, Any] | None:
        self._settle()
        return self._usage

    @property
    def error(self) -> dict[str, Any] | None:
        self._settle()
        return self._error

    @property
    def tokens(self) -> int:
        self._settle()
        return self._tokens

    @property
    def last_token_at(self) -> float | None:
        self._settle()
        return self._last_token_at

    def whole(self, body: bytes) -> bool:
        """A non-streaming answer, relayed untouched: whether it is a JSON object, and its
        usage read (prompt tokens calibrate the pool's characters per token; completion
        tokens are counted)."""
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError:
            return False
        if not isinstance(obj, dict):
            return False
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self._usage = usage
        return True

    def completion_tokens(self) -> int:
        usage = self.usage
        if usage and isinstance(usage.get("completion_tokens"), int):
            return usage["completion_tokens"]
        return self._tokens


def _has_content(choice: dict[str, Any]) -> bool:
    if choice.get("text"):
        return True
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return bool(delta.get("content") or delta.get("tool_calls")
                    or delta.get("reasoning_content") or delta.get("reasoning"))
    return False


def assemble(events: list[dict[str, Any]], chat: bool) -> dict[str, Any]:
    """Rebuild the non-streaming response an engine would have sent from its stream events."""
    out: dict[str, Any] = {}
    choices: dict[int, dict[str, Any]] = {}
    usage = None
    for ev in events:
        for key in ("id", "created", "model", "system_fingerprint", "service_tier"):
            if key in ev and key not in out:
                out[key] = ev[key]
        if ev.get("usage"):
            usage = ev["usage"]
        for ch in ev.get("choices") or ():
            idx = ch.get("index", 0)
            acc = choices.get(idx)
            if acc is None:
                acc = choices[idx] = _new_choice(idx, chat)
            _merge_choice(acc, ch, chat)
    out["object"] = "chat.completion" if chat else "text_completion"
    out["choices"] = [_finish_choice(choices[i], chat) for i in sorted(choices)]
    if usage is not None:
        out["usage"] = usage
    return out


def _new_choice(idx: int, chat: bool) -> dict[str, Any]:
    c: dict[str, Any] = {"index": idx, "_parts": [], "finish_reason": None, "logprobs": None}
    if chat:
        c["_role"] = "assistant"
        c["_tools"] = {}
        c["_reasoning"] = []
    return c


def _merge_choice(acc: dict[str, Any], ch: dict[str, Any], chat: bool) -> None:
    if ch.get("finish_reason") is not None:
        acc["finish_reason"] = ch["finish_reason"]
    if "stop_reason" in ch:
        acc["stop_reason"] = ch["stop_reason"]
    lp = ch.get("logprobs")
    if lp:
        prev = acc["logprobs"]
        if prev is None:
            acc["logprobs"] = {k: (list(v) if isinstance(v, list) else v) for k, v in lp.items()}
        else:
            for k, v in lp.items():
                if isinstance(v, list) and isinstance(prev.get(k), list):
                    prev[k].extend(v)
                elif prev.get(k) is None:
                    prev[k] = v
    if not chat:
        if ch.get("text"):
            acc["_parts"].append(ch["text"])
        return
    delta = ch.get("delta") or {}
    if delta.get("role"):
        acc["_role"] = delta["role"]
    if delta.get("content"):
        acc["_parts"].append(delta["content"])
    for key in ("reasoning_content", "reasoning"):
        if delta.get(key):
            acc["_reasoning"].append(delta[key])
    for tc in delta.get("tool_calls") or ():
        i = tc.get("index", 0)
        slot = acc["_tools"].setdefault(i, {"id": None, "type": "function",
                                            "function": {"name": "", "arguments": ""}})
        if tc.get("id"):
            slot["id"] = tc["id"]
        if tc.get("type"):
            slot["type"] = tc["type"]
        fn = tc.get("function") or {}
        if fn.get("name"):
            slot["function"]["name"] += fn["name"]
        if fn.get("arguments"):
            slot["function"]["arguments"] += fn["arguments"]


def _finish_choice(acc: dict[str, Any], chat: bool) -> dict[str, Any]:
    text = "".join(acc.pop("_parts"))
    if not chat:
        return {"index": acc["index"], "text": text, "logprobs": acc["logprobs"],
                "finish_reason": acc["finish_reason"],
                **({"stop_reason": acc["stop_reason"]} if "stop_reason" in acc else {})}
    tools = acc.pop("_tools")
    # OpenAI sends content null only for a tool-call-only reply.
    message: dict[str, Any] = {"role": acc.pop("_role"),
                               "content": None if tools and not text else text}
    if tools:
        message["tool_calls"] = [tools[i] for i in sorted(tools)]
    reasoning = acc.pop("_reasoning")
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    out = {"index": acc["index"], "message": message, "logprobs": acc["logprobs"],
           "finish_reason": acc["finish_reason"]}
    if "stop_reason" in acc:
        out["stop_reason"] = acc["stop_reason"]
    return out
