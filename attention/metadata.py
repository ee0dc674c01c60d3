"""AttentionMetadataBuilder: one step's AttentionMetadata, a pure function of the scheduled sequences.

Everything is computed on the host with numpy, then each field becomes ONE tensor (pinned and copied
with non_blocking=True on CUDA), so a step costs one small host-to-device copy per field.

Padding (CUDA graphs replay a fixed batch shape): `pad_to_num_tokens` / `pad_to_num_seqs` append
padded sequences after the decodes. A padded sequence is a decode that attends to one key:

    context_len 0, query_len 1, seq_len 1, block_tables row all 0, slot_mapping PAD_SLOT_ID

seq_len 1 (not 0) keeps every kernel safe without a special case: each query row has one valid key
(no empty softmax, so no 0/0), and it reads slot 0 of block 0, which always exists. The padding
token's K/V are never written, so that key is whatever block 0 holds; its output row is garbage by
design and the caller drops it.

A mixed CUDA graph has a fixed token count AND a fixed sequence count, which a batch pads to unequally.
Then the first padded sequence is one fresh prompt holding every padding token (block_tables row 0, so
it reads block 0 only, never writes), the others are empty (query_len 0, seq_len 0: no query rows, no
work), and the metadata declares every sequence a prefill (num_decode_tokens 0): kernels take their
general path, which serves a decode (query_len 1) as a one-token chunk, so nothing in the graph depends
on how many prefills and decodes the batch holds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from attention.base import PAD_SLOT_ID, AttentionMetadata


@dataclass(slots=True)  # not frozen: a frozen dataclass takes ~3x longer to build, and the runner builds one
class SeqSpec:            # per sequence per step; nothing changes one after it is made
    """One scheduled sequence: `context_len` tokens already cached, `query_len` new ones this step.
    `block_ids` may be the caller's live list, but only ever appended to while it is handed in (a freed
    sequence gets a new list): BlockTableRows relies on it."""

    context_len: int
    query_len: int
    block_ids: Sequence[int]  # the sequence's physical blocks in order; at least ceil(seq_len / block_size)

    @property
    def seq_len(self) -> int:
        return self.context_len + self.query_len


def _seq_arrays(seqs: Sequence[SeqSpec], block_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(context_lens, query_lens) as int64 arrays and the number of prefills (query_len > 1), which must
    come first. Validates the batch with whole-array checks: this runs every step over every sequence."""
    n = len(seqs)
    context = np.fromiter((s.context_len for s in seqs), np.int64, n)
    query = np.fromiter((s.query_len for s in seqs), np.int64, n)
    num_blocks = np.fromiter((len(s.block_ids) for s in seqs), np.int64, n)
    if (bad := np.flatnonzero((query < 1) | (context < 0))).size:
        raise ValueError(f"sequence {bad[0]}: query_len must be >= 1 and context_len >= 0, got {seqs[bad[0]]}")
    if (bad := np.flatnonzero(num_blocks * block_size < context + query)).size:
        i = int(bad[0])
        raise ValueError(f"sequence {i}: {num_blocks[i]} blocks of {block_size} cannot hold "
                         f"seq_len {seqs[i].seq_len}")
    is_prefill = query > 1
    num_prefills = int(is_prefill.sum())
    if is_prefill[num_prefills:].any():
        i = num_prefills + int(is_prefill[num_prefills:].argmax())
        raise ValueError(f"sequence {i} is a prefill after a decode: prefills must come first")
    return context, query, num_prefills


def _num_padding(num_real: int, pad_to: int | None, what: str) -> int | None:
    if pad_to is None:
        return None
    if pad_to < num_real:
        raise ValueError(f"cannot pad {num_real} {what} down to {pad_to}")
    return pad_to - num_real


def _padding_query_lens(num_tokens: int, num_seqs: int, pad_to_num_tokens: int | None,
                        pad_to_num_seqs: int | None) -> np.ndarray:
    """query_len of each padded sequence: all 1 when the two paddings agree (or one is not given);
    otherwise one prompt of every padding token, then empty sequences (see the module doc)."""
    pad_tokens = _num_padding(num_tokens, pad_to_num_tokens, "tokens")
    pad_seqs = _num_padding(num_seqs, pad_to_num_seqs, "sequences")
    if pad_tokens is None or pad_seqs is None or pad_tokens == pad_seqs:
        return np.ones(pad_tokens if pad_tokens is not None else (pad_seqs or 0), np.int64)
    if pad_seqs == 0:
        raise ValueError(f"padding {pad_tokens} tokens needs a padded sequence to hold them: "
                         f"pad_to_num_seqs={pad_to_num_seqs} leaves none")
    lens = np.zeros(pad_seqs, np.int64)
    lens[0] = pad_tokens
    return lens


