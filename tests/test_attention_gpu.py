"""Every GPU attention backend against the torch reference, in bfloat16 (skipped without CUDA).

Each backend is skipped when its package is missing or it refuses the configuration (flash-attn 2.x
takes only block sizes that are multiples of 256).
"""
from __future__ import annotations

import random

import pytest
import torch

from attention import get_backend
from attention.base import PAD_SLOT_ID, GraphSupport
from attention.testing import make_random_batch, owned_slots, random_mixed_lens
from attention.torch_ref import TorchAttentionImpl

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BACKENDS = ["triton", "flash-attn", "flash-attn-4", "triton+flash-attn-4"]
NUM_KV_HEADS = 2
# (block_size, GQA group, head_dim): every block size, group and head dim appears, without the full product.
CONFIGS = [(16, 1, 64), (16, 7, 128), (64, 2, 128), (64, 8, 64), (128, 7, 64), (128, 1, 128),
           (256, 8, 128), (256, 2, 64)]


def _backend_or_skip(name: str, head_dim: int, block_size: int):
    try:
        return get_backend(name, torch.device("cuda"), head_dim, block_size)
    except ValueError as e:
        pytest.skip(str(e))


def _impls(backend, group: int, head_dim: int):
    args = (group * NUM_KV_HEADS, head_dim, head_dim ** -0.5, NUM_KV_HEADS)
    return backend.impl_cls(*args), TorchAttentionImpl(*args)


def _run_both(backend, batch, group: int, head_dim: int):
    """(backend output, reference output, backend caches, reference caches) on copies of one batch."""
    impl, ref_impl = _impls(backend, group, head_dim)
    caches = batch.key_cache.clone(), batch.value_cache.clone()
    ref_caches = batch.key_cache.clone(), batch.value_cache.clone()
    out = impl.forward(batch.query, batch.key, batch.value, *caches, batch.meta)
    ref = ref_impl.forward(batch.query, batch.key, batch.value, *ref_caches, batch.meta)
    return out, ref, caches, ref_caches


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _num_real(batch) -> int:
    return int((batch.meta.slot_mapping != PAD_SLOT_ID).sum())


@pytest.mark.parametrize("block_size, group, head_dim", CONFIGS)
@pytest.mark.parametrize("name", BACKENDS)
def test_mixed_batch_matches_reference(name, block_size, group, head_dim):
    backend = _backend_or_skip(name, head_dim, block_size)
    rng = random.Random(block_size * 100 + group * 10 + head_dim)
    # Decodes, fresh prefills and chunks over cached context, in one batch.
    lens = random_mixed_lens(rng, num_prefills=4, num_decodes=9, max_len=700)
    batch = make_random_batch(lens, group * NUM_KV_HEADS, NUM_KV_HEADS, head_dim, block_size, torch.bfloat16,
                              "cuda", seed=rng.randrange(1 << 30))
    out, ref, caches, ref_caches = _run_both(backend, batch, group, head_dim)
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    assert _rel_err(out, ref) < 1e-2
    assert torch.equal(caches[0], ref_caches[0]) and torch.equal(caches[1], ref_caches[1])


@pytest.mark.parametrize("block_size, group, head_dim", CONFIGS[::2])
@pytest.mark.parametrize("name", BACKENDS)
def test_padded_decode_batch_matches_reference(name, block_size, group, head_dim):
    """The CUDA-graph shape: decodes only, padded with one-token sequences; long and short contexts."""
    backend = _backend_or_skip(name, head_dim, block_size)
    lens = [(1, 1), (0, 1), (2500, 1), (block_size - 1, 1), (block_size, 1), (333, 1)]
    batch = make_random_batch(lens, group * NUM_KV_HEADS, NUM_KV_HEADS, head_dim, block_size, torch.bfloat16,
                              "cuda", seed=block_size + group, pad_to_num_tokens=8)
    out, ref, caches, ref_caches = _run_both(backend, batch, group, head_dim)
    n = _num_real(batch)
    assert _rel_err(out[:n], ref[:n]) < 1e-2
    assert torch.equal(caches[0], ref_caches[0]) and torch.equal(caches[1], ref_caches[1])


