"""Command-line options of `prefix-gateway sim` / `python -m backends.sim`."""

from __future__ import annotations

import argparse

from backends.sim.fleet_spec import FLEET_HELP, SLOW_HELP, fleet_profiles
from backends.sim.profiles import PROFILES
from backends.sim.replica import SimReplicaSpec
from backends.sim.server import serve_sims


def add_sim_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the simulated replica's options to `parser`."""
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    parser.add_argument(
        "--port", type=int, required=True, help="port of the first replica (0: a free port)"
    )
    parser.add_argument(
        "--count", type=int, default=None,
        help="replicas to run, on consecutive ports (default 1, or the --fleet's count)",
    )
    parser.add_argument("--kind", choices=("vllm", "trtllm"), default="vllm")
    parser.add_argument(
        "--model",
        action="append",
        dest="models",
        help="served model name; repeat for aliases (default: tiny)",
    )
    parser.add_argument("--profile", choices=sorted(PROFILES), default="vllm-cpu-tiny")
    parser.add_argument("--fleet", default=None, help=FLEET_HELP.replace("replica count",
                                                                         "--count"))
    parser.add_argument("--slow", default=None, help=SLOW_HELP)
    parser.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="multiply every simulated duration (0.01 runs a 100x faster engine)",
    )
    parser.add_argument("--kv-capacity-tokens", type=int, default=262_144)
    parser.add_argument(
        "--block-tokens", type=int, default=None, help="KV block size (default vllm 16, trtllm 32)"
    )
    parser.add_argument(
        "--max-running", type=int, default=None, help="max running sequences (default: profile)"
    )
    parser.add_argument(
        "--lazy-kv", action="store_true",
        help="take KV blocks as tokens need them and preempt the newest request when none is "
             "left, as vLLM does (default: reserve prompt plus max_tokens at admission, as "
             "trtllm-serve's default scheduler does)",
    )
    parser.add_argument(
        "--cache-outputs", action="store_true",
        help="a finished request's full output blocks stay in the prefix cache, as vLLM keeps "
             "them (default: their room is freed)",
    )
    parser.add_argument("--name", default="sim", help="replica name prefix")
    parser.add_argument(
        "--trtllm-perf-metrics",
        action="store_true",
        help="trtllm: mount /prometheus/metrics, as trtllm-serve does with return_perf_metrics",
    )
    parser.add_argument(
        "--trtllm-legacy-metrics",
        action="store_true",
        help="trtllm: 1.1.0rc5's five un-prefixed Prometheus names instead of trtllm_*",
    )


def specs_from_args(args: argparse.Namespace) -> list[SimReplicaSpec]:
    try:
        fleet = fleet_profiles(args.count if args.count is not None or args.fleet else 1,
                               args.profile, args.fleet, args.slow)
    except ValueError as exc:
        raise SystemExit(str(exc).replace("--replicas", "--count")) from None
    count = len(fleet)
    if args.port == 0 and count > 1:
        raise SystemExit("--count > 1 needs an explicit --port (replicas use consecutive ports)")
    return [
        SimReplicaSpec(
            name=f"{args.name}-{i}" if count > 1 else args.name,
            port=args.port + i if args.port else 0,
            kind=args.kind,
            models=tuple(args.models or ("tiny",)),
            profile=fleet[i].profile,
            slowdown=fleet[i].slowdown,
            time_scale=args.time_scale,
            kv_capacity_tokens=args.kv_capacity_tokens,
            block_tokens=args.block_tokens,
            max_running=args.max_running,
            trtllm_perf_metrics=args.trtllm_perf_metrics,
            trtllm_legacy_metrics=args.trtllm_legacy_metrics,
            lazy_kv=args.lazy_kv,
            cache_outputs=args.cache_outputs,
        )
        for i in range(count)
    ]


def main_from_args(args: argparse.Namespace) -> int:
    """Serve the replicas the options describe until Ctrl-C."""
    serve_sims(specs_from_args(args), host=args.host)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m backends.sim",
        description="Simulated vLLM / trtllm-serve replicas on loopback, for tests and planning.",
    )
    add_sim_arguments(parser)
    return main_from_args(parser.parse_args(argv))
