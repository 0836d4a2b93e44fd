"""Where prefix_affinity and the oracle disagree: both decide every request on the same state.

The simulator routes with a policy (prefix_affinity by default) while the oracle, reading the
same engines at the same instant, says where it would have sent the request. Each request is
one row: both choices, the true cached tokens on each (what the engine holds), the tokens the
router's index believed cached on each, and the oracle's TTFT estimate for each. Disagreements
are classed by what the routed choice gave up against the oracle's:

- `hit lost`: the oracle's replica truly held more of the prompt;
- `phantom hit`: the router's index believed more cached on its choice than the engine held
  (evicted there, or never there);
- `queue`: the oracle's replica held no more of the prompt, but its queue was shorter.

    python -m loadtests.experiments.shadow_oracle --workload stress \
        --workload-param rate_per_s=3.34 --replicas 8 --csv /tmp/decisions.csv

`--fleet` and `--slow` give replicas of mixed speeds, as in `loadtests.simulate`; the oracle
reads each engine's own profile.
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from backends.sim.engine import EngineModel
from backends.sim.fleet_spec import (
    ReplicaProfile,
    describe,
)
from gateway.config import RoutingSettings
from loadtests import simulate as sim
from loadtests.reference_policies import Oracle
from loadtests.settings import add_routing_settings, add_workload_param
from loadtests.traces import SYNTHETIC
from routing.policies import Policy
from routing.policies.base import PrefixLookup
from routing.types import Decision, ReplicaView, RoutingRequest

FIELDS = ("t", "prompt", "routed", "oracle", "routed_cached", "oracle_cached",
          "routed_believed", "oracle_believed", "routed_est_s", "oracle_est_s", "kind",
          "busy", "routed_pending", "oracle_pending", "routed_inflight", "oracle_inflight",
          "routed_true_queue", "oracle_true_queue")


class Shadow(Oracle):
    """Routes with `policy`; asks the oracle (same engines, same instant) on every request."""

    def __init__(self, engines: Mapping[str, EngineModel], policy: Policy,
                 true_queue: str = "") -> None:
        super().__init__(engines)
        self.policy = policy
        self.give_true_queue = true_queue
        self.rows: list[dict[str, Any]] = []

    def choose(self, request: RoutingRequest, replicas: Sequence[ReplicaView],
               lookup: PrefixLookup) -> Decision:
        if self.give_true_queue:
            # What if the router knew the engines' true queues: which error is it that costs?
            replicas = [replace(r, pending_prefill_tokens=self.true_queue(
                r.name, self.give_true_queue, r.pending_prefill_tokens)) for r in replicas]
        ours = self.policy.choose(request, replicas, lookup)
        est = {r.name: self.estimate(r.name) for r in replicas}
        best = min(est, key=lambda n: est[n][0])
        bt = request.block_tokens
        routed, oracle = ours.replica, best
        believed = {n: min(request.prompt_tokens, lookup.matched_blocks(n, request.hashes) * bt)
                    for n in (routed, oracle)}
        kind = "agree"
        if routed != oracle and est[routed][0] > est[oracle][0]:
            if est[oracle][1] > est[routed][1]:
                kind = "hit lost"
            elif believed[routed] > est[routed][1] + bt:
                kind = "phantom hit"
            else:
                kind = "queue"
        elif routed != oracle:
            kind = "equal"
        self.rows.append({
            "t": round(self._now, 3), "prompt": self._prompt_tokens, "routed": routed,
            "oracle": oracle, "routed_cached": est[routed][1], "oracle_cached": est[oracle][1],
            "routed_believed": round(believed[routed]), "oracle_believed": round(believed[oracle]),
            "routed_est_s": round(est[routed][0], 4), "oracle_est_s": round(est[oracle][0], 4),
            "kind": kind,
            "busy": round(sum(1 for r in replicas if r.pending_prefill_tokens > 0)
                          / len(replicas), 3),
        })
        views = {r.name: r for r in replicas}
        for side, name in (("routed", routed), ("oracle", oracle)):
            self.rows[-1][f"{side}_pending"] = round(views[name].pending_prefill_tokens)
            self.rows[-1][f"{side}_inflight"] = views[name].inflight
            self.rows[-1][f"{side}_true_queue"] = self.true_queue(name)
        return ours

    def true_queue(self, name: str, part: str = "all", believed: float = 0.0) -> float:
        """Uncached prompt tokens the engine must still prefill before a new request
        (`part` "progress": the router's belief less the prefill done so far)."""
        eng = self.engines[name]
        if part == "progress":
            done = sum(r.computed - r.cached_tokens for r in eng._prefilling)
            return max(0.0, believed - done)
        left = sum(r.prompt_tokens - r.computed for r in eng._prefilling)
        return left + sum(r.prompt_tokens - self._queued_hit.get((name, r.req_id), 0)
                          for r in eng._waiting)

    def on_routed(self, request: RoutingRequest, decision: Decision) -> None:
        self.policy.on_routed(request, decision)


def run(workload: sim.Workload, policy: str, replicas: int, settings: RoutingSettings,
        true_queue: str = "", fleet: Sequence[ReplicaProfile] | None = None
        ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Simulate `policy` with the oracle shadowing it; (report, one row per request)."""
    made: list[Shadow] = []

    def shadowed(name: str, s: RoutingSettings, engines: dict[str, EngineModel],
                 overrides: dict[str, Any] | None = None) -> Policy:
        shadow = Shadow(engines, sim.make_policy(name, s, engines, overrides), true_queue)
        made.append(shadow)
        return shadow

    report = sim.simulate(workload, policy, replicas=replicas, settings=settings,
                          policy_factory=shadowed, fleet=fleet)
    return report, made[0].rows


def summary(rows: Sequence[dict[str, Any]]) -> str:
    """Per kind of disagreement: requests, and the oracle-estimated seconds it cost."""
    count: Counter[str] = Counter()
    cost: Counter[str] = Counter()
    for r in rows:
        count[r["kind"]] += 1
        cost[r["kind"]] += r["routed_est_s"] - r["oracle_est_s"]
    n = len(rows) or 1
    lines = ["kind          requests  share  est. TTFT given up (s, per request of all)"]
    for kind in ("agree", "equal", "hit lost", "phantom hit", "queue"):
        lines.append(f"{kind:<13} {count[kind]:>8}  {count[kind] / n:5.3f}  {cost[kind] / n:.4f}")
    # The queue kind's part between equal holders with nothing queued on either side: there
    # only the requests in flight and the step in flight tell the replicas apart.
    even = [r for r in rows if r["kind"] == "queue" and r["routed_cached"] == r["oracle_cached"]
            and r["routed_pending"] == 0 and r["oracle_pending"] == 0]
    fewer = [r for r in even if r["routed_inflight"] < r["oracle_inflight"]]
    lines.append(f"  of queue, as much held and nothing pending on either: {len(even)}, "
                 f"{sum(r['routed_est_s'] - r['oracle_est_s'] for r in even) / n:.4f} s; "
                 f"to fewer in flight than the oracle's: {len(fewer)}, "
                 f"{sum(r['routed_est_s'] - r['oracle_est_s'] for r in fewer) / n:.4f} s")
    phantom = sum(max(0.0, r["routed_believed"] - r["routed_cached"]) for r in rows)
    cached = sum(r["routed_cached"] for r in rows)
    lines.append(f"index believed {phantom / n:.0f} tokens per request more than the engine "
                 f"held on the routed replica (true cached: {cached / n:.0f})")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace")
    src.add_argument("--workload", choices=sorted(SYNTHETIC))
    ap.add_argument("--policy", default="prefix_affinity")
    sim.add_fleet_options(ap)
    ap.add_argument("--speedup", type=float, default=1.0)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--csv", help="write one row per request here")
    ap.add_argument("--true-queue", choices=("all", "progress"), default="",
                    help="route on the engines' true queues instead of the router's estimate")
    add_workload_param(ap)
    add_routing_settings(ap)
    args = ap.parse_args(argv)
    fleet = sim.fleet_from_options(ap, args)
    workload = sim.load_workload(args.trace, args.workload, limit=args.limit,
                                 speedup=args.speedup, params=dict(args.workload_param))
    settings = sim.settings_for(args.policy, dict(args.settings))
    report, rows = run(workload, args.policy, len(fleet), settings, args.true_queue, fleet)
    print(f"# {workload.name}, {describe(fleet)}: {args.policy} TTFT mean "
          f"{report['ttft_mean_s']:.3f} s, hit {report['hit_ratio']:.3f}")
    print(summary(rows))
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, FIELDS)
            w.writeheader()
            w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
