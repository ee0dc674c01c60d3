"""Cache-aware dispatch against round robin: `kvserve serve --data-parallel-size N` on a shared-prefix load.

    python benchmarks/prefix_affinity.py --out prefix_affinity.json          # CPU, a tiny random model, N=2
    python benchmarks/prefix_affinity.py --model DIR --data-parallel-size 2 --prefix-len 1024 --num-prompts 400

For each --data-parallel-dispatch policy (affinity, round_robin) in turn: start the server, run `bench serve
--dataset prefix_repetition` (P prefixes, each the start of num_prompts / P requests with different suffixes,
shuffled; vLLM's shape), read the prefix cache's counters from /metrics before and after, stop it. With N
cores and round robin a prefix is cached on every core before it hits everywhere; with affinity, once. Prints
the prefix-cache hit rate (prompt tokens found / looked up), TTFT and throughput per policy; writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from bench import server_procs  # noqa: E402
from bench.models import build_random_model  # noqa: E402

TINY = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
        "max_position_embeddings": 1024, "bos_token_id": 0, "eos_token_id": 1}
POLICIES = ("affinity", "round_robin")


def prefix_counters(base_url: str) -> tuple[float, float]:
    """(prompt tokens looked up, found) in the prefix cache, over every engine core."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    found = {"kvserve_prefix_cache_queries_total": [], "kvserve_prefix_cache_hits_total": []}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in found:
                found[sample.name].append(sample)
    # An unlabelled sample is the total; without one, the per-core samples add up to it.
    totals = [next((s.value for s in samples if not s.labels), sum(s.value for s in samples))
              for samples in found.values()]
    return totals[0], totals[1]


def bench(url: str, args, out: Path) -> dict:
    cmd = [sys.executable, "-m", "bench.serve", "--base-url", url, "--dataset", "prefix_repetition",
           "--num-prompts", str(args.num_prompts), "--prefix-repetition-num-prefixes", str(args.num_prefixes),
           "--prefix-repetition-prefix-len", str(args.prefix_len), "--prefix-repetition-suffix-len",
           str(args.suffix_len), "--prefix-repetition-output-len", str(args.output_len), "--request-rate",
           str(args.request_rate), "--random-vocab-size", str(args.vocab), "--seed", "0", "--disable-tqdm",
           "--result-json", str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(server_procs.REPO),
                                                                     os.environ.get("PYTHONPATH")]))}
    subprocess.run(cmd, cwd=server_procs.REPO, env=env, check=True, timeout=args.run_timeout_s,
                   stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def measure(policy: str, model_dir: Path, args, raw: Path) -> dict:
    flags = ["--data-parallel-size", str(args.data_parallel_size), "--data-parallel-dispatch", policy,
             "--enable-prefix-caching", *args.server_args.split()]
    proc = server_procs.start_kvserve(model_dir, flags, raw / f"serve-{policy}.log", args.start_timeout_s)
    try:
        queries0, hits0 = prefix_counters(proc.base_url)
        result = bench(proc.base_url, args, raw / f"bench-{policy}.json")
        queries1, hits1 = prefix_counters(proc.base_url)
    finally:
        server_procs.stop(proc)
    looked_up, hit = queries1 - queries0, hits1 - hits0
    return {"policy": policy, "prefix_cache_queries": looked_up, "prefix_cache_hits": hit,
            "hit_rate": hit / looked_up if looked_up else 0.0, "completed": result["completed"],
            "failed": result["failed"], "output_throughput": result["output_throughput"],
            "median_ttft_ms": result["median_ttft_ms"], "p99_ttft_ms": result["p99_ttft_ms"],
            "median_tpot_ms": result["median_tpot_ms"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model directory (default: a tiny random Llama, vocab 1000)")
    p.add_argument("--data-parallel-size", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=60)
    p.add_argument("--num-prefixes", type=int, default=6)
    p.add_argument("--prefix-len", type=int, default=256)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--request-rate", type=float, default=20.0)
    p.add_argument("--vocab", type=int, default=1000, help="prompt ids from [0, this)")
    p.add_argument("--server-args", default="", help="more `kvserve serve` flags, one string")
    p.add_argument("--start-timeout-s", type=float, default=300.0)
    p.add_argument("--run-timeout-s", type=float, default=300.0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    raw = Path(tempfile.mkdtemp(prefix="kvserve-affinity-"))
    model_dir = Path(args.model) if args.model else build_random_model(TINY, raw / "model")
    rows = []
    for policy in POLICIES:
        print(f"[{time.strftime('%H:%M:%S')}] {policy}: --data-parallel-size {args.data_parallel_size}", flush=True)
        rows.append(measure(policy, model_dir, args, raw))
    print(f"\n{args.num_prompts} requests, {args.num_prefixes} prefixes of {args.prefix_len} + suffixes of "
          f"{args.suffix_len} -> {args.output_len} tokens, {args.request_rate:g} req/s, "
          f"{args.data_parallel_size} engine cores (logs in {raw})")
    print(f"{'dispatch':<12} {'prefix hit rate':>16} {'out tok/s':>10} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} "
          f"{'failed':>7}")
    for r in rows:
        print(f"{r['policy']:<12} {r['hit_rate']:>16.1%} {r['output_throughput']:>10,.0f} "
              f"{r['median_ttft_ms']:>12.1f} {r['p99_ttft_ms']:>12.1f} {r['failed']:>7}")
    if rows[1]["hit_rate"]:
        print(f"affinity / round robin hit rate: {rows[0]['hit_rate'] / rows[1]['hit_rate']:.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args),
                                              "cpu_count": os.cpu_count(), "results": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
