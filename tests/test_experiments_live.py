"""Engine A/B experiments on live traffic, in process: mirror copies, split, the kill switch,
reloads, and what GET /admin/experiments reports."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import openai
import pytest

from backends.sim.app import SimApp
from backends.sim.replica import SimReplicaSpec
from backends.upstream.inprocess import Handler, HandlerResponse
from gateway.config import ConfigError, parse_config
from tests.conftest import eventually, tenant_prompt
from tests.inprocess import FAST_HEALTH, Harness, gateway, replica_answering, sim_handler


def ab_config(mode: str = "mirror", *, baseline: str = "fast", candidate: str = "slow",
              **experiment: Any) -> dict[str, Any]:
    """Two pools of two replicas each; the `chat` class is served by `baseline`."""
    def pool(name: str) -> dict[str, Any]:
        return {"name": name, "engine": "vllm", "models": ["tiny"], "health": FAST_HEALTH,
                "replicas": [{"name": f"{name}-{i}", "url": f"http://{name}-{i}.test:8000"}
                             for i in range(2)]}

    return {
        "pools": [pool("fast"), pool("slow")],
        "traffic_classes": [{"name": "chat", "pool": baseline},
                            {"name": "other", "pool": candidate}],
        "classification": {"default_class": "chat"},
        "experiments": [{"name": "ab", "traffic_class": "chat", "baseline": baseline,
                         "candidate": candidate, "mode": mode, **experiment}],
    }


def slow_sims(time_scale: float = 0.5) -> dict[str, Handler]:
    """The `slow` pool's replicas on the 32B profile (about 4x slower prefill than 8B)."""
    return {f"slow-{i}": sim_handler(SimApp.from_spec(SimReplicaSpec(
        name=f"slow-{i}", kind="vllm", models=("tiny",), profile="qwen-32b-h200",
        time_scale=time_scale))) for i in range(2)}


async def experiments(h: Harness, key: str | None = None) -> list[dict[str, Any]]:
    headers = {"Authorization": f"Bearer {key}"} if key else None
    resp = await h.http.get("/admin/experiments", headers=headers)
    assert resp.status_code == 200, resp.text
    return resp.json()["experiments"]


async def run_requests(h: Harness, n: int, concurrency: int = 8, stream: bool = False,
                       tenants: int = 12) -> list[Any]:
    client = h.openai()
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> Any:
        async with sem:
            messages = [{"role": "system", "content": tenant_prompt(i % tenants, 1200)},
                        {"role": "user", "content": f"question {i}"}]
            if stream:
                chunks = await client.chat.completions.create(
                    model="tiny", messages=messages, max_tokens=4, stream=True)
                return [c async for c in chunks]
            return await client.chat.completions.with_raw_response.create(
                model="tiny", messages=messages, max_tokens=4)

    return await asyncio.gather(*(one(i) for i in range(n)))


async def test_mirror_reports_a_slower_candidate_paired_and_the_client_gets_the_baseline():
    async with gateway(ab_config(), time_scale=0.5, handlers=slow_sims()) as h:
        replies = await run_requests(h, 300)
        assert {r.headers["x-gateway-pool"] for r in replies} == {"fast"}
        assert all(r.parse().choices[0].message.content for r in replies)

        async def settled() -> dict[str, Any] | None:
            exp = (await experiments(h))[0]
            return exp if exp["paired"] >= 290 else None

        exp = await eventually(settled)
        assert exp["mode"] == "mirror"
        assert exp["arms"]["baseline"]["pool"] == "fast"
        assert exp["arms"]["candidate"]["pool"] == "slow"
        assert exp["arms"]["baseline"]["requests"] == 300
        diff = exp["ttft_diff_s"]
        assert diff["ci95"][0] > 0, diff
        assert diff["conclusive"]
        assert exp["mirror"]["sent"] >= 290
        cond = exp["conditions"]
        assert cond["prompt_tokens"]["p50"] > 0
        assert cond["output_tokens"]["max"] == 4
        # Copies are not the clients' requests: the gateway's request counts hold 300.
        samples = await h.metrics()
        client = sum(s.value for s in samples if s.name == "gateway_requests_total")
        assert client == 300
        copies = {s.labels["result"]: s.value for s in samples
                  if s.name == "gateway_experiment_mirror_copies_total"}
        assert copies["sent"] == exp["mirror"]["sent"]
        arms = {(s.labels["arm"], s.labels["outcome"]): s.value for s in samples
                if s.name == "gateway_experiment_requests_total"}
        assert arms[("baseline", "ok")] == 300
        assert arms[("candidate", "ok")] >= 290


