"""Decode steps replayed from CUDA graphs, one graph per padded batch size.

A decode step of a small model is dominated by kernel-launch overhead (24 layers x ~10 kernels);
a graph replays all of them with one launch. Inputs live in persistent buffers filled in place;
the batch is padded up to the nearest captured size with PAD_SLOT_ID tokens (see attention.metadata).
"""
from __future__ import annotations

import logging

import torch
from tqdm import tqdm

from attention.base import AttentionMetadata
from attention.metadata import AttentionMetadataBuilder, SeqSpec

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_batch_size + 1, 16))
    return sorted({s for s in sizes if s <= max_batch_size} | {max_batch_size})


class CudaGraphDecoder:
    def __init__(self, model, kv_caches, builder: AttentionMetadataBuilder, max_batch_size: int,
                 max_blocks_per_seq: int, device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.builder = builder
        self.max_blocks_per_seq = max_blocks_per_seq
        self.sizes = graph_batch_sizes(max_batch_size)
        self.input_ids = torch.zeros(max_batch_size, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch_size, dtype=torch.long, device=device)
        # The metadata the graphs were captured with: its tensors are the persistent buffers.
        self.meta = builder.build([SeqSpec(0, 1, [0])], pad_to_num_seqs=max_batch_size,
                                  pad_to_blocks_per_seq=max_blocks_per_seq)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _view(self, bs: int) -> AttentionMetadata:
        m = self.meta
        return AttentionMetadata(0, 0, bs, m.slot_mapping[:bs], m.block_tables[:bs], m.seq_lens[:bs],
                                 m.context_lens[:bs], m.query_start_loc[:bs + 1], m.seq_start_loc[:bs + 1],
                                 max_query_len=1, max_seq_len=self.max_blocks_per_seq * self.builder.block_size)

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        for bs in tqdm(sorted(self.sizes, reverse=True), desc="capturing CUDA graphs", leave=False):
            meta = self._view(bs)
            self.model(self.input_ids[:bs], self.positions[:bs], self.kv_caches, meta)  # warm-up (autotune, JIT)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = self.model(self.input_ids[:bs], self.positions[:bs], self.kv_caches, meta)
            pool = graph.pool() if pool is None else pool
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        logger.info("captured %d CUDA graphs for decode batch sizes %s", len(self.graphs), self.sizes)

    def padded_size(self, num_seqs: int) -> int | None:
        return next((s for s in self.sizes if s >= num_seqs), None)

    def can_run(self, seqs: list[SeqSpec]) -> bool:
        return (self.padded_size(len(seqs)) is not None and all(s.query_len == 1 for s in seqs)
                and all(len(s.block_ids) <= self.max_blocks_per_seq for s in seqs))

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, seqs: list[SeqSpec]) -> torch.Tensor:
        """input_ids, positions [num_seqs] on the device -> hidden [num_seqs, hidden]."""
        n = len(seqs)
        bs = self.padded_size(n)
        meta = self.builder.build(seqs, pad_to_num_seqs=bs, pad_to_blocks_per_seq=self.max_blocks_per_seq)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.input_ids[n:bs].zero_()
        self.positions[n:bs].zero_()
        static = self._view(bs)
        for dst, src in ((static.slot_mapping, meta.slot_mapping), (static.block_tables, meta.block_tables),
                         (static.seq_lens, meta.seq_lens), (static.context_lens, meta.context_lens),
                         (static.query_start_loc, meta.query_start_loc), (static.seq_start_loc, meta.seq_start_loc)):
            dst.copy_(src, non_blocking=True)
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
