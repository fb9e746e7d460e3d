"""Issue 8's reproductions, each a regression test, plus the limits that bound one request.

Unit tests first (rules, middleware, the engine client); then one real server (the tiny Qwen3
checkpoint) with small limits, an API key and a 1 s request timeout. Every server test ends with
the server still healthy; the last one checks that nothing logged a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import socket
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest
import uvicorn
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from minisgl.api.app import _NotAgainSoon, _Protocol
from minisgl.api.errors import ChoiceFailed, RequestError
from minisgl.api.middleware import Gate, Lifecycle
from minisgl.api.sse import stream_frames
from minisgl.chat.jsontext import _skeleton, check_json
from minisgl.chat.template import apply_chat_template
from minisgl.config import ServerArgs
from minisgl.core import FinishReason, ReqOutput, SamplingParams
from minisgl.limits import (
    CLIENT_TIMEOUT_S,
    MAX_JSON_ITEMS,
    MAX_JSON_OBJECTS,
    MAX_STOP_STRINGS,
    InvalidRequestError,
    ModelLimits,
    check_request,
    resolve_max_tokens,
)
from minisgl.runtime.engine_client import EngineClient
from minisgl.runtime.messages import Endpoints, MessageQueue, TokenizedRequest
from minisgl.scheduler.process import MAX_FAILED_STEPS_IN_A_ROW, SchedulerLoop
from minisgl.scheduler.scheduler import Scheduler
from minisgl.tokenizer import load_tokenizer
from tests.conftest import QWEN3_VOCAB
from tests.server_utils import ServerProcess, running_server, wait_idle

API_KEY = "hardening-key"
KV_POOL_TOKENS = 600  # below the 1024-token context: /v1/models must report this
MAX_SEQUENCES = 8
MAX_RUNNING = 4
MAX_QUEUED = 4  # with MAX_RUNNING: 8 sequences in flight at most
# Long enough for any small request on a busy machine; the timeout test freezes the scheduler.
REQUEST_TIMEOUT_S = 5.0
MAX_BODY_BYTES = 256 * 1024
SERVER_FLAGS = (
    "--num-pages", str(KV_POOL_TOKENS),
    "--max-sequences-per-request", str(MAX_SEQUENCES),
    "--max-running-requests", str(MAX_RUNNING),
    "--max-queued-requests", str(MAX_QUEUED),
    "--request-timeout", str(REQUEST_TIMEOUT_S),
    "--max-request-body-bytes", str(MAX_BODY_BYTES),
)  # fmt: skip
HTTP_TIMEOUT_S = 60.0


# ---- rules, without a server -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"top_k": 2**63}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"stop_token_ids": [2**64]}, "stop_token_ids"),
        ({"stop_token_ids": [1.0]}, "stop_token_ids"),
        ({"seed": 2**64}, "seed"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": 2**40}, "max_tokens"),
        ({"temperature": "1"}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"min_p": float("inf")}, "min_p"),
        ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop"),
        ({"stop": ["x" * 5000]}, "stop"),
        ({"logprobs": True}, "logprobs"),
    ],
)
def test_sampling_params_bound_every_value(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:") as info:
        SamplingParams(**kwargs)
    assert info.value.param == field  # type: ignore[attr-defined]


def test_model_limits_name_the_field_to_blame():
    limits = ModelLimits(max_model_len=100, vocab_size=50, kv_capacity_tokens=60)
    assert resolve_max_tokens(None, 10, limits) == 50  # the KV pool is the smaller limit
    assert resolve_max_tokens(5, 10, limits) == 5
    with pytest.raises(ValueError, match="^messages: .*maximum KV cache capacity is 60") as info:
        resolve_max_tokens(None, 60, limits, prompt_param="messages")
    assert info.value.param == "messages"  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="^prompt: .*context length is 100 .* 120 tokens"):
        resolve_max_tokens(10, 110, limits)  # the prompt alone is too long: blame the prompt
    with pytest.raises(ValueError, match="^max_completion_tokens: .*KV cache .* 70 tokens"):
        resolve_max_tokens(60, 10, limits, max_tokens_param="max_completion_tokens")
    with pytest.raises(ValueError, match="^top_k: must be at most the vocabulary size"):
        check_request([1, 2], SamplingParams(top_k=51), limits)
    check_request([1, 2], SamplingParams(top_k=50), limits)
    with pytest.raises(ValueError, match="^prompt: token id 50 is outside"):
        check_request([1, 50], SamplingParams(), limits)
    with pytest.raises(ValueError, match="^prompt: must not be empty"):
        check_request([], SamplingParams(), limits)


def test_chat_template_errors_are_value_errors(tiny_qwen3):
    """Templates call raise_exception (e.g. "roles must alternate"): a 400, not a 500."""
    tokenizer = load_tokenizer(tiny_qwen3)
    tokenizer.chat_template = "{{ raise_exception('Conversation roles must alternate') }}"
    with pytest.raises(ValueError, match="^messages: .*roles must alternate"):
        apply_chat_template(tokenizer, [{"role": "user", "content": "hi"}])


def _asgi_client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def _guarded_app(lifecycle: Lifecycle, max_body_bytes: int = 1000) -> Starlette:
    async def boom(request):
        raise RuntimeError("handler bug")

    async def echo(request):
        return PlainTextResponse(str(len(await request.body())))

    routes = [Route("/boom", boom), Route("/echo", echo, methods=["POST"]), Route("/metrics", echo)]
    app = Starlette(routes=routes)
    app.add_middleware(Gate, lifecycle, None, max_body_bytes, lambda *_: None)
    return app


def test_request_guard_answers_500_once_with_a_request_id(caplog):
    app = _guarded_app(Lifecycle())

    async def main() -> tuple[httpx.Response, httpx.Response]:
        async with _asgi_client(app) as client:
            return await client.get("/boom"), await client.post("/echo", content=b"abc")

    with caplog.at_level(logging.ERROR):
        broken, ok = asyncio.run(main())
    assert broken.status_code == 500 and ok.text == "3"
    error = broken.json()["error"]
    assert error["type"] == "server_error" and error["code"] == 500
    request_id = broken.headers["x-request-id"]
    assert request_id in error["message"] and "handler bug" not in error["message"]
    failures = [r for r in caplog.records if r.exc_info]
    assert len(failures) == 1 and request_id in failures[0].getMessage()


def test_scheduler_loop_survives_a_failed_step(tiny_qwen3, monkeypatch):
    """The scheduler process's loop, on real sockets: a step that raises ends the requests it
    ran with an internal error (a 500 for the client) and the loop serves the next request;
    MAX_FAILED_STEPS_IN_A_ROW failures in a row end the loop (and the server) as before."""
    endpoints = Endpoints.create()
    sched = Scheduler(
        ServerArgs(model=str(tiny_qwen3), dtype="float32", num_pages=600, overlap="off")
    )
    detokenizer = MessageQueue("pull", endpoints.detokenizer_in)
    api = MessageQueue("pull", endpoints.api_in)
    loop = SchedulerLoop(sched, endpoints)
    to_scheduler = MessageQueue("push", endpoints.scheduler_in)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    real_forward = sched.engine.forward
    failures = {"left": 1}

    def flaky_forward(*args, **kwargs):
        if failures["left"] > 0:
            failures["left"] -= 1
            raise RuntimeError("injected")
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(sched.engine, "forward", flaky_forward)

    def run(rid: str) -> list[ReqOutput]:
        to_scheduler.put(TokenizedRequest(rid, tuple(range(10, 30)), params))
        outputs: list[ReqOutput] = []
        for _ in range(200):
            loop.run_once(idle_timeout_s=0.05)
            while (message := detokenizer.get(timeout_s=0.0)) is not None:
                if isinstance(message, tuple):  # a step's outputs
                    outputs += [o for o in message if o.rid == rid]
            if outputs and outputs[-1].finish_reason is not None:
                return outputs
        raise AssertionError(f"{rid} did not finish")

    try:
        [failed] = run("first")
        assert failed.finish_reason == FinishReason.ERROR and failed.internal_error
        assert "RuntimeError: injected" in (failed.error or "")
        second = run("second")
        assert second[-1].finish_reason == FinishReason.LENGTH
        assert sum(len(o.token_ids) for o in second) == 4
        sched.check_page_accounting()
        # Failed steps with no good one between them: the last of the limit ends the loop.
        failures["left"] = MAX_FAILED_STEPS_IN_A_ROW
        for i in range(MAX_FAILED_STEPS_IN_A_ROW - 1):
            assert run(f"doomed{i}")[-1].finish_reason == FinishReason.ERROR
        with pytest.raises(RuntimeError, match="injected"):
            run("last")
    finally:
        for queue in (to_scheduler, detokenizer, api):
            queue.close()
        loop.close()
        sched.shutdown()
        endpoints.remove()


def test_body_limit_refuses_large_bodies_and_replays_small_ones():
    app = _guarded_app(Lifecycle(), max_body_bytes=1000)

    async def chunks(num: int) -> AsyncIterator[bytes]:
        for _ in range(num):
            yield b"x" * 300

    async def main() -> list[httpx.Response]:
        async with _asgi_client(app) as client:
            return [
                await client.post("/echo", content=b"x" * 1000),
                await client.post("/echo", content=b"x" * 1001),
                await client.post("/echo", content=chunks(3)),  # no Content-Length: counted
                await client.post("/echo", content=chunks(4)),
            ]

    small, large, small_chunked, large_chunked = asyncio.run(main())
    assert small.text == "1000" and small_chunked.text == "900"
    for response in (large, large_chunked):
        assert response.status_code == 413 and "1000 bytes" in response.json()["error"]["message"]


def test_drain_gate_refuses_new_requests_but_keeps_metrics():
    lifecycle = Lifecycle(draining=True)
    app = _guarded_app(lifecycle)

    async def main() -> tuple[httpx.Response, httpx.Response]:
        async with _asgi_client(app) as client:
            return await client.post("/echo", content=b"x"), await client.get("/metrics")

    refused, metrics = asyncio.run(main())
    assert refused.status_code == 503 and refused.headers["connection"] == "close"
    assert refused.json()["error"]["message"] == "The server is shutting down."
    assert metrics.status_code == 200 and lifecycle.num_open_requests == 0


def test_a_stream_that_fails_ends_with_an_error_event(caplog):
    """After the 200 went out, a bug or a RequestError still ends the stream properly."""

    async def events(error: Exception):
        yield {"part": "first"}
        raise error

    async def collect(error: Exception) -> list[str]:
        run = SimpleNamespace(id="req-1", close=lambda: None)
        frames = stream_frames(run, events(error))  # type: ignore[arg-type]
        return [frame async for frame in frames]

    with caplog.at_level(logging.ERROR):
        crashed = asyncio.run(collect(RuntimeError("bug")))
        timed_out = asyncio.run(collect(RequestError(504, "too slow", err_type="timeout_error")))
    assert crashed[0] == 'data: {"part":"first"}\n\n' and crashed[-1] == "data: [DONE]\n\n"
    error = json.loads(crashed[1][len("data: ") :])["error"]
    assert error["code"] == 500 and "req-1" in error["message"]
    assert [r.getMessage() for r in caplog.records if r.exc_info] == [
        "request req-1 failed while streaming"
    ]
    error = json.loads(timed_out[1][len("data: ") :])["error"]
    assert error == {"message": "too slow", "type": "timeout_error", "param": None, "code": 504}
    # a choice the scheduler failed: the request's fault (400-like) or the server's (500)
    for internal, kind, code in (
        (False, "invalid_request_error", None),
        (True, "server_error", 500),
    ):
        failed = asyncio.run(collect(ChoiceFailed("failed", internal)))
        error = json.loads(failed[1][len("data: ") :])["error"]
        assert (error["type"], error["code"]) == (kind, code)


def test_failed_submit_leaves_no_route():
    """A send that raises (here: a value msgpack cannot encode) must not leave the request's
    route registered: that was a leak of ~2 KB per request."""

    async def main() -> None:
        endpoints = Endpoints.create()
        engine = EngineClient(endpoints)
        try:
            params = SamplingParams(max_tokens=2)
            object.__setattr__(params, "top_k", 2**64)  # slip past validation on purpose
            with pytest.raises((OverflowError, TypeError)):  # msgpack: too big for int64
                engine.submit(TokenizedRequest("r1", (1, 2), params), asyncio.Queue())
            assert engine.num_active_requests == 0
            request = TokenizedRequest("r2", (1, 2), SamplingParams(max_tokens=2))
            engine.submit(request, asyncio.Queue())
            assert engine.num_active_requests == 1
        finally:
            await engine.close()
            endpoints.remove()

    asyncio.run(main())


# ---- one real server -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_qwen3) -> Iterator[ServerProcess]:
    with running_server("--model", str(tiny_qwen3), *SERVER_FLAGS, api_key=API_KEY) as srv:
        warm_up = {"prompt": [1, 2, 3], "max_tokens": 2}  # the first forward is the slowest
        httpx.post(srv.url + "/v1/completions", json=warm_up, headers=srv.headers, timeout=60)
        yield srv


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=HTTP_TIMEOUT_S) as c:
        yield c


@pytest.fixture(autouse=True)
def no_traceback_logged(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every server test: what the server logged while it ran holds no traceback (each bad
    request was answered without an exception), whichever tests ran before it."""
    if "server" not in request.fixturenames:
        yield
        return
    server: ServerProcess = request.getfixturevalue("server")
    log_start = len(server.log())
    yield
    logged = server.log()[log_start:]
    assert "Traceback" not in logged, logged[-4000:]


