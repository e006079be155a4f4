"""The HTTP routes: where a request goes. Each route reads and decodes the client's body, plans the
request, and hands it to one `Exchange`:

POST /v1/responses          decode -> to_chat_body -> ChatBackend (boundary rules) -> ResponsesAnswer
POST /v1/chat/completions   decode -> ChatBackend (boundary rules) -> ChatAnswer
with use_completions_api    both plan a CompletionsBackend instead of the ChatBackend
with is_responses_native    /v1/responses is relayed to the upstream's own, with the config applied
GET  /v1/models, POST /v1/completions, POST /tokenize   relayed as they are
POST /v1/messages, /v1/messages/count_tokens   Anthropic's API, relayed to vLLM's own (messages.py);
                            a captured /v1/messages: decode -> convert.anthropic -> ChatBackend -> MessagesAnswer
GET  /api/hello             Claude Code's reachability check
GET  /health, /metrics      the fleet's state
GET, POST /admin/upstreams, POST /admin/upstreams/{name}/drain, DELETE /admin/upstreams/{name}
                            the fleet listed and changed live (the changes behind a key when any is set)
POST /fleet/pause, /fleet/resume, POST|GET /fleet/broadcast/{route}, GET /fleet/status
                            weight updates across the fleet (control.py; behind a key, `access.fleet_control`)
GET  /, /healthz, /livez, /readyz   liveness: 200 while the process serves (NeMo Gym's probes)

`bind` wraps every route: the loop check (`proxy.hop_chain`), the inbound key check, the request
id, the pin cookie read once, errors rendered, the response stamped (request id, new pin) and
counted. A route's `Dialect` says which API's clients call it: where their key may come, and the
envelope its errors are rendered in.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import re
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final, NamedTuple, TypeVar

import msgspec
import orjson
from aiohttp import streams, web

from . import logs, messages, overlay
from .capture import ROLLOUT_HEADER, ROLLOUT_ID, Recording, rollout_id
from .config import BadUpstream, Config, UpstreamSpec, check_upstream
from .control import PAUSE_MODES, ROUTES, Control, Outcome
from .convert.anthropic import has_inline_system, probe_body
from .convert.anthropic import to_chat_body as to_messages_chat_body
from .convert.request import to_chat_body
from .errors import (
    BadRequest,
    BodyTimeout,
    Conflict,
    Envelope,
    Forbidden,
    Handler,
    NotFound,
    PayloadTooLarge,
    Unauthorized,
    Unavailable,
    from_validation,
    render,
)
from .exchange import (
    JSON,
    KEPT_SHARE,
    Backend,
    Caller,
    ChatAnswer,
    ChatBackend,
    CompletionsBackend,
    Exchange,
    MessagesAnswer,
    ResponsesAnswer,
)
from .fleet import HOP_HEADER
from .ids import hex32
from .pinning import read_cookie
from .proxy import Proxy, hop_chain
from .rollouts.record import Rollout
from .rollouts.store import Store, StoreError
from .rollouts.trajectory import view
from .schemas import ENCODER
from .schemas.chat import ChatRequestView
from .schemas.messages import MESSAGES_DECODER
from .upstream import Upstream, upstream_name

Route = Callable[[Proxy, web.Request, Caller], Awaitable[web.StreamResponse]]

TOO_DEEP = "the request body is nested too deeply"
LIVE = ENCODER.encode({"status": "ok"})
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
_VERSION = re.compile(r"[!-~]{1,128}")
MIN_VERSION = "X-Min-Weight-Version"
BIG_BODY: Final = 1 << 20  # bytes: a body this large takes milliseconds to decode (`_let_others_run`)


class Dialect(NamedTuple):
    """The API a route's clients speak, as far as `bind` is concerned."""

    envelope: Envelope | None  # how gymproxy's own errors are rendered (None: OpenAI's)
    key_header: str | None  # a header that carries the inbound key, besides `Authorization: Bearer`
    refused: str  # the 401's message


OPENAI = Dialect(None, None, "a valid `Authorization: Bearer <key>` header is required")
ANTHROPIC = Dialect(
    messages.error_body, "x-api-key", "a valid `x-api-key: <key>` (or `Authorization: Bearer <key>`) header is required"
)


