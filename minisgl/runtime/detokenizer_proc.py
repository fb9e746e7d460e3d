"""The detokenizer process: token ids -> text deltas, stop strings, and the hidden final eos.

When a stop string appears it reports finish_reason "stop" to the API server right away and
asks the scheduler to abort the request (freeing its KV pages); whatever the scheduler still
sends for that request afterwards is dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from minisgl.core import FinishReason, ReqOutput
from minisgl.runtime.messages import (
    AbortRequest,
    BatchDetokenizedOutput,
    BatchTokenOutput,
    DetokenizedOutput,
    DetokenizeInit,
    Endpoints,
    MessageQueue,
)
from minisgl.tokenizer import IncrementalDetokenizer, load_tokenizer

logger = logging.getLogger(__name__)

IDLE_POLL_TIMEOUT_S = 0.1


@dataclass
class _RequestState:
    detokenizer: IncrementalDetokenizer
    hidden_final_ids: frozenset[int]  # a final token with one of these ids adds no text
    stopped_by_string: bool = False  # reported as finished; awaiting the scheduler's abort


class DetokenizerWorker:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, endpoints: Endpoints) -> None:
        self._tokenizer = tokenizer
        self._inbox = MessageQueue("pull", endpoints.detokenizer_in, bind=True)
        self._to_api = MessageQueue("push", endpoints.api_in, bind=False)
        self._to_scheduler = MessageQueue("push", endpoints.scheduler_in, bind=False)
        self._states: dict[str, _RequestState] = {}

    def _init_request(self, message: DetokenizeInit) -> None:
        params = message.sampling_params
        hidden = set(params.stop_token_ids)
        if not params.ignore_eos:
            hidden.update(message.eos_token_ids)
        self._states[message.rid] = _RequestState(
            detokenizer=IncrementalDetokenizer(
                self._tokenizer,
                message.prompt_tail_ids,
                stop=params.stop,
                skip_special_tokens=params.skip_special_tokens,
                min_tokens=params.min_tokens,
                include_stop=params.include_stop_str_in_output,
            ),
            hidden_final_ids=frozenset(hidden),
        )

    def _process(self, output: ReqOutput) -> DetokenizedOutput | None:
        state = self._states.get(output.rid)
        if state is None:
            logger.debug("detokenizer: output for unknown request %s dropped", output.rid)
            return None
        if state.stopped_by_string:
            if output.finish_reason is not None:
                del self._states[output.rid]  # the scheduler's answer to our abort
            return None
        token_ids = list(output.new_token_ids)
        logprobs = list(output.new_logprobs)
        finish = output.finish_reason
        matched: int | str | None = None
        # Stopped by eos / a stop token id: that token counts as generated but shows no text.
        if finish == FinishReason.STOP and token_ids and token_ids[-1] in state.hidden_final_ids:
            matched = token_ids.pop()
            logprobs = logprobs[: len(token_ids)]
        detok = state.detokenizer
        text = detok.add(token_ids)
        if detok.stopped:
            if finish is None:
                self._to_scheduler.put(AbortRequest(output.rid))
                state.stopped_by_string = True
            else:
                del self._states[output.rid]
            finish, matched = FinishReason.STOP, detok.stop_str
        elif finish is not None:
            text += detok.flush()
            del self._states[output.rid]
        return DetokenizedOutput(
            rid=output.rid,
            text=text,
            token_ids=tuple(token_ids),
            num_new_tokens=len(output.new_token_ids),
            logprobs=tuple(logprobs),
            finish_reason=finish,
            prompt_len=output.prompt_len,
            num_cached_prompt_tokens=output.num_cached_prompt_tokens,
            error=output.error,
            internal_error=output.internal_error,
            prompt_logprobs=output.prompt_logprobs,
            matched_stop=matched,
        )

    def run_once(self, timeout_s: float = IDLE_POLL_TIMEOUT_S) -> None:
        first = self._inbox.get(timeout_s=timeout_s)
        if first is None:
            return
        results: list[DetokenizedOutput] = []
        for message in [first, *self._inbox.get_all()]:
            if isinstance(message, DetokenizeInit):
                self._init_request(message)
            elif isinstance(message, BatchTokenOutput):
                for output in message.outputs:
                    result = self._process(output)
                    if result is not None:
                        results.append(result)
            else:
                logger.warning("detokenizer: unexpected message %s", type(message).__name__)
        if results:
            self._to_api.put(BatchDetokenizedOutput(tuple(results)))

    def run(self) -> None:
        while True:
            self.run_once()

    def close(self) -> None:
        for queue in (self._inbox, self._to_api, self._to_scheduler):
            queue.close()


def run_detokenizer_process(
    tokenizer_path: str, endpoints: Endpoints, report_ready: Callable[[dict], None]
) -> None:
    worker = DetokenizerWorker(load_tokenizer(tokenizer_path), endpoints)
    report_ready({})
    try:
        worker.run()
    finally:
        worker.close()
