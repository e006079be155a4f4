"""Where gymproxy's time goes inside the running server: each conversion stage, timed per call.

A micro-benchmark (bench_convert.py) times the stages alone, with warm caches. Inside a server
under load the same calls cost several times more, because the event loop, the sockets and 16
interleaved requests evict them from the CPU caches between calls. This launcher runs
`gymproxy serve` with a `perf_counter` around each stage call and writes a table when the server
stops, so the profile of a bench_proxy.py run says which stage costs what, per request and per
chunk. Use it as a variant (a wrapper adds ~0.4 µs of CPU a call: compare stages, not totals):

    python bench/bench_proxy.py --targets floor,gymproxy --scenario responses-stream \\
        --target-cpus 1 --variant "stages=python $PWD/bench/stages.py --out /tmp/stages.txt"

Every timed stage is synchronous, so on a CPU of its own its wall time is its CPU time; the
exception is the client write, which includes the send system call that the floor also makes.
"""

from __future__ import annotations

import argparse
import atexit
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web

import gymproxy.client_stream as client_stream
import gymproxy.convert.reply as reply
import gymproxy.convert.stream as stream
import gymproxy.exchange as exchange
import gymproxy.routes as routes
from gymproxy import cli
from gymproxy.convert.boundary import Boundary
from gymproxy.convert.request import RequestReader

_clock = time.perf_counter_ns


class Stage:
    """One timed stage; made in the order of the table, which lists every stage made."""

    __slots__ = ("name", "ns", "calls")

    def __init__(self, name: str) -> None:
        self.name = name
        self.ns = 0
        self.calls = 0
        STAGES.append(self)


STAGES: list[Stage] = []
REQUESTS: dict[str, int] = {"responses": 0, "chat_completions": 0}


def _timed(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    stage = Stage(name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = _clock()
        try:
            return function(*args, **kwargs)
        finally:
            stage.ns += _clock() - start
            stage.calls += 1

    return timed


def _timed_async(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    stage = Stage(name)

    async def timed(*args: Any, **kwargs: Any) -> Any:
        start = _clock()
        try:
            return await function(*args, **kwargs)
        finally:
            stage.ns += _clock() - start
            stage.calls += 1

    return timed


class _Method:
    """Stands in for a decoder or encoder object whose one method is timed."""

    def __init__(self, name: str, method: Callable[..., Any]) -> None:
        self.decode = self.encode = _timed(name, method)


def _counted(route: str, handler: Callable[..., Any]) -> Callable[..., Any]:
    async def counted(*args: Any, **kwargs: Any) -> Any:
        REQUESTS[route] += 1
        return await handler(*args, **kwargs)

    return counted


def install() -> None:
    """Wrap the stages of both routes (the route table binds routes at startup, after this)."""
    routes.responses = _counted("responses", routes.responses)
    routes.chat_completions = _counted("chat_completions", routes.chat_completions)
    routes.read_body = _timed_async("read the request body", routes.read_body)
    RequestReader.decode = _timed("decode the Responses request", RequestReader.decode)  # type: ignore[method-assign]
    routes.decode_chat = _timed("decode the chat request", routes.decode_chat)
    routes.to_chat_body = _timed("to_chat_body", routes.to_chat_body)
    Boundary.prepare = _timed("Boundary.prepare", Boundary.prepare)  # type: ignore[method-assign]
    exchange.ENCODER = _Method("encode (chat body, Response)", exchange.ENCODER.encode)  # type: ignore[assignment]
    reply.COMPLETION_DECODER = _Method("decode the chat completion", reply.COMPLETION_DECODER.decode)  # type: ignore[assignment]
    exchange.to_response = _timed("to_response", exchange.to_response)
    client_stream.Payloads.feed = _timed("stream: SSE decode", client_stream.Payloads.feed)  # type: ignore[method-assign]
    stream.CHUNK_DECODER = _Method("stream: decode a chunk", stream.CHUNK_DECODER.decode)  # type: ignore[assignment]
    rs = stream.ResponsesStream
    rs.start = _timed("stream: ResponsesStream.start", rs.start)  # type: ignore[method-assign]
    rs.feed = _timed("stream: ResponsesStream.feed", rs.feed)  # type: ignore[method-assign]
    rs.finish = _timed("stream: ResponsesStream.finish", rs.finish)  # type: ignore[method-assign]
    stream._CHUNK_CHECK = _Method("stream: check a chat chunk", stream._CHUNK_CHECK.decode)  # type: ignore[assignment]
    folder = stream.ChatReasoningFolder
    folder.needed = _timed("stream: ChatReasoningFolder.needed", folder.needed)  # type: ignore[method-assign]
    folder.fold = _timed("stream: ChatReasoningFolder.fold", folder.fold)  # type: ignore[method-assign]
    web.StreamResponse.write = _timed_async("stream: write to the client", web.StreamResponse.write)  # type: ignore[method-assign]


def report() -> str:
    lines = [
        f"gymproxy stages: {REQUESTS['responses']} /v1/responses and {REQUESTS['chat_completions']} "
        "/v1/chat/completions requests",
        f"  {'stage':38} {'calls':>9} {'µs/call':>9} {'total ms':>10}",
    ]
    for stage in STAGES:
        if stage.calls:
            lines.append(
                f"  {stage.name:38} {stage.calls:9d} {stage.ns / stage.calls / 1000:9.2f} {stage.ns / 1e6:10.1f}"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="write the table here when the server stops")
    args, rest = parser.parse_known_args(argv)
    install()
    atexit.register(lambda: args.out.write_text(report()))
    cli.main(rest)


if __name__ == "__main__":
    main(sys.argv[1:])
