"""`kvserve bench throughput`: offline throughput through the engine (`LLM.generate`), and optionally through
transformers on the same prompts in the same process, for a ratio.

Every workload is token ids (exact lengths, identical for both sides), with ignore-EOS semantics: kvserve gets
`ignore_eos=True`, transformers `min_new_tokens = max_new_tokens`. Presets name the standard workloads:
`wa` (nano-vllm's benchmark), `wb` (the GPU issue's W-B) and `cpu-smollm2` (the embedded default on a CPU).
`--model-config` builds a model with random weights from a config (e.g. `qwen2.5-0.5b`), so a host without a
model hub can run the GPU workloads.
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable
from datetime import datetime
from pathlib import Path

from server.bench_datasets import add_dataset_arguments, requests_from_args

PRESETS = ("wa", "wb", "cpu-smollm2")
HF_METHODS = ("generate", "generate_batch")


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]
    temperature: float  # 0: greedy

    @property
    def input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass
class Measurement:
    name: str
    runs_s: list[float]  # wall time of each measured run
    num_requests: int
    input_tokens: int
    output_tokens: int  # produced by one run (requested tokens for static batches: see hf_generate)
    notes: list[str] = field(default_factory=list)

    @property
    def elapsed_s(self) -> float:
        return statistics.median(self.runs_s)

    def summary(self) -> dict:
        t = self.elapsed_s
        # vLLM's throughput keys first (elapsed_time, requests_per_second, tokens_per_second = all tokens).
        return {"name": self.name, "elapsed_time": t, "num_requests": self.num_requests,
                "total_num_tokens": self.input_tokens + self.output_tokens,
                "requests_per_second": self.num_requests / t,
                "tokens_per_second": (self.input_tokens + self.output_tokens) / t,
                "output_tokens_per_second": self.output_tokens / t, "output_tokens": self.output_tokens,
                "input_tokens": self.input_tokens, "runs_s": self.runs_s, "notes": self.notes}


# ------------------------------------------------------------------------------------------------ models


def builtin_model_config(name: str) -> dict | None:
    """Shapes of well-known models, for random-weight builds. Qwen2.5-0.5B: the GPU issue's model."""
    configs = {
        "qwen2.5-0.5b": dict(
            architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=896, intermediate_size=4864,
            num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
            tie_word_embeddings=True, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
            hidden_act="silu", use_sliding_window=False, bos_token_id=151643, eos_token_id=151643,
            dtype="bfloat16"),
    }
    return configs.get(name)


