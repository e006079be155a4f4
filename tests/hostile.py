"""The running stack and the client side of the hostile-input tests (test_hostile_bodies.py,
test_hostile_http.py): every reply is a 4xx OpenAI-style JSON error, or a 200 where the request
is valid: never a 5xx, never a dropped connection, never a hang. Header-level garbage may get
aiohttp's own 400/431.

gymproxy (`create_app`, run as `gymproxy serve` runs it: its event loop, `handler_cancellation`)
and its upstream run on their own event loop in a thread, so the property-based tests are plain
synchronous hypothesis tests talking over real sockets. The upstream is `faults.TolerantUpstream`,
which answers anything, so only gymproxy can cause a bad reply. A sentinel listener stands for
"anywhere else": it must never see a connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import http.client
import os
import socket
import threading
from collections.abc import Iterator
from typing import Any

import orjson
from aiohttp import web
from hypothesis import HealthCheck, settings

import gymproxy
from gymproxy.server import new_loop

from .faults import (
    CHAT,
    ERROR_KEYS,
    PATHS,
    RESPONSES,
    STATS,
    TERMINAL,
    TolerantUpstream,
    hostile,
    sse_data,
)

MAX_BODY = 8 * 1024 * 1024
TIMEOUT = 30.0  # seconds for one exchange: more is a hang
ALLOWED_UPSTREAM_PATHS = {"/v1/chat/completions", "/v1/models", "/v1/completions", "/tokenize", "/health"}

HYPOTHESIS = settings(
    max_examples=int(os.environ.get("GYMPROXY_HOSTILE_EXAMPLES", "150")),
    deadline=None,
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
        HealthCheck.filter_too_much,
        HealthCheck.function_scoped_fixture,  # only the autouse xfail bookkeeping
    ],
)


# --- the running stack ---------------------------------------------------------------------------


class Stack:
    """gymproxy in front of a TolerantUpstream, plus a sentinel, on an event loop in a thread."""

    def __init__(self, **config: Any) -> None:
        self.config = config
        self.upstream = TolerantUpstream()
        self.sentinel_hits = 0
        self.proxy_port = self.upstream_port = self.sentinel_port = 0
        self._ready = threading.Event()
        self._failed: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="hostile-stack", daemon=True)

    def __enter__(self) -> Stack:
        self._thread.start()
        if not self._ready.wait(30) or self._failed is not None:
            raise RuntimeError(f"the hostile-input stack did not start: {self._failed!r}")
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    def _run(self) -> None:
        loop = new_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        try:
            loop.run_until_complete(self._main())
        except BaseException as exc:  # noqa: BLE001 - reported to the main thread
            self._failed = exc
            self._ready.set()
        finally:
            pending = asyncio.all_tasks(loop)  # e.g. connections aiohttp still lingers on
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            asyncio.set_event_loop(None)
            loop.close()

    async def _sentinel(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.sentinel_hits += 1
        writer.close()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        upstream = web.AppRunner(self.upstream.app, access_log=None)
        await upstream.setup()
        await web.TCPSite(upstream, "127.0.0.1", 0).start()
        self.upstream_port = upstream.addresses[0][1]
        sentinel = await asyncio.start_server(self._sentinel, "127.0.0.1", 0)
        self.sentinel_port = sentinel.sockets[0].getsockname()[1]
        config = gymproxy.build_config(
            {"base_url": f"http://127.0.0.1:{self.upstream_port}/v1", "max_body_size": MAX_BODY, **self.config},
            environ={},
        )
        proxy = web.AppRunner(gymproxy.create_app(config), access_log=None, handler_cancellation=True)
        await proxy.setup()
        await web.TCPSite(proxy, "127.0.0.1", 0).start()
        self.proxy_port = proxy.addresses[0][1]
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await proxy.cleanup()
            await upstream.cleanup()
            sentinel.close()
            await sentinel.wait_closed()


def running_stack() -> Iterator[Stack]:
    """What a test module's `stack` fixture yields: one Stack for the module, checked at its end."""
    with Stack() as running:
        yield running
        # Nothing ever went anywhere but the configured upstream, and only to the routes it serves.
        assert running.sentinel_hits == 0
        seen = running.upstream.requests
        assert {r.path for r in seen} <= ALLOWED_UPSTREAM_PATHS, {r.path for r in seen}
        assert {r.headers.get("Host") for r in seen} == {f"127.0.0.1:{running.upstream_port}"}


# --- clients -------------------------------------------------------------------------------------


def post(
    stack: Stack, path: str, body: bytes, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    """One POST over a fresh connection; a hang fails the test."""
    conn = http.client.HTTPConnection("127.0.0.1", stack.proxy_port, timeout=TIMEOUT)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        reply = conn.getresponse()
        return reply.status, dict(reply.getheaders()), reply.read()
    except TimeoutError:
        STATS["lost"] += 1
        raise
    finally:
        conn.close()


def exchange(
    stack: Stack, data: bytes, *, port: int | None = None, until_eof: bool = False
) -> tuple[int | None, dict[str, str], bytes]:
    """Send raw bytes (the request should say `Connection: close`) and read one reply (or, with
    `until_eof`, everything until the server closes).

    Returns (status or None if the connection closed without a reply, headers, body)."""
    chunks: list[bytes] = []
    with socket.create_connection(("127.0.0.1", port or stack.proxy_port), timeout=TIMEOUT) as sock:
        try:
            sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # it answered (and closed) before reading everything: read what it said
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
                if not until_eof and _complete(b"".join(chunks)):
                    # The reply is whole. Wait briefly for the close: aiohttp may log after
                    # replying, and traceback formatting in that thread races with pytest's
                    # own use of `ast` here (CPython 3.11 keeps AST recursion state per module).
                    # It may also linger for 10 s reading a body it refused: don't wait for that.
                    sock.settimeout(0.5)
                    with contextlib.suppress(TimeoutError, socket.timeout, ConnectionResetError):
                        while sock.recv(65536):
                            pass
                    break
        except ConnectionResetError:
            pass
        except TimeoutError:
            STATS["lost"] += 1
            raise
    raw = b"".join(chunks)
    if not raw.startswith(b"HTTP/1."):
        return None, {}, raw
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().title()] = value.strip()
    if headers.get("Transfer-Encoding", "").lower() == "chunked":
        body = _dechunk(body)
    return int(lines[0].split(" ")[1]), headers, body


