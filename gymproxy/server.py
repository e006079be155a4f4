"""`gymproxy serve`'s process: the listening socket and its connection cap, signals, and the drain.

The app runs on aiohttp's `AppRunner` with `handler_cancellation=True` (a client that leaves cancels
its handler), behind a listener of gymproxy's own (`listener.py`): a deep accept backlog
(`limits.backlog`) for connection storms, a deadline for request heads, and a cap on open client
connections (`limits.max_client_connections`) that idle or stalled connections make room under and
past which a new connection is answered 503 at once, so stalled or abandoned clients cannot take the
file descriptors that upstream connections and health checks need. `access.admin_port` is served
the same way, with its own cap (`access.admin_max_connections`). On SIGTERM or SIGINT the
listener closes, requests in flight get `shutdown_grace_s`, and then the ones still running are
ended (streams with their terminal event; `plugin.setup` keeps the grace). A plugin leaves the
listener and the process to its host app. With `launch` (a `launch.Launcher`), the vLLM replicas
start and the listener opens at once: /health lists the replicas while they load (503 until one is
ready), and requests meanwhile get a 503 with Retry-After naming them (`fleet.NotReady`). If every
replica fails before one is ready, gymproxy drains and stops; the replicas are stopped after the drain.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, cast

import msgspec
from aiohttp import web

from . import __version__, tasks
from .config import Config, ConfigError
from .errors import quiet_malformed_requests
from .launch import Launcher, LaunchFailed
from .listener import ConnectionCap
from .ownership import Owner, Process
from .peers import Peers
from .plugin import PROXIES, admin_app, create_app
from .proxy import Proxy
from .routes import end_stalled_body

log = logging.getLogger("gymproxy")

# aiohttp's own backstop after the grace: a handler still running then (one stuck writing to a
# client that reads nothing) is cancelled.
BACKSTOP_S = 5.0
FOLLOW_POLL_S = 0.02  # how often a worker looks at the replicas' states its parent writes (a stat)
# A young-generation collection runs once this many more container objects were made than freed.
GC_THRESHOLD = 20_000
ADMIN_BACKLOG = 128  # the admin port's listen backlog (aiohttp's default)


def run(
    config: Config,
    *,
    fake_port: int | None = None,
    reuse_port: bool = False,
    reload: Callable[[], Config] | None = None,
    overlay: Path | None = None,
    peers: Peers | None = None,
    launcher: Launcher | None = None,
    replicas: Path | None = None,
    lifeline: Callable[[asyncio.Event], None] | None = None,
) -> None:
    """Run one gymproxy process until SIGTERM or SIGINT; with `fake_port`, the fake vLLM runs beside it.

    On SIGHUP, `reload()` reads the config again and its upstreams are applied live (`Proxy.reload`);
    a config it cannot read is logged and the fleet stays. With `overlay` (a worker of
    `--workers N`), the admin changes are shared through that file, and a change taken here is
    announced to the parent with a SIGHUP, which it forwards to every worker. With `peers` (a
    worker too), its `/metrics` covers every worker. With `launcher`, its replicas are the upstreams
    (`config` is `launcher.config`; a `reload` must keep them, as `launch.keep_replicas` does), and
    `launch.LaunchFailed` is raised when none of them starts. With `replicas` (a worker of `--workers
    N` with `launch`), /health shows the replicas' states the parent writes to that file. With
    `lifeline` (a worker too), it is called with the stop event once the process listens: it beats
    to the parent, and stops this process when the parent is gone (`workers.Lifeline.attach`)."""
    raise_open_files(config.limits.open_files)
    quiet_malformed_requests()
    loop = new_loop()
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(
            _serve(config, fake_port, reuse_port, reload, overlay, peers, launcher, replicas, lifeline)
        )
    finally:
        _cancel_tasks(loop)
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.run_until_complete(loop.shutdown_default_executor())  # chat templates render in its threads
        loop.close()


async def _serve(
    config: Config,
    fake_port: int | None,
    reuse_port: bool,
    reload: Callable[[], Config] | None,
    overlay: Path | None,
    peers: Peers | None,
    launcher: Launcher | None = None,
    replicas: Path | None = None,
    lifeline: Callable[[asyncio.Event], None] | None = None,
) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    if launcher is None:
        await _serve_app(config, fake_port, reuse_port, reload, overlay, peers, stop, None, replicas, lifeline)
        return
    failed = asyncio.ensure_future(_until_failed(launcher, stop))
    try:
        await launcher.start()
        await _serve_app(config, fake_port, reuse_port, reload, overlay, peers, stop, launcher)
    finally:
        failed.cancel()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
        await launcher.stop()
    if launcher.failure is not None:
        raise launcher.failure


async def _until_failed(launcher: Launcher, stop: asyncio.Event) -> None:
    """Set `stop` if startup fails (no replica was ever ready, and one failed); past the first
    ready replica, failures are restarts (`launch.restart`) and gymproxy serves on."""
    try:
        await launcher.wait_ready(stop)
    except LaunchFailed:
        log.error("no vLLM replica could start: stopping")
        stop.set()


async def _serve_app(
    config: Config,
    fake_port: int | None,
    reuse_port: bool,
    reload: Callable[[], Config] | None,
    overlay: Path | None,
    peers: Peers | None,
    stop: asyncio.Event,
    launcher: Launcher | None,
    replicas: Path | None = None,
    lifeline: Callable[[asyncio.Event], None] | None = None,
) -> None:
    loop = asyncio.get_running_loop()
    app = create_app(config)
    proxy = app[PROXIES][0]
    if overlay is not None:
        proxy.overlay.path = overlay
        parent = os.getppid()
        proxy.notify = lambda: os.kill(parent, signal.SIGHUP)
    if peers is not None:
        app.cleanup_ctx.append(_peers(proxy, peers))
    if fake_port is not None:
        app.cleanup_ctx.insert(0, _fake_vllm(fake_port, config.model or "fake-model"))
    if config.access.admin_port is not None:
        app.cleanup_ctx.append(_admin_site(app[PROXIES][0], config, reuse_port))
    if launcher is not None:
        follow(launcher, proxy)
    elif replicas is not None:
        app.cleanup_ctx.append(follow_file(replicas, proxy))
    # `access_log`'s lines are gymproxy's own (`logs.access`, with the request's upstream and tokens).
    runner = _runner(app, config, None, config.shutdown_grace_s + BACKSTOP_S)
    await runner.setup()
    assert runner.server is not None
    timeout = config.limits.client_header_timeout
    cap = ConnectionCap(runner.server, connection_limit(config), header_timeout=timeout, end_stalled=end_stalled_body)
    proxy.connections = lambda: cap.open
    proxy.fleet.holds.share(cap.limit, "limits.max_client_connections")
    listener = await loop.create_server(
        cap.protocol, config.host, config.port, backlog=config.limits.backlog, reuse_port=reuse_port or None
    )
    loop.add_signal_handler(signal.SIGHUP, _reloader(proxy, reload))
    tune_gc()
    log.info(
        "gymproxy %s listening on http://%s:%d (pid %d, at most %d client connections)",
        __version__,
        config.host,
        config.port,
        os.getpid(),
        cap.limit,
    )
    if lifeline is not None:
        lifeline(stop)
    try:
        await stop.wait()
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.remove_signal_handler(signum)
        log.info("stopping: no new connections; requests in flight get %g s", config.shutdown_grace_s)
        if launcher is not None:
            launcher.hold()  # a replica that exits during the drain stays down
        listener.close()
        await runner.cleanup()  # app.on_shutdown starts the grace (plugin.setup), then waits for handlers
        cap.close()


def _runner(app: web.Application, config: Config, access_log: logging.Logger | None, shutdown: float) -> web.AppRunner:
    """`app`'s runner, as `gymproxy serve` runs it (its listener is `ConnectionCap`'s: see `listener.py`)."""
    return web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=access_log,
        keepalive_timeout=config.limits.client_keepalive_timeout,  # AppRunner alone keeps them an hour
        shutdown_timeout=shutdown,
    )


def follow(launcher: Launcher, proxy: Proxy) -> None:
    """Keep the fleet in step with the replicas: one that exits is closed at once (its sessions
    move on their next request, and nothing more goes to its port, whoever binds it next), one
    ready again takes new sessions at once; /health lists them all. A replica not ready yet takes
    no sessions until it is, then joins as an upstream added live (`Upstream.fresh`). Every
    connection to a replica's port asks its `ownership.Owner` first (`Fleet.own`), and a replica
    that moved to another port (its own was taken) is followed there (`Proxy.place`)."""
    fleet = proxy.fleet
    proxy.replicas = launcher.states
    replicas = {replica.name: replica for replica in launcher.replicas}

    def down(name: str, why: str) -> None:
        proxy.place(name, replicas[name].url)
        if (u := fleet.find(name)) is not None:
            fleet.close(u, why)

    def ready(name: str) -> None:
        proxy.place(name, replicas[name].url)
        if (u := fleet.find(name)) is not None:
            fleet.ready(u)

    launcher.on_down, launcher.on_ready = down, ready
    for replica in launcher.replicas:
        if (u := fleet.find(replica.name)) is not None:
            fleet.own(u, replica.owner)
    for state in launcher.states():
        if state["state"] != "ready" and (u := fleet.find(state["name"])) is not None:
            fleet.hold(u, _not_ready(state))


def follow_file(path: Path, proxy: Proxy) -> Callable[[web.Application], AsyncIterator[None]]:
    """A worker's view of the replicas its parent runs, from the states it writes to `path`:
    /health shows them, and the fleet opens and closes each replica as they say (looked at every
    `FOLLOW_POLL_S`), and follows one that moved to another port. A worker never opens a replica
    by itself: a closed one waits for the file to say it is ready. The replica's process (its pid
    and start time in the file) is this worker's own `ownership.Owner` of the replica, which every
    connection to its port asks first: the worker learns of its exit from the kernel, not the file.
    Returns the app's cleanup context that runs the watch."""
    fleet = proxy.fleet
    seen: tuple[int, int, int] | None = None
    states: list[dict[str, Any]] = []
    owners: dict[str, tuple[Owner, Any]] = {}  # by replica: its owner, and the process it follows

    def load() -> bool:
        """Read the file if it changed (it is replaced whole, so each write is a new inode)."""
        nonlocal seen, states
        try:
            stat = path.stat()
            if (stat.st_ino, stat.st_mtime_ns, stat.st_size) == seen:
                return False
            seen = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
            states = cast(list[dict[str, Any]], msgspec.json.decode(path.read_bytes()))
        except (OSError, msgspec.DecodeError):
            return False
        for state in states:
            name, identity = state["name"], state.pop("process", None)  # [pid, start time] or null
            if name not in owners:
                owners[name] = (Owner(name), None)
                if (u := fleet.find(name)) is not None:
                    fleet.own(u, owners[name][0])
            owner, known = owners[name]
            if identity != known:
                owner.runs(Process.of(*identity) if identity else None)
                owners[name] = (owner, identity)
            proxy.place(name, state["url"])
        return True

    def apply() -> None:
        for state in states:
            if (u := fleet.find(state["name"])) is None:
                continue
            if state["state"] != "ready":
                fleet.close(u, _not_ready(state))  # again when only its reason changed
            elif u.closed is not None:
                fleet.ready(u)

    load()
    for state in states:  # not ready at startup: they join once they are, as in `follow`
        if state["state"] != "ready" and (u := fleet.find(state["name"])) is not None:
            fleet.hold(u, _not_ready(state))
    proxy.replicas = lambda: states

    async def watch(_: web.Application) -> AsyncIterator[None]:
        async def poll() -> None:
            while True:
                await asyncio.sleep(FOLLOW_POLL_S)
                if load():
                    apply()

        task = asyncio.ensure_future(poll())
        yield
        task.cancel()

    return watch


