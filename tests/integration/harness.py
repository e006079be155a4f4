"""Processes and taps for the real-vLLM suite: `vllm serve`, gymproxy, and recording proxies.

Everything here is synchronous from the tests' point of view. The taps (small aiohttp reverse
proxies that forward every request and keep both sides' bytes) run on one event loop in a
background thread, so session-scoped fixtures do not depend on pytest's per-test loops.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import yaml
from aiohttp import web

from .make_model import MAX_POSITIONS

# The environment of every CPU vLLM server the suites start (gymproxy's `--launch-vllm` replicas too).
CPU_VLLM_ENV = {
    "VLLM_SERVER_DEV_MODE": "1",  # /pause, /resume and the weight routes, for the fleet-control tests
    # GiB; the default reserves far more than this model needs (512 bytes a token: 32 MiB a sequence)
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # servers share the machine's cores
    "OMP_NUM_THREADS": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


T = TypeVar("T")
MODEL_NAME = "tiny-qwen2"
MAX_MODEL_LEN = MAX_POSITIONS  # agent harnesses send tens of thousands of prompt tokens

# Headers a proxy must not copy from one hop to the next.
HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "accept-encoding", "content-encoding"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None, log: Path | None = None) -> None:
    """Poll `url` until it answers 200; fail early (with the log's tail) if `proc` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:4]}... exited with {proc.returncode} while starting\n{tail(log)}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer within {timeout:.0f} s\n{tail(log)}")


def tail(log: Path | None, lines: int = 40) -> str:
    if log is None or not log.exists():
        return ""
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def stop(proc: subprocess.Popen, grace: float = 15.0) -> None:
    """SIGTERM the process group we started, then SIGKILL it if it lingers."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)
    except ProcessLookupError:
        pass


@dataclass
class VLLM:
    """One `vllm serve` process (started through the server module: the console script of vllm-cpu
    cannot find its own package metadata)."""

    python: str
    model: str
    log: Path
    reasoning_parser: str | None
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        args = [
            self.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model, "--served-model-name", MODEL_NAME,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--max-model-len", str(MAX_MODEL_LEN), "--dtype", "float32", "--enforce-eager",
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            "--max-num-seqs", "8", "--seed", "0",
        ]  # fmt: skip
        if self.reasoning_parser:
            args += ["--reasoning-parser", self.reasoning_parser]
        env = {**os.environ, **CPU_VLLM_ENV}
        with self.log.open("wb") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, stdin=subprocess.DEVNULL
            )

    def wait(self, timeout: float) -> None:
        wait_http(self.root + "/health", timeout, self.proc, self.log)

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)


@dataclass
class Exchange:
    """One request through a tap, both sides kept as the bytes that crossed the wire."""

    tap: str
    method: str
    path: str
    request: bytes
    status: int
    content_type: str
    response: bytes
    headers: dict[str, str]
    started: float = 0.0  # time.monotonic() when the request arrived
    request_headers: dict[str, str] = field(default_factory=dict)

    def json(self) -> Any:
        return json.loads(self.response)

    def request_json(self) -> Any:
        return json.loads(self.request) if self.request else None

    def sse(self) -> list[Any]:
        """The `data:` payloads of an SSE body, JSON-decoded, `[DONE]` kept as the string."""
        out = []
        for frame in self.response.decode().split("\n\n"):
            for line in frame.splitlines():
                if line.startswith("data: "):
                    data = line[len("data: ") :]
                    out.append(data if data == "[DONE]" else json.loads(data))
        return out

    def record(self) -> dict[str, Any]:
        request: Any = self.request.decode() if self.request else None
        if request and self.request.lstrip().startswith(b"{"):
            request = json.loads(self.request)
        return {
            "tap": self.tap,
            "method": self.method,
            "path": self.path,
            "request": request,
            "status": self.status,
            "content_type": self.content_type,
            "response": self.response.decode(),
        }


class Tap:
    """A recording reverse proxy in front of `target` (a root URL, no /v1)."""

    def __init__(self, loop: LoopThread, target: str, name: str) -> None:
        self.target = target.rstrip("/")
        self.name = name
        self.exchanges: list[Exchange] = []
        self.inflight = 0
        self._lock = threading.Lock()
        self._loop = loop
        self.port = free_port()
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        loop.run(self._start())

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def take(self, timeout: float = 10.0) -> list[Exchange]:
        """The exchanges since the last `take`, oldest first, once none is still in flight.

        (A client can hold its whole reply before the tap's handler has returned.)
        """
        deadline = time.monotonic() + timeout
        while self.inflight and time.monotonic() < deadline:
            time.sleep(0.01)
        with self._lock:
            out, self.exchanges = self.exchanges, []
        return out

    async def _start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300), auto_decompress=False)
        app = web.Application(client_max_size=64 * 1024**2)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.inflight += 1
        try:
            return await self._forward(request)
        finally:
            self.inflight -= 1

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        started = time.monotonic()
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        headers["Accept-Encoding"] = "identity"  # record the bytes as they are, never compressed
        chunks: list[bytes] = []
        async with self._session.request(
            request.method, self.target + request.path_qs, data=body, headers=headers
        ) as up:
            response = web.StreamResponse(status=up.status, reason=up.reason)
            for k, v in up.headers.items():
                if k.lower() not in HOP and k.lower() not in ("date", "server"):
                    response.headers.add(k, v)
            try:
                await response.prepare(request)
                async for chunk in up.content.iter_any():
                    chunks.append(chunk)
                    await response.write(chunk)
                await response.write_eof()
            except ConnectionError:  # the client went away (it may stop reading once it has seen enough)
                pass
        exchange = Exchange(
            tap=self.name,
            method=request.method,
            path=request.path_qs,
            request=body,
            status=up.status,
            content_type=up.content_type,
            response=b"".join(chunks),
            headers=dict(up.headers),
            started=started,
            request_headers=dict(request.headers),
        )
        with self._lock:
            self.exchanges.append(exchange)
        return response

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()


class LoopThread:
    """An asyncio loop on a daemon thread, for the taps."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="taps", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


# gymproxy logs one of these per upstream once its startup probe of /v1/models is done
PROBE_LOGGED = re.compile(r"upstream \S+: \S+ (?:answered|is NOT answering)")


@dataclass
class Gymproxy:
    """`python -m gymproxy serve --config FILE` in a subprocess."""

    config: dict[str, Any]
    workdir: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        path = self.workdir / f"gymproxy-{self.port}.yaml"
        path.write_text(yaml.safe_dump({**self.config, "host": "127.0.0.1", "port": self.port}))
        self.log = self.workdir / f"gymproxy-{self.port}.log"
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gymproxy", "serve", "--config", str(path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                stdin=subprocess.DEVNULL,
            )
        wait_http(self.root + "/health", 30, self.proc, self.log)
        self._wait_for_probes(15)

    def _wait_for_probes(self, timeout: float) -> None:
        """Wait until the startup probe of every upstream's /v1/models is logged.

        The probe runs in the background after the port opens; a test's first `take` must not
        find it among the upstream exchanges its own request caused.
        """
        expected = len(self.config.get("upstreams") or [self.config.get("base_url")])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            probes = PROBE_LOGGED.findall(self.log.read_text(errors="replace"))
            if len(probes) >= expected:
                return
            time.sleep(0.05)
        raise RuntimeError(
            f"gymproxy did not probe its {expected} upstream(s) within {timeout:.0f} s\n{tail(self.log)}"
        )

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)


def json_call(url: str, body: Any = None, method: str = "POST") -> tuple[int, dict[str, Any]]:
    """One JSON request (gymproxy's /fleet routes, /health): its status and JSON body, errors included."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, dict(json.load(reply))
    except urllib.error.HTTPError as exc:
        return exc.code, dict(json.load(exc))
