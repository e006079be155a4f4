"""The fake vLLM's RL routes (VLLM_SERVER_DEV_MODE=1), over real sockets: they must answer as vLLM's do,
and generation must pause, abort, freeze and resume as vLLM's engine does.

The expected bodies of refused requests are vLLM 0.32's own, as its routers and exception handlers
answered them (FastAPI's TestClient in front of `vllm.entrypoints.rl.online.api_router` and
`serve/dev`, with a stub engine).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp
import orjson
import pytest

from gymproxy.testing.fake_vllm import PAUSED_MESSAGE, FakeVLLM, Script, pieces

USER = [{"role": "user", "content": "hello there"}]
WORDS = " ".join(f"w{i}" for i in range(40))  # 40 tokens
SLOW = 0.05  # seconds a token: a reply takes 2 s, so one is surely in flight when /pause comes
BODIES = {
    "/chat/completions": {"model": "m", "messages": USER},
    "/completions": {"model": "m", "prompt": "hello there", "max_tokens": 100},
    "/messages": {"model": "m", "max_tokens": 100, "messages": USER},
}
SERVE = Path(__file__).with_name("fake_vllm_serve.py")


def bad_request(message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": "Bad Request", "param": param, "code": 400}}


def missing(field: str) -> dict[str, Any]:
    error = f"{{'type': 'missing', 'loc': 'body.{field}', 'msg': 'Field required', 'input': 'None'}}"
    return bad_request(f"1 validation error:\n  {error}", f"body.{field}")


def not_a_string(field: str, value: str) -> dict[str, Any]:
    error = (
        f"{{'type': 'string_type', 'loc': 'body.{field}', 'msg': 'Input should be a valid string', 'input': '{value}'}}"
    )
    return bad_request(f"1 validation error:\n  {error}", f"body.{field}")


BAD_MODE = bad_request(
    "1 validation error:\n  {'type': 'literal_error', 'loc': 'query.mode', 'msg': \"Input should be 'abort', "
    "'wait' or 'keep'\", 'input': 'bogus', 'ctx': {'expected': \"'abort', 'wait' or 'keep'\"}}",
    "query.mode",
)
PAUSED_503 = {"error": {"message": PAUSED_MESSAGE, "type": "Service Unavailable", "param": None, "code": 503}}


@pytest.fixture
async def dev_vllm(aiohttp_server: Any) -> FakeVLLM:
    """A FakeVLLM as vLLM 0.32 with VLLM_SERVER_DEV_MODE=1: new requests while paused are queued."""
    fake = FakeVLLM(dev_mode=True)
    fake.url = str((await aiohttp_server(fake.app)).make_url("/v1"))
    return fake


@pytest.fixture
async def dev_vllm_033(aiohttp_server: Any) -> FakeVLLM:
    """As vLLM 0.33: new requests in an abort or wait pause get 503."""
    fake = FakeVLLM(dev_mode=True, paused_503=True)
    fake.url = str((await aiohttp_server(fake.app)).make_url("/v1"))
    return fake


async def call(
    fake: FakeVLLM, method: str, path: str, body: Any = None, *, raw: bytes | None = None
) -> tuple[int, Any]:
    """A request to a route at the fake's root; returns the status and the decoded JSON (None for no body)."""
    data = raw if raw is not None else None if body is None else orjson.dumps(body)
    headers = {"Content-Type": "application/json"} if data is not None else {}
    async with aiohttp.ClientSession() as session:
        async with session.request(method, fake.url.removesuffix("/v1") + path, data=data, headers=headers) as resp:
            payload = await resp.read()
            return resp.status, orjson.loads(payload) if payload else None


class Reply(NamedTuple):
    status: int
    text: str
    finish: str | None  # chat's and completions' finish_reason, Messages' stop_reason
    tokens: int | None  # the usage's completion (output) tokens
    frames: list[bytes]  # a stream's frames, [DONE] included


async def generate(fake: FakeVLLM, path: str, *, stream: bool, rid: str | None = None) -> Reply:
    body = dict(BODIES[path], stream=stream)
    if stream and path != "/messages":
        body["stream_options"] = {"include_usage": True}
    headers = {"X-Request-Id": rid} if rid else {}
    async with aiohttp.ClientSession() as session:
        async with session.post(fake.url + path, json=body, headers=headers) as resp:
            payload = await resp.read()
    if resp.status != 200:
        return Reply(resp.status, "", None, None, [orjson.loads(payload)])
    if not stream:
        return _whole(path, resp.status, orjson.loads(payload))
    return _streamed(path, resp.status, payload.split(b"\n\n")[:-1])


