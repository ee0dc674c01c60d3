"""Prompts -> token ids: the cheap checks first, then tokenization (in ServingContext's thread pool).

Cheap before expensive: no token is longer than the tokenizer's longest vocabulary entry (81 characters for
SmolLM2's), so a text longer than max_prompt_tokens x that many characters cannot fit and is refused from
its length alone, before it is tokenized (4 MB of "1" took 6-16 s to tokenize; its refusal now takes no time).

Chat messages: message text is tokenized as text (`<|im_start|>` written by a user is eight ordinary tokens),
so a user cannot open a system turn; only the template's own text has control tokens. Messages without any
control-token string (nearly all) are tokenized as one text, exactly as before. Otherwise the template is
rendered once more with placeholders for the messages: the pieces between placeholders are the template's
(tokenized with their control tokens), the messages are tokenized with special tokens split. A template that
rewrites message text (so the placeholders do not line up) cannot be split so: such a request is refused, as
is one with a control token outside message content (a name, tool-call arguments).
chat_parse_special_tokens turns all of this off for trusted callers.
"""
from __future__ import annotations

from server.errors import APIError

MARK = "\ue000kvserve-message-{}\ue001"  # private-use characters: no template writes them


def max_token_chars(tokenizer) -> int:
    """Characters in the longest vocabulary entry (an upper bound on the text one token covers)."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:
        return 1 << 10
    return max(map(len, vocab), default=1)


def too_long(chars: int, max_prompt_tokens: int, param: str) -> APIError:
    return APIError(400, f"{param} is {chars} characters, more than {max_prompt_tokens} tokens (the most allowed) "
                         "can hold", "context_length_exceeded", param)


def check_chars(texts: list[str], max_chars: int, max_prompt_tokens: int, param: str = "prompt") -> None:
    for text in texts:
        if len(text) > max_chars:
            raise too_long(len(text), max_prompt_tokens, param)


def message_chars(messages: list[dict]) -> int:
    return sum(len(m["content"]) + len(m.get("name", "")) for m in messages)


def chat_ids(tok, messages: list[dict], render, parse_special: bool) -> list[int]:
    """The prompt of a chat request (see the module docstring); render(messages) -> the template's text."""
    text = render(messages)
    if parse_special:
        return tok.encode(text, add_special_tokens=False)
    in_content, elsewhere = _control_tokens(tok, messages)
    if not in_content and not elsewhere:
        return tok.encode(text, add_special_tokens=False)
    pieces = None if elsewhere else _template_pieces(messages, render, text)
    if pieces is None:
        raise APIError(400, "messages: text may not contain the model's control tokens here", "invalid_value",
                       "messages")
    ids: list[int] = []
    for template_text, content in pieces:
        ids += tok.encode(template_text, add_special_tokens=False) if template_text else []
        ids += tok.encode(content, add_special_tokens=False, split_special_tokens=True) if content else []
    return ids


def _template_pieces(messages: list[dict], render, text: str):
    """[(template text, message text that follows it), ...] covering `text`, or None if they do not line up."""
    marks = [MARK.format(i) for i in range(len(messages))]
    masked = render([{**m, "content": mark} for m, mark in zip(messages, marks)])
    found = sorted((masked.find(mark), i) for i, mark in enumerate(marks) if masked.count(mark) == 1)
    if len(found) != len(marks):
        return None
    pieces, start = [], 0
    for pos, i in found:
        pieces.append((masked[start:pos], messages[i]["content"]))
        start = pos + len(marks[i])
    pieces.append((masked[start:], ""))
    if "".join(a + b for a, b in pieces) != text:
        return None
    return pieces


def _strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def _control_tokens(tok, messages: list[dict]) -> tuple[bool, bool]:
    """Whether a control token's text appears (in message content, anywhere else in the messages)."""
    added = getattr(tok, "added_tokens_decoder", {}) or {}
    specials = [t.content for t in added.values() if getattr(t, "special", False) and t.content]
    specials = specials or [t for t in getattr(tok, "all_special_tokens", []) if t]
    has = lambda texts: any(sp in t for t in texts for sp in specials)  # noqa: E731
    return (has([m["content"] for m in messages]),
            has([t for m in messages for k, v in m.items() if k != "content" for t in _strings(v)]))
