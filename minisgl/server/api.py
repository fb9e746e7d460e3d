"""The FastAPI app: OpenAI-compatible routes, auth, errors, /health and /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import signal
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from minisgl.config import ServerArgs
from minisgl.message import Endpoints, StatsReply
from minisgl.server.engine_client import EngineClient
from minisgl.server.generation import RequestError, ServingContext
from minisgl.server.metrics import ServerMetrics
from minisgl.server.model_names import accepted_model_names, served_model_name
from minisgl.server.process import ChildStartupError
from minisgl.server.protocol import ChatCompletionRequest, CompletionRequest, error_dict, now_s
from minisgl.server.serving_chat import create_chat_completion
from minisgl.server.serving_completion import create_completion
from minisgl.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

# /health: the scheduler must answer a ping within this long.
HEALTH_TIMEOUT_S = 1.5
# /metrics: how long to wait for fresh scheduler stats before serving the last known ones.
METRICS_STATS_TIMEOUT_S = 1.0
# Startup: ping the scheduler until it has loaded the model; give up after this long.
SCHEDULER_HANDSHAKE_TIMEOUT_S = 3600.0
SCHEDULER_PING_INTERVAL_S = 1.0
AUTH_PATH_PREFIX = "/v1/"
# Shutdown: open streams get this long to finish before their connections are closed.
GRACEFUL_SHUTDOWN_S = 2
KEEP_ALIVE_S = 30
STARTUP_POLL_S = 0.05


class ApiKeyMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware) so streaming and disconnects pass through untouched."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(AUTH_PATH_PREFIX):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                body = error_dict("Invalid or missing API key.", "authentication_error", code=401)
                await JSONResponse(body, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _validation_error_response(exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        message, param = "Request body is not valid JSON.", None
    else:
        param = loc[0] if loc else None
        where = ".".join(loc) or "body"
        message = f"{where}: {first.get('msg', 'invalid value')}"
    return JSONResponse(error_dict(message, param=param, code=400), status_code=400)


async def _wait_for_scheduler(engine: EngineClient) -> StatsReply:
    loop = asyncio.get_running_loop()
    deadline_s = loop.time() + SCHEDULER_HANDSHAKE_TIMEOUT_S
    while loop.time() < deadline_s:
        reply = await engine.stats(SCHEDULER_PING_INTERVAL_S)
        if reply is not None:
            return reply
    raise TimeoutError(f"scheduler did not answer within {SCHEDULER_HANDSHAKE_TIMEOUT_S} s")


def create_app(args: ServerArgs, endpoints: Endpoints, tokenizer_path: str | Path) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tokenizer = await asyncio.to_thread(load_tokenizer, tokenizer_path)
        engine = EngineClient(endpoints)
        engine.start()
        info = await _wait_for_scheduler(engine)
        app.state.ctx = ServingContext(
            tokenizer=tokenizer,
            engine=engine,
            metrics=ServerMetrics(lambda: engine.last_stats),
            served_model_name=served_model_name(args),
            accepted_model_names=accepted_model_names(args),
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            kv_capacity_tokens=info.kv_capacity_tokens,
        )
        try:
            yield
        finally:
            app.state.ctx.tokenize_pool.shutdown(wait=False, cancel_futures=True)
            await engine.close()

    app = FastAPI(title="minisgl", lifespan=lifespan)
    if args.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=args.api_key)

    def ctx_of(request: Request) -> ServingContext:
        return request.app.state.ctx

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error_response(exc)

    @app.exception_handler(RequestError)
    async def on_request_error(_: Request, exc: RequestError) -> JSONResponse:
        body = error_dict(exc.message, exc.err_type, exc.param, exc.status_code)
        return JSONResponse(body, status_code=exc.status_code)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        body = error_dict(str(exc.detail), "invalid_request_error", code=exc.status_code)
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def on_unexpected_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error in a request handler")
        body = error_dict(f"internal error: {type(exc).__name__}", "server_error", code=500)
        return JSONResponse(body, status_code=500)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(ctx_of(request), body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(ctx_of(request), body, request)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        ctx = ctx_of(request)
        card = {
            "id": ctx.served_model_name,
            "object": "model",
            "created": now_s(),
            "owned_by": "minisgl",
            "max_model_len": ctx.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health(request: Request) -> Response:
        reply = await ctx_of(request).engine.stats(HEALTH_TIMEOUT_S)
        return Response(status_code=200 if reply is not None else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        ctx = ctx_of(request)
        await ctx.engine.stats(METRICS_STATS_TIMEOUT_S)  # refreshes engine.last_stats
        return Response(ctx.metrics.render(), media_type="text/plain; version=0.0.4")

    return app


class _UvicornServer(uvicorn.Server):
    """uvicorn that leaves Ctrl-C to the launcher: the terminal sends SIGINT to every process of
    the group, and the launcher, not each child, decides the shutdown order. SIGTERM still stops
    it gracefully: open requests end at once with finish_reason "abort" (streams get their
    final chunk and [DONE]) instead of being cut off when the graceful timeout expires."""

    on_exit: Callable[[], None] | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, self.handle_exit)
        yield

    def handle_exit(self, sig: int, frame: Any) -> None:
        super().handle_exit(sig, frame)
        if self.on_exit is not None:
            self.on_exit()


def _bind(host: str, port: int) -> socket.socket:
    """Bind before starting uvicorn, so a taken port is one clear error line."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        raise ChildStartupError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def run_api_server(
    args: ServerArgs, endpoints: Endpoints, tokenizer_path: str, report_ready: Callable[[], None]
) -> None:
    """The API server process: serve until SIGTERM."""
    app = create_app(args, endpoints, tokenizer_path)
    # uvicorn's own startup lines would repeat what the launcher logs once.
    uvicorn_log_level = "debug" if args.log_level == "debug" else "warning"
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=uvicorn_log_level,
        access_log=args.log_level == "debug",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        timeout_keep_alive=KEEP_ALIVE_S,
    )
    server = _UvicornServer(config)
    listen_socket = _bind(args.host, args.port)

    async def main() -> None:
        serve_task = asyncio.create_task(server.serve(sockets=[listen_socket]))
        while not server.started and not serve_task.done():
            await asyncio.sleep(STARTUP_POLL_S)
        if server.started:
            loop = asyncio.get_running_loop()
            engine = app.state.ctx.engine

            def abort_all_soon() -> None:  # called from the SIGTERM handler
                loop.call_soon_threadsafe(engine.abort_all)

            server.on_exit = abort_all_soon
            report_ready()
        await serve_task
        if not server.started:
            raise RuntimeError(f"API server failed to start on {args.host}:{args.port}")

    asyncio.run(main())
