"""Admission control over real sockets: a gateway process in front of a simulated replica
process, a flood past the queue, clients that leave, and the stats CLI. The behaviour in
detail is tested in-process (tests/test_admission.py)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import httpx
import openai

from gateway import processes
from tests.conftest import eventually, start_gateway, start_sims, two_pool_config


def test_a_flood_past_the_queue_gets_429s_and_leaving_clients_free_everything(tmp_path) -> None:
    # Real-time latencies (time scale 1): a long generation stays in flight while the test runs.
    sims = start_sims(["vllm", "trtllm"], tmp_path, time_scale=1.0)
    config = two_pool_config(sims.urls[:1], sims.urls[1:], processes.free_ports(1)[0])
    config["pools"][0]["max_inflight_per_replica"] = 1
    config["traffic_classes"][0]["admission"] = {"max_queue": 2, "retry_after_s": 2}
    try:
        gw = start_gateway(config, tmp_path)
    except Exception:
        sims.stop()
        raise
    try:
        asyncio.run(flood(gw.url))
        table = subprocess.run([sys.executable, "-m", "gateway.cli", "stats", "--url", gw.url],
                               capture_output=True, text=True, check=True).stdout
        admission = table.split("admission\n", 1)[1]
        row = next(line.split() for line in admission.splitlines()
                   if line.split()[:1] == ["realtime"])
        assert row[:5] == ["realtime", "realtime", "0", "0", "0"]  # nothing left queued or held
        assert "queue_full=20" in row
    finally:
        gw.stop()
        sims.stop()


async def flood(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:

        async def realtime() -> dict:
            return next(c for c in (await http.get("/admin/stats")).json()["admission"]["classes"]
                        if c["name"] == "realtime")

        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        long = await client.completions.create(model="tiny", prompt="a long answer",
                                               max_tokens=4000, stream=True)
        await anext(aiter(long))  # it holds the replica's only slot

        async def one(prompt: str) -> httpx.Response:
            return await http.post("/v1/completions", json={"model": "tiny", "prompt": prompt,
                                                            "max_tokens": 2})

        queued = [asyncio.create_task(one(f"queued {i}")) for i in range(2)]

        async def two_queued() -> bool:
            return (await realtime())["queued"] == 2

        await eventually(two_queued, deadline_s=20)
        flooded = await asyncio.gather(*(one(f"flood {i}") for i in range(20)))
        assert {r.status_code for r in flooded} == {429}
        assert {r.headers["retry-after"] for r in flooded} == {"2"}
        assert {r.json()["error"]["code"] for r in flooded} == {"queue_full"}
        # The queued clients and the streaming one leave: their connections close.
        for task in queued:
            task.cancel()
        await asyncio.gather(*queued, return_exceptions=True)
        await long.close()

        async def all_free() -> bool:
            c = await realtime()
            return c["queued"] == 0 and c["inflight"] == 0

        await eventually(all_free, deadline_s=20)
        answer = await client.completions.create(model="tiny", prompt="after", max_tokens=2)
        assert answer.choices[0].text
        await client.close()
