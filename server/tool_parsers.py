"""Tool calls in model output -> OpenAI `tool_calls`, beside detokenization on the HTTP side.

Parsers (--tool-call-parser): `hermes` (Qwen2.5 / Qwen3: `<tool_call>{"name", "arguments"}</tool_call>`),
`llama3_json` (Llama 3.x: the whole reply is `{"name", "parameters"}` objects, optionally after
`<|python_tag|>`, separated by `;`), `mistral` (`[TOOL_CALLS] [{"name", "arguments"}, ...]`), and `auto`
(told from the chat template). Streaming: text before anything that could start a call goes out at once; from
a possible marker on the text is held back and parsed when the completion ends, so every chunking yields
exactly the calls of parsing the whole text (each call in one delta: its id, name and whole arguments).
The reasoning parser (`<think>...</think>` -> reasoning_content) lives here too.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _call(obj, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


class HermesParser:
    markers = ("<tool_call>",)
    _block = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        calls = [c for c in (_call(_loads(m), "arguments") for m in self._block.findall(text)) if c]
        if not calls:
            return text, []
        return self._block.sub("", text), calls


class MistralParser:
    markers = ("[TOOL_CALLS]",)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        head, sep, tail = text.partition("[TOOL_CALLS]")
        items = _loads(tail.strip()) if sep else None
        items = [items] if isinstance(items, dict) else items
        calls = [c for c in (_call(i, "arguments") for i in items or []) if c]
        return (head, calls) if calls else (text, [])


class Llama3JsonParser:
    markers = ("{", "<|python_tag|>")  # only at the start of the reply

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        body = text.strip()
        body = body[len("<|python_tag|>"):].lstrip() if body.startswith("<|python_tag|>") else body
        if not body.startswith("{"):
            return text, []
        decoder, pos, calls = json.JSONDecoder(), 0, []
        while pos < len(body):
            try:
                obj, pos = decoder.raw_decode(body, pos)
            except ValueError:
                return text, []
            call = _call(obj, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            rest = body[pos:].lstrip()
            pos = len(body) - len(rest) + (1 if rest.startswith(";") else 0)
            pos = len(body) - len(body[pos:].lstrip())
        return "", calls


PARSERS = {"hermes": HermesParser, "mistral": MistralParser, "llama3_json": Llama3JsonParser}


def parser_for(name: str | None, chat_template: str | None):
    """The parser named (`auto`: told from the chat template), or None."""
    if name == "auto":
        template = chat_template or ""
        name = ("hermes" if "<tool_call>" in template else "mistral" if "[TOOL_CALLS]" in template
                else "llama3_json" if "<|python_tag|>" in template or "ipython" in template else None)
    return PARSERS[name]() if name else None


class StreamingToolParser:
    """One completion's stream: feed(text) -> content safe to send now; finish() -> (the rest, the calls)."""

    def __init__(self, parser) -> None:
        self.parser = parser
        self.text = ""
        self.sent = 0  # characters of `text` sent as content
        self.holding = False

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.holding or getattr(self.parser, "hold_all", False):
            return ""
        safe = self._safe_end()
        out, self.sent = self.text[self.sent:safe], max(self.sent, safe)
        return out

    def _safe_end(self) -> int:
        """Characters before anything that is, or may become, a call marker."""
        if isinstance(self.parser, Llama3JsonParser):
            stripped = self.text.lstrip()
            if not stripped:
                return self.sent
            if any(m.startswith(stripped[:len(m)]) for m in self.parser.markers):
                self.holding = True
                return self.sent
            return len(self.text)
        for m in self.parser.markers:
            at = self.text.find(m)
            if at >= 0:
                self.holding = True
                return min(at, len(self.text))
        for m in self.parser.markers:  # a suffix that could grow into a marker is held back
            for k in range(min(len(m) - 1, len(self.text)), 0, -1):
                if self.text.endswith(m[:k]):
                    return len(self.text) - k
        return len(self.text)

    def finish(self) -> tuple[str, list[ToolCall]]:
        content, calls = self.parser.parse(self.text)
        rest = content[self.sent:] if content.startswith(self.text[:self.sent]) else ""
        return rest, calls


# ---- reasoning ------------------------------------------------------------------------------------------


class ReasoningParser:
    """`<think>...</think>` (DeepSeek-R1, Qwen3) -> reasoning_content; the opening tag may be in the prompt."""
    start, end = "<think>", "</think>"

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning or None, content): the same split as StreamingReasoning's, whatever the chunking."""
        head = text.lstrip()
        if not head.startswith(self.start):
            return None, text
        body = head[len(self.start):]
        if self.end not in body:
            return body, ""
        thought, content = body.split(self.end, 1)
        return thought, content.lstrip()


class NamedParser:
    """tool_choice names a function: the grammar made the whole reply its arguments."""
    hold_all = True

    def __init__(self, name: str) -> None:
        self.name = name

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        return ("", [ToolCall(self.name, text.strip())]) if _loads(text) is not None else (text, [])


class RequiredParser:
    """tool_choice required: the grammar made the reply a JSON array of {"name", "parameters"}."""
    hold_all = True

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        items = _loads(text)
        calls = [c for c in (_call(i, "parameters") for i in items or [] if isinstance(items, list)) if c]
        return ("", calls) if calls else (text, [])


class StreamingReasoning:
    """Streaming split: a reply that starts with <think> is reasoning until </think>; one that does not is all
    content. Text that may be a partial tag is held back until the next delta."""

    def __init__(self) -> None:
        self.text = ""
        self.state = "start"  # start -> thinking -> content
        self.sent = 0  # characters of `text` handed out in the current state
        self.strip_lead = False  # after </think>: whitespace before the content is dropped

    def feed(self, delta: str, finished: bool) -> tuple[str, str]:
        """(reasoning, content) to send now."""
        self.text += delta
        if self.state == "start":
            head = self.text.lstrip()
            if ReasoningParser.start.startswith(head) and not finished:
                return "", ""  # still could be <think>
            if not head.startswith(ReasoningParser.start):
                self.state = "content"
                return "", self._content(finished)
            self.state, self.text, self.sent = "thinking", head[len(ReasoningParser.start):], 0
        if self.state == "thinking":
            at = self.text.find(ReasoningParser.end)
            if at < 0:
                return self._take(self._safe(), finished), ""
            thought = self.text[self.sent:at]
            self.state, self.text, self.sent = "content", self.text[at + len(ReasoningParser.end):], 0
            self.strip_lead = True
            return thought, self._content(finished)
        return "", self._content(finished)

    def _content(self, finished: bool) -> str:
        if self.strip_lead:
            rest = self.text[self.sent:].lstrip()
            self.sent = len(self.text) - len(rest)
            self.strip_lead = not rest
        return self._take(len(self.text), finished)

    def _safe(self) -> int:
        end = ReasoningParser.end
        for k in range(min(len(end) - 1, len(self.text)), 0, -1):
            if self.text.endswith(end[:k]):
                return len(self.text) - k
        return len(self.text)

    def _take(self, upto: int, finished: bool) -> str:
        upto = len(self.text) if finished else upto
        out, self.sent = self.text[self.sent:upto], max(self.sent, upto)
        return out
