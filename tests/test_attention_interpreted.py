"""Our Triton attention kernels on the CPU, through Triton's interpreter (TRITON_INTERPRET=1, set before triton
decorates a kernel, so in a process of its own): the TMA decode kernel and the pointer kernel against the
PyTorch reference, with NaN in every cache slot no sequence owns (a TMA tile past a sequence's end reads
them), over 128-token pages and 64-token ones, split-KV ranges on and off; and the pointer kernel over a
batch of chunked prefills (over cached context and without) before decodes, as the engine flattens them."""
from __future__ import annotations

import pytest

from interpreted import run_interpreted


PRELUDE = """
import random, sys, torch
from attention.testing import make_random_batch, owned_slots
from attention.torch_ref import TorchAttentionImpl
from attention.triton_paged import paged_attention_triton

def batch_and_reference(lens, block_size, seed):
    # The batch, its reference output, then NaN in every cache slot no sequence owns (a kernel that reads one
    # fails) and the new tokens' K/V in the cache as the layer writes them.
    b = make_random_batch(lens, 14, 2, 64, block_size, torch.float32, "cpu", seed=seed)
    ref = TorchAttentionImpl(14, 64, 0.125, 2).forward(b.query, b.key, b.value, b.key_cache.clone(),
                                                       b.value_cache.clone(), b.meta)
    owned, ok = owned_slots(b), b.meta.slot_mapping >= 0
    for cache, new in ((b.key_cache, b.key), (b.value_cache, b.value)):
        flat = cache.view(-1, 2, 64)
        flat[~owned] = float("nan")
        flat[b.meta.slot_mapping[ok]] = new[ok]
    return b, ref

def relative_error(out, ref):
    return ((out - ref).norm() / ref.norm()).item()

def report(errors):
    print("max relative error", max(errors))
    sys.exit(0 if max(errors) < 1e-5 else 1)
"""

DECODES = PRELUDE + """
def case(block_size, tiles, seed, lens=None, ranges=((256, None), (None, 1))):
    rng = random.Random(seed)
    lens = lens or [(0, 1), (block_size - 1, 1), (block_size, 1), (300, 1)] + [(rng.randint(0, 900), 1)
                                                                             for _ in range(4)]
    b, ref = batch_and_reference(lens, block_size, seed)
    errors = []
    for kernel in ("tma", "pointer"):
        for split_keys, num_splits in ranges:
            out = paged_attention_triton(b.query, b.key_cache, b.value_cache, b.meta, 0.125, sm_count=132,
                                         num_splits=num_splits, decode_split_keys=split_keys, tiles=tiles,
                                         decode_kernel=kernel)
            errors.append(relative_error(out, ref))
    return errors

# The last case: ranges of 2048 keys (_decode_split_keys' over 128-token pages), one sequence past one range.
report(case(128, (16, 128, 4, 2), 1) + case(64, (16, 64, 4, 3), 2)
       + case(128, (16, 128, 4, 2), 3, lens=[(2200, 1), (130, 1)], ranges=((2048, None),)))
"""


def test_decode_kernels_match_the_reference_through_tritons_interpreter():
    pytest.importorskip("triton")
    done = run_interpreted(DECODES)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]


MIXED = PRELUDE + """
lens = [(0, 37), (45, 19), (130, 3), (70, 1), (0, 1), (200, 1)]  # (cached context, new tokens): prefills first
errors = []
for seed, block_size in ((3, 16), (4, 64)):
    b, ref = batch_and_reference(lens, block_size, seed)
    errors.append(relative_error(paged_attention_triton(b.query, b.key_cache, b.value_cache, b.meta, 0.125,
                                                        sm_count=132), ref))
report(errors)
"""


def test_chunked_prefills_and_decodes_match_the_reference_through_tritons_interpreter():
    pytest.importorskip("triton")
    done = run_interpreted(MIXED)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]


def test_a_forced_tma_decode_refuses_tiles_that_straddle_pages():
    pytest.importorskip("triton")
    import torch

    from attention.testing import make_random_batch
    from attention.triton_paged import paged_attention_triton

    b = make_random_batch([(100, 1), (30, 1)], 14, 2, 64, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="pages of whole key tiles"):
        paged_attention_triton(b.query, b.key_cache, b.value_cache, b.meta, 0.125, sm_count=132,
                               tiles=(16, 64, 4, 2), decode_kernel="tma")
