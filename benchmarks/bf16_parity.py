"""How closely kvserve's greedy tokens follow transformers', per prompt, and why they part where they do.

    python benchmarks/bf16_parity.py --attention-backend triton,flash-attn-4 --out bf16.json

On SmolLM2 (the embedded default) and the 8 prompts of tests/test_gpu_parity.py, greedy for --max-tokens:
transformers in float32 and bfloat16, kvserve in bfloat16 with each backend. For every pair it prints
the index of the first differing token per prompt and how many prompts agree over all of them. Where
kvserve-bf16 and transformers-bf16 part, it prints transformers' float32 top-2 logit gap at that point:
a gap near bfloat16's resolution (~0.1 at logits of ~20) is a near-tie that any reordering of sums
flips; a large gap there is a bug.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402

TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "The three primary colors are",
         "In 1492, Columbus", "Water boils at", "The quick brown fox", "To make a cup of tea,"]


def hf_greedy(model, prompts: list[list[int]], max_tokens: int, eos: list[int], device) -> list[list[int]]:
    outs = []
    for p in prompts:
        with torch.inference_mode():
            ids = model.generate(torch.tensor([p], device=device), max_new_tokens=max_tokens, do_sample=False,
                                 attention_mask=torch.ones(1, len(p), dtype=torch.long, device=device),
                                 eos_token_id=eos, pad_token_id=eos[0])
        outs.append(ids[0, len(p):].tolist())
    return outs


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token, or None when equal over the shorter length and equal lengths."""
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if i is None and len(a) != len(b):
        return min(len(a), len(b))
    return i


def top2_gap(model, tokens: list[int], device) -> float:
    """float32 logit gap between the best and second-best next token after `tokens`."""
    with torch.inference_mode():
        logits = model(torch.tensor([tokens], device=device)).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--attention-backend", default="triton,flash-attn-4,torch")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path)
    args = p.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine import LLM, SamplingParams
    from engine.loader import resolve_model_path

    model_dir = resolve_model_path(None)  # the embedded SmolLM2, converted to safetensors
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok.encode(t) for t in TEXTS]
    runs: dict[str, list[list[int]]] = {}
    hf = {}
    for dtype in (torch.float32, torch.bfloat16):
        hf[dtype] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(args.device).eval()
    eos = [tok.eos_token_id]
    for dtype, name in ((torch.float32, "hf-fp32"), (torch.bfloat16, "hf-bf16")):
        runs[name] = hf_greedy(hf[dtype], prompts, args.max_tokens, eos, args.device)
    for backend in args.attention_backend.split(","):
        llm = LLM(model=str(model_dir), device=args.device, dtype="bfloat16", attention_backend=backend,
                  max_num_batched_tokens=64, block_size=16, max_num_seqs=16)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens))
        runs[f"kvserve-{backend}"] = [o.outputs[0].token_ids for o in outs]
        del llm

    names = list(runs)
    table = {}
    print(f"first differing token per prompt (- = identical over {args.max_tokens}); last column: prompts identical")
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            diffs = [first_difference(x, y) for x, y in zip(runs[a], runs[b])]
            table[f"{a} vs {b}"] = diffs
            cells = " ".join(f"{'-' if d is None else d:>3}" for d in diffs)
            print(f"{a + ' vs ' + b:<40} {cells}  {sum(d is None for d in diffs)}/{len(diffs)}")
    gaps = {}
    for name in names:
        if not name.startswith("kvserve"):
            continue
        for k, (ours, ref) in enumerate(zip(runs[name], runs["hf-bf16"])):
            d = first_difference(ours, ref)
            if d is not None and d < min(len(ours), len(ref)):
                gap = top2_gap(hf[torch.float32], prompts[k] + ref[:d], args.device)
                gaps.setdefault(name, []).append({"prompt": k, "at": d, "fp32_top2_gap": gap})
                print(f"{name}: prompt {k} parts from hf-bf16 at token {d}; hf-fp32 top-2 gap there {gap:.4f}")
    if args.out:
        args.out.write_text(json.dumps({"device": args.device, "runs": runs, "first_difference": table,
                                        "gaps": gaps}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
