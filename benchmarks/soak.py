"""Soak test: thousands of mixed requests against one kvserve server, then check that nothing leaked.

    python benchmarks/soak.py                       # starts `python -m server serve` on the embedded default
    python benchmarks/soak.py --base-url http://127.0.0.1:8000 --server-pid 1234
    python benchmarks/soak.py --model /path/to/tiny --num-requests 200 --json-out soak.json

The mix: random sampling parameters (temperature, top-p/k, min-p, penalties, seeds, n, stop strings,
logprobs, echo, logit bias), completions and chat, streaming and not, text and token-id prompts;
--disconnect-frac of the requests hang up at a random moment, --invalid-frac are invalid and must get
their documented 4xx, --oversized-frac are over a cap (a megabyte of prompt text, thousands of stop_token_ids
or logit_bias entries, /detokenize of 70,000 ids, n x max_tokens x logprobs too large) and must get their 4xx
at once, --slow-frac send their headers a few bytes at a time (within the header timeout: served), and
--never-read-frac start a stream with a tiny receive buffer, read nothing for a while, then hang up;
--structured-frac are checked structured requests: constrained outputs (small random JSON schemas, json_object,
regexes, choices; chat and completions, streamed and not, n up to 3) that must validate when they finish with
`stop` (and be an allowed prefix when cut off; a `<think>` regex is put back together from reasoning_content
under --reasoning-parser), tool calls (tool_choice required, named, or auto with a regex writing hermes calls;
start the server with --tool-call-parser hermes) whose arguments must validate against the tool's schema, and
prompt logprobs (echo + logprobs, prompt_logprobs) with one entry per prompt token, the same for the n choices.
A third of the hang-ups are constrained too (some right after sending, while the grammar compiles), and the
invalid requests include bad regexes and schemas (400 invalid_grammar), an unknown tool_choice name (400
invalid_value), min_tokens with a constraint and a streamed echo with logprobs (400 unsupported).
Reported, and the exit status is 0 only when all three hold:
  * unexpected failures (anything but the expected outcome of each request) == 0
  * leaked KV blocks (`kvserve_kv_blocks_used` once the server is idle again) == 0,
    and no idle-invariant violation (`kvserve_idle_invariant_violations_total`)
  * resident memory of the server process and its children (the engine core) grows by less than
    --max-rss-growth (10%) from after the warm-up to the end
Bounded in time: every request has a timeout and the whole run stops at --time-limit.
Only a client: it imports nothing of kvserve.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import jsonschema
import psutil
import regex
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

REPO_ROOT = Path(__file__).resolve().parent.parent
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex every bold jumping zebra "
         "under grey skies rivers run to the sea and all the kings men could not mend it again").split()


# ------------------------------------------------------------------------------------------- the plan


@dataclass
class Spec:
    """One planned request."""
    index: int
    kind: str  # "valid" | "structured" | "disconnect" | "invalid" | "oversized" | "slow" | "never_read"
    path: str  # "/v1/completions" | "/v1/chat/completions"
    body: dict | None  # JSON body; None when `raw` is sent instead
    raw: bytes | None = None
    stream: bool = False
    expect_status: int = 200
    expect_code: str | None = None
    hangup: str = ""  # disconnects: "before_first_token" | "mid_stream" | "non_streaming"
    hangup_after: float = 0.0  # seconds (non-streaming) or events (mid-stream)
    check: Check | None = None  # "structured": what its reply must satisfy


def _text(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def _sampling(rng: random.Random, max_tokens: int) -> dict:
    body = {"max_tokens": rng.randint(1, max_tokens),
            "temperature": rng.choice([0.0, 0.0, 0.5, 0.8, 1.0, 1.3]),
            "top_p": rng.choice([1.0, 1.0, 0.9, 0.5, 0.1]),
            "top_k": rng.choice([-1, -1, 0, 1, 5, 40]),
            "min_p": rng.choice([0.0, 0.0, 0.05, 0.2]),
            "presence_penalty": rng.choice([0.0, 0.0, 0.5, -0.5, 1.5]),
            "frequency_penalty": rng.choice([0.0, 0.0, 0.3, -0.3]),
            "repetition_penalty": rng.choice([1.0, 1.0, 1.1, 0.9]),
            "n": rng.choice([1, 1, 1, 2, 3])}
    if rng.random() < 0.5:
        body["seed"] = rng.randrange(2 ** 31)
    if rng.random() < 0.2:
        body["stop"] = rng.choice([".", "\n", [" the", " a"], ["ing"]])
    if rng.random() < 0.15:
        body["ignore_eos"] = True
    if rng.random() < 0.1:
        body["min_tokens"] = rng.randint(0, body["max_tokens"])
    if rng.random() < 0.1:
        body["logit_bias"] = {str(rng.randrange(100, 1000)): rng.choice([-100.0, -5.0, 5.0])}
    return body


def valid_spec(rng: random.Random, index: int, model: str | None, max_tokens: int) -> Spec:
    body = _sampling(rng, max_tokens)
    if model:
        body["model"] = model
    stream = rng.random() < 0.5
    if stream:
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.3:
        body["messages"] = [{"role": "user", "content": _text(rng, 1, 30)}]
        if rng.random() < 0.2:
            body["logprobs"], body["top_logprobs"] = True, rng.randint(0, 5)
        return Spec(index, "valid", "/v1/chat/completions", body, stream=stream)
    shape = rng.random()
    if shape < 0.6:
        body["prompt"] = _text(rng, 1, 60)
    elif shape < 0.8:
        body["prompt"] = [rng.randrange(100, 1000) for _ in range(rng.randint(1, 100))]
    else:
        body["prompt"], body["n"] = [_text(rng, 1, 20) for _ in range(rng.randint(2, 3))], 1
    if rng.random() < 0.2:
        body["logprobs"] = rng.randint(0, 5)
    elif rng.random() < 0.1:
        body["echo"] = True
    return Spec(index, "valid", "/v1/completions", body, stream=stream)


def _constrain_for_disconnect(rng: random.Random, body: dict) -> None:
    """A third of the hang-ups are constrained: json_object (long: a random model rarely closes it), a JSON
    schema or a regex; the grammar may still be compiling when the client leaves."""
    r = rng.random()
    if r < 0.15:
        body["response_format"] = {"type": "json_object"}
    elif r < 0.25:
        body["structured_outputs"] = {"json": object_schema(rng, 2)}
    elif r < 0.33:
        body["guided_regex"] = rng.choice(REGEXES) + "( [a-z]{1,8}){0,40}"
    else:
        return
    body.pop("ignore_eos")


def disconnect_spec(rng: random.Random, index: int, model: str | None) -> Spec:
    # Long enough (ignore_eos) that the hang-up usually comes while the request is still running.
    body = {"prompt": _text(rng, 5, 150), "max_tokens": 256, "ignore_eos": True,
            "temperature": rng.choice([0.0, 1.0])}
    if model:
        body["model"] = model
    _constrain_for_disconnect(rng, body)
    hangup = rng.choice(["before_first_token", "mid_stream", "non_streaming"])
    stream = hangup != "non_streaming"
    if stream:
        body["stream"] = True
    after = rng.uniform(0.0, 0.5) if hangup == "non_streaming" else float(rng.randint(1, 8))
    if hangup == "non_streaming" and "ignore_eos" not in body and rng.random() < 0.5:
        after = rng.uniform(0.001, 0.03)  # right after sending: the grammar is likely still compiling
    return Spec(index, "disconnect", "/v1/completions", body, stream=stream, hangup=hangup, hangup_after=after)


def invalid_cases(model: str | None) -> list[tuple[str, dict | None, bytes | None, int, str]]:
    """(path, body, raw body, expected status, expected code)."""
    m = {"model": model} if model else {}
    c, chat = "/v1/completions", "/v1/chat/completions"
    return [
        (c, {**m, "prompt": "hi", "temperature": -1}, None, 400, "invalid_value"),
        (c, {**m, "prompt": "hi", "max_tokens": 0}, None, 400, "invalid_value"),
        (c, {**m, "prompt": "hi", "max_tokens": "16"}, None, 400, "invalid_type"),
        (c, {**m, "prompt": "hi", "top_p": 0}, None, 400, "invalid_value"),
        (c, {**m, "prompt": "hi", "n": 0}, None, 400, "invalid_value"),
        (c, {**m, "prompt": "hi", "logprobs": 21}, None, 400, "invalid_value"),
        (c, {**m, "prompt": []}, None, 400, "invalid_value"),
        (c, {**m, "prompt": [10 ** 9]}, None, 400, "invalid_value"),
        (c, {"prompt": "hi", "model": "no-such-model"}, None, 404, "model_not_found"),
        (c, None, b'{"prompt": "hi", ', 400, "invalid_json"),
        (chat, {**m, "messages": []}, None, 400, "invalid_value"),
        (chat, {**m, "messages": [{"role": "wizard", "content": "hi"}]}, None, 400, "invalid_type"),
        (c, {**m, "prompt": "hi", "structured_outputs": {"regex": "a(b"}}, None, 400, "invalid_grammar"),
        (chat, {**m, "messages": [{"role": "user", "content": "hi"}], "guided_regex": "(("}, None, 400,
         "invalid_grammar"),
        (chat, {**m, "messages": [{"role": "user", "content": "hi"}], "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, None, 400,
         "invalid_grammar"),
        (c, {**m, "prompt": "hi", "guided_json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}},
         None, 400, "invalid_grammar"),
        (chat, {**m, "messages": [{"role": "user", "content": "hi"}], "tools": tool_defs(random.Random(0)),
                "tool_choice": {"type": "function", "function": {"name": "no_such_tool"}}}, None, 400,
         "invalid_value"),
        (c, {**m, "prompt": "hi", "guided_regex": "a+", "min_tokens": 3}, None, 400, "unsupported"),
        (c, {**m, "prompt": "hi", "echo": True, "logprobs": 2, "stream": True}, None, 400, "unsupported"),
    ]


def invalid_spec(rng: random.Random, index: int, model: str | None) -> Spec:
    path, body, raw, status, code = rng.choice(invalid_cases(model))
    return Spec(index, "invalid", path, body, raw=raw, expect_status=status, expect_code=code)


def oversized_cases(model: str | None) -> list[tuple[str, dict, int, str]]:
    """(path, body, expected status, expected code): each over one of the server's default caps."""
    m = {"model": model} if model else {}
    c = "/v1/completions"
    return [
        (c, {**m, "prompt": "1" * 1_000_000, "max_tokens": 1}, 400, "context_length_exceeded"),
        (c, {**m, "prompt": "hi", "max_tokens": 1, "stop_token_ids": list(range(5000))}, 400, "invalid_value"),
        (c, {**m, "prompt": "hi", "max_tokens": 1, "logit_bias": {str(i): 1 for i in range(2000)}}, 400,
         "invalid_value"),
        (c, {**m, "prompt": "hi", "n": 64, "max_tokens": 8192, "logprobs": 20}, 400, "invalid_value"),
        ("/detokenize", {**m, "tokens": [5] * 70_000}, 400, "invalid_value"),
    ]


