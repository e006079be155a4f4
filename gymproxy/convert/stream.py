"""Streaming conversions, sans-IO: vLLM's chat chunks in, the client's stream frames out.

Both translators take each upstream SSE payload (`payload`) and return the bytes to write, and end
the stream with `finish`, `fail` (a terminal error event) or, for an answer made without vLLM,
`answer_locally`. `ResponsesStream` turns chunks into the Responses event protocol as they arrive
and builds its terminal Response with `reply.to_response` from everything it saw, so the streamed
result equals the non-streaming one. `ChatStream` relays vLLM's chunks, folding separate reasoning
deltas into `<think>` content (`ChatReasoningFolder`). `ThinkSplitter` finds `<think>` tags that
may straddle chunks.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import orjson

from ..errors import UpstreamError
from ..ids import new_id
from ..schemas import ENCODER
from ..schemas.chat import (
    CHUNK_DECODER,
    AssistantMessage,
    ChatChunk,
    ChatCompletion,
    Choice,
    ChunkChoice,
    FunctionCall,
    ToolCall,
    Usage,
)
from ..schemas.events import (
    ArgumentsDone,
    ContentPartEvent,
    DeltaFrames,
    Event,
    ItemEvent,
    RefusalDone,
    ResponseEvent,
    SummaryDone,
    SummaryPartEvent,
    TextDone,
    encode_event,
)
from ..schemas.responses import (
    FunctionCallItem,
    MessageItem,
    OutputText,
    ReasoningItem,
    Refusal,
    Response,
    ResponseError,
    ResponsesRequest,
    SummaryText,
)
from .boundary import CLOSE, OPEN
from .reply import NO_PARSER, attach_tokens, echo, empty_completion, has_reasoning, to_response
from .request import NamespaceMap, namespace_map, shown
from .tokens import TokenInfo

DONE_FRAME = b"data: [DONE]\n\n"


class ThinkSplitter:
    """Splits streamed text at `<think>`/`</think>`; a tag cut across two chunks is held back."""

    def __init__(self) -> None:
        self.inside = False
        self._held = ""

    def clear(self, text: str) -> bool:
        """`text` is all inside or all outside `<think>`: no tag, nor the start of one, nothing held."""
        return not self._held and "<" not in text

    def feed(self, text: str) -> list[tuple[str, str]]:
        """Pieces of ("text" | "think" | "think_start" | "think_end", text)."""
        if self.clear(text):
            return [("think" if self.inside else "text", text)] if text else []
        text = self._held + text
        self._held = ""
        pieces: list[tuple[str, str]] = []
        while text:
            tag = CLOSE if self.inside else OPEN
            at = text.find(tag)
            if at < 0:
                keep = _partial_tag(text, tag)
                if keep:
                    self._held = text[-keep:]
                    text = text[:-keep]
                if text:
                    pieces.append(("think" if self.inside else "text", text))
                break
            if at:
                pieces.append(("think" if self.inside else "text", text[:at]))
            self.inside = not self.inside
            pieces.append(("think_start" if self.inside else "think_end", ""))
            text = text[at + len(tag) :]
        return pieces

    def flush(self) -> list[tuple[str, str]]:
        held, self._held = self._held, ""
        return [("think" if self.inside else "text", held)] if held else []


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could be the start of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class _Call:
    __slots__ = ("id", "name", "arguments", "output_index", "frames")

    def __init__(self, call_id: str, name: str, output_index: int) -> None:
        self.id = call_id
        self.name = name
        self.arguments: list[str] = []
        self.output_index = output_index
        self.frames = DeltaFrames("response.function_call_arguments.delta", call_id, output_index, 0)


class ResponsesStream:
    """Chat chunks in, Responses event frames out. Owns sequence numbers and item ids."""

    def __init__(
        self,
        req: ResponsesRequest,
        *,
        model: str | None,
        parser: bool,
        continued: bool = False,
        max_text: int | None = None,
    ) -> None:
        """`max_text`: the characters of output (text, reasoning, refusal, tool arguments) it keeps
        for its last events at most; past it the stream fails (`UpstreamError`)."""
        self.req = req
        self.model = model
        self.parser = parser
        self.continued = continued
        self.id = new_id("resp")
        self.seq = 0
        self.frames: list[bytes] = []
        self.output_count = 0
        self.kind: str | None = None  # the open item: "reasoning", "message", "call"
        self.splitter = ThinkSplitter() if parser else None
        # What the final Response is built from: the same fields a non-streamed reply carries.
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.refusal: list[str] = []
        self.calls: dict[int, _Call] = {}
        self.finish_reason: str | None = None
        self.usage: Usage | None = None
        self.created: float = 0
        # The open reasoning / message item.
        self.reasoning_id: str | None = None
        self.reasoning_index = 0
        self.summary_index = -1
        self.summary: list[str] = []
        self.summaries: list[str] = []
        self.message_id: str | None = None
        self.message_index = 0
        self.text: list[str] = []
        self.text_part = -1
        self.refusal_part = -1
        self.refusal_text: list[str] = []
        self.open_call: _Call | None = None
        self.names: NamespaceMap | None = None  # the request's namespace tools, read at the first call
        # The delta frames of the open summary, text and refusal parts (made as each part opens).
        self.summary_frames: DeltaFrames
        self.text_frames: DeltaFrames
        self.refusal_frames: DeltaFrames
        self.reasoning_id_first: str | None = None
        self.message_id_first: str | None = None
        # Training mode: what the chunks carried about tokens (spec 9.3, assembled as one reply).
        self.prompt_token_ids: Any = None
        self.token_ids: list[int] | None = None
        self.logprobs: list[Any] | None = None
        self.max_text = max_text
        self.kept = 0  # characters of output kept so far, against `max_text`
        self.ended = False  # never early: an in-stream error fails the stream
        self.final: Response | None = None  # the terminal Response, once finished

    # --- public ------------------------------------------------------------------------

    def start(self) -> bytes:
        """`response.created` and `response.in_progress`."""
        snapshot = self._snapshot("in_progress")
        self._emit(ResponseEvent("response.created", 0, snapshot))
        self._emit(ResponseEvent("response.in_progress", 0, snapshot))
        return self._take()

    def payload(self, payload: bytes) -> bytes:
        """Events for one upstream SSE payload; vLLM's in-stream error is an `UpstreamError`."""
        chunk = CHUNK_DECODER.decode(payload)
        if chunk.error is not None:
            raise UpstreamError(chunk_error(chunk.error))
        return self.feed(chunk)

    def feed(self, chunk: ChatChunk) -> bytes:
        """Events for one upstream chunk (often a single text delta)."""
        if chunk.created and not self.created:
            self.created = chunk.created
        if chunk.usage is not None:
            self.usage = chunk.usage
        if chunk.prompt_token_ids is not None:
            self.prompt_token_ids = chunk.prompt_token_ids
        for choice in chunk.choices:
            if choice.index != 0:
                continue
            if choice.token_ids is not None:  # extended in place: a long stream is not copied per chunk
                if self.token_ids is None:
                    self.token_ids = []
                self.token_ids.extend(choice.token_ids)
            if choice.logprobs is not None:
                content = choice.logprobs.get("content") if isinstance(choice.logprobs, dict) else None
                if self.logprobs is None:
                    self.logprobs = []
                self.logprobs.extend(content if isinstance(content, list) else [content])
            delta = choice.delta
            if self.max_text is not None:
                self._keep(delta)
            reasoning = delta.reasoning or delta.reasoning_content
            if reasoning:
                if not self.parser:
                    raise UpstreamError(NO_PARSER)
                if self.continued:  # a continued turn's reasoning is plain text (spec 7.1)
                    self.content.append(reasoning)
                    self._text(reasoning)
                else:
                    self.reasoning.append(reasoning)
                    self._think(reasoning, new_block=not self.reasoning_id or self.kind != "reasoning")
            content = delta.content
            if content:
                self.content.append(content)
                splitter = self.splitter
                if splitter is None:
                    self._text(content)
                elif splitter.clear(content):  # most tokens: no tag, nor part of one
                    if splitter.inside:
                        self._think(content, new_block=False)
                    else:
                        self._text(content)
                else:
                    self._split(splitter.feed(content))
            if delta.refusal:
                self.refusal.append(delta.refusal)
                self._refusal(delta.refusal)
            if delta.tool_calls:
                for call in delta.tool_calls:
                    self._tool_call(call)
            if choice.finish_reason is not None:
                self.finish_reason = choice.finish_reason
        return self._take()

    def keep(self) -> None:
        """What `partial` needs is kept anyway."""

    def partial(self) -> tuple[str, str, int] | None:
        """The answer text and finished reasoning so far, and the deltas that carried them, for a
        continuation (`convert.continuation`); None when it cannot be continued: a tool call, a
        refusal, or reasoning still open."""
        if self.calls or self.refusal or self.continued:
            return None
        content, reasoning = "".join(self.content), "".join(self.reasoning)
        if reasoning and not content:
            return None
        return content, reasoning, len(self.content) + len(self.reasoning)

    def _keep(self, delta: Any) -> None:
        """Count what `delta` adds to what this stream keeps: its last events repeat the whole output
        (some ten copies in all, with the final Response), so a reply's size is bounded here."""
        kept = self.kept + len(delta.content or "") + len(delta.reasoning or delta.reasoning_content or "")
        kept += len(delta.refusal or "")
        for call in delta.tool_calls or ():
            function = call.get("function") if isinstance(call, dict) else None
            arguments = function.get("arguments") if isinstance(function, dict) else None
            if isinstance(arguments, str):
                kept += len(arguments)
        self.kept = kept
        if self.max_text is not None and kept > self.max_text:
            raise UpstreamError(
                f"the reply is over {self.max_text} characters, the most a Responses stream keeps for its "
                "last events (a sixteenth of limits.max_reply_size)"
            )

    def token_reply(self) -> dict[str, Any]:
        """The token fields the stream carried, shaped like a non-streamed reply for `tokens.from_reply`."""
        choice: dict[str, Any] = {"message": {}, "token_ids": self.token_ids}
        if self.logprobs is not None:
            choice["logprobs"] = {"content": self.logprobs}
        return {"prompt_token_ids": self.prompt_token_ids, "choices": [choice]}

    def finish(self, tokens: TokenInfo | None = None) -> bytes:
        """Close every item and end with `response.completed` (or `.incomplete`); sets `final`."""
        if self.splitter is not None:
            self._split(self.splitter.flush())
        completion = ChatCompletion(
            id="",
            created=self.created or time.time(),
            model=self.model,
            choices=[Choice(message=self._message(), finish_reason=self.finish_reason)],
            usage=self.usage,
        )
        final = to_response(completion, self.req, model=self.model, parser=self.parser, continued=self.continued)
        final.id = self.id
        if tokens is not None:
            attach_tokens(final, tokens)
        if self.message_id_first is None and any(isinstance(i, MessageItem) for i in final.output):
            self._open_message()  # an empty answer still gets its (empty) message item
        self._close()
        self._align_ids(final)
        kind = "response.incomplete" if final.status == "incomplete" else "response.completed"
        self._emit(ResponseEvent(kind, 0, final))
        self.final = final
        return self._take()

    def fail(self, message: str) -> bytes:
        """End the stream with `response.failed` (after closing whatever was open)."""
        self._close()
        failed = self._snapshot("failed")
        failed.error = ResponseError(code="server_error", message=message)
        self._emit(ResponseEvent("response.failed", 0, failed))
        return self._take()

    def answer_locally(self, finish_reason: str) -> bytes:
        """The whole stream of an empty answer made without vLLM (context overflow, blocked turn)."""
        frames = self.start()
        frames += self.feed(ChatChunk(created=int(time.time()), choices=[ChunkChoice(finish_reason=finish_reason)]))
        return frames + self.finish()

    # --- accumulation ------------------------------------------------------------------

    def _message(self) -> AssistantMessage:
        calls = [
            ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments="".join(c.arguments)))
            for _, c in sorted(self.calls.items())
        ]
        content = "".join(self.content)
        reasoning = "".join(self.reasoning)
        return AssistantMessage(
            content=content or None,
            reasoning=reasoning or None,
            refusal="".join(self.refusal) or None,
            tool_calls=calls or None,
        )

    def _align_ids(self, final: Response) -> None:
        """The final items keep the ids their streamed events used."""
        for item in final.output:
            if isinstance(item, ReasoningItem) and self.reasoning_id_first:
                item.id = self.reasoning_id_first
            elif isinstance(item, MessageItem) and self.message_id_first:
                item.id = self.message_id_first

    # --- items -------------------------------------------------------------------------

    def _split(self, pieces: list[tuple[str, str]]) -> None:
        for kind, text in pieces:
            if kind == "text":
                self._text(text)
            elif kind == "think":
                self._think(text, new_block=False)
            elif kind == "think_start":
                self._think("", new_block=True)

    def _think(self, text: str, *, new_block: bool) -> None:
        if self.kind != "reasoning":
            self._close()
            self.kind = "reasoning"
            self.reasoning_id = new_id("rs")
            self.reasoning_id_first = self.reasoning_id_first or self.reasoning_id
            self.reasoning_index = self._next_index()
            self.summary_index = -1
            self.summaries = []
            self._emit(
                ItemEvent(
                    "response.output_item.added",
                    0,
                    self.reasoning_index,
                    ReasoningItem(id=self.reasoning_id, summary=[]),
                )
            )
            new_block = True
        if new_block:
            rid = self.reasoning_id
            assert rid is not None  # set when the reasoning item opened, above
            self._end_summary()
            self.summary_index += 1
            self.summary = []
            self.summary_frames = DeltaFrames(
                "response.reasoning_summary_text.delta", rid, self.reasoning_index, self.summary_index
            )
            self._emit(
                SummaryPartEvent(
                    "response.reasoning_summary_part.added",
                    0,
                    rid,
                    self.reasoning_index,
                    self.summary_index,
                    SummaryText(text=""),
                )
            )
        if text:
            self.summary.append(text)
            self._delta(self.summary_frames, text)

    def _end_summary(self) -> None:
        if self.summary_index < 0:
            return
        text = "".join(self.summary)
        rid, index, part = self.reasoning_id, self.reasoning_index, self.summary_index
        assert rid is not None
        self._emit(SummaryDone("response.reasoning_summary_text.done", 0, rid, index, part, text))
        self._emit(
            SummaryPartEvent("response.reasoning_summary_part.done", 0, rid, index, part, SummaryText(text=text))
        )
        self.summaries.append(text)
        self.summary = []

    def _open_message(self) -> None:
        self._close()
        self.kind = "message"
        self.message_id = new_id("msg")
        self.message_id_first = self.message_id_first or self.message_id
        self.message_index = self._next_index()
        self.text = []
        self.text_part = self.refusal_part = -1
        self.refusal_text = []
        item = MessageItem(id=self.message_id, content=[], status="in_progress")
        self._emit(ItemEvent("response.output_item.added", 0, self.message_index, item))

    def _text(self, text: str) -> None:
        if not text:
            return
        if self.kind != "message":
            self._open_message()
        assert self.message_id is not None
        if self.text_part < 0:
            self.text_part = 1 if self.refusal_part >= 0 else 0
            self.text_frames = DeltaFrames(
                "response.output_text.delta", self.message_id, self.message_index, self.text_part
            )
            part = OutputText(text="")
            self._emit(
                ContentPartEvent(
                    "response.content_part.added", 0, self.message_id, self.message_index, self.text_part, part
                )
            )
        self.text.append(text)
        self._delta(self.text_frames, text)

    def _refusal(self, text: str) -> None:
        if self.kind != "message":
            self._open_message()
        assert self.message_id is not None
        if self.refusal_part < 0:
            self.refusal_part = 1 if self.text_part >= 0 else 0
            self.refusal_frames = DeltaFrames(
                "response.refusal.delta", self.message_id, self.message_index, self.refusal_part
            )
            part = Refusal(refusal="")
            self._emit(
                ContentPartEvent(
                    "response.content_part.added", 0, self.message_id, self.message_index, self.refusal_part, part
                )
            )
        self.refusal_text.append(text)
        self._delta(self.refusal_frames, text)

    def _tool_call(self, fragment: dict[str, Any]) -> None:
        index = fragment.get("index", 0)
        function = fragment.get("function") or {}
        call = self.calls.get(index)
        if call is None:
            self._close()
            call = _Call(fragment.get("id") or new_id("call"), function.get("name") or "", self._next_index())
            self.calls[index] = call
            self.kind = "call"
            self.open_call = call
            if self.names is None:
                self.names = namespace_map(self.req.tools)
            name, namespace = shown(call.name, self.names)
            item = FunctionCallItem(
                arguments="", call_id=call.id, name=name, id=call.id, status="in_progress", namespace=namespace
            )
            self._emit(ItemEvent("response.output_item.added", 0, call.output_index, item))
        elif function.get("name") and not call.name:
            call.name = function["name"]
        arguments = function.get("arguments")
        if arguments:
            call.arguments.append(arguments)
            self._delta(call.frames, arguments)

    def _close(self) -> None:
        """Emit the `.done` events of the open item."""
        kind, self.kind = self.kind, None
        if kind == "reasoning":
            assert self.reasoning_id is not None
            self._end_summary()
            item = ReasoningItem(id=self.reasoning_id, summary=[SummaryText(text=t) for t in self.summaries])
            self._emit(ItemEvent("response.output_item.done", 0, self.reasoning_index, item))
        elif kind == "message":
            assert self.message_id is not None
            mid, index = self.message_id, self.message_index
            parts: list[tuple[int, OutputText | Refusal]] = []
            if self.text_part < 0 and self.refusal_part < 0:  # an empty answer still has one (empty) output_text
                self.text_part = 0
                self._emit(ContentPartEvent("response.content_part.added", 0, mid, index, 0, OutputText(text="")))
            if self.text_part >= 0:
                text = "".join(self.text)
                self._emit(TextDone("response.output_text.done", 0, mid, index, self.text_part, text))
                self._emit(
                    ContentPartEvent("response.content_part.done", 0, mid, index, self.text_part, OutputText(text=text))
                )
                parts.append((self.text_part, OutputText(text=text)))
            if self.refusal_part >= 0:
                refusal = "".join(self.refusal_text)
                self._emit(RefusalDone("response.refusal.done", 0, mid, index, self.refusal_part, refusal))
                self._emit(
                    ContentPartEvent(
                        "response.content_part.done", 0, mid, index, self.refusal_part, Refusal(refusal=refusal)
                    )
                )
                parts.append((self.refusal_part, Refusal(refusal=refusal)))
            content = [part for _, part in sorted(parts, key=lambda p: p[0])]  # in content_index order
            self._emit(ItemEvent("response.output_item.done", 0, index, MessageItem(id=mid, content=content)))
        elif kind == "call":
            call = self.open_call
            assert call is not None
            arguments = "".join(call.arguments)
            name, namespace = shown(call.name, self.names or {})
            self._emit(
                ArgumentsDone("response.function_call_arguments.done", 0, call.id, call.output_index, name, arguments)
            )
            call_item = FunctionCallItem(
                arguments=arguments, call_id=call.id, name=name, id=call.id, namespace=namespace
            )
            self._emit(ItemEvent("response.output_item.done", 0, call.output_index, call_item))

    # --- plumbing ----------------------------------------------------------------------

    def _next_index(self) -> int:
        self.output_count += 1
        return self.output_count - 1

    def _snapshot(self, status: str) -> Response:
        return Response(
            id=self.id, created_at=time.time(), model=self.model, output=[], status=status, **echo(self.req)
        )

    def _emit(self, event: Event) -> None:
        event.sequence_number = self.seq  # type: ignore[attr-defined]
        self.seq += 1
        self.frames.append(encode_event(event))

    def _delta(self, part: DeltaFrames, delta: str) -> None:
        self.frames.append(part.frame(self.seq, delta))
        self.seq += 1

    def _take(self) -> bytes:
        frames, self.frames = self.frames, []
        return b"".join(frames)