def bind(proxy: Proxy, route: Route, path: str, *, open_route: bool = False, dialect: Dialect = OPENAI) -> Handler:
    """An aiohttp handler for `route`: access check, request id, errors rendered, cookie and metrics."""
    metrics = proxy.metrics
    keys = [key.encode() for key in proxy.config.access.api_keys] if not open_route else []
    envelope, key_header, refused = dialect
    pinning = proxy.config.pinning
    cookie_name, session_headers = pinning.cookie_name, tuple(pinning.session_headers)
    signer = proxy.fleet.pinner.signer
    clock = time.monotonic
    instance = proxy.instance
    control = proxy.control is not None  # `X-Min-Weight-Version` is read only with fleet control
    access_log = proxy.config.access_log

    # One coroutine around the route: every await of a request passes through each layer.
    async def served(request: web.Request) -> web.StreamResponse:
        start = clock()
        headers = request.headers
        caller = Caller(
            _request_id(headers.get("X-Request-Id")),
            read_cookie(headers.get("Cookie"), cookie_name),
            _session_key(headers, session_headers),
            path,
            start,
            pinning,
            signer,
        )
        try:
            if HOP_HEADER in headers:  # it came through gymproxies (or a client says so)
                caller.hops = hop_chain(headers.getall(HOP_HEADER), instance)
            if keys and not _authorized(request, keys, key_header):
                raise Unauthorized(refused)
            if control and (least := headers.get(MIN_VERSION)) is not None:
                caller.min_version = _min_version(least)
            if (rollout := request.match_info.get("rollout_id")) is not None:
                caller.rollout = rollout_id(rollout, "the path's /ng-rollout/<id>/")
            elif (rollout := headers.get(ROLLOUT_HEADER)) is not None:
                caller.rollout = rollout_id(rollout, ROLLOUT_HEADER)
            response = await route(proxy, request, caller)
        except Exception as exc:
            response = render(exc, request, envelope)
        if not response.prepared:
            caller.stamp(response)  # errors of a new session carry its cookie too
        if caller.weights is not None:
            metrics.count_version(caller.weights)
        status, seconds = response.status, clock() - start
        metrics.requests[(path, status)] += 1
        metrics.duration.observe(path, seconds)
        if access_log:
            _access(request, caller, status, seconds)
        return response

    served.__name__ = route.__name__
    return served


# --- the routes ------------------------------------------------------------------------------------


async def responses(proxy: Proxy, request: web.Request, caller: Caller) -> web.StreamResponse:
    """`POST /v1/responses`: convert to chat, call vLLM, convert the answer (or each chunk) back."""
    config = proxy.config
    raw = await read_body(request, config)
    req = proxy.requests.decode(raw)
    if len(raw) >= BIG_BODY:
        await _let_others_run()
    _add_key(caller, req.prompt_cache_key)
    _add_user(caller, req.user, config)
    stream = req.stream is True
    kept = config.limits.max_reply_size // KEPT_SHARE
    caller.model = config.model or req.model
    recording = None if proxy.capture is None else await _captured(proxy, caller, "responses", stream)
    answer = ResponsesAnswer(req, caller.model, parser=config.uses_reasoning_parser, max_text=kept)
    if proxy.completions is not None:
        warn = proxy.boundary.warn_dropped_template_kwargs
        backend: Backend = CompletionsBackend(
            proxy.completions, proxy.template, warn, to_chat_body(req), stream=stream, chat_client=False
        )
    else:
        body = to_chat_body(req, proxy.boundary)
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        backend = ChatBackend(
            proxy.boundary, body, built=True, conversation_id=_conversation_id(caller, config), recording=recording
        )
    return await Exchange(proxy, request, caller).serve(backend, answer, stream=stream)


async def chat_completions(proxy: Proxy, request: web.Request, caller: Caller) -> web.StreamResponse:
    """`POST /v1/chat/completions`: vLLM's own API, with the boundary rules and reasoning folding."""
    config = proxy.config
    raw = await read_body(request, config)
    body = decode_chat(raw)
    if len(raw) >= BIG_BODY:
        await _let_others_run()
    _add_user(caller, body.get("user"), config)
    stream = body.get("stream") is True
    model = config.model if config.model is not None else body.get("model")
    caller.model = model if isinstance(model, str) else None
    recording = None if proxy.capture is None else await _captured(proxy, caller, "chat", stream)
    answer = ChatAnswer(model, parser=config.uses_reasoning_parser)
    if proxy.completions is not None:
        warn = proxy.boundary.warn_dropped_template_kwargs
        backend: Backend = CompletionsBackend(
            proxy.completions, proxy.template, warn, body, stream=stream, chat_client=True
        )
    else:
        backend = ChatBackend(
            proxy.boundary, body, conversation_id=_conversation_id(caller, config), recording=recording
        )
    return await Exchange(proxy, request, caller).serve(backend, answer, stream=stream)


