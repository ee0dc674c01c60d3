"""Our CausalLM's logits equal Hugging Face's (float32), whether a sequence arrives in one prefill or as
chunks and decodes through a paged cache with scattered blocks, alone or batched with another."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from attention.metadata import AttentionMetadataBuilder, SeqSpec
from attention.torch_ref import TorchAttentionBackend
from engine.loader import load_hf_config, load_model
from engine.model import CausalLM, RotaryEmbedding, rope_inv_freq, rope_parameters
from tests.conftest import ARCHS, tiny_config

ATOL, RTOL = 1e-4, 1e-4
BLOCK_SIZE = 8


class PagedRun:
    """Feeds sequences through a model step by step, like the runner: a shared KV pool whose blocks are
    handed out in a shuffled order, metadata from AttentionMetadataBuilder, every token's logits kept."""

    def __init__(self, model: CausalLM, seqs: list[list[int]], num_blocks: int = 40, seed: int = 0) -> None:
        a = model.args
        shape = TorchAttentionBackend.kv_cache_shape(num_blocks, BLOCK_SIZE, a.num_kv_heads, a.head_dim)
        # Garbage, not zeros, so a read of a slot nobody wrote shows up in the logits.
        self.kv_caches = [(torch.randn(shape) * 30, torch.randn(shape) * 30) for _ in range(a.num_layers)]
        free = list(range(num_blocks))
        random.Random(seed).shuffle(free)
        self.block_ids = []
        for s in seqs:
            n = -(-len(s) // BLOCK_SIZE)
            self.block_ids.append(free[:n])
            free = free[n:]
        self.model, self.seqs = model, seqs
        self.done = [0] * len(seqs)
        self.logits: list[list[torch.Tensor]] = [[] for _ in seqs]

    @torch.inference_mode()
    def step(self, work: list[tuple[int, int]]) -> None:
        """work: (sequence index, new tokens) pairs, prefills (more than one token) first."""
        ids, positions, specs = [], [], []
        for i, n in work:
            start = self.done[i]
            ids += self.seqs[i][start:start + n]
            positions += range(start, start + n)
            specs.append(SeqSpec(context_len=start, query_len=n, block_ids=self.block_ids[i]))
        meta = AttentionMetadataBuilder(BLOCK_SIZE, "cpu").build(specs)
        hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.kv_caches, meta)  # [T, hidden]
        logits = self.model.compute_logits(hidden)  # [T, vocab]
        offset = 0
        for i, n in work:
            self.logits[i].append(logits[offset:offset + n])
            offset += n
            self.done[i] += n

    def all_logits(self, i: int) -> torch.Tensor:
        assert self.done[i] == len(self.seqs[i])
        return torch.cat(self.logits[i])


@torch.inference_mode()
def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([ids])).logits[0].float()  # [len, vocab]


def random_ids(n: int, seed: int, vocab: int = 49152) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, vocab) for _ in range(n)]


@pytest.fixture(scope="module")
def models(tiny_model_dir, smollm2_dir):
    """name -> (ours, HF's), both float32 on CPU; loaded once for the module."""
    cache = {}

    def get(name: str):
        if name not in cache:
            path = smollm2_dir if name == "smollm2" else tiny_model_dir(name)
            ours = load_model(path, load_hf_config(path), torch.float32, torch.device("cpu"), TorchAttentionBackend)
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            cache[name] = (ours, hf)
        return cache[name]

    return get


def prompt_for(name: str, smollm2_tokenizer) -> list[int]:
    if name != "smollm2":
        return random_ids(45, seed=1)
    chat = [{"role": "user", "content": "Write a haiku about paged attention and the memory it saves."}]
    ids = smollm2_tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids) + random_ids(8, seed=2)  # continue past the prompt with decodes


