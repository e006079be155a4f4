"""One client request's trip to vLLM and back: the exchange every converted route goes through.

A route decodes the client's request and plans it as a `Backend` (how vLLM is asked: its chat API,
or its completions API with `use_completions_api`) and an `Answer` (how the client is answered: a
chat completion or a Response). `Exchange.serve` then runs exactly one of:

- answer locally: the plan or vLLM's reply raised `AnswerLocally` (a blocked trailing turn, a
  context overflow); the client gets an empty answer in its own format, whole or streamed;
- whole reply: send, read the reply, judge its status, convert it;
- stream: send, then translate each SSE payload as it arrives. Before the response is prepared a
  failure is raised as usual; after it, every failure ends the stream with a terminal event.

`Exchange.relay` passes a request through unchanged (`/v1/completions`, `/tokenize`, `/v1/models`,
`/v1/responses` with `is_responses_native`, and Anthropic's `/v1/messages` unless captured). A reply that is not read
to its end is closed, which makes vLLM abort the generation: when the client leaves, when a stream
fails, at shutdown.

No upstream reply is held or passed on past its limit (`limits.max_reply_size`, and
`limits.max_error_reply_size` for an error status): a whole reply, relayed or converted, one event
of a converted stream, and a Responses stream (its last events carry the whole reply, so it keeps a
sixteenth of the limit in characters: `KEPT_SHARE`). Past it the client gets a 502 naming the
upstream and the limit (a stream: its terminal event), and no byte of the reply. A relayed event
stream the client asked for is passed on chunk by chunk whatever its length: it holds no more than
a chunk at a time.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

import msgspec
import orjson
from aiohttp import web

from . import messages
from .aborts import ABORT, Cut, aborted, relay_watching
from .client_stream import SSE_HEADERS, ClientGone, Payloads, SSEWriter
from .convert.anthropic import MessagesStream, to_message
from .convert.boundary import Boundary
from .convert.completions import (
    CompletionChunks,
    Rules,
    check_chat_body,
    render_raw,
    template_kwargs,
    to_chat_completion,
    to_completions_body,
)
from .convert.continuation import Partial, continuation
from .convert.reply import ChatReply, attach_tokens, chat_answer, empty_completion, to_response
from .convert.stream import ChatStream, ResponsesStream
from .convert.tokens import TokenInfo, from_reply, prompt_ids_from_tokenize, tokenize_body
from .errors import (
    AnswerLocally,
    ContextOverflow,
    GymproxyError,
    Unavailable,
    UpstreamError,
    UpstreamStatus,
    describe,
)
from .fleet import Fleet
from .http1 import Aborted, ClientError, Reply, ReplyTooLarge
from .overflow import is_context_overflow, status_error, upstream_message
from .pinning import Signer, cookie_header, minted_shape, new_session_id
from .retry import abort_resend
from .schemas import ENCODER
from .schemas.responses import ResponsesRequest
from .sse import SSEError
from .upstream import Sent, Upstream, read, too_large

if TYPE_CHECKING:
    from .capture import Recording
    from .config import Pinning
    from .proxy import Proxy
    from .rollouts.record import Outcome
    from .templates import ChatTemplate

log = logging.getLogger("gymproxy")

JSON = "application/json"
# Relayed routes whose replies a pause may cut, and so are sent again (`_unless_aborted`).
ABORTABLE = frozenset({"completions", "chat", "responses"})
MAX_SESSION_ID = 256  # longer session keys are sent upstream as a digest

# Upstream troubles after the status line: a stream is ended with its terminal error event.
READ_ERRORS = (
    asyncio.TimeoutError,
    ClientError,
    SSEError,
    msgspec.DecodeError,
    orjson.JSONDecodeError,
    GymproxyError,
)


class Caller:
    """What the route layer knows of one client request: its id, the pin cookie and session key it
    came with, its session's id, and the pin its response must set (the fleet's choice for a new
    session)."""

    __slots__ = (
        "request_id",
        "cookie",
        "key",
        "pin",
        "route",
        "start",
        "min_version",
        "weights",
        "upstream",
        "model",
        "prompt_tokens",
        "completion_tokens",
        "outcome",
        "rollout",
        "recording",
        "hops",
        "_pinning",
        "_signer",
        "_sid",
        "_session",
    )

    def __init__(
        self,
        request_id: str,
        cookie: str | None,
        key: str | None,
        route: str,
        start: float,
        pinning: Pinning,
        signer: Signer,
    ) -> None:
        self.request_id = request_id
        self.cookie = cookie
        self.key = key
        self.pin: str | None = None
        self.route = route  # for metrics
        self.start = start  # time.monotonic() when the request arrived
        self.min_version: str | None = None  # `X-Min-Weight-Version`: held until its engine has it
        self.weights: str | None = None  # `X-Weight-Version`: what sampled the reply, once known
        # For the access line (`logs.access`): where it went, the model asked for, its tokens, and
        # what became of it when not its status alone (overflow, local, failed, client_gone).
        self.upstream: str | None = None
        self.model: str | None = None
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.outcome: str | None = None
        self.rollout: str | None = (
            None  # the rollout id it carries (`capture`); keys the session when nothing else does
        )
        self.recording: Recording | None = None  # its capture, when captured
        self.hops: str | None = None  # the `X-Gymproxy-Hop` it goes upstream with, when it came through gymproxies
        self._pinning = pinning
        self._signer = signer
        self._sid: str | None = None
        self._session: str | None = None

    def cookie_sid(self) -> str:
        """The id the session's pin cookie carries: the client's (if valid and it has one), else a
        new one, which a new pin will carry."""
        if self._sid is None:
            opened = self._signer.unsign(self.cookie) if self.cookie else None
            self._sid = opened[1] if opened is not None and opened[1] else new_session_id()
        return self._sid

    def session_id(self) -> str:
        """The session's id for vLLM (`X-Session-ID`): its key when it has one, else `cookie_sid()`.
        Read it once the route has added the body's keys."""
        if self._session is None:
            key = self.key or self.rollout
            self._session = _header_safe(key) if key else self.cookie_sid()
        return self._session

    def stamp(self, response: web.StreamResponse) -> None:
        """The headers every response carries: the request id, the weight version that sampled it
        (when known), and a new session's pin cookie. Call before the response is prepared."""
        response.headers["X-Request-Id"] = self.request_id
        if self.weights is not None:
            response.headers["X-Weight-Version"] = self.weights
        if self.pin is not None:
            pinning = self._pinning
            response.headers.add("Set-Cookie", cookie_header(pinning.cookie_name, self.pin, pinning.max_age))


