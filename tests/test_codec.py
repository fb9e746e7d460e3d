"""The message codec round-trips every registered message; the queue carries them."""

from __future__ import annotations

import asyncio
import os
import stat
import threading

import pytest

from minisgl.core import FinishReason, ReqOutput, SamplingParams, TokenLogprob
from minisgl.runtime.messages import (
    AbortRequest,
    Endpoints,
    MessageQueue,
    StatsReply,
    StatsRequest,
    TokenizedRequest,
    decode,
    encode,
)
from minisgl.scheduler.counters import HistogramCounts
from minisgl.stats import SchedulerStats

PARAMS = SamplingParams(
    max_tokens=7, temperature=0.5, top_k=3, seed=11, stop=("a", "bc"), stop_token_ids=(5,)
)
LOGPROB = TokenLogprob(token_id=3, logprob=-0.25, top=((3, -0.25), (9, -1.5)))
STATS = SchedulerStats(
    *(1, 2, 0.5, 3, 4, 5, 6, 13, 14, 7, 8, 9, 10, 11, 12, 2.5),
    batch_size=HistogramCounts((1.0, 2.0)).snapshot(),
    gpu_memory_total_bytes=1 << 33,
)
MESSAGES = [
    TokenizedRequest(rid="r1", input_ids=(1, 2, 3), sampling_params=PARAMS),
    AbortRequest(rid="r1"),
    (  # a step's outputs, from the scheduler
        ReqOutput(rid="r1", token_ids=(4,), logprobs=(LOGPROB,)),
        ReqOutput(rid="r2", token_ids=(), finish_reason=FinishReason.ERROR, error="x"),
    ),
    (  # and from the detokenizer, their text in
        ReqOutput(
            rid="r1",
            token_ids=(4, 5),
            finish_reason=FinishReason.STOP,
            logprobs=(LOGPROB, LOGPROB),
            matched_stop=2,
            text="héllo 😀",
        ),
    ),
    StatsRequest(request_id=42),
    StatsReply(
        42,
        max_model_len=8192,
        vocab_size=100,
        eos_token_ids=(2,),
        kv_capacity_tokens=64,
        stats=STATS,
    ),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(message):
    assert decode(encode(message)) == message


def test_enum_and_nested_types_survive():
    out = decode(encode(MESSAGES[2]))[1]
    assert out.finish_reason is FinishReason.ERROR
    assert isinstance(decode(encode(MESSAGES[0])).sampling_params, SamplingParams)
    stats = decode(encode(MESSAGES[-1])).stats
    assert isinstance(stats, SchedulerStats) and stats.batch_size.bucket_counts == (0, 0, 0)
    assert stats.gpu_utilization_ratio is None and stats.gpu_memory_total_bytes == 1 << 33


def test_unregistered_type_is_rejected():
    class NotAMessage:
        pass

    with pytest.raises(TypeError, match="not in the message registry"):
        encode(NotAMessage())


def test_endpoints_are_private_and_removed():
    endpoints = Endpoints.create()
    try:
        assert stat.S_IMODE(os.stat(endpoints.root).st_mode) == 0o700
        assert endpoints.scheduler_in.startswith("ipc://" + endpoints.root)
    finally:
        endpoints.remove()
    assert not os.path.exists(endpoints.root)


def test_push_pull():
    endpoints = Endpoints.create()
    try:
        pull = MessageQueue("pull", endpoints.scheduler_in)
        push = MessageQueue("push", endpoints.scheduler_in)
        for message in MESSAGES:
            push.put(message)
        received = [pull.get(timeout_s=2.0) for _ in MESSAGES]
        assert received == MESSAGES
        assert pull.get(timeout_s=0) is None and pull.get_all() == []
        for message in MESSAGES[:3]:
            push.put(message)
        received = []
        while len(received) < 3:
            batch = pull.get_all(timeout_s=2.0)  # waits for the first, takes what is there
            assert batch
            received += batch
        assert received == MESSAGES[:3]
        with pytest.raises(AssertionError, match="cannot send"):
            pull.put(MESSAGES[1])
        for queue in (pull, push):
            queue.close()
    finally:
        endpoints.remove()


def test_async_queue():
    endpoints = Endpoints.create()

    async def main() -> object:
        pull = MessageQueue("pull", endpoints.api_in, asyncio=True)
        sender = threading.Thread(
            target=lambda: MessageQueue("push", endpoints.api_in).put(MESSAGES[4])
        )
        sender.start()
        message = await asyncio.wait_for(pull.aget(), timeout=5.0)
        sender.join()
        pull.close()
        return message

    try:
        assert asyncio.run(main()) == MESSAGES[4]
    finally:
        endpoints.remove()