def test_bad_experiment_configs_are_rejected_with_a_clear_error():
    cases = [
        ({"baseline": "slow", "candidate": "fast"}, "is not the pool of traffic class"),
        ({"candidate": "nowhere"}, "candidate names unknown pool 'nowhere'"),
        ({"traffic_class": "nope"}, "unknown traffic class 'nope'"),
        ({"candidate": "fast"}, "candidate and baseline are the same pool"),
        ({"fraction": 1.5}, "less than or equal to 1"),
        ({"mode": "shadow"}, "'mirror' or 'split'"),
        ({"max_concurrency": 0}, "greater than or equal to 1"),
    ]
    for change, message in cases:
        cfg = ab_config()
        cfg["experiments"][0].update(change)
        with pytest.raises(ConfigError, match="experiments") as err:
            parse_config(cfg)
        assert message in str(err.value), (change, str(err.value))
    cfg = ab_config()
    cfg["experiments"].append({**cfg["experiments"][0]})
    with pytest.raises(ConfigError, match="names must be unique"):
        parse_config(cfg)
    cfg["experiments"][1]["name"] = "ab2"
    with pytest.raises(ConfigError, match="already in experiment 'ab'"):
        parse_config(cfg)
    cfg = ab_config()
    cfg["pools"][1]["models"] = ["other-model"]
    with pytest.raises(ConfigError, match=r"does not serve model\(s\) \['tiny'\]"):
        parse_config(cfg)


async def test_swapped_arms_give_the_opposite_sign():
    config = ab_config(baseline="slow", candidate="fast")
    # The slow pool at twice the latency of the mirror test's: the pools then differ by
    # far more than what a busy machine adds to either side's timing.
    async with gateway(config, time_scale=0.5, handlers=slow_sims(time_scale=1.0)) as h:
        replies = await run_requests(h, 200)
        assert {r.headers["x-gateway-pool"] for r in replies} == {"slow"}

        async def settled() -> dict[str, Any] | None:
            exp = (await experiments(h))[0]
            return exp if exp["paired"] >= 190 else None

        diff = (await eventually(settled))["ttft_diff_s"]
        assert diff["ci95"][1] < 0, diff


def answers(replies: list[Any]) -> list[tuple[str, str, Any]]:
    out = []
    for r in replies:
        body = r.parse()
        out.append((r.headers["x-gateway-pool"], body.choices[0].message.content,
                    body.usage.model_dump()))
    return out


async def test_the_client_gets_what_it_would_without_the_mirror():
    """Same prompts, same pools: with a mirror on, each answer (content, usage, the pool that
    served it) is the one a gateway without the experiment gives."""
    plain = ab_config()
    del plain["experiments"]
    # One at a time: concurrent requests land where the timing of the others sends them, so
    # which are cache hits (the usage's cached_tokens) would differ between any two runs.
    async with gateway(plain, time_scale=0.1, handlers=slow_sims(0.1)) as h:
        without = answers(await run_requests(h, 40, concurrency=1))
    async with gateway(ab_config(), time_scale=0.1, handlers=slow_sims(0.1)) as h:
        mirrored = answers(await run_requests(h, 40, concurrency=1))
        await eventually(lambda: experiments_paired(h, 40))
    assert mirrored == without


async def experiments_paired(h: Harness, n: int, key: str | None = None) -> bool:
    return (await experiments(h, key))[0]["paired"] >= n


def dead(status: int) -> Handler:
    return replica_answering(lambda: HandlerResponse(status, iter([b'{"error": "down"}'])))


async def test_a_failing_candidate_costs_the_client_nothing():
    """Candidate replicas that answer every request with 500: every client request succeeds
    on its first try, no baseline replica is retried or ejected; the copies count as failed."""
    handlers = {"slow-0": dead(500), "slow-1": dead(500)}
    async with gateway(ab_config(), time_scale=0.05, handlers=handlers) as h:
        replies = await run_requests(h, 30, concurrency=4)
        assert all(r.status_code == 200 for r in replies)
        assert {r.headers["x-gateway-pool"] for r in replies} == {"fast"}

        async def counted() -> dict[str, Any] | None:
            exp = (await experiments(h))[0]
            m = exp["mirror"]
            return exp if m["failed"] + m["dropped"] == 30 else None

        exp = await eventually(counted)
        assert exp["mirror"]["failed"] >= 1
        assert exp["arms"]["baseline"]["ok"] == 30
        assert exp["arms"]["candidate"]["ok"] == 0
        samples = await h.metrics()
        assert not [s for s in samples if s.name in (
            "gateway_retries_total", "gateway_tries_failed_total",
            "gateway_replica_ejections_total") and s.labels.get("pool") == "fast"]