def _error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    if param is not None:
        assert error["param"] == param, error
    return error


def _raw(http: httpx.Client, path: str, body: bytes) -> httpx.Response:
    return http.post(path, content=body, headers={"Content-Type": "application/json"})


def _assert_serving(http: httpx.Client, server: ServerProcess) -> None:
    response = http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
    assert response.status_code == 200, response.text
    assert httpx.get(server.url + "/health").status_code == 200
    wait_idle(server)


CAPACITY_BACK_TIMEOUT_S = 10.0
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "hi", "max_tokens": 2}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        # issue 8, defect 1: this one used to kill the scheduler (and the server)
        ("/v1/completions", COMPLETION | {"top_k": 9223372036854775808}, "top_k"),
        ("/v1/completions", COMPLETION | {"top_k": QWEN3_VOCAB + 1}, "top_k"),
        ("/v1/chat/completions", CHAT | {"top_k": 2**64}, "top_k"),
        # defect 2: msgpack could not encode these (500, reset connection, leaked route)
        ("/v1/completions", COMPLETION | {"stop_token_ids": [2**64]}, "stop_token_ids"),
        ("/v1/completions", COMPLETION | {"stop_token_ids": [-1]}, "stop_token_ids"),
        ("/v1/completions", COMPLETION | {"seed": 2**64}, "seed"),
        ("/v1/completions", COMPLETION | {"max_tokens": 2**70}, "max_tokens"),
        ("/v1/completions", COMPLETION | {"logprobs": 2**64}, "logprobs"),
        ("/v1/completions", COMPLETION | {"n": 10**30}, "n"),
        ("/v1/completions", {"prompt": [[2**64]], "max_tokens": 2}, "prompt"),
        ("/v1/completions", {"prompt": [QWEN3_VOCAB], "max_tokens": 2}, "prompt"),
        ("/v1/chat/completions", CHAT | {"logprobs": True, "top_logprobs": 2**64}, "top_logprobs"),
    ],
)
def test_huge_integers_are_a_400(http, server, path, body, param):
    _error(http.post(path, json=body), 400, param)
    _assert_serving(http, server)


