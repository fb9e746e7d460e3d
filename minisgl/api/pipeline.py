"""The one generation pipeline every dialect runs: admission (model, fan-out, capacity) ->
prompt (template, tokens, on the tokenizer thread) -> one SamplingParams per choice ->
constraint (compiled by the grammar worker) -> a `Run` of choices in flight -> events, which a
dialect renders and minisgl.api.sse sends or folds."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, TypeVar, cast

from starlette.requests import Request
from transformers import PreTrainedTokenizerBase

from minisgl.api.errors import ChoiceFailed, ClientDisconnected, RequestError
from minisgl.api.metrics import ServerMetrics
from minisgl.api.request import ApiRequest, api_key_tenant, choice_params
from minisgl.chat import (
    ChatDelta,
    ChatOutputParser,
    ChatPrompt,
    ChatSettings,
    PreparedChat,
    prepare_chat,
    prompt_texts,
)
from minisgl.chat.requests import constraint_from_fields
from minisgl.config import ServerArgs
from minisgl.core import Constraint, FinishReason, ReqOutput, SamplingParams, TokenLogprob
from minisgl.grammar import GrammarWorker
from minisgl.limits import InvalidRequestError, ModelLimits, check_prompt_size
from minisgl.models.names import accepted_model_names
from minisgl.pooling import Pooling
from minisgl.runtime.engine_client import EngineClient
from minisgl.runtime.messages import TokenizedRequest

# Token id -> text is asked for every token when logprobs are on: cache the common ones.
TOKEN_TEXT_CACHE_SIZE = 1 << 16
# Queue full: how long a client should wait before trying again.
QUEUE_FULL_RETRY_AFTER_S = 1
TOKENIZER_THREADS = 2

_T = TypeVar("_T")


@dataclass
class ServingContext:
    """Everything a handler needs, built once when the API server starts."""

    args: ServerArgs  # the bounds on requests: sequences, queue, timeout
    tokenizer: PreTrainedTokenizerBase
    engine: EngineClient
    metrics: ServerMetrics
    served_model_name: str
    limits: ModelLimits
    chat: ChatSettings
    eos_token_ids: tuple[int, ...]
    # For the sampling fields a request leaves unset (--sampling-defaults model): the checkpoint's
    # generation_config.json values; empty means the OpenAI API's defaults.
    sampling_defaults: dict[str, float | int]
    pooling: Pooling  # /v1/embeddings' (minisgl.pooling.model_pooling)
    # Tokenizing a long prompt takes milliseconds to seconds: done on these threads, not on the
    # event loop, so streams of other requests keep flowing, and on more than one, so a huge
    # prompt does not hold up the others. Concurrent use is safe: no call changes the tokenizer's
    # truncation or padding (the only state its encodes share), and Rust releases the GIL.
    tokenizer_thread: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(TOKENIZER_THREADS, "minisgl-tokenize")
    )

    async def on_tokenizer_thread(self, fn: Callable[..., _T], *args: Any) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_thread, fn, *args)

    @functools.cached_property
    def grammar(self) -> GrammarWorker:
        """Compiles constraints in a worker process, off the tokenizer thread, so the scheduler
        never compiles on its loop and a hostile one costs a 400, not the server."""
        return GrammarWorker(
            self.tokenizer,
            self.limits.vocab_size,
            self.eos_token_ids,
            self.args.grammar_compile_timeout_s,
        )

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in accepted_model_names(self.args):
            served = f"this server serves `{self.served_model_name}`"
            raise RequestError(
                HTTPStatus.NOT_FOUND, f"The model `{model}` does not exist: {served}.", "model"
            )

    @functools.cached_property
    def token_text(self) -> Callable[[int], str]:
        @functools.lru_cache(maxsize=TOKEN_TEXT_CACHE_SIZE)
        def decode_one(token_id: int) -> str:
            return cast(str, self.tokenizer.decode([token_id], skip_special_tokens=False))

        return decode_one


@dataclass
class Choice:
    """One sequence of a run: what it produced so far (cumulative) and how it ended."""

    index: int  # prompt_index * n + j
    prompt_index: int
    rid: str
    parser: ChatOutputParser | None  # chat prompts: reasoning and tool calls split off
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt tokens 1..
    num_tokens: int = 0  # generated, a hidden final EOS included (usage counts it)
    num_cached_prompt_tokens: int = 0
    finish_reason: FinishReason | None = None
    matched_stop: int | str | None = None  # ReqOutput.matched_stop of the finish
    error: str | None = None
    last_token_time_s: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def parse(self, output: ReqOutput) -> ChatDelta:
        """The output as the reply's delta (chat: reasoning and tool calls split off)."""
        if self.parser is None:
            return ChatDelta(content=output.text)
        final = output.finish_reason is not None
        return self.parser.feed(output.text, output.num_new_tokens, final)


