"""Anthropic's Messages API on vLLM's chat API, for captured `/v1/messages` calls (vLLM's Anthropic
endpoint returns no token ids). Pure functions and a sans-IO stream translator, each mirroring
vLLM 0.32's `vllm/entrypoints/anthropic/serving.py`, so that vLLM renders the same prompt, and
the client gets the same answer, as if the call had been relayed:

- `to_chat_body`: the chat request vLLM's endpoint builds (system text joined, inline system
  messages in place or merged into it as vLLM's template probe decides, blocks as chat parts,
  a user turn's tool results before its text, `tool_use` arguments as Python's `json.dumps`
  writes them, tool changes applied, sampling fields, stream options). What has no exact chat
  form over HTTP is a 400 naming the field (`thinking.type: disabled`, `tools: []`, a
  `tool_choice` without tools).
- `to_message`: vLLM's whole chat reply as the `message` object vLLM's endpoint answers.
- `MessagesStream`: vLLM's chat chunks as the endpoint's events, each as it arrives.
"""

from __future__ import annotations

import json
import time
from typing import Any, Final

import msgspec

from ..errors import BadRequest, UpstreamError, UpstreamStatus
from ..ids import hex32
from ..messages import envelope, stream_error
from ..schemas import ENCODER
from ..schemas.chat import CHUNK_DECODER, ChatChunk, ChatCompletion, ChunkChoice, ChunkDelta, Usage
from ..schemas.messages import (
    ContentBlock,
    Message,
    MessagesRequest,
    ThinkingDisabled,
    ThinkingEnabled,
    Tool,
    ToolDefinition,
)
from .stream import chunk_error
from .tokens import TokenInfo

BILLING_HEADER: Final = "x-anthropic-billing-header"  # Claude Code's per-request system block; vLLM drops it
# vLLM probes its chat template with this conversation; if the template raises, it merges inline
# system messages into the leading one (`_detect_merge_inline_system`).
PROBE_MESSAGES: Final = [{"role": role, "content": "t"} for role in ("system", "user", "system", "user")]
_TOOL_CHOICES: Final = {"auto": "auto", "any": "required", "none": "none"}


# --- the request ---------------------------------------------------------------------------------


def has_inline_system(req: MessagesRequest) -> bool:
    """Whether a `system` message among `messages` has text: where it goes then depends on the
    upstream's chat template (`probe_body`)."""
    return any(message.role == "system" and _inline_system_text(message) for message in req.messages)


def probe_body(model: str) -> dict[str, Any]:
    """The /tokenize body that renders vLLM's probe conversation: a 400 (the template raised) means
    vLLM merges inline system messages into the leading one."""
    return {"model": model, "messages": PROBE_MESSAGES, "add_generation_prompt": False}


def to_chat_body(req: MessagesRequest, *, merge_inline_system: bool) -> dict[str, Any]:
    """The chat request vLLM's Anthropic endpoint makes of `req`; a `BadRequest` naming the field for
    what vLLM would refuse, and for what has no exact chat form."""
    _check(req)
    messages: list[dict[str, Any]] = []
    system = _system_parts(req, merge_inline_system)
    if system:
        messages.append({"role": "system", "content": "".join(system)})
    for index, message in enumerate(req.messages):
        _message(message, index, messages, merge_inline_system)
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "max_tokens": req.max_tokens,
        "max_completion_tokens": req.max_tokens,
        "stop": req.stop_sequences,  # null, not chat's default `[]`, as vLLM sets it
    }
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "watermarking",
        "cache_salt",
        "kv_transfer_params",
        "ec_transfer_params",
        "vllm_xargs",
        "chat_template_kwargs",
    ):
        value = getattr(req, name)
        if value is not None:
            body[name] = value
    if req.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    config = req.output_config
    if config is not None:
        if config.format is not None and config.format.json_schema:
            schema = {"name": config.format.type, "schema": config.format.json_schema}
            body["response_format"] = {"type": config.format.type, "json_schema": schema}
        if config.effort is not None:
            body["reasoning_effort"] = config.effort
    if isinstance(req.thinking, ThinkingEnabled):
        body["thinking_token_budget"] = req.thinking.budget_tokens
    _tools(req, body)
    return body


