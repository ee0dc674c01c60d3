"""Where a decode step's time goes: host vs device, per kernel, against the memory roofline.

    python benchmarks/profile_step.py --attention-backend triton,flash-attn-4 --out profile.json

Builds the Qwen2.5-0.5B shape with random bfloat16 weights (the GPU issue's model), admits W-B's 256
requests (512-token prompts, greedy), steps until every one of them decodes, then
  1. times --steps decode steps end to end, and the host's share of each (schedule, launch, postprocess;
     `collect` is the wait for the device),
  2. records --profile-steps more under torch.profiler and sums device time per kernel,
  3. compares the step with the roofline: weights + the KV read per step over --hbm-tb-s,
  4. runs cProfile over --profile-steps more: the host functions with the most own time.
Prints a table per backend and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402

from bench.models import build_random_model, parse_model_config  # noqa: E402
from bench.workloads import workload_wb  # noqa: E402

# launch includes inputs (prepare_inputs), metadata (the host arrays of the attention metadata) and replay
# (the CUDA graph's uploads and launch: 1.0-2.0 ms of host time a step through the server on H100 hosts,
# docs/benchmarks.md, eleventh session).
HOST_PARTS = ("schedule", "launch", "inputs", "metadata", "replay", "postprocess", "collect")


class PartTimer:
    """Wraps methods or module functions so each call's wall time adds up under a name (the host-side
    view of a step); restore() puts the originals back."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._wrapped: list[tuple[object, str, object]] = []

    def wrap(self, obj, attr: str, name: str) -> None:
        fn = getattr(obj, attr)
        self._wrapped.append((obj, attr, obj.__dict__.get(attr)))

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[name] += time.perf_counter() - start
                self.calls[name] += 1

        setattr(obj, attr, timed)

    def restore(self) -> None:
        for obj, attr, original in reversed(self._wrapped):
            if original is None:
                delattr(obj, attr)  # an instance attribute shadowing the class's method
            else:
                setattr(obj, attr, original)
        self._wrapped.clear()


def start_decoding(llm, num_requests: int, temperature: float = 0.0) -> None:
    """Admit W-B's prompts with long outputs and step until every request has sampled tokens."""
    from engine.request import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=temperature, max_tokens=1024, ignore_eos=True)
    for i, prompt in enumerate(workload_wb().prompts[:num_requests]):
        engine.add_request(f"p{i}", [t % engine.vocab_size for t in prompt], params)  # small test vocabularies
    seen: set[str] = set()
    while len(seen) < num_requests:
        seen.update(o.request_id for o in engine.step())
    for _ in range(4):  # settle: the async pipeline and every graph size in use are warm
        engine.step()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_steps(engine, steps: int) -> dict:
    import engine.runner as runner_module

    timer = PartTimer()
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(engine.runner, "prepare", "launch")  # a step's two halves
    timer.wrap(engine.runner, "enqueue", "launch")
    timer.wrap(runner_module, "prepare_inputs", "inputs")
    timer.wrap(engine.runner.builder, "build_host", "metadata")
    if engine.runner.decode_graphs is not None:
        timer.wrap(engine.runner.decode_graphs, "replay", "replay")
    timer.wrap(engine.runner, "collect", "collect")
    timer.wrap(engine, "_postprocess", "postprocess")
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    wall = (time.perf_counter() - start) / steps
    timer.restore()
    parts = {k: timer.totals[k] / steps for k in HOST_PARTS}
    # collect's time includes waiting for the device; the rest of collect (tolist) is negligible.
    parts["host_busy"] = parts["schedule"] + parts["launch"] + parts["postprocess"]
    return {"step_ms": wall * 1e3, **{f"{k}_ms": v * 1e3 for k, v in parts.items()}}


