"""`kvserve bench throughput`: offline throughput through the engine (`LLM.generate`), and optionally through
transformers on the same prompts in the same process, for a ratio.

Every workload is token ids (exact lengths, identical for both sides), with ignore-EOS semantics: kvserve gets
`ignore_eos=True`, transformers `min_new_tokens = max_new_tokens`. Presets name the standard workloads:
`wa` (nano-vllm's benchmark), `wb` (the GPU issue's W-B), `wl` and `wl-32k` (long prompts, issue 19's W-L)
and `cpu-smollm2` (the embedded default on a CPU).
`--model-config` builds a model with random weights from a config (e.g. `qwen2.5-0.5b`), so a host without a
model hub can run the GPU workloads.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import traceback
from datetime import datetime
from pathlib import Path

from bench.contenders import Measurement, kvserve_contender, time_contenders
from bench.datasets import SYNTHETIC, add_dataset_arguments
from bench.hf import hf_contenders
from bench.models import build_random_model, free_device_memory, parse_model_config
from bench.workloads import (WL_PRESETS, Workload, workload_cpu_smollm2, workload_from_dataset, workload_wa,
                             workload_wb, workload_wl)

PRESETS = ("wa", "wb", *WL_PRESETS, "cpu-smollm2")
# A preset's engine limits where the user set none: W-L's prompts need a long max_model_len and big chunks.
PRESET_LIMITS = {name: {"max_model_len": shape.max_model_len, "max_num_batched_tokens": 16384}
                 for name, shape in WL_PRESETS.items()}
PRESET_MODELS = {"wa": "qwen2.5-0.5b", "wb": "qwen2.5-0.5b",
                 **{name: shape.model_config for name, shape in WL_PRESETS.items()}}
HF_METHODS = ("generate", "generate_batch")


# ------------------------------------------------------------------------------------------------ kvserve


def engine_options(args: argparse.Namespace, backend: str | None) -> dict:
    """EngineConfig fields the user set; the rest keep the engine's defaults."""
    opts = {"dtype": args.dtype, "device": args.device, "block_size": args.block_size,
            "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_model_len": args.max_model_len, "num_kv_blocks": args.num_kv_blocks,
            "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
            "gpu_memory_utilization": args.gpu_memory_utilization, "attention_backend": backend}
    opts = {k: v for k, v in opts.items() if v is not None}
    if args.enforce_eager:
        opts["enforce_eager"] = True
    if args.cpu_packed_weights is not None:
        opts["cpu_packed_weights"] = args.cpu_packed_weights
    if not args.prefix_caching:
        opts["enable_prefix_caching"] = False
    if args.no_async_scheduling:
        opts["async_scheduling"] = False
    if args.skip_tokenizer_init:
        opts["skip_tokenizer_init"] = True
    return opts

# ------------------------------------------------------------------------------------------------- report


def _kvserve_vs_others(measurements: list[Measurement]):
    """(kvserve measurement, transformers measurement) pairs."""
    ours = [m for m in measurements if m.name.startswith("kvserve")]
    return [(a, b) for a in ours for b in measurements if not b.name.startswith("kvserve")]


def ratios(measurements: list[Measurement]) -> dict[str, float]:
    """Output-throughput ratio of each kvserve run to each transformers run."""
    return {f"{a.name} / {b.name}": b.elapsed_s / a.elapsed_s * a.output_tokens / b.output_tokens
            for a, b in _kvserve_vs_others(measurements)}


def paired_ratios(measurements: list[Measurement]) -> dict[str, float]:
    """With interleaved rounds: the median over rounds of each round's kvserve / transformers ratio."""
    return {f"{a.name} / {b.name}": statistics.median(tb / ta for ta, tb in zip(a.runs_s, b.runs_s))
            * a.output_tokens / b.output_tokens for a, b in _kvserve_vs_others(measurements)}


def print_table(w: Workload, measurements: list[Measurement], repeat: int) -> None:
    print(f"\nworkload {w.name}: {len(w.prompts)} requests, {w.input_tokens} prompt tokens, "
          f"{w.output_tokens} output tokens, temperature {w.temperature}; median of {repeat} run(s)")
    base = next((m for m in measurements if not m.name.startswith("kvserve")), None)
    header = f"{'':<58} {'elapsed s':>10} {'req/s':>8} {'out tok/s':>10} {'total tok/s':>12}"
    print(header + (f" {'ratio':>8}" if base else ""))
    for m in measurements:
        s = m.summary()
        line = (f"{m.name:<58} {s['elapsed_time']:>10.2f} {s['requests_per_second']:>8.2f} "
                f"{s['output_tokens_per_second']:>10.1f} {s['tokens_per_second']:>12.1f}")
        if base:
            line += f" {s['output_tokens_per_second'] / base.summary()['output_tokens_per_second']:>7.2f}x"
        print(line)
        for note in m.notes:
            print(f"    note: {note}")
    if base:
        print(f"ratio: output tokens/s relative to {base.name}")


