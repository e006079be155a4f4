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

The tokenizer is crude but deterministic: one token per word, counting the whitespace before it,
with id = crc32(piece) mod 50000. Every id the fake reports (prompt ids, `/tokenize`, generated ids
and logprob tokens) comes from that one function, so they all agree.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import collections
import functools
import itertools
import re
import socket
import struct
import time
import uuid
import zlib
from collections.abc import Callable
from typing import Any, Final, NamedTuple

import msgspec
import orjson
from aiohttp import web

Json = dict[str, Any]
Frames = tuple[list[bytes], list[bytes], list[bytes]]  # head, body (cut by fail_mid_stream), tail

VLLM_STREAM_HEADERS: Final = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
DONE: Final = b"data: [DONE]\n\n"
VOCAB_SIZE: Final = 50_000
POLL_SECONDS: Final = 0.02
GENERATION_PATHS: Final = ("/v1/chat/completions", "/v1/completions", "/v1/messages")
FAILURE_MODES: Final = ("reset", "truncate", "bad_json", "error")
# The demo fake (`gymproxy serve` with no upstream, `gymproxy fake-vllm`) takes what real agent
# harnesses send: long system prompts, and Claude Code's `max_tokens: 32000`.
DEMO_MAX_MODEL_LEN: Final = 131_072
COMPLETIONS_MAX_TOKENS: Final = 16  # vLLM's default for /v1/completions; chat has none
MID_STREAM_ERROR: Final = "fake vLLM: injected mid-stream error"
ANTHROPIC_STOP: Final = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
BILLING_HEADER: Final = "x-anthropic-billing-header"  # Claude Code's per-request system block; vLLM drops it

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
    """The prompt tokens of a chat request: the tokens of every message's text, in order."""
    return [p for m in messages for p in pieces(_text(m.get("content") if isinstance(m, dict) else None))]


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
    """Frame the delta choices; vLLM puts `length` on the last delta, but a stop (EOS) in a chunk of its own."""
    if t.script.finish_reason != "length" or not choices:
        choices.append(finish)
    choices[-1].update(finish_reason=t.script.finish_reason, stop_reason=None, **(t.script.choice_extra or {}))
    body = [_frame(t.envelope(obj, choices=[c], **base)) for c in choices[:-1]]
    body.append(_frame(t.envelope(obj, choices=choices[-1:], **base, **(t.script.top_extra or {}))))
    usage = [_frame(t.envelope(obj, choices=[], usage=t.usage(stream=True)))] if t.include_usage else []
    return head, body, [*usage, DONE]