async def responses_native(proxy: Proxy, request: web.Request, caller: Caller) -> web.StreamResponse:
    """`POST /v1/responses` with `is_responses_native`: the upstream speaks Responses itself (spec 11)."""
    config = proxy.config
    raw = await read_body(request, config)
    body = decode_object(raw)
    if len(raw) >= BIG_BODY:
        await _let_others_run()
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("`stream` must be a JSON boolean", param="stream")
    _add_key(caller, body.get("prompt_cache_key"))
    _add_user(caller, body.get("user"), config)
    if config.model is not None:
        body["model"] = config.model
    if config.chat_template_kwargs is not None:
        body["chat_template_kwargs"] = dict(config.chat_template_kwargs)
    if config.extra_body:
        body = {**config.extra_body, **body}
    if config.sampling_overrides:
        body.update(config.sampling_overrides)
    return await Exchange(proxy, request, caller).relay("responses", ENCODER.encode(body), streamed=stream is True)


def relay(route: str) -> Route:
    """A route that forwards the request body to `route` unchanged and relays the reply back."""

    async def relayed(proxy: Proxy, request: web.Request, caller: Caller) -> web.StreamResponse:
        data = await read_body(request, proxy.config)
        return await Exchange(proxy, request, caller).relay(route, data, streamed=_asks_stream(data))

    relayed.__name__ = f"relay_{route}"
    return relayed


def anthropic(route: str) -> Route:
    """`POST /v1/messages` (`route` "messages") or `/v1/messages/count_tokens` ("count_tokens"):
    relayed to vLLM's own Anthropic endpoint with the configured model, the client's query string
    and `anthropic-*` headers; a stream the upstream breaks off ends with an `error` event. A
    captured `/v1/messages` call is converted instead (`captured_messages`)."""

    async def relayed(proxy: Proxy, request: web.Request, caller: Caller) -> web.StreamResponse:
        config = proxy.config
        raw = await read_body(request, config)
        body, user_id, stream = messages.prepare(raw, config.model)
        if len(raw) >= BIG_BODY:
            await _let_others_run()
        _add_user(caller, user_id, config)
        if route == "messages" and (rollout := _rollout_of(proxy, caller)) is not None:
            return await captured_messages(proxy, request, caller, body, rollout)
        return await Exchange(proxy, request, caller).relay(
            route,
            body,
            query=request.rel_url.raw_query_string or None,
            headers=messages.upstream_headers(request.headers.items()),
            fail=messages.stream_error,
            streamed=stream,
        )

    relayed.__name__ = f"anthropic_{route}"
    return relayed


async def captured_messages(
    proxy: Proxy, request: web.Request, caller: Caller, body: bytes, rollout: str
) -> web.StreamResponse:
    """A `/v1/messages` call of a rollout: vLLM's Anthropic endpoint returns no token ids, so the call
    is converted to the chat request that endpoint would make (`convert.anthropic`), served by vLLM's
    chat API as chat calls are, recorded, and answered as the endpoint answers."""
    try:
        req = MESSAGES_DECODER.decode(body)
    except msgspec.DecodeError as exc:
        raise from_validation(exc) from exc
    if len(body) >= BIG_BODY:
        await _let_others_run()
    caller.model = req.model
    exchange = Exchange(proxy, request, caller)
    merge = has_inline_system(req) and await _merges_inline_system(proxy, exchange, req.model)
    chat = to_messages_chat_body(req, merge_inline_system=merge)
    stream = req.stream is True
    assert proxy.capture is not None  # `_rollout_of`
    caller.recording = recording = await proxy.capture.begin(rollout, "messages", stream=stream)
    return await exchange.serve(ChatBackend(None, chat, recording=recording), MessagesAnswer(), stream=stream)


async def _merges_inline_system(proxy: Proxy, exchange: Exchange, model: str) -> bool:
    """Whether the upstreams' vLLM merges inline system messages into the leading one: it does when
    its chat template refuses a system message after a user's, which it finds out by rendering
    `convert.anthropic.PROBE_MESSAGES`. gymproxy renders the same on /tokenize, once per process
    (its upstreams serve one model)."""
    if proxy.merge_inline_system is None:
        status, payload = await exchange.fetch("tokenize", ENCODER.encode(probe_body(model)))
        if status not in (200, 400):  # 400: the template raised
            raise messages.upstream_error(status, payload)
        proxy.merge_inline_system = status == 400
    return proxy.merge_inline_system


async def models(proxy: Proxy, request: web.Request, caller: Caller) -> web.StreamResponse:
    """`GET /v1/models`, answered by the (pinned) upstream."""
    return await Exchange(proxy, request, caller).relay("models", None, method="GET")


async def health(proxy: Proxy, request: web.Request, caller: Caller) -> web.StreamResponse:
    """`GET /health`: 200 while at least one upstream is healthy, 503 otherwise; lists each upstream
    (and each launched vLLM replica's state, with `launch`)."""
    states = proxy.fleet.states()
    ok = any(state["healthy"] for state in states)
    body: dict[str, Any] = {"status": "ok" if ok else "unavailable", "upstreams": states}
    if proxy.replicas is not None:
        body["replicas"] = proxy.replicas()
    return web.Response(body=ENCODER.encode(body), status=200 if ok else 503, content_type=JSON)


