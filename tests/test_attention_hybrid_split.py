"""The hybrid backend's split of a long step, on the CPU: each part's kernel replaced by the PyTorch reference
over exactly the views the hybrid hands it, so the parts' offsets, views and routing are checked here, and the
kernels themselves on a GPU (tests/test_attention_gpu.py)."""
from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")  # attention.hybrid imports the Triton kernels (not run here)

import attention.hybrid as hybrid  # noqa: E402
from attention.testing import make_random_batch  # noqa: E402
from attention.torch_ref import TorchAttentionImpl, _gather_seq, write_kv_torch  # noqa: E402

HEADS, KV_HEADS, DIM, BLOCK = 6, 2, 16, 16


def _over_pages(ref, q, key_cache, value_cache, query_start_loc, seq_lens, block_tables):
    """Each sequence's query rows over its keys read back through its block table."""
    out = torch.empty_like(q)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        lo, hi = starts[i], starts[i + 1]
        k, v = (_gather_seq(c, block_tables[i], seq_len) for c in (key_cache, value_cache))
        out[lo:hi] = ref._attend_chunk(q[lo:hi], k, v, seq_len - (hi - lo))
    return out


def _fake_kernels(monkeypatch, ref, calls: list):
    def paged(q, kc, vc, qsl, seq_lens, tables, max_q, scale):
        calls.append(("paged", len(q)))
        assert len(qsl) == len(seq_lens) + 1 and int(qsl[-1]) == len(q) and max_q >= int(qsl.diff().max())
        return _over_pages(ref, q, kc, vc, qsl, seq_lens, tables)

    def dense(q, k, v, cu, max_q, scale):
        calls.append(("dense", len(q)))
        assert int(cu[0]) == 0 and int(cu[-1]) == len(q) == len(k) and max_q >= int(cu.diff().max())
        bounds = cu.tolist()
        return torch.cat([ref._attend_chunk(q[a:b], k[a:b], v[a:b], 0) for a, b in zip(bounds, bounds[1:])])

    def attend(q, kc, vc, meta):
        calls.append(("triton", len(q)))
        qsl = meta.query_start_loc if meta.num_prefills else torch.arange(len(q) + 1)
        assert len(q) == meta.num_tokens == int(qsl[-1])
        return _over_pages(ref, q, kc, vc, qsl, meta.seq_lens, meta.block_tables)

    monkeypatch.setattr(hybrid, "flash_attn_4_paged", paged)
    monkeypatch.setattr(hybrid, "flash_attn_4_dense", dense)
    monkeypatch.setattr(hybrid, "write_kv_triton", write_kv_torch)
    return attend


STEPS = {  # a long step's make-up -> the calls the hybrid makes, in order
    "W-L: a short chunk over 8k, two fresh prompts, decodes": (
        [(3000, 30), (0, 2100), (0, 900)] + [(2500 + i, 1) for i in range(5)],
        [("triton", 30), ("dense", 3000), ("triton", 5)]),
    "a long chunk, a fresh prompt": ([(1000, 2200), (0, 300), (40, 1)],
                                     [("paged", 2200), ("dense", 300), ("triton", 1)]),
    "a fresh prompt before a chunk: all through the pages": ([(0, 2100), (500, 40), (9, 1)],
                                                             [("paged", 2140), ("triton", 1)]),
    "fresh prompts only": ([(0, 2048), (0, 7)], [("dense", 2055)]),
}


@pytest.mark.parametrize("step", list(STEPS))
def test_long_step_parts_match_the_whole_batch_reference(monkeypatch, step):
    lens, expected = STEPS[step]
    calls = []
    ref = TorchAttentionImpl(HEADS, DIM, DIM ** -0.5, KV_HEADS)
    impl = hybrid.HybridAttentionImpl(HEADS, DIM, DIM ** -0.5, KV_HEADS)
    impl.decode.attend = _fake_kernels(monkeypatch, ref, calls)
    batch = make_random_batch(lens, HEADS, KV_HEADS, DIM, BLOCK, torch.float32, "cpu", seed=random.Random(step).randrange(99))
    caches = batch.key_cache.clone(), batch.value_cache.clone()
    out = impl.forward(batch.query, batch.key, batch.value, *caches, batch.meta)
    want = ref.forward(batch.query, batch.key, batch.value, batch.key_cache, batch.value_cache, batch.meta)
    assert calls == expected
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(caches[0], batch.key_cache) and torch.equal(caches[1], batch.value_cache)