def _header_safe(key: str) -> str:
    """A session key as a header value: as it is when printable ASCII and short, else a digest
    (keys from a body, `prompt_cache_key` or `user`, may hold anything, line breaks included).
    A key shaped like an id gymproxy mints goes as a digest too: the ids of cookie sessions are
    gymproxy's alone, so no client can have vLLM attribute its requests to another's session."""
    if len(key) <= MAX_SESSION_ID and key.isascii() and key.isprintable() and not minted_shape(key):
        return key
    return "sha256-" + hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()[:32]


# --- the two sides of an exchange ------------------------------------------------------------------


class Translator(Protocol):
    """A client stream format (`convert.stream`): upstream SSE payloads in, the client's frames out."""

    ended: bool
    usage: Any  # the stream's usage once seen (its last chunk's), for the token metrics

    def start(self) -> bytes: ...
    def payload(self, payload: bytes) -> bytes: ...
    def finish(self, tokens: TokenInfo | None = None) -> bytes: ...
    def fail(self, message: str) -> bytes: ...
    def answer_locally(self, finish_reason: str) -> bytes: ...
    def keep(self) -> None: ...
    def partial(self) -> tuple[str, str, int] | None: ...


class Backend(Protocol):
    """How vLLM is asked, and how its replies become chat form."""

    route: str  # the fleet's route: "chat" or "completions"
    reasoning: bool  # replies may carry vLLM's reasoning fields
    continued: bool  # the request continues the final assistant turn (known once prepared)

    async def prepare(self) -> bytes: ...
    def reply(self, payload: bytes, source: str) -> ChatReply: ...
    def adapter(self) -> Callable[[bytes], bytes] | None: ...
    def tokens(self, reply: ChatReply) -> TokenInfo: ...
    def stream_tokens(self, stream: ResponsesStream) -> TokenInfo: ...
    def tokenize_body(self) -> dict[str, Any]: ...


class Answer(Protocol):
    """How the client is answered, from the upstream's reply in chat form."""

    model: str | None
    shows_tokens: bool  # vLLM's token fields reach the client (a captured call strips what it did not ask for)
    training_tokens: bool  # training mode's token ids (`return_token_id_information`) go into the answer
    # vLLM's error status as this API's error (None: gymproxy's rules, a context overflow answered locally)
    errors: Callable[[int, bytes], GymproxyError] | None

    def whole(self, reply: ChatReply, tokens: TokenInfo | None, *, continued: bool) -> bytes: ...
    def stream(self, *, continued: bool, reasoning: bool) -> Translator: ...


