"""The CUDA-graph decode path minus the capture: padded batches must not change any token.

On CPU `cuda_graph_max_bs > 0` runs decode-only steps through `GraphRunner` eagerly: the batch
is padded to the next graph size with entries pointing at the dummy table row and page. Same
code as on CUDA, where the padded forward is what gets captured and replayed.
"""

from __future__ import annotations

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.engine.graph import GraphRunner, graph_batch_sizes

NEW_TOKENS = 10


def test_graph_batch_sizes_cover_every_batch():
    for max_bs in (1, 3, 8, 20, 64, 100, 160, 256):
        sizes = graph_batch_sizes(max_bs)
        assert sizes == sorted(set(sizes)) and sizes[-1] == max_bs and sizes[0] == 1
        for bs in range(1, max_bs + 1):
            padded = min(s for s in sizes if s >= bs)
            assert padded <= max(bs + 4, bs * 3 // 2), (bs, padded)  # bounded waste


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 5000, (n,), generator=g).tolist() for n in (5, 9, 23, 40, 3, 17, 60)]


def _generate(model_dir, **options) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=NEW_TOKENS)
    with LLM(str(model_dir), dtype="float32", num_pages=1024, **options) as llm:
        prompts = _prompts()
        outs = llm.generate(prompts, [params] * (len(prompts) - 1) + [seeded])
        llm.check_page_accounting()
        return [o.token_ids for o in outs]


@pytest.mark.parametrize("page_size", [1, 4])
def test_padded_decode_matches_unpadded(tiny_qwen3, monkeypatch, page_size):
    padded_runs: list[tuple[int, int]] = []  # (real, padded) batch sizes
    original = GraphRunner.run

    def spy(self, batch):
        padded_runs.append((batch.num_seqs, self.padded_size(batch.num_seqs)))
        return original(self, batch)

    monkeypatch.setattr(GraphRunner, "run", spy)
    expected = _generate(tiny_qwen3, page_size=page_size, cuda_graph_max_bs=0)
    assert not padded_runs
    got = _generate(tiny_qwen3, page_size=page_size, cuda_graph_max_bs=8)
    assert got == expected
    # 7 requests decode together with a graph size of 8: one padding entry each step.
    assert any(padded > real for real, padded in padded_runs), padded_runs
    assert all(padded <= 8 for _, padded in padded_runs)


def test_flashinfer_page_lists_follow_the_page_table():
    """The page ids FlashInfer gets are the pages of each row's positions, in order (CPU check
    of the index arithmetic; the kernels themselves run in tests/test_cuda.py)."""
    from minisgl.attention.base import AttentionBatch
    from minisgl.attention.flashinfer_backend import paged_kv_lists

    page_size, width = 4, 64
    page_table = torch.zeros(5, width, dtype=torch.int32)
    pages_of_row = {0: [7, 2, 9], 3: [1], 4: [5, 11, 0, 3]}
    for row, pages in pages_of_row.items():
        slots = [p * page_size + o for p in pages for o in range(page_size)]
        page_table[row, : len(slots)] = torch.tensor(slots, dtype=torch.int32)
    kv_lens = [9, 4, 13]  # rows 0, 3, 4: 3, 1 and 4 pages; last pages hold 1, 4 and 1 tokens
    batch = AttentionBatch(
        table_rows=torch.tensor([0, 3, 4]),
        prefix_lens=torch.tensor([8, 3, 12]),
        kv_lens=torch.tensor(kv_lens),
        out_slots=torch.zeros(3, dtype=torch.int64),
        page_table=page_table,
        prefix_lens_cpu=[8, 3, 12],
        kv_lens_cpu=kv_lens,
    )
    indptr, page_ids, last, seq_lens = paged_kv_lists(batch, page_size)
    assert indptr.tolist() == [0, 3, 4, 8]
    assert page_ids.tolist() == [7, 2, 9, 1, 5, 11, 0, 3]
    assert last.tolist() == [1, 4, 1]
    # what plan() would recompute from indptr and last: (pages - 1) * page_size + last
    assert seq_lens.tolist() == kv_lens and seq_lens.dtype == torch.int32


def test_host_tensor_is_torch_tensor_faster():
    """The host's index and parameter tensors (array.array + frombuffer) hold what
    torch.tensor would: same values and dtype, empty lists, and the types torch converts."""
    import numpy as np

    from minisgl.attention.base import host_tensor

    cases = [
        ([3, -1, 2**40], torch.int64),
        ([7, 0], torch.int32),
        ([0.5, 1e-3, 2.0], torch.float32),
        ([1, 2.5], torch.float32),  # ints among floats
        ([], torch.int64),
        (range(5), torch.int64),
        ([np.int64(4), np.int64(9)], torch.int64),  # numpy scalars: through torch
        ([1.0, 2.0], torch.int64),  # floats as int64: torch truncates, as before
    ]
    for values, dtype in cases:
        got = host_tensor(values, dtype)
        want = torch.tensor(list(values), dtype=dtype)
        assert got.dtype == dtype and torch.equal(got, want), (values, dtype)
    staged = torch.arange(3)
    assert host_tensor(staged, torch.int32).dtype == torch.int32  # a tensor: converted as is
