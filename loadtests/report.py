"""Printing benchmark results: aligned and markdown tables, table cells, JSON lines."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from loadtests.stats import median


def cell(value: float | None, fmt: str = "{:.3f}") -> str:
    """A number as a table cell; "-" for a figure that could not be measured."""
    return "-" if value is None else fmt.format(value)


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns two spaces apart, for a terminal."""
    widths = [max([len(h), *(len(row[j]) for row in rows)]) for j, h in enumerate(header)]
    lines = [header, *rows]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True))
                     for line in lines)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]],
                   align: str = "") -> str:
    """A markdown table, newline-terminated; `align` holds one letter a column, "l" or "r"
    (default: all left)."""
    marks = ["---:" if a == "r" else "---" for a in align.ljust(len(header), "l")]
    lines = [header, *rows]
    out = ["| " + " | ".join(line) + " |" for line in lines]
    out.insert(1, "|" + "|".join(marks) + "|")
    return "\n".join(out) + "\n"


def span(values: Sequence[float]) -> str:
    """"min..max", without decimals for large values; "-" when empty."""
    if not values:
        return "-"
    fmt = ".0f" if max(abs(x) for x in values) >= 100 else ".3f"
    return f"{min(values):{fmt}}..{max(values):{fmt}}"


def median_range(values: Sequence[float | None], fmt: Callable[[float | None], str]) -> str:
    """"median (min-max)" over repeats, or the single value; "-" when none was measured."""
    xs = [v for v in values if v is not None]
    if len(xs) <= 1:
        return fmt(xs[0]) if xs else "-"
    return f"{fmt(median(xs))} ({fmt(min(xs))}-{fmt(max(xs))})"


def emit_json(result: Any, as_json: bool, output: str | None, **dumps: Any) -> None:
    """Append the result to the JSONL file `output`, and print it as the last line if asked."""
    line = json.dumps(result, **dumps)
    if output:
        with open(output, "a") as f:
            f.write(line + "\n")
    if as_json:
        print(line, flush=True)
