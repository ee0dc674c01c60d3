"""benchmarks/host_step.py: the engine thread's host work per decode step, with a share of the rows under a grammar
(W-B json 20% on the CPU)."""
from __future__ import annotations

import json
import subprocess
import sys
from server_utils import REPO, benchmark_module

host_step = benchmark_module("host_step")


def test_a_share_of_the_rows_is_constrained_spread_evenly():
    rows = host_step.constraints(256, 0.2)
    marked = [i for i, c in enumerate(rows) if c is not None]
    assert len(marked) == 51  # floor(256 * 0.2)
    assert max(b - a for a, b in zip(marked, marked[1:])) <= 5  # one in five, not the first 51
    assert all(c is not None for c in host_step.constraints(8, 1.0))
    assert all(c is None for c in host_step.constraints(8, 0.0))


def test_a_decode_only_run_with_half_the_rows_constrained_waits_for_masks(tmp_path):
    out = tmp_path / "host_step.json"
    subprocess.run([sys.executable, "benchmarks/host_step.py", "--batch", "8", "--max-tokens", "6", "--runs", "1",
                    "--decode-only", "--prompt-len", "5", "20", "--constrained", "1", "--constrained-share", "0.5",
                    "--out", str(out)], cwd=REPO, check=True, capture_output=True, timeout=300)
    result = json.loads(out.read_text())
    assert result["constrained_share"] == 0.5 and result["steps_per_run"] == 6
    assert "mask wait" in result["laps_ms_per_step"]  # the steps sampled under grammar masks
