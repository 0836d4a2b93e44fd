"""The soak benchmark, run for a few seconds: its report's structure, and that its counts add
up (every request sent ends in exactly one outcome; failures are the unexpected outcomes)."""

from __future__ import annotations

import json

from loadtests.soak import EXPECTED_4XX, MIX, Tally, expected, main


def test_tally_counts_unexpected_outcomes_as_failures() -> None:
    t = Tally()
    t.record("chat", "ok")
    t.record("chat_stream", "error_mid_stream")
    t.record("bad_json", "4xx:400")
    t.record("huge_body", "5xx:500")
    t.record("disconnect_mid_request", "client_disconnected")
    assert t.done == 5
    assert t.failures == {"chat_stream: error_mid_stream": 1, "huge_body: 5xx:500": 1}
    assert expected("unknown_model") == "4xx:404" and expected("completion") == "ok"


def test_a_short_soak_reports_consistent_counts(tmp_path, capsys) -> None:
    # Two kills (at 2 s and 4.5 s), two reports, ten samples, ~150 requests.
    code = main(["--seconds", "5", "--rate", "30", "--time-scale", "0.2",
                 "--kill-every-s", "2", "--restart-after-s", "0.5", "--report-every-s", "2",
                 "--sample-every-s", "0.5", "--settle-s", "0.5", "--json",
                 "--log-dir", str(tmp_path)])
    assert code == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    # Progress lines went to stderr, one per report and the final one, then the memory line.
    progress = captured.err.splitlines()
    assert progress[0].startswith("soak: gateway http://127.0.0.1:")
    assert len([line for line in progress if line.startswith("[")]) == len(report["reports"]) + 1
    assert progress[-1].startswith("memory: RSS ")

    assert report["gateway_exit_code"] is None  # the gateway outlived everything thrown at it
    assert report["sent"] > 100
    assert report["sent"] == report["done"] == sum(report["outcomes"].values())
    assert sum(sum(v.values()) for v in report["by_kind"].values()) == report["sent"]
    assert set(report["by_kind"]) <= set(MIX)
    unexpected = {f"{kind}: {outcome}": n for kind, outcomes in report["by_kind"].items()
                  for outcome, n in outcomes.items() if outcome != expected(kind)}
    assert report["failures"] == unexpected
    # Bad input always gets its 4xx, whatever the replicas are going through.
    for kind in EXPECTED_4XX:
        assert set(report["by_kind"].get(kind, {})) <= {expected(kind)}, kind

    kills = [k["replica"] for k in report["kills"]]
    assert kills and kills == list(range(len(kills)))  # in turn, from the first replica
    assert report["reports"]
    for rep in report["reports"]:
        assert rep["sent"] >= rep["done"] == sum(rep["outcomes"].values())
        assert rep["rss_mb"] > 10 and rep["fds"] > 0
    memory = report["memory"]
    assert memory["rss_end_mb"] > 10 and memory["rss_baseline_mb"] > 10
    assert memory["within_5_percent"] == (abs(memory["rss_growth"]) <= 0.05)
    assert len(report["samples"]) >= 6
