"""The OpenAI-compatible API against the real server (uvicorn on a loopback port, tiny random model)."""
from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest
from openai import AsyncOpenAI, NotFoundError, OpenAI

from engine.request import SamplingParams
from server import responses as R
from server_utils import ServerThread, sse_events, wait_for

PROMPTS = ["Hello world", "The capital of France is", "1, 2, 3,", "Once upon a time"]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with ServerThread(tiny_model_dir("llama"), served_model_name="tiny,org/tiny") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    from engine.llm import LLM

    return LLM(str(tiny_model_dir("llama")), device="cpu", num_kv_blocks=128)


def greedy_offline(llm, prompts, max_tokens):
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return [o.outputs[0].text for o in outs]


def test_completion_matches_offline_generate(client, offline):
    expected = greedy_offline(offline, PROMPTS[:2], 8)
    for prompt, want in zip(PROMPTS[:2], expected):
        resp = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
        assert resp.choices[0].text == want
        assert resp.choices[0].finish_reason == "length"
        assert resp.usage.completion_tokens == 8
        assert resp.usage.prompt_tokens == len(offline.get_tokenizer().encode(prompt))


def test_stream_joins_to_the_non_streamed_text(client):
    full = client.completions.create(prompt=PROMPTS[1], max_tokens=10, temperature=0, model="tiny")
    chunks = list(client.completions.create(prompt=PROMPTS[1], max_tokens=10, temperature=0, stream=True,
                                            model="tiny"))
    assert len(chunks) >= 2
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_include_usage_sends_a_final_usage_chunk(server):
    body = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url("/v1/completions"), json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    final = events[-2]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 4
    assert all(e["usage"] is None for e in events[:-2])


def test_n2_and_multiple_prompts(client):
    resp = client.completions.create(model="tiny", prompt=PROMPTS[:2], n=2, max_tokens=5, temperature=0)
    assert sorted(c.index for c in resp.choices) == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in resp.choices}
    # greedy: both completions of a prompt are the same; the two prompts differ
    assert by_index[0] == by_index[1] and by_index[2] == by_index[3]
    single = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=5, temperature=0)
    assert by_index[2] == single.choices[0].text
    assert resp.usage.completion_tokens == 20


def test_n2_sampled_with_seed_is_reproducible(client):
    kwargs = dict(model="tiny", prompt=PROMPTS[0], n=2, max_tokens=6, temperature=1.0, seed=7)
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]


def test_token_id_prompts(client, offline):
    ids = offline.get_tokenizer().encode(PROMPTS[2])
    by_text = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=5, temperature=0)
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=5, temperature=0)
    batch = client.completions.create(model="tiny", prompt=[ids, ids], max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert [c.text for c in batch.choices] == [by_text.choices[0].text] * 2


def test_logprobs_shape(client):
    resp = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=3)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0
        assert 3 <= len(top) <= 4 and token in top
        assert max(top.values()) == pytest.approx(logprob)  # greedy picks the most likely token
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_streamed_logprobs_match(client):
    full = client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=5, temperature=0, logprobs=1)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=5, temperature=0,
                                            logprobs=1, stream=True))
    streamed = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(full.choices[0].logprobs.token_logprobs)


def test_echo(client):
    plain = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=4, temperature=0)
    echoed = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPTS[1] + plain.choices[0].text
    streamed = list(client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=4, temperature=0,
                                              echo=True, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == echoed.choices[0].text


def test_stop_string(client):
    full = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=12, temperature=0).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip(), f"cannot pick a stop string from {full!r}"
    cut = full[:full.index(stop)]
    resp = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=12, temperature=0, stop=[stop])
    assert resp.choices[0].text == cut
    assert resp.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=12, temperature=0,
                                              stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == cut


