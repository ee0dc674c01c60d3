"""Where the engine core's time goes per step under a server load: W-B through the real server (front end +
engine-core process, as `kvserve serve` runs them) at json 0% and 100%, with the engine's host sections timed
inside the core process.

    python benchmarks/server_step_profile.py --out server_step_profile.json              # the GPU, Qwen2.5-0.5B shape
    python benchmarks/server_step_profile.py --smoke --out /tmp/ssp.json                 # a CPU check, tiny model

Issue 15: through the server json 100% ran at 0.69x of json 0% on an H100 (TPOT 6.9 against 4.7 ms), while
offline (benchmarks/structured_step.py) the two steps took the same time. This times, per engine step, what
structured_step.py times offline (schedule, prepare, collect, postprocess, the mask wait, ...) plus what the
server adds: the core loop's work between two `engine.step()` calls (receiving requests, encoding and sending
the step's deltas to the front end). The core is started with an engine factory that wraps those methods
(benchmarks/profile_step.PartTimer) and writes their totals to a file twice a second; each load's share is
the difference of the totals before and after it. Prints a table, writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from bench import server_procs  # noqa: E402
from bench.server_thread import ServerThread  # noqa: E402
from bench.models import build_random_model, parse_model_config  # noqa: E402
from bench.pair_report import PairLoad  # noqa: E402
from benchmarks.online_pair import SMOKE_CONFIG, bench_serve  # noqa: E402
from benchmarks.profile_step import PartTimer  # noqa: E402
from benchmarks.structured_step import wrap_sections  # noqa: E402

STEP, BETWEEN = "step (all of it)", "between steps (core loop)"
IDLE_GAP_S = 0.05  # a longer pause between two steps is the engine idle, not the loop's work


@dataclass
class ProfiledEngine:
    """engine_factory for the core process: an LLMEngine with its sections timed, totals written to `out`."""
    out: str

    def __call__(self, config):
        from engine.engine import LLMEngine

        engine, timer = LLMEngine(config), PartTimer()
        wrap_sections(engine, timer)
        _time_steps(engine, timer)
        threading.Thread(target=_write_totals, args=(timer, engine, self.out), daemon=True, name="profile-dump").start()
        return engine


def _time_steps(engine, timer: PartTimer) -> None:
    """engine.step's own time, and the time from one step's return to the next call (the core loop's work)."""
    step, last_end = engine.step, [None]

    def timed():
        start = time.perf_counter()
        if last_end[0] is not None and start - last_end[0] < IDLE_GAP_S:
            timer.totals[BETWEEN] += start - last_end[0]
            timer.calls[BETWEEN] += 1
        try:
            return step()
        finally:
            last_end[0] = time.perf_counter()
            timer.totals[STEP] += last_end[0] - start
            timer.calls[STEP] += 1

    engine.step = timed


def _worker_totals(engine) -> dict:
    """The grammar process's own time (engine/grammar_link.py worker_s), if the engine has one."""
    times = getattr(engine.structured, "worker_s", None) or {}
    return {f"grammar process: {name}": seconds for name, seconds in times.items()}


def _write_totals(timer: PartTimer, engine, out: str) -> None:
    while True:
        time.sleep(0.5)
        try:
            snapshot = {"totals": {**dict(timer.totals), **_worker_totals(engine)}, "calls": dict(timer.calls)}
        except RuntimeError:  # a section added mid-copy: next time
            continue
        Path(out + ".tmp").write_text(json.dumps(snapshot))
        os.replace(out + ".tmp", out)


def read_totals(path: Path, after: float) -> dict:
    """The core's totals as written after `after` (time.time())."""
    deadline = time.time() + 10
    while time.time() < deadline:
        if path.exists() and path.stat().st_mtime > after:
            return json.loads(path.read_text())
        time.sleep(0.1)
    raise TimeoutError(f"the engine core wrote no totals to {path}")


def per_step(before: dict, after: dict) -> dict:
    steps = after["calls"].get(STEP, 0) - before["calls"].get(STEP, 0)
    ms = {k: (v - before["totals"].get(k, 0.0)) * 1e3 / max(steps, 1) for k, v in after["totals"].items()}
    return {"steps": steps, "sections_ms_per_step": ms}


def loads(args) -> list[PairLoad]:
    vocab = args.prompt_vocab
    return [PairLoad(f"W-B json {round(100 * f)}%", "wb", args.num_prompts, args.input_len, args.output_len, f,
                     None, args.client_workers, 1, vocab) for f in args.fractions]


def measure(server: ServerThread, totals: Path, args, raw: Path) -> list[dict]:
    """One warm-up of each load, then the loads alternated --repeat times, each timed in the core."""
    rows = []
    for rep in range(args.repeat + 1):
        for load in loads(args):
            before = read_totals(totals, time.time())
            metrics = bench_serve(server.base_url, load, rep, "structured_outputs", raw / f"{load.name}-{rep}.json",
                                  args.run_timeout_s)
            row = {"load": load.name, "repetition": rep, "warm_up": rep == 0, **metrics,
                   **per_step(before, read_totals(totals, time.time()))}
            rows.append(row)
            print(format_row(row), flush=True)
    return rows


def format_row(row: dict) -> str:
    ms = row["sections_ms_per_step"]
    parts = ", ".join(f"{k} {v:.2f}" for k, v in sorted(ms.items(), key=lambda kv: -kv[1]) if v >= 0.01)
    tag = " (warm-up)" if row["warm_up"] else ""
    return (f"{row['load']}{tag}: {row['output_throughput']:,.0f} out tok/s, TPOT p50 {row['median_tpot_ms']:.2f} ms, "
            f"{row['steps']} steps; ms per step: {parts}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--smoke", action="store_true", help="CPU check: tiny model, 16 short requests")
    p.add_argument("--model-config", default="qwen2.5-0.5b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prompt-vocab", type=int, default=150_000)
    p.add_argument("--fractions", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--client-workers", type=int, default=4)
    p.add_argument("--run-timeout-s", type=float, default=90.0)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--engine-args", default="{}", help="more EngineConfig fields, as JSON")
    args = p.parse_args()
    if args.smoke:
        args.model_config, args.device, args.num_prompts = json.dumps({**SMOKE_CONFIG, "vocab_size": 2048}), "cpu", 16
        args.input_len, args.output_len, args.prompt_vocab, args.client_workers, args.repeat = 16, 12, 2048, 1, 1
        args.max_num_batched_tokens = 512  # the CPU warm-up builds a oneDNN primitive per row count: 16384 took 15 s
    from engine.config import EngineConfig
    from server.settings import ServerSettings

    with tempfile.TemporaryDirectory(prefix="kvserve-server-step-") as tmp:
        model = build_random_model(parse_model_config(args.model_config), Path(tmp) / "model", tokenizer="bpe")
        config = EngineConfig(model=str(model), device=args.device, max_model_len=2048,
                              max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=256,
                              enable_prefix_caching=False, **json.loads(args.engine_args))
        totals, raw = Path(tmp) / "totals.json", Path(tmp) / "raw"
        raw.mkdir()
        settings = ServerSettings(port=server_procs.free_port(), log_level="warning")
        with ServerThread(config, settings, ProfiledEngine(str(totals)), ready_timeout_s=600) as server:
            rows = measure(server, totals, args, raw)
    args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": sys.argv,
                                    "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
