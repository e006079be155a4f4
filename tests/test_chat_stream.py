"""convert.stream.ChatStream and ChatReasoningFolder: vLLM's chat chunks relayed to a chat client,
reasoning deltas folded into `<think>` content so the streamed text equals the non-streamed fold."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import orjson
import pytest

from gymproxy.convert.reply import fold_reasoning
from gymproxy.convert.stream import ChatReasoningFolder, ChatStream
from gymproxy.errors import UpstreamError

from . import chunks as vllm

# --- ChatReasoningFolder ------------------------------------------------------------------------


def _fold_all(chunks: list[dict[str, Any]], *, continued: bool) -> tuple[list[bytes], list[bytes]]:
    folder = ChatReasoningFolder(continued=continued)
    payloads = [orjson.dumps(c) for c in chunks]
    out = [folder.fold(p) if folder.needed(p) else p for p in payloads]
    return payloads, out


def _joined(chunks: list[dict[str, Any]], *keys: str) -> str:
    return "".join(
        ch["delta"].get(key) or "" for c in chunks for ch in c["choices"] for key in keys if ch["delta"].get(key)
    )


FOLD_CASES = {
    "reasoning_then_content": vllm.reasoning("Let me ", "think.") + vllm.content("The answer", " is 4."),
    "reasoning_then_tool_calls": vllm.reasoning("call it") + vllm.call(0, "call_1", "f", '{"a": 1}'),
    "reasoning_then_finish_only": vllm.reasoning("only ", "thinking"),
    "reasoning_and_content_in_one_delta": [
        {"reasoning": "quick"},
        {"reasoning": " thought", "content": "Answer"},
        *vllm.content("!"),
    ],
    "both_in_first_delta": [{"reasoning": "all at once", "content": "done"}],
    "reasoning_content_key": vllm.reasoning("old ", "name", key="reasoning_content") + vllm.content("ok"),
    "no_reasoning": vllm.content("just ", "text"),
    "empty_deltas_while_open": [*vllm.reasoning("r"), {}, {}, *vllm.reasoning("s"), {}, *vllm.content("c")],
}


@pytest.mark.parametrize("finish", ["stop", "length", "tool_calls"])
@pytest.mark.parametrize("continued", [False, True])
@pytest.mark.parametrize("name", list(FOLD_CASES))
def test_folder_content_equals_non_streaming_fold(name, continued, finish):
    chunks = vllm.chunks(FOLD_CASES[name], finish)
    payloads, out = _fold_all(chunks, continued=continued)
    folded = [orjson.loads(p) for p in out]
    content = _joined(chunks, "content") or None
    reasoning = _joined(chunks, "reasoning", "reasoning_content") or None
    assert _joined(folded, "content") == (fold_reasoning(content, reasoning, continued=continued) or "")
    for chunk in folded:
        for choice in chunk["choices"]:
            assert "reasoning" not in choice["delta"] and "reasoning_content" not in choice["delta"]
    # Chunks that carry no reasoning and need no closing tag pass through as the same bytes object.
    assert out[0] is payloads[0]  # the role chunk
    assert out[-1] is payloads[-1]  # the usage chunk, choices: []
    if reasoning is None:
        assert all(o is p for o, p in zip(out, payloads, strict=True))
    # Tool calls, finish reasons and usage are untouched.
    for before, after in zip(chunks, folded, strict=True):
        assert after.get("usage") == before.get("usage")
        for b, a in zip(before["choices"], after["choices"], strict=True):
            assert a["finish_reason"] == b["finish_reason"]
            assert a["delta"].get("tool_calls") == b["delta"].get("tool_calls")


def test_folder_reasoning_then_content_chunk_by_chunk():
    chunks = vllm.chunks(FOLD_CASES["reasoning_then_content"], "stop")
    _, out = _fold_all(chunks, continued=False)
    contents = [[ch["delta"].get("content") for ch in orjson.loads(o)["choices"]] for o in out]
    assert contents == [[""], ["<think>Let me "], ["think."], ["</think>The answer"], [" is 4."], [None], []]


def test_folder_closes_on_finish_chunk_with_empty_delta():
    chunks = vllm.chunks(FOLD_CASES["reasoning_then_finish_only"], "stop")
    _, out = _fold_all(chunks, continued=False)
    finish = orjson.loads(out[-2])
    assert finish["choices"][0] == {
        "index": 0,
        "delta": {"content": "</think>"},
        "logprobs": None,
        "finish_reason": "stop",
    }


def test_folder_closes_when_length_rides_on_a_reasoning_chunk():
    """vLLM puts a length finish on the last token's chunk: cut off mid-thought, the think still closes."""
    folder = ChatReasoningFolder(continued=False)
    first = orjson.loads(folder.fold(orjson.dumps(vllm.chunk({"reasoning": "a"}))))
    last = orjson.loads(folder.fold(orjson.dumps(vllm.chunk({"reasoning": "b"}, "length"))))
    assert first["choices"][0]["delta"] == {"content": "<think>a"}
    assert last["choices"][0]["delta"] == {"content": "b</think>"} and last["choices"][0]["finish_reason"] == "length"
    usage = orjson.dumps(vllm.chunk(choices=[], usage=vllm.USAGE))
    assert folder.fold(usage) is usage


