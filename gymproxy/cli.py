"""The `gymproxy` command: `serve`, `check-config`, `rollouts export` and `fake-vllm`."""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import multiprocessing
import os
import secrets
import shlex
import signal
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from . import __version__, launch, logs, server
from .config import (
    STAND_IN_HOST,
    Config,
    ConfigError,
    is_loopback,
    load_config,
    shown_placeholder,
    upstream_specs,
)
from .peers import Peers
from .proxy import INSTANCE_ENV
from .upstream import shown
from .workers import Lifeline, RuntimeDir, Workers, WorkersFailed, die_with_parent

log = logging.getLogger("gymproxy")

TICK_S = 0.2  # how often the parent of `--workers N` looks at its workers (and steps its replicas)


def main(argv: Sequence[str] | None = None) -> None:
    args = _arguments(_parser(), argv)
    logs.configure(getattr(args, "log_level", None) or "info", getattr(args, "log_format", None) or "text")
    if args.command == "fake-vllm":
        from .testing.fake_vllm import run

        run(args.host, args.port, args.model, args.max_model_len)
        return
    if args.command == "rollouts":
        from .rollouts.export import export

        raise SystemExit(export(args.store, args.out, frozen_only=args.frozen_only))
    try:
        config = _load(args)
    except ConfigError as exc:
        for line in str(exc).splitlines():
            print(f"gymproxy: {line}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.command == "check-config":
        for line in args._warnings:
            print(f"gymproxy: {line}", file=sys.stderr)
        if config.launch is not None:
            print(f"ok: launches {config.launch.replicas} vLLM replica(s) of {config.launch.model}")
        else:
            urls = [_unstand(shown(spec.url)) for spec in upstream_specs(config)]
            print(f"ok: {len(urls)} upstream(s): {', '.join(urls)}; model {config.model or '(client)'}")
        if args._unresolved:
            listed = (f"{shown_placeholder(name)} ({where})" for name, where in sorted(args._unresolved.items()))
            print(f"given at serve time (--set, an override or the environment): {', '.join(listed)}")
        return
    logs.configure(config.log_level, config.log_format)
    fake_port = getattr(args, "_fake_port", None)
    workers = args.workers or config.num_workers or 1
    if fake_port is not None:
        log.info("no upstream given: serving in front of the bundled fake vLLM at %s", config.base_url[0])
    reload = Loader(args.config or [], dict(_pair(item) for item in args.set), args.server, args._extra, args.overrides)
    if config.launch is not None:
        _serve_launched(config, workers, reload)
    elif workers == 1:
        server.run(config, fake_port=fake_port, reload=reload)
    else:
        serve_workers(config, workers, fake_port=fake_port, reload=reload)


def _serve_launched(config: Config, workers: int, reload: Loader) -> None:
    """`serve` with `launch`: gymproxy starts its vLLM replicas, and fails with status 1 when none starts."""
    try:
        launcher = launch.prepare(config)
    except ConfigError as exc:
        print(f"gymproxy: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    reload.launched = launcher.config
    try:
        if workers == 1:
            server.run(launcher.config, reload=reload, launcher=launcher)
        else:
            serve_workers(launcher.config, workers, reload=reload, launcher=launcher)
    except launch.LaunchFailed as exc:
        log.error("%s; its last lines:\n%s", exc, exc.last_lines)
        print(f"gymproxy: {exc}", file=sys.stderr)  # the last line: the cause, and a hint
        raise SystemExit(1) from None


class Loader:
    """Reads the config again as `serve` first read it (same files, overrides, `--set` pairs and
    flags), for SIGHUP."""

    def __init__(
        self,
        paths: list[str],
        overrides: dict[str, str],
        server: str | None,
        extra: dict[str, Any],
        hydra: Sequence[str] = (),
    ) -> None:
        self.paths, self.overrides, self.server, self.extra, self.hydra = paths, overrides, server, extra, hydra
        self.launched: Config | None = None  # with `launch`: the config its replicas were planned in

    def __call__(self) -> Config:
        config = load_config(
            self.paths, overrides=self.overrides, server=self.server, extra=self.extra, hydra=self.hydra
        )
        return config if self.launched is None else launch.keep_replicas(config, self.launched)


def serve_workers(
    config: Config,
    workers: int,
    *,
    fake_port: int | None = None,
    reload: Loader | None = None,
    launcher: launch.Launcher | None = None,
) -> None:
    """N processes share the port (SO_REUSEPORT); the kernel spreads connections between them.

    Pins stay consistent across workers because every worker checks cookies with the same secret:
    without a configured one, this parent makes one for all of them (through the environment, so a
    config re-read on SIGHUP finds it too), and one instance id (`$GYMPROXY_INSTANCE`, for loop
    detection). A SIGHUP here is forwarded to every worker; a worker sends one here when an admin
    route changed the fleet, after writing the change to the overlay file every worker reads (in a
    private directory that lives as long as they do).

    The workers die with this parent, and one that stops sending its heartbeat or exits is replaced
    (`workers.Workers`, `workers.*` in the config).

    With `launcher`, this parent runs the vLLM replicas (on an event loop it steps while it watches
    the workers) and starts the workers at once, so the port opens while the replicas load; it
    stops the replicas after the workers have drained, and stops everything (`LaunchFailed`) if
    every replica fails before one is ready. The workers follow the replicas' states, which this
    parent writes to the private directory: /health shows them, and a worker sends nothing to a
    replica that is not ready (requests meanwhile get a 503 with Retry-After naming them).
    """
    if config.pinning.secret is None:
        secret = os.environ[config.pinning.secret_env] = secrets.token_hex(32)
        pinning = msgspec.structs.replace(config.pinning, secret=secret)
        config = msgspec.structs.replace(config, pinning=pinning)
    # One instance id for all workers, so a request that loops back to any of them is caught (proxy.py).
    os.environ.setdefault(INSTANCE_ENV, secrets.token_hex(8))
    # The workers' private directory (mode 0700): the admin changes' overlay file, and the socket on
    # which each worker serves its own metrics, so the one a scrape reaches answers for all (peers.py).
    runtime = RuntimeDir.make()
    overlay = runtime.path / "fleet.json"
    replicas = runtime.path / "replicas.json" if launcher is not None else None
    stepping = None
    if launcher is not None:
        stepping = asyncio.new_event_loop()
        try:
            stepping.run_until_complete(launcher.start())
        except BaseException:
            stepping.run_until_complete(launcher.stop())
            stepping.close()
            runtime.remove()
            raise
        _write_states(replicas, launcher)
        # At once, not at the next step: a worker sends nothing to a replica the file says is down.
        launcher.on_down = lambda name, why: _write_states(replicas, launcher)
        launcher.on_ready = lambda name: _write_states(replicas, launcher)
    fake = None
    if fake_port is not None:
        context = multiprocessing.get_context("spawn")
        fake = context.Process(
            target=_run_fake, args=(fake_port, config.model or "fake-model", os.getpid()), daemon=True
        )
        fake.start()
    serve = functools.partial(_run_worker, config, reload, overlay, str(runtime.path), workers, replicas)
    pool = Workers(workers, serve, config.workers, runtime.path)
    signal.signal(signal.SIGHUP, lambda signum, frame: pool.forward())
    signal.signal(signal.SIGTERM, lambda signum, frame: pool.terminate())
    signal.signal(signal.SIGINT, lambda signum, frame: pool.terminate())
    failed: WorkersFailed | launch.LaunchFailed | None = None
    try:
        pool.start()
        log.info(
            "gymproxy %s: %d workers on http://%s:%d (runtime directory %s)",
            __version__,
            workers,
            config.host,
            config.port,
            runtime.path,
        )
        while not pool.stopping:
            if stepping is None or launcher is None:
                pool.watch(TICK_S)
            else:
                stepping.run_until_complete(asyncio.sleep(TICK_S))
                pool.watch(0)
                _write_states(replicas, launcher)
                if launcher.failure is not None:
                    raise launcher.failure
            if fake is not None and not fake.is_alive():
                raise WorkersFailed(f"the bundled fake vLLM exited with {fake.exitcode}")
    except (WorkersFailed, launch.LaunchFailed) as exc:
        failed = exc
        log.error("%s: stopping", exc if isinstance(exc, WorkersFailed) else "no vLLM replica could start")
    finally:
        pool.terminate()
        if launcher is not None:
            launcher.hold()
        codes = pool.join(config.shutdown_grace_s + 5)
        if fake is not None:
            fake.terminate()
            fake.join(5)
        if stepping is not None and launcher is not None:
            stepping.run_until_complete(launcher.stop())
            stepping.close()
        runtime.remove()
    if isinstance(failed, launch.LaunchFailed):
        raise failed
    if failed is not None:
        raise SystemExit(f"gymproxy: {failed}")
    if any(code not in (0, -signal.SIGTERM, None) for code in codes):
        raise SystemExit(f"gymproxy: a worker exited with {codes}")


def _write_states(path: Path | None, launcher: launch.Launcher) -> None:
    """The replicas' states for the workers' /health (replaced whole, so a reader never sees half)."""
    if path is None:
        return
    data = msgspec.json.encode(launcher.states(processes=True))
    if path.exists() and path.read_bytes() == data:
        return
    temporary = path.with_name(path.name + ".new")
    temporary.write_bytes(data)
    os.replace(temporary, path)


def _run_worker(
    config: Config,
    reload: Loader | None,
    overlay: Path,
    runtime: str,
    workers: int,
    replicas: Path | None,
    index: int,
    restarts: int,
    lifeline: Lifeline,
) -> None:
    # A SIGHUP before the loop handles it must not end the worker (its default action).
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    logs.configure(config.log_level, config.log_format, worker=index)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops workers with SIGTERM
    peers = Peers(runtime, index, workers, restarts=restarts)
    server.run(
        config,
        reuse_port=True,
        reload=reload,
        overlay=overlay,
        peers=peers,
        replicas=replicas,
        lifeline=lifeline.attach,
    )


def _run_fake(port: int, model: str, parent: int) -> None:
    from .testing.fake_vllm import run

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(parent)
    run("127.0.0.1", port, model)


def _load(args: argparse.Namespace) -> Config:
    overrides = dict(_pair(item) for item in args.set)
    if args.command == "check-config":
        args._unresolved = None if args.strict else {}
        args._warnings = []
        files = [*args.config, *(item for item in args.items if not _is_override(item))]
        return load_config(
            files,
            overrides=overrides,
            server=args.server,
            unresolved=args._unresolved,
            hydra=[item for item in args.items if _is_override(item)],
            warnings=args._warnings,
        )
    extra: dict[str, Any] = {"host": args.host, "port": args.port, "model": args.model, "api_key": args.api_key}
    extra |= {"log_level": args.log_level, "log_format": args.log_format, "access_log": args.access_log or None}
    launched = _launch_flags(args)
    if launched:
        extra["launch"] = launched
    if args.upstream:
        extra["base_url"] = args.upstream
    elif not args.config and not args.launch_vllm and not args.overrides:
        if args.host is not None and not is_loopback(args.host):
            raise ConfigError(
                f"--host {args.host}: with no upstream gymproxy serves its bundled fake vLLM (a demo), and only on "
                "a loopback host; give the upstream (--upstream URL, or --config FILE with base_url or upstreams)"
            )
        port = _free_port()
        args._fake_port = port
        extra["base_url"] = [f"http://127.0.0.1:{port}/v1"]
    args._extra = extra
    return load_config(args.config or [], overrides=overrides, server=args.server, extra=extra, hydra=args.overrides)


def _arguments(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line, with overrides (and check-config's files) anywhere among the options:
    argparse takes one run of positionals only."""
    args, rest = parser.parse_known_args(argv)
    items: list[str] | None = getattr(args, "overrides", getattr(args, "items", None))
    if rest and (items is None or any(item.startswith("-") for item in rest)):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if items is not None:
        items.extend(rest)
        if args.command == "serve" and not all(_is_override(item) for item in items):
            parser.error(f"serve takes overrides (key=value, +key=value, ++key=value, ~key), got {items}")
    return args


def _is_override(item: str) -> bool:
    """A Hydra-style override (`key=value`, `+key=value`, `~key`) among check-config's files."""
    return "=" in item or item.startswith("~")


def _launch_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The `launch` keys the serve flags set (`--launch-vllm "MODEL ARGS..."`, `--replicas`, ...)."""
    keys: dict[str, Any] = {}
    if args.launch_vllm is not None:
        try:
            words = shlex.split(args.launch_vllm)
        except ValueError as exc:
            raise ConfigError(f"--launch-vllm: cannot split {args.launch_vllm!r}: {exc}") from None
        if not words or words[0].startswith("-"):
            raise ConfigError('--launch-vllm takes "MODEL [vllm serve args...]", the model first')
        keys["model"], keys["args"] = words[0], words[1:]
    flags = {
        "replicas": args.replicas,
        "gpus_per_replica": args.gpus_per_replica,
        "vllm_bin": args.vllm_bin,
        "log_dir": args.vllm_log_dir,
    }
    keys.update({key: value for key, value in flags.items() if value is not None})
    return keys


def _unstand(url: str) -> str:
    """An upstream URL as check-config shows it: a stand-in for a placeholder shown as the placeholder."""
    prefix = f"http://{STAND_IN_HOST}/"
    return f"${{{url[len(prefix) :]}}}" if url.startswith(prefix) else url


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _pair(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise SystemExit(f"gymproxy: --set takes name=value, got {text!r}")
    return name.strip(), value


OVERRIDES_HELP = (
    "Hydra-style overrides as NeMo Gym's command line takes them, merged over the files: key=value or "
    "++key=value sets a dotted key, +key=value adds one, ~key deletes one, +config_paths=[a.yaml,b.yaml] adds files"
)
EXIT_CODES = """exit status:
  0  the config is valid (check-config: warnings, such as a base_url without /v1, go to stderr)
  1  serve: no launched vLLM replica started
  2  the config or the command line is wrong: one line on stderr for each problem, at its file:line"""


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the exit-status table as written."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gymproxy", description="Responses <-> Chat Completions proxy for vLLM")
    parser.add_argument("--version", action="version", version=f"gymproxy {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the proxy", epilog=EXIT_CODES, formatter_class=_Formatter)
    serve.add_argument(
        "--config",
        action="append",
        metavar="FILE",
        help="YAML config (flat, or NeMo Gym's layout); repeat to merge several, later ones winning",
    )
    serve.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=OVERRIDES_HELP)
    serve.add_argument("--host", help="listen address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="listen port (default 8000)")
    serve.add_argument(
        "--upstream", action="append", metavar="URL", help="vLLM base URL ending in /v1; repeat for several"
    )
    serve.add_argument("--model", help="model name sent upstream (default: the client's)")
    serve.add_argument("--api-key", help="bearer token for the upstream")
    serve.add_argument("--server", help="which vllm_model entry of a NeMo Gym config to use")
    serve.add_argument(
        "--set", action="append", default=[], metavar="NAME=VALUE", help="resolve ${NAME} (or set a config key)"
    )
    serve.add_argument("--workers", type=int, help="worker processes sharing the port (default: num_workers or 1)")
    serve.add_argument(
        "--launch-vllm",
        metavar='"MODEL [ARGS...]"',
        help="start `vllm serve MODEL ARGS...` replicas and serve in front of them (the `launch` section)",
    )
    serve.add_argument("--replicas", type=int, help="vLLM replicas to launch (default 1)")
    serve.add_argument(
        "--gpus-per-replica", type=int, help="GPUs per replica (default: its parallel sizes; 0: a CPU vLLM)"
    )
    serve.add_argument("--vllm-bin", help="the vllm executable (default: `vllm` on PATH)")
    serve.add_argument("--log-level", choices=("debug", "info", "warning", "error"), help="default info (log_level)")
    serve.add_argument("--log-format", choices=("text", "json"), help="text or json, one object a line (log_format)")
    serve.add_argument("--access-log", action="store_true", help="one line per request (access_log)")
    serve.add_argument("--vllm-log-dir", help="write each replica's output to DIR/vllm-<i>.log, not to this log")

    check = commands.add_parser(
        "check-config",
        help="validate config files and exit",
        description="Validate config files as `serve` reads them and print every problem, each at its file and line.",
        epilog=EXIT_CODES,
        formatter_class=_Formatter,
    )
    check.add_argument(
        "items",
        nargs="*",
        metavar="FILE|KEY=VALUE",
        help="config files, merged in order (later ones win), and overrides: " + OVERRIDES_HELP,
    )
    check.add_argument(
        "--config", action="append", default=[], metavar="FILE", help="a config file (as serve takes it)"
    )
    check.add_argument("--server")
    check.add_argument("--set", action="append", default=[], metavar="NAME=VALUE")
    check.add_argument(
        "--strict", action="store_true", help="a ${NAME} with no value from --set or the environment is an error"
    )

    rollouts = commands.add_parser("rollouts", help="the rollouts capture recorded (capture.*)")
    actions = rollouts.add_subparsers(dest="action", required=True)
    export = actions.add_parser(
        "export",
        help="write every rollout, as GET /v1/rollouts/{id} gives it, to a file a training job reads",
        epilog="exit status: 0 written; 1 the store could not be read or the file written (no file is left); "
        "2 the command cannot run as given (a bad --store, .parquet without pyarrow)",
    )
    export.add_argument("--store", required=True, help="capture.store: sqlite:///PATH or redis://HOST:PORT/DB")
    export.add_argument("--out", required=True, help="FILE.jsonl (one rollout a line), or FILE.parquet (pyarrow)")
    export.add_argument("--frozen-only", action="store_true", help="only rollouts frozen by POST .../freeze")

    fake = commands.add_parser("fake-vllm", help="run the bundled fake vLLM (for demos and tests)")
    fake.add_argument("--host", default="127.0.0.1")
    fake.add_argument("--port", type=int, default=8001)
    fake.add_argument("--model", default="fake-model")
    fake.add_argument("--max-model-len", type=int, help="the context length it claims and enforces (default 131072)")
    return parser