# --- the fleet's admin routes (mounted beside /health; the changes need `access.admin_fleet_changes`) ---


async def list_upstreams(proxy: Proxy, request: web.Request, caller: Caller) -> web.StreamResponse:
    """`GET /admin/upstreams`: every upstream known, with its state (see `Fleet.states`)."""
    return _fleet_response(proxy)


async def add_upstream(proxy: Proxy, request: web.Request, caller: Caller) -> web.StreamResponse:
    """`POST /admin/upstreams` `{"url": ..., "name"?, "weight"?, "api_key"?}`: 201 and the fleet."""
    _allow_changes(proxy)
    try:
        spec = msgspec.json.decode(await read_body(request, proxy.config), type=UpstreamSpec)
    except msgspec.DecodeError as exc:
        raise from_validation(exc) from exc
    _check_buildable(proxy, spec)
    name = upstream_name(spec)
    states = proxy.fleet.states()
    if any(state["name"] == name for state in states):
        raise Conflict(f"an upstream named {name!r} exists already; remove it first", param="name")
    most = proxy.config.limits.max_upstreams
    if sum(state["state"] != "removing" for state in states) >= most:
        raise Conflict(f"the fleet has {most} upstreams, the most limits.max_upstreams allows; remove one first")
    proxy.change(lambda changes: overlay.add(changes, name, spec))
    return _fleet_response(proxy, status=201)


async def drain_upstream(proxy: Proxy, request: web.Request, caller: Caller) -> web.StreamResponse:
    """`POST /admin/upstreams/{name}/drain`: no new requests go there; those in flight finish."""
    _allow_changes(proxy)
    name = _known(proxy, request)
    proxy.change(lambda changes: overlay.drain(changes, name))
    return _fleet_response(proxy)


async def remove_upstream(proxy: Proxy, request: web.Request, caller: Caller) -> web.StreamResponse:
    """`DELETE /admin/upstreams/{name}`: drained, then forgotten once its requests in flight end."""
    _allow_changes(proxy)
    name = _known(proxy, request)
    proxy.change(lambda changes: overlay.remove(changes, name))
    return _fleet_response(proxy)


def _check_buildable(proxy: Proxy, spec: UpstreamSpec) -> None:
    """A 400 naming the field unless `spec` passes `check_upstream` and builds into an upstream as
    the fleet will build it, so that nothing recorded can fail later, in any worker."""
    try:
        check_upstream(spec)
        Upstream(spec, proxy.fleet.config)
    except BadUpstream as exc:
        raise BadRequest(str(exc), param=exc.field) from None
    except ValueError as exc:
        raise BadRequest(f"url cannot be used: {exc}", param="url") from None


def _allow_changes(proxy: Proxy) -> None:
    if not proxy.config.access.admin_fleet_changes:
        raise Forbidden("changing the fleet over HTTP is off; set `access.admin_fleet_changes: true` to allow it")


def _known(proxy: Proxy, request: web.Request) -> str:
    name = request.match_info["name"]
    if not any(state["name"] == name and state["state"] != "removing" for state in proxy.fleet.states()):
        raise NotFound(f"no upstream is named {name!r} (GET /admin/upstreams lists them)", param="name")
    return name


def _fleet_response(proxy: Proxy, status: int = 200) -> web.Response:
    return web.Response(body=ENCODER.encode({"upstreams": proxy.fleet.states()}), status=status, content_type=JSON)


# --- fleet control for weight updates (`access.fleet_control`; control.py) -------------------------


async def fleet_pause(proxy: Proxy, request: web.Request, caller: Caller) -> web.StreamResponse:
    """`POST /fleet/pause?mode=abort|wait|keep`: every engine paused (a barrier), new requests held."""
    control = _control(proxy)
    mode = request.query.get("mode", "abort")
    if mode not in PAUSE_MODES:
        raise BadRequest(f"mode must be one of {', '.join(PAUSE_MODES)}, not {mode[:64]!r}", param="mode")
    rest = urllib.parse.urlencode([(k, v) for k, v in request.query.items() if k != "mode"])
    ok, outcomes = await control.pause(mode, rest)
    if ok:
        return _control_response({"paused": True, "mode": mode, "engines": outcomes})
    return _control_failed(
        "pause_failed",
        "not every engine paused; those that did were resumed, and one whose /pause is still open is resumed "
        "once it answers (its `pending`)",
        outcomes,
    )


async def fleet_resume(proxy: Proxy, request: web.Request, caller: Caller) -> web.StreamResponse:
    """`POST /fleet/resume`: every engine resumed, then what gymproxy held is sent."""
    ok, outcomes, released = await _control(proxy).resume()
    if ok:
        return _control_response({"paused": False, "released": released, "engines": outcomes})
    return _control_failed(
        "resume_failed", f"not every engine resumed; gymproxy released its {released} held requests", outcomes
    )


