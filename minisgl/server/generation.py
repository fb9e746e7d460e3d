"""What chat and text completions share: request validation and a group of sequences.

A request with n choices (and, for completions, several prompts) becomes one GenerationGroup: one
scheduler request per choice, all reporting into one asyncio queue. The group tracks per-choice
text, tokens, logprobs and timing, and aborts whatever is unfinished when the handler leaves
early (client disconnect, error).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from starlette.requests import Request
from transformers import PreTrainedTokenizerBase

from minisgl.core import SEED_MASK, FinishReason, SamplingParams, TokenLogprob
from minisgl.message import DetokenizedOutput
from minisgl.server.engine_client import DISCONNECTED, EngineClient, RoutedOutput
from minisgl.server.metrics import ServerMetrics
from minisgl.server.protocol import SamplingFields

# Token id -> text is asked for every token when logprobs are on: cache the common ones.
TOKEN_TEXT_CACHE_SIZE = 1 << 16
HTTP_SERVER_ERROR = 500
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


class RequestError(Exception):
    """Becomes an OpenAI-shaped error response."""

    def __init__(
        self, status_code: int, message: str, param: str | None = None, err_type: str | None = None
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        client_error = status_code < HTTP_SERVER_ERROR
        self.err_type = err_type or ("invalid_request_error" if client_error else "server_error")


_T = TypeVar("_T")


class ClientDisconnected(Exception):
    pass


@dataclass
class ServingContext:
    """Everything a handler needs, built once when the API server starts."""

    tokenizer: PreTrainedTokenizerBase
    engine: EngineClient
    metrics: ServerMetrics
    served_model_name: str
    accepted_model_names: frozenset[str]
    max_model_len: int
    vocab_size: int
    kv_capacity_tokens: int  # the most tokens one sequence can hold in the KV pool
    # Tokenizing a long prompt takes milliseconds: done on this one thread, not on the event loop,
    # so streams of other requests keep flowing. One thread: encodes never run concurrently.
    tokenize_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="minisgl-tokenize")
    )

    async def off_loop(self, fn: Callable[..., _T], *args: Any) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, fn, *args)

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.accepted_model_names:
            raise RequestError(
                404, f"The model `{model}` does not exist.", param="model", err_type="NotFoundError"
            )

    @functools.cached_property
    def token_text(self) -> Any:
        @functools.lru_cache(maxsize=TOKEN_TEXT_CACHE_SIZE)
        def decode_one(token_id: int) -> str:
            return cast(str, self.tokenizer.decode([token_id], skip_special_tokens=False))

        return decode_one


def resolve_max_tokens(
    requested: int | None,
    prompt_len: int,
    max_model_len: int,
    kv_capacity_tokens: int,
    prompt_param: str,
) -> int:
    """vLLM's rule: without max_tokens, generate up to the context length that is left (here also
    bounded by what the KV pool can hold, which can be less than the context length)."""
    if requested is not None and requested < 1:
        raise RequestError(400, "max_tokens: must be >= 1", param="max_tokens")
    if requested is not None and prompt_len + requested > max_model_len:
        raise RequestError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} "
            f"for the completion). Please reduce the prompt or max_tokens.",
            param="max_tokens",
        )
    limit = min(max_model_len, kv_capacity_tokens) if kv_capacity_tokens > 0 else max_model_len
    if requested is None:
        if prompt_len >= limit:
            what = "context length" if limit == max_model_len else "KV cache capacity"
            raise RequestError(
                400,
                f"This model's maximum {what} is {limit} tokens. However, your prompt has "
                f"{prompt_len} tokens, which leaves no room for the completion.",
                param=prompt_param,
            )
        return limit - prompt_len
    if prompt_len + requested > limit:
        raise RequestError(
            400,
            f"prompt plus max_tokens ({prompt_len + requested} tokens) exceeds the KV cache "
            f"({limit} tokens)",
            param="max_tokens",
        )
    return requested


def build_sampling_params(
    body: SamplingFields, max_tokens: int, num_logprobs: int | None, choice_index: int
) -> SamplingParams:
    overrides = {name: getattr(body, name) for name in SAMPLING_FIELDS}
    # With a seed, choice i uses seed + i: n sequences that are reproducible yet differ.
    seed = None if body.seed is None else (body.seed + choice_index) & SEED_MASK
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            seed=seed,
            stop=tuple([body.stop] if isinstance(body.stop, str) else body.stop or ()),
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            logprobs=num_logprobs,
            skip_special_tokens=body.skip_special_tokens,
            **{name: value for name, value in overrides.items() if value is not None},
        )
    except ValueError as exc:
        param = str(exc).split(":", 1)[0]
        raise RequestError(400, str(exc), param=param) from None


@dataclass
class ChoiceState:
    index: int
    prompt_index: int
    rid: str
    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    finish_reason: FinishReason | None = None
    error: str | None = None
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
    ) -> None:
        """params[p][j]: choice j of prompt p, whose choice index is p * n + j."""
        assert len(params) == len(prompts) and len({len(row) for row in params}) == 1
        self._ctx = ctx
        self.prompts = list(prompts)
        self.num_choices_per_prompt = len(params[0])
        self._params = [list(row) for row in params]
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

    def start(self, request: Request) -> None:
        for choice in self.choices:
            params = self._params[choice.prompt_index][choice.index % self.num_choices_per_prompt]
            prompt = self.prompts[choice.prompt_index]
            self._ctx.engine.submit(choice.rid, choice.index, prompt, params, self._queue)
        self._watcher = asyncio.create_task(self._watch_disconnect(request))

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
        assert isinstance(item, RoutedOutput)
        choice, output = self.choices[item.index], item.output
        now_s = time.perf_counter()
        if output.num_new_tokens > 0:
            self._observe_token_times(choice, output.num_new_tokens, now_s)
        choice.text_parts.append(output.text)
        choice.token_ids.extend(output.token_ids)
        choice.logprobs.extend(output.logprobs)
        choice.num_tokens += output.num_new_tokens
        choice.num_cached_prompt_tokens = max(
            choice.num_cached_prompt_tokens, output.num_cached_prompt_tokens
        )
        if output.finish_reason is not None:
            choice.finish_reason = output.finish_reason
            choice.error = output.error
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

    def first_error(self) -> str | None:
        for choice in self.choices:
            if choice.finish_reason == FinishReason.ERROR:
                return choice.error or "request failed"
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