async def test_a_candidate_pool_with_no_healthy_replica_drops_every_copy():
    never = replica_answering(lambda: HandlerResponse(200))

    async def down(method: str, target: str, headers: Mapping[str, str],
                   body: bytes) -> HandlerResponse:
        if target == "/health":
            return HandlerResponse(503)
        return await never(method, target, headers, body)

    async with gateway(ab_config(), time_scale=0.05,
                       handlers={"slow-0": down, "slow-1": down}) as h:
        replies = await run_requests(h, 20, concurrency=4)
        assert all(r.status_code == 200 for r in replies)
        exp = (await experiments(h))[0]
        assert exp["mirror"] == {"sent": 0, "dropped": 20, "failed": 0}
        assert exp["arms"]["baseline"]["ok"] == 20


async def test_copies_beyond_max_concurrency_are_dropped_and_tasks_stay_bounded():
    """A candidate that never answers: at most max_concurrency copies wait on it, the rest
    are dropped and counted, and the clients are answered all the same."""
    release = asyncio.Event()

    async def hang() -> HandlerResponse:
        await release.wait()
        return HandlerResponse(200)

    handlers = {"slow-0": replica_answering(hang), "slow-1": replica_answering(hang)}
    async with gateway(ab_config(max_concurrency=3), time_scale=0.05, handlers=handlers) as h:
        mirror = h.app.core.mirror
        replies = await run_requests(h, 25, concurrency=5)
        assert all(r.status_code == 200 for r in replies)
        # Copies are offered as each client is answered: all 25 were, so all were offered.
        assert len(mirror.tasks) == 3
        exp = (await experiments(h))[0]
        assert exp["mirror"] == {"sent": 3, "dropped": 22, "failed": 0}
        assert h.app.state.experiments.by_name["ab"].copies == 3
        replies = await run_requests(h, 25, concurrency=5)
        assert len(mirror.tasks) == 3
        assert (await experiments(h))[0]["mirror"]["dropped"] == 47
        # The kill switch cuts the copies in flight: the candidate stops at once.
        assert (await h.http.post("/admin/experiments/ab/disable")).status_code == 200
        await eventually(lambda: not mirror.tasks)
        exp = (await experiments(h))[0]
        assert exp["arms"]["candidate"]["errors"] == {"cancelled": 3}
        assert h.app.state.experiments.by_name["ab"].copies == 0
        assert (await h.http.post("/admin/experiments/ab/enable")).status_code == 200
        await run_requests(h, 2, concurrency=1)
        assert len(mirror.tasks) == 2
    # Stopping the gateway cancelled the hung copies.
    assert not mirror.tasks


async def test_split_keeps_each_prefix_on_one_side_and_sends_about_the_fraction():
    cfg = ab_config("split", fraction=0.3)
    async with gateway(cfg, time_scale=0.05, handlers=slow_sims(0.05)) as h:
        tenants = 60
        replies = await run_requests(h, tenants * 3, concurrency=8, tenants=tenants)
        side: dict[int, set[str]] = {}
        for i, r in enumerate(replies):
            side.setdefault(i % tenants, set()).add(r.headers["x-gateway-pool"])
        assert all(len(s) == 1 for s in side.values()), side
        share = sum(s == {"slow"} for s in side.values()) / tenants
        assert 0.15 <= share <= 0.45, share
        exp = (await experiments(h))[0]
        arms = exp["arms"]
        assert arms["candidate"]["requests"] == 3 * sum(s == {"slow"} for s in side.values())
        assert arms["baseline"]["requests"] + arms["candidate"]["requests"] == tenants * 3
        assert exp["paired"] == 0
        assert exp["mirror"]["sent"] == 0


ADMIN_KEY = "admin-secret-key"


def with_admin(cfg: dict[str, Any]) -> dict[str, Any]:
    from gateway.config import key_digest

    cfg["auth"] = {"admin_keys": [{"name": "ops", "key": key_digest(ADMIN_KEY)}]}
    return cfg