@pytest.mark.parametrize("seed", [2**63 - 1, -(2**63)])
def test_every_valid_seed_serves_n_choices(http, server, seed):
    # issue 45: choice j's seed + j used to overflow 64 bits and make this a 400
    body = COMPLETION | {"seed": seed, "n": 3, "temperature": 1.0}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 3
    # the same seed gives the same choices: each one's seed is derived, not drawn
    again = http.post("/v1/completions", json=body).json()["choices"]
    assert [c["text"] for c in again] == [c["text"] for c in response.json()["choices"]]
    _assert_serving(http, server)


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        ("/v1/completions", rb'{"prompt": "\ud800", "max_tokens": 2}', "prompt"),
        ("/v1/completions", rb'{"prompt": ["ok", "a\udfffb"], "max_tokens": 2}', "prompt"),
        ("/v1/completions", rb'{"prompt": "hi", "stop": ["\ud800"], "max_tokens": 2}', "stop"),
        ("/v1/completions", rb'{"prompt": "hi", "model": "\ud800", "max_tokens": 2}', "model"),
        ("/v1/completions", rb'{"prompt": "hi", "unknown": {"\ud800": 1}}', "unknown"),
        (
            "/v1/chat/completions",
            rb'{"messages": [{"role": "user", "content": "\ud800"}], "max_tokens": 2}',
            "messages",
        ),
        (
            "/v1/chat/completions",
            rb'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]}',
            "messages",
        ),
        # UTF-8 bytes of a surrogate: Python's JSON decoder lets them through as one
        ("/v1/completions", b'{"prompt": "\xed\xa0\x80", "max_tokens": 2}', "prompt"),
    ],
)
def test_lone_surrogates_are_a_400(http, server, path, raw, param):
    _error(_raw(http, path, raw), 400, param)
    _assert_serving(http, server)


