"""The Responses request: read from the client's bytes, then made a Chat Completions body (spec 5).

Reading (`RequestReader`): every field of the Responses API's request is understood
(`schemas.responses.ResponsesRequest`); a top-level field outside that set is a 400 naming it (a
typo is the client's mistake), or with `unknown_fields: drop` is dropped. Hosted tools
(`web_search`, `mcp`, `shell`, ..., and tool types not known yet) have no chat form: they are
dropped from `tools`, so neither vLLM nor the Response's echo has them. Each kind of drop is said
once in the log (once per gymproxy instance, so once per process under `gymproxy serve`). A body
that decodes at once costs one decode plus a look at `tools`; only a body with an unknown field or
tool type is decoded a second time.

Converting (`to_chat_body`, a pure function): the result is a plain mapping, the same form
`/v1/chat/completions` bodies take, so both routes share the vLLM-boundary rewrite in
`boundary.py`. Every refusal is a `BadRequest` naming the field.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Sequence
from typing import Any, Final, NoReturn

import msgspec
import orjson

from ..errors import BadRequest, from_validation
from ..schemas.responses import (
    NULL,
    REQUEST_DECODER,
    TOOL_TYPES,
    AllowedToolsChoice,
    ContentPart,
    CustomChoice,
    CustomTool,
    FormatJSONObject,
    FormatJSONSchema,
    FunctionCallItem,
    FunctionChoice,
    FunctionTool,
    HostedChoice,
    HostedTool,
    ImageURL,
    InputItem,
    NamespaceTool,
    OutputItem,
    ResponsesRequest,
    Tool,
    ToolChoice,
)
from .boundary import Boundary
from .tokens import TOKEN_FIELDS

# --- reading the request ---------------------------------------------------------------------------

log = logging.getLogger("gymproxy")

FIELDS: Final = frozenset(ResponsesRequest.__struct_encode_fields__)
HINT: Final = "; vLLM sampling extras go in metadata.extra_body (a JSON string)"
MAX_WARNED: Final = 256  # distinct names warned about; past it (a client sending junk), no more

# msgspec's message for a tool whose `type` none of the tool Structs carries.
_UNKNOWN_TOOL = re.compile(r"^Invalid value .* - at `\$\.tools\[\d+\]\.type`$")


class RequestReader:
    """Decodes `/v1/responses` bodies under one config's `unknown_fields` rule; warns once per kind."""

    def __init__(self, *, drop_unknown_fields: bool = False) -> None:
        self.drop_unknown_fields = drop_unknown_fields
        self._warned: set[tuple[str, str]] = set()  # (message, name) pairs logged

    def decode(self, raw: bytes) -> ResponsesRequest:
        """The request, or the 400 naming what is wrong with it."""
        try:
            req = REQUEST_DECODER.decode(raw)
        except msgspec.DecodeError as exc:  # a ValidationError too
            req = self._decode_again(raw, exc)
        tools = req.tools
        if tools:
            for tool in tools:
                if isinstance(tool, HostedTool):
                    req.tools = self._without_hosted(tools)
                    break
        return req

    def _decode_again(self, raw: bytes, exc: msgspec.DecodeError) -> ResponsesRequest:
        """A body with tools of unknown types (dropped) or, when dropping, unknown fields: decoded
        again without them. Any other error is the 400 it names."""
        error = _bad_request(exc)
        unknown_tool = isinstance(exc, msgspec.ValidationError) and _UNKNOWN_TOOL.search(str(exc)) is not None
        if not (unknown_tool or (self.drop_unknown_fields and _unknown_field(error))):
            raise error from exc
        try:
            body = orjson.loads(raw)  # a JSON object (msgspec got as far as its members)
        except orjson.JSONDecodeError:  # past orjson's limits (a 65-bit integer, deep nesting)
            raise error from exc
        if self.drop_unknown_fields:
            for name in [name for name in body if name not in FIELDS]:
                del body[name]
                self._warn(
                    "dropping the unknown top-level field %r from /v1/responses requests (unknown_fields: drop)", name
                )
        tools = body.get("tools")
        if isinstance(tools, list):
            body["tools"] = [tool for tool in tools if not self._unknown_tool(tool)]
        try:
            return REQUEST_DECODER.decode(orjson.dumps(body))
        except msgspec.DecodeError as again:
            raise _bad_request(again) from again

    def _unknown_tool(self, tool: Any) -> bool:
        kind = tool.get("type") if isinstance(tool, dict) else None
        if not isinstance(kind, str) or kind in TOOL_TYPES:
            return False
        self._warn_tool(kind)
        return True

    def _without_hosted(self, tools: list[Any]) -> list[Any]:
        kept = []
        for tool in tools:
            if isinstance(tool, HostedTool):
                self._warn_tool(tool.kind)
            else:
                kept.append(tool)
        return kept

    def _warn_tool(self, kind: str) -> None:
        self._warn("dropping %r tools from /v1/responses requests: they have no Chat Completions form", kind)

    def _warn(self, message: str, name: str) -> None:
        """Log `message` once for `name` (a field's or a tool type's)."""
        key = (message, name)
        if key not in self._warned and len(self._warned) < MAX_WARNED:
            self._warned.add(key)
            log.warning(message + " (said once)", name)


