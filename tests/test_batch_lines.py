"""Batch input files as lines: the run order that puts shared prefixes together, its groups
and their leaders."""

from __future__ import annotations

import orjson

from gateway.batch.lines import parse_input, run_order


def completions(prompts: list[str]) -> bytes:
    return b"".join(orjson.dumps({"custom_id": f"c{i}", "method": "POST",
                                  "url": "/v1/completions",
                                  "body": {"model": "tiny", "prompt": p}}) + b"\n"
                    for i, p in enumerate(prompts))


def test_lines_sharing_a_prefix_are_adjacent_in_groups_led_by_their_first() -> None:
    doc, faq = "D" * 300, "F" * 300
    prompts = [doc + "q1", "short", faq + "a", doc + "q2", faq + "b", doc + "q3", "x" * 400]
    parsed = parse_input(completions(prompts), "/v1/completions", {"tiny"}, 100)
    assert parsed.total == 7 and not parsed.errors
    plan = run_order(parsed.requests, group_chars=256)
    assert [p.request.custom_id for p in plan] == ["c0", "c3", "c5", "c2", "c4", "c1", "c6"]
    assert [p.group for p in plan] == [0, 0, 0, 1, 1, 2, 3]
    # A group of several starts with its leader; a line alone leads nothing.
    assert [p.leader for p in plan] == [True, False, False, True, False, False, False]


def test_prompts_sharing_less_than_a_block_are_separate_groups() -> None:
    prompts = ["same start " + "a" * 100, "same start " + "b" * 100]
    parsed = parse_input(completions(prompts), "/v1/completions", {"tiny"}, 100)
    assert [p.group for p in run_order(parsed.requests, group_chars=64)] == [0, 1]
    assert [p.group for p in run_order(parsed.requests, group_chars=8)] == [0, 0]
