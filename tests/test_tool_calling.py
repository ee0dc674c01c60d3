"""Tool calling and reasoning: the parsers (whole text and every chunking agree), a multi-turn conversation with
tool calls through a Qwen-style template, tool_choice required / named from a random model (the grammar makes the
calls valid), and the openai client's tool loop against the real server."""
from __future__ import annotations

import json
import random

import httpx
import jsonschema
import pytest

from server.tool_parsers import (HermesParser, Llama3JsonParser, MistralParser, ReasoningParser, StreamingReasoning,
                                 StreamingToolParser)
from server_utils import ServerThread

CANNED = {
    HermesParser: ['Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
                   '\n<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>',
                   "No tools needed: 3 < 4 and <tool is not a tag."],
    Llama3JsonParser: ['<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                       '{"name": "get_time", "parameters": {}}',
                       '{"name": "search", "parameters": {"q": "a;b {c}"}}', "Plain {answer} text."],
    MistralParser: ['Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}}]',
                    "[TOOL_CALLS is not complete here"],
}


def chunkings(text: str, tokenizer) -> list[list[str]]:
    rng = random.Random(len(text))
    ids = tokenizer.encode(text, add_special_tokens=False)
    by_token = [tokenizer.decode(ids[:i + 1])[len(tokenizer.decode(ids[:i])):] for i in range(len(ids))]
    out = [[text], list(text), by_token]
    for _ in range(5):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        out.append([text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])])
    return out


def streamed(parser, pieces: list[str]):
    s = StreamingToolParser(parser)
    content = "".join(s.feed(p) for p in pieces)
    rest, calls = s.finish()
    return content + rest, [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("parser_cls, text", [(p, t) for p, texts in CANNED.items() for t in texts])
def test_parsers_agree_in_every_chunking(parser_cls, text, smollm2_tokenizer):
    content, calls = parser_cls().parse(text)
    whole = (content, [(c.name, json.loads(c.arguments)) for c in calls])
    assert bool(calls) == ("get_" in text or "search" in text)
    for pieces in chunkings(text, smollm2_tokenizer):
        assert "".join(pieces) == text
        assert streamed(parser_cls(), pieces) == whole, pieces


@pytest.mark.parametrize("text", ["<think>step 1, then 2</think>\n\nThe answer is 4.", "No thinking here.",
                                  "<think>unfinished thought", "<thin is not a tag"])
def test_reasoning_split_agrees_in_every_chunking(text, smollm2_tokenizer):
    want = ReasoningParser().split(text)
    for pieces in chunkings(text, smollm2_tokenizer):
        s = StreamingReasoning()
        parts = [s.feed(p, i == len(pieces) - 1) for i, p in enumerate(pieces)]
        thought = "".join(t for t, _ in parts)
        assert (thought if want[0] is not None else None, "".join(c for _, c in parts)) == want, pieces


def test_auto_parser_is_told_from_the_template():
    from server.tool_parsers import parser_for

    assert isinstance(parser_for("auto", QWEN_STYLE), HermesParser)
    assert isinstance(parser_for("auto", "{{ '[TOOL_CALLS]' }}"), MistralParser)
    assert parser_for("auto", "{{ messages }}") is None


# ---- the server ----------------------------------------------------------------------------------------

QWEN_STYLE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n"
    "</tools><|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{{ m.content }}"
    "{%- for c in m.tool_calls %}\n<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{%- endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 12},
                                                "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                                                "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
    "additionalProperties": False}}}
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 2})}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with ServerThread(tiny_model_dir("qwen2"), served_model_name="tiny", tool_call_parser="hermes",
                      reasoning_parser=True) as s:
        yield s


