"""The load scenario shared by `tests/test_load.py` (modest size) and `bench/soak.py` (full size).

Everything runs in the calling event loop: several fake vLLMs, gymproxy mounted with
`gymproxy.setup` (so its `Proxy` and connection pool can be inspected), and the clients.

Phases:
1. sessions: N concurrent multi-turn sessions (streaming; even ones on /v1/responses, odd ones on
   /v1/chat/completions), each pinned by the `gymproxy_pin` cookie from its first turn. Every
   prompt carries the session id, so the fakes' request logs show which upstream served it.
2. requests: M more requests, C at a time, mixing both endpoints, streamed and not, half of them
   sent with a session's cookie (and that session's id in the prompt).
3. abandon: A clients open slow streams and disconnect after the first bytes; each upstream must
   see the disconnect and the proxy must hold no upstream connection afterwards.
Then open file descriptors and RSS are compared with their baseline.
"""

from __future__ import annotations

import asyncio
import gc
import os
import random
import re
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web

import gymproxy
from gymproxy.pinning import Signer
from gymproxy.testing.fake_vllm import FakeVLLM, Script

from .faults import CHAT, RESPONSES, acquired, sse_data

SECRET = "load-test-secret"
COOKIE = "gymproxy_pin"
SID = re.compile(rb"\bs(\d{6})x\b")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


@dataclass
class LoadReport:
    sessions: int = 0
    turns: int = 0
    requests: int = 0
    abandoned: int = 0
    ok: int = 0
    errors: list[str] = field(default_factory=list)
    error_count: int = 0
    sessions_moved: int = 0  # sessions served by more than one upstream
    sessions_short: int = 0  # sessions with fewer generations upstream than they sent
    upstream_generations: int = 0
    generations_expected: int = 0
    disconnects: int = 0
    acquired_after: int = 0
    inflight_after: int = 0
    fds: tuple[int, int, int] = (0, 0, 0)  # baseline, peak seen, after
    rss: tuple[float, float, float] = (0.0, 0.0, 0.0)  # MiB: baseline, peak seen, after
    seconds: dict[str, float] = field(default_factory=dict)
    spread: list[int] = field(default_factory=list)  # sessions per upstream

    def error(self, message: str) -> None:
        self.error_count += 1
        if len(self.errors) < 20:
            self.errors.append(message)

    def lines(self) -> list[str]:
        phases = ", ".join(f"{k} {v:.1f} s" for k, v in self.seconds.items())
        return [
            f"sessions: {self.sessions} x {self.turns} turns, then {self.requests} requests, then {self.abandoned} abandoned streams ({phases})",
            f"answers ok: {self.ok}, errors: {self.error_count}, sessions moved: {self.sessions_moved}, "
            f"sessions short: {self.sessions_short}, sessions per upstream: {self.spread}",
            f"upstream generations: {self.upstream_generations} (expected {self.generations_expected}), "
            f"disconnects seen upstream: {self.disconnects}/{self.abandoned}, connections held after: {self.acquired_after}, "
            f"in flight after: {self.inflight_after}",
            f"open fds: baseline {self.fds[0]}, peak {self.fds[1]}, after {self.fds[2]}; "
            f"RSS MiB: baseline {self.rss[0]:.0f}, peak {self.rss[1]:.0f}, after {self.rss[2]:.0f}",
            *(f"error: {e}" for e in self.errors),
        ]


def _body(path: str, history: list[tuple[str, str]], text: str, stream: bool) -> bytes:
    if path == RESPONSES:
        items: list[dict[str, Any]] = []
        for user, answer in history:
            items += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        items.append({"role": "user", "content": text})
        body: dict[str, Any] = {"model": "m", "input": items}
    else:
        messages: list[dict[str, Any]] = []
        for user, answer in history:
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        messages.append({"role": "user", "content": text})
        body = {"model": "m", "messages": messages}
    if stream:
        body["stream"] = True
    return orjson.dumps(body)


