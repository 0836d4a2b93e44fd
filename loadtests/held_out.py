"""Judge the routing on a trace it was not tuned on: every policy from moderate load to saturation.

For each fleet size, the speedup at which the trace saturates the fleet is found first (even
the better of prefix_affinity and the oracle then waits four times the co-batching bound on
average, or ends the run with its last third's TTFT twice its first third's), then every
policy runs at fractions of it, each cell one `python -m loadtests.simulate --trace FILE
--replicas N --speedup S --policy all` (printed with the tables). prefix_affinity is judged
against the targets: mean TTFT within 10% of the greedy oracle's (1.05 where the oracle is
not near the co-batching bound), prefill imbalance by time at most 1.15.

    python -m loadtests.held_out --trace my_trace.jsonl              # 8 and 32 replicas
    python -m loadtests.held_out --trace my_trace.jsonl --replicas 8 --fractions 0.5,0.9
    python -m loadtests.held_out --trace my_trace.jsonl --speedups 0.5,1,2   # by hand
    python -m loadtests.held_out --trace my_trace.jsonl --max-ratio 1.10     # exit 1 past it
    python -m loadtests.held_out --trace my_trace.jsonl --neighbours  # a miss: trait or draw?

The search starts where the trace's offered load would fill the fleet even with one infinite
prefix cache shared by every replica (every request's uncached prefill and decode tokens at
the profile's costs, over the trace's span): no router sustains more. With caches of finite
size on separate replicas, queues grow well before that.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from multiprocessing import Pool
from typing import Any, NamedTuple

from backends.sim.fleet_spec import FLEET_HELP, SLOW_HELP, ReplicaProfile, describe, fleet_profiles
from backends.sim.profiles import PROFILES, LatencyProfile, fastest
from loadtests.settings import add_routing_settings, settings_text
from loadtests.simulate import (
    ALL_POLICIES,
    DEFAULT_ENGINE_BLOCK_TOKENS,
    DEFAULT_KV_CAPACITY_TOKENS,
    DEFAULT_MAX_OUTPUT,
    DEFAULT_PROFILE,
    Workload,
    load_workload,
    settings_for,
    simulate,
)

POLICIES = ("prefix_affinity", "oracle", "sglang_cache_aware", "least_load", "round_robin")
"""What the targets compare prefix_affinity with, and round_robin as the floor of routing."""

DEFAULT_FRACTIONS = (0.3, 0.5, 0.7, 0.9)  # of the saturation speedup
SEARCH_POLICIES = ("prefix_affinity", "oracle")
BISECTIONS = 3  # halving a factor-2 bracket three times: within 9% of the speedup
TARGET_RATIO = 1.10  # mean TTFT over the oracle's, in every cell short of saturation
TIGHT_RATIO = 1.05  # the same, where the oracle is not near its bound
NEAR_BOUND = 1.5  # the oracle within this of the co-batching bound counts as near it
TIME_IMBALANCE = 1.15  # prefill imbalance by time
GROWTH = 2.0  # last third's mean TTFT over the first third's, past which queues grew
CLIFF = 4.0  # mean TTFT over the co-batching bound past which the queue is the TTFT
NEIGHBOURS = (0.9, 0.95, 1.05, 1.1)  # of a cell's speedup, where --neighbours runs it again


@dataclass(frozen=True)
class Cell:
    """One fleet at one speedup of the trace."""

    replicas: int
    speedup: float
    fraction: float | None = None  # of the saturation speedup, when it was searched for


@dataclass(frozen=True)
class Options:
    """What every cell shares: the trace and the simulated fleet."""

    trace: str
    limit: int | None
    fleet_args: tuple[str | None, str | None, str]  # --fleet, --slow, --profile
    kv_capacity_tokens: int
    settings: tuple[tuple[str, Any], ...]

    def fleet(self, replicas: int) -> list[ReplicaProfile]:
        fleet, slow, profile = self.fleet_args
        return fleet_profiles(None if fleet else replicas, profile, fleet, slow)

    def command(self, cell: Cell, tool: str = "simulate") -> str:
        """The cell as one `simulate` command (every policy), or `replay`'s (over HTTP,
        prefix_affinity on simulated replicas of the same profile)."""
        fleet, slow, profile = self.fleet_args
        parts = [f"python -m loadtests.{tool}", f"--trace {self.trace}"]
        parts += [f"--fleet {fleet}"] if fleet else [f"--replicas {cell.replicas}"]
        parts += [f"--slow {slow}"] if slow else []
        # replay's default profile is the 8B's: named whenever it is not the simulator's.
        parts += [f"--profile {profile}"] if profile != DEFAULT_PROFILE or tool == "replay" else []
        parts += [f"--limit {self.limit}"] if self.limit else []
        parts += [f"--kv-capacity-tokens {self.kv_capacity_tokens}"] if (
            self.kv_capacity_tokens != DEFAULT_KV_CAPACITY_TOKENS) else []
        parts += [f"--speedup {cell.speedup:g}"] + (["--policy all"] if tool == "simulate" else [])
        parts += [f"--set {settings_text([setting])}" for setting in self.settings]
        return " ".join(parts)


def work_seconds(workload: Workload, profile: LatencyProfile,
                 block_tokens: int = DEFAULT_ENGINE_BLOCK_TOKENS,
                 max_output: int = DEFAULT_MAX_OUTPUT) -> float:
    """The engine time the workload needs at the least: every request's prefill of what one
    infinite shared cache would not hold, and one decode share per output token, at
    `profile`'s costs (the fixed cost of a step, shared by its batch, left out)."""
    _, tokens = workload.engine_prompts(block_tokens)
    cached = workload.ideal_cached_tokens(block_tokens)
    total = 0.0
    for req, prompt, hit in zip(workload.requests, tokens, cached, strict=True):
        total += profile.prefill_chunk_s(max(0, prompt - hit), hit)
        total += min(max(1, req.output_tokens), max_output) * profile.decode_per_seq_s
    return total


