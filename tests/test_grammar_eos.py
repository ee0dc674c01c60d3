"""Every EOS id of the model ends a grammar, also with llguidance before 1.7, whose tokenizer takes one EOS id
(1.6.1 is the newest wheel for glibc 2.28; on the H200 host every constrained request was a 500 before this)."""
from __future__ import annotations

from types import SimpleNamespace

import llguidance.hf
import pytest
from transformers import AutoTokenizer

from engine.request import StructuredOutput
from engine.structured import StructuredOutputs

VOCAB = 49152


@pytest.fixture(params=["list", "one id"])
def eos_api(request, monkeypatch):
    """The installed llguidance as it is, and as one that refuses a list of EOS ids (llguidance 1.6)."""
    if request.param == "one id":
        real = llguidance.hf.from_tokenizer

        def one_eos(hf_tokenizer, n_vocab=None, eos_token=None, slices=None):
            if isinstance(eos_token, list):
                raise TypeError("argument 'eos_token': 'list' object cannot be interpreted as an integer")
            return real(hf_tokenizer, n_vocab=n_vocab, eos_token=eos_token, slices=slices)

        monkeypatch.setattr(llguidance.hf, "from_tokenizer", one_eos)
    return request.param


def allowed(so: StructuredOutputs, grammar, token: int) -> bool:
    mask = so.fill([SimpleNamespace(grammar=grammar)]).bitmask[0]
    return bool((int(mask[token // 32]) >> (token % 32)) & 1)


def test_each_eos_id_is_allowed_where_the_grammar_ends_and_ends_it(tiny_model_dir, eos_api):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir("llama"))
    own, other = tok.eos_token_id, 7  # a second EOS id, as in Llama 3's and Qwen's generation configs
    assert own not in (None, other)
    so = StructuredOutputs(tok, VOCAB, [own, other])
    compiled = so.compile(StructuredOutput(choice=["yes"]))
    for eos in (own, other):
        grammar = so.new_grammar(compiled)
        assert not allowed(so, grammar, own) and not allowed(so, grammar, other)
        for token in tok.encode("yes", add_special_tokens=False):
            assert grammar.accept(token)
        assert allowed(so, grammar, own) and allowed(so, grammar, other)
        assert grammar.accept(eos) and grammar.error() is None and grammar.matcher.is_stopped()
    so.shutdown()
