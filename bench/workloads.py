"""The offline workloads of `kvserve bench throughput`, as token ids with exact lengths: the presets W-A
(nano-vllm's benchmark), W-B (the GPU issue's), the W-L family (long prompts), cpu-smollm2 (the embedded
default on a CPU), and any
`--dataset` of bench/datasets.py.
"""
from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

from bench.datasets import SYNTHETIC, random_requests, requests_from_args


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]
    temperature: float  # 0: greedy

    @property
    def input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def workload_wa() -> Workload:
    """nano-vllm's bench.py: 256 prompts of 100-1024 ids in [0, 10000], outputs of 100-1024, T=0.6."""
    rnd = random.Random(0)
    prompts = [[rnd.randint(0, 10000) for _ in range(rnd.randint(100, 1024))] for _ in range(256)]
    output_lens = [rnd.randint(100, 1024) for _ in range(256)]
    return Workload("W-A", prompts, output_lens, temperature=0.6)


def workload_wb() -> Workload:
    """256 prompts of 512 ids from torch.randint(100, 150000) under seed 0; 128 greedy output tokens each."""
    import torch

    gen = torch.Generator().manual_seed(0)  # the same stream as torch.manual_seed(0), without global state
    prompts = torch.randint(100, 150000, (256, 512), generator=gen).tolist()
    return Workload("W-B", prompts, [128] * 256, temperature=0.0)


WL_PROMPTS = 64


@dataclass(frozen=True)
class LongPromptShape:
    """One W-L preset: prompt and output lengths, and the engine limits and model config it needs (the
    published Qwen2.5-0.5B config stops at 32,768 positions, which a 32k prompt and its output overrun)."""
    name: str
    prompt_len: int
    output_len: int
    max_model_len: int
    model_config: str


# wl-decode and wl-32k-decode: issue 19's "decode over long contexts": 1,024 output tokens make the split-KV
# decode steps over 8-9k and 32-33k keys most of the run, against vLLM on the same shape.
WL_PRESETS = {
    "wl": LongPromptShape("W-L", 8192, 256, 16384, "qwen2.5-0.5b"),
    "wl-32k": LongPromptShape("W-L 32k", 32768, 256, 40960, "qwen2.5-0.5b-40k"),
    "wl-decode": LongPromptShape("W-L decode", 8192, 1024, 16384, "qwen2.5-0.5b"),
    "wl-32k-decode": LongPromptShape("W-L 32k decode", 32768, 1024, 40960, "qwen2.5-0.5b-40k"),
}


def workload_wl(vocab_size: int, preset: str = "wl") -> Workload:
    """W-L, long prompts (issue 19): 64 prompts of the preset's length (8,192 or 32,768 ids) drawn as vLLM's
    random dataset draws them (seed 0, ids from the model's vocabulary), its output length (256 or 1,024)
    greedy each: for wl, the workload of `--dataset random --random-input-len 8192 --random-output-len 256
    --num-prompts 64`."""
    shape = WL_PRESETS[preset]
    reqs = random_requests(WL_PROMPTS, shape.prompt_len, shape.output_len, 0.0, seed=0, vocab_size=vocab_size)
    return Workload(shape.name, [r.prompt for r in reqs], [r.expected_output_len for r in reqs], 0.0)


def workload_cpu_smollm2(vocab_size: int) -> Workload:
    """32 requests of 128 prompt ids (vLLM's random dataset) and 64 greedy output tokens."""
    reqs = random_requests(32, 128, 64, 0.0, seed=0, vocab_size=vocab_size)
    return Workload("cpu-smollm2", [r.prompt for r in reqs], [r.expected_output_len for r in reqs], 0.0)


def workload_from_dataset(args: argparse.Namespace, tokenizer, vocab_size: int) -> Workload:
    """--dataset random|prefix_repetition|sharegpt|PATH.jsonl, as token ids (text prompts tokenized as the engine would)."""
    args.random_vocab_size = vocab_size
    reqs = requests_from_args(args, tokenizer if args.dataset not in SYNTHETIC else None)
    prompts = [r.prompt if isinstance(r.prompt, list) else tokenizer.encode(r.prompt) for r in reqs]
    return Workload(args.dataset, prompts, [r.expected_output_len for r in reqs], args.temperature)
