"""The soak's plan as plain data (benchmarks/soak.py): a Spec per planned request, and the Check that a
structured request's reply must pass. Client side only: nothing of kvserve's engine or server is imported."""
from __future__ import annotations

import random
from dataclasses import dataclass

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex every bold jumping zebra "
         "under grey skies rivers run to the sea and all the kings men could not mend it again").split()


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


def random_text(rng: random.Random, lo: int, hi: int) -> str:
    """lo to hi random words."""
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))
