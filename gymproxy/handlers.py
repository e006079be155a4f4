"""Route handlers: the only place that sequences I/O. Each step below is a call that returns a value.

POST /v1/responses          read -> decode -> to_chat_body -> boundary -> upstream -> to_response
POST /v1/chat/completions   read -> decode -> boundary -> upstream -> fold reasoning -> reply
GET  /v1/models, POST /v1/completions, POST /tokenize   relayed to the upstream as they are
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import msgspec
import orjson
from aiohttp import web

from .config import Config
from .convert.boundary import sequential_reasoning_blocked
from .convert.reply import NO_PARSER, attach_tokens, empty_completion, fold_reasoning, to_response
from .convert.request import to_chat_body
from .convert.stream import ChatReasoningFolder, ResponsesStream
from .convert.tokens import TokenInfo, attach_to_chat, from_reply, prompt_ids_from_tokenize, tokenize_body
from .errors import BadRequest, PayloadTooLarge, UpstreamError, UpstreamStatus, from_validation
from .overflow import is_context_overflow, upstream_message
from .schemas import ENCODER
from .schemas.chat import COMPLETION_DECODER, ChatRequestView
from .schemas.responses import REQUEST_DECODER, ResponsesRequest
from .state import Proxy
from .streaming import SSE_HEADERS, relay_chat, relay_responses, replay_chat, replay_responses
from .upstream import Upstream, read, stamp

JSON = "application/json"


async def responses(proxy: Proxy, request: web.Request) -> web.StreamResponse:
    """`POST /v1/responses`: convert to chat, call vLLM, convert the answer (or each chunk) back."""
    config = proxy.config
    req = _decode_responses(await read_body(request, config.max_body_size))
    body = to_chat_body(req)
    if req.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    body = proxy.boundary.prepare(body)
    continued = body.get("continue_final_message") is True
    model = config.model or req.model
    parser = config.uses_reasoning_parser
    local = _local_answer(config, body)
    if req.stream:
        translator = ResponsesStream(req, model=model, parser=parser, continued=continued)
        if local is None:
            async with proxy.pool.request(request, "chat", ENCODER.encode(body), key=_user(req.user, config)) as (upstream, up):
                local = await _check_stream(proxy, upstream, up)
                if local is None:
                    tokens_of = None
                    if config.return_token_id_information:

                        async def tokens_of(reply: dict[str, Any]) -> TokenInfo:
                            return await _token_info(proxy, request, upstream, body, reply)

                    return await relay_responses(
                        request, up, upstream, translator, interval=config.stream_keepalive_s, tokens=tokens_of
                    )
        if isinstance(local, web.Response):
            return local
        return await replay_responses(request, translator, empty_completion(model, local), interval=config.stream_keepalive_s)
    tokens = None
    if local is None:
        upstream, status, payload = await proxy.pool.call(request, "chat", ENCODER.encode(body), key=_user(req.user, config))
        local = _check_reply(proxy, status, payload) if status != 200 else None
        if local is None and config.return_token_id_information:
            tokens = await _token_info(proxy, request, upstream, body, _json_reply(payload))
    if isinstance(local, web.Response):
        return local
    if local is not None:
        payload = ENCODER.encode(empty_completion(model, local))
    try:
        completion = COMPLETION_DECODER.decode(payload)
    except msgspec.DecodeError as exc:
        raise UpstreamError(f"the upstream's chat completion is not valid: {exc}") from exc
    response = to_response(completion, req, model=model, parser=parser, continued=continued)
    if tokens is not None:
        attach_tokens(response, tokens)
    return web.Response(body=ENCODER.encode(response), content_type=JSON)


async def responses_native(proxy: Proxy, request: web.Request) -> web.StreamResponse:
    """`POST /v1/responses` with `is_responses_native`: the upstream speaks Responses itself (spec 11)."""
    config = proxy.config
    body = _decode_object(await read_body(request, config.max_body_size))
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("`stream` must be a JSON boolean", param="stream")
    if config.model is not None:
        body["model"] = config.model
    if config.chat_template_kwargs is not None:
        body["chat_template_kwargs"] = dict(config.chat_template_kwargs)
    if config.extra_body:
        body = {**config.extra_body, **body}
    if config.sampling_overrides:
        body.update(config.sampling_overrides)
    return await _forward(proxy, request, "responses", ENCODER.encode(body), key=_user(body.get("user"), config))


async def chat_completions(proxy: Proxy, request: web.Request) -> web.StreamResponse:
    """`POST /v1/chat/completions`: vLLM's own API, with the boundary rules and reasoning folding."""
    config = proxy.config
    body = proxy.boundary.prepare(_decode_chat(await read_body(request, config.max_body_size)))
    continued = body.get("continue_final_message") is True
    model = body.get("model")
    local = _local_answer(config, body)
    if body.get("stream") is True:
        if local is None:
            async with proxy.pool.request(request, "chat", ENCODER.encode(body), key=_user(body.get("user"), config)) as (
                upstream,
                up,
            ):
                local = await _check_stream(proxy, upstream, up)
                if local is None:
                    fold = ChatReasoningFolder(continued=continued) if config.uses_reasoning_parser else None
                    return await relay_chat(
                        request, up, upstream, fold=fold, parser=config.uses_reasoning_parser, interval=config.stream_keepalive_s
                    )
        if isinstance(local, web.Response):
            return local
        return await replay_chat(request, model, local, interval=config.stream_keepalive_s)
    if local is None:
        upstream, status, payload = await proxy.pool.call(
            request, "chat", ENCODER.encode(body), key=_user(body.get("user"), config)
        )
        if status == 200:
            if config.return_token_id_information:
                reply = _json_reply(payload)
                _fold_reasoning(reply, parser=config.uses_reasoning_parser, continued=continued)
                attach_to_chat(reply, await _token_info(proxy, request, upstream, body, reply))
                payload = orjson.dumps(reply)
            elif b'"reasoning' in payload:  # most replies carry no reasoning field: their bytes go back untouched
                reply = _json_reply(payload)
                if _fold_reasoning(reply, parser=config.uses_reasoning_parser, continued=continued):
                    payload = orjson.dumps(reply)
            return web.Response(body=payload, content_type=JSON)
        local = _check_reply(proxy, status, payload)
    if isinstance(local, web.Response):
        return local
    return web.Response(body=ENCODER.encode(empty_completion(model, local)), content_type=JSON)


