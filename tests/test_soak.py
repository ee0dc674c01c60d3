"""The soak script, short: 200 mixed requests (random sampling, 10% hang-ups, 5% invalid, 5% over a cap, 3%
slow-header clients, 3% streams never read) against a real
`python -m server serve` on a tiny model. No unexpected failure, no KV block leaked, RSS growth < 10%."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(400)
def test_soak_200_requests(tiny_model_dir, tmp_path):
    out = tmp_path / "soak.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "soak.py"), "--model", str(tiny_model_dir("llama")),
           "--num-requests", "200", "--concurrency", "8", "--max-tokens", "12", "--time-limit", "240",
           "--request-timeout", "60", "--json-out", str(out), "--no-progress",
           "--server-arg=--num-kv-blocks", "--server-arg=256", "--server-arg=--device", "--server-arg=cpu"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=380)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    failures = report["failures"]
    assert report["unexpected_failures"] == 0, failures
    assert report["leaked_blocks"] == 0
    assert report["idle_invariant_violations"] == 0
    assert report["rss_start_bytes"] and report["rss_end_bytes"]
    assert report["rss_growth"] < 0.10
    assert report["server_healthy_after"] and report["server_exit_code"] == 0
    # The mix really was mixed: hang-ups and invalid requests were sent, and the server saw the hang-ups.
    kinds = report["by_kind"]
    assert sum(kinds.values()) == 200 and kinds["disconnect"] >= 10 and kinds["invalid"] >= 4
    assert kinds["oversized"] >= 4 and kinds["slow"] >= 4 and kinds["never_read"] >= 4
    assert report["finished_by_reason"]["abort"] >= 1
    assert report["passed"] and proc.returncode == 0, proc.stdout[-2000:]
