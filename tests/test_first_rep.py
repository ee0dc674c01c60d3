"""benchmarks/first_rep.py: per-step timing of the first repetition against the last (issue 19's open
question), on a stand-in engine and on made-up steps."""
from __future__ import annotations

from types import SimpleNamespace

from server_utils import benchmark_module

first_rep = benchmark_module("first_rep")


def _step(n: int) -> SimpleNamespace:
    return SimpleNamespace(num_new_tokens=n)


def test_recorder_times_each_step_with_the_schedule_before_it():
    outs = iter([SimpleNamespace(scheduled=[_step(100), _step(1)], num_batched_tokens=101),
                 SimpleNamespace(scheduled=[_step(1), _step(1)], num_batched_tokens=2)])
    engine = SimpleNamespace(scheduler=SimpleNamespace(schedule=lambda: next(outs)))
    engine.step = lambda: engine.scheduler.schedule()
    recorder = first_rep.StepRecorder(engine)
    engine.step(), engine.step()
    steps = recorder.take()
    assert [(s["prompt_tokens"], s["decodes"]) for s in steps] == [(100, 1), (0, 2)]
    assert all(s["s"] >= 0 for s in steps) and recorder.take() == []


def test_compare_sums_by_kind_and_lists_the_steps_that_lost_most():
    first = [{"s": 0.050, "prompt_tokens": 16384, "decodes": 0}, {"s": 0.004, "prompt_tokens": 0, "decodes": 256},
             {"s": 0.009, "prompt_tokens": 0, "decodes": 256}]
    last = [{"s": 0.040, "prompt_tokens": 16384, "decodes": 0}, {"s": 0.004, "prompt_tokens": 0, "decodes": 256},
            {"s": 0.004, "prompt_tokens": 0, "decodes": 256}]
    result = first_rep.compare(first, last, top=2)
    assert result["totals"]["with prompt tokens"] == {"first_s": 0.050, "last_s": 0.040, "steps": 1}
    assert result["totals"]["decode-only"]["steps"] == 2
    assert abs(result["totals"]["decode-only"]["first_s"] - 0.013) < 1e-12
    assert [w["step"] for w in result["worst"]] == [0, 2]
