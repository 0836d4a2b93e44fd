"""The engines' metrics pages are read by a scan for the samples the gateway uses, and the scan
reads what prometheus_client's full parse of the page reads."""

from __future__ import annotations

import dataclasses
import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from backends.adapters import EngineSnapshot, promtext
from backends.adapters.trtllm import parse_trtllm_prometheus
from backends.adapters.vllm import parse_vllm_metrics
from tests.conftest import ROOT
from tests.test_adapters import _BY_SOURCE, _PREFILL_HIST, _PROMPT_AND_HITS, DEPRECATED


def full_parse(text: str) -> tuple[dict[str, float], dict[str, list[tuple[dict, float]]]]:
    """The page as prometheus_client parses it whole: each sample name's sum (a counter's
    `_total` taken off), and each name's samples as (labels, value)."""
    sums: dict[str, float] = {}
    samples: dict[str, list[tuple[dict, float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
            name = sample.name.removesuffix("_total")
            sums[name] = sums.get(name, 0.0) + sample.value
    return sums, samples


def vllm_by_full_parse(text: str) -> EngineSnapshot:
    """What parse_vllm_metrics read when it parsed the whole page with prometheus_client."""
    sums, samples = full_parse(text)
    block_size = num_blocks = None
    for info, _ in samples.get("vllm:cache_config_info", ()):
        if info.get("block_size", "").isdigit():
            block_size = int(info["block_size"])
        blocks = info.get("num_gpu_blocks") or info.get("num_cpu_blocks")
        if blocks and blocks.isdigit():
            num_blocks = (num_blocks or 0) + int(blocks)
    local = [value for labels, value in samples.get("vllm:prompt_tokens_by_source_total", ())
             if labels.get("source") == "local_compute"]
    sums.pop("vllm:prompt_tokens_by_source", None)  # read by its source label alone

    def first(*names: str) -> tuple[float | None, str]:
        return next(((sums[n], n) for n in names if n in sums), (None, ""))

    kv, kv_name = first("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    hits, hits_name = first("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits")
    queries, _ = first("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries")
    engines = max(1, len(samples.get("vllm:num_requests_running", ())))
    computed = sums.get("vllm:request_prefill_kv_computed_tokens_sum",
                        sum(local) if local else None)
    prompt = sums.get("vllm:prompt_tokens")
    if computed is None and prompt is not None and hits is not None:
        computed = max(0.0, prompt - hits)
    return EngineSnapshot(
        running=sums.get("vllm:num_requests_running"),
        waiting=sums.get("vllm:num_requests_waiting"),
        kv_usage=kv / engines if kv is not None else None,
        prefix_hit_tokens=hits, prefix_query_tokens=queries,
        block_size=block_size, num_blocks=num_blocks, computed_prompt_tokens=computed,
        prefill_seconds=sums.get("vllm:request_prefill_time_seconds_sum"),
        prefills=sums.get("vllm:request_prefill_time_seconds_count"),
        first_tokens=sums.get("vllm:time_to_first_token_seconds_count"),
        source="vllm:" + ("deprecated-names" if hits_name.startswith("vllm:gpu_") or
                          kv_name.startswith("vllm:gpu_") else "current-names"))


VLLM_PAGES = {
    "real, idle": (ROOT / "tests" / "fixtures" / "vllm_metrics.txt").read_text(),
    "real, busy": (ROOT / "tests" / "fixtures" / "vllm_metrics_busy.txt").read_text(),
    "prompt tokens by source": _PROMPT_AND_HITS + _BY_SOURCE,
    "prompt tokens and hits": _PROMPT_AND_HITS,
    "prefill histogram, two engines": _PROMPT_AND_HITS + _PREFILL_HIST,
    "deprecated names, two engines": DEPRECATED,
}


@pytest.mark.parametrize("page", VLLM_PAGES.values(), ids=VLLM_PAGES.keys())
def test_the_vllm_scan_reads_what_the_full_parse_reads(page: str) -> None:
    scanned, parsed = parse_vllm_metrics(page), vllm_by_full_parse(page)
    assert scanned == parsed
    # And the comparison has something to compare: most fields are read off every page.
    assert sum(v is not None for v in dataclasses.astuple(scanned)) >= 4


def test_only_sample_lines_of_the_exact_name_are_read() -> None:
    page = (
        "vllm:x 1.0\n"  # the page's first line
        "# HELP vllm:x 100.0\n"
        "# TYPE vllm:x gauge\n"
        'vllm:x{engine="0",model_name="a} vllm:x 7"} 2.5\n'  # a brace and the name in a label
        "vllm:x_other 11.0\n"  # another metric's name begins with this one
        "other_vllm:x 13.0\n"
        'vllm:x{engine="1"} 4.0 1700000000000\r\n'  # a timestamp, a CRLF line end
        "vllm:x{engine=\"2\"} not-a-number\n"
        "vllm:x{engine=\"3\"} NaN\n"
        "vllm:x{broken 5.0\n"
        "vllm:x\t+Inf")  # no line end
    found = promtext.scan_samples(page, ["vllm:x", "vllm:absent"])
    assert "vllm:absent" not in found
    values = found["vllm:x"]
    assert [labels for labels, _ in values] == [
        "", 'engine="0",model_name="a} vllm:x 7"', 'engine="1"', 'engine="3"', ""]
    assert [v for _, v in values if not math.isnan(v)] == [1.0, 2.5, 4.0, math.inf]
    assert promtext.sample_sum({"a": [("", 1.0), ("", 2.0)]}, "a") == 3.0
    assert promtext.sample_sum({}, "a") is None
    # A counter read under its name, with or without the _total of its samples.
    assert promtext.counter_sum({"a": [("", 1.0)], "a_total": [("", 2.0)]}, "a") == 3.0
    assert promtext.counter_sum({"a_total": [("", 2.0)]}, "a") == 2.0
    assert promtext.counter_sum({"a_totals": [("", 2.0)]}, "a") is None
    assert promtext.with_totals(["a", "b"]) == ("a", "b", "a_total", "b_total")


def test_label_values_are_unescaped() -> None:
    assert promtext.parse_labels(r'source="local_compute",name="a \"b\", c\\d\n", le="+Inf"') == {
        "source": "local_compute", "name": 'a "b", c\\d\n', "le": "+Inf"}
    assert promtext.parse_labels("") == {}


@pytest.mark.parametrize("page", [
    "<html><body>Not Found</body></html>",
    '{"error": "metrics are off"}',
    '[{"iter": 1}]',
    "# TYPE x gauge\nx{a=\"1\"}\n",  # a sample line without a value
])
def test_a_page_that_is_not_prometheus_text_is_refused(page: str) -> None:
    with pytest.raises(ValueError, match="not a Prometheus text page"):
        promtext.check_page(page)
    with pytest.raises(ValueError):
        parse_vllm_metrics(page)
    with pytest.raises(ValueError):
        parse_trtllm_prometheus(page)
    # What the full parse refused too.
    with pytest.raises(ValueError):
        list(text_string_to_metric_families(page))


def test_an_empty_page_or_comments_alone_read_as_nothing() -> None:
    for page in ("", "\n", "# HELP x a gauge\n# TYPE x gauge\n"):
        promtext.check_page(page)
        assert parse_vllm_metrics(page) == EngineSnapshot(source="vllm:current-names")
