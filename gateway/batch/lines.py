"""A batch input file read line by line (valid requests, per-line errors, whole-file errors),
the order lines run in, and the output and error file lines in OpenAI's format."""

from __future__ import annotations

import secrets
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.errors import GatewayError
from gateway.parse import validate
from routing.prompt import render_chat, render_completion

ENDPOINTS = {"/v1/chat/completions": True, "/v1/completions": False}
"""The endpoints a batch may name -> whether its lines are chat requests."""


class InputFileError(Exception):
    """The whole input file is unusable: the batch fails validation with these errors."""

    def __init__(self, errors: list[dict[str, Any]]) -> None:
        super().__init__(errors[0]["message"] if errors else "invalid input file")
        self.errors = errors


def file_error(code: str, message: str, *, line: int | None = None,
               param: str | None = None) -> dict[str, Any]:
    """One entry of a batch's `errors.data` (OpenAI's BatchError)."""
    return {"code": code, "message": message, "param": param, "line": line}


@dataclass(slots=True)
class Request:
    """A valid line: what to run."""

    index: int
    """Position among the file's non-blank lines; results are keyed and written by it."""
    custom_id: str
    body: dict[str, Any]
    model: str
    prompt: str
    """The prompt as the router renders it: lines are ordered by it."""


@dataclass(slots=True)
class Parsed:
    total: int
    requests: list[Request]
    errors: dict[int, bytes]
    """index -> its line in the error file (a malformed line)."""


def request_line_id() -> str:
    return "batch_req_" + secrets.token_hex(12)


def error_line(custom_id: str | None, code: str, message: str,
               line: int | None = None) -> bytes:
    """A line of the error file for a request that got no response."""
    error: dict[str, Any] = {"code": code, "message": message}
    if line is not None:
        error["line"] = line
    return orjson.dumps({"id": request_line_id(), "custom_id": custom_id, "response": None,
                         "error": error})


def response_line(custom_id: str, status: int, request_id: str, body: Any) -> bytes:
    """A line of the output file (2xx) or of the error file (any other status)."""
    return orjson.dumps({"id": request_line_id(), "custom_id": custom_id,
                         "response": {"status_code": status, "request_id": request_id,
                                      "body": body},
                         "error": None})


def parse_input(data: bytes, endpoint: str, models: Collection[str],
                max_lines: int) -> Parsed:
    """Every non-blank line of `data` as a request to run or a line of the error file.

    Raises InputFileError when the file as a whole cannot be a batch: an endpoint the gateway
    does not serve, not UTF-8, no request at all, too many lines, or no line a JSON object.
    """
    chat = ENDPOINTS.get(endpoint)
    if chat is None:
        raise InputFileError([file_error(
            "invalid_endpoint", f"The endpoint {endpoint!r} is not supported by this gateway; "
            f"use one of {sorted(ENDPOINTS)}.", param="endpoint")])
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputFileError([file_error(
            "invalid_file_format", f"The input file is not UTF-8 text (byte {exc.start}): a "
            "batch input file is JSONL, one JSON request per line.")]) from None
    numbered = [(n, raw) for n, raw in enumerate(text.splitlines(), 1) if raw.strip()]
    if not numbered:
        raise InputFileError([file_error("empty_file", "The input file has no requests.")])
    if len(numbered) > max_lines:
        raise InputFileError([file_error(
            "too_many_requests", f"The input file has {len(numbered)} requests; this gateway "
            f"takes at most {max_lines} per batch (batch.max_lines).")])
    requests: list[Request] = []
    errors: dict[int, bytes] = {}
    seen: set[str] = set()
    objects = 0
    for index, (n, raw) in enumerate(numbered):
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            errors[index] = error_line(None, "invalid_json",
                                       f"Line {n} is not valid JSON: {exc}", n)
            continue
        if not isinstance(obj, dict):
            errors[index] = error_line(None, "invalid_json",
                                       f"Line {n} is not a JSON object.", n)
            continue
        objects += 1
        req = _request(index, n, obj, endpoint, chat, models, seen)
        if isinstance(req, bytes):
            errors[index] = req
        else:
            requests.append(req)
            seen.add(req.custom_id)
    if not objects:
        raise InputFileError([file_error(
            "invalid_file_format", "No line of the input file is a JSON object: a batch "
            "input file is JSONL, one JSON request per line.")])
    return Parsed(len(numbered), requests, errors)


def _request(index: int, n: int, obj: dict[str, Any], endpoint: str, chat: bool,
             models: Collection[str], seen: set[str]) -> Request | bytes:
    """The line as a request to run, or its line in the error file."""
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return error_line(None, "missing_custom_id",
                          f"Line {n} has no custom_id (a non-empty string).", n)
    if cid in seen:
        return error_line(cid, "duplicate_custom_id", f"Line {n} repeats custom_id {cid!r} of "
                          "an earlier line; each line needs its own.", n)
    if obj.get("method") != "POST":
        return error_line(cid, "invalid_method",
                          f"Line {n}: method must be \"POST\", not {obj.get('method')!r}.", n)
    if obj.get("url") != endpoint:
        return error_line(cid, "invalid_url", f"Line {n}: url {obj.get('url')!r} is not the "
                          f"batch's endpoint {endpoint!r}.", n)
    body = obj.get("body")
    if not isinstance(body, dict):
        return error_line(cid, "invalid_body", f"Line {n}: body must be a JSON object.", n)
    try:
        model, stream = validate(body, chat)
    except GatewayError as err:
        return error_line(cid, err.code or "invalid_request", f"Line {n}: {err.message}", n)
    if stream:
        return error_line(cid, "invalid_request", f"Line {n}: stream is not supported in a "
                          "batch (each response is written whole to the output file).", n)
    if model not in models:
        return error_line(cid, "model_not_found", f"Line {n}: the model {model!r} is not "
                          f"served to batches here; available: {sorted(models)}.", n)
    prompt = render_chat(body) if chat else render_completion(body)
    return Request(index, cid, body, model, prompt)


@dataclass(slots=True)
class Planned:
    """A request in run order, with its prefix group."""

    request: Request
    group: int
    leader: bool
    """The first line of a group of several: the rest wait for its first token, so that
    they find its prompt prefix in the engine's cache instead of all computing it at once."""


def run_order(requests: list[Request], group_chars: int) -> list[Planned]:
    """Requests sorted by prompt, so those sharing the longest prefixes run one after the
    other (prefix affinity then sends them to the replica that holds it); a run of adjacent
    prompts sharing at least `group_chars` characters is one group."""
    ordered = sorted(requests, key=lambda r: (r.prompt, r.index))
    out: list[Planned] = []
    group = -1
    previous = None
    for r in ordered:
        head = r.prompt[:group_chars]
        if previous is None or len(head) < group_chars or head != previous:
            group += 1
        out.append(Planned(r, group, False))
        previous = head
    for i, p in enumerate(out):
        first = i == 0 or out[i - 1].group != p.group
        p.leader = first and i + 1 < len(out) and out[i + 1].group == p.group
    return out
