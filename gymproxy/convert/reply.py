"""An upstream chat completion as each client gets it (spec sections 7.1 and 8), as pure functions.

`ChatReply` holds the upstream's reply bytes and parses them at most once. `chat_answer` is what a
`/v1/chat/completions` client gets (vLLM's bytes untouched unless reasoning must be folded into
`<think>`); `to_response` is what a `/v1/responses` client gets, shared with the stream translator
so that a streamed `response.completed` carries exactly what the non-streaming route returns.
"""

from __future__ import annotations

import re
import time
from typing import Any

import msgspec
import orjson
from msgspec import UNSET

from ..errors import UpstreamError
from ..ids import hex32, new_id
from ..schemas import ENCODER
from ..schemas.chat import COMPLETION_DECODER, AssistantMessage, ChatCompletion, Usage
from ..schemas.responses import (
    CustomToolCallItem,
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    MessageItem,
    OutputItem,
    OutputText,
    OutputTokensDetails,
    ReasoningEcho,
    ReasoningItem,
    Refusal,
    Response,
    ResponsesRequest,
    ResponseUsage,
    SummaryText,
    TextEcho,
)
from .boundary import split_think
from .request import namespace_map, restore
from .tokens import TokenInfo, attach_to_chat

# vLLM's "abort" (a pause for a weight update cut the generation) is a reason of gymproxy's own:
# the Responses API has none for it, and a turn cut short must not look complete.
INCOMPLETE_REASONS = {"length": "max_output_tokens", "content_filter": "content_filter", "abort": "abort"}

NO_PARSER = (
    "the upstream returned a reasoning field, but gymproxy's config says `uses_reasoning_parser: false`; "
    "set it to true for a vLLM started with --reasoning-parser"
)


# A reasoning field with a string value (vLLM 0.32 sends `"reasoning":null` on every full reply).
_REASONING_VALUE = re.compile(rb'"reasoning(?:_content)?"\s*:\s*"')


def has_reasoning(payload: bytes) -> bool:
    """Whether a reply or chunk carries a non-null reasoning field, without decoding it."""
    return _REASONING_VALUE.search(payload) is not None


class _CompletionShape(msgspec.Struct):
    choices: msgspec.Raw  # checked for JSON syntax only, never built into objects
    usage: Any = None  # read on the way, for the token metrics


_SHAPE_CHECK = msgspec.json.Decoder(_CompletionShape)


class ChatReply:
    """An upstream's whole 200 reply in chat form: its bytes, parsed (once) only when asked.

    `source` names where it came from ("the upstream http://..."), for the 502 when it is broken.
    """

    __slots__ = ("_payload", "_mapping", "_usage", "source")

    def __init__(self, payload: bytes | None, source: str, mapping: dict[str, Any] | None = None) -> None:
        self._payload = payload
        self._mapping = mapping
        self._usage: Any = None
        self.source = source

    def usage(self) -> Any:
        """The reply's `usage` if the reply was already read (as a mapping, a completion or by
        `check`); None otherwise: it is never parsed for this alone."""
        if self._usage is not None:
            return self._usage
        return self._mapping.get("usage") if self._mapping is not None else None

    @property
    def payload(self) -> bytes:
        if self._payload is None:
            self._payload = ENCODER.encode(self._mapping)
        return self._payload

    def mapping(self) -> dict[str, Any]:
        """The reply as a mapping; anything but a JSON object is the upstream breaking the protocol (502)."""
        if self._mapping is None:
            try:
                reply = orjson.loads(self.payload)
            except orjson.JSONDecodeError as exc:
                raise UpstreamError(f"{self.source} sent a reply that is not valid JSON: {exc}") from exc
            if not isinstance(reply, dict):
                raise UpstreamError(f"{self.source} sent a reply that is not a JSON object")
            self._mapping = reply
        return self._mapping

    def completion(self) -> ChatCompletion:
        """The reply decoded into its typed form."""
        try:
            completion = COMPLETION_DECODER.decode(self.payload)
        except msgspec.DecodeError as exc:
            raise UpstreamError(f"{self.source} sent an invalid chat completion: {exc}") from exc
        self._usage = completion.usage
        return completion

    def check(self) -> None:
        """A cheap check that a reply passed through untouched is a JSON object with `choices`."""
        try:
            self._usage = _SHAPE_CHECK.decode(self.payload).usage
        except msgspec.DecodeError as exc:
            raise UpstreamError(f"{self.source} sent an invalid chat completion: {exc}") from exc