def oversized_spec(rng: random.Random, index: int, model: str | None) -> Spec:
    path, body, status, code = rng.choice(oversized_cases(model))
    return Spec(index, "oversized", path, body, expect_status=status, expect_code=code)


def slow_spec(rng: random.Random, index: int, model: str | None, max_tokens: int) -> Spec:
    spec = valid_spec(rng, index, model, max_tokens)
    spec.kind, spec.stream = "slow", False
    spec.body.pop("stream", None)
    spec.body.pop("stream_options", None)
    spec.hangup_after = rng.uniform(0.5, 2.0)  # seconds over which the headers trickle in
    return spec


def never_read_spec(rng: random.Random, index: int, model: str | None) -> Spec:
    body = {"prompt": _text(rng, 5, 50), "max_tokens": 256, "ignore_eos": True, "stream": True, "n": 4,
            "logprobs": 5}
    if model:
        body["model"] = model
    return Spec(index, "never_read", "/v1/completions", body, stream=True, hangup_after=rng.uniform(1.0, 4.0))


# ------------------------------------------------------------------------ structured outputs, tools, prompt logprobs

ENUM_WORDS = ["a", "bc", "xyz", "red", "on", "ok"]
CHOICE_WORDS = ["red", "green", "blue sky", "yes", "no", "maybe", "north", "south east"]
# \d and \w are Unicode classes: outputs are matched with the `regex` module, whose tables are as new as the
# server's (Python 3.11's `re` does not know U+11BF9, a Sunuwar digit, as a digit).
REGEXES = [r"[a-z]{2,4}-[0-9]{3}( [A-Z][a-z]{0,3})?", r"(yes|no|maybe)", r"\d{1,3}(\.\d{1,2})?",
           r"[A-Z][a-z]{1,5}( [A-Z][a-z]{1,5}){0,2}", r"[a-z]{1,6}@[a-z]{1,6}\.(com|org)",
           r"\([0-9]{1,2}(,[0-9]{1,2}){0,3}\)", r"\w{1,4}-\w{1,4}",
           r"<think>[a-z ]{1,20}</think>\n\n[A-Z][a-z]{1,8}( [a-z]{1,6}){0,3}\."]  # --reasoning-parser splits it
