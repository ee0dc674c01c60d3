"""Our own Triton paged attention: one launch for a mixed batch of prefill chunks and decodes.

Work split. A program owns BLOCK_Q query tokens of ONE sequence times the GROUP query heads of one
kv head (GQA packing: its BLOCK_M = BLOCK_Q * GROUP rows share every K/V tile it loads), and walks
the sequence's keys in BLOCK_N tiles, gathering each key's page through the block table, with an
online softmax in float32. Query blocks are numbered per sequence without host help: sequence i's
first block is query_start_loc[i] // BLOCK_Q + i, so num_tokens // BLOCK_Q + num_seqs programs cover
any batch (a few find no tokens and exit) and each finds its sequence by binary search.

Split-KV (flash-decoding): a third grid axis splits each sequence's keys into up to NUM_SPLITS ranges;
each writes a normalized partial output and its log-sum-exp, and a second kernel merges them.
- Decode-only batches (DECODE_ONLY: program i is sequence i, no search) split by length: a sequence gets
  one range per DECODE_SPLIT_KEYS_* keys (at most NUM_SPLITS, from the block table's width), so a batch
  of mixed lengths has no program walking 2k keys while the rest of the GPU idles; programs past a
  sequence's last range exit at once and the merge reads only the ranges its sequence used.
- Batches with prefills split only when the grid is too small to fill the GPU (few sequences, long keys),
  evenly, and every range writes (the merge cannot tell a block's key count).

Nothing is read on the host: grids depend only on tensor shapes and on meta.num_prefills (0 for the
decode-only batches a decode graph replays, the sequence count for a mixed graph's), so the backend is
CUDA-graph safe for both kinds of step. A sequence with no query tokens (a mixed graph's padding) owns
one program, which exits at once.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from attention.base import AttentionBackend, AttentionImpl, AttentionMetadata, GraphSupport
from attention.triton_decode_tma import decode_tma, tma_decode_available, tma_decode_fits
from attention.triton_split import keys_per_split, online_softmax, store_partial

_LOG2E = 1.4426950408889634
_MIN_KEYS_PER_SPLIT = 256  # below this a split's fixed cost outweighs the parallelism it adds
_MAX_SPLITS = 32
# Keys per range in decode-only batches, measured on the H200 (docs/benchmarks.md, attention kernels): when
# the batch alone fills half the GPU or more, ranges only even out the lengths, and long ones cost the fewest
# partials (longer still over 128-token pages); when it does not, short ones add the parallelism
# (_decode_split_keys).
DECODE_SPLIT_KEYS_FULL = 1024
DECODE_SPLIT_KEYS_FULL_LARGE_PAGES = 2048
DECODE_SPLIT_KEYS_SPARSE = 256
# Decode-only batches' kernel where the choice is ours: "pointer" (_paged_attention_kernel) or "tma"
# (attention/triton_decode_tma.py). On an H100 (docs/benchmarks.md, thirteenth session) the TMA kernel took
# 108.9 us a layer against 110.1 on W-L's decode shape and W-L end to end 2.426 s against 2.423: no gain, so
# the pointer kernel stays until the H200 is measured.
DECODE_KERNEL = "pointer"


@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    # One program per token: its [kv_heads, head_dim] K and V row -> cache slot (nothing for PAD_SLOT_ID).
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    i = tl.arange(0, BLOCK)
    h = i // HEAD_DIM
    d = i % HEAD_DIM
    mask = (i < NUM_KV_HEADS * HEAD_DIM) & (slot >= 0)
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    dst = slot.to(tl.int64) * (NUM_KV_HEADS * HEAD_DIM) + i
    tl.store(key_cache_ptr + dst, k, mask=mask)
    tl.store(value_cache_ptr + dst, v, mask=mask)


def write_kv_triton(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """key/value [num_tokens, kv_heads, dim] (last dim contiguous) -> contiguous paged caches."""
    num_tokens, num_kv_heads, head_dim = key.shape
    assert key_cache.is_contiguous() and value_cache.is_contiguous()
    assert key.stride(-1) == 1 and value.stride(-1) == 1
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK=triton.next_power_of_2(num_kv_heads * head_dim))


@triton.jit
def _find_seq(query_start_loc_ptr, num_seqs, pid, BLOCK_Q: tl.constexpr):
    # The last sequence whose first query block (query_start_loc[i] // BLOCK_Q + i) is <= pid.
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        next_first_block = tl.load(query_start_loc_ptr + mid + 1) // BLOCK_Q + mid + 1
        if next_first_block <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo


@triton.jit
def _attend_tile(q, acc, m_i, l_i, k_base, v_base, bt_row, start, kv_hi, q_pos, qk_scale,
                 stride_kb, stride_ks, stride_vb, stride_vs, offs_d, d_ok, BLOCK_N: tl.constexpr,
                 PAGE_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr, MASKED: tl.constexpr):
    """One BLOCK_N tile of keys through the online softmax. MASKED: bound keys by kv_hi and each row's
    position; unmasked tiles (wholly visible to every row) skip both, and the block-table bound."""
    offs_n = start + tl.arange(0, BLOCK_N)
    if MASKED:
        n_ok = offs_n < kv_hi
    else:
        n_ok = tl.full([BLOCK_N], 1, tl.int1)
    page = tl.load(bt_row + offs_n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
    in_page = offs_n % PAGE_SIZE
    k = tl.load(k_base + (page * stride_kb + in_page * stride_ks)[None, :] + offs_d[:, None],
                mask=n_ok[None, :] & d_ok[:, None], other=0.0)  # [HEAD_DIM_P, BLOCK_N]
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N], log2 domain
    if MASKED:
        s = tl.where(n_ok[None, :] & (offs_n[None, :] <= q_pos[:, None]), s, float("-inf"))
    p, alpha, m_new, l_i = online_softmax(s, m_i, l_i)
    v = tl.load(v_base + (page * stride_vb + in_page * stride_vs)[:, None] + offs_d[None, :],
                mask=n_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, HEAD_DIM_P]
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


# num_seqs and stride_bt (an eager step's block-table width: its longest sequence's block count) are not
# specialized. Otherwise Triton compiles a new variant, mid-serving, the first time an eager step has 1
# sequence or a multiple of 16 of either (each compile costs ~0.3-1 s on the H200 with a cold cache).
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _paged_attention_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, num_seqs, qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt, NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, SPLIT_KEYS: tl.constexpr, DECODE_ONLY: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if DECODE_ONLY:  # one query token per sequence: program i is sequence i
        seq = pid
        q_start = pid
        q_len = 1
        q_block = 0
    else:
        seq = _find_seq(query_start_loc_ptr, num_seqs, pid, BLOCK_Q)
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        # The sequence's last (longest: it sees the most keys) query block first, so short ones fill the tail.
        q_block = tl.cdiv(q_len, BLOCK_Q) - 1 - (pid - (q_start // BLOCK_Q + seq))
    if q_block < 0:  # a spare program: its sequence has fewer blocks
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_block * BLOCK_Q + rows // GROUP  # query index within the sequence
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows // GROUP < BLOCK_Q) & (q_idx < q_len)
    q_pos = context_len + q_idx  # absolute position: sees keys 0 .. q_pos
    offs_d = tl.arange(0, HEAD_DIM_P)
    # A constant-true mask when the head dim is a power of two, so loads stay vectorized.
    d_ok = offs_d < HEAD_DIM if HEAD_DIM != HEAD_DIM_P else tl.full([HEAD_DIM_P], 1, tl.int1)
    q = tl.load(q_ptr + (q_start + q_idx)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, HEAD_DIM_P]

    if DECODE_ONLY:
        kv_end = seq_len
    else:  # past the block's last visible key
        kv_end = context_len + tl.minimum(q_len, (q_block + 1) * BLOCK_Q)
    if NUM_SPLITS == 1:
        kv_lo = 0
        kv_hi = kv_end
    else:
        per_split = keys_per_split(seq_len, NUM_SPLITS, SPLIT_KEYS, BLOCK_N)
        kv_lo = split * per_split
        kv_hi = tl.minimum(kv_end, kv_lo + per_split)
        if DECODE_ONLY and split > 0 and kv_lo >= kv_end:  # past this sequence's last range
            return

    # Finite start so a row that sees nothing in a tile gives exp2(-inf - m) = 0, never NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    # Tiles wholly before the block's first query position need no mask (every row sees every key):
    # most of a long prefill's tiles. Only the tiles from there on are masked (causal diagonal, the end).
    if DECODE_ONLY:
        unmasked_end = kv_hi
    else:
        unmasked_end = tl.minimum(kv_hi, context_len + q_block * BLOCK_Q)
    unmasked_end = kv_lo + tl.maximum(unmasked_end - kv_lo, 0) // BLOCK_N * BLOCK_N
    for start in range(kv_lo, unmasked_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(q, acc, m_i, l_i, k_base, v_base, bt_row, start, kv_hi, q_pos, qk_scale,
                                     stride_kb, stride_ks, stride_vb, stride_vs, offs_d, d_ok, BLOCK_N, PAGE_SIZE,
                                     DOT_PRECISION, False)
    for start in range(unmasked_end, kv_hi, BLOCK_N):
        m_i, l_i, acc = _attend_tile(q, acc, m_i, l_i, k_base, v_base, bt_row, start, kv_hi, q_pos, qk_scale,
                                     stride_kb, stride_ks, stride_vb, stride_vs, offs_d, d_ok, BLOCK_N, PAGE_SIZE,
                                     DOT_PRECISION, True)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    token = (q_start + q_idx).to(tl.int64)
    out_ptrs = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    part = (token * NUM_HEADS + head) * NUM_SPLITS + split  # [BLOCK_M] into [T, H, S]
    if NUM_SPLITS == 1:
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    elif DECODE_ONLY:
        if seq_len <= per_split:  # one range holds the whole sequence: the answer, no merge
            tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        else:
            store_partial(part_out_ptr, part_lse_ptr, part, out, m_i, l_i, row_ok, offs_d, HEAD_DIM_P)
    else:
        store_partial(part_out_ptr, part_lse_ptr, part, out, m_i, l_i, row_ok, offs_d, HEAD_DIM_P)


@triton.jit
def _merge_splits_kernel(out_ptr, part_out_ptr, part_lse_ptr, seq_lens_ptr, stride_ot, stride_oh,
                         NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLIT_KEYS: tl.constexpr,
                         BLOCK_N: tl.constexpr, DECODE_ONLY: tl.constexpr, HEAD_DIM: tl.constexpr,
                         HEAD_DIM_P: tl.constexpr):
    # One program per (token, head): weight each split's output by exp2(lse_split - max lse).
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    base = (t * NUM_HEADS + h) * NUM_SPLITS
    splits = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM_P)
    if DECODE_ONLY:  # token t is sequence t; only its ranges were written
        seq_len = tl.load(seq_lens_ptr + t)
        num_used = tl.cdiv(seq_len, keys_per_split(seq_len, NUM_SPLITS, SPLIT_KEYS, BLOCK_N))
        if num_used == 1:  # its one range wrote the output itself
            return
        used = splits < num_used
    else:
        used = splits < NUM_SPLITS
    # [S]; split 0 always holds key 0, so max is finite
    lse = tl.load(part_lse_ptr + base + splits, mask=used, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    parts = tl.load(part_out_ptr + (base + splits)[:, None] * HEAD_DIM_P + offs_d[None, :],
                    mask=used[:, None], other=0.0)  # [S, HEAD_DIM_P]
    out = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


def _tiles(head_dim_p: int, group: int, decode_only: bool, page_size: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): short row tiles for decodes, taller ones when prefills are in.
    Sized so that ptxas reports no spills on sm_90 (checked for head dims 64 and 128).
    Decodes read keys 128 at a time, 4 warps, over 128-token pages, and at head dim 128 over any page. On the
    H200, 64 sequences a layer (CUDA graph, benchmarks/attention_kernels.py, 2026-12-05) against 64 keys:
    head dim 64 at ~8k keys 82.7 against 98.5 us, ~32k 282 against 292 us (128-token pages; over 16-token
    pages 85 against 76 us at ~8k, so those keep 64); head dim 128 at ~8k 520 against 557-575 us, ~32k 1995-2007
    against 2104-2183 us (pages of 128 and 16)."""
    block_m = 16 if decode_only else (128 if head_dim_p <= 64 else 64)
    block_m = max(block_m, triton.next_power_of_2(group))
    if decode_only and head_dim_p <= 128 and (page_size >= 128 or head_dim_p == 128):
        return block_m, 128, 4, 2
    block_n = 64 if head_dim_p <= 128 else 32
    num_warps = 4 if decode_only and head_dim_p <= 64 else 8
    return block_m, block_n, num_warps, 2


