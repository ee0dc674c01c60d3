"""benchmarks/grammar_process.py: the engine's grammar process (engine/grammar_link.py) fills the same masks as
the matchers in the engine's process, and the engine thread's work per step with it is recording and sending."""
from __future__ import annotations

import json
import sys

import pytest

pytest.importorskip("xgrammar")


def test_both_forms_fill_the_same_masks(tmp_path, monkeypatch):
    from benchmarks import grammar_process

    out = tmp_path / "gp.json"
    monkeypatch.setattr(sys, "argv", ["grammar_process.py", "--batch", "6", "--steps", "4", "--window-ms", "0.2",
                                      "--out", str(out)])
    assert grammar_process.main() == 0
    result = json.loads(out.read_text())
    assert result["masks_equal"]
    assert len(result["thread"]["steps"]) == len(result["process"]["steps"]) == 4
    assert result["process"]["work_ms"] < 5  # sending the tokens, not consuming them
