"""AttentionMetadataBuilder against tensors worked out by hand (block_size 4)."""
from __future__ import annotations

import pytest
import torch

from attention.base import PAD_SLOT_ID
from attention.metadata import AttentionMetadataBuilder, SeqSpec

BS = 4
# Two prefills (one fresh, one a chunk over 6 cached tokens) then three decodes; blocks out of order.
MIXED = [
    SeqSpec(context_len=0, query_len=5, block_ids=[7, 2]),  # positions 0..4 -> block 7 (0..3), block 2 (4)
    SeqSpec(context_len=6, query_len=3, block_ids=[5, 1, 8]),  # positions 6, 7 -> block 1; 8 -> block 8
    SeqSpec(context_len=3, query_len=1, block_ids=[4]),  # position 3 -> block 4 offset 3
    SeqSpec(context_len=8, query_len=1, block_ids=[6, 10, 11]),  # position 8 -> block 11 offset 0
    SeqSpec(context_len=4, query_len=1, block_ids=[13, 12, 9]),  # position 4 -> block 12; block 9 unused
]
SLOTS = [7 * 4 + 0, 7 * 4 + 1, 7 * 4 + 2, 7 * 4 + 3, 2 * 4 + 0,
         1 * 4 + 2, 1 * 4 + 3, 8 * 4 + 0,
         4 * 4 + 3, 11 * 4 + 0, 12 * 4 + 0]
TABLES = [[7, 2, 0], [5, 1, 8], [4, 0, 0], [6, 10, 11], [13, 12, 0]]


def _eq(t: torch.Tensor, expected: list, dtype: torch.dtype) -> None:
    assert t.dtype == dtype
    assert t.tolist() == expected


def test_mixed_batch_exact_tensors():
    m = AttentionMetadataBuilder(BS, "cpu").build(MIXED)
    assert (m.num_prefills, m.num_prefill_tokens, m.num_decode_tokens) == (2, 8, 3)
    assert (m.num_seqs, m.num_tokens, m.max_query_len, m.max_seq_len) == (5, 11, 5, 9)
    _eq(m.slot_mapping, SLOTS, torch.int64)
    _eq(m.block_tables, TABLES, torch.int32)
    _eq(m.seq_lens, [5, 9, 4, 9, 5], torch.int32)
    _eq(m.context_lens, [0, 6, 3, 8, 4], torch.int32)
    _eq(m.query_start_loc, [0, 5, 8, 9, 10, 11], torch.int32)
    _eq(m.seq_start_loc, [0, 5, 14, 18, 27, 32], torch.int32)


def test_padding_appends_one_token_decodes_that_write_nothing():
    m = AttentionMetadataBuilder(BS, "cpu").build(MIXED, pad_to_num_tokens=13, pad_to_num_seqs=7,
                                                  pad_to_blocks_per_seq=5)
    assert (m.num_prefills, m.num_prefill_tokens, m.num_decode_tokens) == (2, 8, 5)
    assert (m.num_seqs, m.max_query_len, m.max_seq_len) == (7, 5, 9)
    _eq(m.slot_mapping, SLOTS + [PAD_SLOT_ID, PAD_SLOT_ID], torch.int64)
    _eq(m.block_tables, [row + [0, 0] for row in TABLES] + [[0] * 5] * 2, torch.int32)
    _eq(m.seq_lens, [5, 9, 4, 9, 5, 1, 1], torch.int32)
    _eq(m.context_lens, [0, 6, 3, 8, 4, 0, 0], torch.int32)
    _eq(m.query_start_loc, [0, 5, 8, 9, 10, 11, 12, 13], torch.int32)
    _eq(m.seq_start_loc, [0, 5, 14, 18, 27, 32, 33, 34], torch.int32)


def test_padding_one_side_implies_the_other():
    decodes = MIXED[2:]
    by_tokens = AttentionMetadataBuilder(BS, "cpu").build(decodes, pad_to_num_tokens=4)
    by_seqs = AttentionMetadataBuilder(BS, "cpu").build(decodes, pad_to_num_seqs=4)
    for m in (by_tokens, by_seqs):
        assert (m.num_prefills, m.num_decode_tokens, m.num_seqs) == (0, 4, 4)
        _eq(m.slot_mapping, SLOTS[8:] + [PAD_SLOT_ID], torch.int64)
        _eq(m.seq_lens, [4, 9, 5, 1], torch.int32)