def _chat_frames(t: _Turn) -> Frames:
    role = dict(index=0, delta={"role": "assistant", "content": ""}, logprobs=None, finish_reason=None)
    head = [_frame(t.envelope("chat.completion.chunk", choices=[role], prompt_token_ids=t.prompt_token_ids()))]
    choices = [
        dict(index=0, delta=s.delta, logprobs=t.chat_logprobs(s.tokens), finish_reason=None, token_ids=t.ids(s.tokens))
        for s in t.steps
    ]
    finish = dict(index=0, delta={}, logprobs=t.chat_logprobs([]), finish_reason=None, token_ids=t.ids([]))
    return _frames(t, "chat.completion.chunk", head, choices, finish)


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
    """The chat request vLLM's Anthropic endpoint makes of a Messages request (its reply rules apply
    to it), except that a user message's tool results follow its text (see the module docstring)."""
    system = [_system_text(body.get("system"))]
    messages: list[Json] = []
    for message in body["messages"]:
        role, content = message["role"], message["content"]
        if role == "system":
            system.append(_system_text(content))
        elif isinstance(content, str):
            messages.append({"role": role, "content": content})
        else:
            messages += _chat_turn(role, content)
    text = "\n\n".join(part for part in system if part)
    chat: Json = {
        "model": body["model"],
        "messages": ([{"role": "system", "content": text}] if text else []) + messages,
    }
    if "max_tokens" in body:
        chat["max_tokens"] = body["max_tokens"]
    if body.get("stream"):
        chat["stream"] = True
    tools = [
        {"type": "function", "function": {"name": t.get("name"), "description": t.get("description"),
                                          "parameters": t.get("input_schema") or {"type": "object"},
                                          "defer_loading": t.get("defer_loading")}}
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


def _system_text(system: Any) -> str:
    if isinstance(system, str):
        return "" if system.startswith(BILLING_HEADER) else system
    blocks = system if isinstance(system, list) else []
    return "".join(
        b["text"]
        for b in blocks
        if b.get("type") == "text" and b.get("text") and not b["text"].startswith(BILLING_HEADER)
    )


def _chat_turn(role: str, blocks: list[Json]) -> list[Json]:
    """One Messages turn made of content blocks, as chat messages: the turn, then its tool results."""
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
            arguments = orjson.dumps(block.get("input") or {}).decode()
            function = {"name": block.get("name") or "", "arguments": arguments}
            calls.append(
                {"id": block.get("id") or f"call_{int(time.time())}", "type": "function", "function": function}
            )
        elif kind == "tool_result" and role == "user":
            content = block.get("content")
            text = content if isinstance(content, str) else _text(content if isinstance(content, list) else None)
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
    keep = "content" in turn if role == "user" else bool(parts or calls or thinking)
    return ([turn] if keep else []) + results


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


def _anthropic_usage(t: _Turn) -> Json:
    usage = t.usage(stream=True)
    return {"input_tokens": usage.get("prompt_tokens", 0), "output_tokens": usage.get("completion_tokens", 0)}


def _message_body(t: _Turn) -> Json:
    s = t.script
    content: list[Json] = []
    if s.reasoning:
        content.append({"type": "thinking", "thinking": s.reasoning, "signature": uuid.uuid4().hex})
    if s.content:
        content.append({"type": "text", "text": s.content})
    for call in s.tool_calls or []:
        content.append(
            {"type": "tool_use", "id": call["id"], "name": call["name"], "input": orjson.loads(call["arguments"])}
        )
    message: Json = dict(id=t.id, type="message", role="assistant", content=content, model=t.model)
    if (stop := ANTHROPIC_STOP.get(s.finish_reason or "")) is not None:
        message["stop_reason"] = stop  # vLLM dumps with exclude_none: an unmapped reason is absent
    message["usage"] = _anthropic_usage(t)
    return message


def _message_frames(t: _Turn) -> Frames:
    """The turn as vLLM's Anthropic event stream: one frame (of one or more events) per chat chunk."""
    start: Json = dict(id=t.id, content=[], model=t.model, stop_reason=None, stop_sequence=None)
    usage = {"input_tokens": _anthropic_usage(t)["input_tokens"], "output_tokens": 0}
    head = [_event("message_start", message={**start, "usage": usage})]
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
    end = {"stop_reason": ANTHROPIC_STOP.get(t.script.finish_reason or "stop")}
    tail = [b"".join([*stop(), _event("message_delta", delta=end, usage=_anthropic_usage(t))]), _event("message_stop")]
    return head, body, tail


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
    turns = [m for m in messages if isinstance(m, dict) and m.get("role") not in _NOTES]
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


class FakeVLLM:
    """An in-process vLLM stand-in that records what it is sent and replies as scripted."""

    url: str = ""

    def __init__(self, *, model: str = "fake-model", max_model_len: int = 4096) -> None:
        self.model = model
        self.max_model_len = max_model_len
        self.requests: list[SeenRequest] = []
        self.disconnects: list[float] = []
        self._scripts: collections.deque[Script] = collections.deque()
        self.app = web.Application(client_max_size=64 * 1024**2)
        self.app.router.add_post("/v1/chat/completions", functools.partial(self._generate, chat=True))
        self.app.router.add_post("/v1/completions", functools.partial(self._generate, chat=False))
        self.app.router.add_post("/tokenize", self._tokenize)
        self.app.router.add_post("/v1/messages", self._messages)
        self.app.router.add_post("/v1/messages/count_tokens", self._count_tokens)
        self.app.router.add_get("/v1/models", self._models)
        self.app.router.add_get("/health", self._health)

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
            users = [m.get("content") for m in messages if isinstance(m, dict) and m.get("role") == "user"]
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
        last = (body.get("messages") or [{}])[-1]
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
        if body.get("stream"):
            return await self._stream(request, _chat_frames(turn) if chat else _text_frames(turn), turn.script)
        if script.chunk_delay and not await self._idle(request, script.chunk_delay * len(turn.steps)):
            return web.Response()
        return _json_response(orjson.dumps(_chat_body(turn) if chat else _text_body(turn)))

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
        )

    async def _stream(
        self, request: web.Request, frames: Frames, script: Script, failures: dict[str, list[bytes]] | None = None
    ) -> web.StreamResponse:
        """Write the frames, failing midway as `script.fail_mid_stream` says (`failures`: the tails that
        end a stream broken by `bad_json` and by `error`, when not chat's and text completion's)."""
        head, body, tail = frames
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
        await resp.prepare(request)
        for i, frame in enumerate([*head, *body, *tail]):
            if i and script.chunk_delay and not await self._idle(request, script.chunk_delay):
                return resp
            try:
                await resp.write(frame)
            except ConnectionError:  # aiohttp raises ConnectionResetError, or ConnectionError from drain()
                self._lost()
                return resp
        if mode == "reset":
            _reset(request)
            return resp
        await resp.write_eof()
        return resp

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
        if chat.get("stream"):
            error = _event(
                "error", error={"type": "internal_error", "message": script.error_message or MID_STREAM_ERROR}
            )
            failures = {"bad_json": [b"event: content_block_delta\ndata: {not json\n\n"], "error": [error]}
            return await self._stream(request, _message_frames(turn), turn.script, failures)
        if script.chunk_delay and not await self._idle(request, script.chunk_delay * len(turn.steps)):
            return web.Response()
        try:
            reply = _message_body(turn)
        except orjson.JSONDecodeError as exc:  # vLLM json.loads the tool call arguments, and fails so
            return _json_response(anthropic_error(500, str(exc), "internal_error"), status=500)
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