def profile_host(engine, steps: int, top: int = 20) -> list[dict]:
    """cProfile over `steps` steps: the host functions with the most own time (per step)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    sync()
    prof.disable()
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (calls, primitive calls, own time, cumulative, callers)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [{"function": f"{Path(f).name}:{line}({name})", "own_us_per_step": v[2] / steps * 1e6,
             "cum_us_per_step": v[3] / steps * 1e6, "calls_per_step": v[0] / steps} for (f, line, name), v in rows]


def profile_kernels(engine, steps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        sync()
    per_kernel: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[evt.name] += evt.device_time_total / steps
            counts[evt.name] += 1
    total = sum(per_kernel.values())
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:25]
    return {"device_us_per_step": total, "num_kernels_per_step": sum(counts.values()) / steps,
            "top": [{"kernel": k[:110], "us_per_step": v, "calls_per_step": counts[k] / steps, "share": v / total}
                    for k, v in top]}


def roofline_ms(engine, hbm_bytes_per_s: float) -> dict:
    from engine.runner import kv_bytes_per_block

    """Bytes a decode step must read at least: every weight once (the tied embedding once, as lm_head) and
    every cached K/V of every running sequence, over the HBM bandwidth."""
    model = engine.runner.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    block_size = engine.runner.block_size
    kv_per_token = kv_bytes_per_block(engine.hf_config, block_size, engine.dtype) // block_size  # K and V, all layers
    ctx_tokens = sum(r.num_tokens for r in engine.scheduler.running)
    kv_bytes = ctx_tokens * kv_per_token
    return {"weight_gb": weight_bytes / 1e9, "kv_gb": kv_bytes / 1e9,
            "roofline_ms": (weight_bytes + kv_bytes) / hbm_bytes_per_s * 1e3, "batch": len(engine.scheduler.running),
            "mean_context": ctx_tokens / max(1, len(engine.scheduler.running))}


def profile_backend(model_dir: Path, backend: str, args) -> dict:
    from engine.llm import LLM

    llm = LLM(model=str(model_dir), attention_backend=backend, max_model_len=2048, max_num_batched_tokens=16384,
              max_num_seqs=args.num_requests, skip_tokenizer_init=True, enforce_eager=args.enforce_eager,
              device=args.device)
    if args.device == "cpu":  # the GPU's decode path (graph buffers), without capture: same host work
        runner = llm.engine.runner
        runner.decode_graphs = runner.make_graphs(args.num_requests, llm.engine.max_model_len, None, capture=False)
    start_decoding(llm, args.num_requests, args.temperature)
    timing = time_steps(llm.engine, args.steps)
    roof = roofline_ms(llm.engine, args.hbm_tb_s * 1e12)
    kernels = profile_kernels(llm.engine, args.profile_steps)
    host = profile_host(llm.engine, args.profile_steps)
    result = {"backend": llm.engine.backend_name, "enforce_eager": args.enforce_eager, **timing, **roof,
              "kernels": kernels, "host_functions": host}
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def print_result(r: dict) -> None:
    k = r["kernels"]
    print(f"\n== {r['backend']}{' (eager)' if r['enforce_eager'] else ''}: batch {r['batch']}, mean context "
          f"{r['mean_context']:.0f} tokens")
    print(f"step {r['step_ms']:.3f} ms | roofline {r['roofline_ms']:.3f} ms ({r['weight_gb']:.2f} GB weights + "
          f"{r['kv_gb']:.2f} GB KV) -> {r['roofline_ms'] / r['step_ms']:.0%} of roofline")
    print(f"host: schedule {r['schedule_ms']:.3f} + launch {r['launch_ms']:.3f} + postprocess "
          f"{r['postprocess_ms']:.3f} = {r['host_busy_ms']:.3f} ms busy; collect (wait) {r['collect_ms']:.3f} ms")
    print(f"      launch includes: inputs {r['inputs_ms']:.3f}, metadata {r['metadata_ms']:.3f} ms")
    print(f"device: {k['device_us_per_step'] / 1e3:.3f} ms of kernels per step "
          f"({k['device_us_per_step'] / 1e3 / r['step_ms']:.0%} busy), {k['num_kernels_per_step']:.0f} kernels")
    print(f"{'us/step':>9} {'calls':>6} {'share':>6}  kernel")
    for row in k["top"]:
        print(f"{row['us_per_step']:9.1f} {row['calls_per_step']:6.0f} {row['share']:6.1%}  {row['kernel']}")
    print(f"host, cProfile (inflates small calls): {'own us':>8} {'cum us':>8} {'calls':>6}  function (per step)")
    for row in r["host_functions"]:
        print(f"{'':39}{row['own_us_per_step']:8.1f} {row['cum_us_per_step']:8.1f} {row['calls_per_step']:6.0f}  "
              f"{row['function']}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--attention-backend", default="triton,flash-attn-4")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--profile-steps", type=int, default=10)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (W-B); W-A samples at 0.6")
    p.add_argument("--hbm-tb-s", type=float, default=4.3, help="HBM bandwidth (H200: 4.8 peak, ~4.3 achievable)")
    p.add_argument("--model-config", default="qwen2.5-0.5b", help="a built-in name, a .json file or inline JSON")
    p.add_argument("--device", default="cuda", help="cpu only to smoke-test this script")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_random_model(parse_model_config(args.model_config), Path(tmp))
        for backend in args.attention_backend.split(","):
            results.append(profile_backend(model_dir, backend, args))
            print_result(results[-1])
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name() if args.device == "cuda" else args.device, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