# --------------------------------------------------------------------------------------------------- main


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=PRESETS, default=None,
                        help="wa / wb: the GPU workloads (default model: random-weight qwen2.5-0.5b); wl / wl-32k: "
                             "64 prompts of 8,192 / 32,768 ids -> 256 tokens (max-model-len 16384 / 40960, "
                             "max-num-batched-tokens 16384 unless set); wl-decode / wl-32k-decode: the same "
                             "prompts -> 1,024 tokens; cpu-smollm2: the embedded default on the "
                             "CPU. A preset replaces the dataset options")
    parser.add_argument("--model", default=None, help="model directory or hub id (default: the embedded SmolLM2)")
    parser.add_argument("--model-config", default=None,
                        help="build a model with random weights: qwen2.5-0.5b, a config .json file, or inline JSON")
    add_dataset_arguments(parser)
    parser.add_argument("--temperature", type=float, default=0.0, help="for --dataset workloads; 0 is greedy")
    e = parser.add_argument_group("engine (unset: the engine's defaults)")
    e.add_argument("--attention-backend", default="auto", help="one, or a comma-separated list to run each")
    e.add_argument("--dtype", default=None)
    e.add_argument("--device", default=None)
    for flag in ("--block-size", "--max-num-seqs", "--max-num-batched-tokens", "--max-model-len", "--num-kv-blocks",
                 "--kv-cache-memory-bytes"):
        e.add_argument(flag, type=int, default=None)
    e.add_argument("--gpu-memory-utilization", type=float, default=None)
    e.add_argument("--enforce-eager", action="store_true")
    e.add_argument("--cpu-packed-weights", action=argparse.BooleanOptionalAction, default=None,
                   help="oneDNN-packed float32 CPU matmuls (the engine's default: on)")
    e.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=False,
                   help="off by default: repeated runs resend the same prompts and would measure the cache "
                        "(vLLM's peer script turns it off too)")
    e.add_argument("--no-async-scheduling", action="store_true")
    e.add_argument("--skip-tokenizer-init", action="store_true", help="no detokenization (token ids out only)")
    c = parser.add_argument_group("measurement")
    c.add_argument("--compare-hf", nargs="?", const="generate", default=None, metavar="METHODS",
                   help="also run transformers on the same prompts: generate (default), generate_batch, or both "
                        "comma-separated")
    c.add_argument("--hf-batch-size", type=int, default=64, help="static batch size of transformers generate")
    c.add_argument("--repeat", type=int, default=1, help="measured runs of each; the median is reported")
    c.add_argument("--interleave", action="store_true",
                   help="load every system at once and alternate their runs round by round; also reports the "
                        "median of per-round ratios (for CPU comparisons on a noisy host; on a GPU each kvserve "
                        "engine would claim its own KV pool)")
    c.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="a short unmeasured run first (compilation, graph capture, allocator growth)")
    c.add_argument("--out", default=None, help="write the results as JSON")


def apply_preset(args: argparse.Namespace) -> None:
    """The preset's default model (random weights) and engine limits, where the user chose none. Prefix
    caching stays off (this command's default) for every preset."""
    if args.preset in PRESET_MODELS and args.model is None and args.model_config is None:
        args.model_config = PRESET_MODELS[args.preset]
    for name, value in PRESET_LIMITS.get(args.preset, {}).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.preset == "cpu-smollm2" and args.device is None:
        args.device = "cpu"


def resolve_model(args: argparse.Namespace, tmp_dir: Path) -> tuple[Path, dict | None]:
    """(model directory, the config it was built from if random)."""
    if args.model_config is not None:
        if args.model is not None:
            raise ValueError("pass --model or --model-config, not both")
        config = parse_model_config(args.model_config)
        print(f"building a random-weight {config.get('architectures', [config['model_type']])[0]} in {tmp_dir}")
        return build_random_model(config, tmp_dir), config
    from engine.loader import resolve_model_path

    return resolve_model_path(args.model), None


