"""What a JSON schema costs the offline engine per step: W-B (256 prompts, 128 output tokens) with 0% and 100%
of its requests under bench/structured_mix.py's record schema, and where the host's time goes.

    python benchmarks/structured_step.py --out structured_step.json                       # the GPU, Qwen2.5-0.5B shape
    python benchmarks/structured_step.py --device cpu --model-config '{...}' --batch 16   # a smoke run

Issue 15's bar is on the server (json 100% at >= 0.9x json 0%); this isolates the engine's share of it. A
constrained step samples only after the previous step's tokens are read, the matchers have consumed them and
the masks are filled, so whatever of that the engine thread does serially lengthens every step. Each run
times every host section (wall time per call, summed, divided by the run's steps; `fill` runs in the mask
thread, so it may overlap the others) and the step period (the run's wall time over its steps). Fractions
alternate, --runs times each after one warm-up each. Prints a table, writes JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from bench.models import build_random_model, parse_model_config  # noqa: E402
from bench.structured_mix import SCHEMA  # noqa: E402
from bench.workloads import workload_wb  # noqa: E402
from benchmarks.profile_step import PartTimer  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.request import SamplingParams, StructuredOutput  # noqa: E402
from engine.structured import StructuredOutputs  # noqa: E402

# (object path from the engine, attribute, section name): what each run times; one the engine lacks is skipped.
SECTIONS = [("scheduler", "schedule", "schedule"), ("runner", "prepare", "prepare"), ("runner", "enqueue", "enqueue"),
            ("runner", "collect", "collect"), ("", "_postprocess", "postprocess"),
            ("runner", "sample", "sample (waits for masks)"), ("runner.structured", "apply", "apply masks"),
            ("", "_advance_grammars", "consume"),
            ("runner.structured", "_fill_rows", "fill (mask thread)"),
            ("runner.structured", "start_fill", "send step (grammar process)")]


def build(args) -> LLM:
    """The engine on a random-weight model (its files removed once loaded: ~1 GB at Qwen2.5-0.5B's shape)."""
    with tempfile.TemporaryDirectory(prefix="kvserve-structured-step-") as tmp:
        model_dir = build_random_model(parse_model_config(args.model_config), Path(tmp), tokenizer="bpe")
        return LLM(str(model_dir), device=args.device, max_model_len=2048, max_num_batched_tokens=16384,
                   max_num_seqs=args.batch, enable_prefix_caching=False,
                   structured_outputs_process={"auto": None, "on": True, "off": False}[args.grammar_process])


def requests(llm: LLM, batch: int, fraction: float) -> tuple[list[list[int]], list[SamplingParams]]:
    vocab = llm.engine.vocab_size
    prompts = [[t % vocab for t in p] for p in workload_wb().prompts[:batch]]
    constrained = round(fraction * batch)
    schema = StructuredOutput(json=json.dumps(SCHEMA))
    params = [SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True,
                             structured=schema if i < constrained else None) for i in range(batch)]
    return prompts, params


def wrap_sections(engine, timer: PartTimer) -> None:
    """Time each of SECTIONS the engine has (benchmarks/server_step_profile.py does the same in a server's core)."""
    for path, attr, name in SECTIONS:
        obj = engine
        for part in filter(None, path.split(".")):
            obj = getattr(obj, part, None)
        if obj is not None and hasattr(obj, attr):
            timer.wrap(obj, attr, name)


def timed_run(llm: LLM, prompts, params) -> dict:
    engine, timer = llm.engine, PartTimer()
    wrap_sections(engine, timer)
    timer.wrap(engine, "step", "step (all of it)")
    start = time.perf_counter()
    try:
        outs = llm.generate(prompts, params)
    finally:
        steps = timer.calls.get("step (all of it)", 0)
        timer.restore()
    seconds = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    finished = Counter(str(c.finish_reason) for o in outs for c in o.outputs)  # "error": a failed request
    if not steps or not tokens:  # say what happened, and go on with the next run
        print(f"no steps or no tokens: {steps} steps, {tokens} tokens in {seconds:.3f} s; finish reasons "
              f"{dict(finished)}; engine steps {engine._steps}", flush=True)
        steps = max(steps, 1)
    return {"ms_per_step": seconds * 1e3 / steps, "out_tok_s": tokens / seconds, "steps": steps,
            "finish_reasons": dict(finished),
            "sections_ms_per_step": {k: v * 1e3 / steps for k, v in timer.totals.items()}}


