"""A fake vLLM OpenAI-compatible server: the test-suite's upstream and the demo upstream of `gymproxy serve`.

It speaks vLLM 0.32's wire format (spec/wire-facts.md §0, A.1-A.7): chat and text completions,
streamed or not, token ids and logprobs, `/tokenize`, `/v1/models`, `/health` and vLLM's error
envelopes. Each generation request pops one queued `Script`. With the queue empty, the reply comes
from the request: `"echo: <last user text>"`, or a call to the first function tool when tools are
offered and the user spoke last. Directives in the last user text force a case: `[[overflow]]`
(the context-length 400), `[[reason]]` (adds reasoning), `[[error:<status>]]` (that status, in
vLLM's error envelope) and `[[no-call]]` (text, even when tools are offered).

`[[call:<name> <JSON arguments>]]`, e.g. `[[call:exec_command {"cmd": "echo hi"}]]`, drives an agent
harness through one tool round trip: while the user spoke last, the reply calls the tool `<name>`
with those arguments (offered or not, so a test can see how a harness treats an unknown tool); once
tool results follow the last assistant turn, it answers `"tool said: <their text>"`, so a test can
check that the harness really ran the call and sent its output back. System and developer messages
after the user's do not count as a turn (agent harnesses append notes there).

It also speaks vLLM's Anthropic Messages endpoint (`vllm/entrypoints/anthropic`): `POST /v1/messages`
and `/v1/messages/count_tokens`. A Messages request is first made into the chat request vLLM makes
of it (`chat_from_messages`: `system`, as a string or text blocks, and `role: "system"` messages
become one system message; tools become function tools; `tool_use` blocks tool calls; `tool_result`
blocks tool messages), so scripts, replies from the request and directives work as for chat. A
user message's tool results go after its own text (vLLM puts them before): a turn that answers a
tool call, with or without text beside the results, counts as a tool result, and the reply to it is
text. The answer is vLLM's: a `message` object (thinking, text and `tool_use` blocks, `stop_reason`,
usage), or the events `message_start`, `content_block_start` / `_delta` (`thinking_delta` and its
`signature_delta`, `text_delta`, `input_json_delta`) / `_stop`, `message_delta` (stop reason and
usage) and `message_stop`, each framed `event: <type>` + `data: <json>`; errors from generation come
in the Anthropic envelope `{"type": "error", "error": {"type", "message"}}` with vLLM's type names
(`BadRequestError`, ...), a mid-stream failure as an `error` event; a body that fails validation gets
vLLM's OpenAI-style 400, as FastAPI's handler answers it. `count_tokens` answers `{"input_tokens": N}`
(and `context_management`) with N the chat prompt's token count.

Generation runs on a scheduler, as vLLM's engine does (`Scheduler`): a reply makes its tokens one
`chunk_delay` apart, streamed or not, so a test can have it in flight (`await fake.scheduler.generating()`)
when a pause comes. With dev mode on (`FakeVLLM(dev_mode=True)`, or VLLM_SERVER_DEV_MODE=1 in the
environment of `run`, `start` and `python -m gymproxy.testing.fake_vllm`, as vLLM mounts them) it serves
vLLM's RL and dev routes (`vllm/entrypoints/rl/online/api_router.py`, `serve/dev/`), with their bodies
and their refusals (FastAPI's validation errors through vLLM's 400 handler); without, they are 404:
- `POST /pause?mode=abort|wait|keep&clear_cache=`: `abort` (the default) ends every generation at once,
  200 with the tokens so far and `finish_reason: "abort"` (streamed: a finish chunk saying so, then the
  usage chunk if asked and `[DONE]`; one cut before its first token gets no finish chunk, as vLLM skips
  its empty output; Messages has no stop reason for it), and answers once they have ended; `wait`
  answers once the generations in flight have finished; `keep` freezes them (no chunk until
  `POST /resume`). New requests while paused are queued until `/resume`, as vLLM 0.32 does; with
  `paused_503` (`--paused-503`, FAKE_VLLM_PAUSED_503=1) those in an abort or wait pause get 503
  "Generation is paused. Please retry after it resumes.", as 0.33 does. `GET /is_paused`.
- `POST /update_weight_version {"new_version"}`, `POST /finish_weight_update {"weight_version"?}` set the
  version `GET /weight_info` reports (null at first) and `fake.weight_version` holds; every generation
  records the versions the engine had while it made its tokens, in `fake.sampled_versions` by
  X-Request-Id (else the reply's id). No reply carries them: vLLM 0.32's do not.
- `/abort_requests {request_ids?}` cuts those generations (all by default) without pausing; `/sleep`
  pauses (in its `mode`) and `/wake_up` resumes; the weight transfer routes, `/weight_checker`,
  `/reset_prefix_cache`, `/reset_mm_cache`, `/is_sleeping` and `/collective_rpc` answer what vLLM does.

The tokenizer is crude but deterministic: one token per word, counting the whitespace before it,
with id = crc32(piece) mod 50000. Every id the fake reports (prompt ids, `/tokenize`, generated ids
and logprob tokens) comes from that one function, so they all agree. Its chat template renders an
assistant message in history as its reply was generated, so token ids stay consistent across the
turns of a conversation, as a real template's do; `fake.returned` logs the ids of every chat reply.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import collections
import functools
import itertools
import json
import os
import re
import socket
import struct
import time
import uuid
import zlib
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, Final, NamedTuple

import msgspec
import orjson
from aiohttp import web

Json = dict[str, Any]
ControlHandler = Callable[[web.Request, bytes], Awaitable[Json | web.StreamResponse]]
Frames = tuple[list[bytes], list[bytes], list[bytes]]  # head, body (cut by fail_mid_stream), tail

VLLM_STREAM_HEADERS: Final = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
DONE: Final = b"data: [DONE]\n\n"
VOCAB_SIZE: Final = 50_000
POLL_SECONDS: Final = 0.02
FROZEN_POLL_S: Final = 0.25  # how often a frozen or queued generation looks whether its client left
GENERATION_PATHS: Final = ("/v1/chat/completions", "/v1/completions", "/v1/messages")
FAILURE_MODES: Final = ("reset", "truncate", "bad_json", "error")
# The demo fake (`gymproxy serve` with no upstream, `gymproxy fake-vllm`) takes what real agent
# harnesses send: long system prompts, and Claude Code's `max_tokens: 32000`.
DEMO_MAX_MODEL_LEN: Final = 131_072
COMPLETIONS_MAX_TOKENS: Final = 16  # vLLM's default for /v1/completions; chat has none
MID_STREAM_ERROR: Final = "fake vLLM: injected mid-stream error"
ANTHROPIC_STOP: Final = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
BILLING_HEADER: Final = "x-anthropic-billing-header"  # Claude Code's per-request system block; vLLM drops it

PAUSE_MODES: Final = ("abort", "wait", "keep")
PAUSED_MESSAGE: Final = "Generation is paused. Please retry after it resumes."  # vLLM >= 0.33, in abort and wait
DEV_MODE_ENV: Final = "VLLM_SERVER_DEV_MODE"  # vLLM mounts its RL and dev routes only with it set (to a nonzero int)
PAUSED_503_ENV: Final = "FAKE_VLLM_PAUSED_503"  # 1: answer new requests 503 in abort and wait pauses, as 0.33 does
CHECKERS: Final = ("checksum", "reset", "compare")

_PIECE: Final = re.compile(r"\s*\S+(?:\s+\Z)?|\s+")  # trailing whitespace joins the last word
_ERROR_DIRECTIVE: Final = re.compile(r"\[\[error:(\d{3})\]\]")
_CALL_DIRECTIVE: Final = re.compile(r"\[\[call:(?P<name>[^\s\]]+)(?:\s+(?P<arguments>\{.*?\}))?\]\]", re.DOTALL)
_NOTES: Final = ("system", "developer")  # roles that do not take a turn in the conversation


class Script(msgspec.Struct, kw_only=True):
    """One scripted upstream reply; unset fields fall back to a reply derived from the request.

    `chunk_delay` also delays a non-streamed reply, by the delay times the number of deltas, and
    `choice_extra`/`top_extra` land on the finish chunk of a stream.
    """

    content: str | None = None
    reasoning: str | None = None
    reasoning_key: str = "reasoning"
    tool_calls: list[dict[str, Any]] | None = None
    finish_reason: str | None = None
    status: int = 200
    error_message: str | None = None
    error_body: bytes | None = None
    usage: dict[str, Any] | None = None
    chunk_delay: float = 0.0
    pieces: int | None = None
    message_extra: dict[str, Any] | None = None
    choice_extra: dict[str, Any] | None = None
    top_extra: dict[str, Any] | None = None
    fail_mid_stream: str | None = None
    hang: bool = False


class SeenRequest(msgspec.Struct):
    """A request as the fake received it."""

    path: str
    headers: dict[str, str]
    body: bytes
    json: Any
    query: str = ""  # the raw (still encoded) query string


class Rejection(Exception):
    """A request refused before generation: plain JSON, even when a stream was asked for."""

    def __init__(self, status: int, message: str, *, kind: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind or _error_kind(status)
        self.body = error_body(status, message, kind=kind, param=param)

    def response(self) -> web.Response:
        return _json_response(self.body, status=self.status)


def error_body(status: int, message: str, *, kind: str | None = None, param: str | None = None) -> bytes:
    """vLLM's nested error envelope (>= 0.10.1)."""
    kind = kind or _error_kind(status)
    return orjson.dumps({"error": {"message": message, "type": kind, "param": param, "code": status}})


