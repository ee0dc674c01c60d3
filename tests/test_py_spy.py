"""bench/py_spy.py: py-spy's raw stacks read back by thread and function; a live recording where py-spy exists."""
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import py_spy

RAW = """\
thread (11): MainThread;run (engine/core/loop.py:93);LLMEngine.step (engine/engine.py:156);ModelRunner.sample (engine/runner.py:300) 30
thread (11): MainThread;run (engine/core/loop.py:93);LLMEngine.step (engine/engine.py:156);LLMEngine.step (engine/engine.py:170) 10
thread (11): MainThread;run (engine/core/loop.py:93);Poller.poll (zmq/sugar/poll.py:106) 60
thread (12): kvserve-grammar_0;Thread.run (threading.py:982);_worker (concurrent/futures/thread.py:83) 100
"""


def test_the_engine_thread_is_found_and_its_functions_counted_once_a_sample(tmp_path):
    path = tmp_path / "raw.txt"
    path.write_text(RAW)
    prof = py_spy.summarize([path])
    assert prof.thread == "MainThread (11)" and prof.samples == 100
    assert prof.inclusive["LLMEngine.step (engine.py)"] == 40  # a recursive frame counts once a sample
    assert prof.leaf["ModelRunner.sample (runner.py)"] == 30 and prof.leaf["Poller.poll (poll.py)"] == 60
    rows = py_spy.table(prof)
    assert "| `LLMEngine.step (engine.py)` | 40.0% | 10.0% |" in rows


def test_no_engine_thread_gives_none(tmp_path):
    path = tmp_path / "raw.txt"
    path.write_text(RAW.splitlines()[-1] + "\n")
    assert py_spy.summarize([path, tmp_path / "missing.txt"]) is None


def test_a_recorder_without_a_process_records_nothing_and_says_why(tmp_path):
    with py_spy.Recorder(None, tmp_path / "x.txt") as rec:
        pass
    assert rec.skipped and not (tmp_path / "x.txt").exists()


@pytest.mark.skipif(shutil.which("py-spy") is None, reason="py-spy is not installed")
def test_a_live_process_is_sampled_until_the_block_ends(tmp_path):
    code = "import time\ndef spin():\n    while True: sum(range(100))\nspin()\n"
    target = subprocess.Popen([sys.executable, "-c", code])
    try:
        with py_spy.Recorder(target.pid, tmp_path / "raw.txt", rate_hz=200) as rec:
            time.sleep(0.5)
    finally:
        target.kill()
    if rec.skipped:  # a host that forbids ptrace: nothing to check here
        pytest.skip(rec.skipped)
    threads = py_spy.read_threads((tmp_path / "raw.txt").read_text().splitlines())
    assert any(t.inclusive["spin (<string>)"] > 0 for t in threads.values())