def offered_load(workload: Workload, fleet: Sequence[ReplicaProfile]) -> float:
    """The workload's offered load on `fleet` as it stands (module docstring): its least
    engine time, over its span, over the fleet's capacity in replicas of the fastest."""
    profiles = [r.build() for r in fleet]
    ref = fastest(profiles)
    capacity = sum(p.prefill_tokens_per_s / ref.prefill_tokens_per_s for p in profiles)
    stamps = [r.timestamp_s for r in workload.requests]
    span = max(stamps) - min(stamps) if stamps else 0.0
    if span <= 0.0:
        raise ValueError("the trace needs requests at two different times to have a load")
    return work_seconds(workload, ref) / span / capacity


def thirds(timeline: Sequence[Sequence[float]]) -> tuple[float, float]:
    """Mean TTFT of the first and of the last third of the requests, in arrival order."""
    n = len(timeline)
    third = max(1, n // 3)
    first = [ttft for _, ttft in timeline[:third]]
    last = [ttft for _, ttft in timeline[n - third:]]
    return sum(first) / len(first), sum(last) / len(last)


_workloads: dict[tuple[str, int | None, float], Workload] = {}


def _workload(trace: str, limit: int | None, speedup: float) -> Workload:
    key = (trace, limit, speedup)
    got = _workloads.get(key)
    if got is None:
        _workloads.clear()  # one at a time per process: they are large
        got = _workloads[key] = load_workload(trace, limit=limit, speedup=speedup)
    return got


def _run(job: tuple[Options, Cell, str]) -> tuple[Cell, str, dict[str, Any], float]:
    opts, cell, policy = job
    workload = _workload(opts.trace, opts.limit, cell.speedup)
    t0 = time.perf_counter()
    report = simulate(workload, policy, settings=settings_for(policy, dict(opts.settings),
                                                               strict=False),
                      fleet=opts.fleet(cell.replicas), kv_capacity_tokens=opts.kv_capacity_tokens,
                      timeline=True)
    timeline = report.pop("timeline")
    report["ttft_first_third_s"], report["ttft_last_third_s"] = (
        thirds(timeline) if timeline else (0.0, 0.0))
    return cell, policy, report, time.perf_counter() - t0


def saturated(reports: Sequence[dict[str, Any]]) -> bool:
    """Whether the load is past saturation for every policy in `reports` (prefix_affinity's
    and the oracle's, `SEARCH_POLICIES`): even the one with the lowest mean TTFT waits
    `CLIFF` times the co-batching bound on average, or ends the run with its last third's
    TTFT `GROWTH` times its first third's (and past `GROWTH` times the bound). A greedy
    oracle saturating alone is not the load's fault, so a prefix_affinity that holds makes
    the cell short of saturation."""
    best = min(reports, key=lambda r: r["ttft_mean_s"])
    bound = best["ttft_bound_mean_s"]
    first, last = best["ttft_first_third_s"], best["ttft_last_third_s"]
    return best["ttft_mean_s"] > CLIFF * bound or (last > GROWTH * first
                                                   and last > GROWTH * bound)


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.3f}" if base > 0 else "-"


