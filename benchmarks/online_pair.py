"""kvserve's server beside vLLM's on one host: W-B with 0%, 20% and 100% of requests under a JSON schema
(issue 15), and TTFT of one 8k and one 32k prompt alone (issue 19), in one run.

On the H200 host, from the repository root, with vLLM's server staged into /tmp/vllm-site
(shared/peers/vllm: `fetch --server`, every .carry/vllm-K staged; .carry/peers/vllm_serve.sh present):

    PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages python3 benchmarks/online_pair.py \
        --out $OUT/pair.json --raw-dir $OUT/pair-raw --deadline-s 500
    python benchmarks/online_pair.py --smoke      # a CPU check of the whole path: tiny model, kvserve only

One model directory: random bf16 weights of Qwen2.5-0.5B's shape with 40,960 positions (the built-in
`qwen2.5-0.5b-40k`) and a byte-level BPE tokenizer of exactly its 151,936 ids (bench/bpe_tokenizer.py: the
id tokenizer cannot spell JSON, so no schema could be satisfied). Then for each system in turn, kvserve then
vLLM (its api_server through .carry/peers/vllm_serve.sh, xgrammar its default grammar engine), start its
server with the same limits (--max-model-len 40960 --max-num-batched-tokens 16384 --max-num-seqs 256, each
its own prefix-cache default), run the loads, stop it:
  - an unrecorded warm-up load (64 requests, half of them constrained: grammars compiled and cached);
  - W-B json 0% / 20% / 100%: 256 prompts of 512 random ids -> 128 greedy tokens, ignore_eos, streaming, all at
    once from 4 client processes, --structured-fraction 0 / 0.2 / 1.0 (bench/structured_mix.py's schema as
    `structured_outputs`), alternated, --repeat times. With ignore_eos a constrained request writes its JSON
    first; at the document's end its grammar allows only EOS, which does not stop it, and the rest of its
    tokens run free (kvserve drops the grammar at that EOS, engine/engine.py; vLLM's xgrammar matcher is
    terminated by it and its rows get a full mask). A random model rarely ends a document within 128 tokens,
    so most constrained requests are under their mask for every token: the worst case for the mask's cost.
    Each server keeps its own defaults for the schema: kvserve compact JSON (no free whitespace) and extra
    properties allowed; vLLM's xgrammar free whitespace between JSON elements and no extra properties (compact
    for vLLM too: --vllm-args '--structured-outputs-config {"disable_any_whitespace":true}').
  - TTFT 8k / 32k: 5 prompts of 8,192 / 32,768 random ids -> 8 tokens, one at a time; the first (a fresh
    prompt) is the warm-up, the other 4 give TTFT p50 and min.
Every load gets fresh prompts (a seed per load and repetition, ids below 150,000), so no repetition is timed
on prefix-cache hits. Each phase runs under its own timeout, all under --deadline-s (a phase that no longer
fits is skipped and reported). Prints markdown tables (throughput relative to the same server's 0% load,
kvserve / vLLM ratios, the issues' targets), writes JSON to --out after every phase; per-run bench serve
results and both servers' logs go to --raw-dir.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from bench import py_spy, server_procs  # noqa: E402
from bench.proc_cpu import cores_between, cpu_by_role  # noqa: E402
from bench.models import build_random_model, parse_model_config  # noqa: E402
from bench.pair_report import PairLoad, PairRun, summarize, targets, ttft_table, wb_table  # noqa: E402

SERVER_LIMITS = ["--max-model-len", "40960", "--max-num-batched-tokens", "16384", "--max-num-seqs", "256"]
SMOKE_LIMITS = ["--max-model-len", "256", "--max-num-batched-tokens", "128", "--max-num-seqs", "32"]
SMOKE_CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
                "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "vocab_size": 300, "max_position_embeddings": 256,
                "bos_token_id": 0, "eos_token_id": 1}


def gpu_loads(repeats: int, workers: int, temperature: float = 0.0) -> tuple[PairLoad, list[PairLoad]]:
    wb = [PairLoad(f"W-B json {round(100 * f)}%", "wb", 256, 512, 128, f, None, workers, repeats,
                   temperature=temperature) for f in (0.0, 0.2, 1.0)]
    ttft = [PairLoad(f"TTFT {n // 1024}k", "ttft", 5, n, 8, 0.0, 1, 1, 1) for n in (8192, 32768)]
    return PairLoad("warm-up", "wb", 64, 512, 128, 0.5, None, workers, 1), wb + ttft


def smoke_loads() -> tuple[PairLoad, list[PairLoad]]:
    vocab = SMOKE_CONFIG["vocab_size"]
    wb = [PairLoad(f"W-B json {round(100 * f)}%", "wb", 8, 16, 12, f, None, 2, 1, vocab) for f in (0.0, 0.2, 1.0)]
    ttft = [PairLoad(f"TTFT {n}", "ttft", 3, n, 4, 0.0, 1, 1, 1, vocab) for n in (64, 200)]  # 200: two chunks
    return PairLoad("warm-up", "wb", 4, 16, 12, 0.5, None, 1, 1, vocab), wb + ttft


# ----------------------------------------------------------------------------------------------- client


def bench_serve(url: str, load: PairLoad, seed: int, form: str, out: Path, timeout_s: float) -> dict:
    """One `bench serve` run in its own process group (killed at timeout_s); its summary figures."""
    cmd = ["--base-url", url, "--num-prompts", str(load.num_prompts),
           "--random-input-len", str(load.input_len), "--random-output-len", str(load.output_len),
           "--random-vocab-size", str(load.prompt_vocab), "--num-workers", str(load.workers), "--seed", str(seed),
           "--request-timeout", str(max(10.0, timeout_s - 10)), "--percentiles", "50,90,99", "--disable-tqdm",
           "--structured-fraction", str(load.structured_fraction),
           "--structured-form", form, "--num-warmups", "0" if load.kind == "ttft" else "1",
           "--extra-body", json.dumps({"temperature": load.temperature})]
    if load.max_concurrency:
        cmd += ["--max-concurrency", str(load.max_concurrency)]
    return summarize(server_procs.run_bench_serve(cmd, out, timeout_s), load, seed)


def timed_load(server: server_procs.ServerProc, load: PairLoad, seed: int, form: str, out: Path, timeout_s: float
               ) -> dict:
    """bench_serve (with kvserve, what its engine did over the load: bench/engine_counters.py), plus the cores
    each of the server's roles kept busy over the load's duration."""
    before = cpu_by_role(server.pid)
    metrics = bench_serve(server.base_url, load, seed, form, out, timeout_s)
    metrics["cpu_cores"] = cores_between(before, cpu_by_role(server.pid), metrics["duration"])
    return metrics


def _brief(m: dict) -> str:
    text = (f"{m['output_throughput']:,.0f} out tok/s, TTFT p50 {m['median_ttft_ms']:.1f} ms p99 "
            f"{m['p99_ttft_ms']:.1f} ms, TPOT p50 {m['median_tpot_ms']:.2f} ms, failed {m['failed']}")
    if "json" in m:
        j = m["json"]
        text += (f"; constrained {j['constrained']}: {j['json_start']} start as JSON, {j['json_whole_valid']} whole "
                 f"and valid (free ones starting with '{{': {j['free_json_start']})")
    if m.get("ttft_p50_ms") is not None:
        text += f"; after the warm-up: TTFT p50 {m['ttft_p50_ms']:.1f} ms, min {m['ttft_min_ms']:.1f} ms"
    if m.get("cpu_cores"):
        text += "; cores busy: " + ", ".join(f"{role} {c:.2f}" for role, c in m["cpu_cores"].items())
    if m.get("engine"):
        e = m["engine"]
        text += (f"; engine: {e['steps']} steps, {e['tokens_per_step']} tokens a step, busy {e['busy_ms_per_step']:.2f}"
                 f" ms a step ({e['busy_share']:.0%} of the load), mask wait {e['mask_wait_ms_per_masked_step']:.2f} ms"
                 f" a masked step")
        for key, what in (("section_ms_per_step", "host ms a step by section"),
                          ("device_ms_per_step", "device ms a step")):
            if e.get(key):
                text += f"; {what}: " + ", ".join(f"{k} {v:.2f}" for k, v in e[key].items())
    return text


def measure_system(system: str, server: server_procs.ServerProc, warm: PairLoad, loads: list[PairLoad], form: str,
                   raw: Path, clock: server_procs.Clock, args) -> list[PairRun]:
    """The warm-up load, then W-B's loads alternated repetition by repetition, then the TTFT loads. A run
    that fails or no longer fits the deadline is recorded with its reason; after a run that timed out the
    server's remaining runs are skipped (a hung server would time out every one)."""
    wb = [ld for ld in loads if ld.kind == "wb"]
    order = [(ld, r) for r in range(max(ld.repeats for ld in wb)) for ld in wb if r < ld.repeats]
    order += [(ld, 0) for ld in loads if ld.kind == "ttft"]
    runs, hung = [], False
    for i, (load, rep) in enumerate([(warm, 0)] + order):
        run = PairRun(system, load.name, rep, seed=1000 * (i + 1) + rep)
        timeout = min(args.run_timeout_s, clock.left() - 5)
        if hung:
            run.error = "skipped: an earlier run timed out"
        elif timeout < 15:
            run.error = "skipped: the deadline is near"
        else:
            tag = f"{system}-{load.name}-{rep}".replace(" ", "_").replace("%", "pct")
            try:
                with _profiled(system, server, raw / "py-spy" / f"{tag}.txt", args.py_spy and load is not warm):
                    run.metrics = timed_load(server, load, run.seed, form, raw / f"{tag}.json", timeout)
            except Exception as e:  # noqa: BLE001 -- recorded: one bad run must not cost the other system's phase
                run.error = f"{type(e).__name__}: {e}"[:2000]
                hung = isinstance(e, subprocess.TimeoutExpired) or "timed out" in str(e)
        clock.log(f"  {system} | {load.name} #{rep + 1}: " + (run.error or _brief(run.metrics)))
        if load is not warm:
            runs.append(run)
    return runs