def _unknown_field(error: BadRequest) -> bool:
    """Whether the 400 is for an unknown top-level field (its `param` is the field's name)."""
    param = error.param
    return "unknown field" in error.message and param is not None and "." not in param and "[" not in param


def _bad_request(exc: msgspec.DecodeError) -> BadRequest:
    error = from_validation(exc)
    if _unknown_field(error):
        error.message += HINT
    return error


# --- namespace tools -------------------------------------------------------------------------------
# Codex CLI groups tools under a name. vLLM knows only flat tools, so each sub-tool of a `namespace`
# tool goes upstream as the function `<namespace>__<name>` (NeMo Gym's rule), and a replayed call
# carrying a `namespace` is renamed the same way. A function call vLLM returns under such a name
# gets its `namespace` and `name` back (`convert/reply.py`, `convert/stream.py`). Both directions do
# work only for a request that has a namespace tool.

SEPARATOR: Final = "__"

NamespaceMap = dict[str, tuple[str, str]]  # flattened name -> (namespace, name)


def flat_name(namespace: str, name: str) -> str:
    """The function name vLLM sees for `name` inside `namespace`."""
    return f"{namespace}{SEPARATOR}{name}"


def namespace_map(tools: Iterable[Tool] | None) -> NamespaceMap:
    """Each flattened sub-tool name of `tools`, with the namespace and name it came from."""
    names: NamespaceMap = {}
    for tool in tools or ():
        if isinstance(tool, NamespaceTool):
            for sub in tool.tools:
                names[flat_name(tool.name, sub.name)] = (tool.name, sub.name)
    return names


def shown(name: str, names: NamespaceMap) -> tuple[str, str | None]:
    """The (name, namespace) a client sees for a function vLLM called `name`."""
    found = names.get(name)
    return (found[1], found[0]) if found is not None else (name, None)


def restore(items: Iterable[OutputItem], names: NamespaceMap) -> None:
    """Give each flattened function call its namespace and name back, in place."""
    for item in items:
        if isinstance(item, FunctionCallItem) and item.name in names:
            item.namespace, item.name = names[item.name]


# --- converting it ----------------------------------------------------------------------------------

_NO_CHAT = (
    "'{0}' has no Chat Completions representation, so this rollout cannot be downconverted. "
    "Route it to a model server that passes Responses through, or send only message, reasoning, "
    "function_call and function_call_output items."
)


def to_chat_body(req: ResponsesRequest, boundary: Boundary | None = None) -> dict[str, Any]:
    """Convert a Responses request into a Chat Completions body.

    With a `boundary`, messages and tools are built as its rules want them (pass the body on with
    `boundary.prepare(body, built=True)`); without one, they are the plain conversion.
    Token metadata on input items (a training client echoing earlier turns) is validated but never
    sent: vLLM does not read it, and it would multiply the size of long rollouts.
    """
    if (
        req.background
        or req.context_management
        or req.conversation is not None
        or req.previous_response_id is not None
        or req.prompt is not None
        or req.truncation == "auto"
    ):
        _refuse_fields(req)
    turns = _Turns(boundary)
    if isinstance(req.input, str):
        turns.messages.append({"role": "user", "content": [{"type": "text", "text": req.input}]})
    else:
        add = turns.add
        for index, item in enumerate(req.input):
            add(item, index)
    turns.flush()
    messages = turns.messages
    if req.instructions:
        messages = _fold_instructions(req.instructions, messages)

    body: dict[str, Any] = {"messages": messages}
    if req.model is not None:
        body["model"] = req.model
    if req.max_output_tokens is not None:
        body["max_tokens"] = req.max_output_tokens
    if req.reasoning is not None:
        _reasoning(req, body)
    if req.text is not None:
        _text_format(req, body)
    _tools(req, body, strict=boundary is None)  # vLLM mishandles `strict`: the boundary drops it
    for name in _PASSED:
        value = getattr(req, name)
        if value is not None:
            body[name] = value
    if req.stream is False:
        body["stream"] = False
    return body


