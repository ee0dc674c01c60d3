"""Decode steps replayed from CUDA graphs, one graph per padded batch size.

A decode step of a small model is dominated by host work: 24 layers x ~10 kernels launched one by one,
plus one small copy per input tensor. Here a step costs the host two copies and one replay:
- every per-step input (token ids, positions, attention metadata) is written on the host into one
  pinned int64 and one pinned int32 staging buffer, each copied to its device twin in one go; the
  graphs were captured reading views of those device buffers;
- tokens sampled by the previous step, still on the device, are gathered inside the graph
  (`prev_rows`), so the host never waits for them;
- the graph ends with the logits: the sampler reads them straight from the graph's output.
The batch is padded up to the nearest captured size with PAD_SLOT_ID tokens (see attention.metadata).

Without capture (`capture=False`, e.g. on a CPU) the same buffers feed an eager forward: tests use it
to check everything here but the capture itself.
"""
from __future__ import annotations

import logging
from itertools import accumulate

import numpy as np
import torch
from tqdm import tqdm

from attention.base import AttentionMetadata
from attention.metadata import AttentionMetadataBuilder, SeqSpec

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_batch_size + 1, 16))
    return sorted({s for s in sizes if s <= max_batch_size} | {max_batch_size})


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
        self.turn = 0

    def device(self, name: str) -> torch.Tensor:
        return self.device_buf[self.slices[name]]

    def host(self) -> dict[str, np.ndarray]:
        """The next host twin's fields as numpy views, safe to write once its previous copy finished."""
        self.turn ^= 1
        if self.fences[self.turn] is not None:
            self.fences[self.turn].synchronize()
        buf = self.host_bufs[self.turn].numpy()
        return {name: buf[s] for name, s in self.slices.items()}

    def upload(self) -> None:
        """Copy the twin last returned by host() to the device (queued; the host does not wait)."""
        self.device_buf.copy_(self.host_bufs[self.turn], non_blocking=self.on_cuda)
        if self.on_cuda:
            self.fences[self.turn].record()


class CudaGraphDecoder:
    def __init__(self, model, kv_caches, builder: AttentionMetadataBuilder, max_batch_size: int,
                 max_blocks_per_seq: int, max_prev_rows: int, device: torch.device, capture: bool = True) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.builder = builder
        self.max_blocks_per_seq = max_blocks_per_seq
        self.sizes = graph_batch_sizes(max_batch_size)
        self.capture_graphs = capture
        b = max_batch_size
        self.i64 = PackedBuffers({"input_ids": b, "prev_rows": b, "positions": b, "slot_mapping": b},
                                 torch.int64, device)
        self.i32 = PackedBuffers({"seq_lens": b, "context_lens": b, "query_start_loc": b + 1,
                                  "seq_start_loc": b + 1, "block_tables": b * max_blocks_per_seq},
                                 torch.int32, device)
        self.prev_tokens = torch.zeros(max(max_prev_rows, 1), dtype=torch.int64, device=device)
        self._write_padding_batch()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _write_padding_batch(self) -> None:
        """Fill the buffers with a valid all-padding batch: what warm-up and capture run on."""
        seqs = [SeqSpec(0, 1, [0])]
        n = self.sizes[-1]
        self._stage(seqs, [0], [0], [-1], n)
        self._stage(seqs, [0], [0], [-1], n)  # both host twins

    def _meta(self, bs: int) -> AttentionMetadata:
        """Views of the device buffers for a padded batch of bs decodes: what a graph reads."""
        d = self.i32.device
        tables = d("block_tables").view(-1, self.max_blocks_per_seq)
        return AttentionMetadata(0, 0, bs, self.i64.device("slot_mapping")[:bs], tables[:bs], d("seq_lens")[:bs],
                                 d("context_lens")[:bs], d("query_start_loc")[:bs + 1], d("seq_start_loc")[:bs + 1],
                                 max_query_len=1, max_seq_len=self.max_blocks_per_seq * self.builder.block_size)

    def _forward(self, bs: int) -> torch.Tensor:
        """The captured body: gather inputs sampled by the previous step, run the model, [bs, vocab] logits."""
        rows = self.i64.device("prev_rows")[:bs]  # [bs]: row of prev_tokens, or -1 for a known input
        ids = torch.where(rows >= 0, self.prev_tokens[rows.clamp(min=0)], self.i64.device("input_ids")[:bs])
        hidden = self.model(ids, self.i64.device("positions")[:bs], self.kv_caches, self._meta(bs))
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        if not self.capture_graphs:
            return
        pool = None
        for bs in tqdm(sorted(self.sizes, reverse=True), desc="capturing CUDA graphs", leave=False):
            self._forward(bs)  # warm-up (autotune, JIT)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = self._forward(bs)
            pool = graph.pool() if pool is None else pool
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        logger.info("captured %d CUDA graphs for decode batch sizes %s", len(self.graphs), self.sizes)

    def padded_size(self, num_seqs: int) -> int | None:
        return next((s for s in self.sizes if s >= num_seqs), None)

    def can_run(self, seqs: list[SeqSpec], num_prev_rows: int) -> bool:
        return (self.padded_size(len(seqs)) is not None and num_prev_rows <= self.prev_tokens.shape[0]
                and all(s.query_len == 1 and len(s.block_ids) <= self.max_blocks_per_seq for s in seqs))

    def _stage(self, seqs: list[SeqSpec], input_ids: list[int], positions: list[int], prev_rows: list[int],
               bs: int) -> None:
        """Write a step's inputs into the next host twins and queue their copies."""
        n = len(seqs)
        meta = self.builder.build_host(seqs, pad_to_num_seqs=bs, pad_to_blocks_per_seq=self.max_blocks_per_seq)
        h64, h32 = self.i64.host(), self.i32.host()
        for name, values in (("input_ids", input_ids), ("positions", positions), ("prev_rows", prev_rows)):
            h64[name][:n] = values
            h64[name][n:bs] = -1 if name == "prev_rows" else 0
        h64["slot_mapping"][:bs] = meta.slot_mapping
        for name in ("seq_lens", "context_lens", "query_start_loc", "seq_start_loc"):
            h32[name][:len(getattr(meta, name))] = getattr(meta, name)
        h32["block_tables"][:meta.block_tables.size] = meta.block_tables.ravel()
        self.i64.upload()
        self.i32.upload()

    def run(self, seqs: list[SeqSpec], input_ids: list[int], positions: list[int], prev_rows: list[int],
            prev_tokens: torch.Tensor | None) -> torch.Tensor:
        """One decode step -> logits [len(seqs), vocab]. prev_rows[i] >= 0: sequence i's input is row
        prev_rows[i] of prev_tokens (the previous step's sampled tokens, on the device); input_ids[i] is
        ignored then."""
        n = len(seqs)
        bs = self.padded_size(n)
        self._stage(seqs, input_ids, positions, prev_rows, bs)
        if prev_tokens is not None:
            self.prev_tokens[:prev_tokens.shape[0]].copy_(prev_tokens)
        if not self.capture_graphs:
            return self._forward(bs)[:n]
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
