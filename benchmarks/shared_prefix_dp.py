"""Shared-prefix load on `--data-parallel-size 2`: prefix-affinity dispatch against round robin (CPU).

For each policy, in turns (--rounds), one `kvserve serve` with two engine cores on a small random model, one
`kvserve bench serve --dataset prefix_repetition` run (P prefixes of L ids, each reused by many requests with
different suffixes), and the prefix cache's hit rate read from /metrics before and after. Prints a table
(hit rate, TTFT, throughput, ratio affinity / round robin) and writes JSON.

    python benchmarks/shared_prefix_dp.py --out shared_prefix_dp.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from bench import server_procs  # noqa: E402
from bench.models import build_random_model  # noqa: E402

MODEL = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 128,
         "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 8000, "max_position_embeddings": 2048, "bos_token_id": 0, "eos_token_id": 1}
POLICIES = ("affinity", "round_robin")


def hit_counters(base_url: str) -> tuple[float, float]:
    from prometheus_client.parser import text_string_to_metric_families

    values = {s.name: s.value for f in text_string_to_metric_families(httpx.get(base_url + "/metrics").text)
              for s in f.samples}
    return values["kvserve_prefix_cache_hits_total"], values["kvserve_prefix_cache_queries_total"]


def one_run(model_dir: Path, policy: str, args, raw: Path, tag: str) -> dict:
    proc = server_procs.start_kvserve(model_dir, ["--device", "cpu", "--data-parallel-size", "2",
                                                  "--data-parallel-dispatch", policy, "--api-server-count", "1",
                                                  "--num-kv-blocks", str(args.kv_blocks)],
                                      raw / f"{tag}-serve.log", 300)
    try:
        h0, q0 = hit_counters(proc.base_url)
        out = raw / f"{tag}.json"
        cmd = [sys.executable, "-m", "bench.serve", "--base-url", proc.base_url, "--dataset", "prefix_repetition",
               "--num-prompts", str(args.num_prompts), "--prefix-repetition-num-prefixes", str(args.prefixes),
               "--prefix-repetition-prefix-len", str(args.prefix_len), "--prefix-repetition-suffix-len", "32",
               "--prefix-repetition-output-len", "16", "--request-rate", str(args.rate), "--seed", tag[-1],
               "--num-warmups", "0", "--disable-tqdm", "--result-json", str(out)]
        subprocess.run(cmd, check=True, capture_output=True, timeout=600, cwd=server_procs.REPO)
        h1, q1 = hit_counters(proc.base_url)
    finally:
        server_procs.stop(proc)
    r = json.loads(out.read_text())
    return {"policy": policy, "hit_rate": (h1 - h0) / max(1.0, q1 - q0), "output_throughput": r["output_throughput"],
            "median_ttft_ms": r["median_ttft_ms"], "p99_ttft_ms": r["p99_ttft_ms"], "failed": r["failed"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=96)
    p.add_argument("--prefixes", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=256)
    p.add_argument("--rate", type=float, default=8.0, help="requests/s (Poisson)")
    p.add_argument("--kv-blocks", type=int, default=256)
    p.add_argument("--out", default="shared_prefix_dp.json")
    args = p.parse_args()
    raw = Path(args.out).with_suffix("")
    raw.mkdir(parents=True, exist_ok=True)
    model_dir = build_random_model(MODEL, Path(tempfile.mkdtemp(prefix="kvserve-dp-model-")))
    runs = [one_run(model_dir, policy, args, raw, f"{policy}-{r}") for r in range(args.rounds) for policy in POLICIES]
    rows = {pol: {k: statistics.median(run[k] for run in runs if run["policy"] == pol)
                  for k in ("hit_rate", "output_throughput", "median_ttft_ms", "p99_ttft_ms")} for pol in POLICIES}
    print(f"{'dispatch':<12}{'prefix hit rate':>16}{'out tok/s':>12}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}")
    for pol, m in rows.items():
        print(f"{pol:<12}{m['hit_rate']:>16.3f}{m['output_throughput']:>12.1f}{m['median_ttft_ms']:>13.1f}"
              f"{m['p99_ttft_ms']:>13.1f}")
    ratio = rows["affinity"]["hit_rate"] / max(1e-9, rows["round_robin"]["hit_rate"])
    print(f"hit rate, affinity / round robin: {ratio:.2f}x (medians of {args.rounds} rounds, policies alternated)")
    Path(args.out).write_text(json.dumps({"args": vars(args), "runs": runs, "medians": rows, "hit_rate_ratio": ratio},
                                         indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
