"""Incremental reading of tool calls, a character at a time, for streaming them as OpenAI does (the name
first, then the arguments in pieces): CallScan reads one call's JSON object, `{"name": ..., "arguments": ...}`;
Section reads the calls after a marker in a parser's shape (one object then a closing tag, a JSON list, or
objects separated by `;`).

The arguments go out as the model wrote them: an object or array value's characters are argument text the
moment they are read (inside the value nothing can turn out to be anything else), so the pieces concatenate
to the value's exact text. A string value (JSON text inside a string) is decoded when it closes, a number or
literal when the character after it arrives. Only the structure is tracked (strings, escapes, nesting): an
argument value that is not valid JSON passes through as written, as OpenAI's own `arguments` may.
"""
from __future__ import annotations

import json
import re

WS = " \t\r\n"
SCALAR = set("0123456789+-.eEtrufalsn")
_STRING_RUN = re.compile(r'[^"\\]+')  # inside a string: nothing that ends it or escapes
_NESTED_RUN = re.compile(r'[^"{}\[\]]+')  # inside an object or array, outside strings: no nesting change


class ValueScan:
    """One JSON value's extent: step(ch) says whether `ch` belongs to it; `done` once it is complete."""

    def __init__(self, first: str) -> None:
        self.kind = "string" if first == '"' else "nested" if first in "{[" else "scalar"
        self.depth = 1 if self.kind == "nested" else 0
        self.in_string = self.kind == "string"
        self.escaped = False
        self.done = False
        self.valid = self.kind != "scalar" or first in SCALAR

    def run(self, text: str, pos: int) -> int:
        """The end of the characters from `pos` on that change nothing but the value's length (read at once:
        ~0.1 us a character instead of ~3 one by one)."""
        if self.escaped or self.kind == "scalar":
            return pos
        match = (_STRING_RUN if self.in_string else _NESTED_RUN).match(text, pos)
        return match.end() if match else pos

    def step(self, ch: str) -> bool:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
                self.done = self.kind == "string"
            return True
        if self.kind == "scalar":
            self.done = ch not in SCALAR
            return not self.done
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            self.done = self.depth == 0
        return True


def _decode(raw: str):
    try:
        return json.loads(raw)
    except ValueError:
        return None