def _profiled(system: str, server: server_procs.ServerProc, path: Path, wanted: bool):
    """kvserve's engine core sampled by py-spy over the block (--py-spy), else nothing."""
    if not wanted or system != "kvserve":
        return contextlib.nullcontext()
    path.parent.mkdir(parents=True, exist_ok=True)
    return py_spy.Recorder(py_spy.engine_core_pid(server.pid), path)


def print_profiles(raw: Path, loads: list[PairLoad]) -> None:
    """Each W-B load's engine-thread profile, merged over its repetitions (--py-spy)."""
    for load in loads:
        tag = f"kvserve-{load.name}-".replace(" ", "_").replace("%", "pct")
        prof = py_spy.summarize(sorted((raw / "py-spy").glob(f"{tag}*.txt")))
        if prof is not None:
            print("\n".join([f"\n### py-spy, kvserve's engine thread, {load.name}", ""] + py_spy.table(prof)),
                  flush=True)


# ----------------------------------------------------------------------------------------------- phases


def server_phase(name: str, start, warm, loads, form: str, raw: Path, clock: server_procs.Clock, args) -> tuple[list, str]:
    """Start a server (under the start timeout), measure every load, stop it whatever happens."""
    if clock.left() < args.min_phase_s:
        clock.log(f"{name}: skipped, {clock.left():.0f} s left")
        return [], "skipped: the deadline is near"
    clock.log(f"{name}: starting")
    t0 = time.monotonic()
    try:
        proc = start(min(args.start_timeout_s, clock.left() - 30))
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        clock.log(f"{name}: did not start: {e}")
        return [], f"did not start: {e}"[:3000]
    clock.log(f"{name}: up at {proc.base_url} (pid {proc.pid}) after {time.monotonic() - t0:.0f} s")
    runs = []
    try:
        runs = measure_system(name, proc, warm, loads, form, raw, clock, args)
        return runs, "measured"
    finally:
        clock.log(f"{name}: stopping")
        server_procs.stop(proc)
        if proc.log.exists() and proc.log.parent != raw:
            shutil.copy(proc.log, raw / f"{name}-serve.log")
        clock.log(f"{name}: stopped")
        if any(r.error for r in runs) and proc.log.exists():
            print(server_procs.last_traceback(proc.log.read_text(errors="replace")), flush=True)



