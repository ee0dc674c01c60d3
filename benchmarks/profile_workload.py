"""Where a whole workload's time goes, per backend: steps grouped by what they hold, and kernels per phase.

    python benchmarks/profile_workload.py --preset wa --attention-backend triton,flash-attn-4 --out wa-profile.json

profile_step.py looks at one steady decode step; an end-to-end figure (bench throughput) also pays for
prefill steps, the steps where prefills and decodes mix, and the tail where few long requests remain.
This runs the preset's workload once to warm up, then once more timing every step (the wall time between
two schedule() calls, which with async scheduling is the pipeline's period) and grouping the steps:
"prefill" (any prompt tokens in the step) and decode-only steps by batch size. Then it runs it a third
time with torch.profiler on for a few windows of steps (--windows) and sums device time per kernel in each.
Prints a table per backend and a side-by-side summary; writes JSON.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402

from bench.models import QWEN2_5_0_5B, build_random_model, free_device_memory, parse_model_config  # noqa: E402
from bench.throughput import PRESET_LIMITS, PRESET_MODELS  # noqa: E402
from bench.workloads import WL_PRESETS, workload_wa, workload_wb, workload_wl  # noqa: E402

VOCAB = QWEN2_5_0_5B["vocab_size"]
WORKLOADS = {"wa": workload_wa, "wb": workload_wb,
             **{name: (lambda name=name: workload_wl(VOCAB, name)) for name in WL_PRESETS}}
DEFAULT_LIMITS = {"max_model_len": 2048, "max_num_batched_tokens": 16384}
DECODE_GROUPS = ((193, 256), (129, 192), (65, 128), (17, 64), (1, 16))
# Kernel name fragments -> what the layer does (first match wins), for the per-category breakdown.
CATEGORIES = (("attention", ("attention", "attn", "flash", "fmha", "merge_splits")), ("kv write", ("write_kv",)),
              ("matmul", ("gemm", "sm90_xmma", "cutlass", "nvjet", "matmul", "splitk")),
              ("norm", ("rms_norm", "norm")), ("rope", ("rope",)), ("silu*mul", ("silu",)),
              ("sampling / logits", ("argmax", "softmax", "sort", "topk", "exponential", "sampl")))


def category(kernel: str) -> str:
    name = kernel.lower()
    return next((c for c, keys in CATEGORIES if any(k in name for k in keys)), "other")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def step_group(sched_out) -> str:
    if any(s.num_new_tokens > 1 for s in sched_out.scheduled):
        return "prefill (with decodes)"
    n = len(sched_out.scheduled)
    lo, hi = next(g for g in DECODE_GROUPS if g[0] <= n <= g[1])
    return f"decode {lo}-{hi}"


def add_workload(engine, workload) -> None:
    from engine.request import SamplingParams

    for i, (prompt, out_len) in enumerate(zip(workload.prompts, workload.output_lens)):
        params = SamplingParams(temperature=workload.temperature, max_tokens=out_len, ignore_eos=True)
        engine.add_request(f"r{i}", [t % engine.vocab_size for t in prompt], params)


def run_timed(engine, workload) -> dict:
    """One run; every step's period (schedule to schedule) summed per group."""
    marks: list[tuple[float, str]] = []
    schedule = engine.scheduler.schedule

    def timed_schedule():
        out = schedule()
        if not out.is_empty:
            marks.append((time.perf_counter(), step_group(out)))
        return out

    engine.scheduler.schedule = timed_schedule
    add_workload(engine, workload)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    sync()
    end = time.perf_counter()
    del engine.scheduler.schedule
    groups: dict[str, list[float]] = defaultdict(list)
    for (t, group), (t_next, _) in zip(marks, marks[1:] + [(end, "")]):
        groups[group].append(t_next - t)
    return {"wall_s": end - start, "steps": len(marks),
            "groups": {g: {"steps": len(v), "total_s": sum(v), "mean_ms": sum(v) / len(v) * 1e3}
                       for g, v in sorted(groups.items())}}


