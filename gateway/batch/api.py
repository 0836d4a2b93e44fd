"""The HTTP routes of the Batch API (/v1/files, /v1/batches), as the `openai` client calls
them, with OpenAI-shaped errors."""

from __future__ import annotations

import re
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.datastructures import FormData, UploadFile
from starlette.formparsers import MultiPartException

from gateway.auth import CLIENT_SCOPE, class_not_allowed
from gateway.batch.service import BatchService
from gateway.batch.shapes import batch_object
from gateway.batch.store import TERMINAL, new_batch_id, now_s
from gateway.errors import GatewayError, bad_request
from gateway.redis_link import UNAVAILABLE

# Multipart framing around the file: boundaries, part headers, the purpose field.
_FORM_SLACK = 64 * 1024
_WINDOW = re.compile(r"^([1-9][0-9]*)([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_BATCH_KEYS = {"input_file_id", "endpoint", "completion_window", "metadata",
               "output_expires_after"}


def needs_redis() -> GatewayError:
    # 400, not 501 or 503: the openai client retries 408, 409, 429 and every 5xx, and this is
    # no passing condition that a retry could outlast: the gateway was started without Redis.
    return GatewayError(
        400, "The Batch API (/v1/files, /v1/batches) needs Redis, and this gateway runs "
        "without it. Start it with `prefix-gateway up --redis-url redis://HOST:6379/0`, set "
        "PREFIX_GATEWAY_REDIS_URL, or add `redis: {url: redis://HOST:6379/0}` to its "
        "configuration file.", code="batch_api_needs_redis")


def redis_unavailable() -> GatewayError:
    # 503: Redis is configured but not answering right now (restarting, a network blip);
    # the openai client's own retries may well outlast it.
    return GatewayError(503, "The Batch API's Redis is not reachable right now; retry "
                             "shortly. Chat and completions are unaffected.",
                        type="service_unavailable", code="redis_unavailable")


def not_found(kind: str, ident: str, param: str | None = None) -> GatewayError:
    return GatewayError(404, f"No {kind} found with id {ident!r}.", param=param,
                        code=f"{kind}_not_found")


def _error_response(err: GatewayError) -> Response:
    return Response(err.body(), status_code=err.status, media_type="application/json",
                    headers={k.decode(): v.decode() for k, v in err.headers})