class ChatReasoningFolder:
    """Rewrites chat chunks so reasoning deltas arrive as `<think>...</think>` content (spec 7.1)."""

    def __init__(self, *, continued: bool) -> None:
        self.continued = continued
        self.open: set[int] = set()  # choice indexes inside an unclosed <think>

    def needed(self, payload: bytes) -> bool:
        return bool(self.open) or has_reasoning(payload)

    def fold(self, payload: bytes) -> bytes:
        chunk = orjson.loads(payload)
        changed = False
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta")
            if not isinstance(delta, dict):
                continue
            index = choice.get("index", 0)
            reasoning = delta.pop("reasoning_content", None) or delta.pop("reasoning", None)
            delta.pop("reasoning", None)
            content = delta.get("content") or ""
            if reasoning:
                changed = True
                if self.continued:
                    delta["content"] = reasoning + content
                    continue
                prefix = "" if index in self.open else OPEN
                if content or choice.get("finish_reason") is not None:  # the answer starts, or the turn ends here
                    self.open.discard(index)
                    delta["content"] = prefix + reasoning + CLOSE + content
                else:
                    self.open.add(index)
                    delta["content"] = prefix + reasoning
            elif index in self.open and (content or delta.get("tool_calls") or choice.get("finish_reason") is not None):
                self.open.discard(index)
                delta["content"] = CLOSE + content
                changed = True
        return orjson.dumps(chunk) if changed else payload