def _error_kind(status: int) -> str:
    named = {404: "NotFoundError", 501: "NotImplementedError"}
    return named.get(status, "BadRequestError" if status < 500 else "InternalServerError")


def pieces(text: str) -> list[str]:
    """Split `text` into tokens; joining them gives `text` back."""
    return _PIECE.findall(text)


def token_id(piece: str) -> int:
    """The fake vocabulary: a stable id for any piece."""
    return zlib.crc32(piece.encode()) % VOCAB_SIZE


def chat_prompt_pieces(messages: list[Any]) -> list[str]:
    """The prompt tokens of a chat request: the tokens of every message's text, in order. An assistant
    message is rendered as its reply was generated (reasoning, content, then each tool call's name and
    arguments), so a conversation's next prompt begins with the last prompt and the ids generated."""
    return [p for m in messages if isinstance(m, dict) for p in _message_pieces(m)]


def _message_pieces(message: Json) -> list[str]:
    toks = []
    for key in ("reasoning", "reasoning_content"):
        if isinstance(message.get(key), str):
            toks += pieces(message[key])
    toks += pieces(_text(message.get("content")))
    calls = message.get("tool_calls") if message.get("role") == "assistant" else None
    for call in calls if isinstance(calls, list) else ():
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            arguments = function.get("arguments")
            toks += [function["name"], *pieces(arguments if isinstance(arguments, str) else "")]
    return toks


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text") or "" for part in content if isinstance(part, dict))
    return ""


def _logprob(tid: int) -> float:
    return -((tid % 997) + 1) / 1000


def _json_response(body: bytes, status: int = 200) -> web.Response:
    return web.Response(body=body, status=status, content_type="application/json")


def _split(text: str, parts: int | None) -> list[tuple[str, list[str]]]:
    """Cut `text` into deltas, each with the tokens that end inside it (by default one token each)."""
    toks = pieces(text)
    if parts is None or not text:
        return [(tok, [tok]) for tok in toks]
    parts = max(1, min(parts, len(text)))
    bounds = [len(text) * i // parts for i in range(parts + 1)]
    owned: list[list[str]] = [[] for _ in range(parts)]
    end = 0
    for tok in toks:
        end += len(tok)
        owned[bisect.bisect_right(bounds, end - 1) - 1].append(tok)
    return [(text[a:b], own) for a, b, own in zip(bounds[:-1], bounds[1:], owned, strict=True)]


def _fit(script: Script, budget: int) -> Script:
    """Cut reasoning, then content, to `budget` tokens; tool calls survive only in whole replies."""
    reasoning, content = pieces(script.reasoning or ""), pieces(script.content or "")
    calls = script.tool_calls or []
    if len(reasoning) + len(content) + sum(1 + len(pieces(c["arguments"])) for c in calls) <= budget:
        return script
    return msgspec.structs.replace(
        script,
        reasoning=None if script.reasoning is None else "".join(reasoning[:budget]),
        content=None if script.content is None else "".join(content[: max(0, budget - len(reasoning))]),
        tool_calls=None,
        finish_reason="length",
    )


class _Step(NamedTuple):
    delta: Json  # a chat delta; a text completion streams its "content"
    tokens: list[str]


def _chat_steps(script: Script) -> list[_Step]:
    steps = [
        _Step({key: part}, toks)
        for key, text in ((script.reasoning_key, script.reasoning), ("content", script.content))
        for part, toks in _split(text or "", script.pieces)
    ]
    for index, call in enumerate(script.tool_calls or []):
        first, *rest = pieces(call["arguments"]) or [""]
        function = {"name": call["name"], "arguments": first}
        head = {"index": index, "id": call["id"], "type": "function", "function": function}
        steps.append(_Step({"tool_calls": [head]}, [call["name"], first] if first else [call["name"]]))
        for frag in rest:
            steps.append(_Step({"tool_calls": [{"index": index, "function": {"arguments": frag}}]}, [frag]))
    return steps


class _Turn(NamedTuple):
    """One generation: what the request asked for, and the resolved reply."""

    id: str
    created: int
    model: str
    prompt_ids: list[int]
    script: Script  # content filled in, tool call ids set, cut to the token budget
    steps: list[_Step]
    return_ids: bool
    logprobs: bool
    as_ids: bool
    top: int
    include_usage: bool
    continuous_usage: bool = False  # `stream_options.continuous_usage_stats`: usage on every chunk

    def tokens(self) -> list[str]:
        return [tok for step in self.steps for tok in step.tokens]

    def ids(self, toks: list[str]) -> list[int] | None:
        return [token_id(tok) for tok in toks] if self.return_ids else None

    def prompt_token_ids(self) -> list[int] | None:
        return self.prompt_ids if self.return_ids else None

    def usage(self, *, stream: bool) -> Json:
        if self.script.usage is not None:
            return self.script.usage
        n, m = len(self.prompt_ids), len(self.tokens())
        usage: Json = {"prompt_tokens": n, "total_tokens": n + m, "completion_tokens": m}
        # vLLM dumps the stream's usage chunk with exclude_none, so the null field goes there.
        return usage if stream else {**usage, "prompt_tokens_details": None}

    def token_name(self, tok: str) -> str:
        return f"token_id:{token_id(tok)}" if self.as_ids else tok

    def chat_logprobs(self, toks: list[str]) -> Json | None:
        if not self.logprobs:
            return None
        entries = [dict(token=self.token_name(t), logprob=_logprob(token_id(t)), bytes=list(t.encode())) for t in toks]
        return {"content": [dict(e, top_logprobs=[e] if self.top else []) for e in entries]}

    def text_logprobs(self, toks: list[str], offset: int) -> Json | None:
        if not self.logprobs:
            return None
        return dict(
            text_offset=list(itertools.accumulate([offset, *map(len, toks)]))[:-1],
            token_logprobs=[_logprob(token_id(tok)) for tok in toks],
            tokens=[self.token_name(tok) for tok in toks],
            top_logprobs=[{self.token_name(tok): _logprob(token_id(tok))} for tok in toks],
        )

    def envelope(self, obj: str, **fields: Any) -> Json:
        return dict(id=self.id, object=obj, created=self.created, model=self.model, **fields)


def _cut(t: _Turn, done: int) -> _Turn:
    """The turn as an abort leaves it: its first `done` steps, `finish_reason: "abort"`.

    A tool call cut midway is dropped (its tokens stay in the token ids): its arguments are no JSON yet.
    """
    steps = t.steps[:done]
    s = t.script

    def text(key: str, whole: str | None) -> str | None:
        return None if whole is None else "".join(step.delta[key] for step in steps if key in step.delta)

    def calls(step: _Step) -> list[int]:
        return [call["index"] for call in step.delta.get("tool_calls", ())]

    made = collections.Counter(i for step in steps for i in calls(step))
    wanted = collections.Counter(i for step in t.steps for i in calls(step))
    whole = [call for i, call in enumerate(s.tool_calls or []) if made[i] == wanted[i]]
    script = msgspec.structs.replace(
        s, content=text("content", s.content), reasoning=text(s.reasoning_key, s.reasoning),
        tool_calls=whole or None, finish_reason="abort",
    )  # fmt: skip
    return t._replace(script=script, steps=steps)


def _chat_body(t: _Turn) -> Json:
    s, toks = t.script, t.tokens()
    calls = [
        dict(id=c["id"], type="function", function=dict(name=c["name"], arguments=c["arguments"]))
        for c in s.tool_calls or []
    ]
    message: Json = dict(role="assistant", content=s.content, refusal=None, annotations=None, audio=None)
    message.update(function_call=None, tool_calls=calls, **{s.reasoning_key: s.reasoning})
    message.update(s.message_extra or {})  # extras may replace any field
    choice = dict(index=0, message=message, logprobs=t.chat_logprobs(toks), finish_reason=s.finish_reason)
    choice.update(stop_reason=None, token_ids=t.ids(toks))
    choice.update(s.choice_extra or {})
    body = t.envelope(
        "chat.completion", choices=[choice], service_tier=None, system_fingerprint=None,
        usage=t.usage(stream=False), prompt_logprobs=None, prompt_token_ids=t.prompt_token_ids(),
        kv_transfer_params=None,
    )  # fmt: skip
    body.update(s.top_extra or {})
    return body


def _text_body(t: _Turn) -> Json:
    s, toks = t.script, t.tokens()
    choice = dict(index=0, text=s.content or "", logprobs=t.text_logprobs(toks, 0), finish_reason=s.finish_reason)
    choice.update(stop_reason=None, token_ids=t.ids(toks), prompt_logprobs=None)
    choice.update(prompt_token_ids=t.prompt_token_ids())
    choice.update(s.choice_extra or {})
    body = t.envelope(
        "text_completion", choices=[choice], service_tier=None, system_fingerprint=None,
        usage=t.usage(stream=False), kv_transfer_params=None,
    )  # fmt: skip
    body.update(s.top_extra or {})
    return body


def _frame(obj: Json) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _frames(t: _Turn, obj: str, head: list[bytes], choices: list[Json], finish: Json, **base: Any) -> Frames:
    """Frame the delta choices; vLLM puts `length` on the last delta, but a stop (EOS) in a chunk of its own.

    A request aborted before its first token gets no finish chunk at all: vLLM skips its empty output
    (the "chunked prefill" case), so the stream ends with the usage chunk and `[DONE]`.
    """
    body: list[bytes] = []
    if choices or t.script.finish_reason != "abort":
        if t.script.finish_reason != "length" or not choices:
            choices.append(finish)
        choices[-1].update(finish_reason=t.script.finish_reason, stop_reason=None, **(t.script.choice_extra or {}))
        body = [_frame(t.envelope(obj, choices=[c], **base)) for c in choices[:-1]]
        body.append(_frame(t.envelope(obj, choices=choices[-1:], **base, **(t.script.top_extra or {}))))
    usage = [_frame(t.envelope(obj, choices=[], usage=t.usage(stream=True)))] if t.include_usage else []
    return head, body, [*usage, DONE]


def _chat_frames(t: _Turn) -> Frames:
    role = dict(index=0, delta={"role": "assistant", "content": ""}, logprobs=None, finish_reason=None)
    first = t.envelope("chat.completion.chunk", choices=[role], prompt_token_ids=t.prompt_token_ids())
    choices = [
        dict(index=0, delta=s.delta, logprobs=t.chat_logprobs(s.tokens), finish_reason=None, token_ids=t.ids(s.tokens))
        for s in t.steps
    ]
    finish = dict(index=0, delta={}, logprobs=t.chat_logprobs([]), finish_reason=None, token_ids=t.ids([]))
    head, body, tail = _frames(t, "chat.completion.chunk", [], choices, finish)
    if not t.continuous_usage:
        return [_frame(first)], body, tail
    # Each chunk carries the usage so far (vLLM adds it after framing: the frames are made again).
    n, made = len(t.prompt_ids), 0
    framed = []
    for i, frame in enumerate(body):  # the steps' chunks, then the finish chunk
        chunk = orjson.loads(frame[6:])
        made += len(t.steps[i].tokens) if i < len(t.steps) else 0
        chunk["usage"] = {"prompt_tokens": n, "total_tokens": n + made, "completion_tokens": made}
        framed.append(_frame(chunk))
    first["usage"] = {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0}
    return [_frame(first)], framed, tail


def _text_frames(t: _Turn) -> Frames:
    choices, offset = [], 0
    for s in [*t.steps, _Step({}, [])]:  # the last one is the EOS chunk, used for a stop
        text = s.delta.get("content", "")
        choices.append(dict(index=0, text=text, logprobs=t.text_logprobs(s.tokens, offset), finish_reason=None))
        choices[-1].update(stop_reason=None, prompt_token_ids=None, token_ids=t.ids(s.tokens))
        offset += len(text)
    choices[0]["prompt_token_ids"] = t.prompt_token_ids()
    return _frames(t, "text_completion", [], choices[:-1], choices[-1], usage=None)


# --- vLLM's Anthropic Messages endpoint ------------------------------------------------------------


def chat_from_messages(body: Json) -> Json:
    """The chat request vLLM 0.32's Anthropic endpoint makes of a Messages request (its reply rules
    apply to it), for a chat template that takes system messages anywhere (so inline ones stay in place)."""
    system = _system_text(body.get("system"))
    messages: list[Json] = [{"role": "system", "content": system}] if system else []
    for message in body["messages"]:
        role, content = message["role"], message["content"]
        if role == "system":
            if text := _system_text(content, strip=True):
                messages.append({"role": "system", "content": text})
        elif isinstance(content, str):
            messages.append({"role": role, "content": content})
        else:
            messages += _chat_turn(role, content)
    chat: Json = {"model": body["model"], "messages": messages}
    if "max_tokens" in body:
        chat["max_tokens"] = body["max_tokens"]
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    if body.get("stream"):
        chat["stream"] = True
    tools = [
        {"type": "function", "function": {"name": t.get("name"), "description": t.get("description"),
                                          "parameters": t.get("input_schema") or {"type": "object"},
                                          "strict": t.get("strict"), "defer_loading": t.get("defer_loading")}}
        for t in body.get("tools") or []
    ]  # fmt: skip
    choice = body.get("tool_choice") or {}
    if choice.get("type") == "tool":
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    elif choice.get("type") in ("auto", "any", "none"):
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice["type"]]
    if tools:
        chat["tools"] = tools
        chat.setdefault("tool_choice", "auto")
    return chat


