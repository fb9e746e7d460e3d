"""The scheduler process: feed requests to the Scheduler, step it, ship its outputs.

When idle it blocks on the input socket (with a timeout, to refresh stats and notice shutdown);
when busy it only drains what is already waiting, so decoding never waits for input. With tp it
is rank 0 and this loop does not change (docs/server.md#process-layout)."""

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from minisgl.config import ServerArgs
from minisgl.core import FinishReason, Req, ReqOutput
from minisgl.engine.gpu_probe import GpuProbe, make_gpu_probe
from minisgl.runtime import messages as msg
from minisgl.scheduler.counters import ThroughputWindow
from minisgl.scheduler.scheduler import Scheduler
from minisgl.scheduler.tp import make_scheduler
from minisgl.tokenizer.detokenizer import PROMPT_CONTEXT_TOKENS

logger = logging.getLogger(__name__)

IDLE_POLL_TIMEOUT_S = 0.05
# Stats are read from the scheduler by the loop itself (never concurrently with step()) and
# handed to the thread that answers pings; refreshing this often is cheap and fresh enough.
STATS_REFRESH_INTERVAL_S = 0.05
CTL_POLL_TIMEOUT_S = 0.1
RESPONDER_JOIN_TIMEOUT_S = 1.0
# A step that raises fails the requests it ran; this many in a row mean the scheduler itself is
# broken, and the process ends.
MAX_FAILED_STEPS_IN_A_ROW = 3


def build_stats_reply(
    scheduler: Scheduler, gen_throughput: ThroughputWindow, gpu_probe: GpuProbe | None
) -> msg.StatsReply:
    """The scheduler's stats() with this process's numbers (throughput, GPU) filled in."""
    stats, now_s = scheduler.stats(), time.monotonic()
    gpu = gpu_probe.sample(now_s) if gpu_probe is not None else None
    stats = dataclasses.replace(
        stats,
        gen_throughput_tokens_per_s=gen_throughput.update(now_s, stats.generation_tokens_total),
        **(dataclasses.asdict(gpu) if gpu is not None else {}),
    )
    limits, eos_token_ids = scheduler.limits, tuple(scheduler.eos_token_ids)
    model = (limits.max_model_len, limits.vocab_size, eos_token_ids, limits.kv_capacity_tokens)
    return msg.StatsReply(-1, *model, stats)