def chat(server, **body) -> dict:
    resp = httpx.post(server.url("/v1/chat/completions"), timeout=120,
                      json={"model": "tiny", "max_tokens": 120, "chat_template": QWEN_STYLE, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_conversation_with_tool_calls_reaches_the_template(server):
    from server import protocol as P
    from server.serving import template_options

    req = P.ChatCompletionRequest.model_validate({"messages": CONVERSATION, "tools": [WEATHER],
                                                  "chat_template_kwargs": {"enable_thinking": False}})
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(server.engine_config.model)
    text = tok.apply_chat_template(P.message_dicts(req.messages), tokenize=False, chat_template=QWEN_STYLE,
                                   **template_options(req))
    assert '"name": "get_weather"' in text and '{"city": "Paris", "days": 2}' in text
    assert "<tool_response>\nsunny, 21C\n</tool_response>" in text and "<tools>" in text
    assert text.endswith("<think>\n\n</think>\n\n")
    req = P.ChatCompletionRequest.model_validate({"messages": [*CONVERSATION[:1], {
        "role": "assistant", "content": "It is"}], "continue_final_message": True})
    text = tok.apply_chat_template(P.message_dicts(req.messages), tokenize=False, chat_template=QWEN_STYLE,
                                   **template_options(req))
    assert text.endswith("<|im_start|>assistant\nIt is")
    body = chat(server, messages=CONVERSATION, tools=[WEATHER], tool_choice="none", max_tokens=4)
    assert body["choices"][0]["message"].get("tool_calls") is None


@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named_tool_choice_from_a_random_model(server, stream):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        body = dict(messages=CONVERSATION[:1], tools=[WEATHER, TIME], tool_choice=choice, temperature=1.0, seed=2)
        calls, finish = (streamed_calls(server, body) if stream else _calls(chat(server, **body)))
        assert finish == "tool_calls" and calls
        for call in calls:
            assert call["id"].startswith("call_") and call["type"] == "function"
            jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
        if choice != "required":
            assert [c["function"]["name"] for c in calls] == ["get_time"]


def _calls(body: dict):
    choice = body["choices"][0]
    return choice["message"]["tool_calls"], choice["finish_reason"]


def streamed_calls(server, body: dict):
    from server_utils import sse_events

    with httpx.stream("POST", server.url("/v1/chat/completions"), timeout=120, json={
            "model": "tiny", "max_tokens": 120, "chat_template": QWEN_STYLE, "stream": True, **body}) as resp:
        events = [e for e in sse_events(resp) if e != "[DONE]" and e["choices"]]
    calls = [c for e in events for c in e["choices"][0]["delta"].get("tool_calls", [])]
    return calls, events[-1]["choices"][0]["finish_reason"]


def test_openai_tool_loop(server):
    """The client's loop: a forced call, the tool's result sent back, a plain reply."""
    from openai import OpenAI

    client = OpenAI(base_url=server.url("/v1"), api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "What time is it in Berlin?"}]
    extra = {"chat_template": QWEN_STYLE}
    first = client.chat.completions.create(model="tiny", messages=messages, tools=[TIME], max_tokens=60,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}},
                                           extra_body=extra)
    message = first.choices[0].message
    assert message.tool_calls and message.tool_calls[0].function.name == "get_time"
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls:
        args = json.loads(call.function.arguments)
        messages.append({"role": "tool", "tool_call_id": call.id, "content": f"12:00 {args['tz']}"})
    second = client.chat.completions.create(model="tiny", messages=messages, tools=[TIME], max_tokens=8,
                                            tool_choice="none", extra_body=extra)
    assert second.choices[0].message.tool_calls is None and second.choices[0].finish_reason in ("stop", "length")


def test_tool_choice_errors(server):
    def err(**body):
        resp = httpx.post(server.url("/v1/chat/completions"), timeout=60,
                          json={"model": "tiny", "max_tokens": 4, "messages": CONVERSATION[:1], **body})
        assert resp.status_code == 400, resp.text
        return resp.json()["error"]["param"]

    assert err(tool_choice="required") == "tool_choice"
    assert err(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}) == "tool_choice"
    assert err(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}) == "tool_choice"
