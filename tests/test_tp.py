"""Tensor parallelism on CPU (gloo): tp=2 matches tp=1, failures are loud and bounded.

Every tp=2 `LLM` here spawns a follower process; each test shuts it down and checks that no
process is left behind. Waits are bounded: a broken tp group must raise, never hang.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from minisgl.core import SamplingParams
from minisgl.distributed import free_loopback_addr, get_tp_info
from minisgl.llm import LLM
from tests.conftest import build_tiny_checkpoint

# A dead follower must surface well within the collective timeout (60 s).
DEATH_DETECTION_LIMIT_S = 60.0
SUBPROCESS_TIMEOUT_S = 120.0
OPTIONS = dict(max_prefill_tokens=16, num_pages=2048, max_running_requests=16)

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PREFIX = list(range(1000, 1030))
PROMPTS: list[list[int]] = [
    list(range(200, 205)),  # shorter than a chunk
    list(range(300, 323)),  # two chunks
    list(range(400, 441)),  # three chunks
    PREFIX + [7, 8, 9],  # these two share a 30-token prefix
    PREFIX + [11, 12],
]
# Per-prompt params: seeded sampling and logprobs go through the rank-0 broadcast too.
PARAMS = [
    GREEDY,
    GREEDY,
    GREEDY,
    SamplingParams(max_tokens=10, temperature=0.8, seed=7),
    SamplingParams(max_tokens=10, temperature=0.0, logprobs=3),
]


@pytest.fixture(scope="module")
def kv1_model(tmp_path_factory) -> Path:
    """4 query heads, 1 KV head: with tp=2 both ranks hold a replica of the KV head."""
    root = tmp_path_factory.mktemp("tp_models")
    return build_tiny_checkpoint(root / "qwen3_kv1", "qwen3", num_key_value_heads=1)


def _run(llm: LLM) -> list:
    return llm.generate(PROMPTS, PARAMS)


def _assert_same(outputs: list, reference: list) -> None:
    for out, ref in zip(outputs, reference, strict=True):
        assert out.token_ids == ref.token_ids
        assert out.finish_reason == ref.finish_reason
        for lp, ref_lp in zip(out.logprobs, ref.logprobs, strict=True):
            assert lp.token_id == ref_lp.token_id
            assert lp.logprob == pytest.approx(ref_lp.logprob, abs=1e-3)
            assert [t for t, _ in lp.top] == [t for t, _ in ref_lp.top]


def _assert_gone(pids: list[int]) -> None:
    assert pids, "expected follower processes"
    for pid in pids:
        alive = psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        assert not alive, f"follower {pid} still running after shutdown"
    assert get_tp_info().size == 1  # the process may build another group afterwards


def _reference(model: Path, **options) -> list:
    with LLM(str(model), **OPTIONS, **options) as llm:
        return _run(llm)


def _follower_pids(llm: LLM) -> list[int]:
    """This node's follower processes (the tests kill one, or check that none is left)."""
    assert llm.scheduler.tp is not None
    return [c.process.pid for c in llm.scheduler.tp.followers.members if c.process.pid]


@pytest.mark.parametrize(("arch", "page_size"), [("qwen3", 1), ("llama", 4)])
def test_tp2_matches_tp1(tiny_models, arch: str, page_size: int) -> None:
    model = tiny_models[arch]
    reference = _reference(model, page_size=page_size)
    llm = LLM(str(model), tp_size=2, page_size=page_size, **OPTIONS)
    pids = _follower_pids(llm)
    try:
        # The fused CPU decode step is for one rank only (no all-reduce inside): op by op here.
        assert llm.scheduler.engine.model.cpu_decode_stack is None  # type: ignore[attr-defined]
        _assert_same(_run(llm), reference)
        again = _run(llm)  # the radix cache now serves every prompt's prefix
        _assert_same(again, reference)
        assert all(out.num_cached_tokens > 0 for out in again)
        llm.check_page_accounting()

        # An abort between steps reaches every rank: the groups stay in lockstep after it.
        scheduler = llm.scheduler
        from minisgl.core import Req

        reqs = [Req(f"abort-{i}", p, GREEDY) for i, p in enumerate(PROMPTS[:2])]
        for req in reqs:
            scheduler.add_request(req)
        scheduler.step()
        scheduler.abort_request(reqs[0].rid)
        finished = set()
        while scheduler.has_work():
            finished |= {o.rid for o in scheduler.step() if o.finish_reason is not None}
        assert finished == {r.rid for r in reqs}
        llm.check_page_accounting()

        scheduler.flush_cache()
        stats = scheduler.stats()
        assert stats.num_free_pages == stats.num_total_pages
        _assert_same(_run(llm), reference)
    finally:
        llm.shutdown()
    _assert_gone(pids)


