"""W-C, the online benchmark: kvserve's server beside vLLM's, and beside kvserve's own offline W-B, in one run.

On the H200 host, from the repository root, with kvserve's PYTHONPATH and vLLM staged (shared/peers/vllm:
`fetch --server`, every .carry/vllm-K staged into /tmp/vllm-site):

    PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages python3 benchmarks/online_wc.py \
        --out wc.json                              # ~8 minutes; --deadline-s bounds it
    python benchmarks/online_wc.py --smoke         # a CPU check of the whole path: tiny model, kvserve only

In order, each phase under its own timeout and all under --deadline-s (a phase that no longer fits is skipped
and reported so): a random-weight Qwen2.5-0.5B-shaped model directory (bench/models.py, the one W-A/W-B use,
with its id tokenizer); kvserve's offline W-B on it (`bench throughput --preset wb`); `kvserve serve` on it,
measured, stopped; vLLM's server through .carry/peers/vllm_serve.sh (one front end), measured, stopped;
`vllm serve --api-server-count 4`, measured, stopped. Every server gets the same limits (--max-model-len
2048 --max-num-batched-tokens 16384 --max-num-seqs 256: serve.sh's, and W-B's offline settings) and its own
prefix-cache default. The loads (bench/serve.py, streaming, ignore_eos, 512 prompt ids -> 128 tokens):
256 and 1,024 requests at once (alternated, --repeat times), 40 requests/s, one stream at a time; each with
fresh prompts (a seed per load and repetition, ids from 150,000), so no server is timed on cache hits of a
repetition. Client processes: --client-workers for the loads at once (one process streams ~45k tokens/s on
a 2-core VM: docs/benchmarking.md). Prints a table with ratios and the issue's targets, writes JSON; raw
results and server logs go to --raw-dir.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from bench import server_procs  # noqa: E402
from bench.online_report import Load, Run, slowest_ttfts, table, targets  # noqa: E402
from bench.models import build_random_model, parse_model_config  # noqa: E402

SERVER_LIMITS = ["--max-model-len", "2048", "--max-num-batched-tokens", "16384", "--max-num-seqs", "256"]
SMOKE_CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
                "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "vocab_size": 300, "max_position_embeddings": 256,
                "bos_token_id": 0, "eos_token_id": 1}


@dataclass
class Shape:
    input_len: int
    output_len: int
    vocab: int  # prompt ids from [0, vocab)

def gpu_loads(workers: int, repeats: int) -> list[Load]:
    return [Load("256 at once", 256, math.inf, None, workers, repeats),
            Load("1024 at once", 1024, math.inf, None, workers, repeats),
            Load("40 req/s", 160, 40.0, None, 2, 1), Load("one at a time", 12, math.inf, 1, 1, 1)]


def smoke_loads() -> list[Load]:
    return [Load("8 at once", 8, math.inf, None, 2, 1), Load("16 at once", 16, math.inf, None, 2, 1),
            Load("20 req/s", 10, 20.0, None, 2, 1), Load("one at a time", 3, math.inf, 1, 1, 1)]


# ----------------------------------------------------------------------------------------------- client


SUMMARY_KEYS = ("completed", "failed", "duration", "output_throughput", "total_output_tokens", "median_ttft_ms",
                "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "median_e2el_ms",
                "max_concurrent_requests")


def bench_serve(url: str, load: Load, shape: Shape, seed: int, out: Path, timeout_s: float) -> dict:
    """One `bench serve` run in its own process (killed at timeout_s); its summary figures."""
    cmd = ["--base-url", url, "--num-prompts", str(load.num_prompts),
           "--random-input-len", str(shape.input_len), "--random-output-len", str(shape.output_len),
           "--random-vocab-size", str(shape.vocab), "--request-rate", str(load.request_rate),
           "--num-workers", str(load.workers), "--seed", str(seed), "--num-warmups", "1",
           "--request-timeout", str(max(10.0, timeout_s - 10)), "--percentiles", "50,90,99", "--disable-tqdm"]
    if load.max_concurrency:
        cmd += ["--max-concurrency", str(load.max_concurrency)]
    result = server_procs.run_bench_serve(cmd, out, timeout_s)
    return {**{k: result[k] for k in SUMMARY_KEYS}, "slowest_ttfts": slowest_ttfts(result)}



def measure_system(system: str, url: str, loads: list[Load], shape: Shape, raw: Path, clock: server_procs.Clock,
                   run_timeout_s: float) -> list[Run]:
    """A short unrecorded warm-up load, then every load; the loads at once alternate, repetition by
    repetition. A run that fails or no longer fits the deadline is recorded with its reason; after a run
    that timed out the server's remaining runs are skipped (a hung server would time out every one)."""
    warm = Load("warm-up", min(64, loads[0].num_prompts), math.inf, None, 1, 1)
    order = [(load, r) for r in range(max(ld.repeats for ld in loads)) for load in loads if r < load.repeats]
    order.sort(key=lambda lr: math.isinf(lr[0].request_rate) and lr[0].max_concurrency is None, reverse=True)
    runs, hung = [], False
    for i, (load, rep) in enumerate([(warm, 0)] + order):
        run = Run(system, load.name, rep)
        timeout = min(run_timeout_s, clock.left() - 5)
        if hung:
            run.error = "skipped: an earlier run timed out"
        elif timeout < 15:
            run.error = "skipped: the deadline is near"
        else:
            seed = 1000 * i + rep
            tag = f"{system}-{load.name}-{rep}".replace(" ", "_").replace("/", "per")
            try:
                run.metrics = bench_serve(url, load, shape, seed, raw / f"{tag}.json", timeout)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                run.error = f"{type(e).__name__}: {e}"[:2000]
                hung = isinstance(e, subprocess.TimeoutExpired) or "timed out" in str(e)
        clock.log(f"  {system} | {load.name} #{rep + 1}: " + (run.error or _brief(run.metrics)))
        if load is not warm:
            runs.append(run)
    return runs


