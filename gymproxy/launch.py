"""vLLM servers gymproxy starts and keeps up itself (`launch:`, `gymproxy serve --launch-vllm`).

`prepare` plans the replicas (ports, GPUs, command lines) and raises `ConfigError` before anything
starts; `Launcher` runs them. Replica i is upstream `vllm-<i>`, a `vllm serve` in its own process
group on a port it keeps across restarts unless another process takes it (`_claim`: then it moves
to a fresh one, or with `base_port` waits, and spends no restart), so the fleet's upstream list
never changes: the launcher only tells the fleet (`on_down` / `on_ready`, and `Replica.url`) when
one goes down, moves or is ready again. Until the first replica is ready, any failure ends startup
(`LaunchFailed`); after that an exit is restarted under `launch.restart`. `reaper.py` stops the
groups if gymproxy dies without doing so.

A replica's port is a local port above 1024: while the replica restarts, another local process
could bind it and be sent the sessions' prompts. So a replica is ready only once the server on its
port is proven to be it (`_ours`); the fleet sends nothing to a replica's port between `on_down`
and `on_ready`; and since that notice comes milliseconds after the death, every connection the
fleet opens to the port first asks the replica's `ownership.Owner` (its process alive, by pidfd;
the server's end of the connection gymproxy's own user's). With `hold_ports`, gymproxy also holds
each port itself (`hold_port`: bound with SO_REUSEPORT, never listening; Linux lets only the same
user's sockets bind beside it, and vLLM sets SO_REUSEPORT with several API servers). Each replica
has an API key of its own (`VLLM_API_KEY`, in its environment: argv is visible to every local
user), which vLLM checks on `/v1/*` and the fleet sends with every request. A replica's
environment is gymproxy's without gymproxy's own secrets (`replica_environment`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import msgspec

from . import ownership, tasks, vllm_errors
from .config import Config, ConfigError, Launch, UpstreamSpec

log = logging.getLogger("gymproxy")

REPLICA_ENV = "GYMPROXY_REPLICA"  # each replica's index, for wrapper scripts
# vLLM's access lines for gymproxy's own polls (health checks, pause and weight questions): kept out of
# the log below debug, where an idle replica wrote 24 a minute.
OWN_POLLS = re.compile(r'"GET /(?:health|is_paused|weight_info|v1/models) HTTP/1\.[01]" (?:200|401)')
KEY_ENV = "VLLM_API_KEY"  # vLLM's API key from the environment (`--api-key` wins over it)
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"  # `access.fleet_control` sets it to 1 for every replica
# Not passed on to replicas: a client's key of OpenAI's API (vLLM uses none). HF_TOKEN is kept: vLLM
# needs it to download a gated model.
DROPPED_ENV = ("OPENAI_API_KEY",)
SECRET_MIN = 8  # an environment value equal to one of gymproxy's secrets this long or longer is dropped
TAIL_LINES = 200  # output lines of a replica's latest life kept, to find why it failed (`vllm_errors`)
SHOWN_LINES = 20  # ... and shown with an error
LINE_MAX = 4096  # characters of one output line kept; the rest is cut (a replica may print anything)
READY_POLL_S = 0.5
PORT_WAIT_S = 1.0  # how often a replica's fixed port (`launch.base_port`) that another process took is looked at
EXIT_POLL_S = 0.05  # how often a replica's exit is looked for without pidfds
REAP_POLL_S = 0.002  # ... and once its pidfd said it exited, until the child watcher has reaped it
TAIL_BYTES = 64 * 1024  # read back from the end of a replica's file (`launch.log_dir`) for its tail
# A replica's output pipe is drained at most this often, in bulk (a chatty vLLM prints a line per
# request), and is made this big meanwhile (Linux; the default is 64 KiB).
PUMP_PAUSE_S = 0.05
PIPE_SIZE = 1 << 20
READ_MAX = 4 << 20  # bytes read from the pipe per wakeup, at most
LOG_RATE = 100  # lines a second of one replica's output logged, past a burst of
LOG_BURST = 2000  # (vLLM's startup prints a few hundred)
DROPPED_REPORT_S = 10.0  # how often the count of lines not logged is
HEALTH_TIMEOUT_S = 2.0
# A ready replica's /health is asked this often (at most): an answer other than 200 (vLLM's engine
# died) shows it `unhealthy` at once, and no answer for `launch.unresponsive_s` gets it restarted.
WATCH_POLL_S = 1.0
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


class LogBudget:
    """How many output lines may be logged: `burst` at once, then `rate` a second (a token bucket);
    the lines it refuses are counted until `report`."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst, self.clock = rate, burst, clock
        self.tokens = float(burst)
        self.stamp = self.reported = clock()
        self.dropped = 0

    def take(self, count: int) -> int:
        """How many of `count` lines may be logged now; the rest are counted as dropped."""
        now = self.clock()
        self.tokens = min(float(self.burst), self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        allowed = min(count, int(self.tokens))
        self.tokens -= allowed
        self.dropped += count - allowed
        return allowed

    def since_report(self) -> float:
        return self.clock() - self.reported

    def report(self) -> tuple[int, float]:
        """The lines dropped since the last report, and over how many seconds; the count starts again."""
        now = self.clock()
        dropped, seconds = self.dropped, now - self.reported
        self.dropped, self.reported = 0, now
        return dropped, seconds


class LaunchFailed(Exception):
    """Startup failed: no replica became ready. The message is one line: which replica failed, how,
    the cause its output gives and a hint; `last_lines` are its last lines of output."""

    def __init__(self, message: str, last_lines: str) -> None:
        super().__init__(message)
        self.last_lines = last_lines


class Replica:
    """One `vllm serve` process gymproxy keeps running, and what is known of it."""

    def __init__(
        self, index: int, port: int, argv: list[str], env: dict[str, str], devices: list[str] | None, api_key: str
    ) -> None:
        self.index = index
        self.name = f"vllm-{index}"
        self.port = port  # it may move to another (`Launcher._claim`)
        self.argv = argv
        self.env = env
        self.devices = devices  # its CUDA_VISIBLE_DEVICES (None: left as gymproxy's)
        self.api_key = api_key  # what vLLM checks on /v1/* (`KEY_ENV`, or the user's `--api-key`)
        self.state = "starting"
        self.process: asyncio.subprocess.Process | None = None
        self.started = 0.0  # time.monotonic() of its latest start
        self.ready_after: float | None = None  # seconds its latest start took to answer /health
        self.starts = 0
        self.restarts: collections.deque[float] = collections.deque()  # when, within the window
        self.exit_code: int | None = None
        self.error: str | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.partial = ""  # the line it is printing now (no newline yet: a progress bar redrawn in place)
        self.printed: float | None = None  # time.time() of its latest output
        self.started_at: float | None = None  # time.time() of its latest start
        # What its output must not show anywhere gymproxy repeats it (/health, the cause of a failure).
        self.secrets = _secrets_of(api_key, env, argv)
        self.log_start = 0  # with `log_dir`: where its latest life's output starts in its file
        self.stranger: str | None = None  # why the server on its port is not it, while that is so
        self.guard: socket.socket | None = None  # what holds its port while gymproxy runs (`hold_port`)
        self.owner = ownership.Owner(self.name)  # its process while it runs: the fleet asks it before sending

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

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
            "started_at": None if self.started_at is None else round(self.started_at),
            "ready_after_s": None if self.ready_after is None else round(self.ready_after, 1),
            "exit_code": self.exit_code,
            "error": self.error,
        }

    def last_lines(self) -> str:
        if not self.tail:
            return "  (it printed nothing)"
        return "\n".join(f"  [{self.name}] {line}" for line in list(self.tail)[-SHOWN_LINES:])

    def newest(self) -> str:
        """The line it printed last (the one being drawn, if any), and how long ago, for progress reports."""
        line = self.partial or (self.tail[-1] if self.tail else "")
        if not line or self.printed is None:
            return "it printed nothing yet"
        return f"its newest line ({time.time() - self.printed:.0f} s ago): {line}"

    def cause(self) -> str | None:
        """Why its latest life failed, as its output says (`vllm_errors.cause`), with secrets masked."""
        found = vllm_errors.cause([*self.tail, self.partial] if self.partial else list(self.tail))
        return None if found is None else self.redact(found)

    def redact(self, text: str) -> str:
        for secret in self.secrets:
            text = text.replace(secret, "****")
        return text