def _init_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def run_phases(args, warm, loads, model_dir: Path, raw: Path, clock: server_procs.Clock, record: dict, save) -> tuple[list, list]:
    limits = SMOKE_LIMITS if args.smoke else SERVER_LIMITS
    phases = []
    if args.kvserve:
        phases.append(("kvserve", "structured_outputs", lambda t: server_procs.start_kvserve(
            model_dir, limits + args.kvserve_args.split(), raw / "kvserve-serve.log", t)))
    if args.vllm:
        phases.append(("vLLM", "structured_outputs", lambda t: server_procs.start_vllm_script(
            Path(args.vllm_serve_script), model_dir, limits + args.vllm_args.split(), t)))
    runs = []
    for name, form, start in phases:
        got, note = server_phase(name, start, warm, loads, form, raw, clock, args)
        runs += got
        record["phases"][name] = note
        save(runs)
    return runs, [name for name, _, _ in phases]


# ------------------------------------------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="CPU check: tiny model, few requests, kvserve only")
    p.add_argument("--out", default="online_pair.json", help="the results as JSON")
    p.add_argument("--raw-dir", default=None, help="per-run results and logs (default: OUT's stem + _raw)")
    p.add_argument("--deadline-s", type=float, default=500.0,
                   help="the whole run; phases that no longer fit are skipped")
    p.add_argument("--repeat", type=int, default=2, help="repetitions of each W-B load (alternated)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="W-B's sampling temperature (its definition: 0, greedy; earlier sessions sent none: 1)")
    p.add_argument("--client-workers", type=int, default=4, help="bench serve processes for W-B's loads")
    p.add_argument("--kvserve", action=argparse.BooleanOptionalAction, default=True, help="measure kvserve's server")
    p.add_argument("--vllm", action=argparse.BooleanOptionalAction, default=None, help="default: on, off with --smoke")
    p.add_argument("--vllm-serve-script", default=".carry/peers/vllm_serve.sh")
    p.add_argument("--vllm-args", default="", help="more vLLM server flags, one string")
    p.add_argument("--kvserve-args", default="", help="more `kvserve serve` flags, one string")
    p.add_argument("--py-spy", action="store_true",
                   help="sample kvserve's engine core with py-spy over each load (raw stacks under RAW_DIR/py-spy)")
    p.add_argument("--start-timeout-s", type=float, default=240.0)
    p.add_argument("--run-timeout-s", type=float, default=90.0, help="one bench serve run")
    p.add_argument("--min-phase-s", type=float, default=90.0, help="a server phase starts only with this much left")
    args = p.parse_args(argv)
    args.vllm = (not args.smoke) if args.vllm is None else args.vllm
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    clock = server_procs.Clock(args.deadline_s)
    out = Path(args.out)
    raw = Path(args.raw_dir or out.with_name(out.stem + "_raw"))
    raw.mkdir(parents=True, exist_ok=True)
    clock.log(f"online pair: $ {' '.join([sys.executable, *sys.argv])}  (deadline {args.deadline_s:.0f} s)")
    warm, loads = smoke_loads() if args.smoke else gpu_loads(args.repeat, args.client_workers, args.temperature)
    record = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": sys.argv, "smoke": args.smoke,
              "warm_up": asdict(warm), "loads": [asdict(ld) for ld in loads], "phases": {},
              "server_limits": SMOKE_LIMITS if args.smoke else SERVER_LIMITS}

    def save(runs: list[PairRun], extra: dict | None = None) -> None:
        record.update({"runs": [asdict(r) for r in runs], **(extra or {}), "elapsed_s": time.monotonic() - clock.start})
        out.write_text(json.dumps(record, indent=1))  # after every phase: a run cut short keeps what it had

    tmp = Path(tempfile.mkdtemp(prefix="kvserve-pair-model-"))
    try:
        config = SMOKE_CONFIG if args.smoke else parse_model_config("qwen2.5-0.5b-40k")
        clock.log(f"building a random-weight {config['architectures'][0]} with a byte-level BPE in {tmp}")
        model_dir = build_random_model(config, tmp, tokenizer="bpe", init_device=_init_device())
        clock.log("model built")
        runs, systems = run_phases(args, warm, loads, model_dir, raw, clock, record, save)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.py_spy:
        print_profiles(raw, loads)
    figures: dict = {}
    text = "\n".join(wb_table(runs, systems, loads, figures) + [""] + ttft_table(runs, systems, loads, figures))
    checks = [] if args.smoke else targets(figures, systems, loads)
    print("\n" + text + ("\n\n" + "\n".join(checks) if checks else ""), flush=True)
    save(runs, {"figures": figures, "targets": checks, "table": text.splitlines()})
    clock.log(f"wrote {out} (raw results and logs in {raw})")
    return 0 if runs and not any(r.error for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
