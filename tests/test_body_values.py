"""The JSON values of a request body are bounded (`limits.max_json_values`), and so is what its decode
costs: a body that would decode to far more than its size (32 MiB of `{},{},...` made over 1 GB and
held the event loop for seconds) gets a 413 naming the limit while it is still arriving, and another
client's `/health` is answered meanwhile. Every route that decodes a body refuses one nested too
deeply with the same 400.
"""

from __future__ import annotations

import asyncio
import gzip
import socket
import threading
import time
from typing import Any

import aiohttp
import orjson
import pytest

from gymproxy.routes import TOO_DEEP

from .served import Served

CHAT, RESPONSES, MESSAGES = "/v1/chat/completions", "/v1/responses", "/v1/messages"
HOSTILE_SIZE = 32 * 1024 * 1024 - 1024  # just under the default max_body_size
ROUNDS = 3  # hostile bodies per route, back to back on one connection


def empty_objects(key: str, size: int = HOSTILE_SIZE) -> bytes:
    """`{"model": "m", key: [{}, {}, ...]}` of `size` bytes, `model` last (so /v1/messages, with a
    configured model, cannot edit the body in place and decodes it)."""
    head, tail = b'{"' + key.encode() + b'":[', b'],"model":"m"}'
    count = (size - len(head) - len(tail) + 1) // 3
    return head + b",".join([b"{}"] * count) + tail


# --- a client on raw sockets ---------------------------------------------------------------------


def read_reply(sock: socket.socket) -> tuple[int, bytes]:
    """One HTTP/1.1 reply (its body still chunked, if it came so)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += _recv(sock)
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").lower().split("\r\n")
    lengths = [int(line.split(":", 1)[1]) for line in lines if line.startswith("content-length:")]
    if lengths:
        while len(body) < lengths[0]:
            body += _recv(sock)
        return int(lines[0].split()[1]), body[: lengths[0]]
    while not body.endswith(b"0\r\n\r\n"):  # chunked
        body += _recv(sock)
    return int(lines[0].split()[1]), body


def _recv(sock: socket.socket) -> bytes:
    chunk = sock.recv(1 << 16)
    if not chunk:
        raise ConnectionError("gymproxy closed the connection before it replied")
    return chunk


def send_back_to_back(port: int, bodies: list[tuple[str, bytes]]) -> list[tuple[str, int, bytes]]:
    """Each (path, body) POSTed in turn on one keep-alive connection, as fast as replies come."""
    replies = []
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        for path, body in bodies:
            head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
            sock.sendall(head.encode() + b"\r\n\r\n" + body)
            replies.append((path, *read_reply(sock)))
    return replies


def worst_health_wait(port: int, until: threading.Event) -> float:
    """Seconds of the slowest `GET /health` of a client polling it until `until` is set."""
    worst = 0.0
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        while not until.is_set():
            start = time.monotonic()
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_reply(sock)[0] == 200
            worst = max(worst, time.monotonic() - start)
            time.sleep(0.005)
    return worst


def attack(port: int, bodies: list[tuple[str, bytes]]) -> tuple[list[tuple[str, int, bytes]], float]:
    """The hostile client's replies, and the worst /health wait of another client meanwhile."""
    done = threading.Event()
    waits: list[float] = []
    poller = threading.Thread(target=lambda: waits.append(worst_health_wait(port, done)))
    poller.start()
    try:
        replies = send_back_to_back(port, bodies)
    finally:
        done.set()
        poller.join(60)
    return replies, waits[0]


def peak_rss_mb(served: Served) -> float:
    assert served.process is not None
    with open(f"/proc/{served.process.pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024


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
    print(f"worst /health wait {worst * 1000:.1f} ms, peak RSS +{grown:.0f} MB, {len(bodies)} bodies of 32 MiB")
    assert worst < 1.0, f"another client's /health waited {worst:.2f} s"  # ~0.02 s measured; 1-3.7 s before
    assert grown < 64, f"peak RSS grew {grown:.0f} MB"  # ~2 MB measured; +1-1.8 GB before
    for path, status, raw in replies:
        assert status == 413, (path, status, raw[:300])
        assert "limits.max_json_values" in error_message(path, raw), raw[:300]


# --- the limit, exactly --------------------------------------------------------------------------

LIMIT = 2048


def counted(raw: bytes) -> int:
    """The values `limits.max_json_values` counts: each `{`, `[` and pair of `"`."""
    return raw.count(b"{") + raw.count(b"[") + raw.count(b'"') // 2


def chat_with(values: int) -> bytes:
    """A valid chat body of exactly `values` counted values, padded with empty arrays (a vLLM extra)."""
    head = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "pad": []})[:-2]
    pad = values - counted(head + b"]}")
    return head + b",".join([b"[]"] * pad) + b"]}"


@pytest.mark.parametrize("encoding", ["plain", "chunked", "gzip"])
async def test_a_body_at_the_limit_is_served_and_one_more_value_is_a_413(start_proxy, fake_vllm, encoding):
    url = await start_proxy(limits={"max_json_values": LIMIT})
    at, over = chat_with(LIMIT), chat_with(LIMIT + 1)
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
    assert len(fake_vllm.last_json()["pad"]) == LIMIT - counted(chat_with(0))  # forwarded whole
    status, reply = await post(over)
    assert status == 413, reply
    assert f"limit of {LIMIT} (limits.max_json_values" in reply["error"]["message"]


async def test_values_inside_strings_count_and_numbers_do_not(start_proxy):
    url = await start_proxy(limits={"max_json_values": LIMIT})
    async with aiohttp.ClientSession() as session:
        text = '{"a": [1, 2]}' * LIMIT  # JSON inside a string: an upper bound counts it
        async with session.post(url + CHAT, json={"model": "m", "messages": [{"role": "user", "content": text}]}) as r:
            assert r.status == 413
        numbers = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "pad": [0] * 100 * LIMIT}
        async with session.post(url + CHAT, json=numbers) as r:
            assert r.status == 200, await r.text()


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
