"""What chat and text completions share: request limits, sampling params, a group of sequences.

A request with n choices (and, for completions, several prompts) becomes one GenerationGroup: one
scheduler request per choice, all reporting into one asyncio queue. The group tracks per-choice
text, tokens, logprobs and timing, and aborts whatever is unfinished when the handler leaves
early (client disconnect, timeout, error). Errors that end a request early (timeout, a backend
that stopped) arrive on the same queue and are raised to the handler as a RequestError.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from transformers import PreTrainedTokenizerBase

from minisgl.chat import ChatSettings
from minisgl.core import (
    Constraint,
    FinishReason,
    InvalidRequestError,
    SamplingParams,
    TokenLogprob,
)
from minisgl.grammar import GrammarCompiler
from minisgl.limits import ModelLimits, check_request, resolve_max_tokens
from minisgl.runtime.engine_client import (
    DISCONNECTED,
    BackendUnavailable,
    EngineClient,
    RoutedOutput,
)
from minisgl.runtime.messages import DetokenizedOutput
from minisgl.server.errors import (
    HTTP_BAD_REQUEST,
    HTTP_GATEWAY_TIMEOUT,
    HTTP_SERVER_ERROR,
    HTTP_SERVICE_UNAVAILABLE,
    RequestError,
)
from minisgl.server.metrics import ServerMetrics
from minisgl.server.protocol import SamplingFields, error_dict
from minisgl.server.response_store import ResponseStore
from minisgl.server.sampling_fields import build_sampling_params
from minisgl.server.sse import SSE_DONE, SSE_HEADERS, SSE_MEDIA_TYPE, sse_event

logger = logging.getLogger(__name__)

# HTTP status for a response nobody will read (nginx's "client closed request").
CLIENT_CLOSED_REQUEST = 499
# Token id -> text is asked for every token when logprobs are on: cache the common ones.
TOKEN_TEXT_CACHE_SIZE = 1 << 16
# Queue full: how long a client should wait before trying again.
QUEUE_FULL_RETRY_AFTER_S = 1


def invalid_request(exc: InvalidRequestError, body: SamplingFields) -> RequestError:
    """A 400 for a broken rule, `param` named as this endpoint's clients spell it."""
    param = body.wire_param(exc.param)
    return RequestError(HTTP_BAD_REQUEST, f"{param}: {exc.message}", param=param)


def translated_request_error(exc: InvalidRequestError | ValidationError) -> RequestError:
    """A 400 for a rule broken while a request in another API's shape (Responses, Messages)
    was turned into a chat request: the rule's own field and message."""
    if isinstance(exc, ValidationError):  # a rule of the chat request it became
        first = exc.errors()[0]
        rule = first.get("ctx", {}).get("error")
        if not isinstance(rule, InvalidRequestError):
            return RequestError(HTTP_BAD_REQUEST, f"invalid request: {first['msg']}")
        exc = rule
    return RequestError(HTTP_BAD_REQUEST, str(exc), param=exc.param)


_T = TypeVar("_T")


class ClientDisconnected(Exception):
    pass


class ChoiceFailed(Exception):
    """A choice ended with an error while streaming: the stream ends with that error event."""

    def __init__(self, message: str, internal: bool = False) -> None:
        super().__init__(message)
        self.internal = internal  # the server's failure (a step that raised), not the request's


