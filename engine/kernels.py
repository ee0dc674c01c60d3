"""Fused elementwise kernels of the model, each beside its PyTorch reference.

A decode step of a small model is made of many tiny kernels: RMSNorm alone is ~7 launches, RoPE ~14.
On a GPU each launch costs a few microseconds of device time even under CUDA graphs, so the layer's
elementwise work is fused into three Triton kernels. They reproduce the references' rounding (HF's:
normalise in float32, round to the activation dtype, then scale; RoPE and SiLU products rounded as
HF rounds them), so bf16 outputs match transformers. On the CPU, or without triton, the references run.
tests/test_kernels.py checks each kernel against its reference on random inputs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None


def _use_triton(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda


# ------------------------------------------------------------------------------------- references


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); residual None: the first layer, nothing to add."""
    h = x if residual is None else x + residual
    hf = h.float()
    normed = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
    return weight * normed, h


def rope_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    # q [T, H, D], k [T, KVH, D]; cos, sin [T, 1, D / 2] in the activations' dtype (HF casts them first).
    cos, sin = cos_sin_cache[positions].to(q.dtype).unsqueeze(1).chunk(2, dim=-1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    return rotate(q), rotate(k)


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)  # [T, inter] each
    return F.silu(gate) * up


# ------------------------------------------------------------------------------------- dispatch


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    if not _use_triton(x):
        return add_rms_norm_ref(x, residual, weight, eps)
    x = x.contiguous()
    num_tokens, hidden = x.shape
    out = torch.empty_like(x)
    new_residual = x if residual is None else torch.empty_like(x)
    res = x if residual is None else residual.contiguous()
    _add_rms_norm_kernel[(num_tokens,)](x, res, weight, out, new_residual, hidden, eps,
                                        HAS_RESIDUAL=residual is not None,
                                        BLOCK=triton.next_power_of_2(hidden))
    return out, new_residual


def rope_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q [T, H, D] and k [T, KVH, D]; in place on the GPU (they may be strided views
    of the fused qkv output), a new pair otherwise."""
    half = q.shape[-1] // 2
    if not _use_triton(q) or half & (half - 1):  # the kernel takes power-of-two half widths
        return rope_ref(positions, q, k, cos_sin_cache)
    num_tokens, num_heads, _ = q.shape
    num_kv_heads = k.shape[1]
    _rope_kernel[(num_tokens,)](positions, q, k, cos_sin_cache, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                                cos_sin_cache.stride(0), NUM_Q=num_heads, NUM_K=num_kv_heads,
                                NUM_Q_P=triton.next_power_of_2(num_heads),
                                NUM_K_P=triton.next_power_of_2(num_kv_heads), HALF=half, num_warps=2)
    return q, k


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if not _use_triton(gate_up):
        return silu_and_mul_ref(gate_up)
    gate_up = gate_up.contiguous()
    num_tokens, two_inter = gate_up.shape
    inter = two_inter // 2
    out = torch.empty((num_tokens, inter), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block)
    return out


_PACK_BATCH_HINT = 256  # rows oneDNN lays the packed weight out for: measured the best from 1 to 2048 rows


def pack_weight_for_cpu(weight: torch.Tensor) -> torch.Tensor | None:
    """A oneDNN-packed copy of a float32 [out, in] CPU weight for packed_linear, or None where oneDNN's
    linear ops are missing."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_BATCH_HINT)
    except (AttributeError, RuntimeError):  # a torch build without them
        return None


