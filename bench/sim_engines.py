"""Simulated vLLM engines: N OpenAI chat servers in one asyncio process, timed by sleeps.

Each engine runs a continuous batch. A decode step takes `(base + per_seq * batch) * slowdown`
seconds and gives every running sequence one token. A new request first pays for its uncached
prompt tokens (`prefill * uncached * slowdown`); cached 16-token blocks are free. With
`gpu_prefill` that prefill stalls the whole batch (it is added to the next step, as an unchunked
prefill does on a GPU); without it, only the request itself waits.

Tokens are words: a message is `<|role|>` followed by its words, so two prompts share a prefix
exactly when their texts do. Each engine keeps an LRU of block hashes (chained, like vLLM's), fed
with the prompt's blocks at admission and the prompt + answer blocks at completion.

Each engine also serves vLLM's RL routes (as `VLLM_SERVER_DEV_MODE=1` mounts them; `"dev_mode":
false` in its spec answers them 404): `POST /pause?mode=abort|wait|keep&clear_cache=`, `POST
/resume`, `GET /is_paused`, `POST /update_weight_version {"new_version"}`, `GET /weight_info`,
the weight-transfer routes and `POST /reset_prefix_cache`. `abort` ends every request at once with
finish_reason "abort" (the tokens so far); `wait` answers once every request has finished; `keep`
freezes them (no decode step) until `/resume`. New requests while paused get vLLM 0.33's 503
"Generation is paused. Please retry after it resumes." under abort and wait, and are queued under
keep (`"paused_requests": "queue"` in the spec queues them in every mode, as vLLM 0.32 does).
An abort or wait pause clears the prefix cache unless `clear_cache=false`, as vLLM's does.
Each engine has a weight version (`"weight_version"` in the spec, else vLLM's "default"), and
every reply that ends records the version of each decode step it took part in, as vLLM's
`WeightVersionSpan`s: (version, index of the first token it sampled).

A control server (`--control-port`) answers `GET /health`, `GET /stats` (per engine: its counters,
the request ids it completed, and every reply that ended with its finish reason and version
spans), `POST /kill/{i}` (the engine closes its listener and resets every connection, failing
what was in flight) and `POST /start/{i}` (a late engine starts: the "engine added" scenario).

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
PAUSE_MODES = ("abort", "wait", "keep")
PAUSED = "Generation is paused. Please retry after it resumes."  # vLLM >= 0.33's 503, abort and wait modes
TRANSFER_ROUTES = {  # vLLM's weight-transfer routes and what they answer; the sim moves no weights
    "/init_weight_transfer_engine": "Weight transfer initialized",
    "/shutdown_weight_transfer_engine": "Weight transfer shut down",
    "/start_weight_update": "Weight update started",
    "/start_draft_weight_update": "Draft weight update started",
    "/update_weights": "Weights updated",
    "/finish_weight_update": "Weight update finished",
}


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

    __slots__ = (
        "rid", "tokens", "max_tokens", "generated", "ready_at", "done", "chunks", "cached", "words", "finish", "spans"
    )  # fmt: skip

    def __init__(self, rid: str, tokens: list[str], max_tokens: int, stream: bool) -> None:
        self.rid = rid
        self.tokens = tokens
        self.max_tokens = max_tokens
        self.generated = 0
        self.ready_at = 0.0
        self.cached = 0
        self.done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()  # False: failed
        self.finish = ""  # "stop" or "abort" once it ended with a reply
        self.spans: list[tuple[str, int]] = []  # (weight version, its first token), as vLLM's WeightVersionSpan
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
        self.dev_mode = bool(spec.get("dev_mode", True))  # VLLM_SERVER_DEV_MODE=1: the RL routes are mounted
        self.queue_paused = spec.get("paused_requests", "reject") == "queue"  # vLLM 0.32: no 503 while paused
        self.version = str(spec.get("weight_version", "default"))
        self.paused = ""  # the mode of the pause in force, "" when generating
        self.queued: list[Seq] = []  # arrived while paused: admitted on /resume
        self.idle = asyncio.Event()  # nothing admitted or running: what `/pause?mode=wait` waits for
        self.replies: list[tuple[str, str, int, list[tuple[str, int]]]] = []  # rid, finish, tokens, version spans
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
        for seq in self.waiting + self.running + self.queued:
            self._end(seq, "")
        self.waiting.clear()
        self.running.clear()
        self.queued.clear()
        self.idle.set()

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
            if self.paused == "keep" or not (self.running or self.waiting):
                if not (self.running or self.waiting):
                    self.idle.set()
                self.wake.clear()
                await self.wake.wait()
                continue
            now = time.monotonic()
            clock = max(clock, now - MAX_LAG)
            stall = 0.0
            for seq in self.waiting:
                if seq.done.done():  # the client left while it was queued
                    continue
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
            if not self.running:
                continue
            decoding = [s for s in self.running if s.ready_at <= clock]
            if not decoding and stall == 0.0:
                clock = min(s.ready_at for s in self.running)
                await asyncio.sleep(max(0.0, clock - time.monotonic()))
                continue
            version = self.version  # the weights this step samples with
            clock += (self.base + self.per_seq * len(self.running)) * self.slowdown + stall
            await asyncio.sleep(max(0.0, clock - time.monotonic()))
            for seq in decoding:
                if seq.done.done():  # aborted during the step, or the client went away
                    continue
                if not seq.spans or seq.spans[-1][0] != version:
                    seq.spans.append((version, seq.generated))
                if seq.chunks is not None:
                    seq.chunks.put_nowait(seq.words[seq.generated])
                seq.generated += 1
                if seq.generated >= seq.max_tokens:
                    self._insert(block_hashes([*seq.tokens, "<|assistant|>", *seq.words]))
                    self.records.append((seq.rid, time.monotonic(), len(seq.tokens), seq.cached, seq.generated))
                    self._end(seq, "stop")
            self.running = [s for s in self.running if not s.done.done()]

    def _end(self, seq: Seq, finish: str) -> None:
        """The sequence is over: with a reply that says `finish`, or failed ("")."""
        if not seq.done.done():
            seq.finish = finish
            seq.done.set_result(bool(finish))
            if finish:
                self.replies.append((seq.rid, finish, seq.generated, seq.spans))
        if seq.chunks is not None:
            seq.chunks.put_nowait(None)

    def _submit(self, seq: Seq) -> None:
        if self.paused:
            self.queued.append(seq)
            return
        self.waiting.append(seq)
        self.idle.clear()
        self.wake.set()

    # Pause and resume, as vLLM's engine does them.

    async def pause(self, mode: str, clear_cache: bool) -> None:
        self.paused = mode
        if mode == "abort":
            for seq in self.waiting + self.running + self.queued:
                self._end(seq, "abort")
            self.waiting.clear()
            self.running.clear()
            self.queued.clear()
        elif mode == "wait":
            self.wake.set()  # a keep pause before this one froze the batch: it drains now
            while self.running or self.waiting:
                self.idle.clear()
                await self.idle.wait()
        if mode != "keep" and clear_cache:
            self.cache.clear()

    def resume(self) -> None:
        self.paused = ""
        self.waiting += self.queued
        self.queued.clear()
        if self.waiting:
            self.idle.clear()
        self.wake.set()

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
        if path == "/v1/chat/completions" and request.method == "POST":
            return await self.chat(request)
        if self.dev_mode and path in RL_ROUTES:
            method, answer = RL_ROUTES[path]
            if request.method != method:
                return web.json_response({"detail": "Method Not Allowed"}, status=405)
            return await answer(self, request)
        return web.json_response({"error": {"message": f"no route {path}"}}, status=404)

    async def chat(self, request: web.BaseRequest) -> web.StreamResponse:
        body = await request.json()
        if self.paused in ("abort", "wait") and not self.queue_paused:
            error = {"message": PAUSED, "type": "Service Unavailable", "param": None, "code": 503}
            return web.json_response({"error": error}, status=503)
        rid = request.headers.get("X-Request-Id") or str(body.get("request_id") or id(body))
        seq = Seq(
            rid, prompt_tokens(body.get("messages", [])), int(body.get("max_tokens") or 16), bool(body.get("stream"))
        )
        self._submit(seq)
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
                message = {"role": "assistant", "content": " ".join(seq.words[: seq.generated])}
                choice = {"index": 0, "message": message, "finish_reason": seq.finish}
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
            last = {"index": 0, "delta": {}, "finish_reason": seq.finish}
            await response.write(_sse({**chunk, "choices": [last]}))
            if (body.get("stream_options") or {}).get("include_usage"):
                await response.write(_sse({**chunk, "choices": [], "usage": usage()}))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        finally:
            if not seq.done.done():  # cancelled: the client left, the scheduler drops it
                seq.done.set_result(False)

    # vLLM's RL routes (entrypoints/rl/online/api_router.py).

    async def route_pause(self, request: web.BaseRequest) -> web.Response:
        mode = request.query.get("mode", "abort")
        clear_cache = request.query.get("clear_cache", "true").lower() not in ("false", "0", "no", "off")
        if mode not in PAUSE_MODES:
            return web.json_response({"error": f"Invalid pause mode: {mode!r}; choose from {PAUSE_MODES}"}, status=400)
        await self.pause(mode, clear_cache)
        return web.json_response({"status": "paused"})

    async def route_resume(self, request: web.BaseRequest) -> web.Response:
        self.resume()
        return web.json_response({"status": "resumed"})

    async def route_is_paused(self, request: web.BaseRequest) -> web.Response:
        return web.json_response({"is_paused": bool(self.paused)})

    async def route_update_weight_version(self, request: web.BaseRequest) -> web.Response:
        version = (await _json_object(request)).get("new_version")
        if not isinstance(version, str):
            return _missing("new_version")
        self.version = version
        return web.json_response({"success": True, "new_version": version})

    async def route_weight_info(self, request: web.BaseRequest) -> web.Response:
        return web.json_response({"weight_version": self.version})

    async def route_transfer(self, request: web.BaseRequest) -> web.Response:
        body = await _json_object(request)
        if request.path == "/finish_weight_update" and body.get("weight_version") is not None:
            self.version = str(body["weight_version"])
        return web.json_response({"message": TRANSFER_ROUTES[request.path]})

    async def route_reset_prefix_cache(self, request: web.BaseRequest) -> web.Response:
        self.cache.clear()
        return web.Response()

    def stats(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "url": f"http://127.0.0.1:{self.port}/v1",
            "alive": self.alive,
            "records": self.records,
            "weight_version": self.version,
            "paused": self.paused,
            "replies": self.replies,
        }


RL_ROUTES = {
    "/pause": ("POST", Engine.route_pause),
    "/resume": ("POST", Engine.route_resume),
    "/is_paused": ("GET", Engine.route_is_paused),
    "/update_weight_version": ("POST", Engine.route_update_weight_version),
    "/weight_info": ("GET", Engine.route_weight_info),
    "/reset_prefix_cache": ("POST", Engine.route_reset_prefix_cache),
    **{path: ("POST", Engine.route_transfer) for path in TRANSFER_ROUTES},
}


async def _json_object(request: web.BaseRequest) -> dict[str, Any]:
    """The body's JSON object; an empty or other body reads as {} (the routes then say what is missing)."""
    try:
        body = await request.json() if await request.read() else {}
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _missing(field: str) -> web.Response:
    """FastAPI's 422 for a required body field that is missing or not a string."""
    detail = [{"type": "missing", "loc": ["body", field], "msg": "Field required", "input": None}]
    return web.json_response({"detail": detail}, status=422)


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