class CallScan:
    """One call object. feed(text) -> characters consumed (it stops at the object's end or at an error).
    `name` once its string has closed; take() -> argument text final since the last take(); `done`, `error`."""

    def __init__(self, args_keys: tuple[str, ...]) -> None:
        self.args_keys = args_keys
        self.state = "open"
        self.name: str | None = None
        self.args_key: str | None = None  # the key the arguments came under (the first of args_keys seen)
        self.done = self.error = False
        self._value: ValueScan | None = None
        self._raw: list[str] = []  # the current key's or value's text (not the arguments')
        self._args: list[str] = []  # the arguments' text, in pieces
        self._taken = 0  # pieces handed out by take()
        self._role = "skip"  # what the current value is: name | args | skip

    @property
    def arguments(self) -> str:
        return "".join(self._args)

    def take(self) -> str:
        new = "".join(self._args[self._taken:])
        self._taken = len(self._args)
        return new

    def feed(self, text: str) -> int:
        pos = 0
        while pos < len(text) and not (self.done or self.error):
            if self.state in ("key", "value"):
                end = self._value.run(text, pos)
                if end > pos:
                    self._add(text[pos:end])
                    pos = end
                    continue
            if not self._step(text[pos]) and not (self.done or self.error):
                self._step(text[pos])  # a number or literal ended on this character: read it again
            pos += 1
        return pos

    def _add(self, text: str) -> None:
        streaming = self._role == "args" and self._value.kind == "nested"
        (self._args if streaming else self._raw).append(text)

    def _step(self, ch: str) -> bool:
        """Consume ch; False when ch was not consumed (it ended a scalar value)."""
        state = self.state
        if state in ("key", "value"):
            return self._in_token(ch)
        if ch in WS:
            return True
        if state == "value?":
            self._start_value(ch)
        elif state == "open":
            self._expect(ch == "{", "key?")
        elif state == "key?" and ch == '"':
            self.state, self._value, self._raw = "key", ValueScan(ch), [ch]
        elif state in ("key?", "next") and ch == "}":
            self._close()
        elif state == "next":
            self._expect(ch == ",", "key?")
        else:
            self._expect(state == "colon" and ch == ":", "value?")
        return True

    def _expect(self, ok: bool, state: str) -> None:
        self.state, self.error = (state, False) if ok else (self.state, True)

    def _start_value(self, ch: str) -> None:
        self._value, self._raw, self.state = ValueScan(ch), [], "value"
        self.error = not self._value.valid
        self._add(ch)

    def _in_token(self, ch: str) -> bool:
        if not self._value.step(ch):
            self._end_value()
            return False
        self._add(ch)
        if self._value.done:
            self._end_key() if self.state == "key" else self._end_value()
        return True

    def _end_key(self) -> None:
        key = _decode("".join(self._raw))
        if key == "name" and self.name is None:
            self._role = "name"
        elif key in self.args_keys and self.args_key is None:
            self._role, self.args_key = "args", key
        else:
            self._role = "skip"
        self.state = "colon"

    def _end_value(self) -> None:
        value, kind = "".join(self._raw), self._value.kind
        if self._role == "name":
            self.name = _decode(value)
            self.error = not isinstance(self.name, str)
        elif self._role == "args" and kind != "nested":
            decoded = _decode(value)
            self._args = [decoded if kind == "string" and isinstance(decoded, str) else value]
        self.state, self._role = "next", "skip"

    def _close(self) -> None:
        self.done = True
        self.error = self.name is None
        if self.args_key is None:
            self._args = ["{}"]


class Section:
    """The calls after a marker, read as they come: feed(text) -> characters consumed; `done` at its end,
    `failed` at text that does not fit (before any call's name: not a call section at all)."""

    def __init__(self, parser) -> None:
        self.parser = parser
        self.state = "before"  # before -> item / call -> after -> ... -> done
        self.scans: list[CallScan] = []
        self.done = self.failed = False

    @property
    def committed(self) -> bool:
        return any(s.name is not None for s in self.scans)

    def feed(self, text: str) -> int:
        pos = 0
        while pos < len(text) and not (self.done or self.failed):
            if self.state == "call":
                pos += self._call(text[pos:])
                continue
            step = self._step(text[pos], text[pos:])
            if step is None:  # a part of the closing tag: wait for the rest
                break
            pos += step
        return pos

    def _call(self, text: str) -> int:
        scan = self.scans[-1]
        used = scan.feed(text)
        self.failed = scan.error
        self.state = "after" if scan.done else self.state
        return used

    def _step(self, ch: str, rest: str) -> int | None:
        if ch in WS:
            return 1
        if ch == "{" and (self.state in ("before", "item") or self.parser.shape == "chain"):
            self.scans.append(CallScan(self.parser.args_keys))
            self.state = "call"
            return 0
        if self.state == "after":
            return self._after(ch, rest)
        if self.state == "before" and ch == "[" and self.parser.shape == "list":
            self.state = "item"
            return 1
        self.failed = True
        return 0

    def _after(self, ch: str, rest: str) -> int | None:
        shape, close = self.parser.shape, self.parser.close
        if shape == "one":
            if rest.startswith(close):
                self.done = True
                return len(close)
            return None if close.startswith(rest) else self._end()
        if shape == "chain":
            return self._next(1) if ch == ";" else self._end()
        if ch == ",":
            return self._next(1)
        self.done, self.failed = ch == "]", ch != "]"
        return 1 if self.done else 0

    def _next(self, used: int) -> int:
        self.state = "item"
        return used

    def _end(self) -> int:
        self.done = True
        return 0
