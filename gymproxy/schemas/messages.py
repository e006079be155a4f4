"""Anthropic's Messages API as vLLM 0.32 reads it (`vllm/entrypoints/anthropic/protocol.py`): the
request of a captured `/v1/messages` call, decoded once and checked as vLLM's pydantic models
check it, so that what vLLM would refuse is a 400 naming the field, and what it accepts converts.

Unknown fields are ignored, as vLLM's models ignore them (Claude Code sends `context_management`,
which vLLM drops). The checks vLLM's validators make across fields are `convert.anthropic`'s.
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

import msgspec
from msgspec import Meta

BlockType = Literal[
    "text",
    "image",
    "tool_use",
    "tool_result",
    "tool_reference",
    "thinking",
    "redacted_thinking",
    "tool_addition",
    "tool_removal",
]
Effort = Literal["low", "medium", "high", "xhigh", "max"]
Display = Literal["summarized", "omitted", "updates"]


class Tool(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None
    defer_loading: bool | None = None


class ToolReference(msgspec.Struct, tag_field="type", tag="tool_reference"):
    """A tool named by a `tool_addition` or `tool_removal` block."""

    name: str


class ToolDefinition(msgspec.Struct, tag_field="type", tag="tool_definition"):
    """A tool defined by value in a `tool_addition` block."""

    definition: Tool


class ContentBlock(msgspec.Struct, kw_only=True):
    """One block of a message (vLLM has a single model for every block type)."""

    type: BlockType
    text: str | None = None
    source: dict[str, Any] | None = None
    id: str | None = None
    tool_use_id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None
    tool_name: str | None = None
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None
    tool: ToolReference | ToolDefinition | None = None


class Message(msgspec.Struct, kw_only=True):
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class ToolChoice(msgspec.Struct, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class OutputFormat(msgspec.Struct, kw_only=True):
    json_schema: dict[str, Any] | None = msgspec.field(default=None, name="schema")
    type: Literal["json_schema"] = "json_schema"


class OutputConfig(msgspec.Struct, kw_only=True):
    effort: Effort | None = None
    format: OutputFormat | None = None


class ThinkingEnabled(msgspec.Struct, tag_field="type", tag="enabled", kw_only=True):
    budget_tokens: Annotated[int, Meta(ge=1024)]
    display: Display | None = None


class ThinkingDisabled(msgspec.Struct, tag_field="type", tag="disabled"):
    pass


class ThinkingAdaptive(msgspec.Struct, tag_field="type", tag="adaptive", kw_only=True):
    display: Display | None = None


class MessagesRequest(msgspec.Struct, kw_only=True):
    """`POST /v1/messages` (vLLM's `AnthropicMessagesRequest`, its extensions included)."""

    model: Annotated[str, Meta(min_length=1)]
    messages: list[Message]
    max_tokens: Annotated[int, Meta(gt=0)]
    metadata: dict[str, Any] | None = None
    output_config: OutputConfig | None = None
    thinking: ThinkingEnabled | ThinkingDisabled | ThinkingAdaptive | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    system: str | list[ContentBlock] | None = None
    temperature: float | None = None
    tool_choice: ToolChoice | None = None
    tools: list[Tool] | None = None
    top_k: int | None = None
    top_p: float | None = None
    # vLLM's own fields (not in Anthropic's API)
    mm_payload: Literal["tensors", "none"] = "tensors"  # for its render endpoints; ignored here, as there
    return_mm_kwargs: bool | None = None
    cache_salt: Annotated[str, Meta(min_length=1, max_length=1024)] | None = None
    watermarking: bool | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


MESSAGES_DECODER: Final = msgspec.json.Decoder(MessagesRequest)
