"""The offline API: `LLM(model).generate(prompts, sampling_params)`, in-process, no server.

It drives the same Scheduler the server runs, stepping it until every request has finished.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from minisgl.config import ServerArgs
from minisgl.core import FinishReason, Req, SamplingParams, TokenLogprob, next_request_id
from minisgl.scheduler.protocol import SchedulerAPI
from minisgl.scheduler.scheduler import Scheduler
from minisgl.tokenizer.chat import apply_chat_template, load_chat_template, load_tokenizer
from minisgl.tokenizer.detokenizer import IncrementalDetokenizer

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


class LLM:
    def __init__(self, model: str | None = None, **options: Any) -> None:
        self.args = ServerArgs.from_kwargs(model=model, **options)
        self.scheduler: SchedulerAPI
        if self.args.tp_size > 1:
            from minisgl.scheduler.tp import TPScheduler

            self.scheduler = TPScheduler(self.args)
        else:
            self.scheduler = Scheduler(self.args)
        try:
            self.tokenizer = load_tokenizer(self.args.tokenizer or self.scheduler.model_path)
            path = self.args.chat_template
            self.chat_template = load_chat_template(path) if path else None
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
        reqs, outputs = [], []
        for prompt, sp in zip(prompt_list, params, strict=True):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            req = Req(next_request_id(), ids, sp)
            self.scheduler.validate(req)  # all-or-nothing: a bad prompt leaves nothing queued
            reqs.append(req)
            outputs.append(RequestOutput(prompt if isinstance(prompt, str) else None, ids))
        return self._run(reqs, outputs, use_tqdm)

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
        if sampling_params is None:
            return [SamplingParams()] * num
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * num
        params = list(sampling_params)
        if len(params) != num:
            raise ValueError(f"sampling_params: {len(params)} given for {num} prompts")
        return params

    def _run(
        self, reqs: list[Req], outputs: list[RequestOutput], use_tqdm: bool
    ) -> list[RequestOutput]:
        by_rid = {req.rid: (req, out) for req, out in zip(reqs, outputs, strict=True)}
        detoks = {
            req.rid: IncrementalDetokenizer(
                self.tokenizer,
                req.input_ids,
                req.sampling_params.stop,
                req.sampling_params.skip_special_tokens,
                req.sampling_params.min_tokens,
                req.sampling_params.include_stop_str_in_output,
            )
            for req in reqs
            if req.sampling_params.stop
        }
        for req in reqs:
            self.scheduler.add_request(req)
        pending = set(by_rid)
        bar = tqdm(total=len(reqs), disable=not use_tqdm, desc="generate")
        while pending:
            for result in self.scheduler.step():
                if result.rid not in pending:
                    continue
                req, out = by_rid[result.rid]
                out.token_ids.extend(result.new_token_ids)
                out.logprobs.extend(result.new_logprobs)
                if result.prompt_logprobs:
                    out.prompt_logprobs = [None, *result.prompt_logprobs]
                out.num_cached_tokens = result.num_cached_prompt_tokens
                finish = result.finish_reason
                detok = detoks.get(result.rid)
                if detok is not None and finish is None:
                    detok.add(list(result.new_token_ids))
                    if detok.stopped:  # a stop string: end it here, the scheduler frees it
                        self.scheduler.abort_request(result.rid)
                        finish = FinishReason.STOP
                if finish is not None:
                    out.finish_reason = finish.value
                    out.text = self._final_text(req, out, detok)
                    out.stop_reason = _stop_reason(req, out, detok, finish)
                    pending.discard(result.rid)
                    bar.update(1)
        bar.close()
        return outputs

    def _final_text(
        self, req: Req, out: RequestOutput, detok: IncrementalDetokenizer | None
    ) -> str:
        if detok is not None:
            if not detok.stopped:
                detok.add(out.token_ids[len(out.token_ids) - 1 :])
                detok.flush()
            return detok.text
        text = self.tokenizer.decode(
            out.token_ids, skip_special_tokens=req.sampling_params.skip_special_tokens
        )
        return str(text)

    def check_page_accounting(self) -> None:
        """Assert every KV page is free, cached or owned by a live request (tests call this)."""
        self.scheduler.check_page_accounting()

    def shutdown(self) -> None:
        self.scheduler.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()  # with tp_size > 1 this also stops the other ranks' processes


def _stop_reason(
    req: Req, out: RequestOutput, detok: IncrementalDetokenizer | None, finish: FinishReason
) -> int | str | None:
    if finish != FinishReason.STOP:
        return None
    if detok is not None and detok.stop_str is not None:
        return detok.stop_str
    last = out.token_ids[-1] if out.token_ids else None
    return last if last in req.sampling_params.stop_token_ids else None