@dataclass
class HostMetadata:
    """AttentionMetadata's fields as host arrays, before any copy: CUDA-graph steps write these straight
    into their pinned staging buffers instead of making one device tensor per field."""

    num_prefills: int
    num_prefill_tokens: int
    slot_mapping: np.ndarray  # [num_tokens] int64
    block_tables: np.ndarray  # [num_seqs, width] int32
    seq_lens: np.ndarray  # [num_seqs] int64
    context_lens: np.ndarray  # [num_seqs] int64
    query_start_loc: np.ndarray  # [num_seqs + 1] int64
    seq_start_loc: np.ndarray  # [num_seqs + 1] int64

    @property
    def max_query_len(self) -> int:
        return int(np.diff(self.query_start_loc).max())

    @property
    def max_seq_len(self) -> int:
        return int(self.seq_lens.max())


class BlockTableRows:
    """A block table that lives across steps (a CUDA graph's staging buffer): each row is rewritten only
    where its sequence changed or grew, instead of every row every step (at 256 decodes and 2k context,
    filling 256 rows of 128 ids was most of a step's metadata time). A row is known by the block_ids
    list it was written from and how many ids it holds; entries past those are 0, as in a fresh table."""

    def __init__(self, table: np.ndarray) -> None:
        self.table = table  # [max_rows, width] int32, all 0 at start
        self._held: list[Sequence[int] | None] = [None] * table.shape[0]  # per row: the list it was written from
        self._counts = [0] * table.shape[0]  # per row: how many ids it holds

    def fill(self, seqs: Sequence[SeqSpec], needed: list[int], num_rows: int) -> np.ndarray:
        """Rows 0..num_rows-1: sequence i's first needed[i] block ids, then padding rows (all 0).
        Returns the [num_rows, width] view."""
        table, held, counts = self.table, self._held, self._counts
        for i, (seq, n) in enumerate(zip(seqs, needed)):
            ids, m = seq.block_ids, counts[i]
            if held[i] is ids:  # the same list: only appended to since (SeqSpec)
                if n == m:
                    continue  # most rows of a decode step: nothing to write
                if n > m:
                    table[i, m:n] = ids[m:n]
            elif n:
                table[i, :n] = ids[:n] if len(ids) != n else ids
            if m > n:
                table[i, n:m] = 0
            held[i], counts[i] = ids, n
        for i in range(len(seqs), num_rows):  # padding rows: all 0
            if counts[i]:
                table[i, :counts[i]] = 0
            held[i], counts[i] = None, 0
        return table[:num_rows]


