"""The flash-attn backends' glue on CPU: the packages are replaced by stand-ins that implement the
documented call semantics naively (paged K/V through a block table, causal aligned bottom-right), so
what is checked is how our backends slice the batch and which arguments they pass."""
from __future__ import annotations

import random
import sys
import types

import pytest
import torch

from attention.flash_attn import FlashAttn4Impl, FlashAttnImpl
from attention.testing import make_random_batch, random_mixed_lens
from attention.torch_ref import TorchAttentionImpl


def _paged_causal(q, k_cache, v_cache, q_lens, k_lens, block_table, scale):
    """q [sum(q_lens), H, D]; sequence i's keys are its first k_lens[i] cache slots through block_table[i]."""
    out, start = torch.empty_like(q), 0
    page = k_cache.shape[1]
    for i, (q_len, k_len) in enumerate(zip(q_lens, k_lens)):
        blocks = block_table[i, :-(-k_len // page)].long()
        k = k_cache[blocks].flatten(0, 1)[:k_len].float()  # [k_len, KVH, D]
        v = v_cache[blocks].flatten(0, 1)[:k_len].float()
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", q[start:start + q_len].float(), k) * scale
        visible = torch.arange(k_len)[None, :] <= torch.arange(q_len)[:, None] + (k_len - q_len)
        s = s.masked_fill(~visible, float("-inf"))
        out[start:start + q_len] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).to(q.dtype)
        start += q_len
    return out


def _fake_flash_attn_2():
    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, max_seqlen_q, cu_seqlens_k, max_seqlen_k, softmax_scale,
                               causal, block_table):
        assert causal and k.dim() == 4 and block_table.shape[0] == cu_seqlens_q.shape[0] - 1
        assert max_seqlen_q == int(cu_seqlens_q.diff().max()) and max_seqlen_k >= int(cu_seqlens_k.diff().max())
        return _paged_causal(q, k, v, cu_seqlens_q.diff().tolist(), cu_seqlens_k.diff().tolist(), block_table,
                             softmax_scale)

    def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, causal):
        assert causal and q.shape[1] == 1 and q.shape[0] == cache_seqlens.shape[0] == block_table.shape[0]
        out = _paged_causal(q[:, 0], k_cache, v_cache, [1] * q.shape[0], cache_seqlens.tolist(), block_table,
                            softmax_scale)
        return out.unsqueeze(1)

    return types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func,
                                 flash_attn_with_kvcache=flash_attn_with_kvcache)


def _fake_flash_attn_4():
    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, max_seqlen_q, seqused_k, page_table, softmax_scale, causal,
                               num_splits):
        assert causal and page_table.dtype == torch.int32 and page_table.shape[0] == seqused_k.shape[0]
        assert max_seqlen_q == int(cu_seqlens_q.diff().max())
        out = _paged_causal(q, k, v, cu_seqlens_q.diff().tolist(), seqused_k.tolist(), page_table, softmax_scale)
        return out, None

    return types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func)


@pytest.mark.parametrize("impl_cls", [FlashAttnImpl, FlashAttn4Impl])
@pytest.mark.parametrize("lens", [
    random_mixed_lens(random.Random(0), num_prefills=3, num_decodes=4, max_len=300),  # mixed
    [(0, 40), (100, 7)],  # prefills only
    [(5, 1), (300, 1), (0, 1)],  # decodes only
])
def test_flash_backends_pass_the_right_slices(monkeypatch, impl_cls, lens):
    monkeypatch.setitem(sys.modules, "flash_attn", _fake_flash_attn_2())
    monkeypatch.setitem(sys.modules, "flash_attn.cute", _fake_flash_attn_4())
    batch = make_random_batch(lens, 14, 2, 64, 16, torch.float32, "cpu", seed=len(lens), pad_to_num_tokens=None)
    ref_caches = batch.key_cache.clone(), batch.value_cache.clone()
    ref = TorchAttentionImpl(14, 64, 0.125, 2).forward(batch.query, batch.key, batch.value, *ref_caches, batch.meta)
    out = impl_cls(14, 64, 0.125, 2).forward(batch.query, batch.key, batch.value, batch.key_cache,
                                             batch.value_cache, batch.meta)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(batch.key_cache, ref_caches[0]) and torch.equal(batch.value_cache, ref_caches[1])


@pytest.mark.parametrize("capability, head_dim, expected", [((9, 0), 64, 128), ((9, 0), 128, 128), ((9, 0), 256, 16),
                                                            ((8, 0), 64, 16), ((10, 0), 64, 16)])
def test_flash_attn_4_prefers_pages_of_one_key_tile_on_hopper(monkeypatch, capability, head_dim, expected):
    """Unset, the block size follows the backend: flash-attn-4 (alone or in the hybrid) loads pages by TMA on
    Hopper only when a page is its 128-key tile; the other backends keep 16."""
    from attention.base import AttentionBackend
    from attention.flash_attn import FlashAttn4Backend

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert FlashAttn4Backend.preferred_block_size(head_dim, torch.device("cuda")) == expected
    assert FlashAttn4Backend.preferred_block_size(head_dim, torch.device("cpu")) == 16
    assert AttentionBackend.preferred_block_size(head_dim, torch.device("cuda")) == 16


def test_engine_takes_the_backends_block_size_unless_one_is_set(tiny_model_dir):
    from engine.llm import LLM

    auto = LLM(model=str(tiny_model_dir("llama")), num_kv_blocks=16, max_model_len=128)
    assert auto.engine.config.block_size is None and auto.engine.block_size == 16  # torch on the CPU
    assert auto.engine.scheduler.block_size == 16
    chosen = LLM(model=str(tiny_model_dir("llama")), num_kv_blocks=16, max_model_len=128, block_size=32)
    assert chosen.engine.block_size == 32 and chosen.engine.scheduler.block_size == 32