def _system_text(system: Any, *, strip: bool = False) -> str:
    """The text of `system` (the top-level one, or an inline message's `strip`ped of the billing header)."""
    if isinstance(system, str):
        return "" if strip and system.startswith(BILLING_HEADER) else system
    blocks = system if isinstance(system, list) else []
    return "".join(
        b["text"]
        for b in blocks
        if b.get("type") == "text" and b.get("text") and not b["text"].startswith(BILLING_HEADER)
    )


def _chat_turn(role: str, blocks: list[Json]) -> list[Json]:
    """One Messages turn made of content blocks, as chat messages: its tool results, then the turn."""
    parts: list[Json] = []
    calls: list[Json] = []
    thinking: list[str] = []
    results: list[Json] = []
    for block in blocks:
        kind = block.get("type")
        if kind == "text" and block.get("text"):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and isinstance(block.get("source"), dict):
            source = block["source"]
            url = source.get("url") or f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"
            parts.append({"type": "image_url", "image_url": {"url": url}})
        elif kind == "thinking" and block.get("thinking") is not None:
            thinking.append(block["thinking"])
        elif kind == "tool_use":
            arguments = json.dumps(block.get("input") or {})  # vLLM's: Python's spacing
            function = {"name": block.get("name") or "", "arguments": arguments}
            calls.append(
                {"id": block.get("id") or f"call_{int(time.time())}", "type": "function", "function": function}
            )
        elif kind == "tool_result" and role == "user":
            content = block.get("content")
            items = content if isinstance(content, list) else []
            texts = [i.get("text", "") for i in items if isinstance(i, dict) and i.get("type") == "text"]
            text = content if isinstance(content, str) else "\n".join(texts)
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id") or "", "content": text})
        elif kind == "tool_result":
            parts.append({"type": "text", "text": f"Tool result: {block.get('content') or ''}"})
    turn: Json = {"role": role}
    if thinking:
        turn["reasoning"] = "".join(thinking)
    if calls:
        turn["tool_calls"] = calls
    if parts:
        turn["content"] = parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text" else parts
    keep = "content" in turn if role == "user" else True
    return results + ([turn] if keep else [])


def _check_messages(body: Json, *, count: bool) -> None:
    """What vLLM's pydantic model refuses (FastAPI answers it with vLLM's OpenAI-style 400)."""
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise Rejection(400, "model: Field required", kind="Bad Request", param="model")
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise Rejection(400, "messages: Field required", kind="Bad Request", param="messages")
    for i, message in enumerate(messages):
        ok = isinstance(message, dict) and message.get("role") in ("user", "assistant", "system")
        content = message.get("content") if ok else None
        if not (isinstance(content, str) or (isinstance(content, list) and all(isinstance(b, dict) for b in content))):
            raise Rejection(400, f"messages.{i}: Input should be a valid message", kind="Bad Request")
    max_tokens = body.get("max_tokens")
    if not count and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens <= 0):
        raise Rejection(400, "max_tokens: Field required (a positive integer)", kind="Bad Request", param="max_tokens")


def anthropic_error(status: int, message: str, kind: str | None = None) -> bytes:
    """vLLM's Anthropic error envelope (`translate_error_response`): its own error type names."""
    return orjson.dumps({"type": "error", "error": {"type": kind or _error_kind(status), "message": message}})


def _event(kind: str, **fields: Any) -> bytes:
    return b"event: %s\ndata: %s\n\n" % (kind.encode(), orjson.dumps({"type": kind, **fields}))