@pytest.mark.parametrize(
    ("field", "raw_value"),
    [
        ("max_tokens", '"3"'),
        ("max_tokens", "true"),
        ("max_tokens", "3.0"),
        ("n", '"2"'),
        ("temperature", '"0.5"'),
        ("stream", '"yes"'),
        ("stop_token_ids", "[1.5]"),
        ("stop", "[1]"),
    ],
)
def test_types_are_strict(http, field, raw_value):
    raw = f'{{"prompt": "hi", "max_tokens": 2, "{field}": {raw_value}}}'.encode()
    error = _error(_raw(http, "/v1/completions", raw), 400, field)
    assert error["type"] == "invalid_request_error"


def test_error_param_names_the_field_the_client_sent(http, server):
    long_prompt = list(range(1, KV_POOL_TOKENS + 5))
    error = _error(http.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 2}), 400)
    assert error["param"] == "prompt" and str(KV_POOL_TOKENS) in error["message"]
    long_chat = {"messages": [{"role": "user", "content": "hi " * 2000}], "max_tokens": 2}
    _error(http.post("/v1/chat/completions", json=long_chat), 400, "messages")
    too_many = CHAT | {"max_tokens": None, "max_completion_tokens": KV_POOL_TOKENS}
    _error(http.post("/v1/chat/completions", json=too_many), 400, "max_completion_tokens")
    zero = CHAT | {"max_tokens": None, "max_completion_tokens": 0}
    _error(http.post("/v1/chat/completions", json=zero), 400, "max_completion_tokens")
    _error(http.post("/v1/completions", json=COMPLETION | {"max_tokens": 0}), 400, "max_tokens")
    top = CHAT | {"logprobs": True, "top_logprobs": 21}
    _error(http.post("/v1/chat/completions", json=top), 400, "top_logprobs")
    _error(http.post("/v1/completions", json=COMPLETION | {"logprobs": 21}), 400, "logprobs")
    _assert_serving(http, server)


def test_models_reports_what_the_kv_pool_can_hold(http, server):
    card = http.get("/v1/models").json()["data"][0]
    assert card["max_model_len"] == KV_POOL_TOKENS  # not the 1024-token context
    # A request may use exactly what is left of that, and not a token more.
    prompt = list(range(1, KV_POOL_TOKENS - 1))
    body = {"prompt": prompt, "ignore_eos": True, "max_tokens": 2}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2
    error = _error(http.post("/v1/completions", json=body | {"max_tokens": 3}), 400, "max_tokens")
    assert f"capacity is {KV_POOL_TOKENS} tokens" in error["message"]
    _assert_serving(http, server)