async def test_the_kill_switch_stops_copies_and_splits_at_once():
    for mode in ("mirror", "split"):
        cfg = with_admin(ab_config(mode, fraction=1.0))
        async with gateway(cfg, time_scale=0.05, handlers=slow_sims(0.05)) as h:
            admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
            assert (await h.http.post("/admin/experiments/ab/disable")).status_code == 401
            assert (await h.http.get("/admin/experiments")).status_code == 401
            first = await run_requests(h, 10, concurrency=2)
            resp = await h.http.post("/admin/experiments/ab/disable", headers=admin)
            assert resp.status_code == 200 and resp.json()["enabled"] is False
            off = await run_requests(h, 10, concurrency=2)
            body = (await h.http.get("/admin/experiments", headers=admin)).json()
            exp = body["experiments"][0]
            assert exp["enabled"] is False
            if mode == "mirror":
                assert exp["mirror"]["sent"] == 10
            else:
                assert {r.headers["x-gateway-pool"] for r in first} == {"slow"}
                assert {r.headers["x-gateway-pool"] for r in off} == {"fast"}
            resp = await h.http.post("/admin/experiments/ab/enable", headers=admin)
            assert resp.json()["enabled"] is True
            on = await run_requests(h, 10, concurrency=2)
            exp = (await h.http.get("/admin/experiments", headers=admin)).json()["experiments"][0]
            if mode == "mirror":
                assert exp["mirror"]["sent"] == 20
            else:
                assert {r.headers["x-gateway-pool"] for r in on} == {"slow"}
            resp = await h.http.post("/admin/experiments/nope/disable", headers=admin)
            assert resp.status_code == 404
            assert resp.json()["error"]["code"] == "experiment_not_found"


async def test_a_rate_limited_key_is_charged_once_per_request_with_a_mirror_on():
    from gateway.config import key_digest

    cfg = with_admin(ab_config())
    cfg["auth"]["api_keys"] = [{"name": "tenant", "key": key_digest("sk-tenant"),
                                "limits": {"requests_per_minute": 6}}]
    async with gateway(cfg, time_scale=0.05, handlers=slow_sims(0.05)) as h:
        client = h.openai(api_key="sk-tenant")
        for i in range(6):
            await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": f"hello {i}"}],
                max_tokens=2)
        await eventually(lambda: experiments_paired(h, 6, ADMIN_KEY))

        with pytest.raises(openai.RateLimitError):
            await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "one more"}], max_tokens=2)
        exp = (await experiments(h, ADMIN_KEY))[0]
        assert exp["mirror"]["sent"] == 6
        assert exp["arms"]["baseline"]["errors"] == {"rejected": 1}


async def test_a_reload_changes_experiments_without_a_restart():
    async with gateway(ab_config(), time_scale=0.05, handlers=slow_sims(0.05)) as h:
        fleet, state = h.app.fleet, h.app.state
        await run_requests(h, 10, concurrency=2)
        await eventually(lambda: experiments_paired(h, 10))
        # Unchanged: the record is kept.
        changes, not_applied = fleet.apply(parse_config(ab_config()))
        assert not [c for c in changes if "experiment" in c] and not not_applied
        assert (await experiments(h))[0]["paired"] == 10
        # Switched off in the file: kept, no more copies.
        changes, _ = fleet.apply(parse_config(ab_config(enabled=False)))
        assert "experiment ab disabled" in changes
        await run_requests(h, 5, concurrency=2)
        exp = (await experiments(h))[0]
        assert (exp["enabled"], exp["paired"], exp["mirror"]["sent"]) == (False, 10, 10)
        # Changed (now split): its measurements start again.
        changes, _ = fleet.apply(parse_config(ab_config("split", fraction=1.0)))
        assert "experiment ab changed (its measurements start again)" in changes
        replies = await run_requests(h, 5, concurrency=2)
        assert {r.headers["x-gateway-pool"] for r in replies} == {"slow"}
        exp = (await experiments(h))[0]
        assert (exp["mode"], exp["paired"], exp["arms"]["candidate"]["requests"]) == (
            "split", 0, 5)
        # Removed.
        plain = ab_config()
        del plain["experiments"]
        changes, _ = fleet.apply(parse_config(plain))
        assert "experiment ab removed" in changes
        assert await experiments(h) == []
        assert not state.experiments.by_class


async def test_split_under_admission_control_keeps_the_candidate_side_on_the_candidate():
    """The class's admission slot is its own pool's; a request split to the candidate stays
    there (it is not taken back to the baseline as if it had borrowed)."""
    cfg = ab_config("split", fraction=1.0)
    cfg["pools"][0]["max_inflight_per_replica"] = 4
    async with gateway(cfg, time_scale=0.05, handlers=slow_sims(0.05)) as h:
        replies = await run_requests(h, 12, concurrency=4)
        assert {r.headers["x-gateway-pool"] for r in replies} == {"slow"}
        stats = await h.stats()
        chat = next(c for c in stats["admission"]["classes"] if c["name"] == "chat")
        assert chat["inflight"] == 0  # every slot released
        exp = (await experiments(h))[0]
        assert exp["arms"]["candidate"]["ok"] == 12


