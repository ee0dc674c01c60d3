"""Where the first timed repetition loses its time: each engine step of repetition 1 beside the same step of
the last repetition (issue 19: W-A's and W-B's first repetitions run 0.1-0.2 s slower on the H200, with no
compile left in them).

    python3 benchmarks/first_rep.py --preset wb --repeat 3 --out first_rep.json      # on the GPU
    python3 benchmarks/first_rep.py --smoke                                          # CPU, tiny model

The engine is built and warmed up as `kvserve bench throughput` builds it (bench/contenders.py), then the
workload runs --repeat times. Every `step()` call is timed on the host; with async scheduling a call returns
when the device has finished the step before it, so in steady state a call's time is a step's device time.
Every repetition schedules the same steps (fixed output lengths, ignore_eos), so step i of one repetition is
step i of the others. Prints the totals by kind of step (with prompt tokens or decode-only) and the steps
that lost most against the last repetition, with what each ran, and the CUDA allocator's segments before and
after each repetition; writes all of it as JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from bench import throughput as bt  # noqa: E402
from bench.contenders import warm_up, workload_params  # noqa: E402

SMOKE_CONFIG = ('{"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, '
                '"intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, '
                '"num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 2048, '
                '"bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "float32"}')


class StepRecorder:
    """Wraps one engine's step() and scheduler.schedule(): per step call, its seconds and what the latest
    schedule before it held (prompt tokens, decodes)."""

    def __init__(self, engine) -> None:
        self.steps: list[dict] = []
        self._last = {"prompt_tokens": 0, "decodes": 0}
        schedule, step = engine.scheduler.schedule, engine.step
        engine.scheduler.schedule = lambda *a, **k: self._note(schedule(*a, **k))
        engine.step = lambda: self._time(step)

    def take(self) -> list[dict]:
        """The steps recorded since the last take."""
        steps, self.steps = self.steps, []
        return steps

    def _note(self, out):
        decodes = sum(1 for s in out.scheduled if s.num_new_tokens == 1)
        self._last = {"prompt_tokens": out.num_batched_tokens - decodes, "decodes": decodes}
        return out

    def _time(self, step):
        start = time.perf_counter()
        outputs = step()
        self.steps.append({"s": time.perf_counter() - start, **self._last})
        return outputs


def allocator_state() -> dict | None:
    """CUDA caching allocator: segments cudaMalloc'ed so far and bytes reserved (None on the CPU). A first
    repetition that adds segments while the later ones add none is paying for allocator growth."""
    import torch

    if not torch.cuda.is_available():
        return None
    stats = torch.cuda.memory_stats()
    return {"segments_allocated": stats.get("segment.all.allocated", 0), "reserved_bytes": torch.cuda.memory_reserved()}


def compare(first: list[dict], last: list[dict], top: int) -> dict:
    """Totals of both repetitions by kind of step, and the `top` steps that lost most in the first."""
    pairs = list(zip(first, last))
    kinds = {"with prompt tokens": lambda a: a["prompt_tokens"] > 0, "decode-only": lambda a: a["prompt_tokens"] == 0}
    totals = {k: {"first_s": sum(a["s"] for a, _ in pairs if is_k(a)),
                  "last_s": sum(b["s"] for a, b in pairs if is_k(a)),
                  "steps": sum(1 for a, _ in pairs if is_k(a))} for k, is_k in kinds.items()}
    worst = sorted(range(len(pairs)), key=lambda i: pairs[i][1]["s"] - pairs[i][0]["s"])[:top]
    return {"steps": [len(first), len(last)], "totals": totals,
            "worst": [{"step": i, "first_ms": 1e3 * first[i]["s"], "last_ms": 1e3 * last[i]["s"],
                       "prompt_tokens": first[i]["prompt_tokens"], "decodes": first[i]["decodes"]} for i in worst]}


def report(result: dict) -> None:
    print(f"steps per repetition: {result['steps']}")
    for kind, t in result["totals"].items():
        print(f"  {kind:>18}: {t['steps']:4d} steps, first {t['first_s']:.3f} s, last {t['last_s']:.3f} s, "
              f"+{t['first_s'] - t['last_s']:.3f} s")
    print("steps that lost most in the first repetition:")
    for w in result["worst"]:
        print(f"  step {w['step']:4d}: {w['first_ms']:7.2f} ms against {w['last_ms']:7.2f} ms "
              f"({w['prompt_tokens']} prompt tokens, {w['decodes']} decodes)")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=("wa", "wb"), default="wb")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--top", type=int, default=12, help="steps listed")
    parser.add_argument("--smoke", action="store_true", help="CPU check: tiny model, 64 short prompts")
    parser.add_argument("--out", default=None)
    return parser.parse_args()


def engine_args(args: argparse.Namespace) -> list[str]:
    """bench throughput's arguments: the preset with the GPU runs' limits, or the smoke workload."""
    if args.smoke:
        return ["--model-config", SMOKE_CONFIG, "--dataset", "random", "--random-input-len", "48",
                "--random-output-len", "24", "--num-prompts", "64", "--device", "cpu", "--skip-tokenizer-init"]
    return ["--preset", args.preset, "--max-model-len", "2048", "--max-num-batched-tokens", "16384",
            "--max-num-seqs", "256", "--skip-tokenizer-init"]


def main() -> int:
    from engine.llm import LLM

    args = parse_args()
    bargs = bt.build_parser().parse_args(engine_args(args))
    bt.apply_preset(bargs)
    with tempfile.TemporaryDirectory() as tmp:
        model_path, _ = bt.resolve_model(bargs, Path(tmp))
        w = bt.make_workload(bargs, model_path)
        llm = LLM(model=str(model_path), **bt.engine_options(bargs, "auto"))
        warm_up(llm, w)
        recorder, reps = StepRecorder(llm.engine), []
        for _ in range(args.repeat):
            before, start = allocator_state(), time.perf_counter()
            llm.generate(w.prompts, workload_params(w))
            elapsed = time.perf_counter() - start
            reps.append({"s": elapsed, "steps": recorder.take(), "allocator": [before, allocator_state()]})
            print(f"repetition {len(reps)}: {reps[-1]['s']:.3f} s, {len(reps[-1]['steps'])} steps; allocator "
                  f"before / after: {reps[-1]['allocator']}", flush=True)
    result = compare(reps[0]["steps"], reps[-1]["steps"], args.top)
    report(result)
    if args.out:
        Path(args.out).write_text(json.dumps({"repetitions_s": [r["s"] for r in reps], **result,
                                              "allocator": [r["allocator"] for r in reps],
                                              "per_step": [r["steps"] for r in reps]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