async def fleet_broadcast(proxy: Proxy, request: web.Request, caller: Caller) -> web.StreamResponse:
    """`POST|GET /fleet/broadcast/{route}`: the body and query sent to `route` on every engine."""
    control = _control(proxy)
    route = request.match_info["route"]
    method = ROUTES.get(route)
    if method is None:
        raise NotFound(f"{route[:64]!r} is not a route a broadcast reaches: one of {', '.join(ROUTES)}", param="route")
    body = await read_body(request, proxy.config) if request.method == "POST" else b""
    ok, outcomes = await control.broadcast(route, method, body or None, request.rel_url.raw_query_string)
    if ok:
        return _control_response({"route": route, "engines": outcomes})
    return _control_failed("broadcast_failed", f"not every engine answered {route} with success", outcomes)


async def fleet_status(proxy: Proxy, request: web.Request, caller: Caller) -> web.StreamResponse:
    """`GET /fleet/status`: paused or not, held requests, and each engine's pause and weight version."""
    return _control_response(await _control(proxy).status())


def _control(proxy: Proxy) -> Control:
    if proxy.control is None:
        raise Forbidden("fleet control is off; set `access.fleet_control: true` to allow it")
    return proxy.control


def _control_response(body: dict[str, Any], status: int = 200) -> web.Response:
    return web.Response(body=ENCODER.encode(body), status=status, content_type=JSON)


def _control_failed(code: str, message: str, outcomes: list[Outcome]) -> web.Response:
    failed = "; ".join(f"{o.url}: {o.error or o.status}" for o in outcomes if not o.ok)
    error = {"message": f"{message} ({failed})", "type": "upstream_error", "param": None, "code": code}
    return _control_response({"error": error, "engines": outcomes}, status=502)


# --- captured rollouts (`capture.enabled`; capture.py, rollouts/) -----------------------------------

ROLLOUT_PAGE = 100  # a listing's page, unless `limit` asks for fewer (at most `ROLLOUT_PAGE_MAX`)
ROLLOUT_PAGE_MAX = 1000


async def list_rollouts(proxy: Proxy, request: web.Request, caller: Caller) -> web.StreamResponse:
    """`GET /v1/rollouts?after=<id>&limit=<n>&state=open|frozen`: rollouts by id, a page at a time."""
    store = _store(proxy)
    query = request.query
    after = query.get("after")
    if after is not None:
        after = rollout_id(after, "after")
    limit = _limit(query.get("limit"))
    state = query.get("state")
    if state not in (None, "open", "frozen"):
        raise BadRequest(f"state must be open or frozen, not {state[:64]!r}", param="state")
    page = await _stored(store.list(after=after, limit=limit + 1, state=state))  # type: ignore[arg-type]
    more = len(page) > limit
    page = page[:limit]
    body = {"object": "list", "data": page, "has_more": more, "last_id": page[-1].rollout_id if page else None}
    return web.Response(body=ENCODER.encode(body), content_type=JSON)


async def get_rollout(proxy: Proxy, request: web.Request, caller: Caller) -> web.StreamResponse:
    """`GET /v1/rollouts/{rollout_id}`: its calls and its trajectory, rebuilt (`rollouts.trajectory`)."""
    store = _store(proxy)
    rollout = await _stored(store.get(_rollout(request)))
    if rollout is None:
        raise _unknown(request)
    return await _rollout_view(rollout)


async def freeze_rollout(proxy: Proxy, request: web.Request, caller: Caller) -> web.StreamResponse:
    """`POST /v1/rollouts/{rollout_id}/freeze`: the atomic snapshot; later calls of it get a 409."""
    store = _store(proxy)
    rollout = await _stored(store.freeze(_rollout(request)))
    if rollout is None:
        raise _unknown(request)
    return await _rollout_view(rollout)


async def delete_rollout(proxy: Proxy, request: web.Request, caller: Caller) -> web.StreamResponse:
    """`DELETE /v1/rollouts/{rollout_id}`: its records freed."""
    store = _store(proxy)
    rollout = _rollout(request)
    if not await _stored(store.delete(rollout)):
        raise _unknown(request)
    return web.Response(body=ENCODER.encode({"id": rollout, "object": "rollout", "deleted": True}), content_type=JSON)


async def _rollout_view(rollout: Rollout) -> web.Response:
    # A long rollout's trajectory is megabytes of token ids: rebuilt and encoded off the event loop.
    body = await asyncio.to_thread(lambda: ENCODER.encode(view(rollout)))
    return web.Response(body=body, content_type=JSON)


_T = TypeVar("_T")


