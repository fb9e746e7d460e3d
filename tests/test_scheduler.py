"""Scheduling knobs must not change outputs; reuse, retraction and abort must keep exact books."""

from __future__ import annotations

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.config import ServerArgs
from minisgl.core import FinishReason, Req, ReqOutput
from minisgl.scheduler.scheduler import Scheduler

MAX_STEPS = 2000
NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def workload() -> list[list[int]]:
    """Shared system prompts, a long prompt, mixed lengths, and an exact duplicate."""
    g = torch.Generator().manual_seed(7)

    def rand(n: int) -> list[int]:
        return torch.randint(0, 5000, (n,), generator=g).tolist()

    system_a, system_b = rand(48), rand(33)
    prompts = [system_a + rand(n) for n in (3, 17, 40)]
    prompts += [system_b + rand(n) for n in (1, 29)]
    prompts += [rand(150), rand(5), rand(70)]
    prompts.append(list(prompts[1]))
    return prompts


def run_llm(model_dir, prompts, **options) -> tuple[list[list[int]], LLM]:
    llm = LLM(
        str(model_dir),
        **{"dtype": "float32", "num_pages": 2048, "max_running_requests": 16, **options},
    )
    outs = llm.generate(prompts, GREEDY)
    llm.check_page_accounting()
    return [o.token_ids for o in outs], llm


@pytest.fixture(scope="module")
def baseline(tiny_qwen3):
    tokens, llm = run_llm(tiny_qwen3, workload(), disable_overlap=True, cache_type="naive")
    llm.shutdown()
    return tokens


KNOBS = {
    "radix": dict(cache_type="radix"),
    "naive": dict(cache_type="naive"),
    "chunk16": dict(max_prefill_tokens=16),
    "chunk4096": dict(max_prefill_tokens=4096),
    "page16": dict(page_size=16),
    "page16_chunk16_radix": dict(page_size=16, max_prefill_tokens=16, cache_type="radix"),
    "overlap_off": dict(disable_overlap=True),
    "overlap_on": dict(overlap="on"),
    "overlap_on_chunk5": dict(max_prefill_tokens=5, overlap="on"),
    # decode batches padded to graph sizes (the CUDA-graph path, run eagerly on CPU)
    "graph_padding": dict(cuda_graph_max_bs=8),
    "graph_padding_overlap_page16": dict(cuda_graph_max_bs=16, overlap="on", page_size=16),
    "one_running": dict(max_running_requests=1),
    # prefill beside decodes in the smallest chunks (no step fits a target of 1 us)
    "target_itl_tiny": dict(target_itl_ms=1e-3, max_running_requests=2),
}


@pytest.mark.parametrize("name", list(KNOBS))
def test_outputs_do_not_depend_on_knobs(tiny_qwen3, baseline, name):
    tokens, llm = run_llm(tiny_qwen3, workload(), **KNOBS[name])
    try:
        assert tokens == baseline
        llm.scheduler.flush_cache()
        stats = llm.scheduler.stats()
        assert stats.num_free_pages == stats.num_total_pages
        assert llm.scheduler.cache.allocator.num_free == stats.num_total_pages
    finally:
        llm.shutdown()


POOL_TOKENS = 168


@pytest.mark.parametrize("page_size", [1, 4])
def test_retraction_under_tiny_pool_keeps_outputs(tiny_qwen3, baseline, page_size):
    # Longest request: 150 + 12 tokens; the pool barely holds it, never the whole batch.
    tokens, llm = run_llm(
        tiny_qwen3, workload(), num_pages=POOL_TOKENS // page_size, page_size=page_size
    )
    try:
        assert llm.scheduler.stats().num_retractions_total > 0
        assert tokens == baseline
        llm.scheduler.flush_cache()
        assert llm.scheduler.cache.allocator.num_free == POOL_TOKENS // page_size
    finally:
        llm.shutdown()