@dataclass
class ServingContext:
    """Everything a handler needs, built once when the API server starts."""

    tokenizer: PreTrainedTokenizerBase
    engine: EngineClient
    metrics: ServerMetrics
    served_model_name: str
    accepted_model_names: frozenset[str]
    limits: ModelLimits
    max_sequences_per_request: int
    max_in_flight_sequences: int  # running plus queued; more: 503
    request_timeout_s: float | None
    # Tokenizing a long prompt takes milliseconds: done on this one thread, not on the event loop,
    # so streams of other requests keep flowing. One thread: encodes never run concurrently.
    tokenize_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="minisgl-tokenize")
    )
    chat: ChatSettings = field(default_factory=ChatSettings)
    eos_token_ids: tuple[int, ...] = ()
    # For the sampling fields a request leaves unset (--sampling-defaults model): the checkpoint's
    # generation_config.json values; empty means the OpenAI API's defaults.
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)
    # /v1/responses with store: what GET /v1/responses/{id} and previous_response_id read.
    responses: ResponseStore = field(default_factory=ResponseStore)
    # Made at the first constrained request (reading the vocabulary takes ~0.5-1.5 s).
    _grammar: GrammarCompiler | None = field(default=None, init=False)

    def compile_constraint(self, constraint: Constraint, param: str) -> str:
        """Compile (cached) and serialize a constraint for the scheduler; on the tokenize
        thread. Raises InvalidRequestError naming `param` for a bad or unsupported one."""
        if self._grammar is None:
            self._grammar = GrammarCompiler(
                self.tokenizer, self.limits.vocab_size, self.eos_token_ids
            )
        try:
            return self._grammar.serialize(constraint)
        except InvalidRequestError as exc:
            raise InvalidRequestError(param, exc.message) from None

    async def off_loop(self, fn: Callable[..., _T], *args: Any) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, fn, *args)

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.accepted_model_names:
            raise RequestError(
                404, f"The model `{model}` does not exist.", param="model", err_type="NotFoundError"
            )

    def check_fan_out(self, num_prompts: int, n: int) -> None:
        """Bound the sequences one request starts (prompts x n), before any work is done."""
        if num_prompts * n > self.max_sequences_per_request:
            raise RequestError(
                HTTP_BAD_REQUEST,
                f"this request asks for {num_prompts * n} sequences ({num_prompts} prompts x "
                f"n={n}); the server allows at most {self.max_sequences_per_request}",
                param="n" if n > self.max_sequences_per_request else "prompt",
            )

    def check_capacity(self, num_sequences: int) -> None:
        """503 when the queue of waiting sequences would overflow (--max-queued-requests)."""
        if self.engine.num_active_requests + num_sequences > self.max_in_flight_sequences:
            raise RequestError(
                HTTP_SERVICE_UNAVAILABLE,
                "The server is overloaded: its request queue is full. Please retry later.",
                err_type="server_overloaded",
                headers={"Retry-After": str(QUEUE_FULL_RETRY_AFTER_S)},
            )

    def sampling_params_for(
        self,
        body: SamplingFields,
        prompt_ids: list[int],
        prompt_param: str,
        constraint: Constraint | None = None,
    ) -> list[SamplingParams]:
        """One SamplingParams per choice for this prompt, every rule checked (a 400 if not)."""
        try:
            max_tokens = resolve_max_tokens(
                body.requested_max_tokens,
                len(prompt_ids),
                self.limits,
                prompt_param,
                body.wire_param("max_tokens"),
            )
            params = [
                build_sampling_params(body, max_tokens, j, constraint, self.sampling_defaults)
                for j in range(body.n)
            ]
            check_request(prompt_ids, params[0], self.limits, prompt_param)  # same for every j
        except InvalidRequestError as exc:
            raise invalid_request(exc, body) from None
        return params

    @functools.cached_property
    def token_text(self) -> Any:
        @functools.lru_cache(maxsize=TOKEN_TEXT_CACHE_SIZE)
        def decode_one(token_id: int) -> str:
            return cast(str, self.tokenizer.decode([token_id], skip_special_tokens=False))

        return decode_one


