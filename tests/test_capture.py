"""Rollout capture (`capture.enabled`, capture.py, rollouts/): every call that carries a rollout id
is recorded with the exact tokens the fake vLLM returned, the client sees only what it asked for,
and /v1/rollouts gives the rollouts back, rebuilt, frozen and deleted.

gymproxy runs mounted on a real port in front of the fake vLLM (whose chat template keeps token ids
consistent across turns), with the real openai client where a client is the point.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from itertools import pairwise
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import pytest

from gymproxy.rollouts.record import Call
from gymproxy.rollouts.store import Stats
from gymproxy.testing.fake_vllm import FakeVLLM, Script, pieces

from .faults import eventually, start_proxy
from .stores import Backend, RedisServer

CHAT = "/v1/chat/completions"
TOKEN_FIELDS = (b"prompt_token_ids", b"token_ids", b"logprob")


async def gymproxy(aiohttp_server: Any, fake: FakeVLLM, tmp_path: Path, **config: Any) -> tuple[str, Any]:
    capture = {"enabled": True, "store": f"sqlite:///{tmp_path / 'rollouts.db'}", **config.pop("capture", {})}
    return await start_proxy(aiohttp_server, fake.url, capture=capture, health={"interval": 60}, **config)


@pytest.fixture
async def fake(aiohttp_server: Any) -> FakeVLLM:
    fake = FakeVLLM()
    server = await aiohttp_server(fake.app)
    fake.url = str(server.make_url("/v1"))
    return fake


async def rollout(session: aiohttp.ClientSession, url: str, rid: str) -> dict[str, Any]:
    async with session.get(f"{url}/v1/rollouts/{rid}") as r:
        assert r.status == 200, await r.text()
        body: dict[str, Any] = await r.json()
        return body


async def settled(session: aiohttp.ClientSession, url: str, rid: str, calls: int) -> dict[str, Any]:
    """The rollout once `calls` calls have ended (records are written in batches, off the loop)."""
    for _ in range(200):
        async with session.get(f"{url}/v1/rollouts/{rid}") as r:
            if r.status == 200:
                body: dict[str, Any] = await r.json()
                ended = [c for c in body["calls"] if c["outcome"] != "in_flight"]
                if len(ended) >= calls:
                    return body
        await asyncio.sleep(0.02)
    raise AssertionError(f"rollout {rid} never had {calls} ended calls")


def returned(fake: FakeVLLM) -> list[dict[str, Any]]:
    """What the fake returned, in order (its log of every generation's ids)."""
    return list(fake.returned)


def same_tokens(call: dict[str, Any], sent: dict[str, Any]) -> None:
    assert call["prompt_token_ids"] == sent["prompt_token_ids"]
    assert call["generation_token_ids"] == sent["generation_token_ids"]
    assert call["generation_log_probs"] == sent["generation_log_probs"]


# --- what is recorded, and what the client sees ------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_a_chat_call_is_recorded_with_the_tokens_vllm_returned_and_the_client_sees_none(
    aiohttp_server: Any, fake: FakeVLLM, tmp_path: Path, stream: bool
) -> None:
    url, _ = await gymproxy(aiohttp_server, fake, tmp_path)
    body = {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "stream": stream}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/ng-rollout/r-1/v1/chat/completions", json=body) as r:
            assert r.status == 200
            raw = await r.read()
        for field in TOKEN_FIELDS:  # vLLM's nulls stay, but no id nor log prob reaches the client
            for value in (b"[", b"{", b"-", b"0", b"1"):
                assert field + b'":' + value not in raw.replace(b" ", b"")
        got = await settled(session, url, "r-1", 1)
    (call,) = got["calls"]
    assert call["seq"] == 1 and call["route"] == "chat" and call["outcome"] == "ok"
    assert call["finish_reason"] == "stop" and call["stream"] is stream
    assert call["usage"]["completion_tokens"] == len(call["generation_token_ids"]) > 0
    (sent,) = returned(fake)
    same_tokens(call, sent)
    (request,) = [r for r in fake.requests if r.path.endswith(CHAT)]
    assert request.json["return_token_ids"] is True and request.json["logprobs"] is True
    assert request.json["top_logprobs"] == 0


