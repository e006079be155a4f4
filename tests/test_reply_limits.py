"""Upstream replies are held to `limits.max_reply_size` and `limits.max_error_reply_size`: a hostile
upstream that answers with 200 MB costs gymproxy (run as `gymproxy serve` runs) less than 64 MiB of
RSS, and none of it reaches the client, which gets a 502 naming the upstream and the limit.

The upstream is a raw-socket `RawUpstream` that writes its 200 MB lazily, 1 MiB at a time, for as
long as gymproxy reads: every path that reads an upstream body whole (chat, Responses, a busy-shaped
503, a 400), the relayed routes (an error, an announced length, a chunked body: a reply that is not
an event stream is read whole before any of it is sent on) and streams (one event that never ends, a
Responses stream whose last event would carry it all). A long relayed event stream of small events
is a stream the client asked for, and passes whole.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass

import aiohttp
import orjson
import pytest

from .faults import CHAT, RESPONSES, Behaviour, Conn, RawRequest, RawUpstream, Reply, body_for, check_failed_stream
from .served import Served

MiB = 1024 * 1024
HUGE = 200 * 1000 * 1000  # what the upstream offers
RSS_BOUND_MB = 64  # what one such reply may cost gymproxy
MESSAGES, COMPLETIONS = "/v1/messages", "/v1/completions"
BUSY = b'{"error": {"message": "Please try again later or on a different instance ' + b" " * 1000


@dataclass
class Offer:
    """What the upstream answers with, and how much of it gymproxy took before it hung up."""

    status: int = 200
    content_type: str = "application/json"
    announce: bool = False  # a Content-Length of HUGE, rather than chunked
    first: bytes = b'{"id": "'  # the body's first bytes
    frames: bytes | None = None  # the body is this, over and over (else `first` and then b"a"s)
    sent: int = 0

    def pieces(self) -> Iterator[bytes]:
        if self.frames is not None:
            piece = self.frames * (MiB // len(self.frames))
            for _ in range(HUGE // len(piece)):
                yield piece
            return
        yield self.first
        piece = b"a" * MiB
        for _ in range((HUGE - len(self.first)) // MiB):
            yield piece

    def behaviour(self) -> Behaviour:
        async def behave(conn: Conn, req: RawRequest) -> bool:
            await conn.head(self.status, self.content_type, length=HUGE if self.announce else None)
            for piece in self.pieces():
                self.sent += len(piece)
                await (conn.write(piece) if self.announce else conn.chunk(piece))
            return False  # never reached in time: gymproxy hangs up first

        return behave


def delta_frames() -> bytes:
    """A run of vLLM stream chunks, each 4 KB of text: valid to the last byte."""
    chunk = {
        "id": "chatcmpl-raw",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "raw",
        "choices": [{"index": 0, "delta": {"content": "a" * 4000}, "logprobs": None, "finish_reason": None}],
    }
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


async def _post(url: str, path: str, body: dict[str, object]) -> tuple[Reply, bool]:
    """The reply, and whether its body was cut off; within 60 s."""
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session, session.post(url + path, json=body) as r:
        try:
            raw, cut = await r.read(), False
        except aiohttp.ClientPayloadError:
            raw, cut = b"", True
        return Reply(r.status, dict(r.headers), raw, 0.0), cut


async def _exchange(
    tmp_path, offer: Offer, path: str, body: dict[str, object], **limits: int
) -> tuple[Reply, bool, float]:
    """The reply, whether it was cut off, and the peak RSS growth (MB) of one `gymproxy serve`
    answering `body` from an upstream that answers with `offer`."""
    upstream = await RawUpstream(queued=(path.replace(RESPONSES, "/v1/chat/completions"),)).start()
    upstream.push(offer.behaviour())
    try:
        config = {"base_url": upstream.url, "limits": limits}
        async with Served(tmp_path, config) as served:
            before = await served.stats()
            reply, cut = await _post(served.url, path, body)
            after = await served.stats()
    finally:
        await upstream.close()
    return reply, cut, after["peak_rss_mb"] - before["rss_mb"]


def _message(raw: bytes) -> str:
    body = orjson.loads(raw)
    if body.get("type") == "error":  # Anthropic's envelope
        return str(body["error"]["message"])
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return str(body["error"]["message"])


WHOLE = {
    "chat 200": (Offer(), CHAT, body_for(CHAT), "limits.max_reply_size"),
    "chat 200 announced": (Offer(announce=True), CHAT, body_for(CHAT), "limits.max_reply_size"),
    "responses 200": (Offer(), RESPONSES, body_for(RESPONSES), "limits.max_reply_size"),
    "busy 503": (Offer(503, first=BUSY), CHAT, body_for(CHAT), "limits.max_error_reply_size"),
    "plain 503": (Offer(503), RESPONSES, body_for(RESPONSES), "limits.max_error_reply_size"),
    "400": (
        Offer(400, first=b'{"error": {"message": "'),
        RESPONSES,
        body_for(RESPONSES),
        "limits.max_error_reply_size",
    ),
    "relayed 400": (
        Offer(400),
        MESSAGES,
        {"model": "m", "max_tokens": 5, "messages": []},
        "limits.max_error_reply_size",
    ),
    "relayed 200 announced": (
        Offer(announce=True),
        MESSAGES,
        {"model": "m", "max_tokens": 5, "messages": []},
        "limits.max_reply_size",
    ),
    # Before, a chunked relayed body was sent on as it came, and cut off at the limit: 32 MiB of it
    # reached the client first.
    "relayed 200 chunked": (
        Offer(),
        MESSAGES,
        {"model": "m", "max_tokens": 5, "messages": []},
        "limits.max_reply_size",
    ),
    "completions 200 chunked": (Offer(), COMPLETIONS, {"model": "m", "prompt": "hi"}, "limits.max_reply_size"),
    "tokenize 200 chunked": (Offer(), "/tokenize", {"model": "m", "prompt": "hi"}, "limits.max_reply_size"),
    # An event stream for a request that asked for none is read whole too: only a stream the client
    # asked for passes as it comes.
    "relayed stream not asked for": (
        Offer(content_type="text/event-stream", frames=b"event: ping\ndata: {}\n\n"),
        MESSAGES,
        {"model": "m", "max_tokens": 5, "messages": [], "stream": False},
        "limits.max_reply_size",
    ),
    "completions stream not asked for": (
        Offer(content_type="text/event-stream", frames=b"data: {}\n\n"),
        COMPLETIONS,
        {"model": "m", "prompt": "hi"},
        "limits.max_reply_size",
    ),
}


@pytest.mark.parametrize("case", list(WHOLE))
async def test_a_200_mb_reply_is_a_502_and_costs_little(tmp_path, case: str) -> None:
    offer, path, body, key = WHOLE[case]
    reply, cut, grown = await _exchange(tmp_path, offer, path, body)
    assert reply.status == 502 and not cut, (reply.status, reply.raw[:300])
    message = _message(reply.raw)
    assert key in message and "127.0.0.1" in message, message
    assert "a" * 100 not in message  # none of the body itself
    assert grown < RSS_BOUND_MB, f"{grown:.0f} MB of RSS for one reply"
    assert offer.sent < 100 * 1000 * 1000, f"gymproxy read {offer.sent} bytes of it"


async def test_concurrent_huge_replies_cost_at_most_the_limit_each(tmp_path) -> None:
    """Replies held at once cost the limit each, at most: 4 of 200 MB at once (2 converted, 2
    relayed), each a 502."""
    offers = [Offer() for _ in range(4)]
    upstream = await RawUpstream().start()
    upstream.push(*(offer.behaviour() for offer in offers))
    relayed = {"model": "m", "max_tokens": 5, "messages": []}
    try:
        async with Served(tmp_path, {"base_url": upstream.url}) as served:
            before = await served.stats()
            replies = await asyncio.gather(
                *(_post(served.url, path, body) for path, body in [(CHAT, body_for(CHAT)), (MESSAGES, relayed)] * 2)
            )
            after = await served.stats()
    finally:
        await upstream.close()
    grown = after["peak_rss_mb"] - before["rss_mb"]
    print(f"4 replies of 200 MB at once: peak RSS +{grown:.0f} MB")
    for reply, cut in replies:
        assert reply.status == 502 and not cut and "limits.max_reply_size" in _message(reply.raw), reply.raw[:300]
    assert grown < 4 * 16 + 16, f"{grown:.0f} MB of RSS for 4 replies"  # 16 MiB each at most, and the process's own
    assert all(offer.sent < 100 * 1000 * 1000 for offer in offers)


async def test_a_long_relayed_stream_of_small_events_passes_whole(tmp_path) -> None:
    """A relayed event stream is passed on chunk by chunk, however long: 64 MB of small events (four
    times the reply limit) reach the client whole, at a small cost."""
    frames = (
        b'event: content_block_delta\ndata: {"type":"content_block_delta","delta":{"text":"' + b"a" * 1000 + b'"}}\n\n'
    )
    total = 64 * 1000 * 1000

    async def stream(conn: Conn, req: RawRequest) -> bool:
        await conn.head(200, "text/event-stream")
        piece = frames * (MiB // len(frames))
        for _ in range(total // len(piece)):
            await conn.chunk(piece)
        await conn.end_chunks()
        return True

    upstream = await RawUpstream().start()
    upstream.push(stream)
    body = {"model": "m", "max_tokens": 5, "messages": [], "stream": True}
    try:
        async with Served(tmp_path, {"base_url": upstream.url}) as served:
            before = await served.stats()
            reply, cut = await _post(served.url, MESSAGES, body)
            after = await served.stats()
    finally:
        await upstream.close()
    grown = after["peak_rss_mb"] - before["rss_mb"]
    piece = frames * (MiB // len(frames))
    assert reply.status == 200 and not cut
    assert reply.raw == piece * (total // len(piece))
    assert grown < 16, f"{grown:.0f} MB of RSS for a stream"


@pytest.mark.parametrize("path", [CHAT, RESPONSES])
async def test_a_200_mb_stream_event_fails_the_stream(tmp_path, path: str) -> None:
    offer = Offer(content_type="text/event-stream", first=b'data: {"id": "')  # and no line end, ever
    reply, cut, grown = await _exchange(tmp_path, offer, path, body_for(path, stream=True))
    assert not cut
    message = check_failed_stream(reply, path, url="127.0.0.1")
    assert "limits.max_reply_size" in message, message
    assert grown < RSS_BOUND_MB, f"{grown:.0f} MB of RSS for one stream"
    assert offer.sent < 100 * 1000 * 1000, f"gymproxy read {offer.sent} bytes of it"


async def test_a_responses_stream_is_held_to_the_reply_limit(tmp_path) -> None:
    """A Responses stream keeps all it says for its last events (its text twice, and the terminal
    events repeat it four times, some ten copies in all), so it keeps a sixteenth of
    `max_reply_size` at most: 200 MB of small valid events end it with `response.failed`, at the
    default limit, before it holds much (285 MB of RSS before that share)."""
    offer = Offer(content_type="text/event-stream", frames=delta_frames())
    body = body_for(RESPONSES, stream=True)
    reply, cut, grown = await _exchange(tmp_path, offer, RESPONSES, body)
    assert not cut
    message = check_failed_stream(reply, RESPONSES, url="127.0.0.1")
    assert "limits.max_reply_size" in message, message
    assert grown < RSS_BOUND_MB, f"{grown:.0f} MB of RSS for one stream"
    assert offer.sent < 100 * 1000 * 1000, f"gymproxy read {offer.sent} bytes of it"


async def test_replies_under_the_limits_pass_as_before(tmp_path) -> None:
    """The limits cut nothing they should not: a 2 MB reply and a 100 KB error body pass, with the
    limits set just above them."""
    big = {"id": "chatcmpl-raw", "object": "chat.completion", "created": 1, "model": "raw"}
    big["choices"] = [
        {"index": 0, "message": {"role": "assistant", "content": "a" * 2_000_000}, "finish_reason": "stop"}
    ]
    payload = orjson.dumps(big)
    error = orjson.dumps({"error": {"message": "b" * 100_000, "type": "BadRequestError", "param": None, "code": 400}})

    async def whole(conn: Conn, req: RawRequest) -> bool:
        await conn.head(200, length=len(payload))
        await conn.write(payload)
        return True

    async def refused(conn: Conn, req: RawRequest) -> bool:
        await conn.head(400)
        await conn.chunk(error)
        await conn.end_chunks()
        return True

    upstream = await RawUpstream().start()
    upstream.push(whole, refused)
    try:
        limits = {"max_reply_size": 2_100_000, "max_error_reply_size": 110_000}
        async with Served(tmp_path, {"base_url": upstream.url, "limits": limits}) as served:
            reply, _ = await _post(served.url, CHAT, body_for(CHAT))
            assert reply.status == 200 and reply.json()["choices"][0]["message"]["content"] == "a" * 2_000_000
            reply, _ = await _post(served.url, CHAT, body_for(CHAT))
            assert reply.status == 400 and "b" * 100_000 in _message(reply.raw), (reply.status, reply.raw[:300])
    finally:
        await upstream.close()