def _triton_against_reference(batch, head_dim: int):
    """(the reference's output, a call of our Triton kernel with options over the batch's caches, its new K/V
    written as the layer writes them)."""
    from attention.triton_paged import paged_attention_triton, write_kv_triton

    ref = TorchAttentionImpl(14, head_dim, head_dim ** -0.5, NUM_KV_HEADS).forward(
        batch.query, batch.key, batch.value, batch.key_cache.clone(), batch.value_cache.clone(), batch.meta)
    write_kv_triton(batch.key, batch.value, batch.key_cache, batch.value_cache, batch.meta.slot_mapping)
    return ref, lambda **options: paged_attention_triton(batch.query, batch.key_cache, batch.value_cache, batch.meta,
                                                         head_dim ** -0.5, sm_count=132, **options)


@pytest.mark.parametrize("num_splits", [1, 2, 8, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_triton_split_kv_matches_reference(num_splits, head_dim):
    _backend_or_skip("triton", head_dim, 16)
    lens = random_mixed_lens(random.Random(num_splits), num_prefills=2, num_decodes=5, max_len=3000)
    batch = make_random_batch(lens, 14, NUM_KV_HEADS, head_dim, 16, torch.bfloat16, "cuda", seed=num_splits)
    ref, triton_attention = _triton_against_reference(batch, head_dim)
    out = triton_attention(num_splits=num_splits)
    assert _rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("split_keys", [64, 256, 1024])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_triton_decode_ranges_match_reference(split_keys, head_dim):
    """Decode-only batches split each sequence by its length (ranges past its end exit, the merge reads only
    the used ones): mixed lengths, a graph's padded block table and padded sequences."""
    _backend_or_skip("triton", head_dim, 16)
    rng = random.Random(split_keys + head_dim)
    lens = [(0, 1), (1, 1), (split_keys - 1, 1), (split_keys, 1)] + [(rng.randint(0, 3000), 1) for _ in range(20)]
    batch = make_random_batch(lens, 14, NUM_KV_HEADS, head_dim, 16, torch.bfloat16, "cuda", seed=split_keys,
                              pad_to_num_tokens=32, pad_to_blocks_per_seq=4096 // 16)
    ref, triton_attention = _triton_against_reference(batch, head_dim)
    out = triton_attention(decode_split_keys=split_keys)
    n = len(lens)
    assert _rel_err(out[:n], ref[:n]) < 1e-2


@pytest.mark.parametrize("decode_kernel", ["pointer", "tma"])
@pytest.mark.parametrize("num_splits", [2, 4, 8])
def test_triton_decode_even_splits_match_reference(num_splits, decode_kernel):
    """benchmarks/attention_kernels.py's "even split" variants: every sequence in num_splits ranges of at least
    256 keys (short ones in fewer), over W-L-like contexts and short ones, 128-token pages."""
    _backend_or_skip("triton", 64, 128)
    if decode_kernel == "tma" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the TMA decode kernel needs Hopper")
    rng = random.Random(num_splits)
    lens = [(0, 1), (255, 1), (256, 1), (1000, 1)] + [(rng.randint(7000, 9000), 1) for _ in range(20)]
    batch = make_random_batch(lens, 14, NUM_KV_HEADS, 64, 128, torch.bfloat16, "cuda", seed=num_splits)
    ref, triton_attention = _triton_against_reference(batch, 64)
    out = triton_attention(num_splits=num_splits, decode_split_keys=256, decode_kernel=decode_kernel)
    assert _rel_err(out, ref) < 1e-2


# Decode tiles benchmarks/attention_kernels.py times against _tiles' choice (W-L's decode steps read K/V at
# ~3.3 TB/s of the H200's ~4.8): each checked here first, on 128- and 16-token pages.
DECODE_TILES = [(16, 128, 4, 2), (16, 128, 8, 3), (16, 64, 4, 4), (16, 256, 8, 2)]


@pytest.mark.parametrize("decode_kernel", ["pointer", "tma"])
@pytest.mark.parametrize("tiles", DECODE_TILES + [None])  # None: _tiles' choice
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_triton_decode_tiles_match_reference(tiles, block_size, head_dim, decode_kernel):
    _backend_or_skip("triton", head_dim, block_size)
    from attention.triton_decode_tma import tma_decode_fits
    from attention.triton_paged import _tiles

    block_n = (tiles or _tiles(head_dim, 7, True, block_size))[1]
    if decode_kernel == "tma" and not (tma_decode_fits(head_dim, block_size, block_n)
                                       and torch.cuda.get_device_capability()[0] >= 9):
        pytest.skip("the TMA decode kernel needs Hopper and pages of whole key tiles")

    rng = random.Random(block_size + (tiles or (0, 0))[1] + head_dim)
    lens = [(0, 1), (127, 1), (128, 1), (1024, 1)] + [(rng.randint(0, 9000), 1) for _ in range(28)]
    batch = make_random_batch(lens, 14, NUM_KV_HEADS, head_dim, block_size, torch.bfloat16, "cuda", seed=block_size)
    ref, triton_attention = _triton_against_reference(batch, head_dim)
    for split_keys in (256, 1024, 2048):  # 2048: _decode_split_keys' ranges over 128-token pages
        out = triton_attention(decode_split_keys=split_keys, tiles=tiles, decode_kernel=decode_kernel)
        assert _rel_err(out, ref) < 1e-2, (tiles, split_keys)


def test_triton_kv_write_matches_index_copy():
    _backend_or_skip("triton", 128, 16)
    from attention.triton_paged import write_kv_triton

    num_tokens, kv_heads, head_dim, num_slots = 300, 8, 128, 64 * 16
    gen = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(num_tokens, 3 * kv_heads * head_dim, device="cuda", generator=gen).bfloat16()
    # Strided views, as a fused qkv projection hands them over.
    key = qkv[:, :kv_heads * head_dim].view(num_tokens, kv_heads, head_dim)
    value = qkv[:, kv_heads * head_dim:2 * kv_heads * head_dim].view(num_tokens, kv_heads, head_dim)
    slots = torch.randperm(num_slots, device="cuda", generator=gen)[:num_tokens]
    slots[::7] = PAD_SLOT_ID
    caches = [torch.randn(num_slots // 16, 16, kv_heads, head_dim, device="cuda", generator=gen).bfloat16()
              for _ in range(2)]
    expected = [c.clone().view(-1, kv_heads, head_dim) for c in caches]
    keep = slots != PAD_SLOT_ID
    expected[0].index_copy_(0, slots[keep], key[keep])
    expected[1].index_copy_(0, slots[keep], value[keep])
    write_kv_triton(key, value, caches[0], caches[1], slots)
    assert torch.equal(caches[0].view(-1, kv_heads, head_dim), expected[0])
    assert torch.equal(caches[1].view(-1, kv_heads, head_dim), expected[1])


@pytest.mark.parametrize("name", BACKENDS)
def test_cuda_graph_replay_with_new_metadata(name):
    """Backends that claim CUDA-graph support: capture one padded decode batch, replay another."""
    backend = _backend_or_skip(name, 64, 16)
    if backend.graph_support is GraphSupport.NEVER:
        pytest.skip(f"{name} does not claim CUDA-graph support")
    group, head_dim = 7, 64

    def batch(seed: int, lens):
        return make_random_batch(lens, group * NUM_KV_HEADS, NUM_KV_HEADS, head_dim, 16, torch.bfloat16, "cuda",
                                 seed=seed, pad_to_num_tokens=8, num_blocks=400, pad_to_blocks_per_seq=128)

    static = batch(1, [(5, 1), (40, 1), (900, 1), (0, 1), (17, 1)])
    fresh = batch(2, [(1500, 1), (3, 1), (64, 1), (200, 1), (1, 1), (2000, 1)])
    impl, ref_impl = _impls(backend, group, head_dim)
    impl.forward(static.query, static.key, static.value, static.key_cache, static.value_cache, static.meta)  # compile
    _capture_then_replay_with(impl, ref_impl, static, fresh)


def _capture_then_replay_with(impl, ref_impl, static, fresh) -> None:
    """Capture impl.forward on `static`, copy `fresh`'s metadata and tensors into static's, replay: the
    output must match the reference on `fresh`, and the caches must be written as the reference writes them."""
    args = (static.query, static.key, static.value, static.key_cache, static.value_cache, static.meta)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = impl.forward(*args)
    for field in ("slot_mapping", "block_tables", "seq_lens", "context_lens", "query_start_loc", "seq_start_loc"):
        getattr(static.meta, field).copy_(getattr(fresh.meta, field))
    for attr in ("query", "key", "value", "key_cache", "value_cache"):
        getattr(static, attr).copy_(getattr(fresh, attr))
    graph.replay()
    ref = ref_impl.forward(fresh.query, fresh.key, fresh.value, fresh.key_cache, fresh.value_cache, fresh.meta)
    n = _num_real(fresh)
    assert _rel_err(out[:n], ref[:n]) < 1e-2
    assert torch.isfinite(out).all()
    assert torch.equal(static.key_cache, fresh.key_cache) and torch.equal(static.value_cache, fresh.value_cache)


def _mixed_graph_batch(seed: int, lens, group: int, head_dim: int):
    """A mixed graph's layout: 96 tokens in 12 sequences (a padding prompt, then empty sequences)."""
    return make_random_batch(lens, group * NUM_KV_HEADS, NUM_KV_HEADS, head_dim, 16, torch.bfloat16, "cuda",
                             seed=seed, pad_to_num_tokens=96, pad_to_num_seqs=12, num_blocks=600,
                             pad_to_blocks_per_seq=160)


@pytest.mark.parametrize("name", BACKENDS)
def test_mixed_cuda_graph_replay_with_another_batch_make_up(name):
    """Backends that claim mixed-graph support: capture one batch of prefills and decodes in the general
    layout, replay it with metadata of another batch (other prefill/decode counts, lengths, padding)."""
    group, head_dim = 7, 64
    backend = _backend_or_skip(name, head_dim, 16)
    if backend.graph_support is not GraphSupport.MIXED:
        pytest.skip(f"{name} does not claim mixed CUDA-graph support")
    static = _mixed_graph_batch(1, [(0, 30), (100, 20), (5, 1), (900, 1), (17, 1)], group, head_dim)
    fresh = _mixed_graph_batch(2, [(2000, 40), (0, 7), (300, 12), (0, 2), (64, 1), (1500, 1), (1, 1), (31, 1),
                                   (0, 1), (2400, 1), (7, 1)], group, head_dim)
    impl, ref_impl = _impls(backend, group, head_dim)
    eager, ref, _, _ = _run_both(backend, static, group, head_dim)  # the general layout, eagerly (and compiled)
    n = _num_real(static)
    assert _rel_err(eager[:n], ref[:n]) < 1e-2
    _capture_then_replay_with(impl, ref_impl, static, fresh)


def test_hybrid_sends_only_long_prefill_steps_to_flash_attn():
    """CUDA graphs must capture the Triton path only: every mixed graph is at most FLASH_MIN_TOKENS long."""
    from attention.hybrid import FLASH_MIN_TOKENS
    from engine.cuda_graphs import MAX_MIXED_GRAPH_TOKENS

    assert FLASH_MIN_TOKENS >= MAX_MIXED_GRAPH_TOKENS
    backend = _backend_or_skip("triton+flash-attn-4", 64, 16)
    impl = backend.impl_cls(14, 64, 64 ** -0.5, NUM_KV_HEADS)
    calls = []
    impl.prefill.forward = lambda *a: calls.append("flash") or impl.decode.forward(*a)
    cases = (([(0, 600), (40, 1)], []), ([(0, 3000), (40, 1)], ["flash"]), ([(0, 1500)] * 2, []), ([(900, 1)] * 4, []))
    for lens, expected in cases:
        calls.clear()
        batch = make_random_batch(lens, 14, NUM_KV_HEADS, 64, 16, torch.bfloat16, "cuda", seed=3)
        impl.forward(batch.query, batch.key, batch.value, batch.key_cache, batch.value_cache, batch.meta)
        assert calls == expected, lens


LONG_STEPS = {"long chunk": [(5000, 3192), (0, 4100), (0, 77)], "short chunk": [(8150, 42), (0, 8192), (0, 3000)]}


@pytest.mark.parametrize("step", list(LONG_STEPS))
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("name", ["triton", "flash-attn-4", "triton+flash-attn-4"])
def test_long_prefill_chunks_match_reference(name, block_size, step):
    """W-L's step shapes: an 8k prompt's chunk over cached context (long, or W-L's few dozen tokens), fresh
    prompts, decodes over ~8k keys, blocks scattered over the pool (issue 19: unmasked tiles, longest query
    blocks first, hybrid routing), in 16-token pages and in 128-token ones (flash-attn-4's TMA path on
    Hopper)."""
    backend = _backend_or_skip(name, 64, block_size)
    lens = LONG_STEPS[step] + [(8000 + 37 * i, 1) for i in range(6)]
    batch = make_random_batch(lens, 14, NUM_KV_HEADS, 64, block_size, torch.bfloat16, "cuda", seed=19)
    out, ref, caches, ref_caches = _run_both(backend, batch, 7, 64)
    assert _rel_err(out, ref) < 1e-2
    assert torch.equal(caches[0], ref_caches[0]) and torch.equal(caches[1], ref_caches[1])


@pytest.mark.parametrize("tiles", [(16, 128, 4, 2), (16, 128, 4, 3), (16, 128, 4, 4), (16, 64, 4, 3),
                                   (16, 64, 4, 4), (16, 128, 8, 3), (16, 64, 2, 4)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_triton_tma_decode_tiles_match_reference_over_nan_garbage(tiles, head_dim):
    """benchmarks/attention_kernels.py's TMA decode tiles: a tile past a sequence's end reads the page's other
    slots, here NaN, which must not reach the output."""
    _backend_or_skip("triton", head_dim, 128)
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the TMA decode kernel needs Hopper")
    import triton

    from attention.triton_paged import paged_attention_triton, write_kv_triton

    rng = random.Random(head_dim)
    lens = [(0, 1), (127, 1), (128, 1), (1024, 1)] + [(rng.randint(0, 9000), 1) for _ in range(28)]
    batch = make_random_batch(lens, 14, NUM_KV_HEADS, head_dim, 128, torch.bfloat16, "cuda", seed=3)
    ref = TorchAttentionImpl(14, head_dim, head_dim ** -0.5, NUM_KV_HEADS).forward(
        batch.query, batch.key, batch.value, batch.key_cache.clone(), batch.value_cache.clone(), batch.meta)
    write_kv_triton(batch.key, batch.value, batch.key_cache, batch.value_cache, batch.meta.slot_mapping)
    owned = owned_slots(batch)
    for cache in (batch.key_cache, batch.value_cache):
        cache.view(-1, NUM_KV_HEADS, head_dim)[~owned] = float("nan")
    for split_keys in (256, 1024):
        try:
            out = paged_attention_triton(batch.query, batch.key_cache, batch.value_cache, batch.meta,
                                         head_dim ** -0.5, sm_count=132, decode_split_keys=split_keys, tiles=tiles,
                                         decode_kernel="tma")
        except triton.runtime.errors.OutOfResources as e:  # 4 stages of 128 x 128 tiles: over the shared memory
            pytest.skip(str(e))
        assert _rel_err(out, ref) < 1e-2, (tiles, split_keys)
