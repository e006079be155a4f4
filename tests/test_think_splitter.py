"""convert.stream.ThinkSplitter: `<think>` tags found in streamed text, also when a tag straddles chunks."""

from __future__ import annotations

import pytest

from gymproxy.convert.stream import ThinkSplitter

SPLIT_TEXTS = [
    "A<think>r</think>B",
    "<think></think>x",
    "<think>a</think><think>b</think>",
    "x</think>y",
    "plain text, no tags at all",
    "<think>unclosed reasoning",
    "<think>a<think>b</think>c",
    "<<think>>x</think></think>",
    "<thi",
    "text then <think",
    "<think>inside then </thin",
    "<th<think>e</th</think>n",
    "",
]


def _normalize(pieces: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Merge adjacent text (or think) pieces and drop empty ones: the segmentation, not the chunking."""
    out: list[tuple[str, str]] = []
    for kind, text in pieces:
        assert kind in ("text", "think", "think_start", "think_end")
        if kind in ("text", "think"):
            assert text, "an empty text/think piece"
            if out and out[-1][0] == kind:
                out[-1] = (kind, out[-1][1] + text)
                continue
        else:
            assert text == ""
        out.append((kind, text))
    return out


def _split_whole(text: str) -> list[tuple[str, str]]:
    splitter = ThinkSplitter()
    return _normalize(splitter.feed(text) + splitter.flush())


def _reference_segments(text: str) -> list[tuple[str, str]]:
    """An independent scanner: outside look for <think>, inside look for </think>; no chunking."""
    out: list[tuple[str, str]] = []
    inside = False
    while text:
        tag = "</think>" if inside else "<think>"
        at = text.find(tag)
        if at < 0:
            out.append(("think" if inside else "text", text))
            break
        if at:
            out.append(("think" if inside else "text", text[:at]))
        inside = not inside
        out.append(("think_start" if inside else "think_end", ""))
        text = text[at + len(tag) :]
    return out


@pytest.mark.parametrize("text", SPLIT_TEXTS)
def test_splitter_whole_feed_matches_reference(text):
    assert _split_whole(text) == _reference_segments(text)


def test_splitter_examples():
    assert _split_whole("A<think>r</think>B") == [
        ("text", "A"), ("think_start", ""), ("think", "r"), ("think_end", ""), ("text", "B"),
    ]  # fmt: skip
    assert _split_whole("<think></think>x") == [("think_start", ""), ("think_end", ""), ("text", "x")]
    assert _split_whole("x</think>y") == [("text", "x</think>y")]  # a stray close is text
    assert _split_whole("<think>a</think><think>b</think>") == [
        ("think_start", ""), ("think", "a"), ("think_end", ""), ("think_start", ""), ("think", "b"), ("think_end", ""),
    ]  # fmt: skip


@pytest.mark.parametrize("text", SPLIT_TEXTS)
def test_splitter_any_two_feeds_equal_one_feed(text):
    expected = _split_whole(text)
    for cut in range(len(text) + 1):
        splitter = ThinkSplitter()
        pieces = splitter.feed(text[:cut]) + splitter.feed(text[cut:]) + splitter.flush()
        assert _normalize(pieces) == expected, f"cut at {cut}: {text[:cut]!r} + {text[cut:]!r}"


@pytest.mark.parametrize("text", SPLIT_TEXTS)
def test_splitter_one_character_at_a_time(text):
    splitter = ThinkSplitter()
    pieces: list[tuple[str, str]] = []
    for char in text:
        pieces += splitter.feed(char)
    pieces += splitter.flush()
    assert _normalize(pieces) == _split_whole(text)


def test_splitter_holds_a_partial_tag_until_the_next_feed():
    splitter = ThinkSplitter()
    assert splitter.feed("ab<thi") == [("text", "ab")]
    assert splitter.feed("nk>r") == [("think_start", ""), ("think", "r")]
    assert splitter.inside
    assert splitter.feed("s</th") == [("think", "s")]
    assert splitter.feed("ink>B") == [("think_end", ""), ("text", "B")]
    assert not splitter.inside
    assert splitter.flush() == []


def test_splitter_flush_returns_held_partial_tag():
    splitter = ThinkSplitter()
    assert splitter.feed("Hello <thi") == [("text", "Hello ")]
    assert splitter.flush() == [("text", "<thi")]
    assert splitter.flush() == []

    splitter = ThinkSplitter()
    assert splitter.feed("<think>abc</thin") == [("think_start", ""), ("think", "abc")]
    assert splitter.flush() == [("think", "</thin")]

    splitter = ThinkSplitter()
    assert splitter.feed("<") == []
    assert splitter.feed("x") == [("text", "<x")]  # not a tag after all: released as text
    assert splitter.flush() == []
