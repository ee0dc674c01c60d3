"""Applying a step's grammar masks on the GPU: engine/structured.py Masking with kvserve's kernel
(engine/mask_kernel.py) and with xgrammar's Triton kernel (the mask copied on a side stream either way),
against apply_reference (the PyTorch rule, the copy on the compute stream).

    python benchmarks/mask_apply.py --out mask_apply.json

The shape is W-B's at json 100%: 256 rows of Qwen2.5's 151,936 bfloat16 logits, the mask in page-locked host
memory as the grammar processes leave it. Each way is first checked against the reference on random masks,
then timed (CUDA events, median of --iters) twice: alone, and queued behind a matmul that stands in for the
forward pass (the time past the matmul's own is what the step pays). Prints a table, writes JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402

from engine.structured import Masking, MaskBatch, apply_reference  # noqa: E402


def _inputs(rows: int, vocab: int, constrained: list[int], seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (len(constrained), (vocab + 31) // 32), dtype=torch.int32,
                            generator=gen)
    logits = torch.randn(rows, vocab, generator=gen).to(torch.bfloat16).cuda()
    return logits, MaskBatch(constrained, bitmask.pin_memory())


def _maskings(logits) -> dict:
    """Masking as served (kvserve's kernel after its self-check) and with xgrammar's kernel."""
    ours, xgrammar = Masking(), Masking()
    xgrammar._own[(logits.device, logits.dtype)] = False
    return {"kvserve kernel": ours, "xgrammar kernel": xgrammar}


def _checked(logits, batch, masking) -> None:
    expected, got = logits.clone(), logits.clone()
    apply_reference(expected, batch)
    masking.apply(got, batch)
    torch.cuda.synchronize()
    assert torch.equal(got, expected), "a kernel differs from the reference"


def _time_ms(fn, iters: int, before=None) -> float:
    """Median device ms of fn() (after before(), which is not counted when given: it is timed on its own)."""
    times = []
    for _ in range(iters + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if before is not None:
            before()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[3:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default="mask_apply.json")
    args = p.parse_args()
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    forward = lambda: a @ a  # noqa: E731 - stands in for the forward pass the mask queues behind
    matmul_ms = _time_ms(forward, args.iters)
    rows = []
    for shape, constrained in (("every row", list(range(args.rows))), ("every other row", list(range(0, args.rows, 2)))):
        logits, batch = _inputs(args.rows, args.vocab, constrained)
        ways = {"reference": lambda: apply_reference(logits, batch)}
        for name, masking in _maskings(logits).items():
            _checked(logits, batch, masking)  # every kernel against the reference before it is timed
            ways[name] = lambda m=masking: m.apply(logits, batch)
        for name, fn in ways.items():
            alone = _time_ms(fn, args.iters)
            behind = _time_ms(fn, args.iters, before=forward) - matmul_ms
            rows.append({"way": f"{name}, {shape}", "alone_ms": alone, "after_forward_ms": behind})
    print(f"| way | alone, ms | past a {matmul_ms:.2f} ms matmul, ms |\n|---|---:|---:|")
    for r in rows:
        print(f"| {r['way']} | {r['alone_ms']:.3f} | {r['after_forward_ms']:.3f} |")
    Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": args.rows, "vocab": args.vocab,
                                          "matmul_ms": matmul_ms, "results": rows, "checked": True}, indent=1))


if __name__ == "__main__":
    main()