def test_radix_reuse_computes_only_the_tail(tiny_qwen3):
    llm = LLM(str(tiny_qwen3), dtype="float32", num_pages=1024, max_running_requests=8)
    try:
        prompt = list(range(100, 200))
        first = llm.generate([prompt], GREEDY)[0]
        before = llm.scheduler.stats()
        second = llm.generate([prompt], GREEDY)[0]
        after = llm.scheduler.stats()
        assert second.token_ids == first.token_ids
        assert first.num_cached_tokens == 0
        assert second.num_cached_tokens == len(prompt) - 1  # the last token must be computed
        assert after.prefill_tokens_total - before.prefill_tokens_total == 1
        assert after.cached_prompt_tokens_total - before.cached_prompt_tokens_total == 99

        # Shared-prefix group: the prefix is computed once, then only the suffixes.
        system = list(range(1000, 1064))
        group = [system + [7, 8, 9, i] for i in range(4)]
        llm.generate(group[:1], GREEDY)
        mid = llm.scheduler.stats()
        llm.generate(group[1:], GREEDY)
        end = llm.scheduler.stats()
        assert end.prefill_tokens_total - mid.prefill_tokens_total <= 3 * 4
        llm.check_page_accounting()
    finally:
        llm.shutdown()


# ---- driving the scheduler directly: aborts at every stage ------------------------------------


def drive(sched: Scheduler, max_steps: int = MAX_STEPS) -> dict[str, list[ReqOutput]]:
    by_rid: dict[str, list[ReqOutput]] = {}
    for _ in range(max_steps):
        if not sched.has_work():
            return by_rid
        for out in sched.step():
            by_rid.setdefault(out.rid, []).append(out)
    raise AssertionError("scheduler did not finish in time")


def assert_one_terminal(outputs: dict[str, list[ReqOutput]], rids: list[str]) -> None:
    for rid in rids:
        events = outputs.get(rid, [])
        finals = [o for o in events if o.finish_reason is not None]
        assert len(finals) == 1, f"{rid}: {len(finals)} terminal events"
        assert events[-1].finish_reason is not None, f"{rid}: output after its terminal event"


def assert_all_pages_back(sched: Scheduler) -> None:
    sched.check_page_accounting()
    sched.flush_cache()
    assert sched.cache.allocator.num_free == sched.cache.num_total_pages
    assert sched.cache.rows.num_free == sched.args.max_running_requests


@pytest.fixture(scope="module", params=[True, False], ids=["overlap", "no_overlap"])
def sched(request, tiny_qwen3):
    s = Scheduler(
        ServerArgs(
            model=str(tiny_qwen3),
            dtype="float32",
            num_pages=600,
            max_running_requests=4,
            max_prefill_tokens=16,
            overlap="on" if request.param else "off",
        )
    )
    yield s
    s.shutdown()


def _req(rid: str, n: int, max_tokens: int = 20, **kw) -> Req:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)
    return Req(rid, list(range(10, 10 + n)), params)


def test_abort_at_every_stage(sched):
    reqs = [_req(f"r{i}", 60) for i in range(6)]  # 4 rows: two wait in the queue
    for r in reqs:
        sched.add_request(r)
    sched.abort_request("r5")  # queued
    outputs: dict[str, list[ReqOutput]] = {}

    def collect(outs):
        for o in outs:
            outputs.setdefault(o.rid, []).append(o)

    collect(sched.step())  # r0 mid-chunk (16 of 60 tokens)
    sched.abort_request("r0")  # mid-chunk and (with overlap) in the in-flight batch
    for _ in range(12):
        collect(sched.step())
    sched.abort_request("r1")  # running (decoding by now)
    sched.abort_request("unknown")  # ignored
    collect(sched.step())
    sched.abort_request("r2")  # in the batch just launched under overlap
    for rid, outs in drive(sched).items():
        outputs.setdefault(rid, []).extend(outs)
    assert_one_terminal(outputs, [r.rid for r in reqs])
    for rid in ("r0", "r1", "r2", "r5"):
        assert outputs[rid][-1].finish_reason == FinishReason.ABORT
    for rid in ("r3", "r4"):
        assert outputs[rid][-1].finish_reason == FinishReason.LENGTH
        assert sum(len(o.token_ids) for o in outputs[rid]) == 20
    assert_all_pages_back(sched)


