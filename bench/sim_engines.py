"""Simulated vLLM engines: N OpenAI chat servers in one asyncio process, timed by sleeps.

Each engine runs a continuous batch. A decode step takes `(base + per_seq * batch) * slowdown`
seconds and gives every running sequence one token. A new request first pays for its uncached
prompt tokens (`prefill * uncached * slowdown`); cached 16-token blocks are free. With
`gpu_prefill` that prefill stalls the whole batch (it is added to the next step, as an unchunked
prefill does on a GPU); without it, only the request itself waits.

Tokens are words: a message is `<|role|>` followed by its words, so two prompts share a prefix
exactly when their texts do. Each engine keeps an LRU of block hashes (chained, like vLLM's), fed
with the prompt's blocks at admission and the prompt + answer blocks at completion.

A control server (`--control-port`) answers `GET /health`, `GET /stats` (per engine: its counters
and the request ids it completed), `POST /kill/{i}` (the engine closes its listener and resets
every connection, failing what was in flight) and `POST /start/{i}` (a late engine starts: the
"engine added" scenario).

    python bench/sim_engines.py --control-port 9000 --spec '[{"port": 9001}, {"port": 9002}]'
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import socket
import struct
import time
import zlib
from typing import Any

from aiohttp import web

BLOCK = 16
MAX_LAG = 0.1  # seconds an engine may fall behind its virtual clock before it stops catching up


def prompt_tokens(messages: list[dict[str, Any]]) -> list[str]:
    """The pseudo-tokens of a chat prompt: a role marker, then one token a word."""
    tokens: list[str] = []
    for message in messages:
        tokens.append(f"<|{message.get('role', 'user')}|>")
        content = message.get("content") or ""
        if isinstance(content, list):
            content = " ".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
        tokens += str(content).split()
    return tokens


def block_hashes(tokens: list[str]) -> list[int]:
    """Chained hashes of the full 16-token blocks: a block's hash depends on everything before it."""
    out, prev = [], 0
    for i in range(0, len(tokens) - BLOCK + 1, BLOCK):
        prev = hash((prev, *tokens[i : i + BLOCK]))
        out.append(prev)
    return out


class Seq:
    """One request in an engine: what it asks for, how far it got, how its handler hears of it."""

    __slots__ = ("rid", "tokens", "max_tokens", "generated", "ready_at", "done", "chunks", "cached", "words")

    def __init__(self, rid: str, tokens: list[str], max_tokens: int, stream: bool) -> None:
        self.rid = rid
        self.tokens = tokens
        self.max_tokens = max_tokens
        self.generated = 0
        self.ready_at = 0.0
        self.cached = 0
        self.done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self.chunks: asyncio.Queue[str | None] | None = asyncio.Queue() if stream else None
        seed = zlib.crc32(" ".join(tokens[-BLOCK:]).encode())
        rng = random.Random(seed)
        self.words = [f"a{rng.randrange(5000)}" for _ in range(max_tokens)]