async def _stored(answer: Awaitable[_T]) -> _T:
    """The store's answer; a store that cannot give one (down, failing) is a 503 naming it."""
    try:
        return await answer
    except StoreError as exc:
        raise Unavailable(str(exc)) from exc


def _store(proxy: Proxy) -> Store:
    if proxy.capture is None:
        raise Forbidden("rollout capture is off; set `capture.enabled: true` to record rollouts")
    return proxy.capture.store


def _rollout(request: web.Request) -> str:
    return rollout_id(request.match_info["rollout_id"], "rollout_id")


def _unknown(request: web.Request) -> NotFound:
    name = request.match_info["rollout_id"]
    return NotFound(f"no rollout {name!r} is recorded (GET /v1/rollouts lists them)", param="rollout_id")


def _limit(value: str | None) -> int:
    if value is None:
        return ROLLOUT_PAGE
    if not value.isdigit() or not 1 <= int(value) <= ROLLOUT_PAGE_MAX:
        raise BadRequest(f"limit must be a whole number from 1 to {ROLLOUT_PAGE_MAX}", param="limit")
    return int(value)


async def live(proxy: Proxy, request: web.Request, caller: Caller) -> web.StreamResponse:
    """`GET /`, `/healthz`, `/livez`, `/readyz`: the process is up and serving. No upstream is asked
    (that is `/health`), so a probe costs nothing and a fleet outage does not restart gymproxy."""
    return web.Response(body=LIVE, content_type=JSON)


async def metrics(proxy: Proxy, request: web.Request, caller: Caller) -> web.StreamResponse:
    """`GET /metrics` in the Prometheus text format."""
    text = proxy.render_metrics()
    if proxy.peers is not None:  # one worker of several: the scrape covers them all
        text = await proxy.peers.collect(text)
    return web.Response(text=text, content_type="text/plain", charset="utf-8")


async def _captured(proxy: Proxy, caller: Caller, route: str, stream: bool) -> Recording | None:
    """The call's capture, when capture is on and it carries a rollout id (`_rollout_of`)."""
    rollout = _rollout_of(proxy, caller)
    if rollout is None or proxy.capture is None:
        return None
    caller.recording = await proxy.capture.begin(rollout, route, stream=stream)
    return caller.recording


def _rollout_of(proxy: Proxy, caller: Caller) -> str | None:
    """The rollout the call is recorded in, when capture is on and it carries a rollout id (`capture`);
    read once the body's session keys are in (`capture.key: session` takes them as the id)."""
    capture = proxy.capture
    if capture is None:
        return None
    rollout = caller.rollout
    if rollout is None and capture.config.key == "session" and caller.key:
        key = caller.key
        rollout = key if ROLLOUT_ID.fullmatch(key) else "sha256-" + hashlib.sha256(key.encode()).hexdigest()[:32]
    return rollout


def _conversation_id(caller: Caller, config: Config) -> str | None:
    """The session's id for the chat body's `conversation_params`, when configured (NeMo Gym's
    `forward_session_id_as_conversation_id`; the chat path only, as there)."""
    return caller.session_id() if config.forward_session_id_as_conversation_id else None


def _session_key(headers: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    """The first session header present (`pinning.session_headers`), for clients without cookies."""
    for name in names:
        value = headers.get(name)
        if value:
            return value
    return None


def _add_key(caller: Caller, key: Any) -> None:
    """A body field that names the session (Responses' `prompt_cache_key`), below any session header."""
    if caller.key is None and isinstance(key, str) and key:
        caller.key = key


def _add_user(caller: Caller, user: Any, config: Config) -> None:
    """The body's `user` keys a session for clients without cookies (when configured)."""
    if caller.key is None and config.pinning.use_user_field and isinstance(user, str) and user:
        caller.key = user


# --- reading and decoding bodies -------------------------------------------------------------------


async def read_body(request: web.Request, config: Config) -> bytes:
    """The request body, refusing (413) anything over `max_body_size` bytes (on the wire, or inflated
    when compressed) or holding more JSON values than `limits.max_json_values` and
    `limits.max_json_numbers` allow (`_JSONValues`), each as soon as it is known, and a body that
    stops arriving for `limits.client_body_timeout` seconds (408). A refused body ends its
    connection: what is left of it is never read, nor inflated (`errors.render`)."""
    limit = config.max_body_size
    content = request.content
    length = request.content_length
    compressed = "Content-Encoding" in request.headers
    if length is not None and length > limit:
        raise PayloadTooLarge(f"the request body is {length} bytes; the limit is {limit} (max_body_size)")
    limits = config.limits
    watch = None if content.is_eof() else _BodyWatch(content, config.limits.client_body_timeout)
    try:
        if not compressed and length is not None and length <= min(limits.max_json_values, limits.max_json_numbers):
            return await content.readexactly(length)  # too short to hold too many values
        # Larger, chunked or compressed: the values (and, when Content-Length is not the size we get,
        # the bytes) are counted chunk by chunk as they arrive, so no count holds up the event loop.
        values = _JSONValues(limits.max_json_values, limits.max_json_numbers)
        chunks = []
        size = 0
        async for chunk in content.iter_any():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"the request body is over the limit of {limit} bytes (max_body_size)")
            values.count(chunk)
            chunks.append(chunk)
            if compressed:
                # aiohttp inflates the next piece while this one is taken, so the next read never
                # waits: without this, a body that inflates well would be read in one go.
                await asyncio.sleep(0)
        return b"".join(chunks)
    except _Stalled as exc:
        raise BodyTimeout(str(exc)) from None
    except asyncio.IncompleteReadError as exc:
        raise BadRequest("the request body is shorter than its Content-Length") from exc
    except web.RequestPayloadError as exc:  # bad chunking or an undecodable Content-Encoding
        raise BadRequest(f"the request body cannot be read: {exc}") from exc
    finally:
        if watch is not None:
            watch.stop()


