"""A local process that wants a launched replica's port, for tests/test_launch.py: `port_thief.py PORT SECONDS`.

It tries to bind the port every millisecond, every way there is (127.0.0.1, 0.0.0.0 and ::, with
and without SO_REUSEADDR and SO_REUSEPORT), and once it has it, answers 200 to everything (a chat
completion as vLLM's, so gymproxy would pass it on) until SECONDS are up. It prints a JSON line
per event: `ready` (trying), `bound` (how), `request` (method, path, whether it came with a
bearer token), `done`. It imports only the standard library, so it runs as any user.
"""

from __future__ import annotations

import http.server
import json
import socket
import sys
import threading
import time
from typing import Any

REPLY = json.dumps(
    {
        "id": "stranger",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "echo: hi"}, "finish_reason": "stop"}],
        "data": [{"id": "m", "object": "model"}],
    }
).encode()
WAYS = [
    (family, host, options)
    for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::"))
    for options in ((), (socket.SO_REUSEADDR,), (socket.SO_REUSEPORT,), (socket.SO_REUSEADDR, socket.SO_REUSEPORT))
]


def say(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


class Handler(http.server.BaseHTTPRequestHandler):
    def answer(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        say("request", method=self.command, path=self.path, key="Authorization" in self.headers)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(REPLY)))
        self.end_headers()
        self.wfile.write(REPLY)

    do_GET = do_POST = answer

    def log_message(self, *args: Any) -> None:
        pass


def take(port: int) -> socket.socket | None:
    for family, host, options in WAYS:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            for option in options:
                sock.setsockopt(socket.SOL_SOCKET, option, 1)
            sock.bind((host, port))
            sock.listen()
        except OSError:
            sock.close()
            continue
        say("bound", host=host, options=[int(o) for o in options])
        return sock
    return None


def main() -> None:
    port, seconds = int(sys.argv[1]), float(sys.argv[2])
    deadline = time.monotonic() + seconds
    say("ready")
    sock = None
    while sock is None and time.monotonic() < deadline:
        sock = take(port)
        if sock is None:
            time.sleep(0.001)
    if sock is not None:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.socket.close()
        server.socket = sock
        threading.Thread(target=server.serve_forever, daemon=True).start()
        time.sleep(max(0.0, deadline - time.monotonic()))
    say("done")


if __name__ == "__main__":
    main()
