"""Reading engine SSE streams: token timing, and rebuilding a non-streaming response."""

from __future__ import annotations

import itertools

import orjson

from gateway.sse import StreamWatcher, assemble


def sse(obj: dict) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def chat_chunk(delta: dict, finish: str | None = None, index: int = 0) -> dict:
    return {"id": "c1", "object": "chat.completion.chunk", "created": 7, "model": "m",
            "choices": [{"index": index, "delta": delta, "finish_reason": finish}]}


def test_watcher_counts_tokens_across_split_chunks_and_skips_the_role_chunk() -> None:
    stream = (sse(chat_chunk({"role": "assistant", "content": ""}))
              + sse(chat_chunk({"content": "Hel"})) + sse(chat_chunk({"content": "lo"}, "stop"))
              + sse({"id": "c1", "choices": [], "usage": {"prompt_tokens": 9,
                                                           "completion_tokens": 2}})
              + b"data: [DONE]\n\n").replace(b"\n\n", b"\r\n\r\n")
    w = StreamWatcher()
    # Cut the stream at awkward places: inside JSON and inside the blank line.
    cuts = [0, 5, 40, 41, 97, len(stream) - 3, len(stream)]
    for t, (a, b) in enumerate(itertools.pairwise(cuts)):
        w.feed(stream[a:b], float(t))
    assert w.tokens == 2
    assert w.usage == {"prompt_tokens": 9, "completion_tokens": 2}
    assert w.completion_tokens() == 2
    assert w.events == []  # kept only when asked to
    # TTFT is the first chunk with content, not the role-only chunk that precedes it.
    timed = StreamWatcher()
    timed.feed(sse(chat_chunk({"role": "assistant", "content": ""})), 1.0)
    assert timed.first_token_at is None
    timed.feed(sse(chat_chunk({"content": "x"})), 2.0)
    timed.feed(sse(chat_chunk({"content": "y"})), 3.0)
    assert (timed.first_token_at, timed.last_token_at, timed.tokens) == (2.0, 3.0, 2)


def test_error_event_is_reported() -> None:
    w = StreamWatcher(keep=True)
    w.feed(sse({"error": {"message": "boom", "type": "x"}}), 1.0)
    assert w.error == {"error": {"message": "boom", "type": "x"}}
    assert w.tokens == 0


def test_assemble_chat_with_tool_calls_and_two_choices() -> None:
    events = [
        chat_chunk({"role": "assistant", "content": ""}),
        chat_chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                    "function": {"name": "get_", "arguments": '{"ci'}}]}),
        chat_chunk({"tool_calls": [{"index": 0, "function": {"name": "weather",
                                                             "arguments": 'ty": "Oslo"}'}}]},
                   "tool_calls"),
        chat_chunk({"role": "assistant", "content": "B"}, index=1),
        chat_chunk({"content": "ye"}, "stop", index=1),
        {"id": "c1", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4}},
    ]
    out = assemble(events, chat=True)
    assert out["object"] == "chat.completion" and out["id"] == "c1" and out["created"] == 7
    first, second = out["choices"]
    assert first["message"]["content"] is None
    assert first["message"]["tool_calls"] == [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]
    assert first["finish_reason"] == "tool_calls"
    assert second["message"] == {"role": "assistant", "content": "Bye"}
    assert second["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] == 4


def test_assemble_completion_concatenates_text_and_logprobs() -> None:
    def chunk(text: str, lp: float, finish: str | None = None) -> dict:
        return {"id": "t1", "object": "text_completion", "created": 1, "model": "m",
                "choices": [{"index": 0, "text": text, "finish_reason": finish,
                             "logprobs": {"tokens": [text], "token_logprobs": [lp]}}]}

    out = assemble([chunk("a", -0.1), chunk("b", -0.2, "length")], chat=False)
    choice = out["choices"][0]
    assert out["object"] == "text_completion"
    assert choice["text"] == "ab" and choice["finish_reason"] == "length"
    assert choice["logprobs"] == {"tokens": ["a", "b"], "token_logprobs": [-0.1, -0.2]}
    assert "usage" not in out


def test_events_after_the_first_token_keep_their_times_even_when_one_is_malformed() -> None:
    w = StreamWatcher(keep=True)
    w.feed(sse(chat_chunk({"content": "a"})), 1.0)
    w.feed(sse(chat_chunk({"content": "b"})) + b"data: {not json\n\n", 2.0)
    w.feed(b"data: 1,2\n\n" + sse(chat_chunk({"content": "c"}, "stop")), 3.0)
    w.feed(sse({"error": {"message": "late", "type": "x"}}), 4.0)
    # The malformed and non-object events are skipped, the others counted at their own time.
    assert (w.first_token_at, w.last_token_at, w.tokens) == (1.0, 3.0, 3)
    assert [e["choices"][0]["delta"]["content"] for e in w.events] == ["a", "b", "c"]
    assert w.error == {"error": {"message": "late", "type": "x"}}
    clean = StreamWatcher()
    clean.feed(sse(chat_chunk({"content": "a"})) + sse(chat_chunk({"content": "b"})), 1.0)
    clean.feed(sse(chat_chunk({"content": "c"})), 5.0)
    assert (clean.tokens, clean.last_token_at) == (3, 5.0)
