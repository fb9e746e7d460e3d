"""The offline API: `LLM(model).generate(prompts, sampling_params)`, in-process, no server.

It drives the same Scheduler the server runs, stepping it until every request has finished.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tqdm import tqdm

from minisgl.chat.template import apply_chat_template, load_chat_template
from minisgl.config import ServerArgs
from minisgl.core import Req, SamplingParams, TokenLogprob, next_request_id
from minisgl.pooling import Pooling, input_token_ids, model_pooling
from minisgl.scheduler.tp import make_scheduler
from minisgl.tokenizer import IncrementalDetokenizer, load_tokenizer
from minisgl.tokenizer.detokenizer import stop_reason

Prompt = str | list[int]


@dataclass
class RequestOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" or "length"
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # SamplingParams.prompt_logprobs: one entry per prompt token, None for the first
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    # vLLM's: the stop string or stop_token_ids entry that ended the output (None: EOS, length)
    stop_reason: int | str | None = None
    embedding: list[float] | None = None  # SamplingParams.pooling: the prompt's embedding


class LLM:
    def __init__(self, model: str | None = None, **options: Any) -> None:
        self.args = ServerArgs.from_kwargs(model=model, **options)
        self.scheduler = make_scheduler(self.args)
        try:
            model_path = self.scheduler.engine.model_path
            self.tokenizer = load_tokenizer(self.args.tokenizer or str(model_path))
            path = self.args.chat_template
            self.chat_template = load_chat_template(path) if path else None
            self.pooling = model_pooling(model_path, self.args.pooling)
        except BaseException:
            self.scheduler.shutdown()  # with tp_size > 1: no follower processes left behind
            raise

    def generate(
        self,
        prompts: str | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        prompt_list: list[Prompt]
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompt_list = [prompts]  # type: ignore[list-item]
        else:
            prompt_list = list(prompts)  # type: ignore[arg-type]
        params = self._params_per_prompt(sampling_params, len(prompt_list))
        pending: dict[str, tuple[Req, RequestOutput, IncrementalDetokenizer]] = {}
        for prompt, sp in zip(prompt_list, params, strict=True):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            req = Req(next_request_id(), ids, sp)
            out = RequestOutput(prompt if isinstance(prompt, str) else None, ids)
            pending[req.rid] = (req, out, IncrementalDetokenizer(self.tokenizer, ids, sp, False))
        outputs = [out for _, out, _ in pending.values()]
        # All or nothing: a bad prompt leaves nothing queued.
        self.scheduler.add_request(*(req for req, _, _ in pending.values()))
        bar = tqdm(total=len(pending), disable=not use_tqdm, desc="generate")
        while pending:
            for result in self.scheduler.step():
                if (entry := pending.get(result.rid)) is None:
                    continue  # output after a stop string ended it here
                req, out, detok = entry
                out.token_ids.extend(result.token_ids)
                if isinstance(result.matched_stop, int):  # a final EOS included, as vLLM
                    out.token_ids.append(result.matched_stop)
                out.logprobs.extend(result.logprobs)
                if result.prompt_logprobs:
                    out.prompt_logprobs = [None, *result.prompt_logprobs]
                out.num_cached_tokens = result.num_cached_prompt_tokens
                if result.embedding is not None:
                    out.embedding = np.frombuffer(result.embedding, "<f4").tolist()
                detok.add_output(result)
                out.text += result.text
                if result.finish_reason is not None:
                    if not detok.done:  # a stop string ended it first: the scheduler frees it
                        self.scheduler.abort_request(result.rid)
                    out.finish_reason = result.finish_reason.value
                    out.stop_reason = stop_reason(req.sampling_params, result.matched_stop)
                    del pending[result.rid]
                    bar.update(1)
        bar.close()
        return outputs

    def embed(
        self,
        prompts: str | Sequence[Prompt],
        pooling: Pooling | None = None,
        use_tqdm: bool = False,
    ) -> list[list[float]]:
        """One embedding per prompt (text or token ids), pooled as the server's /v1/embeddings
        pools for this model (`pooling` overrides)."""
        ids = input_token_ids(prompts, self.tokenizer.encode, self.scheduler.limits)
        params = SamplingParams(max_tokens=0, pooling=pooling or self.pooling)
        outputs = self.generate(ids, params, use_tqdm)
        return [out.embedding for out in outputs if out.embedding is not None]

    def chat(
        self,
        messages_list: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Chat prompts rendered with the template (--chat-template when given), its variables
        from `chat_template_kwargs` over the LLM's own; the text is the raw reply."""
        conversations: list[list[dict]]
        if messages_list and isinstance(messages_list[0], dict):
            conversations = [list(messages_list)]  # type: ignore[arg-type]
        else:
            conversations = [list(m) for m in messages_list]  # type: ignore[arg-type]
        kwargs = {**self.args.template_kwargs, **(chat_template_kwargs or {})}
        prompts = [
            apply_chat_template(self.tokenizer, m, tools, self.chat_template, kwargs)
            for m in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    @staticmethod
    def _params_per_prompt(
        sampling_params: SamplingParams | Sequence[SamplingParams] | None, num: int
    ) -> list[SamplingParams]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            return [sampling_params or SamplingParams()] * num
        params = list(sampling_params)
        if len(params) != num:
            raise ValueError(f"sampling_params: {len(params)} given for {num} prompts")
        return params

    def check_page_accounting(self) -> None:
        """Assert every KV page is free, cached or owned by a live request (tests call this)."""
        self.scheduler.check_page_accounting()

    def shutdown(self) -> None:
        self.scheduler.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()  # with tp_size > 1 this also stops the other ranks' processes
