"""Steps replayed from CUDA graphs, one graph per padded token count, of two kinds:

- decode graphs: T one-token sequences (a decode step, padded with one-token decodes);
- mixed graphs: up to max_num_seqs sequences of any kind (prefill chunks and decodes) in T tokens, padded
  to T tokens and max_num_seqs + 1 sequences: one padding prompt, then empty sequences (attention.metadata).
  Every sequence takes the kernel's general path, so one graph serves any make-up of the batch. Only for
  backends whose graph_support is GraphSupport.MIXED.

A step of a small model is dominated by host work: 24 layers x ~10 kernels launched one by one, plus
one small copy per input tensor. Here a step costs the host two copies and one replay:
- every per-step input (token ids, positions, attention metadata) is written on the host into one
  pinned int64 and one pinned int32 staging buffer, each copied to its device twin in one go; the
  graphs were captured reading views of those device buffers;
- tokens sampled by the previous step, still on the device, are gathered inside the graph
  (`prev_rows`), so the host never waits for them;
- the graph ends with the final hidden states; the caller computes the logits of the rows it samples.

Without capture (`capture=False`, e.g. on a CPU) the same buffers feed an eager forward: tests use it
to check everything here but the capture itself.
"""
from __future__ import annotations

import logging
from bisect import bisect_left
from itertools import accumulate

import numpy as np
import torch
from tqdm import tqdm

from attention.base import AttentionMetadata
from attention.metadata import AttentionMetadataBuilder, BlockTableRows, SeqSpec

logger = logging.getLogger(__name__)

MAX_MIXED_GRAPH_TOKENS = 1024  # above this a step is long enough on the device that launches do not matter


def decode_graph_sizes(max_batch_size: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_batch_size + 1, 16))
    return sorted({s for s in sizes if s <= max_batch_size} | {max_batch_size})


def mixed_graph_sizes(max_tokens: int) -> list[int]:
    sizes = [32, 64, 128, 256, 384, 512, 768, 1024]
    return sorted({s for s in sizes if s <= max_tokens} | {max_tokens})


class PackedBuffers:
    """Named 1-D fields packed into one device tensor, filled from one of two pinned host twins.

    Two host twins, used in turn: with async scheduling the host fills step N+1's inputs while step N's
    copy may still be queued behind step N-1, so a single staging buffer could be overwritten before
    the device read it. Each twin's last copy is fenced by an event that is waited on before reuse.
    """

    def __init__(self, sizes: dict[str, int], dtype: torch.dtype, device: torch.device) -> None:
        offsets = dict(zip(sizes, accumulate(sizes.values(), initial=0)))
        self.slices = {name: slice(offsets[name], offsets[name] + n) for name, n in sizes.items()}
        total = sum(sizes.values())
        self.device_buf = torch.zeros(total, dtype=dtype, device=device)
        self.on_cuda = device.type == "cuda"
        self.host_bufs = [torch.zeros(total, dtype=dtype, pin_memory=self.on_cuda) for _ in range(2)]
        self.fences = [torch.cuda.Event() if self.on_cuda else None for _ in range(2)]
        # Each twin's fields as numpy views, made once: host() is called every step.
        self.host_views = [{name: buf.numpy()[s] for name, s in self.slices.items()} for buf in self.host_bufs]
        self.turn = 0

    def device(self, name: str) -> torch.Tensor:
        return self.device_buf[self.slices[name]]

    def host(self) -> dict[str, np.ndarray]:
        """The next host twin's fields as numpy views, safe to write once its previous copy finished."""
        self.turn ^= 1
        if self.fences[self.turn] is not None:
            self.fences[self.turn].synchronize()
        return self.host_views[self.turn]

    def upload(self) -> None:
        """Copy the twin last returned by host() to the device (queued; the host does not wait)."""
        self.device_buf.copy_(self.host_bufs[self.turn], non_blocking=self.on_cuda)
        if self.on_cuda:
            self.fences[self.turn].record()