@dataclass
class Event:
    """One output of one choice, as a dialect renders it; `delta`: the output parsed (chat)."""

    choice: Choice
    output: ReqOutput
    delta: ChatDelta


class Run:
    """A request's choices in flight: one scheduler request per (prompt, choice), all reporting
    into one queue. Submitted all or none; `close` aborts whatever is unfinished (the client
    left, a timeout, an error) and stops watching the client."""

    def __init__(self, http_request: Request, req: ApiRequest, request_id: str = "") -> None:
        self.ctx: ServingContext = http_request.app.state.ctx
        self.req = req
        self.id = request_id
        self._http_request = http_request
        self.prompts: list[list[int]] = []  # token ids, by `tokenize`
        self.chat: PreparedChat | None = None  # a chat's parsers, by `tokenize`
        self.grammar_json: str | None = None  # the constraint compiled for the scheduler
        self.params: list[SamplingParams] = []  # one per choice
        self.choices: list[Choice] = []
        self._queue: asyncio.Queue = asyncio.Queue()
        self.arrival_time_s = time.perf_counter()
        # What `close` cancels: the client watcher, the timeout.
        self._pending: list[asyncio.Task | asyncio.TimerHandle] = []

    async def start(self) -> Run:
        """Admit, prepare and submit every choice (or none)."""
        await self.prepare()
        self.submit()
        return self

    async def prepare(self) -> None:
        """Admission, prompts, constraint and every choice's SamplingParams (a 400 or 503 if a
        rule breaks); nothing is sent yet."""
        ctx, req = self.ctx, self.req
        # Before any work: the model, and the sequences one request starts (prompts x n).
        ctx.check_model(req.model)
        num_prompts = 1 if isinstance(req.prompt, ChatPrompt) else len(req.prompt)
        if (num_sequences := num_prompts * req.n) > (most := ctx.args.max_sequences_per_request):
            raise RequestError(
                HTTPStatus.BAD_REQUEST,
                f"this request asks for {num_sequences} sequences ({num_prompts} prompts x "
                f"n={req.n}); the server allows at most {most}",
                param="n" if req.n > most else req.prompt_param,
            )
        self._check_capacity(num_sequences)  # a 503 comes before any tokenizing
        param, constraint = await self.tokenize()
        defaults = {**ctx.sampling_defaults, "user": api_key_tenant(self._http_request.headers)}
        self.params = [
            params
            for p, ids in enumerate(self.prompts)
            for params in choice_params(req, p, ids, ctx.limits, defaults, constraint)
        ]
        if constraint is not None:  # off the tokenizer thread, as one of its tenant's compiles
            self.grammar_json = await ctx.grammar.serialize(
                constraint, req.wire(param), self.params[0].user, self._watch_disconnect
            )
        chat = self.chat
        self.choices = [
            Choice(p * req.n + j, p, f"{self.id}-{p}-{j}", chat.new_parser() if chat else None)
            for p in range(len(self.prompts))
            for j in range(req.n)
        ]

    async def tokenize(self) -> tuple[str, Constraint | None]:
        """The prompts as token ids, a chat's parsers, and the request's constraint with the
        field it came from; a 400 for any broken rule, named as this dialect's clients spell
        the field."""
        ctx, req = self.ctx, self.req
        try:
            check_prompt_size(*prompt_texts(req.prompt), ctx.limits, req.prompt_param)
            return await ctx.on_tokenizer_thread(self._tokenize)
        except InvalidRequestError as exc:
            raise req.invalid(exc) from None
        except ValueError as exc:  # about the messages
            param = req.wire("messages")
            raise RequestError(
                HTTPStatus.BAD_REQUEST,
                f"{param}: {exc}" if param != "messages" else str(exc),
                param=param,
            ) from None

    def _tokenize(self) -> tuple[str, Constraint | None]:
        """On the tokenizer thread: (the field the constraint came from, the constraint)."""
        tokenizer, prompt, fields = self.ctx.tokenizer, self.req.prompt, self.req.constraint_fields
        if isinstance(prompt, ChatPrompt):
            self.chat = chat = prepare_chat(tokenizer, self.ctx.chat, prompt, fields)
            self.prompts = [chat.prompt_ids]
            return chat.constraint_param or "", chat.constraint
        self.prompts = [
            tokenizer(item)["input_ids"] if isinstance(item, str) else item for item in prompt
        ]
        return constraint_from_fields(fields) or ("", None)

    def _check_capacity(self, num_sequences: int) -> None:
        """503 when the queue of waiting sequences would overflow (--max-queued-requests)."""
        args = self.ctx.args
        in_flight_bound = args.max_running_requests + args.max_queued_requests
        if self.ctx.engine.num_active_requests + num_sequences > in_flight_bound:
            raise RequestError(
                HTTPStatus.SERVICE_UNAVAILABLE,
                "The server is overloaded: its request queue is full. Please retry later.",
                err_type="server_overloaded",
                headers={"Retry-After": str(QUEUE_FULL_RETRY_AFTER_S)},
            )

    def submit(self) -> None:
        self._check_capacity(len(self.choices))  # it may have filled while we tokenized
        try:
            for choice, params in zip(self.choices, self.params, strict=True):
                ids = tuple(self.prompts[choice.prompt_index])
                request = TokenizedRequest(choice.rid, ids, params, self.grammar_json)
                self.ctx.engine.submit(request, self._queue)
        except BaseException:
            self.close()
            raise
        self._pending.append(asyncio.create_task(self._watch_disconnect()))
        if (timeout_s := self.ctx.args.request_timeout_s) is not None:
            timed_out = RequestError(
                HTTPStatus.GATEWAY_TIMEOUT,
                f"The request did not finish within the server's timeout ({timeout_s:g} s) "
                "and was aborted.",
                err_type="timeout_error",
            )
            self._pending.append(
                asyncio.get_running_loop().call_later(timeout_s, self._queue.put_nowait, timed_out)
            )

    async def _watch_disconnect(self) -> None:
        # The body is already read, so the next ASGI message is the disconnect (or the end).
        while (await self._http_request.receive())["type"] != "http.disconnect":
            pass
        self._queue.put_nowait(ClientDisconnected())  # the handler wakes up, aborts

    async def events(self) -> AsyncIterator[Event]:
        """Every output as it arrives, its choice updated; raises ChoiceFailed at the first
        choice that fails, ClientDisconnected, or the RequestError that ended the run."""
        by_rid = {choice.rid: choice for choice in self.choices}
        while not all(choice.finished for choice in self.choices):
            output = await self._queue.get()
            if isinstance(output, Exception):  # the client left, timed out, the backend stopped
                raise output
            # Otherwise a ReqOutput: nothing else goes on the queue.
            choice = by_rid[output.rid]
            self._update(choice, output)
            if output.finish_reason == FinishReason.ERROR:
                raise ChoiceFailed(output.error or "request failed", output.internal_error)
            yield Event(choice, output, choice.parse(output))

    def _update(self, choice: Choice, output: ReqOutput) -> None:
        now_s = time.perf_counter()
        metrics = self.ctx.metrics
        if output.num_new_tokens > 0:
            if choice.last_token_time_s is None:
                metrics.time_to_first_token_s.observe(now_s - self.arrival_time_s)
            else:  # several tokens in one output share the gap evenly
                gap_s = (now_s - choice.last_token_time_s) / output.num_new_tokens
                for _ in range(output.num_new_tokens):
                    metrics.inter_token_latency_s.observe(gap_s)
            choice.last_token_time_s = now_s
        choice.text += output.text
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
            metrics.e2e_request_latency_s.observe(now_s - self.arrival_time_s)
            metrics.request_finished(output.finish_reason)

    def close(self) -> None:
        """Abort every unfinished choice (an early exit) and stop watching the client."""
        for pending in self._pending:
            pending.cancel()
        for choice in self.choices:
            if not choice.finished:
                self.ctx.engine.abort(choice.rid)
                choice.finish_reason = FinishReason.ABORT
                self.ctx.metrics.request_finished(FinishReason.ABORT)

    @property
    def model_name(self) -> str:
        """The model a reply names: as the request named it, else the one served."""
        return self.req.model or self.ctx.served_model_name

    def usage(self) -> tuple[int, int, int]:
        """(prompt tokens, completion tokens, cached prompt tokens); each prompt counts once."""
        prompt_tokens = sum(len(p) for p in self.prompts)
        completion_tokens = sum(c.num_tokens for c in self.choices)
        cached_tokens = sum(c.num_cached_prompt_tokens for c in self.choices[:: self.req.n])
        return prompt_tokens, completion_tokens, cached_tokens

    @property
    def reasoning_tokens(self) -> int:
        return sum(c.parser.reasoning_tokens for c in self.choices if c.parser is not None)
