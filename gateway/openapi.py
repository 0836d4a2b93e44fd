"""The OpenAPI 3.1 document of the `/v1` routes the gateway serves (inference, models, Batch
API), in OpenAI's shapes: what `prefix-gateway openapi` prints and the fuzz tests check."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gateway import __version__

Schema = dict[str, Any]

_JSON = "application/json"
_SSE = "text/event-stream"


def _ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def _nullable(schema: Schema) -> Schema:
    return {"anyOf": [schema, {"type": "null"}]}


def _error(description: str) -> Schema:
    return {"description": description,
            "content": {_JSON: {"schema": _ref("ErrorResponse")}}}


# The errors every route may answer, besides its own. 401/403: client API keys, when the
# gateway is configured with them; 429: admission control or rate limits; 503: no replica or
# no Redis; 502/504: every replica tried failed (the gateway never answers a request with 500
# except on a bug, which is why 500 is not documented: a fuzzer must flag it).
_COMMON_ERRORS = {
    "400": _error("The request is malformed; `error.param` names the field at fault."),
    "401": _error("No API key, or an unknown one (only when client API keys are configured)."),
    "403": _error("The API key may not use this traffic class or route."),
    "405": _error("The route exists, with another method."),
    "413": _error("The request body is larger than the gateway's limit."),
    "429": _error("Too many requests: an admission queue is full or a rate limit is reached; "
                  "see `Retry-After`."),
}


def _responses(ok: Schema, *extra: str) -> Schema:
    out = {"200": ok, **_COMMON_ERRORS}
    known = {
        "404": _error("The model, file or batch does not exist here."),
        "502": _error("Every replica tried failed before answering."),
        "503": _error("No healthy replica (or the Batch API's Redis is unreachable)."),
        "504": _error("The replica did not answer in time."),
    }
    for code in extra:
        out[code] = known[code]
    return out


def _json_ok(description: str, schema: Schema) -> Schema:
    return {"description": description, "content": {_JSON: {"schema": schema}}}


def _inference_ok(description: str, response: str) -> Schema:
    return {"description": description + " With `stream: true`, server-sent events: one "
            "`data: {chunk}` per engine step, then `data: [DONE]`.",
            "content": {_JSON: {"schema": _ref(response)},
                        _SSE: {"schema": _ref("StreamEvent")}}}


def _path_id(name: str, description: str) -> Schema:
    return {"name": name, "in": "path", "required": True, "description": description,
            "schema": {"type": "string", "minLength": 1}}


def _query(name: str, schema: Schema, description: str) -> Schema:
    return {"name": name, "in": "query", "required": False, "description": description,
            "schema": schema}


# The request fields below are OpenAI's; the gateway itself checks only `model`, `stream`,
# `messages` and `prompt` (what routing reads) and forwards every other field, including ones
# not listed here, to the engine unchanged: hence `additionalProperties: true`.
_SAMPLING: dict[str, Schema] = {
    "stream": _nullable({"type": "boolean"}),
    "stream_options": _nullable({"type": "object", "properties": {
        "include_usage": {"type": "boolean"}}}),
    "max_tokens": _nullable({"type": "integer", "minimum": 1}),
    "temperature": _nullable({"type": "number", "minimum": 0, "maximum": 2}),
    "top_p": _nullable({"type": "number", "minimum": 0, "maximum": 1}),
    "n": _nullable({"type": "integer", "minimum": 1, "maximum": 128}),
    "stop": _nullable({"anyOf": [{"type": "string"},
                                 {"type": "array", "items": {"type": "string"},
                                  "maxItems": 4}]}),
    "presence_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2}),
    "frequency_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2}),
    "seed": _nullable({"type": "integer"}),
    "user": {"type": "string"},
    "service_tier": _nullable({"type": "string",
                               "enum": ["auto", "default", "flex", "priority"],
                               "description": "Chooses the traffic class when the "
                               "configuration maps it (e.g. `flex` to batch)."}),
}

_CONTENT_PART: Schema = {"type": "object", "required": ["type"],
                         "properties": {"type": {"type": "string"},
                                        "text": {"type": "string"}}}

_MESSAGE: Schema = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"type": "string",
                 "enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": _nullable({"anyOf": [{"type": "string"},
                                        {"type": "array", "items": _CONTENT_PART}]}),
        "name": {"type": "string"},
        "tool_call_id": {"type": "string"},
    },
}

_TOKENS: Schema = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}

_USAGE: Schema = {"type": "object", "required": ["prompt_tokens", "total_tokens"],
                  "properties": {"prompt_tokens": {"type": "integer"},
                                 "completion_tokens": {"type": "integer"},
                                 "total_tokens": {"type": "integer"}}}


def _schemas() -> dict[str, Schema]:
    model_field = {"type": "string", "minLength": 1,
                   "description": "A model served by the pool of the request's traffic class "
                                  "(GET /v1/models lists them)."}
    return {
        "ErrorResponse": {
            "type": "object", "required": ["error"],
            "properties": {"error": {
                "type": "object", "required": ["message", "type", "param", "code"],
                "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                               "param": _nullable({"type": "string"}),
                               # vLLM's own errors, passed through, carry the HTTP
                               # status as an integer code.
                               "code": {"type": ["string", "integer", "null"]}}}}},
        "CreateChatCompletionRequest": {
            "type": "object", "required": ["model", "messages"],
            "additionalProperties": True,
            "properties": {
                "model": model_field,
                "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
                "max_completion_tokens": _nullable({"type": "integer", "minimum": 1}),
                "tools": {"type": "array", "items": {"type": "object"}},
                **_SAMPLING,
            }},
        "CreateCompletionRequest": {
            "type": "object", "required": ["model", "prompt"],
            "additionalProperties": True,
            "properties": {
                "model": model_field,
                "prompt": {"anyOf": [
                    {"type": "string"},
                    {"type": "array", "minItems": 1, "items": {"type": "string"}},
                    _TOKENS,
                    {"type": "array", "minItems": 1, "items": _TOKENS}]},
                "echo": _nullable({"type": "boolean"}),
                "logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": 5}),
                **_SAMPLING,
            }},
        # OpenAPI 3.1: the schema of an event stream describes each event.
        "StreamEvent": {
            "type": "object", "required": ["data"],
            "properties": {
                "event": {"type": "string"},
                "data": {"type": "string", "pattern": "^(\\[DONE\\]|\\{[\\s\\S]*\\})$",
                         "description": "A chunk (`chat.completion.chunk` or "
                         "`text_completion`) as JSON, an `{\"error\": ...}` object if the "
                         "replica failed mid-stream, or `[DONE]`."}}},
        "ChatCompletion": {
            "type": "object", "required": ["id", "object", "created", "model", "choices"],
            "properties": {
                "id": {"type": "string"}, "object": {"const": "chat.completion"},
                "created": {"type": "integer"}, "model": {"type": "string"},
                "choices": {"type": "array", "items": {
                    "type": "object", "required": ["index", "message", "finish_reason"],
                    "properties": {
                        "index": {"type": "integer"},
                        "message": {"type": "object", "required": ["role"],
                                    "properties": {"role": {"type": "string"},
                                                   "content": _nullable({"type": "string"})}},
                        "finish_reason": _nullable({"type": "string"})}}},
                "usage": _USAGE}},
        "Completion": {
            "type": "object", "required": ["id", "object", "created", "model", "choices"],
            "properties": {
                "id": {"type": "string"}, "object": {"const": "text_completion"},
                "created": {"type": "integer"}, "model": {"type": "string"},
                "choices": {"type": "array", "items": {
                    "type": "object", "required": ["index", "text", "finish_reason"],
                    "properties": {"index": {"type": "integer"}, "text": {"type": "string"},
                                   "finish_reason": _nullable({"type": "string"})}}},
                "usage": _USAGE}},
        "Model": {
            "type": "object", "required": ["id", "object", "created", "owned_by"],
            "properties": {"id": {"type": "string"}, "object": {"const": "model"},
                           "created": {"type": "integer"}, "owned_by": {"type": "string"},
                           "pools": {"type": "array", "items": {"type": "string"},
                                     "description": "The pools that serve it."}}},
        "ListModelsResponse": {
            "type": "object", "required": ["object", "data"],
            "properties": {"object": {"const": "list"},
                           "data": {"type": "array", "items": _ref("Model")}}},
        "OpenAIFile": {
            "type": "object",
            "required": ["id", "object", "bytes", "created_at", "filename", "purpose"],
            "properties": {"id": {"type": "string"}, "object": {"const": "file"},
                           "bytes": {"type": "integer"}, "created_at": {"type": "integer"},
                           "filename": {"type": "string"},
                           "purpose": {"type": "string", "enum": ["batch", "batch_output"]},
                           "status": {"type": "string"},
                           "expires_at": _nullable({"type": "integer"})}},
        "ListFilesResponse": _list_of("OpenAIFile"),
        "DeleteFileResponse": {
            "type": "object", "required": ["id", "object", "deleted"],
            "properties": {"id": {"type": "string"}, "object": {"const": "file"},
                           "deleted": {"type": "boolean"}}},
        "CreateBatchRequest": {
            "type": "object", "required": ["input_file_id", "endpoint", "completion_window"],
            "additionalProperties": False,
            "properties": {
                "input_file_id": {"type": "string", "minLength": 1},
                "endpoint": {"type": "string", "minLength": 1,
                             "description": "`/v1/chat/completions` or `/v1/completions`; "
                             "any other fails the batch's validation."},
                "completion_window": {
                    "type": "string", "pattern": "^[1-9][0-9]{0,6}[smhd]$",
                    "description": "OpenAI's `24h`; also seconds, minutes, hours or days "
                                   "(`90s`, `30m`, `2d`), at most 30 days."},
                "metadata": _nullable({
                    "type": "object", "maxProperties": 16,
                    "propertyNames": {"maxLength": 64},
                    "additionalProperties": {"type": "string", "maxLength": 512}}),
                "output_expires_after": {"type": "object"},
            }},
        "Batch": {
            "type": "object",
            "required": ["id", "object", "endpoint", "input_file_id", "completion_window",
                         "status", "created_at", "request_counts"],
            "properties": {
                "id": {"type": "string"}, "object": {"const": "batch"},
                "endpoint": {"type": "string"}, "input_file_id": {"type": "string"},
                "completion_window": {"type": "string"},
                "status": {"type": "string", "enum": [
                    "validating", "failed", "in_progress", "finalizing", "completed",
                    "expired", "cancelling", "cancelled"]},
                "output_file_id": _nullable({"type": "string"}),
                "error_file_id": _nullable({"type": "string"}),
                "created_at": {"type": "integer"},
                "request_counts": {
                    "type": "object", "required": ["total", "completed", "failed"],
                    "properties": {k: {"type": "integer"}
                                   for k in ("total", "completed", "failed")}},
                "metadata": _nullable({"type": "object"}),
                "prefix_cache": {"type": "object", "description": "The engines' prefix-cache "
                                 "figures over the batch's responses."}}},
        "ListBatchesResponse": _list_of("Batch"),
    }


def _list_of(item: str) -> Schema:
    return {"type": "object", "required": ["object", "data", "has_more"],
            "properties": {"object": {"const": "list"},
                           "data": {"type": "array", "items": _ref(item)},
                           "first_id": _nullable({"type": "string"}),
                           "last_id": _nullable({"type": "string"}),
                           "has_more": {"type": "boolean"}}}


def _links(param: str, *operations: str, target: str = "$response.body#/id") -> Schema:
    """OpenAPI links: the id a 200 returns is what `operations` take as `param` (tools such
    as schemathesis follow them to test a file or batch that exists)."""
    return {op: {"operationId": op, "parameters": {param: target}} for op in operations}


def _paths() -> dict[str, Schema]:
    def body(schema: str) -> Schema:
        return {"required": True, "content": {_JSON: {"schema": _ref(schema)}}}

    def ok_with_links(description: str, schema: str, links: Schema) -> Schema:
        return {**_json_ok(description, _ref(schema)), "links": links}

    file_id = _path_id("file_id", "A file's id (`file-...`).")
    batch_id = _path_id("batch_id", "A batch's id (`batch_...`).")
    return {
        "/v1/chat/completions": {"post": {
            "operationId": "createChatCompletion", "tags": ["inference"],
            "summary": "A chat completion from the replica most likely to hold the prompt's "
                       "prefix in cache.",
            "parameters": [{"name": "x-traffic-class", "in": "header", "required": False,
                            "schema": {"type": "string"},
                            "description": "The traffic class, when the configuration's "
                                           "`classification.header` is this header."}],
            "requestBody": body("CreateChatCompletionRequest"),
            "responses": _responses(_inference_ok("The completion.", "ChatCompletion"),
                                    "404", "502", "503", "504")}},
        "/v1/completions": {"post": {
            "operationId": "createCompletion", "tags": ["inference"],
            "summary": "A text completion, routed like chat completions.",
            "requestBody": body("CreateCompletionRequest"),
            "responses": _responses(_inference_ok("The completion.", "Completion"),
                                    "404", "502", "503", "504")}},
        "/v1/models": {"get": {
            "operationId": "listModels", "tags": ["models"],
            "summary": "The models any pool serves.",
            "responses": _responses(_json_ok("The models.", _ref("ListModelsResponse")))}},
        "/v1/models/{model}": {"get": {
            "operationId": "retrieveModel", "tags": ["models"],
            "parameters": [_path_id("model", "A model name.")],
            "responses": _responses(_json_ok("The model.", _ref("Model")), "404")}},
        "/v1/files": {
            "post": {
                "operationId": "createFile", "tags": ["batch"],
                "summary": "Upload a batch input file (JSONL; purpose `batch`).",
                "requestBody": {"required": True, "content": {"multipart/form-data": {
                    "schema": {"type": "object", "required": ["file", "purpose"],
                               "properties": {
                                   "file": {"type": "string", "format": "binary"},
                                   "purpose": {"type": "string", "enum": ["batch"]}}}}}},
                "responses": _responses(ok_with_links(
                    "The stored file.", "OpenAIFile",
                    {**_links("file_id", "retrieveFile", "downloadFile", "deleteFile"),
                     "createBatch": {"operationId": "createBatch",
                                     "requestBody": {"input_file_id": "$response.body#/id",
                                                     "endpoint": "/v1/chat/completions",
                                                     "completion_window": "24h"}}}),
                    "503")},
            "get": {
                "operationId": "listFiles", "tags": ["batch"],
                "parameters": [
                    _query("after", {"type": "string"}, "A file id: list those after it."),
                    _query("limit", {"type": "integer", "minimum": 1, "maximum": 10000},
                           "At most this many files."),
                    _query("order", {"type": "string", "enum": ["asc", "desc"]},
                           "By creation: newest first with `desc` (the default)."),
                    _query("purpose", {"type": "string"}, "Only files of this purpose.")],
                "responses": _responses(_json_ok("The files.", _ref("ListFilesResponse")),
                                        "503")}},
        "/v1/files/{file_id}": {
            "get": {"operationId": "retrieveFile", "tags": ["batch"],
                    "parameters": [file_id],
                    "responses": _responses(_json_ok("The file.", _ref("OpenAIFile")),
                                            "404", "503")},
            "delete": {"operationId": "deleteFile", "tags": ["batch"],
                       "parameters": [file_id],
                       "responses": _responses(
                           _json_ok("The file is deleted.", _ref("DeleteFileResponse")),
                           "404", "503")}},
        "/v1/files/{file_id}/content": {"get": {
            "operationId": "downloadFile", "tags": ["batch"], "parameters": [file_id],
            "responses": _responses(
                {"description": "The file's bytes.",
                 "content": {"application/octet-stream": {
                     "schema": {"type": "string", "format": "binary"}}}},
                "404", "503")}},
        "/v1/batches": {
            "post": {"operationId": "createBatch", "tags": ["batch"],
                     "requestBody": body("CreateBatchRequest"),
                     "responses": _responses(ok_with_links(
                         "The new batch.", "Batch",
                         _links("batch_id", "retrieveBatch", "cancelBatch")), "404", "503")},
            "get": {"operationId": "listBatches", "tags": ["batch"],
                    "parameters": [
                        _query("after", {"type": "string"}, "A batch id: list those after "
                               "it."),
                        _query("limit", {"type": "integer", "minimum": 1, "maximum": 100},
                               "At most this many batches (default 20).")],
                    "responses": _responses(_json_ok("The batches.",
                                                     _ref("ListBatchesResponse")), "503")}},
        "/v1/batches/{batch_id}": {"get": {
            "operationId": "retrieveBatch", "tags": ["batch"], "parameters": [batch_id],
            "responses": _responses(_json_ok("The batch.", _ref("Batch")), "404", "503")}},
        "/v1/batches/{batch_id}/cancel": {"post": {
            "operationId": "cancelBatch", "tags": ["batch"], "parameters": [batch_id],
            "responses": _responses(_json_ok("The batch, cancelling or cancelled.",
                                             _ref("Batch")), "404", "503")}},
    }


def v1_openapi(server_url: str | None = None,
               models: Sequence[str] | None = None) -> dict[str, Any]:
    """The OpenAPI 3.1 document of the gateway's `/v1` routes.

    `server_url`: its base URL (e.g. `http://127.0.0.1:8080`) for tools that call it;
    `models`: the models a deployment serves, to name in the inference requests' `model`
    (by default any string, as a gateway answers an unknown one with 404 `model_not_found`).
    """
    schemas = _schemas()
    if models:
        for name in ("CreateChatCompletionRequest", "CreateCompletionRequest"):
            field = schemas[name]["properties"]["model"]
            schemas[name]["properties"]["model"] = {**field, "enum": list(models)}
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": "prefix-gateway /v1",
            "version": __version__,
            "description": "The OpenAI-compatible routes prefix-gateway serves. Inference "
                           "requests are routed to an engine replica and answered by it; "
                           "fields the gateway does not read are forwarded unchanged. Errors "
                           "are OpenAI's: `{\"error\": {\"message\", \"type\", \"param\", "
                           "\"code\"}}`. The Batch API routes need Redis (without it they "
                           "answer 400 `batch_api_needs_redis`).",
        },
        "paths": _paths(),
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearerAuth": {
                "type": "http", "scheme": "bearer",
                "description": "A client API key, when the gateway is configured with them; "
                               "otherwise any value, or none, is accepted."}},
        },
        "security": [{"bearerAuth": []}, {}],
    }
    if server_url:
        doc["servers"] = [{"url": server_url.rstrip("/")}]
    return doc
