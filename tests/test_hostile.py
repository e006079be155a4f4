"""Hostile input at both endpoints of a running gymproxy: random JSON and bytes, wrong types at
every field, deep nesting, huge strings, invalid UTF-8, oversized bodies, broken headers, and
requests that try to make gymproxy talk to anything but its configured upstream.

Every reply is a 4xx OpenAI-style JSON error, or a 200 where the request is valid: never a 5xx,
never a dropped connection, never a hang. Header-level garbage may get aiohttp's own 400/431.

gymproxy (`create_app`, as `gymproxy serve` runs it) and its upstream run on their own event
loop in a thread, so the property-based tests are plain synchronous hypothesis tests talking
over real sockets. The upstream is `faults.TolerantUpstream`, which answers anything, so only
gymproxy can cause a bad reply. A sentinel listener stands for "anywhere else": it must never
see a connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import gzip
import http.client
import json
import os
import socket
import threading
import zlib
from typing import Any

import orjson
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gymproxy

from .faults import (  # noqa: F401 - xfail_losses_do_not_count is autouse
    ANSWER,
    CHAT,
    ERROR_KEYS,
    PATHS,
    RESPONSES,
    STATS,
    TERMINAL,
    TolerantUpstream,
    hostile,
    sse_data,
    xfail_losses_do_not_count,
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
        loop = asyncio.new_event_loop()
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
        proxy = web.AppRunner(gymproxy.create_app(config), access_log=None)
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


@pytest.fixture(scope="module")
def stack():
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


def _kind(value: Any) -> str:
    return "number" if isinstance(value, (int, float)) and not isinstance(value, bool) else type(value).__name__


def test_valid_requests_are_answered(stack):
    for stream in (False, True):
        for path in PATHS:
            status, headers, raw = post(stack, path, orjson.dumps({**VALID[path], "stream": stream}))
            assert status == 200, raw[:500]
            check(status, headers, raw, path)


@pytest.mark.parametrize("path", PATHS, ids=["responses", "chat"])
def test_wrong_type_at_every_field(stack, path):
    """Each location of a valid request, set in turn to every JSON type it does not have, and deleted."""
    valid = VALID[path]
    tried = 0
    for where in paths_of(valid):
        current = valid
        for step in where:
            current = current[step]
        for value in WRONG:
            if _kind(value) == _kind(current):
                continue
            body = replaced(valid, where, value)
            raw = json.dumps(body, allow_nan=True).encode()  # inf goes out as the non-JSON token Infinity
            check(*post(stack, path, raw), path)
            tried += 1
        check(*post(stack, path, orjson.dumps(replaced(valid, where, None, delete=True))), path)
    assert tried > 100
    still_serves(stack)


# --- property-based -------------------------------------------------------------------------------

scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


def _encode(value: Any) -> bytes:
    return json.dumps(value, allow_nan=True).encode("utf-8", "surrogatepass")  # lone surrogates: invalid UTF-8


@HYPOTHESIS
@given(path=st.sampled_from(PATHS), value=json_values)
def test_random_json_values(stack, path, value):
    check(*post(stack, path, _encode(value)), path)


@HYPOTHESIS
@given(path=st.sampled_from(PATHS), data=st.binary(max_size=512))
def test_random_bytes(stack, path, data):
    check(*post(stack, path, data), path)


def _parts(kinds: list[str], text_keys: list[str]):
    optional = {key: st.text(max_size=12) | json_values for key in text_keys}
    return st.fixed_dictionaries({"type": st.sampled_from(kinds) | json_values}, optional=optional)


RESPONSES_ITEM = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(
            ["message", "reasoning", "function_call", "function_call_output", "custom_tool_call", "x"]
        ),
        "role": st.sampled_from(["user", "assistant", "system", "developer", "tool"]) | json_values,
        "content": st.text(max_size=30)
        | st.lists(
            _parts(["input_text", "output_text", "input_image", "refusal"], ["text", "image_url", "detail"]), max_size=3
        )
        | json_values,
        "summary": st.lists(_parts(["summary_text"], ["text"]), max_size=2) | json_values,
        "call_id": st.text(max_size=8) | json_values,
        "name": st.text(max_size=8) | json_values,
        "arguments": st.text(max_size=20) | json_values,
        "output": st.text(max_size=20) | json_values,
        "id": st.text(max_size=8) | json_values,
        "tool_calls": json_values,
    },
)
RESPONSES_BODY = st.fixed_dictionaries(
    {"input": st.text(max_size=30) | st.lists(RESPONSES_ITEM, max_size=5)},
    optional={
        "model": st.text(max_size=10) | json_values,
        "instructions": st.text(max_size=10) | json_values,
        "stream": st.booleans() | json_values,
        "tools": st.lists(
            st.fixed_dictionaries(
                {"type": st.sampled_from(["function", "custom"]), "name": st.text(max_size=6)},
                optional={"parameters": json_values, "strict": json_values},
            ),
            max_size=2,
        )
        | json_values,
        "tool_choice": st.sampled_from(["auto", "none", "required"]) | json_values,
        "max_output_tokens": st.integers() | json_values,
        "temperature": st.floats() | json_values,
        "metadata": st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3) | json_values,
        "reasoning": st.fixed_dictionaries({}, optional={"effort": st.text(max_size=6), "summary": st.text(max_size=6)})
        | json_values,
        "text": json_values,
        "user": st.text(max_size=8) | json_values,
    },
)
CHAT_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "developer", "tool"]) | st.text(max_size=6)},
    optional={
        "content": st.text(max_size=30)
        | st.lists(_parts(["text", "image_url", "input_audio"], ["text", "image_url"]), max_size=3)
        | json_values,
        "tool_calls": st.lists(
            st.fixed_dictionaries(
                {},
                optional={
                    "id": json_values,
                    "type": json_values,
                    "function": st.fixed_dictionaries({}, optional={"name": json_values, "arguments": json_values})
                    | json_values,
                },
            ),
            max_size=2,
        )
        | json_values,
        "tool_call_id": st.text(max_size=6) | json_values,
        "reasoning_content": st.text(max_size=10) | json_values,
        "reasoning": st.text(max_size=10) | json_values,
        "name": json_values,
    },
)
CHAT_BODY = st.fixed_dictionaries(
    {"messages": st.lists(CHAT_MESSAGE, max_size=5) | json_values},
    optional={
        "model": st.text(max_size=10) | json_values,
        "stream": st.booleans() | json_values,
        "n": st.integers() | json_values,
        "tools": json_values,
        "metadata": st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3) | json_values,
        "chat_template_kwargs": json_values,
        "stream_options": json_values,
        "continue_final_message": st.booleans() | json_values,
        "max_tokens": json_values,
    },
)


@HYPOTHESIS
@given(body=RESPONSES_BODY)
def test_random_responses_requests(stack, body):
    check(*post(stack, RESPONSES, _encode(body)), RESPONSES)


@HYPOTHESIS
@given(body=CHAT_BODY)
def test_random_chat_requests(stack, body):
    check(*post(stack, CHAT, _encode(body)), CHAT)


@HYPOTHESIS
@given(path=st.sampled_from(PATHS), data=st.data(), stream=st.booleans())
def test_random_value_at_a_random_field(stack, path, data, stream):
    valid = {**VALID[path], "stream": stream}
    where = data.draw(st.sampled_from(paths_of(valid)), label="where")
    body = replaced(valid, where, data.draw(json_values, label="value"))
    check(*post(stack, path, _encode(body)), path)


# --- deep, huge, broken ---------------------------------------------------------------------------

DEPTH = 10_000
DEEP_ARRAY = b"[" * DEPTH + b"]" * DEPTH
DEEP_OBJECT = b'{"a":' * DEPTH + b"1" + b"}" * DEPTH


def _inside(body: dict[str, Any], where: tuple[Any, ...], nested: bytes) -> bytes:
    marker = "__NESTED__"
    return orjson.dumps(replaced(body, where, marker)).replace(b'"__NESTED__"', nested)


DEEP_CASES = [
    pytest.param(RESPONSES, DEEP_ARRAY, id="responses-root-array"),
    pytest.param(RESPONSES, DEEP_OBJECT, id="responses-root-object"),
    pytest.param(RESPONSES, _inside(VALID_RESPONSES, ("input",), DEEP_ARRAY), id="responses-input"),
    pytest.param(RESPONSES, _inside(VALID_RESPONSES, ("metadata",), DEEP_OBJECT), id="responses-metadata"),
    pytest.param(
        RESPONSES,
        _inside(VALID_RESPONSES, ("tools", 0, "parameters"), DEEP_OBJECT),
        id="responses-tool-parameters",
    ),
    pytest.param(RESPONSES, _inside(VALID_RESPONSES, ("input", 1, "content"), DEEP_ARRAY), id="responses-content"),
    pytest.param(RESPONSES, _inside(VALID_RESPONSES, ("moderation",), DEEP_ARRAY), id="responses-moderation"),
    pytest.param(
        RESPONSES,
        _inside(VALID_RESPONSES, ("input", 0, "phase"), DEEP_OBJECT),
        id="responses-item-phase",
    ),
    pytest.param(
        RESPONSES,
        _inside(VALID_RESPONSES, ("reasoning", "context"), DEEP_ARRAY),
        id="responses-reasoning-context",
    ),
    pytest.param(CHAT, DEEP_ARRAY, id="chat-root-array"),
    pytest.param(CHAT, DEEP_OBJECT, id="chat-root-object"),
    pytest.param(CHAT, _inside(VALID_CHAT, ("messages", 1, "content"), DEEP_ARRAY), id="chat-content"),
    pytest.param(CHAT, _inside(VALID_CHAT, ("top_k",), DEEP_OBJECT), id="chat-extra-field"),
    pytest.param(
        CHAT,
        _inside(VALID_CHAT, ("chat_template_kwargs",), b'{"a":' * 1000 + b"1" + b"}" * 1000),
        id="chat-kwargs-1000",
    ),
    pytest.param(
        CHAT,
        _inside(VALID_CHAT, ("messages", 1, "content"), b"[" * 1000 + b"]" * 1000),
        id="chat-content-1000",
    ),
    pytest.param(
        CHAT,
        _inside(VALID_CHAT, ("top_k",), b'{"a":' * 1000 + b"1" + b"}" * 1000),
        id="chat-extra-1000",
    ),
    pytest.param(CHAT, _inside(VALID_CHAT, ("top_k",), b'{"a":' * 500 + b"1" + b"}" * 500), id="chat-extra-500"),
    pytest.param(
        RESPONSES,
        _inside(VALID_RESPONSES, ("tools", 0, "parameters"), b'{"a":' * 1000 + b"1" + b"}" * 1000),
        id="responses-parameters-1000",
    ),
    pytest.param(
        RESPONSES,
        _inside(VALID_RESPONSES, ("tools", 0, "parameters"), b'{"a":' * 500 + b"1" + b"}" * 500),
        id="responses-parameters-500",
    ),
]


@pytest.mark.parametrize(("path", "raw"), DEEP_CASES)
def test_deeply_nested_json(stack, path, raw):
    check(*post(stack, path, raw), path)
    still_serves(stack)


HUGE = 5 * 1024 * 1024


@pytest.mark.parametrize(
    ("path", "where", "valid"),
    [
        (RESPONSES, ("input", 6, "content"), True),
        (RESPONSES, ("model",), True),
        (RESPONSES, ("instructions",), True),
        (RESPONSES, ("metadata", "run"), True),
        (RESPONSES, ("input", 4, "arguments"), True),
        (RESPONSES, ("tools", 0, "name"), True),
        (RESPONSES, ("max_output_tokens",), False),
        (CHAT, ("messages", 4, "content"), True),
        (CHAT, ("model",), True),
        (CHAT, ("messages", 2, "content"), True),
        (CHAT, ("top_k",), True),
    ],
    ids=lambda v: ".".join(map(str, v)) if isinstance(v, tuple) else v,
)
def test_huge_strings(stack, path, where, valid):
    body = orjson.dumps(replaced(VALID[path], where, "y" * HUGE))
    status, headers, raw = post(stack, path, body)
    check(status, headers, raw, path)
    if valid:
        assert status == 200, raw[:300]
    else:
        assert len(raw) < 100_000, "the error message repeats the whole huge value"


@pytest.mark.parametrize(
    "path",
    [
        RESPONSES,
        CHAT,
    ],
    ids=["responses", "chat"],
)
def test_huge_key(stack, path):
    status, headers, raw = post(stack, path, orjson.dumps({**VALID[path], "k" * HUGE: 1}))
    check(status, headers, raw, path)
    assert len(raw) < 100_000, "the error message repeats the whole huge key"


@pytest.mark.parametrize("path", PATHS, ids=["responses", "chat"])
def test_many_items(stack, path):
    if path == RESPONSES:
        many = {"model": "m", "input": [{"role": "user", "content": "w"}] * 100_000}
    else:
        many = {"model": "m", "messages": [{"role": "user", "content": "w"}] * 100_000}
    status, headers, raw = post(stack, path, orjson.dumps(many))
    check(status, headers, raw, path)
    assert status == 200
    still_serves(stack)


INVALID_UTF8 = [b"\xff", b"\xc3\x28", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe2\x82", b"\x80"]


@pytest.mark.parametrize("path", PATHS, ids=["responses", "chat"])
@pytest.mark.parametrize("bad", INVALID_UTF8, ids=lambda b: b.hex())
def test_invalid_utf8(stack, path, bad):
    body = orjson.dumps(VALID[path])
    for target in (b'"again"', b'"m"', b'"model"'):  # a value, the model, a key
        status, headers, raw = post(stack, path, body.replace(target, target[:-1] + bad + b'"', 1))
        check(status, headers, raw, path)
        assert status == 400, raw[:300]


# --- the body limit ------------------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS, ids=["responses", "chat"])
def test_body_over_the_limit_is_413(stack, path):
    big = orjson.dumps(replaced(VALID[path], ("model",), "z" * (MAX_BODY + 10)))
    status, headers, raw = post(stack, path, big)
    check(status, headers, raw, path)
    assert status == 413 and "max_body_size" in orjson.loads(raw)["error"]["message"]

    def chunks():
        for i in range(0, len(big), 1 << 20):
            yield big[i : i + (1 << 20)]

    conn = http.client.HTTPConnection("127.0.0.1", stack.proxy_port, timeout=TIMEOUT)
    try:
        conn.request("POST", path, body=chunks(), headers={"Content-Type": "application/json"}, encode_chunked=True)
        reply = conn.getresponse()
        check(reply.status, dict(reply.getheaders()), reply.read(), path)
        assert reply.status == 413
    except (BrokenPipeError, ConnectionResetError):
        pass  # refused while still sending: acceptable, but it must not have crashed anything
    finally:
        conn.close()

    # A Content-Length far past the limit with hardly any body: refused at once, not awaited.
    status, headers, raw = exchange(stack, request_bytes("POST", path, b"{}", length=10_000_000_000))
    check(status, headers, raw, path)
    assert status == 413
    still_serves(stack)


BOMB = b'{"model": "' + b"0" * (64 * 1024 * 1024) + b'"}'
COMPRESSED = {  # name: (body maker, Content-Encoding, chunked, allowed statuses)
    "garbage-gzip": (lambda valid: b"not gzip at all", "gzip", False, (400,)),
    "garbage-deflate": (lambda valid: b"not deflate either", "deflate", False, (400,)),
    "gzip": (gzip.compress, "gzip", False, (200,)),
    "deflate": (zlib.compress, "deflate", False, (200,)),
    "gzip-chunked": (gzip.compress, "gzip", True, (200,)),
    "gzip-bomb": (lambda valid: gzip.compress(BOMB), "gzip", False, (400, 413)),
    "gzip-bomb-chunked": (lambda valid: gzip.compress(BOMB), "gzip", True, (413,)),
}


@pytest.mark.parametrize("path", PATHS, ids=["responses", "chat"])
@pytest.mark.parametrize(
    "case",
    list(COMPRESSED),
)
def test_compressed_bodies(stack, path, case):
    """Content-Encoding on requests: garbage, valid gzip/deflate, and a bomb far past the body limit."""
    make, encoding, chunked, allowed = COMPRESSED[case]
    data = make(orjson.dumps(VALID[path]))
    if chunked:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
            f"Content-Encoding: {encoding}\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        request = head.encode() + b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data)
    else:
        request = request_bytes("POST", path, data, [("Content-Encoding", encoding)])
    status, headers, raw = exchange(stack, request)
    check(status, headers, raw, path)
    assert status in allowed, (status, raw[:300])
    still_serves(stack)


# --- headers ---------------------------------------------------------------------------------------

BAD_HEADER_LINES = {
    "bare-cr": b"X-Session-ID: a\rb\r\n",
    "bare-lf-line": b"X-Session-ID: a\nb\r\n",
    "nul": b"X-Session-ID: a\x00b\r\n",
    "obs-fold": b"X-Session-ID: a\r\n b\r\n",
    "space-in-name": b"X Session: 1\r\n",
    "no-colon": b"X-Session-ID\r\n",
    "two-lengths": b"Content-Length: 5\r\n",
    "te-and-length": b"Transfer-Encoding: chunked\r\n",
    "negative-length": b"",
}


@pytest.mark.parametrize("path", PATHS, ids=["responses", "chat"])
@pytest.mark.parametrize("case", list(BAD_HEADER_LINES))
def test_malformed_header_lines(stack, path, case):
    body = orjson.dumps(VALID[path])
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Type: application/json\r\n".encode()
    )
    length = b"Content-Length: -1\r\n" if case == "negative-length" else b"Content-Length: %d\r\n" % len(body)
    status, headers, raw = exchange(stack, head + BAD_HEADER_LINES[case] + length + b"\r\n" + body)
    if status is not None and status >= 400 and not headers.get("Content-Type", "").startswith("application/json"):
        check_plain_4xx(status, raw)  # refused by aiohttp's parser
    else:
        check(status, headers, raw, path)  # or parsed leniently, and then answered properly
    still_serves(stack)


def test_crlf_injection_never_reaches_the_upstream(stack):
    before = len(stack.upstream.requests)
    for path in PATHS:
        # http.client refuses CR/LF in values, so these go out raw: the "injected" line is simply
        # another header of the client's request.
        data = request_bytes(
            "POST",
            path,
            orjson.dumps(VALID[path]),
            [("X-Session-ID", "s1"), ("X-Injected", "evil"), ("X-Request-Id", "abc\tdef")],
        )
        check(*exchange(stack, data), path)
    for seen in stack.upstream.requests[before:]:
        assert "X-Injected" not in seen.headers and "X-Session-Id" not in seen.headers, seen.headers


@pytest.mark.parametrize(
    ("name", "value"),
    [
        pytest.param("X-Session-ID", "caf\xc3\xa9", id="session-utf8"),
        pytest.param("X-Session-ID", "\xff\xfe", id="session-invalid-utf8"),
        pytest.param("Cookie", "gymproxy_pin=a.1.\xc3\xa9", id="pin-cookie-non-ascii-mac"),
        pytest.param("Cookie", "gymproxy_pin=\xff.1.x", id="pin-cookie-invalid-utf8"),
        pytest.param("Cookie", "gymproxy_pin=" + "a" * 8000, id="pin-cookie-long"),
        pytest.param("Cookie", "gymproxy_pin=a.99999999999999999999999.b", id="pin-cookie-huge-time"),
        pytest.param("Cookie", 'gymproxy_pin="\\"; x=1', id="pin-cookie-quoted"),
        pytest.param("X-Request-Id", "\xff" * 100, id="request-id-invalid-utf8"),
        pytest.param("Authorization", "Bearer \xff", id="authorization-invalid-utf8"),
    ],
)
def test_odd_header_values(stack, name, value):
    for path in PATHS:
        data = request_bytes("POST", path, orjson.dumps(VALID[path]), [(name, value)])
        check(*exchange(stack, data), path)
    still_serves(stack)


@pytest.mark.parametrize(
    "case",
    ["value-100k", "value-16k", "name-20k", "request-line-100k", "headers-5000", "cookie-100k"],
)
def test_absurd_header_lengths(stack, case):
    body = orjson.dumps(VALID[CHAT])
    target = CHAT
    extra: list[tuple[str, str]] = []
    if case == "value-100k":
        extra = [("X-Session-ID", "v" * 100_000)]
    elif case == "value-16k":
        extra = [("X-Session-ID", "v" * 16_000)]
    elif case == "name-20k":
        extra = [("X" * 20_000, "1")]
    elif case == "request-line-100k":
        target = CHAT + "?" + "q" * 100_000
    elif case == "headers-5000":
        extra = [(f"X-H{i}", "v") for i in range(5000)]
    else:
        extra = [("Cookie", "gymproxy_pin=" + "c" * 100_000)]
    status, headers, raw = exchange(stack, request_bytes("POST", target, body, extra))
    if status is not None and status >= 400 and not headers.get("Content-Type", "").startswith("application/json"):
        check_plain_4xx(status, raw, (400, 413, 414, 431))
    else:
        check(status, headers, raw, CHAT)
    still_serves(stack)


def test_pipelined_and_http10_requests(stack):
    one = request_bytes("POST", CHAT, orjson.dumps(VALID[CHAT])).replace(b"Connection: close\r\n", b"")
    last = request_bytes("POST", RESPONSES, orjson.dumps(VALID[RESPONSES]))
    status, headers, raw = exchange(stack, one + one + last, until_eof=True)
    assert status == 200 and raw.count(b"HTTP/1.1 200") == 2, raw[:300]  # the last reply's head is in `raw`
    hostile()
    data = request_bytes("POST", CHAT, orjson.dumps(VALID[CHAT])).replace(b"HTTP/1.1", b"HTTP/1.0", 1)
    check(*exchange(stack, data), CHAT)


# --- nowhere but the configured upstream -----------------------------------------------------------


def _elsewhere(stack: Stack) -> list[tuple[str, bytes]]:
    """(expected route or "", raw request) pairs that try to reach the sentinel or another host."""
    s = f"127.0.0.1:{stack.sentinel_port}"
    body_chat = orjson.dumps(VALID[CHAT])
    body_resp = orjson.dumps(VALID[RESPONSES])
    tries = [
        (CHAT, request_bytes("POST", f"http://{s}/v1/chat/completions", body_chat, host=s)),
        (RESPONSES, request_bytes("POST", "http://evil.example/v1/responses", body_resp, host="evil.example")),
        (CHAT, request_bytes("POST", CHAT, body_chat, host="10.0.0.1")),
        (RESPONSES, request_bytes("POST", RESPONSES, body_resp, host=s)),
        (
            CHAT,
            request_bytes(
                "POST",
                CHAT,
                body_chat,
                [
                    ("X-Forwarded-Host", s),
                    ("Forwarded", f"host={s};proto=http"),
                    ("X-Original-URL", f"http://{s}/v1/chat/completions"),
                ],
            ),
        ),
        (
            CHAT,
            request_bytes(
                "POST", CHAT, orjson.dumps({**VALID[CHAT], "base_url": f"http://{s}/v1", "api_base": f"http://{s}"})
            ),
        ),
        (
            RESPONSES,
            request_bytes(
                "POST",
                RESPONSES,
                orjson.dumps(
                    replaced(VALID[RESPONSES], ("input", 1, "content", 1, "image_url"), f"http://{s}/cat.png")
                ),
            ),
        ),
        (CHAT, request_bytes("POST", CHAT + f"?base_url=http://{s}/v1", body_chat)),
        ("", request_bytes("POST", "/v1/../admin", body_chat)),
        ("", request_bytes("POST", "/v1/%2e%2e/admin", body_chat)),
        ("", request_bytes("POST", "//evil.example/v1/responses", body_resp)),
        ("", request_bytes("POST", f"//{s}/v1/chat/completions", body_chat)),
        ("", request_bytes("POST", f"/%2F%2F{s}/v1/chat/completions", body_chat)),
        ("", request_bytes("POST", f"@{s}/v1/chat/completions", body_chat)),
        ("", request_bytes("POST", "/v1/chat/completions/../../../etc/passwd", body_chat)),
        ("", request_bytes("POST", "/v1/chat/completions\\..\\..\\admin", body_chat)),
        ("", request_bytes("POST", "/v1/chat/completions%00", body_chat)),
        ("", request_bytes("POST", "*", body_chat)),
        ("", request_bytes("CONNECT", s, b"", host=s)),
        ("", request_bytes("GET", f"http://{s}/health", host=s)),
        ("", request_bytes("POST", "/v1/../v1/chat/completions", body_chat)),
        ("", request_bytes("POST", "/tokenize", orjson.dumps({"model": "m", "prompt": f"http://{s}/"}), host=s)),
        ("", request_bytes("POST", "/v1/completions", orjson.dumps({"model": f"http://{s}/", "prompt": "x"}), host=s)),
    ]
    return tries


def test_nothing_reaches_anything_but_the_upstream(stack):
    before = len(stack.upstream.requests)
    for route, data in _elsewhere(stack):
        status, headers, raw = exchange(stack, data)
        if route:
            check(status, headers, raw, route)
            assert status == 200, raw[:300]
        else:
            hostile()
            assert status is not None and status < 500, (data[:80], status, raw[:200])
            if status >= 400 and headers.get("Content-Type", "").startswith("application/json"):
                assert set(orjson.loads(raw)["error"]) == ERROR_KEYS
    assert stack.sentinel_hits == 0, "gymproxy connected to an address it was never configured with"
    seen = stack.upstream.requests[before:]
    assert seen, "the routed requests never reached the upstream"
    assert {r.path for r in seen} <= ALLOWED_UPSTREAM_PATHS, {r.path for r in seen}
    assert {r.headers.get("Host") for r in seen} == {f"127.0.0.1:{stack.upstream_port}"}
    assert not any(r.query for r in seen if r.path == "/v1/chat/completions"), "a client query string reached vLLM"
    still_serves(stack)


def test_stack_still_healthy_at_the_end(stack):
    status, _, raw = exchange(stack, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert status == 200, raw
    still_serves(stack)
    assert ANSWER  # the upstream answered every routed request with its one answer