@dataclass
class ChoiceState:
    index: int
    prompt_index: int
    rid: str
    text_parts: list[str] = field(default_factory=list)
    part_num_tokens: list[int] = field(default_factory=list)  # tokens behind each text part
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt tokens 1..
    num_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    finish_reason: FinishReason | None = None
    matched_stop: int | str | None = None  # DetokenizedOutput.matched_stop of the finish
    error: str | None = None
    internal_error: bool = False  # the server failed the request (a 500), not its input
    last_token_time_s: float | None = None
    logprob_text_offset: int = 0  # completions logprobs: where the next token's text starts

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class GenerationGroup:
    def __init__(
        self,
        ctx: ServingContext,
        request_id: str,
        prompts: Sequence[list[int]],
        params: Sequence[Sequence[SamplingParams]],
        grammar_blob: str | None = None,
    ) -> None:
        """params[p][j]: choice j of prompt p, whose choice index is p * n + j. grammar_blob:
        the compiled constraint every choice shares (ServingContext.compile_constraint)."""
        assert len(params) == len(prompts) and len({len(row) for row in params}) == 1
        self._ctx = ctx
        self.prompts = list(prompts)
        self.num_choices_per_prompt = len(params[0])
        self._params = [list(row) for row in params]
        self._grammar_blob = grammar_blob
        n = self.num_choices_per_prompt
        self.choices = [
            ChoiceState(index=p * n + j, prompt_index=p, rid=f"{request_id}-{p}-{j}")
            for p in range(len(prompts))
            for j in range(n)
        ]
        self._queue: asyncio.Queue = asyncio.Queue()
        self._num_unfinished = len(self.choices)
        self._arrival_time_s = time.perf_counter()
        self._watcher: asyncio.Task | None = None
        self._timer: asyncio.TimerHandle | None = None

    def start(self, request: Request) -> None:
        """Submit every choice, or none: on any failure the ones already sent are aborted."""
        self._ctx.check_capacity(len(self.choices))
        try:
            for choice in self.choices:
                row = self._params[choice.prompt_index]
                params = row[choice.index % self.num_choices_per_prompt]
                prompt = self.prompts[choice.prompt_index]
                self._ctx.engine.submit(
                    choice.rid, choice.index, prompt, params, self._queue, self._grammar_blob
                )
        except BackendUnavailable as exc:  # shutting down, or the backend stopped
            self.close()
            raise RequestError(HTTP_SERVICE_UNAVAILABLE, str(exc)) from None
        except BaseException:
            self.close()
            raise
        self._watcher = asyncio.create_task(self._watch_disconnect(request))
        timeout_s = self._ctx.request_timeout_s
        if timeout_s is not None:
            timed_out = RequestError(
                HTTP_GATEWAY_TIMEOUT,
                f"The request did not finish within the server's timeout ({timeout_s:g} s) "
                "and was aborted.",
                err_type="timeout_error",
            )
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(timeout_s, self._queue.put_nowait, timed_out)

    async def _watch_disconnect(self, request: Request) -> None:
        # The body is already read, so the next ASGI message is the disconnect (or the end).
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                self._queue.put_nowait(DISCONNECTED)
                return

    @property
    def done(self) -> bool:
        return self._num_unfinished == 0

    async def next_output(self) -> tuple[ChoiceState, DetokenizedOutput]:
        """The next output of any choice, with that choice's state already updated."""
        item = await self._queue.get()
        if item is DISCONNECTED:
            raise ClientDisconnected()
        if isinstance(item, RequestError):  # timed out
            raise item
        if isinstance(item, BackendUnavailable):  # the backend stopped
            raise RequestError(HTTP_SERVICE_UNAVAILABLE, str(item))
        assert isinstance(item, RoutedOutput)
        choice, output = self.choices[item.index], item.output
        now_s = time.perf_counter()
        if output.num_new_tokens > 0:
            self._observe_token_times(choice, output.num_new_tokens, now_s)
        choice.text_parts.append(output.text)
        choice.part_num_tokens.append(output.num_new_tokens)
        choice.token_ids.extend(output.token_ids)
        choice.logprobs.extend(output.logprobs)
        choice.prompt_logprobs.extend(output.prompt_logprobs)
        choice.num_tokens += output.num_new_tokens
        choice.num_cached_prompt_tokens = max(
            choice.num_cached_prompt_tokens, output.num_cached_prompt_tokens
        )
        if output.finish_reason is not None:
            choice.finish_reason = output.finish_reason
            choice.matched_stop = output.matched_stop
            choice.error = output.error
            choice.internal_error = output.internal_error
            self._num_unfinished -= 1
            self._ctx.metrics.e2e_request_latency_s.observe(now_s - self._arrival_time_s)
            self._ctx.metrics.request_finished(output.finish_reason)
        return choice, output

    def _observe_token_times(self, choice: ChoiceState, num_new_tokens: int, now_s: float) -> None:
        metrics = self._ctx.metrics
        if choice.last_token_time_s is None:
            metrics.time_to_first_token_s.observe(now_s - self._arrival_time_s)
        else:
            # Several tokens in one output share the gap evenly.
            gap_s = (now_s - choice.last_token_time_s) / num_new_tokens
            for _ in range(num_new_tokens):
                metrics.inter_token_latency_s.observe(gap_s)
        choice.last_token_time_s = now_s

    def close(self) -> None:
        """Abort every unfinished choice (early exit) and stop watching the client."""
        if self._watcher is not None:
            self._watcher.cancel()
        if self._timer is not None:
            self._timer.cancel()
        for choice in self.choices:
            if not choice.finished:
                self._ctx.engine.abort(choice.rid)
                choice.finish_reason = FinishReason.ABORT
                self._ctx.metrics.request_finished(FinishReason.ABORT)
        self._num_unfinished = 0

    async def run_to_end(self) -> None:
        """Collect every output (non-streaming); raises ClientDisconnected if the client leaves."""
        try:
            while not self.done:
                _, output = await self.next_output()
                if output.finish_reason == FinishReason.ERROR:
                    break  # the response is an error: the other choices are not needed
        finally:
            self.close()

    async def stream_outputs(self) -> AsyncIterator[tuple[ChoiceState, DetokenizedOutput]]:
        """Every output as it arrives, for a streaming handler (inside `stream_response`);
        raises ChoiceFailed on a choice's error, which ends the stream with that error."""
        while not self.done:
            choice, output = await self.next_output()
            if output.finish_reason == FinishReason.ERROR:
                raise ChoiceFailed(output.error or "request failed", output.internal_error)
            yield choice, output

    async def collect(self) -> Response | None:
        """A non-streaming request's wait: every choice to its end. Returns the response for a
        client that left (499, nobody reads it), raises a 400 RequestError when a choice
        failed, and returns None when all finished."""
        try:
            await self.run_to_end()
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        failed = self.first_failed()
        if failed is not None:
            status = HTTP_SERVER_ERROR if failed.internal_error else HTTP_BAD_REQUEST
            raise RequestError(status, failed.error or "request failed")
        return None

    def first_failed(self) -> ChoiceState | None:
        for choice in self.choices:
            if choice.finish_reason == FinishReason.ERROR:
                return choice
        return None

    def usage(self) -> tuple[int, int, int]:
        """(prompt tokens, completion tokens, cached prompt tokens); each prompt counts once."""
        prompt_tokens = sum(len(p) for p in self.prompts)
        completion_tokens = sum(c.num_tokens for c in self.choices)
        first_choices = self.choices[:: self.num_choices_per_prompt]
        cached_tokens = sum(c.num_cached_prompt_tokens for c in first_choices)
        return prompt_tokens, completion_tokens, cached_tokens


