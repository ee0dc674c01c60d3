"""The MLP's gate/up GEMM with SiLU*mul fused (engine/mlp_kernel.py) against what runs today: cuBLAS's GEMM
(F.linear) then kvserve's silu_and_mul kernel.

    python benchmarks/gate_up_silu.py --out gate_up_silu.json

Shapes: Qwen2.5-0.5B's MLP (hidden 896, inter 4864: W-L's model) at 256 to 16,384 rows (16k: a W-L prefill
step), and a Llama-3-8B MLP (4096, 14336) at 4,096 rows. Every tile is first checked against the reference on
random bf16 inputs (its error against a float32 reference no worse than cuBLAS's path, and its output within
a few ulps of it); only checked tiles are timed (CUDA events, median of --iters, the inputs cycling through
copies larger than L2 so each call reads from memory as a step does). Prints a table, writes JSON, and the
fewest rows at which the best tile won.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from engine.kernels import silu_and_mul  # noqa: E402
from engine.mlp_kernel import Tile, gate_up_silu_fused, gate_up_silu_ref  # noqa: E402

TILES = [Tile(128, 128, 64, 8, 3), Tile(128, 128, 64, 8, 4), Tile(128, 64, 64, 4, 4), Tile(64, 128, 64, 4, 4),
         Tile(128, 128, 128, 8, 2), Tile(128, 64, 128, 8, 3), Tile(64, 64, 64, 4, 4)]
SHAPES = [(256, 896, 4864), (1024, 896, 4864), (4096, 896, 4864), (16384, 896, 4864), (4096, 4096, 14336)]


def _inputs(tokens: int, hidden: int, inter: int, copies: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    xs = [torch.randn(tokens, hidden, generator=gen, device="cuda").bfloat16() for _ in range(copies)]
    w = (torch.randn(2 * inter, hidden, generator=gen, device="cuda") / hidden ** 0.5).bfloat16()
    return xs, w


def _check(x, w, tile: Tile) -> dict:
    """The tile's output against cuBLAS's path and a float32 reference."""
    exact = gate_up_silu_ref(x.float(), w.float(), None)
    served = silu_and_mul(F.linear(x, w))
    out = gate_up_silu_fused(x, w, None, tile)
    err = lambda y: ((y.float() - exact).norm() / exact.norm()).item()  # noqa: E731
    ulps = ((out.float() - served.float()).abs() / (served.float().abs() * 2 ** -7).clamp_min(1e-30)).max().item()
    ok = err(out) <= 1.1 * err(served) + 1e-6 and ulps <= 8
    return {"ok": ok, "err": err(out), "err_cublas": err(served), "max_ulps_vs_cublas": ulps,
            "equal_frac": (out == served).float().mean().item()}


def _time_ms(fn, xs: list, iters: int) -> float:
    times = []
    for i in range(iters + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(xs[i % len(xs)])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[3:])


def _shape_rows(tokens: int, hidden: int, inter: int, iters: int) -> list[dict]:
    copies = max(2, -(-(256 << 20) // (tokens * hidden * 2)))  # > 256 MiB of inputs: past the L2
    xs, w = _inputs(tokens, hidden, inter, min(copies, 64))
    rows = [{"way": "cuBLAS + silu_and_mul", "ms": _time_ms(lambda x: silu_and_mul(F.linear(x, w)), xs, iters)}]
    for tile in TILES:
        check = _check(xs[0], w, tile)
        ms = _time_ms(lambda x, t=tile: gate_up_silu_fused(x, w, None, t), xs, iters) if check["ok"] else None
        rows.append({"way": f"fused {tile}", "ms": ms, "tile": asdict(tile), **check})
    flops = 2 * tokens * hidden * 2 * inter
    for r in rows:
        r.update(tokens=tokens, hidden=hidden, inter=inter, tflops=None if r["ms"] is None else flops / r["ms"] / 1e9)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--out", default="gate_up_silu.json")
    args = p.parse_args()
    rows, wins = [], []
    print("| rows x hidden x inter | way | ms | TFLOP/s | checked (err / cuBLAS's, max ulps) |")
    print("|---|---|---:|---:|---|")
    for shape in SHAPES:
        shape_rows = _shape_rows(*shape, args.iters)
        for r in shape_rows:
            check = "" if "ok" not in r else f"{r['ok']} ({r['err']:.2e} / {r['err_cublas']:.2e}, " \
                                              f"{r['max_ulps_vs_cublas']:.1f})"
            ms = "-" if r["ms"] is None else f"{r['ms']:.3f}"
            tf = "-" if r["tflops"] is None else f"{r['tflops']:.0f}"
            print(f"| {shape[0]} x {shape[1]} x {shape[2]} | {r['way']} | {ms} | {tf} | {check} |", flush=True)
        best = min((r for r in shape_rows[1:] if r["ms"] is not None), key=lambda r: r["ms"], default=None)
        if best is not None and best["ms"] < shape_rows[0]["ms"]:
            wins.append({"tokens": shape[0], "hidden": shape[1], "best": best["way"],
                         "speedup": shape_rows[0]["ms"] / best["ms"]})
        rows += shape_rows
    print("fused won at:", wins)
    Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "results": rows, "wins": wins},
                                         indent=1))


if __name__ == "__main__":
    main()
