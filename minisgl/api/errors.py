"""The one exception that becomes an error response, and each path's error shape."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

HTTP_BAD_REQUEST = 400
HTTP_NOT_FOUND = 404
HTTP_SERVER_ERROR = 500
HTTP_SERVICE_UNAVAILABLE = 503
HTTP_GATEWAY_TIMEOUT = 504


def error_dict(
    message: str,
    err_type: str = "invalid_request_error",
    param: str | None = None,
    code: Any = None,
) -> dict[str, Any]:
    """OpenAI's error body; `code` carries the HTTP status (as vLLM and SGLang send it)."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


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


# A dialect that answers errors in its own shape registers it for its path prefix; everything
# else, the middleware's refusals included, answers in OpenAI's.
ErrorShape = Callable[[int, str], dict[str, Any]]
ERROR_SHAPES: dict[str, ErrorShape] = {}


def shape_error(path: str, body: dict[str, Any], status_code: int) -> dict[str, Any]:
    """An OpenAI-shaped error body as the endpoint at `path` answers errors."""
    for prefix, shape in ERROR_SHAPES.items():
        if path.startswith(prefix):
            return shape(status_code, str(body.get("error", {}).get("message", "")))
    return body