class _JSONValues:
    """Counts the JSON values of a body as it arrives, and refuses (413) a body with more than the
    limits: decoding costs memory and event-loop time per value, not per byte (a 32 MiB body of
    `{},{},...` decodes to over 1 GB, in seconds; of `0,0,...`, to 450 MB), and bodies are decoded
    on the loop.

    Objects, arrays and strings against `values`: each `{`, `[` and pair of `"`. Numbers, `true`,
    `false` and `null` against `numbers`, which is higher (they cost less each, and a prompt of token
    ids holds many): each `,` (every array item and object member after the first follows one).
    Those inside strings count too, so the counts are upper bounds and need no parse:
    `bytes.translate` keeps just those bytes, at some 3 GB/s. A body of at most the lower limit in
    bytes cannot hold more values than that, so it is not counted.
    """

    __slots__ = ("values", "numbers", "opens", "quotes", "commas")

    def __init__(self, values: int, numbers: int) -> None:
        self.values = values
        self.numbers = numbers
        self.opens = 0  # `{` and `[`
        self.quotes = 0
        self.commas = 0

    def count(self, chunk: bytes) -> None:
        marks = chunk.translate(None, _NOT_MARKS)
        quotes, commas = marks.count(b'"'), marks.count(b",")
        self.quotes += quotes
        self.commas += commas
        self.opens += len(marks) - quotes - commas
        if self.opens + self.quotes // 2 > self.values:
            raise PayloadTooLarge(
                f"the request body holds more JSON objects, arrays and strings than the limit of {self.values} "
                '(limits.max_json_values; each `{`, `[` and pair of `"` counts)'
            )
        if self.commas > self.numbers:
            raise PayloadTooLarge(
                f"the request body holds more JSON numbers (and true, false, null) than the limit of "
                f"{self.numbers} (limits.max_json_numbers; each `,` counts)"
            )


_NOT_MARKS: Final = bytes(sorted(set(range(256)) - set(b'{[",')))  # what `_JSONValues.count` drops


class _Stalled(asyncio.TimeoutError):
    """Set on a request body that stopped arriving. A TimeoutError, because aiohttp reads what is left
    of the body after the response (its lingering close) and lets only timeouts end that quietly."""


