"""CPU seconds of a server's processes by role, read from Linux /proc: which process a load keeps busy.

Through the server W-B json 100% runs at 0.64-0.82x of json 0% on H100 hosts (docs/benchmarks.md, ninth and
tenth sessions) while the engine core's step takes about the same time at both (server_step_profile.py). The
remaining suspects are host processes: the front ends, the grammar processes and their fill threads, the
engine core. benchmarks/online_pair.py records each load's CPU seconds per role with this; divided by the
load's duration they are the cores each role kept busy.
"""
from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

from bench.server_procs import descendants

TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# A fragment of the command line (process titles included) -> the role; the first match wins.
ROLES = (("kvserve::engine-core", "engine core"), ("kvserve::api-server", "front ends"),
         ("engine.grammar_worker", "grammar processes"), ("EngineCore", "engine core"),
         ("kvserve", "launcher"), ("vllm", "front ends"))  # launcher: with one api server, the front end too


def role_of(cmdline: str) -> str:
    return next((role for fragment, role in ROLES if fragment in cmdline), "other")


def role_of_pid(pid: int) -> str | None:
    """A live process's role (by its command line, process title included), or None once it is gone."""
    try:
        cmdline = Path("/proc", str(pid), "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    return role_of(cmdline)


def _sample(pid: int) -> tuple[str, float] | None:
    """(role, CPU seconds so far: user + system) of a live process, or None once it is gone."""
    try:
        fields = Path("/proc", str(pid), "stat").read_text().rpartition(")")[2].split()
        cpu = (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime: fields 14, 15
    except (OSError, IndexError):
        return None
    role = role_of_pid(pid)
    return None if role is None else (role, cpu)


def cpu_by_role(root: int) -> dict[str, float]:
    """CPU seconds so far of `root` and every process below it, summed by role."""
    totals: dict[str, float] = defaultdict(float)
    for pid in [root, *descendants(root)]:
        sample = _sample(pid)
        if sample is not None:
            totals[sample[0]] += sample[1]
    return dict(totals)


def cores_between(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, float]:
    """Cores each role kept busy between two cpu_by_role samples `seconds` apart (roles that used ~none left
    out). A process that exited in between is not counted."""
    cores = {role: (after[role] - before.get(role, 0.0)) / seconds for role in after}
    return {role: round(c, 2) for role, c in sorted(cores.items(), key=lambda kv: -kv[1]) if c >= 0.01}
