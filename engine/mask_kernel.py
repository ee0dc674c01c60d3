"""The grammar mask applied to the logits on the GPU, beside its reference (engine/structured.py apply_reference).

Bit j of word w of a mask row clear -> token 32 * w + j of its logits row becomes -inf. xgrammar's Triton
kernel (what vLLM and SGLang call) runs one program per SM that walks (row, 4,096-token block) pairs one
after another: at 256 rows of 151,936 bfloat16 logits it took 0.26-0.28 ms on an H100 (~300 GB/s of the
~78 MB it writes; benchmarks/mask_apply.py, ninth and tenth sessions). Here every (row, block) pair is a
program of its own, so the whole grid is in flight at once, and the constrained rows are named by an index
instead of a full-batch mask built on the device first. It is the one hot loop of this file; the reference
stays the rule. Checked against the reference on random masks: on the CPU through Triton's interpreter
(tests/test_structured_masking.py), on CUDA by the same tests and, at engine start, by self_check (a failure
or a mismatch keeps xgrammar's kernel).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

BLOCK = 2048  # tokens a program masks: 64 mask words


if triton is not None:
    @triton.jit
    def _apply_mask(logits_ptr, mask_ptr, rows_ptr, vocab, logits_stride, mask_stride,
                    HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0)  # the mask row
        tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = tokens < vocab
        if HAS_ROWS:
            row = tl.load(rows_ptr + i).to(tl.int64)
        else:
            row = i.to(tl.int64)
        words = tl.load(mask_ptr + i.to(tl.int64) * mask_stride + tokens // 32, mask=inside, other=-1)
        banned = ((words >> (tokens % 32)) & 1) == 0
        tl.store(logits_ptr + row * logits_stride + tokens, float("-inf"), mask=inside & banned)


def available() -> bool:
    return triton is not None


def apply_mask(logits: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """logits [batch, vocab] in place; mask [m, words] int32 on the logits' device; rows: the m logits rows the
    mask rows belong to (int64 on the device), None for rows 0..m-1."""
    m, vocab = mask.shape[0], min(logits.shape[1], mask.shape[1] * 32)
    assert logits.stride(1) == 1 and mask.stride(1) == 1, "rows must be contiguous"
    if m == 0:
        return
    grid = (m, triton.cdiv(vocab, BLOCK))
    _apply_mask[grid](logits, mask, mask if rows is None else rows, vocab, logits.stride(0), mask.stride(0),
                      HAS_ROWS=rows is not None, BLOCK=BLOCK, num_warps=4)


def self_check(device: torch.device, dtype: torch.dtype, vocab: int) -> str | None:
    """None if apply_mask equals the reference on random masks (every row, and some rows out of order) on
    `device`; else why not (the caller then keeps xgrammar's kernel)."""
    from engine.structured import MaskBatch, apply_reference

    gen = torch.Generator().manual_seed(0)
    words = (vocab + 31) // 32
    try:
        for rows in ([0, 1, 2, 3], [3, 0]):
            logits = torch.randn(4, vocab, generator=gen).to(dtype)
            mask = torch.randint(-2 ** 31, 2 ** 31 - 1, (len(rows), words), dtype=torch.int32, generator=gen)
            expected = logits.clone()
            apply_reference(expected, MaskBatch(rows, mask))
            got = logits.to(device)
            index = None if rows == [0, 1, 2, 3] else torch.tensor(rows, device=device)
            apply_mask(got, mask.to(device), index)
            if not torch.equal(got.cpu(), expected):
                return f"differs from the reference ({len(rows)} rows)"
    except Exception as exc:  # noqa: BLE001 - reported; xgrammar's kernel is kept
        return f"{type(exc).__name__}: {exc}"[:300]
    return None