class _ChunkCheck(msgspec.Struct):
    error: Any = None
    usage: Any = None  # the last chunk's, with `stream_options.include_usage`: for the token metrics


_CHUNK_CHECK = msgspec.json.Decoder(_ChunkCheck)


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: Any = None
    refusal: Any = None


class _DeltaChoice(msgspec.Struct):
    index: int = 0
    delta: _Delta | None = None


class _Deltas(msgspec.Struct):
    choices: list[_DeltaChoice] = []


_DELTAS = msgspec.json.Decoder(_Deltas)


class _Kept:
    """A chat stream's first choice so far: its text, its reasoning, and whether anything else came."""

    __slots__ = ("content", "reasoning", "other")

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.other = False  # a tool call, a refusal, or a chunk that does not decode

    def add(self, payload: bytes) -> None:
        try:
            chunk = _DELTAS.decode(payload)
        except msgspec.DecodeError:
            self.other = True
            return
        for choice in chunk.choices:
            delta = choice.delta
            if choice.index != 0 or delta is None:
                continue
            if delta.content:
                self.content.append(delta.content)
            if delta.reasoning or delta.reasoning_content:
                self.reasoning.append(delta.reasoning or delta.reasoning_content or "")
            if delta.tool_calls or delta.refusal:
                self.other = True


