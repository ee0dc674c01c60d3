"""The fused add + RMSNorm (engine/kernels.py) at a prefill's and a decode's shape, by rows a program.

    python benchmarks/norm_rows.py --rows 1 2 4 8 16 --out norm_rows.json

A program per row is latency-bound at a prefill's 16,384 rows of 896 (one ~2 KB row in and out each); W-L runs
two norms a layer, 24 layers, 33 prefill steps. Each setting is checked against the reference first (the
residual exactly, the norm within its rounding), then timed: microseconds a call, the median of --iters calls
each timed by CUDA events after a warm-up. Prints a table, writes JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402

from engine import kernels  # noqa: E402

SHAPES = {"prefill 16384 x 896": (16384, 896), "decode 256 x 896": (256, 896), "prefill 16384 x 4096": (16384, 4096)}


def check(x, res, w) -> None:
    out, new_res = kernels.add_rms_norm(x, res, w, 1e-6)
    ref_out, ref_res = kernels.add_rms_norm_ref(x, res, w, 1e-6)
    assert torch.equal(new_res, ref_res), "residual differs from the reference"
    torch.testing.assert_close(out, ref_out, rtol=1e-2, atol=1e-2)


def time_call(x, res, w, iters: int) -> float:
    for _ in range(10):
        kernels.add_rms_norm(x, res, w, 1e-6)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        kernels.add_rms_norm(x, res, w, 1e-6)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    results = []
    for name, (tokens, hidden) in SHAPES.items():
        x, res = (torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
        for rows in args.rows if tokens >= kernels.NORM_ROWS_FROM else [1]:  # a decode: a row a program
            kernels.NORM_ROWS = rows
            check(x, res, w)
            us = time_call(x, res, w, args.iters)
            gbs = 4 * tokens * hidden * 2 / us / 1e3  # x, residual in; out, new residual out
            results.append({"shape": name, "rows": rows, "us": round(us, 2), "GB/s": round(gbs)})
            print(f"| {name} | {rows} | {us:.2f} | {gbs:,.0f} |", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