async def test_a_client_that_asked_for_log_probs_still_gets_them(
    aiohttp_server: Any, fake: FakeVLLM, tmp_path: Path
) -> None:
    url, _ = await gymproxy(aiohttp_server, fake, tmp_path)
    async with openai.AsyncOpenAI(base_url=f"{url}/ng-rollout/r-2/v1", api_key="k", max_retries=0) as client:
        reply = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "one two"}], logprobs=True, top_logprobs=2
        )
    choice = reply.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content
    assert not choice.logprobs.content[0].token.startswith("token_id:")  # the text form it asked for
    assert choice.logprobs.content[0].top_logprobs  # its top_logprobs, not capture's 0
    assert getattr(reply, "prompt_token_ids", None) is None  # ids it did not ask for: vLLM's null
    async with aiohttp.ClientSession() as session:
        (call,) = (await settled(session, url, "r-2", 1))["calls"]
    same_tokens(call, returned(fake)[0])


@pytest.mark.parametrize("stream", [False, True])
async def test_a_codex_like_responses_rollout_is_one_segment(
    aiohttp_server: Any, fake: FakeVLLM, tmp_path: Path, stream: bool
) -> None:
    """Three Responses turns (a tool call, its output, an answer) through the openai client: one
    segment, whose mask covers exactly the generated tokens."""
    url, _ = await gymproxy(aiohttp_server, fake, tmp_path)
    tools = [{"type": "function", "name": "exec_command", "parameters": {"type": "object", "properties": {}}}]
    history: list[Any] = [{"role": "user", "content": 'run it [[call:exec_command {"cmd": "ls"}]]'}]
    async with openai.AsyncOpenAI(base_url=f"{url}/ng-rollout/codex-1/v1", api_key="k", max_retries=0) as client:
        for turn in range(3):
            if stream:
                async with client.responses.stream(model="m", input=history, tools=tools) as events:
                    response = await events.get_final_response()
            else:
                response = await client.responses.create(model="m", input=history, tools=tools)
            dumped = orjson.dumps(response.model_dump())
            assert b"token_ids" not in dumped and b"log_probs" not in dumped
            history += [item.model_dump(exclude_none=True) for item in response.output]
            calls = [item for item in response.output if item.type == "function_call"]
            if calls:
                history.append({"type": "function_call_output", "call_id": calls[0].call_id, "output": f"out {turn}"})
            else:
                history.append({"role": "user", "content": "thanks"})
    async with aiohttp.ClientSession() as session:
        got = await settled(session, url, "codex-1", 3)
    assert [c["seq"] for c in got["calls"]] == [1, 2, 3]
    for call, sent in zip(got["calls"], returned(fake), strict=True):
        same_tokens(call, sent)
    assert got["breaks"] == []
    (segment,) = got["segments"]
    assert segment["calls"] == [1, 2, 3]
    assert sum(segment["loss_mask"]) == sum(c["usage"]["completion_tokens"] for c in got["calls"])
    generated = [t for t, m in zip(segment["token_ids"], segment["loss_mask"], strict=True) if m]
    assert generated == [t for c in got["calls"] for t in c["generation_token_ids"]]
    assert got["complete"] is True and got["state"] == "open"


async def test_a_harness_that_rewrites_its_history_shows_the_break_at_that_call_and_position(
    aiohttp_server: Any, fake: FakeVLLM, tmp_path: Path
) -> None:
    """Two turns that extend each other, then a third whose history was rewritten (an earlier user
    turn re-worded, as a compaction does): a new segment, and the break names call 3 and the first
    token that differs, with the windows around it."""
    url, _ = await gymproxy(aiohttp_server, fake, tmp_path)
    history: list[dict[str, Any]] = [{"role": "user", "content": "please look at the files in this folder"}]
    async with aiohttp.ClientSession() as session:
        for turn in range(3):
            if turn == 2:
                history[2] = {"role": "user", "content": "next one, summarised"}
            async with session.post(f"{url}/ng-rollout/rw{CHAT}", json={"model": "m", "messages": history}) as r:
                assert r.status == 200
                history += [(await r.json())["choices"][0]["message"], {"role": "user", "content": f"next {turn}"}]
        got = await settled(session, url, "rw", 3)
    first, second, third = returned(fake)
    expected = second["prompt_token_ids"] + second["generation_token_ids"]
    assert expected[: len(first["prompt_token_ids"])] == first["prompt_token_ids"]
    position = len(first["prompt_token_ids"]) + len(first["generation_token_ids"]) + len(pieces("next"))
    assert expected[:position] == third["prompt_token_ids"][:position]
    assert expected[position] != third["prompt_token_ids"][position]
    (broken,) = got["breaks"]
    assert broken["call"] == 3 and broken["segment"] == 0 and broken["position"] == position
    start = broken["expected_start"]
    assert start == position - 8
    assert broken["expected"] == expected[start : position + 8]
    assert broken["got"] == third["prompt_token_ids"][start : position + 8]
    assert [s["calls"] for s in got["segments"]] == [[1, 2], [3]]


