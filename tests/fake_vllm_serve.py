"""A stand-in for the `vllm` command, for the tests of `launch`: `fake_vllm_serve.py serve MODEL ... --port P`.

It serves the bundled fake vLLM (gymproxy.testing.fake_vllm) on the port gymproxy gives it, after
printing a few log lines, and starts a child process of its own (as vLLM starts its EngineCore), so
a test can check that the whole process group goes. What each start of each replica does comes from
FAKE_VLLM_PLAN, e.g. `0=ok,exit3;1=slow2`: replica 0 serves on its first start and exits with 3 on
every later one, replica 1 prints for 2 s before it serves. Actions: `ok`, `exit<code>` (before
listening), `slow<seconds>`, `hang` (never listens), `garbage` (prints junk, then serves),
`stubborn` (serves, ignoring SIGTERM), `chatty<lines a second>` (serves, printing that many lines
a second, each flushed, as vLLM's logging does), `nokey` (serves, checking no API key, as a
wrapper that drops VLLM_API_KEY would), `progress<seconds>` (redraws a
progress bar in place, with no newline, for that long, then serves), `nomodel` (fails as vLLM does
on a model name that does not resolve: a prefixed traceback, exit 1), `sick<seconds>` (serves, and
after that long its /health answers 503 while the process stays up, as when vLLM's engine dies),
and `noreuse`. It binds its port as vLLM 0.32 does with one API server: SO_REUSEADDR, no
SO_REUSEPORT; with FAKE_VLLM_REUSE_PORT=1, with SO_REUSEPORT too (as vLLM's `--api-server-count` > 1,
which `launch.hold_ports` needs), unless the action is `noreuse`. The last action of a list repeats; unlisted
replicas are `ok`. Each start appends `<replica> <start> <pid> <child pid>` to $FAKE_VLLM_DIR/pids
and writes its environment to $FAKE_VLLM_DIR/env-<replica>-<start>.json.

As vLLM does, it checks an API key on every `/v1/*` route when it has one (`--api-key`, else
$VLLM_API_KEY): a request without `Authorization: Bearer <key>` gets 401; `/health` stays open. With
VLLM_SERVER_DEV_MODE=1 it serves vLLM's RL routes (`/pause`, `/resume`, `/update_weight_version`, ...),
and with FAKE_VLLM_PAUSED_503=1 answers new requests in an abort or wait pause 503, as vLLM 0.33 does.
With FAKE_VLLM_SLOW=<seconds>, a request whose body holds `[[slow]]` is answered that much later (so
a test can have requests in flight when it kills a replica).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any


def plan(replica: str) -> list[str]:
    for part in os.environ.get("FAKE_VLLM_PLAN", "").split(";"):
        name, _, actions = part.partition("=")
        if name.strip() == replica and actions.strip():
            return [a.strip() for a in actions.split(",")]
    return ["ok"]


def flag(args: list[str], name: str, default: str) -> str:
    return args[args.index(name) + 1] if name in args else default


def main() -> None:
    args = sys.argv[1:]
    if args[:1] != ["serve"] or len(args) < 2:
        print(f"fake vllm: usage: serve MODEL ... (got {args})", file=sys.stderr)
        raise SystemExit(2)
    model = flag(args, "--served-model-name", args[1])
    port = int(flag(args, "--port", "8000"))
    replica = os.environ.get("GYMPROXY_REPLICA", "0")
    state = Path(os.environ.get("FAKE_VLLM_DIR", "."))
    counter = state / f"starts-{replica}"
    start = int(counter.read_text()) + 1 if counter.exists() else 1
    counter.write_text(str(start))
    actions = plan(replica)
    action = actions[min(start, len(actions)) - 1]
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with (state / "pids").open("a") as out:
        out.write(f"{replica} {start} {os.getpid()} {engine.pid}\n")
    (state / f"env-{replica}-{start}.json").write_text(json.dumps(dict(os.environ)))
    print(f"INFO fake vllm {model}: replica {replica} start {start}: {action}", flush=True)
    print(f"INFO args: {' '.join(args)}", flush=True)
    print(f"INFO CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}", flush=True)
    if action.startswith("exit"):
        print("ERROR fake vllm: something went wrong while loading", flush=True)
        engine.kill()
        raise SystemExit(int(action[4:]))
    if action == "hang":
        time.sleep(600)
    if action.startswith("slow"):
        until = time.monotonic() + float(action[4:])
        while time.monotonic() < until:
            print("INFO Loading weights...", flush=True)
            time.sleep(0.2)
    if action.startswith("progress"):
        until = time.monotonic() + float(action[8:])
        step = 0
        while time.monotonic() < until:
            step += 1
            sys.stdout.write(f"\rLoading safetensors checkpoint shards: step {step} ")
            sys.stdout.flush()
            time.sleep(0.1)
        print(flush=True)
    if action == "nomodel":
        unknown_model(model)
    if action == "garbage":
        sys.stdout.buffer.write(b"\x00\x1b[31m\xff\xfe binary junk\r\n" + b"x" * 20000 + b"\nno newline at the end")
        sys.stdout.buffer.write(b"\n")
        sys.stdout.flush()
    if action == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if action.startswith("chatty"):
        threading.Thread(target=chatter, args=(float(action[6:]),), daemon=True).start()

    from aiohttp import web

    from gymproxy.testing.fake_vllm import from_environment

    app = from_environment(model=model, max_model_len=4096).app  # VLLM_SERVER_DEV_MODE=1: the RL routes
    key = flag(args, "--api-key", "") if "--api-key" in args else os.environ.get("VLLM_API_KEY", "")
    if key and action != "nokey":

        @web.middleware
        async def authenticate(request: web.Request, handler: Any) -> web.StreamResponse:
            if request.path.startswith("/v1") and request.headers.get("Authorization") != f"Bearer {key}":
                return web.json_response({"error": "Unauthorized"}, status=401)
            return await handler(request)

        app.middlewares.append(authenticate)
    slow = float(os.environ.get("FAKE_VLLM_SLOW", "0"))
    if slow:

        @web.middleware
        async def slowly(request: web.Request, handler: Any) -> web.StreamResponse:
            if request.can_read_body and b"[[slow]]" in await request.read():
                await asyncio.sleep(slow)
            return await handler(request)

        app.middlewares.append(slowly)
    if action.startswith("sick"):
        sick_after = time.monotonic() + float(action[4:])

        @web.middleware
        async def engine_dead(request: web.Request, handler: Any) -> web.StreamResponse:
            if request.path == "/health" and time.monotonic() >= sick_after:
                return web.Response(status=503)
            return await handler(request)

        app.middlewares.append(engine_dead)
    print(f"INFO Starting vLLM API server on http://127.0.0.1:{port}", flush=True)
    web.run_app(
        app,
        host="127.0.0.1",
        port=port,
        handler_cancellation=True,
        print=None,
        handle_signals=action != "stubborn",
        reuse_port=os.environ.get("FAKE_VLLM_REUSE_PORT") == "1" and action != "noreuse",
    )


def unknown_model(model: str) -> None:
    """What vLLM prints, in its shape, when `model` is neither a repository nor a directory."""
    api = "(APIServer pid=4242)"
    lines = [
        f"{api} INFO 12-06 10:00:00 [utils.py:253] non-default args: {{'model_tag': '{model}'}}",
        f"{api} Traceback (most recent call last):",
        f'{api}   File "/venv/bin/vllm", line 10, in <module>',
        f"{api}     sys.exit(main())",
        f'{api}   File "/venv/lib/python3.12/site-packages/vllm/entrypoints/cli/main.py", line 73, in main',
        f"{api}     args.dispatch_function(args)",
        f'{api}   File "/venv/lib/python3.12/site-packages/vllm/engine/arg_utils.py", line 1130, in create_model_config',
        f"{api}     return ModelConfig(",
        f"{api}            ^^^^^^^^^^^^",
        f"{api} pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig",
        f"{api}   Value error, Invalid repository ID or local directory specified: '{model}'.",
        f"{api} Please verify the following requirements:",
        f"{api} 1. Provide a valid Hugging Face repository ID.",
        f"{api} 2. Specify a local directory that contains a recognized configuration file.",
        f"{api}    - For Hugging Face models: ensure the presence of a 'config.json'.",
        f"{api}  [type=value_error, input_value=ArgsKwargs((), {{'model': '{model}'}}), input_type=ArgsKwargs]",
        f"{api}     For further information visit https://errors.pydantic.dev/2.12/v/value_error",
    ]
    print("\n".join(lines), flush=True)
    raise SystemExit(1)


def chatter(per_second: float) -> None:
    """Print `per_second` lines a second, each flushed, for ever (a replica that logs every request)."""
    count = 0
    started = time.monotonic()
    while True:
        count += 1
        print(
            f"INFO 01-01 00:00:00 [logger.py:43] Received request chatcmpl-{count}: prompt: 'hi', params: ...",
            flush=True,
        )
        ahead = count / per_second - (time.monotonic() - started)
        if ahead > 0:
            time.sleep(ahead)


if __name__ == "__main__":
    main()
