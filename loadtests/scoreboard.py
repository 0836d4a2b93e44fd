"""The simulated routing scoreboard: every workload x fleet size x load x policy, as markdown.

Each table is one `python -m loadtests.simulate` command (printed above it), so every figure
in docs/routing.md comes from a committed command:

    python -m loadtests.scoreboard                 # everything (the 32 scenarios of equal
                                                   # replicas: about 5 min with 2 jobs)
    python -m loadtests.scoreboard --only tenants  # scenarios whose name contains "tenants"
    python -m loadtests.scoreboard --only mixed    # the heterogeneous fleets' scenarios
    python -m loadtests.scoreboard --sweep --set tuning --variant defaults \
        --variant balance_weight=1                 # settings side by side, against targets
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing import Pool
from typing import Any

from backends.sim.fleet_spec import ReplicaProfile, describe, fleet_profiles
from gateway.config import RoutingSettings
from loadtests import traces
from loadtests.fleet import REPO
from loadtests.settings import key_value, settings_text
from loadtests.simulate import (
    ALL_POLICIES,
    DEFAULT_KV_CAPACITY_TOKENS,
    DEFAULT_PROFILE,
    Workload,
    load_workload,
    simulate,
)

# Relative to the repository root, as in the printed commands.
MOONCAKE, RAGPULSE, AZURE_CODE, AZURE_CONV = (
    str(p.relative_to(REPO))
    for p in (traces.MOONCAKE, traces.RAGPULSE, traces.AZURE_CODE, traces.AZURE_CONV))


@dataclass(frozen=True)
class Scenario:
    """One `python -m loadtests.simulate` invocation (without --policy)."""

    name: str
    replicas: int
    load: str  # "light" or "heavy": the two load levels of each workload and fleet size
    pressure: bool  # caches or prefill capacity under pressure (the target split)
    trace: str | None = None
    workload: str | None = None
    speedup: float = 1.0
    params: tuple[tuple[str, Any], ...] = ()
    held_out: bool = False  # never used to choose a setting (docs/routing.md, "Held out")
    fleet: str | None = None  # replicas of mixed speeds (simulate --fleet), or
    slow: str | None = None  # some replicas slower (simulate --slow N:F)
    tag: str = ""  # names the mixed fleet in --only and in the tables ("mixed", "slow")

    @property
    def key(self) -> str:
        return f"{self.tag}:{self.name}" if self.tag else self.name

    @property
    def title(self) -> str:
        return f"{self.name} on the {self.tag} fleet" if self.tag else self.name

    def profiles(self) -> list[ReplicaProfile]:
        return fleet_profiles(self.replicas, DEFAULT_PROFILE, self.fleet, self.slow)

    def command(self) -> str:
        src = f"--trace {self.trace}" if self.trace else f"--workload {self.workload}"
        extra = "".join(f" --workload-param {k}={v}" for k, v in self.params)
        speed = f" --speedup {self.speedup:g}" if self.speedup != 1.0 else ""
        mixed = (f" --fleet {self.fleet}" if self.fleet else "") + (
            f" --slow {self.slow}" if self.slow else "")
        return (f"python -m loadtests.simulate {src}{extra}{speed} --replicas {self.replicas}"
                f"{mixed} --policy all")


def _p(**kw: Any) -> tuple[tuple[str, Any], ...]:
    return tuple(kw.items())


def _scenarios() -> list[Scenario]:
    out: list[Scenario] = []
    for n, k in ((8, 1), (32, 4)):
        # Mooncake's synthetic trace: long prompts (mean 15k tokens), reuse in follow-up turns.
        out += [Scenario("mooncake", n, "light", True, trace=MOONCAKE, speedup=0.5 * k),
                Scenario("mooncake", n, "heavy", True, trace=MOONCAKE, speedup=0.75 * k)]
        # RAGPulse: one week compressed; a shared system prompt and little else to reuse.
        out += [Scenario("ragpulse", n, "light", False, trace=RAGPULSE, speedup=300 * k),
                Scenario("ragpulse", n, "heavy", False, trace=RAGPULSE, speedup=700 * k)]
        # Azure's 2023 production traces (Splitwise): real arrivals and lengths, no prefixes
        # to reuse, so they test balancing alone. code: bursty, 2k-token prompts, short
        # outputs; conv: 1.2k-token prompts, 211-token outputs (x3 is past saturation).
        out += [Scenario("azure_code", n, "light", False, trace=AZURE_CODE, speedup=1 * k),
                Scenario("azure_code", n, "heavy", False, trace=AZURE_CODE, speedup=2 * k),
                Scenario("azure_conv", n, "light", False, trace=AZURE_CONV, speedup=1 * k),
                Scenario("azure_conv", n, "heavy", False, trace=AZURE_CONV, speedup=2 * k)]
        # llm-d's B2B shape: 6k-token tenant contexts; KV demand 300 x 6,144 tokens per 8
        # replicas = 3.6 replica caches, 45% of the fleet's.
        ten = {"n_tenants": 300 * k, "n_requests": 4000 * k}
        out += [Scenario("tenants", n, "light", True, workload="tenants",
                         params=_p(**ten, rate_per_s=10 * k)),
                Scenario("tenants", n, "heavy", True, workload="tenants",
                         params=_p(**ten, rate_per_s=18 * k))]
        hot = {"n_requests": 2000 * k}
        out += [Scenario("hot_prompt", n, "light", False, workload="hot_prompt",
                         params=_p(**hot, rate_per_s=20 * k)),
                Scenario("hot_prompt", n, "heavy", False, workload="hot_prompt",
                         params=_p(**hot, rate_per_s=60 * k))]
        out += [Scenario("multi_turn", n, "light", True, workload="multi_turn",
                         params=_p(n_sessions=200 * k, rate_per_s=8 * k)),
                Scenario("multi_turn", n, "heavy", True, workload="multi_turn",
                         params=_p(n_sessions=400 * k, rate_per_s=20 * k))]
        # Control: 4 tenants x 2k-token prompts fit every replica's cache; nothing to win.
        ctl = {"n_tenants": 4, "system_blocks": 4, "query_blocks": 1, "n_requests": 3000 * k}
        out += [Scenario("control", n, "light", False, workload="tenants",
                         params=_p(**ctl, rate_per_s=25 * k)),
                Scenario("control", n, "heavy", False, workload="tenants",
                         params=_p(**ctl, rate_per_s=50 * k))]
    return out + _long_conversations()


def _long_conversations() -> list[Scenario]:
    """Long multi-turn conversations near saturation, and load that swings.

    Tuning set: `conversation` with seed 5 at 8 replicas (where drain_pending was found and
    checked). Held out, never used to choose a setting: `conversation` with seed 11, the
    `stress` shape (Mooncake's conversation trace's published rate and lengths) with seed 7,
    and `swing`, at 8 and 32 replicas."""
    conv = {"think_time_s": 240, "turns_mean": 3, "first_tokens_mean": 12000}
    out = [Scenario("conversation", 8, load, True, workload="conversation",
                    params=_p(n_sessions=1000, rate_per_s=rate, **conv, seed=5))
           for load, rate in (("moderate", 5.5), ("near saturation", 6.5))]
    for n, k in ((8, 1), (32, 4)):
        out += [Scenario("conversation", n, load, True, workload="conversation",
                         params=_p(n_sessions=750 * k, rate_per_s=rate * k, **conv, seed=11),
                         held_out=True)
                for load, rate in (("moderate", 5.5), ("near saturation", 6.5))]
        out += [Scenario("stress", n, load, True, workload="stress",
                         params=_p(n_requests=1500 * k, rate_per_s=rate * k, seed=7),
                         held_out=True)
                for load, rate in (("moderate", 2.5), ("near saturation", 3.2))]
        out += [Scenario("swing", n, "light <-> moderate", True, workload="swing",
                         params=_p(low_rate_per_s=4 * k, high_rate_per_s=16 * k,
                                   n_tenants=200 * k, duration_s=960 // (k // 2 or 1)),
                         held_out=True)]
    # The heavy half at 24 requests/s is near saturation for cache-aware routing (at 16 it is
    # not); docs/swing.png plots this cell.
    out += [Scenario("swing", 8, "light <-> near saturation", True, workload="swing",
                     params=_p(low_rate_per_s=6, high_rate_per_s=24), held_out=True)]
    return out


MIXED_FLEET = "llama-8b-h200:4,qwen-32b-h200:4"


def _hetero_scenarios() -> list[Scenario]:
    """8 replicas of two speeds: half at the 8B model's speed and half at the 32B's (two GPU
    generations in one pool), and seven at the 32B's with one 3x slower (a throttled or shared
    GPU); the 8-replica loads of the workloads above."""
    out: list[Scenario] = []
    for tag, fleet, slow in (("mixed", MIXED_FLEET, None), ("slow", None, "1:3")):
        kw: dict[str, Any] = {"fleet": fleet, "slow": slow, "tag": tag}
        ten = {"n_tenants": 300, "n_requests": 4000}
        out += [Scenario("tenants", 8, "light", True, workload="tenants",
                         params=_p(**ten, rate_per_s=10), **kw),
                Scenario("tenants", 8, "heavy", True, workload="tenants",
                         params=_p(**ten, rate_per_s=18), **kw),
                Scenario("multi_turn", 8, "light", True, workload="multi_turn",
                         params=_p(n_sessions=200, rate_per_s=8), **kw),
                Scenario("mooncake", 8, "light", True, trace=MOONCAKE, speedup=0.5, **kw),
                Scenario("hot_prompt", 8, "light", False, workload="hot_prompt",
                         params=_p(n_requests=2000, rate_per_s=20), **kw),
                Scenario("control", 8, "light", False, workload="tenants",
                         params=_p(n_tenants=4, system_blocks=4, query_blocks=1,
                                   n_requests=3000, rate_per_s=25), **kw)]
    return out


SCENARIOS = _scenarios() + _hetero_scenarios()
_workloads: dict[Scenario, Workload] = {}
_engine: dict[str, bool] = {}
"""How the simulated engines allocate KV and keep outputs (`--vllm-engines`), set in the
parent before the workers fork."""

# The ablation: prefix_affinity at the gateway's defaults, then with one choice undone at a
# time, on the scenarios where each choice mattered (docs/routing.md, "Defaults and why").
ABLATION_SCENARIOS = ("mooncake/32/light", "mooncake/8/heavy", "tenants/8/heavy",
                      "hot_prompt/8/light", "hot_prompt/8/heavy", "multi_turn/8/light",
                      "control/8/light")
ABLATION: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = (
    ("defaults", ()),
    ("before tuning (c=1.25, w=1, no in-flight term, rendezvous ties)",
     _p(load_weight=1, idle_load_weight=1, inflight_tokens=0, load_allowance=0, tie_tokens=1e9,
        balance_horizon=0)),
    ("load_weight=1, idle_load_weight=1 (constant 1)", _p(load_weight=1, idle_load_weight=1)),
    ("idle_load_weight=0.5 (constant 0.5)", _p(idle_load_weight=0.5)),
    ("inflight_tokens=0", _p(inflight_tokens=0)),
    ("prefill_tokens_per_s=0 (no step wait)", _p(prefill_tokens_per_s=0)),
    ("prefill_tokens_per_s=9000 (fixed: the profile's rate)", _p(prefill_tokens_per_s=9000)),
    ("prefill_tokens_per_s=20000 (fixed: 2.2x too high)", _p(prefill_tokens_per_s=20000)),
    ("load_allowance=0", _p(load_allowance=0)),
    ("load_allowance=1000 (no bound)", _p(load_allowance=1000)),
    ("balance_horizon=0 (rendezvous ties)", _p(balance_horizon=0)),
    ("tie_tokens=0", _p(tie_tokens=0)),
    ("slack_fraction=0.1", _p(slack_fraction=0.1)),
    ("slack_fraction=0.5", _p(slack_fraction=0.5)),
    ("block_chars=128", _p(block_chars=128)),
    ("block_chars=1024", _p(block_chars=1024)),
)


def _pool(jobs: int) -> Any:
    """Worker processes for `_run`, each with this process's `_engine` (forked or not)."""
    return Pool(max(1, jobs), initializer=_engine.update, initargs=(dict(_engine),))


