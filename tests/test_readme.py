"""The README works as written: every code block is run against a real `kvserve serve` of the embedded model
(started once; nothing downloads), or is a setup command this test names and checks exists.

curl commands and Python blocks run as they are, with only the port changed, and must answer the question
they ask ("The capital of France is" -> Paris). Setup commands (venv, pip, serve, pytest, docker) are not run
here: the quick-start CI job runs the install and test line.
"""
from __future__ import annotations

import contextlib
import io
import re
import shlex
import subprocess

import pytest

from server_utils import REPO, start_server_process, stop_process

SETUP = ("python3 -m venv", "pip install", "kvserve serve", "docker ", "python -m pytest")


def code_blocks(lang: str) -> list[str]:
    text = (REPO / "README.md").read_text()
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def commands(block: str) -> list[str]:
    return [c.strip() for c in block.replace("\\\n", " ").splitlines() if c.strip()]


@pytest.fixture(scope="module")
def readme_server(smollm2_dir):
    proc, base = start_server_process(["--log-level", "warning"])
    yield base
    stop_process(proc)


def test_readme_shell_commands(readme_server):
    port = readme_server.rsplit(":", 1)[1]
    ran = 0
    for block in code_blocks("bash"):
        for cmd in commands(block):
            if cmd.startswith("curl "):
                args = shlex.split(cmd.replace("127.0.0.1:8000", f"127.0.0.1:{port}"))
                out = subprocess.run(args, capture_output=True, text=True, timeout=120)
                assert out.returncode == 0 and "Paris" in out.stdout, (cmd, out.stdout[-2000:], out.stderr[-500:])
                ran += 1
            else:
                assert any(part.strip().startswith(SETUP) for part in cmd.split("&&")), f"unknown command: {cmd}"
    assert ran >= 2


def test_readme_python_blocks(readme_server):
    """Run in this process (no second interpreter start), each block in a fresh namespace."""
    port = readme_server.rsplit(":", 1)[1]
    blocks = code_blocks("python")
    assert len(blocks) >= 2
    for block in blocks:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(block.replace("127.0.0.1:8000", f"127.0.0.1:{port}"), "README.md", "exec"), {})
        assert "Paris" in out.getvalue(), out.getvalue()


def test_readme_says_what_a_new_user_needs():
    text = (REPO / "README.md").read_text()
    for needed in ("python3 -m venv", "pip install openai", "SmolLM2-135M-Instruct", "Q4_1", "converts the GGUF",
                   "skip", "--served-model-name", "/docs"):
        assert needed in text, needed
