"""The offline workloads of `kvserve bench throughput`, as token ids with exact lengths: the presets W-A
(nano-vllm's benchmark), W-B (the GPU issue's), W-L and W-L 32k (long prompts), cpu-smollm2 (the embedded
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


WL_PROMPTS, WL_OUTPUT = 64, 256


def workload_wl(vocab_size: int, prompt_len: int = 8192) -> Workload:
    """W-L, long prompts (issue 19): 64 prompts of `prompt_len` ids (8,192; W-L 32k: 32,768) drawn as vLLM's
    random dataset draws them (seed 0, ids from the model's vocabulary), 256 greedy output tokens each: the
    workload of `--dataset random --random-input-len 8192 --random-output-len 256 --num-prompts 64`."""
    reqs = random_requests(WL_PROMPTS, prompt_len, WL_OUTPUT, 0.0, seed=0, vocab_size=vocab_size)
    name = "W-L" if prompt_len == 8192 else f"W-L {prompt_len // 1024}k"
    return Workload(name, [r.prompt for r in reqs], [r.expected_output_len for r in reqs], 0.0)


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