async def test_the_header_names_a_rollout_and_pins_it(aiohttp_server: Any, tmp_path: Path) -> None:
    """`X-Rollout-ID` works as the path prefix does; a rollout with no other key stays on one engine."""
    fakes = []
    for _ in range(3):
        fake = FakeVLLM()
        server = await aiohttp_server(fake.app)
        fake.url = str(server.make_url("/v1"))
        fakes.append(fake)
    capture = {"enabled": True, "store": f"sqlite:///{tmp_path / 'r.db'}"}
    url, _ = await start_proxy(aiohttp_server, [f.url for f in fakes], capture=capture, health={"interval": 60})
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as session:
        for _ in range(6):  # no cookie kept: only the rollout id can pin
            async with session.post(f"{url}{CHAT}", json=body, headers={"X-Rollout-ID": "pinned-7"}) as r:
                assert r.status == 200
            session.cookie_jar.clear()
        got = await settled(session, url, "pinned-7", 6)
        async with session.post(f"{url}{CHAT}", json=body, headers={"X-Rollout-ID": "bad id/"}) as r:
            assert r.status == 400 and "X-Rollout-ID" in (await r.json())["error"]["message"]
    assert len({c["upstream"] for c in got["calls"]}) == 1
    assert sorted(sum(1 for r in f.requests if r.path.endswith(CHAT)) for f in fakes) == [0, 0, 6]


# --- outcomes ------------------------------------------------------------------------------------------


async def test_errors_overflows_and_clients_that_leave_are_recorded_as_such(
    aiohttp_server: Any, fake: FakeVLLM, tmp_path: Path
) -> None:
    url, _ = await gymproxy(aiohttp_server, fake, tmp_path)
    base = f"{url}/ng-rollout/faults/v1/chat/completions"
    async with aiohttp.ClientSession() as session:
        bad = {"model": "m", "messages": [{"role": "user", "content": "[[error:500]]"}]}
        async with session.post(base, json=bad) as r:
            assert r.status == 500
        over = {"model": "m", "messages": [{"role": "user", "content": "[[overflow]]"}]}
        async with session.post(base, json=over) as r:
            assert r.status == 200
        fake.push(Script(content="slow " * 200, chunk_delay=0.02))
        gone = {"model": "m", "messages": [{"role": "user", "content": "go"}], "stream": True}
        async with session.post(base, json=gone) as r:
            await r.content.readany()
        got = await settled(session, url, "faults", 3)
    outcomes = [c["outcome"] for c in got["calls"]]
    assert outcomes == ["error", "overflow", "cut"], outcomes
    assert "500" in got["calls"][0]["error"] or got["calls"][0]["error"]
    assert got["complete"] is False


# --- the routes -----------------------------------------------------------------------------------------


async def test_freeze_is_a_snapshot_and_later_calls_get_409(
    aiohttp_server: Any, fake: FakeVLLM, tmp_path: Path
) -> None:
    url, proxy = await gymproxy(aiohttp_server, fake, tmp_path)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/ng-rollout/f-1{CHAT}", json=body) as r:
            assert r.status == 200
        async with session.post(f"{url}/v1/rollouts/f-1/freeze") as r:
            assert r.status == 200
            frozen = await r.json()
        assert frozen["state"] == "frozen" and len(frozen["calls"]) == 1 and frozen["complete"] is True
        sent = sum(1 for r in fake.requests if r.path.endswith(CHAT))
        async with session.post(f"{url}/ng-rollout/f-1{CHAT}", json=body) as r:
            assert r.status == 409
            error = (await r.json())["error"]
            assert error["code"] == "conflict" and "frozen" in error["message"]
        assert sum(1 for r in fake.requests if r.path.endswith(CHAT)) == sent  # vLLM never saw it
        again = await rollout(session, url, "f-1")
        assert again["calls"] == frozen["calls"] and again["refused"] == 1
        async with session.post(f"{url}/v1/rollouts/nope/freeze") as r:
            assert r.status == 404
    assert proxy.capture.stats.refused == 1


