"""benchmarks/server_step_profile.py: the engine's sections timed inside the real server's engine-core process.
Its whole path on the CPU (--smoke): each load's rows carry the core's own step count and section times,
including the core loop's work between steps; the figures themselves are the GPU run's job."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_smoke_run_times_the_core_sections_per_load(tmp_path):
    out = tmp_path / "profile.json"
    proc = subprocess.run([sys.executable, "benchmarks/server_step_profile.py", "--smoke", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [r for r in json.loads(out.read_text())["rows"] if not r["warm_up"]]
    assert [r["load"] for r in rows] == ["W-B json 0%", "W-B json 100%"]
    for row in rows:
        ms = row["sections_ms_per_step"]
        assert row["completed"] == 16 and row["steps"] >= 12  # 12 output tokens each: at least 12 engine steps
        assert 0 < ms["between steps (core loop)"] < ms["step (all of it)"] + 50
        assert ms["schedule"] > 0 and ms["postprocess"] > 0
    free, constrained = (r["sections_ms_per_step"] for r in rows)
    assert constrained.get("apply masks", 0) > 0 and free.get("apply masks", 0) == 0  # masks only under json
