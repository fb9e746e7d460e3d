"""Triton attention kernels over the paged KV pool: split-KV decode and extend (prefill); device
code only (`triton_backend` sizes the tiles and launches them).

K/V tiles are gathers through the page table (`page_table[row, pos]` is a token slot), so page
size never changes the kernels. Softmax runs in base 2 (scores scaled by `scale * log2(e)`, every
log-sum-exp in log2 units), accumulation in fp32, fp32 inputs with IEEE dots. With
TRITON_INTERPRET=1 set before import they run on CPU tensors: how CI checks them."""

import triton
import triton.language as tl

# True when these kernels were decorated in Triton's interpreter (TRITON_INTERPRET=1).
INTERPRETER: bool = bool(triton.knobs.runtime.interpret)

# The interpreter multiplies bf16 tiles as raw integers (numpy has no bf16): it gets them upcast.
UPCAST_BF16_DOTS: tl.constexpr = tl.constexpr(INTERPRETER)


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr):
    if UPCAST_BF16_DOTS and a.dtype == tl.bfloat16:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b, input_precision=DOT_PRECISION)
    return out


@triton.jit
def _attend_range(
    q,  # [ROWS, BLOCK_D]
    q_pos,  # int32 [ROWS]: each row sees keys at positions <= q_pos
    k_head_ptr,  # K cache offset to this KV head: slot s is at k_head_ptr + s * stride_kv_slot
    v_head_ptr,
    pt_row_ptr,  # this sequence's page-table row
    start,
    end,
    qk_scale,
    stride_kv_slot,  # K and V caches share their layout
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Online softmax over the keys at positions [start, end) for the queries q [rows,
    BLOCK_D]: (running max, running sum, unnormalized output), all fp32. Triton
    software-pipelines the loop over BLOCK_N keys a step (num_stages)."""
    m_i = tl.full([q.shape[0]], float("-inf"), tl.float32)
    l_i = tl.zeros([q.shape[0]], tl.float32)
    acc = tl.zeros(q.shape, tl.float32)
    offs_d = tl.arange(0, q.shape[1])
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        n_mask = pos < end
        slots = tl.load(pt_row_ptr + pos, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
        k = tl.load(
            k_head_ptr + slots[:, None] * stride_kv_slot + offs_d[None, :], mask=kv_mask, other=0.0
        ).to(q.dtype)  # an fp8 pool's codes: their scale is in qk_scale (K) and the output's (V)
        s = _dot(q, tl.trans(k), DOT_PRECISION) * qk_scale  # [ROWS, BLOCK_N]
        visible = (pos[None, :] <= q_pos[:, None]) & n_mask[None, :]
        s = tl.where(visible, s, float("-inf"))
        # Callers guarantee each row sees a key in its first tile, so m_new is finite from then on.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_head_ptr + slots[:, None] * stride_kv_slot + offs_d[None, :], mask=kv_mask, other=0.0
        ).to(q.dtype)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


# num_splits changes with the batch size: one compiled variant for all its values.
@triton.jit(do_not_specialize=["num_splits"])
def decode_split_kernel(
    q_ptr,  # [seqs, heads, head_dim]: one query per sequence
    k_ptr,  # [slots, kv_heads, head_dim]
    v_ptr,
    page_table_ptr,  # int32 [rows, max_len]: token slots
    table_rows_ptr,  # [seqs]
    kv_lens_ptr,  # [seqs]
    part_out_ptr,  # fp32 [>= seqs, heads, max_splits, head_dim]: per-split normalized output
    part_lse_ptr,  # fp32 [>= seqs, heads, max_splits]: per-split log2-sum-exp2 (-inf: empty)
    qk_scale,
    num_splits,
    stride_q_tok,
    stride_q_head,
    stride_kv_slot,
    stride_kv_head,
    stride_pt_row,
    stride_po_seq,
    stride_po_head,
    stride_po_split,
    stride_pl_seq,
    stride_pl_head,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(table_rows_ptr + seq).to(tl.int64)
    kv_len = tl.load(kv_lens_ptr + seq).to(tl.int32)
    # Splits are whole BLOCK_N tiles, so only a split's last tile is partial; trailing splits of
    # a short sequence are empty (start >= end) and report lse = -inf.
    split_len = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, kv_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_h
    # The whole head group shares each K/V tile: [BLOCK_H, BLOCK_D] queries.
    q = tl.load(
        q_ptr + seq * stride_q_tok + heads[:, None] * stride_q_head + offs_d[None, :],
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    # Decode queries sit at position kv_len - 1: every key of the sequence is visible.
    q_pos = tl.full([BLOCK_H], 0, tl.int32) + kv_len - 1
    m_i, l_i, acc = _attend_range(
        q,
        q_pos,
        k_ptr + kv_head * stride_kv_head,
        v_ptr + kv_head * stride_kv_head,
        page_table_ptr + row * stride_pt_row,
        start,
        end,
        qk_scale,
        stride_kv_slot,
        HEAD_DIM=HEAD_DIM,
        BLOCK_N=BLOCK_N,
        DOT_PRECISION=DOT_PRECISION,
    )

    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    out_offs = seq * stride_po_seq + heads[:, None] * stride_po_head + split * stride_po_split
    tl.store(
        part_out_ptr + out_offs + offs_d[None, :],
        acc / l_safe[:, None],
        mask=h_mask[:, None] & d_mask[None, :],
    )
    lse = tl.where(has_keys, m_i + tl.log2(l_safe), float("-inf"))
    tl.store(part_lse_ptr + seq * stride_pl_seq + heads * stride_pl_head + split, lse, mask=h_mask)


@triton.jit(do_not_specialize=["num_splits"])
def decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    o_ptr,  # [seqs, heads, head_dim]
    num_splits,
    stride_po_seq,
    stride_po_head,
    stride_po_split,
    stride_pl_seq,
    stride_pl_head,
    stride_o_tok,
    stride_o_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, MAX_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(
        part_lse_ptr + seq * stride_pl_seq + head * stride_pl_head + offs_s,
        mask=s_mask,
        other=float("-inf"),
    )
    m = tl.max(lse, 0)
    # Split j holds softmax(scores of its keys) @ V; weighting it by 2^(lse_j - m) / sum
    # rescales every split to the softmax over all keys.
    w = tl.where(lse > float("-inf"), tl.exp2(lse - m), 0.0)
    part = tl.load(
        part_out_ptr
        + seq * stride_po_seq
        + head * stride_po_head
        + offs_s[:, None] * stride_po_split
        + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * part, 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        o_ptr + seq * stride_o_tok + head * stride_o_head + offs_d,
        out.to(o_ptr.dtype.element_ty),
        mask=d_mask,
    )


@triton.jit
def extend_kernel(
    q_ptr,  # [tokens, heads, head_dim]: queries of all sequences, back to back
    k_ptr,
    v_ptr,
    o_ptr,  # [tokens, heads, head_dim]
    page_table_ptr,
    table_rows_ptr,  # [seqs]
    prefix_lens_ptr,  # [seqs]
    kv_lens_ptr,  # [seqs]
    seq_q_start_ptr,  # int32 [seqs]: first query token of each sequence
    block_seq_ptr,  # int32 [blocks]: the sequence of each query block
    block_q_start_ptr,  # int32 [blocks]: its first query, counted within the sequence
    qk_scale,
    stride_q_tok,
    stride_q_head,
    stride_kv_slot,
    stride_kv_head,
    stride_o_tok,
    stride_o_head,
    stride_pt_row,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    seq = tl.load(block_seq_ptr + block)
    q_start = tl.load(block_q_start_ptr + block)
    token_start = tl.load(seq_q_start_ptr + seq)
    row = tl.load(table_rows_ptr + seq).to(tl.int64)
    prefix_len = tl.load(prefix_lens_ptr + seq).to(tl.int32)
    kv_len = tl.load(kv_lens_ptr + seq).to(tl.int32)

    offs_m = q_start + tl.arange(0, BLOCK_M)  # query index within the sequence
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < kv_len - prefix_len
    d_mask = offs_d < HEAD_DIM
    q_pos = prefix_len + offs_m  # absolute position: attends to keys [0, q_pos]
    q = tl.load(
        q_ptr
        + (token_start + offs_m)[:, None] * stride_q_tok
        + head * stride_q_head
        + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    # Causal: no query of this block sees past its last query's position.
    end = tl.minimum(kv_len, prefix_len + q_start + BLOCK_M)
    m_i, l_i, acc = _attend_range(
        q,
        q_pos,
        k_ptr + kv_head * stride_kv_head,
        v_ptr + kv_head * stride_kv_head,
        page_table_ptr + row * stride_pt_row,
        0,
        end,
        qk_scale,
        stride_kv_slot,
        HEAD_DIM=HEAD_DIM,
        BLOCK_N=BLOCK_N,
        DOT_PRECISION=DOT_PRECISION,
    )
    # Position 0 is visible to every row (q_pos >= 0), padded rows included: l_i > 0.
    out = acc / l_i[:, None]
    tl.store(
        o_ptr
        + (token_start + offs_m)[:, None] * stride_o_tok
        + head * stride_o_head
        + offs_d[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )
