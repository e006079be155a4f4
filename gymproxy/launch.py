"""vLLM servers gymproxy starts and keeps up itself (`launch:`, `gymproxy serve --launch-vllm`).

`prepare` plans the replicas (ports, GPUs, command lines) and raises `ConfigError` before anything
starts; `Launcher` runs them. Replica i is upstream `vllm-<i>`, a `vllm serve` in its own process
group on a port it keeps across restarts, so the fleet's upstream list never changes: the launcher
only tells the fleet (`on_down` / `on_ready`) when one goes down or is ready again. Until the first
replica is ready, any failure ends startup (`LaunchFailed`); after that an exit is restarted under
`launch.restart`. `reaper.py` stops the groups if gymproxy dies without doing so.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import msgspec

from .config import Config, ConfigError, Launch, UpstreamSpec

log = logging.getLogger("gymproxy")

REPLICA_ENV = "GYMPROXY_REPLICA"  # each replica's index, for wrapper scripts
TAIL_LINES = 20
LINE_MAX = 4096  # characters of one output line kept; the rest is cut (a replica may print anything)
READY_POLL_S = 0.5
EXIT_POLL_S = 0.05
TAIL_BYTES = TAIL_LINES * LINE_MAX
HEALTH_TIMEOUT_S = 2.0
WATCH_POLL_S = 5.0  # a ready replica's /health is asked this often (at most), for `launch.unresponsive_s`
LEFTOVER_GRACE_S = 5.0  # after a replica's main process exits, what is left of its group gets this long
REAPER = Path(__file__).with_name("reaper.py")
EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
PORT_FLOOR = 10000  # replicas' own ports start here: below are the well-known and configured ones
_MANAGED = {"--host", "--port", "--uds"}
_PARALLEL = {
    "--tensor-parallel-size": "tp",
    "-tp": "tp",
    "--pipeline-parallel-size": "pp",
    "-pp": "pp",
    "--data-parallel-size": "dp",
    "-dp": "dp",
}
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
_SECRET = re.compile(r"key|token|secret|password", re.IGNORECASE)


class LaunchFailed(Exception):
    """Startup failed: no replica became ready; the message says which one failed, how, and its last lines."""


class Replica:
    """One `vllm serve` process gymproxy keeps running, and what is known of it."""

    def __init__(self, index: int, port: int, argv: list[str], env: dict[str, str], devices: list[str] | None) -> None:
        self.index = index
        self.name = f"vllm-{index}"
        self.port = port
        self.url = f"http://127.0.0.1:{port}/v1"
        self.argv = argv
        self.env = env
        self.devices = devices  # its CUDA_VISIBLE_DEVICES (None: left as gymproxy's)
        self.state = "starting"
        self.process: asyncio.subprocess.Process | None = None
        self.started = 0.0  # time.monotonic() of its latest start
        self.ready_after: float | None = None  # seconds its latest start took to answer /health
        self.starts = 0
        self.restarts: collections.deque[float] = collections.deque()  # when, within the window
        self.exit_code: int | None = None
        self.error: str | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.log_start = 0  # with `log_dir`: where its latest life's output starts in its file

    def status(self) -> dict[str, Any]:
        """What /health shows of it."""
        running = self.process is not None and self.process.returncode is None
        return {
            "name": self.name,
            "url": self.url,
            "state": self.state,
            "pid": self.process.pid if running and self.process is not None else None,
            "gpus": self.devices,
            "starts": self.starts,
            "ready_after_s": None if self.ready_after is None else round(self.ready_after, 1),
            "exit_code": self.exit_code,
            "error": self.error,
        }

    def last_lines(self) -> str:
        if not self.tail:
            return "  (it printed nothing)"
        return "\n".join(f"  [{self.name}] {line}" for line in self.tail)


def prepare(config: Config, environ: Mapping[str, str] = os.environ) -> Launcher:
    """Plan the replicas of `config.launch` and return the `Launcher` (not started) whose `config`
    has them as its upstreams; raises `ConfigError` naming the option when they cannot be run."""
    launch = config.launch
    assert launch is not None
    if not port_free(config.port, config.host):  # found now, not after minutes of loading models
        raise ConfigError(f"port: {config.host}:{config.port} (gymproxy's own, --port) is taken by another process")
    for arg in launch.args:
        if arg.split("=", 1)[0] in _MANAGED:
            raise ConfigError(
                f"launch.args: gymproxy sets {arg.split('=', 1)[0]} for each replica; remove it "
                "(launch.base_port fixes the ports)"
            )
    binary = _find(launch.vllm_bin, environ)
    groups = gpu_groups(launch, environ)
    ports = _ports(launch)
    base = {**environ, **launch.env}
    if launch.hf_home is not None:
        base["HF_HOME"] = launch.hf_home
    if launch.log_dir is not None:
        try:
            Path(launch.log_dir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"launch.log_dir: cannot create {launch.log_dir}: {exc}") from None
    replicas = []
    for index, (port, devices) in enumerate(zip(ports, groups, strict=True)):
        env = {**base, REPLICA_ENV: str(index)}
        if devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
        argv = [binary, "serve", launch.model, *launch.args, "--host", "127.0.0.1", "--port", str(port)]
        replicas.append(Replica(index, port, argv, env, devices))
    launcher = Launcher(launch, replicas)
    launcher.model = config.model or _flag(launch.args, "--served-model-name") or launch.model
    launcher.api_key = config.api_key or _flag(launch.args, "--api-key")
    launcher.config = launcher.apply(config)
    return launcher


def keep_replicas(read: Config, launched: Config) -> Config:
    """A config read again (SIGHUP) with the upstreams, model and key of the one the replicas were
    launched with (`Launcher.config`): the replicas stay the fleet."""
    return msgspec.structs.replace(
        read, upstreams=launched.upstreams, model=read.model or launched.model, api_key=read.api_key or launched.api_key
    )


def gpu_groups(launch: Launch, environ: Mapping[str, str]) -> list[list[str] | None]:
    """Each replica's GPUs: K of those in CUDA_VISIBLE_DEVICES, else of `nvidia-smi -L`'s; None
    where CUDA_VISIBLE_DEVICES is left alone (K is 0, or it is unset and the host shows none)."""
    visible = visible_gpus(environ)
    wanted = launch.gpus_per_replica
    if wanted is None:
        wanted = _parallel_size(launch.args) if visible else 0
    if wanted == 0:
        if visible is None and launch.gpus_per_replica is None and launch.replicas > 1:
            log.info("launch: no GPUs found; the %d replicas run without CUDA_VISIBLE_DEVICES", launch.replicas)
        return [None] * launch.replicas
    need = launch.replicas * wanted
    have = visible or []
    if len(have) < need:
        found = (
            f"CUDA_VISIBLE_DEVICES has {len(have)} ({','.join(have)})"
            if "CUDA_VISIBLE_DEVICES" in environ
            else f"nvidia-smi -L lists {len(have)}"
        )
        raise ConfigError(
            f"launch: {launch.replicas} replicas x {wanted} GPUs (--replicas, --gpus-per-replica) need {need} GPUs, "
            f"but {found}; use fewer, or --gpus-per-replica 0 for a CPU vLLM"
        )
    return [have[i * wanted : (i + 1) * wanted] for i in range(launch.replicas)]


def visible_gpus(environ: Mapping[str, str]) -> list[str] | None:
    """The GPUs this process may use: CUDA_VISIBLE_DEVICES's entries, else `nvidia-smi -L`'s indices;
    None when neither shows any."""
    if "CUDA_VISIBLE_DEVICES" in environ:
        devices = [d.strip() for d in environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
        return devices or None
    smi = shutil.which("nvidia-smi", path=environ.get("PATH"))
    if smi is None:
        return None
    try:
        done = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20, env=dict(environ))
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    count = sum(1 for line in done.stdout.splitlines() if line.startswith("GPU "))
    return [str(i) for i in range(count)] or None


def _parallel_size(args: Sequence[str]) -> int:
    """GPUs one `vllm serve` with these args uses: tensor x pipeline x data parallel sizes."""
    sizes = {"tp": 1, "pp": 1, "dp": 1}
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name in _PARALLEL:
            if not eq:
                value = args[i + 1] if i + 1 < len(args) else ""
            try:
                sizes[_PARALLEL[name]] = int(value)
            except ValueError:
                raise ConfigError(f"launch.args: {name} needs a whole number, got {value!r}") from None
    return sizes["tp"] * sizes["pp"] * sizes["dp"]


def _flag(args: Sequence[str], name: str) -> str | None:
    """The value of `name` in `args` (`--name v` or `--name=v`), or None."""
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg[len(name) + 1 :]
    return None


def _find(binary: str, environ: Mapping[str, str]) -> str:
    found = shutil.which(binary, path=environ.get("PATH")) if os.sep not in binary else None
    if found is None and os.sep in binary and os.access(binary, os.X_OK) and Path(binary).is_file():
        found = binary
    if found is None:
        where = "is not an executable file" if os.sep in binary else "is not on PATH"
        raise ConfigError(
            f"launch.vllm_bin: {binary!r} {where}; install vLLM, or give its path with --vllm-bin "
            "(e.g. /path/to/vllm-venv/bin/vllm)"
        )
    return os.path.abspath(found)


def _ports(launch: Launch) -> list[int]:
    """The replicas' ports: base_port + i, each checked free; else free ports outside the kernel's
    ephemeral range (see `quiet_ports`)."""
    if launch.base_port is not None:
        ports = [launch.base_port + i for i in range(launch.replicas)]
        if ports[-1] > 65535:
            raise ConfigError(f"launch.base_port: {launch.replicas} replicas from {launch.base_port} pass 65535")
        for port in ports:
            if not port_free(port):
                raise ConfigError(f"launch.base_port: port {port} (of {ports}) is taken by another process")
        return ports
    return quiet_ports(launch.replicas)


def quiet_ports(count: int, ephemeral: Path = EPHEMERAL) -> list[int]:
    """`count` free ports outside the kernel's ephemeral range, so no outgoing connection (gymproxy
    opens thousands) takes one as its local port while its replica restarts; a random start keeps
    two gymproxies starting at once apart. Kernel-picked ports if no such range has room."""
    try:
        low, high = (int(part) for part in ephemeral.read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    spans = [(first, last) for first, last in ((PORT_FLOOR, low - 1), (high + 1, 65535)) if last - first >= 4 * count]
    if spans:
        first, last = max(spans, key=lambda span: span[1] - span[0])
        size = last - first + 1
        start = random.randrange(size)
        ports: list[int] = []
        for step in range(size):
            port = first + (start + step) % size
            if port_free(port):
                ports.append(port)
                if len(ports) == count:
                    return ports
    held = []
    try:  # all held at once, so no two replicas get the same one
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            held.append(sock)
        return [int(sock.getsockname()[1]) for sock in held]
    finally:
        for sock in held:
            sock.close()


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a listener could bind `host:port` now."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except OSError:
        return True  # a name that does not resolve: the listener reports it
    with socket.socket(family) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a TIME_WAIT of the last run is no owner
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def shown_line(raw: bytes) -> str:
    """One output line made safe to log: decoded, control characters escaped, cut at LINE_MAX."""
    text = raw.decode(errors="replace").rstrip("\r\n")
    text = text.rsplit("\r", 1)[-1]  # a progress bar redrawn in place: its last state
    text = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
    if len(text) > LINE_MAX:
        text = f"{text[:LINE_MAX]}... ({len(text) - LINE_MAX} more characters)"
    return text


def shown_command(argv: Sequence[str]) -> str:
    """A command line for the log, with the values of secret-looking flags masked."""
    out, secret = [], False
    for arg in argv:
        if secret:
            out.append("****")
            secret = False
            continue
        name, eq, _ = arg.partition("=")
        if name.startswith("--") and _SECRET.search(name):
            out.append(f"{name}=****" if eq else arg)
            secret = not eq
        else:
            out.append(arg)
    return " ".join(out)


class Launcher:
    """Runs the planned replicas: starts them, reports them, restarts them, and stops them."""

    def __init__(self, launch: Launch, replicas: list[Replica]) -> None:
        self.launch = launch
        self.replicas = replicas
        self.config: Config  # the config with the replicas as upstreams (set by `prepare`)
        self.model: str = launch.model  # the name clients' requests are sent with
        self.api_key: str | None = None
        self.on_down: Callable[[str, str], None] | None = None  # (replica name, why)
        self.on_ready: Callable[[str], None] | None = None
        self.serving = False  # past startup: an exit is restarted, not fatal
        self.failure: LaunchFailed | None = None
        self._changed = asyncio.Event()  # a replica became ready, or startup failed
        self._stopping = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._reaper: subprocess.Popen[bytes] | None = None

    def apply(self, config: Config) -> Config:
        """`config` with the replicas as its upstreams, and the model name and key they serve with."""
        specs = [UpstreamSpec(url=r.url, name=r.name) for r in self.replicas]
        return msgspec.structs.replace(
            config, upstreams=specs, model=config.model or self.model, api_key=config.api_key or self.api_key
        )

    def states(self) -> list[dict[str, Any]]:
        """Each replica's state, for /health."""
        return [replica.status() for replica in self.replicas]

    async def start(self) -> None:
        """Start the reaper and every replica (each supervised by a task of its own)."""
        self._reaper = subprocess.Popen(
            [sys.executable, str(REAPER), str(self.launch.stop_grace_s)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )
        gpus = ", ".join(f"{r.name}: {','.join(r.devices)}" for r in self.replicas if r.devices)
        log.info(
            "launching %d vLLM replica(s) of %s (%s); each gets /health %g s to answer",
            len(self.replicas),
            self.launch.model,
            f"GPUs {gpus}" if gpus else "CUDA_VISIBLE_DEVICES left as it is",
            self.launch.startup_timeout_s,
        )
        for replica in self.replicas:
            self._tasks.append(asyncio.ensure_future(self._keep(replica)))

    async def wait_ready(self, stop: asyncio.Event) -> bool:
        """Wait for the first replica to be ready (True), or for `stop` (False); raises
        `LaunchFailed` if a replica fails first."""
        stopped = asyncio.ensure_future(stop.wait())
        try:
            while True:
                if self.failure is not None:
                    raise self.failure
                if any(r.state == "ready" for r in self.replicas):
                    self.serving = True
                    return True
                if stop.is_set():
                    return False
                self._changed.clear()
                changed = asyncio.ensure_future(self._changed.wait())
                await asyncio.wait({changed, stopped}, return_when=asyncio.FIRST_COMPLETED)
                changed.cancel()
        finally:
            stopped.cancel()

    def hold(self) -> None:
        """gymproxy is stopping: no replica is restarted from now on."""
        self._stopping.set()

    async def stop(self) -> None:
        """Stop every replica's process group (SIGTERM, SIGKILL after `stop_grace_s`), then the reaper."""
        self._stopping.set()
        await asyncio.gather(*(self._terminate(r) for r in self.replicas))
        if self._tasks:  # each ends on its own now; one stuck in its cleanup is cancelled
            await asyncio.wait(self._tasks, timeout=LEFTOVER_GRACE_S + 1)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        running = sum(1 for r in self.replicas if r.state not in ("failed", "stopped"))
        for replica in self.replicas:
            if replica.state != "failed":
                replica.state = "stopped"
        if self._reaper is not None:
            if self._reaper.stdin is not None:
                self._reaper.stdin.close()  # nothing left to reap: it exits at once
            try:
                await asyncio.get_running_loop().run_in_executor(None, self._reaper.wait, 5)
            except subprocess.TimeoutExpired:
                self._reaper.kill()
            self._reaper = None
        log.info("stopped %d vLLM replica(s)", running)

    async def _keep(self, replica: Replica) -> None:
        """Run `replica`, and again after each exit for as long as `launch.restart` allows."""
        policy = self.launch.restart
        while not self._stopping.is_set():
            why = await self._run(replica)
            if self._stopping.is_set():
                return
            if not self.serving and not any(r.state == "ready" for r in self.replicas):
                self._fail(replica, why)
                return
            self.serving = True
            now = time.monotonic()
            while replica.restarts and now - replica.restarts[0] > policy.window_s:
                replica.restarts.popleft()
            if len(replica.restarts) >= policy.attempts:
                replica.state = "failed"
                replica.error = f"{why}; given up after {len(replica.restarts)} restart(s) in {policy.window_s:g} s"
                log.error("%s %s; its last lines:\n%s", replica.name, replica.error, replica.last_lines())
                return
            delay = min(policy.backoff_max_s, policy.backoff_s * 2 ** len(replica.restarts))
            replica.restarts.append(now)
            replica.state = "restarting"
            replica.error = why
            log.warning(
                "%s %s; restarting it in %g s (restart %d of at most %d in %g s); its last lines:\n%s",
                replica.name,
                why,
                delay,
                len(replica.restarts),
                policy.attempts,
                policy.window_s,
                replica.last_lines(),
            )
            try:
                await asyncio.wait_for(self._stopping.wait(), delay)
            except asyncio.TimeoutError:
                pass

    def _fail(self, replica: Replica, why: str) -> None:
        replica.state = "failed"
        replica.error = why
        where = f"; its whole log: {self._log_path(replica)}" if self.launch.log_dir else ""
        self.failure = LaunchFailed(
            f"startup failed: {replica.name} {why}{where}; its last {len(replica.tail)} lines:\n{replica.last_lines()}"
        )
        self._changed.set()

    async def _run(self, replica: Replica) -> str:
        """One life of `replica`, from its start to its exit; returns why it ended."""
        replica.state, replica.ready_after, replica.process = "starting", None, None
        if not port_free(replica.port):
            return f"cannot start: port {replica.port} is taken by another process"
        replica.starts += 1
        replica.started = time.monotonic()
        replica.tail.clear()  # an error names the lines of the life that failed
        command = shown_command(replica.argv)
        log.info("%s starting (port %d): %s", replica.name, replica.port, command)
        # With log_dir the replica writes its file itself: its output never passes through this
        # process (vLLM logs every request), and the tail is read back from the file when needed.
        output: IO[bytes] | int = asyncio.subprocess.PIPE
        if self.launch.log_dir is not None:
            output = self._log_path(replica).open("ab")
            output.write(f"--- gymproxy: start {replica.starts} of {replica.name}: {command}\n".encode())
            output.flush()
            replica.log_start = output.tell()
        try:
            process = await asyncio.create_subprocess_exec(
                *replica.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=output,
                stderr=asyncio.subprocess.STDOUT,
                env=replica.env,
                start_new_session=True,  # its own process group: vLLM's EngineCore is stopped with it
            )
        except OSError as exc:
            return f"cannot start {replica.argv[0]}: {exc}"
        finally:
            if not isinstance(output, int):
                output.close()  # the replica has its own
        replica.process = process
        self._tell_reaper(f"+{process.pid}")
        pump = asyncio.ensure_future(self._pump(replica, process.stdout))
        exited = asyncio.ensure_future(_exit_of(process))
        ready = asyncio.ensure_future(self._until_ready(replica))
        try:
            done, _ = await asyncio.wait(
                {exited, ready}, timeout=self.launch.startup_timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
            if ready in done and not exited.done():
                replica.state = "ready"
                replica.ready_after = time.monotonic() - replica.started
                replica.error = None
                log.info("%s ready after %.0f s at %s", replica.name, replica.ready_after, replica.url)
                self._changed.set()
                if self.on_ready is not None:
                    self.on_ready(replica.name)
                hung = asyncio.ensure_future(self._until_hung(replica))
                try:
                    await asyncio.wait({exited, hung}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    hung.cancel()
                if exited.done():
                    why = f"exited with code {exited.result()} after {time.monotonic() - replica.started:.0f} s"
                else:
                    why = f"stopped answering /health for {self.launch.unresponsive_s:g} s (launch.unresponsive_s)"
                    if not self._stopping.is_set():
                        log.warning("%s %s: stopping it", replica.name, why)
            elif exited.done():
                why = f"exited with code {exited.result()} while starting (after {time.monotonic() - replica.started:.0f} s)"
            else:
                why = f"did not answer /health within {self.launch.startup_timeout_s:g} s (launch.startup_timeout_s)"
            if not self._stopping.is_set() and self.on_down is not None:
                self.on_down(replica.name, f"{replica.name} {why}")  # before its cleanup: sessions move now
        finally:
            ready.cancel()
            await self._terminate(replica)
            try:
                await asyncio.wait_for(pump, LEFTOVER_GRACE_S)  # the rest of its output
            except asyncio.TimeoutError:
                pump.cancel()
            self._tell_reaper(f"-{process.pid}")
            self._read_tail(replica)
        replica.exit_code = process.returncode
        return why

    async def _terminate(self, replica: Replica) -> None:
        """Stop what runs of the replica's process group: SIGTERM, then SIGKILL after the grace."""
        process = replica.process
        if process is None:
            return
        if process.returncode is None:
            _signal_group(process.pid, signal.SIGTERM)
            _signal_group(process.pid, signal.SIGCONT)  # a stopped process acts on the SIGTERM only once it runs
            try:
                await asyncio.wait_for(_exit_of(process), self.launch.stop_grace_s)
            except asyncio.TimeoutError:
                log.warning("%s did not stop in %g s: killing it", replica.name, self.launch.stop_grace_s)
        # What outlives the main process (vLLM's EngineCore) goes too.
        if _group_alive(process.pid):
            _signal_group(process.pid, signal.SIGTERM)
            deadline = time.monotonic() + min(LEFTOVER_GRACE_S, self.launch.stop_grace_s)
            while _group_alive(process.pid) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            _signal_group(process.pid, signal.SIGKILL)
        await _exit_of(process)

    async def _until_ready(self, replica: Replica) -> None:
        """Poll the replica's /health until it answers 200, reporting progress now and then."""
        report = time.monotonic() + self.launch.progress_interval_s
        while not await _healthy(replica.port):
            await asyncio.sleep(READY_POLL_S)
            self._read_tail(replica)
            now = time.monotonic()
            if now >= report:
                report = now + self.launch.progress_interval_s
                last = replica.tail[-1] if replica.tail else "(nothing printed yet)"
                log.info(
                    "%s still %s after %.0f s (pid %s); last line: %s",
                    replica.name,
                    replica.state,
                    now - replica.started,
                    replica.process.pid if replica.process else "-",
                    last,
                )

    async def _until_hung(self, replica: Replica) -> None:
        """Return once the ready replica's /health has not answered 200 for `launch.unresponsive_s`."""
        limit = self.launch.unresponsive_s
        if limit is None:
            await asyncio.get_running_loop().create_future()  # never: the exit ends the wait
            return
        poll = min(WATCH_POLL_S, limit / 4)
        answered = time.monotonic()
        while True:
            await asyncio.sleep(poll)
            if await _healthy(replica.port, timeout=min(limit, WATCH_POLL_S)):
                answered = time.monotonic()
            elif time.monotonic() - answered >= limit:
                return

    async def _pump(self, replica: Replica, stream: asyncio.StreamReader | None) -> None:
        """Copy the replica's output, line by line, to gymproxy's log (None: it writes its file)."""
        if stream is None:
            return
        pending = b""
        while True:
            chunk = await stream.read(65536)
            if not chunk:
                break
            pending += chunk
            *lines, pending = pending.split(b"\n")
            if len(pending) > 4 * LINE_MAX:  # no newline in sight: take it as a line
                lines.append(pending)
                pending = b""
            for line in lines:
                self._line(replica, line)
        if pending:
            self._line(replica, pending)

    def _line(self, replica: Replica, raw: bytes) -> None:
        text = shown_line(raw)
        if not text.strip():
            return
        replica.tail.append(text)
        if replica.state == "starting":
            replica.state = "loading"
        log.info("[%s] %s", replica.name, text)

    def _read_tail(self, replica: Replica) -> None:
        """With `log_dir`: the last lines of the replica's latest life, from its file."""
        if self.launch.log_dir is None:
            return
        try:
            with self._log_path(replica).open("rb") as file:
                size = file.seek(0, os.SEEK_END)
                file.seek(max(replica.log_start, size - TAIL_BYTES))
                data = file.read()
        except OSError:
            return
        if data and replica.state == "starting":
            replica.state = "loading"
        lines = [shown_line(line) for line in data.split(b"\n")]
        replica.tail.clear()
        replica.tail.extend(line for line in lines if line.strip())

    def _log_path(self, replica: Replica) -> Path:
        assert self.launch.log_dir is not None
        return Path(self.launch.log_dir) / f"{replica.name}.log"

    def _tell_reaper(self, line: str) -> None:
        reaper = self._reaper
        if reaper is None or reaper.stdin is None:
            return
        try:
            reaper.stdin.write(line.encode() + b"\n")
            reaper.stdin.flush()
        except OSError:  # it died: there is no guard left, but the replicas run on
            log.warning("the vLLM reaper process has exited: replicas may outlive a killed gymproxy")
            self._reaper = None


async def _exit_of(process: asyncio.subprocess.Process) -> int:
    """Its exit code once it has exited. (`Process.wait()` on asyncio's own loop also waits until
    every holder of its output pipe has closed it, and vLLM's EngineCore holds it.)"""
    while process.returncode is None:
        await asyncio.sleep(EXIT_POLL_S)
    return process.returncode


async def _healthy(port: int, timeout: float = HEALTH_TIMEOUT_S) -> bool:
    """Whether `GET /health` on the port answers 200 within `timeout` (each of connect and reply)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout)
    except (OSError, asyncio.TimeoutError):
        return False
    try:
        writer.write(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        line = await asyncio.wait_for(reader.readline(), timeout)
        return line.split(b" ", 2)[1:2] == [b"200"]
    except (OSError, asyncio.TimeoutError, ValueError):
        return False
    finally:
        writer.close()


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True
