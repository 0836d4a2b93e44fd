"""The oracle held to a prefill imbalance by time: what balance costs in TTFT on a scenario.

The greedy oracle sends each request where its own TTFT is lowest. On a fleet of mixed speeds
at light load that keeps the fast replicas busy and the slow ones almost idle: its prefill
imbalance by time (max over mean, per replica, of its prefill tokens over its prefill rate)
reaches 2 and more. The scoreboard asks both for a mean TTFT within 10% of the oracle's and
for an imbalance by time of at most 1.15. This runs the oracle again with a cap on that
imbalance (a replica whose prefill seconds would pass `cap` times the fleet's mean is left
out, unless every replica would), so that the price of the cap is measured, not guessed:

    python -m loadtests.experiments.balanced_oracle --scenario mixed:multi_turn/8/light \\
        --caps 1.15,1.3,1.6

A trace file that is no scoreboard scenario (a held-out cell) runs the same way, with the
simulator's fleet options:

    python -m loadtests.experiments.balanced_oracle --trace docs8.jsonl --replicas 8 \\
        --speedup 0.5 --slow 1:3 --caps 1.15,1.3
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from backends.sim.engine import EngineModel
from backends.sim.fleet_spec import ReplicaProfile
from loadtests.reference_policies import Oracle
from loadtests.scoreboard import REPO, SCENARIOS, Scenario
from loadtests.simulate import (
    Workload,
    add_fleet_options,
    fleet_from_options,
    load_workload,
    make_policy,
    simulate,
)
from routing.policies.base import Policy, PrefixLookup
from routing.types import Decision, ReplicaView, RoutingRequest


class BalancedOracle(Oracle):
    """The oracle, choosing only among replicas whose prefill seconds so far, with this
    request's own, stay within `cap` times the fleet's mean (the least loaded if none does)."""

    def __init__(self, engines: Mapping[str, EngineModel], cap: float) -> None:
        super().__init__(engines)
        self.cap = cap
        self.seconds = dict.fromkeys(engines, 0.0)
        """Prefill seconds sent to each replica: its uncached tokens over its prefill rate."""

    def _own_seconds(self, name: str) -> float:
        uncached = self._prompt_tokens - self.cached_tokens(name)
        return uncached / self.engines[name].profile.prefill_tokens_per_s

    def choose(self, request: RoutingRequest, replicas: Sequence[ReplicaView],
               lookup: PrefixLookup) -> Decision:
        own = {r.name: self._own_seconds(r.name) for r in replicas}
        total = sum(self.seconds.values())
        n = len(self.seconds)
        allowed = [r for r in replicas
                   if self.seconds[r.name] + own[r.name]
                   <= self.cap * (total + own[r.name]) / n]
        if not allowed:
            allowed = [min(replicas, key=lambda r: self.seconds[r.name] + own[r.name])]
        decision = super().choose(request, allowed, lookup)
        self.seconds[decision.replica] += own[decision.replica]
        return decision


def compare(workload: Workload, fleet: Sequence[ReplicaProfile],
            caps: Sequence[float]) -> list[dict[str, Any]]:
    """prefix_affinity at the gateway's defaults, the oracle, and the oracle under each cap,
    on `workload` over `fleet`: each run's report with its "router"."""
    rows = []
    runs = [("prefix_affinity", "prefix_affinity", None), ("oracle", "oracle", None)]
    runs += [(f"oracle, cap {c:g}", "oracle", c) for c in caps]
    for label, policy, cap in runs:

        def factory(name: str, settings: Any, engines: dict[str, EngineModel],
                    overrides: dict[str, Any] | None, cap: float | None = cap) -> Policy:
            if cap is None:
                return make_policy(name, settings, engines, overrides)
            return BalancedOracle(engines, cap)

        report = simulate(workload, policy, replicas=len(fleet), fleet=fleet,
                          policy_factory=factory)
        rows.append({"router": label, **report})
    return rows


def run(sc: Scenario, caps: Sequence[float]) -> list[dict[str, Any]]:
    trace = str(REPO / sc.trace) if sc.trace else None
    workload = load_workload(trace, sc.workload, speedup=sc.speedup, params=dict(sc.params))
    return compare(workload, sc.profiles(), caps)


def print_rows(title: str, rows: Sequence[dict[str, Any]]) -> None:
    """The runs of one cell as a markdown table, each against the plain oracle."""
    oracle = rows[1]["ttft_mean_s"]
    print(f"\n{title}\n")
    print("| router | TTFT mean s | / oracle | p50 s | prefill time imb |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['router']} | {r['ttft_mean_s']:.3f} | {r['ttft_mean_s'] / oracle:.3f} "
              f"| {r['ttft_p50_s']:.3f} | {r['prefill_time_imbalance']:.2f} |")
    sys.stdout.flush()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    keys = [f"{s.key}/{s.replicas}/{s.load}" for s in SCENARIOS]
    cell = ap.add_mutually_exclusive_group(required=True)
    cell.add_argument("--scenario", action="append", choices=keys, metavar="KEY",
                      help="a scoreboard scenario, e.g. mixed:multi_turn/8/light")
    cell.add_argument("--trace", help="a Mooncake JSONL file, run over the fleet below")
    add_fleet_options(ap, note="with --trace: ")
    ap.add_argument("--speedup", type=float, default=1.0, help="with --trace: divide arrival "
                    "times by this")
    ap.add_argument("--caps", default="1.15", help="comma-separated imbalance caps")
    ap.add_argument("--seed", type=int, default=None,
                    help="the synthetic workload's seed instead of the scenario's")
    args = ap.parse_args(argv)
    caps = [float(c) for c in args.caps.split(",")]
    if args.trace:
        if args.seed is not None:
            ap.error("--seed: a trace has no seed")
        fleet = fleet_from_options(ap, args)
        workload = load_workload(args.trace, None, speedup=args.speedup)
        print_rows(f"{args.trace}, {len(fleet)} replicas, speedup {args.speedup:g}",
                   compare(workload, fleet, caps))
        return 0
    by_key = dict(zip(keys, SCENARIOS, strict=True))
    if args.seed is not None and any(by_key[k].trace for k in args.scenario):
        ap.error("--seed: a trace scenario has no seed")
    for key in args.scenario:
        sc = by_key[key]
        if args.seed is not None:
            sc = replace(sc, params=(*[p for p in sc.params if p[0] != "seed"],
                                     ("seed", args.seed)))
        print_rows(f"{sc.title}, {sc.replicas} replicas, {sc.load} load: `{sc.command()}`",
                   run(sc, caps))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