def _check(req: MessagesRequest) -> None:
    """vLLM's validators beyond the types, and the fields with no exact chat form."""
    thinking = req.thinking
    if isinstance(thinking, ThinkingDisabled):
        # vLLM sends `reasoning_effort` "none" or "low" then, as probing its template decided: gymproxy
        # cannot see which, and would render another prompt.
        raise BadRequest(
            "thinking.type `disabled` cannot be captured: vLLM maps it to a reasoning effort it chose by "
            "probing its chat template, which gymproxy cannot know; send `output_config.effort` instead",
            param="thinking.type",
        )
    remote = isinstance(req.kv_transfer_params, dict) and req.kv_transfer_params.get("do_remote_decode")
    if isinstance(thinking, ThinkingEnabled) and not remote and thinking.budget_tokens >= req.max_tokens:
        raise BadRequest("thinking.budget_tokens must be less than max_tokens", param="thinking.budget_tokens")
    choice = req.tool_choice
    if choice is not None and choice.type == "tool" and not choice.name:
        raise BadRequest("tool_choice.name is required when type is 'tool'", param="tool_choice.name")
    if isinstance(req.system, list):
        _no_tool_changes(req.system, "system")
    for index, message in enumerate(req.messages):
        if isinstance(message.content, str):
            continue
        for i, block in enumerate(message.content):
            where = f"messages[{index}].content[{i}]"
            if block.type in ("tool_addition", "tool_removal"):
                if message.role != "system":
                    raise BadRequest(
                        f'{block.type} blocks are only allowed in messages with role "system"', param=where
                    )
                if block.tool is None:
                    raise BadRequest(f"tool is required for {block.type} blocks", param=f"{where}.tool")
                if block.type == "tool_removal" and isinstance(block.tool, ToolDefinition):
                    raise BadRequest("tool_removal only accepts a tool_reference", param=f"{where}.tool")


def _no_tool_changes(blocks: list[ContentBlock], where: str) -> None:
    for i, block in enumerate(blocks):
        if block.type in ("tool_addition", "tool_removal"):
            raise BadRequest(
                f'{block.type} blocks are only allowed in messages with role "system"', param=f"{where}[{i}]"
            )


def _system_parts(req: MessagesRequest, merge_inline_system: bool) -> list[str]:
    parts: list[str] = []
    system = req.system
    if isinstance(system, str):
        if system:
            parts.append(system)  # a string is not checked for the billing header, as in vLLM
    elif system:
        parts += [b.text for b in system if b.type == "text" and b.text and not b.text.startswith(BILLING_HEADER)]
    if merge_inline_system:
        parts += [text for m in req.messages if m.role == "system" and (text := _inline_system_text(m))]
    return parts


def _inline_system_text(message: Message) -> str | None:
    content = message.content
    if isinstance(content, str):
        return None if content.startswith(BILLING_HEADER) else content
    parts = [b.text for b in content if b.type == "text" and b.text and not b.text.startswith(BILLING_HEADER)]
    return "".join(parts) if parts else None


def _message(message: Message, index: int, out: list[dict[str, Any]], merge_inline_system: bool) -> None:
    """One message as chat messages: a user turn's tool results go first (vLLM appends them while it
    reads the blocks, and the turn after); a user turn with nothing else left is dropped."""
    if message.role == "system":
        text = None if merge_inline_system else _inline_system_text(message)
        if text:
            out.append({"role": "system", "content": text})
        return
    turn: dict[str, Any] = {"role": message.role}
    if isinstance(message.content, str):
        turn["content"] = message.content
    else:
        _blocks(message.role, message.content, index, turn, out)
    if not (message.role == "user" and "content" not in turn):
        out.append(turn)