async def test_listing_pages_and_delete(aiohttp_server: Any, fake: FakeVLLM, tmp_path: Path) -> None:
    url, _ = await gymproxy(aiohttp_server, fake, tmp_path)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as session:
        for i in range(5):
            async with session.post(f"{url}/ng-rollout/p-{i}{CHAT}", json=body) as r:
                assert r.status == 200
        await settled(session, url, "p-4", 1)
        seen: list[str] = []
        after = None
        while True:
            query = {"limit": "2", **({"after": after} if after else {})}
            async with session.get(f"{url}/v1/rollouts", params=query) as r:
                page = await r.json()
            seen += [item["rollout_id"] for item in page["data"]]
            if not page["has_more"]:
                break
            after = page["last_id"]
        assert seen == [f"p-{i}" for i in range(5)]
        async with session.delete(f"{url}/v1/rollouts/p-2") as r:
            assert r.status == 200 and (await r.json())["deleted"] is True
        async with session.get(f"{url}/v1/rollouts/p-2") as r:
            assert r.status == 404
        async with session.get(f"{url}/v1/rollouts", params={"limit": "0"}) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "limit"


async def test_the_rollout_routes_need_the_key_and_capture(aiohttp_server: Any, fake: FakeVLLM, tmp_path: Path) -> None:
    url, _ = await gymproxy(aiohttp_server, fake, tmp_path, access={"api_keys": ["sk-1"]})
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{url}/v1/rollouts") as r:
            assert r.status == 401
        async with session.get(f"{url}/v1/rollouts", headers={"Authorization": "Bearer sk-1"}) as r:
            assert r.status == 200
    off, _ = await start_proxy(aiohttp_server, fake.url)
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{off}/v1/rollouts") as r:
            assert r.status == 403 and "capture.enabled" in (await r.json())["error"]["message"]
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        async with session.post(f"{off}/ng-rollout/x/v1/chat/completions", json=body) as r:
            assert r.status == 200  # the prefix is stripped whether or not capture is on
    plain = [r for r in fake.requests if r.path.endswith(CHAT)][-1]
    assert "return_token_ids" not in plain.json and "logprobs" not in plain.json


# --- a store that does not take writes ---------------------------------------------------------------


class DownStore:
    """A store that is down: takes nothing, admits everything."""

    def __init__(self) -> None:
        self.stats = Stats()

    async def start(self) -> None: ...

    def begin(self, call: Call) -> bool:
        return False

    def end(self, call: Call) -> bool:
        return False

    def available(self) -> bool:
        return False

    async def admit(self, rollout_id: str) -> bool:
        return True

    async def close(self) -> None: ...


@pytest.mark.parametrize("required", [False, True])
async def test_a_store_that_is_down_never_fails_a_call_unless_capture_is_required(
    aiohttp_server: Any, fake: FakeVLLM, tmp_path: Path, required: bool
) -> None:
    url, proxy = await gymproxy(aiohttp_server, fake, tmp_path, capture={"required": required})
    await proxy.capture.store.close()
    proxy.capture.store = DownStore()
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/ng-rollout/d{CHAT}", json=body) as r:
            assert r.status == (503 if required else 200)
            if required:
                assert "capture.required" in (await r.json())["error"]["message"]
        async with session.get(f"{url}/metrics") as r:
            text = await r.text()
    sent = sum(1 for r in fake.requests if r.path.endswith(CHAT))
    assert sent == (0 if required else 1)
    if not required:
        assert 'gymproxy_capture_not_recorded_total{reason="not_taken"} 1' in text
        assert await eventually(lambda: proxy.capture.not_recorded == 1)


# --- as `gymproxy serve` runs: load, SIGTERM, SIGKILL -------------------------------------------------


async def turns(session: aiohttp.ClientSession, url: str, rid: str, n: int) -> list[str]:
    """`n` chat turns of one rollout, each sent after the last answered; the reply ids."""
    history: list[dict[str, Any]] = []
    ids = []
    for i in range(n):
        history.append({"role": "user", "content": f"turn {i} of {rid}"})
        body = {"model": "m", "messages": history}
        async with session.post(f"{url}/ng-rollout/{rid}/v1/chat/completions", json=body) as r:
            assert r.status == 200, await r.text()
            reply = await r.json()
        history.append(reply["choices"][0]["message"])
        ids.append(reply["id"])
    return ids


