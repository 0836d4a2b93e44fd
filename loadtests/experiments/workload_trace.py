"""Write a synthetic workload as a Mooncake-format trace file, as an unseen trace would come.

A trace file carries what the public Mooncake traces carry (ms timestamps, lengths, 512-token
chained hash ids) and nothing else: no session ids, which the synthetic workloads keep for
the reports. Replayed with `--trace`, a workload then reaches the simulator, `replay` and
`compare_http` exactly as a trace the project has never seen would:

    python -m loadtests.experiments.workload_trace --workload conversation \
        --workload-param turns_mean=8 --workload-param think_time_s=15 --out /tmp/agent.jsonl
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Sequence

from loadtests.settings import add_workload_param
from loadtests.traces import SYNTHETIC, TraceRequest, synthetic_workload, write_mooncake


def mooncake_rows(requests: Iterable[TraceRequest]) -> list[dict]:
    """The requests as Mooncake-format rows, in their order."""
    return [{"timestamp": round(r.timestamp_s * 1000), "input_length": r.input_tokens,
             "output_length": r.output_tokens, "hash_ids": list(r.hash_ids)}
            for r in requests]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", required=True, choices=sorted(SYNTHETIC))
    add_workload_param(ap)
    ap.add_argument("--out", required=True, help="JSONL file to write")
    args = ap.parse_args(argv)
    rows = mooncake_rows(synthetic_workload(args.workload, dict(args.workload_param)))
    if not rows:
        ap.error("the workload has no requests with these parameters")
    print(write_mooncake(args.out, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
