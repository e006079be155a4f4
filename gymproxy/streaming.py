"""Streaming I/O: relay vLLM's chat SSE to the client chunk by chunk, as chat or as Responses events.

Every upstream read is written to the client before the next read starts; nothing is buffered
beyond one SSE frame. Before the response is prepared an error is raised as usual; after it,
the stream ends with a terminal event (`response.failed`, or an `error` chunk plus `[DONE]`).
If the client goes away, the upstream response is closed at once, which makes vLLM abort.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import msgspec
import orjson
from aiohttp import web

from .convert.reply import NO_PARSER, empty_completion
from .convert.stream import ChatReasoningFolder, ResponsesStream, has_reasoning
from .convert.tokens import TokenInfo
from .errors import GymproxyError, UpstreamError
from .http1 import ClientError, Reply
from .schemas import ENCODER
from .schemas.chat import CHUNK_DECODER, ChatChunk, ChunkChoice
from .sse import DONE, SSEDecoder, SSEError
from .upstream import TRACE, Upstream, stamp

log = logging.getLogger("gymproxy")

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE_FRAME = b"data: [DONE]\n\n"
KEEPALIVE = b": keep-alive\n\n"

# Upstream troubles after the status line: the stream is ended with an error event.
READ_ERRORS = (
    asyncio.TimeoutError,
    ClientError,
    SSEError,
    msgspec.DecodeError,
    orjson.JSONDecodeError,
    UpstreamError,
)


class _ChunkCheck(msgspec.Struct):
    error: Any = None


_CHUNK_CHECK = msgspec.json.Decoder(_ChunkCheck)


class _Payloads:
    """An upstream SSE body's data payloads, `[DONE]` noted, each adapted to a chat chunk if asked."""

    __slots__ = ("_decoder", "_adapt", "done")

    def __init__(self, adapt: Callable[[bytes], bytes] | None) -> None:
        self._decoder = SSEDecoder()
        self._adapt = adapt
        self.done = False

    def feed(self, data: bytes) -> Iterable[bytes]:
        payloads = self._decoder.feed(data)
        if DONE in payloads:
            self.done = True
            payloads = [payload for payload in payloads if payload != DONE]
        return payloads if self._adapt is None else map(self._adapt, payloads)


class ClientGone(Exception):
    """The client closed its connection mid-stream."""


class SSEWriter:
    """A prepared event-stream response that sends `: keep-alive` while the upstream is silent."""

    def __init__(self, response: web.StreamResponse, interval: float, trace: Any = None) -> None:
        self.response = response
        self.trace = trace  # (metrics, route, start): time to first byte is recorded on the first write
        self.interval = interval
        self.loop = asyncio.get_running_loop()
        self.last = self.loop.time()
        self._timer = self.loop.call_later(interval, self._tick)
        self._pending: asyncio.Future[Any] | None = None

    async def write(self, data: bytes) -> None:
        self.last = self.loop.time()
        if self.trace is not None:
            metrics, route, start = self.trace
            metrics.ttfb.observe(route, self.last - start)
            self.trace = None
        try:
            await self.response.write(data)
        except ConnectionError as exc:  # aiohttp's ClientConnectionResetError is one too
            raise ClientGone from exc

    def _tick(self) -> None:
        idle = self.loop.time() - self.last
        if idle >= self.interval and (self._pending is None or self._pending.done()):
            self.last = self.loop.time()
            self._pending = asyncio.ensure_future(self._keepalive())
            idle = 0
        self._timer = self.loop.call_later(self.interval - idle, self._tick)

    async def _keepalive(self) -> None:
        try:
            await self.response.write(KEEPALIVE)
        except (ConnectionError, RuntimeError):
            pass  # the client is gone; the relay loop finds out on its next write

    def stop(self) -> None:
        self._timer.cancel()
        if self._pending is not None and not self._pending.done():
            self._pending.cancel()

    async def close(self) -> None:
        self.stop()
        await self.response.write_eof()


async def open_stream(request: web.Request, interval: float) -> SSEWriter:
    response = web.StreamResponse(headers=SSE_HEADERS)
    stamp(request, response)  # headers go out with prepare(): the cookie must be on them
    await response.prepare(request)
    return SSEWriter(response, interval, request.get(TRACE))