def test_sequences_per_request_are_bounded(http, server):
    # issue 8, defect 4: 20 prompts x n=128 in a 1 KB body queued 2,560 sequences
    fan_out = {"prompt": ["a"] * 20, "n": 128, "max_tokens": 2}
    assert len(json.dumps(fan_out)) < 1024
    error = _error(http.post("/v1/completions", json=fan_out), 400, "n")
    assert "2560 sequences" in error["message"] and str(MAX_SEQUENCES) in error["message"]
    many_prompts = {"prompt": ["a"] * 5, "n": 2, "max_tokens": 2}  # each fine, together not
    _error(http.post("/v1/completions", json=many_prompts), 400, "prompt")
    _error(http.post("/v1/completions", json=COMPLETION | {"n": MAX_SEQUENCES + 1}), 400, "n")
    _error(http.post("/v1/completions", json=COMPLETION | {"n": 129}), 400, "n")
    at_limit = {"prompt": ["a", "b"], "n": MAX_SEQUENCES // 2, "max_tokens": 2}
    response = http.post("/v1/completions", json=at_limit)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == MAX_SEQUENCES
    _assert_serving(http, server)


def test_body_size_is_bounded(http, server):
    big = {"prompt": "a" * MAX_BODY_BYTES, "max_tokens": 2}
    error = _error(http.post("/v1/completions", json=big), 413)
    assert str(MAX_BODY_BYTES) in error["message"]
    # Nesting beyond what the JSON parser takes is a 400, not a crash.
    deep = b"[" * 100_000 + b"]" * 100_000
    assert len(deep) < MAX_BODY_BYTES
    _error(_raw(http, "/v1/completions", deep), 400)
    _assert_serving(http, server)


@contextlib.contextmanager
def frozen_scheduler(server: ServerProcess) -> Iterator[None]:
    """Suspend the scheduler process: requests sent meanwhile stay in flight, whatever the
    machine's speed, until it resumes (and then sees their aborts)."""
    scheduler = next(p for p in server.children if p.name() == "minisgl:sched")
    scheduler.suspend()
    try:
        yield
    finally:
        scheduler.resume()


def test_full_queue_is_a_503_with_retry_after(http, server):
    """8 sequences in flight fill running (4) plus queued (4): the 9th gets a 503."""
    body = {"prompt": [1, 2, 3], "max_tokens": 100, "n": 8, "stream": True}
    with frozen_scheduler(server), http.stream("POST", "/v1/completions", json=body):
        rejected = http.post("/v1/completions", json=COMPLETION)
    error = _error(rejected, 503)
    assert error["type"] == "server_overloaded"
    assert int(rejected.headers["retry-after"]) >= 1
    # Leaving the stream aborts its 8 sequences; the API server notices the disconnect
    # asynchronously, so their places in the queue come back within moments, not at once.
    deadline_s = time.monotonic() + CAPACITY_BACK_TIMEOUT_S
    while http.post("/v1/completions", json=COMPLETION).status_code == 503:
        assert time.monotonic() < deadline_s, "the aborted sequences still hold the queue"
        time.sleep(0.1)
    _assert_serving(http, server)


def test_request_timeout_aborts_and_frees_pages(http, server):
    body = {"prompt": [1, 2, 3], "max_tokens": 100}
    aborted_before = wait_idle(server)["minisgl:aborted_requests_total"]
    with frozen_scheduler(server), ThreadPoolExecutor(2) as pool:
        start_s = time.monotonic()
        plain = pool.submit(http.post, "/v1/completions", json=body)

        def stream() -> list[str]:
            with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as events:
                return [line for line in events.iter_lines() if line.startswith("data: ")]

        streamed = pool.submit(stream)
        error = _error(plain.result(), 504)
        events = streamed.result()
        elapsed_s = time.monotonic() - start_s
    assert error["type"] == "timeout_error" and f"{REQUEST_TIMEOUT_S:g} s" in error["message"]
    assert REQUEST_TIMEOUT_S <= elapsed_s < REQUEST_TIMEOUT_S + 10
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][len("data: ") :])["error"]["code"] == 504
    metrics = wait_idle(server)  # the scheduler saw both aborts once it resumed
    assert metrics["minisgl:aborted_requests_total"] == aborted_before + 2  # these two only
    _assert_serving(http, server)


def _answered(server: ServerProcess) -> dict[tuple[str, str, int], float]:
    """minisgl:http_requests_total by (route template, method, status)."""
    series = re.compile(
        r'^minisgl:http_requests_total\{handler="([^"]*)",method="(\w+)",status="(\d+)"\}$'
    )
    counts = {}
    for name, value in server.metrics().items():
        if match := series.match(name):
            counts[match[1], match[2], int(match[3])] = value
    return counts


