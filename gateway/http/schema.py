"""The OpenAI-compatible HTTP API's bodies, as pydantic models (they document ``/openapi.json``).

Requests accept what OpenAI's chat and completions endpoints accept, tools and response formats
included. Fields Loom ignores by design (unknown ones) are dropped; fields whose meaning Loom cannot
honour (images, audio, logit bias...) are refused by name in ``unsupported_fields``, because silently
ignoring them would return an answer the client did not ask for. Loom's own ``priority`` and ``top_k``
ride as extra body fields, as vLLM's extensions do, and so do vLLM's output constraints
(``structured_outputs``, and the older ``guided_json``, ``guided_regex``, ``guided_choice`` and
``guided_grammar``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator

from common import Priority
from protocol.limits import LIMITS

# Every list a body may hold is bounded in the schema, so pydantic refuses a long one with one error
# before a per-element error is made for it (a list of a million wrong items would otherwise make a
# million errors, each a Python object, before any of our checks ran).
MAX_CONTENT_PARTS = 256
MAX_TOOLS = 128


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields are ignored (checked by name below)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    # Parts are checked by ``unsupported_fields``, one violation per bad part at most.
    content: str | Annotated[list[Any], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    tool_calls: Annotated[list[Any], Field(max_length=MAX_TOOLS)] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool result's call


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's output constraints (``structured_outputs``); exactly one may be set."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(max_length=LIMITS.max_choice_options)] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _Sampling(_Body):
    model: str
    temperature: float | None = Field(None, description="default 1; 0 is greedy")
    top_p: float | None = None
    top_k: int | None = Field(None, description="Loom/vLLM extension; 0 or unset: no top-k cut")
    seed: int | None = None
    stop: str | Annotated[list[str], Field(max_length=LIMITS.max_stop_strings)] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, description="your end-user's id: logged with the request id")
    priority: Priority | None = Field(None, description="Loom: a hint, capped by the tenant's ceiling")
    request_id: str | None = Field(None, description="Loom: echoed; the admission's idempotency key")
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM: one output constraint")
    guided_json: dict[str, Any] | str | None = Field(None, description="vLLM (older): a JSON schema")
    guided_regex: str | None = Field(None, description="vLLM (older): a regular expression")
    guided_choice: Annotated[list[str], Field(max_length=LIMITS.max_choice_options)] | None = Field(
        None, description="vLLM (older): the output is one of these"
    )
    guided_grammar: str | None = Field(None, description="vLLM (older): a Lark or GBNF grammar")
    speculative: bool | None = Field(
        None, description="Loom: opt into speculative decoding (unset: the tenant's setting)"
    )


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessageIn], Field(max_length=LIMITS.max_messages)]
    tools: Annotated[list[Any], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    _tool_plan: Any = PrivateAttr(None)  # what tools and tool_choice mean (gateway/http/tools.py)

    @property
    def tool_plan(self) -> Any:
        return self._tool_plan

    @tool_plan.setter
    def tool_plan(self, plan: Any) -> None:
        self._tool_plan = plan

    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] = Field(description="one text prompt (or a list holding one)")
    max_tokens: int | None = Field(16, description="as OpenAI: 16 when unset")
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_text_prompt(cls, value: Any) -> Any:
        """Token-id and batched prompts are refused here, as one error, before their elements are
        validated one by one."""
        if isinstance(value, list) and not (len(value) == 1 and isinstance(value[0], str)):
            raise ValueError(
                "send one text prompt per request (token-id and batched prompts are not supported)"
            )
        return value


# Fields that change what the answer means, which Loom cannot honour: refused by name, never ignored.
# Each maps to the value that means "not used" (a request may send that value).
_UNSUPPORTED: dict[str, Any] = {
    "functions": None,  # the deprecated form of tools
    "function_call": None,
    "audio": None,
    "prediction": None,
    "web_search_options": None,
    "logit_bias": None,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "repetition_penalty": 1,
}
_UNSUPPORTED_MODALITIES = {"image_url", "input_audio", "file", "image", "audio", "video"}


def unsupported_fields(body: ChatCompletionRequest | CompletionRequest) -> list[tuple[str, str]]:
    """(field, why) for each field this request sets to a meaning Loom cannot give it."""
    bad: list[tuple[str, str]] = []
    extra = body.model_extra or {}
    for name, off in _UNSUPPORTED.items():
        value = extra.get(name, off)
        if value not in (off, None, {}, []):
            bad.append(
                (name, "is not supported by Loom" + (" (use tools)" if name.startswith("func") else ""))
            )
    modalities = extra.get("modalities")
    if modalities not in (None, ["text"]):
        bad.append(("modalities", "only text output is supported"))
    if isinstance(body, ChatCompletionRequest):
        for i, m in enumerate(body.messages):
            if m.role == "function":
                bad.append((f"messages[{i}].role", "'function' messages are not supported (use tools)"))
            for j, part in enumerate(m.content if isinstance(m.content, list) else []):
                if not isinstance(part, dict):
                    bad.append((f"messages[{i}].content[{j}]", "must be a content part object"))
                    continue
                kind = part.get("type")
                if kind in _UNSUPPORTED_MODALITIES:
                    bad.append((f"messages[{i}].content[{j}]", f"{kind!r} input is not supported; send text"))
                elif kind != "text":
                    bad.append((f"messages[{i}].content[{j}].type", f"unknown content part {kind!r}"))
    else:
        if body.echo:
            bad.append(("echo", "is not supported by Loom"))
        if body.suffix:
            bad.append(("suffix", "is not supported by Loom"))
        if body.best_of is not None and body.best_of != body.n:
            bad.append(("best_of", "is not supported by Loom (use n)"))
    return bad


def compact_extras(body: BaseModel) -> None:
    """Keep of the fields the schema does not declare only what ``unsupported_fields`` reads, each
    value cut to what decides its verdict: unknown fields are ignored by design, and a field such
    as ``functions`` may hold a hundred thousand items that would otherwise be kept, and copied."""
    extra = body.model_extra
    if not extra:
        return
    kept = {k: _verdict_value(k, v) for k, v in extra.items() if k in _UNSUPPORTED or k == "modalities"}
    extra.clear()
    extra.update(kept)


def _verdict_value(name: str, value: Any) -> Any:
    if name == "modalities" and isinstance(value, list) and len(value) <= 4:
        return value
    if isinstance(value, (list, dict)):
        return value if not value else ["set"]  # empty means "not used"; anything else is refused
    return value


# ---- responses -------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class UsageOut(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprobOut(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobOut(TopLogprobOut):
    top_logprobs: list[TopLogprobOut]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobOut]


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageOut


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageOut


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "loom"
    context_length: int
    pool: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