def variant(llm: LLM, name: str):
    """Set the constrained step's switches for one run; returns the undo. `name` is
    "<loop>-<interval>[-t<N>][-inproc]": loop `serial` (a constrained step samples in the call that launched it),
    `pipelined` (the step after it is scheduled and staged first: engine._step_behind_masks) or `device` (queued
    whole, the device waits for its masks: engine/mask_gate.py; as built where it can); interval `5ms`
    (CPython's default) or `0.2ms` (the mask thread gets the GIL back sooner: on the 2-core development machine
    a 3 ms xgrammar fill in a thread beside 3 ms of Python took 6.3 ms at 5 ms and 3.4 ms at 0.2 ms); tN:
    xgrammar's batch fill on N threads (its default: half the host's hardware threads; in-process only);
    `inproc`: the matchers in the engine's process (engine/structured.py) where the engine was built with a
    grammar process (engine/grammar_link.py, the default on CUDA). `as-built`: the defaults."""
    engine, before = llm.engine, sys.getswitchinterval()
    pipelined, built, gate = engine.pipeline_masks, engine.structured, engine.runner.mask_gate
    if name != "as-built":
        loop, ms, threads, inproc = parse_variant(name)
        if inproc:
            use_structured(engine, in_process(llm))
        engine.pipeline_masks = loop == "pipelined"
        if loop != "device" or inproc:  # the gate needs the grammar process's flags
            engine.runner.mask_gate = None
        elif gate is None:
            raise ValueError("device: this engine's device does not wait for masks (no CUDA or no grammar process)")
        sys.setswitchinterval(0.005 if ms == "5ms" else 0.0002)
        structured = engine.structured
        interval = getattr(structured, "switch_interval_s", None)
        if hasattr(structured, "switch_interval_s"):
            structured.switch_interval_s = None if ms == "5ms" else 0.0002
        batch = set_fill_threads(structured, threads) if threads else None

    def undo() -> None:
        engine.pipeline_masks, engine.runner.mask_gate = pipelined, gate
        sys.setswitchinterval(before)
        if name != "as-built":
            if hasattr(structured, "switch_interval_s"):
                structured.switch_interval_s = interval
            if batch is not None:
                structured._xgr.batch = batch
        use_structured(engine, built)
    return undo


def parse_variant(name: str) -> tuple[str, str, int | None, bool]:
    parts = name.split("-")
    inproc = parts[-1] == "inproc"
    parts = parts[:-1] if inproc else parts
    threads = int(parts.pop()[1:]) if len(parts) == 3 and parts[2][:1] == "t" and parts[2][1:].isdigit() else None
    if len(parts) != 2 or parts[0] not in ("serial", "pipelined", "device") or parts[1] not in ("5ms", "0.2ms"):
        raise ValueError(f"unknown variant {name!r}: as-built, or serial|pipelined|device-5ms|0.2ms[-tN][-inproc]")
    return parts[0], parts[1], threads, inproc


def set_fill_threads(structured, threads: int):
    """xgrammar's batch fill on `threads` threads; returns the batch matcher it replaced."""
    batch = getattr(getattr(structured, "_xgr", None), "batch", None)
    if batch is None:
        raise ValueError("-tN: no in-process xgrammar fills masks here (a grammar process, or no xgrammar: it "
                         "needs pydantic)")
    import xgrammar

    structured._xgr.batch = xgrammar.BatchGrammarMatcher(threads)
    return batch


def in_process(llm: LLM):
    """An in-process StructuredOutputs for this engine, made (and its grammar compiled) once."""
    engine = llm.engine
    if isinstance(engine.structured, StructuredOutputs):
        return engine.structured
    if getattr(llm, "_in_process", None) is None:
        llm._in_process = StructuredOutputs(*engine.structured.args)  # what the link falls back to
        llm._in_process.compile(StructuredOutput(json=json.dumps(SCHEMA))).result()
    return llm._in_process


def use_structured(engine, structured) -> None:
    engine.structured = engine.runner.structured = engine._grammars.structured = structured


