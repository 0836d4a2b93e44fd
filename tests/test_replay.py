"""`python -m loadtests.replay` end to end: sims and a gateway as processes, JSON last."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadtests.replay import REQUIRED_KEYS
from loadtests.traces import MOONCAKE, ideal_hit_ratio, load_requests

ROOT = Path(__file__).resolve().parent.parent


def _run(args: list[str]) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "loadtests.replay", *args, "--json"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check(res: dict, limit: int, expected_ideal: float) -> None:
    for key in REQUIRED_KEYS:
        assert key in res, key
    assert res["requests"] == limit
    assert res["errors"] == 0, res.get("first_errors")
    assert 0.0 <= res["hit_ratio"] <= 1.0
    assert res["ideal_hit_ratio"] == pytest.approx(expected_ideal)
    # The replicas' own counters: every request served once, and the imbalance is theirs.
    per_replica = res["requests_per_replica"]
    assert sum(per_replica) == limit
    assert res["imbalance"] == pytest.approx(max(per_replica) * len(per_replica) / limit)
    assert res["ttft_p50_s"] > 0


def test_replay_workload_json() -> None:
    limit = 30
    res = _run(["--workload", "tenants", "--replicas", "2", "--limit", str(limit),
                "--speedup", "4", "--time-scale", "0.05", "--max-output", "8"])
    reqs = load_requests(None, "tenants", limit, 4)
    _check(res, limit, ideal_hit_ratio(reqs))
    assert res["policy"]


def test_replay_workload_params_shape_the_workload() -> None:
    # Three tenants instead of 150: a much higher ideal hit ratio than the default's.
    params = {"n_tenants": 3, "n_requests": 24}
    res = _run(["--workload", "tenants", "--replicas", "2", "--speedup", "4",
                "--time-scale", "0.05", "--max-output", "8",
                *[f"--workload-param={k}={v}" for k, v in params.items()]])
    reqs = load_requests(None, "tenants", None, 4, params)
    assert ideal_hit_ratio(reqs) > ideal_hit_ratio(load_requests(None, "tenants", 24, 4)) + 0.1
    _check(res, 24, ideal_hit_ratio(reqs))


def test_replay_mooncake_trace_with_policy() -> None:
    limit = 25
    # The repository's copy, named as a user would from the repository root.
    res = _run(["--trace", str(MOONCAKE.relative_to(ROOT)), "--replicas", "3", "--limit",
                str(limit), "--speedup", "20", "--time-scale", "0.02", "--max-output", "8",
                "--policy", "round_robin"])
    reqs = load_requests(str(MOONCAKE), None, limit, 20)
    _check(res, limit, ideal_hit_ratio(reqs))
    assert res["policy"] == "round_robin"
    assert res["source"] == "synthetic_trace.jsonl"
    # round robin over 3 replicas: 25 requests split 9/8/8, so the busiest has 9 / (25 / 3).
    assert sorted(res["requests_per_replica"]) == [8, 8, 9]
    assert res["imbalance"] == pytest.approx(1.08)
