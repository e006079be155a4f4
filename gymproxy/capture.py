"""Rollout capture on the request path: which calls are recorded, what vLLM is asked for, and what
the client still sees.

A call is captured when `capture.enabled` and it carries a rollout id: NeMo Gym's path prefix
`/ng-rollout/<id>/` (also `.../training-token-capture/`), the `X-Rollout-ID` header, or with
`capture.key: session` its session key. Its route calls `Capture.begin` before anything goes
upstream: a frozen rollout is a 409; a store that is not taking writes is counted as not recorded,
or, with `capture.required`, a 503. The `Recording` it returns then:

- `ask(body)` asks vLLM's chat API for the exact tokens (`return_token_ids`, and `logprobs` with
  `top_logprobs: 0` unless the client asked for log probs itself), remembering what the client did
  not ask for;
- `cut(payload)` takes them from a whole chat reply and sets what the client did not ask for back
  to the nulls vLLM sends then; `tap(payload)` does the same for each payload of a stream, and
  `tapped()` records what the stream carried. Both find vLLM's token fields in its compact JSON as
  bytes, and the record keeps them as that JSON: on the request path they are never parsed (a
  reply written otherwise is, and `read`/`strip` do it on the mapping);
- `end(...)` queues the call's record: upstream, weight version, outcome, finish reason, usage
  and tokens. Writes never wait (`rollouts.store`).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterable
from typing import Any, Final

import msgspec
import orjson

from .config import Capture as CaptureConfig
from .errors import BadRequest, Conflict, Unavailable
from .ids import hex32
from .metrics import TTFB_BUCKETS, Histogram, label
from .rollouts.record import Call, LogProb, Outcome
from .rollouts.store import Bounds, Stats, Store, open_store

log = logging.getLogger("gymproxy")

ROLLOUT_HEADER: Final = "X-Rollout-ID"
ROLLOUT_ID: Final = re.compile(r"[A-Za-z0-9._:@+=\-]{1,200}")


# vLLM's token fields as its compact JSON writes them (`Recording.cut`, `Recording.tap`).
_PROMPT_IDS: Final = b'"prompt_token_ids":['
_TOKEN_IDS: Final = b'"token_ids":['
_LOGPROBS: Final = b'"logprobs":{'
_FINISH_REASON: Final = b'"finish_reason":"'
# A choice's log probs end where its finish reason begins: no key of a JSON object can be matched
# inside one of its strings, whose quotes are escaped.
_AFTER_LOGPROBS: Final = b',"finish_reason":'
# A token field with a value the client did not ask for (vLLM sends `null` when not asked).
_SHOWN: Final = re.compile(rb'"(?:prompt_token_ids|token_ids)"\s*:\s*\[|"logprobs"\s*:\s*\{')


class _LogProbs(msgspec.Struct):
    content: list[LogProb] | None = None


_LOGPROBS_VIEW: Final = msgspec.json.Decoder(_LogProbs)


def rollout_id(value: str, where: str) -> str:
    """A rollout id as given, or a 400 naming where it came from."""
    if ROLLOUT_ID.fullmatch(value) is None:
        raise BadRequest(
            f"the rollout id in {where} must be 1 to 200 characters of A-Z a-z 0-9 . _ : @ + = -", param=where
        )
    return value


class Capture:
    """One gymproxy's capture: its store and what it counts."""

    def __init__(self, config: CaptureConfig, store: Store | None = None) -> None:
        self.config = config
        bounds = Bounds(max_age_s=config.max_age_s, max_bytes=config.max_bytes, max_pending=config.max_pending)
        self.store = store if store is not None else open_store(config.store, bounds)
        self.stats: Stats = self.store.stats
        self.not_recorded = 0  # calls served without their record (the store did not take it)
        self.calls: dict[str, int] = {}  # calls ended, by outcome

        self._batches = Histogram(TTFB_BUCKETS)

    async def start(self) -> None:
        await self.store.start()

    def batches(self) -> tuple[Histogram, str, str, str]:
        """The store's batch write times, for /metrics (what it measured since the last scrape is folded in)."""
        seconds = self.stats.batch_seconds
        for value in seconds:
            self._batches.observe("", value)
        seconds.clear()
        return (
            self._batches,
            "gymproxy_capture_batch_seconds",
            "Time to write one batch of records to the rollout store.",
            "store",
        )

    def gauges(self) -> Iterable[tuple[str, str, str, Callable[[], Iterable[tuple[str, float]]]]]:
        """Capture's series for /metrics."""
        stats = self.stats
        yield (
            "gymproxy_capture_calls_total",
            "counter",
            "Captured model calls ended, by outcome (ok, error, cut, overflow).",
            lambda: [(label(outcome=k), v) for k, v in sorted(self.calls.items())],
        )
        yield (
            "gymproxy_capture_records_total",
            "counter",
            "Call records written to the rollout store (a call's start and its end).",
            lambda: [("", stats.recorded)],
        )
        yield (
            "gymproxy_capture_bytes_total",
            "counter",
            "Bytes of call records written to the rollout store.",
            lambda: [("", stats.bytes)],
        )
        yield (
            "gymproxy_capture_not_recorded_total",
            "counter",
            "Call records lost, by why: not_taken (the store's queue was full or it was down), failed (a write failed), dropped (refused by the store).",
            lambda: [
                (label(reason="not_taken"), self.not_recorded),
                (label(reason="failed"), stats.failed),
                (label(reason="dropped"), stats.dropped),
            ],
        )
        yield (
            "gymproxy_capture_refused_total",
            "counter",
            "Calls refused with a 409 because their rollout was frozen.",
            lambda: [("", stats.refused)],
        )
        yield (
            "gymproxy_capture_evicted_total",
            "counter",
            "Records evicted by capture.max_age_s and capture.max_bytes, by kind (rollouts, calls).",
            lambda: [(label(kind="rollouts"), stats.evicted_rollouts), (label(kind="calls"), stats.evicted_calls)],
        )
        yield (
            "gymproxy_capture_rollouts",
            "gauge",
            "Rollouts in the store, by state (as the store last counted them).",
            lambda: [(label(state="open"), stats.open), (label(state="frozen"), stats.frozen)],
        )

    async def close(self) -> None:
        await self.store.close()

    async def begin(
        self, rollout: str, route: str, *, stream: bool, session_key: str | None = None
    ) -> Recording | None:
        """The recording of one call of `rollout`; raises the 409 of a frozen rollout, and with
        `capture.required` the 503 of a store that is not taking writes."""
        store = self.store
        if not await store.admit(rollout):
            raise Conflict(
                f"rollout {rollout} is frozen (POST /v1/rollouts/{rollout}/freeze): it takes no more calls; "
                "start a new rollout id",
                param="rollout_id",
            )
        if self.config.required and not store.available():
            raise Unavailable(
                "the rollout store is not taking writes, and capture.required refuses a call it cannot record"
            )
        call = Call(rollout_id=rollout, call_id=hex32(), route=route, stream=stream, started=time.time())
        recording = Recording(self, call)
        if not store.begin(call):
            self.not_recorded += 1
            recording.lost = True
        return recording


