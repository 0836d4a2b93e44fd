"""Write a Mooncake-format trace of a chosen shape, to time replays of traces not seen before.

The public Mooncake traces that are not in data/traces (the arXiv `mooncake_trace.jsonl`,
`toolagent_trace.jsonl`, `conversation_trace.jsonl`) are published with their request rates
and mean lengths; this writes traces with those shapes (Poisson arrivals, log-normal input
lengths, exponential outputs, a share of requests that extend an earlier request's prefix),
so that how long a replay of them takes can be measured without them:

    python -m loadtests.experiments.stress_trace --rate 6.56 --input-mean 7590 \
        --output-mean 182 --out /tmp/arxiv_like.jsonl
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from collections.abc import Sequence

from loadtests.traces import BLOCK_TOKENS, write_mooncake


def stress_trace(n_requests: int, rate_per_s: float, input_mean: float, output_mean: float,
                 reuse: float = 0.5, output_fixed: int = 0, seed: int = 1) -> list[dict]:
    """Rows in the Mooncake format (ms timestamps, 512-token chained hash ids)."""
    rng = random.Random(seed)
    sigma = 1.0
    mu = math.log(input_mean) - sigma * sigma / 2  # so that the log-normal's mean is input_mean
    rows: list[dict] = []
    prompts: list[list[int]] = []
    next_id, t = 0, 0.0
    for _ in range(n_requests):
        t += rng.expovariate(rate_per_s)
        length = max(1, int(rng.lognormvariate(mu, sigma)))
        n_blocks = -(-length // BLOCK_TOKENS)
        ids: list[int] = []
        if prompts and rng.random() < reuse:
            # Extend a leading part of an earlier prompt, as a follow-up turn or shared context.
            base = rng.choice(prompts)
            ids = base[: min(len(base), rng.randint(1, n_blocks))]
        while len(ids) < n_blocks:
            ids.append(next_id)
            next_id += 1
        prompts.append(ids)
        output = output_fixed or max(1, round(rng.expovariate(1.0 / output_mean)))
        rows.append({"timestamp": round(t * 1000), "input_length": length,
                     "output_length": output, "hash_ids": ids})
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1500)
    ap.add_argument("--rate", type=float, required=True, help="requests per second")
    ap.add_argument("--input-mean", type=float, required=True, help="mean prompt tokens")
    ap.add_argument("--output-mean", type=float, default=182.0, help="mean output tokens")
    ap.add_argument("--output-fixed", type=int, default=0,
                    help="every request asks for this many output tokens (0: exponential)")
    ap.add_argument("--reuse", type=float, default=0.5,
                    help="share of requests that extend an earlier request's prefix")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", required=True, help="JSONL file to write")
    args = ap.parse_args(argv)
    if args.rate <= 0 or args.input_mean < 1 or args.output_mean <= 0 or args.requests < 1:
        ap.error("--rate, --input-mean, --output-mean and --requests must be positive")
    if not 0.0 <= args.reuse <= 1.0:
        ap.error("--reuse is a share, between 0 and 1")
    rows = stress_trace(args.requests, args.rate, args.input_mean, args.output_mean,
                        args.reuse, args.output_fixed, args.seed)
    print(write_mooncake(args.out, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