def _blocks(role: str, blocks: list[ContentBlock], index: int, turn: dict[str, Any], out: list[dict[str, Any]]) -> None:
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for i, block in enumerate(blocks):
        kind = block.type
        if kind == "text" and block.text:
            parts.append({"type": "text", "text": block.text})
        elif kind == "image" and block.source:
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block.source)}})
        elif kind == "thinking" and block.thinking is not None:
            reasoning.append(block.thinking)
        elif kind == "tool_use":
            function = {"name": block.name or "", "arguments": json.dumps(block.input or {})}  # Python's spacing
            calls.append({"id": block.id or f"call_{int(time.time())}", "type": "function", "function": function})
        elif kind == "tool_result" and role == "user":
            _tool_result(block, f"messages[{index}].content[{i}]", out)
        elif kind == "tool_result":
            # vLLM writes the content with Python's str(): a list of blocks as its repr.
            parts.append({"type": "text", "text": f"Tool result: {str(block.content) if block.content else ''}"})
    if reasoning:
        turn["reasoning"] = "".join(reasoning)
    if calls:
        turn["tool_calls"] = calls
    if parts:
        turn["content"] = parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text" else parts


def _tool_result(block: ContentBlock, where: str, out: list[dict[str, Any]]) -> None:
    """A user's `tool_result` as a tool message (then its images as a user message, and its tool
    references as a second tool message), as vLLM's `_convert_user_tool_result` does."""
    text = ""
    images: list[str] = []
    references: list[dict[str, Any]] = []
    content = block.content
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts: list[str] = []
        for i, item in enumerate(content):
            kind = item.get("type")
            if kind == "text":
                value = item.get("text", "")
                if not isinstance(value, str):
                    raise BadRequest("a tool_result's text must be a string", param=f"{where}.content[{i}].text")
                texts.append(value)
            elif kind == "image":
                source = item.get("source", {})
                if not isinstance(source, dict):
                    raise BadRequest("an image's source must be an object", param=f"{where}.content[{i}].source")
                if url := _image_url(source):
                    images.append(url)
            elif kind == "tool_reference" and (name := item.get("tool_name") or item.get("name")):
                references.append({"type": "tool_reference", "name": name})
        text = "\n".join(texts)
    out.append({"role": "tool", "tool_call_id": block.tool_use_id or "", "content": text or ""})
    if images:
        out.append({"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}} for url in images]})
    if references:
        out.append({"role": "tool", "tool_call_id": block.tool_use_id or "", "content": references})


def _image_url(source: dict[str, Any]) -> Any:
    if source.get("type") == "url":
        return source.get("url", "")
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _tools(req: MessagesRequest, body: dict[str, Any]) -> None:
    """`tool_choice` and `tools` (after the messages' tool changes), as vLLM sets them."""
    choice = req.tool_choice
    tools = _resolve_tools(req)
    if choice is not None:
        if tools is None and choice.type != "none":
            # vLLM would send it without tools, which its chat API refuses over HTTP.
            raise BadRequest(f"tool_choice `{choice.type}` needs `tools` to be captured", param="tool_choice")
        body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        named = {"type": "function", "function": {"name": choice.name}}
        body["tool_choice"] = named if choice.type == "tool" else _TOOL_CHOICES[choice.type]
    if tools is None:
        return
    if not tools:
        raise BadRequest(
            "`tools` must not be empty to be captured (vLLM's chat API refuses an empty list)", param="tools"
        )
    body["tools"] = [_chat_tool(tool) for tool in tools]
    body.setdefault("tool_choice", "auto")


def _resolve_tools(req: MessagesRequest) -> list[Tool] | None:
    """The tools in effect at the end of the conversation (vLLM's `_resolve_tools`): `tool_addition`
    and `tool_removal` blocks applied in order."""
    changes = [
        (index, block)
        for index, message in enumerate(req.messages)
        if not isinstance(message.content, str)
        for block in message.content
        if block.type in ("tool_addition", "tool_removal")
    ]
    if not changes:
        return req.tools
    tools = {tool.name: tool for tool in req.tools or []}
    removed: set[str] = set()
    for index, block in changes:
        change = block.tool
        if isinstance(change, ToolDefinition):
            name = change.definition.name
            tools[name] = change.definition
        else:
            assert change is not None  # `_check`
            name = change.name
            if name not in tools:
                raise BadRequest(
                    f"{block.type} references tool {name!r}, which is not declared in tools", param=f"messages[{index}]"
                )
            if block.type == "tool_addition":
                tools[name] = msgspec.structs.replace(tools[name], defer_loading=None)
        if block.type == "tool_removal":
            removed.add(name)
        else:
            removed.discard(name)
    return [tool for name, tool in tools.items() if name not in removed]


def _chat_tool(tool: Tool) -> dict[str, Any]:
    schema = tool.input_schema
    if "type" not in schema:
        schema = {**schema, "type": "object"}  # vLLM's validator adds it, last
    function = {
        "name": tool.name,
        "description": tool.description,
        "parameters": schema,
        "strict": tool.strict,
        "defer_loading": tool.defer_loading,
    }
    return {"type": "function", "function": function}


# --- the reply -----------------------------------------------------------------------------------


def to_message(reply: ChatCompletion) -> bytes:
    """vLLM's whole chat reply as its Anthropic endpoint answers it (`messages_full_converter`, dumped
    without nulls). A tool call whose arguments are not a JSON object is vLLM's 400, as there."""
    choice = reply.choices[0] if reply.choices else None
    message = choice.message if choice is not None else None
    content: list[dict[str, Any]] = []
    calls = (message.tool_calls or []) if message is not None else []
    if message is not None:
        reasoning = message.reasoning if message.reasoning is not None else message.reasoning_content
        if reasoning:
            content.append({"type": "thinking", "thinking": reasoning, "signature": hex32()})
        if message.content:
            content.append({"type": "text", "text": message.content})
    for call in calls:
        function = call.function
        name, arguments = (function.name, function.arguments) if function is not None else ("", "")
        content.append({"type": "tool_use", "id": call.id, "name": name, "input": _arguments(arguments)})
    if not content:
        content.append({"type": "text", "text": ""})  # vLLM's shape of an empty answer
    out: dict[str, Any] = {
        "id": reply.id or f"msg_{int(time.time() * 1000)}",
        "type": "message",
        "role": "assistant",
        "content": content,
    }
    if reply.model is not None:
        out["model"] = reply.model
    finish = choice.finish_reason if choice is not None else None
    stop = choice.stop_reason if choice is not None else None
    stop_reason, stop_sequence = stop_reasons(finish, stop, tool_used=bool(calls), tool_complete=bool(calls))
    if stop_reason is not None:
        out["stop_reason"] = stop_reason
    if stop_sequence is not None:
        out["stop_sequence"] = stop_sequence
    out["usage"] = usage(reply.usage)
    if reply.kv_transfer_params is not None:
        out["kv_transfer_params"] = reply.kv_transfer_params
    if reply.ec_transfer_params is not None:
        out["ec_transfer_params"] = reply.ec_transfer_params
    return ENCODER.encode(out)


def _arguments(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError as exc:
        raise _bad_reply(str(exc)) from exc
    if not isinstance(value, dict):
        raise _bad_reply("a tool call's arguments must be a JSON object to be a tool_use block's input")
    return value


def _bad_reply(message: str) -> UpstreamStatus:
    """vLLM's endpoint answers an error in its own conversion so: a 400 `BadRequestError`."""
    return UpstreamStatus(400, message, type="BadRequestError", raw=envelope("BadRequestError", message))


def stop_reasons(
    finish_reason: str | None, stop_reason: int | str | None, *, tool_used: bool, tool_complete: bool
) -> tuple[str | None, str | None]:
    """vLLM's `_to_anthropic_stop_reason`: (`stop_reason`, `stop_sequence`) of a chat finish reason.
    `length` is `max_tokens`; an `abort` (a pause cut it) has none."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason not in ("stop", "tool_calls"):
        return None, None
    if tool_complete:
        return "tool_use", None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    if finish_reason == "tool_calls" or tool_used:
        return "tool_use", None
    return "end_turn", None


def usage(chat: Usage | None) -> dict[str, int]:
    """vLLM's `_build_anthropic_usage`: `input_tokens` are the prompt's less those read from or written
    to its prefix cache, which are reported apart when vLLM counts them."""
    if chat is None:
        return {"input_tokens": 0, "output_tokens": 0}
    input_tokens = chat.prompt_tokens
    details = chat.prompt_tokens_details
    read = details.cached_tokens if details is not None else None
    created = details.created_cache_tokens if details is not None else None
    if isinstance(read, int):
        input_tokens -= read
    if isinstance(created, int):
        input_tokens -= created
    out = {"input_tokens": max(0, input_tokens), "output_tokens": chat.completion_tokens or 0}
    if isinstance(created, int):
        out["cache_creation_input_tokens"] = created
    if isinstance(read, int):
        out["cache_read_input_tokens"] = read
    return out


# --- the stream ----------------------------------------------------------------------------------


def _event(kind: bytes, data: dict[str, Any]) -> bytes:
    return b"event: " + kind + b"\ndata: " + ENCODER.encode(data) + b"\n\n"


class MessagesStream:
    """vLLM's chat chunks in, the events of vLLM's Anthropic endpoint out (`message_stream_converter`).

    The first chunk opens the message (`message_start`); each later one adds to the open content
    block or opens the next (`thinking`, closed with its `signature_delta`; `text`; `tool_use`, whose
    arguments stream as `input_json_delta`s, and text arriving inside one is held until it closes);
    the usage chunk closes the last block and sends `message_delta` (stop reason, usage); `finish`
    sends `message_stop`.
    """

    def __init__(self) -> None:
        self.ended = False  # never early: vLLM's in-stream error fails the stream
        self.usage: Usage | None = None
        self._started = False
        self._index = 0  # the next content block's index
        self._kind: str | None = None  # the open block: "thinking", "text", "tool_use"
        self._signature: str | None = None  # the open thinking block's, until sent
        self._tool_id: str | None = None
        self._pending: list[str] = []  # text that came while a tool_use block was open
        self._ids: dict[int, str] = {}  # tool call index -> its block's id
        self._finish: str | None = None
        self._stop: int | str | None = None
        self._tool_used = False
        self._arguments: list[str] = []  # the last tool_use block's
        self._frames: list[bytes] = []

    def start(self) -> bytes:
        return b""  # `message_start` carries the first chunk's id, model and usage

    def payload(self, payload: bytes) -> bytes:
        chunk = CHUNK_DECODER.decode(payload)
        if chunk.error is not None:
            raise UpstreamError(chunk_error(chunk.error))
        self._feed(chunk)
        frames, self._frames = self._frames, []
        return b"".join(frames)

    def finish(self, tokens: TokenInfo | None = None) -> bytes:
        """vLLM's `[DONE]`: what is open is closed, and `message_stop`."""
        self._flush()
        self._frames.append(_event(b"message_stop", {"type": "message_stop"}))
        frames, self._frames = self._frames, []
        return b"".join(frames)

    def fail(self, message: str) -> bytes:
        return stream_error(UpstreamError(message))

    def answer_locally(self, finish_reason: str) -> bytes:
        """The stream of an empty answer made without vLLM."""
        self._feed(ChatChunk(id=f"msg_{int(time.time() * 1000)}", usage=Usage()))
        self._feed(ChatChunk(choices=[ChunkChoice(finish_reason=finish_reason)]))
        self._feed(ChatChunk(usage=Usage()))
        return self.finish()

    def keep(self) -> None:
        """A captured stream is never continued: nothing to keep."""

    def partial(self) -> None:
        return None

    def _feed(self, chunk: ChatChunk) -> None:
        if chunk.usage is not None:
            self.usage = chunk.usage
        choice = chunk.choices[0] if chunk.choices else None
        if not self._started:
            self._started = True
            message: dict[str, Any] = {"id": chunk.id or f"msg_{int(time.time() * 1000)}", "type": "message"}
            message["role"] = "assistant"
            message.update(content=[], model=chunk.model, stop_reason=None, stop_sequence=None)
            message["usage"] = usage(chunk.usage)
            self._frames.append(_event(b"message_start", {"type": "message_start", "message": message}))
            return
        if choice is None:  # the usage chunk
            self._flush()
            complete = self._tool_used and _is_json("".join(self._arguments))
            reason, sequence = stop_reasons(
                self._finish or "stop", self._stop, tool_used=self._tool_used, tool_complete=complete
            )
            delta = {"stop_reason": reason, "stop_sequence": sequence}
            event = {"type": "message_delta", "delta": delta, "usage": usage(chunk.usage)}
            self._frames.append(_event(b"message_delta", event))
            return
        if choice.finish_reason is not None:
            self._finish, self._stop = choice.finish_reason, choice.stop_reason
        self._delta(choice.delta)

    def _delta(self, delta: ChunkDelta) -> None:
        reasoning = delta.reasoning if delta.reasoning is not None else delta.reasoning_content
        if reasoning:
            if self._kind != "thinking":
                self._flush()
                self._open({"type": "thinking", "thinking": ""})
            self._block_delta({"type": "thinking_delta", "thinking": reasoning})
        if delta.content:
            if self._kind == "tool_use":
                self._pending.append(delta.content)
            else:
                if self._kind != "text":
                    self._flush()
                    self._open({"type": "text", "text": ""})
                self._block_delta({"type": "text_delta", "text": delta.content})
        for call in delta.tool_calls or ():
            self._tool_call(call)

    def _tool_call(self, call: dict[str, Any]) -> None:
        function = call.get("function")
        function = function if isinstance(function, dict) else {}
        arguments = function.get("arguments")
        call_id = call.get("id")
        if call_id is not None:
            self._ids[call.get("index", 0)] = call_id
            name = function.get("name")
            if self._tool_id != call_id and name is not None:
                self._flush()
                self._tool_used = True
                self._arguments = []
                self._open({"type": "tool_use", "id": call_id, "name": name, "input": {}})
        else:
            call_id = self._ids.get(call.get("index", 0))
        if arguments and call_id is not None and self._tool_id == call_id:
            self._arguments.append(arguments)
            self._block_delta({"type": "input_json_delta", "partial_json": arguments})

    def _open(self, block: dict[str, Any]) -> None:
        event = {"type": "content_block_start", "content_block": block, "index": self._index}
        self._frames.append(_event(b"content_block_start", event))
        self._kind = block["type"]
        self._signature = hex32() if self._kind == "thinking" else None
        self._tool_id = block.get("id")

    def _block_delta(self, delta: dict[str, Any]) -> None:
        event = {"type": "content_block_delta", "delta": delta, "index": self._index}
        self._frames.append(_event(b"content_block_delta", event))

    def _close(self) -> None:
        if self._kind is None:
            return
        if self._signature is not None:
            self._block_delta({"type": "signature_delta", "signature": self._signature})
        self._frames.append(_event(b"content_block_stop", {"type": "content_block_stop", "index": self._index}))
        self._kind = self._signature = self._tool_id = None
        self._index += 1

    def _flush(self) -> None:
        """Close the open block; text held while a tool_use block was open becomes a text block of its own."""
        pending, self._pending = self._pending, []
        self._close()
        if pending:
            self._open({"type": "text", "text": ""})
            self._block_delta({"type": "text_delta", "text": "".join(pending)})
            self._close()


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True
