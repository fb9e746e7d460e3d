"""The API process: the FastAPI app (every dialect's routes, errors, /health, /metrics) served
by uvicorn until SIGTERM (then a drain) or the launcher's word that the backend died."""

import asyncio
import contextlib
import logging
import resource
import signal
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from http import HTTPStatus
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI
from starlette.responses import Response
from uvicorn.protocols.http.h11_impl import H11Protocol

from minisgl.api.dialects import anthropic, completions, embeddings, openai, responses, sglang, vllm
from minisgl.api.errors import EXCEPTION_HANDLERS
from minisgl.api.metrics import ServerMetrics
from minisgl.api.middleware import Gate, Lifecycle
from minisgl.api.pipeline import ServingContext
from minisgl.chat import ChatSettings
from minisgl.config import ServerArgs
from minisgl.limits import CLIENT_TIMEOUT_S, KEEP_ALIVE_S, ModelLimits
from minisgl.models.model_config import load_sampling_defaults
from minisgl.models.names import served_model_name
from minisgl.pooling import model_pooling
from minisgl.runtime.engine_client import BACKEND_STOPPED, EngineClient
from minisgl.runtime.messages import Endpoints
from minisgl.runtime.supervisor import BACKEND_FAILED_SIGNAL, ChildStartupError
from minisgl.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

# /health: the scheduler must answer a ping within this long.
HEALTH_TIMEOUT_S = 1.5
# /metrics: how long to wait for fresh scheduler stats before serving the last known ones.
METRICS_STATS_TIMEOUT_S = 1.0
# Startup: how long each ping waits for the scheduler to answer.
SCHEDULER_PING_INTERVAL_S = 1.0
# After the drain (or the abort that ends it) handlers get this long to send their last bytes
# before uvicorn closes the connections.
GRACEFUL_SHUTDOWN_S = 2
DRAIN_POLL_S = 0.05
# Connections accepted in one burst, before any is seen (asyncio's accept loop): the excess over
# the bound below lives that long. Descriptors are left for the burst and all but client
# connections (ZeroMQ sockets, files, the log).
ACCEPT_BACKLOG = 128
RESERVED_FDS = ACCEPT_BACKLOG + 64
REPEATED_LOG_INTERVAL_S = 10.0
MAX_REPEATED_LOGS = 256


class _Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with two bounds it lacks. Its keep-alive timer also runs from
    the moment a connection opens (for CLIENT_TIMEOUT_S; KEEP_ALIVE_S after a response) and on
    while a request head trickles in (uvicorn stops it at the first byte): a head must arrive
    whole in time. Connections stay below the descriptor limit (accept() failing is worse:
    nobody gets in): past `max_connections` the oldest connection with no request in progress
    is closed, so trickling clients cannot lock others out; with none such, the new one."""

    max_connections = 1024 - RESERVED_FDS  # run_api_server sets it from the process's limit

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self.opened_s = self.loop.time()
        self.timeout_keep_alive_task = self.loop.call_later(
            CLIENT_TIMEOUT_S, self.timeout_keep_alive_handler
        )
        if len(self.connections) > self.max_connections:
            # idle: no request yet (cycle None), or its last one answered; not already closing
            idle = [
                c
                for c in self.connections
                if getattr(getattr(c, "cycle", None), "response_complete", True)
                and not c.transport.is_closing()
            ]
            min(idle, key=lambda c: getattr(c, "opened_s", 0.0)).transport.close()

    def data_received(self, data: bytes) -> None:  # uvicorn's, but the timer keeps running
        self.conn.receive_data(data)
        self.handle_events()


class _NotAgainSoon(logging.Filter):
    """The same log message at most once per REPEATED_LOG_INTERVAL_S (asyncio logs a failing
    accept() each time it retries, thousands of times a second)."""

    def __init__(self) -> None:
        super().__init__()
        self._last_s: dict[str, float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        now_s, key = time.monotonic(), str(record.msg)
        if now_s - self._last_s.get(key, -REPEATED_LOG_INTERVAL_S) < REPEATED_LOG_INTERVAL_S:
            return False
        if len(self._last_s) > MAX_REPEATED_LOGS:  # messages differ too: bound what is kept
            self._last_s.clear()
        self._last_s[key] = now_s
        return True


def create_app(
    args: ServerArgs, endpoints: Endpoints, tokenizer_path: str | Path, model_path: str | Path
) -> FastAPI:
    """`tokenizer_path`, `model_path`: the resolved local folders."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tokenizer = await asyncio.to_thread(load_tokenizer, tokenizer_path)
        engine = EngineClient(endpoints)
        # Until the scheduler has loaded the model (the launcher bounds how long that takes).
        while (info := await engine.stats(SCHEDULER_PING_INTERVAL_S)) is None:
            pass
        longest_token_chars = max(map(len, tokenizer.get_vocab()))
        chat = ChatSettings.resolve(
            tokenizer,
            args.chat_template,
            args.chat_template_kwargs,
            args.reasoning_parser,
            args.tool_call_parser,
        )
        app.state.ctx = ctx = ServingContext(
            args,
            tokenizer,
            engine,
            metrics,
            served_model_name(args),
            ModelLimits(
                info.max_model_len, info.vocab_size, info.kv_capacity_tokens, longest_token_chars
            ),
            chat,
            info.eos_token_ids,
            load_sampling_defaults(Path(model_path), args.sampling_defaults),
            pooling,
        )
        try:
            yield
        finally:
            ctx.tokenizer_thread.shutdown(wait=False, cancel_futures=True)
            await engine.close()

    # An exception with no handler there: the Gate (minisgl.api.middleware) logs it once and
    # answers 500.
    app = FastAPI(title="minisgl", lifespan=lifespan, exception_handlers=EXCEPTION_HANDLERS)
    app.state.lifecycle = Lifecycle()
    pooling = model_pooling(Path(model_path), args.pooling)
    app.state.model_info = sglang.model_info(args, str(model_path), str(tokenizer_path))
    app.state.responses = responses.ResponseStore()
    metrics = ServerMetrics(lambda: app.state.ctx.engine.last_stats)  # read once serving
    app.add_middleware(
        Gate, app.state.lifecycle, args.api_key, args.max_request_body_bytes, metrics.count_response
    )

    # The dialects' routes join the app's own (include_router would nest them behind one
    # route, which the middleware's per-route counter could not see through).
    for dialect in (openai, completions, embeddings, responses, anthropic, vllm, sglang):
        app.router.routes.extend(dialect.router.routes)

    @app.get("/health")
    async def health() -> Response:
        reply = await app.state.ctx.engine.stats(HEALTH_TIMEOUT_S)
        return Response(status_code=200 if reply is not None else HTTPStatus.SERVICE_UNAVAILABLE)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        await app.state.ctx.engine.stats(METRICS_STATS_TIMEOUT_S)  # refreshes engine.last_stats
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    return app


