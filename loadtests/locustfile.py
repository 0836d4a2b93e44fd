"""Locust load: realtime multi-turn chat users and batch completion users against the gateway.

Realtime users belong to one of a few tenants, each with a long shared system prompt; every user
runs a conversation that grows turn by turn (streaming /v1/chat/completions; the time to the
first content chunk is reported as its own "TTFT" entry). Batch users send non-streaming
/v1/completions with longer outputs and the header `x-traffic-class: batch`.

    prefix-gateway up --port 8080 &
    locust -f loadtests/locustfile.py --headless -u 20 -r 5 -t 60s --host http://127.0.0.1:8080

Environment (defaults in brackets): PG_REALTIME_WEIGHT [3], PG_BATCH_WEIGHT [1], PG_TENANTS [4],
PG_SYSTEM_TOKENS [3000], PG_TURNS [6], PG_CHAT_MAX_TOKENS [64], PG_BATCH_MAX_TOKENS [256],
PG_BATCH_PROMPT_TOKENS [1500], PG_MODEL [tiny], PG_THINK_S [1.0].
"""

from __future__ import annotations

import json
import os
import random
import time

from locust import HttpUser, between, events, task

# Locust puts the working directory on sys.path: run it from the repository root.
from loadtests.sse import data_events_sync
from loadtests.traces import CHARS_PER_TOKEN, block_text


def _env(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


MODEL = os.environ.get("PG_MODEL", "tiny")
TENANTS = int(_env("PG_TENANTS", 4))
SYSTEM_TOKENS = int(_env("PG_SYSTEM_TOKENS", 3000))
TURNS = int(_env("PG_TURNS", 6))
CHAT_MAX_TOKENS = int(_env("PG_CHAT_MAX_TOKENS", 64))
BATCH_MAX_TOKENS = int(_env("PG_BATCH_MAX_TOKENS", 256))
BATCH_PROMPT_TOKENS = int(_env("PG_BATCH_PROMPT_TOKENS", 1500))
THINK_S = _env("PG_THINK_S", 1.0)


def _text(seed: int, tokens: int) -> str:
    """Deterministic text of about `tokens` tokens (the traces' block text, 4 chars a token)."""
    chars = tokens * CHARS_PER_TOKEN
    out, i = [], 0
    while sum(map(len, out)) < chars:
        out.append(block_text(seed * 1_000_003 + i))
        i += 1
    return "".join(out)[:chars]


_WORDS = ("ask", "about", "the", "order", "status", "refund", "policy", "shipping", "invoice",
          "account", "please", "explain", "why", "when", "how", "delivery", "contract", "terms")


def _fresh(tokens: int) -> str:
    """Unique text of about `tokens` tokens (not cached: every call is new)."""
    words = random.choices(_WORDS, k=tokens * CHARS_PER_TOKEN // 6 + 1)
    return " ".join(words)[: tokens * CHARS_PER_TOKEN]


# Built once per process: every user of a tenant sends the very same system prompt.
SYSTEM_PROMPTS = [
    f"You are the assistant of tenant {t}. Policies follow.\n" + _text(10_000 + t, SYSTEM_TOKENS)
    for t in range(TENANTS)
]


def _record_ttft(name: str, seconds: float, exc: Exception | None = None) -> None:
    events.request.fire(request_type="TTFT", name=name, response_time=seconds * 1000.0,
                        response_length=0, exception=exc, context={})


class RealtimeChatUser(HttpUser):
    """One tenant's user in a multi-turn streaming chat; the history grows every turn."""

    weight = int(_env("PG_REALTIME_WEIGHT", 3))
    wait_time = between(0.5 * THINK_S, 1.5 * THINK_S)

    def on_start(self) -> None:
        self.tenant = random.randrange(TENANTS)
        self._new_conversation()

    def _new_conversation(self) -> None:
        self.messages = [{"role": "system", "content": SYSTEM_PROMPTS[self.tenant]}]
        self.turn = 0

    @task
    def chat_turn(self) -> None:
        if self.turn >= TURNS:
            self._new_conversation()
        self.turn += 1
        question = f"Question {self.turn}: " + _fresh(60)
        self.messages.append({"role": "user", "content": question})
        body = {"model": MODEL, "messages": self.messages, "max_tokens": CHAT_MAX_TOKENS,
                "stream": True}
        start = time.perf_counter()
        first = None
        parts: list[str] = []
        with self.client.post("/v1/chat/completions", json=body, stream=True,
                              name="chat stream (to headers)", catch_response=True) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                self.messages.pop()
                return
            try:
                for data in data_events_sync(resp.iter_lines()):
                    chunk = json.loads(data)
                    for choice in chunk.get("choices") or []:
                        text = (choice.get("delta") or {}).get("content")
                        if text:
                            if first is None:
                                first = time.perf_counter()
                            parts.append(text)
            except (ValueError, OSError) as exc:
                resp.failure(f"bad stream: {exc}")
                self.messages.pop()
                return
            if first is None:
                resp.failure("no content in stream")
                self.messages.pop()
                return
            resp.success()
        _record_ttft("chat", first - start)
        self.messages.append({"role": "assistant", "content": "".join(parts)})


class BatchUser(HttpUser):
    """Offline jobs: non-streaming completions with long outputs, classed as batch."""

    weight = int(_env("PG_BATCH_WEIGHT", 1))
    wait_time = between(0.2, 1.0)

    @task
    def complete(self) -> None:
        # A few shared document headers so batch jobs also have prefixes to reuse.
        doc = random.randrange(8)
        prompt = (_text(20_000 + doc, BATCH_PROMPT_TOKENS // 2)
                  + _fresh(BATCH_PROMPT_TOKENS // 2))
        body = {"model": MODEL, "prompt": prompt, "max_tokens": BATCH_MAX_TOKENS,
                "ignore_eos": True}
        with self.client.post("/v1/completions", json=body, name="batch completion",
                              headers={"x-traffic-class": "batch"},
                              catch_response=True) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                return
            try:
                choices = resp.json()["choices"]
            except (ValueError, KeyError) as exc:
                resp.failure(f"bad response: {exc}")
                return
            if not choices or not choices[0].get("text"):
                resp.failure("empty completion")
                return
            resp.success()
