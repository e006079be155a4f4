"""Tests for gymproxy.sse: every framing, every chunk boundary, and the buffer limit."""

from __future__ import annotations

import random

import pytest

from gymproxy.sse import DONE, SSEDecoder, SSEError


# A vLLM chat stream as it comes off the wire (Hermes tool parser, reasoning parser, usage on):
# role chunk, reasoning deltas, content deltas (one with UTF-8 text), a tool call, the finish
# chunk, the usage chunk and [DONE].
def _chunk(rest: bytes) -> bytes:
    return (
        b'{"id":"chatcmpl-b6e2a1f0c4d8","object":"chat.completion.chunk","created":1767225600,'
        b'"model":"Qwen/Qwen3-0.6B",' + rest + b"}"
    )


def _delta(delta: bytes, finish: bytes = b"null") -> bytes:
    return _chunk(b'"choices":[{"index":0,"delta":' + delta + b',"logprobs":null,"finish_reason":' + finish + b"}]")


VLLM_PAYLOADS = [
    _chunk(
        b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],'
        b'"prompt_token_ids":null'
    ),
    _delta(b'{"reasoning":"The user wants"}'),
    _delta(b'{"reasoning":" the weather in Paris."}'),
    _delta(b'{"content":"Checking \\"Paris\\" \xc3\xa9t\xc3\xa9"}'),
    _delta(b'{"content":".\\n\\n"}'),
    _delta(
        b'{"tool_calls":[{"index":0,"id":"chatcmpl-tool-8e1f0b2a","type":"function",'
        b'"function":{"name":"get_weather","arguments":"{\\"city\\": "}}]}'
    ),
    _delta(b'{"tool_calls":[{"index":0,"function":{"arguments":"\\"Paris\\"}"}}]}'),
    _delta(b"{}", finish=b'"tool_calls","stop_reason":null'),
    _chunk(b'"choices":[],"usage":{"prompt_tokens":152,"total_tokens":201,"completion_tokens":49}'),
    DONE,
]

EOLS = {"lf": b"\n", "crlf": b"\r\n", "cr": b"\r"}


def _vllm_stream(eol: bytes) -> bytes:
    return b"".join(b"data: " + payload + eol + eol for payload in VLLM_PAYLOADS)


VLLM_STREAMS = {name: _vllm_stream(eol) for name, eol in EOLS.items()}

# Everything else the parsing rules cover, one event per line of this table.
_FEATURES = [
    (b": keep-alive\n\n", None),  # a comment-only event dispatches nothing
    (b'event: message\nid: 7\nretry: 1000\ndata: {"a":1}\n\n', b'{"a":1}'),
    (b"data:no-space\n\n", b"no-space"),
    (b"data:  two spaces\n\n", b" two spaces"),  # only one space is stripped ...
    (b"event: e\ndata:  two\ndata:   three\n\n", b" two\n  three"),  # ... on every line
    (b"data: line1\ndata: line2\ndata:\ndata: line4\n\n", b"line1\nline2\n\nline4"),
    (b"data\n\n", b""),  # no colon: an empty data field, still an event
    (b"data:\n\n", b""),
    (b"id: 8\nevent: ping\n\n", None),  # no data line: nothing
    (b"foo: bar\ndata: x: y\n\n", b"x: y"),  # unknown field ignored; later colons belong to the value
    (b"Data: no\ndata : no\n datum: no\n\n", None),  # field names are exact
    (b"\n\n\n", None),  # extra blank lines between events
    (b"data: a\n: comment inside\ndata: b\n\n", b"a\nb"),
    (b"data: [DONE]\n\n", DONE),
]
FEATURE_EXPECTED = [payload for _, payload in _FEATURES if payload is not None]
FEATURE_STREAMS = {name: b"".join(raw for raw, _ in _FEATURES).replace(b"\n", eol) for name, eol in EOLS.items()}
# Line endings may be mixed within one stream.
FEATURE_STREAMS["mixed"] = b"".join(
    raw.replace(b"\n", (b"\r\n", b"\r", b"\n")[i % 3]) for i, (raw, _) in enumerate(_FEATURES)
)


def _cuts(streams: dict[str, bytes]) -> range:
    """Every cut point of the longest stream (cuts past a shorter stream's end split it at its end)."""
    return range(max(map(len, streams.values())) + 1)


def _in_two(raw: bytes, cut: int) -> list[bytes]:
    dec = SSEDecoder()
    return dec.feed(raw[:cut]) + dec.feed(raw[cut:]) + dec.flush()


def _byte_by_byte(raw: bytes) -> list[bytes]:
    dec = SSEDecoder()
    out = [payload for i in range(len(raw)) for payload in dec.feed(raw[i : i + 1])]
    return out + dec.flush()


