"""ModelRunner: owns the KV pool, turns a SchedulerOutput into model inputs, runs the model, samples."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from attention.metadata import AttentionMetadataBuilder, SeqSpec
from engine.cuda_graphs import CudaGraphDecoder
from engine.request import Request, TokenLogprob
from engine.sampler import Sampler
from engine.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass
class RunnerOutput:
    sampled: dict[str, int]  # request_id -> new token, for requests whose step reached the end of their tokens
    logprobs: dict[str, TokenLogprob]  # only for requests that asked for logprobs


@dataclass
class StepInputs:
    input_ids: list[int]
    positions: list[int]
    seqs: list[SeqSpec]
    sample_indices: list[int]  # flat token index whose logits are sampled, one per sampling request
    sample_requests: list[Request]


def kv_bytes_per_block(hf_config, block_size: int, dtype: torch.dtype) -> int:
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    elem = torch.empty((), dtype=dtype).element_size()
    # K and V, every layer.
    return 2 * hf_config.num_hidden_layers * block_size * hf_config.num_key_value_heads * head_dim * elem


def prepare_inputs(out: SchedulerOutput) -> StepInputs:
    """Flatten the scheduled requests into one batch, prefills first (the scheduler already ordered them)."""
    input_ids: list[int] = []
    positions: list[int] = []
    seqs: list[SeqSpec] = []
    sample_indices: list[int] = []
    sample_requests: list[Request] = []
    for sr in out.scheduled:
        start, end = sr.num_computed_tokens, sr.num_computed_tokens + sr.num_new_tokens
        input_ids += sr.request.token_ids_between(start, end)
        positions += range(start, end)
        seqs.append(SeqSpec(context_len=start, query_len=sr.num_new_tokens, block_ids=sr.request.block_ids))
        if sr.samples:
            sample_indices.append(len(input_ids) - 1)
            sample_requests.append(sr.request)
    return StepInputs(input_ids, positions, seqs, sample_indices, sample_requests)


class ModelRunner:
    def __init__(self, model, hf_config, backend, device: torch.device, dtype: torch.dtype,
                 num_blocks: int, block_size: int, max_num_seqs: int, max_model_len: int,
                 use_cuda_graphs: bool) -> None:
        self.model = model
        self.backend = backend
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv_caches = self._allocate_kv(hf_config, dtype)
        self.builder = AttentionMetadataBuilder(block_size, device)
        self.sampler = Sampler()
        self.graphs = None
        if use_cuda_graphs and device.type == "cuda" and backend.supports_cuda_graphs:
            max_blocks = -(-max_model_len // block_size)
            self.graphs = CudaGraphDecoder(model, self.kv_caches, self.builder, min(max_num_seqs, 512), max_blocks,
                                           device)
            self.graphs.capture()

    def _allocate_kv(self, hf_config, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        shape = self.backend.kv_cache_shape(self.num_blocks, self.block_size, hf_config.num_key_value_heads, head_dim)
        return [(torch.zeros(shape, dtype=dtype, device=self.device), torch.zeros(shape, dtype=dtype, device=self.device))
                for _ in range(hf_config.num_hidden_layers)]

    def _to_device(self, values: list[int]) -> torch.Tensor:
        t = torch.tensor(values, dtype=torch.long)
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        for rid in out.finished_ids:
            self.sampler.free(rid)
        inputs = prepare_inputs(out)
        input_ids = self._to_device(inputs.input_ids)  # [num_tokens]
        positions = self._to_device(inputs.positions)  # [num_tokens]
        if self.graphs is not None and self.graphs.can_run(inputs.seqs):
            hidden = self.graphs.run(input_ids, positions, inputs.seqs)  # [num_tokens, hidden]
        else:
            meta = self.builder.build(inputs.seqs)
            hidden = self.model(input_ids, positions, self.kv_caches, meta)  # [num_tokens, hidden]
        if not inputs.sample_requests:
            return RunnerOutput({}, {})
        logits = self.model.compute_logits(hidden[self._to_device(inputs.sample_indices)])  # [n, vocab]
        sampled = self.sampler(logits, inputs.sample_requests)
        ids = [r.request_id for r in inputs.sample_requests]
        logprobs = {rid: lp for rid, lp in zip(ids, sampled.logprobs) if lp is not None}
        return RunnerOutput(dict(zip(ids, sampled.token_ids)), logprobs)
