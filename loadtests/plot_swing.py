"""Each policy's TTFT over time on the swinging load, as a PNG drawn from the simulator's output.

The `swing` workload's arrival rate switches between light and near saturation every half
period (loadtests/traces.py `swing_rate`); the plot shows, per policy, the mean TTFT of the
requests arriving in each time bin, with the heavy halves shaded, and prints each policy's
overall mean:

    python -m loadtests.plot_swing --output docs/swing.png
    python -m loadtests.plot_swing --workload-param duration_s=120 --output /tmp/small.png
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from multiprocessing import Pool
from typing import Any

from loadtests.settings import add_workload_param
from loadtests.simulate import ALL_POLICIES, load_workload, simulate
from loadtests.traces import swing_workload

PLOTTED = ("round_robin", "least_load", "prefix_affinity", "sglang_cache_aware", "oracle")


def binned(timeline: Sequence[Sequence[float]], bin_s: float) -> tuple[list[float], list[float]]:
    """(bin midpoints, mean TTFT of the requests arriving in each bin), empty bins left out."""
    sums: dict[int, list[float]] = {}
    for t, ttft in timeline:
        acc = sums.setdefault(int(t // bin_s), [0.0, 0.0])
        acc[0] += ttft
        acc[1] += 1
    keys = sorted(sums)
    return [(k + 0.5) * bin_s for k in keys], [sums[k][0] / sums[k][1] for k in keys]


def _run(job: tuple[str, int, dict[str, Any]]) -> dict[str, Any]:
    policy, replicas, params = job
    return simulate(load_workload(None, "swing", params=params), policy, replicas=replicas,
                    timeline=True)


def plot(reports: Sequence[dict[str, Any]], params: dict[str, Any], bin_s: float,
         output: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display
    import matplotlib.pyplot as plt

    defaults = swing_workload.__defaults__ or ()
    names = swing_workload.__code__.co_varnames[: len(defaults)]
    p = {**dict(zip(names, defaults, strict=True)), **params}
    fig, ax = plt.subplots(figsize=(10, 4.5), dpi=100)
    half = p["period_s"] / 2
    start = half
    while start < p["duration_s"]:
        ax.axvspan(start, min(start + half, p["duration_s"]), color="0.92", lw=0)
        start += p["period_s"]
    for r in reports:
        xs, ys = binned(r["timeline"], bin_s)
        ax.plot(xs, ys, label=f"{r['policy']} (mean {r['ttft_mean_s']:.2f} s)", lw=1.4)
    ax.set_yscale("log")
    ax.set_xlabel("arrival time, simulated s (shaded: heavy half)")
    ax.set_ylabel(f"mean TTFT per {bin_s:g} s, s")
    ax.set_title(f"swing: {p['low_rate_per_s']:g} <-> {p['high_rate_per_s']:g} req/s every "
                 f"{half:g} s, {reports[0]['replicas']} replicas, qwen-32b-h200")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(output)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output", required=True, help="PNG file to write")
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--policies", nargs="+", default=list(PLOTTED), choices=ALL_POLICIES)
    ap.add_argument("--bin-s", type=float, default=20.0, help="seconds per plotted point")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes")
    add_workload_param(ap)
    args = ap.parse_args(argv)
    params = dict(args.workload_param)
    jobs = [(p, args.replicas, params) for p in args.policies]
    if args.jobs > 1:
        with Pool(args.jobs) as pool:
            reports = pool.map(_run, jobs)
    else:
        reports = [_run(j) for j in jobs]
    plot(reports, params, args.bin_s, args.output)
    print("| policy | TTFT mean s | p50 s | p99 s | hit |")
    print("|---|---:|---:|---:|---:|")
    for r in reports:
        print(f"| {r['policy']} | {r['ttft_mean_s']:.3f} | {r['ttft_p50_s']:.3f} | "
              f"{r['ttft_p99_s']:.3f} | {r['hit_ratio']:.3f} |")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
