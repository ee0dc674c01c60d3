"""The soak's structured requests (benchmarks/soak.py): constrained outputs (random small JSON schemas,
json_object, regexes, choices), forced and parsed tool calls, prompt logprobs; each Spec carries the Check
its reply must pass (bench/soak_checks.py)."""
from __future__ import annotations

import json
import random

from bench.soak_spec import WORDS, Check, Spec, random_text

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
        body["messages"] = [{"role": "user", "content": random_text(rng, 1, 20)}]
        if rng.random() < 0.2:
            body["logprobs"], body["top_logprobs"] = True, rng.randint(0, 5)
        return Spec(index, "structured", "/v1/chat/completions", body, stream=stream, check=check)
    body["prompt"] = random_text(rng, 1, 30)
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
    prompt = rng.choice(PROMPT_POOL) if r < 0.45 else random_text(rng, 1, 40) if r < 0.75 else [
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
