"""engine/structured.py Masking: xgrammar's mask kernel (C++ on the CPU, Triton on CUDA) and kvserve's
(engine/mask_kernel.py: through Triton's interpreter on the CPU, compiled on CUDA) against the PyTorch rule
(apply_reference) on random masks, every row or some rows, float32 and bfloat16, a vocabulary that ends inside
a mask word; on CUDA the mask's side-stream copy too."""
from __future__ import annotations

import pytest
import torch

from engine import mask_kernel

from engine.grammar_xgr import available as xgrammar_available
from engine.structured import Masking, MaskBatch, apply_reference
from interpreted import run_interpreted

needs_xgrammar = pytest.mark.skipif(not xgrammar_available(), reason="xgrammar is not installed")


def _case(batch: int, vocab: int, rows: list[int], dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=gen).to(dtype)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (len(rows), words), dtype=torch.int32, generator=gen)
    if len(rows) > 1:
        bitmask[0] = 0  # a row with nothing allowed, and one with everything
        bitmask[-1] = -1
    return logits, MaskBatch(rows, bitmask)


@needs_xgrammar
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


INTERPRETED = """
import torch
from engine.mask_kernel import apply_mask
from engine.structured import MaskBatch, apply_reference
gen = torch.Generator().manual_seed(1)
for vocab, dtype, rows in [(1000, torch.float32, [0, 1, 2, 3, 4, 5]), (4099, torch.bfloat16, [4, 1, 3]),
                           (4099, torch.float32, [5]), (2048, torch.bfloat16, [2, 0])]:
    logits = torch.randn(6, vocab, generator=gen).to(dtype)
    mask = torch.randint(-2 ** 31, 2 ** 31 - 1, (len(rows), (vocab + 31) // 32), dtype=torch.int32, generator=gen)
    if len(rows) > 1:
        mask[0] = 0  # nothing allowed in the first mask row
    expected = logits.clone()
    apply_reference(expected, MaskBatch(rows, mask))
    index = None if rows == [0, 1, 2, 3, 4, 5] else torch.tensor(rows)
    apply_mask(logits, mask, index)
    assert torch.equal(logits, expected), (vocab, dtype, rows)
    banned = expected[rows] == float("-inf")
    assert banned.any() and not banned.all()
print("equal")
"""


@pytest.mark.skipif(not mask_kernel.available(), reason="triton is not installed")
def test_kvserve_kernel_matches_the_reference_through_tritons_interpreter():
    """engine/mask_kernel.py on CPU tensors under TRITON_INTERPRET=1 (set before triton decorates the kernel,
    so in a process of its own): every row, some rows out of order, a vocabulary ending inside a mask word."""
    done = run_interpreted(INTERPRETED)
    assert done.returncode == 0 and done.stdout.strip() == "equal", done.stderr[-2000:]


def test_the_self_check_refuses_a_kernel_that_differs_or_fails(monkeypatch):
    """Masking keeps xgrammar's kernel unless kvserve's equals the reference on the device; a kernel that
    leaves the logits alone, or raises, is caught by the check, with the reason."""
    monkeypatch.setattr(mask_kernel, "apply_mask", lambda logits, mask, rows=None: None)
    assert "differs from the reference" in mask_kernel.self_check(torch.device("cpu"), torch.float32, 100)

    def broken(logits, mask, rows=None):
        raise RuntimeError("no kernel here")

    monkeypatch.setattr(mask_kernel, "apply_mask", broken)
    assert mask_kernel.self_check(torch.device("cpu"), torch.float32, 100) == "RuntimeError: no kernel here"


@needs_xgrammar
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kernel", ["kvserve", "xgrammar"])
@pytest.mark.parametrize("rows", [list(range(256)), list(range(255, 0, -3))], ids=["every row", "some rows"])
def test_kernel_matches_the_reference_on_cuda(rows, kernel):
    """The served shape: 256 rows of Qwen2.5's 151,936 logits in bfloat16, the mask from pinned host memory;
    kvserve's kernel (after its self-check passed) and xgrammar's."""
    logits, batch = _case(256, 151936, rows, torch.bfloat16, seed=7)
    batch.bitmask = batch.bitmask.pin_memory()
    logits = logits.cuda()
    expected = logits.clone()
    apply_reference(expected, batch)
    masking = Masking()
    if kernel == "xgrammar":
        masking._own[(logits.device, logits.dtype)] = False
    masking.apply(logits, batch)
    torch.cuda.synchronize()
    assert torch.equal(logits, expected)
    assert masking._own[(logits.device, logits.dtype)] == (kernel == "kvserve")  # the self-check passed
