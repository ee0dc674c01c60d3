"""The startup freeze (engine/malloc.py freeze_startup_objects): garbage is collected before the freeze, what
lives is out of the collector's walk, and the throughput benchmark can still free a contender it froze; a
served front end freezes its own heap once the model is loaded (server/frontend.py settle_heap).
Each check runs in its own interpreter: freezing this test process would outlive the test."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import httpx

from server_utils import start_server_process, stop_process

ROOT = Path(__file__).resolve().parents[1]

PRELUDE = """
import gc, weakref
class Node:
    pass
def cycle():
    a, b = Node(), Node()
    a.other, b.other = b, a
    return a
"""


def run_python(body: str) -> str:
    done = subprocess.run([sys.executable, "-c", PRELUDE + body], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_garbage_is_collected_first_and_live_objects_leave_the_walk():
    out = run_python("""
from engine.malloc import freeze_startup_objects
garbage = weakref.ref(cycle())          # unreachable already: must be freed, not frozen for good
live = cycle()
n = freeze_startup_objects()
print(garbage() is None, n > 0, gc.get_freeze_count() == n)
print(any(o is live for o in gc.get_objects()))  # frozen objects are not in any generation
late = cycle()
print(any(o is late for o in gc.get_objects()))  # objects made afterwards are walked as usual
""")
    assert out.split() == ["True", "True", "True", "False", "True"]


def test_the_benchmark_frees_a_frozen_contender():
    # A contender's engine can sit in reference cycles; frozen, its GPU memory would never come back
    # for the next backend in the same run.
    out = run_python("""
from engine.malloc import collect_young_less_often, freeze_startup_objects
from bench.models import free_device_memory
contender = cycle()
ref = weakref.ref(contender)
freeze_startup_objects()
collect_young_less_often()
print(gc.get_threshold()[0] > 700)       # the step loop's young collections, thinned
del contender
gc.collect()
print(ref() is not None)                 # frozen: a plain collection leaves it
free_device_memory()
print(ref() is None, gc.get_freeze_count() == 0, gc.get_threshold() == (700, 10, 10))
""")
    assert out.split() == ["True", "True", "True", "True", "True"]


def test_a_served_front_end_freezes_its_heap_before_it_takes_requests(tiny_model_dir):
    # Unfrozen, a front end's full collections walked ~350k startup objects (~200 ms, event loop stopped).
    proc, url = start_server_process(["--model", str(tiny_model_dir("llama")), "--device", "cpu",
                                      "--num-kv-blocks", "64", "--log-level", "info"])
    try:
        front_end = proc.pid  # one front end: the launcher serves HTTP itself
        assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 200
    finally:
        _, out = stop_process(proc)
    frozen = {int(pid): int(n) for pid, n in re.findall(r"front end (\d+): (\d+) startup objects frozen", out)}
    assert list(frozen) == [front_end], out[-2000:]
    assert frozen[front_end] > 50_000  # transformers, the tokenizer, FastAPI: what the walk no longer visits
    ready = out.index("accepting requests")
    assert out.index("startup objects frozen") < ready  # settled before the first request can arrive
