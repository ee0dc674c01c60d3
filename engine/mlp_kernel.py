"""The MLP's gate/up projection with SiLU*mul in its epilogue, beside its PyTorch reference.

Why: on W-L's 16k-token prefill steps (Qwen2.5-0.5B shape) the gate/up GEMM writes [T, 2 * inter] in bf16
and silu_and_mul reads it back to write [T, inter]: 2.8-2.9 ms of a 37.6 ms step on the H200 at the
device's bandwidth, ~0.08 s of W-L (docs/benchmarks.md, "How far W-L can go"). Here each program
computes a tile of gate and the matching tile of up (two float32 accumulators over the merged weight's
two halves) and writes only silu(gate) * up.

Numerics follow the reference (F.linear, then F.silu and the product, as HF's MLP rounds them): gate and up
are rounded to the activation dtype after the bias, SiLU's result is rounded, then the product. The
accumulation order differs from cuBLAS's, so a bf16 output may differ from the reference's by an ulp.

Used only where benchmarks/gate_up_silu.py measured it faster than cuBLAS + silu_and_mul (FUSED_MIN_TOKENS
and the tile below); on the CPU, in CUDA graphs' small decode batches, and without triton the reference runs.
Measured on an H100 (twenty-third session, docs/benchmarks.md): nowhere yet. At 16,384 x 896 x 4864 its best
tile took 0.642 ms against 0.576 (this GEMM at 445 TFLOP/s, cuBLAS's at ~500), and W-L's prefill steps 1.31 s
against 1.28 s. At 256 rows it took 0.046 ms against 0.081, but that timing is two launches against one,
not the GPU's work (decode batches run in CUDA graphs, where launches cost little). So FUSED_MIN_TOKENS is out
of reach until a faster GEMM body (TMA loads, persistent programs) beats cuBLAS's.
tests/test_mlp_kernel.py checks the kernel against the reference through Triton's interpreter and on CUDA (bf16);
the benchmark checks every tile again before it times it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl

    from engine.kernels import _round_to
except ImportError:  # CPU-only installs
    triton = None

FUSED_MIN_TOKENS = 1 << 62  # never: slower than cuBLAS + silu_and_mul from 1,024 rows up (see above)


@dataclass(frozen=True)
class Tile:
    """A launch configuration of the kernel: output tile BM x BN (of gate and of up each), BK keys a loop."""
    bm: int = 128
    bn: int = 128
    bk: int = 64
    warps: int = 8
    stages: int = 3
    group_m: int = 8


DEFAULT_TILE = Tile()


def gate_up_silu_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """silu(x @ gate^T) * (x @ up^T); weight [2 * inter, hidden], gate rows first (MergedLinear's layout)."""
    gate, up = F.linear(x, weight, bias).chunk(2, dim=-1)
    return F.silu(gate) * up


def fused_pays(x: torch.Tensor, min_tokens: int = FUSED_MIN_TOKENS) -> bool:
    """Whether the fused kernel runs these rows: min_tokens rows or more (asked first: every layer of every eager
    step asks, and the kernel is off), on CUDA with triton."""
    return x.shape[0] >= min_tokens and triton is not None and x.is_cuda


def gate_up_silu_fused(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       tile: Tile = DEFAULT_TILE) -> torch.Tensor:
    """[T, hidden] -> [T, inter] through the Triton kernel (CUDA, or CPU tensors under TRITON_INTERPRET=1)."""
    x, weight = x.contiguous(), weight.contiguous()
    tokens, hidden = x.shape
    inter = weight.shape[0] // 2
    out = torch.empty((tokens, inter), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(tokens, tile.bm) * triton.cdiv(inter, tile.bn),)
    _gate_up_silu_kernel[grid](x, weight, weight if bias is None else bias, out, tokens, inter, hidden,
                               HAS_BIAS=bias is not None, EVEN_K=hidden % tile.bk == 0, BM=tile.bm, BN=tile.bn,
                               BK=tile.bk, GROUP_M=tile.group_m, num_warps=tile.warps, num_stages=tile.stages)
    return out


if triton is not None:

    @triton.jit
    def _gate_up_silu_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K: tl.constexpr, HAS_BIAS: tl.constexpr,
                             EVEN_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                             GROUP_M: tl.constexpr):
        # Programs in groups of GROUP_M row tiles sweep the columns together, so a weight tile is read from L2.
        # K (the hidden size, one per model) is a constant: triton 3.6's interpreter cannot loop to a scalar
        # argument (`range(0, K, BK)` and `range(tl.cdiv(K, BK))` both failed there).
        pid = tl.program_id(0)
        num_m, num_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
        first_m = pid // (GROUP_M * num_n) * GROUP_M
        size_m = min(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % (GROUP_M * num_n)) % size_m
        pid_n = (pid % (GROUP_M * num_n)) // size_m
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        a_ptrs = x_ptr + (rm % M)[:, None] * K + rk[None, :]  # rows past M read row copies, never stored
        g_ptrs = w_ptr + (rn % N)[None, :] * K + rk[:, None]  # [BK, BN]: gate^T
        u_ptrs = g_ptrs + N * K  # up's rows follow gate's
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            if EVEN_K:
                a, g, u = tl.load(a_ptrs), tl.load(g_ptrs), tl.load(u_ptrs)
            else:
                left = K - k0
                a = tl.load(a_ptrs, mask=rk[None, :] < left, other=0.0)
                g = tl.load(g_ptrs, mask=rk[:, None] < left, other=0.0)
                u = tl.load(u_ptrs, mask=rk[:, None] < left, other=0.0)
            acc_g = tl.dot(a, g, acc_g)
            acc_u = tl.dot(a, u, acc_u)
            a_ptrs += BK
            g_ptrs += BK
            u_ptrs += BK
        _store_silu_mul(acc_g, acc_u, b_ptr, out_ptr, rm, rn, M, N, HAS_BIAS)

    @triton.jit
    def _store_silu_mul(acc_g, acc_u, b_ptr, out_ptr, rm, rn, M, N, HAS_BIAS: tl.constexpr):
        """out = round(round(silu(round(gate))) * round(up)), as F.linear, F.silu and the product round."""
        dtype = out_ptr.dtype.element_ty
        if HAS_BIAS:
            acc_g += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
            acc_u += tl.load(b_ptr + N + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        gate, up = _round_to(acc_g, dtype), _round_to(acc_u, dtype)
        act = _round_to(gate / (1.0 + tl.exp(-gate)), dtype)
        out = _round_to(act * up, dtype).to(dtype)
        tl.store(out_ptr + rm[:, None] * N + rn[None, :], out, mask=(rm < M)[:, None] & (rn < N)[None, :])
