"""The swing plot: a PNG drawn from the simulator's per-request output."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtests.plot_swing import binned, main


def test_binned_means_per_arrival_bin() -> None:
    xs, ys = binned([[1.0, 0.2], [4.0, 0.4], [25.0, 3.0]], bin_s=10.0)
    assert xs == [5.0, 25.0]
    assert ys == pytest.approx([0.3, 3.0])


def test_plot_script_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "swing.png"
    assert main(["--output", str(out), "--replicas", "2", "--jobs", "1", "--bin-s", "2",
                 "--policies", "least_load", "prefix_affinity",
                 "--workload-param", "duration_s=8", "--workload-param", "period_s=4",
                 "--workload-param", "n_tenants=4", "--workload-param", "system_blocks=2"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "| least_load |" in printed and "| prefix_affinity |" in printed