async def test_a_thousand_concurrent_rollouts_lose_no_call_and_sigterm_flushes(
    aiohttp_server: Any, fake: FakeVLLM, tmp_path: Path
) -> None:
    """1,000 rollouts of 10 calls at once through `gymproxy serve`; SIGTERM right after the last
    answer: every call is in the store, whole."""
    from .served import Served

    db = tmp_path / "load.db"
    config = {"base_url": fake.url, "capture": {"enabled": True, "store": f"sqlite:///{db}"}}
    async with Served(tmp_path, config) as served:
        connector = aiohttp.TCPConnector(limit=200)
        async with aiohttp.ClientSession(connector=connector) as session:
            await asyncio.gather(*(turns(session, served.url, f"load-{i:04}", 10) for i in range(1000)))
        served.terminate()
        assert await served.wait(60) == 0
    from gymproxy.rollouts.sqlite_store import SQLiteStore
    from gymproxy.rollouts.store import Bounds

    store = SQLiteStore(f"sqlite:///{db}", Bounds())
    await store.start()
    page = await store.list(after=None, limit=2000)
    assert len(page) == 1000 and all(s.calls == 10 and s.complete for s in page)
    one = await store.get("load-0500")
    assert one is not None and [c.seq for c in one.calls] == list(range(1, 11))
    assert all(c.outcome == "ok" and c.generation_token_ids for c in one.calls)
    await store.close()


async def test_after_sigkill_and_a_restart_every_committed_call_is_readable(
    aiohttp_server: Any, fake: FakeVLLM, tmp_path: Path, backend: Backend
) -> None:
    from .served import Served, free_port

    port = free_port()
    config = {"base_url": fake.url, "port": port, "capture": {"enabled": True, "store": backend.url("killed")}}
    seen: dict[str, list[dict[str, Any]]] = {}
    async with Served(tmp_path, dict(config)) as served:
        async with aiohttp.ClientSession() as session:
            work = [asyncio.ensure_future(turns(session, served.url, f"k-{i}", 1000)) for i in range(20)]
            await asyncio.sleep(2)
            for i in range(20):  # what is committed now
                async with session.get(f"{served.url}/v1/rollouts/k-{i}") as r:
                    if r.status == 200:
                        seen[f"k-{i}"] = [c for c in (await r.json())["calls"] if c["outcome"] == "ok"]
            assert served.process is not None
            served.process.kill()
            await served.wait(30)
            for task in work:
                task.cancel()
            await asyncio.gather(*work, return_exceptions=True)
    assert sum(len(calls) for calls in seen.values()) > 20
    async with Served(tmp_path, dict(config)) as again:
        async with aiohttp.ClientSession() as session:
            for rid, calls in seen.items():
                got = await rollout(session, again.url, rid)
                kept = {c["call_id"]: c for c in got["calls"]}
                for call in calls:
                    assert kept[call["call_id"]] == call
                assert [c["seq"] for c in got["calls"]] == list(range(1, len(got["calls"]) + 1))


async def test_a_store_that_stalls_for_5_s_leaves_other_requests_their_latency(
    aiohttp_server: Any, fake: FakeVLLM, tmp_path: Path, backend: Backend
) -> None:
    """SQLite's writer waits on a lock, redis-server is stopped (SIGSTOP): for 5 s nothing is written,
    and neither captured calls nor /health wait for it."""
    import time

    url, proxy = await gymproxy(aiohttp_server, fake, tmp_path, capture={"store": backend.url("rollouts")})
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/ng-rollout/warm{CHAT}", json=body) as r:
            assert r.status == 200
        await settled(session, url, "warm", 1)
        worst, made = 0.0, 0
        with backend.stalled("rollouts"):
            stalled = time.monotonic()
            while time.monotonic() - stalled < 5:
                made += 1
                began = time.monotonic()
                async with session.post(f"{url}/ng-rollout/during{CHAT}", json=body) as r:
                    assert r.status == 200
                async with session.get(f"{url}/health") as r:
                    assert r.status == 200
                worst = max(worst, time.monotonic() - began)
        recorded = await settled(session, url, "during", made)
    # Blocked, they would wait out the 5 s stall; the bound leaves room for a loaded machine.
    assert worst < 2.0, f"a call and a /health took {worst:.3f} s while the store stalled"
    assert all(c["outcome"] == "ok" for c in recorded["calls"]) and len(recorded["calls"]) == made > 10
    assert proxy.capture.stats.failed == 0


# --- the shared store: several processes, a Redis that is down -----------------------------------------


