"""loadtests.held_out: the saturation search, the verdicts, and a trace judged in one command."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from backends.sim.fleet_spec import fleet_profiles
from backends.sim.profiles import PROFILES
from loadtests import held_out
from loadtests.held_out import (
    CLIFF,
    NEIGHBOURS,
    Cell,
    Options,
    find_saturation,
    main,
    neighbour_lines,
    neighbours_of,
    offered_load,
    report_lines,
    saturated,
    saturation_speedup,
    work_seconds,
)
from loadtests.simulate import Workload
from loadtests.traces import TraceRequest


def _probe_log(threshold: float) -> tuple[list[float], Any]:
    seen: list[float] = []

    def past_at(speedup: float) -> bool:
        seen.append(speedup)
        return speedup > threshold

    return seen, past_at


@pytest.mark.parametrize("start", [0.5, 1.0, 2.9, 3.1, 20.0, 100.0])
def test_the_search_brackets_the_saturation_speedup_within_ten_percent(start: float) -> None:
    seen, past_at = _probe_log(3.0)
    lo, hi, probes = find_saturation(past_at, start)
    assert hi is not None
    assert lo <= 3.0 < hi
    assert hi / lo < 1.1
    assert [x for x, _ in probes] == seen
    assert len(set(seen)) == len(seen), "no speedup is run twice"
    assert all(past == (x > 3.0) for x, past in probes)
    assert lo < saturation_speedup(lo, hi) < hi


def test_the_search_says_when_it_found_no_saturation_or_nothing_short_of_it() -> None:
    _, never = _probe_log(math.inf)
    lo, hi, probes = find_saturation(never, 1.0)
    assert (lo, hi) == (8.0, None)  # doubled three times, never past
    assert [x for x, _ in probes] == [1.0, 2.0, 4.0, 8.0]
    assert saturation_speedup(lo, hi) == 8.0
    _, always = _probe_log(0.0)
    lo, hi, probes = find_saturation(always, 1.0)
    assert lo == 0.0 and hi is not None and hi < 0.01
    assert saturation_speedup(lo, hi) == hi


def _report(mean: float, first: float, last: float, bound: float = 1.0) -> dict[str, float]:
    return {"ttft_mean_s": mean, "ttft_first_third_s": first, "ttft_last_third_s": last,
            "ttft_bound_mean_s": bound}


def test_a_load_is_past_saturation_only_if_the_best_policy_is() -> None:
    steady = _report(1.5, 1.4, 1.6)
    growing = _report(3.0, 1.0, 6.0)
    swamped = _report(CLIFF + 0.5, CLIFF, CLIFF + 1)  # flat, but all queue
    assert not saturated([steady])
    assert saturated([growing])
    assert saturated([swamped])
    # A greedy oracle that saturates alone does not make the load saturated.
    assert not saturated([growing, steady])
    assert saturated([growing, swamped])
    # Growth near the bound is noise: the last third must also be well past it.
    assert not saturated([_report(0.5, 0.4, 1.2, bound=1.0)])


def _cell_reports(pa: float, oracle: float, bound: float, imbalance: float = 1.0,
                  ) -> dict[str, dict[str, float]]:
    def one(mean: float) -> dict[str, float]:
        return {**_report(mean, mean, mean, bound), "prefill_time_imbalance": imbalance,
                "hit_ratio": 0.5, "ideal_hit_ratio": 0.6}
    return {"prefix_affinity": one(pa), "oracle": one(oracle)}


def test_the_verdict_asks_1_05_where_the_oracle_is_far_from_its_bound_and_1_10_near_it() -> None:
    opts = Options("t.jsonl", None, (None, None, "qwen-32b-h200"), 512_000, ())
    cases = {  # speedup: (prefix_affinity, oracle, bound, imbalance)
        1.0: (1.08, 1.0, 0.9, 1.0),  # oracle near its bound: within 1.10, met
        2.0: (1.08, 1.0, 0.5, 1.0),  # oracle twice its bound: past 1.05
        3.0: (1.0, 1.0, 0.9, 1.2),  # imbalance by time past 1.15
        4.0: (9.0, 8.0, 1.0, 1.5),  # past saturation (8x the bound): not judged
    }
    cells = [Cell(8, s) for s in cases]
    results = {(cell, p): r for cell in cells
               for p, r in _cell_reports(*cases[cell.speedup]).items()}
    lines, ratios = report_lines(opts, cells, results, ["prefix_affinity", "oracle"])
    text = "\n".join(lines)
    assert ratios == pytest.approx([1.08, 1.08, 1.0])
    assert "speedup 2: 1.080x the oracle (target 1.05)" in text
    assert "speedup 1:" not in text
    assert "speedup 3: prefill imbalance by time 1.200" in text
    assert "speedup 4" not in text
    assert "Short of saturation (3 of 4 cells)" in text
    rows = [line for line in lines if line.startswith("| 8 |")]
    assert [row.split("|")[-2].strip() for row in rows] == [
        "short of saturation"] * 3 + ["past saturation"]


def test_neighbours_tell_a_miss_that_holds_from_one_that_comes_and_goes() -> None:
    holds, draw = Cell(8, 1.0), Cell(32, 2.0)
    assert [c.speedup for c in neighbours_of(draw)] == [2.0 * f for f in NEIGHBOURS]
    results = {}
    for near in neighbours_of(holds):  # 1.08x an oracle twice its bound: past 1.05 at each
        results.update({(near, p): r for p, r in _cell_reports(1.08, 1.0, 0.5).items()})
    for i, near in enumerate(neighbours_of(draw)):  # past the imbalance at one of four
        results.update({(near, p): r for p, r in _cell_reports(
            1.0, 1.0, 0.9, imbalance=1.2 if i == 2 else 1.1).items()})
    lines = neighbour_lines([holds, draw], results)
    text = "\n".join(lines)
    assert "- 8 replicas, speedup 1: past a target at 4 of its 4 neighbours." in text
    assert "- 32 replicas, speedup 2: past a target at 1 of its 4 neighbours." in text
    assert ("At the 8 neighbours short of saturation: past a target at 5; prefix_affinity "
            "at 1.080x the oracle at worst, 1.039x in geometric mean.") in text
    rows = [line for line in lines if line.startswith("| 32 |")]
    assert [row.split("|")[-2].strip() for row in rows] == [
        "none", "none", "prefill imbalance by time 1.200", "none"]
    assert all(line.endswith("1.080x the oracle (target 1.05) |")
               for line in lines if line.startswith("| 8 |"))


def test_a_cells_command_spells_settings_as_simulate_reads_them() -> None:
    opts = Options("t.jsonl", 100, (None, "1:3", "llama-8b-h200"), 100_000,
                   (("time_cap", None), ("wait_first", True), ("policy", "prefix_affinity")))
    assert opts.command(Cell(8, 1.25)) == (
        "python -m loadtests.simulate --trace t.jsonl --replicas 8 --slow 1:3 --profile "
        "llama-8b-h200 --limit 100 --kv-capacity-tokens 100000 --speedup 1.25 --policy all "
        "--set time_cap=null --set wait_first=true --set policy=prefix_affinity")
    # Over HTTP: replay's default profile is another, so the simulator's is named.
    assert Options("t.jsonl", None, (None, None, "qwen-32b-h200"), 512_000, ()).command(
        Cell(32, 2.0), "replay") == ("python -m loadtests.replay --trace t.jsonl --replicas 32 "
                                     "--profile qwen-32b-h200 --speedup 2")


def _workload(rows: list[tuple[float, int, int, tuple[int, ...]]]) -> Workload:
    return Workload("t", [TraceRequest(t, tokens, out, ids) for t, tokens, out, ids in rows])


def test_work_is_the_uncached_prefill_and_the_decode_with_one_shared_cache() -> None:
    profile = PROFILES["qwen-32b-h200"]
    one = _workload([(0.0, 1024, 1, (1, 2))])
    two_same = _workload([(0.0, 1024, 1, (1, 2)), (10.0, 1024, 1, (1, 2))])
    two_apart = _workload([(0.0, 1024, 1, (1, 2)), (10.0, 1024, 1, (3, 4))])
    w1, w_same, w_apart = (work_seconds(w, profile) for w in (one, two_same, two_apart))
    assert w1 > 1024 / profile.prefill_tokens_per_s * 0.9
    assert w_apart == pytest.approx(2 * w1)
    # The second prompt is cached but for the one token an engine always computes.
    assert w1 < w_same < 1.1 * w1
    longer = _workload([(0.0, 1024, 101, (1, 2))])
    assert work_seconds(longer, profile) == pytest.approx(w1 + 100 * profile.decode_per_seq_s)


def test_offered_load_scales_with_the_speedup_and_the_fleets_capacity() -> None:
    rows = [(10.0 * i, 1024, 50, (i, 1000 + i)) for i in range(20)]
    base = _workload(rows)
    faster = _workload([(t / 2, n, o, ids) for t, n, o, ids in rows])
    eight = offered_load(base, fleet_profiles(8, "qwen-32b-h200"))
    assert offered_load(faster, fleet_profiles(8, "qwen-32b-h200")) == pytest.approx(2 * eight)
    assert offered_load(base, fleet_profiles(4, "qwen-32b-h200")) == pytest.approx(2 * eight)
    # One replica of eight three times slower: the capacity of 7 + 1/3.
    slow = offered_load(base, fleet_profiles(8, "qwen-32b-h200", slow="1:3"))
    assert slow == pytest.approx(eight * 8 / (7 + 1 / 3))
    with pytest.raises(ValueError, match="two different times"):
        offered_load(_workload([(1.0, 1024, 1, (1,))]), fleet_profiles(2, "qwen-32b-h200"))


def _trace(path: Path, n: int = 120) -> Path:
    # Sessions of four turns on eight shared documents: prefixes worth routing by.
    rows = []
    for i in range(n):
        doc, turn = i % 8, (i // 8) % 4
        rows.append({"timestamp": 250 * i, "input_length": 512 * (4 + turn),
                     "output_length": 16,
                     "hash_ids": [doc, 100 + doc, 200 + doc, 300 + doc]
                     + [10_000 + 10 * (i // 32) + 100 * doc + k for k in range(turn)]})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _rows(out: str) -> list[list[str]]:
    return [[c.strip() for c in line.split("|")[1:-1]] for line in out.splitlines()
            if line.startswith("| ") and not line.startswith("| replicas")]


def test_the_cli_finds_saturation_and_judges_prefix_affinity_short_of_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = _trace(tmp_path / "unseen.jsonl")
    code = main(["--trace", str(trace), "--replicas", "2", "--fractions", "0.5,0.9",
                 "--policies", "prefix_affinity,oracle,round_robin", "--jobs", "1"])
    out = capsys.readouterr().out
    assert code == 0
    assert "2 replicas: saturation speedup" in out
    assert "short of it at" in out and "past it at" in out
    rows = _rows(out)
    assert [r[2] for r in rows] == ["0.5", "0.9"]
    speedups = [float(r[1]) for r in rows]
    assert speedups[0] < speedups[1]
    assert all(r[-1] == "short of saturation" for r in rows)
    assert "Short of saturation (2 of 2 cells)" in out
    # Each cell is a simulate command a reader can run.
    for s in speedups:
        assert (f"`python -m loadtests.simulate --trace {trace} --replicas 2 --speedup {s:g} "
                f"--policy all`; `python -m loadtests.replay --trace {trace} --replicas 2 "
                f"--profile qwen-32b-h200 --speedup {s:g}`") in out


def test_the_cli_exits_1_past_the_ratio_asked_for(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = _trace(tmp_path / "unseen.jsonl")
    args = ["--trace", str(trace), "--replicas", "2,3", "--speedups", "1",
            "--policies", "prefix_affinity,oracle", "--jobs", "1"]
    assert main([*args, "--max-ratio", "100"]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    assert [(r[0], r[1], r[2]) for r in rows] == [("2", "1", "-"), ("3", "1", "-")]
    assert "Saturation:" not in out  # speedups given: no search
    ratios = [float(r[4]) for r in rows]
    assert main([*args, "--max-ratio", str(min(ratios) * 0.99)]) == 1


def test_the_cli_runs_each_cell_short_of_saturation_again_at_its_neighbours(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
        ) -> None:
    trace = _trace(tmp_path / "unseen.jsonl", n=60)
    args = ["--trace", str(trace), "--replicas", "2", "--speedups", "1",
            "--policies", "prefix_affinity,oracle", "--jobs", "1"]
    assert main(args) == 0
    assert "neighbouring speedups" not in capsys.readouterr().out  # not asked for
    assert main([*args, "--neighbours"]) == 0
    _, after = capsys.readouterr().out.split("again at neighbouring speedups")
    rows = _rows(after)
    assert [(r[0], float(r[1]), float(r[2])) for r in rows] == [
        ("2", pytest.approx(f), f) for f in NEIGHBOURS]
    assert all(r[-1] == "none" for r in rows)  # a small, light trace: every target met
    assert "- 2 replicas, speedup 1: past a target at 0 of its 4 neighbours." in after
    # An imbalance target below 1, which every cell misses.
    monkeypatch.setattr(held_out, "TIME_IMBALANCE", 0.99)
    assert main([*args, "--neighbours"]) == 0
    out = capsys.readouterr().out
    assert "Past a target: 2 replicas, speedup 1: prefill imbalance by time" in out
    rows = _rows(out.split("again at neighbouring speedups")[1])
    assert all(r[-1].startswith("prefill imbalance by time") for r in rows)
    assert "- 2 replicas, speedup 1: past a target at 4 of its 4 neighbours." in out


@pytest.mark.parametrize("bad", [
    ["--replicas", "0"], ["--fractions", "x"], ["--speedups", "-1"],
    ["--policies", "prefix_affinity,nonsense"], ["--set", "no_such_setting=1"],
    ["--fleet", "nonsense:2"],
])
def test_bad_arguments_are_usage_errors(tmp_path: Path, bad: list[str]) -> None:
    trace = _trace(tmp_path / "unseen.jsonl", n=10)
    with pytest.raises(SystemExit) as exc:
        main(["--trace", str(trace), "--jobs", "1", *bad])
    assert exc.value.code == 2


@pytest.mark.parametrize("content", ["", "not json\n"])
def test_a_trace_it_cannot_judge_is_a_usage_error(tmp_path: Path, content: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text(content)
    for path in (trace, tmp_path / "missing.jsonl"):
        with pytest.raises(SystemExit) as exc:
            main(["--trace", str(path), "--jobs", "1", "--speedups", "1"])
        assert exc.value.code == 2
    assert "Traceback" not in capsys.readouterr().err


def test_worker_processes_give_the_figures_one_process_gives(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = _trace(tmp_path / "unseen.jsonl", n=60)
    args = ["--trace", str(trace), "--replicas", "2", "--fractions", "0.5",
            "--policies", "prefix_affinity,oracle"]
    tables = []
    for jobs in ("1", "2"):
        assert main([*args, "--jobs", jobs]) == 0
        out = capsys.readouterr().out
        tables.append([line for line in out.splitlines()
                       if line.startswith("- 2 replicas:") or line.startswith("| 2 |")])
    assert tables[0] and tables[0] == tables[1]
