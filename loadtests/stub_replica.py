"""An instant OpenAI-compatible stub replica (raw uvloop + httptools) for overhead benchmarks."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import sys

import httptools
import orjson

TOKENS = 16
MODEL = "tiny"
_METRICS = (
    b"# TYPE vllm:num_requests_running gauge\n"
    b'vllm:num_requests_running{model_name="tiny"} 0.0\n'
    b"# TYPE vllm:num_requests_waiting gauge\n"
    b'vllm:num_requests_waiting{model_name="tiny"} 0.0\n'
    b"# TYPE vllm:kv_cache_usage_perc gauge\n"
    b'vllm:kv_cache_usage_perc{model_name="tiny"} 0.0\n'
    b"# TYPE vllm:prefix_cache_queries counter\n"
    b'vllm:prefix_cache_queries_total{model_name="tiny"} 0.0\n'
    b"# TYPE vllm:prefix_cache_hits counter\n"
    b'vllm:prefix_cache_hits_total{model_name="tiny"} 0.0\n'
)
_USAGE = {"prompt_tokens": 8, "completion_tokens": TOKENS, "total_tokens": 8 + TOKENS}


def _response(status: bytes, ctype: bytes, body: bytes) -> bytes:
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: " + ctype + b"\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


def _full(chat: bool) -> bytes:
    text = "tok " * TOKENS
    if chat:
        body = {"id": "chatcmpl-stub", "object": "chat.completion", "created": 0, "model": MODEL,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "logprobs": None, "finish_reason": "length"}], "usage": _USAGE}
    else:
        body = {"id": "cmpl-stub", "object": "text_completion", "created": 0, "model": MODEL,
                "choices": [{"index": 0, "text": text, "logprobs": None,
                             "finish_reason": "length"}], "usage": _USAGE}
    return _response(b"200 OK", b"application/json", orjson.dumps(body))


def _chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _stream(chat: bool, usage: bool) -> list[bytes]:
    """The writes of one streamed reply: headers + first token, one token per write, trailer."""
    writes = []
    for i in range(TOKENS):
        last = i == TOKENS - 1
        if chat:
            delta = {"role": "assistant", "content": "tok "} if i == 0 else {"content": "tok "}
            ev = {"id": "chatcmpl-stub", "object": "chat.completion.chunk", "created": 0,
                  "model": MODEL, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                               "finish_reason": "length" if last else None}]}
        else:
            ev = {"id": "cmpl-stub", "object": "text_completion", "created": 0, "model": MODEL,
                  "choices": [{"index": 0, "text": "tok ", "logprobs": None,
                               "finish_reason": "length" if last else None}]}
        sse = b"data: " + orjson.dumps(ev) + b"\n\n"
        if last:
            if usage:
                tail = {"id": ev["id"], "object": ev["object"], "created": 0, "model": MODEL,
                        "choices": [], "usage": _USAGE}
                sse += b"data: " + orjson.dumps(tail) + b"\n\n"
            sse += b"data: [DONE]\n\n"
        out = _chunked(sse)
        if last:
            out += b"0\r\n\r\n"
        writes.append(out)
    writes[0] = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                 b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n" + writes[0])
    return writes


_OK = _response(b"200 OK", b"application/json", b"{}")
_STATIC = {
    b"/health": _OK,
    b"/metrics": _response(b"200 OK", b"text/plain; version=0.0.4", _METRICS),
    b"/v1/models": _response(b"200 OK", b"application/json", orjson.dumps(
        {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "stub"}]})),
}
_NOT_FOUND = _response(b"404 Not Found", b"application/json", b'{"error":"not found"}')
_FULL = {True: _full(True), False: _full(False)}
_STREAM = {(c, u): _stream(c, u) for c in (True, False) for u in (True, False)}
_PATHS = {b"/v1/chat/completions": True, b"/v1/completions": False}


class StubProtocol(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; replies are precomputed byte strings."""

    __slots__ = ("body", "parser", "transport", "url")

    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        url, body = self.url.split(b"?", 1)[0], b"".join(self.body)
        self.url, self.body = b"", []
        write = self.transport.write
        chat = _PATHS.get(url)
        if chat is None:
            write(_STATIC.get(url, _NOT_FOUND))
        else:
            try:
                payload = orjson.loads(body)
            except orjson.JSONDecodeError:
                payload = {}
            if isinstance(payload, dict) and payload.get("stream"):
                opts = payload.get("stream_options")
                usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
                for chunk in _STREAM[(chat, usage)]:
                    write(chunk)  # one send() per token: the stub flushes each event
            else:
                write(_FULL[chat])
        if not self.parser.should_keep_alive():
            self.transport.close()


async def serve(host: str, ports: list[int]) -> None:
    loop = asyncio.get_running_loop()
    servers = [await loop.create_server(StubProtocol, host, p, backlog=1024, reuse_address=True)
               for p in ports]
    print(f"stub replicas on {host}:{','.join(map(str, ports))} (pid {os.getpid()})",
          flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=9100, help="first port")
    ap.add_argument("--count", type=int, default=1, help="replicas on consecutive ports")
    args = ap.parse_args(argv)
    import uvloop

    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(serve(args.host, [args.port + i for i in range(args.count)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