def _int_param(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise bad_request(f"'{name}' must be an integer, not {raw!r}.", name,
                          "invalid_type") from None
    if not low <= value <= high:
        raise bad_request(f"'{name}' must be between {low} and {high}.", name, "invalid_value")
    return value


def _owner(request: Request) -> str:
    """Whose files and batches the request may see: its client key's name ("" on a gateway
    without client keys, where every client shares them)."""
    client = request.scope.get(CLIENT_SCOPE)
    return client.name if client is not None else ""


def _page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


async def _capped_form(request: Request, limit: int) -> FormData:
    """The multipart form, refused with 413 as soon as the body outgrows the file limit."""
    too_big = GatewayError(413, f"The file is larger than this gateway's limit of {limit} "
                           "bytes (batch.max_file_bytes).", param="file", code="file_too_large")
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise bad_request("Upload the file as multipart/form-data, with a 'file' part and a "
                          "'purpose' field.", "file", "invalid_content_type")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit + _FORM_SLACK:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit + _FORM_SLACK:
            raise too_big
        chunks.append(chunk)
    body = b"".join(chunks)

    async def replay() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    try:
        form = await Request(request.scope, replay).form(max_files=1, max_fields=16)
    except MultiPartException as exc:
        raise bad_request(f"The upload is not a valid multipart form: {exc.message}") from None
    upload = form.get("file")
    if isinstance(upload, UploadFile) and upload.size is not None and upload.size > limit:
        raise too_big
    return form


def _window_s(value: Any) -> int:
    m = _WINDOW.match(value) if isinstance(value, str) else None
    seconds = int(m.group(1)) * _UNIT_S[m.group(2)] if m else 0
    if not m or seconds > 30 * 86400:
        raise bad_request("completion_window must be a duration such as \"24h\" (also "
                          "accepted here: seconds, minutes, hours or days, e.g. \"90s\", "
                          "\"30m\", \"2d\"; at most 30 days).", "completion_window",
                          "invalid_value")
    return seconds


def _metadata(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    ok = isinstance(value, dict) and len(value) <= 16 and all(
        isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
        for k, v in value.items())
    if not ok:
        raise bad_request("metadata must be an object of at most 16 string keys (64 "
                          "characters at most) to string values (512 at most).", "metadata",
                          "invalid_value")
    return value


def install(app: FastAPI, service: BatchService | None, max_file_bytes: int) -> None:
    """Add the Batch API's routes to `app`; without a service, each explains that it needs
    Redis."""

    @app.exception_handler(GatewayError)
    async def gateway_error(_: Request, exc: GatewayError) -> Response:
        return _error_response(exc)

    for cls in UNAVAILABLE:
        if cls is OSError:
            continue  # redis-py raises its own ConnectionError for socket errors
        @app.exception_handler(cls)
        async def redis_error(_: Request, exc: Exception) -> Response:
            if service is not None:
                service.link.mark_down(exc)
            return _error_response(redis_unavailable())

    def svc() -> BatchService:
        if service is None:
            raise needs_redis()
        return service

    @app.post("/v1/files")
    async def upload_file(request: Request) -> dict[str, Any]:
        s = svc()
        form = await _capped_form(request, max_file_bytes)
        purpose = form.get("purpose")
        upload = form.get("file")
        if not isinstance(purpose, str) or not purpose:
            raise bad_request("Missing required parameter: 'purpose'.", "purpose",
                              "missing_required_parameter")
        if purpose != "batch":
            raise bad_request(f"This gateway stores files for the Batch API only: purpose "
                              f"must be 'batch', not {purpose!r}.", "purpose", "invalid_value")
        if not isinstance(upload, UploadFile):
            raise bad_request("Missing required parameter: 'file' (a file part of the "
                              "multipart form).", "file", "missing_required_parameter")
        data = await upload.read()
        return await s.files.create(data, upload.filename or "upload.jsonl", purpose,
                                    owner=_owner(request))

    @app.get("/v1/files")
    async def list_files(request: Request) -> dict[str, Any]:
        s = svc()
        q = request.query_params
        order = q.get("order", "desc")
        if order not in ("asc", "desc"):
            raise bad_request("'order' must be 'asc' or 'desc'.", "order", "invalid_value")
        limit = _int_param(request, "limit", 10000, 1, 10000)
        page = await s.files.page(after=q.get("after"), limit=limit, order=order,
                                  purpose=q.get("purpose"), owner=_owner(request))
        if page is None:
            raise bad_request(f"'after' names no file: {q.get('after')!r}.", "after",
                              "invalid_value")
        return _page(*page)

    @app.get("/v1/files/{file_id}")
    async def get_file(file_id: str, request: Request) -> dict[str, Any]:
        obj = await svc().files.get(file_id, _owner(request))
        if obj is None:
            raise not_found("file", file_id)
        return obj

    @app.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str, request: Request) -> Response:
        data = await svc().files.content(file_id, _owner(request))
        if data is None:
            raise not_found("file", file_id)
        return Response(data, media_type="application/octet-stream")

    @app.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str, request: Request) -> dict[str, Any]:
        if not await svc().files.delete(file_id, _owner(request)):
            raise not_found("file", file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    @app.post("/v1/batches")
    async def create_batch(request: Request) -> dict[str, Any]:
        s = svc()
        client = request.scope.get(CLIENT_SCOPE)
        if client is not None and s.runner.traffic_class not in client.classes:
            # Batch lines run as the batch class: a key without it may not start them.
            raise class_not_allowed(s.runner.traffic_class, client.classes, "the Batch API")
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError as exc:
            raise bad_request(f"We could not parse the JSON body of your request ({exc}).",
                              code="invalid_json") from None
        if not isinstance(body, dict):
            raise bad_request("The request body must be a JSON object.")
        unknown = sorted(set(body) - _BATCH_KEYS)
        if unknown:
            raise bad_request(f"Unrecognized request argument supplied: {unknown[0]}",
                              unknown[0], "unknown_parameter")
        for key in ("input_file_id", "endpoint", "completion_window"):
            if not isinstance(body.get(key), str) or not body[key]:
                raise bad_request(f"Missing required parameter: '{key}' (a string).", key,
                                  "missing_required_parameter")
        window = _window_s(body["completion_window"])
        metadata = _metadata(body.get("metadata"))
        file_id = body["input_file_id"]
        owner = _owner(request)
        meta = await s.files.get(file_id, owner)
        if meta is None:
            raise not_found("file", file_id, "input_file_id")
        if meta["purpose"] != "batch":
            raise bad_request(f"File {file_id} has purpose {meta['purpose']!r}; a batch's "
                              "input file must be uploaded with purpose 'batch'.",
                              "input_file_id", "invalid_value")
        created = now_s()
        fields = {"id": new_batch_id(), "endpoint": body["endpoint"], "input_file_id": file_id,
                  "completion_window": body["completion_window"], "status": "validating",
                  "created_at": str(created), "expires_at": str(created + window),
                  "total": "0", "completed": "0", "failed": "0"}
        if metadata is not None:
            fields["metadata"] = orjson.dumps(metadata).decode()
        if owner:
            fields["owner"] = owner
        await s.store.create(fields)
        s.runner.wake.set()
        return batch_object(fields)

    @app.get("/v1/batches")
    async def list_batches(request: Request) -> dict[str, Any]:
        s = svc()
        limit = _int_param(request, "limit", 20, 1, 100)
        after = request.query_params.get("after")
        page = await s.store.page(after, limit, _owner(request))
        if page is None:
            raise bad_request(f"'after' names no batch: {after!r}.", "after", "invalid_value")
        rows, more = page
        return _page([batch_object(h) for h in rows], more)

    @app.get("/v1/batches/{batch_id}")
    async def get_batch(batch_id: str, request: Request) -> dict[str, Any]:
        h = await svc().store.get(batch_id, _owner(request))
        if h is None:
            raise not_found("batch", batch_id)
        return batch_object(h)

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str, request: Request) -> dict[str, Any]:
        s = svc()
        owner = _owner(request)
        if await s.store.get(batch_id, owner) is None:
            raise not_found("batch", batch_id)
        if await s.store.transition(batch_id, ["validating", "in_progress"],
                                    status="cancelling", cancelling_at=now_s()):
            s.runner.wake.set()
        h = await s.store.get(batch_id, owner)
        if h is None:
            raise not_found("batch", batch_id)
        if h["status"] in (*TERMINAL, "finalizing") and h["status"] != "cancelled":
            # 400 rather than 409: the openai client retries a 409, and no retry will make a
            # finished batch cancellable.
            raise bad_request(f"Batch {batch_id} is {h['status']} and can no longer be "
                              "cancelled.", code="batch_not_cancellable")
        return batch_object(h)

