"""OpenAI-shaped error bodies: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import orjson


class GatewayError(Exception):
    """An error the client caused or must be told about, with its HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> bytes:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(
    message: str,
    *,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type, "param": param,
                                   "code": code}})


def bad_request(message: str, param: str | None = None, code: str | None = None) -> GatewayError:
    return GatewayError(400, message, param=param, code=code)


def model_not_found(model: str, hint: str = "") -> GatewayError:
    return GatewayError(404, f"The model `{model}` does not exist or is not served here.{hint}",
                        param="model", code="model_not_found")


def no_replica(pool: str) -> GatewayError:
    return GatewayError(503, f"No healthy replica in pool {pool!r}; retry later.",
                        type="service_unavailable", code="no_healthy_replica")


def upstream_failed(pool: str) -> GatewayError:
    # No replica names, addresses or upstream messages: those are internal, and in the log.
    return GatewayError(502, f"Every replica tried in pool {pool!r} failed before answering; "
                             "retry later.", type="upstream_error", code="upstream_unavailable")
