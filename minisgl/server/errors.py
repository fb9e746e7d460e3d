"""The one exception type that becomes an OpenAI-shaped error response."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from minisgl.server.protocol import error_dict

HTTP_BAD_REQUEST = 400
HTTP_SERVER_ERROR = 500
HTTP_SERVICE_UNAVAILABLE = 503
HTTP_GATEWAY_TIMEOUT = 504


class RequestError(Exception):
    """Becomes `{"error": {...}}` with this status: the response of a non-streaming request, or
    one error event of a stream (whose HTTP status is already 200)."""

    def __init__(
        self,
        status_code: int,
        message: str,
        param: str | None = None,
        err_type: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        client_error = status_code < HTTP_SERVER_ERROR
        self.err_type = err_type or ("invalid_request_error" if client_error else "server_error")
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_dict(self.message, self.err_type, self.param, self.status_code)


# Anthropic's error types by HTTP status (its Messages API answers errors in its own shape).
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}
ANTHROPIC_PATH_PREFIX = "/v1/messages"


def anthropic_error(status_code: Any, message: str) -> dict[str, Any]:
    kind = ANTHROPIC_ERROR_TYPES.get(status_code, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def shape_error(path: str, body: dict[str, Any], status_code: int) -> dict[str, Any]:
    """An OpenAI-shaped error body as the endpoint at `path` answers errors: Anthropic's shape
    under /v1/messages, OpenAI's everywhere else."""
    if not path.startswith(ANTHROPIC_PATH_PREFIX):
        return body
    return anthropic_error(status_code, str(body.get("error", {}).get("message", "")))