# One test per cut point, each checking every framing (one test id per framing and cut would
# mean ~8,000 tests and most of the run time spent in pytest itself).
@pytest.mark.parametrize("cut", _cuts(VLLM_STREAMS))
def test_vllm_stream_split_anywhere(cut: int) -> None:
    for framing, raw in VLLM_STREAMS.items():
        assert _in_two(raw, cut) == VLLM_PAYLOADS, framing


@pytest.mark.parametrize("framing", VLLM_STREAMS)
def test_vllm_stream_byte_by_byte(framing: str) -> None:
    assert _byte_by_byte(VLLM_STREAMS[framing]) == VLLM_PAYLOADS


@pytest.mark.parametrize("framing", VLLM_STREAMS)
def test_vllm_stream_in_one_chunk_needs_no_flush(framing: str) -> None:
    dec = SSEDecoder()
    assert dec.feed(VLLM_STREAMS[framing]) == VLLM_PAYLOADS
    assert dec.flush() == []


@pytest.mark.parametrize("framing", VLLM_STREAMS)
def test_vllm_stream_event_per_chunk(framing: str) -> None:
    """The hot path: each network chunk is exactly one event; each feed returns it at once."""
    eol = EOLS[framing]
    dec = SSEDecoder()
    for payload in VLLM_PAYLOADS:
        assert dec.feed(b"data: " + payload + eol + eol) == [payload]
    assert dec.flush() == []


@pytest.mark.parametrize("cut", _cuts(FEATURE_STREAMS))
def test_parsing_rules_split_anywhere(cut: int) -> None:
    for framing, raw in FEATURE_STREAMS.items():
        assert _in_two(raw, cut) == FEATURE_EXPECTED, framing


@pytest.mark.parametrize("framing", FEATURE_STREAMS)
def test_parsing_rules_byte_by_byte(framing: str) -> None:
    assert _byte_by_byte(FEATURE_STREAMS[framing]) == FEATURE_EXPECTED


@pytest.mark.parametrize("seed", range(50))
def test_random_chunking(seed: int) -> None:
    rng = random.Random(seed)
    raw = VLLM_STREAMS[rng.choice(list(EOLS))] + FEATURE_STREAMS["mixed"]
    cuts = sorted(rng.sample(range(len(raw) + 1), rng.randint(1, 40)))
    dec = SSEDecoder()
    out = [p for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True) for p in dec.feed(raw[a:b])]
    assert out + dec.flush() == VLLM_PAYLOADS + FEATURE_EXPECTED


@pytest.mark.parametrize(("raw", "expected"), _FEATURES)
def test_each_rule(raw: bytes, expected: bytes | None) -> None:
    assert SSEDecoder().feed(raw) == ([] if expected is None else [expected])


def test_payloads_are_bytes() -> None:
    dec = SSEDecoder()
    payloads = dec.feed(b"data: fast\n\ndata:slow\r\n\r\ndata: a\n") + dec.flush()
    assert payloads == [b"fast", b"slow", b"a"]
    assert [type(p) for p in payloads] == [bytes, bytes, bytes]


def test_crlf_split_across_chunks_ends_one_line_only() -> None:
    dec = SSEDecoder()
    assert dec.feed(b"data: a\r") == []
    # If the LF counted as a second line end it would be a blank line and dispatch "a" alone.
    assert dec.feed(b"\ndata: b\r\n\r\n") == [b"a\nb"]


def test_crlf_split_survives_an_empty_chunk() -> None:
    dec = SSEDecoder()
    assert dec.feed(b"data: a\r") == []
    assert dec.feed(b"") == []
    assert dec.feed(b"\n") == []
    assert dec.feed(b"\r\n") == [b"a"]


def test_cr_then_cr_is_a_blank_line() -> None:
    dec = SSEDecoder()
    assert dec.feed(b"data: a\r") == []
    assert dec.feed(b"\r") == [b"a"]


def test_lone_lf_after_cr_chunk_only_swallowed_once() -> None:
    dec = SSEDecoder()
    assert dec.feed(b"data: a\r") == []
    assert dec.feed(b"\n") == []  # the LF of the CRLF
    assert dec.feed(b"\n") == [b"a"]  # a real blank line


def test_events_completed_by_a_later_chunk() -> None:
    dec = SSEDecoder()
    assert dec.feed(b"data: a\n") == []
    assert dec.feed(b"data: b") == []
    assert dec.feed(b"\n") == []
    assert dec.feed(b"\ndata: c\n\ndata: d") == [b"a\nb", b"c"]
    assert dec.flush() == [b"d"]


def test_one_line_chunk_continues_a_pending_event() -> None:
    dec = SSEDecoder()
    assert dec.feed(b"data: a\n") == []
    assert dec.feed(b"data: b\n\n") == [b"a\nb"]