# Request fields forwarded under the same name when sent (spec 5.1 step 10, less the fields that
# mean nothing to vLLM: `store`, `service_tier`, `prompt_cache_*`, `safety_identifier`, `moderation`
# and `stream_options` are accepted and not sent; `stream` and `parallel_tool_calls` have their own
# rules).
_PASSED = ("metadata", "temperature", "top_p", "user", "top_logprobs")

# The fields whose meaning gymproxy cannot honour: answering anyway would answer another request.
_CANNOT = {
    "background": "`background: true` asks for a response fetched later, and gymproxy answers in the "
    "request itself (send false, or leave it out)",
    "context_management": "server-side context compaction is not something gymproxy or vLLM does",
    "conversation": "gymproxy keeps no stored conversations: send the whole conversation in `input`",
    "previous_response_id": "gymproxy keeps no earlier responses: send the whole conversation in `input`",
    "prompt": "gymproxy keeps no stored prompt templates: send the prompt's text in `instructions` or `input`",
    "truncation": '`truncation: "auto"` drops the oldest input items when the context is full, which '
    'gymproxy does not do (send "disabled", or leave it out)',
}


def _refuse_fields(req: ResponsesRequest) -> NoReturn:
    """The 400 for every field sent with a meaning gymproxy cannot honour (checked before the input)."""
    refused = sorted(
        name
        for name, value in (
            ("background", req.background),
            ("context_management", req.context_management),
            ("conversation", req.conversation is not None),
            ("previous_response_id", req.previous_response_id is not None),
            ("prompt", req.prompt is not None),
            ("truncation", req.truncation == "auto"),
        )
        if value
    )
    raise BadRequest(
        f"Responses request field(s) {refused} have no Chat Completions representation, so this request "
        "cannot be downconverted: " + "; ".join(f"{name}: {_CANNOT[name]}" for name in refused) + ".",
        param=refused[0],
    )


