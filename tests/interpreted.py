"""Run a test's kernel check in a process of its own under Triton's interpreter: TRITON_INTERPRET=1 must be set
before triton decorates the kernels, so it cannot be turned on inside the test process."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_interpreted(code: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -c code` from the checkout, on CPU tensors through Triton's interpreter."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
