"""Decode-only paged attention that reads whole K/V tiles of a page through the tensor memory accelerator.

The pointer kernel (attention/triton_paged.py) gathers every key of a tile through the block table: BLOCK_N
page lookups and BLOCK_N x HEAD_DIM addresses a tile, in registers. When a tile lies inside one page (the
page holds a multiple of BLOCK_N tokens: the hybrid's 128-token pages), a tile is one rectangle of the cache
viewed as [num_blocks * page_size, kv_heads * head_dim]: one page lookup and one TMA copy for K and one for
V (Hopper and later; host-side descriptors, so a CUDA graph captures them with the cache's address).

Same work split, split-KV ranges, partial outputs and merge as the pointer kernel's decode-only path
(triton_paged._keys_per_split is the rule both and the merge share). A tile past a sequence's last key reads
the page's other slots, whatever they hold: their scores are masked to -inf and their values zeroed, so
neither garbage nor NaN reaches the output.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention.triton_split import keys_per_split, online_softmax, store_partial


def tma_decode_fits(head_dim: int, page_size: int, block_n: int) -> bool:
    """A power-of-two head dim (one TMA box, no padding) and tiles that never straddle a page."""
    return head_dim & (head_dim - 1) == 0 and page_size % block_n == 0


def tma_decode_available(query: torch.Tensor, page_size: int, block_n: int) -> bool:
    """Where the choice is ours: it fits, on Hopper or later, with 16-bit K/V."""
    if not query.is_cuda or query.dtype not in (torch.bfloat16, torch.float16):
        return False
    return tma_decode_fits(query.shape[-1], page_size, block_n) and (
        torch.cuda.get_device_capability(query.device)[0] >= 9)


def _descriptor(cache: torch.Tensor, block_n: int):
    from triton.tools.tensor_descriptor import TensorDescriptor

    num_blocks, page_size, kv_heads, head_dim = cache.shape
    flat = cache.view(num_blocks * page_size, kv_heads * head_dim)
    return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [block_n, head_dim])


@triton.jit
def _tma_tile(q, acc, m_i, l_i, k_desc, v_desc, bt_row, start, kv_hi, col, qk_scale,
              BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr):
    """One tile of keys, inside one page, through the online softmax (scores in the log2 domain)."""
    page = tl.load(bt_row + start // PAGE_SIZE)
    row0 = page * PAGE_SIZE + start % PAGE_SIZE
    k = k_desc.load([row0, col])  # [BLOCK_N, HEAD_DIM]
    s = tl.dot(q, tl.trans(k)) * qk_scale  # [BLOCK_M, BLOCK_N]
    if MASKED:
        n_ok = start + tl.arange(0, BLOCK_N) < kv_hi
        s = tl.where(n_ok[None, :], s, float("-inf"))
    p, alpha, m_new, l_i = online_softmax(s, m_i, l_i)
    v = v_desc.load([row0, col])  # [BLOCK_N, HEAD_DIM]
    if MASKED:
        v = tl.where(n_ok[:, None], v, 0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["stride_bt"])
def _decode_tma_kernel(out_ptr, part_out_ptr, part_lse_ptr, q_ptr, k_desc, v_desc, block_tables_ptr, seq_lens_ptr,
                       qk_scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                       NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
                       SPLIT_KEYS: tl.constexpr, NUM_STAGES: tl.constexpr):
    seq = tl.program_id(0)  # program i is sequence i: one query token each
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    per_split = keys_per_split(seq_len, NUM_SPLITS, SPLIT_KEYS, BLOCK_N)
    kv_lo = split * per_split
    kv_hi = tl.minimum(seq_len, kv_lo + per_split)
    if split > 0 and kv_lo >= seq_len:  # past this sequence's last range
        return
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP
    head = kv_head * GROUP + rows
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + seq * stride_qt + head[:, None] * stride_qh + offs_d[None, :], mask=row_ok[:, None],
                other=0.0)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: a fully masked row gives 0, never NaN
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    col = kv_head * HEAD_DIM
    full_end = kv_lo + tl.maximum(kv_hi - kv_lo, 0) // BLOCK_N * BLOCK_N
    for start in tl.range(kv_lo, full_end, BLOCK_N, num_stages=NUM_STAGES):
        m_i, l_i, acc = _tma_tile(q, acc, m_i, l_i, k_desc, v_desc, bt_row, start, kv_hi, col, qk_scale,
                                  BLOCK_N, PAGE_SIZE, False)
    if full_end < kv_hi:
        m_i, l_i, acc = _tma_tile(q, acc, m_i, l_i, k_desc, v_desc, bt_row, full_end, kv_hi, col, qk_scale,
                                  BLOCK_N, PAGE_SIZE, True)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1 or seq_len <= per_split:  # one range holds the whole sequence: the answer, no merge
        tl.store(out_ptr + seq * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        part = (seq.to(tl.int64) * NUM_HEADS + head) * NUM_SPLITS + split
        store_partial(part_out_ptr, part_lse_ptr, part, out, m_i, l_i, row_ok, offs_d, HEAD_DIM)


def decode_tma(out: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor, query: torch.Tensor,
               key_cache: torch.Tensor, value_cache: torch.Tensor, meta, qk_scale: float, num_splits: int,
               split_keys: int, tiles: tuple[int, int, int, int]) -> None:
    """Fills `out` (or the partials, for triton_paged's merge) for a decode-only batch; shapes as there."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    _, page_size, num_kv_heads, _ = key_cache.shape
    block_m, block_n, num_warps, num_stages = tiles
    _decode_tma_kernel[(meta.num_seqs, num_kv_heads, num_splits)](
        out, part_out, part_lse, query, _descriptor(key_cache, block_n), _descriptor(value_cache, block_n),
        meta.block_tables, meta.seq_lens, qk_scale, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        meta.block_tables.stride(0), NUM_HEADS=num_heads, GROUP=num_heads // num_kv_heads, BLOCK_M=block_m,
        BLOCK_N=block_n, HEAD_DIM=head_dim, PAGE_SIZE=page_size, NUM_SPLITS=num_splits, SPLIT_KEYS=split_keys,
        NUM_STAGES=num_stages, num_warps=num_warps)