def _run(job: tuple[Scenario, str] | tuple[Scenario, str, tuple[tuple[str, Any], ...]]
         ) -> tuple[Scenario, str, dict[str, Any], float]:
    sc, policy = job[0], job[1]
    settings = RoutingSettings(policy=policy, **dict(job[2])) if len(job) > 2 else None
    w = _workloads.get(sc)
    if w is None:
        _workloads.clear()  # one workload per process at a time: they are large
        # Trace paths are relative to the repository root, as in the printed commands.
        trace = str(REPO / sc.trace) if sc.trace else None
        w = _workloads[sc] = load_workload(trace, sc.workload, speedup=sc.speedup,
                                           params=dict(sc.params))
    t0 = time.perf_counter()
    report = simulate(w, policy, replicas=sc.replicas, settings=settings,
                      fleet=sc.profiles(), **_engine)
    return sc, policy, report, time.perf_counter() - t0


def _table(sc: Scenario, reports: dict[str, dict[str, Any]]) -> list[str]:
    oracle_hit = reports["oracle"]["hit_ratio"]
    ideal = reports["oracle"]["ideal_hit_ratio"]
    lines = [
        f"#### {sc.title}, {sc.replicas} replicas, {sc.load} load",
        "",
        f"`{sc.command()}`",
        *(["", f"Fleet: {describe(sc.profiles())}."] if sc.tag else []),
        "",
        f"Ideal hit ratio (one infinite cache): {ideal:.3f}. TTFT floor (every request alone "
        f"on an idle engine with the ideal hit): {reports['oracle']['ttft_floor_mean_s']:.3f} s. "
        f"Co-batching bound (the floor plus the decode steps no router avoids): "
        f"{reports['oracle']['ttft_bound_mean_s']:.3f} s.",
        "",
        "| policy | TTFT mean s | p50 s | p99 s | hit | hit / ideal | hit / oracle's | "
        "req imb | prefill imb | prefill time imb | peak in-flight imb |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for policy in ALL_POLICIES:
        r = reports[policy]
        lines.append(
            f"| {r['policy']} | {r['ttft_mean_s']:.3f} | {r['ttft_p50_s']:.3f} | "
            f"{r['ttft_p99_s']:.3f} | {r['hit_ratio']:.3f} | "
            f"{r['hit_ratio'] / ideal if ideal else 0:.2f} | "
            f"{r['hit_ratio'] / oracle_hit if oracle_hit else 0:.2f} | {r['imbalance']:.2f} | "
            f"{r['prefill_imbalance']:.2f} | {r['prefill_time_imbalance']:.2f} | "
            f"{r['peak_inflight_imbalance']:.2f} |")
    return [*lines, ""]


def _ratio(a: float, b: float) -> str:
    # Three places: a target such as "within 10%" must not be met or missed by rounding.
    return f"{a / b:.3f}" if b else "n/a"


def _summary(results: dict[Scenario, dict[str, dict[str, Any]]]) -> list[str]:
    lines = [
        "| workload | replicas | load | pressure | prefix_affinity TTFT mean s | / oracle | "
        "/ round_robin | / sglang (emulated) | / least_load | prefill imb | prefill time imb | "
        "TTFT floor s | co-batching bound s |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for sc, reports in results.items():
        pa = reports["prefix_affinity"]["ttft_mean_s"]
        lines.append(
            f"| {sc.title} | {sc.replicas} | {sc.load} | {'yes' if sc.pressure else 'no'} | "
            f"{pa:.3f} | {_ratio(pa, reports['oracle']['ttft_mean_s'])} | "
            f"{_ratio(pa, reports['round_robin']['ttft_mean_s'])} | "
            f"{_ratio(pa, reports['sglang_cache_aware']['ttft_mean_s'])} | "
            f"{_ratio(pa, reports['least_load']['ttft_mean_s'])} | "
            f"{reports['prefix_affinity']['prefill_imbalance']:.2f} | "
            f"{reports['prefix_affinity']['prefill_time_imbalance']:.2f} | "
            f"{reports['oracle']['ttft_floor_mean_s']:.3f} | "
            f"{reports['oracle']['ttft_bound_mean_s']:.3f} |")
    return [*lines, ""]


def ablation(jobs: int) -> int:
    by_key = {f"{sc.key}/{sc.replicas}/{sc.load}": sc for sc in SCENARIOS}
    scs = [by_key[k] for k in ABLATION_SCENARIOS]
    work = [(sc, "prefix_affinity", params) for _, params in ABLATION for sc in scs]
    with _pool(jobs) as pool:
        out = pool.map(_run, work)
    means = {(id(job[2]), job[0]): rep["ttft_mean_s"] for job, (_, _, rep, _) in
             zip(work, out, strict=True)}
    print("prefix_affinity mean TTFT (s) with one default changed at a time; "
          "`python -m loadtests.scoreboard --ablation`. Each cell is "
          "`<the scenario's command> --policy prefix_affinity --set KEY=VALUE ...`.\n")
    print("| variant | " + " | ".join(k.replace("/", " ") for k in ABLATION_SCENARIOS) + " |")
    print("|---|" + "---:|" * len(scs))
    for label, params in ABLATION:
        cells = " | ".join(f"{means[(id(params), sc)]:.3f}" for sc in scs)
        print(f"| {label} | {cells} |")
    print("\nScenario commands:\n")
    for k, sc in zip(ABLATION_SCENARIOS, scs, strict=True):
        print(f"- {k}: `{sc.command()}`")
    return 0


COMPARE_POLICIES = ("least_load", "oracle")


def compare(chosen: Sequence[Scenario], before: dict[str, Any], jobs: int,
            after: dict[str, Any] | None = None) -> int:
    """prefix_affinity with `before` set and at the defaults (or with `after` set), against
    the oracle and least_load at the defaults, on each scenario: the before/after table."""
    frozen = tuple(sorted(before.items()))
    frozen_after = tuple(sorted((after or {}).items()))
    work: list[Any] = [(sc, p) for sc in chosen for p in COMPARE_POLICIES]
    work += [(sc, "prefix_affinity", frozen_after) if frozen_after else (sc, "prefix_affinity")
             for sc in chosen]
    labels = [p for _sc, p, *_rest in work]
    work += [(sc, "prefix_affinity", frozen) for sc in chosen]
    labels += ["before"] * len(chosen)
    res = _run_labelled(work, labels, jobs)
    setting = settings_text(frozen, ", ")
    after_setting = settings_text(frozen_after, ", ")
    command = f"--compare {settings_text(frozen, ' ')}"
    if frozen_after:
        command += f" --after {settings_text(frozen_after, ' ')}"
    print(f"prefix_affinity before ({setting}) and after ({after_setting}); "
          f"`python -m loadtests.scoreboard {command}`\n")
    print("| set | workload | replicas | load | before s | after s | oracle s | before / oracle "
          "| after / oracle | after / least_load | after hit | oracle hit | co-batching bound s "
          "| before time imb | after time imb |")
    print("|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for sc in chosen:
        b, a = res[(sc, "before")], res[(sc, "prefix_affinity")]
        o, ll = res[(sc, "oracle")], res[(sc, "least_load")]
        print(f"| {_set_name(sc)} | {sc.title} | {sc.replicas} | "
              f"{sc.load} | {b['ttft_mean_s']:.3f} | {a['ttft_mean_s']:.3f} | "
              f"{o['ttft_mean_s']:.3f} | {_ratio(b['ttft_mean_s'], o['ttft_mean_s'])} | "
              f"{_ratio(a['ttft_mean_s'], o['ttft_mean_s'])} | "
              f"{_ratio(a['ttft_mean_s'], ll['ttft_mean_s'])} | {a['hit_ratio']:.3f} | "
              f"{o['hit_ratio']:.3f} | {o['ttft_bound_mean_s']:.3f} | "
              f"{b['prefill_time_imbalance']:.2f} | {a['prefill_time_imbalance']:.2f} |")
    _print_commands(chosen)
    return 0


def _set_name(sc: Scenario) -> str:
    return "held out" if sc.held_out else "tuning"


def _run_labelled(work: Sequence[Any], labels: Sequence[str],
                  jobs: int) -> dict[tuple[Scenario, str], dict[str, Any]]:
    """Each `_run` job's report by (scenario, label), with its progress on stderr."""
    res: dict[tuple[Scenario, str], dict[str, Any]] = {}
    with _pool(jobs) as pool:
        for label, (sc, _policy, report, wall) in zip(labels, pool.imap(_run, work), strict=True):
            res[(sc, label)] = report
            print(f"# {sc.title} {sc.replicas} {sc.load} {label}: TTFT mean "
                  f"{report['ttft_mean_s']:.3f} s ({wall:.1f} s)", file=sys.stderr, flush=True)
    return res


def _print_commands(chosen: Sequence[Scenario]) -> None:
    print("\nScenario commands:\n")
    for sc in chosen:
        print(f"- {_set_name(sc)}, {sc.title} {sc.replicas} {sc.load}: `{sc.command()}`")


def _variant(text: str) -> tuple[tuple[str, Any], ...]:
    """``KEY=VALUE,KEY=VALUE`` (or ``defaults``) as sorted settings: one --variant."""
    if text == "defaults":
        return ()
    return tuple(sorted(key_value(part) for part in text.split(",")))


def sweep(chosen: Sequence[Scenario], variants: Sequence[tuple[tuple[str, Any], ...]],
          jobs: int, scope: str = "") -> int:
    """prefix_affinity with each variant's settings on each scenario, against the oracle and
    least_load at the defaults: one row per scenario (each variant's mean TTFT over the
    oracle's, its prefill time imbalance), then a summary per variant against the targets
    (within 1.05x the oracle, 1.05x least_load where nothing is under pressure, prefill time
    imbalance at most 1.15), the tuning set and the held-out set apart."""
    names = [settings_text(v) for v in variants]
    work: list[Any] = [(sc, p) for sc in chosen for p in COMPARE_POLICIES]
    labels = [p for sc in chosen for p in COMPARE_POLICIES]
    work += [(sc, "prefix_affinity", v) for v in variants for sc in chosen]
    labels += [n for n in names for _sc in chosen]
    t0 = time.perf_counter()
    res = _run_labelled(work, labels, jobs)
    command = scope + " ".join(f"--variant {n}" for n in names)
    print(f"prefix_affinity mean TTFT over the oracle's (and prefill time imbalance) per "
          f"variant; `python -m loadtests.scoreboard --sweep {command}` "
          f"({time.perf_counter() - t0:.0f} s).\n")
    print("| set | workload | replicas | load | oracle s | " + " | ".join(names) + " |")
    print("|---|---|---:|---|---:|" + "---:|" * len(names))
    for sc in chosen:
        o = res[(sc, "oracle")]["ttft_mean_s"]
        cells = " | ".join(f"{_ratio(res[(sc, n)]['ttft_mean_s'], o)} "
                           f"({res[(sc, n)]['prefill_time_imbalance']:.2f})" for n in names)
        print(f"| {_set_name(sc)} | {sc.title} | {sc.replicas} | {sc.load} | {o:.3f} | "
              f"{cells} |")
    _sweep_summary(chosen, names, res)
    _print_commands(chosen)
    return 0


def _sweep_summary(chosen: Sequence[Scenario], names: Sequence[str],
                   res: dict[tuple[Scenario, str], dict[str, Any]]) -> None:
    """Each variant against the targets, the tuning and the held-out cells apart."""
    print("\nPer variant: cells past 1.05x the oracle; past 1.05x least_load with nothing "
          "under pressure; prefill time imbalance past 1.15; the worst ratio to the oracle; "
          "the geometric mean ratio.\n")
    print("| variant | set | cells | > 1.05 oracle | > 1.05 least_load | time imb > 1.15 "
          "| worst / oracle | geo-mean / oracle |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for n in names:
        for which, held in (("tuning", False), ("held out", True)):
            scs = [sc for sc in chosen if sc.held_out == held]
            if not scs:
                continue
            ratios = [res[(sc, n)]["ttft_mean_s"] / res[(sc, "oracle")]["ttft_mean_s"]
                      for sc in scs]
            over_ll = sum(1 for sc in scs if not sc.pressure and res[(sc, n)]["ttft_mean_s"]
                          > 1.05 * res[(sc, "least_load")]["ttft_mean_s"])
            imb = sum(1 for sc in scs if res[(sc, n)]["prefill_time_imbalance"] > 1.15)
            geo = statistics.geometric_mean(ratios)
            print(f"| {n} | {which} | {len(scs)} | {sum(1 for r in ratios if r > 1.05)} | "
                  f"{over_ll} | {imb} | {max(ratios):.3f} | {geo:.3f} |")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="run scenarios whose name contains this")
    ap.add_argument("--replicas", type=int, default=0, help="only this fleet size")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes")
    ap.add_argument("--ablation", action="store_true",
                    help="prefix_affinity with one default changed at a time")
    ap.add_argument("--set", dest="which", choices=("tuning", "held-out"), default=None,
                    help="only the scenarios of the tuning set, or only the held-out ones")
    ap.add_argument("--compare", nargs="+", metavar="KEY=VALUE", type=key_value,
                    help="prefix_affinity with these settings (before) against its defaults "
                         "(after), the oracle and least_load")
    ap.add_argument("--after", nargs="+", metavar="KEY=VALUE", type=key_value, default=[],
                    help="with --compare: these settings for the after run, not the defaults")
    ap.add_argument("--sweep", action="store_true",
                    help="prefix_affinity with each --variant against the oracle and "
                         "least_load, and a summary per variant against the targets")
    ap.add_argument("--variant", action="append", default=[], type=_variant,
                    metavar="KEY=VALUE[,KEY=VALUE...]",
                    help="with --sweep: one set of settings (repeatable; 'defaults' for none)")
    ap.add_argument("--vllm-engines", action="store_true",
                    help="simulated engines that allocate KV as a request's tokens need it, "
                         "preempt, and keep outputs cached, as vLLM does (simulate's "
                         "--engine-lazy-kv --engine-caches-outputs)")
    args = ap.parse_args(argv)
    _engine.clear()
    if args.vllm_engines:
        _engine.update(engine_lazy_kv=True, engine_caches_outputs=True)
    if args.after and not args.compare:
        ap.error("--after goes with --compare")
    if args.sweep != bool(args.variant):
        ap.error("--sweep needs at least one --variant, and --variant goes with --sweep")
    if len(set(args.variant)) != len(args.variant):
        ap.error("each --variant once: their results are kept by their settings")
    if args.ablation:
        return ablation(args.jobs)
    chosen = [sc for sc in SCENARIOS if args.only in sc.key
              and (not args.replicas or sc.replicas == args.replicas)
              and (args.which is None or sc.held_out == (args.which == "held-out"))]
    if args.sweep:
        scope = "".join(f"{flag} {value} " for flag, value in (
            ("--only", args.only), ("--replicas", args.replicas), ("--set", args.which))
            if value) + ("--vllm-engines " if args.vllm_engines else "")
        return sweep(chosen, args.variant, args.jobs, scope)
    if args.compare:
        return compare(chosen, dict(args.compare), args.jobs, dict(args.after))
    jobs = [(sc, p) for sc in chosen for p in ALL_POLICIES]
    results: dict[Scenario, dict[str, dict[str, Any]]] = {sc: {} for sc in chosen}
    t0 = time.perf_counter()
    with _pool(args.jobs) as pool:
        for sc, policy, report, wall in pool.imap(_run, jobs):
            results[sc][policy] = report
            print(f"# {sc.key} {sc.replicas} {sc.load} {policy}: "
                  f"TTFT mean {report['ttft_mean_s']:.3f} s ({wall:.1f} s)",
                  file=sys.stderr, flush=True)
    print(f"Simulated: profile {DEFAULT_PROFILE}, KV cache {DEFAULT_KV_CAPACITY_TOKENS:,} "
          f"tokens per replica, gateway RoutingSettings defaults; "
          f"`python -m loadtests.scoreboard` ({time.perf_counter() - t0:.0f} s).\n")
    print("\n".join(_summary(results)))
    for sc in chosen:
        print("\n".join(_table(sc, results[sc])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
