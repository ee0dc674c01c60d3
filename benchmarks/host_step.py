"""Host milliseconds per decode step at batch N, on a CPU: the GPU path's Python work without a GPU.

    python benchmarks/host_step.py --batch 256 --runs 5 --sections --out host_step.json

On an H200 a decode step of 256 requests of a small model is host-bound: the device needs ~2.5 ms, and
the host work of schedule -> prepare inputs -> stage the CUDA-graph inputs -> sample -> update ->
postprocess must fit in that. This measures that work on any machine: the decode CUDA-graph steps are
built without capture (their staging buffers feed an eager forward) and that forward is a null model
(zeros), so what remains is the host's work plus a tiny model's logits and sampling (real CPU compute
here, kernel launches on a GPU). Prefill steps (a few per run) run the tiny model eagerly.

Each run generates --max-tokens greedy tokens for --batch random prompts through LLM.generate (async
scheduling, no prefix caching); ms/step is wall time over engine steps, the median of --runs runs (and
the minimum: a shared machine's noise only ever adds), and the process's CPU time per step (steadier on a
virtual machine whose CPUs are shared: time stolen by the hypervisor is not counted).
--decode-only times only --max-tokens steps in which every request decodes (the prefills before them
untimed): the large-batch decode step alone, as on the GPU's busiest steps.
The heap is frozen and young collections thinned after the warm-up, as in the server's engine core
(engine/malloc.py). --sections adds one more run with timers around the host sections (the timers cost a
little; they nest: prepare holds prepare_inputs and stage, enqueue holds compute_logits and sample). Prints a
table, writes JSON.
--constrained N puts every request under a regex (JSON_LIKE) whose matchers live in N grammar processes, as on
a GPU host: the engine thread's extra work for a constrained step (recording tokens, the Step's send and
answer; on the CPU also the masks' apply, which a GPU does in a kernel). Compare its process CPU per step with
a run without it. --constrained-share F puts only that share of the requests under it (W-B json 20%: 0.2).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402

import engine.runner as runner_mod  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.malloc import collect_young_less_often, freeze_startup_objects  # noqa: E402
from engine.request import SamplingParams, StructuredOutput  # noqa: E402
from bench.models import build_random_model  # noqa: E402

TINY_QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 32,
              "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
              "vocab_size": 512, "max_position_embeddings": 4096, "tie_word_embeddings": True}
# --constrained: a regex no request can finish within its tokens, so every row stays under its mask.
JSON_LIKE = r'\{("[a-z]{1,8}": [0-9]{1,6}, ){1000}'


def build_llm(batch: int, max_model_len: int, grammar_processes: int = 0) -> LLM:
    """A tiny random model whose decode steps go through CUDA-graph staging with a null forward. With
    grammar_processes, a byte-level BPE tokenizer (grammars need one) and the matchers in that many grammar
    processes, as on a GPU host (the CPU's default keeps them in the engine's process)."""
    tokenizer = "bpe" if grammar_processes else "id"
    path = build_random_model(TINY_QWEN2, Path(tempfile.mkdtemp()), tokenizer=tokenizer)
    grammars = dict(structured_outputs_process=True, structured_outputs_processes=grammar_processes,
                    structured_outputs_spin_ms=0) if grammar_processes else {}
    llm = LLM(str(path), device="cpu", attention_backend="torch", skip_tokenizer_init=not grammar_processes,
              async_scheduling=True, max_model_len=max_model_len, max_num_batched_tokens=16384,
              max_num_seqs=batch, enable_prefix_caching=False,
              num_kv_blocks=max(batch * max_model_len // 16 + 64, 1024), **grammars)
    runner = llm.engine.runner
    runner.decode_graphs = runner.make_graphs(batch, max_model_len, None, capture=False)
    hidden = TINY_QWEN2["hidden_size"]
    runner.decode_graphs._forward = lambda size: torch.zeros(size, hidden)  # the null model
    return llm


@dataclass
class Timed:
    """One timed run: wall and process CPU seconds, engine steps, and the engine's own section laps (seconds,
    engine/step_clock.py) over those steps."""
    seconds: float
    cpu_seconds: float
    steps: int
    laps: dict[str, float]


def time_run(llm: LLM, run) -> Timed:
    """run() timed, with the engine's section laps it added."""
    engine = llm.engine
    steps, laps = engine._steps, dict(engine.clock.seconds)
    start, cpu_start = time.perf_counter(), time.process_time()
    idle = run()  # seconds of it left out
    seconds, cpu_seconds = time.perf_counter() - start - idle, time.process_time() - cpu_start
    return Timed(seconds, cpu_seconds, engine._steps - steps,
                 {k: v - laps[k] for k, v in engine.clock.seconds.items() if v > laps[k]})


def run_once(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> Timed:
    """One generate() of every prompt, each with its params."""
    def generate() -> float:
        llm.generate(prompts, params)
        return 0.0

    return time_run(llm, generate)


def run_decode_only(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], num_steps: int,
                    idle_s: float = 0.0) -> Timed:
    """num_steps engine steps in which every request decodes: the prompts are prefilled first, untimed, and
    every request asks for more tokens than the timed steps. idle_s: a sleep after each timed step, left out of
    the times (how the engine runs after blocking that long, as it does for its masks on a small host)."""
    engine = llm.engine
    base = engine._steps
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        long = SamplingParams(temperature=p.temperature, max_tokens=num_steps + 16, ignore_eos=True,
                              detokenize=False, structured=p.structured)
        engine.add_request(f"decode-only-{base}-{i}", prompt, long)
    sched = engine.scheduler
    while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
        engine.step()
    for _ in range(3):  # the first decode steps; a constrained (pipelined) engine runs a launched step at the
        engine.step()  # next call, so the last prompt chunks' forwards come after the loop above (~50 ms each)

    def steps() -> float:
        for _ in range(num_steps):
            engine.step()
            if idle_s:
                time.sleep(idle_s)
        return idle_s * num_steps

    result = time_run(llm, steps)
    for i in range(len(prompts)):
        engine.abort_request(f"decode-only-{base}-{i}")
    while engine.has_unfinished_requests():
        engine.step()
    return result


