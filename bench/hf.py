"""transformers on the same workload as kvserve, for a ratio: `generate` in static batches, and its continuous
batching (`generate_batch`, or the manager it wraps when output lengths differ)."""
from __future__ import annotations

import sys
from pathlib import Path

from bench.contenders import Contender
from bench.models import free_device_memory
from bench.workloads import Workload


def load_hf_model(model_path: Path, dtype, device):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()


def _hf_generation_config(model, max_new: int, temperature: float, ignore_eos_by: str):
    from transformers import GenerationConfig

    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else dict(
        do_sample=False)
    if ignore_eos_by == "min_new_tokens":
        eos = dict(min_new_tokens=max_new, eos_token_id=model.config.eos_token_id)
    else:
        eos = dict(eos_token_id=-1)  # continuous batching: -1 disables EOS
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    return GenerationConfig(max_new_tokens=max_new, pad_token_id=pad, **sampling, **eos)


def _static_batches(model, w: Workload, batch_size: int, device) -> int:
    """Left-padded static batches, each run to its longest requested output; returns the tokens asked for."""
    import torch

    for start in range(0, len(w.prompts), batch_size):
        prompts, lens = w.prompts[start:start + batch_size], w.output_lens[start:start + batch_size]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)  # [batch, width]
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        config = _hf_generation_config(model, max(lens), w.temperature, "min_new_tokens")
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    return w.output_tokens


def hf_generate(model, w: Workload, batch_size: int, warmup: bool, device) -> Contender:
    """transformers `generate` in static batches. Counted: the tokens asked for; a batch runs to its longest
    output, and the extra tokens of its shorter requests are the static-batching waste we measure against."""
    if warmup:
        short = Workload("warmup", w.prompts[:batch_size], [8] * min(batch_size, len(w.prompts)), w.temperature)
        _static_batches(model, short, batch_size, device)
    return Contender(f"transformers generate (static batches of {batch_size})",
                     lambda: _static_batches(model, w, batch_size, device))


def hf_generate_batch(model, w: Workload, warmup: bool) -> Contender:
    """transformers continuous batching (paged attention). `generate_batch` takes one max_new_tokens, so a
    workload with per-request output lengths (W-A) drives the ContinuousBatchingManager that generate_batch
    wraps, whose add_request takes max_new_tokens per request."""
    same_length = len(set(w.output_lens)) == 1
    config = _hf_generation_config(model, max(w.output_lens), w.temperature, "eos_token_id")
    cache = _cpu_cache_config(model, w)

    def run(prompts, lens) -> int:
        if not same_length:
            return _hf_manager_run(model, prompts, lens, config, cache)
        out = model.generate_batch(inputs=prompts, generation_config=config, continuous_batching_config=cache,
                                   progress_bar=False)
        return sum(len(o.generated_tokens) for o in out.values())

    if warmup:
        run(w.prompts[:16], [8] * min(16, len(w.prompts)))
    how = "continuous batching" if same_length else "its manager, per-request lengths"
    return Contender(f"transformers generate_batch ({how})", lambda: run(w.prompts, w.output_lens))


def _cpu_cache_config(model, w: Workload, page_size: int = 256):
    """On the CPU, transformers' paged cache sized to the workload (every request's prompt and output at once);
    None elsewhere (its own sizing from free device memory). Its CPU default sized the cache from host memory:
    18.7 s before the first token of 3 tiny requests on the 2-core development machine, 0.03 s so."""
    if model.device.type != "cpu":
        return None
    from transformers import ContinuousBatchingConfig

    pages = sum(-(-(len(p) + n) // page_size) for p, n in zip(w.prompts, w.output_lens))
    return ContinuousBatchingConfig(page_size=page_size, num_blocks=pages + len(w.prompts))  # + the warm-up's


def _hf_manager_run(model, prompts: list[list[int]], lens: list[int], config, cache=None) -> int:
    """Every request through one ContinuousBatchingManager; returns the tokens generated."""
    manager = model.init_continuous_batching(generation_config=config, continuous_batching_config=cache)
    manager.start()
    done: dict[str, int] = {}
    try:
        for i, (prompt, n) in enumerate(zip(prompts, lens)):
            manager.add_request(prompt, request_id=f"req-{i}", max_new_tokens=n)
        while len(done) < len(prompts):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                done[result.request_id] = len(result.generated_tokens)
            elif result is None and not manager.is_running():
                raise RuntimeError(f"transformers' generation thread stopped after {len(done)} requests")
    finally:
        manager.stop(block=True)
    return sum(done.values())


def hf_contenders(model_path: Path, w: Workload, methods: list[str], args, dtype, device) -> list[Contender]:
    """One contender per transformers method, sharing one loaded model (freed by the last one's close)."""
    model = load_hf_model(model_path, dtype, device)
    contenders = []
    for method in methods:
        try:
            if method == "generate":
                contenders.append(hf_generate(model, w, args.hf_batch_size, args.warmup, device))
            else:
                contenders.append(hf_generate_batch(model, w, args.warmup))
        except Exception as e:  # noqa: BLE001 - one failing comparison must not lose the others' figures
            print(f"bench throughput: transformers {method} failed: {type(e).__name__}: {e}", file=sys.stderr)
    if contenders:
        contenders[-1].close = free_device_memory
    return contenders
