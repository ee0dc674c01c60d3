"""No request field silently ignored: every OpenAI / vLLM field that would change the output and that kvserve
does not implement is a 400 `unsupported` naming it (and accepted at its no-op value); /openapi.json declares
them all."""
from __future__ import annotations

import httpx
import pytest
from openai import BadRequestError, OpenAI

from server_utils import ServerThread

CHAT = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "tiny", "max_tokens": 2, "prompt": "hi"}

REFUSED_BOTH = {"use_beam_search": True, "length_penalty": 0.5, "truncate_prompt_tokens": 3,
                "allowed_token_ids": [1, 2], "bad_words": ["x"], "logits_processors": ["m.f"],
                "return_tokens_as_token_ids": True, "spaces_between_special_tokens": False, "priority": 1,
                "kv_transfer_params": {"a": 1}, "vllm_xargs": {"a": 1}, "guided_whitespace_pattern": " "}
REFUSED_CHAT = {"audio": {"voice": "x"}, "modalities": ["text", "audio"], "prediction": {"type": "content"},
                "reasoning_effort": "high", "web_search_options": {}, "verbosity": "low",
                "functions": [{"name": "f"}], "function_call": {"name": "f"}, "documents": [{"t": "x"}], "echo": True, "add_special_tokens": True, "mm_processor_kwargs": {}}
NO_OPS_BOTH = {"use_beam_search": False, "length_penalty": 1.0, "bad_words": [], "priority": 0,
               "spaces_between_special_tokens": True, "metadata": {"k": "v"}, "store": False, "user": "u",
               "service_tier": "auto", "safety_identifier": "s", "prompt_cache_key": "k", "cache_salt": "c"}
NO_OPS_CHAT = {"modalities": ["text"], "tools": [], "tool_choice": "none", "parallel_tool_calls": True,
               "continue_final_message": False, "echo": False, "chat_template_kwargs": {}}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    """Steps of at most 16 tokens: prompts are prefilled (and scored) chunk by chunk."""
    with ServerThread(tiny_model_dir("llama"), served_model_name="tiny", max_num_batched_tokens=16) as s:
        yield s


def post(server, path, body):
    return httpx.post(server.url(path), json=body, timeout=60)


@pytest.mark.parametrize("path, base, field, value",
                         [("/v1/chat/completions", CHAT, k, v) for k, v in {**REFUSED_BOTH, **REFUSED_CHAT}.items()]
                         + [("/v1/completions", COMPLETION, k, v) for k, v in REFUSED_BOTH.items()]
                         + [("/v1/completions", COMPLETION, "suffix", "tail"),
                            ("/v1/completions", COMPLETION, "prompt_embeds", "AAAA")])
def test_unimplemented_fields_are_refused(server, path, base, field, value):
    resp = post(server, path, {**base, field: value})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["code"] == "unsupported" and err["param"] == field and field in err["message"]


def test_no_op_values_and_harmless_fields_are_accepted(server):
    assert post(server, "/v1/chat/completions", {**CHAT, **NO_OPS_BOTH, **NO_OPS_CHAT}).status_code == 200
    assert post(server, "/v1/completions", {**COMPLETION, **NO_OPS_BOTH, "suffix": "", "best_of": 1}).status_code == 200


@pytest.fixture(scope="module")
def bos_server(tiny_model_dir, tmp_path_factory):
    """The tiny model with a tokenizer that puts <|im_start|> before every text it encodes (as Llama's puts
    BOS), so add_special_tokens changes a prompt's ids."""
    import shutil

    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    model_dir = tmp_path_factory.mktemp("bos-model")
    shutil.copytree(tiny_model_dir("llama"), model_dir, dirs_exist_ok=True)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    bos = "<|im_start|>"
    tok.post_processor = TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    tok.save(str(model_dir / "tokenizer.json"))
    with ServerThread(model_dir, served_model_name="tiny") as s:
        yield s


def test_completion_text_prompts_take_add_special_tokens(bos_server):
    """vLLM's completions field: true (the default) encodes a text prompt with the tokenizer's special tokens,
    false without; the prompt-token count and /tokenize agree."""
    def prompt_tokens(**extra):
        return post(bos_server, "/v1/completions", {**COMPLETION, "prompt": "hello there", **extra}).json()["usage"]

    plain = httpx.post(bos_server.url("/tokenize"), json={"prompt": "hello there", "add_special_tokens": False},
                       timeout=30).json()["count"]
    assert prompt_tokens()["prompt_tokens"] == plain + 1
    assert prompt_tokens(add_special_tokens=True)["prompt_tokens"] == plain + 1
    assert prompt_tokens(add_special_tokens=False)["prompt_tokens"] == plain