class _Server(uvicorn.Server):
    """uvicorn that leaves Ctrl-C to the launcher (the terminal sends SIGINT to every process of
    the group, and the launcher decides the shutdown order) and, once serving, stops in order:
    SIGTERM refuses new requests (503, /health too), lets open ones finish for up to
    `drain_s`, aborts what is left, then stops uvicorn; a second SIGTERM skips the wait.
    BACKEND_FAILED_SIGNAL (the launcher saw the scheduler or detokenizer die) ends open
    requests at once with a 503 error (non-streaming) or an error event (streaming)."""

    def __init__(
        self, config: uvicorn.Config, app: FastAPI, drain_s: float, report_ready: Callable[[], None]
    ) -> None:
        super().__init__(config)
        self._state = app.state
        self._drain_s = drain_s
        self._report_ready = report_ready
        self._hurry = False
        self._error: str | None = None  # set: the backend stopped, open requests fail with it
        self._task: asyncio.Task | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)  # the process exits if the app's startup failed
        # Serving: these signals go to the event loop (before, uvicorn's handler stops at once).
        for sig in (signal.SIGTERM, BACKEND_FAILED_SIGNAL):
            asyncio.get_running_loop().add_signal_handler(sig, self._on_signal, sig)
        self._report_ready()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, self.handle_exit)
        signal.signal(BACKEND_FAILED_SIGNAL, self.handle_exit)
        yield

    def _on_signal(self, sig: int) -> None:
        if sig == BACKEND_FAILED_SIGNAL:
            self._error = BACKEND_STOPPED
        if self._task is not None or self._error is not None:
            self._hurry = True
        if self._task is None:
            self._task = asyncio.create_task(self._shut_down(), name="minisgl-shutdown")

    async def _wait_idle(self, timeout_s: float) -> None:
        deadline_s = time.monotonic() + timeout_s
        lifecycle = self._state.lifecycle
        while lifecycle.num_open_requests and time.monotonic() < deadline_s and not self._hurry:
            await asyncio.sleep(DRAIN_POLL_S)

    async def _shut_down(self) -> None:
        lifecycle = self._state.lifecycle
        lifecycle.draining = True
        if not self._hurry:
            logger.info(
                "shutting down: %d open request(s) get up to %g s to finish",
                lifecycle.num_open_requests,
                self._drain_s,
            )
            await self._wait_idle(self._drain_s)
        self._state.ctx.engine.abort_all(self._error)
        self._hurry = False
        await self._wait_idle(GRACEFUL_SHUTDOWN_S)  # the aborted ones send their last chunks
        self.should_exit = True


def bind(host: str, port: int) -> socket.socket:
    """Bind before starting uvicorn, so a taken port is one clear error line.

    The socket is made with IPPROTO_TCP (not 0): asyncio sets TCP_NODELAY on accepted
    connections only when the listening socket says TCP. Without it, Nagle's algorithm holds
    the second write of every response (the body, after the headers) until the
    client's delayed ACK, adding ~40 ms per response on a keep-alive connection."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # inherited on Linux too
        sock.bind((host, port))
    except OSError as exc:
        raise ChildStartupError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def run_api_server(
    args: ServerArgs,
    endpoints: Endpoints,
    tokenizer_path: str,
    model_path: str,
    report_ready: Callable[[], None],
) -> None:
    """The API server process: serve until SIGTERM (then drain) or BACKEND_FAILED_SIGNAL."""
    app = create_app(args, endpoints, tokenizer_path, model_path)
    debug = args.log_level == "debug"
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):  # as many connections as allowed
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    _Protocol.max_connections = max(1, soft - RESERVED_FDS)
    logging.getLogger("asyncio").addFilter(_NotAgainSoon())
    # uvicorn's own startup lines would repeat what the launcher logs once. It serves the socket
    # bound below, so it needs no host and port.
    config = uvicorn.Config(
        app,
        log_level="debug" if debug else "warning",
        access_log=debug,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        timeout_keep_alive=int(KEEP_ALIVE_S),
        http=_Protocol,
        backlog=ACCEPT_BACKLOG,
    )
    server = _Server(config, app, args.shutdown_timeout_s, report_ready)
    asyncio.run(server.serve(sockets=[bind(args.host, args.port)]))
