"""engine/mlp_kernel.py: the fused gate/up + SiLU*mul kernel against its PyTorch reference, on the CPU through
Triton's interpreter (odd sizes, bias or not, a K loop with a partial last tile); the dispatch's rule on the CPU.
float16 stands in for bfloat16 here: the interpreter's tl.dot on bfloat16 returns garbage (Triton 3.9), the
rounding path is the same code. The bfloat16 check on the GPU is benchmarks/gate_up_silu.py's, before it times."""
from __future__ import annotations

import pytest
import torch

from interpreted import run_interpreted

CHECK = """
import sys, torch
from engine.mlp_kernel import Tile, gate_up_silu_fused, gate_up_silu_ref
bad = []
cases = [(37, 48, 40, True, torch.float32), (16, 32, 32, False, torch.float32), (50, 64, 72, False, torch.float16),
         (33, 40, 24, True, torch.float16), (1, 64, 16, True, torch.float16)]
for seed, (tokens, hidden, inter, bias, dtype) in enumerate(cases):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w = (torch.randn(2 * inter, hidden, generator=g) / hidden ** 0.5).to(dtype)
    b = torch.randn(2 * inter, generator=g).to(dtype) if bias else None
    out = gate_up_silu_fused(x, w, b, Tile(bm=16, bn=16, bk=16, group_m=2))
    if dtype == torch.float32:  # no rounding between the steps: equal up to the sums' order
        ok = out.shape == (tokens, inter) and torch.allclose(out, gate_up_silu_ref(x, w, b), rtol=1e-5, atol=1e-5)
    else:  # each step rounded as the reference rounds it: at most two ulps apart, nearly all equal. Two: the
        # host's float16 GEMM sums in its own order (it differs between CPUs), so a gate may land an ulp away,
        # and silu's slope (up to 1.1) and the product carry that a little past one ulp of the output
        # (1.03 ulps for one of 792 values on an AMD EPYC host, 2026-12-07)
        mine = gate_up_silu_ref(x, w, b)
        ulp = 2 * (mine.float().abs() * 2 ** -10).clamp_min(2 ** -24)
        ok = bool(((out.float() - mine.float()).abs() <= ulp).all()) and (out == mine).float().mean() > 0.97
    if not ok:
        bad.append((tokens, hidden, inter, bias, str(dtype)))
print("failed cases", bad)
sys.exit(1 if bad else 0)
"""


def test_fused_gate_up_silu_matches_the_reference_through_tritons_interpreter():
    pytest.importorskip("triton")
    done = run_interpreted(CHECK)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]


def test_the_fused_kernel_runs_only_on_cuda_past_its_row_count():
    """On the CPU the model's MLP keeps the GEMM then silu_and_mul, whatever the row count."""
    from engine.mlp_kernel import fused_pays

    x = torch.zeros(9, 16)
    assert not fused_pays(x, 0) and not fused_pays(x, 100)
    if torch.cuda.is_available():
        assert fused_pays(x.cuda(), 9) and not fused_pays(x.cuda(), 10)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens,hidden,inter,bias", [(1000, 896, 4864, False), (129, 128, 80, True)])
def test_fused_gate_up_silu_matches_the_reference_on_the_gpu(tokens, hidden, inter, bias):
    """bfloat16, the model's tile: no further from a float32 reference than cuBLAS's path, a few ulps from it."""
    import torch.nn.functional as F

    from engine.kernels import silu_and_mul
    from engine.mlp_kernel import gate_up_silu_fused, gate_up_silu_ref

    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g, device="cuda").bfloat16()
    w = (torch.randn(2 * inter, hidden, generator=g, device="cuda") / hidden ** 0.5).bfloat16()
    b = torch.randn(2 * inter, generator=g, device="cuda").bfloat16() if bias else None
    exact = gate_up_silu_ref(x.float(), w.float(), None if b is None else b.float())
    served, out = silu_and_mul(F.linear(x, w, b)), gate_up_silu_fused(x, w, b)
    err = lambda y: ((y.float() - exact).norm() / exact.norm()).item()  # noqa: E731
    assert out.shape == served.shape and err(out) <= 1.1 * err(served) + 1e-6
    assert ((out.float() - served.float()).abs() <= served.float().abs() * 2 ** -5 + 1e-2).all()