def test_best_of_above_n_is_refused(server):
    err = post(server, "/v1/completions", {**COMPLETION, "n": 1, "best_of": 3}).json()["error"]
    assert (err["code"], err["param"]) == ("unsupported", "best_of")


def test_openapi_declares_every_field(server):
    schemas = httpx.get(server.url("/openapi.json"), timeout=30).json()["components"]["schemas"]
    chat, completion = schemas["ChatCompletionRequest"]["properties"], schemas["CompletionRequest"]["properties"]
    for name in {**REFUSED_BOTH, **REFUSED_CHAT, **NO_OPS_BOTH, **NO_OPS_CHAT, "tools": 1, "tool_choice": 1,
                 "chat_template": 1, "chat_template_kwargs": 1, "continue_final_message": 1}:
        assert name in chat, name
    for name in {**REFUSED_BOTH, **NO_OPS_BOTH, "suffix": 1, "response_format": 1, "structured_outputs": 1,
                 "guided_json": 1, "guided_regex": 1, "guided_choice": 1, "guided_grammar": 1}:
        assert name in completion, name
    assert "unsupported" in chat["functions"]["description"]


# ---- content parts -----------------------------------------------------------------------------------------

NON_TEXT_PARTS = [{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
                  {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
                  {"type": "file", "file": {"file_id": "file-123"}}, {"type": "video_url", "video_url": {"url": "x"}}]


@pytest.mark.parametrize("part", NON_TEXT_PARTS, ids=lambda p: p["type"])
def test_non_text_content_parts_are_refused_by_type(server, part):
    """The openai client's multimodal message: 400 unsupported at the part's path, naming its type."""
    client = OpenAI(base_url=server.url("/v1"), api_key="none", max_retries=0)
    content = [{"type": "text", "text": "What is this?"}, part]
    with pytest.raises(BadRequestError) as exc:
        client.chat.completions.create(model="tiny", max_tokens=2, messages=[
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": content}])
    err = exc.value
    assert (err.code, err.param) == ("unsupported", "messages.1.content.1"), err.body
    assert repr(part["type"]) in err.message and "text parts only" in err.message
    tokenize = post(server, "/tokenize", {"messages": [{"role": "user", "content": [part]}]}).json()["error"]
    assert (tokenize["code"], tokenize["param"]) == ("unsupported", "messages.0.content.0")


def test_text_parts_are_the_joined_text(server):
    parts = [{"type": "text", "text": "The capital "}, {"type": "text", "text": "of France"}]
    as_parts = post(server, "/tokenize", {"messages": [{"role": "user", "content": parts}]}).json()
    as_text = post(server, "/tokenize", {"messages": [{"role": "user", "content": "The capital of France"}]}).json()
    assert as_parts["tokens"] == as_text["tokens"]
    chat = post(server, "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": parts}]})
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["role"] == "assistant"
    schemas = httpx.get(server.url("/openapi.json"), timeout=30).json()["components"]["schemas"]
    members = schemas["ChatMessage"]["properties"]["content"]["anyOf"][1]["items"]["oneOf"]
    assert {"$ref": "#/components/schemas/TextPart"} in members
    assert schemas["TextPart"]["properties"]["type"]["const"] == "text"


# ---- request chat templates ------------------------------------------------------------------------------

ECHO_ONCE = "{% for m in messages %}{{ m.content }}{% endfor %}"
ECHO_FIVE = "{% for m in messages %}{{ m.content * 5 }}{% endfor %}"


@pytest.mark.parametrize("body", [{"chat_template": ECHO_ONCE},
                                  {"chat_template_kwargs": {"chat_template": ECHO_ONCE}}])
def test_request_chat_template_refused_by_default(server, body):
    """A template is a program the server runs: without --trust-request-chat-template it is a 400 (vLLM's rule),
    before any work, and the server keeps serving."""
    resp = post(server, "/v1/chat/completions", {**CHAT, **body})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    param = "chat_template" if "chat_template" in body else "chat_template_kwargs.chat_template"
    assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "unsupported", param)
    assert "--trust-request-chat-template" in err["message"]
    assert post(server, "/v1/chat/completions", {**CHAT, "chat_template": None}).status_code == 200