class CudaGraphSteps:
    def __init__(self, model, kv_caches, builder: AttentionMetadataBuilder, sizes: list[int], max_num_seqs: int,
                 max_blocks_per_seq: int, max_prev_rows: int, device: torch.device, mixed: bool,
                 capture: bool = True) -> None:
        """sizes: the token counts captured. Decode graphs need max_num_seqs >= max(sizes)."""
        self.model = model
        self.kv_caches = kv_caches
        self.builder = builder
        self.max_blocks_per_seq = max_blocks_per_seq
        self.sizes = sorted(sizes)
        self.mixed = mixed
        self.max_num_seqs = max_num_seqs
        self.capture_graphs = capture
        t, s = self.sizes[-1], self._num_seqs(self.sizes[-1])
        self.i64 = PackedBuffers({"input_ids": t, "prev_rows": t, "positions": t, "slot_mapping": t},
                                 torch.int64, device)
        self.i32 = PackedBuffers({"seq_lens": s, "context_lens": s, "query_start_loc": s + 1,
                                  "seq_start_loc": s + 1, "block_tables": s * max_blocks_per_seq},
                                 torch.int32, device)
        # One persistent block table per host twin: a step rewrites only the rows that changed.
        self.table_rows = [BlockTableRows(buf[self.i32.slices["block_tables"]].reshape(s, max_blocks_per_seq))
                           for buf in (b.numpy() for b in self.i32.host_bufs)]
        self.prev_tokens = torch.zeros(max(max_prev_rows, 1), dtype=torch.int64, device=device)
        self._write_padding_batch()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    @property
    def kind(self) -> str:
        return "mixed" if self.mixed else "decode"

    def _num_seqs(self, num_tokens: int) -> int:
        """Sequences in the graph of num_tokens tokens: one per token (decode), or a fixed count (mixed)."""
        return self.max_num_seqs + 1 if self.mixed else num_tokens

    def _write_padding_batch(self, size: int | None = None) -> None:
        """Fill the buffers with a valid all-padding batch of `size` tokens (default: the largest): what
        warm-up and capture of that size run on. Per size: a mixed graph's sequence count is fixed, so a
        batch staged for a larger size would run its padding prompt past the smaller graph's tokens."""
        seqs = [SeqSpec(0, 1, [0])]
        for _ in range(2):  # both host twins
            self._stage(seqs, [0], [0], [-1], size or self.sizes[-1])

    def _meta(self, num_tokens: int) -> AttentionMetadata:
        """Views of the device buffers for a padded batch of num_tokens tokens: what a graph reads."""
        d = self.i32.device
        s = self._num_seqs(num_tokens)
        prefill_tokens = num_tokens if self.mixed else 0  # mixed: every sequence on the general path
        tables = d("block_tables").view(-1, self.max_blocks_per_seq)
        return AttentionMetadata(s if self.mixed else 0, prefill_tokens, num_tokens - prefill_tokens,
                                 self.i64.device("slot_mapping")[:num_tokens], tables[:s], d("seq_lens")[:s],
                                 d("context_lens")[:s], d("query_start_loc")[:s + 1], d("seq_start_loc")[:s + 1],
                                 max_query_len=num_tokens if self.mixed else 1,
                                 max_seq_len=self.max_blocks_per_seq * self.builder.block_size)

    def _forward(self, num_tokens: int) -> torch.Tensor:
        """The captured body: gather inputs sampled by the previous step, run the model -> [T, hidden]."""
        rows = self.i64.device("prev_rows")[:num_tokens]  # [T]: row of prev_tokens, or -1 for a known input
        ids = torch.where(rows >= 0, self.prev_tokens[rows.clamp(min=0)], self.i64.device("input_ids")[:num_tokens])
        return self.model(ids, self.i64.device("positions")[:num_tokens], self.kv_caches, self._meta(num_tokens))

    def warm_up(self, size: int) -> torch.Tensor:
        """Stage a padding batch of `size` tokens and run it once (autotune, JIT): what capture records."""
        self._write_padding_batch(size)
        return self._forward(size)

    @torch.inference_mode()
    def capture(self, pool=None):
        """Capture every size (largest first, so the smaller ones fit in its memory); returns the pool."""
        if not self.capture_graphs:
            return pool
        for size in tqdm(sorted(self.sizes, reverse=True), desc=f"capturing {self.kind} CUDA graphs", leave=False):
            self.warm_up(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            pool = graph.pool() if pool is None else pool
            self.graphs[size] = graph
        torch.cuda.synchronize()
        logger.info("captured %d %s CUDA graphs for token counts %s", len(self.graphs), self.kind, self.sizes)
        return pool

    def padded_size(self, num_tokens: int) -> int | None:
        i = bisect_left(self.sizes, num_tokens)
        return self.sizes[i] if i < len(self.sizes) else None

    def can_run(self, seqs: list[SeqSpec], num_tokens: int, num_prev_rows: int) -> bool:
        if self.padded_size(num_tokens) is None or num_prev_rows > self.prev_tokens.shape[0]:
            return False
        if self.mixed and len(seqs) > self.max_num_seqs:  # one sequence slot is kept for the padding prompt
            return False
        # Every query_len is >= 1, so a batch of as many tokens as sequences is all decodes.
        if not self.mixed and num_tokens != len(seqs):
            return False
        return max([len(s.block_ids) for s in seqs], default=0) <= self.max_blocks_per_seq

    def _stage(self, seqs: list[SeqSpec], input_ids: list[int], positions: list[int], prev_rows: list[int],
               size: int) -> None:
        """Write a step's inputs into the next host twins and queue their copies."""
        self._write(seqs, input_ids, positions, prev_rows, size)
        self.i64.upload()
        self.i32.upload()

    def _write(self, seqs: list[SeqSpec], input_ids: list[int], positions: list[int], prev_rows: list[int],
               size: int) -> None:
        n = len(input_ids)
        h64, h32 = self.i64.host(), self.i32.host()  # waits until the twin's last copy is done
        meta = self.builder.build_host(seqs, pad_to_num_tokens=size, pad_to_num_seqs=self._num_seqs(size),
                                       pad_to_blocks_per_seq=self.max_blocks_per_seq,
                                       table_rows=self.table_rows[self.i32.turn])
        for name, values in (("input_ids", input_ids), ("positions", positions), ("prev_rows", prev_rows)):
            h64[name][:n] = values
            h64[name][n:size] = -1 if name == "prev_rows" else 0
        h64["slot_mapping"][:size] = meta.slot_mapping
        for name in ("seq_lens", "context_lens", "query_start_loc", "seq_start_loc"):
            h32[name][:len(getattr(meta, name))] = getattr(meta, name)

    def run(self, seqs: list[SeqSpec], input_ids: list[int], positions: list[int], prev_rows: list[int],
            prev_tokens: torch.Tensor | None) -> torch.Tensor:
        """One step -> hidden states [len(input_ids), hidden]. prev_rows[i] >= 0: token i's input is row
        prev_rows[i] of prev_tokens (the previous step's sampled tokens, on the device); input_ids[i] is
        ignored then."""
        return self.replay(self.stage(seqs, input_ids, positions, prev_rows), len(input_ids), prev_tokens)

    def stage(self, seqs: list[SeqSpec], input_ids: list[int], positions: list[int], prev_rows: list[int]) -> int:
        """The host half of run(): write the step's inputs into the next host twins; returns the padded size.
        Nothing reaches the device until replay(), so the previous step may still be waiting to sample."""
        size = self.padded_size(len(input_ids))
        self._write(seqs, input_ids, positions, prev_rows, size)
        return size

    def replay(self, size: int, n: int, prev_tokens: torch.Tensor | None) -> torch.Tensor:
        """The device half of run(): copy the staged twins, gather the previous step's tokens, replay."""
        self.i64.upload()
        self.i32.upload()
        if prev_tokens is not None:
            self.prev_tokens[:prev_tokens.shape[0]].copy_(prev_tokens)
        if not self.capture_graphs:
            return self._forward(size)[:n]
        self.graphs[size].replay()
        return self.outputs[size][:n]
