"""Who goes first (minisgl/scheduler/policy.py): priority, preemption, aging, tenant fairness
(virtual token counters) and cache-aware order, on the real scheduler over a tiny model; then
the server side once (the 400, tenants from `user` and the API key, /metrics, /get_load)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from minisgl.api.request import api_key_tenant
from minisgl.config import ServerArgs
from minisgl.core import Req, ReqOutput, SamplingParams
from minisgl.engine.engine import Engine
from minisgl.scheduler import policy as policy_module
from minisgl.scheduler.counters import MAX_LABEL_CHARS, LabelSlots, SchedulerCounters
from minisgl.scheduler.policy import INPUT_TOKEN_WEIGHT, OUTPUT_TOKEN_WEIGHT
from minisgl.scheduler.scheduler import Scheduler
from minisgl.stats import MAX_LABEL_VALUES, OTHER_LABEL
from tests.server_utils import require_default_model, running_server
from tests.test_scheduler import assert_one_terminal, drive

NUM_ROWS = 2  # the engine's table rows: --max-running-requests 2, as the targets
PROMPT_LEN = 12
NEW_TOKENS = 4


@pytest.fixture(scope="module")
def base(tiny_qwen3) -> ServerArgs:
    return ServerArgs(
        model=str(tiny_qwen3),
        dtype="float32",
        num_pages=400,
        max_running_requests=NUM_ROWS,
        max_prefill_tokens=64,
        overlap="off",
    )


@pytest.fixture(scope="module")
def engine(base):
    return Engine(base)  # shared: each test builds its scheduler (its policy) over it


@pytest.fixture
def make(base: ServerArgs, engine: Engine):
    """Schedulers with `flags` over the shared engine, shut down after the test."""
    made: list[Scheduler] = []

    def scheduler(**flags) -> Scheduler:
        made.append(Scheduler(base.replace(**flags), engine=engine))
        return made[-1]

    yield scheduler
    for sched in made:
        sched.shutdown()


def assert_all_pages_back(sched: Scheduler) -> None:
    sched.check_page_accounting()
    sched.flush_cache()
    assert sched.cache.allocator.num_free == sched.cache.num_total_pages
    assert sched.cache.rows.num_free == NUM_ROWS


def req(
    rid: str,
    first: int,
    priority: int = 0,
    user: str | None = None,
    prompt_len: int = PROMPT_LEN,
    max_tokens: int = NEW_TOKENS,
) -> Req:
    """A prompt of distinct tokens from `first` on (prompts 100 apart share nothing)."""
    params = SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, priority=priority, user=user
    )
    return Req(rid, list(range(first, first + prompt_len)), params)


def first_token_order(sched: Scheduler, reqs: list[Req]) -> list[str]:
    """Queue `reqs` at once, run them all; the rids in the order their first token came."""
    for r in reqs:
        sched.add_request(r)
    order: list[str] = []
    outputs: dict[str, list[ReqOutput]] = {}
    while sched.has_work():
        for out in sched.step():
            outputs.setdefault(out.rid, []).append(out)
            if out.token_ids and out.rid not in order:
                order.append(out.rid)
    assert_one_terminal(outputs, [r.rid for r in reqs])
    assert_all_pages_back(sched)
    return order


PRIORITIES = {"a": 0, "b": 5, "c": 1, "d": 5, "e": 3}


@pytest.mark.parametrize(
    "flags, expected",
    [
        ({}, "abcde"),  # the field is accepted and ignored
        ({"enable_priority_scheduling": True}, "bdeca"),  # larger first, then arrival
        ({"enable_priority_scheduling": True, "schedule_low_priority_values_first": True}, "acebd"),
    ],
    ids=["off", "larger_first", "smaller_first"],
)
def test_priority_orders_the_queue(make, flags, expected):
    sched = make(max_running_requests=1, **flags)
    reqs = [req(rid, 100 * i, p) for i, (rid, p) in enumerate(PRIORITIES.items())]
    assert "".join(first_token_order(sched, reqs)) == expected


def run_all(sched: Scheduler, reqs: list[Req]) -> dict[str, list[int]]:
    for r in reqs:
        sched.add_request(r)
    outputs = drive(sched)
    assert_one_terminal(outputs, [r.rid for r in reqs])
    return {rid: [t for o in outs for t in o.token_ids] for rid, outs in outputs.items()}


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_a_high_priority_request_preempts_and_outputs_stay_the_same(make, overlap):
    """The batch is full of low-priority requests: a high one retracts the newest of them at
    once (its computed prefix stays cached); every output is the undisturbed run's."""

    def workload() -> tuple[list[Req], Req]:
        low = [req(f"low{i}", 100 * i, 0, prompt_len=40, max_tokens=24) for i in range(2)]
        return low, req("high", 500, 10)

    low, high = workload()
    want = run_all(make(), low)  # undisturbed: FCFS, the high one alone after
    want.update(run_all(make(), [high]))
    low, high = workload()

    sched = make(enable_priority_scheduling=True, overlap=overlap)
    for r in low:
        sched.add_request(r)
    outputs: dict[str, list[ReqOutput]] = {}
    for _ in range(6):  # both low requests decoding, the batch full
        for out in sched.step():
            outputs.setdefault(out.rid, []).append(out)
    assert len(sched.running) == NUM_ROWS and all(r.output_ids for r in low)
    sched.add_request(high)
    for out in sched.step():
        outputs.setdefault(out.rid, []).append(out)
    assert high in sched.running and low[1] in sched.prefill.waiting  # the newest low one gave way
    assert low[1].num_retractions == 1 and sched.stats().num_retractions_total == 1
    assert sched.cache.prefix_cache.total_size >= 40  # its computed prefix was kept
    sched.check_page_accounting()
    for rid, outs in drive(sched).items():
        outputs.setdefault(rid, []).extend(outs)
    assert_one_terminal(outputs, ["low0", "low1", "high"])
    got = {rid: [t for o in outs for t in o.token_ids] for rid, outs in outputs.items()}
    assert got == want
    assert low[1].num_cached_prompt_tokens == 0  # usage counts its first admission only
    assert_all_pages_back(sched)


