"""Record the raw reply bytes uvicorn (vLLM's HTTP server) writes, for tests/test_http1.py.

vLLM serves its OpenAI API with uvicorn, whose HTTP/1.1 writer is `httptools` or `h11`. This
serves four of the vLLM 0.32 replies recorded in tests/data/vllm-0.32 (a chat completion, its
event stream, the context-overflow 400 and /health) through each, and writes what arrived on the
socket to `uvicorn-<impl>-<name>.http`, and the body it framed to `<name>.body`. It needs uvicorn
and starlette, which gymproxy's tests do not; run it in a venv of its own:

    python3 -m venv /tmp/uv && /tmp/uv/bin/pip install "uvicorn[standard]" starlette
    /tmp/uv/bin/python tests/data/http1/record.py

Recorded with uvicorn 0.54.0, starlette 1.10.0, httptools 0.9.0, h11 0.16.0.
"""

import json
import pathlib
import socket
import threading
import time

import uvicorn
from starlette.applications import Starlette
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

HERE = pathlib.Path(__file__).resolve().parent
DATA = str(HERE.parent / "vllm-0.32") + "/"


def upstream(name, path_prefix="/v1/chat"):
    d = json.load(open(DATA + name))
    for step in d["steps"]:
        for u in step["upstream"]:
            if u["path"].startswith(path_prefix) and u["status"] == 200:
                return u
    raise SystemExit(name)


plain = upstream("chat_tool_call-nostream.json")
stream = upstream("chat_tool_call-stream.json")
overflow = None
for step in json.load(open(DATA + "context_overflow_propagated_as_vllms_400-stream.json"))["steps"]:
    for u in step["upstream"]:
        if u["status"] == 400:
            overflow = u


async def chat(request):
    return Response(plain["response"].encode(), media_type="application/json")


async def sse(request):
    async def events():
        for frame in stream["response"].split("\n\n")[:-1]:
            yield (frame + "\n\n").encode()

    return StreamingResponse(events(), media_type="text/event-stream")


async def error(request):
    return Response(overflow["response"].encode(), status_code=400, media_type="application/json")


async def health(request):
    return Response(status_code=200)


app = Starlette(
    routes=[
        Route("/chat", chat, methods=["POST"]),
        Route("/sse", sse, methods=["POST"]),
        Route("/error", error, methods=["POST"]),
        Route("/health", health),
    ]
)


def serve(port, http):
    uvicorn.run(app, host="127.0.0.1", port=port, http=http, log_level="warning")


def fetch(port, method, path):
    s = socket.create_connection(("127.0.0.1", port))
    body = b"{}" if method == "POST" else b""
    s.sendall(
        f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    s.settimeout(1.0)
    out = b""
    try:
        while True:
            data = s.recv(65536)
            if not data:
                break
            out += data
    except TimeoutError:
        pass
    s.close()
    return out


for http, port in (("httptools", 18801), ("h11", 18802)):
    threading.Thread(target=serve, args=(port, http), daemon=True).start()
time.sleep(2)
for http, port in (("httptools", 18801), ("h11", 18802)):
    for name, method, path in (
        ("chat", "POST", "/chat"),
        ("stream", "POST", "/sse"),
        ("overflow", "POST", "/error"),
        ("health", "GET", "/health"),
    ):
        raw = fetch(port, method, path)
        # The Date header changes every second: the recording keeps the one it got.
        (HERE / f"uvicorn-{http}-{name}.http").write_bytes(raw)
        print(http, name, len(raw))
for name, source in (("chat", plain), ("stream", stream), ("overflow", overflow)):
    (HERE / f"{name}.body").write_bytes(source["response"].encode())
(HERE / "health.body").write_bytes(b"")
