"""Configuration: valid examples load; mistakes are reported with their key and line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gateway.config import ConfigError, load_config, parse_config
from tests.conftest import ROOT


def test_example_configs_are_valid() -> None:
    for path in sorted((ROOT / "deploy" / "examples").glob("*.yaml")):
        config = load_config(path)
        assert config.pools and config.traffic_classes


def test_pool_routing_overrides_only_what_it_sets() -> None:
    config = load_config(ROOT / "deploy" / "examples" / "gateway.yaml")
    batch = next(p for p in config.pools if p.name == "batch")
    merged = config.routing_for(batch)
    assert merged.load_factor == 1.5
    assert merged.block_chars == config.routing.block_chars


BAD = """\
pools:
  - name: rt
    engine: vllm
    models: [tiny]
    replicas:
      - name: a
        url: http://127.0.0.1:1
        polcy: 3
traffic_classes:
  - {name: realtime, pool: nowhere}
classification: {default_class: realtime}
"""


def test_unknown_key_is_named_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(BAD)
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert f"{path}:8: pools[0].replicas[0].polcy: unknown key" in str(exc.value)


def test_dangling_pool_reference_is_explained(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(BAD.replace("        polcy: 3\n", ""))
    with pytest.raises(ConfigError, match="traffic class 'realtime' names unknown pool 'nowhere'"):
        load_config(path)


def test_serve_exits_2_with_the_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(BAD)
    r = subprocess.run([sys.executable, "-m", "gateway.cli", "serve", "--config", str(path)],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert "polcy: unknown key" in r.stderr


def test_check_flag_validates_without_serving() -> None:
    r = subprocess.run([sys.executable, "-m", "gateway.cli", "serve", "--config",
                        str(ROOT / "deploy" / "examples" / "gateway.yaml"), "--check"],
                       capture_output=True, text=True, check=True)
    assert "valid" in r.stdout and "realtime (vllm, 3 replicas)" in r.stdout


def test_the_batch_class_and_the_redis_section_are_checked(tmp_path: Path) -> None:
    from gateway.defaults import default_config, one_pool_config

    assert default_config(["http://a:1"], ["http://b:1"]).batch_class == "batch"
    one = one_pool_config(["http://a:1"], 8080)
    assert parse_config(one).batch_class == "default"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({**one, "batch": {"traffic_class": "bulk"},
                                    "redis": {"url": "http://10.0.0.5:6379"}}))
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert "redis.url: Value error, must start with redis://" in str(exc.value)
    path.write_text(yaml.safe_dump({**one, "batch": {"traffic_class": "bulk"}}))
    with pytest.raises(ConfigError, match=r"batch\.traffic_class 'bulk' is not a traffic class"):
        load_config(path)


def test_the_redis_url_comes_from_the_flag_then_the_environment_then_the_file(
        tmp_path: Path) -> None:
    path = tmp_path / "gw.yaml"
    cfg = yaml.safe_load((ROOT / "deploy" / "examples" / "gateway.yaml").read_text())
    path.write_text(yaml.safe_dump({**cfg, "redis": {"url": "redis://file:6379/0",
                                                     "key_prefix": "mine:"}}))

    def check(*flags: str, env: str | None = None) -> str:
        environ = {k: v for k, v in os.environ.items() if k != "PREFIX_GATEWAY_REDIS_URL"}
        if env:
            environ["PREFIX_GATEWAY_REDIS_URL"] = env
        return subprocess.run([sys.executable, "-m", "gateway.cli", "serve", "--config",
                               str(path), "--check", *flags], capture_output=True, text=True,
                              check=True, env=environ).stdout

    assert "Batch API on (Redis redis://file:6379/0)" in check()
    assert "(Redis redis://env:6379/0)" in check(env="redis://env:6379/0")
    assert "(Redis redis://flag:6379/0)" in check("--redis-url", "redis://flag:6379/0",
                                                   env="redis://env:6379/0")
    assert "(Redis redis://:***@env:6379/0)" in check(env="redis://:secret@env:6379/0")
    r = subprocess.run([sys.executable, "-m", "gateway.cli", "serve", "--config",
                        str(ROOT / "deploy" / "examples" / "gateway.yaml"), "--check",
                        "--redis-url", "localhost:6379"], capture_output=True, text=True)
    assert r.returncode == 2 and "invalid Redis URL 'localhost:6379'" in r.stderr