class Engine:
    """One simulated vLLM server on its own port."""

    def __init__(self, index: int, spec: dict[str, Any]) -> None:
        self.index = index
        self.name = spec.get("name", f"e{index}")
        self.port = int(spec["port"])
        self.slowdown = float(spec.get("slowdown", 1.0))
        self.base = float(spec.get("step_base", 0.012))
        self.per_seq = float(spec.get("step_per_seq", 0.0004))
        self.prefill = float(spec.get("prefill_per_token", 0.00005))
        self.gpu_prefill = bool(spec.get("gpu_prefill", False))
        self.capacity = int(spec.get("cache_blocks", 4000))
        self.cache: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.waiting: list[Seq] = []
        self.running: list[Seq] = []
        self.wake = asyncio.Event()
        self.records: list[tuple[str, float, int, int, int]] = []  # rid, done at, prompt, cached, generated
        self.alive = False
        self.server: asyncio.AbstractServer | None = None
        self.protocols: set[Any] = set()
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        handler = web.Server(self.handle, access_log=None)

        def protocol() -> Any:
            proto = handler()
            self.protocols.add(proto)
            return proto

        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(protocol, "127.0.0.1", self.port, reuse_address=True)
        self.alive = True
        self.task = asyncio.create_task(self.schedule())

    def kill(self) -> None:
        """Close the listener and reset every connection: what is in flight fails on the client's side."""
        self.alive = False
        if self.server is not None:
            self.server.close()
        if self.task is not None:
            self.task.cancel()
        for proto in list(self.protocols):
            transport = getattr(proto, "transport", None)
            if transport is None:
                continue
            sock = transport.get_extra_info("socket")
            if sock is not None:
                try:  # linger 0: close() sends RST, as a crashed process's kernel does
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                except OSError:
                    pass
            transport.abort()
        for seq in self.waiting + self.running:
            self._end(seq, ok=False)
        self.waiting.clear()
        self.running.clear()

    # The cache.

    def _lookup(self, hashes: list[int]) -> int:
        hits = 0
        for h in hashes:
            if h not in self.cache:
                break
            self.cache.move_to_end(h)
            hits += 1
        return hits * BLOCK

    def _insert(self, hashes: list[int]) -> None:
        cache = self.cache
        for h in hashes:
            if h in cache:
                cache.move_to_end(h)
            else:
                cache[h] = None
        while len(cache) > self.capacity:
            cache.popitem(last=False)

    # The batch.

    async def schedule(self) -> None:
        # Steps follow a virtual clock: a step that woke late (a busy CPU) makes the next one
        # shorter, so the simulated times hold on average instead of every overshoot adding up.
        clock = time.monotonic()
        while True:
            if not self.running and not self.waiting:
                self.wake.clear()
                await self.wake.wait()
            now = time.monotonic()
            clock = max(clock, now - MAX_LAG)
            stall = 0.0
            for seq in self.waiting:
                hashes = block_hashes(seq.tokens)
                seq.cached = min(self._lookup(hashes), len(seq.tokens) - 1)  # vLLM recomputes the last token
                self._insert(hashes)
                cost = (len(seq.tokens) - seq.cached) * self.prefill * self.slowdown
                if self.gpu_prefill:
                    stall += cost
                else:
                    seq.ready_at = clock + cost
                self.running.append(seq)
            self.waiting.clear()
            decoding = [s for s in self.running if s.ready_at <= clock]
            if not decoding and stall == 0.0:
                clock = min(s.ready_at for s in self.running)
                await asyncio.sleep(max(0.0, clock - time.monotonic()))
                continue
            clock += (self.base + self.per_seq * len(self.running)) * self.slowdown + stall
            await asyncio.sleep(max(0.0, clock - time.monotonic()))
            for seq in decoding:
                if seq.done.done():  # the client went away
                    self.running.remove(seq)
                    continue
                if seq.chunks is not None:
                    seq.chunks.put_nowait(seq.words[seq.generated])
                seq.generated += 1
                if seq.generated >= seq.max_tokens:
                    self.running.remove(seq)
                    self._insert(block_hashes([*seq.tokens, "<|assistant|>", *seq.words]))
                    self.records.append((seq.rid, time.monotonic(), len(seq.tokens), seq.cached, seq.generated))
                    self._end(seq, ok=True)

    def _end(self, seq: Seq, *, ok: bool) -> None:
        if not seq.done.done():
            seq.done.set_result(ok)
        if seq.chunks is not None:
            seq.chunks.put_nowait(None)

    # HTTP.

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        self.protocols.add(request.protocol)
        path = request.path
        if path == "/health":
            return web.Response(text="")
        if path == "/v1/models":
            return web.json_response(
                {"object": "list", "data": [{"id": "sim", "object": "model", "max_model_len": 131072}]}
            )
        if path != "/v1/chat/completions" or request.method != "POST":
            return web.json_response({"error": {"message": f"no route {path}"}}, status=404)
        body = await request.json()
        rid = request.headers.get("X-Request-Id") or str(body.get("request_id") or id(body))
        seq = Seq(
            rid, prompt_tokens(body.get("messages", [])), int(body.get("max_tokens") or 16), bool(body.get("stream"))
        )
        self.waiting.append(seq)
        self.wake.set()
        headers = {"X-Sim-Engine": self.name}
        created = int(time.time())
        usage = lambda: {  # noqa: E731
            "prompt_tokens": len(seq.tokens),
            "completion_tokens": seq.generated,
            "total_tokens": len(seq.tokens) + seq.generated,
            "prompt_tokens_details": {"cached_tokens": seq.cached},
        }
        base = {"id": f"chatcmpl-{rid}", "created": created, "model": body.get("model", "sim")}
        try:
            if seq.chunks is None:
                if not await seq.done:
                    raise ConnectionResetError
                message = {"role": "assistant", "content": " ".join(seq.words)}
                choice = {"index": 0, "message": message, "finish_reason": "stop"}
                reply = {**base, "object": "chat.completion", "choices": [choice], "usage": usage()}
                return web.json_response(reply, headers=headers)
            response = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream"})
            await response.prepare(request)
            chunk = {**base, "object": "chat.completion.chunk"}
            first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
            await response.write(_sse({**chunk, "choices": [first]}))
            sent = 0
            while (word := await seq.chunks.get()) is not None:
                delta = {"index": 0, "delta": {"content": word if sent == 0 else " " + word}, "finish_reason": None}
                sent += 1
                await response.write(_sse({**chunk, "choices": [delta]}))
            if not seq.done.result():
                raise ConnectionResetError
            last = {"index": 0, "delta": {}, "finish_reason": "stop"}
            await response.write(_sse({**chunk, "choices": [last]}))
            if (body.get("stream_options") or {}).get("include_usage"):
                await response.write(_sse({**chunk, "choices": [], "usage": usage()}))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        finally:
            if not seq.done.done():  # cancelled: the client left, the scheduler drops it
                seq.done.set_result(False)

    def stats(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "url": f"http://127.0.0.1:{self.port}/v1",
            "alive": self.alive,
            "records": self.records,
        }


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def serve(control_port: int, specs: list[dict[str, Any]]) -> None:
    engines = [Engine(i, spec) for i, spec in enumerate(specs)]
    for engine, spec in zip(engines, specs, strict=True):
        if not spec.get("late"):
            await engine.start()

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def stats(request: web.Request) -> web.Response:
        return web.json_response({"engines": [e.stats() for e in engines]})

    async def kill(request: web.Request) -> web.Response:
        engines[int(request.match_info["i"])].kill()
        return web.json_response({"killed": int(request.match_info["i"])})

    async def start(request: web.Request) -> web.Response:
        engine = engines[int(request.match_info["i"])]
        if not engine.alive:
            await engine.start()
        return web.json_response({"started": engine.stats()["url"]})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/stats", stats)
    app.router.add_post("/kill/{i}", kill)
    app.router.add_post("/start/{i}", start)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", control_port).start()
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--control-port", type=int, required=True)
    parser.add_argument("--spec", required=True, help="JSON list of engines: port, slowdown, cache_blocks, ...")
    args = parser.parse_args(argv)
    asyncio.run(serve(args.control_port, json.loads(args.spec)))


if __name__ == "__main__":
    main()
