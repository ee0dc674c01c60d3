"""IncrementalDetokenizer with the real SmolLM2 tokenizer: deltas, split characters, stop strings."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.detokenizer import IncrementalDetokenizer
from engine.request import SamplingParams

TEXTS = [
    "Héllo wörld, ça va? Ünïcödé àéîõü ñ ß",
    "Emoji: 😀🎉👍🏽 and 👨‍👩‍👧 family 🇫🇷",
    "日本語のテキストと中文字符，还有한국어。",
    "def f(x):\n    return {'a': x ** 2}  # tab\there\n\nprint(f(3))",
    "Mixed: naïve café — “quotes” 😀 漢字 end",
]


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


def detok(tok, prompt="", **params) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tok, tok.encode(prompt) if prompt else [], SamplingParams(**params))


def stream(d: IncrementalDetokenizer, ids: list[int], chunk: int = 1):
    """Feed ids `chunk` at a time; returns (deltas, stop string or None)."""
    deltas = []
    for i in range(0, len(ids), chunk):
        text, stop = d.add(ids[i:i + chunk])
        deltas.append(text)
        if stop is not None:
            return deltas, stop
    return deltas, None


def token_boundaries(tok, ids: list[int]) -> list[int]:
    """Char offsets in the decoded text where each token ends (for tokens that end on a full char)."""
    return [len(tok.decode(ids[:i + 1])) for i in range(len(ids))]


# ----------------------------------------------------------------------------- plain streaming


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("prompt", ["", "Write something:"])
def test_streaming_equals_full_decode_without_split_characters(tok, text, prompt):
    ids = tok.encode(text)
    d = detok(tok, prompt)
    deltas, stop = stream(d, ids)
    assert stop is None
    assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) + d.flush() == tok.decode(ids) == text
    assert d.text == text


def test_the_texts_really_split_characters_across_tokens(tok):
    # Otherwise the test above could not catch a delta ending in half a character.
    ids = tok.encode(TEXTS[1] + TEXTS[2])
    assert sum("\ufffd" in tok.decode([i]) for i in ids) >= 4


@pytest.mark.parametrize("chunk", [2, 3, 7])
def test_chunked_adds_give_the_same_text(tok, chunk):
    text = TEXTS[1] + " " + TEXTS[2]
    d = detok(tok)
    deltas, _ = stream(d, tok.encode(text), chunk)
    assert "".join(deltas) + d.flush() == text and "\ufffd" not in "".join(deltas)


def test_skip_special_tokens(tok):
    ids = tok.encode("<|im_start|>assistant\nHi there<|im_end|>")
    assert tok.convert_ids_to_tokens(ids[0]) == "<|im_start|>"
    for skip in (True, False):
        d = detok(tok, skip_special_tokens=skip)
        deltas, _ = stream(d, ids)
        assert "".join(deltas) + d.flush() == tok.decode(ids, skip_special_tokens=skip)
    assert "<|im_end|>" not in detok(tok).add(ids)[0]


def test_unfinished_character_is_held_then_flushed(tok):
    ids = tok.encode("ok 😀")
    cut = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    d = detok(tok)
    text, _ = d.add(ids[:cut])
    assert text == tok.decode(ids[:cut - 1]) == "ok"  # the token " " + half an emoji is held
    # On finish the held part comes out as a full decode of the truncated output shows it.
    assert text + d.flush() == tok.decode(ids[:cut]) == "ok \ufffd"


def test_decoding_window_stays_small(tok):
    calls = []

    class Recording:
        def decode(self, ids, **kw):
            calls.append(len(ids))
            return tok.decode(ids, **kw)

    ids = tok.encode(" ".join(TEXTS) * 6)
    d = IncrementalDetokenizer(Recording(), tok.encode("A long prompt " * 50), SamplingParams())
    deltas, _ = stream(d, ids)
    assert "".join(deltas) + d.flush() == tok.decode(ids)
    assert len(ids) > 300 and max(calls) <= 12


# ----------------------------------------------------------------------------- stop strings


def test_stop_string_spanning_tokens_is_cut_and_never_shown(tok):
    text = "The answer is 42, and the rest is silence."
    ids = tok.encode(text)
    stop = "wer is 42"
    start = text.index(stop)
    ends = token_boundaries(tok, ids)
    first = next(i for i, e in enumerate(ends) if e > start)
    last = next(i for i, e in enumerate(ends) if e >= start + len(stop))
    assert last - first >= 2  # the stop string spans three tokens
    d = detok(tok, stop=[stop])
    shown = ""
    for i, t in enumerate(ids):
        delta, hit = d.add([t])
        shown += delta
        assert stop[:3] not in shown  # not even its beginning is shown
        if hit is not None:
            break
    assert (i, hit, shown) == (last, stop, text[:start])
    assert d.add(tok.encode(" more")) == ("", None)
    assert d.flush() == "" and d.text == text[:start]


def test_partial_match_is_held_then_released(tok):
    text = "The answer is 42, and the rest is silence."
    ids = tok.encode(text)
    ends = token_boundaries(tok, ids)
    stop = "answer is 43"
    d = detok(tok, stop=[stop])
    shown = ""
    for t, end in zip(ids, ends):
        shown += d.add([t])[0]
        visible = text[:end]
        if "answer is 4" in visible and "42" not in visible:
            assert shown == text[:text.index("answer")]  # "answer is 4" held back
    assert shown + d.flush() == text


def test_include_stop_str_in_output(tok):
    text = "alpha beta gamma delta"
    d = detok(tok, stop=["a gam"], include_stop_str_in_output=True)
    deltas, hit = stream(d, tok.encode(text))
    assert hit == "a gam" and "".join(deltas) == "alpha beta gam" == d.text


def test_stop_string_that_is_a_prefix_of_another(tok):
    text = "We are Done here. Bye"
    for stops in (["Done", "Done here"], ["Done here", "Done"]):
        for chunk in (1, 100):
            d = detok(tok, stop=stops)
            deltas, hit = stream(d, tok.encode(text), chunk)
            assert (hit, "".join(deltas)) == ("Done", "We are ")
    d = detok(tok, stop=["Done here"])
    deltas, hit = stream(d, tok.encode("Done there. Done here."))
    assert (hit, "".join(deltas)) == ("Done here", "Done there. ")


def test_earliest_stop_string_wins(tok):
    text = "alpha beta gamma delta"
    for chunk in (1, 100):
        d = detok(tok, stop=["delta", "gamma", "beta"])
        deltas, hit = stream(d, tok.encode(text), chunk)
        assert (hit, "".join(deltas)) == ("beta", "alpha ")


def test_holdback_is_released_by_flush(tok):
    text = "Hello wor"
    d = detok(tok, stop=["world"])
    deltas, hit = stream(d, tok.encode(text))
    assert hit is None and "".join(deltas) == "Hello "
    assert d.flush() == "wor" and d.text == text
    assert d.flush() == ""


def test_stop_string_across_a_split_emoji(tok):
    text = "Smile 😀! ok"
    d = detok(tok, stop=["😀!"])
    deltas, hit = stream(d, tok.encode(text))
    assert (hit, "".join(deltas)) == ("😀!", "Smile ")
    assert all("\ufffd" not in x for x in deltas)


def test_invalid_utf8_from_the_model_does_not_grow_the_window(tok):
    lead = tok.convert_tokens_to_ids("ð")  # byte-level BPE's token for the lone byte 0xF0
    assert tok.decode([lead]) == "\ufffd"
    calls = []

    class Recording:
        def decode(self, ids, **kw):
            calls.append(len(ids))
            return tok.decode(ids, **kw)

    ids = [lead] * 400 + tok.encode(" fine")
    d = IncrementalDetokenizer(Recording(), [], SamplingParams())
    deltas, _ = stream(d, ids)
    assert "".join(deltas) + d.flush() == tok.decode(ids)
    assert max(calls) <= 70  # bounded (2 x MAX_PENDING_TOKENS), not growing with the 400 bad bytes


def reference_output(full: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """The stop string whose first occurrence ends earliest (longer on a tie) cuts the full text."""
    hits = [(full.find(s) + len(s), -full.find(s), s) for s in stops if s in full]
    if not hits:
        return full, None
    end, neg_start, s = min(hits)
    return full[:end if include else -neg_start], s


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(words=st.lists(st.sampled_from(["ab", "ba", " a", "b ", "😀", "é", "語", "\n", "ab😀"]), max_size=14),
       stop_spans=st.lists(st.tuples(st.integers(0, 30), st.integers(1, 5)), max_size=3),
       include=st.booleans(), chunk=st.integers(1, 4))
def test_stop_strings_match_a_reference_for_any_text_and_chunking(tok, words, stop_spans, include, chunk):
    text = "".join(words)
    stops = [text[i:i + n] for i, n in stop_spans if text[i:i + n]] + ["zz"]
    ids = tok.encode(text)
    full = tok.decode(ids)
    expected, expected_stop = reference_output(full, stops, include)
    d = detok(tok, stop=stops, include_stop_str_in_output=include)
    deltas, hit = stream(d, ids, chunk)
    shown = ""
    for delta in deltas:
        shown += delta
        assert expected.startswith(shown)  # nothing past the cut, no half of a stop string, ever
    assert hit == expected_stop
    assert shown + d.flush() == expected == d.text