def chat_answer(reply: ChatReply, tokens: TokenInfo | None, *, parser: bool, continued: bool) -> bytes:
    """What a chat client gets: vLLM's bytes as they are, unless reasoning is folded or token ids added."""
    if tokens is not None:
        mapping = reply.mapping()
        fold_chat_reasoning(mapping, parser=parser, continued=continued)
        attach_to_chat(mapping, tokens)
        return orjson.dumps(mapping)
    payload = reply.payload
    if has_reasoning(payload):  # most replies carry none: their bytes go back untouched
        mapping = reply.mapping()
        if fold_chat_reasoning(mapping, parser=parser, continued=continued):
            return orjson.dumps(mapping)
        return payload
    reply.check()
    return payload


def fold_chat_reasoning(reply: dict[str, Any], *, parser: bool, continued: bool) -> bool:
    """Fold each choice's reasoning field into `<think>` content; True when anything changed."""
    changed = False
    for choice in reply.get("choices") or ():
        message = choice.get("message") if isinstance(choice, dict) else None
        if not isinstance(message, dict):
            continue
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        if not reasoning:
            continue
        if not parser:
            raise UpstreamError(NO_PARSER)
        message.pop("reasoning_content", None)
        message.pop("reasoning", None)
        message["content"] = fold_reasoning(message.get("content"), reasoning, continued=continued)
        changed = True
    return changed


def fold_reasoning(content: str | None, reasoning: str | None, *, continued: bool) -> str | None:
    """vLLM's separate reasoning goes back inline as `<think>...</think>` (bare when continuing a turn)."""
    if not reasoning:
        return content
    return (reasoning if continued else f"<think>{reasoning}</think>") + (content or "")


def output_items(message: AssistantMessage, *, parse_think: bool) -> list[OutputItem]:
    """Reasoning, message and tool-call items for one assistant message (spec 8.2)."""
    content = message.content or ""
    refusal = message.refusal or ""
    thoughts: list[str] = []
    if parse_think:
        thoughts, content = split_think(content)
    tool_calls = message.tool_calls or []
    items: list[OutputItem] = []
    if thoughts:
        items.append(ReasoningItem(id=new_id("rs"), summary=[SummaryText(text=t) for t in thoughts]))
    empty = not thoughts and not tool_calls and not refusal
    if content or refusal or empty:
        parts: list[OutputText | Refusal] = []
        if content or empty:
            parts.append(OutputText(text=content))
        if refusal:
            parts.append(Refusal(refusal=refusal))
        items.append(MessageItem(id=new_id("msg"), content=parts))
    for call in tool_calls:
        if call.function is not None:
            items.append(
                FunctionCallItem(
                    arguments=call.function.arguments, call_id=call.id, name=call.function.name, id=call.id
                )
            )
        elif call.custom is not None:
            items.append(
                CustomToolCallItem(
                    call_id=call.id,
                    name=str(call.custom.get("name", "")),
                    input=str(call.custom.get("input", "")),
                    id=call.id,
                )
            )
        else:
            raise UpstreamError(
                f"the upstream returned a tool call of type '{call.type}' with no function or custom body"
            )
    return items


def assistant_message(completion: ChatCompletion, *, parser: bool, continued: bool) -> AssistantMessage:
    """choices[0].message with vLLM's reasoning field folded into `<think>` content (spec 7.1)."""
    if not completion.choices:
        raise UpstreamError("the upstream's chat completion has no choices")
    message = completion.choices[0].message
    reasoning = message.reasoning_content or message.reasoning
    if reasoning:
        if not parser:
            raise UpstreamError(NO_PARSER)
        message.content = fold_reasoning(message.content, reasoning, continued=continued)
        message.reasoning = message.reasoning_content = None
    return message


