"""Chained xxhash block hashes of a prompt: equal prefixes give equal hash chains."""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

_SEED = 0x5EED


def chain_hashes(blocks: Sequence[bytes], parent: int = 0) -> list[int]:
    """Hash each block together with the hash of everything before it.

    Block i's hash covers blocks 0..i, so two prompts share a hash at position i exactly when
    their first i+1 blocks are equal: the longest common prefix is the common run of hashes.
    """
    out: list[int] = []
    h = parent
    digest = xxhash.xxh3_64_intdigest
    for block in blocks:
        h = digest(block, seed=h ^ _SEED)
        out.append(h)
    return out


def char_block_hashes(text: str, block_chars: int, include_partial: bool = False) -> list[int]:
    """Chained hashes of fixed-size character blocks of `text`.

    Only full blocks are hashed by default: an engine caches whole KV blocks, so a trailing
    partial block can never be a cache hit and would only add noise to the index.
    """
    if block_chars <= 0:
        raise ValueError("block_chars must be positive")
    data = text.encode("utf-8", "surrogatepass")
    # Cut on bytes, not characters: cheap, and equal text still gives equal blocks.
    n_full = len(data) // block_chars
    end = len(data) if include_partial else n_full * block_chars
    blocks = [data[i : i + block_chars] for i in range(0, end, block_chars)]
    return chain_hashes(blocks)


def token_block_hashes(tokens: Sequence[int], block_tokens: int) -> list[int]:
    """Chained hashes of full token blocks, aligned to the engine's KV block size."""
    if block_tokens <= 0:
        raise ValueError("block_tokens must be positive")
    n_full = len(tokens) // block_tokens
    blocks = [
        b"".join(t.to_bytes(4, "little", signed=False) for t in tokens[i : i + block_tokens])
        for i in range(0, n_full * block_tokens, block_tokens)
    ]
    return chain_hashes(blocks)


def key_hash(data: bytes | str) -> int:
    """A 64-bit hash of an arbitrary key (used for rendezvous scores)."""
    if isinstance(data, str):
        data = data.encode()
    return xxhash.xxh3_64_intdigest(data, seed=_SEED)
