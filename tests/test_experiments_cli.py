"""`prefix-gateway experiments --url` as a process against a stub admin API on loopback: the
report as render_report writes it, the raw JSON, and a clear refusal when it cannot read."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from gateway import processes
from gateway.cli import ADMIN_KEY_ENV
from gateway.experiments import render_report
from tests.admin_stub import admin_stub, experiments_body

KEY = "sk-admin-for-the-experiments-cli"


def cli(*args: str, env_key: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != ADMIN_KEY_ENV}
    if env_key:
        env[ADMIN_KEY_ENV] = env_key
    return subprocess.run([sys.executable, "-m", "gateway.cli", "experiments", *args],
                          capture_output=True, text=True, timeout=60, env=env)


def test_the_cli_prints_the_report_and_the_json() -> None:
    body = experiments_body()
    with admin_stub({"/admin/experiments": body}, admin_key=KEY) as url:
        text = cli("--url", url, "--admin-key", KEY)
        raw = cli("--url", url + "/", "--json", env_key=KEY)
    assert text.returncode == 0, text.stderr
    assert text.stdout == render_report(body)
    assert "experiment llama-vs-qwen: mirror 100.0% of traffic class chat" in text.stdout
    assert "TTFT difference (candidate - baseline)" in text.stdout
    assert "conditions:" in text.stdout and "timeout=3" in text.stdout
    assert "DISABLED" in text.stdout and "not paired: a split" in text.stdout
    assert raw.returncode == 0, raw.stderr
    assert json.loads(raw.stdout) == body


def test_the_cli_says_why_it_cannot_read() -> None:
    with admin_stub({"/admin/experiments": experiments_body()}, admin_key=KEY) as url:
        refused = cli("--url", url)
        wrong = cli("--url", url, "--admin-key", "not-the-key")
    for r in (refused, wrong):
        assert r.returncode == 1 and r.stdout == ""
        assert "HTTP 401" in r.stderr and "--admin-key" in r.stderr
        assert "not-the-key" not in r.stderr and "Traceback" not in r.stderr
    with admin_stub({}) as url:  # a gateway without experiments support
        missing = cli("--url", url)
    assert missing.returncode == 1 and "404" in missing.stderr
    closed = f"http://127.0.0.1:{processes.free_ports(1)[0]}"
    gone = cli("--url", closed, "--timeout", "5")
    assert gone.returncode == 1
    assert f"cannot read {closed}/admin/experiments" in gone.stderr
    assert "Traceback" not in gone.stderr


def test_no_experiments_is_said_plainly() -> None:
    with admin_stub({"/admin/experiments": {"experiments": []}}) as url:
        r = cli("--url", url)
    assert r.returncode == 0 and r.stdout == "no experiments configured\n"