class ChatBackend:
    """vLLM's chat API: the body goes through the boundary rules (spec 6), unless it was made by
    gymproxy's own conversion for vLLM as it is (`boundary` None: Anthropic's Messages); replies are
    chat already. A captured call asks for its tokens (`capture.Recording.ask`)."""

    route = "chat"
    reasoning = True

    def __init__(
        self,
        boundary: Boundary | None,
        body: dict[str, Any],
        *,
        built: bool = False,
        conversation_id: str | None = None,
        recording: Recording | None = None,
    ) -> None:
        self.boundary = boundary
        self.body = body
        self.built = built
        self.conversation_id = conversation_id  # `forward_session_id_as_conversation_id`: the session's id
        self.recording = recording
        self.continued = False

    async def prepare(self) -> bytes:
        if self.boundary is not None:
            self.body = self.boundary.prepare(self.body, built=self.built)
        body = self.body
        self.continued = body.get("continue_final_message") is True
        if self.conversation_id is not None:
            body["conversation_params"] = {"conversation_id": self.conversation_id}
        if self.recording is not None:
            self.recording.ask(body)
        return ENCODER.encode(body)

    def reply(self, payload: bytes, source: str) -> ChatReply:
        return ChatReply(payload, source)

    def adapter(self) -> None:
        return None  # vLLM's chunks are chat chunks

    def tokens(self, reply: ChatReply) -> TokenInfo:
        return from_reply(reply.mapping())

    def stream_tokens(self, stream: ResponsesStream) -> TokenInfo:
        return from_reply(stream.token_reply())

    def tokenize_body(self) -> dict[str, Any]:
        return tokenize_body(self.body)


class CompletionsBackend:
    """vLLM's completions API (`use_completions_api`, spec 10): the chat body is rendered to one prompt,
    and every reply or streamed chunk is wrapped back into chat form."""

    route = "completions"
    reasoning = False
    continued = False

    def __init__(
        self,
        rules: Rules,
        template: ChatTemplate | None,
        warn: Callable[[str], None],
        body: dict[str, Any],
        *,
        stream: bool,
        chat_client: bool,
    ) -> None:
        self.rules = rules
        self.template = template
        self.warn = warn
        self.body = body
        self.stream = stream
        self.chat_client = chat_client  # a chat client gets the usage chunk only if it asked, as from vLLM
        self.completion_body: dict[str, Any] = {}
        self.chunks = CompletionChunks(rules.model)

    async def prepare(self) -> bytes:
        body = self.body
        if self.stream:
            body["stream"] = True
        if check_chat_body(body, rendered=self.rules.render_chat_template):
            self.warn("use_completions_api is true")
        if self.template is None:
            prompt = render_raw(body["messages"])
        else:
            kwargs = template_kwargs(self.rules.chat_template_kwargs, body.get("metadata"))
            # Templates are Jinja run in Python: keep them off the event loop.
            prompt = await asyncio.to_thread(self.template.render, body["messages"], body.get("tools"), kwargs)
        completion_body = self.completion_body = to_completions_body(body, self.rules, prompt)
        if self.chat_client and self.stream:
            if body.get("stream_options") is not None:
                completion_body["stream_options"] = body["stream_options"]
            else:
                completion_body.pop("stream_options", None)
        return ENCODER.encode(completion_body)

    def reply(self, payload: bytes, source: str) -> ChatReply:
        training = self.rules.return_token_id_information
        chat = to_chat_completion(ChatReply(payload, source).mapping(), self.rules.model, training=training)
        return ChatReply(None, source, chat)

    def adapter(self) -> Callable[[bytes], bytes]:
        chunks = self.chunks

        def adapt(payload: bytes) -> bytes:
            return ENCODER.encode(chunks.feed(orjson.loads(payload)))

        return adapt

    def tokens(self, reply: ChatReply) -> TokenInfo:
        return _token_info(reply.mapping()["choices"][0]["message"])

    def stream_tokens(self, stream: ResponsesStream) -> TokenInfo:
        return _token_info(self.chunks.token_fields())

    def tokenize_body(self) -> dict[str, Any]:
        return tokenize_body(self.completion_body)


