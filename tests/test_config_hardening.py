"""Configuration mistakes that used to be accepted silently are refused, naming where."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway import cli
from gateway.config import ConfigError, load_config

GOOD = """\
server:
  port: 8080
pools:
  - name: rt
    engine: vllm
    models: [tiny]
    health: {interval_s: 2}
    replicas:
      - {name: a, url: "http://10.0.0.1:8000"}
      - {name: b, url: "http://10.0.0.2:8000"}
  - name: bt
    engine: trtllm
    models: [tiny]
    replicas:
      - {name: c, url: "http://10.0.0.3:8000"}
traffic_classes:
  - {name: realtime, pool: rt}
  - {name: batch, pool: bt}
classification:
  header: X-Traffic-Class
  default_class: realtime
"""


def load(tmp_path: Path, text: str):
    path = tmp_path / "gateway.yaml"
    path.write_text(text)
    return load_config(path)


def refused(tmp_path: Path, text: str) -> str:
    with pytest.raises(ConfigError) as exc:
        load(tmp_path, text)
    return str(exc.value)


def test_the_base_file_is_valid_and_header_names_are_compared_in_lowercase(
        tmp_path: Path) -> None:
    assert load(tmp_path, GOOD).classification.header == "x-traffic-class"


def test_a_key_given_twice_is_refused_with_both_lines(tmp_path: Path) -> None:
    text = GOOD.replace("  port: 8080\n", "  port: 8080\n  port: 9090\n")
    msg = refused(tmp_path, text)
    assert "duplicate key 'port' (first given on line 2)" in msg and "line 3" in msg
    msg = refused(tmp_path, GOOD + "server: {port: 1}\n")
    assert "duplicate key 'server' (first given on line 1)" in msg


@pytest.mark.parametrize(("old", "new"), [
    ('url: "http://10.0.0.2:8000"', 'url: "http://10.0.0.1:8000"'),
    ('url: "http://10.0.0.3:8000"', 'url: "http://10.0.0.1:8000/"'),
    ('url: "http://10.0.0.3:8000"', 'url: "HTTP://10.0.0.1:8000"'),
], ids=["same-pool", "other-pool-trailing-slash", "other-pool-uppercase-scheme"])
def test_a_replica_url_listed_twice_is_refused(tmp_path: Path, old: str, new: str) -> None:
    msg = refused(tmp_path, GOOD.replace(old, new))
    assert "has the same url as pools[0].replicas[0] (rt/a): http://10.0.0.1:8000" in msg


@pytest.mark.parametrize(("url", "why"), [
    ("http://user:secret@10.0.0.9:8000", "must not carry credentials"),
    ("http://10.0.0.9:8000?key=1", "must not have a query"),
    ("http://10.0.0.9:8000/#frag", "must not have a query (?...) or fragment"),
])
def test_replica_urls_with_credentials_query_or_fragment_are_refused(
        tmp_path: Path, url: str, why: str) -> None:
    msg = refused(tmp_path, GOOD.replace("http://10.0.0.2:8000", url))
    assert f"gateway.yaml:10: pools[0].replicas[1].url: Value error, {why}" in msg
    assert "secret" not in msg.split("Value error", 1)[1]


@pytest.mark.parametrize("name", ["X Traffic Class", "x-traffic-class:", "x-tráfico", "a\tb"])
def test_header_names_no_request_can_carry_are_refused(tmp_path: Path, name: str) -> None:
    msg = refused(tmp_path, GOOD.replace("header: X-Traffic-Class", f"header: {name!r}"))
    assert "classification.header: Value error" in msg
    assert "is not a valid HTTP header name" in msg


def test_the_class_header_cannot_also_be_the_priority_header(tmp_path: Path) -> None:
    msg = refused(tmp_path, GOOD + "  priority_header: x-traffic-class\n")
    assert "header and priority_header are the same header" in msg


@pytest.mark.parametrize(("old", "new", "where"), [
    ("health: {interval_s: 2}", "health: {interval_s: 0.0001}", "pools[0].health.interval_s"),
    ("health: {interval_s: 2}", "health: {metrics_interval_s: 0.001}",
     "pools[0].health.metrics_interval_s"),
    ("health: {interval_s: 2}", "health: {timeout_s: 0}", "pools[0].health.timeout_s"),
    ("  port: 8080\n", "  port: 8080\n  request_timeout_s: 0\n", "server.request_timeout_s"),
    ("  port: 8080\n", "  port: 8080\n  header_timeout_s: -1\n", "server.header_timeout_s"),
    ("  port: 8080\n", "  port: 8080\n  body_timeout_s: 0\n", "server.body_timeout_s"),
], ids=["probe-interval", "scrape-interval", "probe-timeout", "request-timeout",
        "header-timeout", "body-timeout"])
def test_absurd_intervals_and_timeouts_are_refused(tmp_path: Path, old: str, new: str,
                                                   where: str) -> None:
    assert f"{where}: Input should be greater than" in refused(tmp_path, GOOD.replace(old, new))


def test_reading_passed_through_counts_too_often_is_refused_and_zero_turns_it_off(
        tmp_path: Path) -> None:
    msg = refused(tmp_path, GOOD.replace("health: {interval_s: 2}",
                                         "health: {passed_through_interval_s: 0.001}"))
    assert "pools[0].health.passed_through_interval_s: Value error" in msg
    assert "must be 0 (off) or at least 0.05" in msg
    path = tmp_path / "off.yaml"
    path.write_text(GOOD.replace("health: {interval_s: 2}",
                                 "health: {passed_through_interval_s: 0}"))
    assert load_config(path).pools[0].health.passed_through_interval_s == 0


def test_serve_check_refuses_a_duplicate_key(tmp_path: Path, capsys) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(GOOD + "pools: []\n")
    # The CLI's parser and command in the test process (test_config runs `serve` as one).
    args = cli.build_parser().parse_args(["serve", "--config", str(path), "--check"])
    assert args.func(args) == 2
    assert "duplicate key 'pools' (first given on line 3)" in capsys.readouterr().err