def parse_model_config(value: str) -> dict:
    """A built-in name, a path to a JSON file, or inline JSON."""
    if (config := builtin_model_config(value)) is not None:
        return config
    path = Path(value)
    text = path.read_text() if path.suffix == ".json" and path.is_file() else value
    try:
        config = json.loads(text)
    except json.JSONDecodeError:
        raise ValueError(f"--model-config {value!r} is neither a built-in name (qwen2.5-0.5b), "
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


def build_random_model(config: dict, out_dir: Path, seed: int = 0) -> Path:
    """A transformers model of `config` with random weights, saved with save_pretrained (+ a tokenizer)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = dict(config)
    dtype = getattr(torch, config.pop("dtype", None) or config.pop("torch_dtype", None) or "float32")
    hf_config = AutoConfig.for_model(config.pop("model_type"), **config)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    model.save_pretrained(out_dir)
    eos = hf_config.eos_token_id if isinstance(hf_config.eos_token_id, int) else 0
    save_id_tokenizer(hf_config.vocab_size, eos, out_dir)
    return out_dir


# --------------------------------------------------------------------------------------------- workloads


def workload_wa() -> Workload:
    """nano-vllm's bench.py: 256 prompts of 100-1024 ids in [0, 10000], outputs of 100-1024, T=0.6."""
    rnd = random.Random(0)
    prompts = [[rnd.randint(0, 10000) for _ in range(rnd.randint(100, 1024))] for _ in range(256)]
    output_lens = [rnd.randint(100, 1024) for _ in range(256)]
    return Workload("W-A", prompts, output_lens, temperature=0.6)


def workload_wb() -> Workload:
    """256 prompts of 512 ids from torch.randint(100, 150000) under seed 0; 128 greedy output tokens each."""
    import torch

    gen = torch.Generator().manual_seed(0)  # the same stream as torch.manual_seed(0), without global state
    prompts = torch.randint(100, 150000, (256, 512), generator=gen).tolist()
    return Workload("W-B", prompts, [128] * 256, temperature=0.0)


def workload_cpu_smollm2(vocab_size: int) -> Workload:
    """32 requests of 128 prompt ids (vLLM's random dataset) and 64 greedy output tokens."""
    from server.bench_datasets import random_requests

    reqs = random_requests(32, 128, 64, 0.0, seed=0, vocab_size=vocab_size)
    return Workload("cpu-smollm2", [r.prompt for r in reqs], [r.expected_output_len for r in reqs], 0.0)


def workload_from_dataset(args: argparse.Namespace, tokenizer, vocab_size: int) -> Workload:
    """--dataset random|sharegpt|PATH.jsonl, as token ids (text prompts tokenized as the engine would)."""
    args.random_vocab_size = vocab_size
    reqs = requests_from_args(args, tokenizer if args.dataset != "random" else None)
    prompts = [r.prompt if isinstance(r.prompt, list) else tokenizer.encode(r.prompt) for r in reqs]
    return Workload(args.dataset, prompts, [r.expected_output_len for r in reqs], args.temperature)


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


def free_device_memory() -> None:
    import torch

    gc.unfreeze()  # what a contender froze (freeze_startup_objects) can be collected again
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@dataclass
class Contender:
    """A system loaded and warmed up: run_once() runs the whole workload and returns the output tokens it
    produced (transformers `generate`: the tokens asked for, see hf_generate)."""
    name: str
    run_once: Callable[[], int]
    close: Callable[[], None] = lambda: None


def time_contenders(contenders: list[Contender], w: Workload, repeat: int) -> list[Measurement]:
    """`repeat` rounds, each running every contender once in turn: with several contenders the runs are
    interleaved, so a slow spell of a noisy host hits each of them instead of one. A contender that fails
    is reported and left out of the rest."""
    runs: dict[str, list[float]] = {c.name: [] for c in contenders}
    produced: dict[str, int] = {}
    for _ in range(repeat):
        for c in list(contenders):
            start = time.perf_counter()
            try:
                produced[c.name] = c.run_once()
            except Exception as e:  # noqa: BLE001 - one failing comparison must not lose the others' figures
                print(f"bench throughput: {c.name} failed: {type(e).__name__}: {e}", file=sys.stderr)
                contenders = [x for x in contenders if x is not c]
                continue
            runs[c.name].append(time.perf_counter() - start)
    measurements = []
    for c in contenders:
        m = Measurement(c.name, runs[c.name], len(w.prompts), w.input_tokens, produced[c.name])
        if produced[c.name] != w.output_tokens:
            m.notes.append(f"produced {produced[c.name]} output tokens, {w.output_tokens} asked for")
        measurements.append(m)
    return measurements


def kvserve_contender(model_path: Path, opts: dict, w: Workload, warmup: bool) -> Contender:
    from engine.llm import LLM
    from engine.malloc import freeze_startup_objects
    from engine.request import SamplingParams

    llm = LLM(model=str(model_path), **opts)
    params = [SamplingParams(temperature=w.temperature, max_tokens=n, ignore_eos=True) for n in w.output_lens]
    if warmup:  # compiles, CUDA graph captures and allocator growth happen here, not in the measurement
        llm.generate(w.prompts[:16], [SamplingParams(temperature=w.temperature, max_tokens=8, ignore_eos=True)] *
                     min(16, len(w.prompts)))
    freeze_startup_objects()  # a full collection in a timed run would cost it ~0.1-0.3 s (engine/malloc.py)
    name = f"kvserve ({llm.engine.backend_name}, {str(llm.engine.dtype).removeprefix('torch.')}, {llm.engine.device})"

    def close() -> None:
        nonlocal llm
        llm = None
        free_device_memory()

    return Contender(name, lambda: sum(len(o.outputs[0].token_ids) for o in llm.generate(w.prompts, params)), close)


# ------------------------------------------------------------------------------------------- transformers


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

    def run(prompts, lens) -> int:
        if not same_length:
            return _hf_manager_run(model, prompts, lens, config)
        out = model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
        return sum(len(o.generated_tokens) for o in out.values())

    if warmup:
        run(w.prompts[:16], [8] * min(16, len(w.prompts)))
    how = "continuous batching" if same_length else "its manager, per-request lengths"
    return Contender(f"transformers generate_batch ({how})", lambda: run(w.prompts, w.output_lens))


def _hf_manager_run(model, prompts: list[list[int]], lens: list[int], config) -> int:
    """Every request through one ContinuousBatchingManager; returns the tokens generated."""
    manager = model.init_continuous_batching(generation_config=config)
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
                        help="wa / wb: the GPU workloads (default model: random-weight qwen2.5-0.5b); "
                             "cpu-smollm2: the embedded default on the CPU. A preset replaces the dataset options")
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
    if args.preset in ("wa", "wb") and args.model is None and args.model_config is None:
        args.model_config = "qwen2.5-0.5b"
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
    if args.preset == "cpu-smollm2":
        return workload_cpu_smollm2(vocab_size)
    tokenizer = None
    if args.dataset != "random":
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
    from engine.engine import resolve_device, resolve_dtype

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