def test_unequal_padding_makes_one_padding_prompt_then_empty_sequences():
    """A mixed CUDA graph's layout: 11 real tokens in 5 sequences padded to 15 tokens in 8 sequences."""
    m = AttentionMetadataBuilder(BS, "cpu").build(MIXED, pad_to_num_tokens=15, pad_to_num_seqs=8,
                                                  pad_to_blocks_per_seq=4)
    # Every sequence declared a prefill: kernels take their general path for the whole batch.
    assert (m.num_prefills, m.num_prefill_tokens, m.num_decode_tokens) == (8, 15, 0)
    assert (m.num_seqs, m.max_query_len, m.max_seq_len) == (8, 5, 9)
    _eq(m.slot_mapping, SLOTS + [PAD_SLOT_ID] * 4, torch.int64)
    _eq(m.block_tables, [row + [0] for row in TABLES] + [[0] * 4] * 3, torch.int32)
    _eq(m.seq_lens, [5, 9, 4, 9, 5, 4, 0, 0], torch.int32)
    _eq(m.context_lens, [0, 6, 3, 8, 4, 0, 0, 0], torch.int32)
    _eq(m.query_start_loc, [0, 5, 8, 9, 10, 11, 15, 15, 15], torch.int32)
    _eq(m.seq_start_loc, [0, 5, 14, 18, 27, 32, 36, 36, 36], torch.int32)
    exact = AttentionMetadataBuilder(BS, "cpu").build(MIXED, pad_to_num_tokens=11, pad_to_num_seqs=7)
    _eq(exact.query_start_loc, [0, 5, 8, 9, 10, 11, 11, 11], torch.int32)  # no padding tokens: all empty
    assert (exact.num_prefills, exact.num_decode_tokens) == (7, 0)


def test_builder_is_a_pure_function():
    b = AttentionMetadataBuilder(BS, "cpu")
    first = b.build(MIXED, pad_to_num_tokens=12)
    b.build(MIXED[2:])
    again = b.build(MIXED, pad_to_num_tokens=12)
    for field in ("slot_mapping", "block_tables", "seq_lens", "context_lens", "query_start_loc", "seq_start_loc"):
        assert torch.equal(getattr(first, field), getattr(again, field))


@pytest.mark.parametrize("seqs, kwargs, match", [
    ([MIXED[2], MIXED[0]], {}, "prefills must come first"),
    ([SeqSpec(0, 0, [1])], {}, "query_len"),
    ([SeqSpec(4, 2, [1])], {}, "cannot hold"),
    (MIXED, {"pad_to_num_tokens": 10}, "cannot pad"),
    (MIXED, {"pad_to_num_tokens": 13, "pad_to_num_seqs": 5}, "needs a padded sequence"),
    (MIXED, {"pad_to_num_tokens": 24, "pad_to_num_seqs": 6, "pad_to_blocks_per_seq": 3}, "pad_to_blocks_per_seq"),
    (MIXED, {"pad_to_blocks_per_seq": 2}, "pad_to_blocks_per_seq"),
    ([], {}, "empty"),
])
def test_rejects_bad_batches(seqs, kwargs, match):
    with pytest.raises(ValueError, match=match):
        AttentionMetadataBuilder(BS, "cpu").build(seqs, **kwargs)


def test_persistent_block_table_rows_equal_fresh_tables():
    """BlockTableRows (a CUDA graph's staging table, kept across steps) against a fresh table every step,
    over random steps: sequences grow and gain blocks, finish (their list is replaced, as the KV manager
    does), join, are reordered and are preempted; padded rows; batches shrinking and growing."""
    import random

    import numpy as np

    from attention.metadata import BlockTableRows

    rng = random.Random(5)
    builder, width, rows = AttentionMetadataBuilder(BS, "cpu"), 12, 10
    persistent = BlockTableRows(np.zeros((rows, width), np.int32))
    live: list[list] = []  # [context_len, block_ids]
    next_block = 0

    def new_blocks(n):
        nonlocal next_block
        next_block += n
        return list(range(next_block - n, next_block))

    for step in range(300):
        if live and rng.random() < 0.15:
            live.pop(rng.randrange(len(live)))[1] = []  # finished or preempted: the list is replaced
        live = [e for e in live if e[0] + 1 < (width - 1) * BS]  # the longest finish
        while len(live) < rng.randint(1, 8):
            ctx = rng.randint(0, 30)
            live.append([ctx, new_blocks(ctx // BS + 1)])
        if rng.random() < 0.3:
            rng.shuffle(live)
        seqs = []
        for entry in live:  # a decode each: one more token, a new block when the last one is full
            ctx, ids = entry
            if (ctx + 1) > len(ids) * BS:
                ids.extend(new_blocks(1))
            if rng.random() < 0.2:
                ids.extend(new_blocks(1))  # a block allocated ahead (more ids than the row lists)
            seqs.append(SeqSpec(context_len=ctx, query_len=1, block_ids=ids))
            entry[0] = ctx + 1
        pad = rng.randint(len(seqs), rows)
        got = builder.build_host(seqs, pad_to_num_tokens=pad, pad_to_blocks_per_seq=width, table_rows=persistent)
        want = builder.build_host(seqs, pad_to_num_tokens=pad, pad_to_blocks_per_seq=width)
        np.testing.assert_array_equal(got.block_tables, want.block_tables, err_msg=f"step {step}")
        np.testing.assert_array_equal(got.slot_mapping, want.slot_mapping)
    # Rows past the widest batch are never read; every other entry matched a fresh table each step.
    assert next_block > 100