async def test_a_mirror_fraction_samples_whole_prefixes():
    """fraction 0.5: a prefix is mirrored always or never (the candidate's cache sees each
    mirrored prefix's every request), and about half the prefixes are."""
    async with gateway(ab_config(fraction=0.5), time_scale=0.05,
                       handlers=slow_sims(0.05)) as h:
        core = h.app.core
        exp = h.app.state.experiments.by_name["ab"]
        tenants = 40
        mirrored = {}
        for t in range(tenants):
            for q in range(3):
                payload = {"model": "tiny", "max_tokens": 2, "messages": [
                    {"role": "system", "content": tenant_prompt(t, 1200)},
                    {"role": "user", "content": f"question {q}"}]}
                _, _, arm, pair = core._arm(_request(payload), exp, "chat")
                assert arm == "baseline"
                mirrored.setdefault(t, set()).add(pair is not None)
        assert all(len(v) == 1 for v in mirrored.values()), mirrored
        share = sum(v == {True} for v in mirrored.values()) / tenants
        assert 0.25 <= share <= 0.75, share
        replies = await run_requests(h, 36, concurrency=4, tenants=12)
        assert all(r.status_code == 200 for r in replies)
        report = (await experiments(h))[0]
        assert 0 < report["mirror"]["sent"] < 36
        assert report["mirror"]["sent"] % 3 == 0  # whole prefixes: 3 requests each


def _request(payload: dict[str, Any]) -> Any:
    import orjson

    from gateway.exchange import InferenceRequest

    return InferenceRequest("/v1/chat/completions", True, payload, orjson.dumps(payload),
                            "tiny", False)


async def test_an_experiments_class_is_timed_even_with_non_streaming_ttft_off():
    """Whole answers are passed through by default, with no first token to time; a class under
    an experiment is streamed from the replica all the same, so its pairs have a TTFT on both
    sides, and the client still gets a whole JSON answer."""
    cfg = ab_config()
    cfg["server"] = {"non_streaming_ttft": False}
    async with gateway(cfg, time_scale=0.05, handlers=slow_sims(0.05)) as h:
        replies = await run_requests(h, 10, concurrency=2)
        assert all(r.parse().choices[0].message.content for r in replies)
        assert all(r.parse().usage.completion_tokens == 4 for r in replies)
        await eventually(lambda: experiments_paired(h, 10))
        exp = (await experiments(h))[0]
        assert exp["arms"]["baseline"]["ttft_p50_s"] > 0
        assert exp["arms"]["candidate"]["ttft_p50_s"] > 0
        assert exp["ttft_diff_s"]["n"] == 10
        assert exp["conditions"]["output_tokens"]["max"] == 4


async def test_streams_without_usage_still_give_the_conditions_their_prompt_lengths():
    # A client's stream carries no usage unless it asks: the prompt lengths then come from
    # the router's estimate rather than going missing from the conditions.
    async with gateway(ab_config(), time_scale=0.5, handlers=slow_sims()) as h:
        await run_requests(h, 20, stream=True)

        async def settled() -> dict[str, Any] | None:
            exp = (await experiments(h))[0]
            return exp if exp["arms"]["baseline"]["requests"] == 20 else None

        prompt = (await eventually(settled))["conditions"]["prompt_tokens"]
        # tenant_prompt(i, 1200) is 1,200 characters, about 300 tokens at 4 per token.
        assert prompt["p50"] is not None and 200 < prompt["p50"] < 500, prompt


async def test_an_unchanged_experiment_is_not_bootstrapped_again(monkeypatch) -> None:
    """The page reads the reports every few seconds: an experiment with no new sample gives
    its last report again instead of bootstrapping its pairs anew; a new sample, a new one."""
    from gateway.experiments.live import LiveExperiment

    monkeypatch.setattr(LiveExperiment, "engines", lambda self: {})  # fixed engine figures
    async with gateway(ab_config(), time_scale=0.05, handlers=slow_sims(0.05)) as h:
        await run_requests(h, 5)
        await eventually(lambda: experiments_paired(h, 5))
        experiments_ = h.app.state.experiments
        first = await experiments_.reports_aside()
        assert (await experiments_.reports_aside())[0] is first[0]
        await run_requests(h, 1)
        await eventually(lambda: experiments_paired(h, 6))
        assert (await experiments_.reports_aside())[0]["paired"] == 6
