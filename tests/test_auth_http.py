"""Authentication against real processes: `prefix-gateway up --api-key K --admin-key A` with
the official `openai` client, the stats CLI with its admin key, and the commands that refuse
to expose an open gateway."""

from __future__ import annotations

import io
import subprocess
import sys

import httpx
import openai
import pytest
import yaml

from gateway import cli as gateway_cli
from gateway import processes
from gateway.config import key_digest
from tests.inprocess import two_pools

K, A = "sk-gw-client-7f3a", "sk-gw-admin-91c2"


def cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    """`prefix-gateway ARGS` as a process."""
    return subprocess.run([sys.executable, "-m", "gateway.cli", *args], input=stdin,
                          capture_output=True, text=True, timeout=60)


@pytest.fixture
def run_cli(capsys, monkeypatch):
    """`prefix-gateway ARGS` through its parser and command in the test process, for commands
    that return without serving: (exit code, stdout, stderr)."""
    monkeypatch.delenv(gateway_cli.ADMIN_KEY_ENV, raising=False)

    def run(*args: str, stdin: str = "") -> tuple[int, str, str]:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))  # not a terminal
        parsed = gateway_cli.build_parser().parse_args(list(args))
        code = parsed.func(parsed)
        out, err = capsys.readouterr()
        return code, out, err

    return run


def test_up_with_keys_serves_only_holders_of_the_key(tmp_path, run_cli) -> None:
    port = processes.consecutive_free_ports(1)  # bound late: below the ephemeral range
    url = f"http://127.0.0.1:{port}"
    proc = processes.spawn([sys.executable, "-m", "gateway.cli", "up", "--port", str(port),
                            "--time-scale", "0.02", "--log-dir", str(tmp_path),
                            "--realtime-replicas", "1", "--batch-replicas", "1",
                            "--api-key", K, "--admin-key", A], str(tmp_path / "up.log"))
    try:
        processes.wait_healthy([url], [proc], deadline_s=60, path="/ready")
        msgs = [{"role": "user", "content": "hello"}]
        for key in ("unused", A):  # no key of the gateway's; the admin key is no client key
            c = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                c.chat.completions.create(model="tiny", messages=msgs, max_tokens=2)
        c = openai.OpenAI(base_url=url + "/v1", api_key=K, max_retries=0)
        answer = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=2)
        assert answer.choices[0].message.content
        chunks = list(c.chat.completions.create(model="tiny", messages=msgs, max_tokens=2,
                                                stream=True))
        assert chunks
        # The single key may use both classes of the embedded default.
        r = c.completions.with_raw_response.create(model="tiny", prompt="x", max_tokens=2,
                                                   extra_headers={"x-traffic-class": "batch"})
        assert r.headers["x-gateway-pool"] == "batch"
        assert httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x"}) \
            .status_code == 401
        assert httpx.get(url + "/admin/stats").status_code == 401
        assert httpx.get(url + "/admin/stats", headers={"Authorization": f"Bearer {K}"}) \
            .status_code == 401
        stats = httpx.get(url + "/admin/stats", headers={"Authorization": f"Bearer {A}"})
        assert stats.status_code == 200 and stats.json()["pools"]
        code, _, err = run_cli("stats", "--url", url)
        assert code == 1 and "--admin-key" in err
        code, out, _ = run_cli("stats", "--url", url, "--admin-key", A)
        assert code == 0 and "realtime-0" in out
    finally:
        processes.stop_all([proc])
    log = (tmp_path / "up.log").read_text()
    assert "1 client key(s), 1 admin key(s)" in log
    assert K not in log and A not in log


def test_serve_refuses_a_public_address_without_client_keys(tmp_path, run_cli) -> None:
    config = two_pools(realtime=1, batch=1)
    config["server"] = {"host": "0.0.0.0", "port": processes.free_ports(1)[0]}
    path = tmp_path / "open.yaml"
    path.write_text(yaml.safe_dump(config))
    # Serving for real: as a process (were it not refused, it would serve, not return).
    refused = cli("serve", "--config", str(path))
    assert refused.returncode == 2
    assert "refusing to serve" in refused.stderr and "auth.api_keys" in refused.stderr
    code, _, err = run_cli("serve", "--config", str(path), "--check")
    assert code == 2
    assert "refusing to serve" in err and "auth.api_keys" in err
    assert run_cli("serve", "--config", str(path), "--check", "--allow-unauthenticated")[0] == 0
    # The same file on loopback is fine, and --host may not sneak the address back in.
    config["server"]["host"] = "127.0.0.1"
    path.write_text(yaml.safe_dump(config))
    assert run_cli("serve", "--config", str(path), "--check")[0] == 0
    assert run_cli("serve", "--config", str(path), "--check", "--host", "0.0.0.0")[0] == 2


def test_hash_key_prints_the_digest_the_config_takes(run_cli) -> None:
    out = cli("hash-key", stdin="sk-some-key\n")  # from stdin, as a process
    assert out.returncode == 0 and out.stdout.strip() == key_digest("sk-some-key")
    code, stdout, _ = run_cli("hash-key", "sk-some-key")
    assert code == 0 and stdout.strip() == key_digest("sk-some-key")
    code, _, err = run_cli("hash-key", stdin="")
    assert code == 2 and "empty key" in err