TOOL_PROMPTS = ["Weather in Paris?", "What time is it in Berlin?", "Look this up for me.", "Call a tool."]
# tool_choice auto: a regex makes the random model write what --tool-call-parser hermes reads (text, then calls)
HERMES_REPLY = (r'[A-Z][a-z]{1,8}\.\n<tool_call>\n\{"name": "get_time", "arguments": \{"tz": "(UTC|CET)"\}\}\n'
                r'</tool_call>(\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,8}", '
                r'"days": [1-7]\}\}\n</tool_call>)?')
PROMPT_POOL = [" ".join(WORDS[i:i + 6 + i % 11]) for i in range(0, 24, 3)]  # repeated: prefix-cache hits


@dataclass
class Check:
    """What the 200 reply of a "structured" request must satisfy (plain data):
    json_schema / json_object / regex / choice: each choice's text, once it finished with `stop` and no stop
    string cut it, validates (jsonschema, json object, regex.fullmatch, membership); cut off (`length` or a stop
    string) it is a prefix the constraint allows (choices and regexes; JSON is not checked then).
    tools: finish_reason `tool_calls`, calls of the tools given (the named one), arguments valid JSON of the
    tool's parameters schema; `length` is allowed (cut mid-call), `stop` is not.
    echo / prompt_logprobs: one logprob per prompt token, the first null, each with at most k + 1 tops."""
    form: str  # "json_schema" | "json_object" | "regex" | "choice" | "tools" | "echo" | "prompt_logprobs"
    schema: dict | None = None
    pattern: str | None = None
    choices: list[str] | None = None
    tools: dict[str, dict] | None = None  # tool name -> its parameters schema
    named: str | None = None  # tools: the name tool_choice forces
    single: bool = False  # tools: parallel_tool_calls false, at most one call
    k: int = 0  # echo / prompt_logprobs: top logprobs asked for


def leaf_schema(rng: random.Random) -> dict:
    """A schema a weak model can finish: strings and numbers bounded."""
    pick = rng.randrange(6)
    if pick == 0:
        return {"type": "string", "maxLength": rng.randint(0, 6)}
    if pick == 1:
        return {"type": "string", "enum": rng.sample(ENUM_WORDS, rng.randint(1, 3))}
    if pick == 2:
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 200)}
    return rng.choice([{"type": "boolean"}, {"type": "null"}, {"enum": [1, "two", None]}])


def random_schema(rng: random.Random, depth: int) -> dict:
    """A leaf, or (depth left) an array with maxItems <= 3 or an object."""
    r = rng.random()
    if depth <= 0 or r < 0.55:
        return leaf_schema(rng)
    if r < 0.8:
        return {"type": "array", "items": random_schema(rng, depth - 1), "maxItems": rng.randint(0, 3)}
    return object_schema(rng, depth - 1)


def object_schema(rng: random.Random, depth: int = 1) -> dict:
    """An object of 1-3 properties, some required, no others allowed."""
    props = {f"k{i}": random_schema(rng, depth) for i in range(rng.randint(1, 3))}
    required = [name for name in props if rng.random() < 0.6]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def _constrain_json(rng: random.Random, body: dict) -> Check:
    """A random schema in one of the three request forms."""
    schema = object_schema(rng, 2)
    form = rng.choice(["response_format", "structured_outputs", "guided_json"])
    if form == "response_format":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    elif form == "structured_outputs":
        body["structured_outputs"] = {"json": schema}
    else:
        body["guided_json"] = json.dumps(schema)
    return Check("json_schema", schema=schema)


def _constrain_json_object(rng: random.Random, body: dict) -> Check:
    """Any JSON object (the random model may go on to max_tokens: `length` is then expected)."""
    if rng.random() < 0.5:
        body["response_format"] = {"type": "json_object"}
    else:
        body["structured_outputs"] = {"json_object": True}
    return Check("json_object")


def _constrain_regex(rng: random.Random, body: dict) -> Check:
    pattern = rng.choice(REGEXES)
    if rng.random() < 0.5:
        body["structured_outputs"] = {"regex": pattern}
    else:
        body["guided_regex"] = pattern
    return Check("regex", pattern=pattern)


def _constrain_choice(rng: random.Random, body: dict) -> Check:
    choices = rng.sample(CHOICE_WORDS, rng.randint(2, 4))
    if rng.random() < 0.5:
        body["structured_outputs"] = {"choice": choices}
    else:
        body["guided_choice"] = choices
    return Check("choice", choices=choices)


def _constrained_sampling(rng: random.Random) -> dict:
    """Greedy or sampled, n up to 3, max_tokens 64-160 (room for most outputs to end), stop strings sometimes."""
    body = {"max_tokens": rng.randint(64, 160), "temperature": rng.choice([0.0, 0.0, 0.7, 1.0]),
            "top_p": rng.choice([1.0, 1.0, 0.9]), "top_k": rng.choice([-1, -1, 5, 40]),
            "n": rng.choice([1, 1, 2, 3])}
    if rng.random() < 0.5:
        body["seed"] = rng.randrange(2 ** 31)
    if rng.random() < 0.15:
        body["stop"] = rng.choice([",", "\n", ["e"], ["}", "]"]])
    if rng.random() < 0.1:
        body["presence_penalty"] = rng.choice([0.5, -0.5])
    return body


def _streaming(rng: random.Random, body: dict) -> bool:
    stream = rng.random() < 0.5
    if stream:
        body["stream"] = True
        if rng.random() < 0.3:
            body["stream_options"] = {"include_usage": True}
    return stream


