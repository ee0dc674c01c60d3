"""Request bodies as strict pydantic models: what each endpoint accepts and refuses (server/request_params.py
turns them into SamplingParams; server/responses.py declares what comes back).

Validation is strict: "16", true and 5.5 are not integers (8.0 is: JSON Schema counts it as one), NaN and
Infinity are not numbers, text may not hold lone surrogates. Unknown fields are ignored, as OpenAI and vLLM do (a client built for a newer API
keeps working); every field this server knows is checked.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag

from server.errors import APIError

INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1


def _no_surrogates(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text must be valid Unicode (no lone surrogates)") from None
    return text


def _whole_float(value):
    return int(value) if isinstance(value, float) and value.is_integer() else value


def Int(ge: int | None = None, le: int | None = None, **extra):
    """A strict int (no "16", no true, no 5.5) in [ge, le], except that 8.0 is 8 as JSON Schema has it.
    The bounds sit on the int itself so that the schema shows them as minimum / maximum."""
    return Annotated[int, Field(ge=ge, le=le, **extra), BeforeValidator(_whole_float)]


Text = Annotated[str, AfterValidator(_no_surrogates)]
# The schema's token-id maximum is filled in from the loaded model's vocabulary (app._openapi).
TokenId = Int(ge=0, json_schema_extra={"x-token-id": True})
TokenIds = list[TokenId]
_NonEmptyIds = Annotated[TokenIds, Field(min_length=1)]
Prompt = Union[Text, Annotated[list[Text], Field(min_length=1)], _NonEmptyIds,
               Annotated[list[_NonEmptyIds], Field(min_length=1)]]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's response_format: text (no constraint), json_object, or json_schema."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(_Strict):
    """vLLM's structured_outputs: exactly one of json (a schema), regex, choice, grammar (Lark or GBNF)."""
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
    json_: Union[dict[str, Any], str, None] = Field(None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = Field(None, description="accepted; kvserve's JSON has no free whitespace")
    disable_fallback: bool | None = Field(None, description="accepted; kvserve has one grammar engine")


_REFUSED = "not implemented by kvserve: any value but the no-op one is refused (400 unsupported)"
_NO_EFFECT = "accepted; it does not change the output"


def _refused(noop: str = "null"):
    return Field(None, description=f"{_REFUSED}; no-op: {noop}")


class _RefusedFields(_Strict):
    """Fields of the OpenAI and vLLM request schemas that would change the output and that kvserve does not
    implement: declared (so /openapi.json lists them) and refused unless they hold their no-op value
    (check_unsupported). Fields that change nothing are accepted."""
    use_beam_search: Any = _refused("false")
    length_penalty: Any = _refused("1.0")
    truncate_prompt_tokens: Any = _refused()
    allowed_token_ids: Any = _refused()
    bad_words: Any = _refused("[]")
    logits_processors: Any = _refused("[]")
    return_tokens_as_token_ids: Any = _refused("false")
    spaces_between_special_tokens: Any = _refused("true")
    priority: Any = _refused("0")
    kv_transfer_params: Any = _refused()
    vllm_xargs: Any = _refused()
    guided_whitespace_pattern: Any = _refused()
    metadata: dict[str, Any] | None = Field(None, description=_NO_EFFECT)
    store: bool | None = Field(None, description=_NO_EFFECT)
    service_tier: str | None = Field(None, description=_NO_EFFECT)
    safety_identifier: str | None = Field(None, description=_NO_EFFECT)
    prompt_cache_key: str | None = Field(None, description=_NO_EFFECT)
    cache_salt: str | None = Field(None, description=_NO_EFFECT)
    request_id: str | None = Field(None, description=_NO_EFFECT)


class FunctionDef(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(_Strict):
    name: str
    arguments: str


class ToolCallIn(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class _ChatExtraFields(_Strict):
    """Chat fields beyond the shared ones: tools and template options (honoured) and the refused ones."""
    audio: Any = _refused()
    modalities: Any = _refused('["text"]')
    prediction: Any = _refused()
    reasoning_effort: Any = _refused()
    web_search_options: Any = _refused()
    verbosity: Any = _refused()
    tools: list[Tool] | None = Field(None, description="functions the model may call (the chat template "
                                     "renders them; --tool-call-parser reads the calls)")
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = Field(
        None, description="required and a named function are enforced with a grammar")
    functions: Any = _refused("[]")
    function_call: Any = _refused('"none" or "auto" without functions')
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call (tool_choice required)")
    chat_template: Text | None = Field(None, description="a Jinja chat template used instead of the model's "
                                       "(only on a server started with --trust-request-chat-template; "
                                       "otherwise 400 unsupported)")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="extra variables for the template "
                                                        "(e.g. enable_thinking)")
    continue_final_message: bool | None = Field(False, description="continue the last (assistant) message "
                                                "instead of starting a new one")
    documents: Any = _refused()
    echo: Any = _refused("false")
    add_special_tokens: Any = _refused("false")
    mm_processor_kwargs: Any = _refused()


class _CompletionExtraFields(_Strict):
    suffix: Any = _refused('"" or null')
    prompt_embeds: Any = _refused()
    add_special_tokens: bool = Field(True, description="text prompts: add the tokenizer's special tokens (BOS) "
                                     "as vLLM does by default; false: the text's own tokens only")


# field -> its no-op values (null is always one)
NO_OP_VALUES = {
    "use_beam_search": (False,), "length_penalty": (1, 1.0), "bad_words": ([],), "logits_processors": ([],),
    "return_tokens_as_token_ids": (False,), "spaces_between_special_tokens": (True,), "priority": (0,),
    "modalities": (["text"],), "tools": ([],), "functions": ([],), "chat_template_kwargs": ({},),
    "continue_final_message": (False,), "echo": (False,), "add_special_tokens": (False,), "suffix": ("",),
    "tool_choice": ("none", "auto"), "function_call": ("none", "auto"),
}


def check_unsupported(req: BaseModel) -> None:
    """400 `unsupported`, naming the field, for the first field set to a value kvserve would not honour (or,
    in messages, the first content part that is not text)."""
    for name, f in type(req).model_fields.items():  # a request's own field of the same name wins (echo)
        if not (f.description or "").startswith(_REFUSED):
            continue
        value = getattr(req, name)
        if value is None or any(value == v and type(value) is type(v) for v in NO_OP_VALUES.get(name, ())):
            continue
        raise APIError(400, f"{name}: not supported by kvserve", "unsupported", name)
    if getattr(req, "best_of", None) is not None and req.best_of > req.n:
        raise APIError(400, "best_of: only best_of == n is supported (kvserve returns every completion)",
                       "unsupported", "best_of")
    check_text_parts(getattr(req, "messages", None) or ())


def check_text_parts(messages: list[ChatMessage]) -> None:
    """400 `unsupported`, at the part's path, for the first content part that is not text."""
    for i, message in enumerate(messages):
        for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
            if part.type != "text":
                where = f"messages.{i}.content.{j}"
                raise APIError(400, f"{where}: {part.type!r} content parts are not supported: this server "
                               'takes text parts only ({"type": "text", "text": ...})', "unsupported", where)


class _PromptLogprobFields(_RefusedFields):
    prompt_logprobs: Int(ge=0, le=20) | None = Field(
        None, description="vLLM's: each prompt token's logprob and the top k (the first token has none)")


class _StructuredFields(_PromptLogprobFields):
    """The ways to constrain the output (at most one per request): OpenAI's response_format, vLLM's
    structured_outputs, and vLLM's older guided_* fields."""
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: Union[dict[str, Any], str, None] = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    guided_decoding_backend: str | None = Field(None, description="accepted; kvserve uses llguidance")


class SamplingFields(_StructuredFields):
    """Fields shared by completions and chat completions. null means the default."""

    model: str | None = None
    n: Int(ge=1) = 1
    best_of: Int(ge=1) | None = Field(None, description="must equal n (or be null): kvserve returns every completion")
    temperature: float | None = Field(1.0, ge=0)
    top_p: float | None = Field(1.0, gt=0, le=1)
    top_k: Int(ge=-1) | None = -1
    min_p: float | None = Field(0.0, ge=0, le=1)
    seed: Int(ge=INT64_MIN, le=INT64_MAX) | None = None
    presence_penalty: float | None = Field(0.0, ge=-2, le=2)
    frequency_penalty: float | None = Field(0.0, ge=-2, le=2)
    repetition_penalty: float | None = Field(1.0, gt=0)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    min_tokens: Int(ge=0) | None = 0
    ignore_eos: bool | None = False
    stop: Union[Text, list[Text], None] = None
    stop_token_ids: TokenIds | None = None
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    timeout: float | None = Field(None, gt=0, description="seconds; the server's request_timeout caps it")
    user: str | None = None


class CompletionRequest(SamplingFields, _CompletionExtraFields):
    prompt: Prompt
    max_tokens: Int(ge=1) | None = Field(None, description="default 16 (lowered to the server's cap)")
    echo: bool | None = False
    logprobs: Int(ge=0, le=20) | None = None
    return_token_ids: bool | None = Field(False, description="add each choice's token_ids (vLLM's option)")


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class NonTextPart(_Strict):
    """A content part that is not text (OpenAI's image_url, input_audio, file, refusal; vLLM's audio_url,
    video_url, ...). kvserve serves text-only models: such a part parses, then is refused with 400 unsupported
    naming its type and path (check_text_parts)."""
    type: str = Field(description="any type but text: refused (400 unsupported)", examples=["image_url", "file"],
                      json_schema_extra={"not": {"const": "text"}})  # so that a text part matches one member


def _part_kind(part) -> str | None:
    """The union member of a content part: 'text' for type text, 'other' for any other type string."""
    kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
    if not isinstance(kind, str):
        return None
    return "text" if kind == "text" else "other"


ContentPart = Annotated[Union[Annotated[TextPart, Tag("text")], Annotated[NonTextPart, Tag("other")]],
                        Discriminator(_part_kind, custom_error_type="invalid_part",
                                      custom_error_message='a content part is an object with a string "type"')]


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[Text, list[ContentPart], None] = Field(
        None, description="a string or a list of text parts (any other part type: 400 unsupported)")
    name: Text | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: Text | None = None
    reasoning_content: Text | None = None


class ChatCompletionRequest(SamplingFields, _ChatExtraFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int(ge=1) | None = None
    max_completion_tokens: Int(ge=1) | None = None
    logprobs: bool | None = False
    top_logprobs: Int(ge=0, le=20) | None = None
    add_generation_prompt: bool = True


class TokenizeRequest(_Strict):
    """prompt (text) or messages (chat, through the template); messages win when both are given, as in vLLM."""

    model_config = ConfigDict(json_schema_extra={"anyOf": [{"required": ["prompt"]}, {"required": ["messages"]}]})
    model: str | None = None
    prompt: Text = None
    messages: list[ChatMessage] = Field(None, min_length=1)
    add_special_tokens: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: TokenIds
