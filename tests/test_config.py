"""Configuration: valid examples load; mistakes are reported with their key and line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gateway import cli
from gateway.config import ConfigError, load_config, parse_config
from tests.conftest import ROOT
from tests.inprocess import two_pools


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



def test_the_output_a_running_request_holds_is_by_the_pools_engine_unless_set() -> None:
    from gateway.wiring import build_pools

    by_engine = {p.name: p.router.output_reserve for p in build_pools(parse_config(two_pools()))}
    # TensorRT-LLM reserves a whole output when it admits a request; vLLM as it decodes.
    assert by_engine == {"realtime": 0.5, "batch": 1.0}
    config = two_pools(output_reserve=0.25)
    config["pools"][1]["routing"] = {"output_reserve": 0.75}
    assert {p.name: p.router.output_reserve for p in build_pools(parse_config(config))} == {
        "realtime": 0.25, "batch": 0.75}
    with pytest.raises(ConfigError, match="output_reserve"):
        parse_config(two_pools(output_reserve=1.5))


async def test_a_finished_requests_output_stays_in_the_index_with_output_cached() -> None:
    from tests.inprocess import gateway

    held: dict[bool, int] = {}
    for cached in (False, True):
        async with gateway(two_pools(realtime=1, batch=1, output_cached=cached)) as gw:
            stream = await gw.openai().chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "tell me a story " * 60}],
                max_tokens=256, stream=True, stream_options={"include_usage": True})
            usage = [chunk.usage async for chunk in stream if chunk.usage]
            assert usage[-1].completion_tokens == 256
            held[cached] = len(gw.app.state.pool_by_name["realtime"].router.indexes["rt-0"])
    # 256 blocks of characters at 4 characters a token are 64 tokens: 256 tokens fill 4.
    assert held[True] - held[False] == 4


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


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    """`prefix-gateway ARGS` in the test process (only commands that return without serving):
    its exit code, stdout and stderr. test_serve_exits_2 runs the command as a process."""
    parsed = cli.build_parser().parse_args(list(args))
    code = parsed.func(parsed)
    out, err = capsys.readouterr()
    return code, out, err


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


def test_check_flag_validates_without_serving(capsys) -> None:
    code, out, _ = run_cli(capsys, "serve", "--config",
                           str(ROOT / "deploy" / "examples" / "gateway.yaml"), "--check")
    assert code == 0
    assert "valid" in out and "realtime (vllm, 3 replicas)" in out


# Admission control ----------------------------------------------------------------------------


def admission_dict(**classes: dict) -> dict:
    """Two pools with limits; realtime borrows batch; `classes` replace a class's settings."""
    config = two_pools()
    for pool in config["pools"]:
        pool["max_inflight_per_replica"] = 4
    config["traffic_classes"] = [
        {"name": "realtime", "pool": "realtime", "priority": 10,
         "admission": {"borrow": [{"pool": "batch", "while_below": 0.5}]}},
        {"name": "batch", "pool": "batch"},
    ]
    for c in config["traffic_classes"]:
        c.update(classes.get(c["name"], {}))
    return config


def test_admission_settings_and_their_defaults() -> None:
    config = parse_config(admission_dict())
    realtime, batch = config.traffic_classes
    assert config.admission_for(realtime).borrow[0].pool == "batch"
    # A class without its own settings, on a pool with a limit: the defaults.
    assert config.admission_for(batch).max_queue == 256
    assert config.pools[0].reserved_fraction == 0.25
    plain = parse_config(admission_dict(realtime={"admission": None}) | {"pools": [
        {k: v for k, v in p.items() if k != "max_inflight_per_replica"}
        for p in admission_dict()["pools"]]})
    assert [plain.admission_for(c) for c in plain.traffic_classes] == [None, None]


def _without_limit(pool: str) -> dict:
    config = admission_dict()
    next(p for p in config["pools"] if p["name"] == pool).pop("max_inflight_per_replica")
    return config


def _pool_setting(key: str, value) -> dict:
    config = admission_dict()
    config["pools"][1][key] = value
    return config


def _classification(**kw) -> dict:
    config = admission_dict()
    config["classification"].update(kw)
    return config


def _borrow(*entries: dict) -> dict:
    return admission_dict(realtime={"admission": {"borrow": list(entries)}})