async def test_two_workers_record_200_rollouts_of_5_calls_each_whole(
    fake: FakeVLLM, tmp_path: Path, backend: Backend
) -> None:
    """`gymproxy serve --workers 2` on one store (Redis, or one SQLite file): each call on a new
    connection, so the kernel spreads a rollout's calls over both workers; every rollout is whole,
    its calls numbered 1 to 5 in turn order, each holding exactly the tokens the fake vLLM returned."""
    import re

    from .served import Served

    config = {"base_url": fake.url, "access_log": True, "capture": {"enabled": True, "store": backend.url("workers")}}
    served = Served(tmp_path, config, "--workers", "2")
    async with served:
        for _ in range(400):
            if served.log.count(" listening on http://") >= 2:  # each worker's
                break
            await asyncio.sleep(0.05)
        connector = aiohttp.TCPConnector(force_close=True)  # a new connection for every call
        async with aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar()) as session:
            gate = asyncio.Semaphore(40)

            async def rollout_of_5(rid: str) -> None:
                async with gate:
                    await turns(session, served.url, rid, 5)

            await asyncio.gather(*(rollout_of_5(f"w-{i:03}") for i in range(200)))
    served_by = re.findall(r"gymproxy\.access \[w(\d)\]: .* method=POST .* session=(w-\d+) ", served.log)
    workers_of: dict[str, set[str]] = {}
    for worker, rid in served_by:
        workers_of.setdefault(rid, set()).add(worker)
    assert len(served_by) == 1000 and len(workers_of) == 200
    assert sum(len(w) == 2 for w in workers_of.values()) > 100  # most rollouts ran on both workers
    store = await backend.opened("workers")  # after SIGTERM: every worker flushed
    page = await store.list(after=None, limit=1000)
    assert len(page) == 200 and all(s.calls == 5 and s.complete for s in page)
    recorded = []
    for summary in page:
        rollout = await store.get(summary.rollout_id)
        assert rollout is not None and [c.seq for c in rollout.calls] == [1, 2, 3, 4, 5]
        assert all(c.outcome == "ok" for c in rollout.calls)
        for earlier, later in pairwise(rollout.calls):  # each turn's prompt holds the turn before, whole
            held = (earlier.prompt_token_ids or []) + (earlier.generation_token_ids or [])
            assert (later.prompt_token_ids or [])[: len(held)] == held
        recorded += [
            (tuple(c.prompt_token_ids or ()), tuple(c.generation_token_ids or ()), tuple(c.generation_log_probs or ()))
            for c in rollout.calls
        ]
    sent = [
        (tuple(r["prompt_token_ids"]), tuple(r["generation_token_ids"]), tuple(r["generation_log_probs"] or ()))
        for r in fake.returned
    ]
    assert len(sent) == 1000 and Counter(recorded) == Counter(sent)


@pytest.mark.parametrize("required", [False, True])
async def test_a_redis_that_is_down_never_fails_a_call_unless_capture_is_required(
    aiohttp_server: Any, fake: FakeVLLM, tmp_path: Path, required: bool
) -> None:
    """Redis down at startup: gymproxy serves; a call's records wait in the queue (up to
    capture.max_pending, past it they are counted as not recorded) and are written once Redis is
    up; with capture.required the call is a 503 before vLLM sees it."""
    redis = RedisServer(tmp_path / "redis")  # not started
    capture = {"store": redis.url(), "required": required, "max_pending": 16}
    url, proxy = await gymproxy(aiohttp_server, fake, tmp_path, capture=capture)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(12):  # 24 records: 16 wait, 8 are not taken
                async with session.post(f"{url}/ng-rollout/d{CHAT}", json=body) as r:
                    assert r.status == (503 if required else 200)
                    if required:
                        assert "capture.required" in (await r.json())["error"]["message"]
            async with session.get(f"{url}/v1/rollouts/d") as r:
                assert r.status == 503 and "unreachable" in (await r.json())["error"]["message"]
            async with session.get(f"{url}/metrics") as r:
                text = await r.text()
            sent = sum(1 for r in fake.requests if r.path.endswith(CHAT))
            assert sent == (0 if required else 12)
            if required:
                return
            assert 'gymproxy_capture_not_recorded_total{reason="not_taken"} 4' in text  # 4 calls' records
            redis.start()
            got = await settled(session, url, "d", 8)
            assert [c["seq"] for c in got["calls"]] == list(range(1, 9))
            async with session.post(f"{url}/ng-rollout/d{CHAT}", json=body) as r:
                assert r.status == 200
            assert len((await settled(session, url, "d", 9))["calls"]) == 9
    finally:
        await proxy.capture.close()
        redis.stop()