def find_saturation(past_at: Callable[[float], bool], start: float,
                    ) -> tuple[float, float | None, list[tuple[float, bool]]]:
    """The highest speedup found steady and the lowest found past saturation (None if none
    was up to eight times `start`), by doubling or halving from `start` and then
    `BISECTIONS` halvings of the bracket in log space; with every probe, in order."""
    probes: list[tuple[float, bool]] = []

    def probe(speedup: float) -> bool:
        past = past_at(speedup)
        probes.append((speedup, past))
        return past

    hi = start
    past = probe(hi)
    for _ in range(3):
        if past:
            break
        hi *= 2
        past = probe(hi)
    if not past:
        return hi, None, probes
    lo = hi / 2
    if len(probes) == 1:  # else hi / 2 was probed, steady, on the way up
        for _ in range(8):
            if not probe(lo):
                break
            hi, lo = lo, lo / 2
        else:
            return 0.0, hi, probes
    for _ in range(BISECTIONS):
        mid = math.sqrt(lo * hi)
        if probe(mid):
            hi = mid
        else:
            lo = mid
    return lo, hi, probes


def saturation_speedup(lo: float, hi: float | None) -> float:
    """The speedup the fractions are of: the bracket's geometric middle (or its steady end)."""
    if hi is None:
        return lo
    return math.sqrt(lo * hi) if lo > 0 else hi


class Verdict(NamedTuple):
    """prefix_affinity judged in one cell."""

    past: bool  # past saturation: no target is judged
    ratio: float  # mean TTFT over the oracle's
    missed: list[str]  # the targets missed, each as the reader is told it


def judge(reps: dict[str, dict[str, Any]]) -> Verdict:
    """The verdict on one cell, from its reports by policy (prefix_affinity and the oracle
    at least)."""
    pa, oracle = reps["prefix_affinity"], reps["oracle"]
    ratio = pa["ttft_mean_s"] / oracle["ttft_mean_s"]
    if saturated([reps[p] for p in SEARCH_POLICIES]):
        return Verdict(True, ratio, [])
    missed = []
    limit = (TARGET_RATIO if oracle["ttft_mean_s"] <= NEAR_BOUND * oracle["ttft_bound_mean_s"]
             else TIGHT_RATIO)
    if ratio > limit:
        missed.append(f"{ratio:.3f}x the oracle (target {limit:.2f})")
    if pa["prefill_time_imbalance"] > TIME_IMBALANCE:
        missed.append(f"prefill imbalance by time {pa['prefill_time_imbalance']:.3f}")
    return Verdict(False, ratio, missed)


def neighbours_of(cell: Cell) -> list[Cell]:
    """The cell's trace at `NEIGHBOURS` times its speedup, on the same fleet."""
    return [Cell(cell.replicas, round(cell.speedup * f, 4)) for f in NEIGHBOURS]


