"""The OpenAI Responses API: the request gymproxy accepts and the Response object it returns.

The request holds every field of the Responses API's (openai-python 3.57). Strictness follows NeMo
Gym's validation: the top level and its structured members (tools, tool_choice, reasoning, text)
reject unknown keys, except hosted tools, whose members are never read; input items and their
content parts ignore them, as the SDK's item types do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final, Literal, Union

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
    summary: list[SummaryPart] | None = None  # a reasoning item's; Codex may send null
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
    weight_version: Any = None  # what gymproxy stamped on it; accepted and not used


# --- request: tools, tool_choice, reasoning, text -------------------------------------------

NULL: Final = msgspec.Raw(b"null")  # an absent or null JSON Schema, kept as raw bytes


class FunctionTool(Strict, tag_field="type", tag="function", kw_only=True):
    name: str
    parameters: msgspec.Raw = NULL
    strict: bool | None = None
    description: str | None = None
    defer_loading: bool | None = None
    # No chat form: accepted, echoed only when sent, never sent to vLLM.
    allowed_callers: list[str] | None | UnsetType = UNSET
    output_schema: dict[str, Any] | None | UnsetType = UNSET
    async_: bool | UnsetType = msgspec.field(default=UNSET, name="async")


class CustomTool(Strict, tag_field="type", tag="custom", kw_only=True):
    name: str
    description: str | None = None
    format: dict[str, Any] | None = None
    defer_loading: bool | None = None
    allowed_callers: list[str] | None | UnsetType = UNSET
    async_: bool | UnsetType = msgspec.field(default=UNSET, name="async")


class NamespaceTool(Strict, tag_field="type", tag="namespace", kw_only=True):
    """Function and custom tools grouped under one name (Codex CLI); flattened for vLLM as `<name>__<tool>`."""

    name: str
    tools: list[FunctionTool | CustomTool]
    description: str | None = None


class HostedTool(msgspec.Struct):
    """A tool OpenAI runs itself (web search, MCP, a shell, ...): it has no chat form, so it is
    dropped. Its members are not read (so not checked)."""

    @property
    def kind(self) -> str:
        """The tool's `type`."""
        tag: str = self.__struct_config__.tag  # type: ignore[assignment]  # every subclass has one
        return tag


class HostedChoice(msgspec.Struct):
    """A `tool_choice` naming a hosted tool type: refused, as the tool is dropped."""

    @property
    def kind(self) -> str:
        """The tool type named."""
        tag: str = self.__struct_config__.tag  # type: ignore[assignment]
        return tag


# The hosted tool types of openai-python 3.57's `ToolParam` (and `computer_use`, a `tool_choice`
# type). A tool of a type in neither `TOOL_TYPES` nor this list is dropped too, by
# `convert.request.RequestReader`, on a slower path (the body is decoded twice).
HOSTED_TOOL_TYPES: Final = (
    "apply_patch",
    "code_interpreter",
    "computer",
    "computer_use",
    "computer_use_preview",
    "file_search",
    "image_generation",
    "local_shell",
    "mcp",
    "programmatic_tool_calling",
    "shell",
    "tool_search",
    "web_search",
    "web_search_2025_08_26",
    "web_search_preview",
    "web_search_preview_2025_03_11",
)
TOOL_TYPES: Final = frozenset(("function", "custom", "namespace", *HOSTED_TOOL_TYPES))


def _hosted(base: type[msgspec.Struct], prefix: str) -> tuple[type[msgspec.Struct], ...]:
    """One lenient tagged Struct per hosted type (msgspec dispatches a union on the tag)."""
    return tuple(
        msgspec.defstruct(f"{prefix}_{kind}", [], bases=(base,), tag_field="type", tag=kind, module=__name__)
        for kind in HOSTED_TOOL_TYPES
    )


_HOSTED_TOOLS: Final = _hosted(HostedTool, "HostedTool")
_HOSTED_CHOICES: Final = _hosted(HostedChoice, "HostedChoice")

if TYPE_CHECKING:
    Tool = FunctionTool | CustomTool | NamespaceTool | HostedTool
else:
    Tool = Union[(FunctionTool, CustomTool, NamespaceTool) + _HOSTED_TOOLS]  # noqa: UP007


class FunctionChoice(Strict, tag_field="type", tag="function"):
    name: str


class CustomChoice(Strict, tag_field="type", tag="custom"):
    name: str


class ToolRef(Strict, kw_only=True):
    type: str
    name: str | None = None
    server_label: str | UnsetType = UNSET  # an `mcp` ref's


class AllowedToolsChoice(Strict, tag_field="type", tag="allowed_tools"):
    mode: Literal["auto", "required"]
    tools: list[ToolRef]


if TYPE_CHECKING:
    ToolChoice = Literal["auto", "none", "required"] | FunctionChoice | CustomChoice | AllowedToolsChoice | HostedChoice
else:
    ToolChoice = Union[  # noqa: UP007
        (Literal["auto", "none", "required"], FunctionChoice, CustomChoice, AllowedToolsChoice) + _HOSTED_CHOICES
    ]


class ReasoningParams(Strict, kw_only=True):
    """`reasoning`: only `effort` has a vLLM meaning (`reasoning_effort`); the rest is accepted."""

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None
    context: Any = None
    mode: str | None = None


class ReasoningEcho(Reply, kw_only=True):
    context: Any = None
    effort: str | None = None
    generate_summary: str | None = None
    summary: str | None = None
    mode: str | UnsetType = UNSET  # newer than the key set NeMo Gym echoes: only when sent


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
    """`POST /v1/responses`: every field of openai-python 3.57's `ResponseCreateParams`, and Codex
    CLI's `client_metadata`. A null field counts as not sent, as in NeMo Gym (exclude-none).

    docs/routes.md's "Responses request fields" says what becomes of each.
    """

    # Sent to vLLM (converted by `convert/request.py`).
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
    stream: bool | None = None
    # Accepted and not sent: no vLLM meaning, and ignoring them answers the request as asked.
    stream_options: StreamOptions | None = None
    store: bool | None = None
    include: list[str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = None
    moderation: Any = None
    max_tool_calls: int | None = None
    background_options: dict[str, Any] | None = None
    access_programs: dict[str, Any] | None = None
    image: dict[str, Any] | None = None
    client_metadata: dict[str, Any] | None = None
    # Refused when they ask for what gymproxy cannot do (`convert.request.refusals`).
    background: bool | None = None
    context_management: list[Any] | None = None
    conversation: str | dict[str, Any] | None = None
    previous_response_id: str | None = None
    prompt: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None


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
    weight_version: str | UnsetType = UNSET  # the engine's weight version(s) while it was sampled


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
    namespace: str | None = None  # the namespace tool it belongs to (`name` is then the sub-tool's)


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
