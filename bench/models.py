"""Random-weight models for hosts without a model hub: the shapes of well-known models (`qwen2.5-0.5b`, the GPU
issues' model), a tokenizer that decodes every id (a word-level "id tokenizer", or a byte-level BPE that can
spell JSON: bench/bpe_tokenizer.py), and freeing device memory between two systems.

Used by `kvserve bench throughput`, benchmarks/online_wc.py and the profiling scripts in benchmarks/.
"""
from __future__ import annotations

import gc
import json
from pathlib import Path


QWEN2_5_0_5B = dict(
    architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=896, intermediate_size=4864,
    num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
    tie_word_embeddings=True, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
    hidden_act="silu", use_sliding_window=False, bos_token_id=151643, eos_token_id=151643, dtype="bfloat16")


def builtin_model_config(name: str) -> dict | None:
    """Shapes of well-known models, for random-weight builds. Qwen2.5-0.5B: the GPU issues' model;
    qwen2.5-0.5b-40k: the same with 40,960 positions, for W-L's 32k-token prompts (the published config
    stops at 32,768, which a 32,768-token prompt and its output would overrun; random weights do not care)."""
    configs = {"qwen2.5-0.5b": QWEN2_5_0_5B, "qwen2.5-0.5b-40k": {**QWEN2_5_0_5B, "max_position_embeddings": 40960}}
    return dict(configs[name]) if name in configs else None


def parse_model_config(value: str) -> dict:
    """A built-in name, a path to a JSON file, or inline JSON."""
    if (config := builtin_model_config(value)) is not None:
        return config
    path = Path(value)
    text = path.read_text() if path.suffix == ".json" and path.is_file() else value
    try:
        config = json.loads(text)
    except json.JSONDecodeError:
        raise ValueError(f"--model-config {value!r} is neither a built-in name (qwen2.5-0.5b, qwen2.5-0.5b-40k), "
                         f"a .json file, nor inline JSON") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise ValueError("--model-config needs a JSON object with at least model_type (e.g. 'qwen2')")
    return config


def save_id_tokenizer(vocab_size: int, eos_token_id: int, out_dir: Path) -> None:
    """A word-level tokenizer whose token i is the word `<i>`: random-weight models need one for the engine
    to detokenize, and any id in the vocabulary decodes. (The brackets keep the EOS word, matched anywhere
    in text as a special token, from matching inside a longer one: `<1>` is no prefix of `<17>`.)"""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(vocab_size)}, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<0>", eos_token=f"<{eos_token_id}>")
    fast.save_pretrained(out_dir)


TOKENIZERS = ("id", "bpe")


def build_random_model(config: dict, out_dir: Path, seed: int = 0, tokenizer: str = "id",
                       init_device: str = "cpu") -> Path:
    """A transformers model of `config` with random weights, saved with save_pretrained (+ a tokenizer of
    exactly vocab_size ids, EOS at eos_token_id): `id`, token i is the text `<i>` (no JSON can be spelt with
    it); `bpe`, a byte-level BPE (bench/bpe_tokenizer.py: every byte expressible, so structured outputs work).
    init_device "cuda" draws the weights there: Qwen2.5-0.5B's took 44 s on an H100 host's CPU (the
    eleventh session's pair logs), a quarter of a 135 s device call; the draws differ from the CPU's."""
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"tokenizer must be one of {TOKENIZERS}, got {tokenizer!r}")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = dict(config)
    dtype = getattr(torch, config.pop("dtype", None) or config.pop("torch_dtype", None) or "float32")
    hf_config = AutoConfig.for_model(config.pop("model_type"), **config)
    with torch.random.fork_rng(), torch.device(init_device):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    model.save_pretrained(out_dir)
    eos = hf_config.eos_token_id if isinstance(hf_config.eos_token_id, int) else 0
    if tokenizer == "bpe":
        from bench.bpe_tokenizer import save_bpe_tokenizer

        save_bpe_tokenizer(hf_config.vocab_size, eos, out_dir, seed)
    else:
        save_id_tokenizer(hf_config.vocab_size, eos, out_dir)
    return out_dir



def free_device_memory() -> None:
    import torch

    from engine.malloc import DEFAULT_THRESHOLDS

    gc.unfreeze()  # what a contender froze (freeze_startup_objects) can be collected again
    gc.set_threshold(*DEFAULT_THRESHOLDS)  # and the next contender collects as Python does by default
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