def test_folder_preserves_other_fields_of_rewritten_chunks():
    logprobs = {"content": [{"token": "token_id:42", "logprob": -0.25, "bytes": [104], "top_logprobs": []}]}
    chunk = vllm.chunk({"reasoning": "hm"}, None, prompt_token_ids=None, system_fingerprint="fp")
    chunk["choices"][0].update(logprobs=logprobs, token_ids=[42], stop_reason=None)
    closing = vllm.chunk({}, "length")
    closing["choices"][0].update(logprobs=logprobs, token_ids=[7], stop_reason=None)
    folder = ChatReasoningFolder(continued=False)
    for before in (chunk, closing):
        payload = orjson.dumps(before)
        assert folder.needed(payload)
        after = orjson.loads(folder.fold(payload))
        expected_content = "<think>hm" if before is chunk else "</think>"
        assert after["choices"][0].pop("delta") == {"content": expected_content}
        expected = orjson.loads(payload)
        del expected["choices"][0]["delta"]
        assert after == expected
        assert list(after) == list(expected)  # key order kept too


def test_folder_passes_untouched_chunks_through_as_the_same_object():
    folder = ChatReasoningFolder(continued=False)
    for chunk in (
        vllm.chunk({"role": "assistant", "content": ""}),
        vllm.chunk({"content": "x"}),
        vllm.chunk({}, "stop"),
        vllm.chunk(choices=[], usage=vllm.USAGE),
    ):
        payload = orjson.dumps(chunk)
        assert folder.fold(payload) is payload
        # needed() is a cheap pre-filter: a false positive ("reasoning_tokens" in usage) costs a parse only.
        assert not folder.needed(payload) or b'"reasoning_tokens"' in payload
    # Content that merely mentions "reasoning" may be inspected, but comes back unchanged.
    payload = orjson.dumps(vllm.chunk({"content": 'say "reasoning" twice'}))
    assert folder.fold(payload) is payload


def test_folder_needed_while_think_is_open():
    folder = ChatReasoningFolder(continued=False)
    folder.fold(orjson.dumps(vllm.chunk({"reasoning": "r"})))
    plain = orjson.dumps(vllm.chunk({"content": "answer"}))
    assert folder.needed(plain)
    assert orjson.loads(folder.fold(plain))["choices"][0]["delta"]["content"] == "</think>answer"
    assert not folder.needed(plain)
    assert folder.fold(plain) is plain


