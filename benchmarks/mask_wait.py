"""Does a constrained step wait for its grammar masks? Per decode step at batch N: wall ms of an unconstrained
step, of a step whose every row is under a JSON grammar, and inside the latter the mask fill (the grammar
engine's batch fill: xgrammar's for this schema, engine/grammar_xgr.py) and the mask's application to the logits.

    python benchmarks/mask_wait.py --batch 1 8 32 --max-tokens 24 --runs 3 --out mask_wait.json

The engine samples a step with constrained rows only after the previous step's tokens are read and consumed
by the matchers; the fill then runs while the device computes the forward that enqueue() queued. On the CPU
enqueue() computes the forward before it returns (there is no device queue), so here nothing overlaps the fill:
the constrained step's extra time is the fill plus the masking, and this measures how large that is next to
the forward. The model is the embedded SmolLM2-135M-Instruct (real weights, 49152-token vocabulary) unless
--model names another; every request generates --max-tokens tokens (the grammar, a long integer array, cannot
end sooner). Free and constrained runs alternate; reported per step: the median and the minimum of wall
time, process CPU time (all threads), the fill and the masking. Prints a table, writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402

from engine.llm import LLM  # noqa: E402
from engine.request import SamplingParams, StructuredOutput  # noqa: E402

SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 200}
PROMPT = "Write the numbers from one to two hundred as a JSON array:"


class Timers:
    """Wall milliseconds of each call of the wrapped methods, per engine step."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.current: dict[str, float] = {}

    def wrap(self, obj, name: str, label: str) -> None:
        fn = getattr(obj, name)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[label] = self.current.get(label, 0.0) + (time.perf_counter() - t) * 1e3
        setattr(obj, name, timed)

    def step_done(self) -> None:
        self.steps.append(self.current)
        self.current = {}


def instrument(llm: LLM) -> Timers:
    timers = Timers()
    engine = llm.engine
    timers.wrap(engine.structured, "fill", "fill")
    timers.wrap(engine.structured, "apply", "apply")
    timers.wrap(engine.runner, "prepare", "launch")  # a step's two halves
    timers.wrap(engine.runner, "enqueue", "launch")
    step = engine.step

    def timed_step():
        t, cpu = time.perf_counter(), time.process_time()
        out = step()
        timers.current["step"] = (time.perf_counter() - t) * 1e3
        timers.current["cpu"] = (time.process_time() - cpu) * 1e3
        timers.step_done()
        return out
    engine.step = timed_step
    return timers


def run(llm: LLM, timers: Timers, batch: int, max_tokens: int, constrained: bool) -> list[dict[str, float]]:
    """The timings of each decode step (the first two, the prefill and its neighbour, left out)."""
    so = StructuredOutput(json=json.dumps(SCHEMA)) if constrained else None
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=not constrained, structured=so)
    timers.steps = []
    outs = llm.generate([PROMPT] * batch, params)
    assert all(len(c.token_ids) == max_tokens for o in outs for c in o.outputs)
    return [s for s in timers.steps if "launch" in s][2:]


def summary(steps: list[dict[str, float]]) -> dict[str, float]:
    """Median and minimum of each timer over the steps (a shared machine's noise only ever adds)."""
    out = {}
    for key in ("step", "cpu", "launch", "fill", "apply"):
        values = [s.get(key, 0.0) for s in steps]
        out[key], out[key + "_min"] = statistics.median(values), min(values)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (1 on a crowded machine: each OpenMP region otherwise waits ~16 ms for "
                         "its second thread when the cores are oversubscribed)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(args.model, device="cpu", max_num_seqs=max(args.batch), enable_prefix_caching=False)
    timers = instrument(llm)
    run(llm, timers, 1, 4, True)  # warm-up: the grammar tokenizer, the compile, the executor
    steps: dict[tuple[int, bool], list] = {}
    for batch in args.batch:
        for _ in range(args.runs):  # free and constrained runs alternate: the machine's load hits both alike
            for constrained in (False, True):
                steps.setdefault((batch, constrained), []).extend(
                    run(llm, timers, batch, args.max_tokens, constrained))
    rows = [{"batch": b, "constrained": c, "steps": len(v), **summary(v)} for (b, c), v in steps.items()]
    print("ms per decode step: median (min); extra = constrained - free, of the minimum steps and of CPU time")
    print(f"{'batch':>5} {'rows':>12} {'step':>16} {'cpu':>16} {'fill':>14} {'apply':>14} {'extra':>7} "
          f"{'extra cpu':>9}")
    for free, con in zip(rows[::2], rows[1::2]):
        con["extra_min"], con["extra_cpu"] = con["step_min"] - free["step_min"], con["cpu"] - free["cpu"]
        for r in (free, con):
            cells = " ".join(f"{r[k]:>8.2f} ({r[k + '_min']:.2f})" for k in ("step", "cpu", "fill", "apply"))
            extra = f"{r['extra_min']:>7.2f} {r['extra_cpu']:>9.2f}" if "extra_min" in r else ""
            print(f"{r['batch']:>5} {'constrained' if r['constrained'] else 'free':>12} {cells} {extra}")
    meta = {"torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(), "load_average": os.getloadavg()}
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), **meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
