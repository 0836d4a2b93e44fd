"""loadtests/replay.py end to end: sims and a gateway as processes, JSON on the last line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadtests.replay import REQUIRED_KEYS
from loadtests.traces import ideal_hit_ratio, load_requests

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT.parent / "shared" / "traces" / "synthetic_trace.jsonl"


def _run(args: list[str]) -> dict:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "loadtests" / "replay.py"), *args, "--json"],
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
    assert sum(res["requests_per_replica"]) == limit
    assert res["imbalance"] >= 1.0
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


@pytest.mark.skipif(not TRACE.exists(), reason="shared Mooncake trace not present")
def test_replay_mooncake_trace_with_policy() -> None:
    limit = 25
    res = _run(["--trace", str(TRACE), "--replicas", "3", "--limit", str(limit),
                "--speedup", "20", "--time-scale", "0.02", "--max-output", "8",
                "--policy", "round_robin"])
    reqs = load_requests(str(TRACE), None, limit, 20)
    _check(res, limit, ideal_hit_ratio(reqs))
    assert res["policy"] == "round_robin"
    # round robin over 3 replicas: 25 requests split 9/8/8.
    assert sorted(res["requests_per_replica"]) == [8, 8, 9]