def make_workload(args: argparse.Namespace, model_path: Path) -> Workload:
    from transformers import AutoConfig

    vocab_size = AutoConfig.from_pretrained(model_path).vocab_size
    if args.preset == "wa":
        return workload_wa()
    if args.preset == "wb":
        return workload_wb()
    if args.preset in WL_PRESETS:
        return workload_wl(vocab_size, args.preset)
    if args.preset == "cpu-smollm2":
        return workload_cpu_smollm2(vocab_size)
    tokenizer = None
    if args.dataset not in SYNTHETIC:
        from engine.loader import load_tokenizer

        tokenizer = load_tokenizer(model_path)
    return workload_from_dataset(args, tokenizer, vocab_size)


def check_args(args: argparse.Namespace) -> list[str]:
    """The transformers methods to compare with; ValueError says what is wrong."""
    if args.repeat < 1 or args.hf_batch_size < 1:
        raise ValueError("--repeat and --hf-batch-size must be >= 1")
    methods = [m.strip() for m in (args.compare_hf or "").split(",") if m.strip()]
    if any(m not in HF_METHODS for m in methods):
        raise ValueError(f"--compare-hf takes {', '.join(HF_METHODS)} (comma-separated)")
    return methods


def run_all(args, model_path: Path, w: Workload, methods: list[str]) -> list[Measurement]:
    """Each system in turn (load, warm up, `repeat` runs, free), or with --interleave all loaded at once
    and their runs interleaved round by round (CPU comparisons: nothing there needs freeing in between)."""
    from engine.setup import resolve_device, resolve_dtype

    preparers = []
    for backend in [b.strip() for b in args.attention_backend.split(",") if b.strip()]:
        preparers.append((f"kvserve with {backend}",
                          lambda b=backend: [kvserve_contender(model_path, engine_options(args, b), w, args.warmup)]))
    if methods:
        device = resolve_device(args.device or "auto")
        dtype = resolve_dtype(args.dtype or "auto", device)
        preparers.append((f"transformers {', '.join(methods)} ({dtype}, {device})",
                          lambda: hf_contenders(model_path, w, methods, args, dtype, device)))
    measurements, loaded = [], []
    for label, prepare in preparers:
        print(f"{label}: {len(w.prompts)} requests ...", flush=True)
        try:
            contenders = prepare()
        except Exception:  # noqa: BLE001 - one failing system must not lose the others' figures
            print(f"bench throughput: {label} failed:\n{traceback.format_exc()}", file=sys.stderr)
            free_device_memory()
            continue
        if args.interleave:
            loaded += contenders
            continue
        measurements += time_contenders(contenders, w, args.repeat)
        for c in contenders:
            c.close()
    if loaded:
        print(f"interleaved: {args.repeat} rounds of {', '.join(c.name for c in loaded)}", flush=True)
        measurements = time_contenders(loaded, w, args.repeat)
        for c in loaded:
            c.close()
    return measurements


def result_record(args, model_path: Path, config: dict | None, w: Workload, measurements: list) -> dict:
    return {
        "date": datetime.now().strftime("%Y-%m-%d %H:%M:%S"), "preset": args.preset,
        "model": None if config else str(model_path), "model_config": config,
        "workload": {"name": w.name, "num_requests": len(w.prompts), "input_tokens": w.input_tokens,
                     "output_tokens": w.output_tokens, "temperature": w.temperature, "ignore_eos": True},
        "engine_options": engine_options(args, None), "attention_backends": args.attention_backend,
        "repeat": args.repeat, "warmup": args.warmup, "hf_batch_size": args.hf_batch_size,
        "results": [m.summary() for m in measurements], "ratios": ratios(measurements),
        "interleave": args.interleave, "paired_ratios": paired_ratios(measurements) if args.interleave else None,
    }


def main(args: argparse.Namespace) -> int:
    tmp_dir = Path(tempfile.mkdtemp(prefix="kvserve-bench-model-"))
    try:
        methods = check_args(args)
        apply_preset(args)
        model_path, config = resolve_model(args, tmp_dir)
        workload = make_workload(args, model_path)
        measurements = run_all(args, model_path, workload, methods)
    except (ValueError, FileNotFoundError) as e:
        print(f"bench throughput: {e}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    print_table(workload, measurements, args.repeat)
    if args.interleave:
        for pair, r in paired_ratios(measurements).items():
            print(f"median of per-round ratios, {pair}: {r:.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result_record(args, model_path, config, workload, measurements), f, indent=1)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve bench throughput", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return parser


if __name__ == "__main__":
    sys.exit(main(build_parser().parse_args()))
