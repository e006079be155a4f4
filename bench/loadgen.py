"""A closed-loop load generator: N keep-alive connections, each sending the next request as soon
as the previous reply has been read in full, for a warm-up and then a measured window. With a
`rate`, requests are also spaced to that many per second in total (while the target keeps up), so
that targets of different speed can be compared doing the same work per second.

Only requests that complete inside the window count. The CPU probe is read at the window's two
edges, so its difference is the CPU each process spent serving exactly those requests.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

HEADERS = {"Content-Type": "application/json", "Authorization": "Bearer bench"}
DONE_FRAME = b"data: [DONE]\n\n"
COMPLETED = b"event: response.completed\n"


@dataclass
class Window:
    """What one measured window saw."""

    seconds: float = 0.0
    requests: int = 0
    errors: int = 0
    first_error: str | None = None
    latencies: list[float] = field(default_factory=list)  # seconds
    ttfbs: list[float] = field(default_factory=list)  # seconds to the first body byte (streams)
    frames: int = 0  # SSE `data:` frames received, [DONE] excluded
    cpu: dict[str, float] = field(default_factory=dict)  # process name -> CPU seconds in the window

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def session(concurrency: int) -> aiohttp.ClientSession:
    """The load generator's client: one connection per worker, kept alive, cookies kept.

    Keeping cookies (gymproxy's pin cookie, set for 127.0.0.1, which aiohttp's default jar would
    refuse) makes requests look like those of an OpenAI client with its cookie jar.
    """
    connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=0, keepalive_timeout=30)
    timeout = aiohttp.ClientTimeout(total=120)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, cookie_jar=aiohttp.CookieJar(unsafe=True))


def complete(data: bytes, *, stream: bool, responses: bool) -> bool:
    """A cheap check that a reply is whole: a JSON object, or a stream with its proper end."""
    if not stream:
        return data[:1] == b"{"
    if responses:
        return data.rfind(COMPLETED) >= 0
    return data.endswith(DONE_FRAME)


async def drive(
    client: aiohttp.ClientSession,
    url: str,
    body: bytes,
    *,
    stream: bool,
    responses: bool,
    concurrency: int,
    warmup: float,
    duration: float,
    probe: Callable[[], dict[str, float]],
    rate: float | None = None,
    rollouts: int = 0,
) -> Window:
    """Keep `concurrency` requests in flight for `warmup` + `duration` seconds; measure the latter.
    With `rollouts`, each worker's requests carry `X-Rollout-ID`, a new one every `rollouts` calls
    (what a captured rollout sends)."""
    window = Window()
    recording = False
    stopping = False
    sent = 0  # requests started, for the pacing of `rate`
    origin = time.perf_counter()

    def failed(message: str) -> None:
        if recording:
            window.errors += 1
            window.first_error = window.first_error or message

    async def worker(index: int) -> None:
        nonlocal sent
        calls = 0
        headers = HEADERS
        while not stopping:
            if rollouts:
                headers = {**HEADERS, "X-Rollout-ID": f"bench-{origin:.0f}-{index}-{calls // rollouts}"}
                calls += 1
            if rate:
                slot, sent = origin + sent / rate, sent + 1
                if slot > time.perf_counter():
                    await asyncio.sleep(slot - time.perf_counter())
                if stopping:
                    return
            start = time.perf_counter()
            first = 0.0
            try:
                async with client.post(url, data=body, headers=headers) as reply:
                    if stream:
                        parts: list[bytes] = []
                        async for part in reply.content.iter_any():
                            if not parts:
                                first = time.perf_counter()
                            parts.append(part)
                        data = b"".join(parts)
                    else:
                        data = await reply.read()
                    status = reply.status
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                failed(f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(0.05)
                continue
            end = time.perf_counter()
            if not recording:
                continue
            if status != 200 or not complete(data, stream=stream, responses=responses):
                failed(f"HTTP {status}: {data[:300]!r}")
                continue
            window.requests += 1
            window.latencies.append(end - start)
            if stream:
                window.ttfbs.append(first - start)
                window.frames += data.count(b"data: ") - data.count(DONE_FRAME)

    tasks = [asyncio.ensure_future(worker(i)) for i in range(concurrency)]
    try:
        await asyncio.sleep(warmup)
        before, started = probe(), time.perf_counter()
        recording = True
        await asyncio.sleep(duration)
        recording = False
        after, window.seconds = probe(), time.perf_counter() - started
        window.cpu = {name: after[name] - before[name] for name in after}
        stopping = True
        await asyncio.wait(tasks, timeout=60)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return window