def _user(user: Any, config: Config) -> str | None:
    """The body's `user` keys a session for clients without cookies (when configured)."""
    return user if config.pinning.use_user_field and isinstance(user, str) and user else None


def _local_answer(config: Config, body: dict[str, Any]) -> str | None:
    """`content_filter` when the sequential-reasoning guard answers without asking vLLM."""
    if not config.sequential_reasoning_allowed and sequential_reasoning_blocked(body):
        return "content_filter"
    return None


async def _check_stream(proxy: Proxy, upstream: Upstream, up: aiohttp.ClientResponse) -> str | web.Response | None:
    """None when `up` is a stream to relay; otherwise what `_check_reply` says about the error."""
    if up.status == 200:
        if up.content_type == "text/event-stream":
            return None
        raise UpstreamError(
            f"the upstream {upstream.base_url} answered a streaming request with {up.content_type}, not an event stream"
        )
    return _check_reply(proxy, up.status, await read(up))


async def models(proxy: Proxy, request: web.Request) -> web.StreamResponse:
    """`GET /v1/models`, answered by the (pinned) upstream."""
    _, status, payload = await proxy.pool.call(request, "models", method="GET")
    return web.Response(body=payload, status=status, content_type=JSON)


async def health(proxy: Proxy, request: web.Request) -> web.StreamResponse:
    """`GET /health`: 200 while at least one upstream is healthy, 503 otherwise; lists each upstream."""
    states = proxy.pool.states()
    ok = any(state["healthy"] for state in states)
    body = {"status": "ok" if ok else "unavailable", "upstreams": states}
    return web.Response(body=ENCODER.encode(body), status=200 if ok else 503, content_type=JSON)


