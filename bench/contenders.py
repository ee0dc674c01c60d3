"""Timing systems on one workload: a Contender is a system loaded and warmed up, a Measurement its timed runs.
kvserve's engine (`LLM.generate`) is one contender; bench/hf.py makes transformers' ones.
"""
from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from bench.models import free_device_memory
from bench.workloads import Workload


@dataclass
class Measurement:
    name: str
    runs_s: list[float]  # wall time of each measured run
    num_requests: int
    input_tokens: int
    output_tokens: int  # produced by one run (requested tokens for static batches: see hf_generate)
    notes: list[str] = field(default_factory=list)

    @property
    def elapsed_s(self) -> float:
        return statistics.median(self.runs_s)

    def summary(self) -> dict:
        t = self.elapsed_s
        # vLLM's throughput keys first (elapsed_time, requests_per_second, tokens_per_second = all tokens).
        return {"name": self.name, "elapsed_time": t, "num_requests": self.num_requests,
                "total_num_tokens": self.input_tokens + self.output_tokens,
                "requests_per_second": self.num_requests / t,
                "tokens_per_second": (self.input_tokens + self.output_tokens) / t,
                "output_tokens_per_second": self.output_tokens / t, "output_tokens": self.output_tokens,
                "input_tokens": self.input_tokens, "runs_s": self.runs_s, "notes": self.notes}


@dataclass
class Contender:
    """A system loaded and warmed up: run_once() runs the whole workload and returns the output tokens it
    produced (transformers `generate`: the tokens asked for, see hf_generate)."""
    name: str
    run_once: Callable[[], int]
    close: Callable[[], None] = lambda: None


def time_contenders(contenders: list[Contender], w: Workload, repeat: int) -> list[Measurement]:
    """`repeat` rounds, each running every contender once in turn: with several contenders the runs are
    interleaved, so a slow spell of a noisy host hits each of them instead of one. A contender that fails
    is reported and left out of the rest."""
    runs: dict[str, list[float]] = {c.name: [] for c in contenders}
    produced: dict[str, int] = {}
    for _ in range(repeat):
        for c in list(contenders):
            start = time.perf_counter()
            try:
                produced[c.name] = c.run_once()
            except Exception as e:  # noqa: BLE001 - one failing comparison must not lose the others' figures
                print(f"bench throughput: {c.name} failed: {type(e).__name__}: {e}", file=sys.stderr)
                contenders = [x for x in contenders if x is not c]
                continue
            runs[c.name].append(time.perf_counter() - start)
    measurements = []
    for c in contenders:
        m = Measurement(c.name, runs[c.name], len(w.prompts), w.input_tokens, produced[c.name])
        if produced[c.name] != w.output_tokens:
            m.notes.append(f"produced {produced[c.name]} output tokens, {w.output_tokens} asked for")
        measurements.append(m)
    return measurements


def workload_params(w: Workload) -> list:
    """Each request's sampling: the workload's temperature, its exact output length (ignore_eos)."""
    from engine.request import SamplingParams

    return [SamplingParams(temperature=w.temperature, max_tokens=n, ignore_eos=True) for n in w.output_lens]


def warm_up(llm, w: Workload) -> None:
    """A short unmeasured run, the workload's first 16 prompts to 8 tokens each: compiles, CUDA graph
    captures and allocator growth happen here, not in the measurement."""
    from engine.request import SamplingParams

    n = min(16, len(w.prompts))
    llm.generate(w.prompts[:n], [SamplingParams(temperature=w.temperature, max_tokens=8, ignore_eos=True)] * n)


def kvserve_contender(model_path: Path, opts: dict, w: Workload, warmup: bool) -> Contender:
    from engine.llm import LLM
    from engine.malloc import collect_young_less_often, freeze_startup_objects

    llm = LLM(model=str(model_path), **opts)
    params = workload_params(w)
    if warmup:
        warm_up(llm, w)
    freeze_startup_objects()  # a full collection in a timed run would cost it ~0.1-0.3 s (engine/malloc.py)
    collect_young_less_often()  # as the server's engine core does
    name = f"kvserve ({llm.engine.backend_name}, {str(llm.engine.dtype).removeprefix('torch.')}, {llm.engine.device})"

    def close() -> None:
        nonlocal llm
        llm = None
        free_device_memory()

    return Contender(name, lambda: sum(len(o.outputs[0].token_ids) for o in llm.generate(w.prompts, params)), close)