def _token_info(fields: dict[str, Any]) -> TokenInfo:
    """The completions backend's token fields (already checked) as `TokenInfo`."""
    return TokenInfo(
        prompt_token_ids=fields["prompt_token_ids"],
        generation_token_ids=fields["generation_token_ids"],
        generation_log_probs=fields["generation_log_probs"],
    )


class ChatAnswer:
    """A `/v1/chat/completions` client: vLLM's chat form, reasoning folded into `<think>` (spec 7.1)."""

    shows_tokens = True
    training_tokens = True
    errors: Callable[[int, bytes], GymproxyError] | None = None

    def __init__(self, model: str | None, *, parser: bool) -> None:
        self.model = model
        self.parser = parser

    def whole(self, reply: ChatReply, tokens: TokenInfo | None, *, continued: bool) -> bytes:
        return chat_answer(reply, tokens, parser=self.parser, continued=continued)

    def stream(self, *, continued: bool, reasoning: bool) -> ChatStream:
        return ChatStream(model=self.model, parser=self.parser, continued=continued, reasoning=reasoning)


# A Responses stream keeps its whole output for its last events, which repeat it (about ten copies
# in all): it keeps at most this share of `limits.max_reply_size`, in characters.
KEPT_SHARE = 16


class ResponsesAnswer:
    """A `/v1/responses` client: a Response (spec 8), or its event stream (which keeps at most
    `max_text` characters of output for its last events)."""

    shows_tokens = False
    training_tokens = True
    errors: Callable[[int, bytes], GymproxyError] | None = None

    def __init__(self, req: ResponsesRequest, model: str | None, *, parser: bool, max_text: int | None = None) -> None:
        self.req = req
        self.model = model
        self.parser = parser
        self.max_text = max_text

    def whole(self, reply: ChatReply, tokens: TokenInfo | None, *, continued: bool) -> bytes:
        response = to_response(reply.completion(), self.req, model=self.model, parser=self.parser, continued=continued)
        if tokens is not None:
            attach_tokens(response, tokens)
        return ENCODER.encode(response)

    def stream(self, *, continued: bool, reasoning: bool) -> ResponsesStream:
        return ResponsesStream(
            self.req, model=self.model, parser=self.parser, continued=continued, max_text=self.max_text
        )


class MessagesAnswer:
    """A captured `/v1/messages` client (`convert.anthropic`): vLLM's chat reply answered as vLLM's
    Anthropic endpoint answers, its errors (a context overflow included) in that endpoint's envelope."""

    model: str | None = None
    shows_tokens = False
    training_tokens = False
    errors: Callable[[int, bytes], GymproxyError] | None = staticmethod(messages.upstream_error)

    def whole(self, reply: ChatReply, tokens: TokenInfo | None, *, continued: bool) -> bytes:
        return to_message(reply.completion())

    def stream(self, *, continued: bool, reasoning: bool) -> MessagesStream:
        return MessagesStream()


# --- the exchange ----------------------------------------------------------------------------------


