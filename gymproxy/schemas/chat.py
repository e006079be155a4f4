"""Chat Completions: typed views of the request gymproxy checks and of the replies it reads.

`/v1/chat/completions` forwards fields it does not know (vLLM's `top_k`, `min_p`, ...), so the
request is carried as a mapping and `ChatRequestView` only validates the fields gymproxy acts on.
Replies are decoded into views holding just the fields the Responses conversion reads.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from . import Wire

# --- request view ----------------------------------------------------------------------------


class ChatMessageView(Wire, kw_only=True):
    role: str
    content: Any = None


class ChatRequestView(Wire, kw_only=True):
    """The request fields gymproxy reads or rewrites; anything else passes through untouched."""

    messages: list[ChatMessageView]
    model: str | None = None
    stream: bool | None = None
    n: int | None = None
    tools: list[dict[str, Any]] | None = None
    metadata: dict[str, str] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    stream_options: dict[str, Any] | None = None


# --- reply views -----------------------------------------------------------------------------


class FunctionCall(Wire):
    name: str = ""
    arguments: str = ""


class ToolCall(Wire, kw_only=True):
    id: str = ""
    type: str = "function"
    function: FunctionCall | None = None
    custom: dict[str, Any] | None = None


class AssistantMessage(Wire, kw_only=True):
    role: str = "assistant"
    content: str | None = None
    refusal: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None
    prompt_token_ids: Any = None
    generation_token_ids: Any = None
    generation_log_probs: Any = None
    routed_experts: Any = None


class Choice(Wire, kw_only=True):
    index: int = 0
    message: AssistantMessage = msgspec.field(default_factory=AssistantMessage)
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string matched (or token id)
    native_finish_reason: Any = None
    logprobs: Any = None
    token_ids: Any = None


class PromptTokensDetails(Wire):
    cached_tokens: Any = None
    created_cache_tokens: Any = None


class CompletionTokensDetails(Wire):
    reasoning_tokens: Any = None


class Usage(Wire, kw_only=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None
    cached_input_tokens: Any = None
    cache_read_input_tokens: Any = None
    reasoning_output_tokens: Any = None


class ChatCompletion(Wire, kw_only=True):
    """A chat completion as the Responses conversion reads it."""

    id: str = ""
    object: str = "chat.completion"
    created: float = 0
    model: str | None = None
    choices: list[Choice] = []
    usage: Usage | None = None
    prompt_token_ids: Any = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None


class ChunkDelta(Wire, kw_only=True):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    refusal: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChunkChoice(Wire, kw_only=True):
    index: int = 0
    delta: ChunkDelta = msgspec.field(default_factory=ChunkDelta)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: Any = None
    token_ids: Any = None


class ChatChunk(Wire, kw_only=True):
    """One streamed `chat.completion.chunk`, or vLLM's in-stream `{"error": ...}`."""

    id: str = ""
    object: str = "chat.completion.chunk"
    created: float = 0
    model: str | None = None
    choices: list[ChunkChoice] = []
    usage: Usage | None = None
    prompt_token_ids: Any = None
    error: Any = None


COMPLETION_DECODER: Final = msgspec.json.Decoder(ChatCompletion)
CHUNK_DECODER: Final = msgspec.json.Decoder(ChatChunk)