def _whole(path: str, status: int, body: dict[str, Any]) -> Reply:
    if path == "/messages":
        text = "".join(block["text"] for block in body["content"] if block["type"] == "text")
        return Reply(status, text, body.get("stop_reason"), body["usage"]["output_tokens"], [])
    (choice,) = body["choices"]
    text = choice["message"]["content"] if path == "/chat/completions" else choice["text"]
    return Reply(status, text, choice["finish_reason"], body["usage"]["completion_tokens"], [])


def _streamed(path: str, status: int, frames: list[bytes]) -> Reply:
    text, finish, tokens = "", None, None
    for frame in frames:
        data = frame.partition(b"data: ")[2]
        if data == b"[DONE]":
            continue
        event = orjson.loads(data)
        if path == "/messages":
            delta = event.get("delta", {})
            text += delta.get("text", "") if delta.get("type") == "text_delta" else ""
            if event["type"] == "message_delta":
                finish, tokens = delta["stop_reason"], event["usage"]["output_tokens"]
            continue
        for choice in event["choices"]:
            text += choice["delta"].get("content") or "" if "delta" in choice else choice["text"]
            finish = choice["finish_reason"] or finish
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
    return Reply(status, text, finish, tokens, frames)


class Frames:
    """A stream read frame by frame, as it arrives."""

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self.resp = resp

    async def next(self) -> bytes:
        frame = b""
        while (line := await self.resp.content.readline()) not in (b"\n", b""):
            frame += line
        return frame.removesuffix(b"\n")

    async def rest(self) -> list[bytes]:
        frames = []
        while frame := await self.next():
            frames.append(frame)
        return frames


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def content(frames: list[bytes]) -> str:
    chunks = [orjson.loads(f.removeprefix(b"data: ")) for f in frames if f != b"data: [DONE]"]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


# --- The routes --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", "/pause"), ("POST", "/resume"), ("GET", "/is_paused"), ("GET", "/pause"), ("GET", "/weight_info"),
     ("POST", "/update_weight_version"), ("POST", "/finish_weight_update"), ("POST", "/collective_rpc")],
)  # fmt: skip
async def test_without_dev_mode_the_routes_are_404(fake_vllm: FakeVLLM, method: str, path: str) -> None:
    assert await call(fake_vllm, method, path, {"new_version": "2"}) == (404, {"detail": "Not Found"})
    assert fake_vllm.weight_version is None and fake_vllm.pause_mode is None


async def test_pause_refuses_a_bad_mode_with_vllms_400(dev_vllm: FakeVLLM) -> None:
    assert await call(dev_vllm, "POST", "/pause?mode=bogus") == (400, BAD_MODE)
    bad_flag = (
        "{'type': 'bool_parsing', 'loc': 'query.clear_cache', 'msg': 'Input should be a valid boolean, unable to "
        "interpret input', 'input': 'maybe'}"
    )
    status, body = await call(dev_vllm, "POST", "/pause?mode=keep&clear_cache=maybe")
    assert (status, body) == (400, bad_request(f"1 validation error:\n  {bad_flag}", "query.clear_cache"))
    status, body = await call(dev_vllm, "POST", "/pause?mode=bogus&clear_cache=maybe")
    assert status == 400 and body["error"]["message"].startswith("2 validation errors:\n  {'type': 'literal_error'")
    assert await call(dev_vllm, "GET", "/is_paused") == (200, {"is_paused": False})
    assert await call(dev_vllm, "POST", "/pause?mode=keep&clear_cache=false") == (200, {"status": "paused"})
    assert await call(dev_vllm, "GET", "/is_paused") == (200, {"is_paused": True})
    assert dev_vllm.pause_mode == "keep"
    assert await call(dev_vllm, "POST", "/resume") == (200, {"status": "resumed"})
    assert await call(dev_vllm, "GET", "/is_paused") == (200, {"is_paused": False})


