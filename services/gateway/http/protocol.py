"""The OpenAI request and response bodies the gateway serves, as pydantic models.

Request models forbid unknown fields: a field tokenmill does not know is a 400 naming it
(OpenAI's own answer), never silently dropped. Fields OpenAI defines that tokenmill does not
support yet (``functions``, ``audio``, ``suffix`` ...) are declared, so that null is
accepted, and refused by ``unsupported()`` when set. Ranges follow OpenAI's where it states
them (temperature [0, 2], penalties [-2, 2], logit bias [-100, 100]) and the engine's
otherwise. Response models document /openapi.json; handlers build the same shapes as dicts.

Every list and map is counted before its items are validated (``at_most``): pydantic's own
``max_length`` applies after validation, so a body of 250,000 empty chat messages (8 MiB) cost
the event loop, which every other client's stream shares, six seconds of validation before
its refusal.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from services.common.detokenize import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS

NonNegInt = Annotated[int, Field(ge=0)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
MAX_STOP_TOKEN_IDS = 64
MAX_CHAT_MESSAGES = 1024
"""As the engine's (its scheduler and tokenizer refuse more turns)."""
MAX_PROMPTS = 1024
MAX_CONTENT_PARTS = 1024


def at_most(limit: int) -> BeforeValidator:
    """A list or map of more than ``limit`` entries is refused before any entry is validated."""
    def check(value: Any) -> Any:
        if isinstance(value, (list, dict)) and len(value) > limit:
            raise ValueError(f"at most {limit} entries, got {len(value)}")
        return value

    return BeforeValidator(check)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool | None = None
    """Send one last chunk with the usage (and empty choices) before [DONE]."""
    continuous_usage_stats: bool | None = None
    """Accepted as vLLM does; tokenmill sends usage in the last chunk only."""


class SamplingFields(BaseModel):
    """What completions and chat share: sampling, stop rules and tokenmill's (vLLM's) extras."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=256)
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None,
                          at_most(1024)] = Field(None, max_length=1024)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: Annotated[Annotated[str, Field(max_length=MAX_STOP_STRING_CHARS)]
                    | list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]] | None,
                    at_most(MAX_STOP_STRINGS)] = Field(None, max_length=MAX_STOP_STRINGS)
    user: str | None = Field(None, max_length=256)
    # vLLM's extra sampling parameters.
    top_k: int | None = Field(None, ge=-1, le=1 << 20)
    """-1 or 0 disables."""
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0)
    ignore_eos: bool = False
    min_tokens: NonNegInt = 0
    stop_token_ids: Annotated[list[TokenId] | None, at_most(MAX_STOP_TOKEN_IDS)] = Field(
        None, max_length=MAX_STOP_TOKEN_IDS)
    include_stop_str_in_output: bool = False
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1)
    """Scheduling priority: lower is served first."""
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    """vLLM's: each prompt token's logprob given the tokens before it, with this many top
    alternatives, as each choice's ``prompt_logprobs`` (chat: the response's); not streamed."""

    def stream_problem(self) -> tuple[str, str] | None:
        """stream_options without stream (it would do nothing) and prompt_logprobs with it:
        refused, as OpenAI and vLLM refuse them."""
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed when stream is true"
        if self.prompt_logprobs is not None and self.stream:
            return "prompt_logprobs", "prompt_logprobs is not available with stream true (as vLLM)"
        return None


class CompletionRequest(SamplingFields):
    prompt: str | Annotated[list[str], at_most(MAX_PROMPTS)] | list[TokenId] \
        | Annotated[list[list[TokenId]], at_most(MAX_PROMPTS)]
    max_tokens: int | None = Field(16, ge=0, le=2**31 - 1)
    """0 with ``echo``: OpenAI's scoring call, the prompt (and its logprobs) with nothing written."""
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = Field(None, ge=1, le=128)
    suffix: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) of the first set field tokenmill cannot serve."""
        if (problem := self.stream_problem()) is not None:
            return problem
        if self.max_tokens == 0 and not self.echo:
            return "max_tokens", "max_tokens must be >= 1 (0 only with echo: the prompt scored, nothing written)"
        if self.suffix is not None:
            return "suffix", "suffix (insertion) is not supported by tokenmill"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of", f"best_of={self.best_of} is not supported (only best_of equal to n={self.n})"
        return None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    """A tool call of an assistant turn sent back in a later request's history."""

    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


