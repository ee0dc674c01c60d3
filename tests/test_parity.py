"""Greedy outputs equal Hugging Face `generate`, token for token, whatever the scheduler does."""
from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from tests.conftest import ARCHS

MAX_TOKENS = 20


def make_prompts(vocab: int, seed: int, lengths=(3, 17, 40, 9, 64, 25, 1, 50)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(n)] for n in lengths]


def shared_prefix_prompts(vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(100, vocab) for _ in range(70)]
    return [prefix + [rng.randrange(100, vocab) for _ in range(k)] for k in (1, 5, 12, 3, 30, 8, 17, 2)]


def hf_greedy(model_dir, prompts: list[list[int]], eos_ids: list[int], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """Hugging Face `generate`, greedy, every prompt in one left-padded batch (its attention mask and positions
    leave the padding out). One prompt at a time took ~9 s for SmolLM2's eight prompts on a 2-core CPU; the
    batch ~1.5 s. A row's output ends at its first EOS (generate pads a finished row with pad_token_id)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[eos_ids[0]] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=eos_ids, pad_token_id=eos_ids[0])
    return [_through_first_eos(row[width:].tolist(), eos_ids) for row in out]


def _through_first_eos(tokens: list[int], eos_ids: list[int]) -> list[int]:
    ends = [i for i, t in enumerate(tokens) if t in eos_ids]
    return tokens[:ends[0] + 1] if ends else tokens


def ours(llm: LLM, prompts, n: int = 1) -> list[list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, n=n)
    return [[c.token_ids for c in r.outputs] for r in llm.generate(prompts, params)]


# (name, engine options) for the scheduler situations the issue names.
SITUATIONS = {
    "defaults": {},
    "chunked": {"max_num_batched_tokens": 8},
    "preempted": {"num_kv_blocks": 12, "block_size": 8},
    # The GPU's pipeline (step N+1 scheduled before step N's tokens are read), run on the CPU.
    "async-chunked-preempted": {"async_scheduling": True, "num_kv_blocks": 12, "block_size": 8,
                                "max_num_batched_tokens": 8},
}


def check_situation(model_dir, situation: str, hf_cache: dict) -> None:
    llm = LLM(model=str(model_dir), **SITUATIONS[situation])
    prompts = make_prompts(llm.engine.vocab_size, seed=1)
    eos = sorted(llm.engine.eos_token_ids)
    key = (str(model_dir), "mixed")
    if key not in hf_cache:
        hf_cache[key] = hf_greedy(model_dir, prompts, eos)
    got = ours(llm, prompts)
    assert [g[0] for g in got] == hf_cache[key]
    stats = llm.engine.stats().scheduler
    if "preempted" in situation:
        assert stats.num_preemptions > 0
    if "chunked" in situation:
        assert llm.engine.stats().num_steps > MAX_TOKENS + 64 // 8
    assert stats.num_blocks_used == 0


def check_prefix_cache(model_dir) -> None:
    llm = LLM(model=str(model_dir), max_num_batched_tokens=80)
    prompts = shared_prefix_prompts(llm.engine.vocab_size, seed=2)
    expected = hf_greedy(model_dir, prompts, sorted(llm.engine.eos_token_ids))
    assert [g[0] for g in ours(llm, prompts)] == expected
    first_hits = llm.engine.stats().scheduler.prefix_cache_hits
    assert first_hits > 0  # later prompts were admitted after the first one computed the prefix
    assert [g[0] for g in ours(llm, prompts)] == expected  # again, now almost all from the cache
    assert llm.engine.stats().scheduler.prefix_cache_hits >= first_hits + 8 * 64


def check_n3(model_dir, hf_cache: dict) -> None:
    llm = LLM(model=str(model_dir))
    prompts = make_prompts(llm.engine.vocab_size, seed=1)
    key = (str(model_dir), "mixed")
    if key not in hf_cache:
        hf_cache[key] = hf_greedy(model_dir, prompts, sorted(llm.engine.eos_token_ids))
    expected = hf_cache[key]
    for completions, exp in zip(ours(llm, prompts, n=3), expected):
        assert completions == [exp, exp, exp]
    assert llm.engine.stats().scheduler.prefix_cache_hits > 0  # siblings shared the prompt's blocks


HF_CACHE: dict = {}


@pytest.mark.parametrize("situation", list(SITUATIONS))
@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_archs_match_hf(tiny_model_dir, arch, situation):
    check_situation(tiny_model_dir(arch), situation, HF_CACHE)


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_archs_prefix_cache_and_n3(tiny_model_dir, arch):
    check_prefix_cache(tiny_model_dir(arch))
    check_n3(tiny_model_dir(arch), HF_CACHE)


@pytest.mark.parametrize("situation", list(SITUATIONS))
def test_smollm2_matches_hf(smollm2_dir, situation):
    check_situation(smollm2_dir, situation, HF_CACHE)


def test_smollm2_prefix_cache_and_n3(smollm2_dir):
    check_prefix_cache(smollm2_dir)
    check_n3(smollm2_dir, HF_CACHE)