def _pow2_floor(n: int) -> int:
    return 1 << int(math.log2(n)) if n > 1 else 1


def _num_splits(num_programs: int, max_keys: int, sm_count: int) -> int:
    """Batches with prefills: splits per sequence so about two waves of programs run; a power of two, 1
    when the grid is full."""
    if num_programs >= sm_count:
        return 1
    return _pow2_floor(min(-(-2 * sm_count // num_programs), max_keys // _MIN_KEYS_PER_SPLIT, _MAX_SPLITS))


def _decode_split_keys(num_programs: int, sm_count: int, page_size: int) -> int:
    """Long ranges once the batch fills half the GPU or more, twice as long over pages of 128 tokens or more
    (their key tiles are 128 wide). On the H200 (132 SMs), W-L's decode steps, 64 sequences of 8.2-8.4k keys
    (128 programs), a layer (best of the timed runs): over 16-token pages 76 us with ranges of 1024 against 85
    with 256; over 128-token pages 75.9 us with four ranges of ~2,176 (75.4 with the TMA kernel's ranges of
    2048) against 83.1-88.8 with ranges of 1024 (twenty-second session). 8 sequences of ~8k (16 programs)
    took 20 us with 256 against 37 us with 1024."""
    return _long_ranges(page_size) if 2 * num_programs >= sm_count else DECODE_SPLIT_KEYS_SPARSE


def _long_ranges(page_size: int) -> int:
    """Keys per range for a batch that fills half the GPU or more (_decode_split_keys says why)."""
    return DECODE_SPLIT_KEYS_FULL_LARGE_PAGES if page_size >= 128 else DECODE_SPLIT_KEYS_FULL


def _decode_splits(max_keys: int, split_keys: int) -> int:
    """Decode-only batches: enough ranges of split_keys for the longest sequence the block table can hold
    (a shape, so a CUDA graph keeps it); a sequence uses only as many as its length needs."""
    return _pow2_floor(min(-(-max_keys // split_keys), _MAX_SPLITS))


def _decode_kernel(choice: str | None, query: torch.Tensor, page_size: int, block_n: int) -> str:
    """A decode-only batch's kernel: the caller's choice, else DECODE_KERNEL where it can run."""
    if choice is None:
        tma = DECODE_KERNEL == "tma" and tma_decode_available(query, page_size, block_n)
        return "tma" if tma else "pointer"
    if choice == "tma" and not tma_decode_fits(query.shape[-1], page_size, block_n):
        raise ValueError(f"the TMA decode kernel needs a power-of-two head dim and pages of whole key tiles, "
                         f"not head dim {query.shape[-1]}, pages of {page_size}, tiles of {block_n}")
    return choice


def _launch_pointer_kernel(out, part_out, part_lse, query, key_cache, value_cache, meta: AttentionMetadata,
                           qk_scale: float, grid: tuple[int, int, int], tiles: tuple[int, int, int, int],
                           split_keys: int) -> None:
    num_heads, head_dim = query.shape[1], query.shape[2]
    page_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    block_m, block_n, num_warps, num_stages = tiles
    group = num_heads // num_kv_heads
    _paged_attention_kernel[grid](
        out, part_out, part_lse, query, key_cache, value_cache,
        meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.num_seqs, qk_scale,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), meta.block_tables.stride(0),
        NUM_HEADS=num_heads, GROUP=group, BLOCK_Q=block_m // group, BLOCK_M=block_m, BLOCK_N=block_n,
        HEAD_DIM=head_dim, HEAD_DIM_P=triton.next_power_of_2(head_dim), PAGE_SIZE=page_size,
        NUM_SPLITS=grid[2], SPLIT_KEYS=split_keys, DECODE_ONLY=meta.num_prefills == 0,
        # float32 caches (rare on GPU) keep full precision; tf32 would cost ~1e-3 relative error.
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages)


def paged_attention_triton(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           meta: AttentionMetadata, scale: float, sm_count: int,
                           num_splits: int | None = None, decode_split_keys: int | None = None,
                           tiles: tuple[int, int, int, int] | None = None,
                           decode_kernel: str | None = None) -> torch.Tensor:
    """query [num_tokens, num_heads, dim] -> [num_tokens, num_heads, dim]. `num_splits` and
    `decode_split_keys` (a multiple of the key tile, 64 or 128) None: chosen from shapes (_num_splits,
    _decode_split_keys, _decode_splits); tests and benchmarks force them, `tiles` (_tiles' tuple) and
    `decode_kernel` ("tma" or "pointer" for decode-only batches; None: _decode_kernel's choice)."""
    num_tokens, num_heads, head_dim = query.shape
    _, page_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    head_dim_p = triton.next_power_of_2(head_dim)
    decode_only = meta.num_prefills == 0
    block_m, block_n, num_warps, num_stages = tiles or _tiles(head_dim_p, group, decode_only, page_size)
    block_q = block_m // group
    grid_q = meta.num_seqs if decode_only else num_tokens // block_q + meta.num_seqs
    max_keys = meta.block_tables.shape[1] * page_size
    if decode_only:
        split_keys = decode_split_keys or _decode_split_keys(grid_q * num_kv_heads, sm_count, page_size)
        num_splits = num_splits or _decode_splits(max_keys, split_keys)
    else:  # even ranges, only when the grid is small
        split_keys = block_n
        num_splits = num_splits or _num_splits(grid_q * num_kv_heads, max_keys, sm_count)
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    part_out = part_lse = out  # unused placeholders when not splitting
    if num_splits > 1:
        part_out = torch.empty((num_tokens, num_heads, num_splits, head_dim_p), dtype=torch.float32,
                               device=query.device)
        part_lse = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=query.device)
    assert query.stride(-1) == 1 and key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1
    tiles = (block_m, block_n, num_warps, num_stages)
    if decode_only and _decode_kernel(decode_kernel, query, page_size, block_n) == "tma":
        decode_tma(out, part_out, part_lse, query, key_cache, value_cache, meta, scale * _LOG2E, num_splits,
                   split_keys, tiles)
    else:
        _launch_pointer_kernel(out, part_out, part_lse, query, key_cache, value_cache, meta, scale * _LOG2E,
                               (grid_q, num_kv_heads, num_splits), tiles, split_keys)
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out, part_out, part_lse, meta.seq_lens, out.stride(0), out.stride(1), NUM_HEADS=num_heads,
            NUM_SPLITS=num_splits, SPLIT_KEYS=split_keys, BLOCK_N=block_n, DECODE_ONLY=decode_only,
            HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p)
    return out


class TritonAttentionImpl(AttentionImpl):
    decode_split_keys: int | None = None  # None: by batch size; benchmarks/profile_workload.py varies it
    decode_kernel: str | None = None  # None: _decode_kernel's choice; the same benchmark varies it

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int) -> None:
        super().__init__(num_heads, head_dim, scale, num_kv_heads)
        self._sm_count: int | None = None  # read once, on the first forward (the device is known then)

    def forward(self, query, key, value, key_cache, value_cache, meta: AttentionMetadata) -> torch.Tensor:
        write_kv_triton(key, value, key_cache, value_cache, meta.slot_mapping)
        if self._sm_count is None:
            self._sm_count = torch.cuda.get_device_properties(query.device).multi_processor_count
        return paged_attention_triton(query, key_cache, value_cache, meta, self.scale, self._sm_count,
                                      decode_split_keys=self.decode_split_keys, decode_kernel=self.decode_kernel)

    def warm_up(self, key_cache: torch.Tensor, value_cache: torch.Tensor, metas: list[AttentionMetadata]) -> None:
        """Every split count (and, for decode-only metas, both range lengths for these pages) an eager step of
        these shapes can choose: each is its own compiled variant. With this and flash-attn-4's warm-up, W-L's
        first timed repetition on the H200 took 2.05 s against 2.02 s for the next (2.71 s before)."""
        if self._sm_count is None:
            self._sm_count = torch.cuda.get_device_properties(key_cache.device).multi_processor_count
        splits = [1 << i for i in range(int(math.log2(_MAX_SPLITS)) + 1)]
        for meta in metas:
            query = key_cache.new_zeros((meta.num_tokens, self.num_heads, self.head_dim))
            key_lens = [None] if meta.num_prefills else [_long_ranges(key_cache.shape[1]), DECODE_SPLIT_KEYS_SPARSE]
            for split_keys in key_lens:
                for num_splits in splits:
                    paged_attention_triton(query, key_cache, value_cache, meta, self.scale, self._sm_count,
                                           num_splits=num_splits, decode_split_keys=split_keys,
                                           decode_kernel=self.decode_kernel)


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    impl_cls = TritonAttentionImpl
    graph_support = GraphSupport.MIXED  # grids depend on shapes only; an empty sequence's programs exit at once

    @classmethod
    def check_config(cls, head_dim: int, block_size: int, device: torch.device) -> None:
        super().check_config(head_dim, block_size, device)
        if torch.device(device).type != "cuda":
            raise ValueError(f"attention backend 'triton' needs a CUDA device, not {device}")
        if block_size < 16 or block_size & (block_size - 1):
            raise ValueError(f"attention backend 'triton' needs a power-of-two block_size >= 16, not {block_size}")
