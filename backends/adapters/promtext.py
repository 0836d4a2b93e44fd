"""Reading chosen samples off a Prometheus text page without parsing the rest of it."""

from __future__ import annotations

import re
from collections.abc import Iterable

# A label pair inside braces; a value may hold escaped quotes and backslashes.
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}
_ESCAPED = re.compile(r'\\[\\"n]')
# A sample line: a metric name, its labels if any, a value.
_SAMPLE_LINE = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*(\{.*\})?[ \t]+\S")


def check_page(text: str) -> None:
    """ValueError unless the page's first line that is not a comment reads as a sample (or
    it has none): an HTML or JSON answer at a metrics path is not a Prometheus page."""
    start = 0
    while start < len(text):
        end = text.find("\n", start)
        end = len(text) if end < 0 else end
        line, start = text[start:end], end + 1
        if line.strip() and not line.startswith("#"):
            if _SAMPLE_LINE.match(line) is None:
                raise ValueError(f"not a Prometheus text page: {line[:80]!r}")
            return


def scan_samples(text: str, names: Iterable[str]) -> dict[str, list[tuple[str, float]]]:
    """Every sample of each of `names` on the page, as (its label text, its value).

    An engine's page is mostly histogram buckets the gateway never reads: parsed whole with
    prometheus_client (0.26), a 48 kB vLLM page held the event loop for 26 ms, and scraped
    often on a busy machine that parse left the gateway too little time to answer its clients.
    Each name is found with `str.find` instead, which runs at C speed, and only its own lines
    are read (0.6 ms for that page).
    A name must begin a line (not a comment's, nor another metric's name it prefixes) and be
    followed by its labels or a space. A sample whose value does not parse is left out.
    """
    found: dict[str, list[tuple[str, float]]] = {}
    for name in names:
        start = 0
        while (at := text.find(name, start)) >= 0:
            start = at + len(name)
            if at > 0 and text[at - 1] != "\n":
                continue  # in a comment, or the end of another name
            end = text.find("\n", start)
            rest = text[start:end if end >= 0 else None]
            labels = ""
            if rest[:1] == "{":
                close = rest.rfind("}")
                if close < 0:
                    continue
                labels, rest = rest[1:close], rest[close + 1:]
            elif rest[:1] not in (" ", "\t"):
                continue  # another metric's name that begins with this one
            fields = rest.split()
            if not fields:
                continue
            try:
                value = float(fields[0])
            except ValueError:
                continue
            found.setdefault(name, []).append((labels, value))
    return found


def sample_sum(found: dict[str, list[tuple[str, float]]], name: str) -> float | None:
    """The sum of `name`'s samples over their label sets (engines, ranks); None if absent."""
    samples = found.get(name)
    return None if samples is None else sum(value for _, value in samples)


def with_totals(names: Iterable[str]) -> tuple[str, ...]:
    """`names`, and each with `_total`: the names to scan for counters read by `counter_sum`."""
    names = tuple(names)
    return (*names, *(name + "_total" for name in names))


def counter_sum(found: dict[str, list[tuple[str, float]]], name: str) -> float | None:
    """`sample_sum` of `name` and of `name_total`: a counter's samples end in _total, and the
    releases that exposed a metric without the suffix are read under the same name."""
    plain, suffixed = sample_sum(found, name), sample_sum(found, name + "_total")
    return plain if suffixed is None else suffixed + (plain or 0.0)


def parse_labels(labels: str) -> dict[str, str]:
    """A sample's label text (inside its braces) as a dict."""
    return {key: _ESCAPED.sub(lambda m: _UNESCAPE[m.group()], value)
            for key, value in _LABEL.findall(labels)}