async def start(
    host: str = "127.0.0.1", port: int = 0, model: str = "fake-model", max_model_len: int = 4096
) -> tuple[FakeVLLM, web.AppRunner, str]:
    """Serve a FakeVLLM in the running loop; returns it, its runner (to clean up) and its base URL (…/v1)."""
    fake = FakeVLLM(model=model, max_model_len=max_model_len)
    runner = web.AppRunner(fake.app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    fake.url = f"http://{host}:{runner.addresses[0][1]}/v1"
    return fake, runner, fake.url


def run(host: str, port: int, model: str = "fake-model", max_model_len: int | None = None) -> None:
    """Serve a FakeVLLM until interrupted (claiming `DEMO_MAX_MODEL_LEN` unless told otherwise)."""
    fake = FakeVLLM(model=model, max_model_len=max_model_len or DEMO_MAX_MODEL_LEN)
    web.run_app(fake.app, host=host, port=port, handler_cancellation=True)


def main(argv: list[str] | None = None) -> None:
    """`python -m gymproxy.testing.fake_vllm --host H --port P --model NAME [--max-model-len L]`."""
    parser = argparse.ArgumentParser(prog="python -m gymproxy.testing.fake_vllm", description="A fake vLLM server.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", default="fake-model")
    parser.add_argument("--max-model-len", type=int, default=DEMO_MAX_MODEL_LEN)
    args = parser.parse_args(argv)
    fake = FakeVLLM(model=args.model, max_model_len=args.max_model_len)
    web.run_app(fake.app, host=args.host, port=args.port, handler_cancellation=True)


if __name__ == "__main__":
    main()