class SchedulerLoop:
    def __init__(
        self, scheduler: Scheduler, endpoints: msg.Endpoints, gpu_probe: GpuProbe | None = None
    ) -> None:
        self.scheduler = scheduler
        self._gpu_probe = gpu_probe
        self._gen_throughput = ThroughputWindow()
        self._inbox = msg.MessageQueue("pull", endpoints.scheduler_in)
        self._to_detokenizer = msg.MessageQueue("push", endpoints.detokenizer_in)
        self._to_api = msg.MessageQueue("push", endpoints.api_in)  # control replies
        self._stats_time_s = 0.0
        self._stats = build_stats_reply(scheduler, self._gen_throughput, gpu_probe)
        self._stopped = threading.Event()
        self._failed_steps = 0  # consecutive steps that raised
        self._responder = threading.Thread(
            target=self._answer_stats, args=(endpoints,), name="stats-responder", daemon=True
        )
        self._responder.start()

    def _answer_stats(self, endpoints: msg.Endpoints) -> None:
        """The stats responder thread: answers msg.StatsRequest pings, so /health works even during
        a long step. It only reads `_stats`, which the loop replaces (never mutates) between
        steps. If the scheduler process dies, nobody answers and /health turns 503."""
        # zmq sockets belong to one thread: this thread makes its own.
        inbox = msg.MessageQueue("pull", endpoints.scheduler_ctl)
        to_api = msg.MessageQueue("push", endpoints.api_in)
        try:
            while not self._stopped.is_set():
                message = inbox.get(timeout_s=CTL_POLL_TIMEOUT_S)
                if isinstance(message, msg.StatsRequest):
                    to_api.put(dataclasses.replace(self._stats, request_id=message.request_id))
        finally:
            inbox.close()
            to_api.close()

    def _refresh_stats(self, force: bool = False) -> None:
        now_s = time.monotonic()
        if force or now_s - self._stats_time_s >= STATS_REFRESH_INTERVAL_S:
            self._stats = build_stats_reply(self.scheduler, self._gen_throughput, self._gpu_probe)
            self._stats_time_s = now_s

    def _handle(self, message: Any) -> ReqOutput | None:
        """Feed one message to the scheduler; a rejected request becomes an error output."""
        if isinstance(message, msg.AbortRequest):
            self.scheduler.abort_request(message.rid)
            return None
        if isinstance(message, msg.FlushCacheRequest):
            busy = self.scheduler.has_work()  # cached pages may be in use: SGLang refuses too
            if not busy:
                self.scheduler.flush_cache()
                self._refresh_stats(force=True)
                logger.info("prefix cache flushed")
            refusal = "requests are running or waiting; the cache was not flushed" if busy else ""
            self._to_api.put(msg.FlushCacheReply(message.request_id, not busy, refusal))
            return None
        # Otherwise a TokenizedRequest: nothing else is sent to scheduler_in. Ahead of any
        # output, on the same socket, the detokenizer learns of it (the prompt's tail is enough).
        tail_ids = message.input_ids[-PROMPT_CONTEXT_TOKENS:]
        self._to_detokenizer.put(
            dataclasses.replace(message, input_ids=tail_ids, grammar_json=None)
        )
        try:
            req = Req(
                message.rid,
                list(message.input_ids),
                message.sampling_params,
                grammar_json=message.grammar_json,
                arrival_time=time.monotonic(),
            )
            self.scheduler.add_request(req)
        except Exception as exc:  # one bad request must not stop the loop everyone depends on
            if not isinstance(exc, ValueError):
                logger.exception("scheduler: request %s failed to queue", message.rid)
            return ReqOutput(message.rid, (), FinishReason.ERROR, error=str(exc))
        return None

    def run_once(self, idle_timeout_s: float = IDLE_POLL_TIMEOUT_S) -> None:
        busy = self.scheduler.has_work()
        messages = self._inbox.get_all(0.0 if busy else idle_timeout_s)
        outputs = [out for out in map(self._handle, messages) if out is not None]
        if self.scheduler.has_work():
            outputs.extend(self._step())
        elif self.scheduler.tp is not None:  # idle: a dead tp rank shows up here, not in a step
            self.scheduler.tp.check_health()
        if outputs:
            self._to_detokenizer.put(tuple(outputs))
        # After going idle, publish at once: clients poll the gauges for "back to zero".
        self._refresh_stats(force=busy and not self.scheduler.has_work())

    def _step(self) -> list[ReqOutput]:
        """One scheduler step. If it raises (a bug, a device out of memory), the requests it was
        running fail with a 500 and the server goes on with the rest; several failures in a
        row, or one the scheduler cannot recover from (a CUDA error, tensor parallelism), end
        the process as before (the launcher then stops the server)."""
        try:
            outputs = self.scheduler.step()
        except Exception as exc:
            self._failed_steps += 1
            logger.exception(
                "scheduler: a step failed (%d in a row); its requests end with an error",
                self._failed_steps,
            )
            if self._failed_steps >= MAX_FAILED_STEPS_IN_A_ROW:
                raise
            error = f"internal error while running the request ({type(exc).__name__}: {exc})"
            return self.scheduler.fail_running(error)
        self._failed_steps = 0
        return outputs

    def close(self) -> None:
        self._stopped.set()
        self._responder.join(timeout=RESPONDER_JOIN_TIMEOUT_S)
        for queue in (self._inbox, self._to_detokenizer, self._to_api):
            queue.close()


def run_scheduler_process(
    args: ServerArgs, endpoints: msg.Endpoints, report_ready: Callable[[], None]
) -> None:
    scheduler = make_scheduler(args)
    scheduler.masks.prepare()  # before serving, while the API process starts too
    device = scheduler.engine.device
    loop = SchedulerLoop(scheduler, endpoints, make_gpu_probe(device.type, device.index))
    report_ready()
    try:
        while True:
            loop.run_once()
    finally:
        loop.close()
        scheduler.shutdown()
