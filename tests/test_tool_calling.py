"""Tool calling and reasoning: the parsers (whole text and every chunking agree), a multi-turn conversation with
tool calls through a Qwen-style template, tool_choice required / named from a random model (the grammar makes the
calls valid), and the openai client's tool loop against the real server."""
from __future__ import annotations

import itertools
import json
import random
import re

import httpx
import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.reasoning import ReasoningParser, StreamingReasoning
from server.tool_parsers import HermesParser, Llama3JsonParser, MistralParser, NamedParser, RequiredParser
from server.tools import piece_delta
from server_utils import ServerThread

# (parser, text, the calls' names: what the whole-text parse must find)
CANNED = [
    (HermesParser(), 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                     '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>',
     ["get_weather", "get_time"]),
    (HermesParser(), '<tool_call>{"arguments": {"q": "a \\"} </tool_call> [", "n": [1, {"x": null}]}, '
                     '"name": "search"}</tool_call>\nDone.', ["search"]),
    (HermesParser(), '<tool_call>{"name": "f", "arguments": "{\\"a\\": \\"\u00e9\\"}"}</tool_call>', ["f"]),
    (HermesParser(), "No tools needed: 3 < 4 and <tool is not a tag.", []),
    (HermesParser(), '<tool_call>{"arguments": {}}</tool_call> has no name', []),
    (Llama3JsonParser(), '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                         '{"name": "get_time", "parameters": {}}', ["get_weather", "get_time"]),
    (Llama3JsonParser(), '{"name": "search", "parameters": {"q": "a;b {c}", "k": 10}}', ["search"]),
    (Llama3JsonParser(), '{"name": "search", "k": 5, "parameters": {"q": "x"}, "strict": true}', ["search"]),
    (Llama3JsonParser(), "Plain {answer} text.", []),
    (Llama3JsonParser(), '{"answer": 42}', []),
    (MistralParser(), 'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome", "days": 3}}, '
                      '{"name": "get_time", "arguments": {"tz": "UTC"}}]', ["get_weather", "get_time"]),
    (MistralParser(), '[TOOL_CALLS]{"name": "ping", "arguments": {}}', ["ping"]),
    (MistralParser(), '[TOOL_CALLS] [{"name": "a", "arguments": {}, "n": 7}, {"name": "b", "arguments": 12.5}]',
     ["a", "b"]),
    (MistralParser(), "[TOOL_CALLS is not complete here", []),
    (RequiredParser(), '[{"name": "get_time", "parameters": {"tz": "CET"}}, {"name": "get_weather", '
                       '"parameters": {"city": "Nice", "days": 1}}]', ["get_time", "get_weather"]),
    (NamedParser("get_weather"), '{"city": "Lyon", "days": 2}', ["get_weather"]),
]


def chunkings(text: str, tokenizer) -> list[list[str]]:
    rng = random.Random(len(text))
    ids = tokenizer.encode(text, add_special_tokens=False)
    by_token = [tokenizer.decode(ids[:i + 1])[len(tokenizer.decode(ids[:i])):] for i in range(len(ids))]
    out = [[text], list(text), by_token]
    for _ in range(5):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        out.append([text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])])
    return out


def counter_ids():
    count = itertools.count()
    return lambda: f"call_{next(count)}"


def stream_deltas(parser, pieces: list[str]) -> list[dict]:
    """The OpenAI deltas a stream sends for these text pieces, in order."""
    s = parser.stream(counter_ids())
    out = [piece_delta(p) for text in pieces for p in s.feed(text)]
    return out + [piece_delta(p) for p in s.finish()]


def reassemble(deltas: list[dict]) -> tuple[str, list[dict], dict[int, int]]:
    """(content, calls, argument pieces per call) as a client accumulates them, checking OpenAI's shape: a
    call's first delta has index, id, type, name and empty arguments; later ones only arguments."""
    content, calls, pieces = "", {}, {}
    for delta in deltas:
        content += delta.get("content", "")
        for tc in delta.get("tool_calls", []):
            i = tc["index"]
            if i not in calls:
                assert set(tc) == {"index", "id", "type", "function"} and tc["type"] == "function", tc
                assert tc["id"] and tc["function"]["name"] and tc["function"]["arguments"] == "", tc
                calls[i] = {"id": tc["id"], "name": tc["function"]["name"], "arguments": ""}
                pieces[i] = 0
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}, tc
                calls[i]["arguments"] += tc["function"]["arguments"]
                pieces[i] += 1
    assert sorted(calls) == list(range(len(calls)))
    return content, [calls[i] for i in sorted(calls)], pieces