async def test_weight_versions_are_set_and_read(dev_vllm: FakeVLLM) -> None:
    assert await call(dev_vllm, "GET", "/weight_info") == (200, {"weight_version": None})
    assert await call(dev_vllm, "POST", "/update_weight_version") == (400, missing("new_version"))
    assert await call(dev_vllm, "POST", "/update_weight_version", {"new_version": None}) == (
        400,
        missing("new_version"),
    )
    assert await call(dev_vllm, "POST", "/update_weight_version", {"new_version": 3}) == (
        400, not_a_string("new_version", "3"),
    )  # fmt: skip
    json_error = (
        "{'type': 'json_invalid', 'loc': 'body.1', 'msg': 'JSON decode error', 'input': '<dict of 0 items>', "
        "'ctx': {'error': 'Expecting property name enclosed in double quotes'}}"
    )
    assert await call(dev_vllm, "POST", "/update_weight_version", raw=b"{not json") == (
        400, bad_request(f"1 validation error:\n  {json_error}", "body.1"),
    )  # fmt: skip
    assert dev_vllm.weight_version is None
    assert await call(dev_vllm, "POST", "/update_weight_version", {"new_version": "7"}) == (
        200, {"success": True, "new_version": "7"},
    )  # fmt: skip
    assert await call(dev_vllm, "GET", "/weight_info") == (200, {"weight_version": "7"})
    finished = (200, {"message": "Weight update finished"})
    assert await call(dev_vllm, "POST", "/finish_weight_update") == finished
    assert dev_vllm.weight_version == "7"  # no version given: it stays
    assert await call(dev_vllm, "POST", "/finish_weight_update", {"weight_version": 8}) == (
        400, not_a_string("weight_version", "8"),
    )  # fmt: skip
    assert await call(dev_vllm, "POST", "/finish_weight_update", {"weight_version": "8"}) == finished
    assert await call(dev_vllm, "GET", "/weight_info") == (200, {"weight_version": "8"})
    assert dev_vllm.weight_version == "8"


@pytest.mark.parametrize(
    ("method", "path", "body", "answer"),
    [
        ("POST", "/init_weight_transfer_engine", {}, (400, missing("init_info"))),
        ("POST", "/init_weight_transfer_engine", {"init_info": {"a": 1}}, (200, {"message": "Weight transfer initialized"})),
        ("POST", "/shutdown_weight_transfer_engine", None, (200, {"message": "Weight transfer shut down"})),
        ("POST", "/start_weight_update", None, (200, {"message": "Weight update started"})),
        ("POST", "/start_draft_weight_update", None, (200, {"message": "Draft weight update started"})),
        ("POST", "/update_weights", {}, (400, missing("update_info"))),
        ("POST", "/update_weights", {"update_info": {}}, (200, {"message": "Weights updated"})),
        ("POST", "/weight_checker", {}, (400, missing("action"))),
        ("POST", "/weight_checker", {"action": "reset"}, (200, {"status": "reset"})),
        ("POST", "/weight_checker", {"action": "compare"},
         (400, bad_request("action='compare' requires a 'baseline' object"))),
        ("POST", "/abort_requests", None, (400, bad_request("Invalid JSON format"))),
        ("POST", "/abort_requests", [1], (400, bad_request("Request body must be a JSON object"))),
        ("POST", "/abort_requests", {}, (200, {"status": "aborted", "aborted": 0})),
        ("POST", "/reset_prefix_cache", None, (200, {"success": True})),
        ("POST", "/reset_mm_cache", None, (200, None)),
        ("POST", "/sleep?level=5", None, (400, bad_request(
            "1 validation error:\n  {'type': 'less_than_equal', 'loc': 'query.level', 'msg': 'Input should be less "
            "than or equal to 2', 'input': '5', 'ctx': {'le': 2}}", "query.level"))),
        ("POST", "/wake_up?tags=weights&tags=kv_cache", None, (200, {"status": "awake", "tags": ["weights", "kv_cache"]})),
        ("GET", "/is_sleeping", None, (200, {"is_sleeping": False})),
        ("POST", "/collective_rpc", {}, (400, bad_request("Missing 'method' in request body"))),
        ("POST", "/collective_rpc", None,
         (400, bad_request("JSON decode error: Expecting value: line 1 column 1 (char 0)"))),
        ("POST", "/collective_rpc", {"method": "reload"}, (200, {"results": [None]})),
    ],
)  # fmt: skip
async def test_the_other_routes_answer_as_vllms(
    dev_vllm: FakeVLLM, method: str, path: str, body: Any, answer: tuple[int, Any]
) -> None:
    assert await call(dev_vllm, method, path, body) == answer
    seen = dev_vllm.requests[-1]
    assert (seen.path, seen.json) == (path.partition("?")[0], body)


