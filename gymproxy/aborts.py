"""A weight-update pause's abort, as it shows in vLLM's replies: a whole reply whose choice finished
`"abort"` (`aborted`), and a stream's abort chunk (`Cut`), watched for as the stream is relayed
(`relay_watching`) so that the stream can be continued after the resume (`exchange.py`).
"""

from __future__ import annotations

from collections.abc import Callable

import orjson

from .client_stream import Payloads, SSEWriter
from .http1 import Reply

ABORT = b'"abort"'  # in a reply a pause cut: its finish_reason


def aborted(payload: bytes) -> bool:
    """Whether a whole chat or completions reply was cut by a pause: a choice finished "abort"."""
    try:
        choices = orjson.loads(payload).get("choices")
    except (orjson.JSONDecodeError, AttributeError):
        return False
    return isinstance(choices, list) and any(isinstance(c, dict) and c.get("finish_reason") == "abort" for c in choices)


async def relay_watching(
    reply: Reply, payloads: Payloads, feed: Callable[[bytes], bytes], out: list[bytes], writer: SSEWriter
) -> Cut | None:
    """`_translate`'s relay loop, watching for the chunk of a pause's abort: what follows it is kept,
    not fed (the caller continues the stream, or feeds them). The cut, or None if none came."""
    cut: Cut | None = None
    async for data in reply.iter_any():
        for payload in payloads.feed(data):
            if cut is not None:
                cut.rest.append(payload)  # what vLLM sends after the cut: usage, [DONE]
            elif ABORT not in payload or (cut := Cut.of(payload)) is None:
                out.append(feed(payload))
        if out:
            frames = out[0] if len(out) == 1 else b"".join(out)
            out.clear()
            await writer.write(frames)
    return cut


class Cut:
    """A stream's chunk that says a pause cut it (`finish_reason: "abort"`), and what followed it."""

    __slots__ = ("payload", "text", "rest")

    def __init__(self, payload: bytes, text: bytes | None) -> None:
        self.payload = payload
        self.text = text  # the chunk without its finish reason, when it carried text too
        self.rest: list[bytes] = []

    @classmethod
    def of(cls, payload: bytes) -> Cut | None:
        """The cut, if `payload` is vLLM's abort chunk (first choice finished "abort")."""
        try:
            chunk = orjson.loads(payload)
            choice = chunk["choices"][0]
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
            return None
        if not isinstance(choice, dict) or choice.get("finish_reason") != "abort":
            return None
        delta = choice.get("delta")
        text = None
        if isinstance(delta, dict) and any(delta.get(k) for k in ("content", "reasoning", "reasoning_content")):
            choice["finish_reason"] = None
            text = orjson.dumps(chunk)
        return cls(payload, text)

    def tokens(self) -> int | None:
        """The tokens it generated, from the usage chunk vLLM sends after it (when asked for)."""
        for payload in self.rest:
            try:
                usage = orjson.loads(payload).get("usage")
            except (orjson.JSONDecodeError, AttributeError):
                continue
            if isinstance(usage, dict) and type(usage.get("completion_tokens")) is int:
                return int(usage["completion_tokens"])
        return None
