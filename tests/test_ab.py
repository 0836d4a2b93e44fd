"""`python -m loadtests.ab`: an offline experiment over two simulated pools finds a 1.5x
slower prefill with the right sign, an interval excluding 0 at 200 pairs that narrows as pairs
accumulate, and the opposite sign with the arms swapped."""

from __future__ import annotations

import json

import pytest

from backends.sim.profiles import PROFILES
from loadtests.ab import checkpoints, main, run_experiment, scaled
from loadtests.simulate import load_workload
from routing.experiment_split import candidate_side

LLAMA = PROFILES["llama-8b-h200"]
SLOW = scaled(LLAMA, 1.5)
PARAMS = {"n_requests": 300, "n_tenants": 30, "rate_per_s": 4.0}


@pytest.fixture(scope="module")
def workload():
    return load_workload(workload="tenants", params=PARAMS)


def test_a_slower_prefill_is_scaled_prefill_only() -> None:
    assert scaled(LLAMA, 1.0) is LLAMA
    assert SLOW.ttft_s(8192) == pytest.approx(1.5 * LLAMA.ttft_s(8192), rel=0.05)
    assert SLOW.decode_s(8) == LLAMA.decode_s(8)
    assert SLOW.cached_token_s == LLAMA.cached_token_s


def test_mirror_finds_the_slower_candidate_and_the_swap_reverses_it(workload) -> None:
    report, pairs = run_experiment(workload, baseline=LLAMA, candidate=SLOW, replicas=4)
    assert report["paired"] == len(pairs) == 300
    assert report["arms"]["candidate"]["pool"] == "llama-8b-h200 prefill x1.5"
    assert report["mirror"] == {"sent": 300, "dropped": 0, "failed": 0}
    rows = checkpoints(pairs, [50, 100, 200, 300])
    at200 = rows[2]
    assert at200["n"] == 200 and at200["mean_s"] > 0
    assert at200["ci95"][0] > 0 and at200["conclusive"]
    widths = [r["width_s"] for r in rows]
    assert widths == sorted(widths, reverse=True) and widths[-1] < widths[0] / 2
    diff = report["ttft_diff_s"]
    assert diff["conclusive"] and diff["ci95"][0] > 0

    swapped, swapped_pairs = run_experiment(workload, baseline=SLOW, candidate=LLAMA,
                                            replicas=4)
    back = checkpoints(swapped_pairs, [200])[0]
    assert back["mean_s"] < 0 and back["ci95"][1] < 0 and back["conclusive"]
    assert swapped["ttft_diff_s"]["ci95"][1] < 0


def test_identical_pools_show_no_difference(workload) -> None:
    report, _ = run_experiment(workload, baseline=LLAMA, candidate=LLAMA, replicas=4)
    diff = report["ttft_diff_s"]
    assert diff["mean"] == 0 and diff["conclusive"] is False


def test_a_mirror_fraction_copies_a_sample_and_a_split_moves_prefixes(workload) -> None:
    report, pairs = run_experiment(workload, fraction=0.5, baseline=LLAMA, candidate=SLOW,
                                   seed=3)
    sent = report["mirror"]["sent"]
    assert 100 < sent < 200 and report["paired"] == len(pairs) == sent
    assert report["arms"]["baseline"]["requests"] == 300

    split, pairs = run_experiment(workload, mode="split", fraction=0.3, name="t",
                                  baseline=LLAMA, candidate=SLOW)
    moved = sum(candidate_side(r.hash_ids[0], "t", 0.3) for r in workload.requests)
    assert split["arms"]["candidate"]["requests"] == moved
    assert split["arms"]["baseline"]["requests"] == 300 - moved
    assert split["paired"] == 0 and pairs == []


def test_the_command_prints_the_report_and_json(capsys) -> None:
    argv = ["--workload", "tenants", *(f"--workload-param={k}={v}" for k, v in PARAMS.items()),
            "--candidate-profile", "llama-8b-h200", "--candidate-prefill-scale", "1.5",
            "--checkpoints", "50,200", "--resamples", "500", "--json"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "experiment ab: mirror 100.0% of traffic class default" in out
    assert "paired TTFT difference (candidate - baseline) as the sample grows" in out
    body = json.loads(out.splitlines()[-1])
    assert [c["n"] for c in body["checkpoints"]] == [50, 200]
    assert body["experiments"][0]["ttft_diff_s"]["conclusive"] is True
    with pytest.raises(SystemExit):
        main(["--workload", "tenants", "--fraction", "2"])
