"""Reasoning in model output: a reply that starts with `<think>` (DeepSeek-R1, Qwen3; the opening tag may be in
the prompt) -> reasoning_content up to `</think>`, the rest content; whole replies and streams split alike."""
from __future__ import annotations


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
