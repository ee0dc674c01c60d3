"""engine/kernels.py: each Triton kernel against its PyTorch reference (GPU), and each reference against
transformers' own modules (CPU)."""
from __future__ import annotations

import pytest
import torch

from engine.kernels import (add_rms_norm, add_rms_norm_ref, pack_weight_for_cpu, packed_linear, packed_rows, rope_,
                            rope_ref, silu_and_mul, silu_and_mul_ref)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _cos_sin_cache(head_dim: int, max_pos: int = 4096, theta: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    freqs = torch.arange(max_pos).float()[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


@pytest.mark.skipif(pack_weight_for_cpu(torch.zeros(2, 2)) is None, reason="this torch build lacks oneDNN's linear")
@pytest.mark.parametrize("rows", [0, 1, 7, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows, bias):
    """The CPU matmul through a oneDNN-packed weight against F.linear: float32, random inputs, a strided view."""
    gen = torch.Generator().manual_seed(rows)
    weight, b = torch.randn(200, 96, generator=gen), torch.randn(200, generator=gen) if bias else None
    x = torch.randn(rows, 2 * 96, generator=gen)[:, ::2]  # [rows, 96], not contiguous
    out = packed_linear(x, pack_weight_for_cpu(weight), b)
    assert out.shape == (rows, 200) and out.dtype == torch.float32
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, b), rtol=1e-5, atol=1e-5)
    assert pack_weight_for_cpu(weight.bfloat16()) is None  # float32 only: other dtypes keep F.linear


def test_packed_rows_are_few_and_pad_little():
    """oneDNN caches a primitive per row count: few distinct counts, each at least the rows asked for."""
    padded = [packed_rows(n) for n in range(1, 2049)]
    assert all(p >= n for n, p in enumerate(padded, 1)) and padded == sorted(padded)
    assert padded[:16] == list(range(1, 17))  # small decode batches run exact
    assert len(set(padded)) <= 60 and max(p - n for n, p in enumerate(padded, 1)) <= 63


def test_references_match_transformers():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    torch.manual_seed(0)
    x, res = torch.randn(5, 64), torch.randn(5, 64)
    norm = LlamaRMSNorm(64, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.2)
    out, new_res = add_rms_norm_ref(x, res, norm.weight, 1e-6)
    torch.testing.assert_close(new_res, x + res)
    torch.testing.assert_close(out, norm(x + res))

    cache = _cos_sin_cache(32)
    positions = torch.tensor([0, 3, 17, 100, 4000])
    q, k = torch.randn(5, 4, 32), torch.randn(5, 2, 32)
    cos, sin = cache[positions].chunk(2, dim=-1)
    cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)  # HF's [T, D] layout
    hq, hk = apply_rotary_pos_emb(q.transpose(0, 1), k.transpose(0, 1), cos, sin, unsqueeze_dim=0)
    rq, rk = rope_ref(positions, q, k, cache)
    torch.testing.assert_close(rq, hq.transpose(0, 1))
    torch.testing.assert_close(rk, hk.transpose(0, 1))

    gate_up = torch.randn(5, 2 * 48)
    torch.testing.assert_close(silu_and_mul_ref(gate_up), torch.nn.functional.silu(gate_up[:, :48]) * gate_up[:, 48:])


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("hidden", (64, 896, 4096))
def test_add_rms_norm_kernel(dtype, hidden):
    torch.manual_seed(0)
    x = torch.randn(37, hidden, device="cuda", dtype=dtype)
    res = torch.randn(37, hidden, device="cuda", dtype=dtype)
    w = torch.randn(hidden, device="cuda", dtype=dtype)
    for r in (None, res):
        out, new_res = add_rms_norm(x, r, w, 1e-6)
        ref_out, ref_res = add_rms_norm_ref(x, r, w, 1e-6)
        torch.testing.assert_close(new_res, ref_res, rtol=0, atol=0)  # the residual add is exact
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out, ref_out, rtol=tol, atol=tol)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", ("float32", "activation"))  # a table cast with the model must work too
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("head_dim", (32, 64, 128))
def test_rope_kernel_on_strided_views(dtype, head_dim, cache_dtype):
    torch.manual_seed(0)
    T, H, KVH = 29, 14, 2
    cache = _cos_sin_cache(head_dim).cuda().to(torch.float32 if cache_dtype == "float32" else dtype)
    positions = torch.randint(0, 4096, (T,), device="cuda")
    qkv = torch.randn(T, (H + 2 * KVH) * head_dim, device="cuda", dtype=dtype)  # the fused projection's output
    q, k, v = qkv.split((H * head_dim, KVH * head_dim, KVH * head_dim), dim=-1)
    q, k = q.view(T, H, head_dim), k.view(T, KVH, head_dim)
    ref_q, ref_k = rope_ref(positions, q.clone(), k.clone(), cache)
    v_before = v.clone()
    out_q, out_k = rope_(positions, q, k, cache)
    tol = 1e-5 if dtype == torch.float32 else 0  # bf16: the kernel rounds exactly where HF does
    torch.testing.assert_close(out_q, ref_q, rtol=tol, atol=tol)
    torch.testing.assert_close(out_k, ref_k, rtol=tol, atol=tol)
    torch.testing.assert_close(v, v_before, rtol=0, atol=0)  # v untouched


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("inter", (128, 4864, 1000))
def test_silu_and_mul_kernel(dtype, inter):
    torch.manual_seed(0)
    gate_up = torch.randn(33, 2 * inter, device="cuda", dtype=dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(silu_and_mul(gate_up), silu_and_mul_ref(gate_up), rtol=tol, atol=tol)
