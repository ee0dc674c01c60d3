"""One reply's tool-call stream: feed(text) -> the Pieces to send now (content, a call's start, argument text);
finish() -> the rest. The rules are server/tool_parsers.py's; this is the machine that applies them.

Modes: `content` (markers anywhere), `start` (Llama 3: a call only at the reply's start), `section` (reading
calls, server/tool_scan.Section), `plain` (all content from here on), `args` (a named tool_choice: the reply
is the call's arguments). Every decision depends on the text only, never on where the chunks were cut.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from server.tool_scan import Section


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as the model wrote it
    id: str = field(default_factory=new_call_id)

    def to_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Piece:
    """One thing a stream sends: content text, a call's start (`call` set: id and name), or more of the
    arguments of call `index`."""
    content: str = ""
    index: int = -1  # -1: content
    call: ToolCall | None = None
    arguments: str = ""


def _safe_end(text: str, markers: tuple[str, ...]) -> int:
    """Characters of `text` before a suffix that could still grow into a marker."""
    held = [k for m in markers for k in range(1, min(len(m) - 1, len(text)) + 1) if text.endswith(m[:k])]
    return len(text) - max(held, default=0)


class ToolStream:
    """One reply's machine for a parser (server/tool_parsers.ToolParser); new_id() names each call it starts.
    `calls` holds the calls so far (whole arguments text included)."""

    def __init__(self, parser, new_id) -> None:
        self.parser, self.new_id = parser, new_id
        self.mode = parser.start
        self.buf = ""  # received and not yet decided
        self.calls: list[ToolCall] = []
        self.pieces: list[Piece] = []
        self.section: Section | None = Section(parser) if self.mode == "section" else None
        self.held = ""  # the current section's text so far (released as content if it is not a call)
        self.lead = 0  # characters of `held` before the section's JSON (its marker)
        self.made: dict[int, int] = {}  # the current section's scans -> their calls' indexes

    def feed(self, text: str) -> list[Piece]:
        self.buf += text
        self._run(final=False)
        return self._take()

    def finish(self) -> list[Piece]:
        self._run(final=True)
        return self._take()

    def _take(self) -> list[Piece]:
        pieces, self.pieces = self.pieces, []
        return pieces

    def _run(self, final: bool) -> None:
        step = {"content": self._content, "plain": self._content, "start": self._start,
                "section": self._section, "args": self._args, "drop": self._drop}
        while step[self.mode](final):
            pass

    # ---- content ---------------------------------------------------------------------------------------

    def _content(self, final: bool) -> bool:
        markers = self.parser.markers if self.mode == "content" else ()
        found = [(self.buf.find(m), m) for m in markers if m in self.buf]
        if found:
            at, marker = min(found)
            head = self.buf[:at]
            self._say(head.rstrip() if self.calls else head)
            self._open(marker, self.buf[at + len(marker):])
            return True
        text = self.buf if final else self.buf[:_safe_end(self.buf, markers)]
        text = text.rstrip() if self.calls else text
        self._say(text)
        self.buf = "" if final else self.buf[len(text):]
        return False

    def _start(self, final: bool) -> bool:
        head = self.buf.lstrip()
        lead = len(self.buf) - len(head)
        for m in self.parser.start_markers:
            if head.startswith(m):
                self._open(self.buf[:lead + len(m)], head[len(m):])
                return True
        if head.startswith("{"):
            self._open(self.buf[:lead], head)
            return True
        if not final and any(m.startswith(head) for m in self.parser.start_markers):
            return False  # empty, or the start of a marker
        self.mode = "plain"
        return True

    def _say(self, text: str) -> None:
        if not text:
            return
        if self.pieces and self.pieces[-1].index < 0:
            self.pieces[-1].content += text
        else:
            self.pieces.append(Piece(content=text))

    # ---- calls -----------------------------------------------------------------------------------------

    def _open(self, marker: str, rest: str) -> None:
        self.mode, self.section, self.made = "section", Section(self.parser), {}
        self.held, self.lead, self.buf = marker, len(marker), rest

    def _section(self, final: bool) -> bool:
        used = self.section.feed(self.buf)
        if not self.section.committed:  # once a call has started the text is never released: keep no copy
            self.held += self.buf[:used]
        self.buf = self.buf[used:]
        self._sync()
        if not (self.section.done or self.section.failed or final):
            return False
        if not self.section.committed and self.parser.forced:  # a forced reply that is no call: not content
            self.mode = "drop"
            return True
        if not self.section.committed:  # not a call after all: its text is content
            self._say(self.held[:self.lead])
            self.buf = self.held[self.lead:] + self.buf
        self.mode = "content" if self.parser.markers else "plain"
        return True

    def _drop(self, final: bool) -> bool:
        """A forced reply (tool_choice required) that did not open with a call: none of it is content."""
        self.buf = ""
        return False

    def _sync(self) -> None:
        """Pieces for what the section's scans have read: a call once its name is known, new argument text."""
        for i, scan in enumerate(self.section.scans):
            if scan.name is None:
                continue
            if i not in self.made:
                self.made[i] = self._begin(scan.name)
            self._more(self.made[i], scan.take())

    def _begin(self, name: str) -> int:
        call = ToolCall(name, "", self.new_id())
        self.calls.append(call)
        self.pieces.append(Piece(index=len(self.calls) - 1, call=call))
        return len(self.calls) - 1

    def _more(self, index: int, text: str) -> None:
        if not text:
            return
        self.calls[index].arguments += text
        last = self.pieces[-1] if self.pieces else None
        if last is not None and last.index == index and last.call is None:
            last.arguments += text
        else:
            self.pieces.append(Piece(index=index, arguments=text))

    def _args(self, final: bool) -> bool:
        """Named tool_choice: the reply, without surrounding whitespace, is the arguments."""
        if not self.calls:
            self._begin(self.parser.name)
        if not self.calls[0].arguments:
            self.buf = self.buf.lstrip()
        text = self.buf.rstrip()
        self._more(0, text)
        self.buf = "" if final else self.buf[len(text):]
        return False
