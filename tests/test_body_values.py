"""The JSON values of a request body are bounded (`limits.max_json_values` for objects, arrays and
strings, `limits.max_json_numbers` for numbers, `true`, `false` and `null`), and so is what its
decode costs: a body that would decode to far more than its size (32 MiB of `{},{},...` made over
1 GB and held the event loop for seconds; 32 MiB of `0,0,...` made 450 MB and held it for 0.5-2.7 s)
gets a 413 naming the limit while it is still arriving, the connection ends after it (what is left
of the body is never read, nor inflated), and another client's `/health` is answered meanwhile.
Every route that decodes a body refuses one nested too deeply with the same 400.
"""

from __future__ import annotations

import asyncio
import gzip
import multiprocessing
import socket
import time
import zlib
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp
import orjson
import pytest

from gymproxy.routes import TOO_DEEP

from .served import Served

CHAT, RESPONSES, MESSAGES = "/v1/chat/completions", "/v1/responses", "/v1/messages"
MiB = 1024 * 1024
HOSTILE_SIZE = 8 * MiB - 1024  # just under the default max_body_size
ROUNDS = 3  # hostile bodies per route, back to back on one connection (a new one after each refusal)


def empty_objects(key: str, size: int = HOSTILE_SIZE) -> bytes:
    """`{"model": "m", key: [{}, {}, ...]}` of `size` bytes, `model` last (so /v1/messages, with a
    configured model, cannot edit the body in place and decodes it)."""
    head, tail = b'{"' + key.encode() + b'":[', b'],"model":"m"}'
    count = (size - len(head) - len(tail) + 1) // 3
    return head + b",".join([b"{}"] * count) + tail