def _complete(raw: bytes) -> bool:
    """One whole HTTP response is in `raw`."""
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not sep:
        return False
    lowered = head.lower()
    if b"\r\ncontent-length:" in lowered:
        length = int(lowered.split(b"\r\ncontent-length:")[1].split(b"\r\n")[0])
        return len(body) >= length
    if b"\r\ntransfer-encoding: chunked" in lowered:
        return body.endswith(b"0\r\n\r\n")
    return False


def _dechunk(data: bytes) -> bytes:
    out = []
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out.append(data[:size])
        data = data[size + 2 :]
    return b"".join(out)


def request_bytes(
    method: str,
    target: str,
    body: bytes = b"",
    headers: list[tuple[str, str]] | None = None,
    *,
    host: str = "127.0.0.1",
    length: int | None = None,
) -> bytes:
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host}", "Connection: close", "Content-Type: application/json"]
    lines += [f"{k}: {v}" for k, v in headers or []]
    lines.append(f"Content-Length: {len(body) if length is None else length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


# --- what a reply must look like -----------------------------------------------------------------


def check(status: int | None, headers: dict[str, str], raw: bytes, path: str) -> None:
    """200 with a whole answer, or a 4xx OpenAI-style JSON error. Never a 5xx."""
    hostile()
    try:
        assert status is not None, f"the connection closed without a reply: {raw[:200]!r}"
        assert status < 500, (status, raw[:500])
        content_type = headers.get("Content-Type", "")
        if status == 200:
            if content_type.startswith("text/event-stream"):
                data = sse_data(raw)
                if path == RESPONSES:
                    assert orjson.loads(data[-1])["type"] in TERMINAL
                else:
                    assert data[-1] == b"[DONE]"
            else:
                body = orjson.loads(raw)
                assert body["object"] == ("response" if path == RESPONSES else "chat.completion"), body
        else:
            assert 400 <= status < 500, status
            assert content_type.startswith("application/json"), (status, content_type, raw[:200])
            error = orjson.loads(raw)["error"]
            assert set(error) == ERROR_KEYS, error
            assert isinstance(error["message"], str) and error["message"]
            assert "Traceback" not in error["message"]
    except BaseException:
        STATS["lost"] += 1
        raise


def check_plain_4xx(status: int | None, raw: bytes, allowed: tuple[int, ...] = (400, 431)) -> None:
    """Garbage below HTTP: aiohttp's own refusal (not JSON, gymproxy never saw a request)."""
    hostile()
    try:
        assert status in allowed, (status, raw[:300])
    except BaseException:
        STATS["lost"] += 1
        raise


def still_serves(stack: Stack) -> None:
    for path in PATHS:
        status, headers, raw = post(stack, path, orjson.dumps(VALID[path]))
        assert status == 200, (status, raw[:300])
        check(status, headers, raw, path)


# --- valid requests with every field set ---------------------------------------------------------

VALID_RESPONSES: dict[str, Any] = {
    "model": "m",
    "input": [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "look"},
                {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "low"},
            ],
        },
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "think"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "calling"}]},
        {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        {"role": "user", "content": "again"},
    ],
    "instructions": "answer",
    "max_output_tokens": 32,
    "metadata": {"run": "7"},
    "temperature": 0.5,
    "top_p": 0.9,
    "parallel_tool_calls": True,
    "tool_choice": "auto",
    "tools": [{"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"}, "strict": False}],
    "reasoning": {"effort": "low"},
    "text": {"format": {"type": "text"}},
    "user": "agent",
    "store": False,
    "stream": False,
}
VALID_CHAT: dict[str, Any] = {
    "model": "m",
    "messages": [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "look"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            ],
        },
        {
            "role": "assistant",
            "content": "<think>hmm</think>calling",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        {"role": "user", "content": "again"},
    ],
    "temperature": 0.5,
    "max_tokens": 32,
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "tool_choice": "auto",
    "metadata": {"run": "7"},
    "top_k": 5,
    "n": 1,
    "stream": False,
    "stream_options": {"include_usage": True},
    "chat_template_kwargs": {"enable_thinking": False},
    "user": "agent",
}
VALID = {RESPONSES: VALID_RESPONSES, CHAT: VALID_CHAT}


def paths_of(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every location in a JSON value, the root excluded."""
    out = []
    if isinstance(value, dict):
        for key, child in value.items():
            out.append((*prefix, key))
            out += paths_of(child, (*prefix, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            out.append((*prefix, index))
            out += paths_of(child, (*prefix, index))
    return out


def replaced(body: dict[str, Any], where: tuple[Any, ...], value: Any, *, delete: bool = False) -> dict[str, Any]:
    body = copy.deepcopy(body)
    node = body
    for step in where[:-1]:
        node = node[step]
    if delete:
        del node[where[-1]]
    else:
        node[where[-1]] = value
    return body


WRONG = [None, True, 0, -1, 2**70, 1.5, float("inf"), "", "x", [], [1, "a"], {}, {"k": [None]}]


def kind_of(value: Any) -> str:
    return "number" if isinstance(value, (int, float)) and not isinstance(value, bool) else type(value).__name__
