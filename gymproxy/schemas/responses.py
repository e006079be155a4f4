"""The OpenAI Responses API: the request gymproxy accepts and the Response object it returns.

Strictness follows NeMo Gym's validation: the top level and its structured members (tools,
tool_choice, reasoning, text) reject unknown keys; input items and their content parts ignore
them, as the SDK's item types do.
"""

from __future__ import annotations

from typing import Any, Final, Literal

import msgspec
from msgspec import UNSET, UnsetType

from . import Reply, Strict, Wire

# --- request: input items -------------------------------------------------------------------


class ImageURL(Wire):
    url: str


class ContentPart(Wire, kw_only=True):
    """One content part of an input item (`input_text`, `input_image`, `output_text`, ...)."""

    type: str
    text: str | None = None
    refusal: str | None = None
    image_url: str | ImageURL | None = None
    detail: str | None = None
    file_id: str | None = None
    video_url: str | ImageURL | None = None
    video: str | ImageURL | None = None


class SummaryPart(Wire):
    text: str
    type: str = "summary_text"


class ChatFunction(Wire):
    name: str
    arguments: str = ""


class ChatToolCall(Wire, kw_only=True):
    """A chat-style tool call some clients put on assistant input items."""

    id: str
    function: ChatFunction
    type: str = "function"


class InputItem(Wire, kw_only=True):
    """Any input item; `type` selects which fields matter (a missing `type` with a `role` is a message)."""

    type: str | None = None
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[ContentPart] | None = None
    phase: Any = None
    summary: list[SummaryPart] = []
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    namespace: str | None = None
    output: str | list[ContentPart] | None = None
    tool_calls: list[ChatToolCall] | None = None
    # Training-mode token metadata echoed back from an earlier turn's output items.
    prompt_token_ids: list[int] | None = None
    generation_token_ids: list[int] | None = None
    generation_log_probs: list[float] | None = None
    routed_experts: Any = None


# --- request: tools, tool_choice, reasoning, text -------------------------------------------

NULL: Final = msgspec.Raw(b"null")  # an absent or null JSON Schema, kept as raw bytes


class FunctionTool(Strict, tag_field="type", tag="function", kw_only=True):
    name: str
    parameters: msgspec.Raw = NULL
    strict: bool | None = None
    description: str | None = None
    defer_loading: bool | None = None


class CustomTool(Strict, tag_field="type", tag="custom", kw_only=True):
    name: str
    description: str | None = None
    format: dict[str, Any] | None = None
    defer_loading: bool | None = None


Tool = FunctionTool | CustomTool


class FunctionChoice(Strict, tag_field="type", tag="function"):
    name: str


class CustomChoice(Strict, tag_field="type", tag="custom"):
    name: str


class ToolRef(Strict, kw_only=True):
    type: str
    name: str | None = None


class AllowedToolsChoice(Strict, tag_field="type", tag="allowed_tools"):
    mode: Literal["auto", "required"]
    tools: list[ToolRef]


ToolChoice = Literal["auto", "none", "required"] | FunctionChoice | CustomChoice | AllowedToolsChoice


class ReasoningParams(Strict, kw_only=True):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None
    context: Any = None


class ReasoningEcho(Reply, kw_only=True):
    context: Any = None
    effort: str | None = None
    generate_summary: str | None = None
    summary: str | None = None


class FormatText(Strict, tag_field="type", tag="text"):
    pass


class FormatJSONObject(Strict, tag_field="type", tag="json_object"):
    pass


class FormatJSONSchema(Strict, tag_field="type", tag="json_schema", kw_only=True):
    name: str
    schema: msgspec.Raw
    strict: bool | None = None
    description: str | None = None


TextFormat = FormatText | FormatJSONObject | FormatJSONSchema


class TextParams(Strict, kw_only=True):
    format: TextFormat | None = None
    verbosity: str | None = None


class TextEcho(Reply, kw_only=True):
    format: TextFormat | None = None
    verbosity: str | None = None


class StreamOptions(Strict, kw_only=True):
    include_obfuscation: bool | None = None