def test_folder_tracks_each_choice_index():
    def two(delta0: dict[str, Any], delta1: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return vllm.chunk(
            choices=[
                {"index": 0, "delta": delta0, "logprobs": None, "finish_reason": finish},
                {"index": 1, "delta": delta1, "logprobs": None, "finish_reason": finish},
            ]
        )

    chunks = [
        two({"role": "assistant", "content": ""}, {"role": "assistant", "content": ""}),
        two({"reasoning": "a"}, {}),
        two({"content": "b"}, {"reasoning": "y"}),
        two({}, {"content": "z"}, "stop"),
    ]
    _, out = _fold_all(chunks, continued=False)
    by_index: dict[int, str] = defaultdict(str)
    for payload in out:
        for choice in orjson.loads(payload)["choices"]:
            by_index[choice["index"]] += choice["delta"].get("content") or ""
    assert by_index == {0: "<think>a</think>b", 1: "<think>y</think>z"}


# --- ChatStream ---------------------------------------------------------------------------------


def _stream(*, parser: bool = True, reasoning: bool = True) -> ChatStream:
    return ChatStream(model="policy", parser=parser, continued=False, reasoning=reasoning)


def test_chat_stream_relays_payloads_byte_for_byte():
    stream = _stream()
    payloads = [orjson.dumps(c) for c in vllm.chunks(vllm.content("Hello", " there"), "stop")]
    assert stream.start() == b""
    assert [stream.payload(p) for p in payloads] == [b"data: " + p + b"\n\n" for p in payloads]
    assert stream.finish() == b"data: [DONE]\n\n" and not stream.ended


def test_chat_stream_folds_reasoning_when_the_parser_runs():
    stream = _stream()
    frames = [stream.payload(orjson.dumps(c)) for c in vllm.chunks(vllm.reasoning("hm") + vllm.content("4"), "stop")]
    text = "".join(
        choice["delta"].get("content") or ""
        for frame in frames
        for choice in orjson.loads(frame.removeprefix(b"data: "))["choices"]
    )
    assert text == "<think>hm</think>4"


def test_chat_stream_refuses_reasoning_the_config_says_cannot_come():
    payload = orjson.dumps(vllm.chunk({"reasoning": "hm"}))
    with pytest.raises(UpstreamError, match="uses_reasoning_parser"):
        _stream(parser=False).payload(payload)
    # The completions backend's chunks carry no reasoning field of vLLM's: nothing to fold or refuse.
    assert _stream(parser=False, reasoning=False).payload(payload) == b"data: " + payload + b"\n\n"
    assert _stream(parser=True, reasoning=False).payload(payload) == b"data: " + payload + b"\n\n"


def test_vllms_error_chunk_is_relayed_and_ends_the_stream():
    stream = _stream()
    error = b'{"error": {"message": "engine died", "type": "InternalServerError", "code": 500}}'
    assert stream.payload(error) == b"data: " + error + b"\n\n"
    assert stream.ended and stream.finish() == b"data: [DONE]\n\n"


def test_a_failed_chat_stream_ends_with_an_error_chunk_and_done():
    frames = _stream().fail("the upstream http://vllm:8000/v1 failed mid-stream: reset").split(b"\n\n")
    assert frames[1:] == [b"data: [DONE]", b""]
    error = orjson.loads(frames[0].removeprefix(b"data: "))["error"]
    assert error == {
        "message": "the upstream http://vllm:8000/v1 failed mid-stream: reset",
        "type": "upstream_error",
        "param": None,
        "code": 502,
    }


@pytest.mark.parametrize("finish", ["length", "content_filter"])
def test_a_local_answer_streams_a_role_chunk_a_finish_chunk_and_done(finish):
    frames = _stream().answer_locally(finish).split(b"\n\n")
    assert frames[2:] == [b"data: [DONE]", b""]
    first, last = (orjson.loads(f.removeprefix(b"data: ")) for f in frames[:2])
    assert first["id"] == last["id"] and first["id"].startswith("chatcmpl-") and first["model"] == "policy"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert last["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish}