def section_times(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, float]:
    """One run with a timer around each host section: ms per step by section."""
    engine, runner = llm.engine, llm.engine.runner
    totals: dict[str, float] = defaultdict(float)
    targets = [(engine, "step"), (engine.scheduler, "schedule"), (runner, "prepare"), (runner, "enqueue"),
               (runner_mod, "prepare_inputs"), (runner.decode_graphs, "stage"), (runner.builder, "build_host"), (runner.model, "compute_logits"),
               (runner.sampler, "sample_on_device"), (runner, "collect"), (engine, "_postprocess"),
               (engine.scheduler, "update")]
    originals = [(obj, name, getattr(obj, name)) for obj, name in targets]

    def timed(fn, name):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[name] += time.perf_counter() - start
        return wrapper

    for obj, name, fn in originals:
        setattr(obj, name, timed(fn, name))
    try:
        steps = run_once(llm, prompts, params).steps
    finally:
        for obj, name, fn in originals:
            if obj is runner_mod:
                setattr(obj, name, fn)
            else:
                delattr(obj, name)  # the instance attribute shadowing the class's method
    return {name: totals[name] * 1e3 / steps for name in sorted(totals, key=totals.get, reverse=True)}


def constraints(batch: int, share: float) -> list[StructuredOutput | None]:
    """The regex for `share` of `batch` rows spread evenly (row i when floor((i + 1) * share) steps up), None
    for the others."""
    return [StructuredOutput(regex=JSON_LIKE) if int((i + 1) * share) > int(i * share) else None
            for i in range(batch)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=256, help="concurrent requests (max_num_seqs)")
    p.add_argument("--max-tokens", type=int, default=300, help="tokens generated per request")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(100, 300), help="prompt lengths, min and max")
    p.add_argument("--runs", type=int, default=3, help="timed runs (the median is reported)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--sections", action="store_true", help="also time the host sections (one more run)")
    p.add_argument("--decode-only", action="store_true",
                   help="time only --max-tokens steps in which every request decodes (prefills untimed)")
    p.add_argument("--constrained", type=int, default=0, metavar="PROCESSES",
                   help="every request under a regex that never ends (JSON_LIKE), its matcher in one of this many "
                        "grammar processes: the engine thread's share of a constrained step (process CPU)")
    p.add_argument("--constrained-share", type=float, default=1.0, metavar="F",
                   help="with --constrained: this share of the requests under the regex, spread evenly (W-B json "
                        "20%%: 0.2), the others free")
    p.add_argument("--idle-ms", type=float, default=0.0,
                   help="with --decode-only: sleep this long after each timed step (left out of the times)")
    p.add_argument("--out", type=Path, help="write the results here as JSON")
    args = p.parse_args()
    torch.set_num_threads(1)
    llm = build_llm(args.batch, max_model_len=2048, grammar_processes=args.constrained)
    rnd = random.Random(0)
    prompts = [[rnd.randint(0, 500) for _ in range(rnd.randint(*args.prompt_len))] for _ in range(args.batch)]
    share = args.constrained_share if args.constrained else 0.0
    params = [SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True,
                             detokenize=False, structured=constraint) for constraint in constraints(args.batch, share)]
    run_once(llm, prompts, params)  # warm-up
    freeze_startup_objects()  # as the server's engine core does: unfrozen, 2 runs in 5 took a full collection
    collect_young_less_often()
    runs = [run_decode_only(llm, prompts, params, args.max_tokens, args.idle_ms / 1e3) if args.decode_only
            else run_once(llm, prompts, params) for _ in range(args.runs)]
    per_step = [r.seconds * 1e3 / r.steps for r in runs]
    steps = runs[-1].steps
    laps = {k: statistics.median(r.laps.get(k, 0.0) * 1e3 / r.steps for r in runs) for k in runs[-1].laps}
    result = {"batch": args.batch, "max_tokens": args.max_tokens, "temperature": args.temperature,
              "decode_only": args.decode_only, "constrained_processes": args.constrained,
              "constrained_share": share, "idle_ms": args.idle_ms,
              "steps_per_run": steps, "ms_per_step_runs": per_step, "ms_per_step": statistics.median(per_step),
              "ms_per_step_min": min(per_step),
              "cpu_ms_per_step": statistics.median(r.cpu_seconds * 1e3 / r.steps for r in runs),
              "laps_ms_per_step": laps}
    print(f"batch {args.batch}, {steps} steps per run: host {result['ms_per_step']:.3f} ms/step, median of "
          f"{args.runs} (min {result['ms_per_step_min']:.3f}; runs {', '.join(f'{x:.3f}' for x in per_step)}); "
          f"process CPU {result['cpu_ms_per_step']:.3f} ms/step")
    print("  engine laps, ms/step (median):", ", ".join(f"{k} {v:.2f}" for k, v in laps.items()))
    if args.sections:
        result["sections_ms_per_step"] = section_times(llm, prompts, params)
        for name, ms in result["sections_ms_per_step"].items():
            print(f"  {name:18s} {ms:7.3f} ms/step")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
