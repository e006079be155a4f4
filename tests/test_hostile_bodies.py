"""Hostile request bodies at both endpoints of a running gymproxy (routes' reading and decoding, and
the conversions' refusals): random JSON and bytes, wrong types at every field, deep nesting, huge
strings and keys, invalid UTF-8, bodies over the limit and compression bombs. See tests/hostile.py."""

from __future__ import annotations

import gzip
import http.client
import json
import zlib
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from .faults import (
    CHAT,
    PATHS,
    RESPONSES,
    xfail_losses_do_not_count,  # noqa: F401  (autouse: an xfail's losses do not count)
)
from .hostile import (
    HYPOTHESIS,
    MAX_BODY,
    TIMEOUT,
    VALID,
    VALID_CHAT,
    VALID_RESPONSES,
    WRONG,
    check,
    exchange,
    kind_of,
    paths_of,
    post,
    replaced,
    request_bytes,
    running_stack,
    still_serves,
)


@pytest.fixture(scope="module")
def stack():
    yield from running_stack()


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
            if kind_of(value) == kind_of(current):
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
    """As many items as `limits.max_json_values` (250,000) allows are answered; 100,000 items, each an
    object and 4 strings, are a 413 naming the limit."""
    key = "input" if path == RESPONSES else "messages"
    for items, expected in ((49_990, 200), (100_000, 413)):
        many = {"model": "m", key: [{"role": "user", "content": "w"}] * items}
        status, headers, raw = post(stack, path, orjson.dumps(many))
        check(status, headers, raw, path)
        assert status == expected, raw[:300]
    assert "limits.max_json_values" in orjson.loads(raw)["error"]["message"]
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
