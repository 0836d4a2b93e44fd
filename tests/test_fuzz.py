"""Schemathesis against a real gateway process: every /v1 operation of the gateway's OpenAPI
document, with generated valid and invalid requests, and chained file -> batch workflows; no
5xx ever, every error in OpenAI's shape, every response as the document says.

Bounded and reproducible: derandomized; every operation gets schemathesis' coverage phase (each
field's boundary and invalid values, as the document defines them: most of the requests) and
a fixed number of generated examples."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis.stateful import run_state_machine_as_test  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    negative_data_rejection,
    positive_data_acceptance,
)

from gateway import processes  # noqa: E402
from gateway.openapi import v1_openapi  # noqa: E402
from tests.conftest import Gateway, Sims, start_gateway, start_sims, two_pool_config  # noqa: E402

FUZZ = settings(max_examples=10, derandomize=True, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))
# negative_data_rejection: the gateway checks only the fields routing reads and forwards the
# rest (temperature, service_tier, ...) to the engine unchanged, as documented; an engine that
# accepts an out-of-range value is not the gateway's defect. positive_data_acceptance: valid
# data may still name a file or batch that does not exist (404).
EXCLUDED = [negative_data_rejection, positive_data_acceptance]


def _is_openai_error(body: object) -> bool:
    if not isinstance(body, dict) or set(body) != {"error"}:
        return False
    err = body["error"]
    return (isinstance(err, dict) and {"message", "type", "param", "code"} <= set(err)
            and isinstance(err["message"], str) and isinstance(err["type"], str))


def openai_error_body(ctx, response, case) -> bool:
    """Every 4xx and 5xx carries OpenAI's error body, as JSON. Passed as an additional check
    (not registered with @schemathesis.check too, which ran it twice per response)."""
    if response.status_code < 400:
        return True
    ctype = response.headers.get("content-type", [""])[0]
    assert ctype.startswith("application/json"), (
        f"{response.status_code} with content-type {ctype!r}: {response.text[:200]!r}")
    assert _is_openai_error(response.json()), (
        f"{response.status_code} body is not OpenAI's error shape: {response.text[:200]!r}")
    return True


@pytest.fixture(scope="module")
def fuzz_fleet(tmp_path_factory, redis_server) -> Iterator[tuple[Gateway, Sims, Path]]:
    """One vLLM-like and one trtllm-like simulated replica behind a gateway process with the
    Batch API on the real redis-server."""
    tmp = tmp_path_factory.mktemp("fuzz")
    sims = start_sims(["vllm", "trtllm"], tmp, time_scale=0.005)
    config = two_pool_config(sims.urls[:1], sims.urls[1:], processes.free_ports(1)[0])
    config["redis"] = redis_server.config()
    try:
        gw = start_gateway(config, tmp)
    except Exception:
        sims.stop()
        raise
    yield gw, sims, tmp
    gw.stop()
    sims.stop()


@pytest.fixture(scope="module")
def api_schema(fuzz_fleet):
    gw, _, _ = fuzz_fleet
    loaded = schemathesis.openapi.from_dict(v1_openapi(gw.url, models=["tiny"]))
    loaded.config.update(base_url=gw.url)
    return loaded


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@FUZZ
def test_every_v1_operation_answers_as_documented(case, fuzz_fleet) -> None:
    case.call_and_validate(excluded_checks=EXCLUDED, additional_checks=[openai_error_body],
                           timeout=30)


def test_file_and_batch_workflows_answer_as_documented(api_schema, fuzz_fleet) -> None:
    """Stateful: the document's links chain an upload to the batch made of it, its retrieval
    and cancellation; every step is checked like a single request."""
    machine = api_schema.as_state_machine()

    class Checked(machine):  # type: ignore[misc, valid-type]
        def validate_response(self, response, case, **kw) -> None:
            case.validate_response(response, excluded_checks=EXCLUDED,
                                   additional_checks=[openai_error_body])

    run_state_machine_as_test(Checked, settings=settings(
        FUZZ, max_examples=8, stateful_step_count=6))


def test_the_gateway_logged_no_unhandled_error(fuzz_fleet) -> None:
    """Whatever the fuzzers sent, nothing reached the gateway's last-resort handler."""
    gw, _, _ = fuzz_fleet
    assert "unhandled error" not in gw.log()
    assert "Traceback" not in gw.log()