@pytest.mark.parametrize("parser, text, names", CANNED, ids=[f"{type(p).__name__}-{i}" for i, (p, *_) in
                                                            enumerate(CANNED)])
def test_streamed_calls_reassemble_to_the_whole_parse(parser, text, names, smollm2_tokenizer):
    content, calls = parser.parse(text, counter_ids())
    assert [c.name for c in calls] == names
    want = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in calls]
    for c in calls:
        json.loads(c.arguments)  # every canned call has JSON arguments
    streaming = [i for i, c in enumerate(calls)  # an object written after the name, as the model wrote it
                 if len(c.arguments) > 2 and c.arguments[0] == "{" and text.find(c.name) < text.find(c.arguments)]
    for pieces in chunkings(text, smollm2_tokenizer):
        assert "".join(pieces) == text
        got_content, got, arg_pieces = reassemble(stream_deltas(parser, pieces))
        assert (got_content, got) == (content, want), pieces
        assert [json.loads(c["arguments"]) for c in got] == [json.loads(c["arguments"]) for c in want]
        if len(pieces) == len(text):  # a character at a time: arguments written after the name come in pieces
            assert all(arg_pieces[i] > 1 for i in streaming), (arg_pieces, streaming)


FRAGMENTS = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "{", "}", "[", "]", '"', "\\", ":",
             ",", ";", " ", "\n", '"name"', '"arguments"', '"parameters"', '"f"', "1", "true", "x", "<tool",
             '{"name": "g", "arguments": {"a": [1, "}"]}}', '"a\\"b"', "some text"]
PARSERS = [HermesParser(), MistralParser(), Llama3JsonParser(), RequiredParser(), NamedParser("n")]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(FRAGMENTS), min_size=1, max_size=25), st.lists(st.integers(1, 400), max_size=8),
       st.sampled_from(range(len(PARSERS))))
def test_any_text_streams_as_it_parses(fragments, cuts, which):
    """Whatever the text (well-formed calls, broken ones, markers inside strings, bare text) and wherever it is
    cut, the stream's deltas reassemble to the whole parse, in OpenAI's delta shape."""
    text, parser = "".join(fragments), PARSERS[which]
    content, calls = parser.parse(text, counter_ids())
    want = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in calls]
    cuts = sorted({c for c in cuts if c < len(text)})
    for pieces in ([text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])], list(text)):
        got_content, got, _ = reassemble(stream_deltas(parser, pieces))
        assert (got_content, got) == (content, want)


def test_nothing_is_sent_before_it_is_certain():
    """Fed a character at a time, a call starts once its name has closed (before its arguments end), and no
    piece of a closing tag or marker goes out as content or arguments."""
    text = 'Hi <tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
    s = HermesParser().stream(counter_ids())
    sent = []
    for n, ch in enumerate(text, 1):
        sent += [(n, piece_delta(p)) for p in s.feed(ch)]
    starts = [n for n, d in sent if "id" in d.get("tool_calls", [{}])[0]]
    assert starts == [text.index('"get_time"') + len('"get_time"')]
    assert "".join(d.get("content", "") for _, d in sent) == "Hi "
    args = "".join(d["tool_calls"][0]["function"]["arguments"] for _, d in sent if "tool_calls" in d)
    assert args == '{"tz": "CET"}' and s.finish() == []


def test_a_cut_off_call_keeps_what_was_sent():
    """max_tokens can end a call midway: the stream and the whole parse both keep the call with the argument
    text so far (OpenAI's own `arguments` are cut the same way; finish_reason stays `length`)."""
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Par'
    content, calls = HermesParser().parse(text)
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Par')]
    assert HermesParser().parse('<tool_call>{"nam') == ('<tool_call>{"nam', [])


