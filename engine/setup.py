"""What an engine is built from, resolved in one place: the device, the dtype, the attention backend with
its KV block size, the step's token budget, the EOS ids, and where structured outputs' matchers live."""
from __future__ import annotations

import logging

import torch

from attention import explain_backend_choice, load_backend
from attention.base import DEFAULT_BLOCK_SIZE
from engine.config import EngineConfig, usable_cores
from engine.grammar import GrammarLimits
from engine.grammar_link import GrammarLink
from engine.structured import StructuredOutputs

logger = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def choose_backend(config: EngineConfig, device: torch.device, head_dim: int, dtype: torch.dtype):
    """(attention backend, why it was chosen, KV block size). An unset block size is the backend's preferred
    one (AttentionBackend.preferred_block_size); "auto" chooses its backend at 16 first."""
    name, block_size = config.attention_backend, config.block_size
    trial = block_size or (DEFAULT_BLOCK_SIZE if name == "auto" else
                           load_backend(name).preferred_block_size(head_dim, device))
    backend, reason = explain_backend_choice(name, device, head_dim, trial, dtype)
    block_size = block_size or backend.preferred_block_size(head_dim, device)
    backend.check_config(head_dim, block_size, device)
    return backend, reason, block_size


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but CUDA is not available")
    return torch.device(name)


def resolve_max_num_batched_tokens(value: int | None, device: torch.device) -> int:
    """Unset: 8192 tokens a step on a GPU, vLLM's default for its API server on 70+ GB GPUs, so one 8k
    prompt is one prefill step (TTFT) and prompts are chunked less; 2048 on the CPU, where a 2048-token step
    of the embedded SmolLM2 already takes about a second and decodes would wait behind a longer one."""
    return value or (8192 if device.type == "cuda" else 2048)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return TORCH_DTYPES[name]


def eos_ids(hf_config, tokenizer) -> frozenset[int]:
    ids = getattr(hf_config, "eos_token_id", None)
    ids = ids if isinstance(ids, list) else [ids]
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return frozenset(i for i in ids if i is not None)


def structured_outputs(config: EngineConfig, tokenizer, vocab_size: int, eos_token_ids, device: torch.device
                       ) -> StructuredOutputs | GrammarLink:
    """The grammar process's link, its worker starting (config.structured_outputs_process; None: with CUDA), else
    the matchers in the engine's process. Pass it through structured_outputs_ready before use: the engine
    starts the worker first and waits for it after loading the model (~3-5 s of imports, overlapped)."""
    limits = GrammarLimits(config.grammar_max_size, config.grammar_compile_fuel,
                           xgrammar_repeats=config.grammar_xgrammar_repeats,
                           xgrammar_nested_repeats=config.grammar_xgrammar_nested_repeats)
    args = (tokenizer, vocab_size, eos_token_ids, limits, config.structured_outputs_backend)
    wanted = config.structured_outputs_process
    if wanted or wanted is None and device.type == "cuda":
        try:
            spin_ms = config.structured_outputs_spin_ms
            return GrammarLink(*args, config.max_num_seqs, grammar_processes(config),
                               spin_s=None if spin_ms is None else spin_ms / 1000,
                               fill_threads=config.structured_outputs_fill_threads)
        except Exception as exc:  # noqa: BLE001 - e.g. a tokenizer that does not pickle
            logger.warning("no grammar process (%s): grammar matchers run in the engine's process", exc)
    structured = StructuredOutputs(*args)
    structured.fill_threads = config.structured_outputs_fill_threads
    return structured


def grammar_processes(config: EngineConfig) -> int:
    """config.structured_outputs_processes, or one per 4 usable cores, at most 4: each takes a core for its
    consumes and shares the rest for its fill threads beside the engine and the front end."""
    if config.structured_outputs_processes is not None:
        return config.structured_outputs_processes
    return max(1, min(4, usable_cores() // 4))


def structured_outputs_ready(structured: StructuredOutputs | GrammarLink) -> StructuredOutputs | GrammarLink:
    """The link once its worker is ready; a worker that does not start falls back to the matchers in the
    engine's process, with a warning."""
    if not isinstance(structured, GrammarLink):
        return structured
    error = structured.wait_ready()
    if error is None:
        return structured
    logger.warning("the grammar process did not start (%s): matchers run in the engine's process", error)
    structured.shutdown()
    return StructuredOutputs(*structured.args)
