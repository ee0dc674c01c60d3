"""IncrementalDetokenizer: token ids -> text deltas, with stop strings and no split characters.

Decoding follows vLLM / TGI: keep two offsets into the token list, `prefix` and `read`. Each step decodes
tokens[prefix:] and tokens[prefix:read]; the text the new tokens add is the difference. A few tokens of
context are needed because a token's text depends on its neighbours (SentencePiece's leading space, byte
tokens that only form a character together). Text ending in U+FFFD is an incomplete UTF-8 character:
nothing is emitted until the next token completes it. Each step costs O(window), not O(output).

Stop strings are searched in the decoded text; a suffix that could still grow into a stop string is held
back, so a client never sees part of a stop string.
"""
from __future__ import annotations

from engine.request import SamplingParams

# Prompt tokens kept as context for the first output tokens (vLLM uses 5 too).
PROMPT_CONTEXT_TOKENS = 5
# Byte-level BPE merges across characters in runs of symbols (emoji), so a window may legitimately end
# inside a character for several tokens in a row. A window still unfinished after this many tokens is
# taken to be invalid UTF-8 from the model and emitted as is, so that it cannot grow without bound.
MAX_PENDING_TOKENS = 32


def rust_decoder(tokenizer):
    """The `tokenizers` library's own decode, when transformers' decode would only wrap it (a fast tokenizer
    whose `_decode` is not overridden): the same text without the wrapper's argument handling, which was
    half of the detokenizer's time in a front end streaming 128 requests (py-spy). None: use `decode`."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or type(tokenizer)._decode is not TokenizersBackend._decode:
        return None
    return backend.decode


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self._rust_decode = rust_decoder(tokenizer)
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = list(params.stop)
        self.include_stop = params.include_stop_str_in_output
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._tokens = context  # context + output tokens; only the window [prefix:] is ever decoded
        self._prefix = 0
        self._read = len(context)
        # Decoded text not yet shown: it could be the start of a stop string (so it is short).
        self._held = ""
        self._pieces: list[str] = []  # everything shown
        self._stopped = False

    @property
    def text(self) -> str:
        """The output text so far: everything add() and flush() returned."""
        return "".join(self._pieces)

    def add(self, token_ids: list[int]) -> tuple[str, str | None]:
        """Returns (new text safe to show, the stop string hit or None). After a stop string: ("", None)."""
        if self._stopped:
            return "", None
        # One token at a time: adding k tokens gives the same text as k single adds.
        buffer = self._held + "".join(self._decode_next(t) for t in token_ids)
        # Shown text never holds the start of a stop string, so a match lies wholly in the buffer.
        hit = self._find_stop(buffer)
        if hit is not None:
            stop_str, end = hit
            self._stopped, self._held = True, ""
            return self._show(buffer[:end]), stop_str
        safe = len(buffer) - self._stop_prefix_len(buffer)
        self._held = buffer[safe:]
        return self._show(buffer[:safe]), None

    def flush(self) -> str:
        """On a finish other than a stop string: the text still held back (including an unfinished
        character, as U+FFFD, just as a full decode would show it)."""
        if self._stopped:
            return ""
        tail = self._decode_window(force=True) if self._read < len(self._tokens) else ""
        text, self._held = self._held + tail, ""
        return self._show(text)

    def _show(self, text: str) -> str:
        if text:
            self._pieces.append(text)
        return text

    # ------------------------------------------------------------------ decoding

    def _decode_next(self, token_id: int) -> str:
        self._tokens.append(token_id)
        force = len(self._tokens) - self._read >= MAX_PENDING_TOKENS
        return self._decode_window(force)

    def _decode_window(self, force: bool) -> str:
        """The text that tokens[read:] add after tokens[prefix:read]; "" (offsets kept) while it is
        unfinished, unless forced."""
        prefix_text = self._decode(self._tokens[self._prefix:self._read])
        full_text = self._decode(self._tokens[self._prefix:])
        if not force and (len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd")):
            return ""
        self._prefix, self._read = self._read, len(self._tokens)
        # Compact: tokens before the window are never decoded again.
        del self._tokens[:self._prefix]
        self._read -= self._prefix
        self._prefix = 0
        return full_text[len(prefix_text):]

    def _decode(self, ids: list[int]) -> str:
        # No clean-up of tokenization spaces: it is not defined on a window (" ." may straddle two).
        if self._rust_decode is not None:
            return self._rust_decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    # ------------------------------------------------------------------ stop strings

    def _find_stop(self, text: str) -> tuple[str, int] | None:
        """The stop string that completes first in `text` (a match that ends earlier wins, so the result
        does not depend on how the text was split into tokens; at the same end the longer one), with
        where the output ends."""
        best = None  # (match end, -match start, stop string)
        for s in self.stop:
            i = text.find(s)
            if i >= 0 and (best is None or (i + len(s), -i) < best[:2]):
                best = (i + len(s), -i, s)
        if best is None:
            return None
        end, neg_start, s = best
        return s, end if self.include_stop else -neg_start

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        held = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), held, -1):
                if text.endswith(s[:k]):
                    held = k
                    break
        return held
