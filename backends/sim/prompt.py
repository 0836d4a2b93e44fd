"""What the simulated engine sees of a request: prompt text, token count and KV block hashes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import xxhash

from routing.hashing import char_block_hashes, token_block_hashes
from routing.prompt import render_chat

# The simulator's tokenizer is "one token per 4 bytes of UTF-8", so a KV block of N tokens is
# a block of 4*N bytes of canonical prompt text.
BYTES_PER_TOKEN = 4
PSEUDO_VOCAB = 32_000

FILLER_WORDS: tuple[str, ...] = (
    "the", "engine", "replies", "with", "simulated", "words", "while", "routing",
    "keeps", "shared", "prefixes", "warm", "in", "one", "replica's", "cache",
)  # fmt: skip


class PromptError(ValueError):
    """The request's prompt cannot be read; the message says what to send instead."""


@dataclass(frozen=True, slots=True)
class Prompt:
    """A request's prompt as the simulated engine accounts for it."""

    text: str
    prompt_tokens: int
    block_hashes: list[int]


def estimate_tokens(text: str) -> int:
    """The simulator's token count of `text`: ceil(UTF-8 bytes / 4), at least 1."""
    return max(1, -(-len(text.encode("utf-8", "surrogatepass")) // BYTES_PER_TOKEN))


def pseudo_tokens(text: str) -> list[int]:
    """A deterministic stand-in tokenisation: one id per 4 bytes of text."""
    data = text.encode("utf-8", "surrogatepass")
    digest = xxhash.xxh32_intdigest
    return [
        digest(data[i : i + BYTES_PER_TOKEN]) % PSEUDO_VOCAB
        for i in range(0, len(data), BYTES_PER_TOKEN)
    ]


def text_prompt(text: str, block_tokens: int) -> Prompt:
    return Prompt(
        text, estimate_tokens(text), char_block_hashes(text, block_tokens * BYTES_PER_TOKEN)
    )


def chat_prompt(body: dict[str, Any], block_tokens: int) -> Prompt:
    """Canonical chat text (tools, then role and content of each message), as routing renders it."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise PromptError("'messages' must be a non-empty list of {role, content} objects")
    return text_prompt(render_chat(body), block_tokens)


def completion_prompt(body: dict[str, Any], block_tokens: int) -> Prompt:
    """A completions prompt: a string, a one-element list of strings, or token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise PromptError("'prompt' must not be empty")
        return text_prompt(prompt, block_tokens)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        tokens: list[int] = prompt
        bad = next((t for t in tokens if isinstance(t, bool) or not 0 <= t < PSEUDO_VOCAB), None)
        if bad is not None:
            # vLLM answers 400 for a token id outside its vocabulary.
            raise PromptError(f"Token id {bad} is out of vocabulary (0 to {PSEUDO_VOCAB - 1})")
        return Prompt(
            " ".join(map(str, tokens)), len(tokens), token_block_hashes(tokens, block_tokens)
        )
    raise PromptError(
        "'prompt' must be a non-empty string or list of token ids; the simulated replica "
        "serves one prompt per request, so send a batch as separate requests"
    )


def filler(start: int, count: int) -> list[str]:
    """Deterministic generated text: token i of every reply is the same word."""
    words = FILLER_WORDS
    n = len(words)
    return [words[i % n] + " " for i in range(start, start + count)]
