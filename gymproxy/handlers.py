"""Route handlers: where a request goes. Each step below is a call that returns a value.

POST /v1/responses          read -> decode -> to_chat_body -> boundary -> upstream -> to_response
                            (stream: relay_responses translates each chunk into events)
POST /v1/chat/completions   read -> decode -> boundary -> upstream -> fold reasoning -> reply
                            (stream: relay_chat relays each chunk)
with use_completions_api    both go through completions_backend.serve instead of the boundary
with is_responses_native    /v1/responses is responses_native: forwarded to the upstream's own
GET  /v1/models, POST /v1/completions, POST /tokenize   relayed to the upstream as they are
GET  /health, /metrics      the fleet's state
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import orjson
from aiohttp import web

from . import completions_backend
from .bodies import decode_chat, decode_object, decode_responses, read_body
from .config import Config
from .convert.boundary import sequential_reasoning_blocked
from .convert.reply import attach_tokens, empty_completion, to_response
from .convert.request import to_chat_body
from .convert.stream import ChatReasoningFolder, ResponsesStream, has_reasoning
from .convert.tokens import TokenInfo, attach_to_chat
from .errors import BadRequest, UpstreamError
from .http1 import ClientError
from .replies import (
    check_completion,
    check_reply,
    check_stream,
    fold_chat_reasoning,
    json_reply,
    token_info,
)
from .schemas import ENCODER
from .schemas.chat import COMPLETION_DECODER
from .state import Proxy
from .streaming import SSE_HEADERS, relay_chat, relay_responses, replay_chat, replay_responses
from .upstream import stamp

JSON = "application/json"


async def responses(proxy: Proxy, request: web.Request) -> web.StreamResponse:
    """`POST /v1/responses`: convert to chat, call vLLM, convert the answer (or each chunk) back."""
    config = proxy.config
    req = decode_responses(await read_body(request, config.max_body_size))
    if config.use_completions_api:
        body = to_chat_body(req)
        return await completions_backend.serve(proxy, request, body, req=req, key=_user(req.user, config))
    body = to_chat_body(req, proxy.boundary)
    if req.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    body = proxy.boundary.prepare(body, built=True)
    continued = body.get("continue_final_message") is True
    model = config.model or req.model
    parser = config.uses_reasoning_parser
    local = _local_answer(config, body)
    if req.stream:
        translator = ResponsesStream(req, model=model, parser=parser, continued=continued)
        if local is None:
            async with proxy.pool.request(request, "chat", ENCODER.encode(body), key=_user(req.user, config)) as (
                upstream,
                up,
            ):
                local = await check_stream(proxy, upstream, up)
                if local is None:
                    tokens_of = None
                    if config.return_token_id_information:

                        async def tokens_of() -> TokenInfo:
                            return await token_info(proxy, request, upstream, body, translator.token_reply())

                    return await relay_responses(
                        request, up, upstream, translator, interval=config.stream_keepalive_s, tokens=tokens_of
                    )
        if isinstance(local, web.Response):
            return local
        return await replay_responses(
            request, translator, empty_completion(model, local), interval=config.stream_keepalive_s
        )
    tokens = None
    source = "gymproxy"
    if local is None:
        upstream, status, payload = await proxy.pool.call(
            request, "chat", ENCODER.encode(body), key=_user(req.user, config)
        )
        local = check_reply(proxy, status, payload) if status != 200 else None
        source = f"the upstream {upstream.base_url}"
        if local is None and config.return_token_id_information:
            tokens = await token_info(proxy, request, upstream, body, json_reply(payload, upstream))
    if isinstance(local, web.Response):
        return local
    if local is not None:
        payload = ENCODER.encode(empty_completion(model, local))
    try:
        completion = COMPLETION_DECODER.decode(payload)
    except msgspec.DecodeError as exc:
        raise UpstreamError(f"{source} sent an invalid chat completion: {exc}") from exc
    response = to_response(completion, req, model=model, parser=parser, continued=continued)
    if tokens is not None:
        attach_tokens(response, tokens)
    return web.Response(body=ENCODER.encode(response), content_type=JSON)


async def responses_native(proxy: Proxy, request: web.Request) -> web.StreamResponse:
    """`POST /v1/responses` with `is_responses_native`: the upstream speaks Responses itself (spec 11)."""
    config = proxy.config
    body = decode_object(await read_body(request, config.max_body_size))
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
    body = decode_chat(await read_body(request, config.max_body_size))
    if config.use_completions_api:
        return await completions_backend.serve(proxy, request, body, req=None, key=_user(body.get("user"), config))
    body = proxy.boundary.prepare(body)
    continued = body.get("continue_final_message") is True
    model = body.get("model")
    local = _local_answer(config, body)
    if body.get("stream") is True:
        if local is None:
            async with proxy.pool.request(
                request, "chat", ENCODER.encode(body), key=_user(body.get("user"), config)
            ) as (
                upstream,
                up,
            ):
                local = await check_stream(proxy, upstream, up)
                if local is None:
                    fold = ChatReasoningFolder(continued=continued) if config.uses_reasoning_parser else None
                    return await relay_chat(
                        request,
                        up,
                        upstream,
                        fold=fold,
                        parser=config.uses_reasoning_parser,
                        interval=config.stream_keepalive_s,
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
                reply = json_reply(payload, upstream)
                fold_chat_reasoning(reply, parser=config.uses_reasoning_parser, continued=continued)
                attach_to_chat(reply, await token_info(proxy, request, upstream, body, reply))
                payload = orjson.dumps(reply)
            elif has_reasoning(payload):  # most replies carry none: their bytes go back untouched
                reply = json_reply(payload, upstream)
                if fold_chat_reasoning(reply, parser=config.uses_reasoning_parser, continued=continued):
                    payload = orjson.dumps(reply)
            else:
                check_completion(payload, upstream)
            return web.Response(body=payload, content_type=JSON)
        local = check_reply(proxy, status, payload)
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
            async for chunk in up.iter_any():
                await response.write(chunk)
        except (asyncio.TimeoutError, ClientError):
            # The status line is gone: drop the connection so the client sees a cut body,
            # never a complete-looking one.
            if request.transport is not None:
                request.transport.close()
            return response
        await response.write_eof()
        return response
