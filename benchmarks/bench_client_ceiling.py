"""The bench client's ceiling: streamed tokens/s that `kvserve bench serve` sustains with 1 and N processes.

    python benchmarks/bench_client_ceiling.py --workers 1,4 --num-prompts 256 --output-len 256 --repeat 3 \
        --out client_ceiling.json

Against a stub server in its own process (bench/stub_server.py) that streams one token per SSE event as
fast as it can, every request at once, a run's output tokens/s is what the client parses: above it, a
server's measured throughput would be the client's, not the server's. The stub's own CPU use is shown beside
it (near 100% of a core: the stub, not the client, is the limit of that row). Median of --repeat runs.
Prints a table, writes JSON.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from bench.datasets import requests_from_args  # noqa: E402
from bench.serve import build_parser, check_args, run_benchmark  # noqa: E402
from bench.serve_metrics import compute_metrics  # noqa: E402
from bench.stub_server import RunningStub, running_stub  # noqa: E402


def one_run(stub: RunningStub, workers: int, num_prompts: int, output_len: int) -> dict:
    args = build_parser().parse_args([
        "--base-url", stub.url, "--num-prompts", str(num_prompts), "--random-input-len", "8",
        "--random-output-len", str(output_len), "--num-workers", str(workers), "--num-warmups", "1",
        "--disable-tqdm"])
    base_url, _, percentiles = check_args(args)
    cpu_before = stub.cpu_seconds()
    with contextlib.redirect_stdout(io.StringIO()):
        _, results, duration, _ = run_benchmark(args, base_url, requests_from_args(args))
    stub_cpu = stub.cpu_seconds() - cpu_before
    m = compute_metrics(results, duration, {}, percentiles)
    return {"duration_s": duration, "completed": m["completed"], "failed": m["failed"],
            "output_tokens": m["total_output_tokens"], "output_tokens_per_s": m["output_throughput"],
            "median_itl_ms": m["median_itl_ms"], "stub_cpu_share": stub_cpu / duration}


def measure(stub: RunningStub, workers: int, args: argparse.Namespace) -> dict:
    runs = []
    for i in range(args.repeat):
        runs.append(one_run(stub, workers, args.num_prompts, args.output_len))
        print(f"  {workers} worker(s), run {i + 1}: {runs[-1]['output_tokens_per_s']:,.0f} tok/s "
              f"(stub at {runs[-1]['stub_cpu_share']:.0%} of a core)", flush=True)
    best = statistics.median(r["output_tokens_per_s"] for r in runs)
    return {"workers": workers, "median_output_tokens_per_s": best, "runs": runs,
            "median_stub_cpu_share": statistics.median(r["stub_cpu_share"] for r in runs)}


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    print(f"\n{args.num_prompts} streams at once x {args.output_len} tokens (one token per SSE event), "
          f"median of {args.repeat}; {os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f}")
    print(f"{'client processes':>16} {'streamed tok/s':>15} {'stub CPU':>9} {'vs 1 process':>13}")
    for row in rows:
        ratio = row["median_output_tokens_per_s"] / rows[0]["median_output_tokens_per_s"]
        print(f"{row['workers']:>16} {row['median_output_tokens_per_s']:>15,.0f} "
              f"{row['median_stub_cpu_share']:>8.0%} {ratio:>12.2f}x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="1,4", help="comma-separated client process counts")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the results as JSON")
    args = parser.parse_args()
    counts = [int(w) for w in args.workers.split(",")]
    with running_stub() as stub:
        rows = [measure(stub, w, args) for w in counts]
    print_table(rows, args)
    if args.out:
        record = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "cpu_count": os.cpu_count(),
                  "machine": platform.platform(), "processor": platform.processor(),
                  "load_average": os.getloadavg(), "num_prompts": args.num_prompts,
                  "output_len": args.output_len, "repeat": args.repeat, "results": rows}
        Path(args.out).write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
