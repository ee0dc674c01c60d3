"""engine/structured.py Masking: xgrammar's mask kernel (C++ on the CPU, Triton on CUDA) against the PyTorch rule
(apply_reference) on random masks, every row or some rows, float32 and bfloat16, a vocabulary that ends inside
a mask word; on CUDA the mask's side-stream copy too."""
from __future__ import annotations

import pytest
import torch

from engine.grammar_xgr import available as xgrammar_available
from engine.structured import Masking, MaskBatch, apply_reference

pytestmark = pytest.mark.skipif(not xgrammar_available(), reason="xgrammar is not installed")


def _case(batch: int, vocab: int, rows: list[int], dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=gen).to(dtype)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (len(rows), words), dtype=torch.int32, generator=gen)
    if len(rows) > 1:
        bitmask[0] = 0  # a row with nothing allowed, and one with everything
        bitmask[-1] = -1
    return logits, MaskBatch(rows, bitmask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [[0, 1, 2, 3, 4, 5], [4, 1, 3], [5]], ids=["every row", "some, unordered", "last"])
def test_kernel_matches_the_reference_on_the_cpu(dtype, rows):
    logits, batch = _case(6, 1000, rows, dtype, seed=len(rows))
    expected = logits.clone()
    apply_reference(expected, batch)
    masking = Masking()
    assert masking._kernel is not None  # the kernel ran, not the reference again
    masking.apply(logits, batch)
    assert torch.equal(logits, expected)
    banned = expected[rows] == float("-inf")
    assert banned.any() and not banned.all()  # the random masks both banned and allowed tokens


def test_reference_bans_exactly_the_clear_bits():
    logits = torch.zeros(2, 40)
    mask = torch.tensor([[0b101, 1 << 7]], dtype=torch.int32)  # row 1: tokens 0 and 2; token 39
    apply_reference(logits, MaskBatch([1], mask))
    allowed = (logits[1] == 0).nonzero().flatten().tolist()
    assert allowed == [0, 2, 39] and torch.equal(logits[0], torch.zeros(40))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [list(range(256)), list(range(255, 0, -3))], ids=["every row", "some rows"])
def test_kernel_matches_the_reference_on_cuda(rows):
    """The served shape: 256 rows of Qwen2.5's 151,936 logits in bfloat16, the mask from pinned host memory."""
    logits, batch = _case(256, 151936, rows, torch.bfloat16, seed=7)
    batch.bitmask = batch.bitmask.pin_memory()
    logits = logits.cuda()
    expected = logits.clone()
    apply_reference(expected, batch)
    Masking().apply(logits, batch)
    torch.cuda.synchronize()
    assert torch.equal(logits, expected)