def _not_ready(state: dict[str, Any]) -> str:
    """Why a replica takes no requests, from its /health entry."""
    why = f"{state['name']} is {state['state']}"
    return f"{why}: {state['error']}" if state.get("error") else why


def _reloader(proxy: Proxy, reload: Callable[[], Config] | None) -> Callable[[], None]:
    """The SIGHUP handler: re-read the config (and the workers' overlay) and apply the upstreams."""

    def hup() -> None:
        if reload is None:
            log.info("SIGHUP: no config to re-read; applying the admin changes only")
            proxy.reload(proxy.config)
            return
        try:
            config = reload()
        except ConfigError as exc:
            log.error("SIGHUP: the new config is not used, the fleet stays as it is: %s", exc)
            return
        except Exception:  # a bug: the process keeps serving the fleet it has
            log.exception("SIGHUP: reading the config failed unexpectedly; the fleet stays as it is")
            return
        proxy.reload(config)

    return hup


def connection_limit(config: Config) -> int:
    """`limits.max_client_connections`, or half the open-file limit: every client connection may
    need an upstream connection too, and health checks and logs need a few more (and the admin
    port's connections, when it has one)."""
    if config.limits.max_client_connections is not None:
        return config.limits.max_client_connections
    try:
        import resource
    except ImportError:  # not on this platform
        return 4096
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 20
    admin = 0 if config.access.admin_port is None else config.access.admin_max_connections
    return max(64, (soft - 128 - admin) // 2)


def raise_open_files(target: int) -> None:
    """Thousands of concurrent rollouts need thousands of sockets: raise `ulimit -n` where allowed."""
    try:
        import resource
    except ImportError:  # not on this platform
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < target:
        try:  # allowed to a privileged process (CAP_SYS_RESOURCE), as a container's root often is
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, target))
            hard = target
        except (ValueError, OSError):
            pass
    wanted = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit to %d: %s", wanted, exc)
    if soft < target:
        log.warning(
            "open-file limit is %d (< %d): thousands of concurrent sessions may fail with 'Too many open files'; "
            "raise it with `ulimit -n`",
            soft,
            target,
        )


