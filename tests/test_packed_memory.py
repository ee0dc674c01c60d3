"""Packed CPU matmuls (the float32 CPU default) keep a server's memory flat. A soak once grew it by 15%,
for two reasons, each pinned down here without timing: oneDNN primitives built lazily while serving
(they are keyed by thread count, and the server changed it after the warm-up), and freed step buffers
kept resident by glibc's arena (the engine trims it when it goes idle; steps keep reusing it, with no
page faults: engine/malloc.py)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from engine import LLM, SamplingParams
from engine.kernels import pack_weight_for_cpu

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(pack_weight_for_cpu(torch.zeros(2, 2)) is None,
                                reason="this torch build lacks oneDNN's linear")

# Small bounds keep the warm-up short; the prompts below still reach every bucketed shape's range.
ENGINE_OPTS = dict(num_kv_blocks=64, block_size=8, max_num_batched_tokens=48, max_num_seqs=6)


def primitives_created(capfd, fn) -> int:
    """oneDNN primitives created (primitive-cache misses) while fn() runs, from oneDNN's verbose log."""
    capfd.readouterr()
    with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON_CREATION):
        fn()
    return capfd.readouterr().out.count("cache_miss")


def _generate(llm: LLM) -> None:
    prompts = [[100 + 7 * i + j for j in range(n)] for i, n in enumerate((1, 5, 17, 33, 47, 2, 9))]
    llm.generate(prompts, SamplingParams(temperature=0.8, seed=1, max_tokens=6, n=2, ignore_eos=True))


def test_no_primitive_is_built_while_serving(tiny_model_dir, capfd):
    llm = LLM(model=str(tiny_model_dir("llama")), **ENGINE_OPTS)
    assert llm.engine.runner.model.is_packed  # the default for float32 on the CPU
    assert primitives_created(capfd, lambda: _generate(llm)) == 0


def test_a_changed_thread_count_rebuilds_at_once(tiny_model_dir, capfd, caplog):
    """Primitives are keyed by thread count: under a new count the next step builds them all (with a
    warning), and later steps build none."""
    llm = LLM(model=str(tiny_model_dir("llama")), **ENGINE_OPTS)
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads != 1 else 2)
    try:
        assert primitives_created(capfd, lambda: _generate(llm)) > 0
        assert "rebuilding the packed matmuls' primitives" in caplog.text
        assert primitives_created(capfd, lambda: _generate(llm)) == 0
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def odd_model_dir(tmp_path_factory, smollm2_tokenizer):
    """A tiny Llama with matmul shapes no other test uses: oneDNN's primitive cache is per process, and
    other tests' servers would have filled it for the serving thread count already."""
    from conftest import build_tiny_model

    return build_tiny_model("llama", tmp_path_factory.mktemp("tiny-odd"), smollm2_tokenizer, hidden_size=192,
                            intermediate_size=320, num_attention_heads=6)


def test_the_server_warms_up_under_its_serving_thread_count(odd_model_dir, capfd, caplog):
    """The server leaves a core to HTTP by lowering torch's thread count: it must do so before the engine's
    warm-up, or every request-shaped matmul misses the primitive cache (the runner then rebuilds them all at
    the first step, with a warning: both are checked)."""
    from server_utils import ServerThread

    with ServerThread(odd_model_dir, **ENGINE_OPTS) as server:
        def requests() -> None:
            for n, max_tokens in ((1, 4), (3, 8), (2, 5)):
                body = {"prompt": "the quick brown fox " * (4 * n), "max_tokens": max_tokens, "n": n}
                assert httpx.post(server.url("/v1/completions"), json=body, timeout=60).status_code == 200

        assert primitives_created(capfd, requests) == 0
    assert "rebuilding the packed matmuls' primitives" not in caplog.text


_FAULTS_PER_STEP = """
import json, resource, sys
from engine import LLM, SamplingParams

llm = LLM(model=sys.argv[1], num_kv_blocks=256, block_size=8, max_num_batched_tokens=256, max_num_seqs=32)
prompts = [[100 + 7 * i + j for j in range(5)] for i in range(32)]
params = SamplingParams(temperature=0.8, seed=1, max_tokens=40, ignore_eos=True)
llm.generate(prompts, params)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
llm.generate(prompts, params)  # 40 steps of 32 decodes: [32, 49152] float32 logits, 6 MiB, every step
print(json.dumps({"faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def test_steps_reuse_the_arena_without_page_faults(tiny_model_dir):
    """A step's large buffers (here 6 MiB of logits) come from the allocator's arena, not fresh mappings:
    pinning glibc's mmap threshold at 1 MiB once cost ~1,500 page faults a step here and half the CPU
    throughput. A fresh process: the allocator's state is per process."""
    proc = subprocess.run([sys.executable, "-c", _FAULTS_PER_STEP, str(tiny_model_dir("llama"))],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    faults = json.loads(proc.stdout.strip().splitlines()[-1])["faults"]
    assert faults < 40 * 1000, f"{faults} page faults in 40 steps"  # ~5k here; ~190k with a 1 MiB pin


def test_the_engine_gives_free_memory_back_when_it_goes_idle(tiny_model_dir, monkeypatch):
    """The arena keeps freed step buffers resident (a soak's server grew 20-50 MB): on the CPU the engine
    trims it at every busy -> idle transition (and the runner after its warm-up), never per step."""
    import engine.engine as engine_module
    from engine.malloc import trim_free_memory

    if not trim_free_memory():
        pytest.skip("not glibc: no malloc_trim")
    calls = []
    monkeypatch.setattr(engine_module, "trim_free_memory", lambda: calls.append(1) or True)
    llm = LLM(model=str(tiny_model_dir("llama")), **ENGINE_OPTS)
    for burst in range(3):
        _generate(llm)
        assert len(calls) == burst + 1
