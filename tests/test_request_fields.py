"""No request field silently ignored: every OpenAI / vLLM field that would change the output and that kvserve
does not implement is a 400 `unsupported` naming it (and accepted at its no-op value); /openapi.json declares
them all."""
from __future__ import annotations

import httpx
import pytest

from server_utils import ServerThread

CHAT = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "tiny", "max_tokens": 2, "prompt": "hi"}

REFUSED_BOTH = {"use_beam_search": True, "length_penalty": 0.5, "truncate_prompt_tokens": 3,
                "allowed_token_ids": [1, 2], "bad_words": ["x"], "logits_processors": ["m.f"],
                "return_tokens_as_token_ids": True, "spaces_between_special_tokens": False, "priority": 1,
                "kv_transfer_params": {"a": 1}, "vllm_xargs": {"a": 1}, "guided_whitespace_pattern": " "}
REFUSED_CHAT = {"audio": {"voice": "x"}, "modalities": ["text", "audio"], "prediction": {"type": "content"},
                "reasoning_effort": "high", "web_search_options": {}, "verbosity": "low",
                "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
                "functions": [{"name": "f"}], "function_call": {"name": "f"}, "chat_template": "{{ x }}",
                "chat_template_kwargs": {"enable_thinking": False}, "continue_final_message": True,
                "documents": [{"t": "x"}], "echo": True, "add_special_tokens": True, "mm_processor_kwargs": {}}
NO_OPS_BOTH = {"use_beam_search": False, "length_penalty": 1.0, "bad_words": [], "priority": 0,
               "spaces_between_special_tokens": True, "metadata": {"k": "v"}, "store": False, "user": "u",
               "service_tier": "auto", "safety_identifier": "s", "prompt_cache_key": "k", "cache_salt": "c"}
NO_OPS_CHAT = {"modalities": ["text"], "tools": [], "tool_choice": "none", "parallel_tool_calls": True,
               "continue_final_message": False, "echo": False, "chat_template_kwargs": {}}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with ServerThread(tiny_model_dir("llama"), served_model_name="tiny") as s:
        yield s


def post(server, path, body):
    return httpx.post(server.url(path), json=body, timeout=60)


@pytest.mark.parametrize("path, base, field, value",
                         [("/v1/chat/completions", CHAT, k, v) for k, v in {**REFUSED_BOTH, **REFUSED_CHAT}.items()]
                         + [("/v1/completions", COMPLETION, k, v) for k, v in REFUSED_BOTH.items()]
                         + [("/v1/completions", COMPLETION, "suffix", "tail")])
def test_unimplemented_fields_are_refused(server, path, base, field, value):
    resp = post(server, path, {**base, field: value})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["code"] == "unsupported" and err["param"] == field and field in err["message"]


def test_no_op_values_and_harmless_fields_are_accepted(server):
    assert post(server, "/v1/chat/completions", {**CHAT, **NO_OPS_BOTH, **NO_OPS_CHAT}).status_code == 200
    assert post(server, "/v1/completions", {**COMPLETION, **NO_OPS_BOTH, "suffix": "", "best_of": 1}).status_code == 200


@pytest.mark.parametrize("message", [
    {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
                                                           "function": {"name": "f", "arguments": "{}"}}]},
    {"role": "tool", "content": "42", "tool_call_id": "c"}])
def test_tool_history_is_refused_not_stripped(server, message):
    body = {**CHAT, "messages": [{"role": "user", "content": "q"}, message]}
    err = post(server, "/v1/chat/completions", body).json()["error"]
    assert err["code"] == "unsupported" and err["param"].startswith("messages.")


def test_best_of_above_n_is_refused(server):
    err = post(server, "/v1/completions", {**COMPLETION, "n": 1, "best_of": 3}).json()["error"]
    assert (err["code"], err["param"]) == ("unsupported", "best_of")


def test_openapi_declares_every_field(server):
    schemas = httpx.get(server.url("/openapi.json"), timeout=30).json()["components"]["schemas"]
    chat, completion = schemas["ChatCompletionRequest"]["properties"], schemas["CompletionRequest"]["properties"]
    for name in {**REFUSED_BOTH, **REFUSED_CHAT, **NO_OPS_BOTH, **NO_OPS_CHAT}:
        assert name in chat, name
    for name in {**REFUSED_BOTH, **NO_OPS_BOTH, "suffix": 1, "response_format": 1, "structured_outputs": 1,
                 "guided_json": 1, "guided_regex": 1, "guided_choice": 1, "guided_grammar": 1}:
        assert name in completion, name
    assert "unsupported" in chat["tools"]["description"]
