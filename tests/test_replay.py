"""`python -m loadtests.replay` end to end: sims and a gateway as processes, JSON last.

The command's main() runs in the test process (the replicas and the gateway it starts are still
processes): a fourth interpreter per run would only repeat the imports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtests.replay import REQUIRED_KEYS, main
from loadtests.traces import MOONCAKE, ideal_hit_ratio, load_requests

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def run(capsys, monkeypatch):
    """`python -m loadtests.replay ARGS --json` from the repository root: its JSON line."""
    monkeypatch.chdir(ROOT)

    def _run(args: list[str]) -> dict:
        code = main([*args, "--json"])
        out, err = capsys.readouterr()
        assert code == 0, err[-3000:]
        return json.loads(out.strip().splitlines()[-1])

    return _run


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


def test_replay_workload_with_params_and_limit_json(run) -> None:
    # Three tenants instead of 150: a much higher ideal hit ratio than the default's; --limit
    # takes the first 24 of the 30 requests the params make.
    limit, params = 24, {"n_tenants": 3, "n_requests": 30}
    res = run(["--workload", "tenants", "--replicas", "2", "--limit", str(limit),
               "--speedup", "4", "--time-scale", "0.05", "--max-output", "8",
               *[f"--workload-param={k}={v}" for k, v in params.items()]])
    reqs = load_requests(None, "tenants", limit, 4, params)
    assert len(reqs) == limit < len(load_requests(None, "tenants", None, 4, params))
    assert ideal_hit_ratio(reqs) > ideal_hit_ratio(load_requests(None, "tenants", limit, 4)) + 0.1
    _check(res, limit, ideal_hit_ratio(reqs))
    assert res["policy"]
    assert res["source"] == "tenants"


def test_replay_mooncake_trace_with_policy(run) -> None:
    limit = 25
    # The repository's copy, named as a user would from the repository root.
    res = run(["--trace", str(MOONCAKE.relative_to(ROOT)), "--replicas", "3", "--limit",
                str(limit), "--speedup", "20", "--time-scale", "0.02", "--max-output", "8",
                "--policy", "round_robin"])
    reqs = load_requests(str(MOONCAKE), None, limit, 20)
    _check(res, limit, ideal_hit_ratio(reqs))
    assert res["policy"] == "round_robin"
    assert res["source"] == "synthetic_trace.jsonl"
    # round robin over 3 replicas: 25 requests split 9/8/8, so the busiest has 9 / (25 / 3).
    assert sorted(res["requests_per_replica"]) == [8, 8, 9]
    assert res["imbalance"] == pytest.approx(1.08)
