"""Tool calling for /v1/chat/completions: which parser reads a request's reply, and the grammar that enforces
tool_choice `required` or a named function (engine.request.StructuredOutput), as vLLM does: a forced call's
reply is JSON (the named function's arguments; for `required` an array of {"name", "parameters"})."""
from __future__ import annotations

import json

from engine.request import StructuredOutput
from server.errors import APIError
from server.reasoning import ReasoningParser, StreamingReasoning
from server.structured import closed_objects
from server.tool_parsers import NamedParser, RequiredParser, parser_for
from server.tool_stream import Piece

# OpenAI: "Omitting parameters defines a function with an empty parameter list": a forced call of such a tool
# writes {} (with "any object", a random model ran to max_tokens inside the arguments).
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def _params_schema(tool) -> dict:
    """A tool's arguments schema ({} too: arguments are an object, never any JSON value); under `strict: true`
    its objects take no keys they do not name (server.structured.closed_objects)."""
    schema = tool.function.parameters or NO_PARAMETERS
    return closed_objects(schema) if tool.function.strict else schema


def tool_parser(req, parser_name: str | None, chat_template: str | None):
    """The parser of this request's reply (None: plain text), checking tools against tool_choice."""
    choice, tools = req.tool_choice, req.tools or []
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return None
    if not tools:
        raise APIError(400, "tool_choice: needs tools", "invalid_value", "tool_choice")
    if choice == "required":
        return RequiredParser()
    if choice == "auto":
        parser = parser_for(parser_name, chat_template)
        if parser is None:
            raise APIError(400, "tool_choice: auto needs a tool-call parser (start the server with "
                           "--tool-call-parser hermes|llama3_json|mistral|auto)", "unsupported", "tool_choice")
        return parser
    names = [t.function.name for t in tools]
    if choice.function.name not in names:
        raise APIError(400, f"tool_choice: no tool named {choice.function.name!r}", "invalid_value", "tool_choice")
    return NamedParser(choice.function.name)


def _arguments_grammar(tool) -> StructuredOutput:
    """The JSON-schema constraint of a tool's arguments (its parameters, or none's), keys in the tool's order."""
    return StructuredOutput(json=json.dumps(_params_schema(tool)))


def parameter_schemas(req) -> list[StructuredOutput]:
    """One constraint per tool of the request, in order: each tool's arguments."""
    return [_arguments_grammar(t) for t in req.tools or []]


def forced_call_grammar(req, parser) -> StructuredOutput | None:
    """The grammar of a forced call (required / named), or None."""
    if not isinstance(parser, (NamedParser, RequiredParser)):
        return None
    if isinstance(parser, NamedParser):
        return _arguments_grammar(next(t for t in req.tools if t.function.name == parser.name))
    item = {"anyOf": [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                         "parameters": _params_schema(t)},
                       "required": ["name", "parameters"], "additionalProperties": False} for t in req.tools]}
    array = {"type": "array", "items": item, "minItems": 1}
    if req.parallel_tool_calls is False:
        array["maxItems"] = 1
    return StructuredOutput(json=json.dumps(array))


# ---- replies --------------------------------------------------------------------------------------------


def reply_message(text: str, parser, reasoning: bool, finish_reason: str | None) -> tuple[dict, str | None]:
    """A whole reply -> (the assistant message, finish_reason): reasoning split off, tool calls parsed."""
    message: dict = {"role": "assistant"}
    if reasoning:
        thought, text = ReasoningParser().split(text)
        if thought is not None:
            message["reasoning_content"] = thought
    calls = []
    if parser is not None:
        text, calls = parser.parse(text)
    message["content"] = text if text.strip() or not calls else None
    if calls:
        message["tool_calls"] = [c.to_dict() for c in calls]
        finish_reason = tool_finish(finish_reason, [c.arguments for c in calls])
    return message, finish_reason


def tool_finish(finish_reason: str | None, arguments: list[str]) -> str | None:
    """`tool_calls` for a reply that stopped with calls whose arguments are all whole JSON; a call cut off
    (max_tokens, a stop string, an early EOS) keeps the reply's own finish reason."""
    if arguments and finish_reason in ("stop", None) and all(_is_json(a) for a in arguments):
        return "tool_calls"
    return finish_reason


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def piece_delta(piece: Piece) -> dict:
    """A Piece as OpenAI streams it: content; a call's first delta (index, id, type, name, `arguments: ""`);
    then only `function.arguments` pieces for that index."""
    if piece.index < 0:
        return {"content": piece.content}
    if piece.call is not None:
        call = {"index": piece.index, "id": piece.call.id, "type": "function",
                "function": {"name": piece.call.name, "arguments": ""}}
    else:
        call = {"index": piece.index, "function": {"arguments": piece.arguments}}
    return {"tool_calls": [call]}


class StreamReply:
    """One choice's stream: each text delta -> the deltas to send now (maybe none), each its own chunk."""

    def __init__(self, parser, reasoning: bool) -> None:
        self.tools = parser.stream() if parser is not None else None
        self.reasoning = StreamingReasoning() if reasoning else None

    def deltas(self, text: str, finished: bool) -> list[dict]:
        out: list[dict] = []
        if self.reasoning is not None:
            thought, text = self.reasoning.feed(text, finished)
            if thought:
                out.append({"reasoning_content": thought})
        if self.tools is None:  # one delta, reasoning and content together
            return [{**(out[0] if out else {}), "content": text}] if text else out
        pieces = self.tools.feed(text) + (self.tools.finish() if finished else [])
        return out + [piece_delta(p) for p in pieces]

    def finish_reason(self, finish: str | None) -> str | None:
        """The finish to send: `stop` with whole calls (the stream's, so far) is `tool_calls` (tool_finish)."""
        if finish != "stop" or self.tools is None:
            return finish
        return tool_finish(finish, [c.arguments for c in self.tools.calls])