def run_profiled(engine, workload, windows: list[tuple[int, int]]) -> list[dict]:
    """One run with torch.profiler on for each [first, last) window of steps: device time per kernel."""
    from torch.profiler import ProfilerActivity, profile

    add_workload(engine, workload)
    results, step, prof = [], 0, None
    while engine.has_unfinished_requests():
        window = next((w for w in windows if w[0] <= step < w[1]), None)
        if window is not None and prof is None:
            cuda = torch.cuda.is_available()  # on the CPU (a smoke test) ops stand in for kernels
            prof = profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU])
            prof.start()
            batch = len(engine.scheduler.running)
        engine.step()
        step += 1
        if prof is not None and (window is None or step == window[1]):
            sync()
            prof.stop()
            results.append(kernel_table(prof, window or (step - 1, step), batch))
            prof = None
    return results


def kernel_table(prof, window: tuple[int, int], batch: int, top: int = 12) -> dict:
    steps = window[1] - window[0]
    per_kernel: dict[str, float] = defaultdict(float)
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[evt.name] += evt.device_time_total / steps
        elif not torch.cuda.is_available():
            per_kernel[evt.name] += evt.self_cpu_time_total / steps
    total = sum(per_kernel.values())
    rows = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:top]
    per_category: dict[str, float] = defaultdict(float)
    for k, v in per_kernel.items():
        per_category[category(k)] += v
    return {"window": list(window), "batch_at_start": batch, "device_us_per_step": total,
            "categories": {c: v for c, v in sorted(per_category.items(), key=lambda kv: -kv[1])},
            "top": [{"kernel": k[:100], "us_per_step": v, "share": v / total} for k, v in rows]}


def profile_backend(model_dir: Path, backend: str, split_keys: int | None, workloads: dict, args,
                    decode_kernel: str | None = None, fused_mlp: int | None = None) -> list[dict]:
    """One engine, each workload warmed up then timed; the first workload also profiled in windows.
    fused_mlp: the rows from which the MLP's gate/up runs fused with SiLU*mul (None: the model's default)."""
    from attention.triton_paged import TritonAttentionImpl
    from engine.llm import LLM
    from engine.malloc import freeze_startup_objects
    from engine.mlp_kernel import FUSED_MIN_TOKENS
    from engine.model import MLP

    MLP.fused_min_tokens = FUSED_MIN_TOKENS if fused_mlp is None else fused_mlp
    if args.fused_mlp_tile_json:
        MLP.fused_tile = best_fused_tile(args.fused_mlp_tile_json)

    # Read at capture: graphs keep the split count and the kernel they were captured with.
    TritonAttentionImpl.decode_split_keys = split_keys
    TritonAttentionImpl.decode_kernel = decode_kernel
    limits = PRESET_LIMITS.get(next(iter(workloads)), DEFAULT_LIMITS)
    llm = LLM(model=str(model_dir), attention_backend=backend, max_num_seqs=256, skip_tokenizer_init=True,
              enable_prefix_caching=False, block_size=args.block_size, **limits)
    engine, results = llm.engine, []
    windows = [tuple(int(x) for x in w.split("-")) for w in args.windows.split(",") if w]
    for i, (name, workload) in enumerate(workloads.items()):
        run_timed(engine, workload)  # warm-up: every graph size and JIT variant the workload meets
        freeze_startup_objects()  # as the server and bench throughput do (engine/malloc.py)
        timed = run_timed(engine, workload)
        kernels = run_profiled(engine, workload, windows) if windows and i == 0 else []
        results.append({"backend": engine.backend_name, "triton_decode_split_keys": split_keys,
                        "triton_decode_kernel": decode_kernel, "fused_mlp_min_tokens": fused_mlp,
                        "block_size": engine.block_size, "preset": name,
                        "output_tokens": workload.output_tokens,
                        "out_tok_per_s": workload.output_tokens / timed["wall_s"], **timed, "kernels": kernels})
        print_result(results[-1])
    del llm, engine
    free_device_memory()  # unfrozen and collected: the next backend's engine needs this one's memory back
    return results