def to_response(
    completion: ChatCompletion,
    req: ResponsesRequest,
    *,
    model: str | None,
    parser: bool,
    continued: bool = False,
    response_id: str | None = None,
) -> Response:
    """The full Response envelope for one upstream chat completion (spec 8.3)."""
    message = assistant_message(completion, parser=parser, continued=continued)
    choice = completion.choices[0]
    reason = INCOMPLETE_REASONS.get(choice.finish_reason or "")
    output = output_items(message, parse_think=parser)
    if message.tool_calls and req.tools:
        names = namespace_map(req.tools)
        if names:
            restore(output, names)
    response = Response(
        id=response_id or new_id("resp"),
        created_at=float(completion.created or time.time()),
        model=model if model is not None else completion.model,
        output=output,
        status="incomplete" if reason else "completed",
        incomplete_details=IncompleteDetails(reason=reason) if reason else None,
        usage=to_usage(completion.usage),
        **echo(req),
    )
    if choice.native_finish_reason is not None:
        response.native_finish_reason = str(choice.native_finish_reason)
    return response


def attach_tokens(response: Response, info: TokenInfo) -> None:
    """Training mode: the token information goes on the last output item only (spec 9.5)."""
    if not response.output:
        return
    item = response.output[-1]
    item.prompt_token_ids = info.prompt_token_ids if info.prompt_token_ids is not None else []
    item.generation_token_ids = info.generation_token_ids
    item.generation_log_probs = info.generation_log_probs
    item.routed_experts = info.routed_experts
    if info.weight_version is not None:
        item.weight_version = info.weight_version


def echo(req: ResponsesRequest) -> dict[str, Any]:
    """The request fields a Response repeats back."""
    fields: dict[str, Any] = {
        "instructions": req.instructions,
        "metadata": req.metadata,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "max_output_tokens": req.max_output_tokens,
        "service_tier": req.service_tier,
        "top_logprobs": req.top_logprobs,
        "user": req.user,
        "tools": req.tools or [],
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
    }
    if req.reasoning is not None:
        r = req.reasoning
        fields["reasoning"] = ReasoningEcho(
            context=r.context,
            effort=r.effort,
            generate_summary=r.generate_summary,
            summary=r.summary,
            mode=r.mode if r.mode is not None else UNSET,
        )
    if req.text is not None:
        fields["text"] = TextEcho(format=req.text.format, verbosity=req.text.verbosity)
    return fields


def _count(value: Any) -> int | None:
    """Only non-negative integers count as a usage detail; anything else is not reported."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def to_usage(usage: Usage | None) -> ResponseUsage | None:
    """vLLM's usage as a Response's (spec 8.4); a detail vLLM does not report is 0, never null."""
    if usage is None:
        return None
    cached = _count(usage.prompt_tokens_details.cached_tokens) if usage.prompt_tokens_details else None
    if cached is None:
        cached = _count(usage.cached_input_tokens)
    if cached is None:
        cached = _count(usage.cache_read_input_tokens)
    reasoning = _count(usage.completion_tokens_details.reasoning_tokens) if usage.completion_tokens_details else None
    if reasoning is None:
        reasoning = _count(usage.reasoning_output_tokens)
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=cached or 0),
        output_tokens=usage.completion_tokens,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning or 0),
        total_tokens=usage.total_tokens,
    )


def empty_completion(model: str | None, finish_reason: str) -> dict[str, Any]:
    """The local empty reply for a context overflow ("length") or a blocked turn ("content_filter")."""
    return {
        "id": f"chatcmpl-{hex32()}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "finish_reason": finish_reason,
                "message": {"role": "assistant", "content": None, "tool_calls": None},
                "logprobs": None,
            }
        ],
        "usage": None,
    }
