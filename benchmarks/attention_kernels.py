"""Attention kernel micro-benchmark: every installed backend on a few paged batches (one layer's call:
K/V write + attention), bfloat16, CUDA only.

    python benchmarks/attention_kernels.py --out results.json [--iters 50]

Per backend and workload it reports
  eager_us  wall time per call, calls back to back (host overhead included when it dominates),
  graph_us  per call from a CUDA graph of one round of calls (GPU time alone; n/a when capture fails),
Calls rotate over copies of the K/V caches ("layers", >= 512 MiB in all) so the L2 cannot serve them.
  GB/s      K/V bytes the batch must read / graph_us (or eager_us), for the decode workloads,
  TFLOP/s   causal attention's matmul FLOPs / graph_us (or eager_us), for the prefill workloads.
Shapes: Qwen2.5-0.5B attention (14 heads, 2 kv heads, head dim 64) and a head-dim-128 one
(32 heads, 8 kv heads, as Llama-3-8B). The table's order guides attention.CUDA_AUTO_ORDER.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import random
import time

import torch

from attention import BACKEND_NAMES, get_backend
from attention.testing import make_random_batch

SHAPES = {"qwen2.5-0.5b (14/2 x 64)": (14, 2, 64), "llama-8b-like (32/8 x 128)": (32, 8, 128)}


def workloads(rng: random.Random) -> dict[str, list[tuple[int, int]]]:
    """(context_len, query_len) per sequence, prefills first."""
    decode = [(rng.randint(500, 700), 1) for _ in range(256)]
    mixed = [(0, 512), (0, 300), (1024, 512), (600, 256)] + [(rng.randint(300, 900), 1) for _ in range(128)]
    long_decode = [(rng.randint(7000, 9000), 1) for _ in range(8)]
    spread = [(rng.randint(100, 2047), 1) for _ in range(256)]  # W-A's decode steps: contexts of 100 to 2k
    # W-L's steps (issue 19): two fresh 8k prompts; a prompt's second chunk over its cached first one beside a
    # fresh one and W-L's 64 decodes; W-L's decode steps at 8k and 32k contexts.
    wl_chunk = [(4096, 4096), (0, 8192), (0, 4032)] + [(rng.randint(8192, 8448), 1) for _ in range(64)]
    # A typical W-L step as the scheduler makes it: the decodes' tokens finish one prompt, two fresh ones follow.
    wl_step = [(8152, 40), (0, 8192), (0, 8112)] + [(rng.randint(8192, 8448), 1) for _ in range(40)]
    return {"decode 256 x ~600": decode, "mixed 4 prefills + 128 decodes": mixed, "decode 8 x ~8k": long_decode,
            "decode 256 x 100-2k": spread, "prefill 2 x 8k fresh": [(0, 8192), (0, 8192)],
            "prefill 8k chunks over 4k cached + 64 decodes": wl_chunk,
            "prefill W-L step: 40 tokens over 8k, 2 fresh 8k, 40 decodes": wl_step,
            "decode 64 x ~8k": [(rng.randint(8192, 8448), 1) for _ in range(64)],
            "decode 64 x ~32k": [(rng.randint(32768, 33024), 1) for _ in range(64)]}


def attention_flops(lens: list[tuple[int, int]], num_heads: int, head_dim: int) -> int:
    """Causal attention's matmul FLOPs (QK^T and PV): query i of a chunk over c cached keys sees c + i + 1 keys."""
    return sum(4 * num_heads * head_dim * (q * c + q * (q + 1) // 2) for c, q in lens)


def _eager_us(calls: list, iters: int) -> float:
    for call in calls:
        call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(iters):
        calls[i % len(calls)]()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e6


def _graph_us(calls: list, iters: int) -> float | None:
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for call in calls:
                call()
    except Exception:  # backends that read the host or allocate outside the pool cannot be captured
        torch.cuda.synchronize()
        return None
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    rounds = max(1, iters // len(calls))
    start.record()
    for _ in range(rounds):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (rounds * len(calls))


def _layers(batch, min_bytes: int = 512 << 20) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copies of the batch's caches, one per "layer", so that calls in turn read more than the L2 holds
    (a model's layers each have their own cache); at most 16."""
    per_layer = 2 * batch.key_cache.numel() * batch.key_cache.element_size()
    n = min(16, max(2, -(-min_bytes // per_layer)))
    return [(batch.key_cache, batch.value_cache)] + [(batch.key_cache.clone(), batch.value_cache.clone())
                                                     for _ in range(n - 1)]


def bench_backend(backend, batch, layers, heads: tuple[int, int, int], iters: int) -> dict:
    num_heads, num_kv_heads, head_dim = heads
    impl = backend.impl_cls(num_heads, head_dim, head_dim ** -0.5, num_kv_heads)
    calls = [functools.partial(impl.forward, batch.query, batch.key, batch.value, k, v, batch.meta)
             for k, v in layers]
    eager_us = _eager_us(calls, iters)  # first: JIT compiles happen here, outside any capture
    # The reference syncs on the host every call: a capture attempt would only fail.
    return {"eager_us": eager_us, "graph_us": _graph_us(calls, iters) if backend.name != "torch" else None}


def bench_triton_variant(batch, layers, heads: tuple[int, int, int], iters: int, **options) -> dict:
    """Our kernel with its split-KV choice overridden (num_splits=1: off; decode_split_keys: range size)."""
    from attention.triton_paged import paged_attention_triton, write_kv_triton

    sm_count = torch.cuda.get_device_properties(0).multi_processor_count

    def call(key_cache, value_cache):
        write_kv_triton(batch.key, batch.value, key_cache, value_cache, batch.meta.slot_mapping)
        return paged_attention_triton(batch.query, key_cache, value_cache, batch.meta, heads[2] ** -0.5,
                                      sm_count, **options)

    calls = [functools.partial(call, k, v) for k, v in layers]
    eager_us = _eager_us(calls, iters)
    return {"eager_us": eager_us, "graph_us": _graph_us(calls, iters)}


TRITON_VARIANTS = {"triton (split-KV off)": {"num_splits": 1}, **{
    f"triton (decode ranges of {n})": {"decode_split_keys": n} for n in (256, 512, 1024)},
    "triton (pointer decode)": {"decode_kernel": "pointer"}, **{
    f"triton (TMA decode, ranges of {n})": {"decode_kernel": "tma", "decode_split_keys": n} for n in (1024, 2048)},
    # Every sequence split evenly into n ranges (at least 256 keys each): W-L's 64 x 2 (sequence, kv head) pairs
    # give 512 programs at n = 4, about one wave at 4 programs an SM, where ranges of 1024 give ~1,150 programs
    # (9 a pair, the last short) in ~2.2 waves. A host rule by batch size would keep CUDA graphs valid.
    **{f"triton (even split into {n})": {"num_splits": n, "decode_split_keys": 256} for n in (2, 4, 8)},
    "triton (TMA decode, even split into 4)": {"decode_kernel": "tma", "num_splits": 4, "decode_split_keys": 256}}
# Prefill tiles (BLOCK_M, BLOCK_N, num_warps, num_stages) against _tiles' choice, for batches with prefills.
TRITON_PREFILL_TILES = [(128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3), (128, 64, 4, 3),
                        (256, 64, 8, 2)]
# Decode tiles against _tiles' choice: the 64-key tiles it picked before 2026-12-05 for head dims 64 and 128
# (it now reads 128 keys at a time over 128-token pages and at head dim 128), and others (whole 128-token pages
# per tile, deeper pipelines); each checked in tests/test_attention_gpu.py first. 16 rows: the GQA group (7)
# padded to a power of two, at least 16.
TRITON_DECODE_TILES = [(16, 64, 4, 2), (16, 64, 8, 2), (16, 128, 4, 2), (16, 128, 8, 3), (16, 64, 4, 4),
                       (16, 256, 8, 2)]


# The TMA decode kernel's tiles (attention/triton_decode_tma.py): whole tiles of a 128-token page, pipelines
# of 2 to 4 stages.
TRITON_TMA_DECODE_TILES = [(16, 128, 4, 2), (16, 128, 4, 3), (16, 128, 4, 4), (16, 64, 4, 3), (16, 64, 4, 4),
                           (16, 128, 8, 3), (16, 64, 2, 4)]


def bench_dense_prefill(batch, heads: tuple[int, int, int], iters: int, kernel: str) -> dict | None:
    """Fresh prompts only (no cached context): attention over the step's own K/V, contiguous, no page table,
    through flash-attn-4's or torch's varlen kernel. None when the batch has cached context or decodes."""
    meta = batch.meta
    if any(s.context_len for s in batch.specs) or meta.num_decode_tokens:
        return None
    cu, max_q, scale = meta.query_start_loc, meta.max_query_len, heads[2] ** -0.5
    if kernel == "flash-attn-4":
        from flash_attn.cute import flash_attn_varlen_func

        def call():
            return flash_attn_varlen_func(batch.query, batch.key, batch.value, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                          max_seqlen_q=max_q, max_seqlen_k=max_q, softmax_scale=scale, causal=True)
    else:
        from torch.nn.attention.varlen import varlen_attn

        def call():
            return varlen_attn(batch.query, batch.key, batch.value, cu, cu, max_q, max_q, scale=scale,
                               window_size=(-1, 0), enable_gqa=True)
    return {"eager_us": _eager_us([call], iters), "graph_us": _graph_us([call], iters)}


def kv_bytes(batch, heads: tuple[int, int, int]) -> int:
    _, num_kv_heads, head_dim = heads
    return int(batch.meta.seq_lens.sum()) * num_kv_heads * head_dim * 2 * batch.key_cache.element_size()


def run(iters: int, only: str | None = None, block_size: int = 16, backends: list[str] | None = None,
        with_variants: bool = True, skip: tuple[str, ...] = ()) -> list[dict]:
    rows = []
    for shape_name, heads in SHAPES.items():
        for work_name, lens in workloads(random.Random(0)).items():
            if only and only not in f"{shape_name} {work_name}" or any(x in work_name for x in skip):
                continue
            batch = make_random_batch(lens, *heads, block_size, torch.bfloat16, "cuda", seed=1)
            layers = _layers(batch)
            del batch.full_keys[:], batch.full_values[:]  # free what only the tests need
            for name in backends or BACKEND_NAMES:
                try:
                    backend = get_backend(name, torch.device("cuda"), heads[2], block_size)
                except ValueError as e:
                    rows.append({"shape": shape_name, "workload": work_name, "backend": name, "skipped": str(e)})
                    continue
                variants = [(name, lambda: bench_backend(backend, batch, layers, heads, iters))]
                if name == "triton" and with_variants:
                    variants += [(label, functools.partial(bench_triton_variant, batch, layers, heads, iters, **opts))
                                 for label, opts in TRITON_VARIANTS.items()
                                 if work_name.startswith("decode") or opts.get("num_splits") == 1]
                    tiles = TRITON_DECODE_TILES if work_name.startswith("decode") else TRITON_PREFILL_TILES
                    variants += [(f"triton (tiles {t})", functools.partial(  # decodes: the pointer kernel's
                        bench_triton_variant, batch, layers, heads, iters, tiles=t, decode_kernel="pointer"))
                        for t in tiles]
                    if work_name.startswith("decode"):
                        variants += [(f"triton TMA (tiles {t})", functools.partial(
                            bench_triton_variant, batch, layers, heads, iters, tiles=t, decode_kernel="tma"))
                            for t in TRITON_TMA_DECODE_TILES if block_size % t[1] == 0]
                if name in ("triton", "flash-attn-4") and work_name.startswith("prefill") and with_variants:
                    kernel = "torch" if name == "triton" else name  # torch's varlen rides along once
                    variants.append((f"{kernel} varlen (dense K/V, no pages)",
                                     functools.partial(bench_dense_prefill, batch, heads, iters, kernel)))
                for label, bench in variants:
                    try:
                        result = bench()
                    except Exception as e:  # a variant the installed kernels refuse: say so, go on
                        result = {"skipped": f"{type(e).__name__}: {e}"[:200]}
                    if result is None:
                        continue
                    row = {"shape": shape_name, "workload": work_name, "backend": label, "block_size": block_size,
                           **result}
                    if "skipped" in row:
                        rows.append(row)
                        print(_format_row(row), flush=True)
                        continue
                    best = row["graph_us"] or row["eager_us"]
                    row["gb_per_s"] = kv_bytes(batch, heads) / best / 1e3 if work_name.startswith("decode") else None
                    row["tflop_per_s"] = (attention_flops(lens, heads[0], heads[2]) / best / 1e6
                                          if not work_name.startswith("decode") else None)
                    rows.append(row)
                    print(_format_row(row), flush=True)
    return rows


def _format_row(row: dict) -> str:
    if "skipped" in row:
        return f"| {row['shape']} | {row['workload']} | {row['backend']} | skipped: {row['skipped'][:80]} | | | |"
    graph = f"{row['graph_us']:.1f}" if row["graph_us"] is not None else "n/a"
    gbs = f"{row['gb_per_s']:.0f}" if row["gb_per_s"] is not None else ""
    tflops = f"{row['tflop_per_s']:.0f}" if row.get("tflop_per_s") is not None else ""
    block = f" (block {row['block_size']})" if row.get("block_size", 16) != 16 else ""
    return (f"| {row['shape']} | {row['workload']} | {row['backend']}{block} | {row['eager_us']:.1f} | {graph} | {gbs} "
            f"| {tflops} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where to write the JSON results")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--only", help="run the shape/workload pairs whose names contain this text")
    parser.add_argument("--skip-workloads", default="", help="comma-separated: skip workloads whose names contain any")
    parser.add_argument("--block-size", default="16", help="KV block sizes, comma-separated: each a full run")
    parser.add_argument("--backends", help="comma-separated backend names (default: every registered one)")
    parser.add_argument("--no-variants", action="store_true", help="backends as shipped only, no Triton variants")
    args = parser.parse_args()
    env = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
           "torch": torch.__version__}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        pass
    backends = args.backends.split(",") if args.backends else None
    rows = [row for bs in args.block_size.split(",")
            for row in run(args.iters, args.only, int(bs), backends, not args.no_variants,
                           tuple(x for x in args.skip_workloads.split(",") if x))]
    with open(args.out, "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)
    print(f"\n{env}\n| shape | workload | backend | eager us/call | graph us/call | KV GB/s | TFLOP/s |\n"
          "|---|---|---|---|---|---|---|")
    for row in rows:
        print(_format_row(row))


if __name__ == "__main__":
    main()
