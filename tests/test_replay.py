"""`python -m loadtests.replay` end to end: sims and a gateway as processes, JSON last.

The command's main() runs in the test process (the replicas and the gateway it starts are still
processes): a fourth interpreter per run would only repeat the imports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from aiohttp import web

from loadtests.gateways import main as gateways_main
from loadtests.replay import (
    REPLICA_HEADER,
    REQUIRED_KEYS,
    ReplayOptions,
    main,
    replay,
    summarize,
)
from loadtests.traces import MOONCAKE, ideal_hit_ratio, load_requests, prompt_text
from tests.test_traces import HAND_AGREEMENT, HAND_REPLICAS, HAND_TRACE

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def run(capsys, monkeypatch):
    """`python -m loadtests.replay ARGS --json` from the repository root: its JSON line."""
    monkeypatch.chdir(ROOT)

    def _run(args: list[str]) -> dict:
        code = main([*args, "--json"])
        out, err = capsys.readouterr()
        assert code == 0, err[-3000:]
        return json.loads(out.strip().splitlines()[-1])

    return _run


def _check(res: dict, limit: int, expected_ideal: float) -> None:
    for key in REQUIRED_KEYS:
        assert key in res, key
    assert res["requests"] == limit
    assert res["errors"] == 0, res.get("first_errors")
    assert 0.0 <= res["hit_ratio"] <= 1.0
    assert res["ideal_hit_ratio"] == pytest.approx(expected_ideal)
    # The replicas' own counters: every request served once, and the imbalance is theirs.
    per_replica = res["requests_per_replica"]
    assert sum(per_replica) == limit
    assert res["imbalance"] == pytest.approx(max(per_replica) * len(per_replica) / limit)
    assert res["ttft_p50_s"] > 0


def test_replay_workload_with_params_and_limit_json(run) -> None:
    # Three tenants instead of 150: a much higher ideal hit ratio than the default's; --limit
    # takes the first 24 of the 30 requests the params make.
    limit, params = 24, {"n_tenants": 3, "n_requests": 30}
    res = run(["--workload", "tenants", "--replicas", "2", "--limit", str(limit),
               "--speedup", "4", "--time-scale", "0.05", "--max-output", "8",
               *[f"--workload-param={k}={v}" for k, v in params.items()]])
    reqs = load_requests(None, "tenants", limit, 4, params)
    assert len(reqs) == limit < len(load_requests(None, "tenants", None, 4, params))
    assert ideal_hit_ratio(reqs) > ideal_hit_ratio(load_requests(None, "tenants", limit, 4)) + 0.1
    _check(res, limit, ideal_hit_ratio(reqs))
    assert res["policy"]
    assert res["source"] == "tenants"


def test_replay_mooncake_trace_with_policy(run) -> None:
    limit = 25
    # The repository's copy, named as a user would from the repository root.
    res = run(["--trace", str(MOONCAKE.relative_to(ROOT)), "--replicas", "3", "--limit",
                str(limit), "--speedup", "20", "--time-scale", "0.02", "--max-output", "8",
                "--policy", "round_robin"])
    reqs = load_requests(str(MOONCAKE), None, limit, 20)
    _check(res, limit, ideal_hit_ratio(reqs))
    assert res["policy"] == "round_robin"
    assert res["source"] == "synthetic_trace.jsonl"
    # round robin over 3 replicas: 25 requests split 9/8/8, so the busiest has 9 / (25 / 3).
    assert sorted(res["requests_per_replica"]) == [8, 8, 9]
    assert res["imbalance"] == pytest.approx(1.08)


def test_replay_sends_a_share_of_requests_non_streaming(run) -> None:
    # Half the requests as whole answers: the client sees no first token for them, and the
    # engines' own TTFT histograms count every request.
    limit = 24
    res = run(["--workload", "tenants", "--replicas", "2", "--limit", str(limit),
               "--speedup", "4", "--time-scale", "0.05", "--max-output", "8",
               "--stream-share", "0.5"])
    assert res["requests"] == limit and res["errors"] == 0, res.get("first_errors")
    assert res["streamed"] == limit // 2
    assert sum(res["requests_per_replica"]) == limit
    assert res["engine_ttft_mean_s"] > 0
    assert res["output_tokens"] == limit * 8  # every answer, streamed or whole, counted


def test_replay_on_replicas_that_allocate_kv_as_vllm_does(run) -> None:
    # 1,024-token prompts asking 400 tokens each on 4,096 KV tokens a replica: replicas that
    # reserve prompt plus output admit two at a time and never preempt; with --vllm-engines
    # they admit on the prompt, run out of blocks mid-decode and preempt, and every token
    # still arrives.
    limit = 24
    args = ["--workload", "tenants", "--replicas", "2", "--limit", str(limit), "--speedup", "4",
            "--time-scale", "0.05", "--max-output", "400", "--kv-capacity-tokens", "4096",
            *[f"--workload-param={k}={v}" for k, v in {
                "n_tenants": 3, "n_requests": 30, "system_blocks": 1, "query_blocks": 1,
                "output_tokens": 400}.items()]]
    reserving = run(args)
    assert reserving["errors"] == 0 and reserving["engine_preemptions"] == 0
    assert "vllm_engines" not in reserving
    lazy = run([*args, "--vllm-engines"])
    assert lazy["errors"] == 0, lazy.get("first_errors")
    assert lazy["vllm_engines"] is True and lazy["engine_preemptions"] > 0
    assert lazy["output_tokens"] == reserving["output_tokens"] == limit * 400


def test_vllm_engines_are_refused_with_trtllm_replicas(capsys, monkeypatch) -> None:
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as exc:
        main(["--workload", "tenants", "--replicas", "1", "--limit", "1", "--engine", "trtllm",
              "--vllm-engines"])
    assert "--vllm-engines needs --engine vllm" in str(exc.value)


# -- several gateways: round robin over them, and agreement --------------------------------


async def _scripted_gateways(n: int, replica_of: dict[str, str],
                             seen: list[list[str]]) -> tuple[list[str], list[web.AppRunner]]:
    """`n` stand-ins for gateways: each answers a streamed completion naming, in
    x-gateway-replica, the replica `replica_of` gives for its prompt, and records the prompts it
    received in `seen[i]`."""
    urls, runners = [], []
    for i in range(n):
        seen.append([])

        async def completions(request: web.Request, got: list[str] = seen[i]) -> web.StreamResponse:
            prompt = (await request.json())["prompt"]
            got.append(prompt)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               REPLICA_HEADER: replica_of[prompt]})
            await resp.prepare(request)
            await resp.write(b'data: {"choices":[{"text":"x"}]}\n\n')
            await resp.write(b"data: [DONE]\n\n")
            return resp

        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        urls.append(f"http://127.0.0.1:{port}")
        runners.append(runner)
    return urls, runners


async def test_replay_alternates_gateways_and_reports_agreement_from_the_replica_header() -> None:
    prompts = [prompt_text(r) for r in HAND_TRACE]
    assert len(set(prompts)) == len(prompts)
    seen: list[list[str]] = []
    urls, runners = await _scripted_gateways(
        2, dict(zip(prompts, HAND_REPLICAS, strict=True)), seen)
    try:
        data = await replay(",".join(urls), [], HAND_TRACE, ReplayOptions(max_output=4))
    finally:
        for r in runners:
            await r.cleanup()
    # Request i went to gateway i mod 2, and each answer's replica is read from its header.
    assert sorted(seen[0]) == sorted(prompts[0::2])
    assert sorted(seen[1]) == sorted(prompts[1::2])
    assert [r.replica for r in data.results] == HAND_REPLICAS
    res = summarize(data, HAND_TRACE, "scripted")
    assert (res["agreement"], res["warm_requests"]) == HAND_AGREEMENT
    assert res["gateways"] == 2
    assert res["requests_per_gateway"] == [4, 3]
    assert res["errors"] == 0 and res["errors_per_gateway"] == [0, 0]


def _hand_trace(tmp_path: Path) -> Path:
    """Nine requests 50 ms apart sharing their first two blocks, each with a third of its own."""
    trace = tmp_path / "hand.jsonl"
    trace.write_text("".join(
        json.dumps({"timestamp": 50 * i, "input_length": 1500, "output_length": 4,
                    "hash_ids": [11, 12, 100 + i]}) + "\n" for i in range(9)))
    return trace


@pytest.mark.parametrize(("gateways", "policy", "agreement", "shadow"), [
    # One gateway keeps the shared prefix on the replica that has it: every warm request
    # goes home, where the shadow single gateway sends it too.
    (1, "prefix_affinity", 1.0, 1.0),
    # Two gateways, each cycling over 2 replicas from the first: requests land on replicas
    # 0, 0, 1, 1, 0, 0, 1, 1, 0, so exactly half of the 8 warm ones follow the one before.
    # One gateway would have sent them to 0, 1, 0, 1, ...: the same replica for half of them.
    (2, "round_robin", 0.5, 0.5),
])
def test_replay_starts_gateways_on_one_config(run, tmp_path: Path, gateways: int, policy: str,
                                              agreement: float, shadow: float) -> None:
    # Sent one at a time (--concurrency-limit 1) so that no load ever moves a request.
    res = run(["--trace", str(_hand_trace(tmp_path)), "--replicas", "2",
               "--gateways", str(gateways), "--policy", policy, "--time-scale", "0.02",
               "--max-output", "4", "--concurrency-limit", "1", "--redis", "--shadow"])
    assert res["errors"] == 0, res.get("first_errors")
    assert res["gateways"] == gateways
    assert res["requests_per_gateway"] == ([9] if gateways == 1 else [5, 4])
    assert (res["agreement"], res["warm_requests"]) == (agreement, 8)
    assert (res["shadow_agreement"], res["shadow_warm_requests"]) == (shadow, 8)
    assert res["shadow_match_agreement"] >= shadow
    # Nothing is evicted: every warm request's prefix is held somewhere when it comes.
    assert (res["shadow_held_agreement"], res["shadow_held_requests"]) == (shadow, 8)
    assert sum(res["requests_per_replica"]) == 9
    # The gateways ran one configuration, with the Redis replay started, on ports of their own.
    names = ["gateway"] if gateways == 1 else [f"gateway-{i}" for i in range(gateways)]
    configs = [yaml.safe_load((Path(res["log_dir"]) / f"{n}.yaml").read_text()) for n in names]
    assert res["redis"] is True
    assert all(c["redis"]["url"].startswith("redis://127.0.0.1:") for c in configs)
    assert len({c.pop("server")["port"] for c in configs}) == gateways
    assert all(c == configs[0] for c in configs)
    assert configs[0]["routing"]["policy"] == policy


def test_gateways_table_runs_each_count_on_emptied_replicas(capsys, tmp_path: Path) -> None:
    # round_robin over 2 replicas: one gateway alternates them (no warm request goes to the
    # replica that served its prefix last; half go to its home, the first); two gateways both
    # start from the first, so half do by either count. Each run begins on emptied caches,
    # so both see the same hit ratio; with Redis each run has a key prefix of its own. One
    # request at a time, so each gateway receives its requests in order.
    trace = _hand_trace(tmp_path)
    out = tmp_path / "runs.jsonl"
    code = gateways_main(["--trace", str(trace), "--replicas", "2", "--counts", "1,2",
                          "--redis", "on", "--policy", "round_robin", "--time-scale", "0.02",
                          "--max-output", "4", "--concurrency-limit", "1",
                          "--output", str(out)])
    table = capsys.readouterr().out
    assert code == 0
    runs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["gateways"], r["redis"], r["agreement"], r["agreement_last"])
            for r in runs] == [(1, True, 0.5, 0.0), (2, True, 0.5, 0.5)]
    assert all(r["errors"] == 0 and r["requests"] == 9 for r in runs)
    assert runs[0]["hit_ratio"] == pytest.approx(runs[1]["hit_ratio"])
    assert runs[0]["redis_key_prefix"] != runs[1]["redis_key_prefix"]
    # Each gateway's speeds at the end, as its /admin/stats shows them: one per gateway, one
    # per replica (equal replicas, few requests: all at 1).
    assert [r["speeds_by_gateway"] for r in runs] == [
        [{"sim-0": 1.0, "sim-1": 1.0}], [{"sim-0": 1.0, "sim-1": 1.0}] * 2]
    rows = [line for line in table.splitlines() if line.startswith("| 1 ") or
            line.startswith("| 2 ")]
    assert len(rows) == 2 and all("| yes |" in row for row in rows)
    assert "| 0.500 | 0.000 | 8 |" in rows[0] and "| 0.500 | 0.500 | 8 |" in rows[1]


def test_gateways_runs_on_a_fleet_of_mixed_speeds(capsys, tmp_path: Path) -> None:
    # --fleet as in replay and compare_http: the replicas and their speeds, named in the
    # table's heading; the replica count is the fleet's.
    trace = _hand_trace(tmp_path)
    out = tmp_path / "runs.jsonl"
    code = gateways_main(["--trace", str(trace), "--fleet", "llama-8b-h200:1,qwen-32b-h200:1",
                          "--counts", "1", "--policy", "round_robin", "--time-scale", "0.02",
                          "--max-output", "4", "--concurrency-limit", "1",
                          "--output", str(out)])
    assert code == 0
    assert "2 replicas (1 x llama-8b-h200 + 1 x qwen-32b-h200" in capsys.readouterr().out
    [run] = [json.loads(line) for line in out.read_text().splitlines()]
    assert (run["requests"], run["errors"], run["replicas"]) == (9, 0, 2)