def _anthropic_usage(t: _Turn, *, start: bool = False) -> Json:
    usage = t.usage(stream=True)
    output = 0 if start else usage.get("completion_tokens", 0)
    return {"input_tokens": usage.get("prompt_tokens", 0), "output_tokens": output}


def _stop_reason(finish_reason: str | None, *, tool_used: bool) -> str | None:
    """vLLM 0.32's `_to_anthropic_stop_reason` (scripts match no stop string): an abort has none."""
    if finish_reason in ("stop", "tool_calls"):
        return "tool_use" if tool_used or finish_reason == "tool_calls" else "end_turn"
    return ANTHROPIC_STOP.get(finish_reason or "")


def _message_body(t: _Turn) -> Json:
    s = t.script
    content: list[Json] = []
    if s.reasoning:
        content.append({"type": "thinking", "thinking": s.reasoning, "signature": uuid.uuid4().hex})
    if s.content:
        content.append({"type": "text", "text": s.content})
    for call in s.tool_calls or []:
        content.append(
            {"type": "tool_use", "id": call["id"], "name": call["name"], "input": json.loads(call["arguments"])}
        )
    message: Json = dict(id=t.id, type="message", role="assistant", content=content or [{"type": "text", "text": ""}])
    message["model"] = t.model
    if (stop := _stop_reason(s.finish_reason, tool_used=bool(s.tool_calls))) is not None:
        message["stop_reason"] = stop  # vLLM dumps with exclude_none: an unmapped reason is absent
    message["usage"] = _anthropic_usage(t)
    return message


def _message_frames(t: _Turn) -> Frames:
    """The turn as vLLM's Anthropic event stream: one frame (of one or more events) per chat chunk."""
    start: Json = dict(id=t.id, type="message", role="assistant", content=[], model=t.model)
    start.update(stop_reason=None, stop_sequence=None, usage=_anthropic_usage(t, start=True))
    head = [_event("message_start", message=start)]
    body: list[bytes] = []
    index = -1
    active: str | None = None  # "thinking", "text" or a tool call's id

    def stop() -> list[bytes]:
        nonlocal active
        if active is None:
            return []
        events = []
        if active == "thinking":
            events.append(
                _event(
                    "content_block_delta", delta={"type": "signature_delta", "signature": uuid.uuid4().hex}, index=index
                )
            )
        events.append(_event("content_block_stop", index=index))
        active = None
        return events

    def begin(kind: str, block: Json) -> list[bytes]:
        nonlocal active, index
        events = stop()
        index += 1
        active = kind
        return [*events, _event("content_block_start", content_block=block, index=index)]

    for step in t.steps:
        delta, events = step.delta, []
        if "tool_calls" in delta:
            call = delta["tool_calls"][0]
            if "id" in call:
                events += begin(
                    call["id"], {"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": {}}
                )
            if call["function"].get("arguments"):
                json_delta = {"type": "input_json_delta", "partial_json": call["function"]["arguments"]}
                events.append(_event("content_block_delta", delta=json_delta, index=index))
        elif "content" in delta:
            if active != "text":
                events += begin("text", {"type": "text", "text": ""})
            events.append(
                _event("content_block_delta", delta={"type": "text_delta", "text": delta["content"]}, index=index)
            )
        else:  # reasoning, under either of its keys
            (thought,) = delta.values()
            if active != "thinking":
                events += begin("thinking", {"type": "thinking", "thinking": ""})
            events.append(
                _event("content_block_delta", delta={"type": "thinking_delta", "thinking": thought}, index=index)
            )
        body.append(b"".join(events))
    end = {"stop_reason": _stop_reason(t.script.finish_reason or "stop", tool_used=bool(t.script.tool_calls))}
    end["stop_sequence"] = None
    tail = [b"".join([*stop(), _event("message_delta", delta=end, usage=_anthropic_usage(t))]), _event("message_stop")]
    return head, body, tail


async def _not_found(request: web.Request) -> web.Response:
    """A dev route without dev mode: FastAPI's 404."""
    return _json_response(b'{"detail":"Not Found"}', status=404)


def _gone(request: web.Request) -> bool:
    return request.transport is None or request.transport.is_closing()


def _reset(request: web.Request) -> None:
    """Drop the connection with a TCP RST rather than a FIN."""
    if (transport := request.transport) is None:
        return
    if (sock := transport.get_extra_info("socket")) is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def _call_directive(script: Script, match: re.Match[str], messages: list[Any]) -> Script:
    """`[[call:<name> <arguments>]]`: the call while the user spoke last; after tool results, their text."""
    arguments = match["arguments"] or "{}"
    try:
        orjson.loads(arguments)
    except orjson.JSONDecodeError as exc:
        raise Rejection(400, f"fake vLLM: the arguments of {match[0]!r} are not JSON: {exc}") from exc
    turns = _turns(messages)
    results: list[str] = []
    for message in reversed(turns):
        if message.get("role") != "tool":
            break
        results.insert(0, _text(message.get("content")))
    if results:
        script.content = "tool said: " + "\n".join(results)
    elif turns and turns[-1].get("role") == "user":
        script.tool_calls = [{"name": match["name"], "arguments": arguments}]
    return script


# --- How vLLM's FastAPI routes refuse a bad query or body ----------------------------------------------


def _turns(messages: list[Any]) -> list[Json]:
    """The conversation's turns: system and developer notes left out, and so is a user message that
    follows tool results with no assistant turn between (the text a Messages turn sends beside its
    tool results, which vLLM puts after them): that turn answers the tool call."""
    turns: list[Json] = []
    for message in messages:
        if not isinstance(message, dict) or message.get("role") in _NOTES:
            continue
        if message.get("role") == "user" and turns and turns[-1].get("role") == "tool":
            continue
        turns.append(message)
    return turns


def _invalid(errors: list[Json]) -> Rejection:
    """vLLM's 400 for a request that fails FastAPI's validation (`validation_exception_handler`)."""
    label = "error" if len(errors) == 1 else "errors"
    message = f"{len(errors)} validation {label}:\n" + "".join(f"  {error}\n" for error in errors)
    return Rejection(400, message.rstrip(), kind="Bad Request", param=errors[0]["loc"])


def _failed(kind: str, loc: str, msg: str, value: Any, **ctx: Any) -> Json:
    """One pydantic error as vLLM prints it: the input stood in for by a bounded string."""
    if isinstance(value, str):
        shown = value if len(value) <= 200 else value[:200] + "...[truncated]"
    elif isinstance(value, list | dict):
        shown = f"<{type(value).__name__} of {len(value)} items>"
    else:
        shown = str(value)
    return {"type": kind, "loc": loc, "msg": msg, "input": shown, **({"ctx": ctx} if ctx else {})}


def _one_of(errors: list[Json], loc: str, value: Any, options: tuple[str, ...], default: str | None) -> str | None:
    """A `Literal[...]` parameter."""
    if value is None or value in options:
        return default if value is None else str(value)
    expected = ", ".join(map(repr, options[:-1])) + f" or {options[-1]!r}"
    errors.append(_failed("literal_error", loc, f"Input should be {expected}", value, expected=expected))
    return default


def _flag(errors: list[Json], loc: str, value: str | None, default: bool) -> bool:
    """A `bool` query parameter, as pydantic reads one from a string."""
    if value is None:
        return default
    if value.lower() in ("1", "on", "t", "true", "y", "yes"):
        return True
    if value.lower() not in ("0", "off", "f", "false", "n", "no"):
        errors.append(_failed("bool_parsing", loc, "Input should be a valid boolean, unable to interpret input", value))
    return False


def _level(errors: list[Json], value: str | None) -> int:
    """`/sleep`'s `level: Annotated[int, Query(ge=0, le=2)] = 1`."""
    if value is None:
        return 1
    try:
        level = int(value.strip())
    except ValueError:
        errors.append(
            _failed("int_parsing", "query.level", "Input should be a valid integer, unable to parse string as an integer", value)
        )  # fmt: skip
        return 1
    if level < 0:
        errors.append(
            _failed("greater_than_equal", "query.level", "Input should be greater than or equal to 0", value, ge=0)
        )
    elif level > 2:
        errors.append(_failed("less_than_equal", "query.level", "Input should be less than or equal to 2", value, le=2))
    return level


def _embedded(raw: bytes) -> Json:
    """The body FastAPI reads `Body(embed=True)` fields from: {} for none, or for JSON that is no object."""
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        ctx = {"error": exc.msg}
        raise _invalid([_failed("json_invalid", f"body.{exc.pos}", "JSON decode error", {}, **ctx)]) from exc
    except ValueError as exc:  # not UTF-8
        raise Rejection(400, "There was an error parsing the body", kind="Bad Request") from exc
    return value if isinstance(value, dict) else {}


def _text_field(errors: list[Json], body: Json, name: str, *, required: bool) -> str | None:
    value = body.get(name)
    if value is None:  # FastAPI takes a null for a missing field
        if required:
            errors.append(_failed("missing", f"body.{name}", "Field required", None))
        return None
    if not isinstance(value, str):
        errors.append(_failed("string_type", f"body.{name}", "Input should be a valid string", value))
        return None
    return value