def test_aging_lets_old_requests_outrank_newer_higher_ones(make):
    """--priority-aging-s 10: arriving 35 s earlier (three aging periods apart) is worth three
    priority levels: the old request outranks a newcomer two levels above it, not four."""

    def workload() -> list[Req]:
        reqs = [req("old_p0", 0, 0), req("new_p2", 100, 2), req("new_p4", 200, 4)]
        for r, arrival_s in zip(reqs, (1000.0, 1035.0, 1035.0), strict=True):
            r.arrival_time = arrival_s
        return reqs

    aging = make(enable_priority_scheduling=True, priority_aging_s=10.0)
    reqs = workload()
    assert first_token_order(aging, reqs) == ["new_p4", "old_p0", "new_p2"]
    # Arrival times fix the order of two requests: neither can preempt the other back.
    victim = aging.prefill.policy.victim
    assert victim(reqs[1], [reqs[0]]) is None and victim(reqs[0], [reqs[1]]) is reqs[1]
    no_aging = make(enable_priority_scheduling=True, priority_aging_s=0)
    assert first_token_order(no_aging, workload()) == ["new_p4", "new_p2", "old_p0"]


def test_fairness_admits_the_tenant_with_the_smallest_counter(make):
    """A floods four requests, then B sends two: B's go second and fourth, not last; the
    counters are the weighted tokens each tenant was served."""
    sched = make(max_running_requests=1, tenant_fairness=True)
    reqs = [req(f"A{i}", 100 * i, user="A") for i in range(4)]
    reqs += [req(f"B{i}", 1000 + 100 * i, user="B") for i in range(2)]
    assert first_token_order(sched, reqs) == ["A0", "B0", "A1", "B1", "A2", "A3"]
    served = INPUT_TOKEN_WEIGHT * PROMPT_LEN + OUTPUT_TOKEN_WEIGHT * NEW_TOKENS
    assert sched.prefill.policy.counters == {"A": 4 * served, "B": 2 * served}


