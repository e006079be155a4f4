"""Hostile HTTP at a running gymproxy (aiohttp's parser and the route wrapper): malformed and absurd
header lines, CRLF injection, pipelined and HTTP/1.0 requests, and requests that try to make
gymproxy talk to anything but its configured upstream. See tests/hostile.py."""

from __future__ import annotations

import orjson
import pytest

from .faults import (
    CHAT,
    ERROR_KEYS,
    PATHS,
    RESPONSES,
    hostile,
    xfail_losses_do_not_count,  # noqa: F401  (autouse: an xfail's losses do not count)
)
from .hostile import (
    ALLOWED_UPSTREAM_PATHS,
    VALID,
    Stack,
    check,
    check_plain_4xx,
    exchange,
    replaced,
    request_bytes,
    running_stack,
    still_serves,
)

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


@pytest.fixture(scope="module")
def stack():
    yield from running_stack()


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