def _secrets_of(api_key: str, env: Mapping[str, str], argv: Sequence[str]) -> list[str]:
    """The replica's key, the values of its secret-looking variables and flags (`shown_command`'s)."""
    found = {api_key, *(value for name, value in env.items() if _SECRET.search(name))}
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name.startswith("--") and _SECRET.search(name):
            found.add(value if eq else (argv[i + 1] if i + 1 < len(argv) else ""))
    return sorted((s for s in found if len(s) >= SECRET_MIN), key=len, reverse=True)


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
    base = {**replica_environment(config, environ), **launch.env}
    flag_key = _flag(launch.args, "--api-key")
    if flag_key is not None:
        base.pop(KEY_ENV, None)  # one key only: vLLM versions differ in which of the two wins
    given = flag_key or launch.env.get(KEY_ENV)  # the user's own key, for every replica
    if launch.hf_home is not None:
        base["HF_HOME"] = launch.hf_home
    if config.access.fleet_control:
        base.setdefault(DEV_MODE_ENV, "1")  # vLLM mounts /pause, /resume and the weight routes only then
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
        key = given
        if key is None:
            key = env[KEY_ENV] = secrets.token_urlsafe(32)
        argv = [binary, "serve", launch.model, *launch.args, "--host", "127.0.0.1", "--port", str(port)]
        replicas.append(Replica(index, port, argv, env, devices, key))
    launcher = Launcher(launch, replicas)
    launcher.model = config.model or _flag(launch.args, "--served-model-name") or launch.model
    launcher.api_key = config.api_key or _flag(launch.args, "--api-key")
    launcher.config = launcher.apply(config)
    return launcher


