"""Serving both endpoints on vLLM's `/v1/completions` (`use_completions_api: true`, spec section 10).

The chat body is rendered to one prompt (raw, or with the tokenizer's chat template), sent as a
text completion, and the answer (or each streamed chunk) is wrapped back into chat form; from
there `/v1/responses` converts it exactly as it converts a chat reply. The vLLM-boundary rules of
section 6 do not apply on this path.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp import web

from .convert.completions import (
    CompletionChunks,
    check_chat_body,
    render_raw,
    template_kwargs,
    to_chat_completion,
    to_completions_body,
    tokenize_body,
)
from .convert.reply import attach_tokens, empty_completion, to_response
from .convert.stream import ResponsesStream
from .convert.tokens import TokenInfo, from_reply, prompt_ids_from_tokenize
from .errors import UpstreamError
from .replies import JSON, check_reply, check_stream, json_reply
from .schemas import ENCODER
from .schemas.chat import COMPLETION_DECODER
from .schemas.responses import ResponsesRequest
from .state import Proxy
from .streaming import relay_chat, relay_responses, replay_chat, replay_responses
from .upstream import Upstream


async def serve(
    proxy: Proxy, request: web.Request, body: dict[str, Any], *, req: ResponsesRequest | None, key: str | None
) -> web.StreamResponse:
    """Answer a chat body (`req` is the Responses request it came from, if any) through /v1/completions."""
    config = proxy.config
    stream = req.stream if req is not None else body.get("stream") is True
    if req is not None and stream:
        body["stream"] = True
    if check_chat_body(body, config):
        proxy.boundary.warn_dropped_template_kwargs("use_completions_api is true")
    prompt = await _render(proxy, body)
    completion_body = to_completions_body(body, config, prompt)
    if req is None and stream:  # a chat client gets the usage chunk only if it asked, as from vLLM
        if body.get("stream_options") is not None:
            completion_body["stream_options"] = body["stream_options"]
        else:
            completion_body.pop("stream_options", None)
    data = ENCODER.encode(completion_body)
    model = config.model or (req.model if req is not None else body.get("model"))
    training = config.return_token_id_information

    async def tokens(upstream: Upstream, fields: dict[str, Any]) -> TokenInfo:
        """Token fields of the completion (already checked), with the prompt ids from /tokenize if vLLM sent none."""
        info = TokenInfo(
            prompt_token_ids=fields["prompt_token_ids"],
            generation_token_ids=fields["generation_token_ids"],
            generation_log_probs=fields["generation_log_probs"],
        )
        if info.prompt_token_ids is None:
            status, payload = await proxy.pool.call_upstream(
                request, upstream, "tokenize", ENCODER.encode(tokenize_body(config, prompt, completion_body))
            )
            if status != 200:
                raise UpstreamError(f"the upstream's /tokenize answered {status}")
            info.prompt_token_ids = prompt_ids_from_tokenize(json_reply(payload, upstream))
        return info

    interval = config.stream_keepalive_s
    if stream:
        async with proxy.pool.request(request, "completions", data, key=key) as (upstream, up):
            local = await check_stream(proxy, upstream, up)
            if local is None:
                chunks = CompletionChunks(config)

                def adapt(payload: bytes) -> bytes:
                    return ENCODER.encode(chunks.feed(orjson.loads(payload)))

                if req is None:
                    return await relay_chat(
                        request, up, upstream, fold=None, parser=True, interval=interval, adapt=adapt
                    )
                translator = ResponsesStream(req, model=model, parser=config.uses_reasoning_parser)

                async def stream_tokens() -> TokenInfo:
                    return await tokens(upstream, chunks.token_fields())

                return await relay_responses(
                    request, up, upstream, translator, interval=interval, adapt=adapt,
                    tokens=stream_tokens if training else None,
                )  # fmt: skip
        if isinstance(local, web.Response):
            return local
        if req is None:
            return await replay_chat(request, model, local, interval=interval)
        translator = ResponsesStream(req, model=model, parser=config.uses_reasoning_parser)
        return await replay_responses(request, translator, empty_completion(model, local), interval=interval)

    upstream, status, payload = await proxy.pool.call(request, "completions", data, key=key)
    if status != 200:
        local = check_reply(proxy, status, payload)
        if isinstance(local, web.Response):
            return local
        chat = empty_completion(model, local)
    else:
        chat = to_chat_completion(json_reply(payload, upstream), config, training=training)
        if training:
            message = chat["choices"][0]["message"]
            info = await tokens(upstream, message)
            message["prompt_token_ids"] = info.prompt_token_ids
    if req is None:
        return web.Response(body=ENCODER.encode(chat), content_type=JSON)
    completion = COMPLETION_DECODER.decode(ENCODER.encode(chat))
    response = to_response(completion, req, model=model, parser=config.uses_reasoning_parser)
    if training and status == 200:
        attach_tokens(response, from_reply(chat))
    return web.Response(body=ENCODER.encode(response), content_type=JSON)


async def _render(proxy: Proxy, body: dict[str, Any]) -> str:
    messages = body["messages"]
    if proxy.template is None:
        return render_raw(messages)
    kwargs = template_kwargs(proxy.config, body.get("metadata"))
    # Templates are Jinja run in Python: keep them off the event loop.
    return await asyncio.to_thread(proxy.template.render, messages, body.get("tools"), kwargs)