class AttentionMetadataBuilder:
    def __init__(self, block_size: int, device: torch.device | str) -> None:
        self.block_size = block_size
        self.device = torch.device(device)

    def build(self, seqs: Sequence[SeqSpec], pad_to_num_tokens: int | None = None,
              pad_to_num_seqs: int | None = None, pad_to_blocks_per_seq: int | None = None) -> AttentionMetadata:
        """`seqs`: prefills first, then decodes. Padding (see the module doc) appends padded decodes;
        one padding token per padded sequence, so given both, the two paddings must be equal.
        `pad_to_blocks_per_seq` widens block_tables (a CUDA graph's fixed width)."""
        host = self.build_host(seqs, pad_to_num_tokens, pad_to_num_seqs, pad_to_blocks_per_seq)
        num_tokens = int(host.query_start_loc[-1])
        return AttentionMetadata(
            num_prefills=host.num_prefills,
            num_prefill_tokens=host.num_prefill_tokens,
            num_decode_tokens=num_tokens - host.num_prefill_tokens,
            slot_mapping=self._to_device(host.slot_mapping, torch.int64),
            block_tables=self._to_device(host.block_tables, torch.int32),
            seq_lens=self._to_device(host.seq_lens, torch.int32),
            context_lens=self._to_device(host.context_lens, torch.int32),
            query_start_loc=self._to_device(host.query_start_loc, torch.int32),
            seq_start_loc=self._to_device(host.seq_start_loc, torch.int32),
            max_query_len=host.max_query_len,
            max_seq_len=host.max_seq_len,
        )

    def build_host(self, seqs: Sequence[SeqSpec], pad_to_num_tokens: int | None = None,
                   pad_to_num_seqs: int | None = None, pad_to_blocks_per_seq: int | None = None,
                   table_rows: BlockTableRows | None = None) -> HostMetadata:
        """build()'s arrays on the host; same arguments. `table_rows`: write block_tables into that
        persistent table (its width must be pad_to_blocks_per_seq) rather than a new array."""
        if not seqs:
            raise ValueError("cannot build attention metadata for an empty batch")
        context, query, num_prefills = _seq_arrays(seqs, self.block_size)
        num_real_tokens = int(query.sum())
        pad_query_lens = _padding_query_lens(num_real_tokens, len(seqs), pad_to_num_tokens, pad_to_num_seqs)
        num_pad = len(pad_query_lens)
        general = bool((pad_query_lens != 1).any())

        context_lens = np.concatenate((context, np.zeros(num_pad, np.int64)))
        query_lens = np.concatenate((query, pad_query_lens))
        seq_lens = context_lens + query_lens
        block_tables = self._block_tables(seqs, seq_lens, num_pad, pad_to_blocks_per_seq, table_rows)
        query_start_loc = np.concatenate(([0], np.cumsum(query_lens)))
        seq_start_loc = np.concatenate(([0], np.cumsum(seq_lens)))
        slot_mapping = np.full(int(query_start_loc[-1]), PAD_SLOT_ID, np.int64)
        slot_mapping[:num_real_tokens] = self._slot_mapping(block_tables, context, query, query_start_loc)
        if general:  # every sequence through the general path (see the module doc)
            num_prefills = len(query_lens)
        return HostMetadata(num_prefills, int(query_lens[:num_prefills].sum()), slot_mapping, block_tables, seq_lens,
                            context_lens, query_start_loc, seq_start_loc)

    def _block_tables(self, seqs: Sequence[SeqSpec], seq_lens: np.ndarray, num_pad: int,
                      pad_to_blocks_per_seq: int | None, table_rows: BlockTableRows | None) -> np.ndarray:
        # [num_seqs, width] int32, rows zero-padded; only the blocks a sequence needs are listed. A padded
        # sequence's row is all block 0, but it must be as wide as its length needs (the kernels read it).
        blocks = -(-seq_lens // self.block_size)  # [num_seqs] blocks each sequence reads
        needed, width = blocks[:len(seqs)].tolist(), int(blocks.max())
        if pad_to_blocks_per_seq is not None:
            if pad_to_blocks_per_seq < width:
                raise ValueError(f"a sequence needs {width} blocks, more than pad_to_blocks_per_seq="
                                 f"{pad_to_blocks_per_seq}")
            width = pad_to_blocks_per_seq
        if table_rows is None:  # a fresh table: a persistent one used once
            table_rows = BlockTableRows(np.zeros((len(seqs) + num_pad, width), dtype=np.int32))
        assert table_rows.table.shape[1] == width, "a persistent table has the padded width"
        return table_rows.fill(seqs, needed, len(seqs) + num_pad)

    def _slot_mapping(self, block_tables: np.ndarray, context_lens: np.ndarray, query_lens: np.ndarray,
                      query_start_loc: np.ndarray) -> np.ndarray:
        # The real tokens at once: sequence, absolute position, then block * block_size + offset.
        seq_of_token = np.repeat(np.arange(len(query_lens)), query_lens)  # [num_tokens]
        positions = (np.arange(len(seq_of_token)) - query_start_loc[seq_of_token]
                     + context_lens[seq_of_token])
        blocks = block_tables[seq_of_token, positions // self.block_size].astype(np.int64)
        return blocks * self.block_size + positions % self.block_size

    def _to_device(self, array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        # from_numpy shares the array's memory: torch.tensor(ndarray) is many times slower for a block table.
        host = torch.from_numpy(np.ascontiguousarray(array)).to(dtype)
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)
