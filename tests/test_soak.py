"""The soak script, short: 200 mixed requests (random sampling, 25% checked structured requests: constrained
outputs, forced tool calls, prompt logprobs; 10% hang-ups, 5% invalid, 5% over a cap, 3% slow-header clients,
3% streams never read) against a real `python -m server serve --tool-call-parser hermes --reasoning-parser` on
a tiny model (its SmolLM2 tokenizer writes JSON). No unexpected failure, no KV block leaked, RSS growth < 10%.
The structured checks themselves are shown to fail on bad replies."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.soak_checks import check_reply, same_prompt_logprobs
from bench.soak_spec import Check
from server_utils import benchmark_module

REPO = Path(__file__).resolve().parent.parent
CONSTRAINED = ("json_schema", "json_object", "regex", "choice", "tools")


@pytest.mark.timeout(400)
def test_soak_200_requests(tiny_model_dir, tmp_path):
    out = tmp_path / "soak.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "soak.py"), "--model", str(tiny_model_dir("llama")),
           "--num-requests", "200", "--concurrency", "8", "--max-tokens", "12", "--time-limit", "240",
           "--request-timeout", "60", "--json-out", str(out), "--no-progress",
           "--structured-frac", "0.25", "--server-arg=--num-kv-blocks", "--server-arg=256", "--server-arg=--device",
           "--server-arg=cpu", "--server-arg=--tool-call-parser", "--server-arg=hermes",
           "--server-arg=--reasoning-parser"]
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
    # Every structured form was sent and checked, and most constrained outputs ended by themselves (validated).
    assert kinds["structured"] >= 30
    finishes = report["structured_finishes"]
    assert set(finishes) == {*CONSTRAINED, "echo", "prompt_logprobs"}, finishes
    ended = sum(finishes[f].get("stop", 0) + finishes[f].get("tool_calls", 0) for f in CONSTRAINED)
    assert ended >= 0.7 * sum(sum(finishes[f].values()) for f in CONSTRAINED), finishes
    assert report["passed"] and proc.returncode == 0, proc.stdout[-2000:]


def _reply(text="", finish="stop", stop_reason=None, calls=None, **extra) -> dict:
    return {"index": 0, "text": text, "reasoning": None, "finish_reason": finish, "stop_reason": stop_reason,
            "calls": calls or {}, "logprobs": None, "prompt_logprobs": None, **extra}


def test_structured_checks_fail_on_bad_replies():
    """What the soak's checks refuse: an output that stopped but does not validate, a cut-off choice that is
    no prefix, a tool call of the wrong tool or with invalid arguments, prompt logprobs of the wrong length."""
    check = check_reply
    schema = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 3}}, "required": ["a"]}
    assert check(Check("json_schema", schema=schema), _reply('{"a":2}'), None) == ""
    assert check(Check("json_schema", schema=schema), _reply('{"a":7}'), None)
    assert check(Check("json_schema", schema=schema), _reply('{"a":'), None)
    assert check(Check("json_schema", schema=schema), _reply('{"a":', "length"), None) == ""
    assert check(Check("json_object"), _reply("[1]"), None)
    assert check(Check("regex", pattern=r"\d{2}"), _reply("123"), None)
    assert check(Check("regex", pattern=r"\d"), _reply("\U00011bf9"), None) == ""  # a digit since Unicode 16
    assert check(Check("regex", pattern=r"\d{2}"), _reply("1", "length"), None) == ""
    assert check(Check("regex", pattern=r"\d{2}"), _reply("x", "length"), None)
    assert check(Check("choice", choices=["red", "blue"]), _reply("re", "stop", ","), None) == ""
    assert check(Check("choice", choices=["red", "blue"]), _reply("green"), None)
    think = Check("regex", pattern=r"<think>[a-z]+</think>\n\nOk\.")
    assert check(think, _reply("Ok.", reasoning="hm"), None) == ""
    assert check(think, _reply("<think>hm</think>\n\nOk."), None) == ""
    assert check(think, _reply("", "length", reasoning="hm"), None) == ""
    assert check(think, _reply("Ok.", reasoning="hm</think>"), None)
    assert check(Check("choice", choices=["red", "blue"]), _reply("bl", "abort"), None)
    tools = Check("tools", tools={"f": schema}, named="f")
    call = {0: {"name": "f", "arguments": '{"a": 1}'}}
    assert check(tools, _reply(finish="tool_calls", calls=call), None) == ""
    assert check(tools, _reply(finish="stop", calls=call), None)
    assert check(tools, _reply(finish="stop", stop_reason='"', calls={0: {"name": "f", "arguments": "{"}}), None) == ""
    assert check(tools, _reply(finish="tool_calls", calls={0: {"name": "f", "arguments": "{"}}), None)
    assert check(tools, _reply(finish="tool_calls", calls={0: {"name": "g", "arguments": '{"a": 1}'}}), None)
    assert check(tools, _reply(finish="tool_calls", calls={0: {"name": "f", "arguments": '{"a": 9}'}}), None)
    usage = {"prompt_tokens": 3, "completion_tokens": 1}
    entries = [None, {"5": {"logprob": -1.0}}, {"6": {"logprob": -2.0}}]
    assert check(Check("prompt_logprobs", k=0), _reply(prompt_logprobs=entries), usage) == ""
    assert check(Check("prompt_logprobs", k=0), _reply(prompt_logprobs=entries[:2]), usage)
    other = [None, {"5": {"logprob": -1.0}}, {"6": {"logprob": -2.5}}]
    assert same_prompt_logprobs([_reply(prompt_logprobs=entries), _reply(prompt_logprobs=entries)]) == ""
    assert same_prompt_logprobs([_reply(prompt_logprobs=entries), _reply(prompt_logprobs=other)])
    echo = {"tokens": ["a", "b", "c", "d"], "token_logprobs": [None, -1.0, -2.0, -0.5],
            "top_logprobs": [None, {"b": -1.0}, {"c": -2.0}, {"d": -0.5}]}
    assert check(Check("echo", k=1), _reply(logprobs=echo), usage) == ""
    assert check(Check("echo", k=1), _reply(logprobs={**echo, "token_logprobs": [-3.0, -1.0, -2.0, -0.5]}), usage)


def test_the_plan_holds_every_structured_form():
    soak = benchmark_module("soak")
    plan = soak.make_plan(400, 0, None, 0.1, 0.05, 12, 0.05, 0.03, 0.03, 0.25)
    forms = {s.check.form for s in plan if s.kind == "structured"}
    assert forms == {*CONSTRAINED, "echo", "prompt_logprobs"}
    assert any(s.kind == "disconnect" and "ignore_eos" not in s.body for s in plan)  # constrained hang-ups
    codes = {s.expect_code for s in plan if s.kind == "invalid"}
    assert "invalid_grammar" in codes