def test_chunk_with_one_line_and_the_start_of_the_next() -> None:
    dec = SSEDecoder()
    assert dec.feed(b"data: a\nd") == []
    assert dec.feed(b"ata: b\n\n") == [b"a\nb"]


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b"data: a\r\n\n", [b"a"]),  # CRLF then LF
        (b"data: a\rb\n\n", [b"a"]),  # the CR ends the data line; `b` is an unknown field
        (b"data: a\rdata: b\n\n", [b"a\nb"]),
    ],
)
def test_cr_inside_a_single_event_chunk(raw: bytes, expected: list[bytes]) -> None:
    assert SSEDecoder().feed(raw) == expected


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b"data: [DONE]", [DONE]),  # no line end at all
        (b"data: a\n", [b"a"]),
        (b"data: a\r\n", [b"a"]),
        (b"data: a\r", [b"a"]),
        (b"data: a\ndata: b", [b"a\nb"]),
        (b"data: a\n\ndata: b", [b"a", b"b"]),
        (b"data", [b""]),
        (b"", []),
        (b": ping", []),
        (b"event: x\n", []),
    ],
)
def test_flush_dispatches_an_unterminated_final_event(raw: bytes, expected: list[bytes]) -> None:
    dec = SSEDecoder()
    assert dec.feed(raw) + dec.flush() == expected


def test_flush_resets_the_decoder() -> None:
    dec = SSEDecoder()
    assert dec.feed(b"data: a") == []
    assert dec.flush() == [b"a"]
    assert dec.flush() == []
    assert dec.feed(b"\n\ndata: b\n\n") == [b"b"]


# --- the buffer limit ---

LIMIT = 64


def _event(size: int) -> bytes:
    """An event of exactly `size` bytes, followed by the blank line that ends it."""
    return b"data: " + b"x" * (size - 6) + b"\n\n"


@pytest.mark.parametrize("cut", range(len(_event(LIMIT)) + 1))
def test_event_of_exactly_max_size_passes(cut: int) -> None:
    dec = SSEDecoder(max_event_size=LIMIT)
    raw = _event(LIMIT)
    assert dec.feed(raw[:cut]) + dec.feed(raw[cut:]) == [b"x" * (LIMIT - 6)]


@pytest.mark.parametrize("cut", range(len(_event(LIMIT + 1)) + 1))
def test_event_one_byte_over_max_size_raises(cut: int) -> None:
    dec = SSEDecoder(max_event_size=LIMIT)
    raw = _event(LIMIT + 1)
    with pytest.raises(SSEError, match="max_event_size=64"):
        dec.feed(raw[:cut])
        dec.feed(raw[cut:])


def test_max_size_byte_by_byte() -> None:
    assert _byte_by_byte(_event(LIMIT)) == [b"x" * (LIMIT - 6)]  # default limit
    dec = SSEDecoder(max_event_size=LIMIT)
    raw = _event(LIMIT + 1)
    with pytest.raises(SSEError):
        for i in range(len(raw)):
            dec.feed(raw[i : i + 1])
    assert i == LIMIT  # raised as soon as the 65th byte arrived, before any blank line


@pytest.mark.parametrize("step", [1, 2, 7, LIMIT + 1])
def test_max_size_events_back_to_back_in_small_chunks(step: int) -> None:
    """The size count starts again with each event, however the chunks fall."""
    raw = _event(LIMIT) * 5
    dec = SSEDecoder(max_event_size=LIMIT)
    out = [p for i in range(0, len(raw), step) for p in dec.feed(raw[i : i + step])]
    assert out == [b"x" * (LIMIT - 6)] * 5


def test_max_size_counts_crlf_as_one_byte() -> None:
    dec = SSEDecoder(max_event_size=LIMIT)
    line = b"data: " + b"x" * 26  # two lines of 32 bytes, joined by one line end: 65 bytes
    assert dec.feed(line + b"\r\n" + line[:-1] + b"\r\n\r\n") == [b"x" * 26 + b"\n" + b"x" * 25]
    with pytest.raises(SSEError):
        dec.feed(line + b"\r\n" + line + b"\r\n\r\n")


def test_max_size_is_per_event_not_per_stream() -> None:
    dec = SSEDecoder(max_event_size=LIMIT)
    assert dec.feed(_event(LIMIT) * 100) == [b"x" * (LIMIT - 6)] * 100


def test_a_stream_without_blank_lines_hits_the_limit() -> None:
    """An upstream that is not sending SSE cannot make the buffer grow without bound."""
    dec = SSEDecoder(max_event_size=1000)
    with pytest.raises(SSEError, match="blank line"):
        for _ in range(1000):
            dec.feed(b'{"not": "sse"}\n')


def test_sse_error_is_a_value_error() -> None:
    assert issubclass(SSEError, ValueError)


@pytest.mark.parametrize("size", [0, -1])
def test_max_event_size_must_be_positive(size: int) -> None:
    with pytest.raises(ValueError, match="max_event_size"):
        SSEDecoder(max_event_size=size)