class ChatStream:
    """vLLM's chat stream relayed to a chat client, frame by frame; reasoning folded when the parser runs.

    Payloads are checked for JSON and an in-stream error only, never built into objects, unless
    reasoning must be folded. vLLM's own error chunk is relayed as it is and ends the stream.
    `reasoning`: the chunks come from vLLM's chat API and may carry its reasoning fields (the
    completions backend's chunks never do).
    """

    def __init__(self, *, model: str | None, parser: bool, continued: bool, reasoning: bool = True) -> None:
        self.model = model
        self.folder = ChatReasoningFolder(continued=continued) if parser and reasoning else None
        self.refuse_reasoning = reasoning and not parser
        self.ended = False  # vLLM sent its error chunk: [DONE] is all that may follow
        self.usage: Any = None
        self.kept: _Kept | None = None  # what `partial` needs, once asked to `keep` it

    def start(self) -> bytes:
        return b""

    def keep(self) -> None:
        """Keep what the stream generates (text, reasoning, whether a tool call began) for `partial`."""
        self.kept = _Kept()

    def partial(self) -> tuple[str, str, int] | None:
        """See `ResponsesStream.partial`; None unless `keep` was called before the first payload."""
        kept = self.kept
        if kept is None or kept.other or (kept.reasoning and not kept.content):
            return None
        return "".join(kept.content), "".join(kept.reasoning), len(kept.content) + len(kept.reasoning)

    def payload(self, payload: bytes) -> bytes:
        if self.kept is not None:
            self.kept.add(payload)
        checked = _CHUNK_CHECK.decode(payload)
        if checked.usage is not None:
            self.usage = checked.usage
        if checked.error is not None:
            self.ended = True
        elif self.folder is not None:
            if self.folder.needed(payload):
                payload = self.folder.fold(payload)
        elif self.refuse_reasoning and has_reasoning(payload):
            raise UpstreamError(NO_PARSER)
        return b"data: " + payload + b"\n\n"

    def finish(self, tokens: TokenInfo | None = None) -> bytes:
        return DONE_FRAME

    def fail(self, message: str) -> bytes:
        error = {"error": {"message": message, "type": "upstream_error", "param": None, "code": 502}}
        return b"data: " + ENCODER.encode(error) + b"\n\n" + DONE_FRAME

    def answer_locally(self, finish_reason: str) -> bytes:
        """The chat stream of an empty answer: a role chunk, a finish chunk, `[DONE]`."""
        body = empty_completion(self.model, finish_reason)
        base = {"id": body["id"], "object": "chat.completion.chunk", "created": body["created"], "model": self.model}
        first = {
            **base,
            "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            ],
        }
        last = {**base, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish_reason}]}
        return b"data: " + ENCODER.encode(first) + b"\n\ndata: " + ENCODER.encode(last) + b"\n\n" + DONE_FRAME


def chunk_error(error: Any) -> str:
    """The message of vLLM's in-stream error chunk."""
    if isinstance(error, dict):
        return f"the upstream reported an error mid-stream: {error.get('message') or error}"
    return f"the upstream reported an error mid-stream: {error}"
