"""vLLM's side of W-L (long prompts, issue 19): the same prompts as `kvserve bench throughput --preset wl|wl-32k`
(and wl-decode, wl-32k-decode: 1,024 output tokens),
through vLLM 0.24.0's offline engine on the H200 host, with vLLM's environment:

    PYTHONPATH=/tmp/vllm-site python3 benchmarks/vllm_wl.py --preset wl --repeat 3 --out vllm-wl.json
    PYTHONPATH=/tmp/vllm-site python3 benchmarks/vllm_wl.py --preset wl-32k --repeat 2 --out vllm-wl32k.json

and kvserve's, one after the other in the same device call:

    python3 -m bench.throughput --preset wl --skip-tokenizer-init --repeat 3 --out kvserve-wl.json

The model: Qwen2.5-0.5B's shape (bench/models.py's config; 40,960 positions for wl-32k), bf16, random weights
(vLLM's load_format="dummy"), no tokenizer. The engine settings are the preset's: max_model_len 16384
(wl-32k: 40960), max_num_batched_tokens 16384, prefix caching off; the rest vLLM's defaults. Prompts from
bench/workloads.py (numpy only, importable beside vLLM: this checkout goes last on the path, after vLLM's
packages). Greedy, ignore_eos, no detokenization; one warm-up generate; each repetition timed. Prints a line
per repetition and the median, writes JSON with bench throughput's keys.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # last: vLLM's own packages come first

from bench.models import builtin_model_config  # noqa: E402
from bench.workloads import WL_PRESETS, workload_wl  # noqa: E402

ENV = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
       "TOKENIZERS_PARALLELISM": "false", "VLLM_USE_FLASHINFER_SAMPLER": "0"}  # as shared/peers/vllm/bench.py


def model_dir(config_name: str) -> str:
    config = builtin_model_config(config_name)
    config["torch_dtype"] = config.pop("dtype")
    path = tempfile.mkdtemp(prefix="vllm-wl-model-")
    Path(path, "config.json").write_text(json.dumps(config))
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(WL_PRESETS), default="wl")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--output-len", type=int, default=None,
                        help="output tokens per prompt (default: the preset's 256); 1 times the prefill alone")
    parser.add_argument("--prefill-repeat", type=int, default=0,
                        help="then time the same prompts with 1 output token this many times: the prefill alone")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    for key, value in ENV.items():
        os.environ.setdefault(key, value)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    shape = WL_PRESETS[args.preset]
    max_model_len = shape.max_model_len
    w = workload_wl(builtin_model_config(shape.model_config)["vocab_size"], args.preset)
    llm = LLM(model=model_dir(shape.model_config), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              max_model_len=max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
              enable_prefix_caching=False, seed=0)
    inputs = [TokensPrompt(prompt_token_ids=p) for p in w.prompts]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len or w.output_lens[0], ignore_eos=True,
                            detokenize=False)
    llm.generate(inputs[:4], SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False), use_tqdm=False)
    runs = []
    for rep in range(args.repeat):
        start = time.perf_counter()
        produced = sum(len(o.outputs[0].token_ids) for o in llm.generate(inputs, params, use_tqdm=False))
        runs.append(time.perf_counter() - start)
        print(f"vLLM {w.name} run {rep + 1}: {runs[-1]:.2f} s, {(w.input_tokens + produced) / runs[-1]:,.0f} "
              f"total tok/s ({produced} output tokens)", flush=True)
    t = statistics.median(runs)
    summary = {"name": "vLLM 0.24.0", "workload": w.name, "elapsed_time": t, "num_requests": len(w.prompts),
               "input_tokens": w.input_tokens, "output_tokens": produced,
               "tokens_per_second": (w.input_tokens + produced) / t, "output_tokens_per_second": produced / t,
               "runs_s": runs, "max_model_len": max_model_len, "max_num_batched_tokens": args.max_num_batched_tokens}
    print(f"vLLM {w.name}: median {t:.2f} s, {summary['tokens_per_second']:,.0f} total tok/s", flush=True)
    prefill_runs = []
    for rep in range(args.prefill_repeat):
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
        start = time.perf_counter()
        llm.generate(inputs, one, use_tqdm=False)
        prefill_runs.append(time.perf_counter() - start)
        print(f"vLLM {w.name} prefill alone (1 output token) run {rep + 1}: {prefill_runs[-1]:.3f} s", flush=True)
    summary["prefill_only_runs_s"] = prefill_runs
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
