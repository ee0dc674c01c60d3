"""benchmarks/loop_stalls.py: its summary from made-up streams, and its whole path on the CPU (a fresh server on
the smoke model, a short steady load, the table and the JSON). Whether the server stalls is the benchmark's
figure, not this test's: a shared CI machine may well stall a stream."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from benchmarks.loop_stalls import summary, table

REPO = Path(__file__).resolve().parents[1]


def test_summary_counts_tokens_gaps_and_stalls():
    args = argparse.Namespace(max_tokens=4, seconds=2.0, stall_ms=100.0)
    streams = [{"constrained": False, "ttft_ms": 10.0, "gaps_ms": [5.0, 150.0, 5.0]},
               {"constrained": True, "ttft_ms": 30.0, "gaps_ms": [5.0, 5.0, 120.0]}]
    s = summary(streams, args, front_end_cpu_s=0.004)
    assert s["streams"] == 2 and s["tokens_per_s"] == 4.0  # 2 streams x 4 tokens in 2 s
    assert s["front_end_cpu_ms_per_1k_tokens"] == 500.0  # 4 ms of CPU for 8 tokens
    assert s["gaps_over_stall"] == 2 and s["gap_max_ms"] == 150.0 and s["gap_p50_ms"] == 5.0
    assert (s["ttft_p50_ms"], s["ttft_max_ms"]) == (20.0, 30.0)
    rows = table([s], 100.0)
    assert "gaps over 100 ms" in rows[0] and rows[2].startswith("| 0 | 2 | 4 | 500.0 |")


def test_the_script_measures_a_fresh_server(tmp_path):
    out = tmp_path / "stalls.json"
    done = subprocess.run([sys.executable, "benchmarks/loop_stalls.py", "--servers", "1", "--seconds", "3",
                           "--concurrency", "4", "--max-tokens", "8", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    (s,) = result["summaries"]
    assert s["streams"] >= 4 and s["tokens_per_s"] > 0 and s["front_end_cpu_ms_per_1k_tokens"] > 0
    streams = result["streams"][0]
    assert any(st["constrained"] for st in streams) or len(streams) < 10  # 20% under the schema
    assert all(len(st["gaps_ms"]) <= 8 for st in streams)  # at most one event a token
    assert "| server | streams |" in done.stdout