def run_variants(args, llm: LLM, loads: dict) -> dict:
    """json 0% first and last, json 100% under each --variants entry between (default: as built); each row
    is printed as it comes."""
    rows = {}

    def record(name: str, fraction: float, what: str = "as-built") -> None:
        undo = variant(llm, what)
        try:
            r = rows[name] = timed_run(llm, *loads[fraction])
        finally:
            undo()
        print(f"{name:28s} {r['out_tok_s']:>10,.0f} tok/s {r['ms_per_step']:7.3f} ms/step  {r['finish_reasons']}  " + "  ".join(
            f"{k} {v:.2f}" for k, v in sorted(r["sections_ms_per_step"].items())), flush=True)

    record("json 0%", 0.0)
    for i, name in enumerate(args.variants):
        again = args.variants[:i].count(name)
        record(f"json 100% {name}" + (f" #{again + 1}" if again else ""), 1.0, name)
    record("json 0% again", 0.0)
    return {"variants": rows}


def alternated_runs(args, llm: LLM, loads: dict) -> dict[float, list[dict]]:
    runs: dict[float, list[dict]] = {f: [] for f in args.fractions}
    for _ in range(args.runs):
        for f in args.fractions:
            runs[f].append(timed_run(llm, *loads[f]))
    return runs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-config", default="qwen2.5-0.5b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--fractions", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--variants", nargs="*", default=[],
                   help="json 100%% once per entry: as-built, or serial|pipelined|device-5ms|0.2ms[-tN][-inproc]")
    p.add_argument("--grammar-process", choices=("auto", "on", "off"), default="auto",
                   help="the engine's matchers in a grammar process (auto: with CUDA); -inproc variants swap")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    llm = build(args)
    print(f"masks: {'xgrammar (JSON schemas)' if llm.engine.structured.use_xgrammar else 'llguidance'}, "
          f"{type(llm.engine.structured).__name__}"
          + (f", masks page-locked: {llm.engine.structured.masks.is_pinned()}"
             if hasattr(llm.engine.structured, "masks") else ""), flush=True)
    loads = {f: requests(llm, args.batch, f) for f in args.fractions}
    for f in args.fractions:  # warm-up: graphs, the grammar compile, every path
        llm.generate(*loads[f])
    result = run_variants(args, llm, loads) if args.variants else summarize(args, alternated_runs(args, llm, loads))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0


def summarize(args, runs: dict[float, list[dict]]) -> dict:
    """The table: per fraction, the median run's figures (by out tok/s) and each section's median."""
    base = statistics.median(r["out_tok_s"] for r in runs[args.fractions[0]])
    rows = {}
    for f, rs in runs.items():
        tok_s = statistics.median(r["out_tok_s"] for r in rs)
        names = sorted({n for r in rs for n in r["sections_ms_per_step"]})
        rows[f] = {"out_tok_s": tok_s, "vs_first": tok_s / base,
                   "ms_per_step": statistics.median(r["ms_per_step"] for r in rs),
                   "sections_ms_per_step": {n: statistics.median(r["sections_ms_per_step"].get(n, 0.0) for r in rs)
                                            for n in names}, "runs": rs}
    names = sorted({n for row in rows.values() for n in row["sections_ms_per_step"]})
    print(f"{'json fraction':26s}" + "".join(f"{f:>12.0%}" for f in rows))
    print(f"{'out tok/s':26s}" + "".join(f"{row['out_tok_s']:>12,.0f}" for row in rows.values()))
    print(f"{'vs first':26s}" + "".join(f"{row['vs_first']:>12.2f}" for row in rows.values()))
    print(f"{'ms per step':26s}" + "".join(f"{row['ms_per_step']:>12.3f}" for row in rows.values()))
    for f, rs in runs.items():  # a failed request ("error") would make the figures meaningless: say so
        print(f"  finish reasons at {f:.0%}: {[r['finish_reasons'] for r in rs]}")
    for n in names:
        print(f"  {n:24s}" + "".join(f"{row['sections_ms_per_step'].get(n, 0.0):>12.3f}" for row in rows.values()))
    return {"batch": args.batch, "device": args.device, "model_config": args.model_config,
            "fractions": {str(f): row for f, row in rows.items()}}


if __name__ == "__main__":
    sys.exit(main())