async def test_weight_checker_sums_the_weight_version(dev_vllm: FakeVLLM) -> None:
    status, before = await call(dev_vllm, "POST", "/weight_checker", {"action": "checksum"})
    assert status == 200 and set(before) == {"checksums"}
    same = await call(dev_vllm, "POST", "/weight_checker", {"action": "compare", "baseline": before["checksums"]})
    assert same == (200, {"match": True, "mismatches": []})
    dev_vllm.weight_version = "2"
    changed = await call(dev_vllm, "POST", "/weight_checker", {"action": "compare", "baseline": before["checksums"]})
    assert changed == (200, {"match": False, "mismatches": sorted(before["checksums"])})


async def test_sleep_pauses_and_wake_up_resumes(dev_vllm: FakeVLLM) -> None:
    assert await call(dev_vllm, "POST", "/sleep?level=1&mode=keep") == (200, {"status": "sleeping", "level": 1})
    assert await call(dev_vllm, "GET", "/is_sleeping") == (200, {"is_sleeping": True})
    assert dev_vllm.pause_mode == "keep"
    partly = await call(dev_vllm, "POST", "/wake_up?tags=weights")
    assert partly == (200, {"status": "sleeping", "tags": ["weights"]}) and dev_vllm.pause_mode == "keep"
    assert await call(dev_vllm, "POST", "/wake_up") == (200, {"status": "awake", "tags": None})
    assert await call(dev_vllm, "GET", "/is_sleeping") == (200, {"is_sleeping": False})
    assert await call(dev_vllm, "GET", "/is_paused") == (200, {"is_paused": False})


# --- Generation while paused ---------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("path", list(BODIES))
async def test_abort_ends_every_generation_in_flight_at_once(dev_vllm: FakeVLLM, path: str, stream: bool) -> None:
    dev_vllm.push(Script(content=WORDS, chunk_delay=SLOW))
    reply = asyncio.create_task(generate(dev_vllm, path, stream=stream))
    await asyncio.wait_for(dev_vllm.scheduler.generating(), 5)
    assert await call(dev_vllm, "POST", "/pause?mode=abort") == (200, {"status": "paused"})
    assert not dev_vllm.scheduler.inflight  # /pause answered once the abort had ended it
    got = await asyncio.wait_for(reply, 2)
    n = got.tokens
    assert got.status == 200 and n is not None and 1 <= n < len(pieces(WORDS))
    assert got.text == "".join(pieces(WORDS)[:n])  # the tokens so far
    assert got.finish == (None if path == "/messages" else "abort")  # vLLM's Messages maps no stop reason from it
    if stream and path != "/messages":
        last, usage, done = got.frames[-3:]
        assert done == b"data: [DONE]" and orjson.loads(usage.removeprefix(b"data: "))["choices"] == []
        (finish,) = orjson.loads(last.removeprefix(b"data: "))["choices"]
        assert finish["finish_reason"] == "abort"
    if stream and path == "/messages":
        assert got.frames[-1].startswith(b"event: message_stop")
    assert await call(dev_vllm, "GET", "/is_paused") == (200, {"is_paused": True})


