"""The detokenizer process: each output's token ids -> text, and stop strings
(minisgl.tokenizer.IncrementalDetokenizer, one per request).

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
from minisgl.tokenizer import IncrementalDetokenizer, load_tokenizer

logger = logging.getLogger(__name__)

IDLE_POLL_TIMEOUT_S = 0.1


class DetokenizerWorker:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, endpoints: msg.Endpoints) -> None:
        self._tokenizer = tokenizer
        self._inbox = msg.MessageQueue("pull", endpoints.detokenizer_in)
        self._to_api = msg.MessageQueue("push", endpoints.api_in)
        self._to_scheduler = msg.MessageQueue("push", endpoints.scheduler_in)
        self._requests: dict[str, IncrementalDetokenizer] = {}

    def _process(self, output: ReqOutput) -> bool:
        """Fill in the output's text; False: drop it (after a stop string ended its request)."""
        if (request := self._requests.get(output.rid)) is None:
            logger.debug("detokenizer: output for unknown request %s dropped", output.rid)
            return False
        shown = request.add_output(output)
        if request.done:
            del self._requests[output.rid]
        elif shown and output.finish_reason is not None:  # a stop string, before the scheduler
            self._to_scheduler.put(msg.AbortRequest(output.rid))
        return shown

    def run_once(self, timeout_s: float = IDLE_POLL_TIMEOUT_S) -> None:
        results: list[ReqOutput] = []
        for message in self._inbox.get_all(timeout_s):
            if isinstance(message, msg.TokenizedRequest):
                params = message.sampling_params
                detok = IncrementalDetokenizer(self._tokenizer, message.input_ids, params)
                self._requests[message.rid] = detok
            else:  # a step's outputs: nothing else is sent to detokenizer_in
                results += filter(self._process, message)
        if results:
            self._to_api.put(tuple(results))

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
