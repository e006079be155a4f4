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
- `read(reply)` takes them from a whole chat reply (or a stream's `token_reply()`), `strip(reply)`
  sets what the client did not ask for back to the nulls vLLM sends then, and `tap(payload)` does
  both for each chunk of a chat stream;
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
from .rollouts.record import Call, Outcome
from .rollouts.store import Bounds, Stats, Store, open_store

log = logging.getLogger("gymproxy")

ROLLOUT_HEADER: Final = "X-Rollout-ID"
ROLLOUT_ID: Final = re.compile(r"[A-Za-z0-9._:@+=\-]{1,200}")


# The token fields of a whole chat reply, decoded straight from its bytes (the rest is skipped).
class _LogProb(msgspec.Struct):
    logprob: Any = None


class _LogProbs(msgspec.Struct):
    content: list[_LogProb] | None = None


class _Choice(msgspec.Struct):
    token_ids: Any = None
    logprobs: _LogProbs | None = None
    finish_reason: Any = None


class _Tokens(msgspec.Struct):
    prompt_token_ids: Any = None
    choices: list[_Choice] = []
    usage: Any = None


_TOKENS: Final = msgspec.json.Decoder(_Tokens)
# A token field with a value the client did not ask for (vLLM sends `null` when not asked).
_SHOWN: Final = re.compile(rb'"(?:prompt_token_ids|token_ids)"\s*:\s*\[|"logprobs"\s*:\s*\{')


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
        "_logprobs",
    )

    def __init__(self, capture: Capture, call: Call) -> None:
        self.capture = capture
        self.call = call
        self.strip_ids = False  # the client did not ask for `return_token_ids`
        self.strip_logprobs = False  # nor for `logprobs`
        self.strip_usage = False  # nor, streamed, for the usage chunk
        self.lost = False  # the start record was not taken
        self.usage: Any = None  # vLLM's usage, as the exchange read it
        self._prompt: Any = None  # a chat stream's token fields, as `tap` meets them
        self._generated: list[int] = []
        self._logprobs: list[Any] = []

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

    def read(self, reply: dict[str, Any]) -> None:
        """The tokens and finish reason of a chat reply (or of a stream's `token_reply()`)."""
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

    def read_payload(self, payload: bytes) -> None:
        """The tokens, finish reason and usage of a whole chat reply, from its bytes."""
        try:
            view = _TOKENS.decode(payload)
        except msgspec.DecodeError:
            return  # not the shape vLLM sends: the exchange's own checks say so
        call = self.call
        call.prompt_token_ids = _ints(view.prompt_token_ids)
        self.usage = view.usage
        if not view.choices:
            return
        choice = view.choices[0]
        call.generation_token_ids = _ints(choice.token_ids)
        if choice.logprobs is not None and choice.logprobs.content is not None:
            values = [entry.logprob for entry in choice.logprobs.content]
            call.generation_log_probs = (
                values if all(isinstance(v, float | int) and not isinstance(v, bool) for v in values) else None
            )
        if isinstance(choice.finish_reason, str):
            call.finish_reason = choice.finish_reason

    def shown(self, payload: bytes) -> bool:
        """Whether a reply carries token fields the client did not ask for (`strip` them)."""
        return (self.strip_ids or self.strip_logprobs) and _SHOWN.search(payload) is not None

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

    def tap(self, payload: bytes) -> bytes | None:
        """One chat stream payload: its token fields kept, and stripped from what the client gets
        (None: the payload is not the client's: the usage chunk it did not ask for)."""
        if b"token_ids" not in payload and b'"logprobs"' not in payload and b'"usage"' not in payload:
            return payload
        chunk = orjson.loads(payload)
        if not isinstance(chunk, dict):
            return payload
        usage = chunk.get("usage")
        if usage is not None:
            self.usage = usage
            if self.strip_usage and not chunk.get("choices"):
                return None
        prompt = chunk.get("prompt_token_ids")
        if prompt is not None:
            self._prompt = prompt
        choice = _first_choice(chunk)
        if choice is not None:
            ids = choice.get("token_ids")
            if isinstance(ids, list):
                self._generated.extend(ids)
            logprobs = choice.get("logprobs")
            content = logprobs.get("content") if isinstance(logprobs, dict) else None
            if isinstance(content, list):
                self._logprobs.extend(content)
            reason = choice.get("finish_reason")
            if isinstance(reason, str):
                self.call.finish_reason = reason
        if not (self.strip_ids or self.strip_logprobs):
            return payload
        self.strip(chunk)
        return orjson.dumps(chunk)

    def tapped(self) -> dict[str, Any]:
        """What `tap` kept, shaped as a whole reply for `read`."""
        choice = {"token_ids": self._generated, "logprobs": {"content": self._logprobs}}
        if self.call.finish_reason is not None:
            choice["finish_reason"] = self.call.finish_reason
        return {"prompt_token_ids": self._prompt, "choices": [choice]}

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


def _log_probs(content: Any) -> list[float] | None:
    """Each generated token's log prob from `logprobs.content` (vLLM's floats; -9999.0 as it sends
    for -inf)."""
    if not isinstance(content, list):
        return None
    values: list[float] = []
    for entry in content:
        logprob = entry.get("logprob") if isinstance(entry, dict) else None
        if not isinstance(logprob, float | int) or isinstance(logprob, bool):
            return None
        values.append(float(logprob))
    return values