def _brief(m: dict) -> str:
    return (f"{m['output_throughput']:,.0f} out tok/s, TTFT p50 {m['median_ttft_ms']:.1f} ms p99 "
            f"{m['p99_ttft_ms']:.1f} ms, TPOT p50 {m['median_tpot_ms']:.2f} ms, failed {m['failed']}; slowest TTFTs: "
            + ", ".join(f"{s['ttft_ms']:.0f} ms sent at {s['sent_at_s']:.2f} s" for s in m.get("slowest_ttfts", [])))


# ----------------------------------------------------------------------------------------------- phases


def offline_wb(model_dir: Path, args, raw: Path, clock: server_procs.Clock) -> dict:
    """kvserve's offline throughput on this model: W-B (or, --smoke, the smoke load's shape on the CPU)."""
    out = raw / "offline.json"
    workload = (["--dataset", "random", "--num-prompts", "16", "--random-input-len", "16",
                 "--random-output-len", "8", "--repeat", "2", "--device", "cpu"] if args.smoke else
                ["--preset", "wb", *SERVER_LIMITS, "--skip-tokenizer-init", "--repeat", "3"])
    cmd = [sys.executable, "-m", "bench.throughput", "--model", str(model_dir), *workload, "--out", str(out)]
    clock.log(f"kvserve offline: $ {' '.join(cmd)}")
    env = server_procs.kvserve_env()
    if args.smoke:  # the threads the engine-core process takes on a CPU (engine/core/process.py): a core for
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) - 1))  # the rest; all of them spin, loaded
    with open(raw / "offline.log", "w") as log:
        subprocess.run(cmd, cwd=server_procs.REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                       timeout=min(args.offline_timeout_s, clock.left()), check=True)
    summary = json.loads(out.read_text())["results"][0]
    clock.log(f"kvserve offline: {summary['output_tokens_per_second']:,.0f} out tok/s ({summary['name']})")
    return summary


def server_phase(name: str, start: Callable[[float], server_procs.ServerProc], loads, shape, raw, clock,
                 args) -> tuple[list[Run], str]:
    """Start a server (under the start timeout), measure every load, stop it whatever happens."""
    if clock.left() < args.min_phase_s:
        clock.log(f"{name}: skipped, {clock.left():.0f} s left")
        return [], "skipped: the deadline is near"
    clock.log(f"{name}: starting")
    try:
        proc = start(min(args.start_timeout_s, clock.left() - 30))
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        clock.log(f"{name}: did not start: {e}")
        return [], f"did not start: {e}"[:3000]
    clock.log(f"{name}: up at {proc.base_url} (pid {proc.pid})")
    try:
        return measure_system(name, proc.base_url, loads, shape, raw, clock, args.run_timeout_s), ""
    finally:
        clock.log(f"{name}: stopping")
        server_procs.stop(proc)
        clock.log(f"{name}: stopped")


