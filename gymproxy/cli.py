"""The `gymproxy` command: `serve`, `check-config` and `fake-vllm`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import sys
from collections.abc import AsyncIterator, Sequence
from typing import Any

from aiohttp import web

from . import __version__
from .config import Config, ConfigError, load_config
from .plugin import create_app

log = logging.getLogger("gymproxy")


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "fake-vllm":
        from .fake_vllm import run

        run(args.host, args.port, args.model)
        return
    try:
        config = _load(args)
    except ConfigError as exc:
        print(f"gymproxy: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.command == "check-config":
        print(f"ok: {len(config.base_url)} upstream(s): {', '.join(config.base_url)}; model {config.model or '(client)'}")
        return
    serve(config, fake_port=getattr(args, "_fake_port", None))


def serve(config: Config, *, fake_port: int | None = None) -> None:
    """Run gymproxy until interrupted; with `fake_port`, the bundled fake vLLM runs beside it."""
    app = create_app(config)
    if fake_port is not None:
        log.info("no upstream given: serving in front of the bundled fake vLLM at %s", config.base_url[0])
        app.cleanup_ctx.insert(0, _fake_vllm(fake_port, config.model or "fake-model"))
    log.info("gymproxy %s listening on http://%s:%d", __version__, config.host, config.port)
    web.run_app(
        app,
        host=config.host,
        port=config.port,
        access_log=logging.getLogger("aiohttp.access") if config.access_log else None,
        handler_cancellation=True,
        print=None,
        loop=_new_loop(),
    )


def _load(args: argparse.Namespace) -> Config:
    overrides = dict(_pair(item) for item in args.set)
    if args.command == "check-config":
        return load_config(args.file, overrides=overrides, server=args.server)
    extra: dict[str, Any] = {"host": args.host, "port": args.port, "model": args.model, "api_key": args.api_key}
    if args.upstream:
        extra["base_url"] = args.upstream
    elif args.config is None:
        port = _free_port()
        args._fake_port = port
        extra["base_url"] = [f"http://127.0.0.1:{port}/v1"]
    return load_config(args.config, overrides=overrides, server=args.server, extra=extra)


def _fake_vllm(port: int, model: str) -> Any:
    async def lifetime(_: web.Application) -> AsyncIterator[None]:
        from .fake_vllm import start

        _, runner, _ = await start("127.0.0.1", port, model)
        yield
        await runner.cleanup()

    return lifetime


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _pair(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise SystemExit(f"gymproxy: --set takes name=value, got {text!r}")
    return name.strip(), value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gymproxy", description="Responses <-> Chat Completions proxy for vLLM")
    parser.add_argument("--version", action="version", version=f"gymproxy {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the proxy")
    serve.add_argument("--config", help="YAML config (flat, or NeMo Gym's vllm_model layout)")
    serve.add_argument("--host", help="listen address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="listen port (default 8000)")
    serve.add_argument("--upstream", action="append", metavar="URL", help="vLLM base URL ending in /v1; repeat for several")
    serve.add_argument("--model", help="model name sent upstream (default: the client's)")
    serve.add_argument("--api-key", help="bearer token for the upstream")
    serve.add_argument("--server", help="which vllm_model entry of a NeMo Gym config to use")
    serve.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="resolve ${NAME} (or set a config key)")

    check = commands.add_parser("check-config", help="validate a config file and exit")
    check.add_argument("file")
    check.add_argument("--server")
    check.add_argument("--set", action="append", default=[], metavar="NAME=VALUE")

    fake = commands.add_parser("fake-vllm", help="run the bundled fake vLLM (for demos and tests)")
    fake.add_argument("--host", default="127.0.0.1")
    fake.add_argument("--port", type=int, default=8001)
    fake.add_argument("--model", default="fake-model")
    return parser