class _BodyWatch:
    """Fails a body read once no byte arrived for `timeout` seconds (like nginx's
    `client_body_timeout`, an idle timeout, not a limit on the whole upload).

    The watches of the bodies being read are kept in the order their bytes were last seen to arrive
    (as of each one's last check), so that a listener at its cap on connections can end the
    longest-stalled one (`end_stalled_body`) instead of refusing a client, looking at a few only.
    """

    __slots__ = ("content", "timeout", "seen", "since", "timer")
    waiting: dict[_BodyWatch, None] = {}  # this process's bodies being read, silent longest first

    def __init__(self, content: streams.StreamReader, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        self.content = content
        self.timeout = timeout
        self.seen = content.total_bytes
        self.since = loop.time()  # when the last byte was seen to arrive (as of the last check)
        self.timer = loop.call_later(timeout, self._check)
        _BodyWatch.waiting[self] = None

    def _check(self) -> None:
        if self.moved():  # bytes came: wait another `timeout`
            self.timer = asyncio.get_running_loop().call_later(self.timeout, self._check)
            return
        self.expire(f"the request body stopped arriving for {self.timeout:g} s (limits.client_body_timeout)")

    def moved(self) -> bool:
        """Whether bytes came since the last look; if so, it goes to the back of `waiting`."""
        if self.content.total_bytes == self.seen:
            return False
        self.seen = self.content.total_bytes
        self.since = asyncio.get_running_loop().time()
        del _BodyWatch.waiting[self]
        _BodyWatch.waiting[self] = None
        return True

    def expire(self, message: str) -> None:
        self.timer.cancel()
        _BodyWatch.waiting.pop(self, None)
        self.content.set_exception(_Stalled(message))

    def stop(self) -> None:
        self.timer.cancel()
        _BodyWatch.waiting.pop(self, None)


def end_waiting_bodies() -> None:
    """Shutdown's grace is over: every body still being read is refused (408)."""
    for watch in list(_BodyWatch.waiting):
        watch.expire("gymproxy is shutting down and the request body had not arrived")


def end_stalled_body(idle: float, looks: int = 4) -> bool:
    """End (408) the body read that has waited longest with no byte for at least `idle` seconds.
    Bodies still arriving are moved back as they are met, at most `looks` of them: the cost per call
    is bounded however many bodies are being read."""
    waiting = _BodyWatch.waiting
    now = asyncio.get_running_loop().time()
    for _ in range(looks):
        if not waiting:
            return False
        watch = next(iter(waiting))
        if watch.moved():
            continue
        if now - watch.since < idle:  # the one silent longest is not silent long enough
            return False
        watch.expire("the request body stalled while gymproxy was at its limit of client connections")
        return True
    return False


async def _let_others_run() -> None:
    """Between a big body's decode and what follows (its conversion, its encoding for vLLM): each is
    one call that holds the event loop (tens of ms for a body at the limits), and back to back they
    would add up. A short timer rather than `sleep(0)`: a request that arrived meanwhile needs a few
    turns of the loop to be answered. (Called for a body of `BIG_BODY` bytes or more only: a smaller
    one makes no coroutine.)"""
    await asyncio.sleep(0.001)


class _Stream(msgspec.Struct):
    stream: Any = None


_STREAM: Final = msgspec.json.Decoder(_Stream)  # a relayed body's `stream`, the rest skipped over


def _asks_stream(raw: bytes) -> bool:
    """Whether a relayed body asks for a stream (`"stream": true`); one that is not a JSON object
    does not (vLLM refuses it)."""
    try:
        return _STREAM.decode(raw).stream is True
    except (msgspec.DecodeError, RecursionError):
        return False


def decode_object(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        if exc.msg == "depth limit exceeded":  # orjson's 1024 levels; msgspec's RecursionError elsewhere
            raise BadRequest(TOO_DEEP) from None
        raise BadRequest(f"The request body is not valid JSON: {exc}") from exc
    except RecursionError:
        raise BadRequest(TOO_DEEP) from None
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object")
    return body


def decode_chat(raw: bytes) -> dict[str, Any]:
    body = decode_object(raw)
    try:
        msgspec.convert(body, ChatRequestView)
    except RecursionError:
        raise BadRequest(TOO_DEEP) from None
    except msgspec.ValidationError as exc:
        raise from_validation(exc) from exc
    return body


# --- access and ids --------------------------------------------------------------------------------


def _authorized(request: web.Request, keys: list[bytes], key_header: str | None = None) -> bool:
    """A configured key in `Authorization: Bearer`, or in `key_header` (Anthropic's `x-api-key`)."""
    headers = request.headers
    scheme, _, token = headers.get("Authorization", "").partition(" ")
    given = [token.strip().encode()] if scheme.lower() == "bearer" and token.strip() else []
    if key_header is not None and (value := headers.get(key_header, "").strip()):
        given.append(value.encode())
    ok = False
    for candidate in given:
        for key in keys:  # every key is compared, in constant time, so timing tells nothing
            ok |= hmac.compare_digest(candidate, key)
    return ok


def _access(request: web.Request, caller: Caller, status: int, seconds: float) -> None:
    """The request's access line (`logs.access`)."""
    outcome = caller.outcome or ("ok" if status < 400 else "error")
    logs.access(
        {
            "request_id": caller.request_id,
            "method": request.method,
            "route": caller.route,
            "status": status,
            "duration_ms": round(seconds * 1000, 1),
            "upstream": caller.upstream,
            "session": caller.session_id() if caller.upstream is not None else None,
            "model": caller.model,
            "prompt_tokens": caller.prompt_tokens,
            "completion_tokens": caller.completion_tokens,
            "outcome": outcome,
        }
    )


def _min_version(value: str) -> str:
    """`X-Min-Weight-Version`, checked: a version as vLLM names them (short, visible ASCII)."""
    value = value.strip()
    if not _VERSION.fullmatch(value):
        raise BadRequest(
            f"{MIN_VERSION} must be a weight version of 1 to 128 visible ASCII characters", param=MIN_VERSION
        )
    return value


def _request_id(given: str | None) -> str:
    """The client's X-Request-Id when it is sane, else a fresh one."""
    if given is not None and _REQUEST_ID.fullmatch(given):
        return given
    return hex32()