class _Turns:
    """Builds chat messages; consecutive assistant-side items merge into one assistant message.

    Runs once per input item of every rollout turn, so the common path formats no strings: an
    item's place (`input[3]`) is spelled out only in an error.
    """

    __slots__ = ("boundary", "messages", "pending", "text", "thoughts", "said", "refusal", "tool_calls")

    def __init__(self, boundary: Boundary | None) -> None:
        self.boundary = boundary
        self.messages: list[dict[str, Any]] = []
        self.pending = False
        self.text: list[str] = []  # the assistant turn's content: reasoning as <think>summary</think>, text
        self.thoughts: list[str] = []  # its reasoning summaries alone
        self.said: list[str] = []  # its text alone
        self.refusal: list[str] = []
        self.tool_calls: list[dict[str, Any]] = []

    def add(self, item: InputItem, index: int) -> None:
        kind = item.type
        if kind == "function_call":
            name = item.name
            if item.call_id is None or name is None or item.arguments is None:
                _refuse_function_call(item, index)
            if item.namespace:  # a call to a namespace tool's sub-tool: vLLM saw it flattened
                name = flat_name(item.namespace, name)
            self.pending = True
            self.tool_calls.append(
                {"id": item.call_id, "function": {"arguments": item.arguments, "name": name}, "type": "function"}
            )
        elif kind == "function_call_output":
            if self.pending:
                self.flush()
            output: Any = item.output
            if item.call_id is None or not isinstance(output, str):
                output = _tool_content(item, index)
            self.messages.append({"content": output, "role": "tool", "tool_call_id": item.call_id})
        elif kind == "reasoning":
            self.pending = True
            for part in item.summary or ():
                if part.text:
                    self.text.append(f"<think>{part.text}</think>")
                    self.thoughts.append(part.text)
        elif kind == "message" or (kind is None and item.role is not None):
            self._message(item, index)
        elif kind is None:
            raise BadRequest(f"{_at(index)} needs a `type`, or a `role` for a message item", param=f"{_at(index)}.type")
        else:
            raise BadRequest(_NO_CHAT.format(kind), param=f"{_at(index)}.type")
        if (
            item.prompt_token_ids is not None
            or item.generation_token_ids is not None
            or item.generation_log_probs is not None
            or item.routed_experts is not None
        ):
            _check_tokens(item, _at(index))

    def flush(self) -> None:
        if self.pending:  # set by every assistant-side item
            message: dict[str, Any] = {"content": "".join(self.text) or None, "role": "assistant"}
            if self.tool_calls:
                message["tool_calls"] = self.tool_calls
            if self.refusal:
                message["refusal"] = "".join(self.refusal)
            if self.boundary is not None:
                self.boundary.split_turn(message, self.thoughts, self.said)
            self.messages.append(message)
            self.pending = False
            self.text = []
            self.thoughts = []
            self.said = []
            self.refusal = []
            self.tool_calls = []

    def _message(self, item: InputItem, index: int) -> None:
        role = item.role
        if role is None:
            raise BadRequest(f"{_at(index)}: a message item needs a `role`", param=f"{_at(index)}.role")
        if item.phase is not None:
            raise BadRequest(
                "Responses message phase has no Chat Completions representation.", param=f"{_at(index)}.phase"
            )
        if role == "assistant":
            self.pending = True
            self._assistant_content(item, index)
            for call in item.tool_calls or ():
                self.tool_calls.append(
                    {
                        "id": call.id,
                        "function": {"arguments": call.function.arguments, "name": call.function.name},
                        "type": "function",
                    }
                )
            return
        self.flush()
        content: Any = item.content
        if content is None:
            raise BadRequest(f"{_at(index)}: a {role} message needs `content`", param=f"{_at(index)}.content")
        if not isinstance(content, str):
            content = [_part(part, index, i) for i, part in enumerate(content)]
        self.messages.append(
            {"role": self.boundary.role(role) if self.boundary is not None else role, "content": content}
        )

    def _assistant_content(self, item: InputItem, index: int) -> None:
        if isinstance(item.content, str):
            self.text.append(item.content)
            self.said.append(item.content)
            return
        for i, part in enumerate(item.content or ()):
            if part.text is not None:
                self.text.append(part.text)
                self.said.append(part.text)
            elif part.refusal is None:
                raise BadRequest(
                    f"Unsupported assistant content part of type '{part.type}': it has neither `text` nor `refusal`.",
                    param=f"{_at(index)}.content[{i}]",
                )
            if part.refusal is not None:
                self.refusal.append(part.refusal)


def _refuse_function_call(item: InputItem, index: int) -> NoReturn:
    name = next(name for name in ("call_id", "name", "arguments") if getattr(item, name) is None)
    raise BadRequest(f"{_at(index)}: a function_call item needs `{name}`", param=f"{_at(index)}.{name}")


def _tool_content(item: InputItem, index: int) -> list[dict[str, Any]]:
    """A function_call_output's content parts as chat text parts, or the 400 for what is missing or wrong."""
    if item.call_id is None:
        raise BadRequest(f"{_at(index)}: a function_call_output item needs `call_id`", param=f"{_at(index)}.call_id")
    if item.output is None:
        raise BadRequest(f"{_at(index)}: a function_call_output item needs `output`", param=f"{_at(index)}.output")
    assert not isinstance(item.output, str)
    bad = sorted({part.type for part in item.output if part.type != "input_text"})
    if bad:
        raise BadRequest(
            f"Cannot convert Responses function_call_output for call '{item.call_id}' to a Chat "
            "Completions tool message: Chat tool messages cannot represent content part type(s) "
            + ", ".join(f"'{t}'" for t in bad),
            param=f"{_at(index)}.output",
        )
    return [{"type": "text", "text": part.text or ""} for part in item.output]


def _at(index: int) -> str:
    return f"input[{index}]"


def _check_tokens(item: InputItem, where: str) -> None:
    """Token metadata is all-or-nothing: any field present requires the three lists."""
    missing = [name for name in TOKEN_FIELDS if getattr(item, name) is None]
    if missing:
        raise BadRequest(
            f"{where} carries partial token metadata; missing: {', '.join(missing)}",
            param=f"{where}.{missing[0]}",
        )


def _url(value: str | ImageURL | None) -> str | None:
    return value.url if isinstance(value, ImageURL) else value


