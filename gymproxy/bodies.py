"""Reading and decoding client request bodies, with every failure a 4xx naming the field."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import orjson
from aiohttp import web

from .errors import BadRequest, PayloadTooLarge, from_validation
from .schemas.chat import ChatRequestView
from .schemas.responses import REQUEST_DECODER, ResponsesRequest


async def read_body(request: web.Request, limit: int) -> bytes:
    """The request body, refusing anything over `limit` bytes (decoded) before reading it all."""
    length = request.content_length
    try:
        if length is not None and "Content-Encoding" not in request.headers:
            if length > limit:
                raise PayloadTooLarge(f"the request body is {length} bytes; the limit is {limit} (max_body_size)")
            return await request.content.readexactly(length)
        # Chunked or compressed: Content-Length (if any) is not the size we get, so count as we go.
        chunks = []
        size = 0
        async for chunk in request.content.iter_any():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"the request body is over the limit of {limit} bytes (max_body_size)")
            chunks.append(chunk)
        return b"".join(chunks)
    except asyncio.IncompleteReadError as exc:
        raise BadRequest("the request body is shorter than its Content-Length") from exc
    except web.RequestPayloadError as exc:  # bad chunking or an undecodable Content-Encoding
        raise BadRequest(f"the request body cannot be read: {exc}") from exc


TOO_DEEP = "the request body is nested too deeply"


def decode_responses(raw: bytes) -> ResponsesRequest:
    try:
        return REQUEST_DECODER.decode(raw)
    except RecursionError:
        raise BadRequest(TOO_DEEP) from None
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        error = from_validation(exc)
        if "unknown field" in error.message and error.param and "." not in error.param and "[" not in error.param:
            error.message += "; vLLM sampling extras go in metadata.extra_body (a JSON string)"
        raise error from exc


def decode_object(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"The request body is not valid JSON: {exc}") from exc
    except RecursionError:
        raise BadRequest(TOO_DEEP) from None
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object")
    return body


def decode_chat(raw: bytes) -> dict[str, Any]:
    body = decode_object(raw)
    try:
        msgspec.convert(body, ChatRequestView)
    except RecursionError:
        raise BadRequest(TOO_DEEP) from None
    except msgspec.ValidationError as exc:
        raise from_validation(exc) from exc
    return body
