"""Split-KV (flash-decoding) rules that the attention kernels and their merge share, and the online softmax's
update that both kernels' tiles run.

A range's length is a rule, not a tensor: the kernels that write partials (triton_paged's, and
triton_decode_tma's) and the merge that reads them each recompute it from the sequence's length.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def keys_per_split(seq_len, NUM_SPLITS: tl.constexpr, MIN_KEYS: tl.constexpr, BLOCK_N: tl.constexpr):
    # Whole BLOCK_N tiles, at least MIN_KEYS; the kernels and the merge must agree on it.
    return tl.maximum(tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N, MIN_KEYS)


@triton.jit
def store_partial(part_out_ptr, part_lse_ptr, part, out, m_i, l_i, row_ok, offs_d, HEAD_DIM_P: tl.constexpr):
    # A range's normalized output and its log-sum-exp (log2 domain), for the merge.
    tl.store(part_out_ptr + part[:, None] * HEAD_DIM_P + offs_d[None, :], out, mask=row_ok[:, None])
    lse = tl.where(l_i > 0, m_i + tl.log2(l_i), float("-inf"))
    tl.store(part_lse_ptr + part, lse, mask=row_ok)


@triton.jit
def online_softmax(s, m_i, l_i):
    # One tile's scores [BLOCK_M, BLOCK_N] (log2 domain) into the running max and sum: the tile's weights p,
    # the factor alpha that rescales what was summed before, and the new max and sum.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)
