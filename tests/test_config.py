"""Configuration: valid examples load; mistakes are reported with their key and line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gateway.config import ConfigError, load_config
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
