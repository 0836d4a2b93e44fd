"""Offline engine A/B: a trace or workload through a mirror or split experiment over two
simulated pools (no HTTP), reported as GET /admin/experiments and `prefix-gateway experiments`.

Each pool is the offline simulator's (loadtests/simulate.py: backends.sim's engine model, the
gateway's router with prefix_affinity). Mirror: every request (or a sampled fraction) runs on
both pools, paired by request; split: a prefix goes to the candidate when
candidate_side(first block id, name, fraction) says so, as the gateway chooses.

    python -m loadtests.ab --workload tenants --workload-param n_requests=400 \\
        --baseline-profile llama-8b-h200 --candidate-profile llama-8b-h200 \\
        --candidate-prefill-scale 1.5 --checkpoints 50,100,200,400
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
from collections.abc import Sequence
from typing import Any

import orjson

from backends.sim.profiles import PROFILES, LatencyProfile
from gateway.experiments import ExperimentRecord, Sample, paired_difference, render_report
from loadtests.settings import add_workload_param
from loadtests.simulate import (
    DEFAULT_ENGINE_BLOCK_TOKENS,
    DEFAULT_KV_CAPACITY_TOKENS,
    PoolRun,
    Workload,
    load_workload,
    run_pool,
)
from loadtests.traces import SYNTHETIC
from routing.experiment_split import candidate_side

ARMS = ("baseline", "candidate")


def scaled(profile: LatencyProfile, prefill_scale: float) -> LatencyProfile:
    """`profile` whose prefill compute takes `prefill_scale` times as long (1.5: a third
    slower tokens per second and attention); reading cached KV and decoding unchanged."""
    if prefill_scale == 1.0:
        return profile
    return dataclasses.replace(
        profile, name=f"{profile.name} prefill x{prefill_scale:g}",
        prefill_tokens_per_s=profile.prefill_tokens_per_s / prefill_scale,
        attention_s_per_token2=profile.attention_s_per_token2 * prefill_scale)


def _sample(run: PoolRun, workload: Workload, rid: int, prompt_tokens: int) -> Sample:
    arrived = workload.requests[rid].timestamp_s
    first, finish, out = run.first_at[rid], run.finish_at[rid], run.out_tokens[rid]
    if run.replica_of[rid] < 0:  # longer than the engine's KV cache: a 400 over HTTP
        return Sample(arrived, None, None, 0.0, prompt_tokens, None, "http_4xx",
                      run.inflight_at_arrival[rid])
    return Sample(arrived, first - arrived, (finish - first) / (out - 1) if out > 1 else None,
                  finish - arrived, prompt_tokens, out, None, run.inflight_at_arrival[rid])


def run_experiment(workload: Workload, *, mode: str = "mirror", fraction: float = 1.0,
                   name: str = "ab", baseline: LatencyProfile, candidate: LatencyProfile,
                   replicas: int = 4, seed: int = 0, resamples: int = 2000,
                   kv_capacity_tokens: int = DEFAULT_KV_CAPACITY_TOKENS,
                   ) -> tuple[dict[str, Any], list[tuple[float, float]]]:
    """The experiment's report and, in mirror mode, the paired TTFTs (baseline, candidate)
    in arrival order."""
    if mode not in ("mirror", "split"):
        raise ValueError(f"mode must be mirror or split, not {mode!r}")
    n = len(workload.requests)
    if mode == "mirror":
        rng = random.Random(seed)
        copies = [rid for rid in range(n) if fraction >= 1.0 or rng.random() < fraction]
        sent = {"baseline": list(range(n)), "candidate": copies}
    else:
        side = [bool(r.hash_ids) and candidate_side(r.hash_ids[0], name, fraction)
                for r in workload.requests]
        sent = {"baseline": [rid for rid in range(n) if not side[rid]],
                "candidate": [rid for rid in range(n) if side[rid]]}
    profiles = {"baseline": baseline, "candidate": candidate}
    record = ExperimentRecord(name, mode, "default", baseline.name, candidate.name, fraction,
                              max_samples=max(1, n))
    _, prompt_tokens = workload.engine_prompts(DEFAULT_ENGINE_BLOCK_TOKENS)
    runs = {arm: run_pool(workload, "prefix_affinity", profiles=[profiles[arm]] * replicas,
                          kv_capacity_tokens=kv_capacity_tokens, only=sent[arm])
            for arm in ARMS}
    samples: dict[str, dict[int, Sample]] = {arm: {} for arm in ARMS}
    for arm in ARMS:
        for rid in sent[arm]:
            s = samples[arm][rid] = _sample(runs[arm], workload, rid, prompt_tokens[rid])
            record.add(arm, s, pair=rid if mode == "mirror" else None)
    if mode == "mirror":
        record.count("sent", len(sent["candidate"]))
        record.count("failed", sum(s.error is not None for s in samples["candidate"].values()))
    engines = {arm: {"prefix_cache_hit_ratio": runs[arm].hit_ratio, "kv_usage": None,
                     "queue_length": None} for arm in ARMS}
    pairs = []
    if mode == "mirror":
        for rid in sent["candidate"]:
            b, c = samples["baseline"][rid], samples["candidate"][rid]
            if b.ttft_s is not None and c.ttft_s is not None:
                pairs.append((b.ttft_s, c.ttft_s))
    report = record.report(engines, resamples=resamples, seed=seed)
    report["conditions"]["since"] = None  # a simulated clock, not a date
    return report, pairs


def checkpoints(pairs: list[tuple[float, float]], sizes: Sequence[int], resamples: int = 2000,
                seed: int = 0) -> list[dict[str, Any]]:
    """The paired TTFT difference over the first n pairs, for each n in `sizes` we have."""
    out = []
    for n in sizes:
        if n > len(pairs):
            break
        d = paired_difference([b for b, _ in pairs[:n]], [c for _, c in pairs[:n]],
                              resamples, seed)
        ci = d["ci95"]
        out.append({"n": n, "mean_s": d["mean"], "ci95": ci,
                    "width_s": ci[1] - ci[0] if ci else None, "conclusive": d["conclusive"]})
    return out


def checkpoint_table(rows: list[dict[str, Any]]) -> str:
    lines = ["paired TTFT difference (candidate - baseline) as the sample grows",
             "  pairs  mean        95% CI                    width      conclusive"]
    for r in rows:
        ci = r["ci95"]
        interval = f"[{1000 * ci[0]:+.1f}, {1000 * ci[1]:+.1f}] ms" if ci else "-"
        width = "-" if r["width_s"] is None else f"{1000 * r['width_s']:.1f} ms"
        lines.append(f"  {r['n']:<5}  {1000 * r['mean_s']:+8.1f} ms  {interval:<24}  "
                     f"{width:<9}  {'yes' if r['conclusive'] else 'no'}")
    return "\n".join(lines) + "\n"


def _profile(name: str) -> LatencyProfile:
    if name not in PROFILES:
        raise argparse.ArgumentTypeError(f"unknown profile {name!r}; one of {sorted(PROFILES)}")
    return PROFILES[name]


def _sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected sizes like 50,100,200, got {text!r}") from None
    if not sizes or sizes[0] < 2:
        raise argparse.ArgumentTypeError("checkpoints are pair counts of 2 or more")
    return sizes


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="Mooncake JSONL file or RAGPulse directory")
    src.add_argument("--workload", choices=sorted(SYNTHETIC), help="a synthetic workload")
    add_workload_param(ap)
    ap.add_argument("--limit", type=int, default=None, help="first N requests")
    ap.add_argument("--speedup", type=float, default=1.0, help="divide arrival times by this")
    ap.add_argument("--mode", choices=("mirror", "split"), default="mirror")
    ap.add_argument("--fraction", type=float, default=1.0,
                    help="mirror: share of requests copied; split: share of prefixes moved")
    ap.add_argument("--name", default="ab", help="the experiment's name (a split's hash seed)")
    ap.add_argument("--baseline-profile", type=_profile, default=PROFILES["llama-8b-h200"])
    ap.add_argument("--candidate-profile", type=_profile, default=PROFILES["qwen-32b-h200"])
    ap.add_argument("--baseline-prefill-scale", type=float, default=1.0,
                    help="multiply the baseline's prefill time (1.5: 1.5x slower prefill)")
    ap.add_argument("--candidate-prefill-scale", type=float, default=1.0,
                    help="multiply the candidate's prefill time")
    ap.add_argument("--replicas", type=int, default=4, help="replicas per pool")
    ap.add_argument("--kv-capacity-tokens", type=int, default=DEFAULT_KV_CAPACITY_TOKENS)
    ap.add_argument("--seed", type=int, default=0, help="mirror sampling and bootstrap seed")
    ap.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples")
    ap.add_argument("--checkpoints", type=_sizes, default=None, metavar="N,N,...",
                    help="mirror: the paired TTFT difference over the first N pairs")
    ap.add_argument("--json", action="store_true", help="one JSON object on the last line")
    args = ap.parse_args(argv)
    if args.replicas < 1:
        ap.error("--replicas must be at least 1")
    if not 0.0 <= args.fraction <= 1.0:
        ap.error("--fraction must be within 0..1")
    if min(args.baseline_prefill_scale, args.candidate_prefill_scale) <= 0:
        ap.error("prefill scales must be positive")
    workload = load_workload(args.trace, args.workload, limit=args.limit, speedup=args.speedup,
                             params=dict(args.workload_param))
    baseline = scaled(args.baseline_profile, args.baseline_prefill_scale)
    candidate = scaled(args.candidate_profile, args.candidate_prefill_scale)
    report, pairs = run_experiment(
        workload, mode=args.mode, fraction=args.fraction, name=args.name, baseline=baseline,
        candidate=candidate, replicas=args.replicas, seed=args.seed, resamples=args.resamples,
        kv_capacity_tokens=args.kv_capacity_tokens)
    body: dict[str, Any] = {"experiments": [report]}
    print(f"# {workload.name}: {len(workload.requests)} requests, speedup {args.speedup:g}; "
          f"{args.replicas} replicas per pool, prefix_affinity, KV {args.kv_capacity_tokens} "
          f"tokens/replica; simulated time")
    print(render_report(body), end="")
    if args.checkpoints:
        if args.mode != "mirror":
            print("checkpoints: a split has no paired requests")
        else:
            body["checkpoints"] = checkpoints(pairs, args.checkpoints, args.resamples, args.seed)
            print(checkpoint_table(body["checkpoints"]), end="")
            if len(pairs) < args.checkpoints[-1]:
                print(f"  (only {len(pairs)} pairs: larger checkpoints skipped)")
    if args.json:
        print(orjson.dumps(body).decode())  # a NaN is written as null, not NaN
    return 0


if __name__ == "__main__":
    sys.exit(main())
