"""The detokenizer process: each output's token ids -> text, and stop strings
(minisgl.tokenizer.IncrementalDetokenizer, one per request).

When a stop string appears it reports finish_reason "stop" to the API server right away and
asks the scheduler to abort the request (freeing its KV pages); whatever the scheduler still
sends for that request afterwards is dropped.
"""

import logging
from collections.abc import Callable

from minisgl.core import ReqOutput
from minisgl.runtime import messages as msg
from minisgl.tokenizer import IncrementalDetokenizer, load_tokenizer

logger = logging.getLogger(__name__)

IDLE_POLL_TIMEOUT_S = 0.1


def run_detokenizer_process(
    tokenizer_path: str, endpoints: msg.Endpoints, report_ready: Callable[[], None]
) -> None:
    tokenizer = load_tokenizer(tokenizer_path)
    inbox = msg.MessageQueue("pull", endpoints.detokenizer_in)
    to_api = msg.MessageQueue("push", endpoints.api_in)
    to_scheduler = msg.MessageQueue("push", endpoints.scheduler_in)
    requests: dict[str, IncrementalDetokenizer] = {}

    def shown(output: ReqOutput) -> bool:
        """Fill in the output's text; False: drop it (after a stop string ended its request)."""
        if (request := requests.get(output.rid)) is None:
            logger.debug("detokenizer: output for unknown request %s dropped", output.rid)
            return False
        keep = request.add_output(output)
        if request.done:
            del requests[output.rid]
        elif keep and output.finish_reason is not None:  # a stop string, before the scheduler
            to_scheduler.put(msg.AbortRequest(output.rid))
        return keep

    report_ready()
    try:
        while True:
            results: list[ReqOutput] = []
            for message in inbox.get_all(IDLE_POLL_TIMEOUT_S):
                if isinstance(message, msg.TokenizedRequest):
                    requests[message.rid] = IncrementalDetokenizer(
                        tokenizer, message.input_ids, message.sampling_params
                    )
                else:  # a step's outputs: nothing else is sent to detokenizer_in
                    results += filter(shown, message)
            if results:
                to_api.put(tuple(results))
    finally:
        for queue in (inbox, to_api, to_scheduler):
            queue.close()
