"""bench/bpe_tokenizer.py: the byte-level BPE that random-weight benchmark models get so that a JSON schema
can be satisfied. Exactly vocab_size ids with EOS where the model says; any text round-trips; both grammar
engines (llguidance: kvserve's, xgrammar: vLLM's default) read its tokens' bytes as the tokenizer does; and
the real server, on a tiny random model with it, returns JSON that validates."""
from __future__ import annotations

import json
import random

import httpx
import jsonschema
import pytest

from bench.bpe_tokenizer import EOS_TEXT, QWEN2_SPLIT, bpe_tokenizer
from bench.models import build_random_model
from bench.structured_mix import SCHEMA
from server_utils import ServerThread

VOCAB, EOS = 3000, 2000
BOUNDED = {"type": "object", "additionalProperties": False, "required": ["id", "status", "tags"],
           "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                          "status": {"enum": ["open", "closed"]},
                          "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}}}
TINY = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB,
        "max_position_embeddings": 512, "bos_token_id": EOS, "eos_token_id": EOS}


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from bench.bpe_tokenizer import save_bpe_tokenizer

    path = tmp_path_factory.mktemp("bpe")
    save_bpe_tokenizer(VOCAB, EOS, path)
    return AutoTokenizer.from_pretrained(path)


def test_exactly_vocab_size_ids_with_eos_in_place(hf_tokenizer):
    assert len(hf_tokenizer) == VOCAB and hf_tokenizer.eos_token_id == EOS
    assert hf_tokenizer.convert_ids_to_tokens(EOS) == EOS_TEXT and hf_tokenizer.all_special_ids == [EOS]
    tokens = hf_tokenizer.convert_ids_to_tokens(list(range(VOCAB)))
    assert len(set(tokens)) == VOCAB  # distinct, so ids and strings map one to one


def test_any_text_round_trips_and_eos_is_one_token(hf_tokenizer):
    rng = random.Random(0)
    texts = [json.dumps({"id": 12, "title": "a \"quoted\" title", "x": [1.5, -3e7, None]}),
             "".join(chr(b) for b in range(256)), "été 中文 🙂 \t\r\n", EOS_TEXT]
    texts += ["".join(chr(rng.randrange(1, 0x3000)) for _ in range(40)) for _ in range(20)]
    for text in texts:
        ids = hf_tokenizer.encode(text, add_special_tokens=False)
        assert hf_tokenizer.decode(ids) == text
    assert hf_tokenizer.encode(EOS_TEXT, add_special_tokens=False) == [EOS]


def test_padding_tokens_are_one_piece_like_a_real_bpe_vocabulary(hf_tokenizer):
    """No token the pre-tokenizer would split (so no multi-digit numbers): a random model walking a JSON
    grammar ends its numbers and strings as it would with Qwen's vocabulary."""
    from tokenizers import Regex, pre_tokenizers

    split = pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated")
    texts = [hf_tokenizer.decode([i]) for i in range(VOCAB) if i != EOS]
    whole = [t for t in texts if "\ufffd" not in t]
    assert all(len(split.pre_tokenize_str(t)) == 1 for t in whole)
    assert not any(len(t) > 1 and t.isdigit() for t in whole)


def test_the_byte_count_is_the_floor():
    with pytest.raises(ValueError, match="257"):
        bpe_tokenizer(256, 0)
    assert bpe_tokenizer(257, 256).get_vocab_size() == 257


def _doc_ids(hf_tokenizer) -> list[int]:
    doc = {"id": 7, "title": "hello world: 1 of 2", "status": "open", "tags": ["a", "b"],
           "owner": {"name": "Ann", "email": "ann.b@example.com"}, "score": -1.5}
    jsonschema.validate(doc, SCHEMA)
    return hf_tokenizer.encode(json.dumps(doc, separators=(",", ":")), add_special_tokens=False) + [EOS]


def test_llguidance_reads_it_and_accepts_a_valid_document(hf_tokenizer):
    from llguidance import LLMatcher

    from engine.grammar import JSON_OPTIONS, llg_tokenizer

    matcher = LLMatcher(llg_tokenizer(hf_tokenizer, VOCAB, [EOS]),
                        LLMatcher.grammar_from_json_schema(SCHEMA, overrides=JSON_OPTIONS))
    assert not matcher.is_error()
    assert all(matcher.consume_token(t) for t in _doc_ids(hf_tokenizer)) and matcher.is_stopped()


def test_xgrammar_reads_it_as_byte_level_and_accepts_a_valid_document(hf_tokenizer):
    xgr = pytest.importorskip("xgrammar")
    info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=VOCAB)
    assert info.vocab_type == xgr.VocabType.BYTE_LEVEL and info.vocab_size == VOCAB
    assert info.stop_token_ids == [EOS]
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_json_schema(SCHEMA))
    assert all(matcher.accept_token(t) for t in _doc_ids(hf_tokenizer)) and matcher.is_terminated()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = build_random_model(TINY, tmp_path_factory.mktemp("bpe-model"), tokenizer="bpe")
    with ServerThread(model, served_model_name="tiny") as s:
        yield s


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_server_returns_json_that_validates_on_a_random_model(server, seed):
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 200, "seed": seed, "temperature": 1.0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": BOUNDED}}}
    choice = httpx.post(server.url("/v1/completions"), json=body, timeout=120).json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["text"]), BOUNDED)


def test_with_ignore_eos_the_json_comes_first_then_free_tokens(server):
    """What a fixed-length benchmark load does to a constrained request (bench/structured_mix.py)."""
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 150, "ignore_eos": True, "seed": 3,
            "structured_outputs": {"json": BOUNDED}}
    resp = httpx.post(server.url("/v1/completions"), json=body, timeout=120).json()
    assert resp["usage"]["completion_tokens"] == 150 and resp["choices"][0]["finish_reason"] == "length"
    doc, end = json.JSONDecoder().raw_decode(resp["choices"][0]["text"])
    jsonschema.validate(doc, BOUNDED)
    assert end < len(resp["choices"][0]["text"])  # the free tokens after it
