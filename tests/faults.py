"""Shared helpers for the fault, hostile-input and load tests.

- `STATS` counts what those tests did (faults survived, hostile inputs tried, requests lost);
  `tests/test_load.py::test_zz_summary` prints it once at the end of the run.
- `RawUpstream` is a bare asyncio HTTP/1.1 server that misbehaves exactly as told, for the faults
  the fake vLLM cannot produce (resets at a chosen byte, bodies cut short, idle closes, ...).
- `TolerantUpstream` is an upstream that answers every request with a valid chat completion,
  whatever its body, so hostile-input tests see only gymproxy's own behaviour.
- `start_proxy` runs gymproxy in-process with `gymproxy.setup` and returns the `Proxy` object too;
  `send` and the `check_*` functions are the client side, each bounded in time.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import re
import resource
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

import gymproxy
from gymproxy import build_config

RESPONSES = "/v1/responses"
CHAT = "/v1/chat/completions"
PATHS = (RESPONSES, CHAT)
TERMINAL = ("response.completed", "response.failed", "response.incomplete")
ERROR_KEYS = {"message", "type", "param", "code"}
BOUND = 20.0  # seconds: a request taking longer than this is a hang

# --- the session summary -------------------------------------------------------------------------

STATS: collections.Counter[str] = collections.Counter(faults=0, hostile=0, lost=0)


def survived(n: int = 1) -> None:
    STATS["faults"] += n


def hostile(n: int = 1) -> None:
    STATS["hostile"] += n


def summary() -> str:
    return (
        f"faults survived: {STATS['faults']}, hostile inputs tried: {STATS['hostile']}, requests lost: {STATS['lost']}"
    )


@pytest.fixture(autouse=True)
def xfail_losses_do_not_count(request: pytest.FixtureRequest):
    """Autouse in the modules that import it: a known bug (an xfail test) is no lost request."""
    before = STATS["lost"]
    yield
    if request.node.get_closest_marker("xfail") is not None:
        STATS["lost"] = before


@contextlib.contextmanager
def counted_loss():
    """Count a failed check or a hang as a lost request, then let it fail the test."""
    try:
        yield
    except BaseException:
        STATS["lost"] += 1
        raise


# --- request bodies ------------------------------------------------------------------------------


def body_for(path: str, *, stream: bool = False, text: str = "hello") -> dict[str, Any]:
    if path == RESPONSES:
        body: dict[str, Any] = {"model": "m", "input": text}
    else:
        body = {"model": "m", "messages": [{"role": "user", "content": text}]}
    if stream:
        body["stream"] = True
    return body


# --- client side ---------------------------------------------------------------------------------


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    raw: bytes
    seconds: float

    def json(self) -> Any:
        return orjson.loads(self.raw)

    @property
    def is_stream(self) -> bool:
        return self.headers.get("Content-Type", "").startswith("text/event-stream")


async def send(
    url: str,
    path: str,
    body: bytes | dict[str, Any],
    *,
    headers: dict[str, str] | None = None,
    bound: float = BOUND,
    session: aiohttp.ClientSession | None = None,
) -> Reply:
    """POST and read the whole reply; a reply slower than `bound` is a hang (and a lost request)."""
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    hdrs = {"Content-Type": "application/json", **(headers or {})}

    async def go(s: aiohttp.ClientSession) -> Reply:
        started = time.monotonic()
        async with s.post(url + path, data=data, headers=hdrs) as r:
            raw = await r.read()
            return Reply(r.status, dict(r.headers), raw, time.monotonic() - started)

    async def run() -> Reply:
        if session is not None:
            return await go(session)
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as s:
            return await go(s)

    with counted_loss():
        try:
            return await asyncio.wait_for(run(), bound)
        except asyncio.TimeoutError:
            raise AssertionError(f"POST {path} hung for more than {bound} s") from None


def sse_data(raw: bytes) -> list[bytes]:
    """The `data:` payloads of an event stream (comments dropped)."""
    out = []
    for frame in raw.replace(b"\r\n", b"\n").split(b"\n\n"):
        lines = [line[5:].lstrip(b" ") for line in frame.split(b"\n") if line.startswith(b"data:")]
        if lines:
            out.append(b"\n".join(lines))
    return out


def stream_events(raw: bytes) -> list[dict[str, Any]]:
    return [orjson.loads(d) for d in sse_data(raw) if d != b"[DONE]"]


def check_error(reply: Reply, statuses: tuple[int, ...] | range, *, url: str | None = None) -> dict[str, Any]:
    """An OpenAI-style JSON error with one of `statuses`; `url` must appear in its message."""
    with counted_loss():
        assert reply.status in statuses, (reply.status, reply.raw[:500])
        assert reply.headers.get("Content-Type", "").startswith("application/json"), reply.headers
        error = reply.json()["error"]
        assert set(error) == ERROR_KEYS, error
        assert isinstance(error["message"], str) and error["message"], error
        assert isinstance(error["type"], str) and error["type"], error
        assert "Traceback" not in error["message"]
        if url is not None:
            assert url in error["message"], (url, error["message"])
        return error


def check_answer(reply: Reply, path: str, *, stream: bool, text: str | None = None) -> str:
    """A correct 200 answer (a whole JSON body, or a stream ending in its proper terminal event);
    returns the answer text, which must equal `text` when given."""
    with counted_loss():
        assert reply.status == 200, (reply.status, reply.raw[:500])
        if stream:
            assert reply.is_stream, reply.headers
            data = sse_data(reply.raw)
            if path == RESPONSES:
                events = [orjson.loads(d) for d in data]
                assert [e["sequence_number"] for e in events] == list(range(len(events)))
                assert events[-1]["type"] == "response.completed", events[-1]
                got = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
            else:
                assert data[-1] == b"[DONE]", data[-3:]
                chunks = [orjson.loads(d) for d in data[:-1]]
                assert not any("error" in c for c in chunks), chunks
                got = "".join((c["choices"][0]["delta"].get("content") or "") for c in chunks if c.get("choices"))
        else:
            body = reply.json()
            if path == RESPONSES:
                assert body["status"] == "completed", body
                got = "".join(
                    part["text"]
                    for item in body["output"]
                    if item["type"] == "message"
                    for part in item["content"]
                    if part["type"] == "output_text"
                )
            else:
                got = body["choices"][0]["message"]["content"]
        if text is not None:
            assert got == text, (got, text)
        return got


def check_failed_stream(reply: Reply, path: str, *, url: str | None = None) -> str:
    """A stream that started (200) and then ended with a failure: `response.failed`, or an
    `error` chunk followed by `data: [DONE]`. Returns the failure message."""
    with counted_loss():
        assert reply.status == 200, (reply.status, reply.raw[:500])
        assert reply.is_stream, reply.headers
        data = sse_data(reply.raw)
        if path == RESPONSES:
            events = [orjson.loads(d) for d in data]
            assert [e["sequence_number"] for e in events] == list(range(len(events)))
            assert events[0]["type"] == "response.created"
            last = events[-1]
            assert last["type"] == "response.failed", last
            assert sum(e["type"] in TERMINAL for e in events) == 1
            error = last["response"]["error"]
            message = error["message"]
        else:
            assert data[-1] == b"[DONE]", data[-3:]
            last = orjson.loads(data[-2])
            assert set(last["error"]) == ERROR_KEYS, last
            message = last["error"]["message"]
        if url is not None:
            assert url in message, (url, message)
        return message


def check_error_or_failed_stream(reply: Reply, path: str, *, stream: bool, url: str | None, statuses=(502, 504)) -> str:
    """A fault may surface before the stream starts (a JSON error) or after (a failed stream)."""
    if stream and reply.status == 200:
        return check_failed_stream(reply, path, url=url)
    return check_error(reply, statuses, url=url)["message"]


# --- gymproxy in-process -------------------------------------------------------------------------


async def start_proxy(aiohttp_server: Any, base_url: str | list[str], **config: Any) -> tuple[str, Any]:
    """gymproxy mounted with `gymproxy.setup` on a real port: (root URL, Proxy)."""
    cfg = build_config({"base_url": base_url, **config}, environ={})
    app = web.Application(client_max_size=cfg.max_body_size)
    proxy = gymproxy.setup(app, cfg)
    server = await aiohttp_server(app)
    return str(server.make_url("")).rstrip("/"), proxy


def acquired(proxy: Any) -> int:
    """Upstream connections the proxy's client has lent to requests in flight."""
    return int(proxy.fleet.client.in_use)


