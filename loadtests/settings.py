"""KEY=VALUE settings on the command line, with JSON values."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from typing import Any


def key_value(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` as (key, value): the value is read as JSON when it parses (1, 0.5, null,
    true), else kept as text, so ``policy=round_robin`` needs no quotes. An argparse type."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def settings_text(settings: Iterable[tuple[str, Any]], sep: str = ",") -> str:
    """Settings as ``key_value`` reads them back (JSON values: true, null; text as it is),
    joined by `sep`, or "defaults" for none: how a printed command or label spells them."""
    return sep.join(f"{k}={v if isinstance(v, str) else json.dumps(v)}"
                    for k, v in settings) or "defaults"


def add_workload_param(parser: argparse.ArgumentParser) -> None:
    """``--workload-param KEY=VALUE`` (repeatable), shared by simulate, replay and compare_http
    so one scoreboard cell is spelled the same way in all three."""
    parser.add_argument("--workload-param", action="append", default=[], metavar="KEY=VALUE",
                        type=key_value,
                        help="synthetic workload parameter, e.g. n_tenants=300 (repeatable)")


def add_routing_settings(parser: argparse.ArgumentParser, note: str = "") -> None:
    """``--set KEY=VALUE`` (repeatable) into ``args.settings``: a routing setting as the
    gateway's config takes it, the router's own or one of the chosen policy's (an unknown key
    is an error), shared by simulate and replay."""
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        dest="settings", type=key_value,
                        help=f"gateway routing setting, e.g. load_weight=1 (repeatable{note})")