def _part(part: ContentPart, index: int, i: int) -> dict[str, Any]:
    if part.type == "input_text" and part.text is not None:
        return {"type": "text", "text": part.text}
    where = f"{_at(index)}.content[{i}]"
    if part.type == "input_text":
        raise BadRequest(f"{where}: an input_text part needs `text`", param=f"{where}.text")
    if part.type == "input_image":
        url = _url(part.image_url)
        if url is None:
            raise BadRequest(
                "Responses input images referenced by file_id have no Chat Completions representation.",
                param=f"{where}.image_url",
            )
        if not url:
            raise BadRequest("input_image requires a non-empty image_url", param=f"{where}.image_url")
        detail = part.detail or "auto"
        if detail == "original":
            raise BadRequest(
                "Responses input_image detail 'original' has no Chat Completions representation.",
                param=f"{where}.detail",
            )
        return {"type": "image_url", "image_url": {"url": url, "detail": detail}}
    if part.type == "input_video":
        sources = [s for s in (part.video_url, part.video) if s is not None]
        if len(sources) != 1:
            raise BadRequest("input_video needs exactly one of `video_url` or `video`", param=f"{where}.video_url")
        url = _url(sources[0])
        if not url:
            raise BadRequest("input_video requires a non-empty video URL", param=f"{where}.video_url")
        return {"type": "video_url", "video_url": {"url": url}}
    raise BadRequest(f"Unsupported part param type: {part.type}", param=f"{where}.type")