async def eventually(predicate: Callable[[], bool], seconds: float = 5.0, step: float = 0.02) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(step)
    return predicate()


def enough_files(needed: int) -> None:
    """Raise this process's open-file limit to `needed` (to its hard limit), or skip the test."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < needed:
        pytest.skip(f"needs {needed} open files; the hard limit here is {hard}")
    if soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed if hard == resource.RLIM_INFINITY else hard, hard))


def connecting_to(port: int) -> int | None:
    """TCP connections to loopback `port` still opening (SYN sent, no answer yet), from any process
    here (Linux's /proc/net/tcp); None where that cannot be read."""
    try:
        lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return None
    state_syn_sent = "02"
    return sum(1 for line in lines if (f := line.split())[3] == state_syn_sent and int(f[2].split(":")[1], 16) == port)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- chat replies, for the upstreams written here -----------------------------------------------


def completion(text: str, model: str = "raw") -> bytes:
    return orjson.dumps(
        {
            "id": "chatcmpl-raw",
            "object": "chat.completion",
            "created": 1,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
        }
    )


def chunk_frames(text: str, model: str = "raw") -> list[bytes]:
    """vLLM-shaped SSE frames for `text`, one per word, ending with usage and `[DONE]`."""
    base = {"id": "chatcmpl-raw", "object": "chat.completion.chunk", "created": 1, "model": model}

    def frame(choices: list[Any], **extra: Any) -> bytes:
        return b"data: " + orjson.dumps({**base, "choices": choices, **extra}) + b"\n\n"

    def choice(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

    words = re.findall(r"\s*\S+", text) or [text]
    frames = [frame([choice({"role": "assistant", "content": ""})])]
    frames += [frame([choice({"content": w})]) for w in words]
    frames.append(frame([choice({}, "stop")]))
    frames.append(
        frame([], usage={"prompt_tokens": 1, "completion_tokens": len(words), "total_tokens": 1 + len(words)})
    )
    frames.append(b"data: [DONE]\n\n")
    return frames


ANSWER = "fine thanks and you"


# --- a raw HTTP/1.1 upstream ---------------------------------------------------------------------


@dataclass
class RawRequest:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    connection: int  # which accepted connection carried it
    reused: bool  # not the first request on its connection
    idle_before: float = 0.0  # seconds the connection sat idle before this request

    @property
    def json(self) -> Any:
        try:
            return orjson.loads(self.body)
        except orjson.JSONDecodeError:
            return None

    @property
    def stream(self) -> bool:
        body = self.json
        return isinstance(body, dict) and body.get("stream") is True


class Conn:
    """One accepted connection: its streams, and the helpers a behaviour writes with."""

    def __init__(
        self, owner: RawUpstream, index: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.owner = owner
        self.index = index
        self.reader = reader
        self.writer = writer
        self.served = 0
        self.last_active = time.monotonic()

    async def write(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def head(
        self, status: int = 200, content_type: str = "application/json", length: int | None = None, **extra: str
    ) -> None:
        reason = {200: "OK", 500: "Internal Server Error", 502: "Bad Gateway", 503: "Service Unavailable"}.get(
            status, "X"
        )
        lines = [f"HTTP/1.1 {status} {reason}", f"Content-Type: {content_type}"]
        lines.append(f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked")
        lines += [f"{k.replace('_', '-')}: {v}" for k, v in extra.items()]
        await self.write(("\r\n".join(lines) + "\r\n\r\n").encode())

    async def chunk(self, data: bytes) -> None:
        await self.write(b"%x\r\n%s\r\n" % (len(data), data))

    async def end_chunks(self) -> None:
        await self.write(b"0\r\n\r\n")

    def reset(self) -> None:
        """Drop the connection with a TCP RST (SO_LINGER 0), not a FIN."""
        sock = self.writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.writer.transport.abort()

    async def settle(self, seconds: float = 0.1) -> None:
        """Give the peer time to read what was sent before the connection is cut."""
        await asyncio.sleep(seconds)

    async def wait_closed_by_peer(self) -> None:
        """Block until the peer closes the connection (a hanging upstream)."""
        with contextlib.suppress(ConnectionError, OSError):
            while await self.reader.read(65536):
                pass
        self.owner.peer_closes += 1


# A behaviour answers one request; it returns True to keep the connection for the next request.
Behaviour = Callable[[Conn, RawRequest], Awaitable[bool]]


async def good(conn: Conn, req: RawRequest) -> bool:
    """A correct answer: an event stream when one was asked for, else a JSON completion."""
    if req.stream:
        await conn.head(200, "text/event-stream")
        for frame in chunk_frames(ANSWER):
            await conn.chunk(frame)
        await conn.end_chunks()
    else:
        body = completion(ANSWER)
        await conn.head(200, length=len(body))
        await conn.write(body)
    return True


async def meta(conn: Conn, req: RawRequest) -> bool:
    """`/v1/models` and `/health`: always answered, so queued faults hit generations only."""
    body = b'{"object": "list", "data": [{"id": "raw", "object": "model"}]}' if req.path.endswith("/models") else b"{}"
    await conn.head(200, length=len(body))
    await conn.write(body)
    return True


async def reset_before_status(conn: Conn, req: RawRequest) -> bool:
    conn.reset()
    return False


async def close_before_status(conn: Conn, req: RawRequest) -> bool:
    """The whole request read, then a FIN and no reply (a server that drops what it cannot take)."""
    conn.writer.close()
    return False


def dies(how: str = "reset") -> Behaviour:
    """The upstream's process dies with the request read: its listener goes (a new connection is
    refused), then its connections end as the kernel ends a killed process's: `reset` (RST, when
    unread bytes were left) or `close` (FIN)."""

    async def behave(conn: Conn, req: RawRequest) -> bool:
        conn.owner.stop_listening()
        if how == "reset":
            conn.reset()
        else:
            conn.writer.close()
        return False

    return behave


def only_if(word: bytes, behaviour: Behaviour, otherwise: Behaviour = good) -> Behaviour:
    """`behaviour` for a request whose body holds `word` (a query of death), `otherwise` for the rest."""

    async def behave(conn: Conn, req: RawRequest) -> bool:
        return await (behaviour if word in req.body else otherwise)(conn, req)

    return behave


async def reset_mid_body(conn: Conn, req: RawRequest) -> bool:
    body = completion(ANSWER)
    await conn.head(200, length=len(body) + 100)
    await conn.write(body[: len(body) // 2])
    await conn.settle()
    conn.reset()
    return False


async def cut_short(conn: Conn, req: RawRequest) -> bool:
    """Content-Length promises more than is sent; then a clean close (FIN)."""
    body = completion(ANSWER)
    await conn.head(200, length=len(body) + 100)
    await conn.write(body[: len(body) // 2])
    await conn.settle()
    conn.writer.close()
    return False


def stream_then(ending: str) -> Behaviour:
    """Half an event stream (chunked), then: `reset` (RST), `cut` (FIN inside the chunked body),
    `eof` (a close-delimited body ending cleanly but without `[DONE]`) or `stall` (silence)."""

    async def behave(conn: Conn, req: RawRequest) -> bool:
        frames = chunk_frames(ANSWER)
        half = frames[: len(frames) // 2]
        if ending == "eof":
            await conn.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
            await conn.write(b"".join(half))
            await conn.settle()
            conn.writer.close()
            return False
        await conn.head(200, "text/event-stream")
        for frame in half:
            await conn.chunk(frame)
        await conn.settle()
        if ending == "reset":
            conn.reset()
        elif ending == "cut":
            conn.writer.close()
        else:
            await conn.wait_closed_by_peer()
        return False

    return behave


def fixed(status: int, body: bytes, content_type: str = "application/json") -> Behaviour:
    """Whatever the request asked for, this status, body and content type."""

    async def behave(conn: Conn, req: RawRequest) -> bool:
        await conn.head(status, content_type, length=len(body))
        await conn.write(body)
        return True

    return behave


async def hang(conn: Conn, req: RawRequest) -> bool:
    await conn.wait_closed_by_peer()
    return False


def trickle(every: float = 0.1, pieces: int = 12) -> Behaviour:
    """A correct answer sent in `pieces` bits, one every `every` seconds."""

    async def behave(conn: Conn, req: RawRequest) -> bool:
        if req.stream:
            data = b"".join(chunk_frames(ANSWER))
            await conn.head(200, "text/event-stream")
        else:
            data = completion(ANSWER)
            await conn.head(200, length=len(data))
        size = -(-len(data) // pieces)
        for i in range(0, len(data), size):
            await asyncio.sleep(every)
            await (conn.chunk(data[i : i + size]) if req.stream else conn.write(data[i : i + size]))
        if req.stream:
            await conn.end_chunks()
        return True

    return behave


def close_if_idle(idle: float) -> Behaviour:
    """The keep-alive race: a request arriving on a connection that sat idle longer than `idle`
    meets the server's idle close (no reply, FIN). Fresh or recently used connections are answered."""

    async def behave(conn: Conn, req: RawRequest) -> bool:
        if req.reused and req.idle_before > idle:
            conn.writer.close()
            return False
        return await good(conn, req)

    return behave


class RawUpstream:
    """An HTTP/1.1 server on a real port that answers each request with the next queued behaviour
    (`good` when the queue is empty). `idle_close` closes connections idle that long, as uvicorn does."""

    def __init__(
        self,
        *,
        idle_close: float | None = None,
        default: Behaviour = good,
        health_delay: float = 0.0,
        health: Behaviour = meta,
        queued: tuple[str, ...] = ("/v1/chat/completions", "/v1/messages"),
    ) -> None:
        self.idle_close = idle_close
        self.queued = queued  # the paths the queued behaviours answer (any other: `meta`)
        self.health_delay = health_delay  # seconds /health takes to answer (a loaded server)
        self.health = health  # how /health is answered (can be changed while it runs)
        self.default = default
        self.queue: collections.deque[Behaviour] = collections.deque()
        self.requests: list[RawRequest] = []
        self.connections = 0
        self.peer_closes = 0  # connections the proxy closed while a hanging behaviour waited
        self.idle_closes = 0
        self._conns: set[Conn] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._server: asyncio.AbstractServer | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def push(self, *behaviours: Behaviour) -> None:
        self.queue.extend(behaviours)

    def generations(self) -> int:
        return sum(1 for r in self.requests if r.path.startswith("/v1/chat/completions"))

    async def start(self, port: int = 0) -> RawUpstream:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def stop_listening(self) -> None:
        """Close the listener (new connections are refused); the accepted ones stay as they are."""
        if self._server is not None:
            self._server.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self._conns):
            conn.writer.transport.abort()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.connections += 1
        conn = Conn(self, self.connections, reader, writer)
        self._conns.add(conn)
        try:
            while True:
                req = await self._read_request(conn)
                if req is None:
                    break
                self.requests.append(req)
                if not req.path.startswith(self.queued):  # the probe, health checks
                    behaviour: Behaviour = meta
                    if req.path.endswith("/health"):
                        await asyncio.sleep(self.health_delay)
                        behaviour = self.health
                else:
                    behaviour = self.queue.popleft() if self.queue else self.default
                keep = await behaviour(conn, req)
                conn.served += 1
                conn.last_active = time.monotonic()
                if not keep:
                    break
        except (ConnectionError, OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        except asyncio.CancelledError:
            pass  # close(): end quietly (asyncio logs a start_server callback task that ends cancelled)
        finally:
            self._conns.discard(conn)
            self._tasks.discard(task)
            if writer.transport.is_closing():
                writer.transport.abort()
            else:
                writer.close()

    async def _read_request(self, conn: Conn) -> RawRequest | None:
        reader = conn.reader
        try:
            if self.idle_close is not None and conn.served:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.idle_close)
            else:
                head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.TimeoutError:
            self.idle_closes += 1
            return None
        except asyncio.IncompleteReadError:
            return None
        idle_before = time.monotonic() - conn.last_active
        lines = head.decode("latin-1").split("\r\n")
        method, target, _ = lines[0].split(" ", 2)
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().title()] = value.strip()
        if "Content-Length" in headers:
            body = await reader.readexactly(int(headers["Content-Length"]))
        elif headers.get("Transfer-Encoding", "").lower() == "chunked":
            parts = []
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                parts.append(await reader.readexactly(size + 2))
                if size == 0:
                    break
            body = b"".join(p[:-2] for p in parts)
        else:
            body = b""
        return RawRequest(method, target, headers, body, conn.index, conn.served > 0, idle_before)


# --- an upstream that accepts anything -----------------------------------------------------------


@dataclass
class Seen:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes


@dataclass
class TolerantUpstream:
    """Records every request and answers any generation request with a valid chat completion
    (a stream when `"stream": true`), so only gymproxy can be the cause of a bad reply."""

    requests: list[Seen] = field(default_factory=list)
    app: web.Application = field(init=False)

    def __post_init__(self) -> None:
        self.app = web.Application(client_max_size=256 * 1024**2)
        self.app.router.add_route("*", "/{tail:.*}", self._any)

    async def _any(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.requests.append(Seen(request.method, request.path, request.query_string, dict(request.headers), raw))
        if request.path.endswith("/models"):
            return web.json_response({"object": "list", "data": [{"id": "tolerant", "object": "model"}]})
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        if isinstance(body, dict) and body.get("stream") is True:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await response.write(b"".join(chunk_frames(ANSWER)))
            await response.write_eof()
            return response
        return web.Response(body=completion(ANSWER), content_type="application/json")