def constrained_spec(rng: random.Random, index: int, model: str | None) -> Spec:
    """A valid constrained request: JSON schema, json_object, regex or choice; chat or completions."""
    body = _constrained_sampling(rng)
    if model:
        body["model"] = model
    constrain = rng.choice([_constrain_json, _constrain_json, _constrain_json_object, _constrain_regex,
                            _constrain_choice])
    check = constrain(rng, body)
    stream = _streaming(rng, body)
    if rng.random() < 0.5:
        body["messages"] = [{"role": "user", "content": _text(rng, 1, 20)}]
        if rng.random() < 0.2:
            body["logprobs"], body["top_logprobs"] = True, rng.randint(0, 5)
        return Spec(index, "structured", "/v1/chat/completions", body, stream=stream, check=check)
    body["prompt"] = _text(rng, 1, 30)
    if rng.random() < 0.2:
        body["logprobs"] = rng.randint(0, 5)
    return Spec(index, "structured", "/v1/completions", body, stream=stream, check=check)


def tool_defs(rng: random.Random) -> list[dict]:
    """Two fixed tools and a random one."""
    weather = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                "days": {"type": "integer", "minimum": 1, "maximum": 7}},
               "required": ["city", "days"], "additionalProperties": False}
    time_ = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
             "additionalProperties": False}
    params = {"get_weather": weather, "get_time": time_, f"tool_{rng.randrange(100)}": object_schema(rng, 1)}
    return [{"type": "function", "function": {"name": name, "parameters": p}} for name, p in params.items()]


def tool_spec(rng: random.Random, index: int, model: str | None) -> Spec:
    """Chat with tools and tool_choice `required`, a named function, or `auto` (read by the hermes parser)."""
    tools = tool_defs(rng)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    body = {"messages": [{"role": "user", "content": rng.choice(TOOL_PROMPTS)}], "tools": tools,
            "max_tokens": rng.randint(96, 160), "temperature": rng.choice([0.0, 0.7, 1.0]), "n": rng.choice([1, 1, 2])}
    if model:
        body["model"] = model
    check = Check("tools", tools=schemas)
    r = rng.random()
    if r < 0.2:
        body["tool_choice"], body["structured_outputs"] = "auto", {"regex": HERMES_REPLY}
    elif r < 0.6:
        check.named = rng.choice(list(schemas))
        body["tool_choice"] = {"type": "function", "function": {"name": check.named}}
    else:
        body["tool_choice"] = "required"
        if rng.random() < 0.3:
            body["parallel_tool_calls"], check.single = False, True
    if rng.random() < 0.1:
        body["stop"] = rng.choice(['"', ",", ["}"], ["e"]])  # may cut a call: then finish stays `stop`
    stream = _streaming(rng, body)
    return Spec(index, "structured", "/v1/chat/completions", body, stream=stream, check=check)


def prompt_logprobs_spec(rng: random.Random, index: int, model: str | None) -> Spec:
    """Completions with echo + logprobs (n=1), or vLLM's prompt_logprobs (n up to 2); never streamed.
    Prompts come from a small pool, so they repeat (the prefix cache must not cut prompt logprobs short), or are
    random text or token ids, some a single token (nothing to score: one null entry)."""
    k = rng.randint(0, 5)
    r = rng.random()
    prompt = rng.choice(PROMPT_POOL) if r < 0.45 else _text(rng, 1, 40) if r < 0.75 else [
        rng.randrange(100, 1000) for _ in range(1 if r < 0.85 else rng.randint(2, 60))]  # one token: [null]
    body = {"prompt": prompt, "max_tokens": rng.randint(1, 16), "temperature": rng.choice([0.0, 1.0])}
    if model:
        body["model"] = model
    if rng.random() < 0.5:
        body["echo"], body["logprobs"] = True, k
        return Spec(index, "structured", "/v1/completions", body, check=Check("echo", k=k))
    body["prompt_logprobs"], body["n"] = k, rng.choice([1, 2])
    if rng.random() < 0.3:
        body["logprobs"] = rng.randint(0, 3)
    return Spec(index, "structured", "/v1/completions", body, check=Check("prompt_logprobs", k=k))


def structured_spec(rng: random.Random, index: int, model: str | None) -> Spec:
    """One of: a constrained request (55%), a forced tool call (25%), prompt logprobs (20%)."""
    r = rng.random()
    if r < 0.55:
        return constrained_spec(rng, index, model)
    if r < 0.8:
        return tool_spec(rng, index, model)
    return prompt_logprobs_spec(rng, index, model)


def make_plan(num: int, seed: int, model: str | None, disconnect_frac: float, invalid_frac: float,
              max_tokens: int, oversized_frac: float = 0.0, slow_frac: float = 0.0,
              never_read_frac: float = 0.0, structured_frac: float = 0.0) -> list[Spec]:
    rng = random.Random(seed)
    makers = [(structured_frac, lambda i: structured_spec(rng, i, model)),
              (disconnect_frac, lambda i: disconnect_spec(rng, i, model)),
              (invalid_frac, lambda i: invalid_spec(rng, i, model)),
              (oversized_frac, lambda i: oversized_spec(rng, i, model)),
              (slow_frac, lambda i: slow_spec(rng, i, model, max_tokens)),
              (never_read_frac, lambda i: never_read_spec(rng, i, model))]
    plan = []
    for i in range(num):
        r, spec = rng.random(), None
        for frac, make in makers:
            if r < frac:
                spec = make(i)
                break
            r -= frac
        plan.append(spec or valid_spec(rng, i, model, max_tokens))
    return plan


# ------------------------------------------------------------------------------------------- running


@dataclass
class Outcome:
    index: int
    kind: str
    ok: bool
    detail: str = ""
    seconds: float = 0.0
    form: str = ""  # "structured": its Check's form
    finishes: dict[str, int] = field(default_factory=dict)  # "structured": its choices by finish_reason


def _check_choices(data: dict, spec: Spec) -> str:
    """'' when a non-streamed 200 body is complete and sane, else what is wrong."""
    choices = data.get("choices")
    prompts = spec.body.get("prompt") if spec.body else None
    num_prompts = len(prompts) if isinstance(prompts, list) and prompts and isinstance(prompts[0], str) else 1
    want = spec.body.get("n", 1) * num_prompts
    if not isinstance(choices, list) or len(choices) != want:
        return f"expected {want} choices, got {choices if not isinstance(choices, list) else len(choices)}"
    bad = [c.get("finish_reason") for c in choices if c.get("finish_reason") not in ("stop", "length")]
    if bad:
        return f"finish_reason {bad}"
    usage = data.get("usage") or {}
    if usage.get("completion_tokens", 0) > spec.body["max_tokens"] * want:
        return f"usage {usage} beyond max_tokens"
    return ""


