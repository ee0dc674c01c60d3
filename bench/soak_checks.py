"""The soak's structured replies (benchmarks/soak.py): read whole or assembled from a stream's deltas, then
checked against their request's Check (bench/soak_spec.py)."""
from __future__ import annotations

import json

import httpx
import jsonschema
import regex

from bench.soak_spec import Check, Spec

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