def test_a_tenant_back_from_idle_banks_no_credit(make):
    """B was served a little, then went idle while A was served; back, B starts at A's counter
    (the smallest active one), not below it: after one request B has had its turn and A goes
    next. With credit banked, B would have gone twice in a row."""
    sched = make(max_running_requests=1, tenant_fairness=True)
    counters = sched.prefill.policy.counters
    run_all(sched, [req("B0", 0, user="B")])
    # A0 long (A's counter far above B's), then A1 and A2 short.
    a_reqs = [
        req(f"A{i}", 100 * (i + 1), user="A", max_tokens=24 if i == 0 else NEW_TOKENS)
        for i in range(3)
    ]
    for r in a_reqs:
        sched.add_request(r)
    while not a_reqs[1].output_ids:  # A0 done, A1 running, A2 waiting
        sched.step()
    a_counter = counters["A"]
    b_reqs = [req("B1", 900, user="B"), req("B2", 1000, user="B")]
    order = [rid for rid in first_token_order(sched, b_reqs) if rid != "A1"]
    assert order == ["B1", "A2", "B2"]
    assert counters["B"] >= a_counter + 2 * (INPUT_TOKEN_WEIGHT * PROMPT_LEN)  # lifted, then two


def test_preemption_under_fairness_stays_within_a_tenant(make):
    sched = make(enable_priority_scheduling=True, tenant_fairness=True)
    policy = sched.prefill.policy
    high_a, low_a, low_b = req("ha", 0, 9, "A"), req("la", 100, 0, "A"), req("lb", 200, 0, "B")
    assert policy.victim(high_a, [low_a, low_b]) is low_a
    assert policy.victim(high_a, [low_b]) is None  # priority orders requests within a tenant


def test_lpm_admits_the_longest_cached_prefix_first_and_falls_back(make, monkeypatch):
    shared = list(range(3000, 3040))  # 40 tokens: cached by a first request

    def prompts() -> list[Req]:
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        cold = [Req(f"cold{i}", list(range(100 * i, 100 * i + 40)), params) for i in range(2)]
        warm = Req("warm", [*shared, 7, 8, 9], params)
        return [cold[0], warm, cold[1]]

    def order(**flags) -> list[str]:
        sched = make(max_running_requests=1, **flags)
        run_all(sched, [Req("seed", [*shared, 1], SamplingParams(temperature=0, max_tokens=1))])
        return first_token_order(sched, prompts())

    assert order() == ["cold0", "warm", "cold1"]
    assert order(schedule_policy="lpm") == ["warm", "cold0", "cold1"]
    monkeypatch.setattr(policy_module, "LPM_MAX_WAITING", 2)  # 3 waiting: a long queue
    assert order(schedule_policy="lpm") == ["cold0", "warm", "cold1"]


def test_queue_time_labels_are_bounded():
    counters = SchedulerCounters()
    for i in range(MAX_LABEL_VALUES + 5):
        r = req(f"r{i}", 0, priority=i, user=f"tenant{i}")
        r.arrival_time = time.monotonic()
        counters.first_admission(r)
    stats = counters.snapshot()
    for series in (stats["queue_time_by_tenant_s"], stats["queue_time_by_priority_s"]):
        assert len(series) == MAX_LABEL_VALUES + 1 and series[OTHER_LABEL].count == 5


def test_junk_label_values_hold_no_slot_for_good():
    """Issue 45: a burst of junk `user`s takes the free slots, shown printable and short; an API
    key takes a slot at once, tenants with sustained traffic soon after, and the junk is gone."""
    slots, key = LabelSlots(), api_key_tenant({"x-api-key": "sk-secret"})
    assert key is not None
    for junk in ["\u0000", "\u202e\u200b\ufeff", "x" * 300, *(f"\u202ejunk{i}" for i in range(20))]:
        slots.observe(junk, 0.5)
    labels = slots.snapshot()
    assert len(labels) == MAX_LABEL_VALUES + 1 and labels[OTHER_LABEL].count == 2 + 5
    assert "x" * MAX_LABEL_CHARS in labels and "junk0" in labels
    assert all(label.isprintable() and len(label) <= MAX_LABEL_CHARS for label in labels)
    slots.observe(key, 0.5)
    assert key in slots.snapshot()
    for _ in range(3):
        slots.observe("alice", 0.5)
        slots.observe("bob", 0.5)
    for _ in range(300):  # the junk is idle; every sustained tenant keeps its slot
        slots.observe("alice", 0.5)
    assert {key, "alice", "bob"} <= slots.snapshot().keys()
    assert len(slots.snapshot()) <= MAX_LABEL_VALUES + 1