def packed_rows(num_rows: int) -> int:
    """The row count packed_linear hands oneDNN: exact up to 16, then rounded up to a multiple of 16 (to
    256) or of 64. oneDNN JIT-compiles and caches a primitive per distinct shape (~0.5-2 MB each, 1024
    kept): unbucketed, a server's ever-changing step sizes grew its memory by a third in a 200-request soak."""
    if num_rows <= 16:
        return num_rows
    step = 16 if num_rows <= 256 else 64
    return -(-num_rows // step) * step


def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear on the CPU through a weight packed once by pack_weight_for_cpu (what torch.compile's CPU
    backend does for frozen weights). F.linear repacks its weight on every call: 2-4x slower from 1 to 2048
    rows on this project's CPU (docs/benchmarks.md). x: [rows, in] -> [rows, out]."""
    rows = x.shape[0]
    if packed_rows(rows) != rows:
        x = torch.cat((x, x.new_zeros(packed_rows(rows) - rows, x.shape[1])))  # [padded rows, in]
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")[:rows]


# ------------------------------------------------------------------------------------- kernels

if triton is not None:

    @triton.jit
    def _round_to(x, dtype: tl.constexpr):
        """float32 -> the nearest value of `dtype` (round to nearest, ties to even), kept in float32.
        bfloat16 by integer arithmetic: a plain `.to(bf16)` does not round to nearest everywhere (under the
        interpreter it truncates), and that made outputs differ from HF's by an ulp on the H200."""
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return bits.to(tl.float32, bitcast=True)
        elif dtype == tl.float16:
            return x.to(tl.float16).to(tl.float32)
        else:
            return x

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr, hidden, eps,
                             HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < hidden
        xf = tl.load(x_ptr + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            # The residual stream is rounded like HF's `h + out`, and the norm reads the rounded sum.
            xf = _round_to(xf + tl.load(res_ptr + row * hidden + cols, mask=mask, other=0.0).to(tl.float32),
                           new_res_ptr.dtype.element_ty)
            tl.store(new_res_ptr + row * hidden + cols, xf.to(new_res_ptr.dtype.element_ty), mask=mask)  # exact
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
        normed = _round_to(xf * rstd, out_ptr.dtype.element_ty)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        out = _round_to(w * normed, out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * hidden + cols, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rope_kernel(pos_ptr, q_ptr, k_ptr, cache_ptr, q_stride_t, q_stride_h, k_stride_t, k_stride_h,
                     cache_stride, NUM_Q: tl.constexpr, NUM_K: tl.constexpr, NUM_Q_P: tl.constexpr,
                     NUM_K_P: tl.constexpr, HALF: tl.constexpr):
        # One program per token, all its q and k heads: a program per (token, head) moved 64 elements each
        # and took 160 us a layer at 16k tokens on the H200 (W-L's prefill, 8% of the step) for ~30 MB.
        token = tl.program_id(0)
        pos = tl.load(pos_ptr + token)
        offs = tl.arange(0, HALF)
        dtype = q_ptr.dtype.element_ty
        # HF casts cos/sin to the activation dtype and rounds each product and sum to it.
        cos = _round_to(tl.load(cache_ptr + pos * cache_stride + offs).to(tl.float32), dtype)[None, :]
        sin = _round_to(tl.load(cache_ptr + pos * cache_stride + HALF + offs).to(tl.float32), dtype)[None, :]
        _rope_heads(q_ptr + token * q_stride_t, q_stride_h, cos, sin, offs, NUM_Q, NUM_Q_P, HALF)
        _rope_heads(k_ptr + token * k_stride_t, k_stride_h, cos, sin, offs, NUM_K, NUM_K_P, HALF)

    @triton.jit
    def _rope_heads(base, stride_h, cos, sin, offs, NUM: tl.constexpr, NUM_P: tl.constexpr, HALF: tl.constexpr):
        heads = tl.arange(0, NUM_P)
        mask = (heads < NUM)[:, None]
        ptr = base + heads[:, None] * stride_h + offs[None, :]  # [NUM_P, HALF]: each head's first half
        dtype = base.dtype.element_ty
        x1 = tl.load(ptr, mask=mask).to(tl.float32)
        x2 = tl.load(ptr + HALF, mask=mask).to(tl.float32)
        a1 = _round_to(x1 * cos, dtype)
        b1 = _round_to(x2 * sin, dtype)
        a2 = _round_to(x2 * cos, dtype)
        b2 = _round_to(x1 * sin, dtype)
        tl.store(ptr, _round_to(a1 - b1, dtype).to(dtype), mask=mask)
        tl.store(ptr + HALF, _round_to(a2 + b2, dtype).to(dtype), mask=mask)

    @triton.jit
    def _silu_and_mul_kernel(x_ptr, out_ptr, inter, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        gate = tl.load(x_ptr + row * 2 * inter + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * 2 * inter + inter + cols, mask=mask, other=0.0)
        act = _round_to(gate / (1.0 + tl.exp(-gate)), up.dtype)  # F.silu rounds to the dtype before the product
        tl.store(out_ptr + row * inter + cols, _round_to(act * up.to(tl.float32), up.dtype).to(up.dtype), mask=mask)