def test_api_key_covers_docs_but_not_probes(server):
    before = _answered(server)
    for path in ("/openapi.json", "/docs", "/v1/models"):
        assert httpx.get(server.url + path).status_code == 401, path
        assert httpx.get(server.url + path, headers=server.headers).status_code == 200, path
    for path in ("/health", "/metrics"):
        assert httpx.get(server.url + path).status_code == 200, path
    # Anthropic's SDK sends the key as x-api-key; a refusal there has Anthropic's shape
    assert httpx.get(server.url + "/v1/models", headers={"x-api-key": API_KEY}).status_code == 200
    body = {"max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}
    wrong = httpx.post(server.url + "/v1/messages", json=body, headers={"x-api-key": "nope"})
    assert wrong.status_code == 401
    assert wrong.json()["error"]["type"] == "authentication_error"
    assert wrong.json()["type"] == "error"
    good = httpx.post(
        server.url + "/v1/messages", json=body, headers={"x-api-key": API_KEY}, timeout=60
    )
    assert good.status_code == 200, good.text
    assert httpx.get(server.url + "/no/such/path", headers=server.headers).status_code == 404
    # every answer is counted by route template, the refusals before routing included: the
    # counts grew by exactly what this test sent (the /metrics scrapes aside)
    expected = {
        ("/openapi.json", "GET", 401): 1, ("/openapi.json", "GET", 200): 1,
        ("/docs", "GET", 401): 1, ("/docs", "GET", 200): 1,
        ("/v1/models", "GET", 401): 1, ("/v1/models", "GET", 200): 2,
        ("/health", "GET", 200): 1,
        ("/v1/messages", "POST", 401): 1, ("/v1/messages", "POST", 200): 1,
        ("unmatched", "GET", 404): 1,
    }  # fmt: skip
    deadline_s = time.monotonic() + CAPACITY_BACK_TIMEOUT_S  # counted as each answer ends
    while True:
        after = _answered(server)
        grown = {key: after[key] - before.get(key, 0.0) for key in after}
        grown = {key: n for key, n in grown.items() if n and key[0] != "/metrics"}
        if grown == expected or time.monotonic() > deadline_s:
            break
        time.sleep(0.1)
    assert grown == expected


# ---- issue 26: JSON that recursive code would choke on, labels, probes -------------------------

DEEP_ARRAY = "[" * 900 + "]" * 900
DEEP_OBJECT = '{"a":' * 900 + "1" + "}" * 900
HELLO = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        # nested past the bound in the body: refused at the edge, whatever the field
        ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": "hi"}}], '
         f'"chat_template_kwargs": {{"x": {DEEP_ARRAY}}}}}', "body"),
        ("/v1/messages", '{"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}, '
         '{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", '
         f'"input": {DEEP_OBJECT}}}]}}]}}', "body"),
        ("/v1/responses", f'{{"input": "hi", "metadata": {{"a": {DEEP_ARRAY}}}}}', "body"),
        ("/tokenize", f'{{"messages": [{{"role": "user", "content": {DEEP_ARRAY}}}]}}', "body"),
        ("/generate", f'{{"text": "hi", "x": {DEEP_ARRAY}}}', "body"),
        # ... and inside a string that is parsed as JSON
        ("/generate", json.dumps({"text": "hi", "sampling_params": {
            "json_schema": '{"default": ' + DEEP_ARRAY + "}"}}),
         "sampling_params.json_schema"),
        ("/v1/chat/completions", json.dumps({"messages": HELLO, "chat_template_kwargs":
            '{"x": ' + DEEP_ARRAY + "}"}), "chat_template_kwargs"),
        # numbers Python cannot hold, and NaN / Infinity (not JSON)
        ("/v1/completions", json.dumps(COMPLETION | {"logit_bias": {"1" * 5000: 1}}),
         "logit_bias"),
        ("/v1/chat/completions", json.dumps(CHAT | {"logit_bias": {"9" * 4400: 1}}),
         "logit_bias"),
        ("/v1/responses", '{"input": "hi", "tools": [{"type": "function", "name": "f", '
         '"parameters": {"type": "object", "properties": {"a": {"maximum": NaN}}}}]}', "body"),
        ("/v1/responses", '{"input": "hi", "text": {"format": {"type": "json_schema", '
         '"name": "x", "schema": {"maximum": 1e999}}}}', "body"),
        ("/v1/responses", '{"input": "hi", "stream": true, "tool_choice": Infinity}', "body"),
        ("/v1/completions", '{"prompt": "hi", "temperature": NaN}', "body"),
    ],
)  # fmt: skip
def test_json_past_what_python_walks_is_a_400(http, server, path, raw, param):
    response = _raw(http, path, raw.encode())
    assert response.status_code == 400, response.text
    if path != "/v1/messages":
        error = _error(response, 400)
        assert error["param"] == param or error["message"].startswith(f"{param}:"), error
    _assert_serving(http, server)


def test_a_deep_tool_call_argument_string_stays_text(http, server):
    """Earlier calls' `arguments` are rendered as objects when they parse: one too deep to walk
    (900 levels made transformers' template code recurse to a 500) is kept as the text it is."""

    def conversation(arguments: str) -> list[dict]:
        call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
        tool = {"role": "tool", "tool_call_id": "c", "content": "x"}
        return [*HELLO, {"role": "assistant", "content": None, "tool_calls": [call]}, tool]

    counted = http.post("/tokenize", json={"messages": conversation(DEEP_OBJECT)})
    assert counted.status_code == 200, counted.text
    assert counted.json()["count"] > 900  # the arguments, as text
    shallow = conversation('{"a":' * 150 + "1" + "}" * 150)  # fits the context
    response = http.post("/v1/chat/completions", json={"messages": shallow, "max_tokens": 2})
    assert response.status_code == 200, response.text
    _assert_serving(http, server)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses",
                                  "/v1/messages", "/generate", "/tokenize"])  # fmt: skip
def test_json_is_utf8_on_every_route(http, server, path):
    body = {
        "/v1/completions": COMPLETION, "/v1/chat/completions": CHAT,
        "/v1/responses": {"input": "hi", "max_output_tokens": 2},
        "/v1/messages": CHAT, "/generate": {"text": "hi", "sampling_params": {"max_new_tokens": 2}},
        "/tokenize": {"prompt": "hi"},
    }[path]  # fmt: skip
    text = json.dumps(body)
    assert _raw(http, path, text.encode()).status_code == 200
    assert _raw(http, path, b"\xef\xbb\xbf" + text.encode()).status_code == 200  # BOM: ignored
    for encoding in ("utf-16", "utf-16-le", "utf-32"):
        refused = _raw(http, path, text.encode(encoding))
        assert refused.status_code == 400 and "UTF-8" in refused.text, (encoding, refused.text)
    _assert_serving(http, server)


def test_content_length_with_chunked_is_a_400(server):
    """RFC 9112 6.3: a proxy and the server could disagree on where such a body ends."""
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {API_KEY}\r\nContent-Length: 2\r\n"
        "Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", server.port), timeout=HTTP_TIMEOUT_S) as sock:
        sock.sendall(head.encode())
        answer = sock.recv(65536).decode(errors="replace")
    assert answer.startswith("HTTP/1.1 400"), answer[:200]