class Recording:
    """One captured call, from its request to its record."""

    __slots__ = (
        "capture",
        "call",
        "strip_ids",
        "strip_logprobs",
        "strip_usage",
        "lost",
        "usage",
        "_prompt",
        "_generated",
        "_entries",
    )

    def __init__(self, capture: Capture, call: Call) -> None:
        self.capture = capture
        self.call = call
        self.strip_ids = False  # the client did not ask for `return_token_ids`
        self.strip_logprobs = False  # nor for `logprobs`
        self.strip_usage = False  # nor, streamed, for the usage chunk
        self.lost = False  # the start record was not taken
        self.usage: Any = None  # vLLM's usage, as the exchange read it
        self._prompt: bytes | None = None  # a stream's token fields as `tap` meets them, as JSON
        self._generated = bytearray()  # the generated ids, comma-separated
        self._entries = bytearray()  # their `logprobs.content` entries (or log probs), comma-separated

    def ask(self, body: dict[str, Any]) -> None:
        """Ask vLLM's chat API for the tokens, in the body about to be sent."""
        if body.get("return_token_ids") is not True:
            body["return_token_ids"] = True
            self.strip_ids = True
        if body.get("logprobs") is not True:
            body["logprobs"] = True
            body["top_logprobs"] = 0
            self.strip_logprobs = True
        options = body.get("stream_options")
        if body.get("stream") is True and not (isinstance(options, dict) and options.get("include_usage") is True):
            body["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
            self.strip_usage = True
        if self.capture.config.record_requests:
            request = {"messages": body.get("messages")}
            if body.get("tools") is not None:
                request["tools"] = body["tools"]
            self.call.request = request

    # --- a whole reply ------------------------------------------------------------------------------

    def cut(self, payload: bytes) -> bytes:
        """A whole chat reply: its first choice's tokens and finish reason recorded, and what the
        client did not ask for set back to the nulls vLLM sends then; the reply for the client.

        vLLM writes compact JSON, so the token fields are found as bytes and never parsed here: the
        record keeps them as the JSON vLLM sent. A reply written otherwise is parsed (`read`, `strip`)."""
        call = self.call
        nulled: list[tuple[int, int]] = []
        at = 0  # each choice's fields are looked for after the last one's, so each byte is read once
        while (fields := _choice(payload, at)) is not None:
            logprobs, generated = fields
            if at == 0:
                if logprobs is not None:
                    call.generation_log_probs = _content(payload[logprobs[0] : logprobs[1]])
                    call.finish_reason = _reason(payload, logprobs[1]) or call.finish_reason
                if generated is not None:
                    call.generation_token_ids = msgspec.Raw(payload[generated[0] : generated[1]])
            if logprobs is not None and self.strip_logprobs:
                nulled.append(logprobs)
            if generated is not None and self.strip_ids:
                nulled.append(generated)
            at = max(span[1] for span in fields if span is not None)
        prompt = _array(payload, _PROMPT_IDS, at) or (_array(payload, _PROMPT_IDS) if at else None)
        if prompt is not None:
            call.prompt_token_ids = msgspec.Raw(payload[prompt[0] : prompt[1]])
            if self.strip_ids:
                nulled.append(prompt)
        if call.finish_reason is None:
            call.finish_reason = _string(payload, _FINISH_REASON)
        if nulled:
            return _nulled(payload, nulled)
        if self._shows(payload):  # token fields, but not as vLLM writes them: parsed
            reply = orjson.loads(payload)
            if not isinstance(reply, dict):
                return payload  # not a chat reply: the exchange says so
            self.read(reply)
            self.strip(reply)
            return orjson.dumps(reply)
        return payload

    def read(self, reply: dict[str, Any]) -> None:
        """The tokens and finish reason of a chat reply as a mapping (the completions backend's, or
        one not written as vLLM writes it)."""
        call = self.call
        call.prompt_token_ids = _ints(reply.get("prompt_token_ids"))
        choice = _first_choice(reply)
        if choice is None:
            return
        call.generation_token_ids = _ints(choice.get("token_ids"))
        logprobs = choice.get("logprobs")
        content = logprobs.get("content") if isinstance(logprobs, dict) else None
        call.generation_log_probs = _log_probs(content)
        reason = choice.get("finish_reason")
        if isinstance(reason, str):
            call.finish_reason = reason

    def strip(self, reply: dict[str, Any]) -> None:
        """What the client did not ask for, back to the nulls vLLM sends when not asked."""
        if self.strip_ids and "prompt_token_ids" in reply:
            reply["prompt_token_ids"] = None
        for choice in reply.get("choices") or ():
            if isinstance(choice, dict):
                if self.strip_ids and "token_ids" in choice:
                    choice["token_ids"] = None
                if self.strip_logprobs and "logprobs" in choice:
                    choice["logprobs"] = None

    # --- a stream -----------------------------------------------------------------------------------

    def tap(self, payload: bytes) -> bytes | None:
        """One chat stream payload: its token fields kept, and stripped from what the client gets
        (None: the payload is not the client's: the usage chunk it did not ask for)."""
        # Most payloads are one generated token's, as vLLM writes it: `..."logprobs":{"content":[ENTRY]},
        # "finish_reason":...,"token_ids":[ID]}]}`; three partitions take it apart.
        head, found, rest = payload.partition(b'"logprobs":{"content":[')
        if found:
            entries, found, tail = rest.partition(b']},"finish_reason":')
            between, found_ids, ids_rest = tail.partition(b'"token_ids":[')
            ids, found_end, after = ids_rest.partition(b"]")
            alone = b'"prompt_token_ids"' not in head and b'token_ids":[' not in after and b'"logprobs":{' not in after
            if found and found_ids and found_end and alone:  # one choice's, and nothing else to take out
                _join(self._entries, entries)
                _join(self._generated, ids)
                if between.startswith(b'"'):
                    self.call.finish_reason = between[1 : between.find(b'"', 1)].decode("utf-8", "replace")
                if self.strip_logprobs:
                    head, entries = head + b'"logprobs":null,"finish_reason":', b""
                else:
                    head, entries = head + found, entries + b']},"finish_reason":'
                if self.strip_ids:
                    return b"".join((head, entries, between, b'"token_ids":null', after))
                return b"".join((head, entries, between, b'"token_ids":[', ids, b"]", after))
        nulled: list[Span] = []
        at = 0  # each choice's fields after the last one's; the first choice's are recorded
        while (fields := _choice(payload, at)) is not None:
            logprobs, generated = fields
            if logprobs is not None:
                content = payload[logprobs[0] : logprobs[1]]
                if not (content.startswith(b'{"content":[') and content.endswith(b"]}")):
                    return self._tap_parsed(payload)
                if at == 0:
                    _join(self._entries, content[12:-2])
                    self.call.finish_reason = _reason(payload, logprobs[1]) or self.call.finish_reason
                if self.strip_logprobs:
                    nulled.append(logprobs)
            if generated is not None:
                if at == 0:
                    _join(self._generated, payload[generated[0] + 1 : generated[1] - 1])
                if self.strip_ids:
                    nulled.append(generated)
            at = max(span[1] for span in fields if span is not None)
        if self._prompt is None and (prompt := _array(payload, _PROMPT_IDS)) is not None:
            self._prompt = payload[prompt[0] : prompt[1]]
            if self.strip_ids:
                nulled.append(prompt)
        if nulled:
            return _nulled(payload, nulled)
        if at:
            return payload
        if b'"usage"' in payload and b'"usage":null' not in payload:  # the usage chunk (or continuous stats)
            chunk = orjson.loads(payload)
            if isinstance(chunk, dict) and chunk.get("usage") is not None:
                self.usage = chunk["usage"]
                if not chunk.get("choices"):
                    return None if self.strip_usage else payload
        if self.call.finish_reason is None and b'"finish_reason":"' in payload:
            self.call.finish_reason = _string(payload, _FINISH_REASON)
        # Not one of vLLM's payloads with tokens, as it writes them: parsed if token fields show.
        return self._tap_parsed(payload) if self._shows(payload) else payload

    def tapped(self) -> None:
        """What `tap` kept, into the record (the stream has ended)."""
        call = self.call
        if self._prompt is not None:
            call.prompt_token_ids = msgspec.Raw(self._prompt)
        call.generation_token_ids = msgspec.Raw(b"[" + self._generated + b"]")
        call.generation_log_probs = msgspec.Raw(b"[" + self._entries + b"]")

    def _tap_parsed(self, payload: bytes) -> bytes:
        """`tap` for a payload not written as vLLM writes it: parsed."""
        chunk = orjson.loads(payload)
        if not isinstance(chunk, dict):
            return payload
        ids = _ints(chunk.get("prompt_token_ids"))
        if ids is not None:
            self._prompt = orjson.dumps(ids)
        choice = _first_choice(chunk)
        if choice is not None:
            ids = _ints(choice.get("token_ids"))
            if ids:
                _join(self._generated, orjson.dumps(ids)[1:-1])
            logprobs = choice.get("logprobs")
            values = _log_probs(logprobs.get("content") if isinstance(logprobs, dict) else None)
            if values:
                _join(self._entries, orjson.dumps(values)[1:-1])
            reason = choice.get("finish_reason")
            if isinstance(reason, str):
                self.call.finish_reason = reason
        self.strip(chunk)
        return orjson.dumps(chunk)

    def _shows(self, payload: bytes) -> bool:
        """Whether token fields the client did not ask for are still in `payload`."""
        return (self.strip_ids or self.strip_logprobs) and _SHOWN.search(payload) is not None

    def end(
        self,
        outcome: Outcome,
        *,
        upstream: str | None,
        weight_version: str | None,
        error: str | None = None,
    ) -> None:
        """Queue the call's record (once)."""
        call = self.call
        if call.ended is not None:
            return
        call.ended = time.time()
        if outcome == "ok" and call.finish_reason == "abort":
            outcome = "cut"  # a pause cut it and it was not sent again
        call.outcome = outcome
        call.upstream = upstream
        call.weight_version = weight_version
        call.error = error
        usage = self.usage
        if usage is not None:
            call.usage = usage if isinstance(usage, dict) else msgspec.to_builtins(usage)
        capture = self.capture
        capture.calls[outcome] = capture.calls.get(outcome, 0) + 1
        if not capture.store.end(call) and not self.lost:
            capture.not_recorded += 1


def _first_choice(reply: dict[str, Any]) -> dict[str, Any] | None:
    choices = reply.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        choice: dict[str, Any] = choices[0]
        return choice
    return None


def _ints(value: Any) -> list[int] | None:
    """A list of token ids as vLLM sent it; anything else is not recorded."""
    if isinstance(value, list) and all(type(item) is int for item in value):
        return value
    return None


def _log_probs(content: Any) -> list[float | LogProb] | None:
    """Each generated token's log prob from `logprobs.content` (vLLM's floats; -9999.0 as it sends
    for -inf)."""
    if not isinstance(content, list):
        return None
    values: list[float | LogProb] = []
    for entry in content:
        logprob = entry.get("logprob") if isinstance(entry, dict) else None
        if not isinstance(logprob, float | int) or isinstance(logprob, bool):
            return None
        values.append(float(logprob))
    return values


def _array(payload: bytes, key: bytes, start: int = 0) -> Span | None:
    """The span of the array of numbers that `key` (ending in `[`) opens, brackets included."""
    at = payload.find(key, start)
    if at < 0:
        return None
    begin = at + len(key) - 1
    end = payload.find(b"]", begin)
    return None if end < 0 else (begin, end + 1)


def _object(payload: bytes, key: bytes, start: int = 0) -> Span | None:
    """The span of a choice's `logprobs` object (`key` ends in `{`), up to its finish reason."""
    at = payload.find(key, start)
    if at < 0:
        return None
    end = payload.find(_AFTER_LOGPROBS, at)
    return None if end < 0 else (at + len(key) - 1, end)


Span = tuple[int, int]


def _choice(payload: bytes, start: int) -> tuple[Span | None, Span | None] | None:
    """The spans of the next choice's `logprobs` object and `token_ids` array from `start` (vLLM
    writes `token_ids` after `logprobs`); None when there is neither."""
    logprobs = _object(payload, _LOGPROBS, start)
    generated = _array(payload, _TOKEN_IDS, logprobs[1] if logprobs is not None else start)
    if logprobs is None and generated is None:
        return None
    return logprobs, generated


def _reason(payload: bytes, end: int) -> str | None:
    """The finish reason that follows a choice's `logprobs` object ending at `end`, when it is a string."""
    begin = end + len(_AFTER_LOGPROBS)
    if payload[begin : begin + 1] != b'"':
        return None
    return payload[begin + 1 : payload.find(b'"', begin + 1)].decode("utf-8", "replace")


def _string(payload: bytes, key: bytes) -> str | None:
    """The first value of `key` (ending in `"`), when it is a plain string."""
    at = payload.find(key)
    if at < 0:
        return None
    begin = at + len(key)
    end = payload.find(b'"', begin)
    return None if end < 0 else payload[begin:end].decode("utf-8", "replace")


def _nulled(payload: bytes, spans: list[Span]) -> bytes:
    """`payload` with each of `spans` (in order, not overlapping) replaced by `null`."""
    pieces, done = [], 0
    for begin, end in sorted(spans):
        pieces += [payload[done:begin], b"null"]
        done = end
    pieces.append(payload[done:])
    return b"".join(pieces)


def _content(logprobs: bytes) -> msgspec.Raw | list[float | LogProb] | None:
    """A whole reply's `logprobs` object as vLLM wrote it: its `content` entries, kept as JSON (read
    back as numbers: `rollouts.record.decode_call`); parsed when written otherwise."""
    if logprobs.startswith(b'{"content":[') and logprobs.endswith(b"]}"):
        return msgspec.Raw(logprobs[11:-1])
    try:
        content = _LOGPROBS_VIEW.decode(logprobs).content
    except msgspec.DecodeError:
        return None
    values: list[float | LogProb] | None = None if content is None else [entry.logprob for entry in content]
    return values


def _join(kept: bytearray, items: bytes) -> None:
    """Comma-separated JSON items, added to those kept so far."""
    if items:
        if kept:
            kept += b","
        kept += items
