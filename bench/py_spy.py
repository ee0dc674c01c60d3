"""Where the engine thread's time goes under a load, by Python function: py-spy samples of the engine core.

engine/step_clock.py times a step's sections; inside a section only a sampling profiler says which calls take
the time. Through the server W-B at json 100% costs the engine thread 16-28% more host time a token than at
json 0% (docs/benchmarks.md, eleventh session). `Recorder` runs `py-spy record` on a process for the length of
a load (raw collapsed stacks, every thread, idle samples kept, the process never paused); `summarize` reads the
file back: the busiest thread's samples by function, inclusive (the function or any call below it) and as the
leaf (the function itself), as shares of that thread's samples.
"""
from __future__ import annotations

import os
import re
import select
import shutil
import signal
import subprocess
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from bench.proc_cpu import role_of_pid
from bench.server_procs import descendants

RATE_HZ = 500  # samples a second: ~500 a 1 s load, enough to rank a 5% share; py-spy's own default is 100
_LINE = re.compile(r"^thread \((\d+)\)(?:: ?([^;]*))?;?(.*) (\d+)$")  # a thread without a name has no ": NAME"


@dataclass
class ThreadProfile:
    """One thread's samples: by function name (file and line dropped), inclusive and as the leaf."""
    thread: str
    samples: int
    inclusive: Counter
    leaf: Counter


def engine_core_pid(server_pid: int) -> int | None:
    """The engine core process below a `kvserve serve` process (found by its process title)."""
    return next((pid for pid in descendants(server_pid) if role_of_pid(pid) == "engine core"), None)


class Recorder:
    """`with Recorder(pid, path):` samples the process into `path` (py-spy's raw format) until the block ends.
    Without py-spy on PATH, or without a pid, it records nothing and says why in `.skipped`."""

    def __init__(self, pid: int | None, path: Path, rate_hz: int = RATE_HZ) -> None:
        self.pid, self.path, self.rate_hz = pid, path, rate_hz
        exe = shutil.which("py-spy")
        self.skipped = "no py-spy on PATH" if exe is None else "no engine core process" if pid is None else ""
        self._cmd = [exe or "py-spy", "record", "--pid", str(pid), "--rate", str(rate_hz), "--format", "raw",
                     "--threads", "--idle", "--nonblocking", "-o", str(path)]
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> Recorder:
        if not self.skipped:
            self._proc = subprocess.Popen(self._cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            self._wait_sampling()
        return self

    def _wait_sampling(self, timeout_s: float = 10.0) -> None:
        """Until py-spy says it samples: a Ctrl-C before that ends it with no file (a CPU smoke load takes 1 s)."""
        said, deadline = b"", time.monotonic() + timeout_s
        while b"Sampling process" not in said and time.monotonic() < deadline and self._proc.poll() is None:
            if select.select([self._proc.stdout], [], [], 0.1)[0]:
                said += os.read(self._proc.stdout.fileno(), 4096)

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        self._proc.send_signal(signal.SIGINT)  # py-spy writes its file on Ctrl-C
        try:
            err, _ = self._proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            err, _ = self._proc.communicate()
        if not self.path.exists():
            self.skipped = f"py-spy wrote nothing: {err.decode(errors='replace')[-300:]}"


def _function(frame: str) -> str:
    """`name (path/file.py:12)` -> `name (file.py)`."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.rsplit(':', 1)[0].rsplit('/', 1)[-1]})" if where else name


def read_threads(lines: list[str]) -> dict[str, ThreadProfile]:
    """py-spy raw lines (`thread (TID): NAME;frame;...;frame COUNT`) -> every thread's profile."""
    threads: dict[str, ThreadProfile] = {}
    for line in lines:
        m = _LINE.match(line.strip())
        if m is None:
            continue
        tid, name, stack, count = m.group(1), m.group(2) or "thread", m.group(3), int(m.group(4))
        prof = threads.setdefault(tid, ThreadProfile(f"{name} ({tid})", 0, Counter(), Counter()))
        frames = [_function(f) for f in stack.split(";") if f]
        prof.samples += count
        for fn in set(frames):
            prof.inclusive[fn] += count
        prof.leaf[frames[-1] if frames else "(no Python frame)"] += count
    return threads


def summarize(paths: list[Path], marker: str = "LLMEngine.step (engine.py)") -> ThreadProfile | None:
    """The thread whose stacks hold `marker` most often (the engine thread), merged over the files."""
    lines = [line for p in paths if p.exists() for line in p.read_text().splitlines()]
    threads = [t for t in read_threads(lines).values() if t.inclusive[marker]]
    return max(threads, key=lambda t: t.inclusive[marker], default=None)


def table(prof: ThreadProfile, top: int = 40) -> list[str]:
    """Markdown: the top functions by inclusive share (with their share as the leaf), then the top leaves."""
    rows = [f"{prof.thread}: {prof.samples} samples", "", "| function | inclusive | as the leaf |", "|---|---:|---:|"]
    for fn, n in prof.inclusive.most_common(top):
        rows.append(f"| `{fn}` | {n / prof.samples:.1%} | {prof.leaf[fn] / prof.samples:.1%} |")
    rows += ["", "| leaf | share |", "|---|---:|"]
    rows += [f"| `{fn}` | {n / prof.samples:.1%} |" for fn, n in prof.leaf.most_common(top)]
    return rows