def finish_reason_text(reason: FinishReason | None) -> str | None:
    return None if reason is None else reason.value


ErrorEvents = Callable[[dict[str, Any]], list[str]]


def chat_error_events(body: dict[str, Any]) -> list[str]:
    """How chat and text completion streams end on an error: the error, then [DONE]."""
    return [sse_event(body), SSE_DONE]


async def _guarded(
    events: AsyncIterator[str], request_id: str, error_events: ErrorEvents
) -> AsyncIterator[str]:
    """Whatever ends a stream early, the client gets an error event (and what this endpoint
    ends a stream with), never a cut connection: a RequestError (timeout, backend stopped) as
    itself, anything else as a 500 that is logged once with the request id. A client that
    left gets nothing more."""
    try:
        async for event in events:
            yield event
    except ClientDisconnected:
        return
    except ChoiceFailed as exc:
        if exc.internal:  # the server failed the request: a 500, as a non-streamed one gets
            body = error_dict(str(exc), "server_error", code=HTTP_SERVER_ERROR)
        else:
            body = error_dict(str(exc))
        for event in error_events(body):
            yield event
    except RequestError as exc:
        for event in error_events(exc.body()):
            yield event
    except Exception:
        logger.exception("request %s failed while streaming", request_id)
        message = f"internal error while streaming (request id {request_id})"
        for event in error_events(error_dict(message, "server_error", code=HTTP_SERVER_ERROR)):
            yield event


def stream_response(
    events: AsyncIterator[str], request_id: str, error_events: ErrorEvents = chat_error_events
) -> StreamingResponse:
    return StreamingResponse(
        _guarded(events, request_id, error_events), media_type=SSE_MEDIA_TYPE, headers=SSE_HEADERS
    )
