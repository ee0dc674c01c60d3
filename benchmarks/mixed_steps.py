"""What mixed CUDA graphs buy: the time of a step that prefills one new prompt while a batch decodes.

    python benchmarks/mixed_steps.py --out mixed.json

A server under load sees this step all the time: a request arrives while others decode, and its prompt
joins the decode batch. Builds the Qwen2.5-0.5B shape with random bfloat16 weights, starts --decodes
requests decoding, then for each prompt length P runs --steps steps in which one new request of P tokens
(one output token, so the batch stays the same size) joins every step, twice: with mixed graphs, and with
them switched off (the step runs eagerly, as before mixed graphs existed). Decode-only steps are timed
as a reference. Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from bench.models import build_random_model, parse_model_config  # noqa: E402


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def start_decoding(engine, num_requests: int, rng: random.Random) -> None:
    from engine.request import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)
    for i in range(num_requests):
        engine.add_request(f"d{i}", [rng.randrange(100, 50000) for _ in range(rng.randint(100, 400))], params)
    seen: set[str] = set()
    while len(seen) < num_requests:
        seen.update(o.request_id for o in engine.step())


def time_steps(engine, steps: int, prompt_len: int, rng: random.Random, tag: str) -> float:
    """Mean wall ms of a step in which a new prompt of prompt_len tokens joins (0: decode-only steps)."""
    from engine.request import SamplingParams

    one_token = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for _ in range(3):  # settle the async pipeline
        engine.step()
    _sync()
    start = time.perf_counter()
    for i in range(steps):
        if prompt_len:
            engine.add_request(f"{tag}-{i}", [rng.randrange(100, 50000) for _ in range(prompt_len)], one_token)
        engine.step()
    _sync()
    return (time.perf_counter() - start) / steps * 1e3


def run(args) -> dict:
    from engine.llm import LLM

    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_random_model(parse_model_config(args.model_config), Path(tmp))
        llm = LLM(model=str(model_dir), attention_backend=args.attention_backend, max_model_len=2048,
                  max_num_seqs=args.decodes + 8, max_num_batched_tokens=4096, skip_tokenizer_init=True,
                  enable_prefix_caching=False, device=args.device)
    engine, runner = llm.engine, llm.engine.runner
    if args.device == "cpu":  # smoke test: the same step paths through the graphs' buffers, not captured
        for max_tokens in (None, 4096):
            graphs = runner.make_graphs(args.decodes + 8, engine.max_model_len, max_tokens, capture=False)
            setattr(runner, "mixed_graphs" if max_tokens else "decode_graphs", graphs)
    mixed_graphs = runner.mixed_graphs
    if mixed_graphs is None:
        raise SystemExit(f"{engine.backend_name} has no mixed CUDA graphs here (CPU, or not supported)")
    start_decoding(engine, args.decodes, rng)
    rows = [{"prompt_len": 0, "decode_only_ms": time_steps(engine, args.steps, 0, rng, "warm")}]
    for p in tqdm(args.prompt_lens, desc="prompt lengths"):
        row = {"prompt_len": p, "tokens_per_step": args.decodes + p}
        for mode, graphs in (("eager_ms", None), ("graph_ms", mixed_graphs)):
            runner.mixed_graphs = graphs
            row[mode] = time_steps(engine, args.steps, p, rng, f"{mode}-{p}")
        row["speedup"] = row["eager_ms"] / row["graph_ms"]
        rows.append(row)
    runner.mixed_graphs = mixed_graphs
    device = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    return {"device": device, "backend": engine.backend_name, "decodes": args.decodes,
            "steps": args.steps, "graph_token_sizes": mixed_graphs.sizes, "rows": rows}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--attention-backend", default="triton")
    p.add_argument("--decodes", type=int, default=128)
    p.add_argument("--prompt-lens", type=lambda s: [int(x) for x in s.split(",")], default=[16, 128, 512])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--model-config", default="qwen2.5-0.5b")
    p.add_argument("--device", default="cuda", help="cpu only to smoke-test this script")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    result = run(args)
    print(f"\n{result['backend']} on {result['device']}: one new prompt joins {result['decodes']} decodes each step "
          f"(mean of {result['steps']} steps); decode-only step {result['rows'][0]['decode_only_ms']:.3f} ms")
    print(f"{'prompt':>7} {'tokens':>7} {'eager ms':>9} {'graph ms':>9} {'speedup':>8}")
    for r in result["rows"][1:]:
        print(f"{r['prompt_len']:7d} {r['tokens_per_step']:7d} {r['eager_ms']:9.3f} {r['graph_ms']:9.3f} "
              f"{r['speedup']:7.2f}x")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