# --- request ---------------------------------------------------------------------------------


class ResponsesRequest(Strict, kw_only=True):
    """`POST /v1/responses`. A null field counts as not sent, as in NeMo Gym (exclude-none)."""

    input: str | list[InputItem]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    parallel_tool_calls: bool | None = None
    tool_choice: ToolChoice | None = None
    tools: list[Tool] | None = None
    reasoning: ReasoningParams | None = None
    text: TextParams | None = None
    user: str | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    moderation: Any = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # No Chat Completions representation: refused when sent non-null.
    background: Any = None
    context_management: Any = None
    conversation: Any = None
    include: Any = None
    max_tool_calls: Any = None
    previous_response_id: Any = None
    prompt: Any = None
    truncation: Any = None


REFUSED_FIELDS: Final = (
    "background",
    "context_management",
    "conversation",
    "include",
    "max_tool_calls",
    "previous_response_id",
    "prompt",
    "truncation",
)

REQUEST_DECODER: Final = msgspec.json.Decoder(ResponsesRequest)


# --- the Response object ---------------------------------------------------------------------


class SummaryText(Reply, kw_only=True):
    text: str
    type: str = "summary_text"


class TokenFields(Reply, kw_only=True):
    """Training-mode token information; attached to the last output item only."""

    prompt_token_ids: list[int] | UnsetType = UNSET
    generation_token_ids: list[int] | UnsetType = UNSET
    generation_log_probs: list[float] | UnsetType = UNSET
    routed_experts: Any = UNSET


class ReasoningItem(TokenFields, tag_field="type", tag="reasoning", kw_only=True):
    id: str
    summary: list[SummaryText]
    encrypted_content: None = None
    content: None = None


class OutputText(Reply, tag_field="type", tag="output_text", kw_only=True):
    text: str
    annotations: list[Any] = []
    logprobs: None = None


class Refusal(Reply, tag_field="type", tag="refusal", kw_only=True):
    refusal: str


class MessageItem(TokenFields, tag_field="type", tag="message", kw_only=True):
    id: str
    content: list[OutputText | Refusal]
    role: str = "assistant"
    status: str = "completed"
    phase: None = None


class FunctionCallItem(TokenFields, tag_field="type", tag="function_call", kw_only=True):
    arguments: str
    call_id: str
    name: str
    id: str
    status: str = "completed"
    namespace: None = None


class CustomToolCallItem(TokenFields, tag_field="type", tag="custom_tool_call", kw_only=True):
    call_id: str
    input: str
    name: str
    id: str
    status: str = "completed"


OutputItem = ReasoningItem | MessageItem | FunctionCallItem | CustomToolCallItem


# The detail counts are integers on the wire (0 when vLLM reports none): Codex CLI fails to parse a
# `response.completed` whose usage carries a null there. NeMo Gym 0.7.0 copies the null.
class InputTokensDetails(Reply):
    cached_tokens: int = 0


class OutputTokensDetails(Reply):
    reasoning_tokens: int = 0


class ResponseUsage(Reply, kw_only=True):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(Reply):
    reason: str


class ResponseError(Reply):
    code: str
    message: str


class Response(Reply, kw_only=True):
    """The Response object, with the full key set of openai-python 2.44."""

    id: str
    created_at: float
    model: str | None
    output: list[OutputItem]
    status: str
    object: str = "response"
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool = True
    temperature: float | None = None
    tool_choice: ToolChoice = "auto"
    tools: list[Tool] = []
    top_p: float | None = None
    background: None = None
    completed_at: float | None = None
    conversation: None = None
    max_output_tokens: int | None = None
    max_tool_calls: None = None
    moderation: None = None
    previous_response_id: None = None
    prompt: None = None
    prompt_cache_key: None = None
    prompt_cache_retention: None = None
    reasoning: ReasoningEcho | None = None
    safety_identifier: None = None
    service_tier: str | None = None
    text: TextEcho | None = None
    top_logprobs: int | None = None
    truncation: None = None
    usage: ResponseUsage | None = None
    user: str | None = None
    native_finish_reason: str | UnsetType = UNSET