class _InjectedFault(RuntimeError):
    pass


@pytest.mark.parametrize("where", ["forward", "process", "admit"])
def test_a_failed_step_fails_its_requests_and_the_rest_run_on(sched, monkeypatch, where):
    """A step that raises (a bug, a device out of memory): `fail_running` ends the admitted
    requests with an internal error, frees their pages without caching them and empties the
    prefix cache (a chunk's pages were shared there before their KV was written); waiting
    requests then produce exactly the tokens an undisturbed run gives."""
    reference = _req("reference", 60)
    sched.add_request(reference)
    expected = [t for o in drive(sched)["reference"] for t in o.token_ids]
    assert_all_pages_back(sched)
    reqs = [_req(f"f{i}", 60) for i in range(6)]  # one prompt: a shared prefix; some wait
    for r in reqs:
        sched.add_request(r)
    outputs: dict[str, list[ReqOutput]] = {}
    for _ in range(3):  # prefills under way: their chunks' pages are in the prefix cache
        for o in sched.step():
            outputs.setdefault(o.rid, []).append(o)
    calls = {"n": 0}
    # forward: the batch's compute; process: reading its results; admit: while scheduling, a
    # request already taken off the queue and not yet in the batch
    target = {"forward": sched.engine, "process": sched, "admit": sched.cache}[where]
    name = {"forward": "forward", "process": "_take", "admit": "admit"}[where]
    original = getattr(target, name)

    def fail_once(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise _InjectedFault("injected")
        return original(*args, **kwargs)

    monkeypatch.setattr(target, name, fail_once)
    for _ in range(3):  # under overlap, a forward's error surfaces when its result is read
        try:
            for o in sched.step():
                outputs.setdefault(o.rid, []).append(o)
        except _InjectedFault:
            break
    else:
        raise AssertionError("the injected fault never surfaced")
    waiting = {r.rid for r in sched.prefill.waiting}
    assert sched.running and waiting
    failed = sched.fail_running("internal error: injected")
    # every request not waiting fails: the running ones and (admit) the one caught between
    assert {o.rid for o in failed} == {r.rid for r in reqs} - waiting
    assert all(o.finish_reason == FinishReason.ERROR for o in failed)
    assert all(o.internal_error and o.error == "internal error: injected" for o in failed)
    assert not sched.running and {r.rid for r in sched.prefill.waiting} == waiting
    assert sched.cache.prefix_cache.total_size == 0  # nothing computed in the failed step stays
    for o in failed:
        outputs.setdefault(o.rid, []).append(o)
    for rid, outs in drive(sched).items():
        outputs.setdefault(rid, []).extend(outs)
    assert_one_terminal(outputs, [r.rid for r in reqs])
    finished = [r.rid for r in reqs if outputs[r.rid][-1].finish_reason == FinishReason.LENGTH]
    assert set(finished) == waiting
    for rid in finished:
        assert [t for o in outputs[rid] for t in o.token_ids] == expected
    assert_all_pages_back(sched)


def test_no_token_after_a_stop(sched, tiny_qwen3):
    probe = _req("probe", 30, max_tokens=8)
    sched.add_request(probe)
    tokens = [t for o in drive(sched)["probe"] for t in o.token_ids]
    stop_at = 4
    stop_token = tokens[stop_at]
    first = tokens.index(stop_token)
    req = _req("stopper", 30, max_tokens=8, stop_token_ids=(stop_token,))
    sched.add_request(req)
    outputs = drive(sched)
    got = [t for o in outputs["stopper"] for t in o.token_ids]
    assert got + [outputs["stopper"][-1].matched_stop] == tokens[: first + 1]  # the stop: hidden
    assert outputs["stopper"][-1].finish_reason == FinishReason.STOP
    assert_one_terminal(outputs, ["stopper"])
    assert_all_pages_back(sched)


def test_requests_that_can_never_fit_are_rejected(sched):
    too_long = Req("long", list(range(2000)), SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="context length"):
        sched.add_request(too_long)
    too_big = Req("big", list(range(590)), SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match="KV cache"):
        sched.add_request(too_big)
    assert not sched.has_work()


def test_shared_prefix_burst_reuses_the_prefix(tiny_qwen3):
    """Requests sharing a system prompt, all queued at once: the prefix is computed once."""
    system = list(range(2000, 2100))
    group = [system + [5, 6, i] for i in range(6)]
    radix = LLM(str(tiny_qwen3), dtype="float32", num_pages=2048, max_running_requests=8)
    naive = LLM(
        str(tiny_qwen3), dtype="float32", num_pages=2048, max_running_requests=8, cache_type="naive"
    )
    try:
        got = radix.generate(group, GREEDY)
        want = naive.generate(group, GREEDY)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        stats = radix.scheduler.stats()
        # The first request computes all 103 tokens; the other five share its first 102 (cached
        # right after its prefill, not at its finish) and compute only their last token.
        assert stats.prefill_tokens_total == 103 + 5 * 1
        assert sum(o.num_cached_tokens for o in got) == 5 * 102
        radix.check_page_accounting()
        radix.scheduler.flush_cache()
        assert radix.scheduler.cache.allocator.num_free == 2048
    finally:
        radix.shutdown()
        naive.shutdown()


def test_a_step_that_crosses_pages_for_everyone_writes_the_page_table_once(tiny_qwen3):
    """Equal prompts cross page boundaries in the same decode step: every request gets its page
    in one allocation and one table write (no per-request torch work), and the table holds, for
    each request, the slots of its pages in order (computed here by hand from page_ids)."""
    page_size, num_reqs = 4, 6
    s = Scheduler(
        ServerArgs(
            model=str(tiny_qwen3),
            dtype="float32",
            num_pages=200,
            page_size=page_size,
            max_running_requests=num_reqs,
            overlap="off",
            cache_type="naive",
        )
    )
    writes: list[int] = []
    write_slots = s.engine.tables.write_slots

    def counting(rows: list[int], starts: list[int], slots: torch.Tensor) -> None:
        writes.append(len(rows))
        write_slots(rows, starts, slots)

    s.engine.tables.write_slots = counting  # type: ignore[method-assign]
    try:
        reqs = [_req(f"p{i}", page_size * 2, max_tokens=3 * page_size) for i in range(num_reqs)]
        for req in reqs:
            s.add_request(req)
        crossing_steps = 0
        for _ in range(MAX_STEPS):
            if not s.has_work():
                break
            writes.clear()
            decoding = bool(s.running) and all(r.output_ids for r in s.running)
            pages_before = sum(len(r.page_ids) for r in s.running)
            s.step()
            if decoding and sum(len(r.page_ids) for r in s.running) == pages_before + num_reqs:
                crossing_steps += 1
                assert writes == [num_reqs]  # one write, a page for each of them
            s.engine.tables.flush()
            for req in s.running:
                expected = [p * page_size + o for p in req.page_ids for o in range(page_size)]
                row = s.engine.tables.page_table[req.table_row, : len(expected)]
                assert row.tolist() == expected
            s.check_page_accounting()
        assert not s.has_work() and crossing_steps >= 2
        assert all(len(r.output_ids) == 3 * page_size for r in reqs)
    finally:
        s.shutdown()


def test_table_writes_and_the_forward_threads_flush_safely():
    """CPU overlap: the scheduler thread queues table writes while the forward thread flushes
    at the start of every forward. Neither may see the other's queue
    half-applied (this raised `torch.cat(): expected a non-empty list` now and then)."""
    import threading

    from minisgl.engine.device import ComputeStream
    from minisgl.engine.tables import DeviceTables

    tables = DeviceTables(8, 64, ComputeStream(torch.device("cpu")))
    stop = threading.Event()
    errors: list[BaseException] = []

    def flush_forever() -> None:
        try:
            while not stop.is_set():
                tables.flush()
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    flusher = threading.Thread(target=flush_forever)
    flusher.start()
    try:
        for i in range(5000):  # each write contends with a flush for the GIL: ~3 ms apiece
            tables.write_tokens(i % 8, i % 60, [i % 1000, 7])
    finally:
        stop.set()
        flusher.join()
    assert not errors, errors[0]
    tables.flush()  # what the next forward does: the last writes land too
    assert tables.token_table[4999 % 8, 4999 % 60].item() == 4999 % 1000


SCORED_KNOBS = {
    "tiny_pool": dict(num_pages=POOL_TOKENS // 4, page_size=4),
    "chunk5_overlap_radix": dict(max_prefill_tokens=5, overlap="on", cache_type="radix"),
    "page16_radix": dict(page_size=16, cache_type="radix"),
}


@pytest.mark.parametrize("name", list(SCORED_KNOBS))
def test_prompt_logprobs_do_not_depend_on_knobs(tiny_qwen3, name):
    """Scored prompts (some only scored, max_tokens 0) under retraction, tiny chunks with
    overlap, and a shared prefix cache: the same tokens and prompt logprobs as a plain run,
    and exact page books."""
    prompts = workload()
    params = [
        SamplingParams(
            temperature=0,
            max_tokens=0 if i % 4 == 3 else NEW_TOKENS,
            ignore_eos=True,
            prompt_logprobs=i % 3,
        )
        for i in range(len(prompts))
    ]

    def run(**options):
        llm = LLM(str(tiny_qwen3), **{"num_pages": 2048, "max_running_requests": 16, **options})
        try:
            outs = llm.generate(prompts, params)
            llm.check_page_accounting()
            return outs, llm.scheduler.stats().num_retractions_total
        finally:
            llm.shutdown()

    want, _ = run(disable_overlap=True, cache_type="naive")
    got, retractions = run(**SCORED_KNOBS[name])
    if name == "tiny_pool":
        assert retractions > 0
    for g, w, prompt in zip(got, want, prompts, strict=True):
        assert g.token_ids == w.token_ids
        assert len(g.prompt_logprobs) == len(prompt) and g.prompt_logprobs[0] is None
        assert [e.token_id for e in g.prompt_logprobs[1:]] == prompt[1:]
        got_lp = torch.tensor([e.logprob for e in g.prompt_logprobs[1:]])
        want_lp = torch.tensor([e.logprob for e in w.prompt_logprobs[1:]])
        torch.testing.assert_close(got_lp, want_lp, atol=1e-4, rtol=0)


def test_scored_positions_per_step_are_bounded(tiny_qwen3):
    """Three 400-token prompts to score at once: no step scores more than the step budget
    (the logits of every scored position exist at once), and all finish, books exact."""
    from minisgl.scheduler.prefill import PROMPT_LOGPROBS_STEP_TOKENS

    llm = LLM(str(tiny_qwen3), num_pages=4096, max_running_requests=8, max_prefill_tokens=4096)
    seen: list[int] = []
    engine = llm.scheduler.engine
    real = engine.forward_logits

    def counting(batch):
        seen.append(sum(batch.num_prompt_scores))
        return real(batch)

    engine.forward_logits = counting  # the plain forward path calls it too
    engine.forward = lambda batch, mask=None: engine.sample(batch, counting(batch), mask)
    try:
        prompts = [[(i * 13 + j) % 4000 + 5 for j in range(400)] for i in range(3)]
        outs = llm.generate(prompts, SamplingParams(max_tokens=0, prompt_logprobs=0))
        assert all(len(o.prompt_logprobs) == 400 for o in outs)
        assert max(seen) <= PROMPT_LOGPROBS_STEP_TOKENS < sum(seen)
        llm.check_page_accounting()
    finally:
        llm.shutdown()