@pytest.mark.parametrize(("config", "error"), [
    (_borrow({"pool": "nowhere"}), "admission.borrow names unknown pool 'nowhere'"),
    (_borrow({"pool": "realtime"}), "names the class's own pool 'realtime'"),
    (_borrow({"pool": "batch"}, {"pool": "batch"}), "names a pool twice"),
    (_borrow({"pool": "batch", "while_below": 0}), "while_below: Input should be greater than 0"),
    (_borrow({"pool": "batch", "while_below": 1.5}), "while_below: Input should be less than or "
     "equal to 1"),
    (_borrow({"pool": "batch", "whle_below": 0.5}), "whle_below: unknown key"),
    (_without_limit("batch"), "pool 'batch' has no max_inflight_per_replica, so its load cannot "
     "be measured"),
    (_without_limit("realtime"), "its pool 'realtime' has no max_inflight_per_replica"),
    (_pool_setting("reserved_fraction", 1.5), "reserved_fraction: Input should be less than or "
     "equal to 1"),
    (_pool_setting("max_inflight_per_replica", 0), "max_inflight_per_replica: Input should be "
     "greater than or equal to 1"),
    (_pool_setting("models", ["other"]), "pool 'batch' serves none of the models of pool "
     "'realtime'"),
    (admission_dict(batch={"admission": {"max_queue": -1}}), "max_queue: Input should be "
     "greater than or equal to 0"),
    (admission_dict(batch={"admission": {"max_queue_wait_s": 0}}), "max_queue_wait_s: Input "
     "should be greater than 0"),
    (admission_dict(batch={"priority": "high"}), "priority: Input should be a valid integer"),
    (_classification(priority_min=5, priority_max=1), "priority_min (5) is above priority_max"),
    (_classification(priority_api_keys={"sk-vip": 50}), "priority_api_keys['sk-v...'] = 50 is "
     "outside priority_min..priority_max (-10..10)"),
])
def test_admission_mistakes_are_explained(config: dict, error: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_config(config)
    assert error in str(exc.value)
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
        tmp_path: Path, capsys, monkeypatch) -> None:
    path = tmp_path / "gw.yaml"
    cfg = yaml.safe_load((ROOT / "deploy" / "examples" / "gateway.yaml").read_text())
    path.write_text(yaml.safe_dump({**cfg, "redis": {"url": "redis://file:6379/0",
                                                     "key_prefix": "mine:"}}))

    def check(*flags: str, env: str | None = None) -> str:
        if env:
            monkeypatch.setenv(cli.REDIS_ENV, env)
        else:
            monkeypatch.delenv(cli.REDIS_ENV, raising=False)
        code, out, err = run_cli(capsys, "serve", "--config", str(path), "--check", *flags)
        assert code == 0, err
        return out

    assert cli.REDIS_ENV == "PREFIX_GATEWAY_REDIS_URL"
    assert "Batch API on (Redis redis://file:6379/0)" in check()
    assert "(Redis redis://env:6379/0)" in check(env="redis://env:6379/0")
    assert "(Redis redis://flag:6379/0)" in check("--redis-url", "redis://flag:6379/0",
                                                   env="redis://env:6379/0")
    assert "(Redis redis://:***@env:6379/0)" in check(env="redis://:secret@env:6379/0")
    monkeypatch.delenv(cli.REDIS_ENV, raising=False)
    code, _, err = run_cli(capsys, "serve", "--config",
                           str(ROOT / "deploy" / "examples" / "gateway.yaml"), "--check",
                           "--redis-url", "localhost:6379")
    assert code == 2 and "invalid Redis URL 'localhost:6379'" in err


def test_serve_takes_its_file_host_port_and_log_level_from_the_environment(
        tmp_path: Path, capsys, monkeypatch) -> None:
    """A container sets PREFIX_GATEWAY_CONFIG, _HOST, _PORT and _LOG_LEVEL; a flag wins."""
    example = ROOT / "deploy" / "examples" / "gateway.yaml"
    for name in (cli.CONFIG_ENV, cli.HOST_ENV, cli.PORT_ENV, cli.LOG_LEVEL_ENV):
        monkeypatch.delenv(name, raising=False)
    code, _, err = run_cli(capsys, "serve", "--check")
    assert code == 2 and f"give --config FILE or set {cli.CONFIG_ENV}" in err

    monkeypatch.setenv(cli.CONFIG_ENV, str(example))
    code, out, err = run_cli(capsys, "serve", "--check")
    assert code == 0 and out.startswith(f"{example}: valid"), err

    seen: list[tuple[str, int]] = []
    monkeypatch.setattr(cli, "run_gateway",
                        lambda config, **kw: seen.append((config.server.host, config.server.port,
                                                          kw["log_level"])))
    monkeypatch.setenv(cli.HOST_ENV, "127.0.0.2")
    monkeypatch.setenv(cli.PORT_ENV, "9123")
    monkeypatch.setenv(cli.LOG_LEVEL_ENV, "WARNING")
    assert run_cli(capsys, "serve")[0] == 0
    assert seen.pop() == ("127.0.0.2", 9123, "warning")
    assert run_cli(capsys, "serve", "--host", "127.0.0.3", "--port", "9124",
                   "--log-level", "debug")[0] == 0
    assert seen.pop() == ("127.0.0.3", 9124, "debug")

    monkeypatch.setenv(cli.PORT_ENV, "80a")
    code, _, err = run_cli(capsys, "serve")
    assert code == 2 and "PREFIX_GATEWAY_PORT='80a': not a port number" in err
    monkeypatch.setenv(cli.PORT_ENV, "9123")
    monkeypatch.setenv(cli.LOG_LEVEL_ENV, "loud")
    code, _, err = run_cli(capsys, "serve")
    assert code == 2 and "PREFIX_GATEWAY_LOG_LEVEL='loud'" in err
    assert not seen
