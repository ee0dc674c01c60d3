"""The host's time to queue a constrained step's sampling on the GPU, piece by piece.

    python benchmarks/sample_issue.py --out sample_issue.json

Through the server, W-B at json 100% spent ~1.0 ms of host time a step queueing its sampling (the engine's
"sample" section) against ~0.5 ms at json 0%, and the device waited for it (its "sample" part 1.2 ms against
0.4; docs/benchmarks.md, eleventh session). This times what runner.sample queues, at W-B's shape (256 rows of
151,936 bfloat16 logits, greedy): the mask's copy on the side stream, the mask kernel, the argmax, the tokens'
copy to page-locked memory with its event; the mask from the allocator's page-locked memory and from a
page-locked shared file as the grammar processes leave it (engine/grammar_link.py). Host microseconds per call
(median of --iters), each call once with the device idle and once behind a matmul standing in for the forward.
Each row of the table is checked against the reference first. Prints a table, writes JSON.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402

from engine.grammar_link import _pin  # noqa: E402
from engine.grammar_worker import mask_buffers, mask_file_words  # noqa: E402
from engine.structured import Masking, MaskBatch, apply_reference  # noqa: E402

ROWS, VOCAB = 256, 151_936


def shared_mask(words: int) -> torch.Tensor:
    """A page-locked mapping of a shared file, as GrammarLink holds the grammar processes' masks."""
    f = tempfile.TemporaryFile(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.ftruncate(f.fileno(), mask_file_words(ROWS, words) * 4)
    masks, _ = mask_buffers(f.fileno(), ROWS, words)
    assert _pin(masks), "cudaHostRegister failed"
    return masks[0]


def host_us(fn, iters: int, busy=None) -> float:
    """Median host microseconds of fn(), the device idle before each call (or running busy())."""
    times = []
    for _ in range(iters + 5):
        torch.cuda.synchronize()
        if busy is not None:
            busy()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(times[5:]) * 1e6


def pieces(masking: Masking, logits: torch.Tensor, batch: MaskBatch) -> dict:
    def tokens_home():
        tokens = logits.argmax(dim=-1)
        host = torch.empty(ROWS, dtype=torch.long, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        torch.cuda.Event().record()

    return {"mask copy (side stream)": lambda: masking._to_device(batch.bitmask, logits.device),
            "mask copy + kernel (Masking.apply)": lambda: masking.apply(logits, batch),
            "argmax": lambda: logits.argmax(dim=-1),
            "argmax + tokens' copy + event": tokens_home,
            "all of it": lambda: (masking.apply(logits, batch), tokens_home())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--out", default="sample_issue.json")
    args = parser.parse_args()
    words = (VOCAB + 31) // 32
    logits = torch.randn(ROWS, VOCAB, device="cuda").to(torch.bfloat16)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    busy = lambda: a @ a  # noqa: E731 - ~1 ms on an H100
    shared = shared_mask(words)
    shared.copy_(torch.randint(-2 ** 31, 2 ** 31 - 1, (ROWS, words), dtype=torch.int32))
    batches = {"allocator page-locked": MaskBatch(list(range(ROWS)), shared.clone().pin_memory()),
               "shared file, registered": MaskBatch(list(range(ROWS)), shared),
               "shared, rows 0-127 of 256": MaskBatch(list(range(0, ROWS, 2)), shared[:ROWS // 2])}
    masking, results = Masking(), []
    for where, batch in batches.items():
        expected, got = logits.clone(), logits.clone()
        apply_reference(expected, batch)
        masking.apply(got, batch)
        assert torch.equal(got, expected), f"{where}: the mask kernel differs from the reference"
        for name, fn in pieces(masking, logits, batch).items():
            results.append({"mask in": where, "piece": name, "idle_us": host_us(fn, args.iters),
                            "behind_matmul_us": host_us(fn, args.iters, busy)})
    print(f"{torch.cuda.get_device_name()}: host us to queue, median of {args.iters}\n"
          "| mask in | piece | device idle | behind a matmul |\n|---|---|---:|---:|")
    for r in results:
        print(f"| {r['mask in']} | {r['piece']} | {r['idle_us']:.0f} | {r['behind_matmul_us']:.0f} |")
    Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