def test_tp2_with_one_kv_head(kv1_model: Path) -> None:
    """tp 2 with a replicated KV head: outputs and embeddings (pooled across chunks) as tp 1's."""
    with LLM(str(kv1_model), **OPTIONS) as llm:
        reference, vectors = _run(llm), torch.tensor(llm.embed(PROMPTS))
    with LLM(str(kv1_model), tp_size=2, **OPTIONS) as llm:
        pids = _follower_pids(llm)
        attn: Any = llm.scheduler.engine.model.model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
        _assert_same(_run(llm), reference)
        assert torch.allclose(torch.tensor(llm.embed(PROMPTS)), vectors, atol=1e-5)
        llm.check_page_accounting()
    _assert_gone(pids)


def test_heads_not_divisible_is_a_clear_error(tiny_qwen3: Path) -> None:
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\).*tp size \(3\)"):
        LLM(str(tiny_qwen3), tp_size=3, **OPTIONS)
    assert get_tp_info().size == 1
    with LLM(str(tiny_qwen3), **OPTIONS) as llm:  # nothing stale is left behind
        assert llm.generate([PROMPTS[0]], GREEDY)[0].token_ids


def test_killed_follower_raises_within_seconds(tiny_qwen3: Path) -> None:
    llm = LLM(str(tiny_qwen3), tp_size=2, **OPTIONS)
    pids = _follower_pids(llm)
    try:
        llm.generate([PROMPTS[0]], GREEDY)
        long_run = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        killer = threading.Timer(1.0, os.kill, (pids[0], signal.SIGKILL))
        killer.start()
        start_s = time.monotonic()
        with pytest.raises(RuntimeError, match="tp rank 1"):
            llm.generate([PROMPTS[2]] * 4, long_run)  # killed mid-generation
        assert time.monotonic() - start_s < DEATH_DETECTION_LIMIT_S
        killer.join()
        with pytest.raises(RuntimeError, match="broken"):  # and stays failed, at once
            llm.generate([PROMPTS[0]], GREEDY)
    finally:
        start_s = time.monotonic()
        llm.shutdown()
        assert time.monotonic() - start_s < DEATH_DETECTION_LIMIT_S
    _assert_gone(pids)


def test_follower_startup_failure_is_reported(tmp_path: Path, tiny_qwen3: Path) -> None:
    """A script without a __main__ guard: the spawned rank dies while bootstrapping."""
    script = tmp_path / "unguarded.py"
    script.write_text(
        textwrap.dedent(f"""
            from minisgl.llm import LLM
            LLM({str(tiny_qwen3)!r}, tp_size=2, num_pages=64)
        """)
    )
    start_s = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S
    )
    assert proc.returncode != 0
    assert "TPRankError" in proc.stderr and "__main__" in proc.stderr
    assert time.monotonic() - start_s < DEATH_DETECTION_LIMIT_S  # not the rendezvous timeout


def test_two_nodes_on_loopback(tiny_qwen3: Path) -> None:
    reference = _reference(tiny_qwen3)
    addr = free_loopback_addr()
    # Node 1 gets only the group flags: scheduling options come from rank 0.
    node1 = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "minisgl.scheduler.tp",
            "--model",
            str(tiny_qwen3),
            "--tp",
            "2",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--dist-init-addr",
            addr,
        ],
    )
    try:
        llm = LLM(str(tiny_qwen3), tp_size=2, nnodes=2, node_rank=0, dist_init_addr=addr, **OPTIONS)
        with llm:
            assert _follower_pids(llm) == []
            _assert_same(_run(llm), reference)
            llm.check_page_accounting()
        assert node1.wait(timeout=SUBPROCESS_TIMEOUT_S) == 0
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait(timeout=SUBPROCESS_TIMEOUT_S)
    assert get_tp_info().size == 1
