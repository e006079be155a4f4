"""Configuration: YAML files (read, merged and resolved as NeMo Gym does, `configfiles`) validated
into a frozen `Config`, with every problem reported at once, at its file and line.

A config is either flat (every key of `Config` at the top level) or NeMo Gym's nested layout
(`<server name>: responses_api_models: vllm_model: {...}`), so NeMo Gym's own configs load
unchanged; a `local_vllm_model` block there becomes a `launch` section (`from_local_vllm_model`),
and a server type gymproxy does not serve is refused by name. `${name}` placeholders are resolved
from `--set name=value` first, then from the environment; an unresolved one is an error. The
environment is read only here and in `configfiles`, and only through the `environ` argument.
"""

from __future__ import annotations

import copy
import difflib
import ipaddress
import json
import logging
import os
import re
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Final, Literal, Union, get_args, get_origin

import msgspec
import msgspec.inspect
from omegaconf import OmegaConf
from yarl import URL

from . import configfiles
from .configfiles import ConfigError as ConfigError
from .configfiles import Problem

log = logging.getLogger("gymproxy")

Seconds = Annotated[float, msgspec.Meta(gt=0)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
HeaderName = Annotated[str, msgspec.Meta(min_length=1, pattern=r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")]
ReasoningField = Literal["both", "reasoning", "reasoning_content"]

REASONING_FIELD_ENV = "NEMO_GYM_REASONING_FIELD"
NEMO_SERVER_TYPES = ("responses_api_models", "resources_servers", "responses_api_agents")


class Settings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Base for config sections: immutable, and a misspelt key is an error."""


class Timeouts(Settings, frozen=True, kw_only=True):
    """Upstream timeouts. There is deliberately no total timeout: generations may run for minutes."""

    connect: Seconds = 10.0
    # Longest silence allowed while reading an upstream reply (None: wait forever).
    read: Seconds | None = None
    # Idle upstream connections are dropped before vLLM's own 5 s keep-alive closes them.
    keepalive: Seconds = 4.0


class UpstreamSpec(Settings, frozen=True, kw_only=True):
    """One upstream in gymproxy's own form (`base_url` lists give each URL the defaults). What makes
    one usable is `check_upstream`'s, wherever it comes from (the file, DNS, the admin routes)."""

    url: str
    name: str | None = None  # what pin cookies carry; defaults to the URL
    api_key: str | None = None  # defaults to the top-level `api_key`
    weight: float = 1.0  # share of cookie-less sessions, in (0, MAX_WEIGHT]


MAX_WEIGHT: Final = 1000.0
MAX_URL: Final = 1024  # characters; an unnamed upstream's URL is its name, in every pin cookie
MAX_NAME: Final = 256
MAX_KEY: Final = 4096
# A name goes into pin cookies (base64), metrics labels, logs and admin paths: URL characters only.
_NAME = re.compile(r"[A-Za-z0-9._~:/?#\[\]@!$&'()*+,;=%-]+")
_HOST = re.compile(r"[A-Za-z0-9_.-]+")  # a DNS name (IDNA already encoded by yarl) or an IPv4 address
_KEY = re.compile(r"[\x21-\x7e]+")  # visible ASCII: it goes into an `Authorization` header as it is


class BadUpstream(ValueError):
    """An upstream spec that cannot be used; `field` names its bad key."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def check_upstream(spec: UpstreamSpec) -> None:
    """Raise `BadUpstream` unless `spec` can be built into an upstream and is safe to keep: an
    http(s) URL with a host, a port in 1..65535 and no query or fragment, a name of URL characters,
    a key that is one header value, a weight in (0, MAX_WEIGHT]; every length bounded."""
    _check_url(spec.url)
    name = spec.name
    if name is not None and (len(name) > MAX_NAME or not _NAME.fullmatch(name)):
        raise BadUpstream("name", f"name must be 1 to {MAX_NAME} URL characters (letters, digits, `.-_~:/@%` ...)")
    check_key(spec.api_key, "api_key")
    if not 0 < spec.weight <= MAX_WEIGHT:  # a NaN fails too
        raise BadUpstream("weight", f"weight must be above 0 and at most {MAX_WEIGHT:g}, got {spec.weight!r}")


def check_key(key: str | None, field: str) -> None:
    """An upstream api key (`field` names it): None or "" (none), else one header value, bounded."""
    if key and (len(key) > MAX_KEY or not _KEY.fullmatch(key)):
        raise BadUpstream(field, f"{field} must be at most {MAX_KEY} visible ASCII characters (no spaces or controls)")


def _check_url(url: str) -> None:
    if len(url) > MAX_URL:
        raise BadUpstream("url", f"url is {len(url)} characters; the limit is {MAX_URL}")
    seen = _without_credentials(url)
    if not url.isprintable() or any(c.isspace() for c in url):
        raise BadUpstream("url", f"url {seen!r} has a space or a control character")
    try:  # as `Upstream.configure` takes it apart
        parsed = URL(url.rstrip("/"))
        host, port = parsed.raw_host, parsed.explicit_port
        if parsed.absolute:
            parsed.with_user(None)
    except ValueError as exc:
        raise BadUpstream("url", f"url {seen!r} cannot be used: {exc}") from None
    if parsed.scheme not in ("http", "https"):
        raise BadUpstream("url", f"url {seen!r} must start with http:// or https://")
    if "#" in url:
        raise BadUpstream("url", f"url {seen!r} has a fragment (`#...`): a base URL has none (it is never sent)")
    if "?" in url:
        raise BadUpstream(
            "url",
            f"url {seen!r} has a query string: a base URL has none; give it as `default_query` (sent on every request)",
        )
    if not host:
        raise BadUpstream("url", f"url {seen!r} has no host")
    if ":" in host:  # an IPv6 literal, perhaps with a zone (`fe80::1%eth0`)
        try:
            ipaddress.IPv6Address(host.partition("%")[0])
        except ValueError:
            raise BadUpstream("url", f"url {seen!r}: {host!r} is not an IPv6 address") from None
    elif not _HOST.fullmatch(host):
        raise BadUpstream("url", f"url {seen!r}: {host!r} is not a host name or address")
    if port is not None and not 0 < port < 65536:
        raise BadUpstream("url", f"url {seen!r}: port {port} is out of range 1..65535")


def _without_credentials(url: str) -> str:
    """`url` for a message, whether or not it parses: no user info, and not too long."""
    shown = re.sub(r"//[^/?#]*@", "//", url, count=1)
    return shown if len(shown) <= 200 else shown[:200] + "..."


def is_loopback(host: str) -> bool:
    """Whether a listen address reaches this machine only (127.0.0.0/8, ::1, localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class LoadBound(Settings, frozen=True, kw_only=True):
    """Consistent hashing with bounded loads: an upstream takes new sessions while its in-flight count
    is at most `max(share * (1 + epsilon), share + slack)`; pinned sessions leave it only past that
    bound times `1 + hysteresis`."""

    epsilon: Annotated[float, msgspec.Meta(ge=0)] = 0.25
    slack: Annotated[float, msgspec.Meta(ge=0)] = 10.0
    hysteresis: Annotated[float, msgspec.Meta(ge=0)] = 0.5


class PaceRule(Settings, frozen=True, kw_only=True):
    """Steering by pace (seconds per generated token, observed over the last `window_s` or so): an
    upstream slower than the fastest times `1 + tolerance` takes no new sessions while a faster one
    can; its pinned sessions leave past that times `1 + load_bound.hysteresis`. `tolerance: null`
    turns it off."""

    tolerance: Annotated[float, msgspec.Meta(ge=0)] | None = 0.5
    window_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0


class Pinning(Settings, frozen=True, kw_only=True):
    """Session pinning (prefix-cache affinity)."""

    cookie_name: str = "gymproxy_pin"
    # The HMAC key; every worker and replica that should honour the same cookies needs the same one.
    secret: str | None = None
    secret_env: str = "GYMPROXY_PIN_SECRET"
    max_age: Seconds = 14 * 24 * 3600.0
    # Headers that key a session for clients without a cookie jar; the first one present wins. Codex
    # CLI sends `session-id`, Claude Code `X-Claude-Code-Session-Id`. The older single-header key
    # `session_header: NAME` is still read, as `session_headers: [NAME]`.
    session_headers: list[HeaderName] = msgspec.field(
        default_factory=lambda: ["X-Session-ID", "session-id", "X-Claude-Code-Session-Id"]
    )
    use_user_field: bool = True  # the request body's `user` field also keys a session
    placement: Literal["least_outstanding", "round_robin"] = "least_outstanding"
    load_bound: LoadBound = LoadBound()
    pace: PaceRule = PaceRule()
    # Cookie-less keyed sessions that moved, remembered per process: at most this many, each for
    # this long after its last use.
    moved_keys: Annotated[int, msgspec.Meta(ge=1)] = 65536
    moved_ttl_s: Seconds = 3600.0


class Retries(Settings, frozen=True, kw_only=True):
    """Re-sending a request that no upstream began (refused, vLLM's "busy" 503), or once one that a
    dead upstream dropped (`retry.Attempts`)."""

    attempts: Annotated[int, msgspec.Meta(ge=1)] = 3  # sends in all, the first included
    deadline_s: Seconds = 30.0  # no retry starts later than this after the first send
    backoff_s: Seconds = 0.25  # full jitter: a wait in [0, min(backoff_max_s, backoff_s * 2^n)]
    backoff_max_s: Seconds = 4.0


class Breaker(Settings, frozen=True, kw_only=True):
    """Per-upstream circuit breaker: `failures` in a row open it for `cooldown_s`, then one probe."""

    failures: Annotated[int, msgspec.Meta(ge=1)] = 5
    cooldown_s: Seconds = 10.0


class Health(Settings, frozen=True, kw_only=True):
    """Background health checks of each upstream's `/health`."""

    interval: Seconds = 5.0
    timeout: Seconds = 2.0


class Hold(Settings, frozen=True, kw_only=True):
    """Requests held while the fleet (`/fleet/pause`) or one engine (vLLM's paused 503) is paused."""

    timeout_s: Seconds = 300.0  # a request held longer gets a 503 with Retry-After
    max_requests: Annotated[int, msgspec.Meta(ge=1)] = 10000  # held at once; past it, a 503 at once
    max_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 256 * 1024 * 1024  # their bodies' bytes at once
    poll_s: Seconds = 0.25  # how often a paused engine's /is_paused is asked while requests wait on it


class FleetControl(Settings, frozen=True, kw_only=True):
    """The /fleet/* routes (`access.fleet_control`): each engine's time to answer."""

    pause_timeout_s: Seconds = 60.0  # /pause and /resume of each engine (the barrier)
    # A /pause or /resume that missed pause_timeout_s is still open (vLLM carries it out all the
    # same): it is followed this much longer, then the engine is settled (`settle.py`).
    follow_s: Seconds = 600.0
    broadcast_timeout_s: Seconds = 600.0  # a broadcast route (a weight transfer may take minutes)
    max_reply_size: Annotated[int, msgspec.Meta(ge=1024)] = 1024 * 1024  # each engine's answer kept


class Capture(Settings, frozen=True, kw_only=True):
    """Rollout capture (`rollouts/`): every model call that carries a rollout id recorded with the
    token ids and log probs vLLM sampled, readable at /v1/rollouts (behind the key, like /fleet/*)."""

    enabled: bool = False
    # `sqlite:///PATH` (the embedded store: a file, relative to the working directory) or
    # `redis://HOST:PORT/DB` (shared by `--workers` and replicas; `pip install gymproxy[redis]`).
    store: str = "sqlite:///gymproxy-rollouts.db"
    # Where a call's rollout id comes from besides `/ng-rollout/<id>/` and `X-Rollout-ID`:
    # "session" takes the session key (a session header, `prompt_cache_key`, `user`) as well.
    key: Literal["rollout", "session"] = "rollout"
    # A store that is not taking writes (full, down): the call is served and counted as not
    # recorded; with `required`, it gets a 503 before it reaches vLLM.
    required: bool = False
    record_requests: bool = False  # keep the messages and tools as sent to vLLM too
    max_age_s: Seconds = 7 * 86400.0  # a rollout not written for this long is evicted
    max_bytes: Annotated[int, msgspec.Meta(ge=1 << 20)] = 8 << 30  # SQLite's size; Redis: its maxmemory
    max_pending: Annotated[int, msgspec.Meta(ge=16)] = 100_000  # records queued for the store at most


class Access(Settings, frozen=True, kw_only=True):
    """Inbound access control. With no keys, gymproxy is open (it usually sits on a private network)."""

    api_keys: list[str] = []  # accepted `Authorization: Bearer <key>` values
    api_keys_file: str | None = None  # one key per line, read at startup ("#" starts a comment)
    admin_port: Port | None = None  # serve /health and /metrics only on this port (`gymproxy serve`)
    admin_requires_key: bool = False  # /health and /metrics need a key too (so `api_keys` are needed)
    # POST/DELETE /admin/upstreams change the fleet live; off, they answer 403. They need a key
    # whenever `api_keys` are configured, whatever `admin_requires_key` says; with no key, gymproxy
    # must listen on a loopback address only, or it refuses to start.
    admin_fleet_changes: bool = False
    # `gymproxy serve`: open connections to `admin_port` past this get a 503 (idle ones make room first).
    admin_max_connections: Annotated[int, msgspec.Meta(ge=1)] = 64
    # The /fleet/* routes (pause, resume, broadcast, status: weight updates); off, they answer 403.
    # Keyed and loopback-bound exactly as `admin_fleet_changes`.
    fleet_control: bool = False


class Limits(Settings, frozen=True, kw_only=True):
    """Caps that keep one busy upstream or one huge client from taking the proxy down."""

    max_inflight_per_upstream: Annotated[int, msgspec.Meta(ge=0)] = 0  # 0: no cap
    when_full: Literal["queue", "reject"] = "queue"  # past the cap: wait for a slot, or answer 503
    max_header_size: Annotated[int, msgspec.Meta(ge=1024)] = 16384  # bytes per header line
    open_files: Annotated[int, msgspec.Meta(ge=0)] = 65536  # raise `ulimit -n` to this at startup
    # A request body that stops arriving for this long is refused with a 408 (nginx's client_body_timeout).
    client_body_timeout: Seconds = 60.0
    # `gymproxy serve`: a client connection idle between requests is closed after this (aiohttp's
    # keep-alive timeout; web.run_app's default). A request head has `client_header_timeout`.
    client_keepalive_timeout: Seconds = 75.0
    # `gymproxy serve`: a client connection past this takes the place of an idle or stalled one, else
    # gets a 503 at once (None: half the open-file limit, so upstream connections and health checks
    # always have file descriptors left).
    max_client_connections: Annotated[int, msgspec.Meta(ge=1)] | None = None
    # `gymproxy serve`: the listen backlog (the kernel caps it at net.core.somaxconn).
    backlog: Annotated[int, msgspec.Meta(ge=1)] = 4096
    # An upstream reply gymproxy holds whole (chat, Responses, /tokenize, every relayed reply but an event
    # stream the client asked for, and a Responses stream, whose last events carry it all: it keeps a
    # sixteenth of this in characters) and one streamed event: past this, a 502. A generation of 128k tokens with their
    # ids and log-probs (training mode) is some 14 MB; a reply held whole costs 2 to 5 times its size.
    max_reply_size: Annotated[int, msgspec.Meta(ge=65536)] = 16 * 1024 * 1024
    # An upstream error reply (status 400 and up; vLLM's are a few hundred bytes): past this, a 502.
    max_error_reply_size: Annotated[int, msgspec.Meta(ge=1024)] = 1024 * 1024
    # Upstreams in the fleet at most, from the file, DNS and the admin routes together (each costs
    # health checks and pooled connections): more in the file is an error, from DNS a warning, an admin add a 409.
    max_upstreams: Annotated[int, msgspec.Meta(ge=1)] = 256
    # `gymproxy serve`: a request head not whole this long after its first byte (or after the accept,
    # for a connection's first request) gets a 408 and the connection is closed (nginx's client_header_timeout).
    client_header_timeout: Seconds = 10.0
    # A request body with more JSON objects, arrays and strings than this gets a 413: it bounds
    # the memory and event-loop time its decode takes (the `{`, `[` and `"` pairs in it are counted).
    max_json_values: Annotated[int, msgspec.Meta(ge=1024)] = 250_000
    # The same for its numbers, `true`, `false` and `null`, which cost less each (each `,` is counted:
    # an array of n numbers holds n - 1). A prompt of 128k token ids holds 128k.
    max_json_numbers: Annotated[int, msgspec.Meta(ge=1024)] = 500_000


class Restart(Settings, frozen=True, kw_only=True):
    """How a process that exits while gymproxy serves is restarted (a launched vLLM, a worker): after a
    backoff (`backoff_s`, doubling with each restart in the window up to `backoff_max_s`), at most
    `attempts` times within any `window_s`; past that it is given up (an error in the log; a vLLM's
    in /health, a worker's in /metrics as missing; with no worker left, gymproxy stops)."""

    attempts: Annotated[int, msgspec.Meta(ge=0)] = 5  # 0: never restart
    window_s: Seconds = 600.0
    backoff_s: Seconds = 2.0
    backoff_max_s: Seconds = 60.0


class Workers(Settings, frozen=True, kw_only=True):
    """How the parent of `gymproxy serve --workers N` watches its workers."""

    # A worker whose event loop sends no heartbeat for this long (stopped, hung) is killed and replaced.
    heartbeat_timeout_s: Annotated[float, msgspec.Meta(ge=1)] = 5.0
    # A worker that exits or is killed is started again under the same index.
    restart: Restart = Restart(attempts=5, window_s=300.0, backoff_s=0.5, backoff_max_s=30.0)


class Launch(Settings, frozen=True, kw_only=True):
    """vLLM servers gymproxy starts, supervises and stops itself (`gymproxy serve --launch-vllm`)."""

    model: Annotated[str, msgspec.Meta(min_length=1)]  # what `vllm serve` is given first
    args: list[str] = []  # the rest of the `vllm serve` command line (a string is split like a shell)
    replicas: Annotated[int, msgspec.Meta(ge=1)] = 1
    # GPUs of each replica's CUDA_VISIBLE_DEVICES; None: the product of the parallel sizes in `args`
    # when the host has GPUs, else 0; 0: CUDA_VISIBLE_DEVICES is left as it is (a CPU vLLM).
    gpus_per_replica: Annotated[int, msgspec.Meta(ge=0)] | None = None
    vllm_bin: str = "vllm"  # found on PATH unless a path
    env: dict[str, str] = {}  # added to each replica's environment
    hf_home: str | None = None  # HF_HOME of the replicas (where models are downloaded to)
    log_dir: str | None = None  # each replica's output to <log_dir>/vllm-<i>.log, not gymproxy's log
    base_port: Port | None = None  # replica i listens on base_port + i (None: free ports)
    startup_timeout_s: Seconds = 1200.0  # a replica whose /health does not answer by then has failed
    progress_interval_s: Seconds = 30.0  # how often a replica still loading is reported
    # A ready replica whose /health has not answered 200 for this long is hung: it is stopped and
    # restarted as if it had exited (None: never; the health checks only mark it down).
    unresponsive_s: Seconds | None = 120.0
    stop_grace_s: Seconds = 30.0  # SIGTERM, then SIGKILL of its process group after this
    # Keep each replica's port bound (SO_REUSEPORT, never listening) while gymproxy runs, so no
    # other user's process can take it while the replica restarts. Only for a vLLM that binds with
    # SO_REUSEPORT (vLLM 0.32 does with `--api-server-count` > 1; with one API server it fails
    # with "Address already in use").
    hold_ports: bool = False
    restart: Restart = Restart()


class Config(Settings, frozen=True, kw_only=True):
    """Everything gymproxy needs; NeMo Gym's `vllm_model` keys keep their names and defaults."""

    # --- NeMo Gym `vllm_model` keys (spec section 4.2) ---
    base_url: list[str] = []
    api_key: str | None = None
    model: str | None = None
    return_token_id_information: bool = False
    request_prompt_and_generation_token_ids: bool = False
    propagate_context_overflow_errors: bool = False
    uses_reasoning_parser: bool = False
    uses_interleaved_reasoning: bool = True
    reasoning_field: ReasoningField = "both"
    preserve_reasoning_in_assistant_content: bool = False
    replace_developer_role_with_system: bool = False
    sequential_reasoning_allowed: bool = True
    supply_prefix_token_ids: bool = False
    is_responses_native: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    forward_request_chat_template_kwargs: bool = False
    continue_final_assistant_message: bool = False
    sampling_overrides: dict[str, Any] | None = None
    extra_body: dict[str, Any] | None = None
    default_headers: dict[str, str] = {}
    endpoint_file: str | None = None
    endpoint_stale_grace_s: float = 300.0
    endpoint_connection_retries: int = 8
    endpoint_check_interval_s: float = 10.0
    forward_session_id_as_conversation_id: bool = False
    audio_root: str | None = None
    use_completions_api: bool = False
    render_chat_template: bool = False
    tokenizer: str | None = None
    # Let the completions backend's tokenizer run code it ships (Hugging Face `trust_remote_code`).
    trust_remote_code: bool = False
    # NeMo Gym server fields: `host`/`port` are where gymproxy listens, `name` names the pin cookie.
    name: str = ""
    host: str = "127.0.0.1"
    port: Port = 8000
    num_workers: Annotated[int, msgspec.Meta(ge=1)] | None = None
    entrypoint: str | None = None
    domain: str | None = None
    token_id_capture_non_generating_requests: bool | None = None

    # --- gymproxy's own keys ---
    upstreams: list[UpstreamSpec] = []
    # Discovery: every address this name resolves to is an upstream (`http://host:port/v1`, or
    # `host:port` for that), re-resolved every `upstreams_dns_interval_s`; a Kubernetes headless
    # Service that scales is followed.
    upstreams_dns: str | None = None
    upstreams_dns_interval_s: Seconds = 10.0
    # A /v1/responses top-level field outside the Responses API's set: a 400 naming it, or dropped
    # (with a warning once per name) for clients that send their own.
    unknown_fields: Literal["reject", "drop"] = "reject"
    pinning: Pinning = Pinning()
    retries: Retries = Retries()
    hold: Hold = Hold()
    fleet_control: FleetControl = FleetControl()
    capture: Capture = Capture()
    breaker: Breaker = Breaker()
    health: Health = Health()
    default_query: dict[str, str] = {}
    timeouts: Timeouts = Timeouts()
    # Agents' requests weigh a few hundred KB (tens of thousands of prompt tokens); rollouts with images
    # need more than aiohttp's 1 MiB default. gymproxy decodes most bodies on its event loop, and
    # encodes them again for vLLM: up to some 3 ms a MiB each (a string of escapes), so a body at
    # this limit and at the JSON values' limits holds the loop some 25 ms of CPU a step, and up to
    # some 10 times its size in memory.
    max_body_size: Annotated[int, msgspec.Meta(ge=1024)] = 8 * 1024 * 1024
    # Upstream connection pool: total connections across all upstreams (0 = no limit).
    max_connections: Annotated[int, msgspec.Meta(ge=0)] = 0
    # A `: keep-alive` comment is sent on a stream after this much upstream silence.
    stream_keepalive_s: Seconds = 15.0
    access_log: bool = False  # one line per request (gymproxy.access): duration, status, ids, upstream, tokens
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["text", "json"] = "text"  # json: one object a line, with the access line's fields
    access: Access = Access()
    limits: Limits = Limits()
    # On SIGTERM: stop accepting, let in-flight requests and streams finish for this long.
    shutdown_grace_s: Annotated[float, msgspec.Meta(ge=0)] = 30.0
    workers: Workers = Workers()  # `--workers N` (num_workers): heartbeats and restarts
    # Serve Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`, `/api/hello`) by
    # relaying it to the session's upstream, vLLM's own Anthropic endpoint.
    anthropic_messages: bool = True
    # Start the upstreams: `vllm serve` processes gymproxy supervises (launch.py).
    launch: Launch | None = None


# Options NeMo Gym has that gymproxy does not implement: refused at startup, never ignored silently.
_UNSUPPORTED = {
    "endpoint_file": "publish the URL through `base_url` and restart instead",
    "supply_prefix_token_ids": "NeMo Gym's prefix-supply capture is out of gymproxy's scope",
    "audio_root": "the metadata audio side-channel is out of gymproxy's scope",
}

_NEMO_DIRECTIVES = ("_inherit_from", "_copy", "_delete_key")  # NeMo Gym's, applied by its parser only


def load_config(
    path: str | Path | Sequence[str | Path] | None = None,
    *,
    overrides: Mapping[str, str] = {},
    environ: Mapping[str, str] = os.environ,
    server: str | None = None,
    extra: Mapping[str, Any] = {},
    unresolved: dict[str, str] | None = None,
    hydra: Sequence[str] = (),
    warnings: list[str] | None = None,
) -> Config:
    """Read, merge, resolve and validate config files; raises `ConfigError` with every problem, one a
    line, each at its file and line (`configfiles`).

    Several paths merge in order, later ones winning (NeMo Gym's `config_paths`); `hydra` holds
    Hydra-style overrides (`key=value`, `+key=value`, `++key=value`, `~key`), merged last as NeMo
    Gym's command line is. `overrides` are the `--set name=value` pairs: a name the files use as
    `${name}` gives it its value, any other sets that config key. A `${name}` nothing gives comes from
    `environ`, as does `${oc.env:NAME}`. `extra` holds keys set by CLI flags, which win over the
    files. With an `unresolved` dict (`check-config`), a value given at serve time (a `${name}` or
    `oc.env` variable with no value yet, a `???`) is no error: it is recorded there (name -> the key
    using it) and a stand-in of the key's type is validated in its place. Warnings go to `warnings`
    when given, else to the log.
    """
    paths = [] if path is None else [path] if isinstance(path, (str, Path)) else list(path)
    files = configfiles.read(paths, hydra)
    names = files.placeholders()
    # `key: ${key}` (a flat file's key given at serve time) is the placeholder, not a cycle.
    top = OmegaConf.to_container(files.tree, resolve=False)
    assert isinstance(top, dict)
    own = {name for name in names if isinstance(top.get(name), str) and top[name].replace(" ", "") == f"${{{name}}}"}
    for name in own:
        files.tree[name] = configfiles.placeholder(name)
    for name, text in overrides.items():
        if name in names:
            files.provide(name, configfiles.read_value(text), f"--set {name}")
    for name in sorted((names - set(files.tree.keys())) | own):
        if name in environ:
            files.provide(name, configfiles.read_value(environ[name]), f"${name} (the environment)")
    keys, kind = _server(files, server)
    raw, problems = files.resolve(keys, environ)
    if problems:
        raise ConfigError.of(problems)
    prefix = ".".join(keys)
    section: dict[str, Any] = raw
    if not keys:  # flat: the top-level values `${name}` took are no config keys
        fields = {field.encode_name for field in msgspec.structs.fields(Config)}
        section = {key: value for key, value in section.items() if key not in files.added | (names - fields)}
    found: list[Problem] = []  # paths relative to the section
    section = _placeholders(section, prefix, unresolved, found)
    if kind == "local_vllm_model":
        section = from_local_vllm_model(section, found)
    given: dict[str, str] = {}  # section keys set on the command line -> where
    for key, value in extra.items():
        if value is None:
            continue
        if isinstance(value, dict) and isinstance(section.get(key), dict):
            value = {**section[key], **value}  # `--replicas 2` keeps the file's other launch keys
        section[key] = value
        given[key] = "the command line"
    if keys:
        section.setdefault("name", keys[0])
    for key, text in overrides.items():
        if key not in names:  # a placeholder's value was given above
            _set_key(section, key, text, found)
            given[key] = f"--set {key}"
    config, invalid, notes = _validated(section, environ)

    def located(problem: Problem) -> Problem:
        if problem.where != "config":  # placed already (--set)
            return problem
        for key, where in given.items():
            if problem.path == key or problem.path.startswith((f"{key}.", f"{key}[")):
                return problem._replace(path="" if where == f"--set {problem.path}" else problem.path, where=where)
        full = configfiles.join(prefix, problem.path) if problem.path else prefix
        return files.place(problem._replace(path=full))

    problems = [located(problem) for problem in found + invalid]
    if problems or config is None:
        raise ConfigError.of(problems)
    for note in notes:
        line = "warning: " + located(note).line()
        if warnings is None:
            log.warning("%s", line)
        else:
            warnings.append(line)
    return config


def _server(files: configfiles.Files, server: str | None) -> tuple[list[str], str | None]:
    """The keys of the model server section in NeMo Gym's nested layout (`<name>:
    responses_api_models: <type>: {...}`) and its type, or `[]` for a flat file. A server type
    gymproxy does not serve is refused by name, saying what to use instead."""
    tree = OmegaConf.to_container(files.tree, resolve=False)  # as written: nothing is resolved yet
    assert isinstance(tree, dict)
    entries = {
        str(key): value
        for key, value in tree.items()
        if isinstance(value, dict) and any(kind in value for kind in NEMO_SERVER_TYPES)
    }
    if not entries:
        return [], None
    models: dict[str, str] = {}
    others: dict[str, str] = {}
    for name, entry in entries.items():
        kinds = entry.get("responses_api_models")
        for kind in kinds if isinstance(kinds, dict) else ():
            (models if kind in NEMO_MODEL_TYPES else others)[name] = str(kind)
    problems: list[Problem] = []

    def refuse(name: str) -> None:
        kind = others[name]
        at = f"{name}.responses_api_models.{kind}"
        why = _OTHER_SERVERS.get(kind, "gymproxy serves `vllm_model` and `local_vllm_model` servers")
        problems.append(Problem(at, f"`{kind}` is not supported: {why}", files.locate(at)))

    if server is not None:
        if server in models:
            chosen = server
        elif server in others:
            refuse(server)
        else:
            problems.append(
                Problem("", f"--server {server}: no model server of that name (found {sorted(models) or 'none'})")
            )
    elif len(models) == 1:
        (chosen,) = models
    elif models:
        found = ", ".join(sorted(models))
        problems.append(
            Problem("", f"{len(models)} model servers ({found}): pick one with --server NAME", ", ".join(files.paths))
        )
    elif others:
        for name in sorted(others):
            refuse(name)
    else:
        problems.append(
            Problem(
                "",
                "no model server: expected `<name>: responses_api_models: vllm_model: {...}`",
                ", ".join(files.paths),
            )
        )
    if problems:
        raise ConfigError.of(problems)
    keys = [chosen, "responses_api_models", models[chosen]]
    node: Any = tree
    for depth, key in enumerate(keys, 1):
        node = node.get(key) if isinstance(node, dict) else None
        for directive in _NEMO_DIRECTIVES:
            if isinstance(node, dict) and directive in node:
                at = ".".join([*keys[:depth], directive])
                why = (
                    "NeMo Gym's parser applies it, gymproxy does not: write the keys out, or merge files with --config"
                )
                problems.append(Problem(at, f"`{directive}` is not supported: {why}", files.locate(at)))
    if problems:
        raise ConfigError.of(problems)
    return keys, models[chosen]


# NeMo Gym model server types gymproxy does not serve, and what to use instead.
_OTHER_SERVERS = {
    "local_vllm_model_proxy": "it forwards to a local_vllm_model server of the same NeMo Gym run, and gymproxy is "
    "that proxy itself: give gymproxy the local_vllm_model config (it starts vLLM), or a vllm_model with base_url",
    "vllm_model_with_compaction": "NeMo Gym's compaction (`required_prefix_token_ids`) is not in gymproxy; "
    "keep NeMo Gym's server for it, or use a vllm_model config (vllm_model_for_training.yaml)",
    "genrm_model": "its GenRM roles (response_1, response_2, principle) are NeMo Gym's; keep NeMo Gym's server for it",
    "openai_model": "gymproxy serves vLLM, not OpenAI's API; keep NeMo Gym's openai_model for it",
    "azure_openai_model": "gymproxy serves vLLM, not Azure OpenAI; keep NeMo Gym's azure_openai_model for it",
    "litellm_model": "gymproxy serves vLLM, not LiteLLM's providers; keep NeMo Gym's litellm_model for it",
    "inference_provider": "gymproxy serves vLLM, not hosted inference providers; keep NeMo Gym's inference_provider "
    "for it",
    "switchyard_model": "gymproxy does not route through Switchyard; keep NeMo Gym's switchyard_model for it",
}


def _placeholders(
    section: dict[str, Any], prefix: str, unresolved: dict[str, str] | None, problems: list[Problem]
) -> dict[str, Any]:
    """Values given at serve time (`configfiles.placeholder`): with `unresolved`, stand-ins of each
    key's type, recorded there (at their whole path, below `prefix`); otherwise problems naming them."""

    def walk(node: Any, at: str) -> Any:
        if isinstance(node, dict):
            return {key: walk(value, configfiles.join(at, key)) for key, value in node.items()}
        if isinstance(node, list):
            return [walk(value, configfiles.join(at, index)) for index, value in enumerate(node)]
        if not isinstance(node, str):
            return node
        names = configfiles.placeholders_in(node)
        if not names:
            return node
        if unresolved is None:
            problems.extend(Problem(at, _unresolved_message(name)) for name in names)
            return node
        for name in names:
            unresolved.setdefault(name, configfiles.join(prefix, at) if at else prefix)
        return configfiles.without_placeholders(node, _stand_in(at, names[0]))

    result = walk(section, "")
    assert isinstance(result, dict)
    return result


def _unresolved_message(name: str) -> str:
    if name == configfiles.MISSING:
        return "is `???` (a value NeMo Gym requires): give it with --set, an override (++KEY=VALUE) or another --config file"
    if name.startswith("oc.env:"):
        variable = name.partition(":")[2]
        return f"uses ${{{name}}}, and {variable} is not in the environment (give the variable, or a default: ${{oc.env:{variable},DEFAULT}})"
    return f"uses ${{{name}}}, which is neither given with --set nor in the environment"


def shown_placeholder(name: str) -> str:
    """How check-config shows a value given at serve time: `${name}`, or `???`."""
    return name if name == configfiles.MISSING else f"${{{name}}}"


def _set_key(section: dict[str, Any], key: str, value: str, problems: list[Problem]) -> None:
    """`--set a.b.c=value`: set that (nested) key of `section`, or record a problem naming an unknown one.

    The value stays a string (converted to the key's type by `build_config`) unless it reads as a
    YAML list or mapping. Under a free-form mapping key (`default_headers`, `extra_body`, ...)
    every name is allowed."""
    parts = key.split(".")
    info: msgspec.inspect.Type = msgspec.inspect.type_info(Config)
    target = section
    for depth, part in enumerate(parts):
        struct = _struct_of(info)
        if struct is not None:
            fields = {field.name: field.type for field in struct.fields}
            if part not in fields:
                hint = _known(parts[:depth], part, sorted(fields))
                problems.append(Problem("", f"unknown key; {hint}", f"--set {key}"))
                return
            info = fields[part]
        elif not _is_mapping(info):
            problems.append(Problem("", f"`{'.'.join(parts[:depth])}` is not a section with keys", f"--set {key}"))
            return
        if depth == len(parts) - 1:
            target[part] = configfiles.read_value(value)
        else:
            child = target.get(part)
            target[part] = child = dict(child) if isinstance(child, dict) else {}
            target = child


def _struct_of(info: msgspec.inspect.Type) -> msgspec.inspect.StructType | None:
    kinds = info.types if isinstance(info, msgspec.inspect.UnionType) else (info,)
    return next((kind for kind in kinds if isinstance(kind, msgspec.inspect.StructType)), None)


def _is_mapping(info: msgspec.inspect.Type) -> bool:
    kinds = info.types if isinstance(info, msgspec.inspect.UnionType) else (info,)
    return any(isinstance(kind, msgspec.inspect.DictType) for kind in kinds)


def _known(where: list[str], name: str, known: list[str]) -> str:
    """The hint after `unknown key`: the closest key, or those the section has."""
    prefix = "".join(f"{part}." for part in where)
    close = difflib.get_close_matches(name, known, n=1)
    if close:
        return f"did you mean {prefix}{close[0]}?"
    return f"{'.'.join(where) or 'the config'} has {', '.join(known)}"


def build_config(section: Mapping[str, Any], environ: Mapping[str, str] = os.environ) -> Config:
    """Validate one flat mapping of config keys; raises `ConfigError` with every problem, one a line."""
    config, problems, notes = _validated(section, environ)
    if problems or config is None:
        raise ConfigError.of(problems)
    for note in notes:
        log.warning("%s", note.line())
    return config


def _validated(
    section: Mapping[str, Any], environ: Mapping[str, str]
) -> tuple[Config | None, list[Problem], list[Problem]]:
    """The config, every problem with it (not only the first) and the warnings, paths relative to `section`."""
    section = dict(section)
    problems: list[Problem] = []
    _read_old_session_header(section, problems)
    _split_launch_args(section, problems)
    _reasoning_parser_default(section)
    if isinstance(section.get("base_url"), str):
        section["base_url"] = [section["base_url"]]
    if section.get("reasoning_field") is None:
        section.pop("reasoning_field", None)
        env_value = environ.get(REASONING_FIELD_ENV, "").strip()
        if env_value:
            if env_value not in ("both", "reasoning", "reasoning_content"):
                message = f"{REASONING_FIELD_ENV}={env_value!r} is not one of both, reasoning, reasoning_content"
                problems.append(Problem("", message, "the environment"))
            else:
                section["reasoning_field"] = env_value
    _validate(section, Config, "", problems)
    try:
        # strict=False: values from --set and the environment arrive as strings ("true", "8").
        config = msgspec.convert(_pruned(section, problems), Config, strict=False)
    except msgspec.ValidationError as exc:
        return None, problems or [Problem("", str(exc))], []
    reported = [problem.path for problem in problems]
    problems += [problem for problem in _check(config) if not _overlaps(problem.path, reported)]
    if config.access.api_keys_file is not None:
        try:
            lines = Path(config.access.api_keys_file).read_text().splitlines()
        except OSError as exc:
            problems.append(Problem("access.api_keys_file", f"cannot read {config.access.api_keys_file}: {exc}"))
            lines = []
        keys = []
        for number, line in enumerate(lines, 1):
            key = line.strip()
            if key and not key.startswith("#"):
                if (wrong := _inbound_key_problem(key)) is not None:
                    problems.append(
                        Problem("access.api_keys_file", f"{config.access.api_keys_file}, line {number}, {wrong}")
                    )
                keys.append(key)
        access = msgspec.structs.replace(config.access, api_keys=[*config.access.api_keys, *keys], api_keys_file=None)
        config = msgspec.structs.replace(config, access=access)
    problems += _check_access(config)
    if config.pinning.secret is None and environ.get(config.pinning.secret_env):
        pinning = msgspec.structs.replace(config.pinning, secret=environ[config.pinning.secret_env])
        config = msgspec.structs.replace(config, pinning=pinning)
    return config, problems, _url_warnings(config)


def _validate(value: Any, kind: Any, at: str, problems: list[Problem]) -> None:
    """Check `value` against the type `kind` as `msgspec.convert(strict=False)` does, recording every
    problem: an unknown key with the closest known one, an enum with its allowed values."""
    struct = _struct_type(kind)
    if struct is not None and isinstance(value, dict):
        fields = {field.encode_name: field for field in msgspec.structs.fields(struct)}
        for key, item in value.items():
            field = fields.get(key)
            if field is None:
                where = at.split(".") if at else []
                problems.append(
                    Problem(configfiles.join(at, key), f"unknown key; {_known(where, str(key), sorted(fields))}")
                )
            else:
                _validate(item, field.type, configfiles.join(at, key), problems)
        for name, field in fields.items():
            if field.required and name not in value:
                problems.append(Problem(configfiles.join(at, name), "is required"))
        return
    item = _list_item(kind)
    if item is not None and isinstance(value, list):
        for index, element in enumerate(value):
            _validate(element, item, configfiles.join(at, index), problems)
        return
    try:
        msgspec.convert(value, kind, strict=False)
    except msgspec.ValidationError as exc:
        message, _, inner = str(exc).partition(" - at `$")
        path = at + inner.rstrip("`") if inner else at
        allowed = _literal_values(kind)
        if message.startswith("Invalid enum value") and allowed:
            message = f"is {value!r}; the allowed values are {', '.join(map(str, allowed))}"
        else:
            message = message[:1].lower() + message[1:]
        problems.append(Problem(path, message))


def _alternatives(kind: Any) -> list[Any]:
    """The types `kind` allows: its union members, without `Annotated` constraints."""
    if get_origin(kind) is Annotated:
        return _alternatives(get_args(kind)[0])
    if get_origin(kind) in (Union, UnionType):
        return [alternative for arg in get_args(kind) for alternative in _alternatives(arg)]
    return [kind]


def _struct_type(kind: Any) -> type[msgspec.Struct] | None:
    structs = [alt for alt in _alternatives(kind) if isinstance(alt, type) and issubclass(alt, msgspec.Struct)]
    return structs[0] if len(structs) == 1 else None


def _list_item(kind: Any) -> Any:
    """The item type of a list of config sections (`upstreams`), else None."""
    for alternative in _alternatives(kind):
        if get_origin(alternative) is list and _struct_type(get_args(alternative)[0]) is not None:
            return get_args(alternative)[0]
    return None


def _literal_values(kind: Any) -> list[Any]:
    return [value for alt in _alternatives(kind) if get_origin(alt) is Literal for value in get_args(alt)]


def _pruned(section: dict[str, Any], problems: list[Problem]) -> dict[str, Any]:
    """`section` without the keys `problems` name (a list item's problem drops the whole list), so
    the rest can still be built and checked."""
    if not problems:
        return section
    pruned = copy.deepcopy(section)
    for problem in problems:
        *parents, last = problem.path.partition("[")[0].split(".")
        node: Any = pruned
        for key in parents:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict) and last:
            node.pop(last, None)
    return pruned


def _overlaps(path: str, reported: list[str]) -> bool:
    """Whether a problem at `path` concerns a key already reported (or one inside or above it)."""

    def under(inner: str, outer: str) -> bool:
        return inner == outer or inner.startswith((f"{outer}.", f"{outer}["))

    return any(under(path, other) or under(other, path) for other in reported if other)


def _url_warnings(config: Config) -> list[Problem]:
    """Upstream URLs that do not end in /v1: gymproxy sends `<url>/chat/completions`, vLLM serves /v1/...."""
    urls = [(f"base_url[{i}]", url) for i, url in enumerate(config.base_url)]
    urls += [(f"upstreams[{i}].url", spec.url) for i, spec in enumerate(config.upstreams)]
    return [
        Problem(
            at,
            f"{_without_credentials(url)!r} does not end in /v1: gymproxy sends requests to "
            f"<base_url>/chat/completions, and vLLM serves /v1/chat/completions",
        )
        for at, url in urls
        if STAND_IN_HOST not in url and not _ends_in_v1(url)
    ]


def _ends_in_v1(url: str) -> bool:
    try:
        return URL(url.rstrip("/")).path.endswith("/v1")
    except ValueError:
        return True  # an unusable URL is a problem of its own


def _split_launch_args(section: dict[str, Any], problems: list[Problem]) -> None:
    """`launch.args` given as one string (`--launch-vllm`, a YAML scalar) is split as a shell would,
    and `launch.env` values YAML reads as numbers or booleans (`VLLM_USE_V1: 1`) are taken as written."""
    launch = section.get("launch")
    if not isinstance(launch, dict):
        return
    launch = dict(launch)
    if isinstance(launch.get("args"), str):
        try:
            launch["args"] = shlex.split(launch["args"])
        except ValueError as exc:
            problems.append(Problem("launch.args", f"cannot be split as a shell would: {exc}"))
    if isinstance(launch.get("env"), dict):
        scalar = (bool, int, float)
        launch["env"] = {
            k: (str(v).lower() if isinstance(v, bool) else str(v)) if isinstance(v, scalar) else v
            for k, v in launch["env"].items()
        }
    section["launch"] = launch


def _reasoning_parser_default(section: dict[str, Any]) -> None:
    """A launched vLLM with `--reasoning-parser` returns reasoning in its own field, so
    `uses_reasoning_parser` defaults to true then; a config that sets it keeps its word (logged)."""
    launch = section.get("launch")
    args = launch.get("args") if isinstance(launch, dict) else None
    if not isinstance(args, list) or not any(
        str(arg) == "--reasoning-parser" or str(arg).startswith("--reasoning-parser=") for arg in args
    ):
        return
    if "uses_reasoning_parser" not in section:
        section["uses_reasoning_parser"] = True
        log.info("launch.args has --reasoning-parser: uses_reasoning_parser is true (set it to say otherwise)")
    elif str(section["uses_reasoning_parser"]).lower() in ("false", "0", "no"):
        log.warning(
            "launch.args has --reasoning-parser, but the config sets uses_reasoning_parser: false; "
            "replies' reasoning is read as the config says"
        )


def _read_old_session_header(section: dict[str, Any], problems: list[Problem]) -> None:
    """`pinning.session_header: NAME` (one header, before harnesses sent their own) means `session_headers: [NAME]`."""
    pinning = section.get("pinning")
    if not isinstance(pinning, dict) or "session_header" not in pinning:
        return
    pinning = dict(pinning)
    old = pinning.pop("session_header")
    if "session_headers" in pinning:
        problems.append(
            Problem(
                "pinning.session_header",
                "give `session_headers` (a list) or the older `session_header` (one name), not both",
            )
        )
        return
    pinning["session_headers"] = [old] if isinstance(old, str) else old
    section["pinning"] = pinning


def _check(config: Config) -> list[Problem]:
    """What the keys mean together: every problem, each at the key to change."""
    problems: list[Problem] = []
    given = config.base_url or config.upstreams or config.upstreams_dns is not None
    if config.launch is not None and given:
        problems.append(
            Problem(
                "launch", "starts the upstreams itself; give it or `base_url`/`upstreams`/`upstreams_dns`, not both"
            )
        )
    if not given and config.launch is None:
        problems.append(
            Problem(
                "base_url",
                "`base_url` (or `upstreams`, or `upstreams_dns`) needs at least one upstream URL, "
                "or `launch` (--launch-vllm) to start them; an overlay file merges over one that has them "
                "(--config base.yaml --config overlay.yaml)",
            )
        )
    if config.upstreams_dns is not None:
        try:
            dns_target(config.upstreams_dns)
        except ValueError as exc:
            problems.append(Problem("upstreams_dns", str(exc)))
    specs = upstream_specs(config)
    where = [f"base_url[{i}]" for i in range(len(config.base_url))]
    where += [f"upstreams[{i}]" for i in range(len(config.upstreams))]
    for at, spec in zip(where, specs, strict=True):
        try:
            check_upstream(spec)
        except BadUpstream as exc:
            problems.append(Problem(at, str(exc)))
    try:
        check_key(config.api_key, "api_key")
    except BadUpstream as exc:
        problems.append(Problem("api_key", str(exc)))
    for i, key in enumerate(config.access.api_keys):
        if (wrong := _inbound_key_problem(key)) is not None:
            problems.append(Problem(f"access.api_keys[{i}]", wrong))
    names = [spec.name or spec.url for spec in specs]
    if len(set(names)) != len(names):
        shown = [_without_credentials(name) for name in names]
        problems.append(Problem("upstreams", f"upstream names must be unique, got {shown}"))
    most = config.limits.max_upstreams
    count = len(specs) if config.launch is None else config.launch.replicas
    if count > most:
        problems.append(Problem("limits.max_upstreams", f"{count} upstreams; limits.max_upstreams allows {most}"))
    if config.render_chat_template and not config.use_completions_api:
        problems.append(Problem("render_chat_template", "only applies with `use_completions_api: true`"))
    if config.use_completions_api and config.supply_prefix_token_ids:
        problems.append(Problem("supply_prefix_token_ids", "cannot be combined with `use_completions_api`"))
    for key, why in _UNSUPPORTED.items():
        if getattr(config, key) not in (None, False):
            problems.append(Problem(key, f"`{key}` is not supported by gymproxy ({why})"))
    if config.is_responses_native:
        clashes = [
            key
            for key, bad in (
                ("return_token_id_information", config.return_token_id_information),
                ("replace_developer_role_with_system", config.replace_developer_role_with_system),
                ("sequential_reasoning_allowed: false", not config.sequential_reasoning_allowed),
                ("use_completions_api", config.use_completions_api),
            )
            if bad
        ]
        if clashes:
            problems.append(
                Problem("is_responses_native", f"forwards /v1/responses unconverted, so {clashes} cannot apply")
            )
    return problems


def _inbound_key_problem(key: str) -> str | None:
    """What is wrong with an inbound key, which a client sends as `Authorization: Bearer <key>`
    (visible ASCII, bounded); None when nothing is. An empty one (or one of spaces) would match no
    request: every request would get a 401, silently."""
    if not key.strip():
        return "is empty: no client can send an empty key, so every request would be refused (401); remove it, or give the key"
    if len(key) > MAX_KEY or not _KEY.fullmatch(key):
        return (
            f"must be at most {MAX_KEY} visible ASCII characters (no spaces or controls), as a client sends it "
            "in `Authorization: Bearer <key>`"
        )
    return None


def _check_access(config: Config) -> list[Problem]:
    """The access settings that would not protect what they seem to (`api_keys` as finally read)."""
    access = config.access
    if access.api_keys:
        return []
    problems: list[Problem] = []
    if access.admin_requires_key:
        problems.append(
            Problem(
                "access.admin_requires_key",
                "needs access.api_keys (or access.api_keys_file): with no key there is nothing to require; "
                "set keys, or drop admin_requires_key",
            )
        )
    exposed = (
        ("admin_fleet_changes", access.admin_fleet_changes, "change the upstreams (and so read every prompt)"),
        ("fleet_control", access.fleet_control, "pause every engine or load weights into them"),
    )
    for key, on, what in exposed:
        if on and not is_loopback(config.host):
            problems.append(Problem(f"access.{key}", _exposed(config, what)))
    if config.capture.enabled and not is_loopback(config.host):
        problems.append(Problem("capture.enabled", _exposed(config, "read every captured prompt at /v1/rollouts")))
    return problems


def _exposed(config: Config, what: str) -> str:
    return (
        f"with no access.api_keys would let anyone who reaches {config.host}:{config.port} {what}; set "
        "access.api_keys (or access.api_keys_file), or listen on a loopback host (127.0.0.1, ::1, localhost)"
    )


def upstream_specs(config: Config) -> list[UpstreamSpec]:
    """Every upstream the file names: `base_url` entries first, then `upstreams` (not `upstreams_dns`'s)."""
    return [UpstreamSpec(url=url) for url in config.base_url] + list(config.upstreams)


class DnsTarget(msgspec.Struct, frozen=True):
    """`upstreams_dns` taken apart: each resolved address becomes `scheme://address:port/path`."""

    scheme: str
    host: str
    port: int
    path: str


def dns_target(value: str) -> DnsTarget:
    """`http://host:port/v1`, or `host:port` (meaning `http://host:port/v1`); ValueError says what is wrong."""
    if "://" not in value:
        value = f"http://{value}/v1"
    scheme, _, rest = value.partition("://")
    hostport, slash, path = rest.partition("/")
    host, colon, port = hostport.rpartition(":")
    if scheme not in ("http", "https"):
        raise ValueError(f"{value!r} must start with http:// or https://")
    if not colon or not port.isdigit() or not host or "@" in host:
        raise ValueError(f"{value!r} needs a host and a port (`host:port` or `http://host:port/v1`)")
    if not 0 < int(port) < 65536:
        raise ValueError(f"{value!r}: port {port} is out of range")
    return DnsTarget(scheme, host.strip("[]"), int(port), slash + path)


NEMO_MODEL_TYPES = ("vllm_model", "local_vllm_model")
# local_vllm_model keys gymproxy does not implement, refused by name whenever they are set.
_LOCAL_REFUSED = {
    "router": "gymproxy itself routes between the replicas",
    "pd": "prefill/decode disaggregation is not supported",
    "ray_worker_py_executable": "gymproxy starts `vllm serve` as a process, not through Ray; "
    "give subprocess.executable (launch.vllm_bin)",
}
# Its `subprocess:` keys, as `launch` keys; the others there are refused by name.
_LOCAL_SUBPROCESS = {
    "executable": "vllm_bin",
    "port": "base_port",
    "startup_timeout_seconds": "startup_timeout_s",
    "shutdown_timeout_seconds": "stop_grace_s",
    "log_dir": "log_dir",
}
_LOCAL_MANAGED = ("host", "port", "uds")  # vllm_serve_kwargs gymproxy sets itself


def from_local_vllm_model(block: dict[str, Any], problems: list[Problem]) -> dict[str, Any]:
    """A NeMo Gym `local_vllm_model` block as gymproxy keys: the `vllm_model` keys it shares stay,
    and `vllm_serve_kwargs`, `vllm_serve_env_vars`, `hf_home` and `subprocess` become `launch`, so
    gymproxy starts the server LocalVLLMModel would (one `vllm serve model --download-dir
    <hf_home>/hub ...` on the GPUs its parallel sizes need). A block with a `base_url` names a server
    already running, as in NeMo Gym: nothing is launched. A `launch` key of the block's own wins.
    What cannot be carried over is added to `problems` (paths relative to the block)."""
    section = dict(block)
    kwargs = section.pop("vllm_serve_kwargs", None) or {}
    env = section.pop("vllm_serve_env_vars", None) or {}
    hf_home = section.pop("hf_home", None)
    show_stats = section.pop("show_vllm_engine_stats", False)
    subprocess = section.pop("subprocess", None) or {}
    launcher = section.pop("launcher", "ray")
    section.pop("debug", None)  # gymproxy always logs each replica's command line
    for key, why in _LOCAL_REFUSED.items():
        if section.pop(key, None) is not None:
            problems.append(Problem(key, f"local_vllm_model `{key}` is not supported by gymproxy ({why})"))
    if section.get("base_url"):
        return section
    if launcher not in ("ray", "subprocess"):
        problems.append(Problem("launcher", f"local_vllm_model `launcher` must be ray or subprocess, got {launcher!r}"))
    for key, value in (("vllm_serve_kwargs", kwargs), ("vllm_serve_env_vars", env), ("subprocess", subprocess)):
        if not isinstance(value, dict):
            problems.append(Problem(key, "must be a mapping"))
    model = section.get("model")
    if not isinstance(model, str) or not model:
        problems.append(Problem("model", "local_vllm_model needs `model` (the checkpoint to serve)"))
    if not (isinstance(kwargs, dict) and isinstance(env, dict) and isinstance(subprocess, dict)):
        return section
    launch: dict[str, Any] = {}
    for key, value in subprocess.items():
        if key in _LOCAL_SUBPROCESS:
            launch[_LOCAL_SUBPROCESS[key]] = value
        else:
            problems.append(
                Problem(f"subprocess.{key}", f"local_vllm_model `subprocess.{key}` is not supported by gymproxy")
            )
    options = {str(key).replace("-", "_"): value for key, value in kwargs.items()}
    for key in _LOCAL_MANAGED:
        if key in options:
            problems.append(
                Problem(
                    f"vllm_serve_kwargs.{key}",
                    f"local_vllm_model `vllm_serve_kwargs.{key}` is set by gymproxy for each replica",
                )
            )
    checkpoint = options.pop("model", model)
    if checkpoint != model:
        options.setdefault("served_model_name", model)
    # NeMo Gym's default: ./.cache/huggingface, and models downloaded to its hub/.
    hf_home = hf_home or str(Path.cwd() / ".cache" / "huggingface")
    options.setdefault("download_dir", str(Path(hf_home) / "hub"))
    if not show_stats:
        options.setdefault("disable_log_stats", True)
    launch |= {"model": str(checkpoint), "args": to_vllm_args(options), "env": env, "hf_home": hf_home}
    own = section.pop("launch", None)
    section["launch"] = {**launch, **own} if isinstance(own, dict) else launch
    return section


def to_vllm_args(options: Mapping[str, Any]) -> list[str]:
    """`vllm_serve_kwargs` as `vllm serve` flags: `key: v` is `--key=v` (underscores as dashes),
    `true`/`false` `--key`/`--no-key`, a list `--key a b`, a mapping JSON; `null` is left out."""
    args: list[str] = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, (list, tuple)):
            args += [flag, *(json.dumps(v) if isinstance(v, (dict, list, bool)) else str(v) for v in value)]
        elif isinstance(value, dict):
            args.append(f"{flag}={json.dumps(value)}")
        else:
            args.append(f"{flag}={value}")
    return args


STAND_IN_HOST: Final = "given-at-serve-time.invalid"


def _stand_in(where: str, name: str) -> str:
    """A valid value for the key at `where`, in place of the placeholder `name` (check-config)."""
    key = re.sub(r"\[\d+\]$", "", where).rpartition(".")[2]
    if key in ("base_url", "url"):
        return f"http://{STAND_IN_HOST}/{name}"
    if key in ("name", "api_key"):  # an upstream's are checked (`check_upstream`): no `${}` there
        return re.sub(r"[^A-Za-z0-9._-]", "_", name)
    return _SCALAR_STAND_INS.get(key, f"${{{name}}}")


def _scalar_stand_ins(struct: Any) -> dict[str, str]:
    """Field name -> a string that converts to its type, for the non-string scalar fields of the
    config and of its nested sections."""
    found: dict[str, str] = {}
    info = msgspec.inspect.type_info(struct)
    assert isinstance(info, msgspec.inspect.StructType)
    for field in info.fields:
        kinds = field.type.types if isinstance(field.type, msgspec.inspect.UnionType) else (field.type,)
        for kind in kinds:
            if isinstance(kind, msgspec.inspect.StructType):
                found.update(_scalar_stand_ins(kind.cls))
            elif isinstance(kind, msgspec.inspect.BoolType):
                found.setdefault(field.name, "false")
            elif isinstance(kind, (msgspec.inspect.IntType, msgspec.inspect.FloatType)):
                found.setdefault(field.name, "1")
    return found


_SCALAR_STAND_INS: Final = _scalar_stand_ins(Config)