def neighbour_lines(judged: Sequence[Cell], results: dict[tuple[Cell, str], dict[str, Any]]
                    ) -> list[str]:
    """Each cell `judged` at neighbouring speedups: a miss, or a pass, that holds at them is
    the policy's; one that comes and goes with a few percent of load is the draw of a few
    decisions (a rule then moves it from one speedup to another)."""
    lines = ["| replicas | speedup | of the cell's | prefix_affinity TTFT s | / oracle | "
             "prefill time imb | past a target |", "|---:|---:|---:|---:|---:|---:|---|"]
    summary = []
    ratios: list[float] = []  # at the neighbours short of saturation
    past_target = 0  # neighbours past a target, over every cell
    for cell in judged:
        missed_at = 0  # of this cell's neighbours
        for near, factor in zip(neighbours_of(cell), NEIGHBOURS, strict=True):
            pa = results[(near, "prefix_affinity")]
            past, ratio, missed = judge({p: results[(near, p)] for p in SEARCH_POLICIES})
            missed_at += bool(missed)
            if not past:
                ratios.append(ratio)
            told = "past saturation" if past else "; ".join(missed) if missed else "none"
            lines.append(f"| {cell.replicas} | {near.speedup:g} | {factor:g} | "
                         f"{pa['ttft_mean_s']:.3f} | {ratio:.3f} | "
                         f"{pa['prefill_time_imbalance']:.2f} | {told} |")
        summary.append(f"- {cell.replicas} replicas, speedup {cell.speedup:g}: past a target at "
                       f"{missed_at} of its {len(NEIGHBOURS)} neighbours.")
        past_target += missed_at
    if ratios:
        summary.append(f"\nAt the {len(ratios)} neighbours short of saturation: past a target "
                       f"at {past_target}; prefix_affinity at {max(ratios):.3f}x the oracle at "
                       f"worst, {statistics.geometric_mean(ratios):.3f}x in geometric mean.")
    return [*lines, "", *summary]


def report_lines(opts: Options, cells: Sequence[Cell],
                 results: dict[tuple[Cell, str], dict[str, Any]],
                 policies: Sequence[str]) -> tuple[list[str], list[float]]:
    """The markdown tables, and prefix_affinity's ratios to the oracle in the cells short of
    saturation (what `--max-ratio` judges)."""
    others = [p for p in policies if p not in ("prefix_affinity", "oracle")]
    lines = ["| replicas | speedup | share of saturation | prefix_affinity TTFT s | / oracle | "
             + "".join(f"/ {p} | " for p in others)
             + "hit (ideal) | prefill time imb | oracle / co-batching bound | regime |",
             "|---:|---:|---:|---:|---:|" + "---:|" * len(others) + "---:|---:|---:|---|"]
    ratios: list[float] = []
    flags: list[str] = []
    for cell in cells:
        reps = {p: results[(cell, p)] for p in policies}
        pa, oracle = reps["prefix_affinity"], reps["oracle"]
        past, ratio, missed = judge(reps)
        bound = oracle["ttft_bound_mean_s"]
        if not past:
            ratios.append(ratio)
            flags += [f"{cell.replicas} replicas, speedup {cell.speedup:g}: {miss}"
                      for miss in missed]
        lines.append(
            f"| {cell.replicas} | {cell.speedup:g} | "
            f"{'-' if cell.fraction is None else f'{cell.fraction:g}'} | {pa['ttft_mean_s']:.3f} | "
            f"{_ratio(pa['ttft_mean_s'], oracle['ttft_mean_s'])} | "
            + "".join(f"{_ratio(pa['ttft_mean_s'], reps[p]['ttft_mean_s'])} | " for p in others)
            + f"{pa['hit_ratio']:.3f} ({pa['ideal_hit_ratio']:.3f}) | "
            f"{pa['prefill_time_imbalance']:.2f} | {_ratio(oracle['ttft_mean_s'], bound)} | "
            + ("past saturation" if past else "short of saturation") + " |")
    lines.append("")
    steady = len(ratios)
    if ratios:
        geo = statistics.geometric_mean(ratios)
        lines.append(f"Short of saturation ({steady} of {len(cells)} cells): prefix_affinity "
                     f"at {max(ratios):.3f}x the oracle at worst, {geo:.3f}x in geometric "
                     f"mean.")
    else:
        lines.append("Every cell is past saturation.")
    lines += ([f"Past a target: {'; '.join(flags)}."] if flags
              else ["Every target met short of saturation." if ratios else ""])
    return lines, ratios