async def test_abort_before_the_first_token_sends_no_finish_chunk(dev_vllm: FakeVLLM, session: Any) -> None:
    """vLLM skips the empty output of a request aborted before its first token: no finish_reason at all."""
    await dev_vllm.pause("keep")
    body = dict(BODIES["/chat/completions"], stream=True, stream_options={"include_usage": True})
    async with session.post(dev_vllm.url + "/chat/completions", json=body) as resp:
        assert resp.status == 200  # the headers go out at once; the first chunk waits for the first token
        await dev_vllm.scheduler.until(lambda: len(dev_vllm.scheduler.inflight) == 1)
        pause = asyncio.create_task(call(dev_vllm, "POST", "/pause?mode=abort"))
        role, usage, done = await asyncio.wait_for(Frames(resp).rest(), 2)
    assert await pause == (200, {"status": "paused"})
    assert done == b"data: [DONE]" and b'"finish_reason":"abort"' not in role + usage
    assert orjson.loads(role.removeprefix(b"data: "))["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert orjson.loads(usage.removeprefix(b"data: "))["usage"]["completion_tokens"] == 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_wait_answers_once_the_generations_in_flight_have_finished(dev_vllm: FakeVLLM, stream: bool) -> None:
    dev_vllm.push(Script(content=" ".join(pieces(WORDS)[:10]), chunk_delay=SLOW))
    reply = asyncio.create_task(generate(dev_vllm, "/chat/completions", stream=stream))
    await asyncio.wait_for(dev_vllm.scheduler.generating(), 5)
    assert await call(dev_vllm, "POST", "/pause?mode=wait") == (200, {"status": "paused"})
    assert not dev_vllm.scheduler.inflight and dev_vllm.pause_mode == "wait"
    got = await asyncio.wait_for(reply, 2)
    assert (got.status, got.text, got.finish, got.tokens) == (200, " ".join(pieces(WORDS)[:10]), "stop", 10)


async def test_keep_freezes_a_stream_that_then_completes_after_resume(dev_vllm: FakeVLLM, session: Any) -> None:
    dev_vllm.weight_version = "1"
    dev_vllm.push(Script(content=" ".join(pieces(WORDS)[:10]), chunk_delay=SLOW))
    body = dict(BODIES["/chat/completions"], stream=True)
    async with session.post(dev_vllm.url + "/chat/completions", json=body, headers={"X-Request-Id": "kept"}) as resp:
        frames = Frames(resp)
        got = [await frames.next(), await frames.next()]  # the role and the first token
        assert await call(dev_vllm, "POST", "/pause?mode=keep") == (200, {"status": "paused"})
        assert await call(dev_vllm, "POST", "/update_weight_version", {"new_version": "2"}) == (
            200, {"success": True, "new_version": "2"},
        )  # fmt: skip
        (kept,) = dev_vllm.scheduler.inflight
        while len(got) < 1 + kept.made:  # what it sent before the pause took hold
            got.append(await frames.next())
        with pytest.raises(TimeoutError):  # frozen: nothing more comes
            await asyncio.wait_for(frames.next(), 0.3)
        assert dev_vllm.sampled_versions["kept"] == ["1"]
        assert await call(dev_vllm, "POST", "/resume") == (200, {"status": "resumed"})
        got += await asyncio.wait_for(frames.rest(), 2)
    assert content(got) == " ".join(pieces(WORDS)[:10])
    assert b'"finish_reason":"stop"' in got[-2] and got[-1] == b"data: [DONE]"
    assert dev_vllm.sampled_versions["kept"] == ["1", "2"]  # its tokens before and after the update


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
async def test_new_requests_while_paused_are_queued_until_resume(dev_vllm: FakeVLLM, mode: str, stream: bool) -> None:
    """vLLM 0.32 queues them (in every mode); they run after /resume, with the weights then loaded."""
    assert await call(dev_vllm, "POST", f"/pause?mode={mode}") == (200, {"status": "paused"})
    reply = asyncio.create_task(generate(dev_vllm, "/chat/completions", stream=stream, rid="queued"))
    await asyncio.wait_for(dev_vllm.scheduler.until(lambda: len(dev_vllm.scheduler.inflight) == 1), 5)
    done, _ = await asyncio.wait({reply}, timeout=0.3)
    assert not done and dev_vllm.sampled_versions["queued"] == []  # held, nothing made yet
    await call(dev_vllm, "POST", "/update_weight_version", {"new_version": "2"})
    assert await call(dev_vllm, "POST", "/resume") == (200, {"status": "resumed"})
    got = await asyncio.wait_for(reply, 2)
    assert (got.status, got.text, got.finish) == (200, "echo: hello there", "stop")
    assert dev_vllm.sampled_versions["queued"] == ["2"]


@pytest.mark.parametrize("mode", ["abort", "wait"])
async def test_vllm_033_refuses_new_requests_in_abort_and_wait_pauses(dev_vllm_033: FakeVLLM, mode: str) -> None:
    assert await call(dev_vllm_033, "POST", f"/pause?mode={mode}") == (200, {"status": "paused"})
    for stream in (False, True):
        got = await generate(dev_vllm_033, "/chat/completions", stream=stream)
        assert (got.status, got.frames) == (503, [PAUSED_503])
    got = await generate(dev_vllm_033, "/messages", stream=False)
    paused = {"type": "error", "error": {"type": "Service Unavailable", "message": PAUSED_MESSAGE}}
    assert (got.status, got.frames) == (503, [paused])
    assert not dev_vllm_033.scheduler.inflight
    await call(dev_vllm_033, "POST", "/resume")
    assert (await generate(dev_vllm_033, "/chat/completions", stream=False)).status == 200


async def test_vllm_033_queues_new_requests_under_keep(dev_vllm_033: FakeVLLM) -> None:
    await call(dev_vllm_033, "POST", "/pause?mode=keep")
    reply = asyncio.create_task(generate(dev_vllm_033, "/chat/completions", stream=False))
    await asyncio.wait_for(dev_vllm_033.scheduler.until(lambda: len(dev_vllm_033.scheduler.inflight) == 1), 5)
    assert not reply.done()
    await call(dev_vllm_033, "POST", "/resume")
    assert (await asyncio.wait_for(reply, 2)).status == 200


async def test_abort_requests_cuts_only_the_ones_named(dev_vllm: FakeVLLM) -> None:
    dev_vllm.push(*(Script(content=" ".join(pieces(WORDS)[:10]), chunk_delay=SLOW) for _ in range(2)))
    cut = asyncio.create_task(generate(dev_vllm, "/chat/completions", stream=True, rid="cut"))
    kept = asyncio.create_task(generate(dev_vllm, "/chat/completions", stream=False, rid="kept"))
    await asyncio.wait_for(dev_vllm.scheduler.generating(2), 5)
    assert await call(dev_vllm, "POST", "/abort_requests", {"request_ids": ["cut"]}) == (
        200, {"status": "aborted", "aborted": 1},
    )  # fmt: skip
    assert (await asyncio.wait_for(cut, 2)).finish == "abort"
    assert (await asyncio.wait_for(kept, 2)).finish == "stop"
    assert dev_vllm.pause_mode is None


async def test_each_reply_records_the_versions_that_sampled_it(dev_vllm: FakeVLLM) -> None:
    dev_vllm.weight_version = "1"
    one = await generate(dev_vllm, "/chat/completions", stream=False, rid="one")
    await call(dev_vllm, "POST", "/update_weight_version", {"new_version": "2"})
    async with aiohttp.ClientSession() as session:
        async with session.post(dev_vllm.url + "/chat/completions", json=BODIES["/chat/completions"]) as resp:
            body = await resp.json()
    assert one.status == resp.status == 200
    assert dev_vllm.sampled_versions == {"one": ["1"], body["id"]: ["2"]}  # no X-Request-Id: the reply's id
    assert not any("version" in key for key in [*body, *body["choices"][0]])  # vLLM 0.32 sends none


# --- How it is started -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("command", "environ", "mounted", "refuses"),
    [
        ("module", {}, False, False),
        ("module", {"VLLM_SERVER_DEV_MODE": "1"}, True, False),
        ("module --dev-mode --paused-503", {}, True, True),
        ("module", {"VLLM_SERVER_DEV_MODE": "1", "FAKE_VLLM_PAUSED_503": "1"}, True, True),
        ("launched", {"VLLM_SERVER_DEV_MODE": "1"}, True, False),
        ("launched", {"VLLM_SERVER_DEV_MODE": "0"}, False, False),
    ],
)
async def test_the_environment_mounts_the_routes_as_vllms_does(
    tmp_path: Path, command: str, environ: dict[str, str], mounted: bool, refuses: bool
) -> None:
    """`python -m gymproxy.testing.fake_vllm` and the `vllm` stand-in gymproxy launches (tests/fake_vllm_serve.py)."""
    from .served import free_port

    port = free_port()
    name, *flags = command.split()
    argv = ["-m", "gymproxy.testing.fake_vllm", *flags] if name == "module" else [str(SERVE), "serve", "m"]
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_SERVER_DEV_MODE", "FAKE_VLLM_PAUSED_503")}
    env.update(environ, FAKE_VLLM_DIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, *argv, "--port", str(port)], env=env, stdout=subprocess.DEVNULL)
    fake = FakeVLLM()
    fake.url = f"http://127.0.0.1:{port}/v1"
    try:
        for _ in range(200):
            try:
                status, body = await call(fake, "GET", "/is_paused")
                break
            except aiohttp.ClientConnectionError:
                await asyncio.sleep(0.05)
        assert (status, body) == ((200, {"is_paused": False}) if mounted else (404, {"detail": "Not Found"}))
        if refuses:
            assert await call(fake, "POST", "/pause?mode=wait") == (200, {"status": "paused"})
            assert (await generate(fake, "/chat/completions", stream=False)).frames == [PAUSED_503]
    finally:
        proc.terminate()
        proc.wait(timeout=5)