def test_chat_stream_and_not(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    assert full.choices[0].message.role == "assistant"
    assert full.usage.completion_tokens == 6
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_equals_completion_of_the_templated_prompt(server, client):
    messages = [{"role": "user", "content": "Hi there"}]
    ids = httpx.post(server.url("/tokenize"), json={"messages": messages}, timeout=30).json()["tokens"]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0, n=2,
                                          logprobs=True, top_logprobs=2)
    comp = client.completions.create(model="tiny", prompt=ids, max_tokens=5, temperature=0)
    assert [c.message.content for c in chat.choices] == [comp.choices[0].text] * 2
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(t.top_logprobs) == 2 for t in content)


def test_responses_match_the_declared_schema(server):
    body = {"prompt": PROMPTS[0], "max_tokens": 3, "logprobs": 1, "temperature": 0}
    R.CompletionResponse.model_validate(httpx.post(server.url("/v1/completions"), json=body, timeout=60).json())
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], "max_tokens": 3}
    R.ChatCompletionResponse.model_validate(
        httpx.post(server.url("/v1/chat/completions"), json=body, timeout=60).json())
    models = R.ModelList.model_validate(httpx.get(server.url("/v1/models")).json())
    assert models.data[0].id == "tiny" and models.data[0].max_model_len == 512
    assert httpx.get(server.url("/version")).json()["version"]
    schema = httpx.get(server.url("/openapi.json")).json()
    assert "CompletionRequest" in schema["components"]["schemas"]
    assert "429" in schema["paths"]["/v1/completions"]["post"]["responses"]


def test_models_retrieve_gives_each_served_name_its_card(server, client):
    """client.models.retrieve (GET /v1/models/{model}): every served name gets its card from /v1/models, one
    with a slash too (the client sends it as %2F); any other name is the completion routes' 404."""
    listed = {card.id: card for card in client.models.list().data}
    assert list(listed) == ["tiny", "org/tiny"]
    for name, card in listed.items():
        assert client.models.retrieve(name) == card
    with pytest.raises(NotFoundError) as err:
        client.models.retrieve("no-such-model")
    assert (err.value.code, err.value.param, err.value.type) == ("model_not_found", "model", "invalid_request_error")
    assert "no-such-model" in err.value.message
    route = httpx.get(server.url("/openapi.json")).json()["paths"]["/v1/models/{model}"]["get"]
    assert route["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/ModelCard")
    assert "404" in route["responses"] and route["parameters"][0]["name"] == "model"


def test_tokenize_detokenize_roundtrip(server, offline):
    r = httpx.post(server.url("/tokenize"), json={"prompt": PROMPTS[3]}, timeout=30).json()
    assert r["tokens"] == offline.get_tokenizer().encode(PROMPTS[3]) and r["count"] == len(r["tokens"])
    back = httpx.post(server.url("/detokenize"), json={"tokens": r["tokens"]}, timeout=30).json()
    assert back["prompt"] == PROMPTS[3]


def test_health_ready(server):
    assert httpx.get(server.url("/health")).status_code == 200
    assert httpx.get(server.url("/ready")).json()["status"] == "ok"


def test_metrics_parse_and_move(server, client):
    before = server.metrics()
    client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=3, temperature=0)
    after = server.metrics()
    assert after["kvserve_generation_tokens_total"] == before["kvserve_generation_tokens_total"] + 3
    assert after["kvserve_prompt_tokens_total"] > before["kvserve_prompt_tokens_total"]
    key = 'kvserve_requests_finished_total{reason="length"}'
    assert after[key] == before[key] + 1
    assert after["kvserve_time_to_first_token_seconds_count"] == before["kvserve_time_to_first_token_seconds_count"] + 1
    assert after["kvserve_e2e_request_latency_seconds_count"] == before["kvserve_e2e_request_latency_seconds_count"] + 1
    assert after["kvserve_inter_token_latency_seconds_count"] >= before["kvserve_inter_token_latency_seconds_count"] + 2
    assert after["kvserve_queue_time_seconds_count"] == before["kvserve_queue_time_seconds_count"] + 1
    assert after["kvserve_kv_blocks_total"] == 128
    for name in ("kvserve_requests_running", "kvserve_requests_waiting", "kvserve_prefix_cache_queries_total",
                 "kvserve_prefix_cache_hits_total", "kvserve_preemptions_total"):
        assert name in after
    assert after["kvserve_kv_blocks_used"] == 0 and after["kvserve_idle_invariant_violations_total"] == 0