def _answer(path: str, stream: bool, status: int, raw: bytes) -> str:
    """The answer text of a good reply; raises ValueError describing a bad one."""
    if status != 200:
        raise ValueError(f"HTTP {status}: {raw[:200]!r}")
    if not stream:
        body = orjson.loads(raw)
        if path == RESPONSES:
            if body.get("status") != "completed":
                raise ValueError(f"status {body.get('status')}")
            return "".join(p["text"] for i in body["output"] if i["type"] == "message" for p in i["content"])
        return body["choices"][0]["message"]["content"]
    data = sse_data(raw)
    if path == RESPONSES:
        events = [orjson.loads(d) for d in data]
        if not events or events[-1]["type"] != "response.completed":
            raise ValueError(f"stream ended with {events[-1]['type'] if events else 'nothing'}")
        return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    if not data or data[-1] != b"[DONE]":
        raise ValueError("chat stream without [DONE]")
    chunks = [orjson.loads(d) for d in data[:-1]]
    if any("error" in c for c in chunks):
        raise ValueError(f"chat stream error: {chunks[-1]}")
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))


class Load:
    def __init__(
        self,
        *,
        upstreams: int,
        keepalive: float,
        backlog: int,
        health: dict[str, float] | None = None,
        pinning: dict[str, Any] | None = None,
    ) -> None:
        self.health = health
        self.pinning = {"secret": SECRET, **(pinning or {})}
        self.n_upstreams = upstreams
        self.keepalive = keepalive
        self.backlog = backlog
        self.fakes: list[FakeVLLM] = []
        self.runners: list[web.AppRunner] = []
        self.proxy: Any = None
        self.url = ""
        self.report = LoadReport()
        self.peak_fds = 0
        self.peak_rss = 0.0

    async def start(self) -> None:
        for i in range(self.n_upstreams):
            fake = FakeVLLM(model=f"m{i}")
            runner = web.AppRunner(fake.app, handler_cancellation=True, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0, backlog=self.backlog).start()
            fake.url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
            self.fakes.append(fake)
            self.runners.append(runner)
        config = gymproxy.build_config(
            {
                "base_url": [f.url for f in self.fakes],
                "pinning": self.pinning,
                "timeouts": {"keepalive": self.keepalive},
                **({"health": self.health} if self.health else {}),
            },
            environ={},
        )
        app = web.Application(client_max_size=config.max_body_size)
        self.proxy = gymproxy.setup(app, config)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0, backlog=self.backlog).start()
        self.runners.append(runner)
        self.url = f"http://127.0.0.1:{runner.addresses[0][1]}"

    async def close(self) -> None:
        for runner in reversed(self.runners):
            await runner.cleanup()

    def sample(self) -> None:
        self.peak_fds = max(self.peak_fds, open_fds())
        self.peak_rss = max(self.peak_rss, rss_mb())

    async def sampler(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(0.2)

    async def post(
        self, client: aiohttp.ClientSession, path: str, body: bytes, cookie: str | None
    ) -> tuple[int, bytes, str | None]:
        headers = {"Content-Type": "application/json"}
        if cookie is not None:
            headers["Cookie"] = f"{COOKIE}={cookie}"
        async with client.post(self.url + path, data=body, headers=headers) as r:
            raw = await r.read()
            morsel = r.cookies.get(COOKIE)
            return r.status, raw, morsel.value if morsel is not None else None

    async def one(
        self, client: aiohttp.ClientSession, path: str, body: bytes, cookie: str | None, stream: bool, expect: str
    ) -> str | None:
        """One request; returns the new pin cookie if one was set. Errors are recorded."""
        try:
            status, raw, pin = await self.post(client, path, body, cookie)
            answer = _answer(path, stream, status, raw)
            if answer != expect:
                raise ValueError(f"answer {answer!r} != {expect!r}")
        except Exception as exc:  # noqa: BLE001 - every failure is a counted error
            self.report.error(f"{path} stream={stream}: {type(exc).__name__}: {exc}")
            return None
        self.report.ok += 1
        return pin

    async def session(self, client: aiohttp.ClientSession, index: int, turns: int, cookies: dict[int, str]) -> None:
        sid = f"s{index:06d}x"
        path = RESPONSES if index % 2 == 0 else CHAT
        history: list[tuple[str, str]] = []
        cookie: str | None = None
        for turn in range(turns):
            text = f"{sid} turn {turn}"
            pin = await self.one(client, path, _body(path, history, text, True), cookie, True, f"echo: {text}")
            if turn == 0:
                if pin is None:
                    self.report.error(f"{sid}: no pin cookie on the first turn")
                    return
                cookie = cookies[index] = pin
            elif pin is not None:
                self.report.error(f"{sid}: a valid pin was replaced on turn {turn}")
            history.append((text, f"echo: {text}"))

    async def requests(
        self, client: aiohttp.ClientSession, total: int, concurrency: int, cookies: dict[int, str], pinned: Counter[int]
    ) -> None:
        counter = iter(range(total))
        rng = random.Random(1234)
        sessions = sorted(cookies)

        async def worker() -> None:
            for k in counter:
                path = (RESPONSES, CHAT)[k % 2]
                stream = k % 4 < 2
                if k % 3 != 2 and sessions:
                    index = rng.choice(sessions)
                    pinned[index] += 1
                    text, cookie = f"s{index:06d}x request {k}", cookies[index]
                else:
                    text, cookie = f"request {k}", None
                await self.one(client, path, _body(path, [], text, stream), cookie, stream, f"echo: {text}")

        await asyncio.gather(*(worker() for _ in range(concurrency)))

    async def abandon(self, client: aiohttp.ClientSession, count: int) -> None:
        signer = Signer(SECRET.encode(), 3600)
        slow = Script(content=" ".join(["slow"] * 400), chunk_delay=0.02)

        async def leave(i: int) -> None:
            fake = self.fakes[i % len(self.fakes)]
            path = (RESPONSES, CHAT)[i % 2]
            headers = {"Content-Type": "application/json", "Cookie": f"{COOKIE}={signer.sign(fake.url)}"}
            try:
                async with client.post(
                    self.url + path, data=_body(path, [], f"abandon {i}", True), headers=headers
                ) as r:
                    if r.status != 200:
                        raise ValueError(f"HTTP {r.status}")
                    await r.content.readany()
                    r.close()  # the client goes away mid-stream
            except Exception as exc:  # noqa: BLE001
                self.report.error(f"abandon {i}: {type(exc).__name__}: {exc}")

        for i in range(count):
            self.fakes[i % len(self.fakes)].push(slow)
        await asyncio.gather(*(leave(i) for i in range(count)))


def _generations(fake: FakeVLLM) -> int:
    return sum(1 for r in fake.requests if r.path == "/v1/chat/completions")


async def run(
    *,
    sessions: int = 200,
    requests: int = 2000,
    upstreams: int = 3,
    turns: int = 3,
    abandon: int = 30,
    concurrency: int = 200,
    keepalive: float = 1.0,
    settle: float = 15.0,
    fd_slack: int = 16,
    health: dict[str, float] | None = None,
    pinning: dict[str, Any] | None = None,
    phase_done: Callable[[str, int], None] = lambda phase, requests: None,
) -> LoadReport:
    """Run the phases; `phase_done(phase, requests it sent)` is told as each one ends (bench/soak.py's progress)."""
    backlog = max(1024, sessions + abandon)
    load = Load(upstreams=upstreams, keepalive=keepalive, backlog=backlog, health=health, pinning=pinning)
    report = load.report
    report.sessions, report.turns, report.requests, report.abandoned = sessions, turns, requests, abandon
    await load.start()
    sampler = None
    try:
        # Warm up, let idle connections expire, then take the baseline.
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as warm:
            for path in (RESPONSES, CHAT):
                for stream in (False, True):
                    await load.one(warm, path, _body(path, [], "warm up", stream), None, stream, "echo: warm up")
        await _settle(load, None, keepalive * 2 + 1, fd_slack)
        gc.collect()
        base_fds, base_rss = open_fds(), rss_mb()
        phase_done("warm-up and baseline", 0)
        base_generations = sum(_generations(f) for f in load.fakes)
        sampler = asyncio.ensure_future(load.sampler())

        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30)
        timeout = aiohttp.ClientTimeout(total=300)
        cookies: dict[int, str] = {}
        pinned: Counter[int] = Counter()
        async with aiohttp.ClientSession(
            connector=connector, timeout=timeout, cookie_jar=aiohttp.DummyCookieJar()
        ) as client:
            started = time.monotonic()
            await asyncio.gather(*(load.session(client, i, turns, cookies) for i in range(sessions)))
            report.seconds["sessions"] = time.monotonic() - started
            phase_done("sessions", sessions * turns)

            started = time.monotonic()
            await load.requests(client, requests, concurrency, cookies, pinned)
            report.seconds["requests"] = time.monotonic() - started
            phase_done("requests", requests)

            started = time.monotonic()
            lost_before = sum(len(f.disconnects) for f in load.fakes)
            await load.abandon(client, abandon)
            deadline = time.monotonic() + settle
            while time.monotonic() < deadline:
                report.disconnects = sum(len(f.disconnects) for f in load.fakes) - lost_before
                if report.disconnects >= abandon and acquired(load.proxy) == 0:
                    break
                await asyncio.sleep(0.05)
            report.disconnects = sum(len(f.disconnects) for f in load.fakes) - lost_before
            report.acquired_after = acquired(load.proxy)
            report.inflight_after = sum(u.inflight for u in load.proxy.fleet.upstreams)
            report.seconds["abandon"] = time.monotonic() - started
            phase_done("abandon", abandon)

        # Which upstream served each session: every prompt names its session.
        seen: dict[int, set[int]] = defaultdict(set)
        count: Counter[int] = Counter()
        for u, fake in enumerate(load.fakes):
            for r in fake.requests:
                if r.path != "/v1/chat/completions":
                    continue
                for sid in {int(m) for m in SID.findall(r.body)}:
                    seen[sid].add(u)
                    count[sid] += 1
        report.sessions_moved = sum(1 for s in range(sessions) if len(seen[s]) > 1)
        report.sessions_short = sum(1 for s in range(sessions) if count[s] < turns + pinned[s])
        report.spread = [sum(1 for s in range(sessions) if seen[s] == {u}) for u in range(upstreams)]
        report.upstream_generations = sum(_generations(f) for f in load.fakes) - base_generations
        report.generations_expected = sessions * turns + requests + abandon
        for fake in load.fakes:  # the logs are the fakes' memory, not gymproxy's
            fake.requests.clear()
            fake.disconnects.clear()

        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
        after_fds = await _settle(load, base_fds, settle, fd_slack)
        gc.collect()
        phase_done("open fds back near the baseline", 0)
        report.fds = (base_fds, load.peak_fds, after_fds)
        report.rss = (base_rss, load.peak_rss, rss_mb())
    finally:
        if sampler is not None and not sampler.done():
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
        await load.close()
    return report


async def _settle(load: Load, baseline: int | None, seconds: float, slack: int) -> int:
    """Wait for idle upstream connections to expire: until fds are back near `baseline` (or,
    without one, stop falling), at most `seconds`. Returns the last count."""
    deadline = time.monotonic() + seconds
    last = open_fds()
    steady = 0
    while time.monotonic() < deadline:
        await asyncio.sleep(0.25)
        now = open_fds()
        if baseline is not None and now <= baseline + slack and acquired(load.proxy) == 0:
            return now
        steady = steady + 1 if now >= last else 0
        if baseline is None and steady >= 8:
            return now
        last = now
    return open_fds()