# ------------------------------------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="CPU check: tiny model, few requests, kvserve only")
    p.add_argument("--out", default="online_wc.json", help="the results as JSON")
    p.add_argument("--raw-dir", default=None, help="per-run results and logs (default: OUT's stem + _raw)")
    p.add_argument("--deadline-s", type=float, default=480.0, help="the whole run; phases that no longer fit are skipped")
    p.add_argument("--repeat", type=int, default=2, help="repetitions of the loads at once (alternated)")
    p.add_argument("--client-workers", type=int, default=4, help="bench serve processes for the loads at once")
    p.add_argument("--vllm", action=argparse.BooleanOptionalAction, default=None, help="default: on, off with --smoke")
    p.add_argument("--vllm-serve-script", default=".carry/peers/vllm_serve.sh")
    p.add_argument("--vllm-site", default="/tmp/vllm-site")
    p.add_argument("--offline", action=argparse.BooleanOptionalAction, default=True, help="kvserve's offline W-B")
    p.add_argument("--kvserve-args", default="", help="more `kvserve serve` flags, one string")
    p.add_argument("--start-timeout-s", type=float, default=300.0)
    p.add_argument("--run-timeout-s", type=float, default=120.0, help="one bench serve run")
    p.add_argument("--offline-timeout-s", type=float, default=200.0)
    p.add_argument("--min-phase-s", type=float, default=90.0, help="a server phase starts only with this much left")
    args = p.parse_args()
    args.vllm = (not args.smoke) if args.vllm is None else args.vllm
    return args


def main() -> int:
    args = parse_args()
    clock = server_procs.Clock(args.deadline_s)
    out = Path(args.out)
    raw = Path(args.raw_dir or out.with_name(out.stem + "_raw"))
    raw.mkdir(parents=True, exist_ok=True)
    clock.log(f"online W-C: $ {' '.join([sys.executable, *sys.argv])}  (deadline {args.deadline_s:.0f} s)")
    loads = smoke_loads() if args.smoke else gpu_loads(args.client_workers, args.repeat)
    shape = Shape(16, 8, 290) if args.smoke else Shape(512, 128, 150_000)
    tmp = Path(tempfile.mkdtemp(prefix="kvserve-wc-model-"))
    record = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": sys.argv, "smoke": args.smoke,
              "loads": [asdict(ld) for ld in loads], "shape": asdict(shape), "server_limits": SERVER_LIMITS,
              "phases": {}}
    def save(runs: list[Run], offline: dict | None, extra: dict | None = None) -> None:
        record.update({"offline": offline, "runs": [asdict(r) for r in runs], **(extra or {}),
                       "elapsed_s": time.monotonic() - clock.start})
        out.write_text(json.dumps(record, indent=1))  # after every phase: a run cut short keeps what it had

    try:
        runs, systems, offline = run_phases(args, loads, shape, tmp, raw, clock, record, save)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    text, figures = table(runs, systems, loads, offline)
    checks = [] if args.smoke else targets(figures, systems, offline)
    print("\n" + text + ("\n\n" + "\n".join(checks) if checks else ""), flush=True)
    save(runs, offline, {"figures": figures, "targets": checks, "table": text.splitlines()})
    clock.log(f"wrote {out} (raw results and logs in {raw})")
    return 0 if runs and not any(r.error for r in runs) else 1


def run_phases(args, loads, shape, tmp: Path, raw: Path, clock: server_procs.Clock, record: dict, save):
    config = SMOKE_CONFIG if args.smoke else parse_model_config("qwen2.5-0.5b")
    clock.log(f"building a random-weight {config['architectures'][0]} in {tmp}")
    model_dir = build_random_model(config, tmp)
    offline = None
    if args.offline:
        try:
            offline = offline_wb(model_dir, args, raw, clock)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError, KeyError) as e:
            clock.log(f"kvserve offline failed: {e} (log: {raw / 'offline.log'})")
    save([], offline)
    limits = ["--max-model-len", "256", "--max-num-seqs", "32"] if args.smoke else SERVER_LIMITS
    phases = [("kvserve", lambda t: server_procs.start_kvserve(
        model_dir, limits + args.kvserve_args.split(), raw / "kvserve-serve.log", t))]
    if args.vllm:
        phases.append(("vLLM", lambda t: server_procs.start_vllm_script(
            Path(args.vllm_serve_script), model_dir, [], t)))
        phases.append(("vLLM x4", lambda t: server_procs.start_vllm_cli(
            args.vllm_site, model_dir, SERVER_LIMITS + ["--dtype", "bfloat16", "--api-server-count", "4",
                                          "--disable-uvicorn-access-log"],
            raw / "vllm-x4-serve.log", t)))
    runs = []
    for name, start in phases:
        got, note = server_phase(name, start, loads, shape, raw, clock, args)
        runs += got
        record["phases"][name] = note or "measured"
        save(runs, offline)
    return runs, [name for name, _ in phases], offline


if __name__ == "__main__":
    sys.exit(main())