def test_prefix_cache_hits_show_in_metrics(server, client):
    prompt = "The quick brown fox jumps over the lazy dog. " * 4  # several full blocks
    client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    before = server.metrics()["kvserve_prefix_cache_hits_total"]
    client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    assert server.metrics()["kvserve_prefix_cache_hits_total"] >= before + 16


def test_32_concurrent_streams(server, offline):
    prompts = [f"{PROMPTS[i % 4]} {i}" for i in range(32)]
    expected = greedy_offline(offline, prompts, 6)

    async def one(aclient, prompt):
        stream = await aclient.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0,
                                                  stream=True)
        parts, finish = [], None
        async for chunk in stream:
            parts.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        return "".join(parts), finish

    async def run_all():
        async with AsyncOpenAI(base_url=server.url("/v1"), api_key="x", max_retries=0, timeout=300) as aclient:
            return await asyncio.gather(*(one(aclient, p) for p in prompts))

    results = asyncio.run(run_all())
    assert [text for text, _ in results] == expected
    assert all(finish == "length" for _, finish in results)
    assert server.wait_blocks_free() == 0


def test_stream_disconnect_aborts_and_frees_blocks(server):
    key = 'kvserve_requests_finished_total{reason="abort"}'
    aborted = server.metrics()[key]
    body = {"prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url("/v1/completions"), json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(4)]
        assert any(line.startswith("data: {") for line in got)
        assert server.metrics()["kvserve_kv_blocks_used"] > 0
    # leaving the block closes the connection mid-stream
    assert server.wait_blocks_free() == 0
    assert server.metrics()[key] == aborted + 1
    ok = httpx.post(server.url("/v1/completions"), json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


def test_non_stream_disconnect_aborts(server):
    """A client that hangs up on a plain (non-streaming) request while it runs aborts it. The socket closes once
    the request holds KV blocks: a read timeout instead raced the tiny model, which wrote its 400 tokens within
    the timeout's second on a fast host."""
    key = 'kvserve_requests_finished_total{reason="abort"}'
    aborted = server.metrics()[key]
    body = json.dumps({"prompt": PROMPTS[1], "max_tokens": 400, "temperature": 0, "ignore_eos": True}).encode()
    host, port = httpx.URL(server.url("/")).host, httpx.URL(server.url("/")).port
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_for(lambda: server.metrics()["kvserve_kv_blocks_used"] > 0, timeout=20, what="the request to run")
    wait_for(lambda: server.metrics()[key] == aborted + 1, timeout=20, what="the abort")
    assert server.wait_blocks_free() == 0


def test_prompt_plus_max_tokens_exactly_at_the_context_is_served(client):
    resp = client.completions.create(model="tiny", prompt=[5] * 500, max_tokens=12, temperature=0)
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 12


def test_prompts_and_outputs_are_logged_only_when_asked(server, client, caplog):
    import logging

    def server_log() -> str:  # the server's own loggers, not the client's
        return "\n".join(r.getMessage() for r in caplog.records
                         if r.name.split(".")[0] in ("kvserve", "engine", "server", "uvicorn"))

    marker = "zebra-marker-4711"
    with caplog.at_level(logging.DEBUG):
        client.completions.create(model="tiny", prompt=marker, max_tokens=2)
    assert "prompt(s)" in server_log()  # the request was logged, without its text
    assert marker not in server_log()
    caplog.clear()
    ctx = server.app.state.ctx
    ctx.log_requests = True
    try:
        with caplog.at_level(logging.INFO):
            client.completions.create(model="tiny", prompt=marker, max_tokens=2)
    finally:
        ctx.log_requests = False
    assert marker in server_log()
