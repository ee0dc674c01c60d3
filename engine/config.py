"""EngineConfig: every engine knob in one place, validated, no I/O."""
from __future__ import annotations

import os
from dataclasses import dataclass, fields

from engine import grammar_xgr

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("auto", "torch", "triton", "flash-attn", "flash-attn-4", "triton+flash-attn-4")
STRUCTURED_WAITS = ("auto", "device", "pipeline", "step")
# Grammar engines for structured outputs' masks (engine/grammar_xgr.py); vLLM's names.
GRAMMAR_BACKENDS = ("auto", "xgrammar", "guidance")


def usable_cores(cpu_max: str = "/sys/fs/cgroup/cpu.max") -> int:
    """The cores this process may run on: its CPU affinity, capped by a cgroup v2 CPU quota (a Kubernetes
    limit: os.cpu_count() is the node's, e.g. 96 against `limits.cpu: 8` in deploy/)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        with open(cpu_max) as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return cores


def need(cond: bool, msg: str) -> None:
    """A settings check: ValueError(msg) unless cond (the server's settings use it too)."""
    if not cond:
        raise ValueError(msg)


@dataclass
class EngineConfig:
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    tokenizer: str | None = None  # defaults to the model directory
    dtype: str = "auto"  # bfloat16 on GPU, float32 on CPU
    device: str = "auto"
    block_size: int | None = None  # None: the attention backend's preferred size (16; 128 with flash-attn-4 on Hopper)
    num_kv_blocks: int | None = None  # None: sized from kv_cache_memory_bytes (CPU) or gpu_memory_utilization
    kv_cache_memory_bytes: int = 1 << 30  # CPU budget for the KV pool
    gpu_memory_utilization: float = 0.90
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: 8192 on a GPU, 2048 on the CPU (engine/setup.py)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    enforce_eager: bool = False  # True: no CUDA graphs
    # float32 CPU matmuls through oneDNN-packed weights: ~2x faster than F.linear, which repacks its weight
    # every call (docs/benchmarks.md). Other dtypes and devices ignore it.
    cpu_packed_weights: bool = True
    # Schedule step N+1 while the device runs step N. None: on CUDA only (on the CPU nothing overlaps;
    # True there still runs the same pipeline, which tests use).
    async_scheduling: bool | None = None
    seed: int = 0
    skip_tokenizer_init: bool = False  # token-id prompts only, no text out (benchmarks on random-weight models)
    # Structured outputs: a grammar with more symbols, or whose lexer needs more fuel to build (~50k units a
    # millisecond), is refused with 400 invalid_grammar (engine/grammar.py).
    grammar_max_size: int = grammar_xgr.DEFAULT_LIMITS.max_grammar_size
    grammar_compile_fuel: int = grammar_xgr.DEFAULT_LIMITS.lexer_fuel
    # A regex or schema pattern whose bounded repeats multiply past these (one chain; a nested chain that varies)
    # goes to llguidance: xgrammar unrolls them, slowly, and its compile cannot be stopped (grammar_xgr.py).
    grammar_xgrammar_repeats: int = grammar_xgr.DEFAULT_LIMITS.xgrammar_repeats
    grammar_xgrammar_nested_repeats: int = grammar_xgr.DEFAULT_LIMITS.xgrammar_nested_repeats
    # auto: xgrammar's masks for JSON schemas and regexes when it is installed, llguidance's for the rest.
    structured_outputs_backend: str = "auto"
    # Who waits for a constrained step's grammar masks (STRUCTURED_WAITS): "device": the engine queues the step
    # whole and the device waits for the masks (engine/mask_gate.py: CUDA, grammar process); "pipeline": the
    # host samples it once the step behind it is scheduled and staged (engine.LLMEngine._step_behind_masks);
    # "step": the host samples it in the step() that launched it; "auto": device where it can, else pipeline.
    # "pipeline" by default until the device wait has passed its GPU tests (seventeenth session: not yet).
    structured_outputs_wait: str = "pipeline"
    # The matchers in a grammar process of their own (engine/grammar_worker.py), off the engine's GIL.
    # None: on CUDA only (on a 2-core machine the process shares the cores the engine needs).
    structured_outputs_process: bool | None = None
    # How many grammar processes share the matchers (each consumes and fills its own rows, all at once). None:
    # one per 4 usable cores (usable_cores: affinity, cgroup quota), at most 4 (1 on small hosts).
    structured_outputs_processes: int | None = None
    # xgrammar's batch-fill threads in each grammar process (or in the engine's process). None: half the usable
    # cores shared among the grammar processes (2 each at 4 processes on 16 cores), half the host's in-process.
    structured_outputs_fill_threads: int | None = None
    # How long the engine thread polls for a step's grammar masks before it blocks, in ms. None: 3 on hosts of 8
    # usable cores or more, else 0 (engine/grammar_link.py SPIN_S).
    structured_outputs_spin_ms: float | None = None
    # A CSV line per step into this file (engine/step_trace.py): the rows and tokens of each step, for benchmarks.
    step_trace: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        need(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        need(self.structured_outputs_wait in STRUCTURED_WAITS,
             f"structured_outputs_wait must be one of {STRUCTURED_WAITS}, got {self.structured_outputs_wait!r}")
        need(self.device in DEVICES, f"device must be one of {DEVICES}, got {self.device!r}")
        need(self.attention_backend in BACKENDS,
             f"attention_backend must be one of {BACKENDS}, got {self.attention_backend!r}")
        need(self.block_size is None or self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
             f"block_size must be a power of two, got {self.block_size}")
        need(self.num_kv_blocks is None or self.num_kv_blocks >= 2, "num_kv_blocks must be >= 2")
        need(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization must be in (0, 1]")
        need(self.max_num_seqs >= 1, "max_num_seqs must be >= 1")
        need(self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
             "max_num_batched_tokens must be >= 1")
        need(self.max_model_len is None or self.max_model_len >= 1, "max_model_len must be >= 1")
        need(min(self.grammar_max_size, self.grammar_compile_fuel, self.grammar_xgrammar_repeats,
                 self.grammar_xgrammar_nested_repeats) >= 1,
             "grammar_max_size, grammar_compile_fuel and grammar_xgrammar_(nested_)repeats must be >= 1")
        need(self.structured_outputs_processes is None or self.structured_outputs_processes >= 1,
             "structured_outputs_processes must be >= 1")
        need(self.structured_outputs_fill_threads is None or self.structured_outputs_fill_threads >= 1,
             "structured_outputs_fill_threads must be >= 1")
        need(self.structured_outputs_spin_ms is None or 0 <= self.structured_outputs_spin_ms <= 100,
             "structured_outputs_spin_ms must be in [0, 100]")
        need(self.structured_outputs_backend in GRAMMAR_BACKENDS,
             f"structured_outputs_backend must be one of {GRAMMAR_BACKENDS}, got {self.structured_outputs_backend!r}")
        need(self.structured_outputs_backend != "xgrammar" or grammar_xgr.available(),
             "structured_outputs_backend xgrammar: xgrammar is not installed (pip install 'kvserve[xgrammar]')")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
