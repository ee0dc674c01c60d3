"""The torch reference backend against a naive dense attention over each sequence's full K/V."""
from __future__ import annotations

import random

import pytest
import torch

from attention import BACKEND_NAMES, explain_backend_choice, get_backend
from attention.base import PAD_SLOT_ID
from attention.testing import make_random_batch, random_mixed_lens
from attention.torch_ref import TorchAttentionBackend


def naive_attention(batch, num_heads: int, scale: float) -> torch.Tensor:
    """Dense, per sequence, in float64: query i of a sequence sees its keys 0 .. context_len + i."""
    outs, start = [], 0
    for spec, keys, values in zip(batch.specs, batch.full_keys, batch.full_values):
        group = num_heads // keys.shape[1]
        k = keys.double().repeat_interleave(group, dim=1)  # [seq_len, H, D]
        v = values.double().repeat_interleave(group, dim=1)
        q = batch.query[start:start + spec.query_len].double()  # [q_len, H, D]
        start += spec.query_len
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        visible = torch.arange(spec.seq_len)[None, :] <= spec.context_len + torch.arange(spec.query_len)[:, None]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, v))
    padding = torch.zeros(batch.query.shape[0] - start, *batch.query.shape[1:], dtype=torch.float64)
    return torch.cat(outs + [padding])


def run_torch_backend(batch, num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    impl = TorchAttentionBackend.impl_cls(num_heads, head_dim, head_dim ** -0.5, num_kv_heads)
    return impl.forward(batch.query, batch.key, batch.value, batch.key_cache, batch.value_cache, batch.meta)


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 7])
def test_reference_matches_naive_on_mixed_batches(group, head_dim, block_size):
    num_kv_heads = 2
    num_heads = group * num_kv_heads
    seed = group * 1000 + head_dim + block_size
    lens = random_mixed_lens(random.Random(seed), num_prefills=3, num_decodes=4, max_len=150)
    batch = make_random_batch(lens, num_heads, num_kv_heads, head_dim, block_size, torch.float32, "cpu", seed=seed)
    out = run_torch_backend(batch, num_heads, num_kv_heads, head_dim)
    expected = naive_attention(batch, num_heads, head_dim ** -0.5)
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-4)


def test_reference_handles_only_decodes_and_only_prefills():
    for lens in ([(0, 1), (17, 1), (63, 1)], [(0, 20), (30, 5)]):
        batch = make_random_batch(lens, 4, 2, 64, 16, torch.float32, "cpu", seed=len(lens))
        out = run_torch_backend(batch, 4, 2, 64)
        torch.testing.assert_close(out.double(), naive_attention(batch, 4, 0.125), rtol=1e-4, atol=1e-4)


def test_kv_lands_at_slot_mapping_and_padding_writes_nothing():
    lens = [(5, 12), (0, 9), (33, 1), (2, 1)]
    batch = make_random_batch(lens, 4, 2, 64, 16, torch.float32, "cpu", seed=3, pad_to_num_tokens=27)
    before_k, before_v = batch.key_cache.clone(), batch.value_cache.clone()
    out = run_torch_backend(batch, 4, 2, 64)

    slots = batch.meta.slot_mapping
    real = slots != PAD_SLOT_ID
    assert int((~real).sum()) == 4
    flat_k, flat_v = batch.key_cache.view(-1, 2, 64), batch.value_cache.view(-1, 2, 64)
    assert torch.equal(flat_k[slots[real]], batch.key[real])
    assert torch.equal(flat_v[slots[real]], batch.value[real])
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[slots[real]] = False
    assert torch.equal(flat_k[untouched], before_k.view(-1, 2, 64)[untouched])
    assert torch.equal(flat_v[untouched], before_v.view(-1, 2, 64)[untouched])
    # Padded decodes attend to one key in block 0: a finite row, and real rows are unaffected.
    assert torch.isfinite(out).all()
    expected = naive_attention(batch, 4, 0.125)
    n_real = int(real.sum())
    torch.testing.assert_close(out[:n_real].double(), expected[:n_real], rtol=1e-4, atol=1e-4)


def test_reference_keeps_bfloat16():
    batch = make_random_batch([(10, 6), (40, 1)], 14, 2, 64, 16, torch.bfloat16, "cpu", seed=4)
    out = run_torch_backend(batch, 14, 2, 64)
    assert out.dtype == torch.bfloat16
    expected = naive_attention(batch, 14, 0.125)
    assert ((out.double() - expected).norm() / expected.norm()).item() < 1e-2


def test_registry_on_cpu():
    assert set(BACKEND_NAMES) == {"torch", "triton", "flash-attn", "flash-attn-4", "triton+flash-attn-4"}
    backend, reason = explain_backend_choice("auto", torch.device("cpu"), 64, 16)
    assert backend is TorchAttentionBackend and "cpu" in reason
    assert get_backend("torch", "cpu", 80, 16) is TorchAttentionBackend
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_backend("sdpa", "cpu", 64, 16)


@pytest.mark.parametrize("name", ["triton", "flash-attn", "flash-attn-4"])
def test_gpu_backends_refuse_cpu_with_a_reason(name):
    with pytest.raises(ValueError, match=name):
        get_backend(name, torch.device("cpu"), 64, 16)


def test_reference_runs_a_mixed_graph_layout():
    """Unequal padding (a mixed CUDA graph's batch): a padding prompt and empty sequences after the real
    ones, every sequence on the general path. Real rows match the naive attention; padding writes nothing."""
    lens = [(0, 9), (40, 6), (33, 1), (2, 1), (0, 1)]
    batch = make_random_batch(lens, 4, 2, 64, 16, torch.float32, "cpu", seed=5, pad_to_num_tokens=24,
                              pad_to_num_seqs=9)
    assert (batch.meta.num_prefills, batch.meta.num_decode_tokens, batch.meta.num_seqs) == (9, 0, 9)
    before_k = batch.key_cache.clone()
    out = run_torch_backend(batch, 4, 2, 64)
    n_real = sum(q for _, q in lens)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[:n_real].double(), naive_attention(batch, 4, 0.125)[:n_real], rtol=1e-4,
                               atol=1e-4)
    slots = batch.meta.slot_mapping[:n_real]
    changed = (batch.key_cache != before_k).flatten(2).any(-1).flatten()  # [num_slots]
    assert set(changed.nonzero().flatten().tolist()) <= set(slots.tolist())
