"""`prefix-gateway up --engine vllm-cpu`: the embedded default on real vLLM CPU replicas.

Its own module, so that no other real engine is up while it runs on the machine's two cores.
"""

from __future__ import annotations

import os
import signal
import sys

import openai
import pytest

from gateway import processes
from tests.conftest import poll
from tests.test_cli_up import alive, children_of

pytestmark = pytest.mark.engine


def test_up_runs_the_default_on_real_vllm_and_stops_it(tmp_path) -> None:
    # Below the ephemeral range: the engines bind their ports only once vLLM has imported,
    # and the gateway its own once they serve.
    base = processes.consecutive_free_ports(3)
    port = base + 2
    url = f"http://127.0.0.1:{port}"
    proc = processes.spawn([sys.executable, "-m", "gateway.cli", "up", "--engine", "vllm-cpu",
                            "--port", str(port), "--realtime-replicas", "1",
                            "--batch-replicas", "1", "--engine-base-port", str(base),
                            "--log-dir", str(tmp_path)], str(tmp_path / "up.log"))
    try:
        # Generous: two engines start at once on two cores other work may also want.
        processes.wait_healthy([url], [proc], deadline_s=960, path="/ready")
        engines = children_of(proc.pid)
        assert len(engines) == 2
        # Each vLLM API server has an EngineCore child: everything below must stop too.
        tree, frontier = set(engines), set(engines)
        while frontier:
            frontier = set().union(*(children_of(p) for p in frontier)) - tree
            tree |= frontier
        assert len(tree) > len(engines)
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)
        rt = c.chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=2)
        assert rt.headers["x-gateway-replica"] == "realtime-0"
        assert rt.parse().usage.prompt_tokens > 0
        bt = c.completions.with_raw_response.create(
            model="tiny", prompt="hello", max_tokens=2, extra_headers={"x-traffic-class": "batch"})
        assert bt.headers["x-gateway-replica"] == "batch-0"
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=180)
        poll(lambda: not any(alive(p) for p in tree), deadline_s=180)
    finally:
        processes.stop_all([proc])