def _object_field(errors: list[Json], body: Json, name: str, *, lists: bool = False) -> None:
    """A required `dict[str, Any]` field (`lists`: or a list of them, as `update_info` may be)."""
    value = body.get(name)
    if value is None:
        errors.append(_failed("missing", f"body.{name}", "Field required", None))
    elif not isinstance(value, dict) and not (lists and isinstance(value, list)):
        errors.append(_failed("dict_type", f"body.{name}", "Input should be a valid dictionary", value))


def _object_body(raw: bytes) -> Json:
    """The body of the routes that read `await raw_request.json()` themselves."""
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise Rejection(400, f"JSON decode error: {exc}", kind="Bad Request") from exc
    if not isinstance(body, dict):
        raise Rejection(400, "Request body must be a JSON object", kind="Bad Request")
    return body


def _last(request: web.Request, name: str) -> str | None:
    """A query parameter as Starlette reads it: the last of its values."""
    values = request.query.getall(name, [])
    return values[-1] if values else None


def dev_mode_from(environ: Mapping[str, str]) -> bool:
    """vLLM's reading of VLLM_SERVER_DEV_MODE: an integer, on unless 0 (anything else: off)."""
    try:
        return bool(int(environ.get(DEV_MODE_ENV, "0")))
    except ValueError:
        return False


def paused_503_from(environ: Mapping[str, str]) -> bool:
    return environ.get(PAUSED_503_ENV, "0").strip() not in ("", "0")


# --- The engine's scheduler: pause modes, in-flight generations, weight versions ----------------------


class _Generation:
    """One generation request as the engine sees it."""

    __slots__ = ("rid", "reply_id", "queued", "cut", "writing", "made", "versions", "wake")

    def __init__(self, rid: str, reply_id: str, *, queued: bool) -> None:
        self.rid = rid  # X-Request-Id, else the reply's id
        self.reply_id = reply_id
        self.queued = queued  # arrived while paused: waits for /resume before its first token
        self.cut = False  # aborted: ends at once with finish_reason "abort"
        self.writing = False  # blocked writing a chunk (an abort does not wait for the reader)
        self.made = 0  # tokens (steps of the turn) made so far
        self.versions: list[str | None] = []  # the weight versions its tokens were sampled with
        self.wake: asyncio.Future[None] | None = None  # settled to end its nap early


def _settle(future: asyncio.Future[None] | None) -> None:
    if future is not None and not future.done():
        future.set_result(None)


