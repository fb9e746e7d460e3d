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


def shutting_down_error() -> RequestError:
    return RequestError(HTTP_SERVICE_UNAVAILABLE, "The server is shutting down.")


def backend_stopped_error() -> RequestError:
    return RequestError(
        HTTP_SERVICE_UNAVAILABLE,
        "The inference backend stopped unexpectedly; the request was not completed.",
    )