async def metrics(proxy: Proxy, request: web.Request) -> web.StreamResponse:
    """`GET /metrics` in the Prometheus text format."""
    text = proxy.metrics.render(proxy.pool.gauges())
    return web.Response(text=text, content_type="text/plain", charset="utf-8")


def relay(route: str) -> Any:
    """A handler that forwards the request body to `route` unchanged and streams the reply back."""

    async def handler(proxy: Proxy, request: web.Request) -> web.StreamResponse:
        return await _forward(proxy, request, route, await read_body(request, proxy.config.max_body_size))

    handler.__name__ = f"relay_{route}"
    return handler


async def _forward(
    proxy: Proxy, request: web.Request, route: str, data: bytes, key: str | None = None
) -> web.StreamResponse:
    """Send `data` to the pinned upstream and relay its status and body chunk by chunk."""
    async with proxy.pool.request(request, route, data, key=key) as (_, up):
        response = web.StreamResponse(status=up.status)
        response.content_type = up.content_type
        if up.content_type == "text/event-stream":
            response.headers.update(SSE_HEADERS)
        stamp(request, response)
        await response.prepare(request)
        try:
            async for chunk in up.content.iter_any():
                await response.write(chunk)
        except (asyncio.TimeoutError, aiohttp.ClientError):
            # The status line is gone: drop the connection so the client sees a cut body,
            # never a complete-looking one.
            if request.transport is not None:
                request.transport.close()
            return response
        await response.write_eof()
        return response


async def read_body(request: web.Request, limit: int) -> bytes:
    """The request body, refusing anything over `limit` bytes before reading it all."""
    length = request.content_length
    if length is not None:
        if length > limit:
            raise PayloadTooLarge(f"the request body is {length} bytes; the limit is {limit} (max_body_size)")
        try:
            return await request.content.readexactly(length)
        except asyncio.IncompleteReadError as exc:
            raise BadRequest("the request body is shorter than its Content-Length") from exc
    chunks = []
    size = 0
    async for chunk in request.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"the request body is over the limit of {limit} bytes (max_body_size)")
        chunks.append(chunk)
    return b"".join(chunks)


def _decode_responses(raw: bytes) -> ResponsesRequest:
    try:
        return REQUEST_DECODER.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        error = from_validation(exc)
        if "unknown field" in error.message and error.param and "." not in error.param and "[" not in error.param:
            error.message += "; vLLM sampling extras go in metadata.extra_body (a JSON string)"
        raise error from exc


def _decode_object(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"The request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object")
    return body


def _decode_chat(raw: bytes) -> dict[str, Any]:
    body = _decode_object(raw)
    try:
        msgspec.convert(body, ChatRequestView)
    except msgspec.ValidationError as exc:
        raise from_validation(exc) from exc
    return body


def _check_reply(proxy: Proxy, status: int, payload: bytes) -> str | web.Response:
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


def _json_reply(payload: bytes) -> dict[str, Any]:
    try:
        reply = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise UpstreamError(f"the upstream's chat completion is not valid JSON: {exc}") from exc
    if not isinstance(reply, dict):
        raise UpstreamError("the upstream's chat completion is not a JSON object")
    return reply


def _fold_reasoning(reply: dict[str, Any], *, parser: bool, continued: bool) -> bool:
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


async def _token_info(
    proxy: Proxy, request: web.Request, upstream: Upstream, body: dict[str, Any], reply: dict[str, Any]
) -> TokenInfo:
    """Training mode: the reply's token ids, asking the same upstream's /tokenize for the prompt if needed."""
    info = from_reply(reply)
    if info.prompt_token_ids is None:
        status, payload = await proxy.pool.call_upstream(request, upstream, "tokenize", ENCODER.encode(tokenize_body(body)))
        if status != 200:
            raise UpstreamError(f"the upstream's /tokenize answered {status}: {upstream_message(payload)}")
        info.prompt_token_ids = prompt_ids_from_tokenize(_json_reply(payload))
    return info