class Exchange:
    """One client request's trip to vLLM and back."""

    __slots__ = ("proxy", "request", "caller", "fleet")

    def __init__(self, proxy: Proxy, request: web.Request, caller: Caller) -> None:
        self.proxy = proxy
        self.request = request
        self.caller = caller
        self.fleet: Fleet = proxy.fleet

    async def serve(self, backend: Backend, answer: Answer, *, stream: bool) -> web.StreamResponse:
        """Answer the client: locally, with the whole reply, or as a stream (and record it, when captured)."""
        caller = self.caller
        try:
            try:
                data = await backend.prepare()
                if stream:
                    return await self._stream(backend, answer, data)
                return await self._whole(backend, answer, data)
            except AnswerLocally as local:
                caller.outcome = "overflow" if isinstance(local, ContextOverflow) else "local"
                return await self._answer_locally(answer, local.finish_reason, stream=stream)
        except BaseException as exc:
            if caller.recording is not None:
                if isinstance(exc, asyncio.CancelledError):
                    caller.recording.end(
                        "cut", upstream=caller.upstream, weight_version=caller.weights, error="the client left"
                    )
                else:
                    error = str(exc) if isinstance(exc, GymproxyError) else type(exc).__name__
                    failed: Outcome = "overflow" if caller.outcome == "overflow" else "error"
                    caller.recording.end(failed, upstream=caller.upstream, weight_version=caller.weights, error=error)
            raise
        finally:
            if caller.recording is not None:
                outcome = caller.outcome
                caller.recording.end(
                    "overflow" if outcome == "overflow" else "cut" if outcome in ("failed", "client_gone") else "ok",
                    upstream=caller.upstream,
                    weight_version=caller.weights,
                )

    async def relay(
        self,
        route: str,
        data: bytes | None,
        *,
        method: str = "POST",
        query: str | None = None,
        headers: Mapping[str, str] | None = None,
        fail: Callable[[GymproxyError], bytes] | None = None,
        streamed: bool = False,
    ) -> web.StreamResponse:
        """Send `data` to the session's upstream and relay its status and body. When the client
        asked for a stream (`streamed`), an event stream is passed on chunk by chunk as it arrives,
        however long; any other reply is read whole first (vLLM sends it whole, at the end), so
        one over the limit reaches the client as a 502 and nothing of it.

        `query` and `headers` go upstream too (see `Fleet.send`). `fail` is the route's last event
        for a stream the upstream broke off: written when the stream is at an event boundary, so
        the client's stream ends in its own protocol; otherwise the connection is dropped."""
        sent = await self._send(route, data, method, query=query, headers=headers)
        try:
            reply = sent.reply
            self.caller.weights = sent.versions()
            if reply.status >= 400:  # read whole (it is small), so one over its limit is still a 502
                return web.Response(status=reply.status, body=await read(reply), content_type=reply.content_type)
            if not streamed or reply.content_type != "text/event-stream":
                payload = await read(reply)  # within `limits.max_reply_size`
                if route in ABORTABLE and reply.content_type == JSON and ABORT in payload:
                    sent, payload = await self._unless_aborted(sent, payload, route, data, method)
                self.caller.weights = sent.versions()
                whole = web.Response(status=sent.reply.status, body=payload, content_type=sent.reply.content_type)
                self.caller.stamp(whole)
                return whole
            response = web.StreamResponse(status=reply.status, headers=SSE_HEADERS)
            self.caller.stamp(response)
            await response.prepare(self.request)
            end = b"\n\n"  # the last bytes relayed: do they end an event?
            try:
                async for chunk in reply.iter_any():
                    await response.write(chunk)
                    end = chunk[-4:] if len(chunk) >= 4 else (end + chunk)[-4:]
            except (asyncio.TimeoutError, ClientError) as exc:
                if fail is not None and end.endswith((b"\n\n", b"\r\n\r\n", b"\r\r")):
                    sent.close()
                    failure = (
                        Unavailable(str(exc))
                        if isinstance(exc, Aborted)
                        else UpstreamError(f"the upstream {sent.upstream.url} failed mid-stream: {describe(exc)}")
                    )
                    try:
                        await response.write(fail(failure))
                        await response.write_eof()
                    except ConnectionError:
                        pass  # the client left as well
                    return response
                # The status line is gone: drop the connection so the client sees a cut body,
                # never a complete-looking one.
                if self.request.transport is not None:
                    self.request.transport.close()
                return response
            await response.write_eof()
            return response
        finally:
            sent.release()

    async def fetch(self, route: str, data: bytes) -> tuple[int, bytes]:
        """A request of gymproxy's own on the way to the client's, sent where that one will go (the
        session's upstream): its status and body."""
        sent = await self._send(route, data)
        try:
            return sent.reply.status, await read(sent.reply)
        finally:
            sent.release()

    # --- the three ways ----------------------------------------------------------------------------

    async def _whole(self, backend: Backend, answer: Answer, data: bytes) -> web.Response:
        sent = await self._send(backend.route, data)
        try:
            reply = sent.reply
            payload = await read(reply)
            if reply.status == 200 and reply.content_type != JSON:
                raise UpstreamError(
                    f"the upstream {sent.upstream.url} answered 200 with {reply.content_type}, not JSON"
                )
        finally:
            sent.release()
        if reply.status != 200:
            self._judge(reply.status, payload, answer)
        if ABORT in payload:
            sent, payload = await self._unless_aborted(sent, payload, backend.route, data, "POST")
        self.caller.weights = weights = sent.versions()
        ended = time.monotonic()
        recording = self.caller.recording
        if recording is not None and backend.route == "chat":
            payload = recording.cut(payload)  # recorded, and without what the client did not ask for
        chat = backend.reply(payload, f"the upstream {sent.upstream.url}")
        if recording is not None and backend.route != "chat":  # the completions backend's, made chat-shaped
            recording.read(chat.mapping())
        tokens = None
        if self.proxy.config.return_token_id_information and answer.training_tokens:
            tokens = await self._tokens(sent.upstream, backend, backend.tokens(chat))
            tokens.weight_version = weights
        body = answer.whole(chat, tokens, continued=backend.continued)
        usage = chat.usage()  # read by the conversion: never parsed for this alone
        if recording is not None:
            recording.usage = usage
        self._count_usage(sent, usage, ended)
        return web.Response(body=body, content_type=JSON)

    async def _stream(self, backend: Backend, answer: Answer, data: bytes) -> web.StreamResponse:
        sent = await self._send(backend.route, data)
        try:
            reply = sent.reply
            if reply.status != 200:
                self._judge(reply.status, await read(reply), answer)
            if reply.content_type != "text/event-stream":
                raise UpstreamError(
                    f"the upstream {sent.upstream.url} answered a streaming request with {reply.content_type}, "
                    "not an event stream"
                )
            translator = answer.stream(continued=backend.continued, reasoning=backend.reasoning)
            recording = self.caller.recording
            if isinstance(translator, ResponsesStream):  # it keeps it all for its last event: a whole reply
                self._limit(reply)
            self.caller.weights = sent.upstream.version  # the headers go first: its version as it starts
            response = await self._prepare_stream()
            async with SSEWriter(response, self._interval, self._first_byte) as writer:
                tail = await self._translate(sent, backend, translator, writer)
                usage = translator.usage
                if recording is not None:
                    recording.tapped()
                    usage = usage if usage is not None else recording.usage  # a usage chunk kept from the client
                    recording.usage = usage
                self._count_usage(sent, usage, time.monotonic())
                if tail is not None:
                    await writer.end(tail)
            return response
        finally:
            sent.release()  # closed unless read to its end: vLLM stops generating

    async def _translate(self, sent: Sent, backend: Backend, translator: Translator, writer: SSEWriter) -> bytes | None:
        """Relay the upstream's stream through `translator`; the tail to end it with (None: the client left).

        With fleet control on, a chat stream a pause cut (`finish_reason: "abort"`) is continued once
        its engine resumes (`convert.continuation`): the new stream's payloads follow in the same
        translator, so the client sees one stream."""
        config = self.proxy.config
        payloads = Payloads(backend.adapter(), config.limits.max_reply_size)
        feed: Callable[[bytes], bytes] = translator.payload
        if self.caller.recording is not None:
            feed = _tapped(self.caller.recording.tap, feed, chat_client=isinstance(translator, ChatStream))
        out: list[bytes] = []
        # A captured stream is not continued: its record holds one generation, as vLLM sampled it.
        watch = (
            self.proxy.control is not None
            and backend.route == "chat"
            and not config.return_token_id_information
            and self.caller.recording is None
        )
        if watch:
            translator.keep()
        current = sent  # the stream being relayed: `sent`, or a continuation of it
        try:
            head = translator.start()
            if head:
                await writer.write(head)
            while True:
                if not watch:
                    async for data in current.reply.iter_any():
                        for payload in payloads.feed(data):
                            out.append(feed(payload))
                        if out:
                            frames = out[0] if len(out) == 1 else b"".join(out)
                            out.clear()
                            await writer.write(frames)
                    break
                cut = await relay_watching(current.reply, payloads, feed, out, writer)
                if cut is None:
                    break
                following = await self._continuation(current, backend, translator, cut)
                if following is None:  # it ends as vLLM ended it, saying it was aborted
                    out += [feed(payload) for payload in (cut.payload, *cut.rest)]
                    break
                if cut.text is not None:
                    out.append(feed(cut.text))
                if current is not sent:
                    current.release()
                current = following
                payloads = Payloads(backend.adapter(), config.limits.max_reply_size)
            if not (payloads.done or translator.ended):
                raise UpstreamError("the stream ended without [DONE]")
            tokens = None
            if config.return_token_id_information and isinstance(translator, ResponsesStream):
                tokens = await self._tokens(current.upstream, backend, backend.stream_tokens(translator))
                tokens.weight_version = sent.versions()
            return b"".join(out) + translator.finish(tokens)
        except ClientGone:
            current.close()
            self.caller.outcome = "client_gone"
            return None
        except Aborted as exc:  # the shutdown's grace is over
            failure = str(exc)
        except ReplyTooLarge as exc:
            failure = too_large(current.reply, exc).message
        except SSEError:
            limit = config.limits.max_reply_size
            failure = f"the upstream {current.upstream.url} sent an event over {limit} bytes (limits.max_reply_size)"
        except READ_ERRORS as exc:
            failure = f"the upstream {current.upstream.url} failed mid-stream: {describe(exc)}"
        except Exception:  # a bug in gymproxy: the stream still ends with its terminal event
            log.exception("unhandled error while relaying a stream")
            failure = "internal error in gymproxy (see its log)"
        finally:
            if current is not sent:
                current.release()
        current.close()
        self.caller.outcome = "failed"
        # The frames of this read made before the failure go first: their sequence numbers are taken.
        return b"".join(out) + translator.fail(failure)

    async def _continuation(self, cut_off: Sent, backend: Backend, translator: Translator, cut: Cut) -> Sent | None:
        """The stream that continues one a pause cut, once its engine resumes; None when it is not
        continued (see `convert.continuation`), or the engine was not paused (the trainer's
        /abort_requests)."""
        text = translator.partial()
        body = getattr(backend, "body", None)
        if text is None or not isinstance(body, dict):
            return None
        content, reasoning, deltas = text
        # vLLM streams about one token a delta (a few hold two): its usage, when asked for, is exact.
        following = continuation(body, Partial(content, reasoning, cut.tokens() or deltas))
        if following is None:
            return None
        data = ENCODER.encode(following)
        until = asyncio.get_running_loop().time() + self.proxy.config.hold.timeout_s
        if not await self._resumed_after_abort(cut_off.upstream, until, len(data)):
            return None
        self.fleet.retries["abort"] += 1
        sent = await self._send(backend.route, data)
        if sent.reply.status != 200 or sent.reply.content_type != "text/event-stream":
            sent.close()
            raise UpstreamError(
                f"the upstream {sent.upstream.url} answered {sent.reply.status} to the continuation of a stream "
                "a weight-update pause cut"
            )
        return sent

    async def _resumed_after_abort(self, upstream: Upstream, until: float, size: int) -> bool:
        """After a reply a pause cut: whether to send it again (once the pause is over). While the
        fleet is paused the next send waits for it; else only if its engine says it is paused,
        waiting for it to resume. An abort while nothing is paused was asked for (/abort_requests)."""
        fleet = self.fleet
        if fleet.holds.paused:
            return True
        if not await fleet.engines.paused(upstream):
            return False
        await fleet.engines.resumed(upstream, until, size)
        return True

    async def _answer_locally(self, answer: Answer, finish_reason: str, *, stream: bool) -> web.StreamResponse:
        if not stream:
            reply = ChatReply(None, "gymproxy", empty_completion(answer.model, finish_reason))
            return web.Response(body=answer.whole(reply, None, continued=False), content_type=JSON)
        translator = answer.stream(continued=False, reasoning=False)
        response = await self._prepare_stream()
        async with SSEWriter(response, self._interval, self._first_byte) as writer:
            await writer.end(translator.answer_locally(finish_reason))
        return response

    # --- plumbing ----------------------------------------------------------------------------------

    async def _send(
        self,
        route: str,
        data: bytes | None,
        method: str = "POST",
        *,
        query: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Sent:
        caller = self.caller
        sent = await self.fleet.send(
            route,
            data,
            method=method,
            cookie=caller.cookie,
            key=caller.key or caller.rollout,
            sid=caller.cookie_sid(),
            session_id=caller.session_id(),
            request_id=caller.request_id,
            query=query,
            headers=headers,
            min_version=caller.min_version,
            hops=caller.hops,
        )
        if sent.pin is not None:
            caller.pin = sent.pin
        caller.upstream = sent.upstream.name
        return sent

    async def _unless_aborted(
        self, sent: Sent, payload: bytes, route: str, data: bytes | None, method: str
    ) -> tuple[Sent, bytes]:
        """A whole reply that a pause cut (`finish_reason: "abort"`) is sent again from the start
        once its engine resumes (`retry.abort_resend`); the client sees only the last reply. A reply
        aborted while neither the fleet nor its engine is paused (the trainer's /abort_requests) is
        the client's answer. Called when `ABORT` is in `payload`."""
        fleet = self.fleet
        loop = asyncio.get_running_loop()
        until = loop.time() + self.proxy.config.hold.timeout_s
        resends = 0
        while aborted(payload) and abort_resend(resends, loop.time(), until):
            if not await self._resumed_after_abort(sent.upstream, until, len(data or b"")):
                break
            resends += 1
            fleet.retries["abort"] += 1
            sent.release()
            sent = await self._send(route, data, method)
            try:
                payload = await read(sent.reply)
            finally:
                sent.release()
            if sent.reply.status != 200 or ABORT not in payload:
                break
        return sent, payload

    def _limit(self, reply: Reply) -> None:
        """Hold `reply` to `limits.max_reply_size` (a 502 now if its Content-Length is over)."""
        try:
            reply.limit(self.proxy.config.limits.max_reply_size)
        except ReplyTooLarge as exc:
            raise too_large(reply, exc) from exc

    def _count_usage(self, sent: Sent, usage: Any, ended: float) -> None:
        """Prompt tokens, and those vLLM served from its prefix cache (`--enable-prompt-tokens-details`);
        the reply's time per generated token (it ended at `ended`) feeds the upstream's pace; and
        the reply's time at its upstream, usage or not."""
        metrics = self.proxy.metrics
        metrics.upstream_duration.observe(sent.upstream.name, ended - sent.started)
        if usage is None:
            return
        if isinstance(usage, dict):
            prompt, details = usage.get("prompt_tokens"), usage.get("prompt_tokens_details")
            cached = details.get("cached_tokens") if isinstance(details, dict) else None
            generated = usage.get("completion_tokens")
        else:  # a decoded `Usage`
            prompt, details = usage.prompt_tokens, usage.prompt_tokens_details
            cached = details.cached_tokens if details is not None else None
            generated = usage.completion_tokens
        upstream = sent.upstream
        if type(generated) is int and generated > 0:
            upstream.meter.observe(ended - sent.started, generated)
            metrics.completion_tokens[upstream.name] += generated
            self.caller.completion_tokens = generated
        if type(prompt) is int and prompt > 0:
            self.caller.prompt_tokens = prompt
            metrics.prompt_tokens[upstream.name] += prompt
        if type(cached) is int and cached > 0:
            metrics.cached_prompt_tokens[upstream.name] += cached

    def _judge(self, status: int, payload: bytes, answer: Answer) -> NoReturn:
        """An upstream error status: a context overflow answers locally (or is vLLM's own 400 when
        propagating, or in the answer's own error form); any other error is raised with the
        upstream's status and message (in the answer's own error form, when it has one)."""
        if is_context_overflow(status, payload):
            self.proxy.metrics.overflows += 1
            if answer.errors is None and not self.proxy.config.propagate_context_overflow_errors:
                raise ContextOverflow
            self.caller.outcome = "overflow"
            if answer.errors is None:
                raise UpstreamStatus(status, upstream_message(payload), raw=payload)
        if answer.errors is not None:
            raise answer.errors(status, payload)
        raise status_error(status, payload)

    async def _tokens(self, upstream: Upstream, backend: Backend, info: TokenInfo) -> TokenInfo:
        """Training mode: the prompt ids from the same upstream's /tokenize when the reply had none."""
        if info.prompt_token_ids is None:
            data = ENCODER.encode(backend.tokenize_body())
            caller = self.caller
            status, payload = await self.fleet.call(
                upstream,
                "tokenize",
                data,
                request_id=caller.request_id,
                session_id=caller.session_id(),
                hops=caller.hops,
            )
            if status != 200:
                raise UpstreamError(f"the upstream's /tokenize answered {status}: {upstream_message(payload)}")
            info.prompt_token_ids = prompt_ids_from_tokenize(
                ChatReply(payload, f"the upstream {upstream.url}").mapping()
            )
        return info

    async def _prepare_stream(self) -> web.StreamResponse:
        response = web.StreamResponse(headers=SSE_HEADERS)
        self.caller.stamp(response)  # headers go out with prepare(): the cookie must be on them
        await response.prepare(self.request)
        return response

    @property
    def _interval(self) -> float:
        return self.proxy.config.stream_keepalive_s

    def _first_byte(self) -> None:
        self.proxy.metrics.ttfb.observe(self.caller.route, time.monotonic() - self.caller.start)


def _tapped(
    tap: Callable[[bytes], bytes | None], feed: Callable[[bytes], bytes], *, chat_client: bool
) -> Callable[[bytes], bytes]:
    """`feed` behind capture's tap (`capture.Recording.tap`): each payload's token fields recorded,
    and those the client did not ask for taken out; a chat client's unasked usage chunk dropped."""

    def tapped(payload: bytes) -> bytes:
        kept = tap(payload)
        if kept is None:
            if chat_client:
                return b""
            kept = payload
        return feed(kept)

    return tapped
