"""The one exception that becomes an error response, and each path's error shape."""

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from minisgl.api.request import JsonObject
from minisgl.limits import InvalidRequestError
from minisgl.runtime.engine_client import BackendUnavailable

logger = logging.getLogger(__name__)


@dataclass(eq=False)  # compared and hashed as the exception it is
class RequestError(Exception):
    """Becomes `{"error": {...}}` with this status: the response of a non-streaming request, or
    one error event of a stream (whose HTTP status is already 200)."""

    status_code: int
    message: str
    param: str | None = None
    err_type: str = ""  # "": invalid_request_error for a 4xx, server_error for a 5xx
    headers: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__(self.message)
        if not self.err_type:
            self.err_type = (
                "invalid_request_error"
                if self.status_code < HTTPStatus.INTERNAL_SERVER_ERROR
                else "server_error"
            )

    def body(self, with_code: bool = True) -> JsonObject:
        """OpenAI's error body; `code` carries the HTTP status (as vLLM and SGLang send it)."""
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.status_code if with_code else None,
            }
        }

    def response(self, path: str) -> JSONResponse:
        """This error as the endpoint at `path` answers errors: in the shape its dialect
        registered for a prefix of it (ERROR_SHAPES), else in OpenAI's."""
        shape = next((s for prefix, s in ERROR_SHAPES.items() if path.startswith(prefix)), None)
        return JSONResponse(
            shape(self.status_code, self.message) if shape else self.body(),
            status_code=self.status_code,
            headers=self.headers,
        )


class ClientDisconnected(Exception):
    pass


class ChoiceFailed(RequestError):
    """A choice ended with an error: a stream ends with that error event, a reply is that error
    (a 500 when the server failed the request, a step that raised; else a 400)."""

    def __init__(self, message: str, internal: bool = False) -> None:
        super().__init__(
            HTTPStatus.INTERNAL_SERVER_ERROR if internal else HTTPStatus.BAD_REQUEST, message
        )


# A dialect that answers errors in its own shape registers it for its path prefix; everything
# else, the middleware's refusals included, answers in OpenAI's.
ErrorShape = Callable[[int, str], JsonObject]
ERROR_SHAPES: dict[str, ErrorShape] = {}


def _validation_error(exc: RequestValidationError) -> RequestError:
    first = exc.errors()[0]
    loc = [str(part) for part in first["loc"] if part not in ("body", "query")]
    rule = (first.get("ctx") or {}).get("error")
    if first["type"] == "json_invalid":
        return RequestError(HTTPStatus.BAD_REQUEST, "Request body is not valid JSON.")
    if isinstance(rule, InvalidRequestError):  # raised by one of our own validators
        return RequestError(HTTPStatus.BAD_REQUEST, str(rule), param=rule.param)
    where = ".".join(loc) or "body"
    message = f"{where}: {first['msg']}"
    return RequestError(HTTPStatus.BAD_REQUEST, message, param=loc[0] if loc else None)


# Each kind of exception that has an error response, and how it becomes one. InvalidRequestError:
# a rule a dialect's translation broke (the param is its own).
_ANSWERS: dict[type[Exception], Callable[[Any], RequestError]] = {
    RequestError: lambda exc: exc,
    InvalidRequestError: lambda exc: RequestError(exc.status, str(exc), exc.param),
    BackendUnavailable: lambda exc: RequestError(HTTPStatus.SERVICE_UNAVAILABLE, str(exc)),
    RequestValidationError: _validation_error,
    # Routing's 404 and 405 (a client error: nothing raises one with a 5xx status).
    HTTPException: lambda exc: RequestError(exc.status_code, exc.detail, headers=exc.headers or {}),
}


def as_request_error(exc: BaseException) -> RequestError | None:
    """The error response an exception stands for; None for a bug (a 500 whoever catches it)."""
    answer = next((answer for kind, answer in _ANSWERS.items() if isinstance(exc, kind)), None)
    return None if answer is None else answer(exc)


async def error_response(request: Request, exc: Exception) -> JSONResponse:
    """The app's handler of each kind that has an answer: the error in the shape of the path's
    dialect."""
    error = as_request_error(exc)
    assert error is not None  # registered for the kinds that have an answer
    return error.response(request.url.path)


# The app's exception handlers (FastAPI's `exception_handlers`).
EXCEPTION_HANDLERS: dict[int | type[Exception], Any] = dict.fromkeys(_ANSWERS, error_response)


def stream_error_body(exc: BaseException, request_id: str) -> JsonObject:
    """The error event that ends a stream early; a bug is logged (with the request id it
    names) and reported as a 500."""
    # The request's own failure (not the server's) carries no code.
    if isinstance(exc, ChoiceFailed) and exc.status_code < HTTPStatus.INTERNAL_SERVER_ERROR:
        return exc.body(with_code=False)
    if (error := as_request_error(exc)) is not None:
        return error.body()
    logger.exception("request %s failed while streaming", request_id, exc_info=exc)
    message = f"internal error while streaming (request id {request_id})"
    return RequestError(HTTPStatus.INTERNAL_SERVER_ERROR, message).body()