class Scheduler:
    """vLLM's pause states (`EngineCore.pause_scheduler`), over the generations in flight.

    `mode` is None while running. `abort` ends every generation (running or queued) at once; `abort`
    and `wait` let the running ones step and queue new ones (`wait` drains them first); `keep` steps
    nothing. `resume` releases the queued ones. Each generation records the weight versions the
    engine had while it produced its tokens.
    """

    def __init__(self) -> None:
        self.mode: str | None = None
        self.weight_version: str | None = None
        self.sampled_versions: dict[str, list[str | None]] = {}
        self.inflight: set[_Generation] = set()
        self._changed: asyncio.Future[None] | None = None  # settled when a generation starts, steps or ends

    def enter(self, rid: str, reply_id: str) -> _Generation:
        gen = _Generation(rid, reply_id, queued=self.mode is not None)
        self.inflight.add(gen)
        self.sampled_versions[rid] = gen.versions
        self._notify()
        return gen

    def finish(self, gen: _Generation) -> None:
        """The generation made its last token (or was cut, or its client left)."""
        if gen in self.inflight:
            self.inflight.discard(gen)
            self._notify()

    def sampled(self, gen: _Generation, made: int) -> None:
        """`gen` has made `made` tokens: record the version the engine has as it makes them."""
        gen.made = made
        if not gen.versions or gen.versions[-1] != self.weight_version:
            gen.versions.append(self.weight_version)
        self._notify()

    def _notify(self) -> None:
        if self._changed is not None:
            _settle(self._changed)
            self._changed = None

    def steps(self, gen: _Generation) -> bool:
        return self.mode is None or (self.mode != "keep" and not gen.queued)

    async def tick(self, request: web.Request, gen: _Generation, seconds: float) -> bool:
        """Wait out one token's `seconds`, and any freeze; False once `gen` is cut or its client left."""
        end = time.monotonic() + seconds
        while not gen.cut and not _gone(request):
            runs = self.steps(gen)
            left = end - time.monotonic()
            if runs and left <= 0:
                return True
            await self._nap(gen, min(POLL_SECONDS, left) if runs else FROZEN_POLL_S)
        return False

    async def _nap(self, gen: _Generation, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        gen.wake = wake = loop.create_future()
        timer = loop.call_later(seconds, _settle, wake)
        try:
            await wake
        finally:
            timer.cancel()
            gen.wake = None

    def cut(self, gens: Iterable[_Generation]) -> list[_Generation]:
        """Abort these generations: each ends at once, with the tokens it made."""
        cut = list(gens)
        for gen in cut:
            gen.cut = True
            _settle(gen.wake)
        return cut

    async def pause(self, mode: str) -> None:
        """Pause as `mode` says; returns once aborted generations ended (`abort`) or running ones finished (`wait`)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"Invalid pause mode: {mode}")  # as vLLM's engine says it
        self.mode = mode
        for gen in self.inflight:
            _settle(gen.wake)  # a frozen one steps again under abort or wait
        if mode == "abort":
            cut = self.cut(self.inflight)
            await self.until(lambda: not any(g in self.inflight and not g.writing for g in cut))
        elif mode == "wait":
            running = [g for g in self.inflight if not g.queued]
            await self.until(lambda: not any(g in self.inflight for g in running))

    def resume(self) -> None:
        self.mode = None
        for gen in self.inflight:
            gen.queued = False
            _settle(gen.wake)

    async def until(self, done: Callable[[], bool]) -> None:
        """Return once `done()` holds, looked at whenever a generation starts, makes a token or ends."""
        while not done():
            if self._changed is None:
                self._changed = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._changed)  # shared: a waiter that leaves must not cancel it

    async def generating(self, count: int = 1) -> None:
        """Return once `count` generations in flight have each made a token (for a test to cut them)."""
        await self.until(lambda: sum(gen.made > 0 for gen in self.inflight) >= count)


class FakeVLLM:
    """An in-process vLLM stand-in that records what it is sent and replies as scripted."""

    url: str = ""

    def __init__(
        self, *, model: str = "fake-model", max_model_len: int = 4096, dev_mode: bool = False, paused_503: bool = False
    ) -> None:
        self.model = model
        self.max_model_len = max_model_len
        self.dev_mode = dev_mode  # vLLM's RL and dev routes (/pause, /update_weight_version, ...); else 404
        self.paused_503 = paused_503  # vLLM 0.33+: new requests in an abort or wait pause get 503, not queued
        self.requests: list[SeenRequest] = []
        self.disconnects: list[float] = []
        self.scheduler = Scheduler()
        self.sampled_versions = self.scheduler.sampled_versions  # request id -> the versions that sampled it
        # Every chat generation that returned token ids, in the order it ended: its prompt and generated
        # ids and the generated tokens' log probs (null unless asked), as a capturing proxy should record them.
        self.returned: list[Json] = []
        self._asleep: set[str] = set()  # what /sleep put to sleep (level 1 and 2: the weights and KV cache)
        self._scripts: collections.deque[Script] = collections.deque()
        self.app = web.Application(client_max_size=64 * 1024**2)
        self.app.router.add_post("/v1/chat/completions", functools.partial(self._generate, chat=True))
        self.app.router.add_post("/v1/completions", functools.partial(self._generate, chat=False))
        self.app.router.add_post("/tokenize", self._tokenize)
        self.app.router.add_post("/v1/messages", self._messages)
        self.app.router.add_post("/v1/messages/count_tokens", self._count_tokens)
        self.app.router.add_get("/v1/models", self._models)
        self.app.router.add_get("/health", self._health)
        self._mount_dev_routes()

    @property
    def weight_version(self) -> str | None:
        """The engine's weight version (`/weight_info`); set by `/update_weight_version` and `/finish_weight_update`."""
        return self.scheduler.weight_version

    @weight_version.setter
    def weight_version(self, version: str | None) -> None:
        self.scheduler.weight_version = version

    @property
    def pause_mode(self) -> str | None:
        """The mode of the pause in force (`abort`, `wait`, `keep`), None while generating."""
        return self.scheduler.mode

    async def pause(self, mode: str = "abort") -> None:
        """`POST /pause?mode=...`, in process: returns once the pause holds."""
        await self.scheduler.pause(mode)

    def resume(self) -> None:
        """`POST /resume`, in process."""
        self.scheduler.resume()

    def push(self, *scripts: Script) -> None:
        """Queue replies; each generation request pops one."""
        self._scripts.extend(scripts)

    def last_json(self) -> Any:
        """The decoded body of the last generation request."""
        for seen in reversed(self.requests):
            if seen.path in GENERATION_PATHS:
                return seen.json
        raise LookupError("the fake vLLM has not received a generation request yet")

    async def _record(self, request: web.Request) -> Any:
        raw = await request.read()
        try:
            body = orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError as exc:
            self.requests.append(
                SeenRequest(request.path, dict(request.headers), raw, None, request.rel_url.raw_query_string)
            )
            raise Rejection(400, f"JSON decode error: {exc}", kind="Bad Request") from exc
        self.requests.append(
            SeenRequest(request.path, dict(request.headers), raw, body, request.rel_url.raw_query_string)
        )
        if request.method == "POST" and not isinstance(body, dict):
            raise Rejection(400, "Input should be a valid dictionary", kind="Bad Request")
        return body

    def _lost(self) -> None:
        self.disconnects.append(time.monotonic())

    async def _idle(self, request: web.Request, seconds: float | None) -> bool:
        """Sleep `seconds` (None: forever) while the client stays; once it has gone, record it and return False."""
        # Polling, because a server without handler_cancellation never cancels this handler.
        end = None if seconds is None else time.monotonic() + seconds
        while not _gone(request):
            left = POLL_SECONDS if end is None else min(POLL_SECONDS, end - time.monotonic())
            if left <= 0:
                return True
            await asyncio.sleep(left)
        self._lost()
        return False

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        try:
            body = await self._record(request)
            prompt_ids, text = self._prompt(body, chat=chat)
            script = self._scripts.popleft() if self._scripts else self._default(body, text, len(prompt_ids))
            return await self._reply(request, body, script, prompt_ids, text, chat=chat)
        except Rejection as exc:
            return exc.response()
        except asyncio.CancelledError:  # with handler_cancellation, a client that leaves cancels us
            self._lost()
            raise

    def _prompt(self, body: Json, *, chat: bool) -> tuple[list[int], str]:
        """The prompt's token ids, and the text a default reply echoes."""
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise Rejection(400, "messages: Field required", kind="Bad Request")
            users = [m.get("content") for m in _turns(messages) if m.get("role") == "user"]
            return [token_id(p) for p in chat_prompt_pieces(messages)], _text(users[-1] if users else None)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(i, int) for i in prompt):
            return prompt, ""
        if isinstance(prompt, list) and prompt:
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise Rejection(400, "Either prompt or prompt_embeds must be provided and non-empty.")
        return [token_id(p) for p in pieces(prompt)], prompt

    def _overflow(self, n: int) -> Rejection:
        limit = self.max_model_len
        return Rejection(
            400,
            f"This model's maximum context length is {limit} tokens. However, your prompt contains at least {n} "
            "input tokens, which exceeds this limit even without any output tokens. Please reduce the length of "
            f"the input prompt. (parameter=input_tokens, value={n})",
            param="input_tokens",
        )

    def _budget(self, body: Json, n: int, default: int | None) -> int:
        """How many tokens may be generated; raises vLLM 0.32's validation errors."""
        limit = self.max_model_len
        asked = body.get("max_completion_tokens")
        if asked is None:
            asked = body.get("max_tokens", default)
        if asked is not None and asked > limit:
            message = f"max_tokens={asked} cannot be greater than max_model_len={limit}."
            message += f" Please request fewer output tokens. (parameter=max_tokens, value={asked})"
            raise Rejection(400, message, param="max_tokens")
        if n > limit:
            raise self._overflow(n)
        if n == limit:
            raise Rejection(400, "max_tokens must be at least 1, got 0", param="max_tokens")
        # As on 0.32, a prompt plus max_tokens over the limit is no error: max_tokens shrinks to fit.
        return min(limit - n, limit if asked is None else asked)

    def _default(self, body: Json, text: str, n: int) -> Script:
        """The reply for an empty queue, steered by directives in the last user text."""
        if "[[overflow]]" in text:
            raise self._overflow(max(n, self.max_model_len + 1))
        if match := _ERROR_DIRECTIVE.search(text):
            return Script(status=int(match[1]), error_message=f"fake vLLM: injected error {match[1]}")
        script = Script(reasoning="thinking about it" if "[[reason]]" in text else None)
        if match := _CALL_DIRECTIVE.search(text):
            return _call_directive(script, match, body.get("messages") or [])
        tools = [t["function"] for t in body.get("tools") or [] if t.get("type") == "function"]
        choice = body.get("tool_choice")
        last = ([{}, *_turns(body.get("messages") or [])])[-1]
        wants_call = choice != "none" and "[[no-call]]" not in text
        if tools and wants_call and isinstance(last, dict) and last.get("role") == "user":
            named = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
            script.tool_calls = [{"name": named or tools[0]["name"], "arguments": "{}"}]
        return script

    async def _scripted_end(
        self, request: web.Request, script: Script, envelope: Callable[[int, str], bytes]
    ) -> web.StreamResponse | None:
        """A scripted hang (until the client leaves) or error status in `envelope`; None for a reply."""
        if script.hang:
            await self._idle(request, None)
            return web.Response()
        if script.status != 200:
            message = script.error_message or f"fake vLLM: scripted error {script.status}"
            return _json_response(script.error_body or envelope(script.status, message), status=script.status)
        return None

    async def _reply(
        self, request: web.Request, body: Json, script: Script, prompt_ids: list[int], text: str, *, chat: bool
    ) -> web.StreamResponse:
        scripted = await self._scripted_end(request, script, error_body)
        if scripted is not None:
            return scripted
        budget = self._budget(body, len(prompt_ids), None if chat else COMPLETIONS_MAX_TOKENS)
        turn = self._turn(body, script, prompt_ids, text, budget, chat=chat)
        gen = self._enter(request, turn)
        try:
            if body.get("stream"):
                return await self._stream(request, gen, turn, _chat_frames if chat else _text_frames, returned=chat)
            made = await self._produce(request, gen, turn)
            if made is None:
                return web.Response()
            if chat:
                self._returned(made)
            return _json_response(orjson.dumps(_chat_body(made) if chat else _text_body(made)))
        finally:
            self.scheduler.finish(gen)

    def _enter(self, request: web.Request, turn: _Turn) -> _Generation:
        """Hand the turn to the scheduler, or refuse it as vLLM 0.33 does while an abort or wait pause holds."""
        if self.paused_503 and self.scheduler.mode in ("abort", "wait"):
            raise Rejection(503, PAUSED_MESSAGE, kind="Service Unavailable")
        return self.scheduler.enter(request.headers.get("X-Request-Id") or turn.id, turn.id)

    async def _produce(self, request: web.Request, gen: _Generation, turn: _Turn) -> _Turn | None:
        """Make a non-streamed reply's tokens, `chunk_delay` apart: the turn, or as an abort cut it, or
        None once the client left."""
        scheduler, delay = self.scheduler, turn.script.chunk_delay
        for done in range(-1, len(turn.steps) if delay else 0):  # -1: the wait for admission (while queued)
            if not await scheduler.tick(request, gen, delay if done >= 0 else 0.0):
                if gen.cut:
                    return _cut(turn, max(done, 0))
                self._lost()
                return None
            scheduler.sampled(gen, done + 1)
        scheduler.sampled(gen, len(turn.steps))  # without a delay, the rest takes no time
        return turn

    def _turn(self, body: Json, script: Script, prompt_ids: list[int], text: str, budget: int, *, chat: bool) -> _Turn:
        calls = script.tool_calls if chat else None
        if script.content is None and not calls:
            script = msgspec.structs.replace(script, content="echo: " + text)
        calls = [{"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "arguments": "", **c} for c in calls or []]
        script = msgspec.structs.replace(script, tool_calls=calls or None, reasoning=script.reasoning if chat else None)
        script = _fit(script, budget)
        script.finish_reason = script.finish_reason or ("tool_calls" if script.tool_calls else "stop")
        steps = _chat_steps(script)
        options, logprobs = body.get("stream_options"), body.get("logprobs")
        return _Turn(
            id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=body.get("model") or self.model,
            prompt_ids=prompt_ids,
            script=script,
            steps=steps,
            return_ids=bool(body.get("return_token_ids")),
            logprobs=bool(logprobs) if chat else logprobs is not None,
            as_ids=bool(body.get("return_tokens_as_token_ids")),
            top=(body.get("top_logprobs") if chat else logprobs) or 0,
            # vLLM's StreamOptions.include_usage defaults to true, so `{}` asks for the usage chunk.
            include_usage=isinstance(options, dict) and bool(options.get("include_usage", True)),
            continuous_usage=isinstance(options, dict) and bool(options.get("continuous_usage_stats")),
        )

    async def _stream(
        self,
        request: web.Request,
        gen: _Generation,
        turn: _Turn,
        framer: Callable[[_Turn], Frames],
        failures: dict[str, list[bytes]] | None = None,
        *,
        returned: bool = False,
    ) -> web.StreamResponse:
        """Write the turn's frames, `chunk_delay` apart, failing midway as `script.fail_mid_stream` says
        (`failures`: the tails that end a stream broken by `bad_json` and by `error`, when not chat's and
        text completion's). While the head and body go out the turn is generating: the scheduler may
        freeze it or cut it, and a cut one ends at once with the frames of the turn as cut. With
        `returned`, a stream that ends whole or cut is logged in `returned`."""
        head, body, tail = framer(turn)
        script = turn.script
        mode = script.fail_mid_stream
        if mode is not None:
            if mode not in FAILURE_MODES:
                raise ValueError(f"fail_mid_stream must be one of {FAILURE_MODES}, not {mode!r}")
            body = body[: len(body) // 2]
            if failures is None:
                error = error_body(500, script.error_message or MID_STREAM_ERROR)
                failures = {"bad_json": [b"data: {not json\n\n", DONE], "error": [b"data: %s\n\n" % error, DONE]}
            tail = failures.get(mode, [])
        resp = web.StreamResponse(headers=VLLM_STREAM_HEADERS)
        if mode == "truncate":
            resp.force_close()
        await resp.prepare(request)  # vLLM sends the headers at once, the first chunk with the first token
        scheduler, live = self.scheduler, len(head) + len(body)
        for i, frame in enumerate([*head, *body, *tail]):
            if i < live:
                if not await scheduler.tick(request, gen, script.chunk_delay if i else 0.0):
                    if not gen.cut:
                        self._lost()
                        return resp
                    scheduler.finish(gen)
                    cut = _cut(turn, max(0, i - len(head)))
                    if returned:
                        self._returned(cut)
                    cut_head, cut_body, cut_tail = framer(cut)
                    await self._write(resp, [*cut_head, *cut_body, *cut_tail][i:])
                    return resp
                scheduler.sampled(gen, min(len(turn.steps), max(0, i + 1 - len(head))))
            else:
                scheduler.finish(gen)
                if i and script.chunk_delay and not await self._idle(request, script.chunk_delay):
                    return resp
            gen.writing = True
            try:
                await resp.write(frame)
            except ConnectionError:  # aiohttp raises ConnectionResetError, or ConnectionError from drain()
                self._lost()
                return resp
            finally:
                gen.writing = False
        if returned and mode is None:
            self._returned(turn)
        if mode == "reset":
            _reset(request)
            return resp
        await resp.write_eof()
        return resp

    def _returned(self, turn: _Turn) -> None:
        if turn.return_ids:
            toks = turn.tokens()
            self.returned.append(
                {
                    "prompt_token_ids": turn.prompt_ids,
                    "generation_token_ids": [token_id(tok) for tok in toks],
                    "generation_log_probs": [_logprob(token_id(tok)) for tok in toks] if turn.logprobs else None,
                }
            )

    async def _write(self, resp: web.StreamResponse, frames: list[bytes]) -> None:
        try:
            for frame in frames:
                await resp.write(frame)
            await resp.write_eof()
        except ConnectionError:
            self._lost()

    async def _tokenize(self, request: web.Request) -> web.Response:
        try:
            body = await self._record(request)
            if isinstance(body.get("messages"), list):
                toks = chat_prompt_pieces(body["messages"])
            elif isinstance(body.get("prompt"), str):
                toks = pieces(body["prompt"])
            else:
                raise Rejection(400, "Either messages or prompt must be provided.", kind="Bad Request")
        except Rejection as exc:
            return exc.response()
        token_strs = toks if body.get("return_token_strs") else None
        reply = dict(count=len(toks), max_model_len=self.max_model_len, tokens=[token_id(t) for t in toks])
        return _json_response(orjson.dumps(dict(reply, token_strs=token_strs)))

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        """`POST /v1/messages`: the chat machinery (scripts, replies from the request, directives), answered
        as vLLM's Anthropic endpoint answers."""
        try:
            try:
                body = await self._record(request)
                _check_messages(body, count=False)
            except Rejection as exc:
                return exc.response()
            try:
                chat = chat_from_messages(body)
                if not body["messages"]:
                    raise Rejection(400, "messages must contain at least one item")
                prompt_ids, text = self._prompt(chat, chat=True)
                script = self._scripts.popleft() if self._scripts else self._default(chat, text, len(prompt_ids))
                return await self._message_reply(request, chat, script, prompt_ids, text)
            except Rejection as exc:  # refused by the engine: vLLM translates it to the Anthropic envelope
                return _json_response(anthropic_error(exc.status, exc.message, exc.kind), status=exc.status)
        except asyncio.CancelledError:
            self._lost()
            raise

    async def _message_reply(
        self, request: web.Request, chat: Json, script: Script, prompt_ids: list[int], text: str
    ) -> web.StreamResponse:
        scripted = await self._scripted_end(request, script, anthropic_error)
        if scripted is not None:
            return scripted
        turn = self._turn(chat, script, prompt_ids, text, self._budget(chat, len(prompt_ids), None), chat=True)
        gen = self._enter(request, turn)
        try:
            if chat.get("stream"):
                error = _event(
                    "error", error={"type": "internal_error", "message": script.error_message or MID_STREAM_ERROR}
                )
                failures = {"bad_json": [b"event: content_block_delta\ndata: {not json\n\n"], "error": [error]}
                return await self._stream(request, gen, turn, _message_frames, failures)
            made = await self._produce(request, gen, turn)
        finally:
            self.scheduler.finish(gen)
        if made is None:
            return web.Response()
        try:
            reply = _message_body(made)
        except json.JSONDecodeError as exc:  # vLLM json.loads the tool call arguments: a ValueError's 400
            return _json_response(anthropic_error(400, str(exc), "BadRequestError"), status=400)
        return _json_response(orjson.dumps(reply))

    async def _count_tokens(self, request: web.Request) -> web.Response:
        """`POST /v1/messages/count_tokens`: the prompt's token count, as the chat request would have it."""
        try:
            body = await self._record(request)
            _check_messages(body, count=True)
        except Rejection as exc:
            return exc.response()
        try:
            if not body["messages"]:
                raise Rejection(400, "messages must contain at least one item")
            prompt_ids, _ = self._prompt(chat_from_messages(body), chat=True)
        except Rejection as exc:
            return _json_response(anthropic_error(exc.status, exc.message, exc.kind), status=exc.status)
        n = len(prompt_ids)
        return _json_response(orjson.dumps({"input_tokens": n, "context_management": {"original_input_tokens": n}}))

    async def _models(self, request: web.Request) -> web.Response:
        await self._record(request)
        card = dict(id=self.model, object="model", created=int(time.time()), owned_by="vllm", root=self.model)
        card.update(parent=None, max_model_len=self.max_model_len, permission=[])
        return _json_response(orjson.dumps({"object": "list", "data": [card]}))

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response()

    # --- vLLM's RL and dev routes (VLLM_SERVER_DEV_MODE=1): entrypoints/rl/online, serve/dev -------

    def _mount_dev_routes(self) -> None:
        said = {
            "/shutdown_weight_transfer_engine": "Weight transfer shut down",
            "/start_weight_update": "Weight update started",
            "/start_draft_weight_update": "Draft weight update started",
        }
        routes: dict[str, tuple[str, ControlHandler]] = {
            "/pause": ("POST", self._pause),
            "/resume": ("POST", self._resume),
            "/is_paused": ("GET", self._is_paused),
            "/abort_requests": ("POST", self._abort_requests),
            "/init_weight_transfer_engine": ("POST", functools.partial(self._transfer, "init_info", "Weight transfer initialized")),
            **{path: ("POST", functools.partial(self._said, text)) for path, text in said.items()},
            "/update_weights": ("POST", functools.partial(self._transfer, "update_info", "Weights updated")),
            "/finish_weight_update": ("POST", self._finish_weight_update),
            "/update_weight_version": ("POST", self._update_weight_version),
            "/weight_info": ("GET", self._weight_info),
            "/weight_checker": ("POST", self._weight_checker),
            "/reset_prefix_cache": ("POST", self._reset_prefix_cache),
            "/reset_mm_cache": ("POST", self._reset_mm_cache),
            "/sleep": ("POST", self._sleep),
            "/wake_up": ("POST", self._wake_up),
            "/is_sleeping": ("GET", self._is_sleeping),
            "/collective_rpc": ("POST", self._collective_rpc),
        }  # fmt: skip
        for path, (method, handle) in routes.items():
            if self.dev_mode:
                self.app.router.add_route(method, path, self._control(handle))
            else:
                self.app.router.add_route("*", path, _not_found)

    def _control(self, handle: ControlHandler) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        """A dev route: the request recorded, its answer as JSON, a refusal in vLLM's envelope."""

        async def serve(request: web.Request) -> web.StreamResponse:
            raw = await request.read()
            try:
                parsed = orjson.loads(raw) if raw else None
            except orjson.JSONDecodeError:
                parsed = None
            self.requests.append(
                SeenRequest(request.path, dict(request.headers), raw, parsed, request.rel_url.raw_query_string)
            )
            try:
                answer = await handle(request, raw)
            except Rejection as exc:
                return exc.response()
            return answer if isinstance(answer, web.StreamResponse) else _json_response(orjson.dumps(answer))

        return serve

    async def _pause(self, request: web.Request, raw: bytes) -> Json:
        errors: list[Json] = []
        mode = _one_of(errors, "query.mode", _last(request, "mode"), PAUSE_MODES, "abort")
        _flag(errors, "query.clear_cache", _last(request, "clear_cache"), True)
        if errors or mode is None:
            raise _invalid(errors)
        await self.pause(mode)
        return {"status": "paused"}

    async def _resume(self, request: web.Request, raw: bytes) -> Json:
        self.resume()
        return {"status": "resumed"}

    async def _is_paused(self, request: web.Request, raw: bytes) -> Json:
        return {"is_paused": self.scheduler.mode is not None}

    async def _abort_requests(self, request: web.Request, raw: bytes) -> Json:
        """Cut the generations named (by X-Request-Id or reply id), or every one; no pause."""
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise Rejection(400, "Invalid JSON format", kind="Bad Request") from exc
        if not isinstance(body, dict):
            raise Rejection(400, "Request body must be a JSON object", kind="Bad Request")
        named = body.get("request_ids")
        if named:
            ids = set(named) if isinstance(named, list) else {named}
            self.scheduler.cut(g for g in self.scheduler.inflight if g.rid in ids or g.reply_id in ids)
            return {"status": "aborted", "aborted": len(named) if isinstance(named, list) else 1}
        return {"status": "aborted", "aborted": len(self.scheduler.cut(self.scheduler.inflight))}

    async def _said(self, text: str, request: web.Request, raw: bytes) -> Json:
        return {"message": text}

    async def _transfer(self, field: str, text: str, request: web.Request, raw: bytes) -> Json:
        errors: list[Json] = []
        _object_field(errors, _embedded(raw), field, lists=field == "update_info")
        if errors:
            raise _invalid(errors)
        return {"message": text}

    async def _finish_weight_update(self, request: web.Request, raw: bytes) -> Json:
        errors: list[Json] = []
        version = _text_field(errors, _embedded(raw), "weight_version", required=False)
        if errors:
            raise _invalid(errors)
        if version is not None:
            self.weight_version = version
        return {"message": "Weight update finished"}

    async def _update_weight_version(self, request: web.Request, raw: bytes) -> Json:
        errors: list[Json] = []
        version = _text_field(errors, _embedded(raw), "new_version", required=True)
        if errors or version is None:
            raise _invalid(errors)
        self.weight_version = version
        return {"success": True, "new_version": version}

    async def _weight_info(self, request: web.Request, raw: bytes) -> Json:
        return {"weight_version": self.weight_version}

    async def _weight_checker(self, request: web.Request, raw: bytes) -> Json:
        """One checksum, of the weight version: a changed version is changed weights."""
        errors: list[Json] = []
        body = _embedded(raw)
        action = _one_of(errors, "body.action", body.get("action"), CHECKERS, None)
        if "action" not in body or body["action"] is None:
            errors.append(_failed("missing", "body.action", "Field required", None))
        baseline = body.get("baseline")
        if baseline is not None and not isinstance(baseline, dict):
            errors.append(_failed("dict_type", "body.baseline", "Input should be a valid dictionary", baseline))
        if errors:
            raise _invalid(errors)
        if action == "reset":
            return {"status": "reset"}
        checksums = {"model.weights": f"{zlib.crc32(str(self.weight_version).encode()):08x}"}
        if action == "checksum":
            return {"checksums": checksums}
        if baseline is None:
            raise Rejection(400, "action='compare' requires a 'baseline' object", kind="Bad Request")
        mismatches = sorted(k for k in checksums.keys() | baseline.keys() if checksums.get(k) != baseline.get(k))
        return {"match": not mismatches, "mismatches": mismatches}

    async def _reset_prefix_cache(self, request: web.Request, raw: bytes) -> Json:
        errors: list[Json] = []
        for name in ("reset_running_requests", "reset_external"):
            _flag(errors, f"query.{name}", _last(request, name), False)
        if errors:
            raise _invalid(errors)
        return {"success": True}

    async def _reset_mm_cache(self, request: web.Request, raw: bytes) -> web.Response:
        return web.Response()

    async def _sleep(self, request: web.Request, raw: bytes) -> Json:
        """`/sleep?level=&mode=`: a pause in `mode`, then (level 1 and 2) the weights and KV cache asleep."""
        errors: list[Json] = []
        level = _level(errors, _last(request, "level"))
        mode = _one_of(errors, "query.mode", _last(request, "mode"), PAUSE_MODES, "abort")
        if errors or mode is None:
            raise _invalid(errors)
        await self.pause(mode)
        if level >= 1:
            self._asleep = {"weights", "kv_cache"}
        return {"status": "sleeping", "level": level}

    async def _wake_up(self, request: web.Request, raw: bytes) -> Json:
        """Wake what `tags` names (all by default); once nothing sleeps, generation resumes."""
        tags = request.query.getall("tags", []) or None
        if tags is None:
            self._asleep.clear()
        else:
            self._asleep.difference_update(tags)
        if not self._asleep:
            self.resume()
        return {"status": "sleeping" if self._asleep else "awake", "tags": tags}

    async def _is_sleeping(self, request: web.Request, raw: bytes) -> Json:
        return {"is_sleeping": bool(self._asleep)}

    async def _collective_rpc(self, request: web.Request, raw: bytes) -> Json:
        """One worker, whose every method returns None."""
        if _object_body(raw).get("method") is None:
            raise Rejection(400, "Missing 'method' in request body", kind="Bad Request")
        return {"results": [None]}


def from_environment(**options: Any) -> FakeVLLM:
    """A FakeVLLM whose dev mode and paused 503s, unless given (not None), come from the environment as
    vLLM's do: VLLM_SERVER_DEV_MODE=1 mounts the RL and dev routes, FAKE_VLLM_PAUSED_503=1 answers as 0.33."""
    if options.get("dev_mode") is None:
        options["dev_mode"] = dev_mode_from(os.environ)
    if options.get("paused_503") is None:
        options["paused_503"] = paused_503_from(os.environ)
    return FakeVLLM(**options)


async def start(
    host: str = "127.0.0.1",
    port: int = 0,
    model: str = "fake-model",
    max_model_len: int = 4096,
    *,
    dev_mode: bool | None = None,
    paused_503: bool | None = None,
) -> tuple[FakeVLLM, web.AppRunner, str]:
    """Serve a FakeVLLM in the running loop; returns it, its runner (to clean up) and its base URL (…/v1)."""
    fake = from_environment(model=model, max_model_len=max_model_len, dev_mode=dev_mode, paused_503=paused_503)
    runner = web.AppRunner(fake.app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    fake.url = f"http://{host}:{runner.addresses[0][1]}/v1"
    return fake, runner, fake.url


def run(
    host: str,
    port: int,
    model: str = "fake-model",
    max_model_len: int | None = None,
    *,
    dev_mode: bool | None = None,
    paused_503: bool | None = None,
) -> None:
    """Serve a FakeVLLM until interrupted (claiming `DEMO_MAX_MODEL_LEN` unless told otherwise)."""
    options = dict(dev_mode=dev_mode, paused_503=paused_503)
    fake = from_environment(model=model, max_model_len=max_model_len or DEMO_MAX_MODEL_LEN, **options)
    web.run_app(fake.app, host=host, port=port, handler_cancellation=True)


def main(argv: list[str] | None = None) -> None:
    """`python -m gymproxy.testing.fake_vllm --host H --port P --model NAME [--max-model-len L] [--dev-mode]
    [--paused-503]`."""
    parser = argparse.ArgumentParser(prog="python -m gymproxy.testing.fake_vllm", description="A fake vLLM server.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", default="fake-model")
    parser.add_argument("--max-model-len", type=int, default=DEMO_MAX_MODEL_LEN)
    parser.add_argument(
        "--dev-mode", action="store_true", default=None, help=f"the RL and dev routes (or {DEV_MODE_ENV}=1)"
    )
    parser.add_argument(
        "--paused-503", action="store_true", default=None, help=f"vLLM 0.33's paused 503s (or {PAUSED_503_ENV}=1)"
    )
    args = parser.parse_args(argv)
    run(args.host, args.port, args.model, args.max_model_len, dev_mode=args.dev_mode, paused_503=args.paused_503)


if __name__ == "__main__":
    main()