def best_fused_tile(path: Path):
    """The fastest checked tile of benchmarks/gate_up_silu.py's JSON at its largest row count of W-L's model."""
    from engine.mlp_kernel import Tile

    rows = [r for r in json.loads(path.read_text())["results"] if r.get("tile") and r["ms"] and r["hidden"] == 896]
    best = min((r for r in rows if r["tokens"] == max(r["tokens"] for r in rows)), key=lambda r: r["ms"])
    return Tile(**best["tile"])


def label(r: dict) -> str:
    keys = r["triton_decode_split_keys"]
    split = "" if not keys else " (decode: no split)" if keys >= 1 << 20 else f" (decode ranges of {keys})"
    kernel = f" ({r['triton_decode_kernel']} decode)" if r.get("triton_decode_kernel") else ""
    fused = r.get("fused_mlp_min_tokens")
    mlp = "" if fused is None else " (MLP unfused)" if fused >= 1 << 40 else f" (MLP fused from {fused} rows)"
    return f"{r['backend']}{split}{kernel}{mlp}, {r['preset']}"


def group_order(group: str) -> tuple[int, int]:
    # The prefill steps first, then decode groups from the largest batches down: a run's order in time.
    return (0, 0) if group.startswith("prefill") else (1, -int(group.split("-")[-1]))


def print_result(r: dict) -> None:
    print(f"\n== {label(r)}: {r['wall_s']:.3f} s, {r['steps']} steps, {r['out_tok_per_s']:,.0f} output tok/s")
    print(f"{'group':>24} {'steps':>6} {'total s':>8} {'ms/step':>8}")
    for g, v in r["groups"].items():
        print(f"{g:>24} {v['steps']:6d} {v['total_s']:8.3f} {v['mean_ms']:8.3f}")
    for k in r["kernels"]:
        print(f"-- steps {k['window'][0]}-{k['window'][1]} (batch {k['batch_at_start']}): "
              f"{k['device_us_per_step'] / 1e3:.3f} ms of kernels per step")
        print("   " + ", ".join(f"{c} {v / 1e3:.2f} ms ({v / k['device_us_per_step']:.0%})"
                                 for c, v in k.get("categories", {}).items()))
        for row in k["top"]:
            print(f"{row['us_per_step']:10.1f} us {row['share']:6.1%}  {row['kernel']}")


def print_summary(results: list[dict]) -> None:
    for preset in dict.fromkeys(r["preset"] for r in results):
        rows = [r for r in results if r["preset"] == preset]
        groups = sorted({g for r in rows for g in r["groups"]}, key=group_order)
        print(f"\n{preset}, seconds per group: " + " | ".join(label(r) for r in rows))
        for g in groups:
            print(f"{g:>24} " + " ".join(f"{r['groups'].get(g, {}).get('total_s', 0):10.3f}" for r in rows))
        print(f"{'total':>24} " + " ".join(f"{r['wall_s']:10.3f}" for r in rows))
        print(f"{'output tok/s':>24} " + " ".join(f"{r['out_tok_per_s']:10.0f}" for r in rows))


