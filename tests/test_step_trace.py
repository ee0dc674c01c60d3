"""benchmarks/step_trace_report.py over a trace written by engine.step_trace: loads cut apart by idle gaps, and
a batch split in two (alternating halves) counted as thin steps."""
from __future__ import annotations

import json
import time
from types import SimpleNamespace

from engine.step_trace import StepTrace
from server_utils import benchmark_module


def _step(rows: int, prefills: int = 0):
    scheduled = [SimpleNamespace(num_new_tokens=64 if i < prefills else 1, samples=True) for i in range(rows)]
    return SimpleNamespace(scheduled=scheduled, num_batched_tokens=prefills * 64 + rows - prefills)


def test_loads_split_at_gaps_and_a_split_batch_shows_thin_steps(tmp_path, monkeypatch):
    report = benchmark_module("step_trace_report")
    clock = iter([0.0, 0.004, 0.008, 0.012, 1.0, 1.002, 1.004, 1.006, 1.008])
    monkeypatch.setattr(time, "monotonic", lambda: next(clock))
    trace = StepTrace(str(tmp_path / "t.csv"))
    for rows, prefills in [(8, 8), (8, 0), (8, 0), (8, 0)]:  # one batch of 8, in lockstep
        trace.record(_step(rows, prefills), 8, 0)
    for rows in (8, 4, 4, 4, 4):  # then the same 8 as two halves that alternate
        trace.record(_step(rows, 8 if rows == 8 else 0), 8, 0)
    out = tmp_path / "r.json"
    assert report.main([str(tmp_path / "t.csv"), "--json", str(out), "--plot", str(tmp_path / "r.png")]) == 0
    first, second = json.loads(out.read_text())
    assert (first["steps"], first["thin_steps"], first["prefill_steps"], first["tokens_per_step"]) == (4, 0, 1, 8)
    assert (second["steps"], second["thin_steps"], second["tokens_per_step"]) == (5, 4, 4.8)
    assert first["decode_ms_per_step"] == 4.0 and second["decode_ms_per_step"] == 2.0
    assert (tmp_path / "r.png").stat().st_size > 1000
    assert report.main([str(tmp_path / "t.csv"), "--min-rows", "9", "--json", str(out)]) == 0
    assert json.loads(out.read_text()) == []  # neither load ever ran 9 rows