def replica_environment(config: Config, environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` without gymproxy's own secrets: the pin secret's variable (`pinning.secret_env`),
    `DROPPED_ENV`, and any variable whose value is a key or secret gymproxy holds (upstream keys,
    client keys, the pin secret). A replica runs a model's code, which has no use for them."""
    held = {config.pinning.secret, config.api_key, *config.access.api_keys, *(u.api_key for u in config.upstreams)}
    held = {value for value in held if value and len(value) >= SECRET_MIN}
    dropped = {config.pinning.secret_env, *DROPPED_ENV}
    return {name: value for name, value in environ.items() if name not in dropped and value not in held}


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


def quiet_ports(count: int, ephemeral: Path = EPHEMERAL, exclude: Collection[int] = ()) -> list[int]:
    """`count` free ports outside the kernel's ephemeral range, so no outgoing connection (gymproxy
    opens thousands) takes one as its local port while its replica restarts; a random start keeps
    two gymproxies starting at once apart. None of `exclude` (another replica's, free while it
    restarts). Kernel-picked ports if no such range has room."""
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
            if port not in exclude and port_free(port):
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


def hold_port(port: int) -> socket.socket | None:
    """A socket bound to 127.0.0.1:`port` that never listens, so the port stays gymproxy's while
    its replica restarts: with SO_REUSEPORT (and no SO_REUSEADDR) Linux lets no other user's socket
    bind the port, whatever its options or address, while the replica (gymproxy's user; vLLM sets
    SO_REUSEPORT with `--api-server-count` > 1) binds beside it, and connections go to the listening one only. None where the
    platform has no SO_REUSEPORT or the port is taken."""
    reuse_port = getattr(socket, "SO_REUSEPORT", None)
    if reuse_port is None:
        return None
    sock = socket.socket()
    try:
        sock.setsockopt(socket.SOL_SOCKET, reuse_port, 1)
        sock.bind(("127.0.0.1", port))
    except OSError:
        sock.close()
        return None
    return sock


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
        specs = [UpstreamSpec(url=r.url, name=r.name, api_key=r.api_key) for r in self.replicas]
        return msgspec.structs.replace(
            config, upstreams=specs, model=config.model or self.model, api_key=config.api_key or self.api_key
        )

    def states(self, processes: bool = False) -> list[dict[str, Any]]:
        """Each replica's state, for /health; with `processes`, also its process's pid and start time
        (`process`, for the workers' `ownership.Owner`s), or null while none runs."""
        if not processes:
            return [replica.status() for replica in self.replicas]
        return [{**replica.status(), "process": replica.owner.identity()} for replica in self.replicas]

    async def start(self) -> None:
        """Hold the replicas' ports, start the reaper and every replica (each supervised by a task of its own)."""
        if self.launch.hold_ports:
            if not hasattr(socket, "SO_REUSEPORT"):
                log.warning("launch.hold_ports: no SO_REUSEPORT here; a replica's port is free while it restarts")
            for replica in self.replicas:
                replica.guard = hold_port(replica.port)  # None when taken: its start says so
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
                if self.serving:
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
        await tasks.cancel(self._tasks)
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
        for replica in self.replicas:
            if replica.guard is not None:
                replica.guard.close()
                replica.guard = None
        log.info("stopped %d vLLM replica(s)", running)

    async def _keep(self, replica: Replica) -> None:
        """Run `replica`, and again after each exit for as long as `launch.restart` allows."""
        policy = self.launch.restart
        lost = False
        while await self._claim(replica, lost):
            why = await self._run(replica)
            if self._stopping.is_set():
                return
            # A start that failed while another process holds its port lost the port to it after
            # gymproxy looked: no restart is spent on that (`_claim` moves it).
            lost = replica.ready_after is None and self._taken(replica)
            if lost:
                log.warning("%s %s, and another process holds its port %d", replica.name, why, replica.port)
                continue
            if not self.serving:  # no replica was ever ready: startup failed
                self._fail(replica, why)
                return
            now = time.monotonic()
            while replica.restarts and now - replica.restarts[0] > policy.window_s:
                replica.restarts.popleft()
            if len(replica.restarts) >= policy.attempts:
                replica.state = "failed"
                replica.error = f"{why}; given up after {len(replica.restarts)} restart(s) in {policy.window_s:g} s"
                log.error("%s %s; its last lines:\n%s", replica.name, replica.error, replica.last_lines())
                self._down(replica)
                return
            delay = min(policy.backoff_max_s, policy.backoff_s * 2 ** len(replica.restarts))
            replica.restarts.append(now)
            replica.state = "restarting"
            replica.error = why
            self._down(replica)
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

    async def _claim(self, replica: Replica, lost: bool) -> bool:
        """Before each start, make sure the replica's port is free (`lost`: its last start failed
        with the port taken). A port another process took is left to it, and costs no restart: the
        replica moves to a fresh port (the fleet's upstream follows; its sessions keep their pins,
        which name the replica), or with `launch.base_port` waits for its own, saying who holds it.
        So a local user who takes the port can neither use up the restart budget nor keep the
        replica out for good. False once gymproxy is stopping."""
        said = None
        loop = asyncio.get_running_loop()
        while not self._stopping.is_set():
            if self.launch.hold_ports and replica.guard is None:
                replica.guard = hold_port(replica.port)
            if not (lost or self._taken(replica)):
                return True
            lost = False
            port = replica.port
            who = await loop.run_in_executor(None, ownership.holder, port)  # reads /proc: off the loop
            if self.launch.base_port is None:
                fresh = quiet_ports(1, exclude={r.port for r in self.replicas})[0]
                replica.error = f"port {port} is taken by {who}: moved to port {fresh}"
                log.warning("%s: %s (its sessions stay pinned to it)", replica.name, replica.error)
                self._move(replica, fresh)
                self._down(replica)  # the fleet's upstream, and the workers' file, follow it
                continue
            why = f"port {port} is taken by {who}; waiting for it (launch.base_port fixes the ports)"
            if why != said:
                said = replica.error = why
                log.warning("%s: %s", replica.name, why)
                self._down(replica)
            try:
                await asyncio.wait_for(self._stopping.wait(), PORT_WAIT_S)
            except asyncio.TimeoutError:
                pass
        return False

    def _move(self, replica: Replica, port: int) -> None:
        """The replica starts on `port` from now on (another process has its old one)."""
        replica.port = port
        replica.argv[-1] = str(port)  # `--port N` ends its command line (`prepare`)
        if replica.guard is not None:
            replica.guard.close()
            replica.guard = None

    def _down(self, replica: Replica) -> None:
        """Tell the fleet why the replica is down now (each restart that fails says so anew)."""
        if not self._stopping.is_set():
            self._tell(self.on_down, replica.name, f"{replica.name} {replica.state}: {replica.error}")

    def _tell(self, listener: Callable[..., None] | None, *args: str) -> None:
        """Call `on_down` / `on_ready`; a failure there is logged, and the supervision goes on."""
        if listener is None:
            return
        try:
            listener(*args)
        except Exception:
            log.exception("telling the fleet of %s failed", args[0])

    def _fail(self, replica: Replica, why: str) -> None:
        replica.state = "failed"
        replica.error = why
        where = f"; its whole log: {self._log_path(replica)}" if self.launch.log_dir else ""
        advice = vllm_errors.hint("\n".join([why, *replica.tail]), self.launch.model, replica.env)
        self.failure = LaunchFailed(
            f"startup failed: {replica.name} {why}{where}" + (f"; hint: {advice}" if advice else ""),
            replica.last_lines(),
        )
        self._changed.set()

    def _loading(self, replica: Replica) -> None:
        """It printed its first output: loading. The fleet's reason for holding it says so (a request
        before any replica is ready is answered with every replica's reason)."""
        replica.state = "loading"
        if not self._stopping.is_set():
            self._tell(self.on_down, replica.name, f"{replica.name} is loading")

    async def _run(self, replica: Replica) -> str:
        """One life of `replica`, from its start to its exit; returns why it ended."""
        replica.state, replica.ready_after, replica.process = "starting", None, None
        replica.starts += 1
        replica.started, replica.started_at = time.monotonic(), time.time()
        replica.tail.clear()  # an error names the lines of the life that failed
        replica.partial, replica.printed = "", None
        command = shown_command(replica.argv)
        log.info("%s starting (port %d): %s", replica.name, replica.port, command)
        # With log_dir the replica writes its file itself: its output never passes through this
        # process (vLLM logs every request), and the tail is read back from the file when needed.
        pipe: int | None = None
        output: IO[bytes] | int
        if self.launch.log_dir is None:
            pipe, output = _output_pipe()
        else:
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
            if pipe is not None:
                os.close(pipe)
            return f"cannot start {replica.argv[0]}: {exc}"
        except BaseException:
            if pipe is not None:
                os.close(pipe)
            raise
        finally:
            if isinstance(output, int):
                os.close(output)  # the replica has its own
            else:
                output.close()
        replica.process = process
        replica.owner.runs(ownership.Process.of(process.pid))
        self._tell_reaper(f"+{process.pid}")
        pump = asyncio.ensure_future(self._pump(replica, pipe))
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
                self.serving = True  # past startup: from now on an exit is restarted, not fatal
                log.info("%s ready after %.0f s at %s", replica.name, replica.ready_after, replica.url)
                self._changed.set()
                self._tell(self.on_ready, replica.name)
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
                if replica.stranger:
                    why = f"was not ready within {self.launch.startup_timeout_s:g} s (launch.startup_timeout_s): {replica.stranger}"
            replica.state, replica.error = "down", why  # not ready from now on, for the workers' file too
            if not self._stopping.is_set():
                self._tell(self.on_down, replica.name, f"{replica.name} {why}")  # before its cleanup: sessions move now
        finally:
            ready.cancel()
            await self._terminate(replica)
            try:
                await asyncio.wait_for(pump, LEFTOVER_GRACE_S)  # the rest of its output
            except asyncio.TimeoutError:
                pump.cancel()
            self._tell_reaper(f"-{process.pid}")
            self._read_tail(replica)
            replica.owner.runs(None)
        replica.exit_code = process.returncode
        found = replica.cause() if process.returncode else None
        if found is not None:
            why = f"{why}: {found}" if replica.ready_after is None else f"{why} (the last error in its output: {found})"
        if replica.ready_after is None and replica.guard is not None and self._cannot_bind(replica):
            why += (
                "; gymproxy holds its port with SO_REUSEPORT (launch.hold_ports), which a vLLM that does not"
                " set SO_REUSEPORT cannot bind beside: set launch.hold_ports: false"
            )
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
        """Poll the replica's /health until it answers 200 and the server on its port is proven to
        be the replica (`_ours`), reporting progress now and then."""
        report = time.monotonic() + self.launch.progress_interval_s
        replica.stranger = None
        while not (await _healthy(replica.port, replica.owner) and await self._ours(replica)):
            await asyncio.sleep(READY_POLL_S)
            self._read_tail(replica)
            now = time.monotonic()
            if now >= report:
                report = now + self.launch.progress_interval_s
                log.info(
                    "%s still %s after %.0f s (pid %s); %s",
                    replica.name,
                    replica.state,
                    now - replica.started,
                    replica.process.pid if replica.process else "-",
                    replica.newest(),
                )

    def _taken(self, replica: Replica) -> bool:
        """Whether another process has the replica's port now. Held for it (`hold_port`), only a
        listener of gymproxy's own user can be there: /proc tells (else the replica finds out)."""
        if replica.guard is None:
            return not port_free(replica.port)
        return bool(ownership.listeners(replica.port))

    async def _ours(self, replica: Replica) -> bool:
        """Whether the server answering on the replica's port is the replica: its process runs,
        `/v1/models` refuses a wrong API key (401) and takes its own (200), and unless gymproxy holds
        the port for it (then only gymproxy's own user can listen there), the listening socket is
        held by its process group (where /proc tells). Every probe's connection passes the
        replica's `Owner` first (`_status`), so another user's process on the port is sent no
        probe, and never the key."""
        process = replica.process
        if process is None or process.returncode is not None:
            return False
        try:
            if replica.guard is None and ownership.holds_listener(process.pid, replica.port) is False:
                why = f"port {replica.port} is held by another process, not by {replica.name}'s"
            elif await _status(replica.port, "/v1/models", replica.owner, secrets.token_urlsafe(16)) != 401:
                why = f"the server on port {replica.port} does not check {replica.name}'s API key (a wrong one is not refused)"
            elif (status := await _status(replica.port, "/v1/models", replica.owner, replica.api_key)) != 200:
                why = f"the server on port {replica.port} refuses {replica.name}'s API key (GET /v1/models answered {status})"
            else:
                return True
        except Stranger as exc:
            why = f"{replica.name}'s key was not sent: {exc}"
        if why != replica.stranger:
            replica.stranger = why
            log.warning("%s is not ready: %s", replica.name, why)
        return False

    async def _until_hung(self, replica: Replica) -> None:
        """Watch the ready replica's /health until it has not answered at all for
        `launch.unresponsive_s` (then return). An answer other than 200 (vLLM's engine died: the
        process exits soon) shows it `unhealthy` at once, and the fleet sends it nothing; a 200
        makes it ready again."""
        limit = self.launch.unresponsive_s
        poll = WATCH_POLL_S if limit is None else min(WATCH_POLL_S, limit / 4)
        answered = time.monotonic()
        while True:
            await asyncio.sleep(poll)
            timeout = HEALTH_TIMEOUT_S if limit is None else min(limit, HEALTH_TIMEOUT_S)
            try:
                status = await _status(replica.port, "/health", replica.owner, timeout=timeout)
            except Stranger:
                status = None  # it is gone from its port: its exit is next
            if status is not None:
                answered = time.monotonic()
                self._answered(replica, status)
            elif limit is not None and time.monotonic() - answered >= limit:
                return

    def _answered(self, replica: Replica, status: int) -> None:
        """What a ready (or unhealthy) replica's /health answered."""
        if status != 200 and replica.state == "ready":
            replica.state, replica.error = "unhealthy", f"its /health answered {status}"
            log.warning("%s is unhealthy: its /health answered %d", replica.name, status)
            self._down(replica)
        elif status == 200 and replica.state == "unhealthy":
            replica.state, replica.error = "ready", None
            log.info("%s is healthy again", replica.name)
            self._tell(self.on_ready, replica.name)

    async def _pump(self, replica: Replica, pipe: int | None) -> None:
        """Copy the replica's output to gymproxy's log (None: it writes its file), cheaply however
        much it prints: the pipe is drained in bulk at most every `PUMP_PAUSE_S` (it holds
        `PIPE_SIZE` meanwhile), lines are split in bulk, at most `LOG_RATE` a second are logged
        past a burst of `LOG_BURST` (the others are counted, and the count logged), and only the
        last `TAIL_LINES` of each read are kept for error messages."""
        if pipe is None:
            return
        loop = asyncio.get_running_loop()
        budget = LogBudget(LOG_RATE, LOG_BURST)
        pending = b""
        try:
            while True:
                readable = loop.create_future()
                loop.add_reader(pipe, _wake, readable)
                try:
                    await readable
                finally:
                    loop.remove_reader(pipe)
                data, ended = _drain(pipe)
                lines = (pending + data).split(b"\n")
                pending = b"" if ended else lines.pop()
                if len(pending) > 4 * LINE_MAX:  # no newline in sight: take it as a line
                    lines.append(pending)
                    pending = b""
                if data:
                    replica.printed = time.time()
                    replica.partial = shown_line(pending) if pending.strip() else ""
                self._lines(replica, lines, budget)
                if ended:
                    break
                await asyncio.sleep(PUMP_PAUSE_S)
        finally:
            os.close(pipe)
            if budget.dropped:
                self._report_dropped(replica, budget)

    def _lines(self, replica: Replica, lines: list[bytes], budget: LogBudget) -> None:
        """Some of the replica's output lines: the last few go to its tail, as many as the
        budget allows to the log."""
        lines = [line for line in lines if line.strip()]
        if not lines:
            if replica.partial and replica.state == "starting":
                self._loading(replica)
            return
        if replica.state == "starting":
            self._loading(replica)
        replica.tail.extend(text for text in map(shown_line, lines[-TAIL_LINES:]) if text.strip())
        quiet = not log.isEnabledFor(logging.DEBUG)
        for raw in lines[: budget.take(len(lines))]:
            text = shown_line(raw)
            if text.strip() and not (quiet and OWN_POLLS.search(text)):
                log.info("[%s] %s", replica.name, text)
        if budget.dropped and budget.since_report() >= DROPPED_REPORT_S:
            self._report_dropped(replica, budget)

    def _report_dropped(self, replica: Replica, budget: LogBudget) -> None:
        dropped, seconds = budget.report()
        log.info(
            "[%s] ... %d more lines in the last %.0f s not logged (over %d a second; launch.log_dir keeps them all)",
            replica.name,
            dropped,
            seconds,
            LOG_RATE,
        )

    def _cannot_bind(self, replica: Replica) -> bool:
        """Its last lines say it could not bind its port."""
        return any("address already in use" in line.lower() for line in replica.tail)

    def _read_tail(self, replica: Replica) -> None:
        """With `log_dir`: the last lines of the replica's latest life, from its file."""
        if self.launch.log_dir is None:
            return
        try:
            with self._log_path(replica).open("rb") as file:
                size = file.seek(0, os.SEEK_END)
                file.seek(max(replica.log_start, size - TAIL_BYTES))
                data = file.read()
                printed = os.fstat(file.fileno()).st_mtime
        except OSError:
            return
        if data and replica.state == "starting":
            self._loading(replica)
        lines = [shown_line(line) for line in data.split(b"\n")]
        replica.tail.clear()
        replica.tail.extend(line for line in lines if line.strip())
        if data:
            replica.printed = printed

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
    """Its exit code once it has exited, known within a millisecond where a pidfd tells (Linux):
    the fleet must stop sending to its port before anyone else can bind it. (`Process.wait()` on
    asyncio's own loop also waits until every holder of its output pipe has closed it, and vLLM's
    EngineCore holds it.)"""
    poll = EXIT_POLL_S
    if process.returncode is None and await _pidfd_exit(process.pid):
        poll = REAP_POLL_S
    while process.returncode is None:  # set once the loop's child watcher has reaped it
        await asyncio.sleep(poll)
    return process.returncode


async def _pidfd_exit(pid: int) -> bool:
    """Wait for process `pid` to exit; False at once where pidfds are not available."""
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        return False
    loop = asyncio.get_running_loop()
    gone = loop.create_future()
    try:
        loop.add_reader(pidfd, _wake, gone)
        try:
            await gone
        finally:
            loop.remove_reader(pidfd)
    finally:
        os.close(pidfd)
    return True


def _wake(waiter: asyncio.Future[None]) -> None:
    """A reader callback: its fd is readable (it may be called again before the waiter runs)."""
    if not waiter.done():
        waiter.set_result(None)


async def _healthy(port: int, owner: ownership.Owner, timeout: float = HEALTH_TIMEOUT_S) -> bool:
    """Whether `GET /health` on the port answers 200 within `timeout` (each of connect and reply)."""
    try:
        return await _status(port, "/health", owner, timeout=timeout) == 200
    except Stranger:
        return False


class Stranger(Exception):
    """The replica's `Owner` refused the connection `_status` opened: nothing was sent on it."""


async def _status(
    port: int, path: str, owner: ownership.Owner, key: str | None = None, timeout: float = HEALTH_TIMEOUT_S
) -> int | None:
    """The status of `GET path` on the replica's port (with `key` as the bearer token), None when
    no status line came within `timeout` (each of connect and reply); `Stranger` when its `owner`
    refuses the connection (`Owner.after`: nothing is sent on it)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout)
    except (OSError, asyncio.TimeoutError):
        return None
    if (refused := await owner.after(writer.get_extra_info("socket"))) is not None:
        writer.close()
        raise Stranger(refused)
    auth = b"" if key is None else b"Authorization: Bearer %s\r\n" % key.encode()
    try:
        writer.write(b"GET %s HTTP/1.0\r\nHost: 127.0.0.1\r\n%s\r\n" % (path.encode(), auth))
        line = await asyncio.wait_for(reader.readline(), timeout)
        return int(line.split(b" ", 2)[1])
    except (OSError, asyncio.TimeoutError, ValueError, IndexError):
        return None
    finally:
        writer.close()


def _output_pipe() -> tuple[int, int]:
    """A pipe for a replica's output (read end non-blocking), made `PIPE_SIZE` big where allowed."""
    read, write = os.pipe()
    os.set_blocking(read, False)
    try:
        import fcntl

        fcntl.fcntl(write, getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_SIZE)
    except (ImportError, OSError):
        pass  # the default size: a flood of output waits on the pipe a little sooner
    return read, write


def _drain(pipe: int) -> tuple[bytes, bool]:
    """What can be read from the pipe now (up to `READ_MAX`), and whether it has ended."""
    chunks: list[bytes] = []
    size = 0
    while size < READ_MAX:
        try:
            chunk = os.read(pipe, PIPE_SIZE)
        except BlockingIOError:
            return b"".join(chunks), False
        except OSError:
            return b"".join(chunks), True
        if not chunk:
            return b"".join(chunks), True
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks), False


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
