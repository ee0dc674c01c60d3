"""Tool calls in model output -> OpenAI `tool_calls`, beside detokenization on the HTTP side.

Parsers (--tool-call-parser): `hermes` (Qwen2.5 / Qwen3: `<tool_call>{"name", "arguments"}</tool_call>`),
`llama3_json` (Llama 3.x: the whole reply is `{"name", "parameters"}` objects, optionally after
`<|python_tag|>`, separated by `;`), `mistral` (`[TOOL_CALLS] [{"name", "arguments"}, ...]`), and `auto`
(told from the chat template); `required` and named tool_choice read the JSON their grammar forces.

Every parser streams (ToolStream): text before anything that could start a call goes out as content at once (a
suffix that may grow into a marker is held back); from a marker on, a call goes out as soon as its name has
closed (index, id, name, `arguments: ""`), then its arguments in pieces as they are read (server/tool_scan.py),
as OpenAI streams them. Nothing is sent that could still turn out to be something else. A whole reply is
parsed by the same machine fed at once, so every chunking yields the same content and calls. Text that
started like a call but is not one (no name before the object ends, not JSON) is released as content, except
under tool_choice required, whose reply the grammar forces (cut before a name closed, it is dropped, not shown
as a JSON fragment); after a call, whitespace-only text between and after calls is dropped.
"""
from __future__ import annotations

from server.tool_stream import ToolCall, ToolStream, new_call_id


class ToolParser:
    """A format: where call sections start, their shape, and the key the arguments come under."""
    markers: tuple[str, ...] = ()  # a section starts at any of these, anywhere in the content
    start = "content"  # the mode at the reply's start: content | start | section | args
    start_markers: tuple[str, ...] = ()  # `start` mode: a section starts here (or at `{`), only at the start
    shape = "one"  # one (an object, then `close`) | list ([obj, ...] or one obj) | chain (obj; obj ...)
    close = ""
    args_keys: tuple[str, ...] = ("arguments", "parameters")
    forced = False  # tool_choice required: a grammar wrote the reply, so none of it is content

    def stream(self, new_id=new_call_id) -> ToolStream:
        return ToolStream(self, new_id)

    def parse(self, text: str, new_id=new_call_id) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a whole reply: the stream's, fed at once."""
        s = self.stream(new_id)
        pieces = s.feed(text) + s.finish()
        return "".join(p.content for p in pieces), s.calls


class HermesParser(ToolParser):
    markers, close = ("<tool_call>",), "</tool_call>"


class MistralParser(ToolParser):
    markers, shape = ("[TOOL_CALLS]",), "list"


class Llama3JsonParser(ToolParser):
    start, start_markers, shape = "start", ("<|python_tag|>",), "chain"
    args_keys = ("parameters", "arguments")


class RequiredParser(ToolParser):
    """tool_choice required: the grammar made the reply a JSON array of {"name", "parameters"}."""
    start, shape, args_keys = "section", "list", ("parameters", "arguments")
    forced = True


class NamedParser(ToolParser):
    """tool_choice names a function: the grammar made the whole reply its arguments (the call starts at once)."""
    start = "args"

    def __init__(self, name: str) -> None:
        self.name = name


PARSERS = {"hermes": HermesParser, "mistral": MistralParser, "llama3_json": Llama3JsonParser}


def parser_for(name: str | None, chat_template: str | None):
    """The parser named (`auto`: told from the chat template), or None."""
    if name == "auto":
        template = chat_template or ""
        name = ("hermes" if "<tool_call>" in template else "mistral" if "[TOOL_CALLS]" in template
                else "llama3_json" if "<|python_tag|>" in template or "ipython" in template else None)
    return PARSERS[name]() if name else None
