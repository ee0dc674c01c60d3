"""The startup freeze (engine/malloc.py freeze_startup_objects): garbage is collected before the freeze, what
lives is out of the collector's walk, and the throughput benchmark can still free a contender it froze.
Each check runs in its own interpreter: freezing this test process would outlive the test."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
from engine.malloc import freeze_startup_objects
from bench.models import free_device_memory
contender = cycle()
ref = weakref.ref(contender)
freeze_startup_objects()
del contender
gc.collect()
print(ref() is not None)                 # frozen: a plain collection leaves it
free_device_memory()
print(ref() is None, gc.get_freeze_count() == 0)
""")
    assert out.split() == ["True", "True", "True"]
