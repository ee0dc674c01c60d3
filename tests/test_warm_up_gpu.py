"""Nothing compiles while serving: after the engine is built (CUDA graphs captured, attention warmed up), a
batch of eager prompt chunks of many lengths (block-table widths of both parities, split and unsplit grids,
a flash-attn-4 step in the hybrid) and decodes compiles no new Triton variant and no flash-attn-4 kernel.
Each compile on the H200 cost ~0.3-1 s: the first repetition of W-A, W-B and W-L ran ~0.7 s slower."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import tiny_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _triton_kernels():
    import triton

    import attention.triton_paged as attn
    import engine.kernels as kernels

    return {f"{m.__name__}.{name}": fn for m in (attn, kernels) for name, fn in vars(m).items()
            if isinstance(fn, triton.runtime.JITFunction)}


def _variants(fn) -> int:
    return sum(len(cache[0]) for cache in fn.device_caches.values())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    config = tiny_config("llama", head_dim=64, bos_token_id=1, eos_token_id=2, max_position_embeddings=8192)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    out = tmp_path_factory.mktemp("warm-up")
    model.save_pretrained(out)
    return out


@pytest.mark.parametrize("enforce_eager", (False, True))
@pytest.mark.parametrize("backend", ("triton", "triton+flash-attn-4"))
def test_serving_compiles_nothing(model_dir, backend, enforce_eager, monkeypatch):
    from engine import LLM, SamplingParams

    try:
        llm = LLM(model=str(model_dir), device="cuda", dtype="bfloat16", attention_backend=backend,
                  skip_tokenizer_init=True, max_num_batched_tokens=4096, max_num_seqs=16, max_model_len=6144,
                  enforce_eager=enforce_eager)
    except ValueError as e:  # the backend is not installed here
        pytest.skip(str(e))
    fa4_compiles = []
    if "flash-attn-4" in backend:
        import cutlass.cute as cute

        compile_ = cute.compile
        monkeypatch.setattr(cute, "compile", lambda *a, **k: fa4_compiles.append(1) or compile_(*a, **k))
    kernels = _triton_kernels()
    before = {name: _variants(fn) for name, fn in kernels.items()}
    lengths = (3000, 2100, 1500, 700, 257, 130, 37, 5, 1)  # 3000 and 2100: flash-attn-4 steps in the hybrid
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [24] * len(prompts)
    grew = {name: (before[name], _variants(fn)) for name, fn in kernels.items() if _variants(fn) != before[name]}
    assert not grew, f"Triton compiled while serving (variants before, after): {grew}"
    assert not fa4_compiles, f"flash-attn-4 compiled {len(fa4_compiles)} kernel(s) while serving"
