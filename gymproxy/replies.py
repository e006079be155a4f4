"""Judging upstream replies: errors and context overflows, reasoning folding, training token ids."""

from __future__ import annotations

from typing import Any

import msgspec
import orjson
from aiohttp import web

from .convert.reply import NO_PARSER, fold_reasoning
from .convert.tokens import TokenInfo, from_reply, prompt_ids_from_tokenize, tokenize_body
from .errors import UpstreamError, UpstreamStatus
from .http1 import Reply
from .overflow import is_context_overflow, upstream_message
from .schemas import ENCODER
from .state import Proxy
from .upstream import Upstream, read

JSON = "application/json"


async def check_stream(proxy: Proxy, upstream: Upstream, up: Reply) -> str | web.Response | None:
    """None when `up` is a stream to relay; otherwise what `_check_reply` says about the error."""
    if up.status == 200:
        if up.content_type == "text/event-stream":
            return None
        raise UpstreamError(
            f"the upstream {upstream.base_url} answered a streaming request with {up.content_type}, not an event stream"
        )
    return check_reply(proxy, up.status, await read(up))


def check_reply(proxy: Proxy, status: int, payload: bytes) -> str | web.Response:
    """An upstream error status: "length" for a context overflow (or vLLM's own 400 when propagating);
    any other error is raised with the upstream's status and message."""
    if is_context_overflow(status, payload):
        proxy.metrics.overflows += 1
        if proxy.config.propagate_context_overflow_errors:
            return web.Response(body=payload, status=status, content_type=JSON)
        return "length"
    error = _envelope(payload)
    raise UpstreamStatus(
        status,
        upstream_message(payload) or f"the upstream answered HTTP {status}",
        param=error.get("param") if isinstance(error.get("param"), str) else None,
        type=error.get("type") if isinstance(error.get("type"), str) else None,
    )


def _envelope(payload: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return {}
    if not isinstance(body, dict):
        return {}
    inner = body.get("error")
    return inner if isinstance(inner, dict) else body


def json_reply(payload: bytes, upstream: Upstream) -> dict[str, Any]:
    """An upstream reply as a mapping; anything else is the upstream breaking the protocol (502)."""
    try:
        reply = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise UpstreamError(f"the upstream {upstream.base_url} sent a reply that is not valid JSON: {exc}") from exc
    if not isinstance(reply, dict):
        raise UpstreamError(f"the upstream {upstream.base_url} sent a reply that is not a JSON object")
    return reply


class _CompletionShape(msgspec.Struct):
    choices: msgspec.Raw  # checked for JSON syntax only, never built into objects


_SHAPE_CHECK = msgspec.json.Decoder(_CompletionShape)


def check_completion(payload: bytes, upstream: Upstream) -> None:
    """A cheap check that a reply we pass through untouched is a JSON object with `choices`."""
    try:
        _SHAPE_CHECK.decode(payload)
    except msgspec.DecodeError as exc:
        raise UpstreamError(f"the upstream {upstream.base_url} sent an invalid chat completion: {exc}") from exc


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


async def token_info(
    proxy: Proxy, request: web.Request, upstream: Upstream, body: dict[str, Any], reply: dict[str, Any]
) -> TokenInfo:
    """Training mode: the reply's token ids, asking the same upstream's /tokenize for the prompt if needed."""
    info = from_reply(reply)
    if info.prompt_token_ids is None:
        status, payload = await proxy.pool.call_upstream(
            request, upstream, "tokenize", ENCODER.encode(tokenize_body(body))
        )
        if status != 200:
            raise UpstreamError(f"the upstream's /tokenize answered {status}: {upstream_message(payload)}")
        info.prompt_token_ids = prompt_ids_from_tokenize(json_reply(payload, upstream))
    return info