@pytest.mark.parametrize("text", ['[', '[{"nam', '[{"name": "get_we', '[{"name": "get_weather", "parameters": {"ci'])
def test_a_forced_reply_cut_short_is_never_content(text):
    """tool_choice required: the grammar wrote the reply, so a reply cut before its first call's name closed
    is no content (not a JSON fragment shown as the assistant's words), whole or streamed in any chunking;
    once the name closed, the call is kept with its arguments so far."""
    want = RequiredParser().parse(text)
    assert want[0] == "" and [c.name for c in want[1]] == (["get_weather"] if "parameters" in text else [])
    for cut in range(1, len(text)):
        s = RequiredParser().stream()
        pieces = s.feed(text[:cut]) + s.feed(text[cut:]) + s.finish()
        assert "".join(p.content for p in pieces) == "" and [c.name for c in s.calls] == [c.name for c in want[1]]


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
                      reasoning_parser=True, chat_template=QWEN_STYLE) as s:
        yield s


def chat(server, **body) -> dict:
    resp = httpx.post(server.url("/v1/chat/completions"), timeout=120,
                      json={"model": "tiny", "max_tokens": 120, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_conversation_with_tool_calls_reaches_the_template(server):
    from server import protocol as P
    from server import request_params as RP
    from server.serving import template_options

    req = P.ChatCompletionRequest.model_validate({"messages": CONVERSATION, "tools": [WEATHER],
                                                  "chat_template_kwargs": {"enable_thinking": False}})
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(server.engine_config.model)
    text = tok.apply_chat_template(RP.message_dicts(req.messages), tokenize=False, chat_template=QWEN_STYLE,
                                   **template_options(req))
    assert '"name": "get_weather"' in text and '{"city": "Paris", "days": 2}' in text
    assert "<tool_response>\nsunny, 21C\n</tool_response>" in text and "<tools>" in text
    assert text.endswith("<think>\n\n</think>\n\n")
    req = P.ChatCompletionRequest.model_validate({"messages": [*CONVERSATION[:1], {
        "role": "assistant", "content": "It is"}], "continue_final_message": True})
    text = tok.apply_chat_template(RP.message_dicts(req.messages), tokenize=False, chat_template=QWEN_STYLE,
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


def test_forced_arguments_keep_the_tools_key_order(server):
    """A named tool_choice's arguments come in the order of the tool's properties (`days` before `city` here),
    not sorted: the grammar follows the schema as the client wrote it."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 7},
                                         "city": {"type": "string", "maxLength": 6}},
        "required": ["days", "city"], "additionalProperties": False}}}
    forced = {"type": "function", "function": {"name": "get_weather"}}
    calls, finish = _calls(chat(server, messages=CONVERSATION[:1], tools=[tool], tool_choice=forced,
                                temperature=0.0, max_tokens=60))
    assert finish == "tool_calls" and list(json.loads(calls[0]["function"]["arguments"])) == ["days", "city"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_by_a_stop_string_does_not_finish_as_tool_calls(server, stream):
    """Found by the soak's probes: a named tool_choice whose arguments a stop string cut (`{`) came back with
    finish_reason `tool_calls`, which tells a client the call is whole. Like a call cut by max_tokens
    (`length`), it keeps its own finish reason (`stop`); a whole call still finishes as `tool_calls`."""
    forced = {"type": "function", "function": {"name": "get_weather"}}
    body = dict(messages=CONVERSATION[:1], tools=[WEATHER], tool_choice=forced, temperature=0.0)
    calls, finish = streamed_calls(server, {**body, "stop": ['"']}) if stream else _calls(
        chat(server, **body, stop=['"']))
    assert finish == "stop" and [c["function"]["arguments"] for c in calls] in ([], ["{"]), (finish, calls)
    calls, finish = streamed_calls(server, body) if stream else _calls(chat(server, **body))
    assert finish == "tool_calls" and json.loads(calls[0]["function"]["arguments"])


def test_required_cut_by_max_tokens_shows_no_json_fragment(server):
    """Through the server: tool_choice required cut after two tokens ends with `length` and no content."""
    body = chat(server, messages=CONVERSATION[:1], tools=[WEATHER], tool_choice="required", max_tokens=2)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and not choice["message"]["content"], choice


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_without_parameters_is_called_with_none(server, stream):
    """OpenAI: omitting `parameters` defines a function with an empty parameter list, so a forced call of it
    writes `{}` (and, named or required, finishes at once, not at max_tokens); `parameters: {}` too (an empty
    schema would otherwise let the arguments be any JSON value, not an object)."""
    for ping, choice in itertools.product(({"name": "ping"}, {"name": "ping", "parameters": {}}),
                                          ({"type": "function", "function": {"name": "ping"}}, "required")):
        tools = [{"type": "function", "function": ping}]
        body = dict(messages=CONVERSATION[:1], tools=tools, tool_choice=choice, temperature=1.0, seed=3)
        calls, finish = streamed_calls(server, body) if stream else _calls(chat(server, **body))
        assert finish == "tool_calls" and calls, (finish, calls)
        assert all(c["function"]["name"] == "ping" and json.loads(c["function"]["arguments"]) == {} for c in calls)


def test_a_strict_tool_is_called_with_no_key_its_parameters_do_not_name(server):
    """`strict: true` on a function: its arguments' objects take no key they do not name (OpenAI's strict
    function calling). `,` is favoured by far, so without strict the same call goes on to a second key."""
    comma = httpx.post(server.url("/tokenize"), json={"prompt": ","}).json()["tokens"][-1]
    params = {"type": "object", "properties": {"d": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["d"]}
    forced = {"type": "function", "function": {"name": "digit"}}
    arguments = {}
    for strict in (False, True):
        tool = {"type": "function", "function": {"name": "digit", "parameters": params, "strict": strict}}
        body = chat(server, messages=CONVERSATION[:1], tools=[tool], tool_choice=forced, temperature=0.0,
                    max_tokens=24, logit_bias={str(comma): 30})
        arguments[strict] = body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
    assert re.fullmatch(r'\{"d":\d,.*', arguments[False], re.S), arguments
    assert re.fullmatch(r'\{"d":\d\}', arguments[True]), arguments


def _calls(body: dict):
    choice = body["choices"][0]
    return choice["message"]["tool_calls"], choice["finish_reason"]


def streamed_calls(server, body: dict):
    from server_utils import sse_events

    with httpx.stream("POST", server.url("/v1/chat/completions"), timeout=120, json={
            "model": "tiny", "max_tokens": 120, "stream": True, **body}) as resp:
        events = [e for e in sse_events(resp) if e != "[DONE]" and e["choices"]]
    _, calls, _ = reassemble([e["choices"][0]["delta"] for e in events])
    calls = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
             for c in calls]
    return calls, events[-1]["choices"][0]["finish_reason"]


def test_openai_tool_loop(server):
    """The client's loop: a forced call, the tool's result sent back, a plain reply."""
    from openai import OpenAI

    client = OpenAI(base_url=server.url("/v1"), api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "What time is it in Berlin?"}]
    first = client.chat.completions.create(model="tiny", messages=messages, tools=[TIME], max_tokens=60,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}})
    message = first.choices[0].message
    assert message.tool_calls and message.tool_calls[0].function.name == "get_time"
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls:
        args = json.loads(call.function.arguments)
        messages.append({"role": "tool", "tool_call_id": call.id, "content": f"12:00 {args['tz']}"})
    second = client.chat.completions.create(model="tiny", messages=messages, tools=[TIME], max_tokens=8,
                                            tool_choice="none")
    assert second.choices[0].message.tool_calls is None and second.choices[0].finish_reason in ("stop", "length")


def openai_stream(server, **body) -> dict:
    """The official client's streamed chunks, accumulated as its users do: content, reasoning_content, the
    calls by index (with how many deltas each took) and the finish reason."""
    from openai import OpenAI

    client = OpenAI(base_url=server.url("/v1"), api_key="none", max_retries=0)
    got = {"content": "", "reasoning": "", "calls": {}, "finish": None}
    body.setdefault("max_tokens", 120)
    for chunk in client.chat.completions.create(model="tiny", stream=True, **body):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        got["content"] += choice.delta.content or ""
        got["reasoning"] += getattr(choice.delta, "reasoning_content", None) or ""  # vLLM's extra field
        for tc in choice.delta.tool_calls or []:
            call = got["calls"].setdefault(tc.index, {"id": tc.id, "name": tc.function.name, "arguments": "",
                                                      "deltas": 0})
            call["arguments"] += tc.function.arguments or ""
            call["deltas"] += 1
        got["finish"] = choice.finish_reason or got["finish"]
    return got


def test_openai_client_accumulates_streamed_calls(server):
    """Streamed through the real server, the official client's chunks accumulate into valid calls: a named
    tool_choice (the grammar forces the arguments), and `auto` read by the hermes parser from a reply that a
    regex forces into `<think>` + `<tool_call>` form (a random model writes no calls of its own)."""
    messages = [{"role": "user", "content": "Time in Berlin?"}]
    forced = {"type": "function", "function": {"name": "get_weather"}}
    got = openai_stream(server, messages=messages, tools=[WEATHER, TIME], tool_choice=forced, temperature=1.0, seed=3)
    calls = got["calls"]
    assert got["finish"] == "tool_calls" and list(calls) == [0] and calls[0]["name"] == "get_weather"
    assert calls[0]["id"].startswith("call_") and calls[0]["deltas"] > 2
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["function"]["parameters"])
    regex = (r'<think>Berlin is CET\.</think>\n\nChecking\.\n<tool_call>\n\{"name": "get_time", "arguments": '
             r'\{"tz": "(UTC|CET)"\}\}\n</tool_call>\n<tool_call>\n\{"name": "get_weather", "arguments": '
             r'\{"city": "[a-z]{1,8}", "days": [1-7]\}\}\n</tool_call>')
    # 300 tokens: a random model under xgrammar's mask spells the forced text in short tokens (llguidance's
    # allows only the canonical token of a forced string: 87 tokens; xgrammar's every prefix: over 120).
    body = dict(messages=messages, tools=[WEATHER, TIME], tool_choice="auto", temperature=0.0, max_tokens=300,
                extra_body={"structured_outputs": {"regex": regex}})
    got = openai_stream(server, **body)
    calls = got["calls"]
    assert got["finish"] == "tool_calls" and got["content"] == "Checking.\n"
    assert got["reasoning"] == "Berlin is CET."
    assert [calls[i]["name"] for i in sorted(calls)] == ["get_time", "get_weather"]
    assert len({c["id"] for c in calls.values()}) == 2 and all(c["deltas"] > 2 for c in calls.values())
    for call, tool in zip((calls[0], calls[1]), (TIME, WEATHER)):
        jsonschema.validate(json.loads(call["arguments"]), tool["function"]["parameters"])
    from openai import OpenAI  # the same request not streamed (greedy): the same reply, parsed whole

    whole = OpenAI(base_url=server.url("/v1"), api_key="none", max_retries=0).chat.completions.create(
        model="tiny", **body).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == got["content"]
    assert whole.message.model_extra["reasoning_content"] == got["reasoning"]
    assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls] == [
        (calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]


def test_tool_choice_errors(server):
    def err(**body):
        resp = httpx.post(server.url("/v1/chat/completions"), timeout=60,
                          json={"model": "tiny", "max_tokens": 4, "messages": CONVERSATION[:1], **body})
        assert resp.status_code == 400, resp.text
        return resp.json()["error"]["param"]

    assert err(tool_choice="required") == "tool_choice"
    assert err(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}) == "tool_choice"
    assert err(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}) == "tool_choice"
    bad = {"type": "function", "function": {"name": "bad", "parameters": {"type": "objectx"}}}
    for choice in ("auto", "none", "required"):  # refused whatever tool_choice is, naming the tool
        assert err(tools=[WEATHER, bad], tool_choice=choice) == "tools[1].function.parameters"