def chat_padded(unit: bytes, size: int = HOSTILE_SIZE) -> bytes:
    """A valid chat body of `size` bytes whose vLLM extra `x` is an array of `unit`s (numbers are
    forwarded as vLLM extras: a body of them was decoded, and encoded again, whole)."""
    head, tail = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"x":[', b"]}"
    count = (size - len(head) - len(tail) + 1) // (len(unit) + 1)
    return head + b",".join([unit] * count) + tail


def chat_string(escape: bytes, size: int) -> bytes:
    """A valid chat body of `size` bytes whose one message is a string of JSON escapes (one value;
    decoding and encoding it again cost the event loop by its length)."""
    head, tail = b'{"model":"m","max_tokens":1,"messages":[{"role":"user","content":"', b'"}]}'
    return head + escape * ((size - len(head) - len(tail)) // len(escape)) + tail


# --- a client on raw sockets ---------------------------------------------------------------------


class RawReply(NamedTuple):
    status: int
    closes: bool  # `Connection: close`: gymproxy ends the connection after it
    body: bytes


def read_reply(sock: socket.socket) -> RawReply:
    """One HTTP/1.1 reply (its body still chunked, if it came so)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += _recv(sock)
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").lower().split("\r\n")
    status, closes = int(lines[0].split()[1]), "connection: close" in lines
    lengths = [int(line.split(":", 1)[1]) for line in lines if line.startswith("content-length:")]
    if lengths:
        while len(body) < lengths[0]:
            body += _recv(sock)
        return RawReply(status, closes, body[: lengths[0]])
    while not body.endswith(b"0\r\n\r\n"):  # chunked
        body += _recv(sock)
    return RawReply(status, closes, body)


def _recv(sock: socket.socket) -> bytes:
    chunk = sock.recv(1 << 16)
    if not chunk:
        raise ConnectionError("gymproxy closed the connection before it replied")
    return chunk


def post_raw(sock: socket.socket, path: str, body: bytes, *, encoding: str | None = None) -> RawReply:
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    if encoding is not None:
        head += f"Content-Encoding: {encoding}\r\n"
    sock.sendall(head.encode() + b"\r\n" + body)
    return read_reply(sock)


def send_back_to_back(
    port: int, bodies: list[tuple[str, bytes]], *, encoding: str | None = None
) -> list[tuple[str, RawReply]]:
    """Each (path, body) POSTed in turn on one keep-alive connection, as fast as replies come, on a
    new one after a reply that ends its connection."""
    replies = []
    sock = None
    try:
        for path, body in bodies:
            if sock is None:
                sock = socket.create_connection(("127.0.0.1", port), timeout=60)
            reply = post_raw(sock, path, body, encoding=encoding)
            replies.append((path, reply))
            if reply.closes:
                sock.close()
                sock = None
    finally:
        if sock is not None:
            sock.close()
    return replies


def poll_health(port: int, started: Any, until: Any, worst: Any) -> None:
    """Poll `GET /health` until `until` is set; the slowest wait (seconds) goes into `worst`."""
    slowest = 0.0
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        while not until.is_set():
            start = time.monotonic()
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_reply(sock).status == 200
            slowest = max(slowest, time.monotonic() - start)
            started.set()
            time.sleep(0.005)
    worst.put(slowest)


def attack(
    port: int, bodies: list[tuple[str, bytes]], *, encoding: str | None = None
) -> tuple[list[tuple[str, RawReply]], float]:
    """The hostile client's replies, and the worst /health wait of another client meanwhile. That
    client is a process of its own: the fake vLLM, in this one, holds its GIL while it decodes."""
    spawn = multiprocessing.get_context("spawn")
    started, done, worst = spawn.Event(), spawn.Event(), spawn.Queue()
    poller = spawn.Process(target=poll_health, args=(port, started, done, worst))
    poller.start()
    try:
        assert started.wait(60), "the /health poller did not start"
        replies = send_back_to_back(port, bodies, encoding=encoding)
    finally:
        done.set()
        slowest: float = worst.get(timeout=60)
        poller.join(60)
    return replies, slowest


def _status(served: Served, field: str) -> float:
    assert served.process is not None
    with open(f"/proc/{served.process.pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":")) / 1024


def peak_rss_mb(served: Served) -> float:
    return _status(served, "VmHWM")


def cpu_seconds(served: Served) -> float:
    """The process's CPU time so far (user and system)."""
    assert served.process is not None
    fields = Path(f"/proc/{served.process.pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / 100  # USER_HZ, 100 on Linux


def error_message(path: str, raw: bytes) -> str:
    body = orjson.loads(raw)
    message: str = body["error"]["message"]
    if path.startswith(MESSAGES):  # Anthropic's envelope
        assert body["type"] == "error", body
    else:
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return message


# --- the regression: hostile bodies against `gymproxy serve` --------------------------------------


@pytest.mark.parametrize(
    ("config", "targets"),
    [
        (
            {"model": "served"},
            [(CHAT, "messages"), (RESPONSES, "input"), (MESSAGES, "messages"), ("/v1/completions", "prompt")],
        ),
        ({"is_responses_native": True}, [(RESPONSES, "input")]),
    ],
    ids=["converted-and-relayed", "responses-native"],
)
async def test_hostile_bodies_are_refused_as_they_arrive_and_hold_up_no_one(fake_vllm, tmp_path, config, targets):
    bodies = [(path, empty_objects(key)) for path, key in targets] * ROUNDS
    async with Served(tmp_path, {"base_url": [fake_vllm.url], **config}) as served:
        before = peak_rss_mb(served)
        replies, worst = await asyncio.to_thread(attack, served.port, bodies)
        grown = peak_rss_mb(served) - before
    print(f"worst /health wait {worst * 1000:.1f} ms, peak RSS +{grown:.0f} MB, {len(bodies)} bodies of 8 MiB")
    assert worst < 1.0, f"another client's /health waited {worst:.2f} s"  # ~0.02 s measured; 1-3.7 s before
    assert grown < 64, f"peak RSS grew {grown:.0f} MB"  # ~2 MB measured; +1-1.8 GB before
    for path, (status, closes, raw) in replies:
        assert (status, closes) == (413, True), (path, status, raw[:300])
        assert "limits.max_json_values" in error_message(path, raw), raw[:300]


# The red team's variants of the same attack: bodies just under the limit back to back on one
# connection, against `gymproxy serve`'s defaults. The numbers were not counted: before, each body
# was decoded (and encoded again for vLLM) whole.
VARIANTS = {
    "numbers": (chat_padded(b"0"), None, 413, "limits.max_json_numbers"),  # +446 MB, /health 0.6-2.7 s before
    "floats": (chat_padded(b"0.5"), None, 413, "limits.max_json_numbers"),  # +512 MB, 1.1-1.8 s before
    "numbers gzipped": (gzip.compress(chat_padded(b"0")), "gzip", 413, "limits.max_json_numbers"),  # 16 KB sent
    # One string of 32 MiB of escapes was decoded and encoded again whole (0.4-0.85 s); over the limit
    # now, it is refused before a byte of it is read. One of 8 MiB is served.
    "escapes 32 MiB": (chat_string(b"\\u00e9", 32 * MiB - 1024), None, 413, "max_body_size"),
    "escapes 8 MiB": (chat_string(b"\\n", HOSTILE_SIZE), None, 200, None),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
async def test_hostile_variants_are_refused_or_served_and_hold_up_no_one(fake_vllm, tmp_path, variant):
    body, encoding, status, limit = VARIANTS[variant]
    async with Served(tmp_path, {"base_url": [fake_vllm.url]}) as served:
        before = peak_rss_mb(served)
        replies, worst = await asyncio.to_thread(attack, served.port, [(CHAT, body)] * ROUNDS, encoding=encoding)
        grown = peak_rss_mb(served) - before
    print(f"{variant}: worst /health wait {worst * 1000:.1f} ms, peak RSS +{grown:.0f} MB")
    for path, reply in replies:
        assert reply.status == status, (variant, reply.status, reply.body[:300])
        if limit is not None:
            assert reply.closes and limit in error_message(path, reply.body), reply.body[:300]
    assert worst < 0.5, f"another client's /health waited {worst:.2f} s"  # 10-60 ms measured
    # A served body is held as its bytes, its decoded value and the body sent on, and here the fake
    # vLLM's answer echoes it (25-45 MB measured); a refused one costs next to nothing (2-3 MB).
    assert grown < (64 if status == 200 else 16), f"peak RSS grew {grown:.0f} MB"


def inflating(head: bytes, filler: bytes, size: int, tail: bytes) -> bytes:
    """gzip of `head`, `filler` repeated to `size` bytes, and `tail`: made a MiB at a time."""
    deflate = zlib.compressobj(1, zlib.DEFLATED, 31)  # 31: a gzip stream
    block = filler * (MiB // len(filler))
    parts = [deflate.compress(head)]
    parts += [deflate.compress(block) for _ in range(size // len(block))]
    parts += [deflate.compress(tail), deflate.flush()]
    return b"".join(parts)


async def test_a_refused_compressed_body_is_never_inflated_to_its_end(fake_vllm, tmp_path):
    """A gzip body of 5 MB that inflates to 1 GiB of spaces (nothing to count) is refused once 8 MiB
    of it are inflated, and the connection ends: before, aiohttp's lingering close read what was
    left and inflated it, some 1 GiB on the event loop in one go, after the 413."""
    bomb = inflating(b'{"model":"m","messages":[{"role":"user","content":"', b" ", 1024 * MiB, b'"}]}')
    async with Served(tmp_path, {"base_url": [fake_vllm.url]}) as served:
        cpu = cpu_seconds(served)
        replies, worst = await asyncio.to_thread(attack, served.port, [(CHAT, bomb)] * 2, encoding="gzip")
        cpu = cpu_seconds(served) - cpu
    print(f"{len(bomb)} bytes sent twice: {cpu:.2f} s of CPU, worst /health wait {worst * 1000:.1f} ms")
    for path, (status, closes, raw) in replies:
        assert (status, closes) == (413, True), (status, raw[:300])
        assert "over the limit of 8388608 bytes (max_body_size)" in error_message(path, raw)
    assert cpu < 0.5, f"gymproxy spent {cpu:.2f} s of CPU"  # some 0.05 s: inflating 8 MiB twice
    assert worst < 0.5, f"another client's /health waited {worst:.2f} s"


# --- the limit, exactly --------------------------------------------------------------------------

LIMIT = 2048
KINDS = {  # what each limit counts, and a value that counts against it alone
    "values": ("max_json_values", lambda raw: raw.count(b"{") + raw.count(b"[") + raw.count(b'"') // 2, b"[]"),
    "numbers": ("max_json_numbers", lambda raw: raw.count(b","), b"0"),
}


def chat_with(kind: str, count: int) -> bytes:
    """A valid chat body of exactly `count` values of `kind` as its limit counts them, padded with
    empty arrays or zeros (a vLLM extra)."""
    _, counted, unit = KINDS[kind]
    head = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "pad": []})[:-2]
    pad = count - counted(head + unit + b"]}") + 1  # the first item brings no comma
    return head + b",".join([unit] * pad) + b"]}"


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("encoding", ["plain", "chunked", "gzip"])
async def test_a_body_at_the_limit_is_served_and_one_more_value_is_a_413(start_proxy, fake_vllm, encoding, kind):
    key, counted, _ = KINDS[kind]
    other = "max_json_numbers" if kind == "values" else "max_json_values"
    url = await start_proxy(limits={key: LIMIT, other: 10 * LIMIT})
    at, over = chat_with(kind, LIMIT), chat_with(kind, LIMIT + 1)
    assert counted(at) == LIMIT and len(at) > LIMIT  # long enough to be counted at all

    async def post(body: bytes) -> tuple[int, Any]:
        headers = {"Content-Type": "application/json"}
        data: Any = body
        if encoding == "gzip":
            data, headers["Content-Encoding"] = gzip.compress(body), "gzip"
        elif encoding == "chunked":

            async def pieces() -> Any:
                for i in range(0, len(body), 777):  # splits land anywhere, inside strings too
                    yield body[i : i + 777]

            data = pieces()
        async with aiohttp.ClientSession() as session, session.post(url + CHAT, data=data, headers=headers) as r:
            return r.status, await r.json()

    status, reply = await post(at)
    assert status == 200, reply
    assert fake_vllm.last_json()["pad"] == orjson.loads(at)["pad"]  # forwarded whole
    status, reply = await post(over)
    assert status == 413, reply
    assert f"limit of {LIMIT} (limits.{key}" in reply["error"]["message"]


async def test_values_and_numbers_inside_strings_count(start_proxy):
    url = await start_proxy(limits={"max_json_values": LIMIT, "max_json_numbers": LIMIT})
    async with aiohttp.ClientSession() as session:
        for text, key in [('{"a": "b"}' * LIMIT, "max_json_values"), ("1, " * LIMIT, "max_json_numbers")]:
            body = {"model": "m", "messages": [{"role": "user", "content": text}]}  # an upper bound counts them
            async with session.post(url + CHAT, json=body) as r:
                assert r.status == 413 and f"limits.{key}" in (await r.json())["error"]["message"]


async def test_a_prompt_of_128k_token_ids_passes_the_default_limits(start_proxy, fake_vllm):
    """The numbers' limit leaves room for what a client sends as numbers: a long prompt as token ids
    (and, beside it, the 30,000-50,000 values a MB of agent JSON holds)."""
    url = await start_proxy()
    fake_vllm.max_model_len = 256 * 1024
    ids = [(i * 7919) % 150_000 for i in range(128 * 1024)]
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/completions", json={"model": "m", "prompt": ids, "max_tokens": 1}) as r:
            assert r.status == 200, await r.text()
        assert fake_vllm.last_json()["prompt"] == ids
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "prompt_token_ids": ids}
        async with session.post(url + CHAT, json=body) as r:
            assert r.status == 200, await r.text()
        assert fake_vllm.last_json()["prompt_token_ids"] == ids


# --- nesting: the same 400 on every route that decodes a body -------------------------------------

DEEP = b"[" * 2000 + b"]" * 2000  # past orjson's 1024 levels and the recursion limit msgspec stops at
CHAT_BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}]'
ANTHROPIC_BODY = b'{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"hi"}]'
DEEP_BODIES = {  # where each route's decode goes down into the value
    "chat": [b'{"model":"m","messages":[{"role":"user","content":%s}]}', CHAT_BODY + b',"top_k":%s}'],
    "responses": [
        b'{"model":"m","input":"hi","moderation":%s}',
        b'{"model":"m","input":"hi","reasoning":{"context":%s}}',
    ],
    "native": [b'{"model":"m","input":%s}', b'{"model":"m","input":"hi","extra":%s}'],
    "anthropic": [b'{"model":"m","messages":%s}', ANTHROPIC_BODY + b',"metadata":%s}'],
}


@pytest.mark.parametrize(
    ("config", "path", "bodies"),
    [
        ({}, CHAT, "chat"),
        ({}, RESPONSES, "responses"),
        ({"is_responses_native": True}, RESPONSES, "native"),
        ({"model": "served"}, MESSAGES, "anthropic"),
        ({}, MESSAGES, "anthropic"),
        ({}, MESSAGES + "/count_tokens", "anthropic"),
    ],
    ids=["chat", "responses", "responses-native", "messages-model", "messages", "count-tokens"],
)
async def test_nesting_too_deep_is_the_same_400_everywhere(start_proxy, config, path, bodies):
    """(`POST /admin/upstreams` decodes a Struct that forbids unknown fields: nothing in it can nest.)"""
    url = await start_proxy(**config)
    async with aiohttp.ClientSession() as session:
        for body in DEEP_BODIES[bodies]:
            async with session.post(url + path, data=body % DEEP, headers={"Content-Type": "application/json"}) as r:
                raw = await r.read()
                assert (r.status, error_message(path, raw)) == (400, TOO_DEEP), (body, raw[:300])
