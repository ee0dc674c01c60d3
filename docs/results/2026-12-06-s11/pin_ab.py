"""Eleventh session, call B: does W-B json 100% lose to CPU contention on the engine thread's core?

Every host section of the engine's step ran 1.3-1.5x longer at json 100% than at json 0% (call A: schedule,
prepare, update, outputs, the core loop alike), while the grammar processes' fill threads were busy. One
kvserve server (the pair's limits and model), then W-B json 0% and 100% alternated, each repetition once with
the server's processes as started ("free") and once "pinned": every thread of every server process on the CPUs
but one physical core, the engine core's main thread alone on that core (its hardware threads). Affinity
changes on the live processes, so both modes are timed on one server. Prints a table, writes JSON.
    PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages python3 docs/results/2026-12-06-s11/pin_ab.py
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from bench import server_procs  # noqa: E402
from bench.models import build_random_model, parse_model_config  # noqa: E402
from bench.proc_cpu import role_of  # noqa: E402
from benchmarks.online_pair import (SERVER_LIMITS, SMOKE_CONFIG, SMOKE_LIMITS, gpu_loads, smoke_loads,  # noqa: E402
                                    timed_load)

OUT = Path(os.environ.get("OUT", "gpu-out"))
REPEAT = int(os.environ.get("REPEAT", "4"))
SMOKE = os.environ.get("SMOKE") == "1"  # a CPU check of the script: the pair's tiny model and loads


def siblings(cpu: int) -> set[int]:
    text = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip()
    out = set()
    for part in text.split(","):
        a, _, b = part.partition("-")
        out.update(range(int(a), int(b or a) + 1))
    return out


def threads(root: int) -> list[tuple[int, str]]:
    """(thread id, role) of every thread of the server's processes."""
    out = []
    for pid in [root, *server_procs.descendants(root)]:
        try:
            role = role_of(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
            out += [(int(t), role) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            pass
    return out


def set_mode(root: int, engine_pid: int, mode: str, everything: set[int], core: set[int]) -> None:
    for tid, _ in threads(root):
        try:
            os.sched_setaffinity(tid, everything if mode == "free" else everything - core)
        except OSError:
            pass
    if mode == "pinned":
        os.sched_setaffinity(engine_pid, core)  # the engine core's main thread: the engine's own


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    everything = os.sched_getaffinity(0)
    core = siblings(max(everything))
    print(f"{len(everything)} CPUs; hardware threads of CPU 0: {sorted(siblings(0))}; the engine's core: {sorted(core)}")
    warm, loads = smoke_loads() if SMOKE else gpu_loads(1, 4)
    wb = {load.name: load for load in loads if load.kind == "wb" and load.structured_fraction in (0.0, 1.0)}
    config = SMOKE_CONFIG if SMOKE else parse_model_config("qwen2.5-0.5b-40k")
    model_dir = build_random_model(config, Path(tempfile.mkdtemp()), tokenizer="bpe")
    server = server_procs.start_kvserve(model_dir, SMOKE_LIMITS if SMOKE else SERVER_LIMITS, OUT / "serve.log", 600)
    raw, runs = Path(tempfile.mkdtemp()), []
    try:
        engine_pid = next(p for p, role in threads(server.pid) if role == "engine core" and
                          p in server_procs.descendants(server.pid))  # the process: its main thread's id
        timed_load(server, warm, 1, "structured_outputs", raw / "warm.json", 120)
        for rep in range(REPEAT):
            for mode in (("free", "pinned") if rep % 2 == 0 else ("pinned", "free")):
                set_mode(server.pid, engine_pid, mode, everything, core)
                for name, load in wb.items():
                    m = timed_load(server, load, 100 + rep, "structured_outputs", raw / f"{mode}-{rep}-{name}.json", 120)
                    runs.append({"mode": mode, "load": name, "rep": rep, "metrics": m})
                    e = m.get("engine", {})
                    print(f"{rep} {mode:6} {name:14} {m['output_throughput']:8,.0f} tok/s TPOT {m['median_tpot_ms']:.2f}"
                          f" busy {e.get('busy_ms_per_step', 0):.2f} ms/step, cores {m.get('cpu_cores')}", flush=True)
    finally:
        server_procs.stop(server)
    print("| mode | json 0%, median tok/s | json 100% | json 100% / 0% |\n|---|---:|---:|---:|")
    for mode in ("free", "pinned"):
        med = {n: statistics.median(r["metrics"]["output_throughput"] for r in runs if r["mode"] == mode and
                                    r["load"] == n) for n in wb}
        a, b = med["W-B json 0%"], med["W-B json 100%"]
        print(f"| {mode} | {a:,.0f} | {b:,.0f} | {b / a:.2f}x |")
    (OUT / "pin_ab.json").write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