async def relay_chat(
    request: web.Request,
    up: Reply,
    upstream: Upstream,
    *,
    fold: ChatReasoningFolder | None,
    parser: bool,
    interval: float,
    adapt: Callable[[bytes], bytes] | None = None,
) -> web.StreamResponse:
    """vLLM's chat stream to the client: each frame as it arrives, reasoning folded when asked.
    `adapt` turns another stream's payloads (the completions backend's) into chat chunks first."""
    writer = await open_stream(request, interval)
    body = _Payloads(adapt)
    done = False
    failure: str | None = None
    out: list[bytes] = []
    try:
        async for data in up.iter_any():
            for payload in body.feed(data):
                # Relayed as is: checked for JSON and an error only, never built into objects.
                if _CHUNK_CHECK.decode(payload).error is not None:
                    out.append(b"data: " + payload + b"\n\n")  # vLLM's own in-stream error
                    done = True  # vLLM's [DONE] follows; the stream is over either way
                    continue
                if fold is not None and fold.needed(payload):
                    payload = fold.fold(payload)
                elif not parser and has_reasoning(payload):
                    raise UpstreamError(NO_PARSER)
                out.append(b"data: " + payload + b"\n\n")
            if out:
                frames, out = b"".join(out), []
                await writer.write(frames)
        if not (done or body.done):
            failure = f"the upstream {upstream.base_url} ended the stream without [DONE]"
    except ClientGone:
        return _gone(up, writer)
    except READ_ERRORS as exc:
        failure = f"the upstream {upstream.base_url} failed mid-stream: {_describe(exc)}"
    except Exception:  # a bug in gymproxy: the stream still ends properly
        log.exception("unhandled error while relaying a chat stream")
        failure = "internal error in gymproxy (see its log)"
    if failure is not None:
        up.close()
        error = {"error": {"message": failure, "type": "upstream_error", "param": None, "code": 502}}
        out.append(b"data: " + ENCODER.encode(error) + b"\n\n")
    out.append(DONE_FRAME)
    return await _end(up, writer, b"".join(out))


async def relay_responses(
    request: web.Request,
    up: Reply,
    upstream: Upstream,
    translator: ResponsesStream,
    *,
    interval: float,
    tokens: Callable[[], Awaitable[TokenInfo]] | None = None,
    adapt: Callable[[bytes], bytes] | None = None,
) -> web.StreamResponse:
    """vLLM's chat stream to the client as Responses events; `tokens` gives training-mode ids at
    the end, and `adapt` turns another stream's payloads into chat chunks first."""
    writer = await open_stream(request, interval)
    body = _Payloads(adapt)
    out: list[bytes] = []
    try:
        await writer.write(translator.start())
        async for data in up.iter_any():
            for payload in body.feed(data):
                chunk = CHUNK_DECODER.decode(payload)
                if chunk.error is not None:
                    raise UpstreamError(_chunk_error(chunk))
                out.append(translator.feed(chunk))
            if out:
                frames, out = b"".join(out), []
                await writer.write(frames)
        if not body.done:
            raise UpstreamError("the stream ended without [DONE]")
        info = await tokens() if tokens is not None else None
        tail, _ = translator.finish(info)
    except ClientGone:
        return _gone(up, writer)
    except READ_ERRORS as exc:
        up.close()
        tail = translator.fail(f"the upstream {upstream.base_url} failed mid-stream: {_describe(exc)}")
    except Exception:  # a bug in gymproxy: the stream still ends with a terminal event
        log.exception("unhandled error while translating a Responses stream")
        up.close()
        tail = translator.fail("internal error in gymproxy (see its log)")
    out.append(tail)
    return await _end(up, writer, b"".join(out))


def _gone(up: Reply, writer: SSEWriter) -> web.StreamResponse:
    """The client went away: close the upstream connection at once so vLLM aborts the generation."""
    up.close()
    writer.stop()
    return writer.response


async def _end(up: Reply, writer: SSEWriter, tail: bytes) -> web.StreamResponse:
    try:
        await writer.write(tail)
        await writer.close()
    except (ClientGone, ConnectionError):
        return _gone(up, writer)
    return writer.response


async def replay_responses(
    request: web.Request, translator: ResponsesStream, completion_body: dict[str, Any], *, interval: float
) -> web.StreamResponse:
    """A proper event stream for an answer made locally (context overflow, blocked turn)."""
    choice = completion_body["choices"][0]
    writer = await open_stream(request, interval)
    frames = translator.start()
    frames += translator.feed(
        ChatChunk(created=completion_body["created"], choices=[ChunkChoice(finish_reason=choice["finish_reason"])])
    )
    tail, _ = translator.finish()
    await writer.write(frames + tail)
    await writer.close()
    return writer.response


async def replay_chat(
    request: web.Request, model: str | None, finish_reason: str, *, interval: float
) -> web.StreamResponse:
    """The chat stream of a local empty answer: a role chunk, a finish chunk, `[DONE]`."""
    body = empty_completion(model, finish_reason)
    base = {"id": body["id"], "object": "chat.completion.chunk", "created": body["created"], "model": model}
    first = {
        **base,
        "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        ],
    }
    last = {**base, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish_reason}]}
    writer = await open_stream(request, interval)
    await writer.write(b"data: " + ENCODER.encode(first) + b"\n\ndata: " + ENCODER.encode(last) + b"\n\n" + DONE_FRAME)
    await writer.close()
    return writer.response


def _chunk_error(chunk: ChatChunk) -> str:
    error = chunk.error
    if isinstance(error, dict):
        return f"the upstream reported an error mid-stream: {error.get('message') or error}"
    return f"the upstream reported an error mid-stream: {error}"


def _describe(exc: BaseException) -> str:
    if isinstance(exc, GymproxyError):
        return exc.message
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