def _request_args(spec: Spec) -> dict:
    if spec.raw is not None:
        return {"content": spec.raw, "headers": {"content-type": "application/json"}}
    return {"json": spec.body}


async def run_plain(client: httpx.AsyncClient, spec: Spec) -> str:
    resp = await client.post(spec.path, **_request_args(spec))
    if spec.kind in ("invalid", "oversized"):
        code = _error_code(resp)
        if resp.status_code != spec.expect_status or code != spec.expect_code:
            return f"expected {spec.expect_status} {spec.expect_code}, got {resp.status_code} {code}"
        return ""
    if resp.status_code != 200:
        return f"status {resp.status_code}: {resp.text[:200]}"
    return _check_choices(resp.json(), spec)


def _error_code(resp: httpx.Response) -> str | None:
    try:
        return resp.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


async def run_stream(client: httpx.AsyncClient, spec: Spec) -> str:
    async with client.stream("POST", spec.path, json=spec.body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return f"status {resp.status_code}: {resp.text[:200]}"
        finished, done = set(), False
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            event = json.loads(line[6:])
            if "error" in event:
                return f"stream error event {event['error']}"
            for choice in event.get("choices", []):
                if choice.get("finish_reason") is not None:
                    finished.add(choice["index"])
                    if choice["finish_reason"] not in ("stop", "length"):
                        return f"finish_reason {choice['finish_reason']}"
    return "" if done and finished else f"stream ended early (done={done}, finished={sorted(finished)})"


async def run_disconnect(client: httpx.AsyncClient, spec: Spec) -> str:
    """Hang up at the planned moment. Only a 5xx seen before hanging up is a failure."""
    if spec.hangup == "non_streaming":
        try:
            resp = await asyncio.wait_for(client.post(spec.path, json=spec.body), timeout=spec.hangup_after)
        except asyncio.TimeoutError:
            return ""
        return f"status {resp.status_code}" if resp.status_code >= 500 else ""
    async with client.stream("POST", spec.path, json=spec.body) as resp:
        if resp.status_code >= 500:
            return f"status {resp.status_code}"
        if spec.hangup == "before_first_token":
            return ""  # leaving the block unread closes the connection
        events = 0
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                if "\"error\"" in line:
                    return f"stream error event before hanging up: {line[:200]}"
                events += 1
                if events >= spec.hangup_after:
                    break
    return ""


async def _raw_connection(base_url: str, rcvbuf: int | None = None):
    host, port = base_url.split("//", 1)[1].rsplit(":", 1)
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    return await asyncio.open_connection(sock=sock)


def _raw_request(spec: Spec) -> bytes:
    body = json.dumps(spec.body).encode()
    return (f"POST {spec.path} HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


async def run_slow(base_url: str, spec: Spec) -> str:
    """Headers a few bytes at a time over hangup_after seconds (under the header timeout), then read it all."""
    reader, writer = await _raw_connection(base_url)
    data = _raw_request(spec)
    pieces = [data[i:i + 16] for i in range(0, len(data), 16)]
    try:
        for piece in pieces:
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(spec.hangup_after / len(pieces))
        response = await reader.read()
    finally:
        writer.close()
    head, _, body = response.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        return f"slow client got {head[:100]!r}"
    return ""


async def run_never_read(base_url: str, spec: Spec) -> str:
    """A stream that is never read (4 KiB receive buffer), then a hang-up: only the leak checks judge it."""
    _, writer = await _raw_connection(base_url, rcvbuf=4096)
    writer.write(_raw_request(spec))
    await asyncio.sleep(spec.hangup_after)
    writer.transport.abort()
    return ""


# ---------------------------------------------------------------- structured replies: assembled, then checked


def _reply(index: int) -> dict:
    """One choice as a client sees it: text, finish, stop_reason, tool calls by index, logprobs."""
    return {"index": index, "text": "", "reasoning": None, "finish_reason": None, "stop_reason": None, "calls": {},
            "logprobs": None, "prompt_logprobs": None}


def _reply_of_choice(choice: dict) -> dict:
    """A non-streamed choice (chat or completions) as a reply."""
    reply, message = _reply(choice["index"]), choice.get("message")
    reply["text"] = (message.get("content") or "") if message is not None else choice.get("text", "")
    reply["reasoning"] = (message or {}).get("reasoning_content")
    for i, call in enumerate((message or {}).get("tool_calls") or []):
        reply["calls"][i] = {"name": call["function"]["name"], "arguments": call["function"]["arguments"]}
    for key in ("finish_reason", "stop_reason", "logprobs", "prompt_logprobs"):
        reply[key] = choice.get(key)
    return reply


def _absorb_delta(reply: dict, choice: dict) -> None:
    """A streamed chunk's choice into its reply: text, and argument pieces per tool-call index."""
    delta = choice.get("delta")
    reply["text"] += (delta.get("content") or "") if delta is not None else choice.get("text", "")
    if (delta or {}).get("reasoning_content") is not None:
        reply["reasoning"] = (reply["reasoning"] or "") + delta["reasoning_content"]
    for tc in (delta or {}).get("tool_calls") or []:
        call = reply["calls"].setdefault(tc["index"], {"name": "", "arguments": ""})
        fn = tc.get("function") or {}
        call["name"] += fn.get("name") or ""
        call["arguments"] += fn.get("arguments") or ""
    if choice.get("finish_reason") is not None:
        reply["finish_reason"], reply["stop_reason"] = choice["finish_reason"], choice.get("stop_reason")


async def fetch_replies(client: httpx.AsyncClient, spec: Spec) -> dict:
    """{"error": what went wrong or "", "replies": [...], "usage": {...}}: the whole body, or the stream
    assembled from its deltas (which must end with [DONE])."""
    if not spec.stream:
        resp = await client.post(spec.path, json=spec.body)
        if resp.status_code != 200:
            return {"error": f"status {resp.status_code}: {resp.text[:200]}"}
        data = resp.json()
        return {"error": "", "replies": [_reply_of_choice(c) for c in data["choices"]], "usage": data.get("usage")}
    replies, done = {}, False
    async with client.stream("POST", spec.path, json=spec.body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return {"error": f"status {resp.status_code}: {resp.text[:200]}"}
        async for line in resp.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    return {"error": f"stream error event {event['error']}"}
                for choice in event.get("choices", []):
                    _absorb_delta(replies.setdefault(choice["index"], _reply(choice["index"])), choice)
    return {"error": "" if done else "stream ended without [DONE]", "replies": list(replies.values()), "usage": None}


def _validation_error(check: Check, text: str) -> str:
    """'' when a whole constrained text satisfies its constraint."""
    try:
        if check.form == "json_schema":
            jsonschema.validate(json.loads(text), check.schema)
        elif check.form == "json_object" and not isinstance(json.loads(text), dict):
            return "not a JSON object"
    except (ValueError, jsonschema.ValidationError) as exc:
        return f"{type(exc).__name__}: {str(exc)[:150]}"
    if check.form == "regex" and not regex.fullmatch(check.pattern, text):
        return f"does not match {check.pattern!r}"
    if check.form == "choice" and text not in check.choices:
        return f"not one of {check.choices}"
    return ""


def _prefix_error(check: Check, text: str) -> str:
    """'' when a cut-off text is a prefix the constraint allows (JSON is not checked)."""
    if check.form == "choice" and not any(c.startswith(text) for c in check.choices):
        return f"not a prefix of one of {check.choices}"
    if check.form == "regex" and not regex.fullmatch(check.pattern, text, partial=True):
        return f"not a prefix {check.pattern!r} allows"
    return ""


def whole_text(reply: dict) -> str:
    """The text the model wrote: reasoning_content (a --reasoning-parser split `<think>` off; the think regex
    writes exactly "\n\n" after `</think>`) put back before the content."""
    if reply["reasoning"] is None:
        return reply["text"]
    return f"<think>{reply['reasoning']}" + (f"</think>\n\n{reply['text']}" if reply["text"] else "")


def check_constrained(check: Check, reply: dict) -> str:
    """A constrained choice: whole and valid when it stopped by itself, else an allowed prefix."""
    finish, text = reply["finish_reason"], whole_text(reply)
    if finish not in ("stop", "length"):
        return f"finish_reason {finish}"
    cut = finish == "length" or isinstance(reply["stop_reason"], str)
    error = _prefix_error(check, text) if cut else _validation_error(check, text)
    return f"{check.form} output {text[:120]!r} ({finish}): {error}" if error else ""


def check_tool_calls(check: Check, reply: dict) -> str:
    """Tool calls: finish tool_calls, known (or the named) tools, arguments valid for the tool, no call markup
    left in the content; cut off (`length`, or `stop` by a stop string) nothing is checked."""
    finish, calls = reply["finish_reason"], [reply["calls"][i] for i in sorted(reply["calls"])]
    if finish == "length" or (finish == "stop" and isinstance(reply["stop_reason"], str)):
        return ""  # cut off (max_tokens, a stop string): whatever was read so far
    if finish != "tool_calls" or not calls or "tool_call>" in reply["text"]:
        return f"finish_reason {finish} with {len(calls)} calls, text {reply['text'][:120]!r}"
    if check.single and len(calls) > 1:
        return f"{len(calls)} calls with parallel_tool_calls false"
    for call in calls:
        if call["name"] not in check.tools or (check.named and call["name"] != check.named):
            return f"call of {call['name']!r} (tools {sorted(check.tools)}, named {check.named})"
        try:
            jsonschema.validate(json.loads(call["arguments"]), check.tools[call["name"]])
        except (ValueError, jsonschema.ValidationError) as exc:
            return f"arguments {call['arguments'][:120]!r}: {type(exc).__name__}: {str(exc)[:120]}"
    return ""


def _tops_error(entries: list, k: int, what: str) -> str:
    """Each entry after the first has 1..k+1 top logprobs; the first is null."""
    if not entries or entries[0] is not None:
        return f"{what}: the first prompt token's entry is {entries[:1]}, not null"
    bad = [i for i, e in enumerate(entries[1:], 1) if not isinstance(e, dict) or not 1 <= len(e) <= k + 1]
    return f"{what}: entries {bad[:5]} hold not 1..{k + 1} logprobs" if bad else ""


def check_echo(check: Check, reply: dict, usage: dict) -> str:
    """echo + logprobs (n=1): a token per prompt and output token, the first logprob null, the rest numbers."""
    lps = reply["logprobs"] or {}
    tokens, values = lps.get("tokens") or [], lps.get("token_logprobs") or []
    want = usage["prompt_tokens"] + usage["completion_tokens"]
    if len(tokens) != want or len(values) != want:
        return f"echo: {len(tokens)} tokens, {len(values)} logprobs for {want} prompt + output tokens"
    if values[0] is not None or not all(isinstance(v, (int, float)) for v in values[1:]):
        return f"echo: token_logprobs {values[:3]}... (the first must be null, the rest numbers)"
    return _tops_error(lps.get("top_logprobs") or [], max(check.k, 1), "echo top_logprobs")


def check_prompt_logprobs(check: Check, reply: dict, usage: dict) -> str:
    """prompt_logprobs: one entry per prompt token (the first null), each with the token and the top k."""
    entries = reply["prompt_logprobs"] or []
    if len(entries) != usage["prompt_tokens"]:
        return f"prompt_logprobs: {len(entries)} entries for {usage['prompt_tokens']} prompt tokens"
    return _tops_error(entries, check.k, "prompt_logprobs")


def _close(a: dict | None, b: dict | None, tol: float = 1e-3) -> bool:
    """Two prompt-logprob entries hold the same tokens with logprobs within tol."""
    if a is None or b is None:
        return a is b
    return a.keys() == b.keys() and all(abs(a[t]["logprob"] - b[t]["logprob"]) <= tol for t in a)


def same_prompt_logprobs(replies: list[dict]) -> str:
    """The n choices of one prompt carry the same prompt logprobs (one prompt, one forward of it)."""
    first = replies[0]["prompt_logprobs"] or []
    for reply in replies[1:]:
        other = reply["prompt_logprobs"] or []
        bad = [i for i, (a, b) in enumerate(zip(first, other)) if not _close(a, b)]
        if len(other) != len(first) or bad:
            return f"prompt_logprobs differ between choices 0 and {reply['index']} at positions {bad[:5]}"
    return ""


def check_reply(check: Check, reply: dict, usage: dict | None) -> str:
    """'' when one choice satisfies its request's Check."""
    if check.form == "tools":
        return check_tool_calls(check, reply)
    if check.form == "echo":
        return check_echo(check, reply, usage)
    if check.form == "prompt_logprobs":
        return check_prompt_logprobs(check, reply, usage)
    return check_constrained(check, reply)


async def run_structured(client: httpx.AsyncClient, spec: Spec, finishes: dict[str, int]) -> str:
    """Send a structured request, count its choices' finish reasons, check every choice."""
    got = await fetch_replies(client, spec)
    if got["error"]:
        return got["error"]
    replies, want = got["replies"], spec.body.get("n", 1)
    if len(replies) != want:
        return f"expected {want} choices, got {len(replies)}"
    for reply in replies:
        finishes[str(reply["finish_reason"])] = finishes.get(str(reply["finish_reason"]), 0) + 1
    errors = [e for e in (check_reply(spec.check, r, got["usage"]) for r in replies) if e]
    if spec.check.form == "prompt_logprobs":
        errors += [same_prompt_logprobs(replies)]
    return next((e for e in errors if e), "")


async def run_one(client: httpx.AsyncClient, spec: Spec, timeout: float) -> Outcome:
    start = time.monotonic()
    base_url = str(client.base_url).rstrip("/")
    finishes: dict[str, int] = {}
    try:
        if spec.kind == "slow":
            coro = run_slow(base_url, spec)
        elif spec.kind == "never_read":
            coro = run_never_read(base_url, spec)
        elif spec.kind == "disconnect":
            coro = run_disconnect(client, spec)
        elif spec.kind == "structured":
            coro = run_structured(client, spec, finishes)
        elif spec.stream:
            coro = run_stream(client, spec)
        else:
            coro = run_plain(client, spec)
        detail = await asyncio.wait_for(coro, timeout=timeout)
    except asyncio.TimeoutError:
        detail = f"no answer within {timeout:.0f} s"
    except (httpx.HTTPError, ValueError, KeyError, TypeError, OSError) as exc:
        detail = f"{type(exc).__name__}: {exc}"
    form = spec.check.form if spec.check else ""
    return Outcome(spec.index, spec.kind, not detail, detail, time.monotonic() - start, form, finishes)


async def run_plan(base_url: str, plan: list[Spec], concurrency: int, timeout: float, time_limit: float,
                   progress: bool) -> list[Outcome]:
    queue: asyncio.Queue[Spec] = asyncio.Queue()
    for spec in plan:
        queue.put_nowait(spec)
    outcomes: list[Outcome] = []
    bar = tqdm(total=len(plan), desc="soak", disable=not progress, unit="req")
    deadline = time.monotonic() + time_limit
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits) as client:
        async def worker() -> None:
            while not queue.empty() and time.monotonic() < deadline:
                spec = queue.get_nowait()
                outcomes.append(await run_one(client, spec, min(timeout, max(1.0, deadline - time.monotonic()))))
                bar.update(1)
                if not outcomes[-1].ok:
                    bar.set_postfix(failures=sum(not o.ok for o in outcomes))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    bar.close()
    done = {o.index for o in outcomes}
    outcomes += [Outcome(s.index, s.kind, False, "not run: time limit reached") for s in plan if s.index not in done]
    return outcomes


# ------------------------------------------------------------------------------------------- the server


def read_metrics(client: httpx.Client) -> dict[str, float]:
    """Unlabelled samples by name, labelled ones as name{k=v,...}."""
    out = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def wait_idle(client: httpx.Client, timeout: float) -> dict[str, float]:
    """The metrics once nothing runs or waits (or the last read at the timeout)."""
    end = time.monotonic() + timeout
    while True:
        m = read_metrics(client)
        idle = m.get("kvserve_requests_running", 0) == 0 and m.get("kvserve_requests_waiting", 0) == 0
        if (idle and m.get("kvserve_kv_blocks_used", 0) == 0) or time.monotonic() > end:
            return m
        time.sleep(0.2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m server serve` on a free loopback port; its output goes to a log file."""

    def __init__(self, model: str | None, extra_args: list[str], startup_timeout: float):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kvserve-soak-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "server", "serve", "--port", str(self.port), "--log-level", "warning"]
        cmd += (["--model", model] if model else []) + extra_args
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_ready(startup_timeout)

    def _wait_ready(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.base_url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"the server was not ready within {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        return Path(self.log.name).read_text(errors="replace")[-chars:]

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def rss(pid: int | None) -> int | None:
    """Resident bytes of the server: the process and all its children (the engine core is one: its grammar
    matchers, caches and KV pool live there, not in the front end that `pid` is)."""
    if not pid:
        return None
    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.Error:
        return None
    return sum(_rss_of(p) for p in procs)


def _rss_of(proc: psutil.Process) -> int:
    """One process's resident bytes; 0 once it has gone."""
    try:
        return proc.memory_info().rss
    except psutil.Error:
        return 0


# ------------------------------------------------------------------------------------------- the report


@dataclass
class Report:
    num_requests: int
    by_kind: dict[str, int]
    unexpected_failures: int
    failures: list[dict]  # the first few, for the eye
    leaked_blocks: float
    idle_invariant_violations: float
    rss_start_bytes: int | None
    rss_end_bytes: int | None
    rss_growth: float | None
    elapsed_s: float
    requests_per_s: float
    finished_by_reason: dict[str, float]
    server_healthy_after: bool
    structured_finishes: dict[str, dict[str, int]] = field(default_factory=dict)  # form -> finish -> choices
    preemptions: float = float("nan")  # kvserve_preemptions_total at the end (a small --num-kv-blocks: many)
    criteria: dict[str, bool] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(self.criteria.values())


def structured_finishes(outcomes: list[Outcome]) -> dict[str, dict[str, int]]:
    """The structured requests' choices by form, then finish_reason (failed requests included)."""
    out: dict[str, dict[str, int]] = {}
    for o in outcomes:
        for reason, count in o.finishes.items():
            by_reason = out.setdefault(o.form, {})
            by_reason[reason] = by_reason.get(reason, 0) + count
    return out


def _finishes_row(r: Report) -> str:
    """'json_schema 40/52 stop, ...': how many of each constrained form's choices ended by themselves."""
    return ", ".join(f"{form} {c.get('stop', 0) + c.get('tool_calls', 0)}/{sum(c.values())} stop"
                     for form, c in sorted(r.structured_finishes.items())
                     if form not in ("echo", "prompt_logprobs")) or "none"


def make_report(plan, outcomes, metrics_end, rss_start, rss_end, elapsed, healthy, max_growth) -> Report:
    failed = sorted((o for o in outcomes if not o.ok), key=lambda o: o.index)
    kinds = {k: sum(s.kind == k for s in plan)
             for k in ("valid", "structured", "disconnect", "invalid", "oversized", "slow", "never_read")}
    growth = None if not rss_start or rss_end is None else (rss_end - rss_start) / rss_start
    reasons = {k.split("reason=")[1].rstrip("}"): v for k, v in metrics_end.items()
               if k.startswith("kvserve_requests_finished_total{")}
    report = Report(len(plan), kinds, len(failed), [asdict(o) for o in failed[:20]],
                    metrics_end.get("kvserve_kv_blocks_used", float("nan")),
                    metrics_end.get("kvserve_idle_invariant_violations_total", float("nan")),
                    rss_start, rss_end, growth, elapsed, len(plan) / elapsed if elapsed else 0.0, reasons, healthy,
                    structured_finishes(outcomes), metrics_end.get("kvserve_preemptions_total", float("nan")))
    report.criteria = {"no_unexpected_failures": not failed,
                       "no_leaked_blocks": report.leaked_blocks == 0 and report.idle_invariant_violations == 0,
                       "rss_growth_ok": growth is None or growth < max_growth,
                       "healthy_after": healthy}
    return report


def print_table(r: Report) -> None:
    mib = lambda b: "n/a" if b is None else f"{b / 2 ** 20:.1f} MiB"  # noqa: E731
    rows = [("requests", f"{r.num_requests} ({', '.join(f'{k} {v}' for k, v in r.by_kind.items())})"),
            ("unexpected failures", str(r.unexpected_failures)),
            ("leaked KV blocks (idle)", f"{r.leaked_blocks:g}"),
            ("idle-invariant violations", f"{r.idle_invariant_violations:g}"),
            ("RSS start -> end", f"{mib(r.rss_start_bytes)} -> {mib(r.rss_end_bytes)}"),
            ("RSS growth", "n/a" if r.rss_growth is None else f"{100 * r.rss_growth:+.2f}%"),
            ("structured choices", _finishes_row(r)),
            ("preemptions", f"{r.preemptions:g}"),
            ("finished by reason", ", ".join(f"{k} {v:g}" for k, v in sorted(r.finished_by_reason.items()))),
            ("elapsed", f"{r.elapsed_s:.1f} s ({r.requests_per_s:.1f} req/s)"),
            ("healthy after", str(r.server_healthy_after)),
            ("PASSED" if r.passed else "FAILED", ", ".join(k for k, ok in r.criteria.items() if not ok) or "all")]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    for f in r.failures:
        print(f"  failure #{f['index']} ({f['kind']}): {f['detail']}")


# ------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=None, help="an already running server (default: start one)")
    p.add_argument("--server-pid", type=int, default=None, help="with --base-url: the pid whose RSS to watch")
    p.add_argument("--model", default=None, help="model for the started server (default: the embedded SmolLM2)")
    p.add_argument("--served-model-name", default=None, help="model name to send (default: none, allowed)")
    p.add_argument("--server-arg", action="append", default=[], help="extra flag for the started server")
    p.add_argument("--num-requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--disconnect-frac", type=float, default=0.10)
    p.add_argument("--invalid-frac", type=float, default=0.05)
    p.add_argument("--oversized-frac", type=float, default=0.05)
    p.add_argument("--slow-frac", type=float, default=0.03)
    p.add_argument("--never-read-frac", type=float, default=0.03)
    p.add_argument("--structured-frac", type=float, default=0.15,
                   help="constrained outputs, forced tool calls and prompt logprobs, each checked")
    p.add_argument("--max-tokens", type=int, default=48, help="largest max_tokens of a valid request")
    p.add_argument("--warmup", type=int, default=20, help="valid requests before RSS is first measured")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--time-limit", type=float, default=3600.0, help="seconds for the whole run")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--max-rss-growth", type=float, default=0.10)
    p.add_argument("--json-out", default="soak.json")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def soak(args: argparse.Namespace, base_url: str, pid: int | None) -> Report:
    model = args.served_model_name
    # Structured requests in the warm-up too: the grammar tokenizer and compile caches are built once.
    warm = make_plan(args.warmup, args.seed + 1, model, 0.0, 0.0, args.max_tokens,
                     structured_frac=min(0.5, 2 * args.structured_frac))
    asyncio.run(run_plan(base_url, warm, args.concurrency, args.request_timeout, args.time_limit, False))
    with httpx.Client(base_url=base_url, timeout=30) as client:
        wait_idle(client, 60)
        rss_start = rss(pid)
        plan = make_plan(args.num_requests, args.seed, model, args.disconnect_frac, args.invalid_frac,
                         args.max_tokens, args.oversized_frac, args.slow_frac, args.never_read_frac,
                         args.structured_frac)
        start = time.monotonic()
        outcomes = asyncio.run(run_plan(base_url, plan, args.concurrency, args.request_timeout,
                                        args.time_limit, not args.no_progress))
        elapsed = time.monotonic() - start
        metrics_end = wait_idle(client, 60)
        rss_end = rss(pid)
        healthy = client.get("/health").status_code == 200
    return make_report(plan, outcomes, metrics_end, rss_start, rss_end, elapsed, healthy, args.max_rss_growth)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    server = None
    if args.base_url is None:
        print(f"starting a server ({args.model or 'the embedded default'}) ...", file=sys.stderr)
        server = ServerProcess(args.model, args.server_arg, args.startup_timeout)
    base_url = args.base_url or server.base_url
    pid = args.server_pid if server is None else server.proc.pid
    try:
        report = soak(args, base_url, pid)
    finally:
        exit_code = server.stop() if server is not None else None
    result = {**asdict(report), "passed": report.passed, "server_exit_code": exit_code,
              "args": {k: v for k, v in vars(args).items()}}
    Path(args.json_out).write_text(json.dumps(result, indent=2))
    print_table(report)
    if server is not None and exit_code != 0:
        print(f"the server exited with {exit_code}:\n{server.log_tail()}", file=sys.stderr)
    print(f"wrote {args.json_out}")
    return 0 if report.passed and exit_code in (0, None) else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