def test_request_chat_template_used_when_trusted(tiny_model_dir, smollm2_tokenizer):
    """With the flag, the request's template renders the prompt (either spelling): the prompt is the
    template's output, token for token."""
    with ServerThread(tiny_model_dir("llama"), served_model_name="tiny", trust_request_chat_template=True) as s:
        msgs = [{"role": "user", "content": "hello there"}]
        for template, rendered in ((ECHO_ONCE, "hello there"), (ECHO_FIVE, "hello there" * 5)):
            want = len(smollm2_tokenizer.encode(rendered, add_special_tokens=False))
            for body in ({"chat_template": template}, {"chat_template_kwargs": {"chat_template": template}}):
                resp = post(s, "/v1/chat/completions", {**CHAT, "messages": msgs, **body})
                assert resp.status_code == 200, resp.text
                assert resp.json()["usage"]["prompt_tokens"] == want, (template, body)


# ---- prompt logprobs ---------------------------------------------------------------------------------------

PROMPT = "The quick brown fox jumps over the lazy dog, and then a few more words to span chunks"


@pytest.fixture(scope="module")
def hf_prompt_logprobs(tiny_model_dir, server):
    """transformers' float32 log_softmax over the prompt: each token's logprob given the ones before it."""
    import torch
    from transformers import AutoModelForCausalLM

    ids = httpx.post(server.url("/tokenize"), json={"prompt": PROMPT}).json()["tokens"]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"), dtype=torch.float32)
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return ids, lp[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1).tolist(), lp[:-1].topk(2).values


def test_echo_logprobs_match_transformers(server, hf_prompt_logprobs):
    """The shape lm-evaluation-harness reads; asked twice, the second time after a plain request put the prompt
    in the prefix cache (a prompt-logprobs request must not take the hit)."""
    ids, want, top = hf_prompt_logprobs
    post(server, "/v1/completions", {**COMPLETION, "prompt": PROMPT})
    for _ in range(2):
        resp = post(server, "/v1/completions", {**COMPLETION, "prompt": PROMPT, "echo": True, "logprobs": 2,
                                                "max_tokens": 1, "temperature": 0})
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        lps = choice["logprobs"]
        assert choice["text"].startswith(PROMPT)
        assert len(lps["tokens"]) == len(ids) + 1 and lps["token_logprobs"][0] is None
        assert lps["top_logprobs"][0] is None
        got = lps["token_logprobs"][1:len(ids)]
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
        best = [max(t.values()) for t in lps["top_logprobs"][1:len(ids)]]
        assert max(abs(a - b) for a, b in zip(best, top[:, 0].tolist())) < 1e-4


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_vllm_prompt_logprobs(server, hf_prompt_logprobs, path):
    ids, want, _ = hf_prompt_logprobs
    if path == "/v1/completions":
        body = post(server, path, {**COMPLETION, "prompt": ids, "prompt_logprobs": 1, "n": 2}).json()
        plps = [c["prompt_logprobs"] for c in body["choices"]]
    else:
        body = post(server, path, {**CHAT, "prompt_logprobs": 0}).json()
        plps = [body["prompt_logprobs"]]
    for plp in plps:
        assert plp[0] is None and all(len(e) >= 1 for e in plp[1:])
    if path == "/v1/completions":
        got = [entry[str(t)]["logprob"] for entry, t in zip(plps[0][1:], ids[1:])]
        assert len(plps[0]) == len(ids) and max(abs(a - b) for a, b in zip(got, want)) < 1e-4


def test_prompt_logprobs_of_a_one_token_prompt_is_one_null(server):
    """Found by the soak: a one-token prompt has no logprob to score, and its prompt_logprobs is [null] (one
    entry per prompt token, as vLLM gives), not null. The engine sends an empty list, which the front end and
    the offline LLM took for "not asked"."""
    for prompt in ([500], "hi"):
        body = post(server, "/v1/completions", {**COMPLETION, "prompt": prompt, "prompt_logprobs": 0, "n": 2}).json()
        assert body["usage"]["prompt_tokens"] == 1
        assert [c["prompt_logprobs"] for c in body["choices"]] == [[None], [None]], body


def test_prompt_logprobs_refused_with_stream(server):
    err = post(server, "/v1/completions", {**COMPLETION, "echo": True, "logprobs": 1, "stream": True}).json()
    assert err["error"]["code"] == "unsupported" and err["error"]["param"] == "prompt_logprobs"
