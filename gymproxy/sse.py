"""Incremental, sans-IO decoding of a Server-Sent-Events byte stream into event payloads.

`SSEDecoder` takes the upstream body in whatever chunks the network delivers and returns the
`data:` payload of every event those chunks complete, following the WHATWG parsing rules: lines
end with CRLF, LF or CR (a CRLF may be split across two chunks), a blank line dispatches the event,
several `data:` lines are joined with LF, one space after the colon is dropped, and comments,
`event:`, `id:`, `retry:` and unknown fields are ignored because gymproxy only needs the data.
vLLM sends one small `data: {...}\\n\\n` frame per token, so that case takes a fast path built on
bytes methods; anything else falls back to line-by-line parsing of the frame. It does no I/O and
keeps at most one unfinished event, bounded by `max_event_size`.
"""

from __future__ import annotations

from typing import Final, NoReturn

DONE: Final = b"[DONE]"
DEFAULT_MAX_EVENT_SIZE: Final = 16 * 1024 * 1024

_LF: Final = 0x0A  # b"\n"[0]
_CR: Final = 0x0D  # b"\r"[0]


class SSEError(ValueError):
    """The stream cannot be decoded within the decoder's limits."""


class SSEDecoder:
    """Feed arbitrary byte chunks; get back the `data:` payload of each complete event.

    Payloads are returned as bytes, `[DONE]` included (compare with `DONE`); an event with no
    `data` field produces nothing, while a bare `data:` produces `b""`. An event larger than
    `max_event_size` bytes (counted after line endings are normalised to LF, without the blank
    line that ends it) raises `SSEError`.
    """

    __slots__ = ("_max", "_parts", "_size", "_ends_lf", "_trailing_cr")

    def __init__(self, max_event_size: int = DEFAULT_MAX_EVENT_SIZE) -> None:
        if max_event_size < 1:
            raise ValueError(f"max_event_size must be at least 1, got {max_event_size}")
        self._max = max_event_size
        # The unfinished event, LF-normalised, kept as pieces so that a large event arriving in
        # many small chunks is joined once rather than once per chunk. It never holds b"\n\n".
        self._parts: list[bytes] = []
        self._size = 0
        self._ends_lf = False  # the last piece ends with LF: a leading LF next completes the event
        # The previous chunk ended with CR, already counted as a line end: if the next chunk
        # starts with LF, that LF is the second half of the same CRLF and must be dropped.
        self._trailing_cr = False

    def feed(self, chunk: bytes) -> list[bytes]:
        """Consume `chunk`; return the payloads of the events it completes, in order."""
        if self._trailing_cr and chunk:
            self._trailing_cr = False
            if chunk[0] == _LF:
                chunk = chunk[1:]
        # The hot path: the chunk is exactly one `data: ...` line and a blank line, LF-framed.
        # (`int in bytes` is a memchr; `b"x" in bytes` is several times slower.)
        if (
            not self._parts
            and chunk[:6] == b"data: "
            and chunk.find(b"\n") == len(chunk) - 2
            and chunk[-1] == _LF
            and _CR not in chunk
        ):
            if len(chunk) - 2 > self._max:
                self._too_large()
            return [chunk[6:-2]]
        if _CR in chunk:
            self._trailing_cr = chunk[-1] == _CR
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        if _LF not in chunk:  # no line ends here (or an empty chunk): no event can end
            if chunk:
                self._keep(chunk)
            return []
        if self._parts:
            if b"\n\n" not in chunk and not (self._ends_lf and chunk[0] == _LF):
                # Still inside the same event: keep the piece, join nothing yet.
                self._keep(chunk)
                return []
            self._parts.append(chunk)
            chunk = b"".join(self._parts)
            self._parts = []
        # Every b"\n\n" ends an event: it is a line end followed by an empty line. A frame can
        # only start with one stray LF (from a run of three), i.e. an empty line with nothing
        # pending, which dispatches nothing.
        frames = chunk.split(b"\n\n")
        rest = frames.pop()
        payloads: list[bytes] = []
        for frame in frames:
            if len(frame) > self._max:
                self._too_large()
            if frame[:6] == b"data: " and _LF not in frame:
                payloads.append(frame[6:])  # one `data: ` line
            elif frame:
                payload = _parse_frame(frame)
                if payload is not None:
                    payloads.append(payload)
        self._size = 0
        if rest:
            self._keep(rest)
        return payloads

    def flush(self) -> list[bytes]:
        """End of stream: dispatch a final event that no blank line followed, and reset."""
        frame = b"".join(self._parts)
        self._parts = []
        self._size = 0
        # `_ends_lf` and `_trailing_cr` may keep stale values: they only ever make the decoder
        # skip or notice a blank line, and a blank line with no event pending dispatches nothing.
        payload = _parse_frame(frame) if frame else None
        return [] if payload is None else [payload]

    def _keep(self, piece: bytes) -> None:
        self._parts.append(piece)
        self._size += len(piece)
        self._ends_lf = piece[-1] == _LF
        # A trailing LF may be the end of the event's last line rather than part of the event.
        if self._size - self._ends_lf > self._max:
            self._too_large()

    def _too_large(self) -> NoReturn:
        self._parts = []  # the stream is unusable now; at least free the buffer
        self._size = 0
        raise SSEError(
            f"SSE event larger than max_event_size={self._max} bytes "
            "(is the upstream sending Server-Sent Events, with a blank line after each event?)"
        )


def _parse_frame(frame: bytes) -> bytes | None:
    """The data of one LF-separated event, or None if it has no `data` field."""
    data: list[bytes] | None = None
    for line in frame.split(b"\n"):
        field, colon, value = line.partition(b":")
        if field != b"data":
            continue  # empty line, `:` comment (empty field name), event, id, retry, unknown
        if colon and value[:1] == b" ":
            value = value[1:]
        if data is None:
            data = [value]
        else:
            data.append(value)
    return None if data is None else b"\n".join(data)