class Runner:
    """Runs policies on cells (in `jobs` worker processes, or in this one for 1), keeping
    every report by (cell, policy) and telling each on stderr as it ends."""

    def __init__(self, opts: Options, mapper: Callable[..., Any]) -> None:
        self.opts = opts
        self.mapper = mapper
        self.results: dict[tuple[Cell, str], dict[str, Any]] = {}

    def run(self, batch: Sequence[tuple[Cell, str]]) -> None:
        for cell, policy, report, wall in self.mapper(
                _run, [(self.opts, c, p) for c, p in batch]):
            self.results[(cell, policy)] = report
            print(f"# {cell.replicas} replicas, speedup {cell.speedup:g}, {policy}: TTFT mean "
                  f"{report['ttft_mean_s']:.3f} s ({wall:.1f} s)", file=sys.stderr, flush=True)

    def past_at(self, replicas: int, speedup: float) -> bool:
        """Whether `speedup` is past saturation on `replicas` (`saturated`)."""
        probe = Cell(replicas, round(speedup, 4))
        self.run([(probe, p) for p in SEARCH_POLICIES])
        return saturated([self.results[(probe, p)] for p in SEARCH_POLICIES])


def search_line(replicas: int, lo: float, hi: float | None,
                probes: Sequence[tuple[float, bool]]) -> str:
    """What the search for `replicas` found, for the reader."""
    found = ("saturated at every speedup tried" if lo == 0.0 else
             f"not saturated up to {lo:.3g}" if hi is None else
             f"short of it at {lo:.3g}, past it at {hi:.3g}")
    tried = ", ".join(f"{x:.3g} {'past' if past else 'short'}" for x, past in probes)
    return (f"{replicas} replicas: saturation speedup {saturation_speedup(lo, hi):.3g} "
            f"({found}; probes {tried})")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", required=True, help="Mooncake JSONL file or RAGPulse directory")
    ap.add_argument("--replicas", default="8,32",
                    help="fleet sizes, comma-separated (default 8,32; with --fleet, its own)")
    ap.add_argument("--fleet", default=None, help=FLEET_HELP + "; instead of --replicas")
    ap.add_argument("--slow", default=None, help=SLOW_HELP)
    ap.add_argument("--profile", default=DEFAULT_PROFILE, choices=sorted(PROFILES),
                    help="the replicas' latency profile, where --fleet gives none")
    loads = ap.add_mutually_exclusive_group()
    loads.add_argument("--fractions", default=None,
                       help="fractions of the saturation speedup to judge at, comma-separated "
                            "(default " + ",".join(f"{x:g}" for x in DEFAULT_FRACTIONS) + ")")
    loads.add_argument("--speedups", default=None,
                       help="speedups instead, comma-separated (no search for saturation)")
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help="policies to run, comma-separated; prefix_affinity and oracle always")
    ap.add_argument("--limit", type=int, default=None, help="first N requests")
    ap.add_argument("--kv-capacity-tokens", type=int, default=DEFAULT_KV_CAPACITY_TOKENS)
    ap.add_argument("--jobs", type=int, default=2, help="worker processes")
    ap.add_argument("--max-ratio", type=float, default=None,
                    help="exit 1 if prefix_affinity's mean TTFT is past this times the "
                         "oracle's in any cell short of saturation")
    ap.add_argument("--neighbours", action="store_true",
                    help="run each cell short of saturation again (prefix_affinity and the "
                         "oracle) at " + ", ".join(f"{f:g}" for f in NEIGHBOURS) + " times its "
                         "speedup, to tell the policy's misses and passes from the draw of "
                         "one load")
    add_routing_settings(ap, note="; prefix_affinity's and the router's")
    args = ap.parse_args(argv)
    try:
        sizes = [int(x) for x in str(args.replicas).split(",") if x]
        chosen = ([float(x) for x in args.speedups.split(",") if x] if args.speedups else
                  [float(x) for x in args.fractions.split(",") if x] if args.fractions else
                  list(DEFAULT_FRACTIONS))
    except ValueError:
        ap.error("--replicas, --fractions and --speedups take comma-separated numbers")
    if not sizes or min(sizes) < 1 or not chosen or min(chosen) <= 0:
        ap.error("--replicas, --fractions and --speedups take positive numbers")
    policies = ["prefix_affinity", "oracle"] + [
        p for p in args.policies.split(",") if p and p not in ("prefix_affinity", "oracle")]
    unknown = [p for p in policies if p not in ALL_POLICIES]
    if unknown:
        ap.error(f"unknown policies {unknown}; choose from {list(ALL_POLICIES)}")
    try:
        for p in policies:
            settings_for(p, dict(args.settings), strict=p == "prefix_affinity")
    except ValueError as exc:
        ap.error(str(exc))
    opts = Options(args.trace, args.limit, (args.fleet, args.slow, args.profile),
                   args.kv_capacity_tokens, tuple(args.settings))
    try:
        if args.fleet:
            sizes = [len(opts.fleet(0))]
        for n in sizes:
            opts.fleet(n)
    except ValueError as exc:
        ap.error(str(exc))
    try:
        base = load_workload(args.trace, limit=args.limit)
    except (OSError, ValueError) as exc:
        ap.error(f"cannot read the trace: {exc}")
    if not base.requests:
        ap.error("the trace has no requests")
    searches: list[str] = []
    cells: list[Cell] = []
    t0 = time.perf_counter()
    with (Pool(args.jobs) if args.jobs > 1 else nullcontext()) as pool:
        runner = Runner(opts, pool.imap if pool is not None else map)
        for n in sizes:
            if args.speedups:
                cells += [Cell(n, x) for x in chosen]
                continue
            try:
                start = 1.0 / offered_load(base, opts.fleet(n))
            except ValueError as exc:
                ap.error(str(exc))
            lo, hi, probes = find_saturation(partial(runner.past_at, n), start)
            searches.append(search_line(n, lo, hi, probes))
            cells += [Cell(n, round(f * saturation_speedup(lo, hi), 4), f) for f in chosen]
        runner.run([(c, p) for c in cells for p in policies])
        judged = [c for c in cells if args.neighbours
                  and not judge({p: runner.results[(c, p)] for p in SEARCH_POLICIES}).past]
        runner.run([(near, p) for c in judged for near in neighbours_of(c)
                    for p in SEARCH_POLICIES])
    results = runner.results
    first = results[(cells[0], "prefix_affinity")]
    print(f"# {base.name}: {len(base.requests)} requests, fleet {describe(opts.fleet(sizes[0]))}"
          f"{' (per size)' if len(sizes) > 1 else ''}, KV {args.kv_capacity_tokens:,} tokens "
          f"per replica, ideal hit ratio {first['ideal_hit_ratio']:.3f}; "
          f"`python -m loadtests.held_out {' '.join(argv if argv is not None else sys.argv[1:])}`"
          f" ({time.perf_counter() - t0:.0f} s)\n")
    if searches:
        print(f"Saturation: the better of prefix_affinity and the oracle waits {CLIFF:g} times "
              f"the co-batching bound on average, or ends the run with its last third's TTFT "
              f"{GROWTH:g} times its first third's:\n")
        print("\n".join(f"- {line}" for line in searches) + "\n")
    lines, ratios = report_lines(opts, cells, results, policies)
    print("\n".join(lines))
    if judged:
        print("\nThe cells short of saturation, again at neighbouring speedups (the exit "
              "status judges the cells above only):\n")
        print("\n".join(neighbour_lines(judged, results)))
    print("\nCell commands (and the same cell over HTTP, prefix_affinity alone):\n")
    for cell in cells:
        print(f"- {cell.replicas} replicas, speedup {cell.speedup:g}: `{opts.command(cell)}`; "
              f"`{opts.command(cell, 'replay')}`")
    if args.max_ratio is not None and any(r > args.max_ratio for r in ratios):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