def tune_gc() -> None:
    """Make the cycle collector run when cyclic garbage builds up, not every other request.

    A 30-item rollout request allocates hundreds of containers that reference counting frees.
    With Python's default threshold (700) the in-flight ones alone set off a young collection
    every few requests, and now and then a full one over every module object: 25-30 µs of CPU
    per request (timed with `gc.callbacks`). Startup objects are frozen (never garbage), and the
    threshold is raised well above what the requests in flight hold at a time, so collections
    run when garbage cycles pile up. Only `gymproxy serve` does this: an application that mounts
    gymproxy keeps its own settings.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_THRESHOLD, *gc.get_threshold()[1:])


def new_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop when it is installed (`pip install 'gymproxy[speed]'`), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


def _admin_site(proxy: Any, config: Config, reuse_port: bool) -> Callable[[web.Application], AsyncIterator[None]]:
    """`access.admin_port`, behind a listener like the main port's, with its own cap."""

    async def lifetime(_: web.Application) -> AsyncIterator[None]:
        runner = _runner(admin_app(proxy), config, None, BACKSTOP_S)
        await runner.setup()
        assert runner.server is not None
        cap = ConnectionCap(
            runner.server,
            config.access.admin_max_connections,
            header_timeout=config.limits.client_header_timeout,
            setting="access.admin_max_connections",
            what="connections to the admin port",
        )
        port = config.access.admin_port
        listener = await asyncio.get_running_loop().create_server(
            cap.protocol, config.host, port, backlog=ADMIN_BACKLOG, reuse_port=reuse_port or None
        )
        log.info("/health and /metrics on http://%s:%d (at most %d connections)", config.host, port, cap.limit)
        yield
        listener.close()
        await runner.cleanup()
        cap.close()

    return lifetime


def _peers(proxy: Any, peers: Peers) -> Callable[[web.Application], AsyncIterator[None]]:
    async def lifetime(_: web.Application) -> AsyncIterator[None]:
        proxy.peers = peers
        await peers.serve(proxy.render_metrics)
        yield
        await peers.close()

    return lifetime


def _fake_vllm(port: int, model: str) -> Callable[[web.Application], AsyncIterator[None]]:
    async def lifetime(app: web.Application) -> AsyncIterator[None]:
        from .testing.fake_vllm import DEMO_MAX_MODEL_LEN, start

        fake_runner = (await start("127.0.0.1", port, model, DEMO_MAX_MODEL_LEN))[1]
        yield
        await fake_runner.cleanup()

    return lifetime


def _cancel_tasks(loop: asyncio.AbstractEventLoop) -> None:
    running = asyncio.all_tasks(loop)
    if running:
        loop.run_until_complete(tasks.cancel(running))