def _message_by_role(schema: dict[str, Any]) -> None:
    """The published schema of a chat message: one shape per role, as OpenAI's own spec has it
    (tool_calls on an assistant turn only, tool_call_id required on a tool turn and nowhere
    else), so a client generated from /openapi.json knows what ``ChatMessage.invalid`` refuses.
    Validation stays the one model's (its errors name the message's index)."""
    fields = schema.pop("properties")
    for key in ("required", "additionalProperties", "type"):
        schema.pop(key, None)

    def shape(roles: list[str], *names: str, required: tuple[str, ...] = ()) -> dict[str, Any]:
        properties = {"role": {"type": "string", "enum": roles}} | {n: fields[n] for n in names}
        return {"type": "object", "additionalProperties": False, "required": ["role", *required],
                "properties": properties}

    schema["oneOf"] = [
        shape(["system", "developer", "user"], "content", "name"),
        shape(["assistant"], "content", "name", "tool_calls"),
        shape(["tool"], "content", "name", "tool_call_id", required=("tool_call_id",)),
    ]
    schema["oneOf"][2]["properties"]["tool_call_id"] = {"type": "string", "minLength": 1, "maxLength": 256}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra=_message_by_role)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], at_most(MAX_CONTENT_PARTS)] | None = None
    name: str | None = Field(None, max_length=256)
    """The template's ``message.name`` (a participant's name; on a tool turn, as some clients
    send it, the function that answered)."""
    tool_calls: Annotated[list[ToolCall] | None, at_most(128)] = Field(None, max_length=128)
    """An assistant turn's calls; the chat template gets them as ``message.tool_calls``, the
    arguments parsed (services/tokenizer/chat_messages.py)."""
    tool_call_id: str | None = Field(None, max_length=256)
    """A tool turn: the call whose result this is (required there, as OpenAI has it)."""

    def text(self) -> str:
        """The turn's text content (its calls travel apart)."""
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def invalid(self, index: int) -> tuple[str, str] | None:
        """(field, why) of what OpenAI refuses in this turn's tool fields."""
        where = f"messages.{index}"
        if self.role == "tool" and not self.tool_call_id:
            return f"{where}.tool_call_id", f"{where}.tool_call_id is required in a message of role tool"
        if self.tool_call_id is not None and self.role != "tool":
            return f"{where}.tool_call_id", f"{where}.tool_call_id is only for a message of role tool"
        if self.tool_calls and self.role != "assistant":
            return f"{where}.tool_calls", f"{where}.tool_calls is only for a message of role assistant"
        for number, call in enumerate(self.tool_calls or ()):
            field = f"{where}.tool_calls.{number}.function.arguments"
            if not call.function.arguments.strip():
                continue  # a function without parameters: the engine renders it as {}
            try:
                json.loads(call.function.arguments)
            except (ValueError, RecursionError) as exc:
                return field, f"{field} is not valid JSON: {exc}"
        return None


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    """The JSON Schema the reply must satisfy; absent = any JSON value."""
    strict: bool | None = None
    """Accepted; tokenmill always constrains decoding to the schema."""


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """The arguments' JSON Schema; absent = an object of any shape."""
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


UNSUPPORTED_CHAT_FIELDS = ("functions", "function_call", "audio", "modalities", "prediction", "web_search_options",
                           "reasoning_effort")


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], at_most(MAX_CHAT_MESSAGES)] = Field(
        min_length=1, max_length=MAX_CHAT_MESSAGES)
    max_tokens: int | None = Field(None, ge=1, le=2**31 - 1)
    max_completion_tokens: int | None = Field(None, ge=1, le=2**31 - 1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    metadata: Annotated[dict[str, Annotated[str, Field(max_length=512)]] | None, at_most(16)] = Field(
        None, max_length=16)
    """OpenAI's request metadata; tokenmill's conditional routes read it as metadata.<key>."""
    store: bool | None = None
    service_tier: str | None = None
    add_generation_prompt: bool = True
    tools: Annotated[list[Tool] | None, at_most(128)] = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    functions: Any = None
    function_call: Any = None
    response_format: ResponseFormat | None = None
    parallel_tool_calls: bool | None = None
    """false: a reply makes at most one call (the reader stops at the first); a constrained
    reply (tool_choice required or named) makes one call either way."""
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None

    def unsupported(self) -> tuple[str, str] | None:
        if (problem := self.stream_problem()) is not None:
            return problem
        for name in UNSUPPORTED_CHAT_FIELDS:
            if getattr(self, name) is not None:
                return name, f"{name} is not supported by tokenmill yet"
        if self.store:
            return "store", "store=true is not supported (tokenmill keeps no completions)"
        if self.service_tier not in (None, "auto", "default"):
            return "service_tier", f"service_tier {self.service_tier!r} is not supported (only auto or default)"
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs=true"
        return None

    def invalid_history(self) -> tuple[str, str] | None:
        """(field, why) of the first turn whose tool fields OpenAI would refuse."""
        return next((problem for index, turn in enumerate(self.messages)
                     if (problem := turn.invalid(index)) is not None), None)


# ---------------------------------------------------------------------------- responses (documentation)
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class Model(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    """As vLLM answers: what the id serves (the model id itself; an adapter's own name, its path
    on the engine not being told)."""
    parent: str | None = None
    """A LoRA adapter's base model id (vLLM's field); null for a base model."""


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[Model]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
