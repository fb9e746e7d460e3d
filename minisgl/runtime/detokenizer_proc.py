"""The detokenizer process: token ids -> text deltas, stop strings, and the hidden final eos
(minisgl.tokenizer.detokenizer.RequestDetokenizer, one per request).

When a stop string appears it reports finish_reason "stop" to the API server right away and
asks the scheduler to abort the request (freeing its KV pages); whatever the scheduler still
sends for that request afterwards is dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from transformers import PreTrainedTokenizerBase

from minisgl.core import ReqOutput
from minisgl.runtime import messages as msg
from minisgl.tokenizer import load_tokenizer
from minisgl.tokenizer.detokenizer import RequestDetokenizer

logger = logging.getLogger(__name__)

IDLE_POLL_TIMEOUT_S = 0.1
# DetokenizedOutput's fields: the scheduler's ReqOutput's as they are, the TextDelta's, and
# num_new_tokens (every token generated, a hidden final eos included).
PASSED_ON = ("rid", "num_cached_prompt_tokens", "error", "internal_error", "prompt_logprobs")
TEXT_FIELDS = ("text", "token_ids", "logprobs", "finish_reason", "matched_stop")


class DetokenizerWorker:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, endpoints: msg.Endpoints) -> None:
        self._tokenizer = tokenizer
        self._inbox = msg.MessageQueue("pull", endpoints.detokenizer_in)
        self._to_api = msg.MessageQueue("push", endpoints.api_in)
        self._to_scheduler = msg.MessageQueue("push", endpoints.scheduler_in)
        self._requests: dict[str, RequestDetokenizer] = {}

    def _process(self, output: ReqOutput) -> msg.DetokenizedOutput | None:
        if (request := self._requests.get(output.rid)) is None:
            logger.debug("detokenizer: output for unknown request %s dropped", output.rid)
            return None
        delta = request.add(output)
        if request.done:
            del self._requests[output.rid]
        if delta is None:
            return None
        if delta.abort:
            self._to_scheduler.put(msg.AbortRequest(output.rid))
        fields = {name: getattr(output, name) for name in PASSED_ON}
        fields |= {name: getattr(delta, name) for name in TEXT_FIELDS}
        return msg.DetokenizedOutput(num_new_tokens=len(output.new_token_ids), **fields)

    def run_once(self, timeout_s: float = IDLE_POLL_TIMEOUT_S) -> None:
        results: list[msg.DetokenizedOutput] = []
        for message in self._inbox.get_all(timeout_s):
            if isinstance(message, msg.DetokenizeInit):
                init = (message.prompt_tail_ids, message.sampling_params, message.eos_token_ids)
                self._requests[message.rid] = RequestDetokenizer(self._tokenizer, *init)
            else:  # a BatchTokenOutput: nothing else is sent to detokenizer_in
                results += [r for r in map(self._process, message.outputs) if r is not None]
        if results:
            self._to_api.put(msg.BatchDetokenizedOutput(tuple(results)))

    def close(self) -> None:
        for queue in (self._inbox, self._to_api, self._to_scheduler):
            queue.close()


def run_detokenizer_process(
    tokenizer_path: str, endpoints: msg.Endpoints, report_ready: Callable[[], None]
) -> None:
    worker = DetokenizerWorker(load_tokenizer(tokenizer_path), endpoints)
    report_ready()
    try:
        while True:
            worker.run_once()
    finally:
        worker.close()
