"""capture.Recording's reading of vLLM's token fields, on the bytes: what is recorded and what the
client gets, for replies and stream payloads as vLLM writes them (compact JSON) and written
otherwise (parsed), with token texts that look like the JSON around them."""

from __future__ import annotations

import json
import time
from typing import Any

import msgspec
import orjson
import pytest

from gymproxy.capture import Recording
from gymproxy.config import Capture as CaptureConfig
from gymproxy.rollouts.record import Call, decode_call, encode_call

TRICKY = ['}]},"finish_reason":"x', '"token_ids":[1]', "\\", "ok"]  # texts a byte scan must not trip on


class _Capture:
    config = CaptureConfig()


def recording(**asked: Any) -> Recording:
    record = Recording(_Capture(), Call(rollout_id="r", call_id="c", route="chat", started=time.time()))  # type: ignore[arg-type]
    record.ask({"messages": [], **asked})
    return record


def entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": []}


def reply(texts: list[str], *, choices: int = 1) -> dict[str, Any]:
    ids = list(range(7, 7 + len(texts)))
    one = [
        {
            "index": i,
            "message": {"role": "assistant", "content": "".join(texts)},
            "logprobs": {"content": [entry(t, -0.5 - k) for k, t in enumerate(texts)]},
            "finish_reason": "stop",
            "stop_reason": None,
            "token_ids": ids,
        }
        for i in range(choices)
    ]
    return {
        "id": "chatcmpl-1",
        "choices": one,
        "usage": {"completion_tokens": len(texts)},
        "prompt_token_ids": [1, 2, 3],
    }


def written(obj: Any, compact: bool) -> bytes:
    return orjson.dumps(obj) if compact else json.dumps(obj, indent=1).encode()


def stored(record: Recording) -> Call:
    return decode_call(encode_call(record.call))  # as the store writes it and reads it back


@pytest.mark.parametrize("compact", [True, False])
@pytest.mark.parametrize("choices", [1, 2])
def test_a_whole_reply_is_recorded_and_the_client_gets_vllms_nulls(compact: bool, choices: int) -> None:
    record = recording()
    out = orjson.loads(record.cut(written(reply(TRICKY, choices=choices), compact)))
    assert out["prompt_token_ids"] is None
    assert [(c["token_ids"], c["logprobs"]) for c in out["choices"]] == [(None, None)] * choices
    assert out["choices"][0]["message"]["content"] == "".join(TRICKY)
    call = stored(record)
    assert call.prompt_token_ids == [1, 2, 3] and call.generation_token_ids == [7, 8, 9, 10]
    assert call.generation_log_probs == [-0.5, -1.5, -2.5, -3.5] and call.finish_reason == "stop"


def test_what_the_client_asked_for_stays() -> None:
    record = recording(return_token_ids=True, logprobs=True, top_logprobs=2)
    payload = orjson.dumps(reply(TRICKY))
    assert record.cut(payload) == payload
    assert stored(record).generation_log_probs == [-0.5, -1.5, -2.5, -3.5]


def chunks(texts: list[str]) -> list[dict[str, Any]]:
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk"}
    first = {**base, "choices": [{"index": 0, "delta": {"role": "assistant"}, "logprobs": None, "finish_reason": None}]}
    out = [{**first, "prompt_token_ids": [1, 2, 3]}]
    for k, text in enumerate(texts):
        choice = {"index": 0, "delta": {"content": text}, "logprobs": {"content": [entry(text, -0.5 - k)]}}
        last = k == len(texts) - 1
        choice |= {"finish_reason": "stop" if last else None, "token_ids": [7 + k]}
        out.append({**base, "choices": [choice]})
    out.append({**base, "choices": [], "usage": {"completion_tokens": len(texts)}})
    return out


@pytest.mark.parametrize("compact", [True, False])
def test_a_stream_is_recorded_and_the_client_gets_vllms_nulls(compact: bool) -> None:
    record = recording(stream=True)
    seen = [record.tap(written(chunk, compact)) for chunk in chunks(TRICKY)]
    assert seen[-1] is None  # the usage chunk the client did not ask for
    for got in seen[:-1]:
        assert got is not None
        chunk = orjson.loads(got)
        assert chunk.get("prompt_token_ids") is None
        assert all(c.get("token_ids") is None and c.get("logprobs") is None for c in chunk["choices"])
    assert "".join(orjson.loads(got)["choices"][0]["delta"].get("content", "") for got in seen[1:-1]) == "".join(TRICKY)
    record.tapped()
    call = stored(record)
    assert call.prompt_token_ids == [1, 2, 3] and call.generation_token_ids == [7, 8, 9, 10]
    assert call.generation_log_probs == [-0.5, -1.5, -2.5, -3.5] and call.finish_reason == "stop"
    assert record.usage == {"completion_tokens": 4}


def test_the_kept_tokens_are_written_as_vllm_sent_them() -> None:
    record = recording()
    record.cut(orjson.dumps(reply(["a", "b"])))
    assert isinstance(record.call.prompt_token_ids, msgspec.Raw)  # never parsed on the request path
    assert b'"prompt_token_ids":[1,2,3]' in encode_call(record.call)


def test_a_stream_payload_with_two_choices_shows_neither_ones_tokens() -> None:
    record = recording(stream=True)
    (chunk,) = chunks(["a"])[1:2]
    chunk["choices"].append({**chunk["choices"][0], "index": 1})
    got = record.tap(orjson.dumps(chunk))
    assert got is not None
    assert all(c["token_ids"] is None and c["logprobs"] is None for c in orjson.loads(got)["choices"])