def plot_groups(results: list[dict], path: Path) -> None:
    """Per run, one bar stacked by step group (seconds): where the runs of each workload differ."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({g for r in results for g in r["groups"]}, key=group_order)
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.55 * len(results)))
    labels = [label(r) for r in results]
    left = [0.0] * len(results)
    for g in groups:
        widths = [r["groups"].get(g, {}).get("total_s", 0.0) for r in results]
        ax.barh(labels, widths, left=left, label=g)
        left = [a + b for a, b in zip(left, widths)]
    for y, r in enumerate(results):
        ax.text(left[y], y, f" {r['out_tok_per_s']:,.0f} tok/s", va="center", fontsize=8)
    ax.set_xlim(0, max(left) * 1.25)  # room for the tok/s labels
    ax.set_xlabel("seconds (one timed run)")
    ax.invert_yaxis()
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_categories(results: list[dict], path: Path) -> None:
    """Per run and profiled window, one bar of device ms per step stacked by kernel category."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [(f"{label(r)}, steps {k['window'][0]}-{k['window'][1]} (batch {k['batch_at_start']})", k["categories"])
            for r in results for k in r["kernels"] if "categories" in k]
    cats = [c for c, _ in CATEGORIES] + ["other"]
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.55 * len(bars)))
    left = [0.0] * len(bars)
    for c in cats:
        widths = [b[1].get(c, 0.0) / 1e3 for b in bars]
        ax.barh([b[0] for b in bars], widths, left=left, label=c)
        left = [a + w for a, w in zip(left, widths)]
    for y, total in enumerate(left):
        ax.text(total, y, f" {total:.1f} ms", va="center", fontsize=8)
    ax.set_xlim(0, max(left) * 1.2)
    ax.set_xlabel("device ms per step (torch.profiler)")
    ax.invert_yaxis()
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="wa", help=f"comma-separated, of {sorted(WORKLOADS)}; the engine takes the "
                   "first one's limits (wl, wl-32k: bench throughput's), so profile wl and wl-32k in separate runs")
    p.add_argument("--attention-backend", default="triton,flash-attn-4")
    p.add_argument("--windows", default="0-12,300-306,800-806", help="step windows to profile, first-last")
    p.add_argument("--model-config", help="default: the first preset's (bench throughput's PRESET_MODELS)")
    p.add_argument("--num-requests", type=int, help="only the first N requests (a CPU smoke test)")
    p.add_argument("--triton-decode-split-keys", default="",
                   help="comma-separated keys per split-KV range in triton's decode-only batches, one engine "
                        "each (a huge value: no split); default: the kernel's")
    p.add_argument("--triton-decode-kernel", default="",
                   help="comma-separated, of pointer and tma: triton's decode-only kernel, one engine each; "
                        "default: the kernel's choice")
    p.add_argument("--block-size", type=int, help="KV page size; default: the backend's")
    p.add_argument("--fused-mlp-min-tokens", default="",
                   help="comma-separated: the rows from which gate/up runs fused with SiLU*mul, one engine each, "
                        "alternated with the split-KV ranges (a huge value: never); default: the model's")
    p.add_argument("--fused-mlp-tile-json", type=Path, help="take the fused kernel's tile from this "
                   "benchmarks/gate_up_silu.py output (its fastest at W-L's shape)")
    p.add_argument("--out", type=Path)
    p.add_argument("--plot", type=Path, help="a PNG of the step groups per run, and beside it (NAME_kernels.png) "
                   "one of each profiled window's kernels by category")
    p.add_argument("--replot", type=Path, nargs="+",
                   help="only plot earlier --out files, their runs together (no GPU needed)")
    args = p.parse_args()
    if args.replot:
        results = [r for f in args.replot for r in json.loads(f.read_text())["results"]]
        plot_groups(results, args.plot)
        plot_categories(results, args.plot.with_name(args.plot.stem + "_kernels.png"))
        return 0
    workloads = {name: WORKLOADS[name]() for name in args.preset.split(",")}
    for w in workloads.values():
        if args.num_requests:
            w.prompts, w.output_lens = w.prompts[:args.num_requests], w.output_lens[:args.num_requests]
    splits = [int(x) for x in args.triton_decode_split_keys.split(",") if x] or [None]
    fused_options = [int(x) for x in args.fused_mlp_min_tokens.split(",") if x] or [None]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        config = args.model_config or PRESET_MODELS[args.preset.split(",")[0]]
        model_dir = build_random_model(parse_model_config(config), Path(tmp))
        for backend in args.attention_backend.split(","):
            kernels = [k for k in args.triton_decode_kernel.split(",") if k] or [None]
            triton_axes = (splits, kernels) if "triton" in backend else ([None], [None])
            for split_keys, kernel, fused in itertools.product(*triton_axes, fused_options):
                results += profile_backend(model_dir, backend, split_keys, workloads, args, kernel, fused)
                if args.out:  # after each engine: a run cut short still leaves what it measured
                    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
                    args.out.write_text(json.dumps({"device": device, "results": results}, indent=2))
    print_summary(results)
    if args.plot:
        plot_groups(results, args.plot)
        plot_categories(results, args.plot.with_name(args.plot.stem + "_kernels.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
