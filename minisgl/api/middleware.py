"""The `Gate`: pure ASGI middleware in front of the app (not BaseHTTPMiddleware, so streams and
disconnects pass through untouched)."""

import asyncio
import hmac
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus

from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from minisgl.api.errors import RequestError
from minisgl.api.request import new_id
from minisgl.chat.jsontext import check_json
from minisgl.limits import CLIENT_TIMEOUT_S, InvalidRequestError
from minisgl.runtime.engine_client import SHUTTING_DOWN

logger = logging.getLogger(__name__)

# Probes and scrapers: open without an API key, and /metrics still answers while draining.
# /health_generate runs a generation: it needs the key, as every route that does work.
METRICS_PATH = "/metrics"
PROBE_PATHS = frozenset({"/health", METRICS_PATH})
# Metric labels: any other method (a client may invent thousands) counts as one.
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


@dataclass
class Lifecycle:
    """The API server's state as the middleware sees it (one instance per app)."""

    draining: bool = False  # a shutdown began: refuse new requests
    num_open_requests: int = 0  # requests in progress, probes excluded


# Called once per answered request: (route template, method, status code).
ResponseObserver = Callable[[str, str, int], None]
UNMATCHED_ROUTE = "unmatched"


def route_template(scope: Scope) -> str:
    """The route a request went to, as its template (`/v1/responses/{response_id}`), so that
    a metric's labels stay few; a request refused before routing (401, 413, 503) is matched
    here. UNMATCHED_ROUTE for paths no route serves."""
    matching = (r for r in scope["app"].router.routes if r.matches(scope)[0] == Match.FULL)
    return getattr(scope.get("route") or next(matching, None), "path", UNMATCHED_ROUTE)


@dataclass
class Gate:
    """Every HTTP request passes here first: while shutting down a 503 (but /metrics); with
    --api-key every path but the probes needs `Authorization: Bearer KEY` or `x-api-key: KEY`
    (401); a body over the limit is a 413, a stalled one a 408, before anything parses it. The
    body is read here and replayed. Open requests (probes excluded) are counted; whatever a
    handler raises is logged once and answered with a 500 carrying a request id; every answer's
    status goes to `observe`."""

    app: ASGIApp
    lifecycle: Lifecycle
    api_key: str | None = field(repr=False)  # a secret: kept out of any repr
    max_body_bytes: int
    observe: ResponseObserver

    def _allowed(self, headers: dict[bytes, bytes]) -> bool:
        if not self.api_key:
            return True
        key = self.api_key.encode()
        bearer = hmac.compare_digest(headers.get(b"authorization", b""), b"Bearer " + key)
        return hmac.compare_digest(headers.get(b"x-api-key", b""), key) or bearer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 0  # 0 until the response starts

        async def tracking_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        method, path = scope["method"], scope["path"]
        try:
            await self._admit(scope, receive, tracking_send)
        except Exception:
            request_id = new_id("req")
            logger.exception("request %s (%s %s) failed", request_id, method, path)
            if not status:
                message = f"internal error (request id {request_id})"
                error = RequestError(
                    HTTPStatus.INTERNAL_SERVER_ERROR, message, headers={"X-Request-Id": request_id}
                )
                await error.response(path)(scope, receive, tracking_send)
        finally:
            if status:
                self.observe(
                    route_template(scope), method if method in HTTP_METHODS else "other", status
                )

    async def _admit(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        if path in PROBE_PATHS and (path == METRICS_PATH or not self.lifecycle.draining):
            return await self.app(scope, receive, send)
        self.lifecycle.num_open_requests += 1
        try:
            body = await self._read_body(scope, receive)
        except RequestError as refusal:
            if refusal.status_code != HTTPStatus.UNAUTHORIZED:  # its body may still be arriving
                refusal.headers = {**refusal.headers, "Connection": "close"}
            await refusal.response(path)(scope, receive, send)
        else:
            pending = [body]

            async def replay() -> Message:
                return pending.pop() if pending else await receive()

            await self.app(scope, replay, send)
        finally:
            self.lifecycle.num_open_requests -= 1

    async def _read_body(self, scope: Scope, receive: Receive) -> Message:
        """The whole body as one message, checked (`check_json`, on a thread: a 32 MiB body
        takes ~0.7 s, and other requests' streams keep flowing); a RequestError says why the
        request is refused."""
        headers = dict(scope["headers"])
        if self.lifecycle.draining:
            raise RequestError(HTTPStatus.SERVICE_UNAVAILABLE, SHUTTING_DOWN)
        if not self._allowed(headers):
            raise RequestError(
                HTTPStatus.UNAUTHORIZED,
                "Invalid or missing API key.",
                err_type="authentication_error",
            )
        if b"content-length" in headers and b"transfer-encoding" in headers:  # RFC 9112 6.3
            raise RequestError(
                HTTPStatus.BAD_REQUEST,
                "A request may not carry both Content-Length and Transfer-Encoding.",
            )
        too_large = RequestError(
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            f"Request body too large: the limit is {self.max_body_bytes} bytes.",
        )
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise too_large
        body = bytearray()
        while True:
            try:
                received = await asyncio.wait_for(receive(), CLIENT_TIMEOUT_S)
            except TimeoutError:
                raise RequestError(
                    HTTPStatus.REQUEST_TIMEOUT,
                    f"The request body stopped arriving for {CLIENT_TIMEOUT_S:g} s.",
                ) from None
            if received["type"] != "http.request":
                return received  # the client left before sending it all: the app sees it
            body += received.get("body", b"")
            if len(body) > self.max_body_bytes:
                raise too_large
            if not received.get("more_body", False):
                break
        try:
            data = await asyncio.to_thread(check_json, bytes(body)) if body else b""
        except InvalidRequestError as exc:
            raise RequestError(HTTPStatus.BAD_REQUEST, str(exc), exc.param) from None
        return {"type": "http.request", "body": data, "more_body": False}