def test_made_up_methods_pool_into_one_metric_label(http, server):
    for i in range(100):
        assert http.request(f"M{i:05d}", "/health").status_code == 405
        http.request(f"M{i:05d}", f"/no/such/{i}")
    methods = {method for _, method, _ in _answered(server)}
    assert methods <= {"GET", "POST", "other"}, methods
    assert sum(1 for key in _answered(server) if key[1] == "other") <= 2  # /health, unmatched


def _num_finished(metrics: dict[str, float]) -> float:
    return sum(v for k, v in metrics.items() if k.startswith("minisgl:request_success_total{"))


def test_health_generate_needs_the_key_and_never_queues_behind_work(http, server):
    assert httpx.get(server.url + "/health_generate").status_code == 401
    assert httpx.get(server.url + "/health_generate", headers=server.headers).status_code == 200
    finished = _num_finished(wait_idle(server))
    body = {"prompt": [1, 2, 3], "max_tokens": 500, "stream": True, "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json=body) as events, ThreadPoolExecutor(8) as pool:
        lines = events.iter_lines()
        next(lines)  # the stream runs: the engine is busy
        probes = list(pool.map(lambda _: http.get("/health_generate").status_code, range(16)))
        assert probes == [200] * 16
        assert sum(1 for line in lines if line.startswith("data: ")) > 1  # still ran after
    assert _num_finished(wait_idle(server)) == finished + 1  # the stream alone: no probe ran


def _read_until_closed(sock: socket.socket, deadline_s: float) -> bytes:
    answer = b""
    while chunk := sock.recv(65536):
        answer += chunk
        assert time.monotonic() < deadline_s, answer[:200]
    return answer


def test_half_sent_requests_are_closed_in_time(http, server):
    """Slowloris: an idle socket, half a request line, headers never ended, a body that stops
    arriving (declared or chunked) all hold a descriptor; each is closed within
    CLIENT_TIMEOUT_S (the bodies with a 408), and the server answers others meanwhile."""
    auth = f"Host: x\r\nAuthorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n"
    post = f"POST /v1/completions HTTP/1.1\r\n{auth}"
    sent = {
        "idle": b"",
        "half a line": b"GET /hea",
        "unended headers": b"GET /health HTTP/1.1\r\nHost: x\r\n",
        "short body": f'{post}Content-Length: 1000\r\n\r\n{{"prompt"'.encode(),
        "unended chunks": f'{post}Transfer-Encoding: chunked\r\n\r\n3\r\n{{"p\r\n'.encode(),
        "unended chunks, probe": b"POST /health HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
    }
    start_s = time.monotonic()
    sockets = {name: socket.create_connection(("127.0.0.1", server.port)) for name in sent}
    for name, data in sent.items():
        sockets[name].sendall(data)
    _assert_serving(http, server)
    for name, sock in sockets.items():
        with sock:
            sock.settimeout(CLIENT_TIMEOUT_S + HTTP_TIMEOUT_S)
            answer = _read_until_closed(sock, start_s + CLIENT_TIMEOUT_S + 10.0)
        status = answer.split(b"\r\n", 1)[0]
        expected = {"short body": b"HTTP/1.1 408", "unended chunks": b"HTTP/1.1 408"}
        assert status.startswith(expected.get(name, b"")), (name, answer[:300])
    assert time.monotonic() - start_s >= CLIENT_TIMEOUT_S - 1.0  # none was cut before its time
    _assert_serving(http, server)


def test_connections_past_the_bound_close_the_oldest_idle_one():
    """Below the descriptor limit, a new connection closes the longest-open one that has no
    request in progress: trickling clients cannot fill the limit and lock everyone out."""
    max_connections = 4

    async def main() -> None:
        async def app(scope, receive, send):
            await PlainTextResponse("ok")(scope, receive, send)

        config = uvicorn.Config(app, http=_Protocol, log_level="warning", lifespan="off")
        uvicorn_server = uvicorn.Server(config)
        sock = socket.create_server(("127.0.0.1", 0))
        task = asyncio.create_task(uvicorn_server.serve(sockets=[sock]))
        while not uvicorn_server.started:
            await asyncio.sleep(0.01)
        streams = []
        for _ in range(max_connections + 3):
            reader, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            writer.write(b"GET / HTTP/1.1\r\n")  # half-sent
            streams.append((reader, writer))
        closed = [await asyncio.wait_for(r.read(), 5.0) == b"" for r, _ in streams[:3]]
        assert closed == [True] * 3  # the three oldest made room
        reader, writer = streams[-1]
        writer.write(b"Host: x\r\n\r\n")  # the newest one is served
        assert (await asyncio.wait_for(reader.readline(), 5.0)).startswith(b"HTTP/1.1 200")
        assert len(uvicorn_server.server_state.connections) == max_connections
        uvicorn_server.should_exit = True
        await task

    original = _Protocol.max_connections
    _Protocol.max_connections = max_connections
    try:
        asyncio.run(main())
    finally:
        _Protocol.max_connections = original


def test_a_repeated_log_line_is_written_once_per_interval():
    once = _NotAgainSoon()
    record = logging.LogRecord("asyncio", logging.ERROR, "", 0, "accept() failed", None, None)
    other = logging.LogRecord("asyncio", logging.ERROR, "", 0, "something else", None, None)
    assert [once.filter(record) for _ in range(1000)].count(True) == 1
    assert once.filter(other)


_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(_JSON_VALUES)
def test_json_skeleton_cuts_exactly_the_strings(value):
    """The vectorised skeleton equals cutting every string out with a JSON string regex, for
    any value (escaped quotes and backslashes in keys and strings included)."""
    raw = json.dumps(value, ensure_ascii=False).encode()
    string = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
    assert _skeleton(raw) == string.sub(b'""', raw)


def test_prompts_past_the_context_are_refused_before_tokenizing(http, server):
    """More characters than the context holds at the longest token's length, or more messages
    than tokens: a 400 before the template or the tokenizer runs (a body of small objects past
    the JSON bound too)."""
    context_len = KV_POOL_TOKENS * 2  # the tiny checkpoint's context (1024)
    letters = "abcdefgh " * (context_len * 128 // 9 + 1)  # Qwen3's longest token: 128 chars
    body = {"prompt": letters, "max_tokens": 1}
    error = _error(http.post("/v1/completions", json=body), 400, "prompt")
    assert f"{len(letters)} characters" in error["message"], error
    messages = [{"role": "user", "content": "hi"}] * (context_len + 1)
    body = {"messages": messages, "max_tokens": 1}
    error = _error(http.post("/v1/chat/completions", json=body), 400, "messages")
    assert f"{context_len + 1} messages" in error["message"], error
    _assert_serving(http, server)


def test_a_body_of_too_many_objects_is_refused():
    with pytest.raises(InvalidRequestError, match=f"more than {MAX_JSON_OBJECTS} objects"):
        check_json(json.dumps({"messages": [{}] * MAX_JSON_OBJECTS}).encode())
    check_json(json.dumps({"messages": [{}] * (MAX_JSON_OBJECTS - 1)}).encode())


def test_every_array_element_counts_against_the_body_bound():
    """Numbers too (issue 45): past MAX_JSON_ITEMS a body is refused before anything parses
    it, naming the field that holds them; a body at the bound passes."""
    ids = [1] * MAX_JSON_ITEMS
    with pytest.raises(InvalidRequestError, match=f"^prompt: holds more than {MAX_JSON_ITEMS}"):
        check_json(json.dumps({"model": "m", "prompt": ids, "max_tokens": 1}).encode())
    rows = [ids[:1000]] * (MAX_JSON_ITEMS // 1000 + 1)
    with pytest.raises(InvalidRequestError, match="^input_ids: "):
        check_json(json.dumps({"text": '"a", [1, 2]', "input_ids": rows}).encode())
    with pytest.raises(InvalidRequestError, match="^body: "):
        check_json(json.dumps([*ids, 1]).encode())
    check_json(json.dumps({"tokens": ids[:-2]}).encode())  # {, [ and the ids: the bound


# What the number check refused with one regex (RESULTS.md section 17), the oracle of its
# faster substring searches.
_BAD_NUMBER = re.compile(rb"NaN|Infinity|\d{4300}|[eE]\+?0*(?:[1-9]\d{3,}|[4-9]\d\d|3[1-9]\d|309)")


@pytest.mark.parametrize(
    "number",
    ["1e308", "1e309", "1E+0400", "2e-999", "1e0000308", "1e0000309", "0.5E+31", "9" * 4299,
     "9" * 4300, "1." + "0" * 5000, "NaN", "-Infinity", "12345", "true", "-0.0e3"],
)  # fmt: skip
def test_numbers_python_cannot_hold_are_refused(number):
    raw = f'{{"a": [true, false, null, {number}], "e": "1e999 NaN"}}'.encode()
    refused = _BAD_NUMBER.search(raw.replace(b'"1e999 NaN"', b""))
    try:
        check_json(raw)
    except InvalidRequestError as exc:
        assert refused and "NaN, Infinity" in exc.message, exc
    else:
        assert not refused


def test_token_id_bodies_of_every_legitimate_shape_are_served(http, server):
    """/detokenize (its longest: tests/test_grammar_isolation.py), a prompt of the whole context
    as ids, batches of id lists on /v1/completions and /generate (issue 45: the body bound counts
    every id); a malformed id list is a 400 naming its field."""
    ids = [5] * (MAX_BODY_BYTES // 4)
    detokenized = http.post("/detokenize", json={"tokens": ids})
    assert detokenized.status_code == 200 and len(detokenized.json()["prompt"]) >= len(ids)
    whole_context = {"prompt": [5] * (KV_POOL_TOKENS - 1), "max_tokens": 1}
    assert http.post("/v1/completions", json=whole_context).status_code == 200
    batch = http.post("/v1/completions", json={"prompt": [[5, 6, 7]] * 3, "max_tokens": 1})
    assert batch.status_code == 200 and len(batch.json()["choices"]) == 3, batch.text
    body = {"input_ids": [[5, 6], [7, 8]], "sampling_params": {"max_new_tokens": 1}}
    generated = http.post("/generate", json=body)
    assert generated.status_code == 200 and len(generated.json()) == 2, generated.text
    for prompt in ([5, "a"], [[5], [6, 7.0]], []):
        _error(
            http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}), 400, "prompt"
        )
    _error(http.post("/generate", json={"input_ids": [5, None]}), 400, "input_ids")
    _error(_raw(http, "/detokenize", b'{"tokens": [1, 2'), 400)
    _assert_serving(http, server)
