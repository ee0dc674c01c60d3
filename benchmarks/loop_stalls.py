"""Stalls of the server's streams on the CPU: a steady load of streaming requests (a share of them under a JSON
schema) for a while, every SSE event timed; a gap between two events of one stream far above the step time is
a stall of the front end's event loop (or of the core), not of the model.

    python benchmarks/loop_stalls.py --out /tmp/stalls.json           # 2 fresh servers x 20 s

What it was written for: a front end's full garbage collections walked its ~350k startup objects with the
event loop stopped (~170-250 ms on this machine), each time its long-lived objects had grown by a quarter
(here about once per 20-s run); every stream of the process stalled that long. Frozen
once the model is loaded (server/frontend.py settle_heap), a full collection walks only what requests made.

On the tiny random model of `online_pair.py --smoke`, --concurrency clients each sending one request after
another (--max-tokens tokens, ignore_eos, --constrained share under bench/structured_mix.py's schema).
Prints, per server, the gaps between events (p50, p99, max, how many over --stall-ms) and TTFT, and writes
every stream's gaps as JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import psutil
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from bench import server_procs  # noqa: E402
from bench.models import build_random_model  # noqa: E402
from bench.structured_mix import SCHEMA  # noqa: E402
from benchmarks.online_pair import SMOKE_CONFIG  # noqa: E402
from engine.malloc import freeze_startup_objects  # noqa: E402

LIMITS = ["--max-model-len", "256", "--max-num-batched-tokens", "256", "--max-num-seqs", "64"]


async def one_stream(session: aiohttp.ClientSession, url: str, ids: list[int], constrained: bool,
                     max_tokens: int) -> dict:
    """The stream's TTFT and the gaps between its events, in ms."""
    body = {"model": "model", "prompt": ids, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0, **({"structured_outputs": {"json": SCHEMA}} if constrained else {})}
    times = [time.perf_counter()]
    async with session.post(f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if line.startswith(b"data:"):
                times.append(time.perf_counter())
    ms = [1000 * (b - a) for a, b in zip(times, times[1:])]
    return {"constrained": constrained, "ttft_ms": ms[0], "gaps_ms": ms[1:-1]}  # the last: [DONE]


async def load(url: str, args, rng: random.Random, bar) -> list[dict]:
    """--concurrency clients, each sending one request after another until --seconds have passed."""
    end = time.monotonic() + args.seconds
    vocab = SMOKE_CONFIG["vocab_size"]
    results: list[dict] = []

    async def client_loop(session: aiohttp.ClientSession) -> None:
        while time.monotonic() < end:
            ids = [rng.randrange(2, vocab) for _ in range(16)]
            results.append(await one_stream(session, url, ids, rng.random() < args.constrained, args.max_tokens))
            bar.update(1)

    # aiohttp: with httpx as the client, 1 in 100 streams waited ~1 s for its first event in the client itself
    # (the server's own TTFT histogram had none above 50 ms)
    connector = aiohttp.TCPConnector(limit=args.concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
        await asyncio.gather(*[client_loop(session) for _ in range(args.concurrency)])
    return results


def one_server(model_dir: Path, args, seed: int, log: Path) -> tuple[list[dict], float]:
    """A fresh server's streams under the load, and its front end's CPU seconds meanwhile (one front end: the
    server's own process)."""
    proc = server_procs.start_kvserve(model_dir, LIMITS, log, 120)
    try:
        front_end = psutil.Process(proc.pid)
        before = sum(front_end.cpu_times()[:2])
        with tqdm(desc=f"server {seed}: streams", unit="stream") as bar:
            run = asyncio.run(load(proc.base_url, args, random.Random(seed), bar))
        return run, sum(front_end.cpu_times()[:2]) - before
    finally:
        server_procs.stop(proc)


def summary(streams: list[dict], args, front_end_cpu_s: float) -> dict:
    gaps = sorted(g for s in streams for g in s["gaps_ms"])
    ttft = sorted(s["ttft_ms"] for s in streams)
    tokens = len(streams) * args.max_tokens  # ignore_eos: every stream runs to max_tokens (an event may carry several)
    return {"streams": len(streams), "tokens_per_s": tokens / args.seconds,
            "front_end_cpu_ms_per_1k_tokens": 1e6 * front_end_cpu_s / max(tokens, 1),
            "gap_p50_ms": statistics.median(gaps),
            "gap_p99_ms": gaps[int(0.99 * (len(gaps) - 1))], "gap_max_ms": gaps[-1],
            "gaps_over_stall": sum(g > args.stall_ms for g in gaps), "ttft_p50_ms": statistics.median(ttft),
            "ttft_max_ms": ttft[-1]}


def table(summaries: list[dict], stall_ms: float) -> list[str]:
    out = [f"| server | streams | tok/s | front-end CPU ms / 1k tokens | gap p50 ms | gap p99 ms | gap max ms "
           f"| gaps over {stall_ms:.0f} ms | TTFT p50 ms | TTFT max ms |", "|---:" * 10 + "|"]
    for i, s in enumerate(summaries):
        out.append(f"| {i} | {s['streams']} | {s['tokens_per_s']:,.0f} | {s['front_end_cpu_ms_per_1k_tokens']:.1f} "
                   f"| {s['gap_p50_ms']:.1f} | {s['gap_p99_ms']:.1f} | {s['gap_max_ms']:.1f} "
                   f"| {s['gaps_over_stall']} | {s['ttft_p50_ms']:.1f} | {s['ttft_max_ms']:.1f} |")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--servers", type=int, default=2, help="fresh servers, one after another")
    ap.add_argument("--seconds", type=float, default=20.0, help="load per server")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--constrained", type=float, default=0.2, help="share of requests under the schema")
    ap.add_argument("--stall-ms", type=float, default=100.0, help="a gap above this counts as a stall")
    ap.add_argument("--out", default="loop_stalls.json")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="kvserve-stalls-"))
    try:
        model_dir = build_random_model(SMOKE_CONFIG, tmp / "model", tokenizer="bpe")
        freeze_startup_objects()  # this client's own full collections (torch, transformers) would stall its streams
        measured = [one_server(model_dir, args, s, tmp / f"serve-{s}.log") for s in range(args.servers)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    runs = [run for run, _ in measured]
    summaries = [summary(run, args, cpu) for run, cpu in measured]
    text = table(summaries, args.stall_ms)
    print("\n".join(text))
    Path(args.out).write_text(json.dumps({"args": vars(args), "summaries": summaries, "table": text,
                                          "streams": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