def _fold_instructions(instructions: str, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`instructions` and the leading system/developer messages become one system message."""
    parts = [instructions]
    lead = 0
    for message in messages:
        if message["role"] not in ("system", "developer"):
            break
        content = message["content"]
        parts.append(content if isinstance(content, str) else "".join(p.get("text", "") for p in content))
        lead += 1
    return [{"content": "\n\n".join(parts), "role": "system"}, *messages[lead:]]


def _reasoning(req: ResponsesRequest, body: dict[str, Any]) -> None:
    """Only `effort` means something to vLLM; `summary` and the rest are accepted and not sent
    (the model's reasoning comes back as a summary anyway)."""
    reasoning = req.reasoning
    assert reasoning is not None
    if reasoning.effort is not None:
        body["reasoning_effort"] = reasoning.effort


def _text_format(req: ResponsesRequest, body: dict[str, Any]) -> None:
    text = req.text
    assert text is not None
    fmt = text.format
    if isinstance(fmt, FormatJSONSchema):
        schema: dict[str, Any] = {"name": fmt.name, "schema": fmt.schema}
        if fmt.strict is not None:
            schema["strict"] = fmt.strict
        if fmt.description is not None:
            schema["description"] = fmt.description
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif isinstance(fmt, FormatJSONObject):
        body["response_format"] = {"type": "json_object"}
    if text.verbosity is not None:
        body["verbosity"] = text.verbosity


def _tools(req: ResponsesRequest, body: dict[str, Any], *, strict: bool) -> None:
    """`tools`, `tool_choice`, `parallel_tool_calls`; function tools keep `strict` only if asked.

    A namespace tool's sub-tools become function tools named `<namespace>__<name>` (custom ones
    too, as NeMo Gym does). Hosted tools have no chat form and are dropped (`RequestReader`
    says so in the log).
    """
    if isinstance(req.tool_choice, HostedChoice):
        _refuse_hosted_choice(req.tool_choice)
    tools: list[dict[str, Any]] = []
    namespaced = False
    for i, tool in enumerate(req.tools or ()):
        if isinstance(tool, (FunctionTool, CustomTool)):
            tools.append(_chat_tool(tool, i, strict))
        elif isinstance(tool, NamespaceTool):
            namespaced = True
            tools += [_flat_tool(tool.name, sub, i, j, strict) for j, sub in enumerate(tool.tools)]
    if namespaced:
        _check_flat_names(req.tools or ())
    if not tools:
        if req.tool_choice not in (None, "auto", "none"):
            raise BadRequest(
                f"tool_choice={_choice_repr(req.tool_choice)} requires at least one tool", param="tool_choice"
            )
        return
    body["tools"] = tools
    if req.tool_choice is not None:
        body["tool_choice"] = _chat_tool_choice(req.tool_choice)
    if req.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = req.parallel_tool_calls


def _chat_tool(tool: FunctionTool | CustomTool, index: int, strict: bool) -> dict[str, Any]:
    if tool.defer_loading:
        _refuse_deferred(tool, f"tools[{index}]")
    if isinstance(tool, FunctionTool):
        return _function(tool, tool.name, strict)
    custom: dict[str, Any] = {"name": tool.name}
    if tool.description is not None:
        custom["description"] = tool.description
    if tool.format is not None:
        fmt = tool.format
        if fmt.get("type") == "grammar":
            fmt = {"type": "grammar", "grammar": {"syntax": fmt.get("syntax"), "definition": fmt.get("definition")}}
        custom["format"] = fmt
    return {"type": "custom", "custom": custom}


def _flat_tool(namespace: str, tool: FunctionTool | CustomTool, index: int, sub: int, strict: bool) -> dict[str, Any]:
    """A namespace tool's sub-tool as the function tool vLLM sees.

    NeMo Gym drops a sub-tool that lacks `strict` or `parameters` (they fail the SDK's function-tool
    schema once flattened); gymproxy keeps it, as it is a valid function tool.
    """
    if tool.defer_loading:
        _refuse_deferred(tool, f"tools[{index}].tools[{sub}]")
    return _function(tool, flat_name(namespace, tool.name), strict)


def _function(tool: FunctionTool | CustomTool, name: str, strict: bool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name}
    if tool.description is not None:
        function["description"] = tool.description
    if isinstance(tool, FunctionTool):
        if tool.parameters != NULL:
            function["parameters"] = tool.parameters
        if tool.strict is not None and strict:
            function["strict"] = tool.strict
    return {"type": "function", "function": function}


def _refuse_deferred(tool: FunctionTool | CustomTool, where: str) -> NoReturn:
    raise BadRequest(
        f"Responses {'function' if isinstance(tool, FunctionTool) else 'custom'} tools with "
        "defer_loading enabled have no Chat Completions representation.",
        param=f"{where}.defer_loading",
    )


def _check_flat_names(tools: Sequence[Tool]) -> None:
    """A flattened sub-tool may not take the name of another tool: its calls could not be told apart."""
    seen = {tool.name for tool in tools if isinstance(tool, (FunctionTool, CustomTool))}
    for i, tool in enumerate(tools):
        if not isinstance(tool, NamespaceTool):
            continue
        for j, sub in enumerate(tool.tools):
            name = flat_name(tool.name, sub.name)
            if name in seen:
                raise BadRequest(
                    f"the namespace tool '{tool.name}' has a tool '{sub.name}', which vLLM would see as "
                    f"'{name}': another tool already has that name",
                    param=f"tools[{i}].tools[{j}].name",
                )
            seen.add(name)


def _chat_tool_choice(choice: ToolChoice) -> Any:
    if isinstance(choice, str):
        return choice
    if isinstance(choice, FunctionChoice):
        return {"type": "function", "function": {"name": choice.name}}
    if isinstance(choice, CustomChoice):
        return {"type": "custom", "custom": {"name": choice.name}}
    if isinstance(choice, HostedChoice):
        _refuse_hosted_choice(choice)
    assert isinstance(choice, AllowedToolsChoice)
    refs = []
    for i, ref in enumerate(choice.tools):
        if ref.type not in ("function", "custom"):
            continue  # a hosted tool: dropped from `tools`, so from what the model may call
        if ref.name is None:
            raise BadRequest(
                f"an allowed_tools entry of type '{ref.type}' needs a `name`", param=f"tool_choice.tools[{i}].name"
            )
        refs.append({"type": ref.type, ref.type: {"name": ref.name}})
    if not refs:
        raise BadRequest(
            "tool_choice.tools lists only hosted tools, which gymproxy drops: the model would have none to call",
            param="tool_choice.tools",
        )
    return {"type": "allowed_tools", "allowed_tools": {"mode": choice.mode, "tools": refs}}


def _refuse_hosted_choice(choice: HostedChoice) -> NoReturn:
    raise BadRequest(
        f"Responses tool choice type '{choice.kind}' has no Chat representation: gymproxy drops "
        f"{choice.kind} tools, so the model cannot be made to call one.",
        param="tool_choice.type",
    )


def _choice_repr(choice: ToolChoice | None) -> str:
    if isinstance(choice, str):
        return repr(choice)
    return repr(msgspec.to_builtins(choice))