MODEL_NAMES = list(ARCHS) + ["smollm2"]


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_one_prefill_matches_hf(models, name, smollm2_tokenizer):
    ours, hf = models(name)
    ids = prompt_for(name, smollm2_tokenizer)
    run = PagedRun(ours, [ids])
    run.step([(0, len(ids))])
    torch.testing.assert_close(run.all_logits(0), hf_logits(hf, ids), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_chunked_prefill_then_decodes_match_hf(models, name, smollm2_tokenizer):
    ours, hf = models(name)
    ids = prompt_for(name, smollm2_tokenizer)
    run = PagedRun(ours, [ids], seed=3)
    first, second = 13, len(ids) - 13 - 6  # chunk boundaries off the block boundaries
    run.step([(0, first)])
    run.step([(0, second)])
    for _ in range(6):
        run.step([(0, 1)])
    torch.testing.assert_close(run.all_logits(0), hf_logits(hf, ids), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_mixed_batches_match_hf(models, name):
    # Two sequences sharing every step: prefill + decode, two chunks over context, chunk + decode, decodes.
    ours, hf = models(name)
    a, b = random_ids(33, seed=4), random_ids(26, seed=5)
    run = PagedRun(ours, [a, b], seed=6)
    for work in ([(0, 17), (1, 1)], [(0, 13), (1, 12)], [(1, 11), (0, 1)], [(0, 1), (1, 1)], [(1, 1), (0, 1)]):
        run.step(work)
    torch.testing.assert_close(run.all_logits(0), hf_logits(hf, a), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(run.all_logits(1), hf_logits(hf, b), atol=ATOL, rtol=RTOL)


def test_tiny_archs_cover_the_variants():
    # The fixtures are what make the parity tests above meaningful: check they still span the branches.
    from engine.model import ModelArgs

    args = {arch: ModelArgs.from_hf(tiny_config(arch)) for arch in ARCHS}
    assert args["qwen2"].qkv_bias and not args["qwen2"].o_bias
    assert args["qwen3"].qk_norm and args["qwen3"].head_dim * args["qwen3"].num_heads != args["qwen3"].hidden_size
    assert {a.tie_word_embeddings for a in args.values()} == {True, False}
    assert {a.rope["rope_type"] for a in args.values()} >= {"default", "linear", "llama3"}
    assert all(a.num_kv_heads < a.num_heads for a in args.values())


# --------------------------------------------------------------------------- RoPE

ROPE_VARIANTS = {
    "default": dict(rope_type="default", rope_theta=10000.0),
    "default-big-theta": dict(rope_type="default", rope_theta=500000.0),
    "linear": dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
    "llama3": dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=128),
}


@pytest.mark.parametrize("variant", list(ROPE_VARIANTS))
def test_rope_table_matches_hf(variant):
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=1024,
                         rope_parameters=ROPE_VARIANTS[variant])
    head_dim = 64
    positions = torch.arange(1024)
    hf_cos, hf_sin = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions[None])
    ours = RotaryEmbedding(rope_parameters(config), head_dim, 1024).cos_sin_cache  # [1024, head_dim]
    cos, sin = ours.chunk(2, dim=-1)
    torch.testing.assert_close(torch.cat((cos, cos), -1), hf_cos[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.cat((sin, sin), -1), hf_sin[0], atol=1e-6, rtol=0)


def test_rope_scaling_changes_the_table():
    # Guards the comparison above against a variant silently falling back to plain RoPE.
    plain = rope_inv_freq(ROPE_VARIANTS["default-big-theta"], 64)
    llama3 = rope_inv_freq(ROPE_VARIANTS["llama3"], 64)
    assert torch.equal(llama3[:4], plain[:4])  # high frequencies kept
    torch.testing.assert_close(llama3[-4:], plain[-4:] / 8.0)  # low frequencies slowed by `factor`
    torch.testing.assert_close(rope_inv_freq(ROPE_VARIANTS["linear"], 64),
                               rope_inv_freq(ROPE_VARIANTS["default"], 64) / 4.0)


def test_legacy_rope_fields_are_read():
    legacy = SimpleNamespace(rope_theta=250000.0, rope_scaling={"type": "linear", "factor": 2.0})
    params = rope_parameters(legacy)
    assert params["rope_type"] == "linear" and params["rope_theta"] == 250000.0 and params["factor"] == 2.0
    assert rope_parameters(SimpleNamespace(rope_theta=1e6, rope_scaling=None)) == {
        "rope_type": "default", "rope_theta": 1e6}


@pytest.mark.parametrize("rope", [
    dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64),
    dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0),
])
def test_unsupported_rope_type_is_a_clear_error(rope):
    config = tiny_config("llama", rope_parameters=rope)
    with pytest.raises(ValueError, match=rf"RoPE type '{rope['rope_type']}' is not implemented.*llama3"):
        CausalLM(config, TorchAttentionBackend)


def test_unsupported_architecture_is_a_clear_error():
    config = SimpleNamespace(model_type="gpt2")
    with pytest.raises(ValueError, match="gpt2.*not supported.*llama"):
        CausalLM(config, TorchAttentionBackend)