def test_api_key_tenant_hides_the_key():
    tenant = api_key_tenant({"authorization": "Bearer sk-secret"})
    assert tenant is not None and tenant.startswith("key-") and "secret" not in tenant
    assert api_key_tenant({"x-api-key": "sk-secret"}) == tenant
    assert api_key_tenant({}) is None


# ---- the server: one, with every policy on --------------------------------------------------

API_KEY = "sk-policy-test"
LONG_TOKENS = 64
LOAD_WAIT_S = 30.0


def test_server_priority_and_tenants():
    require_default_model()
    flags = ("--max-running-requests", "1", "--enable-priority-scheduling", "--tenant-fairness")
    with running_server(*flags, api_key=API_KEY) as srv:
        headers = srv.headers
        chat = srv.url + "/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        for bad in ("high", 1.5, True):
            reply = httpx.post(chat, json={**body, "priority": bad}, headers=headers)
            assert reply.status_code == 400 and "priority" in reply.text, reply.text
        reply = httpx.post(
            srv.url + "/generate", headers=headers, json={"text": "Hi", "priority": "x"}
        )
        assert reply.status_code == 400
        assert httpx.post(chat, json={**body, "user": "alice"}, headers=headers).is_success
        anthropic = {**body, "metadata": {"user_id": "bob"}}
        assert httpx.post(srv.url + "/v1/messages", json=anthropic, headers=headers).is_success

        # One long request holds the only row (a priority nothing here preempts); two of
        # priority 3 and one of 0 wait behind it.
        long_body = {**body, "max_tokens": LONG_TOKENS, "ignore_eos": True, "priority": 9}
        threads = [
            threading.Thread(
                target=httpx.post,
                args=(chat,),
                kwargs={"json": long_body, "headers": headers, "timeout": 120},
            )
        ]
        threads += [
            threading.Thread(
                target=httpx.post,
                args=(chat,),
                kwargs={"json": {**body, "priority": p}, "headers": headers, "timeout": 120},
            )
            for p in (3, 3, 0)
        ]

        def load_when(ready) -> dict:
            deadline_s = time.monotonic() + LOAD_WAIT_S
            while not ready(load := httpx.get(srv.url + "/get_load", headers=headers).json()[0]):
                assert time.monotonic() < deadline_s, load
                time.sleep(0.05)
            return load

        threads[0].start()
        load_when(lambda load: load["num_reqs"] == 1)  # the long one runs
        for t in threads[1:]:
            t.start()
        load = load_when(lambda load: load["num_waiting_reqs"] == 3)
        assert load["num_waiting_reqs_by_priority"] == {"3": 2, "0": 1}, load
        for t in threads:
            t.join()
        for junk in ("\u0000", "\u202e\u200b\ufeff"):  # label values /metrics cannot show
            assert httpx.post(chat, json={**body, "user": junk}, headers=headers).is_success
        text = httpx.get(srv.url + "/metrics").text
        tenants = {
            sample.labels["tenant"]
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if "tenant" in sample.labels
        }
        assert OTHER_LABEL in tenants and all(t.isprintable() for t in tenants), tenants
        metrics = srv.metrics()
        key_tenant = api_key_tenant({"authorization": f"Bearer {API_KEY}"})
        for label in ('tenant="alice"', 'tenant="bob"', f'tenant="{key_tenant}"'):
            assert f"minisgl:queue_time_by_tenant_seconds_count{{{label}}}" in metrics, label
        by_priority = 'minisgl:queue_time_by_priority_seconds_count{priority="3"}'
        assert metrics[by_priority] == 2
