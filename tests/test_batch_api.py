"""The OpenAI Batch API through the official `openai` client: a gateway in-process, its
batches and files in a real redis-server, its replicas simulated."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

import openai
import orjson
import pytest

from backends.sim.app import SimApp
from backends.sim.replica import SimReplicaSpec
from backends.upstream.inprocess import HandlerResponse
from gateway import processes
from gateway.config import key_digest
from tests.conftest import eventually
from tests.inprocess import gateway, sim_handler, two_pools

SYSTEM = "You are the support assistant of ACME; answer in one short sentence. " * 40
OTHER = "You translate English to French, word for word, without comment. " * 40
ENDED = ("completed", "failed", "expired", "cancelled")


def chat_line(cid: str, question: str, *, system: str = SYSTEM, max_tokens: int = 4,
              **body: Any) -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny", "max_tokens": max_tokens,
                     "messages": [{"role": "system", "content": system},
                                  {"role": "user", "content": question}], **body}}


def jsonl(lines: list[Any]) -> bytes:
    return b"".join((x if isinstance(x, bytes) else orjson.dumps(x)) + b"\n" for x in lines)


def config(redis_server, **batch: Any) -> dict[str, Any]:
    cfg = two_pools()
    cfg["redis"] = redis_server.config()
    cfg["batch"] = {"poll_interval_s": 0.2, **batch}
    return cfg


async def finished(client: openai.AsyncOpenAI, batch_id: str, statuses=ENDED,
                   deadline_s: float = 30.0):
    """The batch once its status is one of `statuses` (polled, with a deadline)."""
    end = time.monotonic() + deadline_s
    while True:
        batch = await client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        assert time.monotonic() < end, f"batch still {batch.status}: {batch}"
        await asyncio.sleep(0.02)


async def lines_of(client: openai.AsyncOpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    content = (await client.files.content(file_id)).content
    return [orjson.loads(x) for x in content.splitlines()]


async def submit(client: openai.AsyncOpenAI, data: bytes, **kw: Any):
    f = await client.files.create(file=("input.jsonl", data), purpose="batch")
    kw.setdefault("endpoint", "/v1/chat/completions")
    kw.setdefault("completion_window", "24h")
    return await client.batches.create(input_file_id=f.id, **kw)


async def set_failing(gw, names: list[str], failing: bool) -> None:
    for name in names:
        await gw.sims[name].handle("POST", "/sim/fail" if failing else "/sim/recover", {}, b"")


# The whole flow ---------------------------------------------------------------------------


async def test_a_batch_runs_to_completed_with_its_output_and_error_files(redis_server) -> None:
    good = [chat_line(f"ok-{i}", f"Question {i}?") for i in range(8)]
    good += [chat_line(f"fr-{i}", f"Sentence {i}.", system=OTHER) for i in range(2)]
    bad = [
        b'{"custom_id": "broken", "method": "POST"',                     # not JSON
        b"[1, 2, 3]",                                                    # not an object
        {"method": "POST", "url": "/v1/chat/completions", "body": {}},   # no custom_id
        chat_line("ok-0", "again"),                                      # duplicate custom_id
        {**chat_line("wrong-url", "x"), "url": "/v1/completions"},
        {**chat_line("wrong-method", "x"), "method": "GET"},
        {**chat_line("body-string", "x"), "body": "hello"},
        chat_line("other-model", "x", model="gpt-unknown"),
        chat_line("streams", "x", stream=True),
        {**chat_line("no-messages", "x"), "body": {"model": "tiny"}},
        chat_line("engine-refuses", "x", n=2),                           # the replica's 400
    ]
    data = jsonl([*good[:5], b"", *bad, *good[5:]])  # a blank line is skipped, not a request
    async with gateway(config(redis_server)) as gw:
        c = gw.openai()
        batch = await submit(c, data, metadata={"team": "support"})
        assert batch.status == "validating"
        assert batch.metadata == {"team": "support"}
        batch = await finished(c, batch.id)

        assert batch.status == "completed"
        assert batch.request_counts.total == 21
        assert batch.request_counts.completed == 10
        assert batch.request_counts.failed == 11
        assert batch.errors is None and batch.model == "tiny"
        assert batch.expires_at == batch.created_at + 24 * 3600
        assert batch.created_at <= batch.in_progress_at <= batch.finalizing_at \
            <= batch.completed_at
        assert batch.failed_at is batch.cancelled_at is batch.expired_at is None

        out = await lines_of(c, batch.output_file_id)
        assert [x["custom_id"] for x in out] == [g["custom_id"] for g in good]  # input order
        for x in out:
            assert x["id"].startswith("batch_req_") and x["error"] is None
            response = x["response"]
            assert response["status_code"] == 200
            assert response["request_id"].startswith("req_")
            assert response["body"]["object"] == "chat.completion"
            assert response["body"]["choices"][0]["message"]["content"]
        assert len({x["id"] for x in out}) == len(out)

        errors = await lines_of(c, batch.error_file_id)
        codes = {(x["custom_id"], x["error"]["code"] if x["error"] else
                  x["response"]["status_code"]) for x in errors}
        assert codes == {
            (None, "invalid_json"), (None, "missing_custom_id"),
            ("ok-0", "duplicate_custom_id"), ("wrong-url", "invalid_url"),
            ("wrong-method", "invalid_method"), ("body-string", "invalid_body"),
            ("other-model", "model_not_found"), ("streams", "invalid_request"),
            ("no-messages", "missing_required_parameter"), ("engine-refuses", 400)}
        assert len(errors) == 11  # two lines are invalid JSON
        assert [x["error"]["line"] for x in errors if x["error"]] == list(range(7, 17))
        refused = next(x for x in errors if x["custom_id"] == "engine-refuses")
        assert refused["error"] is None
        assert refused["response"]["body"]["error"]["message"]

        # The engines' own prefix-cache figures, summed over the responses.
        usages = [x["response"]["body"]["usage"] for x in out]
        prompt = sum(u["prompt_tokens"] for u in usages)
        cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
        assert batch.usage.input_tokens == prompt
        assert batch.usage.input_tokens_details.cached_tokens == cached
        assert batch.usage.output_tokens == sum(u["completion_tokens"] for u in usages)
        extra = batch.model_extra["prefix_cache"]
        assert extra == {"prompt_tokens": prompt, "cached_tokens": cached,
                         "hit_ratio": round(cached / prompt, 4)}
        # Lines sharing the system prompt ran after their group's first line had it cached.
        assert cached > 0

        output = await c.files.retrieve(batch.output_file_id)
        assert output.purpose == "batch_output" and output.bytes > 0
        assert output.filename == f"{batch.id}_output.jsonl"
        assert (await c.files.content(batch.input_file_id)).content == data


async def test_completions_lines_and_lines_sharing_a_prefix_run_one_after_another(
        redis_server) -> None:
    """A /v1/completions batch: with concurrency 1, the engine sees the lines in prompt order
    (so shared prefixes are adjacent), whatever their order in the file."""
    seen: list[str] = []
    sims: dict[str, SimApp] = {}

    async def recording(name: str):
        sim = sims[name] = SimApp.from_spec(SimReplicaSpec(name=name, kind="trtllm",
                                                           models=("tiny",), time_scale=0.02))
        inner = sim_handler(sim)

        async def handle(method: str, path: str, headers: Mapping[str, str],
                         body: bytes) -> HandlerResponse:
            if path == "/v1/completions":
                seen.append(orjson.loads(body)["prompt"])
            return await inner(method, path, headers, body)
        return handle

    handlers = {name: await recording(name) for name in ("bt-0", "bt-1")}
    prompts = ["beta: two", "alpha: one", "gamma", "alpha: three", "beta: four"]
    lines = [{"custom_id": f"p{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "tiny", "prompt": p, "max_tokens": 2}}
             for i, p in enumerate(prompts)]
    try:
        async with gateway(config(redis_server, concurrency=1), handlers=handlers) as gw:
            c = gw.openai()
            batch = await finished(c, (await submit(c, jsonl(lines),
                                                    endpoint="/v1/completions")).id)
            assert batch.status == "completed" and batch.request_counts.completed == 5
            out = await lines_of(c, batch.output_file_id)
            assert [x["custom_id"] for x in out] == ["p0", "p1", "p2", "p3", "p4"]
            assert all(x["response"]["body"]["object"] == "text_completion" for x in out)
            assert seen == sorted(prompts)
    finally:
        for sim in sims.values():
            sim.close()


async def test_a_429_or_an_outage_is_waited_out_never_written_as_a_failure(
        redis_server) -> None:
    """Admission control's 429 (here a replica's own) means "later": the line keeps its lease
    and is tried again."""
    sims: dict[str, SimApp] = {}
    refused = {"left": 6}

    def crowded(name: str):
        sim = sims[name] = SimApp.from_spec(SimReplicaSpec(name=name, kind="trtllm",
                                                           models=("tiny",), time_scale=0.02))
        inner = sim_handler(sim)

        async def handle(method: str, path: str, headers: Mapping[str, str],
                         body: bytes) -> HandlerResponse:
            if path.startswith("/v1/") and refused["left"] > 0:
                refused["left"] -= 1
                return HandlerResponse(429, b'{"error": {"message": "queue full", "type": '
                                       b'"rate_limit_error", "code": "queue_full"}}',
                                       {"Retry-After": "0"})
            return await inner(method, path, headers, body)
        return handle

    handlers = {name: crowded(name) for name in ("bt-0", "bt-1")}
    try:
        async with gateway(config(redis_server), handlers=handlers) as gw:
            c = gw.openai()
            # Prompts sharing nothing: no line waits for another's prefix.
            lines = [chat_line(f"q{i}", "Question?", system=f"{i} " * 300) for i in range(4)]
            batch = await finished(c, (await submit(c, jsonl(lines))).id)
            assert refused["left"] == 0
            assert batch.status == "completed"
            assert (batch.request_counts.completed, batch.request_counts.failed) == (4, 0)
            assert batch.error_file_id is None
            retried = sum(s.value for s in await gw.metrics()
                          if s.name == "gateway_batch_lines_total"
                          and s.labels["result"] == "retried")
            assert retried >= 6
    finally:
        for sim in sims.values():
            sim.close()


# Listing, cancelling, expiry, deleting ----------------------------------------------------


async def test_files_and_batches_are_listed_newest_first_a_page_at_a_time(
        redis_server) -> None:
    async with gateway(config(redis_server)) as gw:
        c = gw.openai()
        data = jsonl([chat_line("a", "x")])
        ids = [(await c.files.create(file=(f"f{i}.jsonl", data), purpose="batch")).id
               for i in range(3)]
        first = await c.files.list(limit=2)
        assert [f.id for f in first.data] == ids[:0:-1] and first.has_more
        assert [f.id async for f in c.files.list(limit=2)] == ids[::-1]
        assert [f.id async for f in c.files.list(limit=1, order="asc")] == ids
        assert [f.id async for f in c.files.list(purpose="batch_output")] == []

        batches = [(await c.batches.create(input_file_id=i, endpoint="/v1/chat/completions",
                                           completion_window="24h")).id for i in ids]
        page = await c.batches.list(limit=2)
        assert [b.id for b in page.data] == batches[:0:-1] and page.has_more
        assert [b.id async for b in c.batches.list(limit=2)] == batches[::-1]
        for b in batches:
            await finished(c, b)
        outputs = [f async for f in c.files.list(purpose="batch_output")]
        assert len(outputs) == 3 and all(f.purpose == "batch_output" for f in outputs)


async def test_each_client_key_sees_only_its_own_files_and_batches(redis_server) -> None:
    cfg = config(redis_server)
    cfg["classification"].pop("api_keys", None)
    cfg["auth"] = {"api_keys": [{"name": "team-a", "key": key_digest("sk-a")},
                                {"name": "team-b", "key": key_digest("sk-b")}]}
    async with gateway(cfg) as gw:
        a, b = gw.openai(api_key="sk-a"), gw.openai(api_key="sk-b")
        batch = await submit(a, jsonl([chat_line("one", "Hello?")]))
        done = await finished(a, batch.id)
        assert done.status == "completed"
        mine = [done.input_file_id, done.output_file_id]
        # Its owner lists, reads and fetches them ...
        assert {f.id for f in (await a.files.list()).data} == set(mine)
        assert [x.id for x in (await a.batches.list()).data] == [batch.id]
        assert [line["custom_id"] for line in await lines_of(a, done.output_file_id)] == ["one"]
        # ... another key sees none of it, as if it did not exist, and cannot use it.
        assert (await b.files.list()).data == []
        assert (await b.batches.list()).data == []
        for call in (lambda: b.batches.retrieve(batch.id),
                     lambda: b.batches.cancel(batch.id),
                     lambda: b.files.retrieve(mine[0]),
                     lambda: b.files.content(mine[1]),
                     lambda: b.files.delete(mine[0]),
                     lambda: b.batches.create(input_file_id=mine[0], completion_window="24h",
                                              endpoint="/v1/chat/completions")):
            with pytest.raises(openai.NotFoundError):
                await call()
        assert (await a.files.retrieve(mine[0])).id == mine[0]  # not deleted by the other key


async def test_a_file_is_deleted(redis_server) -> None:
    async with gateway(config(redis_server)) as gw:
        c = gw.openai()
        f = await c.files.create(file=("x.jsonl", jsonl([chat_line("a", "x")])),
                                 purpose="batch")
        assert (await c.files.retrieve(f.id)).filename == "x.jsonl"
        deleted = await c.files.delete(f.id)
        assert deleted.id == f.id and deleted.deleted
        for call in (c.files.retrieve, c.files.content, c.files.delete):
            with pytest.raises(openai.NotFoundError):
                await call(f.id)
        assert [x.id async for x in c.files.list()] == []


async def test_cancel_stops_new_lines_and_ends_cancelled_with_partial_files(
        redis_server) -> None:
    lines = [chat_line(f"q{i}", f"Question {i}?", max_tokens=20) for i in range(6)]
    async with gateway(config(redis_server, concurrency=1), time_scale=1.0) as gw:
        c = gw.openai()
        batch = await submit(c, jsonl(lines))
        async def one_done() -> bool:
            return (await c.batches.retrieve(batch.id)).request_counts.completed >= 1

        await eventually(one_done, deadline_s=30)
        # The replicas stop answering: whatever the runner starts now waits, so the cancel
        # surely finds lines not yet run.
        await set_failing(gw, ["bt-0", "bt-1"], True)
        cancelling = await c.batches.cancel(batch.id)
        assert cancelling.status in ("cancelling", "cancelled")
        assert cancelling.cancelling_at is not None
        batch = await finished(c, batch.id)
        assert batch.status == "cancelled" and batch.cancelled_at is not None
        counts = batch.request_counts
        assert counts.total == 6 and counts.completed >= 1 and counts.failed >= 1
        assert counts.completed + counts.failed == 6
        out = await lines_of(c, batch.output_file_id)
        errors = await lines_of(c, batch.error_file_id)
        assert len(out) == counts.completed and len(errors) == counts.failed
        assert {x["error"]["code"] for x in errors} == {"batch_cancelled"}
        assert {x["custom_id"] for x in out + errors} == {f"q{i}" for i in range(6)}
        # Cancelling again is harmless; a finished batch cannot be cancelled.
        assert (await c.batches.cancel(batch.id)).status == "cancelled"
        await set_failing(gw, ["bt-0", "bt-1"], False)
        done = await finished(c, (await submit(c, jsonl(lines[:1]))).id)
        with pytest.raises(openai.BadRequestError) as exc:
            await c.batches.cancel(done.id)
        assert exc.value.code == "batch_not_cancellable"


async def test_a_batch_cancelled_at_once_ends_cancelled_with_every_line_accounted_for(
        redis_server) -> None:
    async with gateway(config(redis_server)) as gw:
        c = gw.openai()
        await set_failing(gw, ["bt-0", "bt-1"], True)  # nothing can finish meanwhile
        batch = await submit(c, jsonl([chat_line(f"q{i}", "x") for i in range(4)]))
        await c.batches.cancel(batch.id)  # while validating, or just after
        batch = await finished(c, batch.id)
        assert batch.status == "cancelled" and batch.request_counts.completed == 0
        errors = await lines_of(c, batch.error_file_id)
        assert batch.request_counts.failed == batch.request_counts.total == len(errors)
        assert {x["error"]["code"] for x in errors} <= {"batch_cancelled"}


async def test_lines_not_run_within_the_completion_window_expire(redis_server,
                                                                   monkeypatch) -> None:
    # The runner's clock is 2 s ahead: the window has passed when it first sees the batch,
    # still validating (which a 1 s window in whole seconds allows on any machine). It is
    # validated all the same, so that each request gets its error line.
    for module in ("runner", "lifecycle"):
        monkeypatch.setattr(f"gateway.batch.{module}.now_s", lambda: int(time.time()) + 2)
    async with gateway(config(redis_server)) as gw:
        c = gw.openai()
        await set_failing(gw, ["bt-0", "bt-1"], True)  # nothing can run
        batch = await submit(c, jsonl([chat_line(f"q{i}", "x") for i in range(3)]),
                             completion_window="1s")
        assert batch.expires_at == batch.created_at + 1
        batch = await finished(c, batch.id)
        assert batch.status == "expired" and batch.expired_at >= batch.expires_at
        assert batch.request_counts.total == batch.request_counts.failed == 3
        assert batch.output_file_id is None
        errors = await lines_of(c, batch.error_file_id)
        assert sorted(x["custom_id"] for x in errors) == ["q0", "q1", "q2"]
        assert {x["error"]["code"] for x in errors} == {"batch_expired"}


async def test_a_gateway_stopped_gracefully_gives_its_lines_back_at_once(redis_server) -> None:
    # Leases of an hour: the second gateway can only finish the batch if the first one gave
    # its lines back when it stopped.
    cfg = config(redis_server, lease_s=3600, concurrency=2)
    async with gateway(cfg) as first:
        c = first.openai()
        await set_failing(first, ["bt-0", "bt-1"], True)
        batch = await submit(c, jsonl([chat_line(f"q{i}", "x") for i in range(4)]))
        async def both_leased() -> bool:
            return any(s.name == "gateway_batch_lines_in_flight" and s.value == 2
                       for s in await first.metrics())

        await eventually(both_leased, deadline_s=30)
    async with gateway(cfg) as second:
        c = second.openai()
        batch = await finished(c, batch.id)
        assert batch.status == "completed" and batch.request_counts.completed == 4
        assert len(await lines_of(c, batch.output_file_id)) == 4


# Bad input --------------------------------------------------------------------------------


async def test_whole_file_problems_fail_the_batch_with_openai_errors(redis_server) -> None:
    cases = {
        "empty_file": (b"\n \n", "/v1/chat/completions"),
        "invalid_file_format": (b"hello\nworld\n", "/v1/chat/completions"),
        "too_many_requests": (jsonl([chat_line(f"q{i}", "x") for i in range(4)]),
                              "/v1/chat/completions"),
        "invalid_endpoint": (jsonl([chat_line("q", "x")]), "/v1/embeddings"),
    }
    async with gateway(config(redis_server, max_lines=3)) as gw:
        c = gw.openai()
        for code, (data, endpoint) in cases.items():
            batch = await finished(c, (await submit(c, data, endpoint=endpoint)).id)
            assert batch.status == "failed", code
            assert batch.failed_at is not None and batch.in_progress_at is None
            assert [e.code for e in batch.errors.data] == [code]
            assert batch.errors.data[0].message
            assert batch.output_file_id is batch.error_file_id is None
        binary = await submit(c, b"\xff\xfe\x00garbage")
        assert (await finished(c, binary.id)).errors.data[0].code == "invalid_file_format"


async def test_bad_requests_get_openai_errors(redis_server) -> None:
    async with gateway(config(redis_server, max_file_bytes=4096)) as gw:
        c = gw.openai()
        small = jsonl([chat_line("a", "x")])
        with pytest.raises(openai.BadRequestError) as exc:
            await c.files.create(file=("x.jsonl", small), purpose="fine-tune")
        assert exc.value.body["param"] == "purpose"
        with pytest.raises(openai.APIStatusError) as exc:
            await c.files.create(file=("x.jsonl", b"x" * 8192), purpose="batch")
        assert exc.value.status_code == 413 and exc.value.body["code"] == "file_too_large"
        r = await gw.http.post("/v1/files", json={"purpose": "batch"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "file"
        r = await gw.http.post("/v1/files", content=b"--x\r\nbroken",
                               headers={"content-type": "multipart/form-data; boundary=x"})
        assert r.status_code == 400 and "error" in r.json()

        for call in (c.batches.retrieve, c.batches.cancel):
            with pytest.raises(openai.NotFoundError) as exc:
                await call("batch_nope")
            assert exc.value.code == "batch_not_found"
        with pytest.raises(openai.NotFoundError):
            await c.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions",
                                   completion_window="24h")
        f = await c.files.create(file=("x.jsonl", small), purpose="batch")
        for kw, param in (({"completion_window": "tomorrow"}, "completion_window"),
                          ({"completion_window": "31d"}, "completion_window"),
                          ({"metadata": {"k" * 65: "v"}}, "metadata")):
            with pytest.raises(openai.BadRequestError) as exc:
                await c.batches.create(**{"input_file_id": f.id,
                                          "endpoint": "/v1/chat/completions",
                                          "completion_window": "24h", **kw})
            assert exc.value.body["param"] == param
        for body in ({"input_file_id": f.id, "completion_window": "24h"},
                     {"input_file_id": f.id, "endpoint": "/v1/completions",
                      "completion_window": "24h", "colour": "red"}):
            r = await gw.http.post("/v1/batches", json=body)
            assert r.status_code == 400 and r.json()["error"]["message"]
        r = await gw.http.post("/v1/batches", content=b"{not json")
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        done = await finished(c, (await submit(c, small)).id)
        with pytest.raises(openai.BadRequestError) as exc:  # an output file is no input
            await c.batches.create(input_file_id=done.output_file_id,
                                   endpoint="/v1/chat/completions", completion_window="24h")
        assert exc.value.body["param"] == "input_file_id"
        for query in ("limit=0", "limit=abc", "order=up", "after=file-nope"):
            r = await gw.http.get(f"/v1/files?{query}")
            assert r.status_code == 400 and r.json()["error"]["param"], query
        for query in ("limit=101", "after=batch_nope"):
            r = await gw.http.get(f"/v1/batches?{query}")
            assert r.status_code == 400 and r.json()["error"]["param"], query


# Without Redis ----------------------------------------------------------------------------


async def test_without_redis_the_batch_api_says_how_to_turn_it_on() -> None:
    async with gateway(two_pools()) as gw:
        c = gw.openai()
        calls = [lambda: c.files.create(file=("x.jsonl", b"{}\n"), purpose="batch"),
                 lambda: c.files.list(), lambda: c.files.retrieve("file-x"),
                 lambda: c.batches.create(input_file_id="file-x",
                                          endpoint="/v1/chat/completions",
                                          completion_window="24h"),
                 lambda: c.batches.list(), lambda: c.batches.cancel("batch_x")]
        for call in calls:
            with pytest.raises(openai.BadRequestError) as exc:
                await call()
            assert exc.value.code == "batch_api_needs_redis"
            assert "--redis-url" in exc.value.message
            assert "PREFIX_GATEWAY_REDIS_URL" in exc.value.message
        reply = await c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert reply.choices[0].message.content


async def test_an_unreachable_redis_answers_503_and_leaves_serving_alone(caplog) -> None:
    caplog.set_level(logging.INFO, logger="prefix_gateway.batch")
    cfg = two_pools()
    cfg["redis"] = {"url": f"redis://127.0.0.1:{processes.free_ports(1)[0]}/0",
                    "timeout_s": 0.5}
    async with gateway(cfg) as gw:
        c = gw.openai()
        with pytest.raises(openai.InternalServerError) as exc:
            await c.batches.list()
        assert exc.value.status_code == 503 and exc.value.code == "redis_unavailable"
        reply = await c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert reply.choices[0].message.content
        samples = [s for s in await gw.metrics() if s.name == "gateway_redis_up"]
        assert [s.value for s in samples] == [0.0]
        with pytest.raises(openai.InternalServerError):
            await c.files.list()
    # Said once, however often it was found so.
    said = [r.getMessage() for r in caplog.records if "not reachable" in r.getMessage()]
    assert len(said) == 1 and "retrying in the background" in said[0]
