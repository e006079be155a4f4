"""gymproxy's log as `gymproxy serve` writes it: level, json format, worker labels, the access line."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson

from .faults import eventually
from .served import Served


async def test_json_access_lines_carry_what_finds_a_slow_rollout(fake_vllm, tmp_path):
    config = {"base_url": fake_vllm.url}
    async with Served(tmp_path, config, "--access-log", "--log-format", "json") as served:
        async with aiohttp.ClientSession() as session:
            body = {"model": "m", "input": "hi", "prompt_cache_key": "rollout-7"}
            async with session.post(served.url + "/v1/responses", json=body, headers={"X-Request-Id": "r-1"}) as r:
                assert r.status == 200
            async with session.post(served.url + "/v1/chat/completions", json={"model": "m"}) as r:
                assert r.status == 400  # no messages
            fake_vllm.push()  # nothing queued: the overflow directive answers
            over = {"model": "m", "messages": [{"role": "user", "content": "[[overflow]]"}]}
            async with session.post(served.url + "/v1/chat/completions", json=over) as r:
                assert r.status == 200
        assert await eventually(lambda: served.log.count('"gymproxy.access"') >= 3, seconds=30)
    lines = [orjson.loads(line) for line in served.log.splitlines() if line.startswith("{")]
    assert lines and all({"time", "level", "logger", "message"} <= line.keys() for line in lines)
    access = [line for line in lines if line["logger"] == "gymproxy.access"]
    first = next(line for line in access if line["request_id"] == "r-1")
    assert first["route"] == "/v1/responses" and first["status"] == 200 and first["outcome"] == "ok"
    assert first["upstream"] == fake_vllm.url and first["session"] == "rollout-7" and first["model"] == "m"
    assert first["prompt_tokens"] > 0 and first["completion_tokens"] > 0 and first["duration_ms"] > 0
    assert any(line["status"] == 400 and line["outcome"] == "error" for line in access)
    assert any(line.get("outcome") == "overflow" for line in access)  # an empty answer, logged as what it was


async def test_each_worker_labels_its_lines_and_the_level_is_kept(fake_vllm, tmp_path):
    config = {"base_url": fake_vllm.url}
    quiet = Served(tmp_path, config, "--workers", "2", "--log-level", "warning")
    quiet.start()  # its "listening on" line is an info line: it is served once /livez answers
    try:
        async with aiohttp.ClientSession() as session:

            async def live() -> bool:
                try:
                    async with session.get(quiet.url + "/livez") as r:
                        return r.status == 200
                except aiohttp.ClientConnectionError:
                    return False

            for _ in range(200):
                if await live():
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError(quiet.log[-2000:])
    finally:
        quiet.terminate()
        assert await quiet.wait(20) == 0
    assert "listening on" not in quiet.log and " INFO " not in quiet.log, quiet.log[-2000:]
    async with Served(tmp_path, config, "--workers", "2") as served:
        assert await eventually(lambda: served.log.count("listening on") == 2, seconds=30)  # each worker says it
    listening = [line for line in served.log.splitlines() if "listening on" in line]
    assert sorted(" [w0]" in line for line in listening) == [False, True]  # once as w0, once as w1
    assert all(" [w0]" in line or " [w1]" in line for line in listening)
